//! Where the GPU loop's batches come from: windows of `seq` tokens across documents
//! ([`Batcher`]: the byte-level GPT, and fine-tuning with [`Pack::Blocks`]) or rows of whole
//! documents packed with `cu_seqlens` ([`ThdPacker`], TE's `thd`: [`Pack::Thd`]), and the
//! forward each kind of batch takes.

use super::lm::TrainLm;
use crate::data::{Batcher, DataError, ThdPacker, TokenDocs, TokenId};
use crate::error::TrainError;
use crate::TrainConfig;
use std::sync::Arc;
use te_models::decoder::train::{shard_rows, Packing};
use te_models::gpt::{GptLoss, MicroBatch};
use te_nn::modules::TokenIds;
use te_runtime::Device;

/// How fine-tuning packs its documents into batches (`te train --pack`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Pack {
    /// Windows of `seq` tokens across document boundaries (EOS between documents), `batch` of
    /// them a batch: the plain way, every token attends to the window's earlier tokens.
    #[default]
    Blocks,
    /// TE's `thd`: rows of `seq` tokens filled with whole documents (longer ones split), padded
    /// at the end, each document attending within itself, its positions from 0.
    Thd,
}

impl Pack {
    /// `blocks` or `thd`.
    pub fn name(self) -> &'static str {
        match self {
            Pack::Blocks => "blocks",
            Pack::Thd => "thd",
        }
    }

    /// The packing [`Pack::name`] names (`te train --pack`, a checkpoint's `[model.decoder]`).
    ///
    /// # Errors
    /// Another name, with the ones expected.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "blocks" => Ok(Pack::Blocks),
            "thd" => Ok(Pack::Thd),
            p => Err(format!("packing `{p}`: expected blocks or thd")),
        }
    }
}

/// A run's train and validation data and its row length.
pub(super) enum Tokens<'a, T> {
    /// Token ids of each split, read in windows.
    Windows { train: &'a [T], val: &'a [T], seq: usize },
    /// Documents of each split, packed in `thd` rows.
    Thd { train: &'a TokenDocs, val: &'a TokenDocs, seq: usize },
}

impl<'a, T: TokenId> Tokens<'a, T> {
    /// Tokens a row (a window or a packed row).
    pub(super) fn seq(&self) -> usize {
        match self {
            Tokens::Windows { seq, .. } | Tokens::Thd { seq, .. } => *seq,
        }
    }

    /// Whether the batches are windows of one shape (not packed rows).
    pub(super) fn is_windows(&self) -> bool {
        matches!(self, Tokens::Windows { .. })
    }

    /// This rank's batches of the training split drawn with `seed`: data rank `rank` of
    /// `world`'s shard, and of its windows context-parallel rank `cp.0` of `cp.1`'s chunks
    /// (`(0, 1)`: whole windows).
    pub(super) fn train(
        &self,
        seed: u64,
        batch: usize,
        (rank, world): (usize, usize),
        cp: (usize, usize),
    ) -> Result<Source<'a, T>, TrainError> {
        Ok(match *self {
            Tokens::Windows { train, seq, .. } => Source::Windows {
                batcher: Box::new(Batcher::sharded(seed, seq, batch, rank, world)),
                data: train,
                split: "train",
                cp,
            },
            Tokens::Thd { train, seq, .. } => {
                Source::Thd(ThdPacker::sharded(train, seed, seq, batch, rank, world, "train")?)
            }
        })
    }

    /// The fixed validation batches of `cfg` (the same for every evaluation), of their windows
    /// context-parallel rank `cp.0` of `cp.1`'s chunks.
    pub(super) fn val(&self, cfg: &TrainConfig, cp: (usize, usize)) -> Result<Source<'a, T>, TrainError> {
        Ok(match *self {
            Tokens::Windows { val, seq, .. } => {
                Source::Windows { batcher: Box::new(cfg.eval_batcher(seq)), data: val, split: "validation", cp }
            }
            Tokens::Thd { val, seq, .. } => {
                Source::Thd(ThdPacker::new(val, cfg.data_seed ^ 0x5eed, seq, cfg.batch, "validation")?)
            }
        })
    }
}

/// A sequence of batches of one split.
pub(super) enum Source<'a, T> {
    /// Windows of `data`; with context parallelism (`cp`: this rank and the group's size, above
    /// 1) this rank's two chunks of each.
    Windows { batcher: Box<Batcher>, data: &'a [T], split: &'static str, cp: (usize, usize) },
    /// Packed rows.
    Thd(ThdPacker<'a>),
}

/// One batch on the device: `[seq, batch]` windows, or `[tokens, 1]` packed rows with their
/// tables.
pub(super) struct StepBatch {
    ids: TokenIds,
    targets: TokenIds,
    /// Positions, `cu_seqlens` and `cu_seqlens_padded` of packed rows.
    packing: Option<[Vec<usize>; 3]>,
}

/// Context-parallel rank `rank` of `cp`'s part of the `[seq, batch]` windows `b`: its chunks
/// `rank` and `2·cp − 1 − rank` of every window, `[seq / cp, batch]` (`b` itself for `cp` 1).
///
/// # Errors
/// [`TrainError::Config`] for a `seq` that is not a multiple of `2·cp`, naming `--seq-length`.
pub(super) fn context_part(
    b: crate::data::Batch,
    (seq, batch): (usize, usize),
    (rank, cp): (usize, usize),
) -> Result<crate::data::Batch, TrainError> {
    if cp <= 1 {
        return Ok(b);
    }
    check_context_seq(seq, cp)?;
    let part = |v: &[i32]| shard_rows(v, (seq, batch), (rank, cp));
    Ok(crate::data::Batch { ids: part(&b.ids)?, targets: part(&b.targets)? })
}

/// A window length context parallelism over `cp` ranks splits: a positive multiple of `2·cp`.
///
/// # Errors
/// [`TrainError::Config`] naming `--seq-length` and the lengths that work.
pub fn check_context_seq(seq: usize, cp: usize) -> Result<(), TrainError> {
    if cp > 1 && (seq == 0 || seq % (2 * cp) != 0) {
        let below = seq / (2 * cp) * (2 * cp);
        return Err(TrainError::Config {
            field: "seq_length",
            message: format!(
                "--seq-length {seq} with --context-parallel {cp}: each rank holds two chunks of every sequence, so the \
                 length must be a multiple of 2 · {cp} = {} (e.g. {} or {})",
                2 * cp,
                below.max(2 * cp),
                below + 2 * cp
            ),
        });
    }
    Ok(())
}

fn usizes(v: &[i32]) -> Vec<usize> {
    v.iter().map(|&x| x.max(0) as usize).collect()
}

impl<T: TokenId> Source<'_, T> {
    /// The next batch of `batch` rows of `seq` tokens, uploaded (with context parallelism
    /// this rank's `[seq / cp, batch]` part of it).
    pub(super) fn next(&mut self, dev: &Arc<Device>, seq: usize, batch: usize) -> Result<StepBatch, TrainError> {
        match self {
            Source::Windows { batcher, data, split, cp } => {
                let b = context_part(batcher.next(data, split)?, (seq, batch), *cp)?;
                let rows = seq / cp.1;
                let ids = TokenIds::from_host(dev, &[rows, batch], &b.ids)?;
                let targets = TokenIds::from_host(dev, &[rows, batch], &b.targets)?;
                Ok(StepBatch { ids, targets, packing: None })
            }
            Source::Thd(packer) => {
                let b = packer.next_batch();
                let n = b.ids.len();
                let ids = TokenIds::from_host(dev, &[n, 1], &b.ids)?;
                let targets = TokenIds::from_host(dev, &[n, 1], &b.targets)?;
                let packing = [usizes(&b.position_ids), usizes(&b.cu_seqlens), usizes(&b.cu_seqlens_padded)];
                Ok(StepBatch { ids, targets, packing: Some(packing) })
            }
        }
    }

    /// The next batch of windows on the host (a CUDA graph's static batch is refilled from
    /// it: [`StepBatch::refill`]); `None` for packed rows, whose tables vary from batch to
    /// batch.
    ///
    /// # Errors
    /// Data errors.
    pub(super) fn next_windows(&mut self) -> Result<Option<crate::data::Batch>, TrainError> {
        match self {
            Source::Windows { batcher, data, split, cp: (_, 1) } => Ok(Some(batcher.next(data, split)?)),
            // Graphs are not captured with context parallelism (a parallel run steps eagerly).
            Source::Windows { .. } => Ok(None),
            Source::Thd(_) => Ok(None),
        }
    }

    /// Moves past `batches` batches (a resumed run's data order).
    pub(super) fn skip(&mut self, batches: u64) -> Result<(), DataError> {
        match self {
            Source::Windows { batcher, data, split, .. } => batcher.skip(data, batches, split),
            Source::Thd(packer) => {
                packer.skip(batches);
                Ok(())
            }
        }
    }
}

impl StepBatch {
    /// A batch of `[seq, batch]` windows uploaded into buffers of its own, the ids with their
    /// grouping for the embedding's backward: the static input of a CUDA graph, which
    /// [`StepBatch::refill`] overwrites in place before each replay.
    ///
    /// # Errors
    /// Shape, allocation and copy failures.
    pub(super) fn windows(
        dev: &Arc<Device>,
        seq: usize,
        batch: usize,
        b: &crate::data::Batch,
    ) -> te_runtime::Result<Self> {
        let ids = TokenIds::from_host(dev, &[seq, batch], &b.ids)?.with_grad_index(dev)?;
        let targets = TokenIds::from_host(dev, &[seq, batch], &b.targets)?;
        Ok(StepBatch { ids, targets, packing: None })
    }

    /// Overwrites the ids and targets in place with `b`'s (the same shape): the buffers keep
    /// their addresses. A host upload: not inside a capture.
    ///
    /// # Errors
    /// [`te_runtime::Error::Shape`] for another number of tokens; [`te_runtime::Error::Argument`]
    /// while a context still holds the buffers; copy failures.
    pub(super) fn refill(&mut self, dev: &Device, b: &crate::data::Batch) -> te_runtime::Result<()> {
        self.ids.update(dev, &b.ids)?;
        self.targets.update(dev, &b.targets)
    }

    /// `model`'s loss forward of this batch.
    ///
    /// # Errors
    /// The model's.
    pub(super) fn forward<M: TrainLm>(
        &self,
        model: &mut M,
        micro: MicroBatch,
    ) -> te_runtime::Result<(GptLoss, M::Ctx)> {
        match &self.packing {
            None => model.forward_loss_with(&self.ids, &self.targets, micro),
            Some([position_ids, cu_seqlens, padded]) => {
                let packing = Packing { position_ids, cu_seqlens, cu_seqlens_padded: Some(padded) };
                model.forward_loss_thd(&self.ids, &self.targets, packing, micro)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::Batch;

    /// Each context-parallel rank takes its two chunks of every window of the batch; the ranks'
    /// parts are the whole batch; `--seq-length` that does not split is refused naming it.
    #[test]
    fn context_parallel_ranks_take_their_chunks_of_each_window() {
        let (seq, batch) = (8, 2);
        let b = Batch { ids: (0..16).collect(), targets: (1..17).collect() };
        let r0 = context_part(b.clone(), (seq, batch), (0, 2)).unwrap();
        let r1 = context_part(b.clone(), (seq, batch), (1, 2)).unwrap();
        // Rows 0, 1, 6, 7 and rows 2..6 of the [8, 2] batch.
        assert_eq!(r0.ids, [0, 1, 2, 3, 12, 13, 14, 15]);
        assert_eq!(r0.targets, [1, 2, 3, 4, 13, 14, 15, 16]);
        assert_eq!(r1.ids, [4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(context_part(b.clone(), (seq, batch), (0, 1)).unwrap(), b);
        let e = context_part(b, (seq, batch), (0, 3)).unwrap_err().to_string();
        assert!(e.contains("--seq-length 8 with --context-parallel 3") && e.contains("multiple of 2 · 3 = 6"), "{e}");
        assert!(check_context_seq(8192, 4).is_ok() && check_context_seq(100, 1).is_ok());
        let e = check_context_seq(100, 4).unwrap_err().to_string();
        assert!(e.contains("(e.g. 96 or 104)"), "{e}");
    }
}
