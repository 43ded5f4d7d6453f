//! The parameters of a GEMM layer — weight, bias, their gradients, the caller's `main_grad` and
//! the cached FP8 weight — shared by `Linear`, `LayerNormLinear` and `LayerNormMLP`.

use super::init;
use crate::fp8::{is_fp8_model_init, Float8CurrentScaling, Float8CurrentScalingQuantizer, Float8Tensor, Quantizer};
use crate::parallel::{GemmParallel, Split};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::gemm::{gemm, BlockScale, Epilogue, GemmConfig, Operand, Output as GemmOut};
use te_runtime::ops;
use te_runtime::{Device, Error, Result, Tensor};

/// The weight: high precision, FP8 only (made under `fp8_model_init`), or gathered as FP8 codes
/// (a ZeRO-3 step's FP8 all-gather: [`LinearParams::set_gathered_fp8_weight`]).
#[derive(Debug)]
enum Weight {
    High(Tensor),
    Fp8(Float8Tensor),
    Gathered(Float8Tensor),
}

/// Fails unless an FP8 GEMM dimension is a multiple of 16, naming it and what to pad to
/// ([`te_codegen::check_fp8_dim`]).
pub(crate) fn fp8_dim(module: &'static str, dim: &str, value: usize) -> Result<()> {
    te_codegen::check_fp8_dim(dim, value).map_err(|message| Error::Shape { op: module, message })
}

/// Weight `[out, in]` and optional bias `[out]` of a GEMM layer, with gradients accumulated
/// over backward calls (PyTorch `.grad` semantics) and a version bumped by every write.
#[derive(Debug)]
pub struct LinearParams {
    dev: Arc<Device>,
    module: &'static str,
    in_features: usize,
    out_features: usize,
    params_dtype: DType,
    fuse_wgrad_accumulation: bool,
    weight: Weight,
    bias: Option<Tensor>,
    weight_grad: Option<Tensor>,
    bias_grad: Option<Tensor>,
    main_grad: Option<Tensor>,
    version: u64,
    /// FP8 weight cached by `is_first_microbatch = Some(true)`, with the version it was cast at.
    cache: Option<(Float8Tensor, u64)>,
    /// Whether the weight and the bias are tensor-parallel slices.
    tensor_parallel: [bool; 2],
}

/// Arguments of [`LinearParams::new`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct ParamsInit {
    pub in_features: usize,
    pub out_features: usize,
    pub bias: bool,
    pub params_dtype: DType,
    pub fuse_wgrad_accumulation: bool,
    pub init_std: f32,
    pub seed: u64,
}

impl LinearParams {
    /// Weight `N(0, init_std)` (TE `init_method_normal`), bias 0; FP8 only (E4M3 scaled by its
    /// own amax) under `fp8_model_init`.
    pub(crate) fn new(dev: &Arc<Device>, module: &'static str, p: ParamsInit) -> Result<Self> {
        let config = |message: String| Error::Config { module, message };
        if p.in_features == 0 || p.out_features == 0 {
            return Err(config(format!(
                "in_features and out_features must be ≥ 1, got {} and {}",
                p.in_features, p.out_features
            )));
        }
        if !p.params_dtype.is_high_precision() {
            return Err(config(format!("params_dtype must be f32, bf16 or f16, got {}", p.params_dtype)));
        }
        if !(p.init_std.is_finite() && p.init_std >= 0.0) {
            return Err(config(format!("init_std must be finite and ≥ 0, got {}", p.init_std)));
        }
        let (n_in, n_out) = (p.in_features, p.out_features);
        let w = Tensor::from_f32(dev, p.params_dtype, &[n_out, n_in], &init::normal(n_in * n_out, p.init_std, p.seed))?;
        let weight = if is_fp8_model_init() {
            fp8_dim(module, "in_features", n_in)
                .and(fp8_dim(module, "out_features", n_out))
                .map_err(|e| config(e.to_string()))?;
            let q = Float8CurrentScalingQuantizer::new(dev, DType::E4M3, Float8CurrentScaling::default())?;
            Weight::Fp8(q.quantize(&w, false, None)?)
        } else {
            Weight::High(w)
        };
        let bias = if p.bias { Some(Tensor::zeros(dev, p.params_dtype, &[n_out])?) } else { None };
        Ok(Self {
            dev: dev.clone(),
            module,
            in_features: n_in,
            out_features: n_out,
            params_dtype: p.params_dtype,
            fuse_wgrad_accumulation: p.fuse_wgrad_accumulation,
            weight,
            bias,
            weight_grad: None,
            bias_grad: None,
            main_grad: None,
            version: 0,
            cache: None,
            tensor_parallel: [false; 2],
        })
    }

    /// The parameters of a GEMM whose whole sizes are `init`'s, as `comm` places them on this
    /// rank: for a whole GEMM [`LinearParams::new`]; for a tensor-parallel one this rank's slice,
    /// the whole layer's weight initialized from `init.seed` and sliced as `split` says
    /// ([`GemmParallel::shard_weight`]; `None`: the mode's dim), so the weights do not depend on
    /// the group's size, the bias (0) of the slice's size, and the slices marked
    /// ([`LinearParams::tensor_parallel`]).
    ///
    /// # Errors
    /// [`GemmParallel::check_init`]'s and [`GemmParallel::local_features`]' [`Error::Config`];
    /// [`Error::Dist`] for a `split` that does not divide; the errors of [`LinearParams::new`].
    pub(crate) fn for_gemm(
        dev: &Arc<Device>,
        module: &'static str,
        p: ParamsInit,
        comm: &GemmParallel,
        split: Option<Split>,
    ) -> Result<Self> {
        comm.check_init(module, dev)?;
        let (w_in, w_out) = (p.in_features, p.out_features);
        let (n_in, n_out) = comm.local_features(module, w_in, w_out)?;
        let mut params = Self::new(dev, module, ParamsInit { in_features: n_in, out_features: n_out, ..p })?;
        let whole = || init::normal(w_in * w_out, p.init_std, p.seed);
        if let Some(slice) = comm.shard_weight(module, [w_out, w_in], split, whole)? {
            params.set_weight(Tensor::from_f32(dev, p.params_dtype, &[n_out, n_in], &slice)?)?;
        }
        params.tensor_parallel = comm.param_split();
        Ok(params)
    }

    /// The device the parameters live on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Input features (columns of the weight).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features (rows of the weight).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// Dtype of weight, bias and their gradients.
    pub fn params_dtype(&self) -> DType {
        self.params_dtype
    }

    /// The high-precision weight `[out, in]`, or `None` for an FP8-only weight.
    pub fn weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::High(t) => Some(t),
            Weight::Fp8(_) | Weight::Gathered(_) => None,
        }
    }

    /// The FP8-only weight of a layer made under `fp8_model_init`.
    pub fn fp8_weight(&self) -> Option<&Float8Tensor> {
        match &self.weight {
            Weight::Fp8(f) => Some(f),
            Weight::High(_) | Weight::Gathered(_) => None,
        }
    }

    /// The weight a ZeRO-3 step gathered as FP8 codes ([`LinearParams::set_gathered_fp8_weight`]),
    /// while the layer holds it.
    pub fn gathered_fp8_weight(&self) -> Option<&Float8Tensor> {
        match &self.weight {
            Weight::Gathered(f) => Some(f),
            Weight::High(_) | Weight::Fp8(_) => None,
        }
    }

    /// The bias `[out]`, when the layer has one.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The weight and bias as the decode GEMV (`ops::gemv`) reads them: a BF16 weight, or an
    /// FP8-only weight with a per-tensor scale (E4M3 codes multiplied with BF16 activations); a
    /// BF16 bias. `None` for what it does not read (f32 or f16 parameters, blockwise scales).
    /// Marked constant: the decode paths run it inside a forward, after kernels that do not
    /// write parameters, so on Hopper it starts loading the weight early.
    pub fn gemv_matrix(&self) -> Option<ops::gemv::GemvMatrix<'_>> {
        use ops::gemv::{GemvMatrix, GemvWeight};
        let weight = match &self.weight {
            Weight::High(w) if w.dtype() == DType::BF16 => GemvWeight::Bf16(w),
            Weight::Fp8(f) if f.block_scale().is_none() => GemvWeight::Fp8 { data: f.data(), scale_inv: f.scale_inv() },
            _ => return None,
        };
        if self.bias.as_ref().is_some_and(|b| b.dtype() != DType::BF16) {
            return None;
        }
        Some(GemvMatrix { weight, bias: self.bias.as_ref(), constant: true })
    }

    /// Writes since creation; contexts made at another version are stale.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Replaces the weight (loaded, or updated by an optimizer); invalidates saved contexts and
    /// the cached FP8 weight.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless `w` is `[out, in]` of `params_dtype`.
    pub fn set_weight(&mut self, w: Tensor) -> Result<()> {
        ops::check_shape(self.module, "weight", &w, &[self.out_features, self.in_features])?;
        let dt = self.params_dtype;
        ops::check_dtype(self.module, "weight", &w, |d| d == dt, dt.name())?;
        self.weight = Weight::High(w);
        self.touch();
        Ok(())
    }

    /// Whether the weight and the bias are slices of a tensor-parallel layer (the weight always;
    /// the bias of a column-parallel one), rather than whole on every rank.
    pub fn tensor_parallel(&self) -> [bool; 2] {
        self.tensor_parallel
    }

    /// Replaces the bias.
    ///
    /// # Errors
    /// [`Error::Config`] when the layer has no bias; [`Error::Shape`] / [`Error::DType`] unless
    /// `b` is `[out]` of `params_dtype`.
    pub fn set_bias(&mut self, b: Tensor) -> Result<()> {
        if self.bias.is_none() {
            return Err(Error::Config { module: self.module, message: "this layer was made with bias = false".into() });
        }
        ops::check_shape(self.module, "bias", &b, &[self.out_features])?;
        let dt = self.params_dtype;
        ops::check_dtype(self.module, "bias", &b, |d| d == dt, dt.name())?;
        self.bias = Some(b);
        self.touch();
        Ok(())
    }

    /// Replaces an FP8-only weight by `w` (E4M3 codes `[out, in]` with their `scale_inv`, a
    /// checkpoint's); invalidates saved contexts as [`LinearParams::set_weight`] does.
    ///
    /// # Errors
    /// [`Error::Config`] when the weight is high precision (write it with
    /// [`LinearParams::set_weight`]); [`Error::Shape`] / [`Error::DType`] unless `w` is
    /// `[out, in]` E4M3.
    pub fn set_fp8_weight(&mut self, w: Float8Tensor) -> Result<()> {
        if !matches!(self.weight, Weight::Fp8(_)) {
            return Err(Error::Config {
                module: self.module,
                message: "the weight is high precision, not FP8-only (made outside fp8_model_init)".into(),
            });
        }
        ops::check_shape(self.module, "weight", w.data(), &[self.out_features, self.in_features])?;
        ops::check_dtype(self.module, "weight", w.data(), |d| d == DType::E4M3, "e4m3")?;
        self.weight = Weight::Fp8(w);
        self.touch();
        Ok(())
    }

    /// Hands the layer its weight as FP8 codes gathered for this step from the data-parallel
    /// ranks' pieces (ZeRO-3's FP8 all-gather, torchao's `enable_fsdp_float8_all_gather`):
    /// `w` holds E4M3 codes `[out, in]` with one `scale_inv`, cast by the recipe's weight
    /// quantizer with the whole weight's amax (`te_nn::parallel::ParamShards::set_fp8_gather`),
    /// so they are the codes the layer's own cast of the whole weight would make. The layer's
    /// FP8 GEMMs read it (its transpose made from the codes when a backward needs it); no
    /// high-precision value of the weight is held, so a high-precision GEMM of the layer fails
    /// until [`LinearParams::set_weight`] hands one in again. Invalidates saved contexts as
    /// [`LinearParams::set_weight`] does.
    ///
    /// # Errors
    /// [`Error::Config`] for an FP8-only weight (`fp8_model_init`: it is FP8 already) or
    /// block-scaled codes; [`Error::Shape`] / [`Error::DType`] unless `w` is `[out, in]` E4M3.
    pub fn set_gathered_fp8_weight(&mut self, w: Float8Tensor) -> Result<()> {
        let config = |message: &str| Error::Config { module: self.module, message: message.into() };
        if matches!(self.weight, Weight::Fp8(_)) {
            return Err(config("the weight is FP8-only (fp8_model_init): write it with set_fp8_weight"));
        }
        if w.block_scale().is_some() {
            return Err(config("gathered FP8 weights have one scale per tensor, not block scales"));
        }
        ops::check_shape(self.module, "weight", w.data(), &[self.out_features, self.in_features])?;
        ops::check_dtype(self.module, "weight", w.data(), |d| d == DType::E4M3, "e4m3")?;
        self.weight = Weight::Gathered(w);
        self.touch();
        Ok(())
    }

    fn touch(&mut self) {
        self.version += 1;
        self.cache = None;
    }

    /// Gradient of the weight `[out, in]` (`params_dtype`), accumulated since
    /// [`LinearParams::zero_grad`]; `None` before the first backward or with
    /// `fuse_wgrad_accumulation`.
    pub fn weight_grad(&self) -> Option<&Tensor> {
        self.weight_grad.as_ref()
    }

    /// Takes the weight's gradient out (leaving none, as [`LinearParams::zero_grad`] would): a
    /// tied layer hands it to the module that owns the weight without a copy.
    pub fn take_weight_grad(&mut self) -> Option<Tensor> {
        self.weight_grad.take()
    }

    /// Gradient of the bias `[out]`, accumulated like [`LinearParams::weight_grad`].
    pub fn bias_grad(&self) -> Option<&Tensor> {
        self.bias_grad.as_ref()
    }

    /// Takes the bias's gradient out (leaving none, and the weight's as it is): a ZeRO-2
    /// backward releases it once reduced to the rank that owns it.
    pub fn take_bias_grad(&mut self) -> Option<Tensor> {
        self.bias_grad.take()
    }

    /// Drops the accumulated gradients (PyTorch `zero_grad(set_to_none=True)`).
    pub fn zero_grad(&mut self) {
        self.weight_grad = None;
        self.bias_grad = None;
    }

    /// The weight's and the bias's gradients as the optimizer reads them, writable (the
    /// `main_grad` in the weight's place when there is one): a data-parallel reduction averages
    /// them in place.
    pub(crate) fn grads_mut(&mut self) -> [Option<&mut Tensor>; 2] {
        let weight = match &mut self.main_grad {
            Some(m) => Some(m),
            None => self.weight_grad.as_mut(),
        };
        [weight, self.bias_grad.as_mut()]
    }

    /// Hands in the caller's f32 `main_grad` `[out, in]` that wgrad accumulates into with
    /// `fuse_wgrad_accumulation` (Megatron's `weight.main_grad`).
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] unless it is `[out, in]` f32.
    pub fn set_main_grad(&mut self, main_grad: Tensor) -> Result<()> {
        ops::check_shape(self.module, "main_grad", &main_grad, &[self.out_features, self.in_features])?;
        ops::check_dtype(self.module, "main_grad", &main_grad, |d| d == DType::F32, "f32")?;
        self.main_grad = Some(main_grad);
        Ok(())
    }

    /// The `main_grad` handed in with [`LinearParams::set_main_grad`].
    pub fn main_grad(&self) -> Option<&Tensor> {
        self.main_grad.as_ref()
    }

    /// Takes the `main_grad` back.
    pub fn take_main_grad(&mut self) -> Option<Tensor> {
        self.main_grad.take()
    }

    /// Device bytes of the parameters as stored: the weight (FP8 codes and their transpose when
    /// one was built, or high precision), the cached FP8 weight, and the bias.
    pub fn parameter_bytes(&self) -> usize {
        let w = match &self.weight {
            Weight::High(t) => t.num_bytes(),
            Weight::Fp8(f) | Weight::Gathered(f) => f.num_bytes(),
        };
        let cache = self.cache.as_ref().map_or(0, |(f, _)| f.num_bytes());
        w + cache + self.bias.as_ref().map_or(0, Tensor::num_bytes)
    }

    /// Fails before a backward that would need a `main_grad` nobody handed in.
    pub(crate) fn check_main_grad(&self) -> Result<()> {
        if self.fuse_wgrad_accumulation && self.main_grad.is_none() {
            return Err(Error::Config {
                module: self.module,
                message: "fuse_wgrad_accumulation is set but no main_grad was handed in; call set_main_grad with an \
                          f32 [out_features, in_features] tensor first"
                    .into(),
            });
        }
        Ok(())
    }

    /// The high-precision weight in `dtype`, dequantizing an FP8-only weight.
    pub(crate) fn weight_high(&self, dtype: DType) -> Result<Tensor> {
        let w = match &self.weight {
            Weight::High(w) => w.clone(),
            Weight::Fp8(f) => f.dequantize(&self.dev, self.params_dtype)?,
            Weight::Gathered(_) => return Err(gathered_in_high_precision(self.module)),
        };
        convert(&self.dev, w, dtype)
    }

    /// The bias in `dtype`.
    pub(crate) fn bias_as(&self, dtype: DType) -> Result<Option<Tensor>> {
        self.bias.clone().map(|b| convert(&self.dev, b, dtype)).transpose()
    }

    /// The FP8 weight for this call: the FP8-only weight, the micro-batch cache, or a fresh cast
    /// by `q`, with its transpose when backward will need it (`grad`).
    pub(crate) fn fp8_weight_for(
        &mut self,
        q: &dyn Quantizer,
        is_first_microbatch: Option<bool>,
        grad: bool,
    ) -> Result<Float8Tensor> {
        let dev = self.dev.clone();
        let w = match &mut self.weight {
            Weight::Fp8(f) if f.block_scale() != q.block_scale() => {
                return Err(Error::Config {
                    module: self.module,
                    message: format!(
                        "the weight is stored as FP8 codes with {} but the recipe casts with {}: run this model \
                         under the recipe its FP8 weights were made with, or load its high-precision weights",
                        scaling_name(f.block_scale()),
                        scaling_name(q.block_scale())
                    ),
                })
            }
            Weight::Fp8(f) => {
                if grad {
                    f.ensure_transpose(&dev)?;
                }
                return Ok(f.clone());
            }
            Weight::Gathered(f) if f.dtype() != q.dtype() || q.block_scale().is_some() => {
                return Err(Error::Config {
                    module: self.module,
                    message: format!(
                        "the weight was gathered as one-scale {} codes (ZeRO-3's FP8 all-gather) but this GEMM casts \
                         its weight to {} with {}: gather in high precision for this recipe",
                        f.dtype(),
                        q.dtype(),
                        scaling_name(q.block_scale())
                    ),
                })
            }
            Weight::Gathered(f) => {
                if grad {
                    f.ensure_transpose(&dev)?;
                }
                return Ok(f.clone());
            }
            Weight::High(w) => w.clone(),
        };
        if is_first_microbatch == Some(false) {
            if let Some((cached, version)) = &mut self.cache {
                // A blockwise weight's transpose comes from the high-precision values: one
                // cached without it is cast again when backward needs it.
                let usable = !grad || cached.transpose().is_some() || cached.block_scale().is_none();
                if *version == self.version && cached.block_scale() == q.block_scale() && usable {
                    if grad {
                        cached.ensure_transpose(&dev)?;
                    }
                    return Ok(cached.clone());
                }
            }
        }
        let w8 = q.quantize(&w, grad, None)?;
        self.cache = is_first_microbatch.is_some().then(|| (w8.clone(), self.version));
        Ok(w8)
    }

    /// Records the weight's amax with `q` (calibration).
    pub(crate) fn calibrate_weight(&self, q: &dyn Quantizer) -> Result<()> {
        match &self.weight {
            Weight::High(w) => q.calibrate(w),
            Weight::Fp8(_) => Ok(()),
            Weight::Gathered(_) => Err(gathered_in_high_precision(self.module)),
        }
    }

    /// wgrad `dW (+)= A · Bᵀ` into `main_grad` (f32, always accumulating) or the weight gradient
    /// (`params_dtype`, accumulating when one exists); with `bgrad`, the GEMM's BGRADB epilogue
    /// writes the bias gradient too (`a` then must be `dY` stored transposed).
    pub(crate) fn accumulate_wgrad(
        &mut self,
        a: Operand<'_>,
        b: Operand<'_>,
        bgrad: Option<&mut Tensor>,
    ) -> Result<()> {
        let dev = self.dev.clone();
        let epilogue = bgrad.map_or(Epilogue::None, |bgrad| Epilogue::BgradB { bgrad });
        let (target, accumulate) = self.wgrad_target(false)?;
        let cfg = GemmConfig { accumulate, epilogue, ..Default::default() };
        gemm(&dev, a, b, GemmOut::new(target), &cfg)
    }

    /// Where wgrad goes and whether it accumulates there: the `main_grad` (f32, accumulating),
    /// the weight gradient accumulated so far, or a new `[out, in]` `params_dtype` gradient
    /// (zeros to accumulate into with `zeroed`, else uninitialized for wgrad to overwrite).
    pub(crate) fn wgrad_target(&mut self, zeroed: bool) -> Result<(&mut Tensor, bool)> {
        self.check_main_grad()?;
        let shape = [self.out_features, self.in_features];
        Ok(match (self.fuse_wgrad_accumulation, &mut self.main_grad, &mut self.weight_grad) {
            (true, Some(m), _) => (m, true),
            (true, None, _) => return Err(Error::internal(self.module, "no main_grad after check_main_grad")),
            (false, _, Some(g)) => (g, true),
            (false, _, g @ None) if zeroed => (g.insert(Tensor::zeros(&self.dev, self.params_dtype, &shape)?), true),
            (false, _, g @ None) => (g.insert(Tensor::empty(&self.dev, self.params_dtype, &shape)?), false),
        })
    }

    /// Where the bias gradient goes and whether it accumulates there, as
    /// [`LinearParams::wgrad_target`] for the bias (`None` without a bias).
    pub(crate) fn bias_grad_target(&mut self, zeroed: bool) -> Result<Option<(&mut Tensor, bool)>> {
        if self.bias.is_none() {
            return Ok(None);
        }
        let shape = [self.out_features];
        Ok(Some(match &mut self.bias_grad {
            Some(g) => (g, true),
            g @ None if zeroed => (g.insert(Tensor::zeros(&self.dev, self.params_dtype, &shape)?), true),
            g @ None => (g.insert(Tensor::empty(&self.dev, self.params_dtype, &shape)?), false),
        }))
    }

    /// Whether the bias gradient accumulates into one that exists.
    pub(crate) fn bias_grad_accumulates(&self) -> bool {
        self.bias_grad.is_some()
    }

    /// Whether wgrad accumulates into something that exists (a `main_grad`, or a weight
    /// gradient since the last [`LinearParams::zero_grad`]).
    pub(crate) fn wgrad_accumulates(&self) -> bool {
        self.fuse_wgrad_accumulation || self.weight_grad.is_some()
    }

    /// A zero gradient where none has accumulated yet: the weight's (unless wgrad goes to the
    /// `main_grad`) and the bias's. For a GEMM that received no rows in a backward (an expert
    /// no token was routed to): its gradient is zero, as PyTorch's would be, and every
    /// parameter has one after a backward, which a data-parallel reduction relies on (ranks must
    /// reduce the same tensors).
    pub(crate) fn ensure_grads(&mut self) -> Result<()> {
        if !self.fuse_wgrad_accumulation && self.weight_grad.is_none() {
            let shape = [self.out_features, self.in_features];
            self.weight_grad = Some(Tensor::zeros(&self.dev, self.params_dtype, &shape)?);
        }
        if self.bias.is_some() && self.bias_grad.is_none() {
            self.bias_grad = Some(Tensor::zeros(&self.dev, self.params_dtype, &[self.out_features])?);
        }
        Ok(())
    }

    /// `bias_grad += dbias` (or `= dbias` for the first backward).
    pub(crate) fn accumulate_bias_grad(&mut self, dbias: Tensor) -> Result<()> {
        let dbias = convert(&self.dev, dbias, self.params_dtype)?;
        accumulate(&self.dev, &mut self.bias_grad, dbias)
    }
}

/// `*acc += g`, or `*acc = g` when empty.
pub(crate) fn accumulate(dev: &Device, acc: &mut Option<Tensor>, g: Tensor) -> Result<()> {
    match acc {
        Some(a) => ops::elementwise::add_assign(dev, a, &g),
        None => {
            *acc = Some(g);
            Ok(())
        }
    }
}

/// `x` in another high-precision dtype (unchanged when it already is).
pub(crate) fn convert(dev: &Device, x: Tensor, dtype: DType) -> Result<Tensor> {
    if x.dtype() == dtype {
        return Ok(x);
    }
    let mut y = Tensor::zeros(dev, dtype, x.shape())?;
    ops::elementwise::add_assign(dev, &mut y, &x)?;
    Ok(y)
}

/// The error of a high-precision read of a weight gathered as FP8 codes.
fn gathered_in_high_precision(module: &'static str) -> Error {
    Error::Config {
        module,
        message: "the weight was gathered as FP8 codes for an FP8 step (ZeRO-3's FP8 all-gather): its high-precision \
                  values are not here; run this layer under the FP8 recipe of the step, or gather in high precision \
                  (DecoderLm::set_zero3_fp8_gather(false))"
            .into(),
    }
}

/// How an FP8 tensor of this block layout is scaled, for messages.
fn scaling_name(block: Option<BlockScale>) -> &'static str {
    match block {
        None => "one scale per tensor",
        Some(BlockScale::Vec128) => "1x128 block scales",
        Some(BlockScale::Blk128x128) => "128x128 block scales",
    }
}
