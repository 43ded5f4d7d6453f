//! Family 10 launchers: dropout with a counter-based RNG (Philox4x32-10). The fused
//! `out = residual + dropout(x + bias)` of Megatron's `bias_dropout_add` (the hidden dropout
//! after the attention projection and fc2), plain dropout (attention probabilities), and the
//! backward from the saved bit mask. Semantics of TE's `nvte_dropout_fwd`/`nvte_dropout_bwd`
//! (`common/dropout/dropout.cu`) with 32 random bits per element instead of 8 (any `p`, not only
//! multiples of 1/256) and a keep mask (1 = kept) instead of a drop mask.
//!
//! Masks are reproducible: element `i` of a call keyed `(seed, offset)` is kept iff word `i % 4`
//! of Philox block `i / 4` is below [`keep_threshold`]`(p)`, whatever the launch shape; the CPU
//! reference (`reference::dropout`) computes the same bits.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, check_shape, grid_stride_blocks, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::DropoutSpec;
use te_codegen::{DType, KernelSpec};

const HIGH_PRECISION: &str = "f32, bf16 or f16 (dequantize FP8 tensors first)";

/// The probability and the random stream of one dropout call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutParams {
    /// Probability of dropping an element, in `[0, 1]`. `0` keeps every element (out = input
    /// exactly; no random numbers are drawn), `1` drops every element (out = 0, or the residual).
    pub p: f32,
    /// Philox key.
    pub seed: u64,
    /// Philox counter words 2 and 3 (words 0 and 1 index the element's block of four): each
    /// `(seed, offset)` is an independent stream. Use a fresh offset (e.g. a call counter) per
    /// call for fresh masks, and the same one to reproduce a mask. The kernel adds the device's
    /// graph-safe base ([`crate::Device::philox_offset_base`], 0 outside graph replays).
    pub offset: u64,
}

/// Element `i` is kept iff its 32-bit random word `r` is below this: `min(2^32, ceil((1 - p) ·
/// 2^32))`, so `r · 2^-32 < 1 - p` exactly. `2^32` for `p = 0`, `0` for `p = 1`.
pub fn keep_threshold(p: f32) -> u64 {
    const TWO_32: f64 = 4_294_967_296.0;
    ((1.0 - p as f64) * TWO_32).ceil().clamp(0.0, TWO_32) as u64
}

/// The f32 factor of kept elements: `1 / (1 - p)`; `0` for `p = 1`, where nothing is kept (no
/// division by zero).
pub fn keep_scale(p: f32) -> f32 {
    if p >= 1.0 {
        0.0
    } else {
        1.0 / (1.0 - p)
    }
}

/// Bytes of the bit-packed keep mask of `numel` elements: `ceil(numel / 8)`. Bit `i % 8` of byte
/// `i / 8` is element `i`; the unused high bits of the last byte are 0.
pub const fn mask_bytes(numel: usize) -> usize {
    numel.div_ceil(8)
}

/// `out = residual + dropout(x + bias)`, element by element, and the keep mask for backward.
///
/// Per element in f32, each operation rounded (no fused multiply-add): `v = x + bias[i % cols]`,
/// `d = kept ? v · keep_scale(p) : 0`, `out = residual + d`, rounded once to `out`'s dtype.
///
/// - `x`: `[..., cols]`, f32/bf16/f16.
/// - `bias`: `[cols]`, the dtype of `x` (a Linear's bias returned unfused), or `None`.
/// - `residual`, `out`: the shape of `x`, one dtype (f32/bf16/f16; f32 for an f32 residual
///   stream).
/// - `mask`: [`mask_bytes`]`(x.numel())` bytes, written (1 = kept). Backward:
///   [`dropout_backward`] of `dout` gives `d(x + bias)`; `d residual = dout`.
///
/// # Errors
/// [`Error::Argument`] for `p` outside `[0, 1]` or NaN; [`Error::DType`] for an FP8 tensor, a
/// `bias` of another dtype than `x` or a `residual` of another dtype than `out`; [`Error::Shape`]
/// for an empty `x`, a `bias` that is not `[cols]`, a `residual` or `out` of another shape, a
/// `mask` of another length; compile and launch failures.
pub fn bias_dropout_add(
    dev: &Device,
    x: &Tensor,
    bias: Option<&Tensor>,
    residual: &Tensor,
    params: DropoutParams,
    out: &mut Tensor,
    mask: &mut CudaSlice<u8>,
) -> Result<()> {
    forward(dev, "bias_dropout_add", (x, bias, Some(residual)), params, out, mask)
}

/// `out = dropout(x)`: kept elements scaled by `1 / (1 - p)`, dropped ones 0 (e.g. attention
/// probabilities), and the keep mask for backward.
///
/// `x`: any shape, f32/bf16/f16; `out`: the shape of `x`, f32/bf16/f16; `mask`:
/// [`mask_bytes`]`(x.numel())` bytes, written (1 = kept). `out = x` bit for bit for `p = 0` when
/// the dtypes match.
///
/// # Errors
/// [`Error::Argument`] for `p` outside `[0, 1]` or NaN; [`Error::DType`] for an FP8 tensor;
/// [`Error::Shape`] for an empty `x`, an `out` of another shape or a `mask` of another length;
/// compile and launch failures.
pub fn dropout(
    dev: &Device,
    x: &Tensor,
    params: DropoutParams,
    out: &mut Tensor,
    mask: &mut CudaSlice<u8>,
) -> Result<()> {
    forward(dev, "dropout", (x, None, None), params, out, mask)
}

/// The backward of [`dropout`] and [`bias_dropout_add`]: `dx = kept ? dout · keep_scale(p) : 0`
/// (f32, rounded to `dx`'s dtype), the keep bits read from the forward's `mask`.
///
/// `dout`: any shape, f32/bf16/f16; `dx`: the shape of `dout`, f32/bf16/f16; `mask`:
/// [`mask_bytes`]`(dout.numel())` bytes from the forward; `p`: the forward's probability.
///
/// # Errors
/// [`Error::Argument`] for `p` outside `[0, 1]` or NaN; [`Error::DType`] for an FP8 tensor;
/// [`Error::Shape`] for an empty `dout`, a `dx` of another shape or a `mask` of another length;
/// compile and launch failures.
pub fn dropout_backward(dev: &Device, dout: &Tensor, mask: &CudaSlice<u8>, p: f32, dx: &mut Tensor) -> Result<()> {
    const OP: &str = "dropout_backward";
    check_p(OP, p)?;
    check_dtype(OP, "dout", dout, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "dx", dx, DType::is_high_precision, HIGH_PRECISION)?;
    check_shape(OP, "dx", dx, dout.shape())?;
    check_nonempty(OP, "dout", dout)?;
    check_mask(OP, mask.len(), dout.numel())?;
    let spec = DropoutSpec::backward(dout.dtype(), dx.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Dropout(spec), 0)?;
    let (n, scale) = (dout.numel() as u64, keep_scale(p));
    let cfg = launch_config(dev, &spec, dout.numel());
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("dout", dout.data()).ptr("mask", mask).ptr("dx", dx.data_mut()?).scalar("n", &n).scalar("scale", &scale);
    // SAFETY: the arguments follow the backward signature documented on `DropoutSpec`: `dout`
    // and `dx` hold `n` elements of the spec's dtypes, `mask` `ceil(n / 8)` bytes (checked
    // above); `dx` is a distinct allocation (`&mut` vs `&`), as `__restrict__` requires.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Checks and launches either forward: `(x, bias, residual)`, the latter two optional.
fn forward(
    dev: &Device,
    op: &'static str,
    (x, bias, residual): (&Tensor, Option<&Tensor>, Option<&Tensor>),
    params: DropoutParams,
    out: &mut Tensor,
    mask: &mut CudaSlice<u8>,
) -> Result<()> {
    check_p(op, params.p)?;
    check_dtype(op, "x", x, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(op, "out", out, DType::is_high_precision, HIGH_PRECISION)?;
    check_shape(op, "out", out, x.shape())?;
    check_nonempty(op, "x", x)?;
    let mut cols = 0u64;
    if let Some(b) = bias {
        check_dtype(op, "bias", b, |d| d == x.dtype(), &format!("{} (the dtype of `x`)", x.dtype()))?;
        let (_, c) = x.as_2d(op)?;
        check_shape(op, "bias", b, &[c])?;
        cols = c as u64;
    }
    if let Some(r) = residual {
        check_dtype(op, "residual", r, |d| d == out.dtype(), &format!("{} (the dtype of `out`)", out.dtype()))?;
        check_shape(op, "residual", r, x.shape())?;
    }
    check_mask(op, mask.len(), x.numel())?;
    let spec = DropoutSpec::forward(x.dtype(), out.dtype(), bias.is_some(), residual.is_some(), dev.arch());
    let f = dev.function(&KernelSpec::Dropout(spec), 0)?;
    let n = x.numel() as u64;
    let (threshold, scale) = (keep_threshold(params.p), keep_scale(params.p));
    let cfg = launch_config(dev, &spec, x.numel());
    let mut b = Launch::new(op, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data());
    if let Some(bias) = bias {
        b.ptr("bias", bias.data());
    }
    if let Some(r) = residual {
        b.ptr("residual", r.data());
    }
    b.ptr("out", out.data_mut()?).ptr("mask", mask).scalar("n", &n);
    if bias.is_some() {
        b.scalar("cols", &cols);
    }
    b.scalar("seed", &params.seed)
        .scalar("offset", &params.offset)
        .ptr("offset_base", dev.philox_offset_base())
        .scalar("threshold", &threshold)
        .scalar("scale", &scale);
    // SAFETY: the arguments follow the forward signature documented on `DropoutSpec`, `bias`
    // and `cols` present exactly when the spec has a bias and `residual` when it has one: `x`,
    // `residual` and `out` hold `n` elements of their dtypes, `bias` `cols`, `mask`
    // `ceil(n / 8)` bytes (checked above); `out` and `mask` are distinct allocations from the
    // inputs (`&mut` vs `&`), as `__restrict__` requires.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

fn check_p(op: &'static str, p: f32) -> Result<()> {
    if (0.0..=1.0).contains(&p) {
        Ok(())
    } else {
        Err(Error::Argument { op, message: format!("the dropout probability p = {p} must be in [0, 1]") })
    }
}

fn check_mask(op: &'static str, len: usize, numel: usize) -> Result<()> {
    if len == mask_bytes(numel) {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            message: format!(
                "`mask` must hold ceil({numel} / 8) = {} bytes (one bit per element), got {len}",
                mask_bytes(numel)
            ),
        })
    }
}

/// Enough blocks for each thread to have `unroll` chunks in flight, capped by the grid-stride
/// limit; at least one block (for the tail when `n < 8`).
fn launch_config(dev: &Device, spec: &DropoutSpec, n: usize) -> cudarc::driver::LaunchConfig {
    let chunks = n / 8;
    launch_1d(grid_stride_blocks(dev, chunks.div_ceil(spec.unroll), spec.threads), spec.threads, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thresholds_and_scales_at_the_ends_and_inside() {
        assert_eq!(keep_threshold(0.0), 1 << 32);
        assert_eq!(keep_threshold(1.0), 0);
        assert_eq!(keep_threshold(0.5), 1 << 31);
        assert_eq!(keep_threshold(0.25), 3 << 30);
        // p = 0.1 (f32: 0.100000001490116...): ceil(0.899999998509884 * 2^32).
        assert_eq!(keep_threshold(0.1), 3_865_470_560);
        // Every word is below 2^32: a p under 2^-32 drops nothing.
        assert_eq!(keep_threshold(f32::MIN_POSITIVE), 1 << 32);
        assert_eq!((keep_scale(0.0), keep_scale(0.5), keep_scale(1.0)), (1.0, 2.0, 0.0));
        assert_eq!(keep_scale(0.1), 1.0 / 0.9f32);
    }

    #[test]
    fn p_must_be_a_probability() {
        for p in [-0.1, 1.5, f32::NAN, f32::INFINITY] {
            let e = check_p("dropout", p).unwrap_err();
            assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("[0, 1]"), "{e}");
        }
        check_p("dropout", 0.0).unwrap();
        check_p("dropout", 1.0).unwrap();
        assert_eq!((mask_bytes(1), mask_bytes(8), mask_bytes(9)), (1, 1, 2));
    }
}
