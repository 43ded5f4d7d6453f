//! `LayerNorm` and `RMSNorm` (TE `pytorch/module/layernorm.py`, `rmsnorm.py`), and the norm
//! parameters `LayerNormLinear` and `LayerNormMLP` fuse in front of their first GEMM.

use super::params::accumulate;
use super::{next_module_id, Stamp};
use crate::fp8::quantizer::produce_fp8;
use crate::fp8::{Float8Tensor, Quantizer};
use crate::parallel::SequenceParallel;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::ops;
use te_runtime::ops::norm::{norm_bwd, norm_fwd, NormBwdArgs, NormBwdOut, NormFwdArgs, NormFwdOut};
use te_runtime::{Device, DeviceBuffer, Error, Result, Tensor};

pub use te_codegen::spec::NormKind;

/// Arguments of [`Norm::new`] (TE `te.LayerNorm(hidden_size, eps, zero_centered_gamma, ...)`).
#[derive(Debug, Clone, Copy)]
pub struct NormConfig {
    /// Size of the normalized last dimension.
    pub hidden_size: usize,
    /// Added to the variance (LayerNorm) or mean square (RMSNorm). TE default 1e-5.
    pub eps: f32,
    /// Store `gamma - 1` and scale by `1 + gamma` (TE `zero_centered_gamma`). Default false.
    pub zero_centered_gamma: bool,
    /// Dtype of gamma, beta and their gradients. Default BF16.
    pub params_dtype: DType,
}

impl NormConfig {
    /// TE's defaults for a norm over `hidden_size` features.
    pub fn new(hidden_size: usize) -> Self {
        Self { hidden_size, eps: 1e-5, zero_centered_gamma: false, params_dtype: DType::BF16 }
    }
}

/// Per-row statistics the backward needs: `mu` (LayerNorm) and `rsigma`, f32 `[rows]`.
#[derive(Debug)]
pub(crate) struct NormStats {
    mu: Option<DeviceBuffer<f32>>,
    rsigma: DeviceBuffer<f32>,
}

impl NormStats {
    pub(crate) fn bytes(&self) -> usize {
        4 * (self.rsigma.len() + self.mu.as_ref().map_or(0, |m| m.len()))
    }
}

/// Gamma `[hidden]` (TE's `weight`, initialized to 1, or 0 when zero-centered), beta `[hidden]`
/// (LayerNorm only, TE's `bias`, initialized to 0) and their accumulated gradients.
#[derive(Debug)]
pub struct NormParams {
    dev: Arc<Device>,
    module: &'static str,
    kind: NormKind,
    cfg: NormConfig,
    gamma: Tensor,
    beta: Option<Tensor>,
    dgamma: Option<Tensor>,
    dbeta: Option<Tensor>,
    version: u64,
    /// Sequence parallelism: the group over whose ranks the tokens are split; the gradients of
    /// gamma and beta are summed over it (Megatron-LM's all-reduce of the norms' gradients).
    sequence: SequenceParallel,
}

impl NormParams {
    pub(crate) fn new(dev: &Arc<Device>, module: &'static str, kind: NormKind, cfg: NormConfig) -> Result<Self> {
        let config = |message: String| Error::Config { module, message };
        if cfg.hidden_size == 0 {
            return Err(config("hidden_size must be ≥ 1".into()));
        }
        if !cfg.params_dtype.is_high_precision() {
            return Err(config(format!("params_dtype must be f32, bf16 or f16, got {}", cfg.params_dtype)));
        }
        if !(cfg.eps.is_finite() && cfg.eps >= 0.0) {
            return Err(config(format!("eps must be finite and ≥ 0, got {}", cfg.eps)));
        }
        let h = cfg.hidden_size;
        let g0 = if cfg.zero_centered_gamma { 0.0 } else { 1.0 };
        let gamma = Tensor::from_f32(dev, cfg.params_dtype, &[h], &vec![g0; h])?;
        let beta = match kind {
            NormKind::LayerNorm => Some(Tensor::zeros(dev, cfg.params_dtype, &[h])?),
            NormKind::RmsNorm => None,
        };
        Ok(Self {
            dev: dev.clone(),
            module,
            kind,
            cfg,
            gamma,
            beta,
            dgamma: None,
            dbeta: None,
            version: 0,
            sequence: SequenceParallel::none(),
        })
    }

    /// Runs on `sequence`'s token shards (sequence parallelism): each backward sums the gamma
    /// and beta gradients over its group before they accumulate, so every rank holds the whole
    /// batch's. [`SequenceParallel::none`]: the tokens are whole.
    pub(crate) fn set_sequence_parallel(&mut self, sequence: SequenceParallel) {
        self.sequence = sequence;
    }

    /// LayerNorm or RMSNorm.
    pub fn kind(&self) -> NormKind {
        self.kind
    }

    /// The configuration.
    pub fn config(&self) -> &NormConfig {
        &self.cfg
    }

    /// Gamma `[hidden]` as stored (`gamma - 1` when zero-centered).
    pub fn weight(&self) -> &Tensor {
        &self.gamma
    }

    /// Beta `[hidden]` (LayerNorm).
    pub fn bias(&self) -> Option<&Tensor> {
        self.beta.as_ref()
    }

    /// The norm as the decode GEMV's prologue takes it (`ops::gemv`): its kind and options, and
    /// its BF16 weights; `None` for f32 or f16 weights.
    pub fn gemv_norm(&self) -> Option<(ops::gemv::GemvNormKind, ops::gemv::GemvNorm<'_>)> {
        if self.gamma.dtype() != DType::BF16 {
            return None;
        }
        let kind = ops::gemv::GemvNormKind {
            kind: self.kind,
            eps: self.cfg.eps,
            zero_centered_gamma: self.cfg.zero_centered_gamma,
        };
        Some((kind, ops::gemv::GemvNorm { gamma: &self.gamma, beta: self.beta.as_ref() }))
    }

    /// Accumulated gradient of the stored gamma.
    pub fn weight_grad(&self) -> Option<&Tensor> {
        self.dgamma.as_ref()
    }

    /// Accumulated gradient of beta.
    pub fn bias_grad(&self) -> Option<&Tensor> {
        self.dbeta.as_ref()
    }

    /// Drops the accumulated gradients.
    pub fn zero_grad(&mut self) {
        self.dgamma = None;
        self.dbeta = None;
    }

    /// The gamma and beta gradients, writable (a data-parallel reduction averages them in place).
    pub(crate) fn grads_mut(&mut self) -> [Option<&mut Tensor>; 2] {
        [self.dgamma.as_mut(), self.dbeta.as_mut()]
    }

    /// Takes the gamma gradient out when `which[0]`, the beta gradient when `which[1]`, leaving
    /// the other (a ZeRO-2 backward releases each once reduced to the rank that owns it).
    pub(crate) fn take_grads_of(&mut self, which: [bool; 2]) -> [Option<Tensor>; 2] {
        let take = |g: &mut Option<Tensor>, yes: bool| if yes { g.take() } else { None };
        [take(&mut self.dgamma, which[0]), take(&mut self.dbeta, which[1])]
    }

    /// Writes since creation; contexts made at another version are stale.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Replaces gamma (as stored).
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless `[hidden]` of `params_dtype`.
    pub fn set_weight(&mut self, gamma: Tensor) -> Result<()> {
        self.check_param("weight", &gamma)?;
        self.gamma = gamma;
        self.version += 1;
        Ok(())
    }

    /// Replaces beta.
    ///
    /// # Errors
    /// [`Error::Config`] for RMSNorm (no beta); shape and dtype as [`NormParams::set_weight`].
    pub fn set_bias(&mut self, beta: Tensor) -> Result<()> {
        if self.beta.is_none() {
            return Err(Error::Config { module: self.module, message: "RMSNorm has no bias (beta)".into() });
        }
        self.check_param("bias", &beta)?;
        self.beta = Some(beta);
        self.version += 1;
        Ok(())
    }

    fn check_param(&self, arg: &'static str, t: &Tensor) -> Result<()> {
        ops::check_shape(self.module, arg, t, &[self.cfg.hidden_size])?;
        let dt = self.cfg.params_dtype;
        ops::check_dtype(self.module, arg, t, |d| d == dt, dt.name())
    }

    fn args<'a>(&'a self, x: &'a Tensor) -> NormFwdArgs<'a> {
        NormFwdArgs {
            kind: self.kind,
            x,
            gamma: &self.gamma,
            beta: self.beta.as_ref(),
            eps: self.cfg.eps,
            zero_centered_gamma: self.cfg.zero_centered_gamma,
        }
    }

    fn stats(&self, rows: usize) -> Result<NormStats> {
        let s = self.dev.stream();
        // SAFETY: f32 has no invalid bit patterns; the forward kernel writes every row's stats.
        let (mu, rsigma) = unsafe {
            let mu = match self.kind {
                NormKind::LayerNorm => Some(DeviceBuffer::new(s.alloc::<f32>(rows)?)),
                NormKind::RmsNorm => None,
            };
            (mu, DeviceBuffer::new(s.alloc::<f32>(rows)?))
        };
        Ok(NormStats { mu, rsigma })
    }

    /// `y = norm(x)` in `dtype` (high precision).
    pub(crate) fn forward(&self, x: &Tensor, dtype: DType) -> Result<(Tensor, NormStats)> {
        let (rows, _) = x.as_2d(self.module)?;
        let mut stats = self.stats(rows)?;
        let mut y = Tensor::empty(&self.dev, dtype, x.shape())?;
        let out = NormFwdOut { y: &mut y, mu: stats.mu.as_deref_mut(), rsigma: &mut stats.rsigma, fp8: None };
        norm_fwd(&self.dev, &self.args(x), out)?;
        Ok((y, stats))
    }

    /// `y = norm(x)` in FP8 through `q` (TE's LayerNorm writing the GEMM input of
    /// `LayerNormLinear` directly): the kernel casts its output when `q` allows it, else it
    /// writes `x`'s dtype and `q` casts. With `columnwise`, the transposed codes too.
    pub(crate) fn forward_fp8(
        &self,
        x: &Tensor,
        q: &dyn Quantizer,
        columnwise: bool,
    ) -> Result<(Float8Tensor, NormStats)> {
        let (rows, _) = x.as_2d(self.module)?;
        let mut stats = self.stats(rows)?;
        let y = produce_fp8(q, &self.dev, x.shape(), x.dtype(), columnwise, &mut |y, fp8| {
            let out = NormFwdOut { y, mu: stats.mu.as_deref_mut(), rsigma: &mut stats.rsigma, fp8 };
            norm_fwd(&self.dev, &self.args(x), out)
        })?;
        Ok((y, stats))
    }

    /// The backward of a norm whose output fed a GEMM: `d_ln` (the GEMM's input gradient) plus
    /// `grad_ln_out`, the gradient of the norm output when the module also returned it
    /// (`return_layernorm_output`), then [`NormParams::backward`].
    pub(crate) fn backward_sum(
        &mut self,
        mut d_ln: Tensor,
        grad_ln_out: Option<&Tensor>,
        x: &Tensor,
        stats: &NormStats,
    ) -> Result<Tensor> {
        if let Some(g) = grad_ln_out {
            ops::check_shape(self.module, "grad_ln_out", g, x.shape())?;
            ops::elementwise::add_assign(&self.dev, &mut d_ln, g)?;
        }
        self.backward(&d_ln, x, stats)
    }

    /// `dx` for `dy` (converted to `x`'s dtype); dgamma and dbeta accumulate.
    pub(crate) fn backward(&mut self, dy: &Tensor, x: &Tensor, stats: &NormStats) -> Result<Tensor> {
        let dy = super::params::convert(&self.dev, dy.clone(), x.dtype())?;
        let h = [self.cfg.hidden_size];
        let dt = self.cfg.params_dtype;
        let mut dx = Tensor::empty(&self.dev, x.dtype(), x.shape())?;
        let mut dgamma = Tensor::empty(&self.dev, dt, &h)?;
        let mut dbeta = match self.kind {
            NormKind::LayerNorm => Some(Tensor::empty(&self.dev, dt, &h)?),
            NormKind::RmsNorm => None,
        };
        let args = NormBwdArgs {
            kind: self.kind,
            dy: &dy,
            x,
            mu: stats.mu.as_deref(),
            rsigma: &stats.rsigma,
            gamma: &self.gamma,
            zero_centered_gamma: self.cfg.zero_centered_gamma,
        };
        norm_bwd(&self.dev, &args, NormBwdOut { dx: &mut dx, dgamma: &mut dgamma, dbeta: dbeta.as_mut() })?;
        // Token shards: each gives part of the gradients, summed over the group (one NCCL launch
        // for both); nothing for whole tokens.
        match dbeta.as_mut() {
            Some(db) => self.sequence.sum_grads(&mut [&mut dgamma, db])?,
            None => self.sequence.sum_grads(&mut [&mut dgamma])?,
        }
        accumulate(&self.dev, &mut self.dgamma, dgamma)?;
        if let Some(db) = dbeta {
            accumulate(&self.dev, &mut self.dbeta, db)?;
        }
        Ok(dx)
    }
}

/// The context a [`Norm::forward`] saves for [`Norm::backward`]: the input (shared) and the
/// row statistics.
#[derive(Debug)]
pub struct NormCtx {
    stamp: Stamp<1>,
    x: Tensor,
    stats: NormStats,
}

/// LayerNorm `y = (x - mean) / sqrt(var + eps) * gamma + beta` or RMSNorm
/// `y = x / sqrt(mean(x²) + eps) * gamma` over the last dimension of `x: [..., hidden]`
/// (f32/bf16/f16; `y` in `x`'s dtype). Statistics in f32. Under `fp8_autocast` it still runs in
/// high precision, as in TE; [`super::LayerNormLinear`] fuses the FP8 cast.
#[derive(Debug)]
pub struct Norm {
    id: u64,
    params: NormParams,
}

/// TE's `LayerNorm`: a [`Norm`] made with [`Norm::layer_norm`].
pub type LayerNorm = Norm;
/// TE's `RMSNorm`: a [`Norm`] made with [`Norm::rms_norm`].
pub type RMSNorm = Norm;

impl Norm {
    /// A norm of `kind`.
    ///
    /// # Errors
    /// [`Error::Config`] for `hidden_size = 0`, a non-high-precision `params_dtype` or a bad
    /// `eps`; allocation failures.
    pub fn new(dev: &Arc<Device>, kind: NormKind, cfg: NormConfig) -> Result<Self> {
        let module = match kind {
            NormKind::LayerNorm => "LayerNorm",
            NormKind::RmsNorm => "RMSNorm",
        };
        Ok(Self { id: next_module_id(), params: NormParams::new(dev, module, kind, cfg)? })
    }

    /// Sequence parallelism (TE `LayerNorm(..., sequence_parallel=True)` in a tensor-parallel
    /// model): the norm runs on this rank's token shard of `sequence`'s ranks, and its backward
    /// sums the gamma and beta gradients over the group (each rank's shard gives part of
    /// them). [`SequenceParallel::none`] (the default): the tokens are whole.
    pub fn set_sequence_parallel(&mut self, sequence: SequenceParallel) {
        self.params.set_sequence_parallel(sequence);
    }

    /// TE `LayerNorm(hidden_size, eps, zero_centered_gamma)`.
    ///
    /// # Errors
    /// As [`Norm::new`].
    pub fn layer_norm(dev: &Arc<Device>, cfg: NormConfig) -> Result<Self> {
        Self::new(dev, NormKind::LayerNorm, cfg)
    }

    /// TE `RMSNorm(hidden_size, eps, zero_centered_gamma)`.
    ///
    /// # Errors
    /// As [`Norm::new`].
    pub fn rms_norm(dev: &Arc<Device>, cfg: NormConfig) -> Result<Self> {
        Self::new(dev, NormKind::RmsNorm, cfg)
    }

    fn stamp(&self) -> Stamp<1> {
        Stamp::new(self.id, [self.params.version])
    }

    /// Gamma, beta and their gradients.
    pub fn params(&self) -> &NormParams {
        &self.params
    }

    /// Gamma, beta and their gradients, mutably.
    pub fn params_mut(&mut self) -> &mut NormParams {
        &mut self.params
    }

    /// `y = norm(x)` and the context for backward.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] when `x` is not `[..., hidden]` f32/bf16/f16 or is
    /// empty; kernel failures.
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, NormCtx)> {
        let (y, stats) = self.params.forward(x, x.dtype())?;
        Ok((y, NormCtx { stamp: self.stamp(), x: x.clone(), stats }))
    }

    /// `y = norm(x)` without a context.
    ///
    /// # Errors
    /// As [`Norm::forward`].
    pub fn infer(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.params.forward(x, x.dtype())?.0)
    }

    /// `dx` for `dy` (the output's shape); gamma's and beta's gradients accumulate.
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; shape and dtype errors.
    pub fn backward(&mut self, ctx: NormCtx, dy: &Tensor) -> Result<Tensor> {
        ctx.stamp.check(self.params.module, self.stamp())?;
        ops::check_shape(self.params.module, "grad_output", dy, ctx.x.shape())?;
        self.params.backward(dy, &ctx.x, &ctx.stats)
    }
}
