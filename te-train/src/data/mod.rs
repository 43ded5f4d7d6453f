//! The training text: byte-level tokens (vocabulary 256) from any bytes, text file or directory
//! ([`Corpus`], [`read_text`]), a held-out validation split, and seeded random batches of
//! `[seq, batch]` windows sharded over the ranks of a data-parallel run ([`Batcher`]).
//!
//! ```
//! use te_train::data::{Batcher, Corpus};
//! let corpus = Corpus::from_text("to be or not to be, that is the question. ".repeat(20), 0.1);
//! let mut batches = Batcher::new(7, 16, 4);
//! let batch = batches.next(&corpus.train, "train")?;
//! assert_eq!((batch.ids.len(), batch.targets.len()), (16 * 4, 16 * 4));
//! # Ok::<(), te_train::data::DataError>(())
//! ```

mod batcher;
mod corpus;

pub use batcher::{Batch, Batcher};
pub use corpus::{read_text, Corpus};

use std::path::PathBuf;

/// Errors of the data pipeline; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Too little text for the requested windows.
    #[error(
        "the {split} split holds {len} bytes, fewer than one window of {need}; use more text or a shorter sequence \
         (GptConfig::seq_length, te train --seq-length)"
    )]
    TooShort {
        /// `train` or `validation`.
        split: &'static str,
        /// Bytes in the split.
        len: usize,
        /// Bytes one window needs (`seq + 1`).
        need: usize,
    },
}
