//! Quantizers: how one tensor is cast to FP8 under a recipe (TE `pytorch/tensor/quantized_tensor.py`
//! `Quantizer`; `float8_tensor.py` `Float8Quantizer`, `Float8CurrentScalingQuantizer`).
//!
//! There is one quantizer type per way of choosing the scale, and modules ask a quantizer instead
//! of matching recipes. A module builds its quantizers once per pass from the autocast scope's
//! recipe and its own scaling state (`GemmScaling`, `fp8/gemm_scaling.rs`); the quantizer then
//! owns everything recipe-specific about a cast:
//! - the cast itself: plain ([`Quantizer::quantize`]), fused with the transpose and the bias
//!   gradient, or fused into the kernel that produces the tensor (a norm, an activation, a GEMM
//!   epilogue: [`Quantizer::fused_cast`]);
//! - the FP8 tensor's `scale_inv`;
//! - amax recording (delayed scaling, calibration).
//!
//! A new recipe adds a quantizer here and its line in `GemmScaling`; no module changes.

use super::{Float8BlockScaling, Float8CurrentScaling, Float8Tensor, ScalingState};
use cudarc::driver::CudaSlice;
use std::fmt;
use std::sync::{Arc, Mutex};
use te_codegen::DType;
use te_runtime::gemm::BlockScale;
use te_runtime::graph::HostCopies;
use te_runtime::ops::block_quantize::{self, BlockFp8, BlockQuantizeParams};
use te_runtime::ops::cast_transpose::DbiasOut;
use te_runtime::ops::{self, Fp8Meta, Fp8Scaling};
use te_runtime::{Device, Error, Result, Tensor};

/// A kernel that writes its FP8 output itself, given the scaling views to cast with (the scale
/// it multiplies by, the amax it maxes `|x|` into, the `scale_inv` it may write).
pub type FusedCastKernel<'k> = dyn FnMut(&mut Fp8Scaling<'_>) -> Result<()> + 'k;

/// How one tensor is cast to FP8 (TE `Quantizer`).
///
/// Implementations: [`DelayedScalingQuantizer`] (a slot of a module's amax history),
/// [`Float8CurrentScalingQuantizer`] (the tensor's own amax), [`Float8Quantizer`] (a given scale),
/// [`Float8BlockQuantizer`] (each block's own amax).
pub trait Quantizer: fmt::Debug + Send + Sync {
    /// The FP8 format of the codes (E4M3 or E5M2).
    fn dtype(&self) -> DType;

    /// Whether the scale is known before the data, so that the kernel producing a tensor (a norm,
    /// an activation, a GEMM epilogue) can cast its own output ([`Quantizer::fused_cast`]).
    /// False for current scaling, whose scale needs the finished tensor's amax: the producer then
    /// writes high precision and [`Quantizer::quantize`] casts it.
    fn fuses_cast(&self) -> bool;

    /// `x` (f32/bf16/f16, `[..., cols]`) cast to FP8, recording its amax where the recipe keeps
    /// one. With `columnwise` the transposed codes `[cols, rows]` are made in the same pass (what
    /// Hopper's TN-only FP8 GEMMs need for wgrad/dgrad; `cols` a multiple of 16); with `dbias` the
    /// column sums of `x` too (then `columnwise` is implied).
    ///
    /// # Errors
    /// Dtype and shape errors of [`ops::cast::quantize`] / [`ops::cast_transpose::cast_transpose`];
    /// allocation and launch failures.
    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor>;

    /// Runs `kernel`, which writes FP8 in [`Quantizer::dtype`] with the scaling views it gets,
    /// and returns the output's `scale_inv` (`[1]` f32: written by the kernel, or already holding
    /// `1 / scale` for a kernel that does not write it, such as a GEMM epilogue).
    ///
    /// # Errors
    /// [`Error::Internal`] when [`Quantizer::fuses_cast`] is false; the kernel's errors;
    /// allocation failures.
    fn fused_cast(&self, kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>>;

    /// Runs `kernel`, which casts the values of `inputs` themselves (rearranged, in one launch
    /// or several) to FP8 in [`Quantizer::dtype`] with the scaling views it gets, and returns
    /// their one `scale_inv` (`[1]` f32). Works for every recipe: current scaling first takes
    /// the amax of all `inputs` and the scale from it (one scale for them all, as TE's
    /// `combine_and_quantize` casts q, k and v); the others cast as [`Quantizer::fused_cast`].
    ///
    /// # Errors
    /// The kernel's errors; amax and allocation failures.
    fn cast_inputs(&self, inputs: &[&Tensor], kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        let _ = inputs;
        self.fused_cast(kernel)
    }

    /// Records the amax of `x` without casting it (TE calibration: high-precision GEMMs, scales
    /// for later FP8 inference). Nothing for quantizers that keep no amax.
    ///
    /// # Errors
    /// Launch failures.
    fn calibrate(&self, x: &Tensor) -> Result<()>;

    /// A quantizer that casts later exactly as this one casts now, recording nothing (what a
    /// module keeps to recompute an FP8 activation in backward after the scope's scale update
    /// may have changed its slot).
    ///
    /// # Errors
    /// Allocation failures.
    fn frozen(&self) -> Result<Box<dyn Quantizer>>;

    /// The layout of the block scales of the tensors it makes; `None` for one scale per tensor
    /// (every quantizer but [`Float8BlockQuantizer`]).
    fn block_scale(&self) -> Option<BlockScale> {
        None
    }

    /// [`Quantizer::quantize`] for a quantizer whose scale comes from the tensor's own amax
    /// (current scaling), with `reduce_amax` run on that amax (`[1]` f32, on the device's stream)
    /// before the scale is taken from it: a tensor-parallel group all-reduces it (max), so every
    /// rank casts its part with the scale of the whole (TE's amax reduction before the FP8
    /// all-gather of current scaling). `None` for the others, whose scale does not come from
    /// the tensor being cast.
    ///
    /// # Errors
    /// As [`Quantizer::quantize`]; `reduce_amax`'s.
    fn quantize_with_amax(
        &self,
        x: &Tensor,
        columnwise: bool,
        reduce_amax: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<Option<Float8Tensor>> {
        let _ = (x, columnwise, reduce_amax);
        Ok(None)
    }
}

/// Runs a kernel that produces a `shape` tensor and returns it in FP8 through `q`: the kernel
/// casts its own output when `q` allows it ([`Quantizer::fuses_cast`]: it gets `Some` scaling
/// views and an FP8 tensor), else it writes `high` (f32/bf16/f16, gets `None`) and `q` casts
/// the result. With `columnwise` the transposed codes are made too (the byte transpose of the
/// fused output, or in the same pass as the cast).
///
/// # Errors
/// The kernel's errors; those of [`Quantizer::quantize`]; allocation failures.
pub(crate) fn produce_fp8(
    q: &dyn Quantizer,
    dev: &Device,
    shape: &[usize],
    high: DType,
    columnwise: bool,
    kernel: &mut dyn FnMut(&mut Tensor, Option<&mut Fp8Scaling<'_>>) -> Result<()>,
) -> Result<Float8Tensor> {
    if !q.fuses_cast() {
        let mut y = Tensor::empty(dev, high, shape)?;
        kernel(&mut y, None)?;
        return q.quantize(&y, columnwise, None);
    }
    let mut y = Tensor::empty(dev, q.dtype(), shape)?;
    let scale_inv = q.fused_cast(&mut |s| kernel(&mut y, Some(s)))?;
    let mut f = Float8Tensor::from_parts(y, None, scale_inv)?;
    if columnwise {
        f.ensure_transpose(dev)?;
    }
    Ok(f)
}

/// The cast itself: cast_transpose (with dbias) when a transpose or a dbias is asked for, else a
/// plain quantize. `scaling.scale_inv` is written.
fn cast(
    dev: &Device,
    x: &Tensor,
    dtype: DType,
    scaling: &mut Fp8Scaling<'_>,
    columnwise: bool,
    dbias: Option<DbiasOut<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut data = Tensor::empty(dev, dtype, x.shape())?;
    if columnwise || dbias.is_some() {
        let (rows, cols) = x.as_2d("fp8 cast")?;
        let mut t = Tensor::empty(dev, dtype, &[cols, rows])?;
        ops::cast_transpose::cast_transpose(dev, x, &mut data, &mut t, scaling, dbias)?;
        Ok((data, Some(t)))
    } else {
        ops::cast::quantize(dev, x, &mut data, scaling)?;
        Ok((data, None))
    }
}

/// A fresh `[1]` f32 holding `src[0]`: the `scale_inv` of an output whose producer may not write
/// it (4 bytes, stream-ordered).
fn copy_of(dev: &Device, src: &cudarc::driver::CudaView<'_, f32>) -> Result<CudaSlice<f32>> {
    let s = dev.stream();
    // SAFETY: f32 has no invalid bit patterns; the copy below fills the one element.
    let mut out = unsafe { s.alloc::<f32>(1) }?;
    s.memcpy_dtod(src, &mut out)?;
    Ok(out)
}

fn not_fusable(op: &'static str) -> Error {
    Error::internal(op, "fused_cast on a quantizer that cannot fuse its cast (check Quantizer::fuses_cast first)")
}

/// Delayed scaling (TE `Float8Quantizer` over `fp8_meta`): one slot of a module's
/// [`ScalingState`]. Casts with the slot's scale (from the amax history of earlier steps) and
/// maxes each tensor's `|x|` into the slot's newest amax; the autocast scope updates the scale.
#[derive(Debug, Clone)]
pub struct DelayedScalingQuantizer {
    state: Arc<ScalingState>,
    slot: usize,
}

impl DelayedScalingQuantizer {
    /// Slot `slot` of `state`.
    ///
    /// # Errors
    /// [`Error::Internal`] for a slot the state does not have.
    pub(crate) fn new(state: Arc<ScalingState>, slot: usize) -> Result<Self> {
        if slot >= state.slots() {
            return Err(Error::internal(
                "DelayedScalingQuantizer",
                format!("slot {slot} of a state with {} slots", state.slots()),
            ));
        }
        Ok(Self { state, slot })
    }
}

impl Quantizer for DelayedScalingQuantizer {
    fn dtype(&self) -> DType {
        self.state.dtype()
    }

    fn fuses_cast(&self) -> bool {
        true
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        let dev = self.state.device();
        let mut b = self.state.lock();
        let dtype = b.dtype;
        let mut scale_inv = dev.stream().alloc_zeros::<f32>(1)?;
        let mut scaling = b.scaling(self.slot, &mut scale_inv);
        let (data, transpose) = cast(dev, x, dtype, &mut scaling, columnwise, dbias)?;
        Float8Tensor::from_parts(data, transpose, Arc::new(scale_inv))
    }

    fn fused_cast(&self, kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        let dev = self.state.device();
        let mut b = self.state.lock();
        let mut scale_inv = copy_of(dev, &b.scale_inv.slice(self.slot..self.slot + 1))?;
        kernel(&mut b.scaling(self.slot, &mut scale_inv))?;
        Ok(Arc::new(scale_inv))
    }

    fn calibrate(&self, x: &Tensor) -> Result<()> {
        let mut b = self.state.lock();
        let h = self.slot * b.history_len;
        ops::cast::amax(self.state.device(), x, &mut b.amax_history.slice_mut(h..h + 1))
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        let dev = self.state.device();
        let b = self.state.lock();
        let (i, j) = (self.slot, self.slot + 1);
        let (scale, scale_inv) = (copy_of(dev, &b.scale.slice(i..j))?, copy_of(dev, &b.scale_inv.slice(i..j))?);
        Ok(Box::new(Float8Quantizer::from_device(dev, b.dtype, scale, scale_inv)?))
    }
}

/// Current scaling (TE `Float8CurrentScalingQuantizer`): each tensor's own amax, then its scale
/// `fp8_max / max(amax, amax_epsilon)`, then the cast: three launches, no state.
#[derive(Debug, Clone)]
pub struct Float8CurrentScalingQuantizer {
    dev: Arc<Device>,
    dtype: DType,
    recipe: Float8CurrentScaling,
}

impl Float8CurrentScalingQuantizer {
    /// Casts to `dtype` (E4M3 or E5M2) with `recipe`'s epsilon and power-of-2 rule.
    ///
    /// # Errors
    /// [`Error::Argument`] for a `dtype` that is not FP8.
    pub fn new(dev: &Arc<Device>, dtype: DType, recipe: Float8CurrentScaling) -> Result<Self> {
        check_fp8("Float8CurrentScalingQuantizer::new", dtype)?;
        Ok(Self { dev: dev.clone(), dtype, recipe })
    }

    /// The amax of all of `xs` and the scale (and `scale_inv`) it gives.
    fn scaled(&self, xs: &[&Tensor]) -> Result<Fp8Meta> {
        self.scaled_reduced(xs, &mut |_| Ok(()))
    }

    /// [`Float8CurrentScalingQuantizer::scaled`] with `reduce_amax` run on the amax first.
    fn scaled_reduced(
        &self,
        xs: &[&Tensor],
        reduce_amax: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<Fp8Meta> {
        let dev = &self.dev;
        let mut meta = Fp8Meta::new(dev, 1.0)?;
        for x in xs {
            ops::cast::amax(dev, x, &mut meta.amax.as_view_mut())?;
        }
        reduce_amax(&mut meta.amax)?;
        let fp8_max = self.dtype.fp8_max().unwrap_or(1.0);
        let r = &self.recipe;
        ops::scaling::current_scaling(
            dev,
            &meta.amax,
            &mut meta.scale,
            &mut meta.scale_inv,
            fp8_max,
            r.amax_epsilon,
            r.power_2_scale,
        )?;
        Ok(meta)
    }
}

impl Quantizer for Float8CurrentScalingQuantizer {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn fuses_cast(&self) -> bool {
        false
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        let mut meta = self.scaled(&[x])?;
        let (data, transpose) = cast(&self.dev, x, self.dtype, &mut meta.scaling(), columnwise, dbias)?;
        Float8Tensor::from_parts(data, transpose, Arc::new(meta.scale_inv))
    }

    fn fused_cast(&self, _: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        Err(not_fusable("Float8CurrentScalingQuantizer::fused_cast"))
    }

    fn cast_inputs(&self, inputs: &[&Tensor], kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        let mut meta = self.scaled(inputs)?;
        kernel(&mut meta.scaling())?;
        Ok(Arc::new(meta.scale_inv))
    }

    fn calibrate(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        // Deterministic: the same tensor gives the same amax, so the same scale and codes.
        Ok(Box::new(self.clone()))
    }

    fn quantize_with_amax(
        &self,
        x: &Tensor,
        columnwise: bool,
        reduce_amax: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<Option<Float8Tensor>> {
        let mut meta = self.scaled_reduced(&[x], reduce_amax)?;
        let (data, transpose) = cast(&self.dev, x, self.dtype, &mut meta.scaling(), columnwise, None)?;
        Ok(Some(Float8Tensor::from_parts(data, transpose, Arc::new(meta.scale_inv))?))
    }
}

/// A given scale (TE `Float8Quantizer` with its own `scale` tensor): `q = fp8(x * scale)`. The
/// amax of what it casts goes to a scratch value nobody reads.
#[derive(Debug)]
pub struct Float8Quantizer {
    dev: Arc<Device>,
    dtype: DType,
    scale: CudaSlice<f32>,
    scale_inv: CudaSlice<f32>,
    amax: Mutex<CudaSlice<f32>>,
}

impl Float8Quantizer {
    /// Casts to `dtype` (E4M3 or E5M2) with `scale`.
    ///
    /// # Errors
    /// [`Error::Argument`] for a non-FP8 `dtype` or a scale that is not finite and positive;
    /// allocation failures.
    pub fn new(dev: &Arc<Device>, dtype: DType, scale: f32) -> Result<Self> {
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::Argument {
                op: "Float8Quantizer::new",
                message: format!("scale must be finite and > 0, got {scale}"),
            });
        }
        let s = dev.stream();
        Self::from_device(dev, dtype, s.htod(&[scale])?, s.htod(&[1.0 / scale])?)
    }

    /// From device buffers `[1]` f32 holding the scale and its inverse.
    fn from_device(dev: &Arc<Device>, dtype: DType, scale: CudaSlice<f32>, scale_inv: CudaSlice<f32>) -> Result<Self> {
        check_fp8("Float8Quantizer", dtype)?;
        let amax = Mutex::new(dev.stream().alloc_zeros::<f32>(1)?);
        Ok(Self { dev: dev.clone(), dtype, scale, scale_inv, amax })
    }

    /// Runs `f` with this quantizer's scaling views and a fresh `scale_inv` holding `1 / scale`.
    fn with_scaling(&self, f: impl FnOnce(&mut Fp8Scaling<'_>) -> Result<()>) -> Result<Arc<CudaSlice<f32>>> {
        let mut scale_inv = copy_of(&self.dev, &self.scale_inv.as_view())?;
        let mut amax = self.amax.lock().unwrap_or_else(|p| p.into_inner());
        let mut s =
            Fp8Scaling { scale: self.scale.as_view(), amax: amax.as_view_mut(), scale_inv: scale_inv.as_view_mut() };
        f(&mut s)?;
        Ok(Arc::new(scale_inv))
    }
}

impl Quantizer for Float8Quantizer {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn fuses_cast(&self) -> bool {
        true
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        let mut out = None;
        let scale_inv = self.with_scaling(|s| {
            out = Some(cast(&self.dev, x, self.dtype, s, columnwise, dbias)?);
            Ok(())
        })?;
        let (data, transpose) = out.ok_or_else(|| Error::internal("Float8Quantizer::quantize", "no cast output"))?;
        Float8Tensor::from_parts(data, transpose, scale_inv)
    }

    fn fused_cast(&self, kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        self.with_scaling(|s| kernel(s))
    }

    fn calibrate(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        let s = self.dev.stream();
        Ok(Box::new(Self::from_device(
            &self.dev,
            self.dtype,
            s.clone_dtod(&self.scale)?,
            s.clone_dtod(&self.scale_inv)?,
        )?))
    }
}

/// Blockwise scaling (TE `Float8BlockQuantizer`, [`Float8BlockScaling`]): each 1×128 tile
/// (activations, gradients) or 128×128 block (weights) cast with the scale of its own amax, in
/// one pass ([`block_quantize::quantize`]); with `columnwise` the transpose is quantized in the
/// same pass from the high-precision values in 128×1 tiles (or the same 128×128 blocks). No
/// state; the cast cannot be fused into a producer, whose output is cast after it.
#[derive(Debug, Clone)]
pub struct Float8BlockQuantizer {
    dev: Arc<Device>,
    params: BlockQuantizeParams,
}

impl Float8BlockQuantizer {
    /// Casts to `dtype` in blocks of `block_dim` (1: 1×128, 2: 128×128) with `recipe`'s epsilon
    /// and power-of-2 rule.
    ///
    /// # Errors
    /// [`Error::Recipe`] on a GPU other than Hopper (cuBLASLt's block-scaled GEMMs are sm_90
    /// only); [`Error::DType`] / [`Error::Config`] for a `dtype` that is not FP8 or a
    /// `block_dim` other than 1 or 2 ([`BlockQuantizeParams::validate`]).
    pub fn new(dev: &Arc<Device>, dtype: DType, block_dim: usize, recipe: &Float8BlockScaling) -> Result<Self> {
        if dev.arch() != te_codegen::Arch::Sm90a {
            return Err(Error::Recipe {
                message: format!(
                    "Float8BlockScaling needs a Hopper GPU (sm_90): cuBLASLt has no block-scaled FP8 GEMMs on {}; \
                     use DelayedScaling or Float8CurrentScaling here",
                    dev.arch()
                ),
            });
        }
        let params =
            BlockQuantizeParams { dtype, block_dim, epsilon: recipe.amax_epsilon, power_2: recipe.power_2_scale };
        params.validate()?;
        Ok(Self { dev: dev.clone(), params })
    }
}

impl Quantizer for Float8BlockQuantizer {
    fn dtype(&self) -> DType {
        self.params.dtype
    }

    fn fuses_cast(&self) -> bool {
        false
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        const OP: &str = "Float8BlockQuantizer::quantize";
        ops::check_dtype(
            OP,
            "x",
            x,
            |d| matches!(d, DType::BF16 | DType::F16),
            "bf16 or f16 (Float8BlockScaling \
             casts 16-bit activations and gradients: run the module with params_dtype bf16)",
        )?;
        let (rows, cols) = x.as_2d(OP)?;
        let columnwise = columnwise || dbias.is_some();
        let mut q = BlockFp8::new(&self.dev, [rows, cols], &self.params, true, columnwise)?;
        match dbias {
            // 1×128 tiles: the column sums come from the column-wise pass of the same read (the
            // workspace a module sizes for cast_transpose, 64-row tiles, holds the 128-row one).
            Some(d) if self.params.block_dim == 1 => {
                block_quantize::quantize_dbias(&self.dev, x, &self.params, &mut q, d)?
            }
            // 128×128 blocks (`grad_block_scaling_dim` 2) have no per-column pass: a ones GEMM.
            Some(d) => {
                block_quantize::quantize(&self.dev, x, &self.params, &mut q)?;
                ops::cast_transpose::dbias(&self.dev, x, d.dbias)?;
            }
            None => block_quantize::quantize(&self.dev, x, &self.params, &mut q)?,
        }
        Float8Tensor::from_block(q, x.shape())
    }

    fn fused_cast(&self, _: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        Err(not_fusable("Float8BlockQuantizer::fused_cast"))
    }

    fn calibrate(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        // Deterministic: the same tensor gives the same block amaxes, scales and codes.
        Ok(Box::new(self.clone()))
    }

    fn block_scale(&self) -> Option<BlockScale> {
        Some(if self.params.block_dim == 1 { BlockScale::Vec128 } else { BlockScale::Blk128x128 })
    }
}

fn check_fp8(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_fp8() {
        Ok(())
    } else {
        Err(Error::Argument { op, message: format!("the FP8 format must be e4m3 or e5m2, got {dtype}") })
    }
}
