//! `te eval --model`: the perplexity of a decoder LLM on text files.
//!
//! The files' texts are concatenated in order (as `cat` would) and encoded once with the
//! model's tokenizer, with its BOS at the start when the tokenizer adds one; `--max-tokens`
//! keeps the first N ids. [`te_models::decoder::CausalLm::perplexity`] scores them with
//! transformers' recipe for fixed-length models: windows of at most `--max-length` tokens every
//! `--stride` tokens, each token scored once with the window's earlier tokens as its context
//! (every token but the first is scored unless the windows are disjoint).

use crate::model::{encode_with_bos, open_causal_lm, ModelError, ModelOptions, ModelPrecision};
use std::path::PathBuf;
use std::time::Instant;
use te_models::decoder::Perplexity;

/// `--max-length` when not given (or the model's context, when shorter).
pub const DEFAULT_MAX_LENGTH: usize = 512;

/// The options of `te eval`.
#[derive(Debug, Clone, clap::Args)]
pub struct EvalArgs {
    /// A decoder LLM (Llama, Qwen2, Qwen3, Gemma 3): a `.gguf` file or a Hugging Face model
    /// directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Text files to score, concatenated in order.
    #[arg(long, required = true, num_args = 1..)]
    pub data: Vec<PathBuf>,
    /// Tokens of a window (default: 512, or the model's context when shorter).
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Tokens between window starts, ≤ --max-length (default: half of --max-length); a smaller
    /// stride gives each token more context and costs more.
    #[arg(long)]
    pub stride: Option<usize>,
    /// Score only the first N tokens of the text (with its BOS).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// Precision: f32 (the CPU default), bf16, or fp8 (the GPU path only).
    #[arg(long, value_parser = ["f32", "bf16", "fp8"])]
    pub precision: Option<String>,
    /// Run on the CPU even when a GPU is present.
    #[arg(long)]
    pub cpu: bool,
    /// With --precision fp8: the LM head's GEMM in FP8 too (one E4M3 table for the tied
    /// embedding and head).
    #[arg(long)]
    pub fp8_lm_head: bool,
    /// Print the result as one JSON object on stdout instead of a sentence.
    #[arg(long)]
    pub json: bool,
}

/// What one `te eval` measured.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalReport {
    /// The model's device and precision ([`te_models::decoder::CausalLm::describe`]).
    pub device: String,
    /// Tokens of the text evaluated (after `--max-tokens`), with the BOS.
    pub text_tokens: usize,
    /// Window length used.
    pub max_length: usize,
    /// Stride used.
    pub stride: usize,
    /// The result.
    pub perplexity: Perplexity,
    /// Seconds of the scoring (not of the load or the tokenization).
    pub seconds: f64,
}

impl EvalReport {
    /// The result as a sentence.
    pub fn line(&self) -> String {
        format!(
            "perplexity {:.4} (mean NLL {:.5} nats) over {} tokens scored of {} (windows of {}, stride {}) in {:.2} s \
             ({:.1} tokens/s)",
            self.perplexity.perplexity,
            self.perplexity.mean_nll,
            self.perplexity.tokens,
            self.text_tokens,
            self.max_length,
            self.stride,
            self.seconds,
            self.text_tokens as f64 / self.seconds.max(1e-9)
        )
    }

    /// The result as one JSON object (`perplexity`, `mean_nll`, `tokens` scored, `text_tokens`,
    /// `max_length`, `stride`, `seconds`, `device`).
    pub fn to_json(&self) -> String {
        serde_json::json!({
            "perplexity": self.perplexity.perplexity,
            "mean_nll": self.perplexity.mean_nll,
            "tokens": self.perplexity.tokens,
            "text_tokens": self.text_tokens,
            "max_length": self.max_length,
            "stride": self.stride,
            "seconds": self.seconds,
            "device": self.device,
        })
        .to_string()
    }
}

/// Checks window settings given on the command line (before the model is loaded).
fn check_windows(
    max_length: Option<usize>,
    stride: Option<usize>,
    max_tokens: Option<usize>,
) -> Result<(), ModelError> {
    let bad = |m: String| Err(ModelError::Request(m));
    if let Some(m) = max_length.filter(|&m| m < 2) {
        return bad(format!("--max-length {m}: a window needs at least 2 tokens (the first is only context)"));
    }
    if stride == Some(0) {
        return bad("--stride 0: windows must advance (1 ≤ stride ≤ --max-length)".into());
    }
    if let (Some(m), Some(s)) = (max_length, stride) {
        if s > m {
            return bad(format!("--stride {s} exceeds --max-length {m}: tokens between windows would go unscored"));
        }
    }
    if let Some(n) = max_tokens.filter(|&n| n < 2) {
        return bad(format!("--max-tokens {n}: perplexity needs at least 2 tokens (the first is never scored)"));
    }
    Ok(())
}

/// Runs `te eval`: reads the data, opens the model, scores the text.
///
/// # Errors
/// [`ModelError`]: an unreadable or non-UTF-8 data file, an empty text, bad window settings
/// (checked before the model is loaded), the model's errors, a `--max-length` beyond the model's
/// context (`max_position_embeddings`), a text of fewer than 2 tokens.
pub fn run(a: &EvalArgs) -> Result<EvalReport, ModelError> {
    check_windows(a.max_length, a.stride, a.max_tokens)?;
    let mut text = String::new();
    for f in &a.data {
        let bytes = std::fs::read(f)
            .map_err(|source| ModelError::Io { what: format!("cannot read {}", f.display()), source })?;
        let part = String::from_utf8(bytes)
            .map_err(|e| ModelError::Request(format!("{}: not UTF-8 text ({e})", f.display())))?;
        text.push_str(&part);
    }
    if text.is_empty() {
        return Err(ModelError::Request("the data is empty: give text files to score".into()));
    }
    let precision = a.precision.as_deref().map(ModelPrecision::from_name).transpose()?;
    let (mut model, tokenizer) = open_causal_lm(
        &a.model,
        &ModelOptions { cpu: a.cpu, precision, fp8_lm_head: a.fp8_lm_head, kv_cache_e4m3: false },
    )?;
    let device = model.describe();
    eprintln!("running on {device}");
    let context = model.config().max_position_embeddings;
    let max_length = match a.max_length {
        Some(m) if m > context => {
            return Err(ModelError::Request(format!(
                "--max-length {m} exceeds the model's context of {context} tokens (max_position_embeddings): give at \
                 most {context}"
            )))
        }
        Some(m) => m,
        None => DEFAULT_MAX_LENGTH.min(context),
    };
    let stride = a.stride.unwrap_or((max_length / 2).max(1));
    if stride > max_length {
        return Err(ModelError::Request(format!(
            "--stride {stride} exceeds the window of {max_length} tokens: give at most {max_length}"
        )));
    }
    let mut ids = encode_with_bos(&tokenizer, &text)?;
    if let Some(n) = a.max_tokens {
        ids.truncate(n);
    }
    if ids.len() < 2 {
        return Err(ModelError::Request(format!(
            "the data is {} token{}: perplexity needs at least 2 (the first is never scored)",
            ids.len(),
            if ids.len() == 1 { "" } else { "s" }
        )));
    }
    eprintln!("scoring {} tokens of {} bytes", ids.len(), text.len());
    let start = Instant::now();
    let perplexity = model.perplexity(&ids, max_length, stride)?;
    Ok(EvalReport {
        device,
        text_tokens: ids.len(),
        max_length,
        stride,
        perplexity,
        seconds: start.elapsed().as_secs_f64(),
    })
}
