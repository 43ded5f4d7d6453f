//! `Linear`: `y = x · Wᵀ + b` with FP8 GEMMs under `fp8_autocast` (TE `pytorch/module/linear.py`).
//! This file holds the module (its configuration, per-call options and context); the GEMM itself,
//! shared with `LayerNormLinear` and `LayerNormMLP`, is in `gemm_core`.
//!
//! FP8 forward (Hopper GEMMs take only the TN layout, TE `cublaslt_gemm.cu`):
//! - `x [tokens, in]` → the input quantizer → `x8` (fprop) and `x8ᵀ [in, tokens]` (saved for
//!   wgrad, 1 byte/element; the row-wise copy is freed after fprop). A fused producer (the norm of
//!   `LayerNormLinear`) hands in `x8` already cast;
//! - `W [out, in]` → the weight quantizer → `W8` (fprop) and `W8ᵀ [in, out]` (saved for dgrad),
//!   cached across micro-batches with `is_first_microbatch`;
//! - fprop `y = x8 · W8ᵀ` (+ bias epilogue), fast accumulation; with `fp8_output` the output
//!   quantizer casts `y` (in the GEMM epilogue when it can).
//!
//! FP8 backward: `dy [tokens, out]` → the gradient quantizer → `dy8`, `dy8ᵀ` (+ dbias, one pass;
//! E5M2 under HYBRID); dgrad `dx = dy8 · (W8ᵀ)ᵀ`, wgrad `dW = dy8ᵀ · (x8ᵀ)ᵀ`, both with split
//! accumulation; wgrad accumulates (beta = 1) into `main_grad` (f32) with
//! `fuse_wgrad_accumulation`.
//!
//! Without FP8 the same GEMMs run in the parameters' precision on the saved high-precision input.

pub(crate) mod gemm_core;
mod gemm_io;
pub(crate) mod norm_input;

pub(crate) use self::gemm_core::LinearInput;
use self::gemm_core::{LinearCore, Saved};
use super::params::{LinearParams, ParamsInit};
use super::{next_module_id, Output, Stamp};
use crate::fp8::{fp8_mode, Float8Tensor, Fp8StateSlot, Quantizer, ScalingState};
use crate::parallel::{GemmParallel, ParallelMode, Split, TpConfig};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::{ops, Device, Error, Result, Tensor};

const MODULE: &str = "Linear";

/// Arguments of [`Linear::new`] (TE `te.Linear(in_features, out_features, ...)`).
#[derive(Debug, Clone)]
pub struct LinearConfig {
    /// Size of each input row.
    pub in_features: usize,
    /// Size of each output row.
    pub out_features: usize,
    /// Learn an additive bias (TE default true).
    pub bias: bool,
    /// Do not add the bias in forward; the caller adds [`LinearParams::bias`] (fused into its next op,
    /// TE `return_bias`), and backward computes no bias gradient. Default false.
    pub return_bias: bool,
    /// Dtype of the weight, bias and their gradients: F32, BF16 or F16. Default BF16 (TE
    /// defaults to the torch default dtype; BF16 is what FP8 training runs with).
    pub params_dtype: DType,
    /// Wgrad GEMM accumulates into the caller's f32 `main_grad` (see
    /// [`LinearParams::set_main_grad`]) instead of the weight gradient. Default false.
    pub fuse_wgrad_accumulation: bool,
    /// Std of the normal weight init (TE `init_method_normal(0.023)`); the bias starts at 0.
    pub init_std: f32,
    /// Seed of the weight init.
    pub seed: u64,
    /// Tensor parallelism (TE `tp_group`, `sequence_parallel`; see [`TpConfig`]), split as
    /// [`LinearConfig::parallel_mode`] says: `in_features` and `out_features` stay the whole
    /// layer's, each rank holds its slice of the weight (initialized as the whole layer's, then
    /// sliced). Default `None`: the whole layer on this GPU.
    pub tp: Option<TpConfig>,
    /// How the layer splits over `tp`'s group (TE `parallel_mode`): column (output features) or
    /// row (input features). Read only with `tp`. Default column.
    pub parallel_mode: ParallelMode,
}

impl LinearConfig {
    /// TE's defaults for a `[in_features → out_features]` layer.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self {
            in_features,
            out_features,
            bias: true,
            return_bias: false,
            params_dtype: DType::BF16,
            fuse_wgrad_accumulation: false,
            init_std: 0.023,
            seed: 0,
            tp: None,
            parallel_mode: ParallelMode::Column,
        }
    }

    /// The layer's parallelism hook: `tp` split as `parallel_mode` says, or the whole GEMM.
    pub fn gemm_parallel(&self) -> GemmParallel {
        GemmParallel::new(self.tp.as_ref(), self.parallel_mode)
    }

    /// This rank's `(in_features, out_features)`: the whole layer's without `tp`, its slice's
    /// with (the whole layer's when the split does not divide: `Linear::new` refuses that).
    pub fn local_features(&self) -> (usize, usize) {
        let whole = (self.in_features, self.out_features);
        self.gemm_parallel().local_features(MODULE, whole.0, whole.1).unwrap_or(whole)
    }
}

/// Per-call forward options of the GEMM modules (TE `forward(inp, is_first_microbatch,
/// fp8_output)`): `Linear`, `LayerNormLinear`, `LayerNormMLP` take the same ones.
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    /// Gradient accumulation over micro-batches: `Some(true)` casts the weight(s) to FP8 and
    /// caches them, `Some(false)` reuses the cache, `None` casts every call.
    pub is_first_microbatch: Option<bool>,
    /// Return the output in FP8 (E4M3, with the module's output scale) for an FP8 consumer
    /// (the last GEMM's output).
    pub fp8_output: bool,
}

/// Per-call backward options of the GEMM modules.
#[derive(Debug, Clone, Copy)]
pub struct BackwardOptions<'a> {
    /// Return the input gradient (false for a first layer: `Linear` then skips its dgrad GEMM;
    /// modules with a norm in front compute it anyway for the norm's gradients). Default true.
    pub input_grad: bool,
    /// The gradient of the norm output the forward returned (`return_layernorm_output` of
    /// `LayerNormLinear` / `LayerNormMLP`), added to the gradient flowing back into the norm.
    /// `Linear` has no norm: it refuses one. Default `None`.
    pub grad_ln_out: Option<&'a Tensor>,
}

impl Default for BackwardOptions<'_> {
    fn default() -> Self {
        Self { input_grad: true, grad_ln_out: None }
    }
}

/// The context a [`Linear::forward`] saves for its [`Linear::backward`].
#[derive(Debug)]
pub struct LinearCtx {
    stamp: Stamp<1>,
    input_shape: Vec<usize>,
    saved: Saved,
}

impl LinearCtx {
    /// Device bytes this context holds only for backward (the FP8 input transpose).
    pub fn saved_bytes(&self) -> usize {
        self.saved.bytes()
    }

    /// Whether the forward ran FP8 GEMMs with per-tensor scales (delayed or current scaling):
    /// then [`Linear::backward_fp8`] takes an output gradient already cast to FP8.
    pub fn takes_fp8_grad(&self) -> bool {
        matches!(&self.saved, Saved::Fp8(s) if s.weight.block_scale().is_none())
    }
}

/// A linear layer `y = x · Wᵀ + b`, `x: [..., in_features]`, `W: [out_features, in_features]`,
/// `b: [out_features]`, `y: [..., out_features]` in the input's dtype.
///
/// Inside [`crate::fp8::fp8_autocast`] its GEMMs run in FP8 with the scope's recipe; outside
/// in `params_dtype`. See the module docs for the FP8 dataflow.
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// use te_nn::fp8::{fp8_autocast, DelayedScaling};
/// use te_nn::modules::{Linear, LinearConfig};
/// use te_runtime::{DType, Device, Tensor};
///
/// let dev = Device::new(0)?;
/// let mut fc = Linear::new(&dev, LinearConfig::new(4096, 16384))?;
/// let x = Tensor::zeros(&dev, DType::BF16, &[8192, 4096])?;
/// let (y, ctx) = fp8_autocast(true, DelayedScaling::default(), || fc.forward(&x))?;
/// let dy = Tensor::zeros(&dev, DType::BF16, y.shape())?;
/// let dx = fc.backward(ctx, &dy)?; // [8192, 4096]; params().weight_grad() and bias_grad() accumulate
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Linear {
    dev: Arc<Device>,
    cfg: LinearConfig,
    id: u64,
    core: LinearCore,
}

impl Linear {
    /// A layer on `dev` initialized as in TE (weight `N(0, init_std)`, bias 0). Under
    /// [`crate::fp8::fp8_model_init`] the weight is kept only in FP8 (E4M3, scaled by its own
    /// amax): 1 byte per parameter.
    ///
    /// # Errors
    /// [`Error::Config`] for zero sizes, a `params_dtype` that is not F32/BF16/F16, a bad
    /// `init_std`, or FP8 weights whose dims are not multiples of 16; with `tp`, a split
    /// dimension that does not divide by the group's size, a group on another GPU, or
    /// `fp8_model_init` (not supported with tensor parallelism yet); allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: LinearConfig) -> Result<Self> {
        Self::with_split(dev, cfg, None)
    }

    /// [`Linear::new`] whose weight splits under tensor parallelism as `split` says (see
    /// [`GemmParallel::shard_weight`]; a fused QKV projection by heads); `None`: the mode's dim.
    pub(crate) fn with_split(dev: &Arc<Device>, cfg: LinearConfig, split: Option<Split>) -> Result<Self> {
        let init = ParamsInit {
            in_features: cfg.in_features,
            out_features: cfg.out_features,
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
            init_std: cfg.init_std,
            seed: cfg.seed,
        };
        let comm = cfg.gemm_parallel();
        let params = LinearParams::for_gemm(dev, MODULE, init, &comm, split)?;
        let core = LinearCore::with_comm(params, MODULE, comm, !cfg.return_bias, !cfg.return_bias);
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, core })
    }

    /// The configuration.
    pub fn config(&self) -> &LinearConfig {
        &self.cfg
    }

    /// The layer's parallelism hook.
    pub(crate) fn gemm_parallel(&self) -> &GemmParallel {
        self.core.comm()
    }

    /// Weight, bias and their gradients.
    pub fn params(&self) -> &LinearParams {
        &self.core.params
    }

    /// Weight, bias and their gradients, mutably (writes invalidate saved contexts).
    pub fn params_mut(&mut self) -> &mut LinearParams {
        &mut self.core.params
    }

    /// The forward scaling state (input, weight, output slots), once an FP8 forward ran with
    /// delayed scaling.
    pub fn fp8_forward_state(&self) -> Option<&Arc<ScalingState>> {
        self.core.fwd_state()
    }

    /// The backward scaling state (the output gradient's slot).
    pub fn fp8_backward_state(&self) -> Option<&Arc<ScalingState>> {
        self.core.bwd_state()
    }

    /// The forward and backward state slots, for a writable traversal.
    pub(crate) fn fp8_state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        self.core.state_slots()
    }

    fn stamp(&self) -> Stamp<1> {
        Stamp::new(self.id, [self.core.params.version()])
    }

    /// `y = x · Wᵀ + b` for training: returns `y` (input dtype, `[..., out]`) and the context
    /// [`Linear::backward`] needs.
    ///
    /// # Errors
    /// As [`Linear::forward_with`].
    pub fn forward(&mut self, input: &Tensor) -> Result<(Tensor, LinearCtx)> {
        let (out, ctx) = self.forward_with(input, ForwardOptions::default())?;
        Ok((out.into_high(&self.dev, input.dtype())?, ctx))
    }

    /// Forward for training with per-call options: the output (FP8 with `fp8_output`) and the
    /// context.
    ///
    /// # Errors
    /// [`Error::Shape`] when the last dim of `input` is not `in_features`, or (FP8) when
    /// `in_features`, `out_features` or the token count (product of leading dims) is not a
    /// multiple of 16, naming the dim and what to pad to; [`Error::DType`] for a non-f32/bf16/f16
    /// input; GEMM and kernel failures.
    ///
    /// With [`LinearConfig::tp`] (see [`GemmParallel`]): column-parallel takes the whole input
    /// (a token shard under sequence parallelism, all-gathered first) and returns its slice of
    /// the output features; row-parallel takes its slice of the input features and returns the
    /// whole output (the ranks' partial products summed; under sequence parallelism its token
    /// shard).
    /// [`Error::Config`] for `fp8_output` with row parallelism (the partial outputs are summed in
    /// 16 bits).
    pub fn forward_with(&mut self, input: &Tensor, opts: ForwardOptions) -> Result<(Output, LinearCtx)> {
        let x = self.gemm_input(input, opts)?;
        let input_shape = x.shape();
        let (out, saved) = self.run(x, opts, true)?;
        let saved = saved.ok_or_else(|| Error::internal(MODULE, "a training forward saved nothing"))?;
        Ok((out, LinearCtx { stamp: self.stamp(), input_shape, saved }))
    }

    /// The input of this rank's GEMM ([`GemmParallel::gather_input`]: the whole tokens of the
    /// ranks' shards when it gathers them; this rank's shard, gathered beside the GEMM, with the
    /// communication overlap). Refuses an FP8 output the ranks would have to sum before any
    /// collective runs.
    fn gemm_input(&self, input: &Tensor, opts: ForwardOptions) -> Result<LinearInput> {
        let comm = self.core.comm();
        comm.check_fp8_output(MODULE, opts.fp8_output)?;
        check_input(MODULE, input, self.core.params.in_features())?;
        match comm.overlaps_gather() {
            true => Ok(LinearInput::shard(LinearInput::High(input.clone()), comm)),
            false => Ok(LinearInput::High(comm.gather_input(input)?)),
        }
    }

    /// Forward for inference (TE under `torch.no_grad()`): no context, no transposes; an FP8
    /// weight stays 1 byte per parameter.
    ///
    /// # Errors
    /// As [`Linear::forward_with`], except that the token count may be any size.
    pub fn infer(&mut self, input: &Tensor) -> Result<Tensor> {
        self.infer_with(input, ForwardOptions::default())?.into_high(&self.dev, input.dtype())
    }

    /// Forward for inference with per-call options.
    ///
    /// # Errors
    /// As [`Linear::infer`].
    pub fn infer_with(&mut self, input: &Tensor, opts: ForwardOptions) -> Result<Output> {
        let x = self.gemm_input(input, opts)?;
        Ok(self.run(x, opts, false)?.0)
    }

    /// Forward of an input a producer writes (TE `fp8_mha`: the attention writes its output in
    /// E4M3 for `MultiheadAttention`'s projection): `produce` gets this layer's FP8 input
    /// quantizer when the forward runs FP8 GEMMs (`None` otherwise) and returns the input
    /// (16-bit, or FP8 cast by that quantizer, with its transpose when `grad`) and anything of
    /// its own. `dtype` is the output's; `grad` a training forward (a context is returned).
    ///
    /// # Errors
    /// As [`Linear::forward_with`]; the producer's errors.
    pub(crate) fn forward_produced<T>(
        &mut self,
        dtype: DType,
        opts: ForwardOptions,
        grad: bool,
        produce: impl FnOnce(Option<&dyn Quantizer>) -> Result<(LinearInput, T)>,
    ) -> Result<(Output, Option<LinearCtx>, T)> {
        self.core.comm().check_fp8_output(MODULE, opts.fp8_output)?;
        if self.core.comm().gathers_input() {
            return Err(Error::Config {
                module: MODULE,
                message: "a produced input (fp8_mha) of a column-parallel layer under sequence parallelism is not \
                          supported: the producer writes this rank's tokens only"
                    .into(),
            });
        }
        let pass = self.core.pass(fp8_mode())?;
        let (input, extra) = produce(pass.fp8_input())?;
        let shape = match &input {
            LinearInput::High(x) => {
                check_input(MODULE, x, self.core.params.in_features())?;
                x.shape().to_vec()
            }
            LinearInput::Fp8(f) if f.shape().last() == Some(&self.core.params.in_features()) => f.shape().to_vec(),
            LinearInput::Shard { .. } => return Err(Error::internal(MODULE, "a produced token shard")),
            LinearInput::Fp8(f) => {
                return Err(Error::Shape {
                    op: MODULE,
                    message: format!(
                        "input {:?} must end in in_features = {}",
                        f.shape(),
                        self.core.params.in_features()
                    ),
                })
            }
        };
        let (out, saved) = self.core.forward(input, &shape, dtype, &pass, opts, grad)?;
        let ctx = match saved {
            Some(saved) => Some(LinearCtx { stamp: self.stamp(), input_shape: shape, saved }),
            None if grad => return Err(Error::internal(MODULE, "a training forward saved nothing")),
            None => None,
        };
        Ok((out, ctx, extra))
    }

    /// This rank's GEMM (the whole layer's without tensor parallelism); the input ends in this
    /// rank's input features.
    fn run(&mut self, x: LinearInput, opts: ForwardOptions, grad: bool) -> Result<(Output, Option<Saved>)> {
        let (shape, dtype) = match &x {
            LinearInput::High(t) => (t.shape().to_vec(), t.dtype()),
            LinearInput::Shard { input, whole } => match &**input {
                LinearInput::High(t) => (whole.clone(), t.dtype()),
                _ => return Err(Error::internal(MODULE, "a shard of another input than a 16-bit one")),
            },
            LinearInput::Fp8(_) => return Err(Error::internal(MODULE, "an FP8 input to a 16-bit forward")),
        };
        let pass = self.core.pass(fp8_mode())?;
        self.core.forward(x, &shape, dtype, &pass, opts, grad)
    }

    /// Backward of [`Linear::forward`]: returns `dx` (`grad_output`'s dtype, the input's shape)
    /// and accumulates the weight and bias gradients.
    ///
    /// # Errors
    /// As [`Linear::backward_with`].
    pub fn backward(&mut self, ctx: LinearCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, BackwardOptions::default())?
            .ok_or_else(|| Error::internal(MODULE, "no input gradient with input_grad = true"))
    }

    /// Backward with options; `None` when `input_grad` is false.
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another layer or one made before the parameters
    /// changed; [`Error::Shape`] / [`Error::DType`] when `grad_output` is not the output's shape
    /// or not f32/bf16/f16; [`Error::Config`] when `fuse_wgrad_accumulation` is set but no
    /// `main_grad` was handed in, or for a `grad_ln_out` (a `Linear` has no norm); GEMM and
    /// kernel failures.
    pub fn backward_with(
        &mut self,
        ctx: LinearCtx,
        grad_output: &Tensor,
        opts: BackwardOptions<'_>,
    ) -> Result<Option<Tensor>> {
        ctx.stamp.check(MODULE, self.stamp())?;
        if opts.grad_ln_out.is_some() {
            return Err(Error::Config {
                module: MODULE,
                message: "grad_ln_out is the gradient of a returned norm output; a Linear has no norm (use \
                          LayerNormLinear with return_layernorm_output)"
                    .into(),
            });
        }
        // The core gathers a token shard of the output gradient and sums the ranks' dgrads
        // (its hook's collectives).
        self.core.backward(ctx.saved, grad_output, &ctx.input_shape, opts.input_grad)
    }
}

impl Linear {
    /// Backward of an FP8 forward ([`LinearCtx::takes_fp8_grad`]) from an output gradient
    /// already in FP8: `grad_output` `[..., out_features]` E4M3/E5M2 codes with their transpose
    /// `[out_features, tokens]` and one per-tensor `scale_inv` (for example the FP8 `dlogits`
    /// of `te_runtime::ops::cross_entropy::cross_entropy` and `transpose_fp8`), so no cast runs
    /// (TE's modules take a `Float8Tensor` gradient the same way). dgrad `[..., in_features]` in
    /// `dtype` and wgrad (into the parameters) are FP8 GEMMs; the gradient's amax is not
    /// recorded (its producer chose the scale).
    ///
    /// # Errors
    /// [`Error::Context`] as [`Linear::backward_with`]; [`Error::Config`] for a forward in high
    /// precision or with block scaling, a layer with a bias (its gradient comes from a
    /// high-precision `grad_output`) or split for tensor parallelism, a `grad_output` without
    /// its transpose or with block scales; [`Error::Shape`] / [`Error::DType`] for a
    /// `grad_output` not of the output's shape, or a `dtype` that is not f32/bf16/f16; GEMM
    /// failures.
    pub fn backward_fp8(&mut self, ctx: LinearCtx, grad_output: &Float8Tensor, dtype: DType) -> Result<Tensor> {
        ctx.stamp.check(MODULE, self.stamp())?;
        let config = |message: &str| Error::Config { module: MODULE, message: message.into() };
        let saved = match ctx.saved {
            Saved::Fp8(s) if s.weight.block_scale().is_none() => s,
            _ => {
                return Err(config(
                    "backward_fp8 takes the context of an FP8 forward with per-tensor scales (delayed or current \
                     scaling): pass a high-precision grad_output to backward instead",
                ))
            }
        };
        if self.core.params.bias().is_some() {
            return Err(config(
                "a layer with a bias takes its bias gradient from a high-precision grad_output: use backward",
            ));
        }
        if self.core.params.tensor_parallel()[0] {
            return Err(config("a tensor-parallel layer gathers and reduces high-precision gradients: use backward"));
        }
        if grad_output.transpose().is_none() || grad_output.block_scale().is_some() {
            return Err(config(
                "grad_output must carry its transpose (Float8Tensor::ensure_transpose) and one per-tensor scale_inv",
            ));
        }
        if !dtype.is_high_precision() {
            return Err(Error::DType { op: MODULE, arg: "dtype", expected: "f32, bf16 or f16".into(), got: dtype });
        }
        let want = gemm_core::out_shape(&ctx.input_shape, self.core.params.out_features());
        if grad_output.shape() != want.as_slice() {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("grad_output {:?} must be the output's shape {want:?}", grad_output.shape()),
            });
        }
        self.core
            .backward_fp8(grad_output, None, saved, &ctx.input_shape, dtype, true)?
            .ok_or_else(|| Error::internal(MODULE, "no input gradient with input_grad = true"))
    }
}

/// Fails unless `x` is a non-empty f32/bf16/f16 tensor whose last dim is `features`.
pub(crate) fn check_input(module: &'static str, x: &Tensor, features: usize) -> Result<()> {
    ops::check_dtype(module, "input", x, DType::is_high_precision, "f32, bf16 or f16")?;
    ops::check_nonempty(module, "input", x)?;
    let (_, k) = x.as_2d(module)?;
    if k != features {
        return Err(Error::Shape {
            op: module,
            message: format!("input {:?} must end in in_features = {features}, got {k}", x.shape()),
        });
    }
    Ok(())
}
