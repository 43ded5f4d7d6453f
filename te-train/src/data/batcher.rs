//! Seeded random batches of windows of a split, sharded over data-parallel ranks.

use super::DataError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::ops::Range;

/// A token a [`Batcher`] reads: a byte (the byte-level GPT's whole vocabulary) or a tokenizer's
/// `u32` id ([`TokenDocs`](super::TokenDocs)).
pub trait TokenId: Copy {
    /// The id as the model's `i32` input. Ids past `i32::MAX` (no vocabulary has them) saturate
    /// there rather than wrap to a negative id, which the loss would read as ignored.
    fn id(self) -> i32;
}

impl TokenId for u8 {
    fn id(self) -> i32 {
        i32::from(self)
    }
}

impl TokenId for u32 {
    fn id(self) -> i32 {
        i32::try_from(self).unwrap_or(i32::MAX)
    }
}

/// The data-parallel sharding rule, for every loader of this module: a global batch holds
/// `shards × batch` items (windows, packed rows) drawn as a single-GPU run of batch
/// `shards × batch` would draw them; rank `shard` reads items `shard × batch .. (shard + 1) ×
/// batch` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shard {
    /// This rank's shard, `0..shards`.
    shard: usize,
    /// Ranks the global batch is split over (at least 1).
    shards: usize,
}

impl Shard {
    /// Rank `shard` of `shards` (at least 1); `shard` is taken modulo `shards`.
    pub(crate) fn new(shard: usize, shards: usize) -> Shard {
        let shards = shards.max(1);
        Shard { shard: shard % shards, shards }
    }

    /// The items of a global batch of ranks of `batch` items each.
    pub(crate) fn global(self, batch: usize) -> usize {
        batch * self.shards
    }

    /// The items of a global batch this rank reads.
    pub(crate) fn part(self, batch: usize) -> Range<usize> {
        self.shard * batch..(self.shard + 1) * batch
    }
}

/// Random windows of `seq + 1` tokens from a split (bytes, or a tokenizer's ids: any
/// [`TokenId`]), from a seeded generator: the same seed gives the same batches (FP8 and BF16 runs
/// see the same data order). Sharded over the ranks of a data-parallel run
/// ([`Batcher::sharded`]), each rank reads its own part of every global batch.
#[derive(Debug, Clone)]
pub struct Batcher {
    rng: StdRng,
    seq: usize,
    batch: usize,
    shard: Shard,
}

/// One batch: token ids and next-token targets, both `[seq, batch]` row-major (sequence-major, as
/// the model's `[s, b, hidden]` layout).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Input tokens, `[seq, batch]`.
    pub ids: Vec<i32>,
    /// The tokens that follow them, `[seq, batch]`.
    pub targets: Vec<i32>,
}

impl Batcher {
    /// Batches of `batch` windows of `seq` tokens, drawn with `seed`.
    pub fn new(seed: u64, seq: usize, batch: usize) -> Batcher {
        Self::sharded(seed, seq, batch, 0, 1)
    }

    /// Rank `shard`'s part of the batches of `shards × batch` windows that
    /// [`Batcher::new`]`(seed, seq, shards × batch)` draws: windows `shard × batch ..
    /// (shard + 1) × batch` of each. A data-parallel run of `shards` ranks of `batch` sequences
    /// each thus sees the data of a single-GPU run of batch `shards × batch`, rank by rank.
    /// `shard` is taken modulo `shards` (at least 1).
    pub fn sharded(seed: u64, seq: usize, batch: usize, shard: usize, shards: usize) -> Batcher {
        Batcher { rng: StdRng::seed_from_u64(seed), seq, batch, shard: Shard::new(shard, shards) }
    }

    /// Errs on a window or batch of 0 or `data` shorter than one window; returns `seq + 1`.
    fn window<T>(&self, data: &[T], split: &'static str) -> Result<usize, DataError> {
        if self.seq == 0 || self.batch == 0 {
            return Err(DataError::Zero { name: if self.seq == 0 { "seq" } else { "batch" } });
        }
        let need = self.seq + 1;
        if data.len() < need {
            return Err(DataError::TooShort { split, len: data.len(), need });
        }
        Ok(need)
    }

    /// The next batch from `data` (`split` names it in errors).
    ///
    /// # Errors
    /// [`DataError::TooShort`] when `data` is shorter than one window; [`DataError::Zero`] for
    /// `seq` or `batch` 0.
    pub fn next<T: TokenId>(&mut self, data: &[T], split: &'static str) -> Result<Batch, DataError> {
        let need = self.window(data, split)?;
        let all: Vec<usize> =
            (0..self.shard.global(self.batch)).map(|_| self.rng.random_range(0..=data.len() - need)).collect();
        let starts = &all[self.shard.part(self.batch)];
        let mut ids = vec![0i32; self.seq * self.batch];
        let mut targets = vec![0i32; self.seq * self.batch];
        for (b, &s) in starts.iter().enumerate() {
            for t in 0..self.seq {
                ids[t * self.batch + b] = data[s + t].id();
                targets[t * self.batch + b] = data[s + t + 1].id();
            }
        }
        Ok(Batch { ids, targets })
    }

    /// Moves past `batches` batches of `data` without building them: the next batch is the one
    /// that many calls of [`Batcher::next`] would have led to (a resumed run's data order).
    ///
    /// # Errors
    /// [`DataError::TooShort`] as [`Batcher::next`].
    pub fn skip<T: TokenId>(&mut self, data: &[T], batches: u64, split: &'static str) -> Result<(), DataError> {
        let need = self.window(data, split)?;
        for _ in 0..batches * self.shard.global(self.batch) as u64 {
            self.rng.random_range(0..=data.len() - need);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_shifted_windows_and_reproducible() {
        let data: Vec<u8> = (0..200u8).collect();
        let (mut a, mut b) = (Batcher::new(7, 16, 4), Batcher::new(7, 16, 4));
        let x = a.next(&data, "train").unwrap();
        assert_eq!(x, b.next(&data, "train").unwrap());
        for i in 0..16 * 4 {
            assert_eq!(x.targets[i], x.ids[i] + 1, "targets are the next byte");
        }
        let (mut c, mut d) = (Batcher::new(3, 16, 4), Batcher::new(3, 16, 4));
        for _ in 0..5 {
            c.next(&data, "train").unwrap();
        }
        d.skip(&data, 5, "train").unwrap();
        assert_eq!(c.next(&data, "train").unwrap(), d.next(&data, "train").unwrap(), "skip = that many next calls");
        let e = Batcher::new(0, 300, 1).next(&data, "validation").unwrap_err();
        assert!(e.to_string().contains("validation") && e.to_string().contains("301"), "{e}");
        let e = Batcher::new(0, 300, 1).skip(&data, 1, "train").unwrap_err();
        assert!(matches!(e, DataError::TooShort { split: "train", len: 200, need: 301 }), "{e}");
        let e = Batcher::new(0, 0, 1).next(&data, "train").unwrap_err();
        assert!(matches!(e, DataError::Zero { name: "seq" }), "{e}");
        let e = Batcher::new(0, 4, 0).skip(&data, 1, "train").unwrap_err();
        assert!(matches!(e, DataError::Zero { name: "batch" }), "{e}");
    }

    /// The batches of a seed are pinned: the generator (rand's `StdRng`) and the window
    /// arithmetic must not change, or a resumed run would read other data than it started with.
    #[test]
    fn the_data_order_of_a_seed_is_pinned() {
        let data: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
        let mut b = Batcher::new(1234, 4, 2);
        let first = b.next(&data, "train").unwrap();
        // Windows at bytes 56 and 117, then 224 and 168 (`[seq, batch]`: the two interleave).
        assert_eq!(first.ids, [56, 117, 57, 118, 58, 119, 59, 120]);
        assert_eq!(b.next(&data, "train").unwrap().ids, [224, 168, 225, 169, 226, 170, 227, 171]);
        let again = Batcher::new(1234, 4, 2).next(&data, "train").unwrap();
        assert_eq!(first, again);
        let other = Batcher::new(1235, 4, 2).next(&data, "train").unwrap();
        assert_ne!(first, other, "another seed, other windows");
    }

    #[test]
    fn shards_of_a_data_parallel_run_are_the_parts_of_the_global_batch() {
        let data: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let (seq, b, world) = (8, 3, 2);
        let mut whole = Batcher::new(11, seq, b * world);
        let mut ranks: Vec<Batcher> = (0..world).map(|r| Batcher::sharded(11, seq, b, r, world)).collect();
        // Resumed ranks skip whole global batches.
        let mut late = Batcher::sharded(11, seq, b, 1, world);
        late.skip(&data, 2, "train").unwrap();
        for step in 0..3 {
            let g = whole.next(&data, "train").unwrap();
            let parts: Vec<Batch> = ranks.iter_mut().map(|r| r.next(&data, "train").unwrap()).collect();
            for (r, part) in parts.iter().enumerate() {
                for t in 0..seq {
                    for i in 0..b {
                        let want = g.ids[t * b * world + r * b + i];
                        assert_eq!(part.ids[t * b + i], want, "step {step} rank {r} token {t} sequence {i}");
                    }
                }
            }
            if step == 2 {
                assert_eq!(late.next(&data, "train").unwrap(), parts[1], "skip counts global batches");
            }
        }
    }
}
