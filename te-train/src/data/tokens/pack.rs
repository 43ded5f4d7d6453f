//! `thd` packing: whole documents in rows of at most `seq` tokens, each row's sequences given by
//! `cu_seqlens` so that attention stays inside each document (TE's `qkv_format = "thd"`).
//!
//! Per epoch, the documents are taken in a seeded random order; a document longer than `seq` is
//! cut into pieces of `seq` tokens (the last one shorter), each piece its own sequence; the
//! pieces are placed greedily first-fit (each into the first row with room for it, a new row when
//! none has) — `O(pieces · log pieces)` through a max-tree over the rows' free space. Every token
//! of the split is in exactly one row of an epoch; rows are then served in order, epoch after
//! epoch (a new order each), `batch` rows a batch, sharded over data-parallel ranks as
//! [`Batcher::sharded`](crate::data::Batcher::sharded) shards windows.
//!
//! Within a row, a sequence's targets are its next tokens; its last token's target is
//! [`IGNORE_INDEX`] (the end of a document, or the cut before its next piece: no target crosses a
//! sequence boundary, as Hugging Face's `DataCollatorWithFlattening`); position ids restart at 0
//! for each sequence (RoPE). The row's tail after its last sequence is padding: id 0, target
//! [`IGNORE_INDEX`], position 0, outside `cu_seqlens` (TE's convention: `cu_seqlens` covers the
//! real tokens; a batch's `cu_seqlens_padded` gives each row's padding to its last sequence).

use std::ops::Range;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use te_models::IGNORE_INDEX;

use super::TokenDocs;
use crate::data::{DataError, Shard, TokenId};

/// The input id of padding (any id would do: padding is outside `cu_seqlens`).
const PAD_ID: i32 = 0;

/// One packed row of `seq` tokens: sequences (documents or pieces of them) one after another,
/// then padding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThdRow {
    /// Input ids, `[seq]` (padding: 0).
    pub ids: Vec<i32>,
    /// Each token's target, `[seq]`: the next token of its sequence, [`IGNORE_INDEX`] for a
    /// sequence's last token and for padding.
    pub targets: Vec<i32>,
    /// Each token's position in its sequence, from 0, `[seq]` (padding: 0).
    pub position_ids: Vec<i32>,
    /// The sequences' lengths as prefix sums, `[num_seqs + 1]`, from 0 to the row's real tokens
    /// (≤ `seq`); the padded tail is not covered.
    pub cu_seqlens: Vec<i32>,
    /// The longest sequence, in tokens.
    pub max_seqlen: usize,
}

impl ThdRow {
    /// The number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// The tokens that are not padding.
    pub fn real_tokens(&self) -> usize {
        self.cu_seqlens.last().map_or(0, |&t| t as usize)
    }
}

/// Packed rows one after another, as TE's `thd` attention takes them: token `t = row × seq + s`
/// (`[rows × seq]`, row-major — unlike the `[seq, batch]` of block batches, `thd` lays sequences
/// end to end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThdBatch {
    /// Input ids, `[rows × seq]`.
    pub ids: Vec<i32>,
    /// Targets, `[rows × seq]` ([`IGNORE_INDEX`] at each sequence's end and on padding).
    pub targets: Vec<i32>,
    /// Positions within each sequence, `[rows × seq]`.
    pub position_ids: Vec<i32>,
    /// Every sequence's length as prefix sums over the real tokens, `[num_seqs + 1]` i32 (TE's
    /// `cu_seqlens_q` = `cu_seqlens_kv`).
    pub cu_seqlens: Vec<i32>,
    /// Where each sequence starts in the `[rows × seq]` layout, then the layout's length,
    /// `[num_seqs + 1]` i32 (TE's `cu_seqlens_q_padded`): a row's padding belongs to its last
    /// sequence's slot.
    pub cu_seqlens_padded: Vec<i32>,
    /// The longest sequence, in tokens (TE's `max_seqlen_q`).
    pub max_seqlen: usize,
    /// The number of rows.
    pub rows: usize,
}

impl ThdBatch {
    /// The rows given, one after another.
    pub fn from_rows(rows: &[ThdRow]) -> ThdBatch {
        let mut b = ThdBatch {
            ids: Vec::new(),
            targets: Vec::new(),
            position_ids: Vec::new(),
            cu_seqlens: vec![0],
            cu_seqlens_padded: vec![],
            max_seqlen: 0,
            rows: rows.len(),
        };
        for row in rows {
            let (start, real) = (b.ids.len() as i32, *b.cu_seqlens.last().unwrap_or(&0));
            b.cu_seqlens_padded.extend(row.cu_seqlens[..row.num_seqs()].iter().map(|&c| start + c));
            b.cu_seqlens.extend(row.cu_seqlens.get(1..).unwrap_or_default().iter().map(|&c| real + c));
            b.ids.extend_from_slice(&row.ids);
            b.targets.extend_from_slice(&row.targets);
            b.position_ids.extend_from_slice(&row.position_ids);
            b.max_seqlen = b.max_seqlen.max(row.max_seqlen);
        }
        b.cu_seqlens_padded.push(b.ids.len() as i32);
        b
    }

    /// The number of sequences.
    pub fn num_seqs(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    /// The tokens that are not padding.
    pub fn real_tokens(&self) -> usize {
        self.cu_seqlens.last().map_or(0, |&t| t as usize)
    }
}

/// First fit over rows of `cap` free tokens: a max-tree of the free space, so the first row with
/// room is found in `O(log rows)`.
pub(super) struct FirstFit {
    cap: usize,
    leaves: usize,
    free: Vec<usize>,
}

impl FirstFit {
    /// Rows of `cap` tokens for `tokens` tokens. First fit leaves at most one row at most half
    /// full (a later row's pieces would have fit in an earlier half-empty one), so it needs
    /// fewer than `2 · tokens / cap + 1` rows; the tree grows if it ever runs out.
    pub(super) fn new(tokens: usize, cap: usize) -> FirstFit {
        let leaves = (2 * tokens.div_ceil(cap) + 1).next_power_of_two();
        let mut fit = FirstFit { cap, leaves, free: vec![0; 2 * leaves] };
        fit.free[leaves..].fill(cap);
        fit.rebuild();
        fit
    }

    fn rebuild(&mut self) {
        for i in (1..self.leaves).rev() {
            self.free[i] = self.free[2 * i].max(self.free[2 * i + 1]);
        }
    }

    /// Twice the rows, the new ones empty.
    fn grow(&mut self) {
        let leaves = 2 * self.leaves;
        let mut free = vec![0; 2 * leaves];
        free[leaves..leaves + self.leaves].copy_from_slice(&self.free[self.leaves..]);
        free[leaves + self.leaves..].fill(self.cap);
        (self.leaves, self.free) = (leaves, free);
        self.rebuild();
    }

    /// Places `len` tokens (at most `cap`) in the first row with room; returns it.
    pub(super) fn place(&mut self, len: usize) -> usize {
        while self.free[1] < len {
            self.grow();
        }
        let mut i = 1;
        while i < self.leaves {
            i = if self.free[2 * i] >= len { 2 * i } else { 2 * i + 1 };
        }
        self.free[i] -= len;
        let row = i - self.leaves;
        while i > 1 {
            i /= 2;
            self.free[i] = self.free[2 * i].max(self.free[2 * i + 1]);
        }
        row
    }
}

/// One epoch's packing: the pieces (ranges of the tokens) of each row, in placement order.
#[derive(Debug, Clone)]
struct Plan {
    pieces: Vec<Range<usize>>,
    /// `[rows + 1]` offsets into `pieces`.
    rows: Vec<usize>,
}

/// The seed of epoch `epoch` (epoch 0: `seed` itself).
fn epoch_seed(seed: u64, epoch: u64) -> u64 {
    seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Plan {
    fn new(docs: &TokenDocs, seq: usize, seed: u64) -> Plan {
        let mut order: Vec<usize> = (0..docs.num_documents()).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let offsets = docs.offsets();
        let pieces: Vec<Range<usize>> = order
            .iter()
            .flat_map(|&d| (offsets[d]..offsets[d + 1]).step_by(seq).map(move |s| s..(s + seq).min(offsets[d + 1])))
            .collect();
        let mut fit = FirstFit::new(docs.num_tokens(), seq);
        let row_of: Vec<usize> = pieces.iter().map(|p| fit.place(p.len())).collect();
        let n_rows = row_of.iter().max().map_or(0, |&r| r + 1);
        // Pieces grouped by row, each row's in the order placed (a counting sort).
        let mut rows = vec![0usize; n_rows + 1];
        for &r in &row_of {
            rows[r + 1] += 1;
        }
        for r in 0..n_rows {
            rows[r + 1] += rows[r];
        }
        let mut at = rows.clone();
        let mut grouped = vec![0..0; pieces.len()];
        for (p, &r) in pieces.into_iter().zip(&row_of) {
            grouped[at[r]] = p;
            at[r] += 1;
        }
        Plan { pieces: grouped, rows }
    }

    fn num_rows(&self) -> usize {
        self.rows.len() - 1
    }

    fn row(&self, docs: &TokenDocs, r: usize, seq: usize) -> ThdRow {
        let mut row = ThdRow {
            ids: Vec::with_capacity(seq),
            targets: Vec::with_capacity(seq),
            position_ids: Vec::with_capacity(seq),
            cu_seqlens: vec![0],
            max_seqlen: 0,
        };
        for p in &self.pieces[self.rows[r]..self.rows[r + 1]] {
            let tokens = &docs.tokens()[p.clone()];
            row.ids.extend(tokens.iter().map(|t| t.id()));
            row.targets.extend(tokens[1..].iter().map(|t| t.id()));
            row.targets.push(IGNORE_INDEX);
            row.position_ids.extend((0..tokens.len()).map(|s| s as i32));
            row.cu_seqlens.push(row.ids.len() as i32);
            row.max_seqlen = row.max_seqlen.max(tokens.len());
        }
        row.ids.resize(seq, PAD_ID);
        row.targets.resize(seq, IGNORE_INDEX);
        row.position_ids.resize(seq, 0);
        row
    }
}

fn check(docs: &TokenDocs, seq: usize, split: &'static str) -> Result<(), DataError> {
    if seq == 0 {
        return Err(DataError::Zero { name: "seq" });
    }
    if docs.num_tokens() == 0 {
        return Err(DataError::NoTokens { split });
    }
    Ok(())
}

/// Every row of one epoch of `thd` packing (the module's rules) of `docs` in rows of `seq`
/// tokens, the document order drawn with `seed`: what [`ThdPacker`] serves first, e.g. to
/// evaluate a validation split once.
///
/// # Errors
/// [`DataError::Zero`] for `seq` 0; [`DataError::NoTokens`] when `docs` holds no token (`split`
/// names it).
pub fn pack_thd(docs: &TokenDocs, seq: usize, seed: u64, split: &'static str) -> Result<Vec<ThdRow>, DataError> {
    check(docs, seq, split)?;
    let plan = Plan::new(docs, seq, seed);
    Ok((0..plan.num_rows()).map(|r| plan.row(docs, r, seq)).collect())
}

/// Batches of `batch` `thd` rows of `seq` tokens from a split, epoch after epoch, each epoch's
/// document order drawn from the seed (the module's rules): the same seed gives the same batches.
/// Sharded over the ranks of a data-parallel run ([`ThdPacker::sharded`]) like
/// [`Batcher::sharded`](crate::data::Batcher::sharded): rank `shard` reads rows `shard × batch ..
/// (shard + 1) × batch` of each global batch of `shards × batch` rows.
#[derive(Debug, Clone)]
pub struct ThdPacker<'a> {
    docs: &'a TokenDocs,
    seq: usize,
    batch: usize,
    seed: u64,
    shard: Shard,
    epoch: u64,
    plan: Plan,
    /// The next row of `plan`.
    row: usize,
}

impl<'a> ThdPacker<'a> {
    /// Batches of `batch` rows of `seq` tokens of `docs` (`split` names it in errors), drawn
    /// with `seed`.
    ///
    /// # Errors
    /// [`DataError::Zero`] for `seq` or `batch` 0; [`DataError::NoTokens`] for no tokens.
    pub fn new(
        docs: &'a TokenDocs,
        seed: u64,
        seq: usize,
        batch: usize,
        split: &'static str,
    ) -> Result<ThdPacker<'a>, DataError> {
        Self::sharded(docs, seed, seq, batch, 0, 1, split)
    }

    /// Rank `shard`'s part of the batches of `shards × batch` rows that
    /// [`ThdPacker::new`]`(docs, seed, seq, shards × batch)` serves. `shard` is taken modulo
    /// `shards` (at least 1).
    ///
    /// # Errors
    /// As [`ThdPacker::new`].
    pub fn sharded(
        docs: &'a TokenDocs,
        seed: u64,
        seq: usize,
        batch: usize,
        shard: usize,
        shards: usize,
        split: &'static str,
    ) -> Result<ThdPacker<'a>, DataError> {
        check(docs, seq, split)?;
        if batch == 0 {
            return Err(DataError::Zero { name: "batch" });
        }
        let plan = Plan::new(docs, seq, epoch_seed(seed, 0));
        Ok(ThdPacker { docs, seq, batch, seed, shard: Shard::new(shard, shards), epoch: 0, plan, row: 0 })
    }

    /// Packs the next epoch when this one's rows are used up.
    fn refill(&mut self) {
        if self.row == self.plan.num_rows() {
            self.epoch += 1;
            self.plan = Plan::new(self.docs, self.seq, epoch_seed(self.seed, self.epoch));
            self.row = 0;
        }
    }

    /// The next batch: this rank's `batch` rows, one after another.
    pub fn next_batch(&mut self) -> ThdBatch {
        let part = self.shard.part(self.batch);
        let mut rows = Vec::with_capacity(self.batch);
        for i in 0..self.shard.global(self.batch) {
            self.refill();
            if part.contains(&i) {
                rows.push(self.plan.row(self.docs, self.row, self.seq));
            }
            self.row += 1;
        }
        ThdBatch::from_rows(&rows)
    }

    /// Moves past `batches` batches without building them: the next batch is the one that many
    /// calls of [`ThdPacker::next_batch`] would have led to (a resumed run's data order).
    pub fn skip(&mut self, batches: u64) {
        let mut left = batches.saturating_mul(self.shard.global(self.batch) as u64);
        while left > 0 {
            self.refill();
            let step = left.min((self.plan.num_rows() - self.row) as u64);
            self.row += step as usize;
            left -= step;
        }
    }

    /// The epoch the next row comes from, from 0.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The rows of the current epoch's packing.
    pub fn rows_per_epoch(&self) -> usize {
        self.plan.num_rows()
    }
}
