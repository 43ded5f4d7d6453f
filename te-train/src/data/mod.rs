//! The training text and its batches.
//!
//! - Byte-level tokens (vocabulary 256) from any bytes, text file or directory ([`Corpus`],
//!   [`read_text`]) with a held-out validation split: what the byte-level GPT presets train on.
//! - A tokenizer's ids ([`TokenDataset`], module `tokens`): documents from text files,
//!   directories and `.jsonl` files, tokenized in parallel with a model's
//!   [`Tokenizer`](te_models::tokenizer::Tokenizer), EOS after each document, cached in a binary
//!   token file keyed by the tokenizer and the data; split by documents ([`TokenDocs::split`]);
//!   packed in fixed-length blocks across documents ([`Batcher`] over [`TokenDocs::tokens`]) or
//!   in TE's `thd` format ([`ThdPacker`]: rows of whole documents with `cu_seqlens`).
//! - Seeded random batches of `[seq, batch]` windows sharded over the ranks of a data-parallel
//!   run ([`Batcher`]), over bytes or token ids ([`TokenId`]).
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
mod tokens;

pub use batcher::{Batch, Batcher, TokenId};
pub use corpus::{read_text, Corpus};
pub use tokens::{
    document_ids, pack_thd, read_documents, source_files, CacheStatus, Document, SourceFile, SourceFormat, ThdBatch,
    ThdPacker, ThdRow, TokenDataset, TokenDocs, TokenSplit, CACHE_VERSION, DOCUMENT_EXTENSIONS,
};

pub(crate) use batcher::Shard;

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
        "the {split} split holds {len} tokens (bytes for the byte-level GPT), fewer than one window of {need}; \
         use more text or a shorter sequence (GptConfig::seq_length, te train --seq-length)"
    )]
    TooShort {
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split.
        len: usize,
        /// Tokens one window needs (`seq + 1`).
        need: usize,
    },
    /// The token cache could not be written.
    #[error("cannot write the token cache {path}: {source}; pass a writable cache directory")]
    CacheWrite {
        /// The cache directory or file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A size that must be positive is 0.
    #[error("{name} is 0; it must be at least 1")]
    Zero {
        /// What is 0: `seq`, `batch`.
        name: &'static str,
    },
    /// No data was given.
    #[error(
        "no data sources given: pass text files, .jsonl files or directories (of {exts} files)",
        exts = DOCUMENT_EXTENSIONS.join("/")
    )]
    NoSources,
    /// The sources hold no document.
    #[error(
        "no documents in {sources}: a directory contributes its {exts} files, a .jsonl file its non-blank lines",
        exts = DOCUMENT_EXTENSIONS.join("/")
    )]
    NoDocuments {
        /// The sources, as given.
        sources: String,
    },
    /// A line of a `.jsonl` file is not an object with a string `text`.
    #[error(
        "{path}:{line}: {message}; each line of a .jsonl file must be a JSON object with a string \"text\" \
         field (blank lines are skipped)"
    )]
    Jsonl {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// A text file is not UTF-8, which tokenizers take.
    #[error("{path}: not UTF-8 text (invalid bytes at byte {at}); convert it to UTF-8 (iconv) or leave it out")]
    NotUtf8 {
        /// The file.
        path: PathBuf,
        /// The offset of the first invalid byte.
        at: usize,
    },
    /// A document whose text gives no token.
    #[error("{origin}: the document is empty (its text encodes to no token); remove it or give it text")]
    EmptyDocument {
        /// The file, or `file:line` of a `.jsonl` file.
        origin: String,
    },
    /// The tokenizer has no end-of-sequence token to separate documents with.
    #[error(
        "the tokenizer has no EOS token, which ends every document; use the model's full tokenizer \
         (tokenizer_config.json `eos_token`, GGUF `tokenizer.ggml.eos_token_id`)"
    )]
    NoEos,
    /// The tokenizer's ids do not fit the model's `i32` inputs.
    #[error("the tokenizer's vocabulary of {vocab_size} ids does not fit i32 token ids")]
    VocabTooLarge {
        /// Its size.
        vocab_size: usize,
    },
    /// The tokenizer failed on a document.
    #[error("{origin}: {source}")]
    Tokenize {
        /// The file, or `file:line` of a `.jsonl` file.
        origin: String,
        /// The cause.
        source: te_models::tokenizer::TokenizerError,
    },
    /// A validation fraction outside `[0, 1]`.
    #[error("the validation fraction is {value}; it must be within [0, 1] (0.05 holds out 5% of the documents)")]
    BadFraction {
        /// The fraction given.
        value: f64,
    },
    /// Too few documents to hold some out.
    #[error(
        "{documents} document(s): a train / validation split by documents needs at least 2; add documents, \
         or cut the text into several (one per line of a .jsonl file, one per file of a directory)"
    )]
    TooFewDocuments {
        /// The documents there are.
        documents: usize,
    },
    /// A split with no token to pack.
    #[error("the {split} split holds no tokens; give it documents")]
    NoTokens {
        /// `train` or `validation`.
        split: &'static str,
    },
}
