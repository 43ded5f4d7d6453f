//! Families 2, 3 and the fused dact backward of 4: cast + transpose (+ dbias) (+ dact).
//!
//! One read of a `[rows, cols]` input writes the row-wise FP8 copy `out` `[rows, cols]`, the
//! column-wise copy `out_t` `[cols, rows]` (the same codes, transposed: what Hopper's TN-only
//! FP8 GEMMs need for wgrad/dgrad), maxes `|g|` into `amax` and writes `scale_inv`; optionally
//! the bias gradient `dbias = Σ_rows g` and a fused activation backward `g = dy * act'(act_in)`.
//! Follows TE `common/transpose/cast_transpose.cu` and `cast_transpose_fusion.cu`
//! (`nvte_cast_transpose`, `nvte_cast_transpose_dbias`, `nvte_cast_transpose_dbias_dgelu`).
//! [`transpose_fp8`] builds the column-wise copy of data that is already FP8 (TE
//! `Float8Tensor.transpose_2d`, `nvte_transpose`).

use super::launch::Launch;
use super::{check_dtype, check_fp8_cols, check_nonempty, check_shape, launch_1d, Fp8Scaling};
use crate::gemm::{gemm, GemmConfig, Operand, Output as GemmOut};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaViewMut;
use te_codegen::spec::{Activation, CastTransposeSpec};
use te_codegen::{DType, KernelSpec};

/// The bias-gradient outputs of a cast_transpose.
///
/// The dbias is computed deterministically in two passes: the main kernel writes per-row-tile
/// f32 column sums to `workspace`, a second kernel sums them in a fixed order into `dbias`. The
/// workspace is caller-allocated (as TE's `nvte_cast_transpose_dbias` workspace) so the op never
/// allocates; its contents need no initialization and are scratch after the call.
#[derive(Debug)]
pub struct DbiasOut<'a> {
    /// Written: `[cols]`, in the dtype of the input (`x` or `dy`).
    pub dbias: &'a mut Tensor,
    /// Scratch: at least [`dbias_workspace_len`]`(rows, cols)` f32 elements.
    pub workspace: CudaViewMut<'a, f32>,
}

/// f32 elements of the [`DbiasOut::workspace`] a `[rows, cols]` cast_transpose with dbias needs:
/// `ceil(rows / 64) * cols` (one row of column sums per 64-row tile).
pub fn dbias_workspace_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(CastTransposeSpec::DEFAULT_TILE_ROWS) * cols
}

/// The bias gradient without a cast: `dbias[c] = Σ_r x[r, c]` for a cast that cannot fuse it
/// (the blockwise one; TE reduces separately there too). One cuBLASLt GEMM `ones[1, rows] · x`
/// with f32 accumulation, written in `dbias`'s dtype: `x`'s or f32. Deterministic.
///
/// `x`: `[..., cols]` bf16/f16/f32, leading dims folded into `rows`; `dbias`: `[cols]`.
///
/// # Errors
/// [`Error::Shape`] for a `dbias` that is not `[cols]` or an empty `x`; the GEMM's dtype
/// errors; allocation and launch failures.
pub fn dbias(dev: &Device, x: &Tensor, dbias: &mut Tensor) -> Result<()> {
    const OP: &str = "dbias";
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    let (rows, cols) = x.as_2d(OP)?;
    check_shape(OP, "dbias", dbias, &[cols])?;
    let ones = Tensor::ones(dev, x.dtype(), &[1, rows])?;
    // D [1, cols] = ones [1, rows] · (x stored [rows, cols] = Bᵀ).
    let (a, b) = (Operand::new(&ones), Operand::new(x).transposed());
    gemm(dev, a, b, GemmOut::new(dbias), &GemmConfig::default())
}

/// `out = fp8(x * scale)`, `out_t = outᵀ`, `amax = max(amax, max|x|)`, `scale_inv = 1/scale`,
/// and with `dbias`, `dbias[c] = Σ_r x[r, c]` (f32 accumulation, rounded to `x`'s dtype).
///
/// `x`: `[..., cols]` f32/bf16/f16, all leading dims folded into `rows` (≥ 1); `cols` a multiple
/// of 16. `out`: E4M3 or E5M2, shaped like `x` or `[rows, cols]`; `out_t`: `[cols, rows]`, same
/// FP8 dtype as `out`. `dbias`: see [`DbiasOut`].
///
/// # Errors
/// [`Error::DType`] / [`Error::Shape`] naming the argument and what to change (cols not a
/// multiple of 16 says what to pad to); empty tensors; compile and launch failures.
pub fn cast_transpose(
    dev: &Device,
    x: &Tensor,
    out: &mut Tensor,
    out_t: &mut Tensor,
    scaling: &mut Fp8Scaling<'_>,
    dbias: Option<DbiasOut<'_>>,
) -> Result<()> {
    launch(dev, "cast_transpose", x, None, out, out_t, scaling, dbias)
}

/// The activation backward fused in front of [`cast_transpose`]: `g = dy * act'(act_in)` in f32,
/// then `out = fp8(g * scale)`, `out_t = outᵀ`, `amax = max(amax, max|g|)`, `scale_inv = 1/scale`
/// and with `dbias`, `dbias[c] = Σ_r g[r, c]` (TE `nvte_cast_transpose_dbias_dgelu`).
///
/// `act`: [`Activation::Gelu`], [`Activation::GeluErf`] or [`Activation::Relu`] (gated activations have their own
/// backward kernel). `dy` and `act_in` (the forward activation's input): same shape and dtype,
/// f32/bf16/f16. Other arguments as in [`cast_transpose`], with `dy` in place of `x`.
///
/// # Errors
/// As [`cast_transpose`]; a gated `act` is an [`Error::Codegen`]
/// ([`te_codegen::Error::InvalidSpec`]) saying what to run instead; `act_in` of another shape or
/// dtype than `dy` is an [`Error::Shape`] / [`Error::DType`].
// TE's argument list (nvte_cast_transpose_dbias_dgelu): inputs, both outputs, their scaling and
// the optional dbias; grouping them would only rename TE's arguments.
#[allow(clippy::too_many_arguments)]
pub fn cast_transpose_dact(
    dev: &Device,
    act: Activation,
    dy: &Tensor,
    act_in: &Tensor,
    out: &mut Tensor,
    out_t: &mut Tensor,
    scaling: &mut Fp8Scaling<'_>,
    dbias: Option<DbiasOut<'_>>,
) -> Result<()> {
    const OP: &str = "cast_transpose_dact";
    check_dtype(OP, "act_in", act_in, |d| d == dy.dtype(), &format!("{} (the dtype of `dy`)", dy.dtype()))?;
    check_shape(OP, "act_in", act_in, dy.shape())?;
    launch(dev, OP, dy, Some((act, act_in)), out, out_t, scaling, dbias)
}

/// `out_t = xᵀ` for FP8 codes: the bytes of `x` transposed, not rescaled, so `out_t` shares
/// `x`'s `scale_inv` (the lazy transposed copy of an FP8 weight, TE `Float8Tensor._transpose`).
///
/// `x`: `[..., cols]` E4M3 or E5M2, all leading dims folded into `rows` (≥ 1); `cols` a multiple
/// of 16. `out_t`: `[cols, rows]`, the dtype of `x`.
///
/// # Errors
/// [`Error::DType`] when `x` is not FP8 (cast a high-precision tensor with [`cast_transpose`]) or
/// `out_t` has another dtype; [`Error::Shape`] for `out_t` not `[cols, rows]`, cols not a
/// multiple of 16 (says what to pad to), empty tensors, or more rows than one grid holds;
/// compile and launch failures.
pub fn transpose_fp8(dev: &Device, x: &Tensor, out_t: &mut Tensor) -> Result<()> {
    const OP: &str = "transpose_fp8";
    check_dtype(OP, "x", x, DType::is_fp8, "e4m3 or e5m2 (use cast_transpose for f32/bf16/f16)")?;
    check_dtype(OP, "out_t", out_t, |d| d == x.dtype(), &format!("{} (the dtype of `x`)", x.dtype()))?;
    check_nonempty(OP, "x", x)?;
    let (rows, cols) = x.as_2d(OP)?;
    check_fp8_cols(OP, "cols (the last dim of `x`)", cols)?;
    check_shape(OP, "out_t", out_t, &[cols, rows])?;
    let spec = CastTransposeSpec::transpose(x.dtype(), cols, dev.arch());
    let blocks = check_grid(OP, &spec, rows)?;
    let f = dev.function(&KernelSpec::CastTranspose(spec), 0)?;
    let rows_u64 = rows as u64;
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data()).ptr("out_t", out_t.data_mut()?).scalar("rows", &rows_u64);
    // SAFETY: arguments match the transpose-mode signature documented on `CastTransposeSpec`:
    // `x` holds `rows * cols` and `out_t` `cols * rows` codes (checked above) in distinct
    // allocations (`&` vs `&mut`); one block per tile as the spec requires.
    unsafe { b.launch(launch_1d(blocks, spec.threads, 0)) }?;
    Ok(())
}

/// The main kernel's block count for `rows` rows, or an error when one grid cannot hold it.
fn check_grid(op: &'static str, spec: &CastTransposeSpec, rows: usize) -> Result<usize> {
    let blocks = spec.blocks(rows);
    if blocks > i32::MAX as usize {
        return Err(Error::Shape {
            op,
            message: format!("rows = {rows} needs {blocks} blocks, more than a grid holds: split the input along rows"),
        });
    }
    Ok(blocks)
}

// The union of the public cast_transpose entry points' arguments (and the op name for errors).
#[allow(clippy::too_many_arguments)]
fn launch(
    dev: &Device,
    op: &'static str,
    x: &Tensor,
    dact: Option<(Activation, &Tensor)>,
    out: &mut Tensor,
    out_t: &mut Tensor,
    s: &mut Fp8Scaling<'_>,
    dbias: Option<DbiasOut<'_>>,
) -> Result<()> {
    let x_arg = if dact.is_some() { "dy" } else { "x" };
    check_dtype(op, x_arg, x, DType::is_high_precision, "f32, bf16 or f16 (use transpose_fp8 for FP8 codes)")?;
    check_dtype(op, "out", out, DType::is_fp8, "e4m3 or e5m2")?;
    check_dtype(op, "out_t", out_t, |d| d == out.dtype(), &format!("{} (the dtype of `out`)", out.dtype()))?;
    check_nonempty(op, x_arg, x)?;
    let (rows, cols) = x.as_2d(op)?;
    check_fp8_cols(op, &format!("cols (the last dim of `{x_arg}`)"), cols)?;
    if out.shape() != x.shape() && out.shape() != [rows, cols] {
        return Err(Error::Shape {
            op,
            message: format!(
                "`out` must have the shape of `{x_arg}` ({:?}) or [rows, cols] = {:?}, got {:?}",
                x.shape(),
                [rows, cols],
                out.shape()
            ),
        });
    }
    check_shape(op, "out_t", out_t, &[cols, rows])?;
    let spec = CastTransposeSpec::new(x.dtype(), out.dtype(), cols, dbias.is_some(), dact.map(|d| d.0), dev.arch());
    let blocks = check_grid(op, &spec, rows)?;
    let mut dbias = dbias;
    if let Some(d) = &dbias {
        check_dtype(op, "dbias", d.dbias, |t| t == x.dtype(), &format!("{} (the dtype of `{x_arg}`)", x.dtype()))?;
        check_shape(op, "dbias", d.dbias, &[cols])?;
        let need = spec.row_tiles(rows) * cols;
        if d.workspace.len() < need {
            return Err(Error::Shape {
                op,
                message: format!(
                    "the dbias workspace holds {} f32, needs {need}: allocate dbias_workspace_len({rows}, {cols})",
                    d.workspace.len()
                ),
            });
        }
    }
    let kspec = KernelSpec::CastTranspose(spec);
    let f = dev.function(&kspec, 0)?;
    let rows_u64 = rows as u64;
    let mut b = Launch::new(op, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data());
    if let Some((_, act_in)) = &dact {
        b.ptr("act_in", act_in.data());
    }
    b.ptr("q", out.data_mut()?)
        .ptr("q_t", out_t.data_mut()?)
        .ptr("scale_ptr", &s.scale)
        .ptr("amax_ptr", &mut s.amax)
        .ptr("scale_inv_ptr", &mut s.scale_inv);
    if let Some(d) = &mut dbias {
        b.ptr("dbias_partial", &mut d.workspace);
    }
    b.scalar("rows", &rows_u64);
    // SAFETY: arguments match the `<name>` signature documented on `CastTransposeSpec`: `x` (and
    // `act_in`) hold `rows * cols` elements of the spec's input dtype, `out` `rows * cols` and
    // `out_t` `cols * rows` FP8 codes, the scaling views one f32 each, the workspace at least
    // `row_tiles * cols` f32 (checked above); one block per tile as the spec requires.
    unsafe { b.launch(launch_1d(blocks, spec.threads, 0)) }?;
    if let Some(mut d) = dbias {
        let g = dev.function(&kspec, 1)?;
        let row_tiles = spec.row_tiles(rows) as u64;
        let mut b = Launch::new(op, dev.stream(), &g, &spec, 1);
        b.ptr("dbias_partial", &mut d.workspace).ptr("dbias", d.dbias.data_mut()?).scalar("row_tiles", &row_tiles);
        let cfg = launch_1d(cols.div_ceil(CastTransposeSpec::DBIAS_COLS), CastTransposeSpec::DBIAS_THREADS, 0);
        // SAFETY: arguments match the `<name>_dbias` signature documented on `CastTransposeSpec`;
        // the workspace rows `0..row_tiles` were written by the launch above on the same stream,
        // `dbias` holds `cols` elements of the input dtype.
        unsafe { b.launch(cfg) }?;
    }
    Ok(())
}
