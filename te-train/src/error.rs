//! The errors of a training run ([`crate::Trainer`]).

use crate::data::DataError;
use std::path::PathBuf;

/// Errors of a training run; each says what was wrong and what to change.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The data pipeline (unreadable text, a split shorter than one window).
    #[error(transparent)]
    Data(#[from] DataError),
    /// The runtime (device, kernels, modules, checkpoint files, an invalid FP8 recipe).
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
    /// A setting of [`crate::TrainConfig`] out of its range ([`crate::TrainConfig::validate`]).
    #[error("invalid training configuration: {field}: {message}")]
    Config {
        /// The field of [`crate::TrainConfig`].
        field: &'static str,
        /// What is wrong and what to set instead.
        message: String,
    },
    /// The backend cannot run what was asked (data or tensor parallelism on the CPU).
    #[error("{message}")]
    Unsupported {
        /// What is not supported and what to do instead.
        message: String,
    },
    /// Writing results.
    #[error("cannot write {path}: {source}")]
    Output {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A checkpoint that cannot be resumed from.
    #[error("cannot resume from {path}: {message}")]
    Resume {
        /// The checkpoint's `latest.toml` or file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A stop was requested ([`crate::CheckpointOptions::stop`]: SIGTERM or SIGINT to `te
    /// train`): the run finished `step` and wrote `checkpoint` (none without a checkpoint
    /// directory).
    #[error("stopped on request after step {step}: {}", match checkpoint {
        Some(c) => format!("checkpoint written at {}; continue with --resume (CheckpointOptions::resume)", c.display()),
        None => "no checkpoint (--no-checkpoint: CheckpointOptions::dir is None)".into(),
    })]
    Interrupted {
        /// The last step completed.
        step: u64,
        /// The checkpoint of that step.
        checkpoint: Option<PathBuf>,
    },
    /// The configuration needs more host memory than the machine has available (the CPU path).
    #[error(
        "the CPU path needs about {} MiB for this configuration and {} MiB are available: lower --seq-length \
         (GptConfig::seq_length; the attention probabilities grow with its square) or --batch (TrainConfig::batch)",
        needed >> 20,
        available >> 20
    )]
    HostMemory {
        /// The estimate in bytes.
        needed: u64,
        /// `MemAvailable` in bytes.
        available: u64,
    },
    /// A NaN or infinite loss, gradient norm or FP8 scaling state: the run stops.
    #[error("step {step}: {message}")]
    NonFinite {
        /// The optimizer step.
        step: u64,
        /// What was not finite, what happened to the weights, where the last good checkpoint
        /// is and what to change.
        message: String,
    },
}
