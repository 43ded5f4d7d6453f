//! Tensor-parallel communication hidden behind the GEMMs ([`super::TpConfig::tp_comm_overlap`]):
//! TE's Userbuffers overlaps (`ub_overlap_ag`, `ub_overlap_rs`, `ub_bulk_dgrad` of
//! `transformer_engine/pytorch/module/base.py`) and torchtitan's async tensor parallelism
//! (`torch.distributed._symmetric_memory`'s `fused_all_gather_matmul` /
//! `fused_matmul_reduce_scatter`), built with NCCL on a side stream of the tensor-parallel
//! group ([`te_runtime::dist::ProcessGroup::with_side_stream`]) and its events
//! ([`te_runtime::dist::ProcessGroup::mark`] / `wait_mark`) instead of Userbuffers' copy
//! engines. Only under sequence parallelism (where TE overlaps too):
//!
//! - **All-gather ⟶ column-parallel GEMM** ([`gather_gemm`]): every rank's token shard is
//!   broadcast from its owner on the side stream, the broadcasts in one NCCL group (on two
//!   ranks both directions of the link at once, as the all-gather), followed by a mark; the
//!   GEMM of this rank's own shard starts at once, beside them, and the GEMMs of the other
//!   shards wait for the mark. The output rows of a GEMM depend on their input rows alone, so
//!   the concatenated outputs are the one-GEMM output, bit for bit where cuBLASLt picks an
//!   algorithm of the same reduction order for the shard's `M` as for the whole `M` (the
//!   reduction runs along `k`, which does not change; a split-k algorithm for one `M` and not
//!   the other rounds differently: within the GEMM's own tolerance). FP8 inputs travel as their
//!   codes (one scale on every rank), as the non-overlapped FP8 all-gather does. The backward
//!   of a row-parallel GEMM gathers its output gradient the same way beside the dgrad GEMM of
//!   this rank's shard (16-bit backward; the wgrad GEMM takes the whole gathered gradient; an
//!   FP8 backward casts the whole gradient with its transpose and bias gradient, so it gathers
//!   it first, not overlapped). On more than two ranks a ring of steps, each its own event,
//!   would let the GEMMs start on the first shards to arrive (TE's `ub_overlap_ag` ring
//!   exchange); the one group is what two ranks need.
//! - **Row-parallel GEMM ⟶ reduce-scatter** ([`gemm_reduce_scatter`]): the GEMM runs in row
//!   blocks: each owner's rows (its token shard) in up to [`MAX_REDUCE_CHUNKS`] chunks of at
//!   least [`MIN_CHUNK_ROWS`] GEMM rows ([`reduce_chunks`]; [`REDUCE_CHUNKS_ENV`] sets the count;
//!   a shard too small for two is not overlapped: one GEMM, then the reduce-scatter); at step
//!   `j` the GEMMs of chunk `j` of every owner's rows run, then their reductions to their owners
//!   (`ncclReduce`, one NCCL group: on two ranks both directions at once) on the side stream
//!   while the GEMMs of step `j + 1` run; only the last step's reductions are left after the
//!   last GEMM. This rank's reduced chunks, concatenated, are its shard. On 2 ranks the sum of
//!   two values is the same in any order, so the shard is bit for bit the reduce-scatter's when
//!   the block GEMMs give the whole GEMM's rows (same proviso on the algorithm); on more ranks
//!   NCCL's reduce and reduce-scatter may sum in other orders (within rounding).
//! - **Dgrad reduction ∥ wgrad GEMM** ([`PendingReduce`]): the dgrad GEMM runs first, its
//!   reduce-scatter is issued on the side stream, the wgrad GEMM runs on the device's stream,
//!   and the device's stream waits for the reduction at the end (TE's bulk dgrad overlap). The
//!   same collective on the same data: bit for bit the non-overlapped result.
//!
//! Memory is stream-ordered: the side-stream group holds every tensor its collectives read or
//! write until the device's stream waited for them (`wait`, `wait_mark`), so a tensor dropped
//! here is freed after its collective. NVLink SHARP (`cuMulticastCreate`) is not used.

use super::sequence::shard_rows;
use std::iter::once;
use std::ops::Range;
use std::sync::Arc;
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Error, Result, Tensor};

use super::collectives::{gathered_shape, sum_rows};

/// The order in which rank `rank` of `size` runs the GEMMs of the gathered shards: its own
/// first (already here), then the others in the order their broadcasts are issued (rank
/// order), which is the order they arrive in.
pub(crate) fn gather_order(rank: usize, size: usize) -> Vec<usize> {
    once(rank).chain((0..size).filter(|&r| r != rank)).collect()
}

/// The most chunks each owner's rows are computed and reduced in by an overlapped
/// reduce-scatter: only the last chunk's reduction is left exposed after the last GEMM.
pub const MAX_REDUCE_CHUNKS: usize = 4;

/// The fewest GEMM rows (leading dims folded) of one chunk of an overlapped reduce-scatter
/// chosen by default: smaller GEMMs leave SMs idle (cuBLASLt's tiles of one wave), which costs
/// more than the reduction they would hide. Measured on 2 × H200 (2026-11-28), GPT `large` FP8
/// at TP=2 + SP, batch 4 (4 096 GEMM rows a shard): 4 chunks of 1 024 rows gave 103.2k tokens/s,
/// one chunk (no reduce-scatter overlap) 112.3k; at batch 2, 2 chunks of 1 024 rows 82.5k
/// against 88.2k.
pub const MIN_CHUNK_ROWS: usize = 4096;

/// The environment variable that sets the chunks per owner of the overlapped reduce-scatter
/// (see [`reduce_chunks`]): `0` or `1` turns that overlap off (one GEMM, then the
/// reduce-scatter), a count that does not divide the shard is taken as the default.
pub const REDUCE_CHUNKS_ENV: &str = "TE_TP_OVERLAP_RS_CHUNKS";

/// How many chunks an owner's `shard` first-dim rows (each `per_row` GEMM rows: the folded
/// trailing leading dims, e.g. the batch) split into in an overlapped reduce-scatter: `forced`
/// ([`REDUCE_CHUNKS_ENV`]) where it divides the shard, else the most up to
/// [`MAX_REDUCE_CHUNKS`] that divide it evenly with chunks of at least [`MIN_CHUNK_ROWS`]
/// GEMM rows. 1: not overlapped (the whole GEMM, then the reduce-scatter).
pub fn reduce_chunks(shard: usize, per_row: usize, forced: Option<usize>) -> usize {
    if let Some(c) = forced.filter(|&c| c <= 1 || (shard > 0 && shard % c == 0)) {
        return c.max(1);
    }
    (2..=MAX_REDUCE_CHUNKS)
        .rev()
        .find(|&c| shard > 0 && shard % c == 0 && shard / c * per_row >= MIN_CHUNK_ROWS)
        .unwrap_or(1)
}

/// [`REDUCE_CHUNKS_ENV`]'s count, if set to a number.
pub(crate) fn forced_chunks() -> Option<usize> {
    std::env::var(REDUCE_CHUNKS_ENV).ok().and_then(|v| v.trim().parse().ok())
}

/// The rows of the whole first dim `rows` whose reduction rank `owner` of `size` receives in
/// an overlapped reduce-scatter, chunk `chunk` of `chunks` of them: chunk `chunk` of the
/// owner's token shard ([`shard_rows`]).
///
/// # Errors
/// [`Error::Shape`] naming `module` when `rows` is not a multiple of `size`, or the shard not
/// of `chunks`.
pub(crate) fn block_rows(
    module: &'static str,
    rows: usize,
    owner: usize,
    size: usize,
    (chunk, chunks): (usize, usize),
) -> Result<Range<usize>> {
    let shard = shard_rows(module, rows, owner, size)?;
    let part = shard_rows(module, shard.len(), chunk, chunks)?;
    Ok(shard.start + part.start..shard.start + part.end)
}

/// The overlapped all-gather of `shard` (this rank's token shard, the same shape on every rank)
/// over `side` (a side-stream group) with `gemm` of each shard: returns the whole input (every
/// rank's shard in rank order along the first dim; only with `keep_input`) and the whole output
/// (each shard's `gemm` output, in rank order along the first dim). See the module docs.
///
/// # Errors
/// NCCL, allocation and copy errors; `gemm`'s errors.
pub fn gather_gemm(
    side: &ProcessGroup,
    shard: &Tensor,
    keep_input: bool,
    mut gemm: impl FnMut(&Tensor) -> Result<Tensor>,
) -> Result<(Option<Tensor>, Tensor)> {
    let (size, rank, dev) = (side.size(), side.rank(), side.device().clone());
    let mut pieces = Vec::with_capacity(size);
    for r in 0..size {
        pieces.push(if r == rank { shard.clone() } else { Tensor::empty(&dev, shard.dtype(), shard.shape())? });
    }
    // One NCCL group: the broadcasts run together (on two ranks both directions of the link at
    // once, as an all-gather), beside the GEMM of this rank's own shard. The root reads its own
    // shard; the others receive into their piece (not shared).
    side.grouped(|| {
        pieces
            .iter()
            .enumerate()
            .try_for_each(|(root, piece)| side.broadcast_range_shared(piece, 0..piece.numel(), root))
    })?;
    let arrived = side.mark()?;
    let mut outs: Vec<Option<Tensor>> = (0..size).map(|_| None).collect();
    for r in gather_order(rank, size) {
        if r != rank {
            side.wait_mark(&arrived)?;
        }
        outs[r] = Some(gemm(&pieces[r])?);
    }
    side.wait()?;
    let outs: Vec<Tensor> = outs
        .into_iter()
        .map(|o| o.ok_or_else(|| Error::internal("GemmParallel::gather_gemm", "a shard's GEMM did not run")))
        .collect::<Result<_>>()?;
    let out_shape = gathered_shape(outs[0].shape(), size);
    let out = Tensor::cat_rows(&dev, &outs)?.reshape(&out_shape)?;
    let whole = match keep_input {
        true => Some(Tensor::cat_rows(&dev, &pieces)?.reshape(&gathered_shape(shard.shape(), size))?),
        false => None,
    };
    Ok((whole, out))
}

/// The overlapped reduce-scatter over `side` (a side-stream group) of a GEMM whose whole output
/// has `rows` first-dim rows: `gemm(range)` computes the output rows `range` (of the first dim)
/// of this rank's partial product, in `chunks` chunks of every owner's rows (see
/// [`reduce_chunks`]); each step's blocks are reduced (summed) to the ranks that own them while
/// the next step computes. Returns this rank's blocks of the sum: its token shard. See the
/// module docs.
///
/// # Errors
/// [`Error::Shape`] naming `module` when `rows` is not a multiple of the group's size; NCCL,
/// allocation errors; `gemm`'s errors.
pub fn gemm_reduce_scatter(
    side: &ProcessGroup,
    module: &'static str,
    rows: usize,
    chunks: usize,
    mut gemm: impl FnMut(Range<usize>) -> Result<Tensor>,
) -> Result<Tensor> {
    let (size, rank, dev) = (side.size(), side.rank(), side.device().clone());
    let mut own = Vec::with_capacity(chunks);
    for chunk in 0..chunks {
        let mut blocks = Vec::with_capacity(size);
        for owner in 0..size {
            blocks.push(gemm(block_rows(module, rows, owner, size, (chunk, chunks))?)?);
        }
        // In place, one NCCL group (on two ranks both directions of the link at once, as a
        // reduce-scatter): each owner's block becomes the sum, the others' are only sent.
        side.grouped(|| blocks.iter_mut().enumerate().try_for_each(|(owner, b)| side.reduce(b, owner, ReduceOp::Sum)))?;
        own.push(blocks.swap_remove(rank));
    }
    side.wait()?;
    let first = own.first().ok_or_else(|| Error::internal(module, "an overlapped reduce-scatter of no chunks"))?;
    let mut shape = first.shape().to_vec();
    if let Some(d0) = shape.first_mut() {
        *d0 *= chunks;
    }
    match chunks {
        1 => Ok(first.clone()),
        _ => Tensor::cat_rows(&dev, &own)?.reshape(&shape),
    }
}

/// The input gradient of a column-parallel GEMM whose reduction over the ranks was started
/// ([`super::GemmParallel::start_reduce_dgrad`]): on the side stream while the wgrad GEMM runs
/// (overlapped), or still to do (the reduction runs at [`PendingReduce::finish`]), or nothing to
/// reduce.
#[derive(Debug)]
pub struct PendingReduce {
    state: Pending,
}

#[derive(Debug)]
enum Pending {
    /// Nothing to reduce (a whole GEMM, a row-parallel one).
    Ready(Tensor),
    /// Reduced at `finish` on the group's own stream (no overlap).
    Deferred { group: Arc<ProcessGroup>, module: &'static str, dx: Tensor, scatter: bool },
    /// Reduce-scattered into `out` on `side`'s stream; `finish` makes the device's stream wait.
    Side { side: Arc<ProcessGroup>, out: Tensor },
}

impl PendingReduce {
    /// Nothing to reduce: `dx` is the input gradient.
    pub(crate) fn ready(dx: Tensor) -> Self {
        Self { state: Pending::Ready(dx) }
    }

    /// `dx` summed over `group` at [`PendingReduce::finish`] (reduce-scattered with `scatter`).
    pub(crate) fn deferred(group: Arc<ProcessGroup>, module: &'static str, dx: Tensor, scatter: bool) -> Self {
        Self { state: Pending::Deferred { group, module, dx, scatter } }
    }

    /// The reduce-scatter of `dx` into this rank's shard, issued now on `side`'s stream.
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` for a first dim that does not divide; NCCL and allocation
    /// errors.
    pub(crate) fn reduce_scatter(side: Arc<ProcessGroup>, module: &'static str, dx: Tensor) -> Result<Self> {
        let shape = super::collectives::scattered_shape(module, dx.shape(), side.size())?;
        let mut out = Tensor::empty(side.device(), dx.dtype(), &shape)?;
        side.reduce_scatter(&dx, &mut out, ReduceOp::Sum)?;
        Ok(Self { state: Pending::Side { side, out } })
    }

    /// The layer's input gradient: waits for the side stream's reduction (the device's stream
    /// waits, not the host), or runs the deferred one.
    ///
    /// # Errors
    /// NCCL and driver errors; [`Error::Shape`] for a first dim that does not divide (deferred
    /// reduce-scatter).
    pub fn finish(self) -> Result<Tensor> {
        match self.state {
            Pending::Ready(dx) => Ok(dx),
            Pending::Deferred { group, module, dx, scatter } => sum_rows(&group, module, dx, scatter),
            Pending::Side { side, out } => {
                side.wait()?;
                Ok(out)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank runs its own shard's GEMM first, then the others in arrival (rank) order;
    /// every shard exactly once.
    #[test]
    fn gemm_order_starts_with_the_own_shard() {
        assert_eq!(gather_order(0, 2), [0, 1]);
        assert_eq!(gather_order(1, 2), [1, 0]);
        assert_eq!(gather_order(2, 4), [2, 0, 1, 3]);
        assert_eq!(gather_order(0, 1), [0]);
        for size in 1..9 {
            for rank in 0..size {
                let mut o = gather_order(rank, size);
                o.sort_unstable();
                assert_eq!(o, (0..size).collect::<Vec<_>>());
            }
        }
    }

    /// The reduce-scatter blocks are chunks of the owners' token shards: consecutive, equal,
    /// tiling each shard and, owner by owner, the rows; rows that do not divide are a typed
    /// error naming the module.
    #[test]
    fn reduce_scatter_blocks_are_chunks_of_the_owners_shards() {
        let blocks: Vec<_> = (0..4).map(|r| block_rows("Linear", 64, r, 4, (0, 1)).unwrap()).collect();
        assert_eq!(blocks, [0..16, 16..32, 32..48, 48..64]);
        let chunks: Vec<_> = (0..4).map(|c| block_rows("Linear", 64, 1, 2, (c, 4)).unwrap()).collect();
        assert_eq!(chunks, [32..40, 40..48, 48..56, 56..64]);
        for (rows, size) in [(64, 2), (96, 4), (24, 2), (10, 1)] {
            let shard = rows / size;
            let chunks = reduce_chunks(shard, 1, Some(2));
            let mut all: Vec<usize> = (0..size)
                .flat_map(|o| (0..chunks).flat_map(move |c| block_rows("m", rows, o, size, (c, chunks)).unwrap()))
                .collect();
            all.sort_unstable();
            assert_eq!(all, (0..rows).collect::<Vec<_>>(), "{rows} rows over {size}");
        }
        assert_eq!(block_rows("Linear", 10, 0, 1, (0, 1)).unwrap(), 0..10);
        let e = block_rows("Linear", 30, 1, 4, (0, 1)).unwrap_err().to_string();
        assert!(e.contains("Linear") && e.contains("multiple of 4"), "{e}");
    }

    /// Each shard splits into the most chunks up to four that divide it and keep GEMMs of at
    /// least 4096 rows; a forced count where it divides (0 and 1: not overlapped).
    #[test]
    fn shards_split_into_chunks_of_large_enough_gemms() {
        // GPT large at TP=2: s 2048 → shards of 1024 positions; batch 2 and 4: not chunked.
        assert_eq!(reduce_chunks(1024, 2, None), 1);
        assert_eq!(reduce_chunks(1024, 4, None), 1);
        assert_eq!(reduce_chunks(4096, 2, None), 2);
        assert_eq!(reduce_chunks(8192, 2, None), 4);
        assert_eq!(reduce_chunks(6144, 2, None), 3);
        assert_eq!(reduce_chunks(12288, 1, None), 3);
        assert_eq!(reduce_chunks(32, 2, None), 1);
        assert_eq!(reduce_chunks(32, 2, Some(2)), 2);
        assert_eq!(reduce_chunks(32, 2, Some(4)), 4);
        assert_eq!(reduce_chunks(32, 2, Some(0)), 1);
        assert_eq!(reduce_chunks(32, 2, Some(1)), 1);
        assert_eq!(reduce_chunks(30, 2, Some(4)), 1, "4 does not divide 30: the default");
        assert_eq!(reduce_chunks(0, 2, None), 1);
    }
}
