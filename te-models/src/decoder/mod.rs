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

mod config;
mod gguf;
pub mod gpu;
mod hf_config;
#[cfg(test)]
mod hf_config_tests;
mod lm;
mod load;
mod names;
mod rope;
mod safetensors_dir;
mod weights;
#[cfg(test)]
mod weights_tests;

pub use config::{DecoderActivation, DecoderConfig, LayerAttention, MAX_HEAD_DIM, MAX_LAYERS, MAX_SIZE};
pub use hf_config::HfArchitecture;
pub use gpu::{Decoder, DecoderCache, GpuPrecision};
pub use lm::{CausalLm, DecodeOptions, Perplexity};
pub use load::{load_model, LoadedModel, ModelSource};
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
    /// The model's tokenizer could not be read.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
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
