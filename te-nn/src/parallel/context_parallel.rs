//! Context parallelism (TE's `cp_group` with `cp_comm_type="p2p"` or `"all_gather"`,
//! Megatron-LM's `--context-parallel-size`): every sequence of a batch split over the ranks of a context-parallel
//! group along its tokens, so that each rank holds `S / cp` tokens of every layer's activations
//! and only attention needs the other ranks' tokens.
//!
//! **Load balancing.** A causal sequence of `S` tokens is cut into `2·cp` chunks of `c = S /
//! (2·cp)` tokens; rank `r` holds chunks `r` and `2·cp − 1 − r` (TE's and Megatron-LM's layout),
//! so every rank attends over the same number of (query, key) pairs: chunk `r` sees `(r + 1)·c`
//! keys, chunk `2·cp − 1 − r` sees `(2·cp − r)·c`, together `(2·cp + 1)·c` on every rank.
//! [`ContextParallel::chunks`] gives the token ranges, [`ContextParallel::positions`] their
//! global positions (RoPE must rotate by those), [`ContextParallel::shard`] cuts a whole
//! `[S, ...]` tensor into a rank's `[2c, ...]` part, [`ContextParallel::unshard`] puts the parts
//! back together.
//!
//! **The all-gather** (TE's `AttnFuncWithCPAndKVAllGather`, [`CpCommType::AllGather`]; the
//! attention module calls it, `DotProductAttention::forward_context_parallel`):
//! [`ContextParallel::gather_sequence`] all-gathers the ranks' keys and values and puts them in global order, each of the rank's two
//! query chunks then attends over the keys up to its own end ([`ContextParallel::key_ends`]) with
//! a causal mask aligned bottom-right; in the backward the two chunks' key and value gradients,
//! summed over the global sequence, go back to the ranks that hold those tokens
//! ([`ContextParallel::scatter_sequence`], a reduce-scatter of the sum).
//!
//! **The ring** (TE's `AttnFuncWithCPAndKVP2P`, [`CpCommType::P2p`], the default as in TE): the
//! keys and values travel around the group, one rank's a step, on a side stream
//! ([`ContextParallel::ring_exchange`]) beside the attention of the ones in hand, and the steps'
//! outputs are merged by their log-sum-exp; the schedule is [`super::cp_ring`]'s.
//! [`CpCommType::AllGather`] picks the all-gather above.
//!
//! Built here: sequence-first layouts (`sbhd`), causal (aligned bottom-right) or no mask, sliding
//! windows (all-gather only: a ring layer with a window runs the all-gather), GQA. Not yet: FP8
//! attention, padding masks and `thd`.

use super::cp_ring::CpCommType;
use std::ops::Range;
use std::sync::{Arc, OnceLock};
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "ContextParallel";

/// The context-parallel group, the sequence split over it and how the attention exchanges keys
/// and values (see the module docs).
#[derive(Debug, Clone)]
pub struct ContextParallel {
    /// The context-parallel ranks, on the device's stream.
    group: Arc<ProcessGroup>,
    /// TE's `cp_comm_type`.
    comm_type: CpCommType,
    /// The side-stream copy of `group` the ring's transfers run on, made at the first use
    /// (shared by the clones: one communicator for every layer).
    ring: Arc<OnceLock<Arc<ProcessGroup>>>,
}

impl ContextParallel {
    /// Context parallelism over `group` (on the device's stream; every rank of a group holds
    /// parts of the same sequences) with the ring exchange ([`CpCommType::P2p`], TE's default;
    /// [`ContextParallel::with_comm_type`] picks another). The ring's side-stream group is made
    /// at the first ring exchange or by [`ContextParallel::prepare`] (collective).
    ///
    /// # Errors
    /// [`Error::Argument`] for a group on a side stream (the attention's collectives are
    /// ordered with its kernels on the device's stream).
    pub fn new(group: Arc<ProcessGroup>) -> Result<Self> {
        if group.is_side_stream() {
            return Err(Error::Argument {
                op: MODULE,
                message: "the group runs its collectives on a side stream: pass a group on the device's stream".into(),
            });
        }
        Ok(Self { group, comm_type: CpCommType::default(), ring: Arc::default() })
    }

    /// The same group with the key/value exchange `comm_type` (TE's `cp_comm_type`).
    pub fn with_comm_type(mut self, comm_type: CpCommType) -> Self {
        self.comm_type = comm_type;
        self
    }

    /// How the attention exchanges keys and values.
    pub fn comm_type(&self) -> CpCommType {
        self.comm_type
    }

    /// Makes the ring's side-stream group now under [`CpCommType::P2p`] (collective: every rank
    /// of the group calls it at the same point, before any CUDA graph capture); nothing to do
    /// under all-gather or once made.
    ///
    /// # Errors
    /// As [`ProcessGroup::with_side_stream`].
    pub fn prepare(&self) -> Result<()> {
        if self.comm_type == CpCommType::P2p && self.size() > 1 {
            self.ring_group()?;
        }
        Ok(())
    }

    /// The side-stream copy of the group the ring's transfers run on, made at the first call
    /// (collective, as [`ContextParallel::prepare`]).
    fn ring_group(&self) -> Result<Arc<ProcessGroup>> {
        if let Some(g) = self.ring.get() {
            return Ok(g.clone());
        }
        let made = Arc::new(self.group.with_side_stream()?);
        Ok(self.ring.get_or_init(|| made).clone())
    }

    /// One step of the ring: sends each of `send` to the next rank (`rank + 1 mod cp`) and
    /// receives into each of `recv` from the previous one, as one NCCL group on the ring's side
    /// stream (after the device stream's work issued so far), so that the caller's kernels run
    /// meanwhile; [`ContextParallel::ring_wait`] makes the device stream wait for it. Every rank
    /// passes tensors of the same shapes in the same order; the caller neither writes `send`
    /// nor touches `recv` (buffers of their own, not shared clones) until the wait.
    ///
    /// # Errors
    /// [`Error::Argument`] for `send` and `recv` of different counts or byte sizes; NCCL errors
    /// (and those of making the side-stream group at the first call).
    pub fn ring_exchange(&self, send: &[&Tensor], recv: &mut [&mut Tensor]) -> Result<()> {
        let same =
            send.len() == recv.len() && send.iter().zip(recv.iter()).all(|(s, r)| s.num_bytes() == r.num_bytes());
        if !same {
            return Err(Error::Argument {
                op: MODULE,
                message: "the ring sends and receives the same buffers: pass as many, of the same sizes".into(),
            });
        }
        let ring = self.ring_group()?;
        let (cp, r) = (self.size(), self.rank());
        let (next, prev) = ((r + 1) % cp, (r + cp - 1) % cp);
        ring.grouped(|| {
            for (s, d) in send.iter().zip(recv.iter_mut()) {
                ring.send(*s, next)?;
                ring.recv(&mut **d, prev)?;
            }
            Ok(())
        })
    }

    /// Makes the device stream wait for the ring's transfers issued so far (their received
    /// buffers readable, their sent ones writable again).
    ///
    /// # Errors
    /// Driver errors.
    pub fn ring_wait(&self) -> Result<()> {
        match self.ring.get() {
            Some(ring) => ring.wait(),
            None => Ok(()),
        }
    }

    /// The context-parallel group.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// Ranks the sequences are split over (`cp`).
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank, `0..cp`.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Tokens a chunk for sequences of `seq` tokens: `seq / (2·cp)`.
    ///
    /// # Errors
    /// [`Error::Shape`] when `seq` is 0 or not a multiple of `2·cp` (pad the sequences, as
    /// Megatron-LM requires).
    pub fn chunk_len(&self, seq: usize) -> Result<usize> {
        chunk_len(seq, self.size())
    }

    /// The token ranges of a sequence of `seq` tokens this rank holds, in the order it holds
    /// them: chunk `r` and chunk `2·cp − 1 − r`.
    ///
    /// # Errors
    /// As [`ContextParallel::chunk_len`].
    pub fn chunks(&self, seq: usize) -> Result<[Range<usize>; 2]> {
        chunks(seq, self.size(), self.rank())
    }

    /// The global positions of this rank's `2c` tokens of a sequence of `seq` (what RoPE
    /// rotates by): its chunks' ranges one after the other.
    ///
    /// # Errors
    /// As [`ContextParallel::chunk_len`].
    pub fn positions(&self, seq: usize) -> Result<Vec<usize>> {
        Ok(self.chunks(seq)?.into_iter().flatten().collect())
    }

    /// This rank's part `[2c, ...]` of a whole sequence-first tensor `x: [S, ...]` (copied): its
    /// two chunks stacked.
    ///
    /// # Errors
    /// As [`ContextParallel::chunk_len`] for `S`; allocation and copy failures.
    pub fn shard(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        let seq = x.shape().first().copied().unwrap_or(0);
        let [a, b] = self.chunks(seq)?;
        let parts = [x.narrow(dev, a)?, x.narrow(dev, b)?];
        stack(dev, &parts, &local_shape(x.shape(), self.chunk_len(seq)?))
    }

    /// The whole `[S, ...]` tensor from every rank's part `x: [2c, ...]` (an all-gather, then
    /// the chunks put in global order); the inverse of [`ContextParallel::shard`].
    ///
    /// # Errors
    /// [`Error::Shape`] for a first dim that is not even; NCCL, allocation and copy failures.
    pub fn unshard(&self, dev: &Device, x: &Tensor) -> Result<Tensor> {
        let local = x.shape().first().copied().unwrap_or(0);
        if local == 0 || local % 2 != 0 {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("a rank's part {:?} must hold two chunks of equal length", x.shape()),
            });
        }
        let mut gathered = Tensor::empty(dev, x.dtype(), &scaled_first(x.shape(), self.size()))?;
        self.group.all_gather(x, &mut gathered)?;
        self.group.wait()?;
        reorder(dev, &gathered, self.size(), local / 2, Order::RanksToGlobal)
    }

    /// The keys each of the rank's two query chunks attends over, as the end of a prefix of
    /// the global sequence (chunks of `c` tokens): with a causal mask chunk `r` sees `(r +
    /// 1)·c` keys and chunk `2·cp − 1 − r` sees `(2·cp − r)·c`; without one both see all
    /// `2·cp·c`.
    pub fn key_ends(&self, c: usize, causal: bool) -> [usize; 2] {
        let (cp, r) = (self.size(), self.rank());
        if causal {
            [(r + 1) * c, (2 * cp - r) * c]
        } else {
            [2 * cp * c; 2]
        }
    }

    /// Every rank's `x: [2c, ...]` (its two chunks of `c` tokens, sequence first) gathered and
    /// put in global order: `[S, ...]`, `S = 2·cp·c` (an all-gather on the group's stream, then
    /// the chunks copied into place).
    ///
    /// # Errors
    /// NCCL, allocation and copy failures.
    pub fn gather_sequence(&self, dev: &Device, x: &Tensor, c: usize) -> Result<Tensor> {
        let mut gathered = Tensor::empty(dev, x.dtype(), &scaled_first(x.shape(), self.size()))?;
        self.group.all_gather(x, &mut gathered)?;
        self.group.wait()?;
        reorder(dev, &gathered, self.size(), c, Order::RanksToGlobal)
    }

    /// The sum over the group of every rank's `x: [S, ...]` (global order, sequence first),
    /// this rank's two chunks of `c` tokens of it: `[2c, ...]`, viewed as `shape` (a
    /// reduce-scatter of the chunks put in rank order).
    ///
    /// # Errors
    /// [`Error::Shape`] for a `shape` of another element count; NCCL, allocation and copy
    /// failures.
    pub fn scatter_sequence(&self, dev: &Device, x: &Tensor, c: usize, shape: &[usize]) -> Result<Tensor> {
        let by_rank = reorder(dev, x, self.size(), c, Order::GlobalToRanks)?;
        let mut out = Tensor::empty(dev, x.dtype(), shape)?;
        self.group.reduce_scatter(&by_rank, &mut out, ReduceOp::Sum)?;
        self.group.wait()?;
        Ok(out)
    }
}

/// Which way [`reorder`] permutes the chunks.
#[derive(Debug, Clone, Copy)]
enum Order {
    /// From rank order (rank `r`'s chunks `r`, `2cp − 1 − r` at `2r`, `2r + 1`) to global order.
    RanksToGlobal,
    /// From global order to rank order.
    GlobalToRanks,
}

/// The global chunk held in slot `slot` of rank order (`2r + half`).
fn global_chunk(slot: usize, cp: usize) -> usize {
    let (r, half) = (slot / 2, slot % 2);
    if half == 0 {
        r
    } else {
        2 * cp - 1 - r
    }
}

/// `x: [2·cp·c, ...]` with its `2·cp` chunks of `c` rows permuted as `order` says.
fn reorder(dev: &Device, x: &Tensor, cp: usize, c: usize, order: Order) -> Result<Tensor> {
    let per_row: usize = x.shape()[1..].iter().product();
    let parts = x.reshape(&[x.numel(), 1])?.split_rows(dev, &vec![c * per_row; 2 * cp])?;
    let mut slots: Vec<Option<Tensor>> = vec![None; 2 * cp];
    for (slot, part) in parts.into_iter().enumerate() {
        let to = match order {
            Order::RanksToGlobal => global_chunk(slot, cp),
            Order::GlobalToRanks => (0..2 * cp).find(|&s| global_chunk(s, cp) == slot).unwrap_or(slot),
        };
        slots[to] = Some(part);
    }
    let parts: Vec<Tensor> =
        slots.into_iter().collect::<Option<_>>().ok_or_else(|| Error::internal(MODULE, "a chunk left no slot"))?;
    stack(dev, &parts, x.shape())
}

/// `parts` stacked along their first dim, viewed as `shape`.
pub(crate) fn stack(dev: &Device, parts: &[Tensor], shape: &[usize]) -> Result<Tensor> {
    let flat: Vec<Tensor> = parts.iter().map(|p| p.reshape(&[p.numel(), 1])).collect::<Result<_>>()?;
    Tensor::cat_rows(dev, &flat)?.reshape(shape)
}

/// `x: [n, ...]` followed by zero rows up to `[rows, ...]`.
pub(crate) fn pad_rows(dev: &Device, x: &Tensor, rows: usize) -> Result<Tensor> {
    let n = x.shape().first().copied().unwrap_or(0);
    let shape = with_first(x.shape(), rows);
    if n == rows {
        return Ok(x.clone());
    }
    let zeros = Tensor::zeros(dev, x.dtype(), &with_first(x.shape(), rows - n))?;
    stack(dev, &[x.clone(), zeros], &shape)
}

/// `shape` with its first dim set to `first`.
fn with_first(shape: &[usize], first: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    if let Some(d0) = out.first_mut() {
        *d0 = first;
    }
    out
}

/// `shape` with its first dim times `n`.
fn scaled_first(shape: &[usize], n: usize) -> Vec<usize> {
    with_first(shape, shape.first().copied().unwrap_or(0) * n)
}

/// A rank's `[2c, ...]` shape from a chunk's `[c, ...]` (or anything with the trailing dims).
pub(crate) fn local_shape(shape: &[usize], c: usize) -> Vec<usize> {
    with_first(shape, 2 * c)
}

/// `seq / (2·cp)`, see [`ContextParallel::chunk_len`].
fn chunk_len(seq: usize, cp: usize) -> Result<usize> {
    if seq == 0 || cp == 0 || seq % (2 * cp) != 0 {
        return Err(Error::Shape {
            op: MODULE,
            message: format!(
                "sequences of {seq} tokens over {cp} context-parallel ranks: the length must be a positive multiple \
                 of 2 · cp = {} (each rank holds two chunks); pad the sequences",
                2 * cp
            ),
        });
    }
    Ok(seq / (2 * cp))
}

/// Rank `r`'s chunks of a sequence of `seq` tokens over `cp` ranks.
fn chunks(seq: usize, cp: usize, r: usize) -> Result<[Range<usize>; 2]> {
    let c = chunk_len(seq, cp)?;
    let second = 2 * cp - 1 - r;
    Ok([r * c..(r + 1) * c, second * c..(second + 1) * c])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_balance_the_causal_work_over_the_ranks() {
        // cp = 2, 8 tokens: chunks of 2; rank 0 holds 0..2 and 6..8, rank 1 2..4 and 4..6.
        assert_eq!(chunks(8, 2, 0).unwrap(), [0..2, 6..8]);
        assert_eq!(chunks(8, 2, 1).unwrap(), [2..4, 4..6]);
        for cp in 1..=8 {
            let seq = 2 * cp * 3;
            let mut seen = vec![0; seq];
            let mut pairs = Vec::new();
            for r in 0..cp {
                let [a, b] = chunks(seq, cp, r).unwrap();
                // Causal (query, key) pairs of the rank's queries: query t sees t + 1 keys.
                pairs.push(a.clone().chain(b.clone()).map(|t| t + 1).sum::<usize>());
                for t in a.chain(b) {
                    seen[t] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "cp {cp}: every token on exactly one rank");
            assert!(pairs.windows(2).all(|w| w[0] == w[1]), "cp {cp}: equal work {pairs:?}");
        }
    }

    #[test]
    fn rank_order_and_global_order_are_inverse_permutations() {
        for cp in 1..=8 {
            let mut global: Vec<usize> = (0..2 * cp).map(|s| global_chunk(s, cp)).collect();
            global.sort_unstable();
            assert_eq!(global, (0..2 * cp).collect::<Vec<_>>(), "cp {cp}: a permutation");
        }
        // cp = 2: slots (r0 first, r0 second, r1 first, r1 second) hold chunks 0, 3, 1, 2.
        assert_eq!((0..4).map(|s| global_chunk(s, 2)).collect::<Vec<_>>(), [0, 3, 1, 2]);
    }

    #[test]
    fn lengths_that_do_not_split_into_two_chunks_a_rank_are_refused() {
        for (seq, cp) in [(0, 2), (6, 2), (7, 1), (10, 4)] {
            let err = chunk_len(seq, cp).unwrap_err().to_string();
            assert!(err.contains("multiple of 2 · cp"), "{seq}/{cp}: {err}");
        }
        assert_eq!(chunk_len(8192, 4).unwrap(), 1024);
    }
}
