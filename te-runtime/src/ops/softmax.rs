//! Family 6 launchers: scaled softmax forward (no mask, causal, padding) and backward over
//! attention scores `[batch, heads, sq, sk]`. Follows TE's `scaled_softmax`,
//! `scaled_masked_softmax` and `scaled_upper_triang_masked_softmax`
//! (`common/fused_softmax/`), except that a fully masked row gives zeros instead of a uniform
//! distribution.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, check_shape, grid_stride_blocks, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::{Direction, MaskKind, SoftmaxSpec};
use te_codegen::{DType, KernelSpec};

/// Longest key dimension the kernels take (TE's fused softmax limit).
pub const MAX_SK: usize = 16384;

/// The attention mask of [`forward`]. TE's convention: nonzero / `true` = masked out.
#[derive(Debug, Clone, Copy)]
pub enum Mask<'a> {
    /// Every key is attended.
    None,
    /// Query `i` attends keys `j <= i` (top-left aligned).
    Causal,
    /// `[batch, sq, sk]` row-major bytes, shared by all heads; nonzero = masked out. A whole
    /// allocation (its start is aligned for the kernel's vector loads).
    Padding(&'a CudaSlice<u8>),
}

impl Mask<'_> {
    /// The spec's mask kind.
    pub fn kind(&self) -> MaskKind {
        match self {
            Mask::None => MaskKind::None,
            Mask::Causal => MaskKind::Causal,
            Mask::Padding(_) => MaskKind::Padding,
        }
    }
}

/// `y = softmax(scale * x)` over the last dimension, masked keys excluded.
///
/// - `x`: scores `[batch, heads, sq, sk]`, f32/bf16/f16, `1 <= sk <= 16384`.
/// - `y`: same shape and dtype. Masked keys get exactly 0; a row with every key masked gives
///   all zeros. Math is f32.
///
/// # Errors
/// [`Error::DType`] for an FP8 `x` or a `y` of another dtype; [`Error::Shape`] for `x` not 4-D,
/// an empty `x`, `sk` above 16384, a `y` of another shape, or a padding mask that does not hold
/// `batch * sq * sk` bytes; compile and launch failures.
pub fn forward(dev: &Device, x: &Tensor, mask: Mask<'_>, scale: f32, y: &mut Tensor) -> Result<()> {
    const OP: &str = "softmax forward";
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    check_dtype(OP, "y", y, |d| d == x.dtype(), &format!("{} (the dtype of `x`)", x.dtype()))?;
    let &[batch, heads, sq, sk] = x.shape() else {
        return Err(Error::Shape {
            op: OP,
            message: format!("`x` must be 4-D [batch, heads, sq, sk], got {:?}", x.shape()),
        });
    };
    check_shape(OP, "y", y, x.shape())?;
    check_nonempty(OP, "x", x)?;
    check_sk(OP, sk)?;
    if let Mask::Padding(m) = mask {
        let want = batch * sq * sk;
        if m.len() != want {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "the padding mask must be [batch, sq, sk] = [{batch}, {sq}, {sk}] = {want} bytes, got {}",
                    m.len()
                ),
            });
        }
    }
    let spec = SoftmaxSpec::new(mask.kind(), Direction::Fwd, x.dtype(), sk, dev.arch());
    let f = dev.function(&KernelSpec::Softmax(spec), 0)?;
    let rows = batch * heads * sq;
    let (sq_arg, heads_arg, rows_arg) = (sq as u64, heads as u64, rows as u64);
    let cfg = launch_config(dev, &spec, rows);
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data());
    if let Mask::Padding(m) = mask {
        b.ptr("mask", m);
    }
    b.ptr("y", y.data_mut()?)
        .scalar("scale", &scale)
        .scalar("sq", &sq_arg)
        .scalar("heads", &heads_arg)
        .scalar("rows", &rows_arg);
    // SAFETY: the arguments follow the forward signature documented on `SoftmaxSpec`, the mask
    // present exactly for `MaskKind::Padding`; `x` and `y` hold `rows * sk` elements of the
    // spec's dtype and the mask `batch * sq * sk` bytes (checked above).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// `dx = scale * (dy * y - y * Σ_j dy_j y_j)` over the last dimension (TE's form of
/// `scale * y * (dy - Σ dy·y)`); masked keys have `y = 0` and get `dx = 0`.
///
/// `dy`, `y` (the forward output) and `dx`: one shape `[..., sk]` (e.g. `[batch, heads, sq,
/// sk]`) and dtype (f32/bf16/f16), `1 <= sk <= 16384`.
///
/// # Errors
/// [`Error::DType`] / [`Error::Shape`] for mismatched dtypes or shapes, empty tensors, `sk` out
/// of range; compile and launch failures.
pub fn backward(dev: &Device, dy: &Tensor, y: &Tensor, scale: f32, dx: &mut Tensor) -> Result<()> {
    const OP: &str = "softmax backward";
    check_dtype(OP, "dy", dy, DType::is_high_precision, "f32, bf16 or f16")?;
    let same = format!("{} (the dtype of `dy`)", dy.dtype());
    check_dtype(OP, "y", y, |d| d == dy.dtype(), &same)?;
    check_dtype(OP, "dx", dx, |d| d == dy.dtype(), &same)?;
    check_shape(OP, "y", y, dy.shape())?;
    check_shape(OP, "dx", dx, dy.shape())?;
    let (rows, sk) = dy.as_2d(OP)?;
    check_nonempty(OP, "dy", dy)?;
    check_sk(OP, sk)?;
    let spec = SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dy.dtype(), sk, dev.arch());
    let f = dev.function(&KernelSpec::Softmax(spec), 0)?;
    let rows_arg = rows as u64;
    let cfg = launch_config(dev, &spec, rows);
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("dy", dy.data())
        .ptr("y", y.data())
        .ptr("dx", dx.data_mut()?)
        .scalar("scale", &scale)
        .scalar("rows", &rows_arg);
    // SAFETY: the arguments follow the backward signature documented on `SoftmaxSpec`; `dy`, `y`
    // and `dx` hold `rows * sk` elements of the spec's dtype (checked above).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

fn check_sk(op: &'static str, sk: usize) -> Result<()> {
    if sk <= MAX_SK {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            message: format!(
                "sk = {sk} exceeds the fused softmax limit of {MAX_SK} keys (TE's limit too): shorten the key sequence"
            ),
        })
    }
}

/// Blocks striding over groups of `rows_per_block` rows.
fn launch_config(dev: &Device, spec: &SoftmaxSpec, rows: usize) -> cudarc::driver::LaunchConfig {
    let groups = rows.div_ceil(spec.rows_per_block());
    launch_1d(grid_stride_blocks(dev, groups * spec.threads, spec.threads), spec.threads, 0)
}
