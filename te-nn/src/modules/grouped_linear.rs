//! `GroupedLinear`: `num_gemms` independent linear layers over consecutive row groups of one
//! input, the expert layer of mixture-of-experts models (TE `pytorch/module/grouped_linear.py`).
//!
//! `x [tokens, in]` holds the rows of expert 0, then those of expert 1, ... (`m_splits[i]` rows
//! each: what `ops::moe::permute` writes); `y [tokens, out]` holds `x_i · W_iᵀ + b_i` in the same
//! order. Each GEMM is a `LinearCore` (the GEMM part of `Linear`) of its own, with its weight, bias, gradients,
//! `main_grad`, micro-batch FP8 weight cache and FP8 scaling state (TE keeps `num_gemms` sets of
//! scaling metadata too), so under `fp8_autocast` every recipe runs as in `Linear`, per expert.
//!
//! Data movement: the row groups are copied out of `x` (and of `dy` in backward) into tensors of
//! their own and the outputs copied back together (one read and one write of the activations
//! each way, ≈ 5 % of an FP8 expert layer at 4096 → 14336); the GEMMs run one after the other
//! on the device's stream.
//!
//! With `m_splits` on the device ([`GroupedLinear::forward_device`], 16-bit): one grouped GEMM
//! launch per pass (`ops::grouped_gemm`, Hopper), no copies and no host synchronization, so a
//! CUDA graph can capture the layer and replay it with other routings.

use super::linear::gemm_core::{LinearCore, LinearInput, Saved};
use super::linear::{check_input, ForwardOptions};
use super::params::{fp8_dim, LinearParams, ParamsInit};
use super::{next_module_id, Stamp};
use crate::fp8::{fp8_mode, Fp8Mode, Fp8StateSlot, ScalingState};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::ops::grouped_gemm::{
    grouped_dbias, grouped_gemm_reduction, grouped_gemm_rows, GroupedStatus, GroupedTables, GroupedWeights,
};
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "GroupedLinear";

/// Arguments of [`GroupedLinear::new`] (TE `te.GroupedLinear(num_gemms, in_features,
/// out_features, ...)`).
#[derive(Debug, Clone)]
pub struct GroupedLinearConfig {
    /// Number of GEMMs (experts), each `[in_features → out_features]`.
    pub num_gemms: usize,
    /// Size of each input row.
    pub in_features: usize,
    /// Size of each output row.
    pub out_features: usize,
    /// Each GEMM learns an additive bias (TE default true).
    pub bias: bool,
    /// Dtype of the weights, biases and their gradients: F32, BF16 or F16. Default BF16.
    pub params_dtype: DType,
    /// Each wgrad GEMM accumulates into the caller's f32 `main_grad` of its expert
    /// ([`LinearParams::set_main_grad`] on [`GroupedLinear::params_mut`]). Default false.
    pub fuse_wgrad_accumulation: bool,
    /// Std of the normal weight init (TE `init_method_normal(0.023)`); biases start at 0.
    pub init_std: f32,
    /// Seed of the weight init; GEMM `i` uses `seed + i`.
    pub seed: u64,
}

impl GroupedLinearConfig {
    /// TE's defaults for `num_gemms` layers `[in_features → out_features]`.
    pub fn new(num_gemms: usize, in_features: usize, out_features: usize) -> Self {
        Self {
            num_gemms,
            in_features,
            out_features,
            bias: true,
            params_dtype: DType::BF16,
            fuse_wgrad_accumulation: false,
            init_std: 0.023,
            seed: 0,
        }
    }
}

/// The context a [`GroupedLinear::forward`] saves for its [`GroupedLinear::backward`].
#[derive(Debug)]
pub struct GroupedLinearCtx {
    stamp: Stamp<1>,
    m_splits: Vec<usize>,
    /// What each GEMM saved; `None` for a GEMM that received no rows.
    saved: Vec<Option<Saved>>,
    /// The device-splits path's input and its copy of the splits.
    device: Option<DeviceCtx>,
}

/// What [`GroupedLinear::forward_device`] saves: the input and the splits (copied on the
/// device, so the caller may route the next batch into its buffer before this backward).
#[derive(Debug)]
struct DeviceCtx {
    x: Tensor,
    m_splits: CudaSlice<i32>,
}

/// The device-splits path's address tables (one set per GEMM of a step, so that steady-state
/// calls upload nothing) and its status flag.
#[derive(Debug)]
struct DeviceTables {
    fprop: GroupedTables,
    dgrad: GroupedTables,
    wgrad: GroupedTables,
    status: GroupedStatus,
}

impl DeviceTables {
    fn new(dev: &Device, groups: usize) -> Result<Self> {
        let t = || GroupedTables::new(dev, groups);
        Ok(Self { fprop: t()?, dgrad: t()?, wgrad: t()?, status: GroupedStatus::new(dev)? })
    }
}

impl GroupedLinearCtx {
    /// Device bytes this context holds only for backward (the FP8 input transposes).
    pub fn saved_bytes(&self) -> usize {
        self.saved.iter().flatten().map(Saved::bytes).sum()
    }

    /// The rows of each GEMM, as the forward got them (empty after
    /// [`GroupedLinear::forward_device`]: the splits stayed on the device).
    pub fn m_splits(&self) -> &[usize] {
        &self.m_splits
    }
}

/// `num_gemms` linear layers over consecutive row groups of one input (see the module docs):
/// `x: [tokens, in_features]` with `m_splits` (rows per GEMM, summing to `tokens`, given on the
/// host as in TE), `y: [tokens, out_features]` in the input's dtype.
///
/// A GEMM that receives no rows does no work; its gradients get a zero contribution (they are
/// allocated as zeros when none has accumulated yet, as PyTorch's would be: after a backward
/// every expert has gradients, which a data-parallel reduction needs). Under FP8 every `m_splits[i]` must be a multiple of 16 in
/// training (the transposed FP8 copies; TE's `Fp8Padding` pads each expert's rows to it).
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// use te_nn::fp8::{fp8_autocast, DelayedScaling};
/// use te_nn::modules::{GroupedLinear, GroupedLinearConfig};
/// use te_runtime::{DType, Device, Tensor};
///
/// let dev = Device::new(0)?;
/// let mut experts = GroupedLinear::new(&dev, GroupedLinearConfig::new(8, 4096, 14336))?;
/// let x = Tensor::zeros(&dev, DType::BF16, &[8192, 4096])?;
/// let m_splits = [1024, 2048, 512, 0, 1536, 1024, 1024, 1024];
/// let (y, ctx) = fp8_autocast(true, DelayedScaling::default(), || experts.forward(&x, &m_splits))?;
/// let dx = experts.backward(ctx, &Tensor::zeros(&dev, DType::BF16, y.shape())?)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct GroupedLinear {
    dev: Arc<Device>,
    cfg: GroupedLinearConfig,
    id: u64,
    gemms: Vec<LinearCore>,
    tables: Option<DeviceTables>,
}

impl GroupedLinear {
    /// `num_gemms` layers on `dev`, each initialized as `Linear` (weight `N(0, init_std)` with
    /// seed `seed + i`, bias 0; FP8 only under [`crate::fp8::fp8_model_init`]).
    ///
    /// # Errors
    /// [`Error::Config`] for `num_gemms` 0 and for what [`super::Linear::new`] refuses;
    /// allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: GroupedLinearConfig) -> Result<Self> {
        if cfg.num_gemms == 0 {
            return Err(Error::Config {
                module: MODULE,
                message: "num_gemms must be ≥ 1 (one GEMM per expert)".into(),
            });
        }
        let gemms = (0..cfg.num_gemms)
            .map(|i| {
                let init = ParamsInit {
                    in_features: cfg.in_features,
                    out_features: cfg.out_features,
                    bias: cfg.bias,
                    params_dtype: cfg.params_dtype,
                    fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
                    init_std: cfg.init_std,
                    seed: cfg.seed.wrapping_add(i as u64),
                };
                Ok(LinearCore::new(LinearParams::new(dev, MODULE, init)?, MODULE, true, true))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { dev: dev.clone(), cfg, id: next_module_id(), gemms, tables: None })
    }

    /// The configuration.
    pub fn config(&self) -> &GroupedLinearConfig {
        &self.cfg
    }

    /// Weight, bias and gradients of GEMM `i` (`None` past `num_gemms`).
    pub fn params(&self, i: usize) -> Option<&LinearParams> {
        self.gemms.get(i).map(|g| &g.params)
    }

    /// Weight, bias and gradients of GEMM `i`, mutably (writes invalidate saved contexts).
    pub fn params_mut(&mut self, i: usize) -> Option<&mut LinearParams> {
        self.gemms.get_mut(i).map(|g| &mut g.params)
    }

    /// The forward and backward delayed-scaling states of each GEMM, once an FP8 pass made them.
    pub fn fp8_states(&self) -> Vec<[Option<&Arc<ScalingState>>; 2]> {
        self.gemms.iter().map(|g| [g.fwd_state(), g.bwd_state()]).collect()
    }

    /// The forward and backward state slots of GEMM `i`, for a writable traversal.
    pub(crate) fn fp8_state_slots(&mut self, i: usize) -> Option<[Fp8StateSlot<'_>; 2]> {
        self.gemms.get_mut(i).map(LinearCore::state_slots)
    }

    fn stamp(&self) -> Stamp<1> {
        // Versions only grow: their sum changes whenever any GEMM's parameters do.
        Stamp::new(self.id, [self.gemms.iter().map(|g| g.params.version()).fold(0u64, u64::wrapping_add)])
    }

    /// `y = [x_0 · W_0ᵀ + b_0; x_1 · W_1ᵀ + b_1; ...]` for training, `x` split by `m_splits`:
    /// the output (input dtype, `[tokens, out_features]`) and the context for backward.
    ///
    /// # Errors
    /// As [`GroupedLinear::forward_with`].
    pub fn forward(&mut self, x: &Tensor, m_splits: &[usize]) -> Result<(Tensor, GroupedLinearCtx)> {
        self.forward_with(x, m_splits, ForwardOptions::default())
    }

    /// Forward for training with per-call options (`is_first_microbatch` caches every GEMM's
    /// FP8 weight; `fp8_output` is not supported: the experts' outputs are concatenated).
    ///
    /// # Errors
    /// [`Error::Shape`] when `x` is not `[tokens, in_features]`, `m_splits` does not have
    /// `num_gemms` entries or does not sum to `tokens`, or (FP8) a split or a feature count is
    /// not a multiple of 16 (naming the expert and what to pad to); [`Error::Config`] for
    /// `fp8_output`; [`Error::DType`] for a non-f32/bf16/f16 input; GEMM and kernel failures.
    pub fn forward_with(
        &mut self,
        x: &Tensor,
        m_splits: &[usize],
        opts: ForwardOptions,
    ) -> Result<(Tensor, GroupedLinearCtx)> {
        let (y, saved) = self.run(x, m_splits, opts, true)?;
        let ctx = GroupedLinearCtx { stamp: self.stamp(), m_splits: m_splits.to_vec(), saved, device: None };
        Ok((y, ctx))
    }

    /// Forward for inference: no context, no transposes; the splits may be any size.
    ///
    /// # Errors
    /// As [`GroupedLinear::forward_with`], except the multiple-of-16 rule for the splits.
    pub fn infer(&mut self, x: &Tensor, m_splits: &[usize]) -> Result<Tensor> {
        Ok(self.run(x, m_splits, ForwardOptions::default(), false)?.0)
    }

    fn run(
        &mut self,
        x: &Tensor,
        m_splits: &[usize],
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Tensor, Vec<Option<Saved>>)> {
        check_input(MODULE, x, self.cfg.in_features)?;
        if x.shape().len() != 2 {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("the input must be [tokens, in_features], got {:?}", x.shape()),
            });
        }
        if opts.fp8_output {
            return Err(Error::Config {
                module: MODULE,
                message: "fp8_output is not supported: the experts' outputs are concatenated in the input's dtype"
                    .into(),
            });
        }
        self.check_splits(x.shape()[0], m_splits)?;
        let mode = fp8_mode();
        if grad && matches!(mode, Fp8Mode::Fp8(_)) {
            for (i, &m) in m_splits.iter().enumerate().filter(|&(_, &m)| m > 0) {
                fp8_dim(MODULE, &format!("m_splits[{i}] (the rows of expert {i}; pad them, TE's Fp8Padding)"), m)?;
            }
        }
        let xs = x.split_rows(&self.dev, m_splits)?;
        let (mut ys, mut saved) = (Vec::with_capacity(xs.len()), Vec::with_capacity(xs.len()));
        for ((core, xi), &m) in self.gemms.iter_mut().zip(xs).zip(m_splits) {
            if m == 0 {
                saved.push(None);
                continue;
            }
            let pass = core.pass(mode)?;
            let shape = [m, self.cfg.in_features];
            let (out, s) = core.forward(LinearInput::High(xi), &shape, x.dtype(), &pass, opts, grad)?;
            ys.push(out.into_high(&self.dev, x.dtype())?);
            saved.push(s);
        }
        let tokens = x.shape()[0];
        let y = match ys.is_empty() {
            true => Tensor::empty(&self.dev, x.dtype(), &[tokens, self.cfg.out_features])?,
            false => Tensor::cat_rows(&self.dev, &ys)?,
        };
        Ok((y, saved))
    }

    fn check_splits(&self, tokens: usize, m_splits: &[usize]) -> Result<()> {
        let total: usize = m_splits.iter().sum();
        if m_splits.len() != self.cfg.num_gemms || total != tokens {
            return Err(Error::Shape {
                op: MODULE,
                message: format!(
                    "m_splits must hold the rows of each of the {} GEMMs and sum to the {tokens} input rows; got {} \
                     entries summing to {total}",
                    self.cfg.num_gemms,
                    m_splits.len()
                ),
            });
        }
        Ok(())
    }

    /// Backward of [`GroupedLinear::forward`]: `dx` (`grad_output`'s dtype, `[tokens,
    /// in_features]`); each GEMM's weight and bias gradients accumulate.
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another module or one made before the parameters
    /// changed; [`Error::Shape`] / [`Error::DType`] for a `grad_output` that is not `[tokens,
    /// out_features]` f32/bf16/f16; [`Error::Config`] when `fuse_wgrad_accumulation` is set and a
    /// GEMM has no `main_grad`; GEMM and kernel failures.
    pub fn backward(&mut self, ctx: GroupedLinearCtx, grad_output: &Tensor) -> Result<Tensor> {
        ctx.stamp.check(MODULE, self.stamp())?;
        if let Some(d) = ctx.device {
            return self.backward_device(d, grad_output);
        }
        let tokens: usize = ctx.m_splits.iter().sum();
        te_runtime::ops::check_shape(MODULE, "grad_output", grad_output, &[tokens, self.cfg.out_features])?;
        let dys = grad_output.split_rows(&self.dev, &ctx.m_splits)?;
        let mut dxs = Vec::with_capacity(dys.len());
        for ((core, (dy, saved)), &m) in self.gemms.iter_mut().zip(dys.iter().zip(ctx.saved)).zip(&ctx.m_splits) {
            let Some(saved) = saved else {
                core.params.ensure_grads()?;
                continue;
            };
            let dx = core.backward(saved, dy, &[m, self.cfg.in_features], true)?;
            dxs.push(dx.ok_or_else(|| Error::internal(MODULE, "no input gradient with input_grad = true"))?);
        }
        match dxs.is_empty() {
            true => Tensor::zeros(&self.dev, grad_output.dtype(), &[tokens, self.cfg.in_features]),
            false => Tensor::cat_rows(&self.dev, &dxs),
        }
    }

    /// Forward for training with `m_splits` on the device (i32 `[num_gemms]`, what
    /// [`te_runtime::ops::moe::routing_map`] writes): the rows of group `g` are `x[o_g .. o_g +
    /// m_splits[g]]`, and the output rows past `Σ m_splits` (a routing's dropped slots) are
    /// zeros. One grouped GEMM launch per pass and no host synchronization: a CUDA graph can
    /// capture it and replay it with other splits. 16-bit (bf16/f16 input, weights and biases
    /// converted to it), Hopper.
    ///
    /// Sizes on the device cannot be checked on the host: negative splits, or splits summing past
    /// the rows, are clamped by the kernel and reported by
    /// [`GroupedLinear::check_device_splits`].
    ///
    /// # Errors
    /// [`Error::Config`] under an enabled (or calibrating) `fp8_autocast` (pass `m_splits` on the
    /// host for FP8), or for `in_features`/`out_features` not multiples of 16;
    /// [`Error::Shape`] when `x` is not `[tokens, in_features]`, `m_splits` does not have
    /// `num_gemms` entries, or the device is not Hopper; [`Error::DType`] for an input that is
    /// not bf16/f16; kernel failures.
    pub fn forward_device(&mut self, x: &Tensor, m_splits: &CudaSlice<i32>) -> Result<(Tensor, GroupedLinearCtx)> {
        let y = self.run_device(x, m_splits)?;
        let mut copy = self.dev.stream().alloc_zeros::<i32>(m_splits.len())?;
        self.dev.stream().memcpy_dtod(m_splits, &mut copy)?;
        let device = Some(DeviceCtx { x: x.clone(), m_splits: copy });
        Ok((y, GroupedLinearCtx { stamp: self.stamp(), m_splits: Vec::new(), saved: Vec::new(), device }))
    }

    /// Forward for inference with `m_splits` on the device ([`GroupedLinear::forward_device`]
    /// without the context).
    ///
    /// # Errors
    /// As [`GroupedLinear::forward_device`].
    pub fn infer_device(&mut self, x: &Tensor, m_splits: &CudaSlice<i32>) -> Result<Tensor> {
        self.run_device(x, m_splits)
    }

    /// Reads (one synchronization) and clears the flag the device-splits kernels set when the
    /// splits they got were negative or summed past the input's rows.
    ///
    /// # Errors
    /// [`Error::Shape`] when a call since the last check had such splits (its outputs and
    /// gradients are not those of the splits given); [`Error::Capture`] inside a CUDA graph
    /// capture (check after a replay); driver failures.
    pub fn check_device_splits(&mut self) -> Result<()> {
        match &mut self.tables {
            Some(t) => t.status.check(&self.dev),
            None => Ok(()),
        }
    }

    fn check_device_path(&self, x: &Tensor, m_splits: &CudaSlice<i32>) -> Result<()> {
        check_input(MODULE, x, self.cfg.in_features)?;
        te_runtime::ops::check_dtype(MODULE, "x", x, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
        if x.shape().len() != 2 || m_splits.len() != self.cfg.num_gemms {
            return Err(Error::Shape {
                op: MODULE,
                message: format!(
                    "the input must be [tokens, in_features] and m_splits i32 [num_gemms = {}]; got {:?} and {} splits",
                    self.cfg.num_gemms,
                    x.shape(),
                    m_splits.len()
                ),
            });
        }
        let why = if !matches!(fp8_mode(), Fp8Mode::HighPrecision) {
            Some("runs in 16 bits: under fp8_autocast pass m_splits on the host (forward)".to_string())
        } else if self.cfg.in_features % 16 != 0 || self.cfg.out_features % 16 != 0 {
            Some(format!(
                "needs in_features ({}) and out_features ({}) that are multiples of 16",
                self.cfg.in_features, self.cfg.out_features
            ))
        } else {
            None
        };
        match why {
            Some(why) => Err(Error::Config { module: MODULE, message: format!("the device-m_splits path {why}") }),
            None => Ok(()),
        }
    }

    fn tables(&mut self) -> Result<&mut DeviceTables> {
        if self.tables.is_none() {
            self.tables = Some(DeviceTables::new(&self.dev, self.cfg.num_gemms)?);
        }
        self.tables.as_mut().ok_or_else(|| Error::internal(MODULE, "no device tables after creating them"))
    }

    fn weights(&self, dtype: DType) -> Result<Vec<Tensor>> {
        self.gemms.iter().map(|g| g.params.weight_high(dtype)).collect()
    }

    fn run_device(&mut self, x: &Tensor, m_splits: &CudaSlice<i32>) -> Result<Tensor> {
        self.check_device_path(x, m_splits)?;
        let weights = self.weights(x.dtype())?;
        let refs: Vec<&Tensor> = weights.iter().collect();
        let biases = match self.cfg.bias {
            true => self
                .gemms
                .iter()
                .map(|g| {
                    g.params.bias_as(x.dtype())?.ok_or_else(|| Error::internal(MODULE, "a layer with bias has none"))
                })
                .collect::<Result<Vec<_>>>()?,
            false => Vec::new(),
        };
        let bias_refs: Vec<&Tensor> = biases.iter().collect();
        let mut y = Tensor::empty(&self.dev, x.dtype(), &[x.shape()[0], self.cfg.out_features])?;
        let dev = self.dev.clone();
        let t = self.tables()?;
        let bias = (!bias_refs.is_empty()).then_some(bias_refs.as_slice());
        let w = GroupedWeights { tensors: &refs, k_major: true, scale_inv: None, bias };
        grouped_gemm_rows(&dev, x, None, &w, m_splits, &mut y, 1.0, (&mut t.fprop, &mut t.status))?;
        Ok(y)
    }

    /// dgrad `dx = dy · W_g` (the weights read MN-major), wgrad `dW_g (+)= dy_gᵀ · x_g` (both
    /// read MN-major) and with biases `db_g (+)= Σ dy_g`, one grouped launch each.
    fn backward_device(&mut self, ctx: DeviceCtx, dy: &Tensor) -> Result<Tensor> {
        let tokens = ctx.x.shape()[0];
        te_runtime::ops::check_shape(MODULE, "grad_output", dy, &[tokens, self.cfg.out_features])?;
        te_runtime::ops::check_dtype(MODULE, "grad_output", dy, |d| d == ctx.x.dtype(), ctx.x.dtype().name())?;
        let dev = self.dev.clone();
        let weights = self.weights(dy.dtype())?;
        let refs: Vec<&Tensor> = weights.iter().collect();
        let mut dx = Tensor::empty(&dev, dy.dtype(), &[tokens, self.cfg.in_features])?;
        {
            let t = self.tables()?;
            let w = GroupedWeights { tensors: &refs, k_major: false, scale_inv: None, bias: None };
            grouped_gemm_rows(&dev, dy, None, &w, &ctx.m_splits, &mut dx, 1.0, (&mut t.dgrad, &mut t.status))?;
        }
        drop(refs);
        // Every expert accumulates, or none: fresh gradients are zeros when another one has
        // accumulated already (the one launch has one mode).
        let accumulate = self.gemms.iter().any(|g| g.params.wgrad_accumulates());
        let mut tables = self.tables.take().ok_or_else(|| Error::internal(MODULE, "no device tables"))?;
        let result = (|| {
            let mut targets = Vec::with_capacity(self.gemms.len());
            for g in &mut self.gemms {
                targets.push(g.params.wgrad_target(accumulate)?.0);
            }
            grouped_gemm_reduction(
                &dev,
                (dy, false, None),
                (&ctx.x, false, None),
                &ctx.m_splits,
                &mut targets,
                (1.0, accumulate),
                (&mut tables.wgrad, &mut tables.status),
            )
        })();
        let result = result.and_then(|()| {
            if !self.cfg.bias {
                return Ok(());
            }
            let accumulate = self.gemms.iter().any(|g| g.params.bias_grad_accumulates());
            let mut targets = Vec::with_capacity(self.gemms.len());
            for g in &mut self.gemms {
                let target = g.params.bias_grad_target(accumulate)?;
                targets
                    .push(target.ok_or_else(|| Error::internal(MODULE, "a layer with bias has no bias gradient"))?.0);
            }
            grouped_dbias(&dev, dy, &ctx.m_splits, &mut targets, accumulate, &mut tables.wgrad)
        });
        self.tables = Some(tables);
        result?;
        Ok(dx)
    }
}
