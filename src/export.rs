//! `te export`: a decoder LLM (a GGUF file, or a Hugging Face directory) written as a Hugging Face
//! model directory that transformers loads (`AutoModelForCausalLM.from_pretrained(out)`,
//! `AutoTokenizer.from_pretrained(out)`): `config.json`, `model.safetensors` (sharded above 4 GB)
//! in BF16, F16 or F32, the tokenizer files and `generation_config.json`
//! ([`te_models::decoder::LoadedModel::save_hf_dir_with`]). A GGUF file's quantized tensors are
//! dequantized; its SentencePiece or byte-level BPE vocabulary becomes a `tokenizer.json`. A
//! Hugging Face directory without `tokenizer.json` exports its configuration and weights only.

use std::path::{Path, PathBuf};
use te_codegen::DType;
use te_models::decoder::{load_model, DecoderWeights, ExportOptions, ExportReport, ModelSource};

/// The options of `te export`.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// The model: a `.gguf` file or a Hugging Face model directory (Llama, Qwen2, Qwen3, Gemma 3).
    #[arg(long)]
    pub model: PathBuf,
    /// The directory to write (created; it must be empty unless --force).
    #[arg(long)]
    pub out: PathBuf,
    /// The dtype of the written tensors.
    #[arg(long, default_value = "bf16", value_parser = ["bf16", "f16", "f32"])]
    pub dtype: String,
    /// Write into a directory that holds files, replacing the model files there.
    #[arg(long)]
    pub force: bool,
}

/// `te export`: loads the model, writes the directory and returns the line that reports it.
///
/// # Errors
/// The loader's and the export's errors (each names the file, field or tensor), as text.
pub fn run(a: &ExportArgs) -> Result<String, String> {
    let dtype: DType = a.dtype.parse()?;
    let opts = ExportOptions { overwrite: a.force, ..ExportOptions::new(dtype) };
    let tokenizer = a.model.join("tokenizer.json");
    let (report, from) = if a.model.is_dir() && !tokenizer.exists() {
        let weights = DecoderWeights::from_hf_dir(&a.model).map_err(|e| e.to_string())?;
        let report = weights.save_hf_dir_with(&a.out, &opts).map_err(|e| e.to_string())?;
        (report, format!("{} (no tokenizer.json: configuration and weights only)", a.model.display()))
    } else {
        let model = load_model(&a.model).map_err(|e| e.to_string())?;
        let from = match &model.source {
            ModelSource::Gguf { path, types } => format!("{} ({})", path.display(), types.join(", ")),
            ModelSource::HuggingFace { dir } => dir.display().to_string(),
        };
        (model.save_hf_dir_with(&a.out, &opts).map_err(|e| e.to_string())?, from)
    };
    Ok(summary(&report, &from, &a.out))
}

/// `exported FROM as CLASS (N tensors, X MB BF16) to OUT: files`.
fn summary(r: &ExportReport, from: &str, out: &Path) -> String {
    format!(
        "exported {from} as {} ({} tensors, {:.1} MB {}) to {}: {}",
        r.architecture.class_name(),
        r.tensors,
        r.weight_bytes as f64 / 1e6,
        r.dtype.name().to_uppercase(),
        out.display(),
        r.files.join(", ")
    )
}
