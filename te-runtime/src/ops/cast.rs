//! Family 1 launchers: quantize (with amax and scale_inv), dequantize, amax.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, check_shape, grid_stride_blocks, launch_1d, Fp8Scaling};
use crate::{Device, Result, Tensor};
use te_codegen::spec::CastSpec;
use te_codegen::{DType, KernelSpec};

/// `out = fp8(x * scale)`, `amax = max(amax, max|x|)`, `scale_inv = 1/scale`.
///
/// `x`: any shape, f32/bf16/f16; `out`: same shape, E4M3 or E5M2.
///
/// # Errors
/// Dtype or shape mismatches, empty tensors, compile/launch failures.
pub fn quantize(dev: &Device, x: &Tensor, out: &mut Tensor, s: &mut Fp8Scaling<'_>) -> Result<()> {
    const OP: &str = "quantize";
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    check_dtype(OP, "out", out, DType::is_fp8, "e4m3 or e5m2")?;
    check_shape(OP, "out", out, x.shape())?;
    check_nonempty(OP, "x", x)?;
    let spec = CastSpec::quantize(x.dtype(), out.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Cast(spec), 0)?;
    let n = x.numel() as u64;
    let cfg = launch_1d(grid_stride_blocks(dev, x.numel() / spec.vec, spec.threads), spec.threads, 0);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("x", x.data()).ptr("q", out.data_mut()?).ptr("scale_ptr", &s.scale);
    l.ptr("amax_ptr", &mut s.amax).ptr("scale_inv_ptr", &mut s.scale_inv).scalar("n", &n);
    // SAFETY: `x` and `out` hold `n` elements of the spec's dtypes, the scaling views one f32
    // each; `out` is a distinct allocation (`&mut`).
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// `y = q * scale_inv` with `q` E4M3/E5M2 and `y` f32/bf16/f16 of the same shape.
///
/// # Errors
/// Dtype or shape mismatches, empty tensors, compile/launch failures.
pub fn dequantize(
    dev: &Device,
    q: &Tensor,
    scale_inv: &cudarc::driver::CudaView<'_, f32>,
    y: &mut Tensor,
) -> Result<()> {
    const OP: &str = "dequantize";
    check_dtype(OP, "q", q, DType::is_fp8, "e4m3 or e5m2")?;
    check_dtype(OP, "y", y, DType::is_high_precision, "f32, bf16 or f16")?;
    check_shape(OP, "y", y, q.shape())?;
    check_nonempty(OP, "q", q)?;
    let spec = CastSpec::dequantize(q.dtype(), y.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Cast(spec), 0)?;
    let n = q.numel() as u64;
    let cfg = launch_1d(grid_stride_blocks(dev, q.numel() / spec.vec, spec.threads), spec.threads, 0);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("q", q.data()).ptr("y", y.data_mut()?).ptr("scale_inv_ptr", scale_inv).scalar("n", &n);
    // SAFETY: `q` and `y` hold `n` elements of the spec's dtypes, `scale_inv` one f32.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// `amax = max(amax, max|x|)` (NaN skipped) for `x` f32/bf16/f16 of any shape.
///
/// # Errors
/// Dtype mismatches, empty tensors, compile/launch failures.
pub fn amax(dev: &Device, x: &Tensor, amax: &mut cudarc::driver::CudaViewMut<'_, f32>) -> Result<()> {
    const OP: &str = "amax";
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    check_nonempty(OP, "x", x)?;
    let spec = CastSpec::amax(x.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Cast(spec), 0)?;
    let n = x.numel() as u64;
    let cfg = launch_1d(grid_stride_blocks(dev, x.numel() / spec.vec, spec.threads), spec.threads, 0);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("x", x.data()).ptr("amax_ptr", amax).scalar("n", &n);
    // SAFETY: `x` holds `n` elements of the spec's dtype, `amax` one f32.
    unsafe { l.launch(cfg) }?;
    Ok(())
}
