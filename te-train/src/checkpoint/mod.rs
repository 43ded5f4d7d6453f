//! Checkpoints of a training run, on the GPU and on the CPU path alike.
//!
//! A checkpoint of a run is a directory `<checkpoint_dir>/<precision>/step-NNNNNNN/` holding
//! `model.safetensors` (weights and FP8 state, [`te_nn::checkpoint`]),
//! `optimizer.safetensors` ([`crate::optim::AdamW::save_state`]), `history.csv` (the loss
//! curve so far) and `trainer.toml` (the step, the dropout stream position, the settings the
//! run must be resumed with, and the model: its architecture, precision and FP8 recipe, what
//! `te generate` rebuilds it from, and for a fine-tuning run the pretrained decoder and the
//! packing ([`DecoderSection`]); [`Latest`]); `<checkpoint_dir>/<precision>/latest.toml`, a
//! copy of the newest complete one's `trainer.toml`, is what a resumed run starts from. It is
//! rewritten (atomically) only after the new directory is complete, and the checkpoint before
//! stays on disk, so a crash while saving never loses the last good checkpoint; copying an
//! older `trainer.toml` over it resumes from that one.
//!
//! A stop request ([`CheckpointOptions::stop`], set by a signal handler) ends the run after the
//! step in progress, with that step's checkpoint written; resuming continues it bit for bit
//! (weights, FP8 state, optimizer state, dropout stream, data order and loss curve restored).
//!
//! The files are the same on both paths (the CPU model writes the device model's format), so a
//! run started on the CPU can be sampled from anywhere.

mod checkpointer;
mod history;
mod latest;

pub(crate) use checkpointer::{Checkpointer, RunState};
pub use latest::{read_latest, DecoderSection, Latest, ModelSection};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Checkpointing of a run.
#[derive(Debug, Clone, Default)]
pub struct CheckpointOptions {
    /// Where checkpoints go (`<dir>/<precision>/...`); `None`: no checkpoints.
    pub dir: Option<PathBuf>,
    /// Save every this many steps (and at the end); 0: only at the end.
    pub interval: u64,
    /// Continue from the newest checkpoint in `dir` when there is one.
    pub resume: bool,
    /// Preemption: once this flag is set (`te train` sets it on SIGTERM or SIGINT), the run
    /// finishes the step in progress, writes its checkpoint (when `dir` is set) and returns
    /// [`crate::TrainError::Interrupted`]. Checked between steps, on both paths; in a
    /// data-parallel run a stop requested on any rank stops every rank after the same step.
    pub stop: Option<Arc<AtomicBool>>,
    /// The pretrained model a [`crate::Trainer::finetune`] run starts from (a `.gguf` file or a
    /// Hugging Face directory; absolute, `te train --model` canonicalizes it), recorded in its
    /// checkpoints' `[model.decoder]` ([`DecoderSection::source`]) so that `te generate
    /// --checkpoint` finds the tokenizer and the architecture. Not compared on resume (a moved
    /// file is the same model); ignored by GPT runs.
    pub model_source: Option<PathBuf>,
}

impl CheckpointOptions {
    /// Whether a stop was requested.
    pub fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed))
    }
}
