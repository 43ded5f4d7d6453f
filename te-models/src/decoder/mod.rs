//! The decoder LLM family (Llama, Qwen2, Qwen3, Gemma 3): one configuration
//! ([`DecoderConfig`], parsed from a Hugging Face `config.json` by
//! [`DecoderConfig::from_hf_config`]) and the import of a Hugging Face directory's weights
//! ([`DecoderWeights::from_hf_dir`]) onto TE/Megatron parameter names. The CPU model that runs
//! them is [`crate::cpu::decoder::DecoderRef`].
//!
//! # The layer
//!
//! Token ids → embedding (× `√hidden` when [`DecoderConfig::scale_embeddings`]) → `num_layers`
//! pre-norm layers → final norm → LM head (the embedding when tied) → `cap · tanh(logits / cap)`
//! when [`DecoderConfig::final_logit_softcapping`] is set (`Gemma3ForCausalLM.forward`). Layer `l`
//! (transformers' `LlamaDecoderLayer` in `modeling_llama.py`, `Qwen2DecoderLayer` in
//! `modeling_qwen2.py`, `Qwen3DecoderLayer` in `modeling_qwen3.py`, `Gemma3DecoderLayer` in
//! `modeling_gemma3.py`; attention as their `eager_attention_forward`, the sliding mask as
//! `masking_utils.sliding_window_overlay`):
//!
//! ```text
//! q|k|v = norm₁(x) · W_qkvᵀ (+ b_qkv)          [tokens, (heads + 2·groups)·head_dim]
//! q, k  = RMSNorm_head_dim(q), RMSNorm(k)      qk_norm (Qwen3, Gemma 3)
//! q, k  = RoPE(q), RoPE(k) at each position    θ of the layer (rope or rope_local)
//! o     = softmax(scale · q·kᵀ, causal [+ window]) · v   GQA: query head h reads group h / (heads / groups)
//! a     = o · W_projᵀ (+ b)                    [tokens, hidden]
//! x     = x + post_attn_norm(a)                post_attn_norm only with sandwich_norm (Gemma)
//! m     = act(norm₂(x) · W_fc1ᵀ (+ b))         gated: act(gate) · up, fc1 rows [gate | up]
//! x     = x + post_mlp_norm(m · W_fc2ᵀ (+ b))
//! ```
//!
//! Norms are RMSNorm (`x / √(mean(x²) + ε) · γ`: `LlamaRMSNorm`, `Qwen2RMSNorm`, `Qwen3RMSNorm`;
//! `· (1 + γ)` with [`DecoderConfig::zero_centered_gamma`]: `Gemma3RMSNorm`) or LayerNorm. RoPE is
//! [`RopeConfig`] (`modeling_rope_utils.py`), the embedding multiplier Gemma's
//! `Gemma3TextScaledWordEmbedding`.
//!
//! # Parameter names
//!
//! The internal names are TE's `TransformerLayer` state-dict paths where a TE module holds the
//! tensor (`self_attention.layernorm_qkv`, `self_attention.proj`, `layernorm_mlp`), Megatron's
//! otherwise (`q_layernorm`, `k_layernorm`), so the GPU model can load the same tensors. The
//! Hugging Face names are those of `LlamaForCausalLM` and its siblings (prefix `model.`; under
//! `Gemma3ForConditionalGeneration` `model.language_model.` or `language_model.model.`):
//!
//! | Hugging Face | internal | shape |
//! |---|---|---|
//! | `model.embed_tokens.weight` | `embedding.weight` | `[vocab, hidden]` |
//! | `model.layers.{i}.input_layernorm.weight` (`.bias`) | `layers.{i}.self_attention.layernorm_qkv.layer_norm_weight` (`_bias`) | `[hidden]` |
//! | `model.layers.{i}.self_attn.{q,k,v}_proj.weight` | `layers.{i}.self_attention.layernorm_qkv.weight`, rows `[q \| k \| v]` | `[(heads + 2·groups)·head_dim, hidden]` |
//! | `model.layers.{i}.self_attn.{q,k,v}_proj.bias` | `layers.{i}.self_attention.layernorm_qkv.bias` | `[(heads + 2·groups)·head_dim]` |
//! | `model.layers.{i}.self_attn.q_norm.weight` | `layers.{i}.self_attention.q_layernorm.weight` | `[head_dim]` |
//! | `model.layers.{i}.self_attn.k_norm.weight` | `layers.{i}.self_attention.k_layernorm.weight` | `[head_dim]` |
//! | `model.layers.{i}.self_attn.o_proj.weight` (`.bias`) | `layers.{i}.self_attention.proj.weight` (`.bias`) | `[hidden, heads·head_dim]` |
//! | `model.layers.{i}.post_attention_layernorm.weight` (Llama, Qwen: the norm before the MLP) | `layers.{i}.layernorm_mlp.layer_norm_weight` | `[hidden]` |
//! | `model.layers.{i}.post_attention_layernorm.weight` (Gemma: the sandwich norm) | `layers.{i}.post_attention_layernorm.weight` | `[hidden]` |
//! | `model.layers.{i}.pre_feedforward_layernorm.weight` (Gemma) | `layers.{i}.layernorm_mlp.layer_norm_weight` | `[hidden]` |
//! | `model.layers.{i}.post_feedforward_layernorm.weight` (Gemma) | `layers.{i}.post_mlp_layernorm.weight` | `[hidden]` |
//! | `model.layers.{i}.mlp.gate_proj.weight`, `up_proj.weight` | `layers.{i}.layernorm_mlp.fc1_weight`, rows `[gate \| up]` | `[2·ffn, hidden]` |
//! | `model.layers.{i}.mlp.up_proj.weight` (not gated) | `layers.{i}.layernorm_mlp.fc1_weight` | `[ffn, hidden]` |
//! | `model.layers.{i}.mlp.down_proj.weight` | `layers.{i}.layernorm_mlp.fc2_weight` | `[hidden, ffn]` |
//! | `….bias` of the MLP's projections (`mlp_bias`) | `fc1_bias`, `fc2_bias` | `[2·ffn]`, `[hidden]` |
//! | `model.norm.weight` | `final_norm.weight` | `[hidden]` |
//! | `lm_head.weight` (absent when tied) | `lm_head.weight` | `[vocab, hidden]` |
//!
//! Norm weights are stored as the checkpoint has them (`γ − 1` under zero-centered gamma, as
//! TE's `zero_centered_gamma` stores them too).
//!
//! # Export
//!
//! [`DecoderWeights::save_hf_dir`] and [`LoadedModel::save_hf_dir`] write the table backwards: a
//! Hugging Face directory that transformers loads (`AutoModelForCausalLM.from_pretrained(dir)`,
//! `AutoTokenizer.from_pretrained(dir)`) and that [`DecoderWeights::from_hf_dir`] /
//! [`load_model`] read back to the same configuration and weights (`te export` on the command
//! line). It holds:
//!
//! - `config.json`: the configuration as `LlamaForCausalLM`, `Qwen2ForCausalLM`,
//!   `Qwen3ForCausalLM` or `Gemma3ForCausalLM` (the multimodal Gemma's text model as the latter)
//!   writes it (module `export_config`): it parses back to the same [`DecoderConfig`], or
//!   the export is refused naming the field the class cannot express.
//! - `model.safetensors` (metadata `format: pt`), or above [`ExportOptions::max_shard_bytes`] the
//!   shards `model-00001-of-0000N.safetensors` with `model.safetensors.index.json`
//!   (`metadata.total_size`, `weight_map`), as transformers' `save_pretrained` shards: every
//!   tensor under its Hugging Face name in BF16, F16 or F32 (rounded to nearest even), the
//!   inverse of the import ([`hf_layout`]): the fused q|k|v rows split into `q_proj`,
//!   `k_proj`, `v_proj`, fc1's `[gate | up]` into `gate_proj`, `up_proj`; no `lm_head.weight`
//!   when tied. Norm weights follow the class's convention: Gemma's `γ` applied as `1 + γ`
//!   (`Gemma3RMSNorm`), so the `1 + γ` a GGUF Gemma stores has 1 subtracted.
//! - the tokenizer: a Hugging Face source's files copied (`tokenizer.json`,
//!   `tokenizer_config.json`, `special_tokens_map.json`, `tokenizer.model`, chat templates...), a
//!   GGUF vocabulary written by [`crate::tokenizer::Tokenizer::to_hf_files`] with the file's
//!   padding token (`tokenizer.ggml.padding_token_id`) and chat template
//!   (`tokenizer.chat_template`).
//! - `generation_config.json`: a Hugging Face source's; for a GGUF file `bos_token_id`, every
//!   end-of-generation id of the tokenizer as `eos_token_id` (Gemma: `<eos>` and
//!   `<end_of_turn>`) and `pad_token_id`.

mod config;
mod export;
mod export_config;
#[cfg(test)]
mod export_tests;
mod gguf;
pub mod gpu;
mod hf_config;
#[cfg(test)]
mod hf_config_tests;
pub(crate) mod lm;
mod load;
mod names;
mod rope;
mod safetensors_dir;
pub mod train;
mod weights;
#[cfg(test)]
mod weights_tests;

pub use config::{DecoderActivation, DecoderConfig, LayerAttention, MAX_HEAD_DIM, MAX_LAYERS, MAX_SIZE};
pub use export::{ExportOptions, ExportReport, DEFAULT_MAX_SHARD_BYTES};
pub use gpu::{Decoder, DecoderCache, GpuPrecision, DEFAULT_PREFILL_CHUNK};
pub use hf_config::HfArchitecture;
pub use lm::{CausalLm, DecodeOptions, Perplexity};
pub use load::{load_config, load_model, load_tokenizer, LoadedModel, ModelSource};
pub use names::{hf_layout, ParamSource};
pub use rope::{RopeConfig, RopeScaling};
pub use weights::{DecoderWeights, WeightReport, WeightTensor};

use std::path::{Path, PathBuf};

/// Errors of configuring, importing and running a decoder; each names the file, field or
/// tensor and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DecoderError {
    /// A file of the checkpoint is missing.
    #[error(
        "{path} is missing: a Hugging Face model directory holds config.json and model.safetensors (or \
         model.safetensors.index.json and its shards)"
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
    /// A JSON file (`config.json`, the shard index) that is not valid JSON or not of the expected
    /// form.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// `config.json` names an architecture this crate does not import.
    #[error(
        "config.json: architecture `{found}` is not supported: the decoder family imports LlamaForCausalLM, \
         Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM and Gemma3ForConditionalGeneration (its text model)"
    )]
    Architecture {
        /// The `architectures` entry or `model_type` found.
        found: String,
    },
    /// A configuration field that is missing, of the wrong type, or of a value the family does
    /// not support.
    #[error("config: `{field}`: {message}")]
    Config {
        /// The field (its Hugging Face key; nested ones dotted: `rope_scaling.factor`).
        field: String,
        /// The value found and what is expected.
        message: String,
    },
    /// A safetensors file that cannot be parsed.
    #[error("{path}: not a readable safetensors file: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// The checkpoint's tensors do not match the configuration: every missing, unexpected,
    /// mis-shaped and wrongly typed tensor, listed together.
    #[error("{source_name}: the tensors do not match config.json: {report}")]
    Weights {
        /// The directory or file the tensors came from.
        source_name: String,
        /// What is wrong, all of it.
        report: WeightReport,
    },
    /// An input the model cannot take (an id outside the vocabulary, an empty batch, a cache of
    /// another model or batch).
    #[error("decoder input: {message}")]
    Input {
        /// What is wrong and what to change.
        message: String,
    },
    /// An error of the sampler, the GGUF reader or another runtime piece.
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
    /// The model's tokenizer could not be read or written.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// An export's target directory holds files and overwriting was not asked for.
    #[error(
        "{path} exists and is not empty: choose a new directory, or ask to overwrite (`te export --force`, \
         ExportOptions::overwrite) to replace the model files in it"
    )]
    OutputExists {
        /// The target directory.
        path: PathBuf,
    },
    /// An export's target directory is the Hugging Face directory the model was loaded from.
    #[error("{path} is the directory the model was loaded from: export into another directory")]
    OutputIsSource {
        /// The directory.
        path: PathBuf,
    },
    /// An export dtype that Hugging Face checkpoints are not written in.
    #[error("cannot export in {dtype}: the checkpoint is written in bf16, f16 or f32")]
    ExportDtype {
        /// The dtype asked for.
        dtype: te_codegen::DType,
    },
}

impl DecoderError {
    /// A [`DecoderError::Config`] for `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config { field: field.into(), message: message.into() }
    }

    /// A [`DecoderError::Input`].
    pub fn input(message: impl Into<String>) -> Self {
        Self::Input { message: message.into() }
    }
}

/// Result of this module.
pub type DecoderResult<T> = std::result::Result<T, DecoderError>;

/// Reads `path` whole, with [`DecoderError::MissingFile`] when it does not exist.
fn read_file(path: &Path) -> DecoderResult<Vec<u8>> {
    if !path.exists() {
        return Err(DecoderError::MissingFile { path: path.to_path_buf() });
    }
    std::fs::read(path).map_err(|source| DecoderError::Io { path: path.to_path_buf(), source })
}
