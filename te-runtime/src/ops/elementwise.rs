//! Family 8 launchers: `out = a + b` (residual adds) and the in-place `dst += src` (gradient
//! accumulation: an f32 `main_grad += ` a bf16 wgrad, a bf16 bias grad `+=` a new one). Any mix
//! of f32, bf16 and f16; the math is one f32 add, rounded once to the output type.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, check_shape, grid_stride_blocks, launch_1d};
use crate::{Device, Result, Tensor};
use cudarc::driver::LaunchConfig;
use te_codegen::spec::ElementwiseSpec;
use te_codegen::{DType, KernelSpec};

const HIGH_PRECISION: &str = "f32, bf16 or f16 (dequantize FP8 tensors first)";

/// `out = a + b`, element by element: `out[i] = round(f32(a[i]) + f32(b[i]))`.
///
/// `a`, `b`, `out`: the same shape (any rank), each f32, bf16 or f16 independently. `a` and `b`
/// may be the same tensor; `out` is distinct from both (the borrow checker sees to it). For the
/// in-place form use [`add_assign`].
///
/// # Errors
/// [`crate::Error::DType`] for an FP8 argument, [`crate::Error::Shape`] when `b` or `out` does
/// not have the shape of `a` or the tensors are empty; compile and launch failures.
pub fn add(dev: &Device, a: &Tensor, b: &Tensor, out: &mut Tensor) -> Result<()> {
    const OP: &str = "add";
    check_dtype(OP, "a", a, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "b", b, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "out", out, DType::is_high_precision, HIGH_PRECISION)?;
    check_shape(OP, "b", b, a.shape())?;
    check_shape(OP, "out", out, a.shape())?;
    check_nonempty(OP, "a", a)?;
    let spec = ElementwiseSpec::add(a.dtype(), b.dtype(), out.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Elementwise(spec), 0)?;
    let n = a.numel() as u64;
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder.ptr("a", a.data()).ptr("b", b.data()).ptr("out", out.data_mut()?).scalar("n", &n);
    // SAFETY: the arguments follow the add signature documented on `ElementwiseSpec`: `a`, `b`
    // and `out` hold `n` elements of the spec's dtypes (checked above); `out` is a distinct
    // allocation from `a` and `b` (`&mut` vs `&`), which the kernel's `__restrict__` requires.
    unsafe { builder.launch(launch_config(dev, &spec, a.numel())) }?;
    Ok(())
}

/// `dst += src` in place, element by element: `dst[i] = round(f32(dst[i]) + f32(src[i]))`.
///
/// `dst`: f32, bf16 or f16; `src`: the shape of `dst`, f32, bf16 or f16 (e.g. an f32
/// `main_grad` += a bf16 gradient). `dst` keeps its dtype. The kernel reads and writes `dst`
/// through one pointer (its own entry point, not `add` with `out` aliasing `a`).
///
/// # Errors
/// [`crate::Error::DType`] for an FP8 argument, [`crate::Error::Shape`] when `src` does not have
/// the shape of `dst` or the tensors are empty; compile and launch failures.
pub fn add_assign(dev: &Device, dst: &mut Tensor, src: &Tensor) -> Result<()> {
    const OP: &str = "add_assign";
    check_dtype(OP, "dst", dst, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "src", src, DType::is_high_precision, HIGH_PRECISION)?;
    check_shape(OP, "src", src, dst.shape())?;
    check_nonempty(OP, "dst", dst)?;
    let spec = ElementwiseSpec::add_assign(dst.dtype(), src.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Elementwise(spec), 0)?;
    let numel = dst.numel();
    let n = numel as u64;
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder.ptr("dst", dst.data_mut()?).ptr("src", src.data()).scalar("n", &n);
    // SAFETY: the arguments follow the add_assign signature documented on `ElementwiseSpec`:
    // `dst` and `src` hold `n` elements of the spec's dtypes (checked above) and are distinct
    // allocations (`&mut` vs `&`), as the kernel's `__restrict__` requires.
    unsafe { builder.launch(launch_config(dev, &spec, numel)) }?;
    Ok(())
}

/// `dst[row + i] += src[i]` in place over the rows of `src`: [`add_assign`] into the rows
/// `row .. row + src_rows` of `dst` (both viewed as `[rows, cols]` over their first dim, the
/// trailing dims equal): the gradient of a span of a sequence-first tensor (`sbhd`) added where
/// that span sits, with no copy of it. Same math as [`add_assign`].
///
/// # Errors
/// As [`add_assign`]; [`crate::Error::Shape`] when the trailing dims differ, the rows run past
/// `dst`'s or the span does not start on a 16-byte boundary (a row of a whole number of 16-byte
/// vectors, as attention's head dims give).
pub fn add_assign_rows(dev: &Device, dst: &mut Tensor, row: usize, src: &Tensor) -> Result<()> {
    const OP: &str = "add_assign_rows";
    check_dtype(OP, "dst", dst, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "src", src, DType::is_high_precision, HIGH_PRECISION)?;
    check_nonempty(OP, "src", src)?;
    let (d, s) = (dst.shape(), src.shape());
    let per_row: usize = d.iter().skip(1).product();
    let start = row * per_row * dst.dtype().size_bytes();
    if d.len() != s.len() || d.get(1..) != s.get(1..) || row + s[0] > d[0] || start % 16 != 0 {
        return Err(crate::Error::Shape {
            op: OP,
            message: format!(
                "src {s:?} added from row {row} of dst {d:?}: the trailing dims must match, the rows fit, and the \
                 span start on a 16-byte boundary"
            ),
        });
    }
    let spec = ElementwiseSpec::add_assign(dst.dtype(), src.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Elementwise(spec), 0)?;
    let numel = src.numel();
    let n = numel as u64;
    let bytes = numel * dst.dtype().size_bytes();
    let mut span = dst.data_mut()?.slice_mut(start..start + bytes);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder.ptr("dst", &mut span).ptr("src", src.data()).scalar("n", &n);
    // SAFETY: as `add_assign`'s, for the span of `dst` (inside it and 16-byte aligned, checked
    // above) and `src`, distinct allocations.
    unsafe { builder.launch(launch_config(dev, &spec, numel)) }?;
    Ok(())
}

/// `dst *= alpha` in place: `dst[i] = round(f32(dst[i]) · alpha)` (f32 math, rounded once to
/// `dst`'s dtype; `alpha` as given: Gemma's embedding multiplier is passed already rounded to the
/// model's dtype, as transformers does).
///
/// # Errors
/// [`crate::Error::DType`] for an FP8 `dst`, [`crate::Error::Shape`] for an empty one,
/// [`crate::Error::Argument`] for a non-finite `alpha`; compile and launch failures.
pub fn scale_assign(dev: &Device, dst: &mut Tensor, alpha: f32) -> Result<()> {
    const OP: &str = "scale_assign";
    check_dtype(OP, "dst", dst, DType::is_high_precision, HIGH_PRECISION)?;
    check_nonempty(OP, "dst", dst)?;
    if !alpha.is_finite() {
        return Err(crate::Error::Argument { op: OP, message: format!("alpha = {alpha} must be finite") });
    }
    let spec = ElementwiseSpec::scale_assign(dst.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Elementwise(spec), 0)?;
    let numel = dst.numel();
    let n = numel as u64;
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder.ptr("dst", dst.data_mut()?).scalar("n", &n).scalar("alpha", &alpha);
    // SAFETY: the arguments follow the scale_assign signature documented on `ElementwiseSpec`:
    // `dst` holds `n` elements of the spec's dtype (checked above).
    unsafe { builder.launch(launch_config(dev, &spec, numel)) }?;
    Ok(())
}

/// Enough blocks for each thread to have `unroll` vectors in flight, capped by the grid-stride
/// limit; at least one block (for the tail when `n < vec`).
fn launch_config(dev: &Device, spec: &ElementwiseSpec, n: usize) -> LaunchConfig {
    let vectors = n / spec.vec;
    launch_1d(grid_stride_blocks(dev, vectors.div_ceil(spec.unroll), spec.threads), spec.threads, 0)
}
