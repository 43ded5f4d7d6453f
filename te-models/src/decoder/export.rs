//! Export of a decoder to a Hugging Face model directory: [`DecoderWeights::save_hf_dir`]
//! (configuration and weights) and [`LoadedModel::save_hf_dir`] (with the tokenizer); what the
//! directory holds is in the `decoder` module docs (section Export).

use super::export_config::{hf_config, torch_dtype, HfConfigPlan};
use super::hf_config::HfArchitecture;
use super::load::{LoadedModel, ModelSource};
use super::names::hf_layout;
use super::safetensors_dir::{INDEX, SINGLE};
use super::weights::DecoderWeights;
use super::{DecoderError, DecoderResult};
use crate::gguf::{GgufFile, Metadata};
use crate::tokenizer::HfTokenizerExtras;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensorError};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use te_codegen::DType;

/// The default shard limit: 4 GB of tensor data per file.
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 4_000_000_000;

/// The tokenizer files of a Hugging Face directory that an export copies (those present).
const TOKENIZER_FILES: [&str; 9] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];
const CONFIG: &str = "config.json";
const GENERATION_CONFIG: &str = "generation_config.json";

/// How to write an export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportOptions {
    /// The dtype of the tensors: [`DType::BF16`], [`DType::F16`] or [`DType::F32`] (the f32
    /// weights rounded to nearest even; F32 is exact).
    pub dtype: DType,
    /// Write into a directory that holds files: the model files there (`config.json`,
    /// `model*.safetensors`, the index, the tokenizer and generation files) are replaced, other
    /// files are left. Without it such a directory is [`DecoderError::OutputExists`].
    pub overwrite: bool,
    /// The most tensor bytes in one safetensors file before the checkpoint is sharded (a
    /// larger tensor gets a file of its own).
    pub max_shard_bytes: u64,
}

impl ExportOptions {
    /// `dtype`, no overwriting, [`DEFAULT_MAX_SHARD_BYTES`].
    pub fn new(dtype: DType) -> Self {
        Self { dtype, overwrite: false, max_shard_bytes: DEFAULT_MAX_SHARD_BYTES }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportReport {
    /// The directory.
    pub dir: PathBuf,
    /// The class of `config.json`.
    pub architecture: HfArchitecture,
    /// The dtype of the tensors.
    pub dtype: DType,
    /// The files written, by name, in order.
    pub files: Vec<String>,
    /// The Hugging Face tensors written.
    pub tensors: usize,
    /// Their bytes (the index's `total_size`).
    pub weight_bytes: u64,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DecoderError + '_ {
    move |source| DecoderError::Io { path: path.to_path_buf(), source }
}

/// Whether an export writes (so may replace) a file of this name.
fn is_export_file(name: &str) -> bool {
    name == CONFIG
        || name == GENERATION_CONFIG
        || name == SINGLE
        || name == INDEX
        || (name.starts_with("model-") && name.ends_with(".safetensors"))
        || TOKENIZER_FILES.contains(&name)
}

/// Creates `dir`, or checks that it is empty, or with `overwrite` removes the files an export
/// writes (a stale shard or index would otherwise be read with the new files).
fn prepare_dir(dir: &Path, overwrite: bool) -> DecoderResult<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries.collect::<Result<Vec<_>, _>>().map_err(io(dir))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return std::fs::create_dir_all(dir).map_err(io(dir)),
        Err(e) => return Err(io(dir)(e)),
    };
    if entries.is_empty() {
        return Ok(());
    }
    if !overwrite {
        return Err(DecoderError::OutputExists { path: dir.to_path_buf() });
    }
    for e in entries {
        let path = e.path();
        let is_file = e.file_type().map_err(io(&path))?.is_file();
        if is_file && e.file_name().to_str().is_some_and(is_export_file) {
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    Ok(())
}

/// Writes `bytes` to `dir/name`, naming the file in errors.
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> DecoderResult<()> {
    let path = dir.join(name);
    std::fs::write(&path, bytes).map_err(io(&path))
}

fn json_bytes(v: &Value) -> Vec<u8> {
    let mut text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    text.push('\n');
    text.into_bytes()
}

/// One Hugging Face tensor: a run of rows of an internal parameter.
struct Part {
    name: String,
    source: String,
    start: usize,
    len: usize,
    shape: Vec<usize>,
    /// An RMSNorm weight (shifted by the plan's `gamma_shift`).
    norm: bool,
}

/// Whether a Hugging Face tensor is a norm's weight (`input_layernorm`, `post_attention_layernorm`,
/// `pre_feedforward_layernorm`, `post_feedforward_layernorm`, `q_norm`, `k_norm`, `model.norm`).
fn is_norm_weight(name: &str) -> bool {
    name.ends_with("layernorm.weight") || name.ends_with("_norm.weight") || name == "model.norm.weight"
}

/// Writes the weights of `w` as safetensors files in `dir` (see the module docs); returns the
/// files' names, the tensor count and their bytes.
fn write_weights(
    w: &DecoderWeights,
    dir: &Path,
    opts: &ExportOptions,
    gamma_shift: f32,
) -> DecoderResult<(Vec<String>, usize, u64)> {
    let st_dtype = match opts.dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        dtype => return Err(DecoderError::ExportDtype { dtype }),
    };
    let mut parts = Vec::new();
    for p in hf_layout(w.config()) {
        let mut start = 0;
        for (name, shape) in p.hf {
            let len = shape.iter().product();
            parts.push(Part { norm: is_norm_weight(&name), name, source: p.name.clone(), start, len, shape });
            start += len;
        }
    }
    let size = opts.dtype.size_bytes() as u64;
    let mut shards: Vec<(Vec<&Part>, u64)> = Vec::new();
    for part in &parts {
        let bytes = part.len as u64 * size;
        match shards.last_mut() {
            Some((list, total)) if *total + bytes <= opts.max_shard_bytes || list.is_empty() => {
                list.push(part);
                *total += bytes;
            }
            _ => shards.push((vec![part], bytes)),
        }
    }
    let n = shards.len();
    let file_name =
        |k: usize| if n == 1 { SINGLE.to_string() } else { format!("model-{:05}-of-{n:05}.safetensors", k + 1) };
    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = BTreeMap::new();
    let mut files = Vec::with_capacity(n + 1);
    for (k, (list, _)) in shards.iter().enumerate() {
        let file = file_name(k);
        let path = dir.join(&file);
        let bad = |message: String| DecoderError::Safetensors { path: path.clone(), message };
        let mut encoded = Vec::with_capacity(list.len());
        for part in list {
            let t = w.get(&part.source).ok_or_else(|| bad(format!("parameter `{}` is missing", part.source)))?;
            let values = t.data.get(part.start..part.start + part.len).ok_or_else(|| {
                bad(format!("parameter `{}` has {} values for the shape {:?}", part.source, t.data.len(), t.shape))
            })?;
            let bytes = if part.norm && gamma_shift != 0.0 {
                let shifted: Vec<f32> = values.iter().map(|x| x + gamma_shift).collect();
                te_runtime::numerics::encode(opts.dtype, &shifted)
            } else {
                te_runtime::numerics::encode(opts.dtype, values)
            };
            encoded.push((part.name.as_str(), part.shape.clone(), bytes));
            weight_map.insert(part.name.clone(), file.clone());
        }
        let views = encoded
            .iter()
            .map(|(name, shape, bytes)| {
                TensorView::new(st_dtype, shape.clone(), bytes).map(|v| (*name, v)).map_err(|e| bad(e.to_string()))
            })
            .collect::<DecoderResult<Vec<_>>>()?;
        safetensors::serialize_to_file(views, Some(metadata.clone()), &path).map_err(|e| match e {
            SafeTensorError::IoError(source) => DecoderError::Io { path: path.clone(), source },
            e => bad(e.to_string()),
        })?;
        files.push(file);
    }
    let total = parts.iter().map(|p| p.len as u64 * size).sum();
    if n > 1 {
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_file(dir, INDEX, &json_bytes(&index))?;
        files.push(INDEX.to_string());
    }
    Ok((files, parts.len(), total))
}

/// Writes `config.json` and the weights into a prepared `dir`.
fn write_model(
    w: &DecoderWeights,
    dir: &Path,
    opts: &ExportOptions,
    plan: &HfConfigPlan,
) -> DecoderResult<ExportReport> {
    write_file(dir, CONFIG, &json_bytes(&plan.json))?;
    let (weight_files, tensors, weight_bytes) = write_weights(w, dir, opts, plan.gamma_shift)?;
    let mut files = vec![CONFIG.to_string()];
    files.extend(weight_files);
    Ok(ExportReport {
        dir: dir.to_path_buf(),
        architecture: plan.arch,
        dtype: opts.dtype,
        files,
        tensors,
        weight_bytes,
    })
}

impl DecoderWeights {
    /// Writes the configuration and weights as a Hugging Face model directory (`config.json`,
    /// `model.safetensors`; no tokenizer) in `dtype`: see the [`decoder` module docs](super) and
    /// [`DecoderWeights::save_hf_dir_with`].
    ///
    /// # Errors
    /// As [`DecoderWeights::save_hf_dir_with`].
    pub fn save_hf_dir(&self, dir: &Path, dtype: DType) -> DecoderResult<()> {
        self.save_hf_dir_with(dir, &ExportOptions::new(dtype)).map(|_| ())
    }

    /// [`DecoderWeights::save_hf_dir`] with every option: the configuration is checked before
    /// anything is written; `dir` is created when absent.
    ///
    /// # Errors
    /// [`DecoderError::ExportDtype`] for an FP8 dtype; [`DecoderError::Config`] for a
    /// configuration the class cannot express (naming the field); [`DecoderError::OutputExists`]
    /// for a directory holding files without [`ExportOptions::overwrite`]; [`DecoderError::Io`]
    /// naming the file or directory that cannot be written.
    pub fn save_hf_dir_with(&self, dir: &Path, opts: &ExportOptions) -> DecoderResult<ExportReport> {
        let plan = hf_config(self.config(), self.architecture(), opts.dtype, None)?;
        prepare_dir(dir, opts.overwrite)?;
        write_model(self, dir, opts, &plan)
    }
}

/// `pad_token_id` of a Hugging Face `config.json` (or its `text_config`), if any.
fn hf_pad_token(src: &Path) -> Option<u32> {
    let v: Value = serde_json::from_slice(&std::fs::read(src.join(CONFIG)).ok()?).ok()?;
    let id = |v: &Value| v.get("pad_token_id").and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok());
    id(&v).or_else(|| v.get("text_config").and_then(id))
}

/// The padding token and chat template of a GGUF file's metadata.
fn gguf_extras(meta: &Metadata) -> DecoderResult<HfTokenizerExtras> {
    Ok(HfTokenizerExtras {
        pad_token_id: meta.optional("tokenizer.ggml.padding_token_id", Metadata::get_u32)?,
        chat_template: meta.optional("tokenizer.chat_template", |m, k| m.get_str(k).map(str::to_string))?,
    })
}

impl LoadedModel {
    /// Writes the model as a Hugging Face model directory that transformers loads: configuration,
    /// weights in `dtype` and tokenizer (see the [`decoder` module docs](super)).
    ///
    /// # Errors
    /// As [`LoadedModel::save_hf_dir_with`].
    pub fn save_hf_dir(&self, dir: &Path, dtype: DType) -> DecoderResult<()> {
        self.save_hf_dir_with(dir, &ExportOptions::new(dtype)).map(|_| ())
    }

    /// [`LoadedModel::save_hf_dir`] with every option. The configuration and tokenizer files are
    /// made (a Hugging Face source's read) before anything is written; `dir` is created when
    /// absent.
    ///
    /// # Errors
    /// The errors of [`DecoderWeights::save_hf_dir_with`]; [`DecoderError::OutputIsSource`] for
    /// the directory the model was loaded from; [`DecoderError::Io`] for a source file that
    /// cannot be read; [`DecoderError::Runtime`] when the source GGUF file cannot be reopened for
    /// its chat template; [`DecoderError::Tokenizer`] when the tokenizer cannot be written.
    pub fn save_hf_dir_with(&self, dir: &Path, opts: &ExportOptions) -> DecoderResult<ExportReport> {
        torch_dtype(opts.dtype)?;
        let (pad, extra_files) = match &self.source {
            ModelSource::HuggingFace { dir: src } => {
                let same = match (std::fs::canonicalize(src), std::fs::canonicalize(dir)) {
                    (Ok(a), Ok(b)) => a == b,
                    _ => false,
                };
                if same {
                    return Err(DecoderError::OutputIsSource { path: dir.to_path_buf() });
                }
                let mut files = Vec::new();
                for name in TOKENIZER_FILES.iter().chain(&[GENERATION_CONFIG]) {
                    let path = src.join(name);
                    if path.is_file() {
                        files.push((name.to_string(), std::fs::read(&path).map_err(io(&path))?));
                    }
                }
                (hf_pad_token(src), files)
            }
            ModelSource::Gguf { path, .. } => {
                let extras = gguf_extras(GgufFile::open(path)?.metadata())?;
                let files = self.tokenizer.to_hf_files(&extras)?;
                (extras.pad_token_id, files.into_iter().map(|(n, b)| (n.to_string(), b)).collect())
            }
        };
        let pad = pad.filter(|&p| (p as usize) < self.weights.config().vocab_size);
        let plan = hf_config(self.weights.config(), self.weights.architecture(), opts.dtype, pad)?;
        prepare_dir(dir, opts.overwrite)?;
        let mut report = write_model(&self.weights, dir, opts, &plan)?;
        for (name, bytes) in &extra_files {
            write_file(dir, name, bytes)?;
            report.files.push(name.clone());
        }
        Ok(report)
    }
}
