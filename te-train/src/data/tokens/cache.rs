//! The token cache: one binary file of a tokenized dataset, named and keyed by the blake3 hash
//! of what decides its ids, written to a temporary file and renamed into place, checked whole
//! before it is trusted.
//!
//! Layout (every integer little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0..8 | magic `TETOKENS` |
//! | 8..12 | format version ([`CACHE_VERSION`]) |
//! | 12..16 | token dtype: 1 = `u32` |
//! | 16..48 | key: blake3 of the tokenizer, the sources and the document rule ([`key`]) |
//! | 48..56 | vocabulary size |
//! | 56..64 | documents `d` |
//! | 64..72 | tokens `n` |
//! | 72..104 | blake3 of the payload (the tokens and offsets as stored) |
//! | 104..128 | zero |
//! | 128.. | `n` tokens, `u32` |
//! | then | `d + 1` document offsets, `u64`: document `i` is tokens `offsets[i]..offsets[i + 1]` |
//!
//! A file is trusted only when its length is the header's, every field matches what the run
//! expects, the payload hashes to the header's checksum, every token is inside the vocabulary
//! and the offsets run from 0 to `n` without decreasing. The file is read whole into memory (a
//! memory map would share the file with whoever rewrites it; the tokens are read once, in 1 MiB
//! chunks, at about the speed of the disk).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::source::{SourceFile, SourceFormat};
use super::TokenDocs;
use crate::data::DataError;

/// The version of the token cache's format (and of the rule that makes a document's ids, see
/// [`TokenDataset`](super::TokenDataset)): a cache of another version is rebuilt.
pub const CACHE_VERSION: u32 = 1;

const MAGIC: [u8; 8] = *b"TETOKENS";
const HEADER: usize = 128;
const DTYPE_U32: u32 = 1;
/// Tokens per chunk read or written.
const CHUNK: usize = 1 << 18;

/// What a cached dataset's ids depend on, hashed: the format version and the document rule,
/// the tokenizer's [`fingerprint`](te_models::tokenizer::Tokenizer::fingerprint), then each
/// source file's path (as found), format and blake3 of its bytes, in order.
pub(super) fn key(tokenizer: &[u8; 32], rule: &str, files: &[(SourceFile, [u8; 32])]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(b"te-train token cache\0").update(&CACHE_VERSION.to_le_bytes());
    h.update(&(rule.len() as u64).to_le_bytes()).update(rule.as_bytes());
    h.update(tokenizer);
    h.update(&(files.len() as u64).to_le_bytes());
    for (file, hash) in files {
        let path = file.path.as_os_str().as_encoded_bytes();
        h.update(&(path.len() as u64).to_le_bytes()).update(path);
        h.update(&[match file.format {
            SourceFormat::Text => 0,
            SourceFormat::Jsonl => 1,
        }]);
        h.update(hash);
    }
    *h.finalize().as_bytes()
}

/// The cache file of `key` in `dir`: `tokens-<first 16 bytes of the key in hex>.bin`.
pub(super) fn path(dir: &Path, key: &[u8; 32]) -> PathBuf {
    let hex: String = key[..16].iter().map(|b| format!("{b:02x}")).collect();
    dir.join(format!("tokens-{hex}.bin"))
}

/// What [`load`] found.
pub(super) enum Loaded {
    /// No cache file.
    Missing,
    /// A file that cannot be trusted, and why.
    Invalid(String),
    /// The cached documents.
    Docs(TokenDocs),
}

fn header(key: &[u8; 32], vocab_size: usize, docs: &TokenDocs, checksum: &[u8; 32]) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[0..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&CACHE_VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&DTYPE_U32.to_le_bytes());
    h[16..48].copy_from_slice(key);
    h[48..56].copy_from_slice(&(vocab_size as u64).to_le_bytes());
    h[56..64].copy_from_slice(&(docs.num_documents() as u64).to_le_bytes());
    h[64..72].copy_from_slice(&(docs.num_tokens() as u64).to_le_bytes());
    h[72..104].copy_from_slice(checksum);
    h
}

/// Writes `docs` to `path` through a temporary file in the same directory, renamed into place
/// once complete and synced: an interrupted write leaves no cache file (at most a `.tokens-*.tmp`
/// file, removed when the process unwinds).
///
/// # Errors
/// [`DataError::CacheWrite`] when the directory cannot be created or the file written.
pub(super) fn write(path: &Path, key: &[u8; 32], vocab_size: usize, docs: &TokenDocs) -> Result<(), DataError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let fail = |source: std::io::Error| DataError::CacheWrite { path: path.to_path_buf(), source };
    std::fs::create_dir_all(dir).map_err(|source| DataError::CacheWrite { path: dir.to_path_buf(), source })?;
    let mut tmp = tempfile::Builder::new().prefix(".tokens-").suffix(".tmp").tempfile_in(dir).map_err(fail)?;
    let checksum = {
        let mut out = std::io::BufWriter::new(tmp.as_file_mut());
        out.write_all(&[0u8; HEADER]).map_err(fail)?;
        let mut h = blake3::Hasher::new();
        let mut buf = Vec::with_capacity(CHUNK * 8);
        for chunk in docs.tokens().chunks(CHUNK) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|t| t.to_le_bytes()));
            h.update(&buf);
            out.write_all(&buf).map_err(fail)?;
        }
        for chunk in docs.offsets().chunks(CHUNK) {
            buf.clear();
            buf.extend(chunk.iter().flat_map(|&o| (o as u64).to_le_bytes()));
            h.update(&buf);
            out.write_all(&buf).map_err(fail)?;
        }
        out.flush().map_err(fail)?;
        *h.finalize().as_bytes()
    };
    let file = tmp.as_file_mut();
    file.seek(SeekFrom::Start(0)).map_err(fail)?;
    file.write_all(&header(key, vocab_size, docs, &checksum)).map_err(fail)?;
    file.sync_all().map_err(fail)?;
    tmp.persist(path).map_err(|e| fail(e.error))?;
    Ok(())
}

fn u32_at(h: &[u8; HEADER], at: usize) -> u32 {
    u32::from_le_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]])
}

fn u64_at(h: &[u8; HEADER], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[at..at + 8]);
    u64::from_le_bytes(b)
}

/// The documents cached at `path` for `key`, or why the file cannot be trusted.
pub(super) fn load(path: &Path, key: &[u8; 32], vocab_size: usize) -> Loaded {
    match std::fs::File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Loaded::Missing,
        Err(e) => Loaded::Invalid(format!("cannot open it: {e}")),
        Ok(file) => match read(file, key, vocab_size) {
            Ok(docs) => Loaded::Docs(docs),
            Err(why) => Loaded::Invalid(why),
        },
    }
}

fn read(file: File, key: &[u8; 32], vocab_size: usize) -> Result<TokenDocs, String> {
    let len = file.metadata().map_err(|e| format!("cannot stat it: {e}"))?.len();
    if len < HEADER as u64 {
        return Err(format!("{len} bytes, shorter than the {HEADER}-byte header (a torn or foreign file)"));
    }
    let mut r = BufReader::with_capacity(CHUNK * 4, file);
    let mut h = [0u8; HEADER];
    r.read_exact(&mut h).map_err(|e| format!("cannot read the header: {e}"))?;
    if h[0..8] != MAGIC {
        return Err("not a token cache (bad magic)".into());
    }
    let version = u32_at(&h, 8);
    if version != CACHE_VERSION {
        return Err(format!("format version {version}, this build reads {CACHE_VERSION}"));
    }
    let dtype = u32_at(&h, 12);
    if dtype != DTYPE_U32 {
        return Err(format!("token dtype code {dtype}, expected {DTYPE_U32} (u32)"));
    }
    if h[16..48] != key[..] {
        return Err("its key is another dataset's".into());
    }
    let vocab = u64_at(&h, 48);
    if vocab != vocab_size as u64 {
        return Err(format!("vocabulary size {vocab}, the tokenizer has {vocab_size}"));
    }
    let (n_docs, n_tokens) = (u64_at(&h, 56), u64_at(&h, 64));
    let want = n_tokens
        .checked_mul(4)
        .zip(n_docs.checked_add(1).and_then(|d| d.checked_mul(8)))
        .and_then(|(t, o)| t.checked_add(o)?.checked_add(HEADER as u64));
    if want != Some(len) {
        return Err(format!(
            "{len} bytes, but its header counts {n_docs} documents of {n_tokens} tokens (truncated or corrupt)"
        ));
    }
    // The length matched, so these fit in memory as the file does.
    let (n_docs, n_tokens) = (n_docs as usize, n_tokens as usize);
    let mut hasher = blake3::Hasher::new();
    let mut buf = vec![0u8; CHUNK * 8];
    let mut tokens = Vec::with_capacity(n_tokens);
    while tokens.len() < n_tokens {
        let take = (n_tokens - tokens.len()).min(CHUNK) * 4;
        r.read_exact(&mut buf[..take]).map_err(|e| format!("cannot read its tokens: {e}"))?;
        hasher.update(&buf[..take]);
        tokens.extend(buf[..take].chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
    }
    let mut offsets = Vec::with_capacity(n_docs + 1);
    while offsets.len() < n_docs + 1 {
        let take = (n_docs + 1 - offsets.len()).min(CHUNK) * 8;
        r.read_exact(&mut buf[..take]).map_err(|e| format!("cannot read its offsets: {e}"))?;
        hasher.update(&buf[..take]);
        for b in buf[..take].chunks_exact(8) {
            let mut o = [0u8; 8];
            o.copy_from_slice(b);
            offsets.push(usize::try_from(u64::from_le_bytes(o)).unwrap_or(usize::MAX));
        }
    }
    if hasher.finalize().as_bytes()[..] != h[72..104] {
        return Err("its tokens do not match its checksum (corrupt)".into());
    }
    if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(format!("token {t} is outside the vocabulary of {vocab_size}"));
    }
    TokenDocs::from_parts(tokens, offsets).map_err(|why| format!("bad document offsets: {why}"))
}
