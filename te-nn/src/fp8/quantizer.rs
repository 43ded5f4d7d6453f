//! Quantizers: how one tensor is cast to FP8 under a recipe (TE `pytorch/tensor/quantized_tensor.py`
//! `Quantizer`; `float8_tensor.py` `Float8Quantizer`).
//!
//! There is one quantizer type per way of choosing the scale, and modules ask a quantizer instead
//! of matching recipes. A module builds its quantizers once per pass from the autocast scope's
//! recipe and its own scaling state (`GemmScaling`, `fp8/gemm_scaling.rs`, asking the recipe's
//! [`super::ScalingRecipe`]); the quantizer then owns everything recipe-specific about a cast:
//! - the cast itself: plain ([`Quantizer::quantize`]), fused with the transpose and the bias
//!   gradient, or fused into the kernel that produces the tensor (a norm, an activation, a GEMM
//!   epilogue: [`Quantizer::fused_cast`]);
//! - the FP8 tensor's `scale_inv`;
//! - amax recording (delayed scaling, calibration).
//!
//! This file holds the trait, the casts the quantizers share and [`Float8Quantizer`] (a given
//! scale, no recipe); each recipe's quantizer lives with its recipe (`fp8/recipe/*.rs`:
//! [`super::DelayedScalingQuantizer`], [`super::Float8CurrentScalingQuantizer`],
//! [`super::Float8BlockQuantizer`]).

use super::Float8Tensor;
use cudarc::driver::CudaSlice;
use std::fmt;
use std::sync::{Arc, Mutex};
use te_codegen::DType;
use te_runtime::gemm::BlockScale;
use te_runtime::graph::HostCopies;
use te_runtime::ops::cast_transpose::DbiasOut;
use te_runtime::ops::{self, Fp8Scaling};
use te_runtime::{Device, Error, Result, Tensor};

/// A kernel that writes its FP8 output itself, given the scaling views to cast with (the scale
/// it multiplies by, the amax it maxes `|x|` into, the `scale_inv` it may write).
pub type FusedCastKernel<'k> = dyn FnMut(&mut Fp8Scaling<'_>) -> Result<()> + 'k;

/// How one tensor is cast to FP8 (TE `Quantizer`).
///
/// Implementations: [`super::DelayedScalingQuantizer`] (a slot of a module's amax history),
/// [`super::Float8CurrentScalingQuantizer`] (the tensor's own amax), [`Float8Quantizer`] (a
/// given scale), [`super::Float8BlockQuantizer`] (each block's own amax).
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
    /// (every quantizer but [`super::Float8BlockQuantizer`]).
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
pub(crate) fn cast(
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
pub(crate) fn copy_of(dev: &Device, src: &cudarc::driver::CudaView<'_, f32>) -> Result<CudaSlice<f32>> {
    let s = dev.stream();
    // SAFETY: f32 has no invalid bit patterns; the copy below fills the one element.
    let mut out = unsafe { s.alloc::<f32>(1) }?;
    s.memcpy_dtod(src, &mut out)?;
    Ok(out)
}

/// The error of `fused_cast` on a quantizer that cannot fuse its cast.
pub(crate) fn not_fusable(op: &'static str) -> Error {
    Error::internal(op, "fused_cast on a quantizer that cannot fuse its cast (check Quantizer::fuses_cast first)")
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
    pub(crate) fn from_device(
        dev: &Arc<Device>,
        dtype: DType,
        scale: CudaSlice<f32>,
        scale_inv: CudaSlice<f32>,
    ) -> Result<Self> {
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

/// `Ok` for an FP8 `dtype`; else the typed error of `op`.
pub(crate) fn check_fp8(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_fp8() {
        Ok(())
    } else {
        Err(Error::Argument { op, message: format!("the FP8 format must be e4m3 or e5m2, got {dtype}") })
    }
}
