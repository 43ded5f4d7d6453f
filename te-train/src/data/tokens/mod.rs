//! Tokenized training data: documents read from text files, directories and `.jsonl` files
//! ([`source_files`], [`read_documents`]), tokenized in parallel with a model's [`Tokenizer`]
//! into one stream of ids with an EOS after each document ([`TokenDataset`]), cached in a binary
//! token file so a second run does not tokenize again (module `cache`), split into train and
//! validation by documents ([`TokenDocs::split`]), and packed either way:
//!
//! - **blocks**: windows of `seq + 1` tokens across document boundaries, inputs and targets
//!   `[seq, batch]` ([`Batcher`](crate::data::Batcher) over [`TokenDocs::tokens`], as the
//!   byte-level data; Hugging Face's `group_texts`, NeMo's and TE's pretraining recipes);
//! - **`thd`**: whole documents in rows of at most `seq` tokens with `cu_seqlens`, so that no
//!   token attends across documents (TE's `qkv_format = "thd"`; [`ThdPacker`], [`pack_thd`]).
//!
//! A document's ids are `[BOS] + encode(text) + [EOS]`: BOS when the tokenizer adds one
//! ([`Tokenizer::add_bos`]), the text encoded without special tokens (special tokens written in
//! the text are still matched), then the tokenizer's EOS ([`Tokenizer::eos_id`]) whether or not
//! it appends one itself. Concatenated, every document is followed by EOS (then the next one's
//! BOS), the separator the block packing trains across.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use te_models::tokenizer::{SpmVocab, Tokenizer};
//! use te_train::data::{Batcher, CacheStatus, ThdPacker, TokenDataset};
//!
//! // A tiny SentencePiece vocabulary: <pad> 0, <eos> 1, <bos> 2, then the 256 byte tokens.
//! let mut vocab = SpmVocab { bos: Some(2), eos: Some(1), add_space_prefix: Some(false), ..Default::default() };
//! vocab.tokens = ["<pad>", "<eos>", "<bos>"].map(String::from).to_vec();
//! vocab.tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
//! vocab.token_types = [vec![3; 3], vec![6; 256]].concat(); // control, byte
//! let tokenizer = Tokenizer::from_spm(vocab)?;
//!
//! let dir = tempfile::tempdir()?;
//! let data = dir.path().join("docs.jsonl");
//! std::fs::write(&data, "{\"text\": \"to be\"}\n{\"text\": \"or not to be\"}\n{\"text\": \"that is the question\"}\n")?;
//! let cache = dir.path().join("run");
//! let dataset = TokenDataset::build(&[&data], &tokenizer, Some(&cache))?;
//! assert_eq!(dataset.cache_status(), &CacheStatus::Written);
//! // [BOS] t o ␣ b e [EOS]: the space is ▁, three bytes.
//! assert_eq!(dataset.docs().document(0).map(<[u32]>::len), Some(9));
//! let again = TokenDataset::build(&[&data], &tokenizer, Some(&cache))?;
//! assert_eq!(again.cache_status(), &CacheStatus::Hit); // read back, not tokenized
//!
//! let split = dataset.docs().split(0.3, 0)?; // one document held out
//! let blocks = Batcher::new(7, 8, 2).next(split.train.tokens(), "train")?;
//! assert_eq!(blocks.ids.len(), 8 * 2); // [seq, batch]
//! let thd = ThdPacker::new(&split.train, 7, 16, 2, "train")?.next_batch();
//! assert_eq!(thd.ids.len(), 2 * 16); // rows one after another
//! assert_eq!(thd.cu_seqlens[0], 0); // then the running total of each document's tokens
//! # Ok(())
//! # }
//! ```

mod cache;
mod pack;
mod source;
#[cfg(test)]
mod tests;

pub use cache::CACHE_VERSION;
pub use pack::{pack_thd, ThdBatch, ThdPacker, ThdRow};
pub use source::{read_documents, source_files, Document, SourceFile, SourceFormat, DOCUMENT_EXTENSIONS};

use std::path::{Path, PathBuf};
use std::time::Instant;

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rayon::prelude::*;
use te_models::tokenizer::Tokenizer;

use super::DataError;

/// The rule that makes a document's ids, part of the cache key (a new rule, a new key).
const DOCUMENT_RULE: &str = "[BOS if add_bos] + encode(text, add_special = false) + [EOS]";

/// Documents of token ids as one stream: `tokens` holds them one after another, document `i` is
/// `tokens[offsets[i]..offsets[i + 1]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenDocs {
    tokens: Vec<u32>,
    /// `[documents + 1]`, from 0 to `tokens.len()`, not decreasing.
    offsets: Vec<usize>,
}

impl Default for TokenDocs {
    fn default() -> Self {
        Self { tokens: Vec::new(), offsets: vec![0] }
    }
}

impl TokenDocs {
    /// The documents given, in order.
    pub fn from_documents<D: AsRef<[u32]>>(docs: impl IntoIterator<Item = D>) -> TokenDocs {
        let mut out = TokenDocs::default();
        for d in docs {
            out.tokens.extend_from_slice(d.as_ref());
            out.offsets.push(out.tokens.len());
        }
        out
    }

    /// Checked parts: the offsets start at 0, do not decrease and end at the token count.
    fn from_parts(tokens: Vec<u32>, offsets: Vec<usize>) -> Result<TokenDocs, String> {
        if offsets.first() != Some(&0) || offsets.last() != Some(&tokens.len()) {
            return Err(format!("they must run from 0 to the {} tokens", tokens.len()));
        }
        if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
            return Err(format!("document {i} ends before it starts"));
        }
        Ok(TokenDocs { tokens, offsets })
    }

    /// Every token, document after document (what block packing reads).
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Where each document starts, then the token count: `[documents + 1]`.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The number of documents.
    pub fn num_documents(&self) -> usize {
        self.offsets.len() - 1
    }

    /// The number of tokens.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The ids of document `i`, `None` past the last.
    pub fn document(&self, i: usize) -> Option<&[u32]> {
        Some(&self.tokens[*self.offsets.get(i)?..*self.offsets.get(i + 1)?])
    }

    /// The documents in order.
    pub fn documents(&self) -> impl ExactSizeIterator<Item = &[u32]> + '_ {
        self.offsets.windows(2).map(|w| &self.tokens[w[0]..w[1]])
    }

    /// The train / validation split by whole documents: `round(documents × val_fraction)`
    /// documents, at least 1 and at most all but 1, drawn at random with `seed`, are held out;
    /// both sides keep the documents' order. The same documents and seed give the same split.
    ///
    /// # Errors
    /// [`DataError::BadFraction`] for a fraction outside `[0, 1]`;
    /// [`DataError::TooFewDocuments`] for fewer than 2 documents.
    pub fn split(&self, val_fraction: f64, seed: u64) -> Result<TokenSplit, DataError> {
        if !(0.0..=1.0).contains(&val_fraction) {
            return Err(DataError::BadFraction { value: val_fraction });
        }
        let n = self.num_documents();
        if n < 2 {
            return Err(DataError::TooFewDocuments { documents: n });
        }
        let held = ((n as f64 * val_fraction).round() as usize).clamp(1, n - 1);
        let mut order: Vec<usize> = (0..n).collect();
        order.shuffle(&mut StdRng::seed_from_u64(seed));
        let mut val_documents = order[..held].to_vec();
        val_documents.sort_unstable();
        let mut is_val = vec![false; n];
        for &i in &val_documents {
            is_val[i] = true;
        }
        let pick = |want: bool| {
            TokenDocs::from_documents(self.documents().zip(&is_val).filter(|(_, &v)| v == want).map(|(d, _)| d))
        };
        Ok(TokenSplit { train: pick(false), val: pick(true), val_documents })
    }
}

/// Train and validation documents ([`TokenDocs::split`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenSplit {
    /// The documents trained on.
    pub train: TokenDocs,
    /// The held-out documents.
    pub val: TokenDocs,
    /// The indices of the held-out documents in the dataset, ascending.
    pub val_documents: Vec<usize>,
}

/// Where a [`TokenDataset`]'s tokens came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheStatus {
    /// Tokenized, no cache directory given.
    Off,
    /// Read from the cache file: nothing was tokenized.
    Hit,
    /// Tokenized and written to the cache (there was no cache file for these inputs).
    Written,
    /// The cache file could not be trusted (`reason`: truncated, corrupt, another format);
    /// tokenized and written again.
    Rebuilt {
        /// What was wrong with the file.
        reason: String,
    },
}

/// Tokenized documents and where they came from.
#[derive(Debug, Clone)]
pub struct TokenDataset {
    docs: TokenDocs,
    vocab_size: usize,
    cache: CacheStatus,
    cache_path: Option<PathBuf>,
}

/// Errs unless `tokenizer` can make documents: an EOS, ids that fit `i32`.
fn check_tokenizer(tokenizer: &Tokenizer) -> Result<u32, DataError> {
    let vocab_size = tokenizer.vocab_size();
    if i32::try_from(vocab_size).is_err() {
        return Err(DataError::VocabTooLarge { vocab_size });
    }
    tokenizer.eos_id().ok_or(DataError::NoEos)
}

/// The ids of one document, `[BOS] + encode(text) + [EOS]` (see the module docs).
fn encode(tokenizer: &Tokenizer, eos: u32, text: &str, origin: &str) -> Result<Vec<u32>, DataError> {
    let body =
        tokenizer.encode(text, false).map_err(|source| DataError::Tokenize { origin: origin.to_string(), source })?;
    if body.is_empty() {
        return Err(DataError::EmptyDocument { origin: origin.to_string() });
    }
    let bos = tokenizer.bos_id().filter(|_| tokenizer.add_bos());
    let mut ids = Vec::with_capacity(body.len() + 2);
    ids.extend(bos);
    ids.extend(body);
    ids.push(eos);
    Ok(ids)
}

/// The ids of one document's text as a [`TokenDataset`] makes them: BOS when the tokenizer adds
/// one, the text encoded without special tokens, EOS.
///
/// # Errors
/// [`DataError::NoEos`] for a tokenizer without EOS; [`DataError::EmptyDocument`] for a text
/// that encodes to nothing; [`DataError::Tokenize`]; [`DataError::VocabTooLarge`].
pub fn document_ids(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, DataError> {
    let eos = check_tokenizer(tokenizer)?;
    encode(tokenizer, eos, text, "the text")
}

/// Tokenizes documents in parallel (rayon), the first failing document's error in document
/// order.
fn tokenize(tokenizer: &Tokenizer, docs: &[Document]) -> Result<TokenDocs, DataError> {
    let eos = check_tokenizer(tokenizer)?;
    let start = Instant::now();
    let ids: Vec<Result<Vec<u32>, DataError>> =
        docs.par_iter().map(|d| encode(tokenizer, eos, &d.text, &d.origin)).collect();
    let ids = ids.into_iter().collect::<Result<Vec<_>, _>>()?;
    let out = TokenDocs::from_documents(ids);
    tracing::info!(
        documents = out.num_documents(),
        tokens = out.num_tokens(),
        seconds = start.elapsed().as_secs_f64(),
        "tokenized"
    );
    Ok(out)
}

impl TokenDataset {
    /// The documents of `sources` (files and directories, see [`source_files`]) tokenized with
    /// `tokenizer` ([`document_ids`] each, in parallel). With `cache_dir`, the tokens are cached
    /// there in `tokens-<key>.bin` (see module `cache`: the key hashes the tokenizer's
    /// [`fingerprint`](Tokenizer::fingerprint), every source file's path and bytes, the format
    /// version and the document rule): a later build with the same inputs reads the file
    /// ([`CacheStatus::Hit`]) instead of tokenizing, any change of the data or the tokenizer
    /// gives another key and tokenizes again, and a file that fails its checks is rebuilt with a
    /// warning ([`CacheStatus::Rebuilt`]). The sources are read whole (to hash them) whether or
    /// not the cache holds them; their paths are keyed as given (the same data named from
    /// another working directory is tokenized once more). The ranks of a data-parallel run may
    /// build at once: each writes its own temporary file and renames it into place, atomically,
    /// with the same contents.
    ///
    /// # Errors
    /// [`DataError::NoSources`], [`DataError::Io`], [`DataError::NoDocuments`], and those of
    /// [`read_documents`] and [`document_ids`]; [`DataError::CacheWrite`] when the cache cannot
    /// be written.
    pub fn build<P: AsRef<Path>>(
        sources: &[P],
        tokenizer: &Tokenizer,
        cache_dir: Option<&Path>,
    ) -> Result<TokenDataset, DataError> {
        check_tokenizer(tokenizer)?;
        let vocab_size = tokenizer.vocab_size();
        let mut files = Vec::new();
        let mut contents = Vec::new();
        for file in source_files(sources)? {
            let bytes =
                std::fs::read(&file.path).map_err(|source| DataError::Io { path: file.path.clone(), source })?;
            files.push((file, *blake3::hash(&bytes).as_bytes()));
            contents.push(bytes);
        }
        let read = |files: Vec<(SourceFile, [u8; 32])>| -> Result<TokenDocs, DataError> {
            let mut docs = Vec::new();
            for ((file, _), bytes) in files.iter().zip(contents) {
                docs.extend(source::file_documents(file, bytes)?);
            }
            if docs.is_empty() {
                return Err(DataError::NoDocuments { sources: source::describe(sources) });
            }
            tokenize(tokenizer, &docs)
        };
        let Some(dir) = cache_dir else {
            return Ok(TokenDataset { docs: read(files)?, vocab_size, cache: CacheStatus::Off, cache_path: None });
        };
        let key = cache::key(&tokenizer.fingerprint(), DOCUMENT_RULE, &files);
        let path = cache::path(dir, &key);
        let cache = match cache::load(&path, &key, vocab_size) {
            cache::Loaded::Docs(docs) => {
                tracing::info!(path = %path.display(), documents = docs.num_documents(), tokens = docs.num_tokens(), "token cache read");
                return Ok(TokenDataset { docs, vocab_size, cache: CacheStatus::Hit, cache_path: Some(path) });
            }
            cache::Loaded::Missing => CacheStatus::Written,
            cache::Loaded::Invalid(reason) => {
                tracing::warn!(path = %path.display(), %reason, "token cache not trusted; tokenizing again");
                CacheStatus::Rebuilt { reason }
            }
        };
        let docs = read(files)?;
        cache::write(&path, &key, vocab_size, &docs)?;
        Ok(TokenDataset { docs, vocab_size, cache, cache_path: Some(path) })
    }

    /// Texts given in memory, one document each (origins `text 0`, `text 1`, …), tokenized as
    /// [`TokenDataset::build`] does, without a cache.
    ///
    /// # Errors
    /// [`DataError::NoDocuments`] for no texts; those of [`document_ids`].
    pub fn from_texts<S: AsRef<str> + Sync>(texts: &[S], tokenizer: &Tokenizer) -> Result<TokenDataset, DataError> {
        if texts.is_empty() {
            return Err(DataError::NoDocuments { sources: "the texts given".into() });
        }
        let docs: Vec<Document> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| Document { text: t.as_ref().to_string(), origin: format!("text {i}") })
            .collect();
        let docs = tokenize(tokenizer, &docs)?;
        Ok(TokenDataset { docs, vocab_size: tokenizer.vocab_size(), cache: CacheStatus::Off, cache_path: None })
    }

    /// The documents.
    pub fn docs(&self) -> &TokenDocs {
        &self.docs
    }

    /// The documents, the dataset dropped.
    pub fn into_docs(self) -> TokenDocs {
        self.docs
    }

    /// The tokenizer's vocabulary size: every id is below it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether the tokens came from the cache.
    pub fn cache_status(&self) -> &CacheStatus {
        &self.cache
    }

    /// The cache file, when a cache directory was given.
    pub fn cache_path(&self) -> Option<&Path> {
        self.cache_path.as_deref()
    }
}
