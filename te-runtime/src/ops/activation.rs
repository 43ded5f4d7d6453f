//! Family 4 launchers: `y = act(x + bias)` (optionally quantized to FP8 with amax and
//! scale_inv) and the activation backward `dx = act'(x) * dy`, for GELU (tanh), ReLU, SwiGLU and
//! GeGLU. Follows TE's `nvte_gelu` / `nvte_dgelu` / `nvte_swiglu` / `nvte_dswiglu` family
//! (`common/activation/`), with the bias add fused into the forward.

use super::launch::Launch;
use super::{check_dtype, check_fp8_cols, check_nonempty, check_shape, grid_stride_blocks, launch_1d, Fp8Scaling};
use crate::{Device, Error, Result, Tensor};
use te_codegen::spec::{Activation, ActivationSpec, Direction};
use te_codegen::{DType, KernelSpec};

/// `y = act(x + bias)`.
///
/// - `x`: `[..., in_cols]`, f32/bf16/f16, where `in_cols = 2 * cols` for gated activations
///   (SwiGLU, GeGLU: `[a | b]`, `y = act(a) * b`) and `cols` otherwise.
/// - `bias`: `[in_cols]`, the dtype of `x`, added before the activation (both halves when gated).
/// - `y`: `[..., cols]` with the leading dims of `x`; f32/bf16/f16, or E4M3/E5M2 together with
///   `fp8` scaling: then `y = fp8(act(..) * scale)`, `amax = max(amax, max|act(..)|)` and
///   `scale_inv = 1 / scale`. FP8 output needs `cols % 16 == 0`.
///
/// # Errors
/// [`Error::DType`] for unsupported dtypes, a bias dtype other than `x`'s, an FP8 `y` without
/// `fp8` scaling or scaling with a high-precision `y`; [`Error::Shape`] for mismatched shapes
/// (a gated `x` must be `2 * cols` wide), empty tensors or FP8 `cols` not a multiple of 16;
/// compile and launch failures.
pub fn forward(
    dev: &Device,
    act: Activation,
    x: &Tensor,
    bias: Option<&Tensor>,
    y: &mut Tensor,
    fp8: Option<&mut Fp8Scaling<'_>>,
) -> Result<()> {
    const OP: &str = "activation forward";
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    check_output(OP, "y", y, fp8.is_some())?;
    let (rows, cols) = check_widths(OP, act, ("x", x), ("y", y))?;
    if let Some(b) = bias {
        check_dtype(OP, "bias", b, |d| d == x.dtype(), &format!("{} (the dtype of `x`)", x.dtype()))?;
        check_shape(OP, "bias", b, &[if act.is_gated() { 2 * cols } else { cols }])?;
    }
    if y.dtype().is_fp8() {
        check_fp8_cols(OP, "cols", cols)?;
    }
    let spec = ActivationSpec::new(act, Direction::Fwd, x.dtype(), y.dtype(), cols, bias.is_some(), dev.arch());
    let f = dev.function(&KernelSpec::Activation(spec), 0)?;
    let rows_arg = rows as u64;
    let cfg = launch_config(dev, &spec, rows);
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data());
    if let Some(bias) = bias {
        b.ptr("bias", bias.data());
    }
    b.ptr("y", y.data_mut()?);
    if let Some(s) = fp8 {
        b.ptr("scale_ptr", &s.scale).ptr("amax_ptr", &mut s.amax).ptr("scale_inv_ptr", &mut s.scale_inv);
    }
    b.scalar("rows", &rows_arg);
    // SAFETY: the arguments follow the forward signature documented on `ActivationSpec`, with
    // `bias` and the scaling views present exactly when the spec enables them; `x` holds
    // `rows * in_cols` and `y` `rows * cols` elements of the spec's dtypes (checked above),
    // `bias` `in_cols`, each scaling view one f32.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `dx = act'(x) * dy`; gated: `da = dy * b * act'(a)`, `db = dy * act(a)`.
///
/// - `dy`: `[..., cols]`, f32/bf16/f16.
/// - `x`: the forward input (after any bias add) `[..., in_cols]`, the dtype of `dy`
///   (`in_cols = 2 * cols` for gated activations).
/// - `dx`: the shape of `x`; f32/bf16/f16, or E4M3/E5M2 with `fp8` scaling (quantized like the
///   forward output; FP8 needs `cols % 16 == 0`).
///
/// # Errors
/// As [`forward`]; `x` must have the dtype of `dy`, `dx` the shape of `x`.
pub fn backward(
    dev: &Device,
    act: Activation,
    dy: &Tensor,
    x: &Tensor,
    dx: &mut Tensor,
    fp8: Option<&mut Fp8Scaling<'_>>,
) -> Result<()> {
    const OP: &str = "activation backward";
    check_dtype(OP, "dy", dy, DType::is_high_precision, "f32, bf16 or f16")?;
    check_dtype(OP, "x", x, |d| d == dy.dtype(), &format!("{} (the dtype of `dy`)", dy.dtype()))?;
    check_output(OP, "dx", dx, fp8.is_some())?;
    check_shape(OP, "dx", dx, x.shape())?;
    let (rows, cols) = check_widths(OP, act, ("x", x), ("dy", dy))?;
    if dx.dtype().is_fp8() {
        check_fp8_cols(OP, "cols", cols)?;
    }
    let spec = ActivationSpec::new(act, Direction::Bwd, dy.dtype(), dx.dtype(), cols, false, dev.arch());
    let f = dev.function(&KernelSpec::Activation(spec), 0)?;
    let rows_arg = rows as u64;
    let cfg = launch_config(dev, &spec, rows);
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("dy", dy.data()).ptr("x", x.data()).ptr("dx", dx.data_mut()?);
    if let Some(s) = fp8 {
        b.ptr("scale_ptr", &s.scale).ptr("amax_ptr", &mut s.amax).ptr("scale_inv_ptr", &mut s.scale_inv);
    }
    b.scalar("rows", &rows_arg);
    // SAFETY: the arguments follow the backward signature documented on `ActivationSpec`, with
    // the scaling views present exactly when the output is FP8; `dy` holds `rows * cols`, `x`
    // and `dx` `rows * in_cols` elements of the spec's dtypes (checked above).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// The output dtype must be high precision without scaling or FP8 with it.
fn check_output(op: &'static str, arg: &'static str, out: &Tensor, has_scaling: bool) -> Result<()> {
    if has_scaling {
        check_dtype(op, arg, out, DType::is_fp8, "e4m3 or e5m2 (FP8 scaling was passed)")
    } else {
        check_dtype(op, arg, out, DType::is_high_precision, "f32, bf16 or f16 (pass FP8 scaling for an FP8 output)")
    }
}

/// Checks that `wide` (`[..., in_cols]`) and `narrow` (`[..., cols]`) share their leading dims
/// and that `in_cols` is `2 * cols` for gated activations (`cols` otherwise); returns
/// `(rows, cols)`.
fn check_widths(
    op: &'static str,
    act: Activation,
    (wide_name, wide): (&str, &Tensor),
    (narrow_name, narrow): (&str, &Tensor),
) -> Result<(usize, usize)> {
    let (rows, in_cols) = wide.as_2d(op)?;
    let (_, cols) = narrow.as_2d(op)?;
    let lead = &wide.shape()[..wide.shape().len() - 1];
    if narrow.shape()[..narrow.shape().len() - 1] != *lead {
        return Err(Error::Shape {
            op,
            message: format!(
                "`{narrow_name}` {:?} and `{wide_name}` {:?} must share their leading dimensions",
                narrow.shape(),
                wide.shape()
            ),
        });
    }
    let want = if act.is_gated() { 2 * cols } else { cols };
    if in_cols != want {
        let why = if act.is_gated() {
            format!("{act} reads [a | b], so `{wide_name}` must be 2 * cols = {want} wide")
        } else {
            format!("`{wide_name}` must be cols = {want} wide")
        };
        return Err(Error::Shape { op, message: format!("{why}, got {in_cols} (`{narrow_name}` has cols = {cols})") });
    }
    check_nonempty(op, wide_name, wide)?;
    Ok((rows, cols))
}

/// Enough blocks for each thread to have `unroll` vectors in flight, capped by the grid-stride
/// limit.
fn launch_config(dev: &Device, spec: &ActivationSpec, rows: usize) -> cudarc::driver::LaunchConfig {
    let vectors = rows * (spec.cols / spec.vec);
    launch_1d(grid_stride_blocks(dev, vectors.div_ceil(spec.unroll), spec.threads), spec.threads, 0)
}
