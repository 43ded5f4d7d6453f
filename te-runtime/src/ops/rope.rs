//! Family 9 launchers: rotary position embedding (RoPE) of queries and keys, forward and
//! backward, non-interleaved ("rotate half"). Follows TE's `apply_rotary_pos_emb(...,
//! fused=True)` (`common/fused_rope/fused_rope.cu`) for the `sbhd` and `bshd` formats, without
//! context parallelism or per-sequence start positions.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, check_shape, grid_stride_blocks, launch_1d};
use crate::{Device, Error, Result, Tensor};
use te_codegen::spec::{Direction, RopeSpec};
use te_codegen::{DType, KernelSpec};

pub use te_codegen::spec::RopeFormat;

/// `out = t·cos θ + rotate_half(t)·sin θ` over the first `d2` channels of each head; channels
/// `d2..d` are copied unchanged.
///
/// With `half = d2 / 2` and `θ_c = freqs[p][c]` for a row at position `p`: `out[c] =
/// t[c]·cos θ_c − t[c+half]·sin θ_c` for `c < half`, `out[c] = t[c]·cos θ_c + t[c−half]·sin θ_c`
/// for `half <= c < d2`. Math in f32 (`fmaf(t, cos, rounded(rot·sin))`), rounded once to the dtype.
///
/// - `t`: `[s, b, h, d]` ([`RopeFormat::Sbhd`]) or `[b, s, h, d]` ([`RopeFormat::Bshd`]), f32,
///   bf16 or f16, `d <= 1024`.
/// - `freqs`: angles in radians, f32, `[s_f, d2]` or TE's `[s_f, 1, 1, d2]`, with `s_f >= s`
///   (position `p` reads row `p`, so a table built for the longest sequence serves every
///   shorter one) and `d2` even, `2 <= d2 <= d`.
/// - `out`: the shape and dtype of `t`.
///
/// # Errors
/// [`Error::DType`] for an FP8 `t`, an `out` of another dtype or non-f32 `freqs`;
/// [`Error::Shape`] for a `t` that is not 4-D or is empty, `d > 1024`, an `out` of another shape,
/// `freqs` of another rank, with fewer than `s` rows, an odd `d2` or `d2 > d`; compile and launch
/// failures.
pub fn forward(dev: &Device, format: RopeFormat, t: &Tensor, freqs: &Tensor, out: &mut Tensor) -> Result<()> {
    launch(dev, ("rope forward", "t", "out"), Direction::Fwd, format, t, freqs, out)
}

/// The gradient of [`forward`]: `dt = dout·cos θ + rotate_half_transposed(dout)·sin θ`, the
/// rotation by `−θ` (TE's `fused_rope_block_backward`).
///
/// `dt[c] = dout[c]·cos θ_c + dout[c+half]·sin θ_{c+half}` for `c < half`, `dt[c] = dout[c]·cos θ_c
/// − dout[c−half]·sin θ_{c−half}` for `half <= c < d2` (the exact transpose of the forward, also
/// when the two halves' angles differ); channels `d2..d` are copied. `dout` and `dt` have the
/// layout, shape and dtype rules of `t` and `out` in [`forward`]; `freqs` is the forward's.
///
/// # Errors
/// As [`forward`], with `dout` for `t` and `dt` for `out`.
pub fn backward(dev: &Device, format: RopeFormat, dout: &Tensor, freqs: &Tensor, dt: &mut Tensor) -> Result<()> {
    launch(dev, ("rope backward", "dout", "dt"), Direction::Bwd, format, dout, freqs, dt)
}

/// Checks the arguments of either direction and launches its kernel.
fn launch(
    dev: &Device,
    (op, src_name, dst_name): (&'static str, &'static str, &'static str),
    direction: Direction,
    format: RopeFormat,
    src: &Tensor,
    freqs: &Tensor,
    dst: &mut Tensor,
) -> Result<()> {
    check_dtype(op, src_name, src, DType::is_high_precision, "f32, bf16 or f16")?;
    let same = format!("{} (the dtype of `{src_name}`)", src.dtype());
    check_dtype(op, dst_name, dst, |d| d == src.dtype(), &same)?;
    check_dtype(op, "freqs", freqs, |d| d == DType::F32, "f32")?;
    let &[d0, d1, h, d] = src.shape() else {
        let layout = match format {
            RopeFormat::Sbhd => "[s, b, h, d]",
            RopeFormat::Bshd => "[b, s, h, d]",
        };
        return Err(Error::Shape {
            op,
            message: format!("`{src_name}` must be 4-D {layout} ({format}), got {:?}", src.shape()),
        });
    };
    let (s, b) = match format {
        RopeFormat::Sbhd => (d0, d1),
        RopeFormat::Bshd => (d1, d0),
    };
    check_shape(op, dst_name, dst, src.shape())?;
    check_nonempty(op, src_name, src)?;
    if d > RopeSpec::MAX_D {
        return Err(Error::Shape {
            op,
            message: format!("d = {d} exceeds the largest head dimension, {}", RopeSpec::MAX_D),
        });
    }
    let d2 = check_freqs(op, freqs, s, d)?;
    let spec = RopeSpec::new(direction, format, src.dtype(), d, d2, dev.arch());
    let f = dev.function(&KernelSpec::Rope(spec), 0)?;
    let items = s * (b * h).div_ceil(spec.rows_per_item());
    let cfg = launch_1d(grid_stride_blocks(dev, items * spec.threads(), spec.threads()), spec.threads(), 0);
    let (s_arg, b_arg, h_arg) = (s as u64, b as u64, h as u64);
    let mut builder = Launch::new(op, dev.stream(), &f, &spec, 0);
    builder
        .ptr("src", src.data())
        .ptr("freqs", freqs.data())
        .ptr("dst", dst.data_mut()?)
        .scalar("s", &s_arg)
        .scalar("b", &b_arg)
        .scalar("h", &h_arg);
    // SAFETY: the arguments follow the signature documented on `RopeSpec`: `src` and `dst` hold
    // `s * b * h * d` elements of the spec's dtype in the spec's format, `freqs` at least
    // `s * d2` f32 (checked above); `dst` is a distinct allocation (`&mut` vs `&`), as the
    // kernel's `__restrict__` requires.
    unsafe { builder.launch(cfg) }?;
    Ok(())
}

/// `d2` of `freqs: [s_f, d2]` or `[s_f, 1, 1, d2]` after checking `s_f >= s` and `2 <= d2 <= d`,
/// `d2` even.
fn check_freqs(op: &'static str, freqs: &Tensor, s: usize, d: usize) -> Result<usize> {
    let (rows, d2) = match *freqs.shape() {
        [rows, d2] | [rows, 1, 1, d2] => (rows, d2),
        _ => {
            return Err(Error::Shape {
                op,
                message: format!("`freqs` must be [s, d2] or [s, 1, 1, d2], got {:?}", freqs.shape()),
            })
        }
    };
    if rows < s {
        return Err(Error::Shape {
            op,
            message: format!(
                "`freqs` has angles for {rows} positions, the input has s = {s}: build it for at least {s}"
            ),
        });
    }
    if d2 < 2 || d2 % 2 != 0 || d2 > d {
        return Err(Error::Shape {
            op,
            message: format!("the rotated width d2 = {d2} (last dim of `freqs`) must be even and in [2, d = {d}]"),
        });
    }
    Ok(d2)
}
