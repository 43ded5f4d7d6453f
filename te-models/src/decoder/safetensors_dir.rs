//! The safetensors files of a Hugging Face directory: `model.safetensors`, or the shards that
//! `model.safetensors.index.json` lists (its `weight_map`: tensor name → file). Headers are read
//! first (names, dtypes, shapes: cheap, so that every problem is reported before any data is
//! converted), then the data of the tensors asked for, file by file, widened to f32
//! ([`te_runtime::numerics::decode`]).

use super::{read_file, DecoderError, DecoderResult};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use te_codegen::DType;

/// The index of a sharded checkpoint.
pub(super) const INDEX: &str = "model.safetensors.index.json";
/// The single file of an unsharded one.
pub(super) const SINGLE: &str = "model.safetensors";
/// The largest header read (the format's own limit).
const MAX_HEADER: u64 = 100_000_000;

/// One tensor's header entry.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Entry {
    /// Index into [`Checkpoint::files`].
    pub file: usize,
    /// The dtype as the header spells it (`F32`, `BF16`, `I8`...).
    pub dtype: String,
    /// Shape.
    pub shape: Vec<usize>,
}

impl Entry {
    /// The dtype when it is one the import widens (F32, BF16, F16).
    pub fn float_dtype(&self) -> Option<DType> {
        match self.dtype.as_str() {
            "F32" => Some(DType::F32),
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            _ => None,
        }
    }
}

/// The headers of every file of a checkpoint.
#[derive(Debug, Clone, Default)]
pub(super) struct Checkpoint {
    /// The files, in the order read.
    pub files: Vec<PathBuf>,
    /// Every tensor by name.
    pub entries: BTreeMap<String, Entry>,
}

/// Reads the header of one safetensors file: `{name: {dtype, shape, data_offsets}}`.
fn read_header(path: &Path) -> DecoderResult<BTreeMap<String, (String, Vec<usize>)>> {
    let io = |source| DecoderError::Io { path: path.to_path_buf(), source };
    let bad = |message: String| DecoderError::Safetensors { path: path.to_path_buf(), message };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| bad("shorter than its 8-byte header length".into()))?;
    let n = u64::from_le_bytes(len);
    if n > MAX_HEADER {
        return Err(bad(format!("header of {n} bytes (the format allows {MAX_HEADER})")));
    }
    let mut header = vec![0u8; n as usize];
    file.read_exact(&mut header).map_err(|_| bad(format!("shorter than its {n}-byte header")))?;
    let v: serde_json::Value = serde_json::from_slice(&header).map_err(|e| bad(format!("header: {e}")))?;
    let map = v.as_object().ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut out = BTreeMap::new();
    for (name, info) in map.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = info.get("dtype").and_then(|d| d.as_str());
        let shape: Option<Vec<usize>> = info
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|s| s.iter().map(|x| x.as_u64().map(|n| n as usize)).collect());
        match (dtype, shape) {
            (Some(d), Some(s)) => {
                out.insert(name.clone(), (d.to_string(), s));
            }
            _ => return Err(bad(format!("tensor `{name}` has no dtype or shape in the header"))),
        }
    }
    Ok(out)
}

/// The files of the checkpoint in `dir` and, for a sharded one, the tensors the index assigns to
/// each.
fn list_files(dir: &Path) -> DecoderResult<Vec<(PathBuf, Vec<String>)>> {
    let index = dir.join(INDEX);
    if !index.exists() {
        let single = dir.join(SINGLE);
        if !single.exists() {
            return Err(DecoderError::MissingFile { path: single });
        }
        return Ok(vec![(single, Vec::new())]);
    }
    let json = |message: String| DecoderError::Json { path: index.clone(), message };
    let text = read_file(&index)?;
    let v: serde_json::Value = serde_json::from_slice(&text).map_err(|e| json(e.to_string()))?;
    let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| json("no `weight_map` object".into()))?;
    let mut files: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| json(format!("weight_map entry `{name}` is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(json(format!("weight_map entry `{name}` names `{file}`, not a file of this directory")));
        }
        files.entry(file.to_string()).or_default().push(name.clone());
    }
    for (file, names) in &files {
        let path = dir.join(file);
        if !path.exists() {
            let first: Vec<&str> = names.iter().take(3).map(String::as_str).collect();
            return Err(DecoderError::Json {
                path: index.clone(),
                message: format!(
                    "its weight_map names the shard {file} ({} tensors: {}{}), which is not in {}: download every shard",
                    names.len(),
                    first.join(", "),
                    if names.len() > 3 { ", …" } else { "" },
                    dir.display()
                ),
            });
        }
    }
    Ok(files.into_iter().map(|(f, names)| (dir.join(f), names)).collect())
}

impl Checkpoint {
    /// The headers of the checkpoint in `dir`: every tensor of every file (a tensor in two shards
    /// is taken from the one the index names). A tensor the index assigns to a shard that does
    /// not hold it is not there (so it is reported missing).
    ///
    /// # Errors
    /// [`DecoderError::MissingFile`] without `model.safetensors` or an index;
    /// [`DecoderError::Json`] for an unreadable index or one naming a shard that is not there;
    /// [`DecoderError::Safetensors`] for an unreadable header; [`DecoderError::Io`].
    pub fn open(dir: &Path) -> DecoderResult<Self> {
        let mut ck = Checkpoint::default();
        for (path, listed) in list_files(dir)? {
            let header = read_header(&path)?;
            let listed: BTreeSet<&String> = listed.iter().collect();
            let file = ck.files.len();
            for (name, (dtype, shape)) in header {
                // The index's assignment wins over a stray copy in another shard.
                if listed.contains(&name) || !ck.entries.contains_key(&name) {
                    ck.entries.insert(name, Entry { file, dtype, shape });
                }
            }
            ck.files.push(path);
        }
        Ok(ck)
    }

    /// The data of the tensors `names` (present in [`Checkpoint::entries`] with a float dtype),
    /// widened to f32, by name; each file is read once.
    ///
    /// # Errors
    /// [`DecoderError::Io`]; [`DecoderError::Safetensors`] for a file whose data does not match its
    /// header (truncated, corrupt).
    pub fn read(&self, names: &BTreeSet<&str>) -> DecoderResult<BTreeMap<String, Vec<f32>>> {
        let mut out = BTreeMap::new();
        for (i, path) in self.files.iter().enumerate() {
            let here: Vec<(&str, &Entry)> =
                names.iter().filter_map(|&n| self.entries.get(n).filter(|e| e.file == i).map(|e| (n, e))).collect();
            if here.is_empty() {
                continue;
            }
            let bytes = read_file(path)?;
            let bad = |message: String| DecoderError::Safetensors { path: path.clone(), message };
            let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
            for (name, entry) in here {
                let view = st.tensor(name).map_err(|e| bad(format!("tensor `{name}`: {e}")))?;
                let dtype = entry.float_dtype().ok_or_else(|| bad(format!("tensor `{name}` is {}", entry.dtype)))?;
                if view.shape() != entry.shape.as_slice() {
                    return Err(bad(format!("tensor `{name}` changed shape between reads")));
                }
                out.insert(name.to_string(), te_runtime::numerics::decode(dtype, view.data()));
            }
        }
        Ok(out)
    }
}
