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

use super::{init, next_module_id, Output};
use crate::fp8::autocast::{backward_ticket, register_forward, BackwardTicket};
use crate::fp8::{
    fp8_mode, is_fp8_model_init, quantize_current, DelayedScaling, Float8CurrentScaling, Float8Tensor, Fp8Mode, Recipe,
    ScalingState,
};
use crate::gemm::{gemm, Epilogue, Fp8Output, GemmConfig, Operand, Output as GemmOut};
use crate::ops;
use crate::ops::cast_transpose::{dbias_workspace_len, DbiasOut};
use crate::{Device, Error, Result, Tensor};
use std::sync::Arc;
use te_codegen::DType;

const MODULE: &str = "Linear";

/// Forward slots of the delayed-scaling state (TE `FP8FwdTensors`).
const FWD_INPUT: usize = 0;
const FWD_WEIGHT: usize = 1;
const FWD_OUTPUT: usize = 2;
/// Backward slots (TE `FP8BwdTensors`); `grad_input` is kept for FP8 dgrad outputs of fused
/// modules, as in TE.
const BWD_GRAD_OUTPUT: usize = 0;
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
    /// Do not add the bias in forward; the caller adds [`Linear::bias`] (fused into its next op,
    /// TE `return_bias`), and backward computes no bias gradient. Default false.
    pub return_bias: bool,
    /// Dtype of the weight, bias and their gradients: F32, BF16 or F16. Default BF16 (TE
    /// defaults to the torch default dtype; BF16 is what FP8 training runs with).
    pub params_dtype: DType,
    /// Wgrad GEMM accumulates into the caller's f32 `main_grad` (see
    /// [`Linear::set_main_grad`]) instead of the weight gradient. Default false.
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

/// The weight: high precision, or FP8 only (made under `fp8_model_init`).
#[derive(Debug)]
enum Weight {
    High(Tensor),
    Fp8(Float8Tensor),
}

/// What forward saved for backward.
#[derive(Debug)]
enum Saved {
    /// FP8 GEMMs: `x8ᵀ [in, tokens]`, `W8` with its transpose, and the forward's recipe.
    Fp8 { input_t: Float8Tensor, weight: Float8Tensor, recipe: Recipe, ticket: Option<BackwardTicket> },
    /// High-precision GEMMs: the input and weight (shared, not copied).
    High { input: Tensor, weight: Tensor },
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
    /// Device bytes this context holds for backward (saved input and weight copies).
    pub fn saved_bytes(&self) -> usize {
        match &self.saved {
            Saved::Fp8 { input_t, .. } => input_t.num_bytes(),
            Saved::High { .. } => 0,
        }
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
/// use te_runtime::fp8::{fp8_autocast, DelayedScaling};
/// use te_runtime::modules::{Linear, LinearConfig};
/// use te_runtime::{DType, Device, Tensor};
///
/// let dev = Device::new(0)?;
/// let mut fc = Linear::new(&dev, LinearConfig::new(4096, 16384))?;
/// let x = Tensor::zeros(&dev, DType::BF16, &[8192, 4096])?;
/// let (y, ctx) = fp8_autocast(true, DelayedScaling::default(), || fc.forward(&x))?;
/// let dy = Tensor::zeros(&dev, DType::BF16, y.shape())?;
/// let dx = fc.backward(ctx, &dy)?; // [8192, 4096]; weight_grad() and bias_grad() accumulate
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Linear {
    dev: Arc<Device>,
    cfg: LinearConfig,
    id: u64,
    weight: Weight,
    bias: Option<Tensor>,
    weight_grad: Option<Tensor>,
    bias_grad: Option<Tensor>,
    main_grad: Option<Tensor>,
    /// Bumped by every write to the parameters; contexts of older versions are stale.
    version: u64,
    fwd_state: Option<Arc<ScalingState>>,
    bwd_state: Option<Arc<ScalingState>>,
    /// FP8 weight cached by `is_first_microbatch = Some(true)`, with the version it was cast at.
    weight_cache: Option<(Float8Tensor, u64)>,
}

fn err(message: String) -> Error {
    Error::Shape { op: MODULE, message }
}

fn fp8_dim(dim: &str, value: usize) -> Result<()> {
    if value % 16 == 0 {
        Ok(())
    } else {
        Err(err(format!(
            "{dim} = {value} must be a multiple of 16 for FP8 GEMMs; pad it to {}",
            value.div_ceil(16) * 16
        )))
    }
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
        let config = |message: String| Error::Config { module: MODULE, message };
        if cfg.in_features == 0 || cfg.out_features == 0 {
            return Err(config(format!(
                "in_features and out_features must be ≥ 1, got {} and {}",
                cfg.in_features, cfg.out_features
            )));
        }
        if !cfg.params_dtype.is_high_precision() {
            return Err(config(format!("params_dtype must be f32, bf16 or f16, got {}", cfg.params_dtype)));
        }
        if !(cfg.init_std.is_finite() && cfg.init_std >= 0.0) {
            return Err(config(format!("init_std must be finite and ≥ 0, got {}", cfg.init_std)));
        }
        let (n_in, n_out) = (cfg.in_features, cfg.out_features);
        let w = init::normal(n_in * n_out, cfg.init_std, cfg.seed);
        let w = Tensor::from_f32(dev, cfg.params_dtype, &[n_out, n_in], &w)?;
        let weight = if is_fp8_model_init() {
            fp8_dim("in_features", n_in).and(fp8_dim("out_features", n_out)).map_err(|e| config(e.to_string()))?;
            Weight::Fp8(quantize_current(dev, &w, DType::E4M3, &Float8CurrentScaling::default(), false, None)?)
        } else {
            Weight::High(w)
        };
        let bias = if cfg.bias { Some(Tensor::zeros(dev, cfg.params_dtype, &[n_out])?) } else { None };
        Ok(Self {
            dev: dev.clone(),
            id: next_module_id(),
            cfg,
            weight,
            bias,
            weight_grad: None,
            bias_grad: None,
            main_grad: None,
            version: 0,
            fwd_state: None,
            bwd_state: None,
            weight_cache: None,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LinearConfig {
        &self.cfg
    }

    /// The high-precision weight `[out, in]`, or `None` for an FP8-only weight.
    pub fn weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::High(t) => Some(t),
            Weight::Fp8(_) => None,
        }
    }

    /// The FP8-only weight of a layer made under `fp8_model_init`.
    pub fn fp8_weight(&self) -> Option<&Float8Tensor> {
        match &self.weight {
            Weight::Fp8(f) => Some(f),
            Weight::High(_) => None,
        }
    }

    /// The bias `[out]`, when the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Replaces the weight (e.g. loaded or updated by an optimizer); invalidates saved contexts
    /// and the cached FP8 weight.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless `w` is `[out, in]` of `params_dtype`.
    pub fn set_weight(&mut self, w: Tensor) -> Result<()> {
        let (o, i) = (self.cfg.out_features, self.cfg.in_features);
        ops::check_shape(MODULE, "weight", &w, &[o, i])?;
        let dt = self.cfg.params_dtype;
        ops::check_dtype(MODULE, "weight", &w, |d| d == dt, dt.name())?;
        self.weight = Weight::High(w);
        self.touch();
        Ok(())
    }

    /// Replaces the bias.
    ///
    /// # Errors
    /// [`Error::Config`] when the layer has no bias; [`Error::Shape`] / [`Error::DType`] unless
    /// `b` is `[out]` of `params_dtype`.
    pub fn set_bias(&mut self, b: Tensor) -> Result<()> {
        if self.bias.is_none() {
            return Err(Error::Config { module: MODULE, message: "this layer was made with bias = false".into() });
        }
        ops::check_shape(MODULE, "bias", &b, &[self.cfg.out_features])?;
        let dt = self.cfg.params_dtype;
        ops::check_dtype(MODULE, "bias", &b, |d| d == dt, dt.name())?;
        self.bias = Some(b);
        self.touch();
        Ok(())
    }

    /// Gradient of the weight `[out, in]` (`params_dtype`), accumulated over backward calls
    /// since [`Linear::zero_grad`]; `None` before the first backward or with
    /// `fuse_wgrad_accumulation`.
    pub fn weight_grad(&self) -> Option<&Tensor> {
        self.weight_grad.as_ref()
    }

    /// Gradient of the bias `[out]`, accumulated like [`Linear::weight_grad`].
    pub fn bias_grad(&self) -> Option<&Tensor> {
        self.bias_grad.as_ref()
    }

    /// Drops the accumulated gradients (TE/PyTorch `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.weight_grad = None;
        self.bias_grad = None;
    }

    /// Hands the layer the caller's f32 `main_grad` `[out, in]` that wgrad accumulates into with
    /// `fuse_wgrad_accumulation` (Megatron's `weight.main_grad`).
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless it is `[out, in]` f32.
    pub fn set_main_grad(&mut self, main_grad: Tensor) -> Result<()> {
        ops::check_shape(MODULE, "main_grad", &main_grad, &[self.cfg.out_features, self.cfg.in_features])?;
        ops::check_dtype(MODULE, "main_grad", &main_grad, |d| d == DType::F32, "f32")?;
        self.main_grad = Some(main_grad);
        Ok(())
    }

    /// The `main_grad` handed in with [`Linear::set_main_grad`].
    pub fn main_grad(&self) -> Option<&Tensor> {
        self.main_grad.as_ref()
    }

    /// Takes the `main_grad` back.
    pub fn take_main_grad(&mut self) -> Option<Tensor> {
        self.main_grad.take()
    }

    /// Device bytes of the parameters as stored: the weight (FP8 codes, their transpose when one
    /// was built, or high precision), the cached FP8 weight, and the bias.
    pub fn parameter_bytes(&self) -> usize {
        let w = match &self.weight {
            Weight::High(t) => t.num_bytes(),
            Weight::Fp8(f) => f.num_bytes(),
        };
        let cache = self.weight_cache.as_ref().map_or(0, |(f, _)| f.num_bytes());
        w + cache + self.bias.as_ref().map_or(0, Tensor::num_bytes)
    }

    /// The forward scaling state (input, weight, output slots), once an FP8 forward ran with
    /// delayed scaling.
    pub fn fp8_forward_state(&self) -> Option<&Arc<ScalingState>> {
        self.fwd_state.as_ref()
    }

    /// The backward scaling state (grad_output, grad_input slots).
    pub fn fp8_backward_state(&self) -> Option<&Arc<ScalingState>> {
        self.bwd_state.as_ref()
    }

    fn touch(&mut self) {
        self.version += 1;
        self.weight_cache = None;
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
        let saved = saved.ok_or_else(|| err("internal: training forward saved nothing".into()))?;
        let ctx =
            LinearCtx { module_id: self.id, weight_version: self.version, input_shape: input.shape().to_vec(), saved };
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
        ops::check_dtype(MODULE, "input", x, DType::is_high_precision, "f32, bf16 or f16")?;
        ops::check_nonempty(MODULE, "input", x)?;
        let (tokens, k) = x.as_2d(MODULE)?;
        if k != self.cfg.in_features {
            return Err(err(format!(
                "input {:?} must end in in_features = {}, got {k}",
                x.shape(),
                self.cfg.in_features
            )));
        }
        match fp8_mode() {
            Fp8Mode::Fp8(recipe) => {
                fp8_dim("in_features", self.cfg.in_features)?;
                fp8_dim("out_features", self.cfg.out_features)?;
                if grad {
                    fp8_dim("tokens (the product of the input's leading dims)", tokens)?;
                }
                self.forward_fp8(x, recipe, opts, grad)
            }
            Fp8Mode::Calibrating(Recipe::Delayed(r)) => {
                let state = self.fwd_state(&r)?;
                register_forward(&state);
                state.record_amax(x, FWD_INPUT)?;
                if let Weight::High(w) = &self.weight {
                    state.record_amax(w, FWD_WEIGHT)?;
                }
                self.forward_high(x, grad)
            }
            Fp8Mode::Calibrating(Recipe::Current(_)) | Fp8Mode::HighPrecision => self.forward_high(x, grad),
        }
    }

    fn fwd_state(&mut self, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
        conform(&mut self.fwd_state, &self.dev, 3, r.fp8_format.forward_dtype(), r)
    }

    fn bwd_state(&mut self, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
        conform(&mut self.bwd_state, &self.dev, BWD_SLOTS, r.fp8_format.backward_dtype(), r)
    }

    /// The high-precision weight, or the FP8-only weight dequantized to `params_dtype`.
    fn weight_high(&self) -> Result<Tensor> {
        match &self.weight {
            Weight::High(w) => Ok(w.clone()),
            Weight::Fp8(f) => f.dequantize(&self.dev, self.cfg.params_dtype),
        }
    }

    fn forward_high(&mut self, x: &Tensor, grad: bool) -> Result<(Output, Option<Saved>)> {
        let w = self.weight_high()?;
        let w = if w.dtype() == x.dtype() { w } else { cast_high(&self.dev, &w, x.dtype())? };
        let mut y = Tensor::empty(&self.dev, x.dtype(), &out_shape(x.shape(), self.cfg.out_features))?;
        let bias = self.added_bias(x.dtype())?;
        let cfg = GemmConfig { epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias), ..Default::default() };
        gemm(&self.dev, Operand::new(x), Operand::new(&w), GemmOut::new(&mut y), &cfg)?;
        let saved = grad.then(|| Saved::High { input: x.clone(), weight: w });
        Ok((Output::High(y), saved))
    }

    /// The bias the forward adds (none with `return_bias`), in `dtype`.
    fn added_bias(&self, dtype: DType) -> Result<Option<Tensor>> {
        match &self.bias {
            Some(b) if !self.cfg.return_bias => {
                Ok(Some(if b.dtype() == dtype { b.clone() } else { cast_high(&self.dev, b, dtype)? }))
            }
            _ => Ok(None),
        }
    }

    fn forward_fp8(
        &mut self,
        x: &Tensor,
        recipe: Recipe,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Output, Option<Saved>)> {
        let dev = self.dev.clone();
        let fwd = match recipe {
            Recipe::Delayed(r) => {
                let s = self.fwd_state(&r)?;
                register_forward(&s);
                Some(s)
            }
            Recipe::Current(_) => None,
        };
        let x8 = match (&fwd, recipe) {
            (Some(s), _) => s.quantize(x, FWD_INPUT, grad, None)?,
            (None, Recipe::Current(c)) => quantize_current(&dev, x, DType::E4M3, &c, grad, None)?,
            (None, Recipe::Delayed(_)) => return Err(err("internal: delayed recipe without state".into())),
        };
        let w8 = self.fp8_weight_for(recipe, fwd.as_deref(), opts.is_first_microbatch, grad)?;
        let bias = self.added_bias(x.dtype())?;
        let cfg = GemmConfig {
            fast_accum: true,
            epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias),
            ..Default::default()
        };
        let shape = out_shape(x.shape(), self.cfg.out_features);
        let (a, b) =
            (Operand::fp8(x8.data(), x8.scale_inv().as_view()), Operand::fp8(w8.data(), w8.scale_inv().as_view()));
        let out = match (opts.fp8_output, &fwd, recipe) {
            (false, ..) => {
                let mut y = Tensor::empty(&dev, x.dtype(), &shape)?;
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
                let mut y = Tensor::empty(&dev, x.dtype(), &shape)?;
                gemm(&dev, a, b, GemmOut::new(&mut y), &cfg)?;
                Output::Fp8(quantize_current(&dev, &y, DType::E4M3, &c, false, None)?)
            }
            (true, None, Recipe::Delayed(_)) => return Err(err("internal: delayed recipe without state".into())),
        };
        if !grad {
            return Ok((out, None));
        }
        let input_t = x8.into_transposed().ok_or_else(|| err("internal: the input cast made no transpose".into()))?;
        let ticket = match recipe {
            Recipe::Delayed(r) => Some(backward_ticket(&self.bwd_state(&r)?)),
            Recipe::Current(_) => None,
        };
        Ok((out, Some(Saved::Fp8 { input_t, weight: w8, recipe, ticket })))
    }

    /// The FP8 weight for this call: the FP8-only weight, the micro-batch cache, or a fresh cast
    /// (with its transpose when backward will need it).
    fn fp8_weight_for(
        &mut self,
        recipe: Recipe,
        fwd: Option<&ScalingState>,
        is_first_microbatch: Option<bool>,
        grad: bool,
    ) -> Result<Float8Tensor> {
        let dev = self.dev.clone();
        let w = match &mut self.weight {
            Weight::Fp8(f) => {
                if grad {
                    f.ensure_transpose(&dev)?;
                }
                return Ok(f.clone());
            }
            Weight::High(w) => w.clone(),
        };
        if is_first_microbatch == Some(false) {
            if let Some((cached, version)) = &mut self.weight_cache {
                if *version == self.version {
                    if grad {
                        cached.ensure_transpose(&dev)?;
                    }
                    return Ok(cached.clone());
                }
            }
        }
        let w8 = match (fwd, recipe) {
            (Some(s), _) => s.quantize(&w, FWD_WEIGHT, grad, None)?,
            (None, Recipe::Current(c)) => quantize_current(&dev, &w, DType::E4M3, &c, grad, None)?,
            (None, Recipe::Delayed(_)) => return Err(err("internal: delayed recipe without state".into())),
        };
        self.weight_cache = is_first_microbatch.is_some().then(|| (w8.clone(), self.version));
        Ok(w8)
    }

    /// Backward of [`Linear::forward`]: returns `dx` (`grad_output`'s dtype, the input's shape)
    /// and accumulates the weight and bias gradients.
    ///
    /// # Errors
    /// As [`Linear::backward_with`].
    pub fn backward(&mut self, ctx: LinearCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, BackwardOptions::default())?
            .ok_or_else(|| err("internal: no input gradient".into()))
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
        let context = |message: String| Error::Context { module: MODULE, message };
        if ctx.module_id != self.id {
            return Err(context("the context was made by another Linear's forward".into()));
        }
        if ctx.weight_version != self.version {
            return Err(context(
                "the parameters changed after the forward that made this context (stale context); run forward \
                 again after updating the weights"
                    .into(),
            ));
        }
        ops::check_dtype(MODULE, "grad_output", grad_output, DType::is_high_precision, "f32, bf16 or f16")?;
        let want = out_shape(&ctx.input_shape, self.cfg.out_features);
        ops::check_shape(MODULE, "grad_output", grad_output, &want)?;
        if self.cfg.fuse_wgrad_accumulation && self.main_grad.is_none() {
            return Err(Error::Config {
                module: MODULE,
                message: "fuse_wgrad_accumulation is set but no main_grad was handed in; call set_main_grad with an \
                          f32 [out_features, in_features] tensor first"
                    .into(),
            });
        }
        match ctx.saved {
            Saved::Fp8 { input_t, weight, recipe, ticket } => {
                let dx = self.backward_fp8(grad_output, &input_t, &weight, recipe, &ctx.input_shape, opts)?;
                if let Some(t) = ticket {
                    t.finish()?;
                }
                Ok(dx)
            }
            Saved::High { input, weight } => self.backward_high(grad_output, &input, &weight, opts),
        }
    }

    fn backward_fp8(
        &mut self,
        dy: &Tensor,
        input_t: &Float8Tensor,
        weight: &Float8Tensor,
        recipe: Recipe,
        input_shape: &[usize],
        opts: BackwardOptions,
    ) -> Result<Option<Tensor>> {
        let dev = self.dev.clone();
        let (tokens, n_out) = dy.as_2d(MODULE)?;
        let mut dbias = match (&self.bias, self.cfg.return_bias) {
            (Some(_), false) => Some(Tensor::empty(&dev, dy.dtype(), &[n_out])?),
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
        let dy8_t = dy8.transpose().ok_or_else(|| err("internal: the grad_output cast made no transpose".into()))?;
        let dx = if opts.input_grad {
            let w_t = weight.transpose().ok_or_else(|| err("internal: the saved weight has no transpose".into()))?;
            let mut dx = Tensor::empty(&dev, dy.dtype(), input_shape)?;
            let (a, b) =
                (Operand::fp8(dy8.data(), dy8.scale_inv().as_view()), Operand::fp8(w_t, weight.scale_inv().as_view()));
            gemm(&dev, a, b, GemmOut::new(&mut dx), &GemmConfig::default())?;
            Some(dx)
        } else {
            None
        };
        let a = Operand::fp8(dy8_t, dy8.scale_inv().as_view());
        let b = Operand::fp8(input_t.data(), input_t.scale_inv().as_view());
        self.accumulate_wgrad(a, b)?;
        if let Some(d) = dbias {
            self.accumulate_bias_grad(d)?;
        }
        Ok(dx)
    }

    fn backward_high(&mut self, dy: &Tensor, x: &Tensor, w: &Tensor, opts: BackwardOptions) -> Result<Option<Tensor>> {
        let dev = self.dev.clone();
        let dy = if dy.dtype() == x.dtype() { dy.clone() } else { cast_high(&dev, dy, x.dtype())? };
        let dx = if opts.input_grad {
            // dx [t, in] = dy [t, out] · W [out, in]: B = Wᵀ as stored transposed.
            let mut dx = Tensor::empty(&dev, x.dtype(), x.shape())?;
            gemm(&dev, Operand::new(&dy), Operand::new(w).transposed(), GemmOut::new(&mut dx), &GemmConfig::default())?;
            Some(dx)
        } else {
            None
        };
        // dW [out, in] = dyᵀ [out, t] · x [t, in]; the bias gradient Σ_t dy comes from the same
        // GEMM's BGRADB epilogue (TE's non-FP8 wgrad with `grad = true`).
        let (_, n_out) = dy.as_2d(MODULE)?;
        let mut dbias = match (&self.bias, self.cfg.return_bias) {
            (Some(_), false) => Some(Tensor::empty(&dev, x.dtype(), &[n_out])?),
            _ => None,
        };
        let a = Operand::new(&dy).transposed();
        let b = Operand::new(x).transposed();
        self.accumulate_wgrad_with(a, b, dbias.as_mut())?;
        if let Some(d) = dbias {
            self.accumulate_bias_grad(d)?;
        }
        Ok(dx)
    }

    fn accumulate_wgrad(&mut self, a: Operand<'_>, b: Operand<'_>) -> Result<()> {
        self.accumulate_wgrad_with(a, b, None)
    }

    /// `dW (+)= A · Bᵀ` into `main_grad` (f32, always accumulating) or the weight gradient
    /// (`params_dtype`, accumulating when one exists); with `bgrad`, its BGRADB epilogue.
    fn accumulate_wgrad_with(&mut self, a: Operand<'_>, b: Operand<'_>, bgrad: Option<&mut Tensor>) -> Result<()> {
        let dev = self.dev.clone();
        let epilogue = bgrad.map_or(Epilogue::None, |bgrad| Epilogue::BgradB { bgrad });
        let (target, accumulate) = if self.cfg.fuse_wgrad_accumulation {
            (self.main_grad.as_mut().ok_or_else(|| err("internal: main_grad checked above".into()))?, true)
        } else {
            let exists = self.weight_grad.is_some();
            let shape = [self.cfg.out_features, self.cfg.in_features];
            let dt = self.cfg.params_dtype;
            let g = match &mut self.weight_grad {
                Some(g) => g,
                None => self.weight_grad.insert(Tensor::empty(&dev, dt, &shape)?),
            };
            (g, exists)
        };
        let cfg = GemmConfig { accumulate, epilogue, ..Default::default() };
        gemm(&dev, a, b, GemmOut::new(target), &cfg)
    }

    fn accumulate_bias_grad(&mut self, dbias: Tensor) -> Result<()> {
        let dbias = if dbias.dtype() == self.cfg.params_dtype {
            dbias
        } else {
            cast_high(&self.dev, &dbias, self.cfg.params_dtype)?
        };
        match &mut self.bias_grad {
            Some(g) => ops::elementwise::add_assign(&self.dev, g, &dbias),
            None => {
                self.bias_grad = Some(dbias);
                Ok(())
            }
        }
    }
}

/// `[..., out]` for an input `[..., in]`.
fn out_shape(input: &[usize], out: usize) -> Vec<usize> {
    let mut s = input.to_vec();
    if let Some(last) = s.last_mut() {
        *last = out;
    }
    s
}

/// `x` converted to another high-precision dtype (`0 + x`).
fn cast_high(dev: &Device, x: &Tensor, dtype: DType) -> Result<Tensor> {
    let mut y = Tensor::zeros(dev, dtype, x.shape())?;
    ops::elementwise::add_assign(dev, &mut y, x)?;
    Ok(y)
}

/// The module's state for this recipe and format: created on first use, conformed after.
fn conform(
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
