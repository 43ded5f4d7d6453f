//! Family 11 launchers: the token-embedding lookup and its deterministic gradient scatter-add.
//!
//! Ids are `i32` device slices (the [`Tensor`] type holds floating-point data only): an id
//! outside `[0, vocab)` (a padding `-1`) reads as a zero row and receives no gradient.

use super::launch::Launch;
use super::{check_dtype, check_nonempty, grid_stride_blocks, launch_1d};
use crate::graph::HostCopies;
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

/// The ids of a batch grouped by id, on the device: what [`embedding_backward`] reads to sum
/// each id's tokens without scanning every id per vocabulary row (`O(tokens * hidden)` whatever
/// the vocabulary). Built on the host from the ids ([`EmbeddingGradIndex::layout`]: the token
/// positions sorted stably by id, so each id's tokens stay in token order, where each id's run
/// starts, and the ids present; negative ids, padding, are left out) and uploaded as one
/// `[3 * tokens + 2]` i32 buffer.
#[derive(Debug)]
pub struct EmbeddingGradIndex {
    data: CudaSlice<i32>,
    tokens: usize,
}

impl EmbeddingGradIndex {
    /// The grouping of `ids` (one per token, any shape flattened) uploaded.
    ///
    /// # Errors
    /// [`Error::Shape`] for no ids or more than `i32::MAX`; allocation and copy failures.
    pub fn from_host(dev: &Device, ids: &[i32]) -> Result<Self> {
        let packed = Self::packed(ids)?;
        Ok(Self { data: dev.stream().htod(&packed)?, tokens: ids.len() })
    }

    /// Refills the buffer in place with the grouping of `ids` (as many as before): the address
    /// stays, so a CUDA graph that reads it replays with the new batch. A host upload: not
    /// inside a capture.
    ///
    /// # Errors
    /// [`Error::Shape`] for another number of ids; [`Error::Capture`] inside a capture; copy
    /// failures.
    pub fn update(&mut self, dev: &Device, ids: &[i32]) -> Result<()> {
        if ids.len() != self.tokens {
            return Err(Error::Shape {
                op: "EmbeddingGradIndex::update",
                message: format!("{} ids for an index of {} tokens", ids.len(), self.tokens),
            });
        }
        let packed = Self::packed(ids)?;
        crate::graph::refuse_in_capture(dev.stream(), "EmbeddingGradIndex::update")?;
        dev.stream().memcpy_htod(&packed, &mut self.data)?;
        Ok(())
    }

    /// Tokens indexed.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The grouping of `ids`: `(order, starts, rows)` with `order` the positions `t` of the ids
    /// `≥ 0` sorted stably by `ids[t]`, `rows` the distinct ids in ascending order and
    /// `order[starts[s]..starts[s + 1]]` the positions of `rows[s]` (ascending).
    pub fn layout(ids: &[i32]) -> (Vec<i32>, Vec<i32>, Vec<i32>) {
        let mut order: Vec<i32> = (0..ids.len()).filter(|&t| ids[t] >= 0).map(|t| t as i32).collect();
        // Stable: equal ids keep their token order, the order the kernel sums in.
        order.sort_by_key(|&t| ids[t as usize]);
        let (mut starts, mut rows) = (Vec::new(), Vec::new());
        for (i, &t) in order.iter().enumerate() {
            let id = ids[t as usize];
            if rows.last() != Some(&id) {
                rows.push(id);
                starts.push(i as i32);
            }
        }
        starts.push(order.len() as i32);
        (order, starts, rows)
    }

    /// `[n, order (padded to tokens), starts (tokens + 1), rows (tokens)]`.
    fn packed(ids: &[i32]) -> Result<Vec<i32>> {
        let tokens = ids.len();
        if tokens == 0 || tokens > i32::MAX as usize {
            return Err(Error::Shape {
                op: "EmbeddingGradIndex",
                message: format!("{tokens} ids: an index holds 1 to {} tokens", i32::MAX),
            });
        }
        let (order, starts, rows) = Self::layout(ids);
        let mut packed = vec![0i32; 3 * tokens + 2];
        packed[0] = rows.len() as i32;
        packed[1..1 + order.len()].copy_from_slice(&order);
        packed[1 + tokens..1 + tokens + starts.len()].copy_from_slice(&starts);
        packed[2 + 2 * tokens..2 + 2 * tokens + rows.len()].copy_from_slice(&rows);
        Ok(packed)
    }
}

/// `dtable[v, :] += Σ_{t: ids[t] = v} dout[t, :]`, summed in f32 in token order and added once
/// per row, rounded to `dtable`'s dtype: deterministic (no atomics), see [`EmbeddingSpec`]. The
/// ids come grouped ([`EmbeddingGradIndex`]), so the cost does not grow with the vocabulary.
///
/// `dout`: f32/bf16/f16, any shape with last dim `hidden` and `tokens * hidden` elements;
/// `index`: the grouping of the forward's `[tokens]` ids; `dtable`: `[vocab, hidden]`,
/// f32/bf16/f16 (rows no id names are untouched; ids outside `[0, vocab)` are skipped).
///
/// # Errors
/// [`Error::DType`] for FP8 tensors, [`Error::Shape`] for a `dtable` that is not
/// `[vocab, hidden]`, or a `dout` that does not fit the index's tokens; compile and launch
/// failures.
pub fn embedding_backward(dev: &Device, dout: &Tensor, index: &EmbeddingGradIndex, dtable: &mut Tensor) -> Result<()> {
    const OP: &str = "embedding_backward";
    check_dtype(OP, "dout", dout, DType::is_high_precision, HIGH_PRECISION)?;
    check_dtype(OP, "dtable", dtable, DType::is_high_precision, HIGH_PRECISION)?;
    let (vocab, hidden) = table_dims(OP, "dtable", dtable)?;
    let tokens = index.tokens;
    check_rows(OP, "dout", dout, tokens, hidden)?;
    check_nonempty(OP, "dout", dout)?;
    let spec = EmbeddingSpec::backward(dout.dtype(), dtable.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::Embedding(spec), 0)?;
    let (t, v, h) = (tokens as u64, vocab as u64, hidden as u64);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder
        .ptr("dout", dout.data())
        .ptr("index", &index.data)
        .ptr("dtable", dtable.data_mut()?)
        .scalar("tokens", &t)
        .scalar("vocab", &v)
        .scalar("hidden", &h);
    // SAFETY: the arguments follow the backward signature documented on `EmbeddingSpec`: `dout`
    // holds `tokens * hidden` elements (checked above), `index` `3 * tokens + 2` i32 packed by
    // `EmbeddingGradIndex::packed` (its count `n ≤ tokens`, positions `< tokens`, run starts
    // ascending within `[0, tokens]`), `dtable` `vocab * hidden` elements of its dtype; the
    // kernel writes `dtable` rows `< vocab` only, and `dtable` is a distinct allocation from
    // `dout` (`&mut` vs `&`). One block per id present at most: the grid covers `tokens`.
    unsafe {
        builder.launch(launch_1d(grid_stride_blocks(dev, tokens * spec.threads, spec.threads), spec.threads, 0))
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal ids keep their token order; negative ids are left out; runs cover the order.
    #[test]
    fn the_layout_groups_ids_stably() {
        let (order, starts, rows) = EmbeddingGradIndex::layout(&[5, -1, 2, 5, 0, 2, 5]);
        assert_eq!(order, [4, 2, 5, 0, 3, 6]);
        assert_eq!(rows, [0, 2, 5]);
        assert_eq!(starts, [0, 1, 3, 6]);
        let packed = EmbeddingGradIndex::packed(&[5, -1, 2, 5, 0, 2, 5]).unwrap();
        assert_eq!(packed.len(), 3 * 7 + 2);
        assert_eq!(packed[0], 3);
        assert_eq!(&packed[1..7], &[4, 2, 5, 0, 3, 6]);
        assert_eq!(&packed[8..12], &[0, 1, 3, 6]);
        assert_eq!(&packed[16..19], &[0, 2, 5]);
        let (order, starts, rows) = EmbeddingGradIndex::layout(&[-1, -3]);
        assert!(order.is_empty() && rows.is_empty() && starts == [0]);
        assert!(EmbeddingGradIndex::packed(&[]).is_err());
    }
}
