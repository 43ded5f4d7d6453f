//! The errors of the tokenizer layer: each names the file, field, token or id at fault and what
//! to change.

use std::path::PathBuf;

/// Errors of building a [`Tokenizer`](super::Tokenizer), encoding and decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file of a Hugging Face tokenizer is missing.
    #[error(
        "{path} is missing: a Hugging Face model directory holds tokenizer.json (tokenizer_config.json and generation_config.json are optional)"
    )]
    MissingFile {
        /// The file looked for.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A JSON file is malformed, or a field of it has the wrong type.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong (the field and the type expected).
        message: String,
    },
    /// The `tokenizers` crate refused a `tokenizer.json`.
    #[error("{path}: not a tokenizer.json the `tokenizers` crate (0.22) can load: {message}")]
    HfLoad {
        /// The file.
        path: PathBuf,
        /// What the `tokenizers` crate said.
        message: String,
    },
    /// The `tokenizers` crate failed while encoding or decoding, or refused a vocabulary built for it.
    #[error("tokenizers crate: {message}")]
    Hf {
        /// What the `tokenizers` crate said.
        message: String,
    },
    /// A vocabulary without tokens.
    #[error("the vocabulary is empty: GGUF `tokenizer.ggml.tokens` must list every token")]
    EmptyVocab,
    /// A per-token array whose length is not the number of tokens.
    #[error(
        "vocabulary: `{field}` has {got} entries but `tokenizer.ggml.tokens` has {expected}: per-token arrays are parallel to the tokens (or empty when the GGUF key is absent)"
    )]
    LengthMismatch {
        /// The array (`tokenizer.ggml.scores`, `tokenizer.ggml.token_type`).
        field: &'static str,
        /// The number of tokens.
        expected: usize,
        /// Its length.
        got: usize,
    },
    /// A token type outside GGUF's enumeration.
    #[error(
        "vocabulary: token {id} ({text:?}) has type {value}; GGUF token types are 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte (0 undefined)"
    )]
    BadTokenType {
        /// The token's id.
        id: u32,
        /// The token's text.
        text: String,
        /// The type found.
        value: i32,
    },
    /// A NaN score: the merge order of SentencePiece would be undefined.
    #[error("vocabulary: token {id} ({text:?}) has a NaN score: `tokenizer.ggml.scores` must be numbers")]
    NanScore {
        /// The token's id.
        id: u32,
        /// The token's text.
        text: String,
    },
    /// Two ids with the same text: text → id would be ambiguous (llama.cpp refuses it too).
    #[error("vocabulary: {text:?} is both token {first} and token {second}: every token's text must be unique")]
    DuplicateToken {
        /// The text.
        text: String,
        /// Its first id.
        first: u32,
        /// Its second id.
        second: u32,
    },
    /// A token of type byte (6) whose text is not `<0xXX>`.
    #[error("vocabulary: token {id} has type byte but its text is {text:?}, not `<0xXX>` (two hex digits)")]
    BadByteToken {
        /// The token's id.
        id: u32,
        /// Its text.
        text: String,
    },
    /// A BPE merge that is not two tokens separated by a space.
    #[error("vocabulary: merge {index} is {merge:?}, not two tokens separated by one space (`tokenizer.ggml.merges`)")]
    BadMerge {
        /// Its index in the merges.
        index: usize,
        /// The merge.
        merge: String,
    },
    /// A special token id outside the vocabulary.
    #[error(
        "{name} token id {id} is outside the vocabulary of {vocab_size} tokens: fix the id (GGUF `tokenizer.ggml.*_token_id`, `generation_config.json`) or leave it unset"
    )]
    SpecialIdOutOfRange {
        /// Which special token (`BOS`, `EOS`, `unknown`, `end-of-generation`).
        name: &'static str,
        /// The id.
        id: u32,
        /// The number of tokens.
        vocab_size: usize,
    },
    /// A special token named by text (`tokenizer_config.json`) that the vocabulary lacks.
    #[error("{path}: `{field}` is {text:?}, which is not a token of tokenizer.json")]
    SpecialNotInVocab {
        /// The configuration file.
        path: PathBuf,
        /// The field (`bos_token`, `eos_token`).
        field: &'static str,
        /// The token's text.
        text: String,
    },
    /// A flag asks for a special token the vocabulary does not name.
    #[error(
        "{flag} is set but the vocabulary has no {name} token: give its id (GGUF `tokenizer.ggml.{key}_token_id`, `tokenizer_config.json` `{key}_token`) or unset {flag}"
    )]
    MissingSpecial {
        /// `BOS` or `EOS`.
        name: &'static str,
        /// `bos` or `eos`.
        key: &'static str,
        /// The flag (`add_bos`, `add_eos`).
        flag: &'static str,
    },
    /// A GGUF file's tokenizer keys that are missing or of the wrong type (the reader's error
    /// names the file and the key).
    #[error(transparent)]
    Gguf(#[from] te_runtime::Error),
    /// A GGUF tokenizer variant this layer does not implement.
    #[error("unsupported tokenizer: {message}")]
    Unsupported {
        /// What is not supported and what is.
        message: String,
    },
    /// A character the vocabulary cannot represent: no token, no byte tokens, no unknown token.
    #[error(
        "cannot encode {text:?}: the vocabulary has no token for it, no byte tokens `<0xXX>` for its bytes and no unknown token"
    )]
    Unencodable {
        /// The character.
        text: String,
    },
    /// An id outside the vocabulary given to decode.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens: the ids do not come from this tokenizer's model")]
    IdOutOfRange {
        /// The id.
        id: u32,
        /// The number of tokens.
        vocab_size: usize,
    },
    /// The matcher of special tokens could not be built (too many or too long special tokens).
    #[error("cannot build the matcher of {count} special tokens: {message}")]
    SpecialMatcher {
        /// The number of special tokens.
        count: usize,
        /// What the `aho-corasick` crate said.
        message: String,
    },
}

/// Result of the tokenizer layer.
pub type TokenizerResult<T> = std::result::Result<T, TokenizerError>;
