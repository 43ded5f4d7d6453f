//! Family 11 launchers: the token-embedding lookup and its deterministic gradient scatter-add.
//!
//! Ids are `i32` device slices (the [`Tensor`] type holds floating-point data only): an id
//! outside `[0, vocab)` (a padding `-1`) reads as a zero row and receives no gradient.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, grid_stride_blocks, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::EmbeddingSpec;
use te_codegen::{DType, KernelSpec};

const HIGH_PRECISION: &str = "f32, bf16 or f16";

/// `[vocab, hidden]` of a 2-D table, or a shape error.
fn table_dims(op: &'static str, arg: &str, t: &Tensor) -> Result<(usize, usize)> {
    match *t.shape() {
        [vocab, hidden] if vocab > 0 && hidden > 0 => Ok((vocab, hidden)),
        _ => Err(Error::Shape {
            op,
            message: format!("`{arg}` must be a non-empty [vocab, hidden], got {:?}", t.shape()),
        }),
    }
}

/// Fails unless `x` holds `[tokens, hidden]` elements with `hidden` last (any leading shape).
fn check_rows(op: &'static str, arg: &str, x: &Tensor, tokens: usize, hidden: usize) -> Result<()> {
    if x.shape().last() == Some(&hidden) && x.numel() == tokens * hidden {
        Ok(())
    } else {
        Err(Error::Shape {
            op,
            message: format!(
                "`{arg}` must hold one row of {hidden} per id ({tokens} ids), last dim {hidden}; got {:?}",
                x.shape()
            ),
        })
    }
}

/// `out[t, :] = table[ids[t], :]`.
///
/// `table`: `[vocab, hidden]`, f32/bf16/f16; `ids`: `[tokens]` i32; `out`: `table`'s dtype, any
/// shape with last dim `hidden` and `tokens * hidden` elements (e.g. `[s, b, hidden]` for ids
/// `[s, b]` flattened). Ids outside `[0, vocab)` give zero rows.
///
/// # Errors
/// [`Error::DType`] for an FP8 table or an `out` of another dtype, [`Error::Shape`] for a table
/// that is not `[vocab, hidden]`, no ids, or an `out` that does not fit; compile and launch
/// failures.
pub fn embedding_forward(dev: &Device, table: &Tensor, ids: &CudaSlice<i32>, out: &mut Tensor) -> Result<()> {
    const OP: &str = "embedding_forward";
    check_dtype(OP, "table", table, DType::is_high_precision, HIGH_PRECISION)?;
    let dt = table.dtype();
    check_dtype(OP, "out", out, |d| d == dt, &format!("{dt} (the table's dtype)"))?;
    let (vocab, hidden) = table_dims(OP, "table", table)?;
    let tokens = ids.len();
    check_rows(OP, "out", out, tokens, hidden)?;
    check_nonempty(OP, "out", out)?;
    let spec = EmbeddingSpec::forward(dt, dev.arch());
    let f = dev.function(&KernelSpec::Embedding(spec), 0)?;
    let (t, v, h) = (tokens as u64, vocab as u64, hidden as u64);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder
        .ptr("table", table.data())
        .ptr("ids", ids)
        .ptr("out", out.data_mut()?)
        .scalar("tokens", &t)
        .scalar("vocab", &v)
        .scalar("hidden", &h);
    // SAFETY: the arguments follow the forward signature documented on `EmbeddingSpec`: `table`
    // holds `vocab * hidden` elements, `ids` `tokens` i32, `out` `tokens * hidden` elements of
    // the table's dtype (checked above); the kernel reads table rows only for ids in
    // `[0, vocab)`, and `out` is a distinct allocation (`&mut` vs `&`).
    unsafe {
        builder.launch(launch_1d(grid_stride_blocks(dev, tokens * spec.threads, spec.threads), spec.threads, 0))
    }?;
    Ok(())
}

/// `out[t, :] = dequantize(table[ids[t], :])`: the lookup of an FP8 table (`codes`: E4M3 or E5M2
/// `[vocab, hidden]`, with one per-tensor `scale_inv` (`[1]` f32 on the device), e.g. the
/// `data()` and `scale_inv()` of a `Float8Tensor` of inference weights),
/// `out[t, c] = f32(code) * scale_inv` rounded to `out`'s dtype.
///
/// `out`: f32/bf16/f16, any shape with last dim `hidden` and `tokens * hidden` elements. Ids
/// outside `[0, vocab)` give zero rows.
///
/// # Errors
/// [`Error::DType`] for a high-precision table or an FP8 `out`, [`Error::Shape`] for a table
/// that is not `[vocab, hidden]`, no ids, or an `out` that does not fit; compile and launch
/// failures.
pub fn embedding_forward_fp8(
    dev: &Device,
    codes: &Tensor,
    scale_inv: &CudaSlice<f32>,
    ids: &CudaSlice<i32>,
    out: &mut Tensor,
) -> Result<()> {
    const OP: &str = "embedding_forward_fp8";
    check_dtype(OP, "table", codes, DType::is_fp8, "e4m3 or e5m2")?;
    check_dtype(OP, "out", out, DType::is_high_precision, HIGH_PRECISION)?;
    let (vocab, hidden) = table_dims(OP, "table", codes)?;
    if scale_inv.len() != 1 {
        return Err(Error::Shape {
            op: OP,
            message: format!("scale_inv has {} elements; a per-tensor table has one", scale_inv.len()),
        });
    }
    let tokens = ids.len();
    check_rows(OP, "out", out, tokens, hidden)?;
    check_nonempty(OP, "out", out)?;
    let spec = EmbeddingSpec::forward_fp8(codes.dtype(), out.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Embedding(spec), 0)?;
    let (t, v, h) = (tokens as u64, vocab as u64, hidden as u64);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder
        .ptr("table", codes.data())
        .ptr("ids", ids)
        .ptr("out", out.data_mut()?)
        .ptr("scale_inv_ptr", scale_inv)
        .scalar("tokens", &t)
        .scalar("vocab", &v)
        .scalar("hidden", &h);
    // SAFETY: the arguments follow the FP8 forward signature documented on `EmbeddingSpec`:
    // `table` holds `vocab * hidden` one-byte codes, `scale_inv` one f32, `ids` `tokens` i32,
    // `out` `tokens * hidden` elements of its dtype (checked above); the kernel reads table rows
    // only for ids in `[0, vocab)`, and `out` is a distinct allocation (`&mut` vs `&`).
    unsafe {
        builder.launch(launch_1d(grid_stride_blocks(dev, tokens * spec.threads, spec.threads), spec.threads, 0))
    }?;
    Ok(())
}

/// `dtable[v, :] += Σ_{t: ids[t] = v} dout[t, :]`, summed in f32 in token order and added once
/// per row, rounded to `dtable`'s dtype: deterministic (no atomics), see [`EmbeddingSpec`].
///
/// `dout`: f32/bf16/f16, any shape with last dim `hidden` and `tokens * hidden` elements; `ids`:
/// `[tokens]` i32; `dtable`: `[vocab, hidden]`, f32/bf16/f16 (rows no id names are untouched).
///
/// # Errors
/// [`Error::DType`] for FP8 tensors, [`Error::Shape`] for a `dtable` that is not
/// `[vocab, hidden]`, no ids, or a `dout` that does not fit; compile and launch failures.
pub fn embedding_backward(dev: &Device, dout: &Tensor, ids: &CudaSlice<i32>, dtable: &mut Tensor) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_dtype(OP, "dout", dout, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "dtable", dtable, DType::is_high_precision, HIGH_PRECISION)?;
    let (vocab, hidden) = table_dims(OP, "dtable", dtable)?;
    let tokens = ids.len();
    check_rows(OP, "dout", dout, tokens, hidden)?;
    check_nonempty(OP, "dout", dout)?;
    let spec = EmbeddingSpec::backward(dout.dtype(), dtable.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Embedding(spec), 0)?;
    let (t, v, h) = (tokens as u64, vocab as u64, hidden as u64);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder
        .ptr("dout", dout.data())
        .ptr("ids", ids)
        .ptr("dtable", dtable.data_mut()?)
        .scalar("tokens", &t)
        .scalar("vocab", &v)
        .scalar("hidden", &h);
    // SAFETY: the arguments follow the backward signature documented on `EmbeddingSpec`: `dout`
    // holds `tokens * hidden` elements, `ids` `tokens` i32, `dtable` `vocab * hidden` elements
    // of their dtypes (checked above); the kernel writes `dtable` rows `< vocab` only, and
    // `dtable` is a distinct allocation from `dout` (`&mut` vs `&`).
    unsafe { builder.launch(launch_1d(grid_stride_blocks(dev, vocab * spec.threads, spec.threads), spec.threads, 0)) }?;
    Ok(())
}
