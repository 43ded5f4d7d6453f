//! `Linear`: `y = x · Wᵀ + b` with FP8 GEMMs under `fp8_autocast` (TE `pytorch/module/linear.py`).
//!
//! FP8 forward (Hopper GEMMs take only the TN layout, TE `cublaslt_gemm.cu`):
//! - `x [tokens, in]` → one cast_transpose → `x8` (fprop) and `x8ᵀ [in, tokens]` (saved for wgrad,
//!   1 byte/element; the row-wise copy is freed after fprop);
//! - `W [out, in]` → `W8` (fprop) and `W8ᵀ [in, out]` (saved for dgrad), cached across
//!   micro-batches with `is_first_microbatch`;
//! - fprop `y = x8 · W8ᵀ` (+ bias epilogue), fast accumulation.
//!
//! FP8 backward: `dy [tokens, out]` → one cast_transpose (+ dbias) → `dy8`, `dy8ᵀ` (E5M2 under
//! HYBRID); dgrad `dx = dy8 · (W8ᵀ)ᵀ`, wgrad `dW = dy8ᵀ · (x8ᵀ)ᵀ`, both with split accumulation;
//! wgrad accumulates (beta = 1) into `main_grad` (f32) with `fuse_wgrad_accumulation`.
//!
//! Without FP8 the same GEMMs run in the parameters' precision on the saved high-precision input.

use super::params::{fp8_dim, LinearParams, ParamsInit};
use super::state_slot::{Fp8Direction, Fp8StateSlot};
use super::{next_module_id, Output};
use crate::fp8::autocast::{backward_ticket, register_forward, BackwardTicket};
use crate::fp8::{fp8_mode, quantize_current, DelayedScaling, Float8Tensor, Fp8Mode, Recipe, ScalingState};
use crate::gemm::{gemm, Epilogue, Fp8Output, GemmConfig, Operand, Output as GemmOut};
use crate::ops;
use crate::ops::cast_transpose::{dbias_workspace_len, DbiasOut};
use crate::{Device, Error, Result, Tensor};
use std::sync::Arc;
use te_codegen::DType;

const MODULE: &str = "Linear";

/// Forward slots of a GEMM's delayed-scaling state (TE `FP8FwdTensors`).
pub(crate) const FWD_INPUT: usize = 0;
const FWD_WEIGHT: usize = 1;
const FWD_OUTPUT: usize = 2;
const FWD_SLOTS: usize = 3;
/// Backward slots (TE `FP8BwdTensors`); `grad_input` is kept for FP8 dgrad outputs of fused
/// modules, as in TE.
pub(crate) const BWD_GRAD_OUTPUT: usize = 0;
const BWD_SLOTS: usize = 2;

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
        }
    }
}

/// Per-call forward options (TE `forward(inp, is_first_microbatch, fp8_output)`).
#[derive(Debug, Clone, Copy, Default)]
pub struct ForwardOptions {
    /// Gradient accumulation over micro-batches: `Some(true)` casts the weight to FP8 and caches
    /// it, `Some(false)` reuses the cache, `None` casts every call.
    pub is_first_microbatch: Option<bool>,
    /// Return the output in FP8 (E4M3, with the module's output scale) for an FP8 consumer.
    pub fp8_output: bool,
}

/// Per-call backward options.
#[derive(Debug, Clone, Copy)]
pub struct BackwardOptions {
    /// Compute the input gradient (false for a first layer: saves the dgrad GEMM).
    pub input_grad: bool,
}

impl Default for BackwardOptions {
    fn default() -> Self {
        Self { input_grad: true }
    }
}

/// The input of a GEMM layer's forward: high precision, or already FP8 (a fused producer, e.g.
/// the LayerNorm of `LayerNormLinear`, cast it with the layer's input scale; with its transpose
/// when backward will run).
#[derive(Debug)]
pub(crate) enum LinearInput {
    High(Tensor),
    Fp8(Float8Tensor),
}

/// What a GEMM layer's forward saved for backward.
#[derive(Debug)]
pub(crate) enum Saved {
    /// FP8 GEMMs: `x8ᵀ [in, tokens]` (`None` when the owner recomputes it before backward, see
    /// [`LinearCore::recompute_input`]), `W8` with its transpose, and the forward's recipe.
    Fp8 { input_t: Option<Float8Tensor>, weight: Float8Tensor, recipe: Recipe, ticket: Option<BackwardTicket> },
    /// High-precision GEMMs: the input and weight (shared, not copied).
    High { input: Tensor, weight: Tensor },
}

impl Saved {
    /// Device bytes held only for backward (the FP8 input transpose; high-precision tensors are
    /// shared with the caller and the parameters).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Saved::Fp8 { input_t, .. } => input_t.as_ref().map_or(0, Float8Tensor::num_bytes),
            Saved::High { .. } => 0,
        }
    }

    /// Puts back the FP8 input transpose a forward without it left out.
    pub(crate) fn restore_input(&mut self, t: Float8Tensor) {
        if let Saved::Fp8 { input_t, .. } = self {
            *input_t = Some(t);
        }
    }
}

/// The GEMM part of `Linear` and `LayerNormLinear`: parameters, FP8 scaling state, forward and
/// backward of `y = x · Wᵀ + b`.
#[derive(Debug)]
pub(crate) struct LinearCore {
    pub params: LinearParams,
    module: &'static str,
    /// The GEMM adds the bias (false for `return_bias`, or when a fused kernel adds it).
    bias_fwd: bool,
    /// Backward computes the bias gradient (false for `return_bias`).
    bias_bwd: bool,
    /// FP8 forward saves the input transpose (false: the owner recomputes it before backward).
    save_input: bool,
    fwd_state: Option<Arc<ScalingState>>,
    bwd_state: Option<Arc<ScalingState>>,
}

impl LinearCore {
    pub(crate) fn new(params: LinearParams, module: &'static str, bias_fwd: bool, bias_bwd: bool) -> Self {
        Self { params, module, bias_fwd, bias_bwd, save_input: true, fwd_state: None, bwd_state: None }
    }

    /// FP8 forwards stop saving the input transpose; the owner recomputes it and hands it back
    /// with [`Saved::restore_input`] before backward (activation recomputation).
    pub(crate) fn recompute_input(&mut self) {
        self.save_input = false;
    }

    fn err(&self, message: String) -> Error {
        Error::Shape { op: self.module, message }
    }

    /// The forward scaling state for `r` (created on first use, conformed after).
    pub(crate) fn fwd_state(&mut self, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
        let dev = self.dev();
        conform(&mut self.fwd_state, &dev, FWD_SLOTS, r.fp8_format.forward_dtype(), r)
    }

    /// The backward scaling state for `r` (grad_output, grad_input slots).
    pub(crate) fn bwd_state(&mut self, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
        let dev = self.dev();
        conform(&mut self.bwd_state, &dev, BWD_SLOTS, r.fp8_format.backward_dtype(), r)
    }

    pub(crate) fn fwd_state_opt(&self) -> Option<&Arc<ScalingState>> {
        self.fwd_state.as_ref()
    }

    pub(crate) fn bwd_state_opt(&self) -> Option<&Arc<ScalingState>> {
        self.bwd_state.as_ref()
    }

    /// The forward and backward state slots, for a writable traversal.
    pub(crate) fn state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        let dev = self.params.device();
        [
            Fp8StateSlot::new(&mut self.fwd_state, dev, FWD_SLOTS, Fp8Direction::Forward),
            Fp8StateSlot::new(&mut self.bwd_state, dev, BWD_SLOTS, Fp8Direction::Backward),
        ]
    }

    fn dev(&self) -> Arc<Device> {
        self.params.device().clone()
    }

    /// Checks the GEMM dims under FP8: features always, tokens when transposes are made.
    pub(crate) fn check_fp8_dims(&self, tokens: usize, grad: bool) -> Result<()> {
        fp8_dim(self.module, "in_features", self.params.in_features())?;
        fp8_dim(self.module, "out_features", self.params.out_features())?;
        if grad {
            fp8_dim(self.module, "tokens (the product of the input's leading dims)", tokens)?;
        }
        Ok(())
    }

    /// Forward in `mode`; `shape` is the input's shape, `dtype` the output's.
    pub(crate) fn forward(
        &mut self,
        x: LinearInput,
        shape: &[usize],
        dtype: DType,
        mode: Fp8Mode,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Output, Option<Saved>)> {
        match (mode, x) {
            (Fp8Mode::Fp8(recipe), x) => {
                let tokens = shape.split_last().map_or(0, |(_, lead)| lead.iter().product());
                self.check_fp8_dims(tokens, grad)?;
                self.forward_fp8(x, shape, dtype, recipe, opts, grad)
            }
            (Fp8Mode::Calibrating(Recipe::Delayed(r)), LinearInput::High(x)) => {
                let state = self.fwd_state(&r)?;
                register_forward(&state);
                state.record_amax(&x, FWD_INPUT)?;
                self.params.record_weight_amax(&state, FWD_WEIGHT)?;
                self.forward_high(&x, grad)
            }
            (_, LinearInput::High(x)) => self.forward_high(&x, grad),
            (_, LinearInput::Fp8(_)) => Err(self.err("internal: an FP8 input outside FP8 autocast".into())),
        }
    }

    fn forward_high(&mut self, x: &Tensor, grad: bool) -> Result<(Output, Option<Saved>)> {
        let dev = self.dev();
        let w = self.params.weight_high(x.dtype())?;
        let mut y = Tensor::empty(&dev, x.dtype(), &out_shape(x.shape(), self.params.out_features()))?;
        let bias = self.added_bias(x.dtype())?;
        let cfg = GemmConfig { epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias), ..Default::default() };
        gemm(&dev, Operand::new(x), Operand::new(&w), GemmOut::new(&mut y), &cfg)?;
        let saved = grad.then(|| Saved::High { input: x.clone(), weight: w });
        Ok((Output::High(y), saved))
    }

    /// The bias the forward adds (none with `return_bias`), in `dtype`.
    fn added_bias(&self, dtype: DType) -> Result<Option<Tensor>> {
        if self.bias_fwd {
            self.params.bias_as(dtype)
        } else {
            Ok(None)
        }
    }

    fn forward_fp8(
        &mut self,
        x: LinearInput,
        shape: &[usize],
        dtype: DType,
        recipe: Recipe,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Output, Option<Saved>)> {
        let dev = self.dev();
        let fwd = match recipe {
            Recipe::Delayed(r) => {
                let s = self.fwd_state(&r)?;
                register_forward(&s);
                Some(s)
            }
            Recipe::Current(_) => None,
        };
        let x8 = match (x, &fwd, recipe) {
            (LinearInput::Fp8(f), ..) => f,
            (LinearInput::High(x), Some(s), _) => s.quantize(&x, FWD_INPUT, grad && self.save_input, None)?,
            (LinearInput::High(x), None, Recipe::Current(c)) => {
                quantize_current(&dev, &x, DType::E4M3, &c, grad && self.save_input, None)?
            }
            (LinearInput::High(_), None, Recipe::Delayed(_)) => {
                return Err(self.err("internal: delayed recipe without state".into()))
            }
        };
        let w8 = self.params.fp8_weight_for(
            recipe,
            fwd.as_deref().map(|s| (s, FWD_WEIGHT)),
            opts.is_first_microbatch,
            grad,
        )?;
        // cuBLASLt's FP8 GEMMs take a bf16 bias for an f32 output (the output dtype otherwise).
        let bias = self.added_bias(if dtype == DType::F32 { DType::BF16 } else { dtype })?;
        let cfg = GemmConfig {
            fast_accum: true,
            epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias),
            ..Default::default()
        };
        let shape = out_shape(shape, self.params.out_features());
        let (a, b) =
            (Operand::fp8(x8.data(), x8.scale_inv().as_view()), Operand::fp8(w8.data(), w8.scale_inv().as_view()));
        let out = match (opts.fp8_output, &fwd, recipe) {
            (false, ..) => {
                let mut y = Tensor::empty(&dev, dtype, &shape)?;
                gemm(&dev, a, b, GemmOut::new(&mut y), &cfg)?;
                Output::High(y)
            }
            (true, Some(s), _) => {
                let mut y = Tensor::empty(&dev, DType::E4M3, &shape)?;
                let ((), scale_inv) = s.with_output_scaling(FWD_OUTPUT, |scale, amax| {
                    let d = GemmOut { tensor: &mut y, fp8: Some(Fp8Output { scale, amax }) };
                    gemm(&dev, a, b, d, &cfg)
                })?;
                Output::Fp8(Float8Tensor::from_parts(y, None, scale_inv)?)
            }
            (true, None, Recipe::Current(c)) => {
                // Current scaling needs the output's amax before its cast: GEMM to high precision
                // first (as TE's current-scaling quantizer does).
                let mut y = Tensor::empty(&dev, dtype, &shape)?;
                gemm(&dev, a, b, GemmOut::new(&mut y), &cfg)?;
                Output::Fp8(quantize_current(&dev, &y, DType::E4M3, &c, false, None)?)
            }
            (true, None, Recipe::Delayed(_)) => return Err(self.err("internal: delayed recipe without state".into())),
        };
        if !grad {
            return Ok((out, None));
        }
        let input_t = match self.save_input {
            true => {
                Some(x8.into_transposed().ok_or_else(|| self.err("internal: the FP8 input has no transpose".into()))?)
            }
            false => None,
        };
        let ticket = match recipe {
            Recipe::Delayed(r) => Some(backward_ticket(&self.bwd_state(&r)?)),
            Recipe::Current(_) => None,
        };
        Ok((out, Some(Saved::Fp8 { input_t, weight: w8, recipe, ticket })))
    }

    /// Backward: `dy` `[..., out]` → `dx` (`input_shape`, `dy`'s dtype) when asked; wgrad and
    /// bgrad accumulate into the parameters.
    pub(crate) fn backward(
        &mut self,
        saved: Saved,
        dy: &Tensor,
        input_shape: &[usize],
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        ops::check_dtype(self.module, "grad_output", dy, DType::is_high_precision, "f32, bf16 or f16")?;
        ops::check_shape(self.module, "grad_output", dy, &out_shape(input_shape, self.params.out_features()))?;
        self.params.check_main_grad()?;
        match saved {
            Saved::Fp8 { input_t, weight, recipe, ticket } => {
                let input_t = input_t.ok_or_else(|| self.err("internal: the FP8 input was not restored".into()))?;
                let dx = self.backward_fp8(dy, &input_t, &weight, recipe, input_shape, input_grad)?;
                if let Some(t) = ticket {
                    t.finish()?;
                }
                Ok(dx)
            }
            Saved::High { input, weight } => self.backward_high(dy, &input, &weight, input_grad),
        }
    }

    fn backward_fp8(
        &mut self,
        dy: &Tensor,
        input_t: &Float8Tensor,
        weight: &Float8Tensor,
        recipe: Recipe,
        input_shape: &[usize],
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let (dy8, dbias) = self.quantize_grad(dy, recipe)?;
        self.backward_fp8_quantized(&dy8, dbias, input_t, weight, input_shape, dy.dtype(), input_grad)
    }

    /// `dy` → FP8 `dy8` with its transpose in one cast_transpose, with the bias gradient fused
    /// when backward computes it.
    fn quantize_grad(&mut self, dy: &Tensor, recipe: Recipe) -> Result<(Float8Tensor, Option<Tensor>)> {
        let dev = self.dev();
        let (tokens, n_out) = dy.as_2d(self.module)?;
        let mut dbias = match (self.params.bias(), self.bias_bwd) {
            (Some(_), true) => Some(Tensor::empty(&dev, dy.dtype(), &[n_out])?),
            _ => None,
        };
        let mut workspace = match dbias {
            // SAFETY: f32 has no invalid bit patterns; the workspace is scratch the kernel writes
            // before it reads it (`DbiasOut::workspace`).
            Some(_) => Some(unsafe { dev.stream().alloc::<f32>(dbias_workspace_len(tokens, n_out)) }?),
            None => None,
        };
        let dbias_out = match (&mut dbias, &mut workspace) {
            (Some(d), Some(w)) => Some(DbiasOut { dbias: d, workspace: w.as_view_mut() }),
            _ => None,
        };
        let dy8 = match recipe {
            Recipe::Delayed(r) => self.bwd_state(&r)?.quantize(dy, BWD_GRAD_OUTPUT, true, dbias_out)?,
            Recipe::Current(c) => quantize_current(&dev, dy, c.fp8_format.backward_dtype(), &c, true, dbias_out)?,
        };
        Ok((dy8, dbias))
    }

    /// FP8 backward from an already cast `dy8` (with transpose) and its bias gradient: dgrad
    /// when asked, wgrad and bgrad into the parameters. A fused producer (the dGELU cast of
    /// `LayerNormMLP`) calls it directly.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn backward_fp8_quantized(
        &mut self,
        dy8: &Float8Tensor,
        dbias: Option<Tensor>,
        input_t: &Float8Tensor,
        weight: &Float8Tensor,
        input_shape: &[usize],
        dtype: DType,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let dev = self.dev();
        let dx = fp8_dgrad(&dev, dy8, weight, input_shape, dtype, input_grad)?;
        let dy8_t =
            dy8.transpose().ok_or_else(|| self.err("internal: the grad_output cast made no transpose".into()))?;
        let a = Operand::fp8(dy8_t, dy8.scale_inv().as_view());
        let b = Operand::fp8(input_t.data(), input_t.scale_inv().as_view());
        self.params.accumulate_wgrad(a, b, None)?;
        if let Some(d) = dbias {
            self.params.accumulate_bias_grad(d)?;
        }
        Ok(dx)
    }

    fn backward_high(&mut self, dy: &Tensor, x: &Tensor, w: &Tensor, input_grad: bool) -> Result<Option<Tensor>> {
        let dev = self.dev();
        let dy = super::params::convert(&dev, dy.clone(), x.dtype())?;
        let dx = if input_grad {
            // dx [t, in] = dy [t, out] · W [out, in]: B = Wᵀ as stored transposed.
            let mut dx = Tensor::empty(&dev, x.dtype(), x.shape())?;
            gemm(&dev, Operand::new(&dy), Operand::new(w).transposed(), GemmOut::new(&mut dx), &GemmConfig::default())?;
            Some(dx)
        } else {
            None
        };
        // dW [out, in] = dyᵀ [out, t] · x [t, in]; the bias gradient Σ_t dy comes from the same
        // GEMM's BGRADB epilogue (TE's non-FP8 wgrad with `grad = true`).
        let (_, n_out) = dy.as_2d(self.module)?;
        let mut dbias = match (self.params.bias(), self.bias_bwd) {
            (Some(_), true) => Some(Tensor::empty(&dev, x.dtype(), &[n_out])?),
            _ => None,
        };
        self.params.accumulate_wgrad(Operand::new(&dy).transposed(), Operand::new(x).transposed(), dbias.as_mut())?;
        if let Some(d) = dbias {
            self.params.accumulate_bias_grad(d)?;
        }
        Ok(dx)
    }
}

/// FP8 dgrad `dx = dy8 · (W8ᵀ)ᵀ` with the split accumulator (TE), or `None` when not asked.
pub(crate) fn fp8_dgrad(
    dev: &Device,
    dy8: &Float8Tensor,
    weight: &Float8Tensor,
    input_shape: &[usize],
    dtype: DType,
    input_grad: bool,
) -> Result<Option<Tensor>> {
    if !input_grad {
        return Ok(None);
    }
    let w_t = weight.transpose().ok_or_else(|| Error::Shape {
        op: "dgrad",
        message: "internal: the saved FP8 weight has no transpose".into(),
    })?;
    let mut dx = Tensor::empty(dev, dtype, input_shape)?;
    let (a, b) = (Operand::fp8(dy8.data(), dy8.scale_inv().as_view()), Operand::fp8(w_t, weight.scale_inv().as_view()));
    gemm(dev, a, b, GemmOut::new(&mut dx), &GemmConfig::default())?;
    Ok(Some(dx))
}

/// The context a [`Linear::forward`] saves for its [`Linear::backward`].
#[derive(Debug)]
pub struct LinearCtx {
    module_id: u64,
    weight_version: u64,
    input_shape: Vec<usize>,
    saved: Saved,
}

impl LinearCtx {
    /// Device bytes this context holds only for backward (the FP8 input transpose).
    pub fn saved_bytes(&self) -> usize {
        self.saved.bytes()
    }
}

/// Fails unless `ctx` was made by module `id` at parameter version `version`.
pub(crate) fn check_ctx(module: &'static str, ctx: (u64, u64), id: u64, version: u64) -> Result<()> {
    let context = |message: String| Error::Context { module, message };
    if ctx.0 != id {
        return Err(context(format!("the context was made by another {module}'s forward")));
    }
    if ctx.1 != version {
        return Err(context(
            "the parameters changed after the forward that made this context (stale context); run forward again \
             after updating the weights"
                .into(),
        ));
    }
    Ok(())
}

/// A linear layer `y = x · Wᵀ + b`, `x: [..., in_features]`, `W: [out_features, in_features]`,
/// `b: [out_features]`, `y: [..., out_features]` in the input's dtype.
///
/// Inside [`crate::fp8::fp8_autocast`] its GEMMs run in FP8 with the scope's recipe; outside
/// in `params_dtype`. See the module docs for the FP8 dataflow.
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// use te_runtime::fp8::{fp8_autocast, DelayedScaling};
/// use te_runtime::modules::{Linear, LinearConfig};
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
    /// `init_std`, or FP8 weights whose dims are not multiples of 16; allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: LinearConfig) -> Result<Self> {
        let params = LinearParams::new(
            dev,
            MODULE,
            ParamsInit {
                in_features: cfg.in_features,
                out_features: cfg.out_features,
                bias: cfg.bias,
                params_dtype: cfg.params_dtype,
                fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
                init_std: cfg.init_std,
                seed: cfg.seed,
            },
        )?;
        let core = LinearCore::new(params, MODULE, !cfg.return_bias, !cfg.return_bias);
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, core })
    }

    /// The configuration.
    pub fn config(&self) -> &LinearConfig {
        &self.cfg
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
        self.core.fwd_state_opt()
    }

    /// The backward scaling state (grad_output, grad_input slots).
    pub fn fp8_backward_state(&self) -> Option<&Arc<ScalingState>> {
        self.core.bwd_state_opt()
    }

    /// The forward and backward state slots, for a writable traversal.
    pub(crate) fn fp8_state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        self.core.state_slots()
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

    /// Forward for training with per-call options.
    ///
    /// # Errors
    /// [`Error::Shape`] when the last dim of `input` is not `in_features`, or (FP8) when
    /// `in_features`, `out_features` or the token count (product of leading dims) is not a
    /// multiple of 16, naming the dim and what to pad to; [`Error::DType`] for a non-f32/bf16/f16
    /// input; GEMM and kernel failures.
    pub fn forward_with(&mut self, input: &Tensor, opts: ForwardOptions) -> Result<(Output, LinearCtx)> {
        let (out, saved) = self.run_forward(input, opts, true)?;
        let saved = saved.ok_or_else(|| self.core.err("internal: training forward saved nothing".into()))?;
        let ctx = LinearCtx {
            module_id: self.id,
            weight_version: self.core.params.version(),
            input_shape: input.shape().to_vec(),
            saved,
        };
        Ok((out, ctx))
    }

    /// Forward for inference (TE under `torch.no_grad()`): no context, no transposes; an FP8
    /// weight stays 1 byte per parameter.
    ///
    /// # Errors
    /// As [`Linear::forward_with`], except that the token count may be any size.
    pub fn infer(&mut self, input: &Tensor) -> Result<Tensor> {
        let (out, _) = self.run_forward(input, ForwardOptions::default(), false)?;
        out.into_high(&self.dev, input.dtype())
    }

    fn run_forward(&mut self, x: &Tensor, opts: ForwardOptions, grad: bool) -> Result<(Output, Option<Saved>)> {
        check_input(MODULE, x, self.cfg.in_features)?;
        self.core.forward(LinearInput::High(x.clone()), x.shape(), x.dtype(), fp8_mode(), opts, grad)
    }

    /// Backward of [`Linear::forward`]: returns `dx` (`grad_output`'s dtype, the input's shape)
    /// and accumulates the weight and bias gradients.
    ///
    /// # Errors
    /// As [`Linear::backward_with`].
    pub fn backward(&mut self, ctx: LinearCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, BackwardOptions::default())?
            .ok_or_else(|| self.core.err("internal: no input gradient".into()))
    }

    /// Backward with options; `None` when `input_grad` is false.
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another layer or one made before the parameters
    /// changed; [`Error::Shape`] / [`Error::DType`] when `grad_output` is not the output's shape
    /// or not f32/bf16/f16; [`Error::Config`] when `fuse_wgrad_accumulation` is set but no
    /// `main_grad` was handed in; GEMM and kernel failures.
    pub fn backward_with(
        &mut self,
        ctx: LinearCtx,
        grad_output: &Tensor,
        opts: BackwardOptions,
    ) -> Result<Option<Tensor>> {
        check_ctx(MODULE, (ctx.module_id, ctx.weight_version), self.id, self.core.params.version())?;
        self.core.backward(ctx.saved, grad_output, &ctx.input_shape, opts.input_grad)
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

/// `[..., out]` for an input `[..., in]`.
pub(crate) fn out_shape(input: &[usize], out: usize) -> Vec<usize> {
    let mut s = input.to_vec();
    if let Some(last) = s.last_mut() {
        *last = out;
    }
    s
}

/// The module's state for this recipe and format: created on first use, conformed after.
pub(crate) fn conform(
    slot: &mut Option<Arc<ScalingState>>,
    dev: &Arc<Device>,
    n: usize,
    dtype: DType,
    r: &DelayedScaling,
) -> Result<Arc<ScalingState>> {
    match slot {
        Some(s) => {
            s.conform(r, dtype)?;
            Ok(s.clone())
        }
        None => Ok(slot.insert(ScalingState::new(dev, n, dtype, r)?).clone()),
    }
}
