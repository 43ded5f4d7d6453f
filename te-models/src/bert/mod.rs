//! BERT encoders from Hugging Face checkpoints (`config.json` + `model.safetensors`), built from
//! this crate's modules for inference: sentence embeddings as sentence-transformers computes
//! them (mean pooling over real tokens, L2 normalisation). The reference model is
//! all-MiniLM-L6-v2 (hidden 384, 12 heads, 6 layers, ffn 1536, vocabulary 30522).
//!
//! Mapping (Hugging Face `BertModel` → modules; names with or without the `bert.` prefix):
//!
//! | Hugging Face | here |
//! |---|---|
//! | `embeddings.word_embeddings.weight` `[vocab, hidden]` | word table (lookup kernel) |
//! | `embeddings.position_embeddings.weight` + `token_type_embeddings.weight[0]` | position table (token type 0 folded in, in f32, at load) |
//! | `embeddings.LayerNorm.{weight,bias}` | [`Norm`](te_nn::modules::Norm) |
//! | `encoder.layer.N.attention.self.{query,key,value}.*` | `self_attention.qkv` (rows `[q \| k \| v]`, concatenated) |
//! | `encoder.layer.N.attention.output.dense.*` | `self_attention.proj` |
//! | `encoder.layer.N.attention.output.LayerNorm.*` | `layernorm_mlp.layer_norm_*` |
//! | `encoder.layer.N.intermediate.dense.*` | `layernorm_mlp.fc1_*` |
//! | `encoder.layer.N.output.dense.*` | `layernorm_mlp.fc2_*` |
//! | `encoder.layer.N.output.LayerNorm.*` | `layernorm.*` (the output norm) |
//!
//! Each layer is a post-LN [`TransformerLayer`](te_nn::modules::TransformerLayer) with `output_layernorm` and
//! `apply_residual_connection_post_layernorm` (TE's BERT form): `h = LN1(x + Attn(x))`,
//! `y = LN2(h + FFN(h))`, with BERT's exact (erf) GELU ([`Activation::GeluErf`](te_nn::modules::Activation::GeluErf)), a padding mask
//! from the sequence lengths (TE's `true` = masked out) and the `[b, s, hidden]` (bshd) layout.
//!
//! Precision: activations are BF16. [`WeightPrecision::Bf16`] keeps BF16 weights;
//! [`WeightPrecision::Fp8`] builds the layers under [`fp8_model_init`](te_nn::fp8::fp8_model_init) (E4M3 codes, 1 byte per
//! parameter, no transpose, each weight scaled by its own amax) and runs their GEMMs in FP8 with
//! the activation scales of [`ActivationScaling`]; it also stores the word-embedding table (half
//! of MiniLM's parameters) as E4M3 codes with a per-tensor scale, dequantized by the lookup
//! kernel ([`Bert::new_with`] keeps it BF16). Position table, norms, softmax, residuals and the
//! pooling stay in high precision, as in TE.

mod config;
mod model;
mod pooling;
mod weights;

pub use config::BertConfig;
pub use model::{ActivationScaling, Bert, Fp8Gemms, WeightPrecision};
pub use pooling::{cosine, l2_normalize, mean_pool_normalize, pad_batch};
pub use weights::{BertWeights, HostTensor};

use std::path::{Path, PathBuf};

/// Errors of loading and running a BERT checkpoint; each names the file, field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum BertError {
    /// A file of the checkpoint is missing.
    #[error(
        "{path} is missing: a Hugging Face BERT directory holds config.json, model.safetensors and tokenizer.json"
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
    /// `config.json` is not valid JSON or not a BERT configuration.
    #[error("{path}: {message}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A configuration field the mapper does not support (or that is missing).
    #[error("config.json: unsupported `{field}`: {message}")]
    Unsupported {
        /// The JSON field.
        field: &'static str,
        /// The value found and what is supported.
        message: String,
    },
    /// A tensor that is missing, of an unsupported dtype, or of the wrong shape.
    #[error("model.safetensors: tensor `{name}`: {message}")]
    Tensor {
        /// The Hugging Face tensor name.
        name: String,
        /// What is wrong.
        message: String,
    },
    /// An input the model cannot take (empty batch, a sequence over the maximum length, an id
    /// outside the vocabulary).
    #[error("Bert input: {message}")]
    Input {
        /// What is wrong.
        message: String,
    },
    /// A device, kernel or module failure.
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
}

/// Result of this module.
pub type BertResult<T> = std::result::Result<T, BertError>;

fn read_file(path: &Path) -> BertResult<Vec<u8>> {
    if !path.exists() {
        return Err(BertError::MissingFile { path: path.to_path_buf() });
    }
    std::fs::read(path).map_err(|source| BertError::Io { path: path.to_path_buf(), source })
}
