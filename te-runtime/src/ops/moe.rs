//! Family 17's launchers: mixture-of-experts token permutation (TE 2.x `moe_permute` /
//! `moe_unpermute` with an index routing map, `pytorch/permutation.py`): [`routing_map`] turns
//! the router's top-k expert indices into each slot's destination row and the rows per expert
//! (`m_splits`, what the expert GEMMs of a `GroupedLinear` take), [`permute`] gathers each
//! token's row once per slot next to the other rows of its expert, [`unpermute`] sums them back
//! weighted by the routing probabilities, and [`unpermute_dprobs`] is the probabilities'
//! gradient. The numerics are `te_reference::moe`'s (rows grouped by expert in ascending
//! order, in token order within an expert; `row_id_map` `[k, tokens]`).

use super::check_dtype;
use super::launch::Launch;
use crate::DeviceBuffer;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::MoePermuteSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "moe_permute";

/// Where the slots of a routing go ([`routing_map`]).
#[derive(Debug)]
pub struct MoeRouting {
    /// Tokens routed.
    pub tokens: usize,
    /// Slots per token (top-k).
    pub k: usize,
    /// Experts.
    pub experts: usize,
    /// i32 `[k, tokens]`: the row of slot `j` of token `t` at `j · tokens + t`, or -1 for a
    /// dropped slot (one element at least: a routing of 0 tokens holds a 0).
    pub row_id_map: DeviceBuffer<i32>,
    /// i32 `[experts]`: rows per expert (they sum to the slots not dropped).
    pub m_splits: DeviceBuffer<i32>,
}

impl MoeRouting {
    /// Rows of the permuted tensor: every slot's, dropped ones included (their rows come last
    /// and stay zero), so that the size is known without reading `m_splits` back.
    pub fn rows(&self) -> usize {
        self.tokens * self.k
    }
}

fn spec(dev: &Device, dtype: DType) -> MoePermuteSpec {
    MoePermuteSpec::new(dtype, dev.arch())
}

fn grid(blocks: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(blocks).map_err(|_| Error::Shape {
        op: OP,
        message: format!("{blocks} tokens × slots exceed one launch grid: route the batch in parts"),
    })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (MoePermuteSpec::THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

impl MoeRouting {
    /// Storage for the routing of `tokens` tokens with `k` slots each over `experts` experts
    /// ([`routing_map`] fills it).
    ///
    /// # Errors
    /// [`Error::Shape`] when `k` or `experts` is 0 or `tokens · k` reaches 2^31 (i32 rows);
    /// allocation failures.
    pub fn new(dev: &Device, tokens: usize, k: usize, experts: usize) -> Result<Self> {
        if k == 0 || experts == 0 || tokens.saturating_mul(k) > i32::MAX as usize {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "a routing needs k >= 1 (got {k}) and experts >= 1 (got {experts}) with tokens · k = {tokens} · {k} \
                     below 2^31"
                ),
            });
        }
        let stream = dev.stream();
        Ok(Self {
            tokens,
            k,
            experts,
            // At least one element (a 0-byte allocation is refused).
            row_id_map: stream.alloc_zeros::<i32>((tokens * k).max(1))?.into(),
            m_splits: stream.alloc_zeros::<i32>(experts)?.into(),
        })
    }
}

/// Fills `out` ([`MoeRouting::new`]) from the router's expert indices (`indices`, i32 `[tokens,
/// k]` on the device; an index outside `[0, experts)`, e.g. -1, drops its slot as in TE).
///
/// # Errors
/// [`Error::Shape`] when `indices` is not `tokens · k` long; compile and launch failures.
pub fn routing_map(dev: &Device, indices: &CudaSlice<i32>, out: &mut MoeRouting) -> Result<()> {
    let (tokens, k, experts) = (out.tokens, out.k, out.experts);
    if indices.len() != tokens * k && !(tokens == 0 && indices.len() == 1) {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "the routing indices must be i32 [tokens, k] = [{tokens}, {k}] ({} values), got {}",
                tokens * k,
                indices.len()
            ),
        });
    }
    if tokens == 0 {
        return Ok(());
    }
    let stream = dev.stream();
    let spec = spec(dev, DType::BF16);
    let f = dev.function(&KernelSpec::MoePermute(spec), 0)?;
    let sizes = [tokens as u64, k as u64, experts as u64];
    let mut l = Launch::new(OP, stream, &f, &spec, 0);
    l.ptr("indices", indices).ptr("row_id_map", &mut *out.row_id_map).ptr("m_splits", &mut *out.m_splits);
    l.scalar("tokens", &sizes[0]).scalar("k", &sizes[1]).scalar("experts", &sizes[2]);
    // SAFETY: indices holds tokens · k i32, row_id_map as many, m_splits experts; one block per
    // expert writes its own m_splits entry and its slots' rows (block 0 the dropped ones).
    unsafe { l.launch(grid(experts)?) }
}

/// Checks a `[rows, hidden]` activation tensor and optional `[tokens, k]` probabilities.
fn check(x: &Tensor, rows: usize, what: &'static str, r: &MoeRouting, probs: Option<&CudaSlice<f32>>) -> Result<usize> {
    check_dtype(OP, what, x, DType::is_high_precision, "bf16, f16 or f32")?;
    let (got_rows, hidden) = x.as_2d(OP)?;
    if got_rows != rows {
        return Err(Error::Shape {
            op: OP,
            message: format!("`{what}` {:?} must have {rows} rows for this routing", x.shape()),
        });
    }
    if let Some(p) = probs {
        if p.len() != r.tokens * r.k {
            return Err(Error::Shape {
                op: OP,
                message: format!("probs must be f32 [tokens, k] = [{}, {}], got {} values", r.tokens, r.k, p.len()),
            });
        }
    }
    Ok(hidden)
}

/// `x` (`[tokens, hidden]`) permuted by `r` into `out` (`[tokens · k, hidden]`, `x`'s dtype):
/// each slot's row at its `row_id_map` entry, times `probs[t, j]` when given (the backward of
/// [`unpermute`]). The rows past `Σ m_splits` (those of dropped slots) are not written: zero
/// `out` first if they are read.
///
/// # Errors
/// [`Error::DType`] for activations other than bf16/f16/f32; [`Error::Shape`] when `x` has
/// another number of rows than `r` routes, `out` is not `[tokens · k, hidden]` of `x`'s dtype
/// or `probs` is not `[tokens, k]`; compile and launch failures.
pub fn permute(
    dev: &Device,
    x: &Tensor,
    r: &MoeRouting,
    probs: Option<&CudaSlice<f32>>,
    out: &mut Tensor,
) -> Result<()> {
    let hidden = check(x, r.tokens, "x", r, probs)?;
    move_rows(dev, Entry::Permute, x, r, probs, (out, [r.rows(), hidden]))
}

/// The inverse of [`permute`] into `out` (`[tokens, hidden]`, `y`'s dtype): `out[t] = Σ_j
/// probs[t, j] · y[row_id_map[j, t]]` (`probs` `None`: weight 1), summed in f32 in slot order;
/// `y` `[tokens · k, hidden]`. Every element of `out` is written.
///
/// # Errors
/// As [`permute`], for `y` of `tokens · k` rows and `out` of `tokens`.
pub fn unpermute(
    dev: &Device,
    y: &Tensor,
    r: &MoeRouting,
    probs: Option<&CudaSlice<f32>>,
    out: &mut Tensor,
) -> Result<()> {
    let hidden = check(y, r.rows(), "y", r, probs)?;
    move_rows(dev, Entry::Unpermute, y, r, probs, (out, [r.tokens, hidden]))
}

/// The entry points that move rows.
#[derive(Clone, Copy)]
enum Entry {
    Permute,
    Unpermute,
}

/// [`permute`] or [`unpermute`] of the checked `input` into `out` of `out_shape`.
fn move_rows(
    dev: &Device,
    entry: Entry,
    input: &Tensor,
    r: &MoeRouting,
    probs: Option<&CudaSlice<f32>>,
    (out, out_shape): (&mut Tensor, [usize; 2]),
) -> Result<()> {
    if out.dtype() != input.dtype() || out.shape() != out_shape {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "out is {} {:?}, the call writes {} {out_shape:?}",
                out.dtype(),
                out.shape(),
                input.dtype()
            ),
        });
    }
    if r.tokens == 0 || out_shape[1] == 0 {
        return Ok(());
    }
    let (index, name, blocks) = match entry {
        Entry::Permute => (1, "x", r.rows()),
        Entry::Unpermute => (2, "y", r.tokens),
    };
    let spec = spec(dev, input.dtype());
    let f = dev.function(&KernelSpec::MoePermute(spec), index)?;
    let (null, sizes) = (0u64, [r.tokens as u64, r.k as u64, out_shape[1] as u64]);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, index);
    l.ptr(name, input.data()).ptr("row_id_map", &*r.row_id_map);
    match probs {
        Some(p) => l.ptr("probs", p),
        None => l.ptr("probs", &null),
    };
    l.ptr("out", out.data_mut()?);
    l.scalar("tokens", &sizes[0]).scalar("k", &sizes[1]).scalar("hidden", &sizes[2]);
    // SAFETY: the input holds tokens (permute) or tokens · k (unpermute) rows of hidden
    // elements, out the other count of the same dtype (both checked); the map's rows are below
    // tokens · k or -1 (skipped); probs (if any) tokens · k f32 (checked).
    unsafe { l.launch(grid(blocks)?) }
}

/// The gradient of [`unpermute`]'s probabilities into `d_probs` (f32 `[tokens, k]`):
/// `d_probs[t, j] = d_out[t] · y[row_id_map[j, t]]`, 0 for a dropped slot. The gradient of
/// `y` is [`permute`] of `d_out` with the same `probs`.
///
/// # Errors
/// As [`unpermute`]; [`Error::Shape`] when `d_out` is not `[tokens, hidden]` of `y`'s dtype or
/// `d_probs` is not `tokens · k` long.
pub fn unpermute_dprobs(
    dev: &Device,
    d_out: &Tensor,
    y: &Tensor,
    r: &MoeRouting,
    d_probs: &mut CudaSlice<f32>,
) -> Result<()> {
    if r.tokens == 0 {
        return Ok(());
    }
    let hidden = check(y, r.rows(), "y", r, Some(d_probs))?;
    if check(d_out, r.tokens, "d_out", r, None)? != hidden || d_out.dtype() != y.dtype() {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "d_out {:?} {} must be [tokens, hidden] of y's dtype {}",
                d_out.shape(),
                d_out.dtype(),
                y.dtype()
            ),
        });
    }
    let spec = spec(dev, y.dtype());
    let f = dev.function(&KernelSpec::MoePermute(spec), 3)?;
    let sizes = [r.tokens as u64, r.k as u64, hidden as u64];
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 3);
    l.ptr("d_out", d_out.data()).ptr("y", y.data()).ptr("row_id_map", &*r.row_id_map).ptr("d_probs", d_probs);
    l.scalar("tokens", &sizes[0]).scalar("k", &sizes[1]).scalar("hidden", &sizes[2]);
    // SAFETY: d_out holds tokens · hidden elements, y tokens · k · hidden, d_probs tokens · k f32
    // (checked).
    unsafe { l.launch(grid(r.rows())?) }
}
