//! Where the GPU loop's batches come from: windows of `seq` tokens across documents
//! ([`Batcher`]: the byte-level GPT, and fine-tuning with [`Pack::Blocks`]) or rows of whole
//! documents packed with `cu_seqlens` ([`ThdPacker`], TE's `thd`: [`Pack::Thd`]), and the
//! forward each kind of batch takes.

use super::lm::TrainLm;
use crate::data::{Batcher, DataError, ThdPacker, TokenDocs, TokenId};
use crate::error::TrainError;
use crate::TrainConfig;
use std::sync::Arc;
use te_models::decoder::train::Packing;
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

    /// This rank's batches of the training split drawn with `seed`.
    pub(super) fn train(
        &self,
        seed: u64,
        batch: usize,
        (rank, world): (usize, usize),
    ) -> Result<Source<'a, T>, TrainError> {
        Ok(match *self {
            Tokens::Windows { train, seq, .. } => Source::Windows {
                batcher: Box::new(Batcher::sharded(seed, seq, batch, rank, world)),
                data: train,
                split: "train",
            },
            Tokens::Thd { train, seq, .. } => {
                Source::Thd(ThdPacker::sharded(train, seed, seq, batch, rank, world, "train")?)
            }
        })
    }

    /// The fixed validation batches of `cfg` (the same for every evaluation).
    pub(super) fn val(&self, cfg: &TrainConfig) -> Result<Source<'a, T>, TrainError> {
        Ok(match *self {
            Tokens::Windows { val, seq, .. } => {
                Source::Windows { batcher: Box::new(cfg.eval_batcher(seq)), data: val, split: "validation" }
            }
            Tokens::Thd { val, seq, .. } => {
                Source::Thd(ThdPacker::new(val, cfg.data_seed ^ 0x5eed, seq, cfg.batch, "validation")?)
            }
        })
    }
}

/// A sequence of batches of one split.
pub(super) enum Source<'a, T> {
    /// Windows of `data`.
    Windows { batcher: Box<Batcher>, data: &'a [T], split: &'static str },
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

fn usizes(v: &[i32]) -> Vec<usize> {
    v.iter().map(|&x| x.max(0) as usize).collect()
}

impl<T: TokenId> Source<'_, T> {
    /// The next batch of `batch` rows of `seq` tokens, uploaded.
    pub(super) fn next(&mut self, dev: &Arc<Device>, seq: usize, batch: usize) -> Result<StepBatch, TrainError> {
        match self {
            Source::Windows { batcher, data, split } => {
                let b = batcher.next(data, split)?;
                let ids = TokenIds::from_host(dev, &[seq, batch], &b.ids)?;
                let targets = TokenIds::from_host(dev, &[seq, batch], &b.targets)?;
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
            Source::Windows { batcher, data, split } => Ok(Some(batcher.next(data, split)?)),
            Source::Thd(_) => Ok(None),
        }
    }

    /// Moves past `batches` batches (a resumed run's data order).
    pub(super) fn skip(&mut self, batches: u64) -> Result<(), DataError> {
        match self {
            Source::Windows { batcher, data, split } => batcher.skip(data, batches, split),
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
