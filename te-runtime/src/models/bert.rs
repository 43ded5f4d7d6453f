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
//! | `embeddings.LayerNorm.{weight,bias}` | [`Norm`] |
//! | `encoder.layer.N.attention.self.{query,key,value}.*` | `self_attention.qkv` (rows `[q \| k \| v]`, concatenated) |
//! | `encoder.layer.N.attention.output.dense.*` | `self_attention.proj` |
//! | `encoder.layer.N.attention.output.LayerNorm.*` | `layernorm_mlp.layer_norm_*` |
//! | `encoder.layer.N.intermediate.dense.*` | `layernorm_mlp.fc1_*` |
//! | `encoder.layer.N.output.dense.*` | `layernorm_mlp.fc2_*` |
//! | `encoder.layer.N.output.LayerNorm.*` | `layernorm.*` (the output norm) |
//!
//! Each layer is a post-LN [`TransformerLayer`] with `output_layernorm` and
//! `apply_residual_connection_post_layernorm` (TE's BERT form): `h = LN1(x + Attn(x))`,
//! `y = LN2(h + FFN(h))`, with BERT's exact (erf) GELU ([`Activation::GeluErf`]), a padding mask
//! from the sequence lengths (TE's `true` = masked out) and the `[b, s, hidden]` (bshd) layout.
//!
//! Precision: activations are BF16. [`WeightPrecision::Bf16`] keeps BF16 weights;
//! [`WeightPrecision::Fp8`] builds the layers under [`fp8_model_init`] (E4M3 codes, 1 byte per
//! parameter, no transpose, each weight scaled by its own amax) and runs their GEMMs in FP8 with
//! the activation scales of [`ActivationScaling`]; it also stores the word-embedding table (half
//! of MiniLM's parameters) as E4M3 codes with a per-tensor scale, dequantized by the lookup
//! kernel ([`Bert::new_with`] keeps it BF16). Position table, norms, softmax, residuals and the
//! pooling stay in high precision, as in TE.

use crate::fp8::{
    fp8_autocast, fp8_model_init, DelayedScaling, Float8CurrentScaling, Float8CurrentScalingQuantizer, Float8Tensor,
    Fp8Autocast, Quantizer, Recipe,
};
use crate::modules::{
    Activation, AttentionInputs, AttnMaskType, Norm, NormConfig, NormKind, QkvFormat, TokenIds, TransformerLayer,
    TransformerLayerConfig,
};
use crate::ops::elementwise::add;
use crate::ops::embedding::{embedding_forward, embedding_forward_fp8};
use crate::{Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use te_codegen::DType;

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
    Runtime(#[from] crate::Error),
}

/// Result of this module.
pub type BertResult<T> = std::result::Result<T, BertError>;

/// The fields of a Hugging Face `BertConfig` the model uses.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// `vocab_size`.
    pub vocab_size: usize,
    /// `hidden_size`.
    pub hidden_size: usize,
    /// `num_hidden_layers`.
    pub num_hidden_layers: usize,
    /// `num_attention_heads` (divides `hidden_size`).
    pub num_attention_heads: usize,
    /// `intermediate_size` (the MLP width).
    pub intermediate_size: usize,
    /// `max_position_embeddings` (rows of the position table; the longest sequence).
    pub max_position_embeddings: usize,
    /// `type_vocab_size` (≥ 1; only token type 0 is used).
    pub type_vocab_size: usize,
    /// `layer_norm_eps`.
    pub layer_norm_eps: f32,
    /// `hidden_act`: `gelu` → [`Activation::GeluErf`]; `gelu_new`, `gelu_pytorch_tanh` →
    /// [`Activation::Gelu`] (tanh); `relu` → [`Activation::Relu`].
    pub activation: Activation,
}

impl BertConfig {
    /// all-MiniLM-L6-v2's configuration.
    pub fn minilm_l6() -> Self {
        Self {
            vocab_size: 30522,
            hidden_size: 384,
            num_hidden_layers: 6,
            num_attention_heads: 12,
            intermediate_size: 1536,
            max_position_embeddings: 512,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            activation: Activation::GeluErf,
        }
    }

    /// Channels per head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Parses a Hugging Face `config.json` text.
    ///
    /// # Errors
    /// [`BertError::Unsupported`] naming the field: `model_type` other than `bert`, `hidden_act`
    /// other than gelu / gelu_new / gelu_pytorch_tanh / relu, `position_embedding_type` other
    /// than `absolute`, a missing or non-positive size, heads that do not divide the hidden
    /// size, `is_decoder`/`add_cross_attention` set; [`BertError::Json`] for invalid JSON.
    pub fn from_json(text: &str) -> BertResult<Self> {
        let v: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| BertError::Json { path: PathBuf::from("config.json"), message: e.to_string() })?;
        let unsupported = |field: &'static str, message: String| BertError::Unsupported { field, message };
        let str_field = |field: &'static str| v.get(field).and_then(|x| x.as_str());
        if let Some(t) = str_field("model_type") {
            if t != "bert" {
                return Err(unsupported("model_type", format!("`{t}`; only `bert` is supported")));
            }
        }
        for field in ["is_decoder", "add_cross_attention"] {
            if v.get(field).and_then(|x| x.as_bool()) == Some(true) {
                let field = if field == "is_decoder" { "is_decoder" } else { "add_cross_attention" };
                return Err(unsupported(
                    field,
                    "true; only encoders (self-attention, no decoder) are supported".into(),
                ));
            }
        }
        if let Some(p) = str_field("position_embedding_type") {
            if p != "absolute" {
                return Err(unsupported("position_embedding_type", format!("`{p}`; only `absolute` is supported")));
            }
        }
        let activation = match str_field("hidden_act").unwrap_or("gelu") {
            "gelu" => Activation::GeluErf,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::Gelu,
            "relu" => Activation::Relu,
            other => {
                return Err(unsupported(
                    "hidden_act",
                    format!("`{other}`; supported: gelu (erf), gelu_new / gelu_pytorch_tanh (tanh), relu"),
                ))
            }
        };
        let size = |field: &'static str| -> BertResult<usize> {
            match v.get(field).and_then(|x| x.as_u64()) {
                Some(n) if n > 0 => Ok(n as usize),
                Some(n) => Err(unsupported(field, format!("{n}; must be ≥ 1"))),
                None => Err(unsupported(field, "missing or not a positive integer".into())),
            }
        };
        let cfg = Self {
            vocab_size: size("vocab_size")?,
            hidden_size: size("hidden_size")?,
            num_hidden_layers: size("num_hidden_layers")?,
            num_attention_heads: size("num_attention_heads")?,
            intermediate_size: size("intermediate_size")?,
            max_position_embeddings: size("max_position_embeddings")?,
            type_vocab_size: v.get("type_vocab_size").and_then(|x| x.as_u64()).unwrap_or(2).max(1) as usize,
            layer_norm_eps: v.get("layer_norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-12) as f32,
            activation,
        };
        if cfg.hidden_size % cfg.num_attention_heads != 0 {
            return Err(unsupported(
                "num_attention_heads",
                format!("{} does not divide hidden_size = {}", cfg.num_attention_heads, cfg.hidden_size),
            ));
        }
        Ok(cfg)
    }

    /// Reads and parses `path` (a `config.json`).
    ///
    /// # Errors
    /// [`BertError::MissingFile`] / [`BertError::Io`]; as [`BertConfig::from_json`].
    pub fn load(path: &Path) -> BertResult<Self> {
        let text = read_file(path)?;
        let text = String::from_utf8(text)
            .map_err(|e| BertError::Json { path: path.to_path_buf(), message: e.to_string() })?;
        Self::from_json(&text).map_err(|e| match e {
            BertError::Json { message, .. } => BertError::Json { path: path.to_path_buf(), message },
            e => e,
        })
    }
}

fn read_file(path: &Path) -> BertResult<Vec<u8>> {
    if !path.exists() {
        return Err(BertError::MissingFile { path: path.to_path_buf() });
    }
    std::fs::read(path).map_err(|source| BertError::Io { path: path.to_path_buf(), source })
}

/// A host tensor in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    /// Shape.
    pub shape: Vec<usize>,
    /// Row-major values.
    pub data: Vec<f32>,
}

/// The checkpoint's tensors on the host in f32, by Hugging Face name (the `bert.` prefix
/// stripped); F32, F16 and BF16 tensors are read, others (the `position_ids` buffer) skipped.
#[derive(Debug, Clone, Default)]
pub struct BertWeights {
    tensors: HashMap<String, HostTensor>,
}

impl BertWeights {
    /// Reads a `model.safetensors` file.
    ///
    /// # Errors
    /// [`BertError::MissingFile`] / [`BertError::Io`]; [`BertError::Tensor`] for a file that is
    /// not safetensors.
    pub fn load(path: &Path) -> BertResult<Self> {
        let bytes = read_file(path)?;
        Self::from_safetensors(&bytes)
    }

    /// Parses safetensors bytes.
    ///
    /// # Errors
    /// [`BertError::Tensor`] (name `*`) for bytes that are not safetensors.
    pub fn from_safetensors(bytes: &[u8]) -> BertResult<Self> {
        use safetensors::Dtype;
        let st = safetensors::SafeTensors::deserialize(bytes)
            .map_err(|e| BertError::Tensor { name: "*".into(), message: format!("not a safetensors file: {e}") })?;
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let raw = view.data();
            let data: Vec<f32> = match view.dtype() {
                Dtype::F32 => raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
                Dtype::F16 => raw.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                Dtype::BF16 => raw.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
                _ => continue,
            };
            let name = name.strip_prefix("bert.").unwrap_or(&name).to_string();
            tensors.insert(name, HostTensor { shape: view.shape().to_vec(), data });
        }
        Ok(Self { tensors })
    }

    /// Builds weights from named tensors (tests, conversions).
    pub fn from_tensors(tensors: HashMap<String, HostTensor>) -> Self {
        Self { tensors }
    }

    /// The tensor `name`, checked to have `shape`.
    ///
    /// # Errors
    /// [`BertError::Tensor`] when it is missing or of another shape.
    pub fn get(&self, name: &str, shape: &[usize]) -> BertResult<&[f32]> {
        let t = self.tensors.get(name).ok_or_else(|| BertError::Tensor {
            name: name.into(),
            message: "missing (is this a BERT checkpoint of this config.json?)".into(),
        })?;
        if t.shape != shape {
            return Err(BertError::Tensor {
                name: name.into(),
                message: format!("shape {:?} does not match config.json, which implies {shape:?}", t.shape),
            });
        }
        Ok(&t.data)
    }

    /// Checks every tensor the model reads against `cfg`.
    ///
    /// # Errors
    /// The first missing or mismatched tensor, as [`BertWeights::get`].
    pub fn validate(&self, cfg: &BertConfig) -> BertResult<()> {
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        self.get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?;
        self.get("embeddings.position_embeddings.weight", &[cfg.max_position_embeddings, h])?;
        self.get("embeddings.token_type_embeddings.weight", &[cfg.type_vocab_size, h])?;
        self.get("embeddings.LayerNorm.weight", &[h])?;
        self.get("embeddings.LayerNorm.bias", &[h])?;
        for l in 0..cfg.num_hidden_layers {
            let p = format!("encoder.layer.{l}.");
            for (name, shape) in [
                ("attention.self.query.weight", vec![h, h]),
                ("attention.self.query.bias", vec![h]),
                ("attention.self.key.weight", vec![h, h]),
                ("attention.self.key.bias", vec![h]),
                ("attention.self.value.weight", vec![h, h]),
                ("attention.self.value.bias", vec![h]),
                ("attention.output.dense.weight", vec![h, h]),
                ("attention.output.dense.bias", vec![h]),
                ("attention.output.LayerNorm.weight", vec![h]),
                ("attention.output.LayerNorm.bias", vec![h]),
                ("intermediate.dense.weight", vec![f, h]),
                ("intermediate.dense.bias", vec![f]),
                ("output.dense.weight", vec![h, f]),
                ("output.dense.bias", vec![h]),
                ("output.LayerNorm.weight", vec![h]),
                ("output.LayerNorm.bias", vec![h]),
            ] {
                self.get(&format!("{p}{name}"), &shape)?;
            }
        }
        Ok(())
    }

    /// The fused QKV weight `[3·hidden, hidden]` (rows `[query | key | value]`) and bias of layer
    /// `l`, in the layout of `MultiheadAttention`.
    ///
    /// # Errors
    /// As [`BertWeights::get`].
    pub fn qkv(&self, cfg: &BertConfig, l: usize) -> BertResult<(Vec<f32>, Vec<f32>)> {
        let h = cfg.hidden_size;
        let (mut w, mut b) = (Vec::with_capacity(3 * h * h), Vec::with_capacity(3 * h));
        for part in ["query", "key", "value"] {
            w.extend_from_slice(self.get(&format!("encoder.layer.{l}.attention.self.{part}.weight"), &[h, h])?);
            b.extend_from_slice(self.get(&format!("encoder.layer.{l}.attention.self.{part}.bias"), &[h])?);
        }
        Ok((w, b))
    }

    /// Position table `[max_position_embeddings, hidden]` with token type 0 folded in (f32 sum).
    ///
    /// # Errors
    /// As [`BertWeights::get`].
    pub fn position_table(&self, cfg: &BertConfig) -> BertResult<Vec<f32>> {
        let h = cfg.hidden_size;
        let pos = self.get("embeddings.position_embeddings.weight", &[cfg.max_position_embeddings, h])?;
        let tt = &self.get("embeddings.token_type_embeddings.weight", &[cfg.type_vocab_size, h])?[..h];
        Ok(pos.chunks_exact(h).flat_map(|r| r.iter().zip(tt).map(|(a, b)| a + b)).collect())
    }
}

/// The dtype of the layers' GEMM weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPrecision {
    /// BF16 weights, BF16 GEMMs.
    Bf16,
    /// E4M3 weights made under `fp8_model_init` (1 byte per parameter), FP8 GEMMs.
    Fp8,
}

/// How FP8 GEMM inputs (activations) are scaled with [`WeightPrecision::Fp8`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationScaling {
    /// `Float8CurrentScaling`: each activation scaled by its own amax just before its cast (an
    /// amax kernel and a scale kernel per GEMM input; no calibration, robust to outliers in a
    /// batch).
    Current,
    /// `DelayedScaling` with the scales of a calibration pass ([`Bert::calibrate`], TE's
    /// `fp8_autocast(calibrating=True)`): no amax pass before the casts; every later batch
    /// still records its amax (the history is the running max).
    Calibrated,
}

/// The word-embedding table: BF16, or E4M3 codes with a per-tensor scale (1 byte per entry; the
/// lookup dequantizes to BF16).
#[derive(Debug)]
enum WordTable {
    High(Tensor),
    Fp8(Float8Tensor),
}

/// Which GEMMs of each layer run in FP8 under [`WeightPrecision::Fp8`]: the attention block's
/// (QKV and output projection) and the MLP's (fc1, fc2). A block left out runs its GEMMs in BF16
/// inside a disabled `fp8_autocast` scope, on its FP8 weights dequantized at each call: for GEMMs
/// too small for FP8 to pay for its input casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Gemms {
    /// QKV and output projection in FP8.
    pub attention: bool,
    /// fc1 and fc2 in FP8.
    pub mlp: bool,
}

impl Fp8Gemms {
    /// Every GEMM in FP8 (the default).
    pub const ALL: Fp8Gemms = Fp8Gemms { attention: true, mlp: true };
}

/// [`TransformerLayer::infer_with`] of a post-LN or pre-LN layer block by block, each block's
/// GEMMs in FP8 or (inside a disabled scope) BF16 as `gemms` says.
fn layer_infer_split(
    dev: &Arc<Device>,
    layer: &mut TransformerLayer,
    x: &Tensor,
    inputs: AttentionInputs<'_>,
    gemms: Fp8Gemms,
    recipe: Recipe,
) -> crate::Result<Tensor> {
    let a = fp8_autocast(gemms.attention, recipe, || layer.self_attention_mut().infer_with(x, inputs))?;
    let mut h1 = Tensor::empty(dev, x.dtype(), x.shape())?;
    add(dev, &a, x, &mut h1)?;
    let y = fp8_autocast(gemms.mlp, recipe, || {
        // The MLP returns its norm's output exactly when the residual is taken after it.
        let m = layer.layernorm_mlp_mut().infer_with(&h1, Default::default())?;
        let mut y = m.out.into_high(dev, h1.dtype())?;
        crate::ops::elementwise::add_assign(dev, &mut y, m.ln_out.as_ref().unwrap_or(&h1))?;
        Ok(y)
    })?;
    match layer.output_norm() {
        Some(n) => n.infer(&y),
        None => Ok(y),
    }
}

/// A batch's pooled output: sums still on the device, or embeddings pooled on the host.
enum Pooled {
    Device(Tensor),
    Host(Vec<Vec<f32>>),
}

/// A BERT encoder on the device for inference.
#[derive(Debug)]
pub struct Bert {
    dev: Arc<Device>,
    cfg: BertConfig,
    precision: WeightPrecision,
    scaling: ActivationScaling,
    calibrated: bool,
    host_pooling: bool,
    fp8_gemms: Fp8Gemms,
    word: WordTable,
    pos: Tensor,
    emb_norm: Norm,
    layers: Vec<TransformerLayer>,
}

fn upload(dev: &Arc<Device>, shape: &[usize], values: &[f32]) -> BertResult<Tensor> {
    Ok(Tensor::from_f32(dev, DType::BF16, shape, values)?)
}

impl Bert {
    /// The model with `weights` on `dev`; FP8 layers are made under `fp8_model_init` and start
    /// with [`ActivationScaling::Current`]. With [`WeightPrecision::Fp8`] the word-embedding
    /// table is FP8 too (see [`Bert::new_with`]).
    ///
    /// # Errors
    /// [`BertError::Tensor`] for missing or mismatched tensors; device and module failures.
    pub fn new(
        dev: &Arc<Device>,
        cfg: &BertConfig,
        weights: &BertWeights,
        precision: WeightPrecision,
    ) -> BertResult<Self> {
        Self::new_with(dev, cfg, weights, precision, precision == WeightPrecision::Fp8)
    }

    /// As [`Bert::new`], choosing the word-embedding table's storage: `fp8_word_embeddings`
    /// keeps it as E4M3 codes with one per-tensor scale (its own amax; 1 byte per entry, the
    /// lookup dequantizes to BF16), otherwise BF16. The table is about half of MiniLM's
    /// parameters, so FP8 weight memory is about half of BF16's only with it.
    ///
    /// # Errors
    /// As [`Bert::new`].
    pub fn new_with(
        dev: &Arc<Device>,
        cfg: &BertConfig,
        weights: &BertWeights,
        precision: WeightPrecision,
        fp8_word_embeddings: bool,
    ) -> BertResult<Self> {
        weights.validate(cfg)?;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let word =
            upload(dev, &[cfg.vocab_size, h], weights.get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?)?;
        let word = if fp8_word_embeddings { WordTable::Fp8(quantize_e4m3(dev, &word)?) } else { WordTable::High(word) };
        let pos = upload(dev, &[cfg.max_position_embeddings, h], &weights.position_table(cfg)?)?;
        let norm_cfg = NormConfig { eps: cfg.layer_norm_eps, params_dtype: DType::BF16, ..NormConfig::new(h) };
        let mut emb_norm = Norm::new(dev, NormKind::LayerNorm, norm_cfg)?;
        emb_norm.params_mut().set_weight(upload(dev, &[h], weights.get("embeddings.LayerNorm.weight", &[h])?)?)?;
        emb_norm.params_mut().set_bias(upload(dev, &[h], weights.get("embeddings.LayerNorm.bias", &[h])?)?)?;
        let fp8 = precision == WeightPrecision::Fp8;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let layer_cfg = TransformerLayerConfig {
                layernorm_epsilon: cfg.layer_norm_eps,
                hidden_dropout: 0.0,
                attention_dropout: 0.0,
                self_attn_mask_type: AttnMaskType::Padding,
                activation: cfg.activation,
                apply_residual_connection_post_layernorm: true,
                output_layernorm: true,
                qkv_format: QkvFormat::Bshd,
                params_dtype: DType::BF16,
                ..TransformerLayerConfig::new(h, f, cfg.num_attention_heads)
            };
            let mut layer = fp8_model_init(fp8, || TransformerLayer::new(dev, layer_cfg))?;
            let p = format!("encoder.layer.{l}.");
            let g = |name: &str, shape: &[usize]| weights.get(&format!("{p}{name}"), shape);
            let (qkv_w, qkv_b) = weights.qkv(cfg, l)?;
            let set = |params: &mut crate::modules::LinearParams, w: &[f32], b: &[f32], shape: [usize; 2]| {
                set_linear(dev, params, w, b, shape, fp8)
            };
            let attn = layer.self_attention_mut();
            set(attn.qkv_params_mut(), &qkv_w, &qkv_b, [3 * h, h])?;
            set(
                attn.proj_params_mut(),
                g("attention.output.dense.weight", &[h, h])?,
                g("attention.output.dense.bias", &[h])?,
                [h, h],
            )?;
            let mlp = layer.layernorm_mlp_mut();
            mlp.norm_params_mut().set_weight(upload(dev, &[h], g("attention.output.LayerNorm.weight", &[h])?)?)?;
            mlp.norm_params_mut().set_bias(upload(dev, &[h], g("attention.output.LayerNorm.bias", &[h])?)?)?;
            set(mlp.fc1_mut(), g("intermediate.dense.weight", &[f, h])?, g("intermediate.dense.bias", &[f])?, [f, h])?;
            set(mlp.fc2_mut(), g("output.dense.weight", &[h, f])?, g("output.dense.bias", &[h])?, [h, f])?;
            let out = layer.output_norm_mut().ok_or_else(|| BertError::Input {
                message: "internal: a post-LN layer without its output norm".into(),
            })?;
            out.params_mut().set_weight(upload(dev, &[h], g("output.LayerNorm.weight", &[h])?)?)?;
            out.params_mut().set_bias(upload(dev, &[h], g("output.LayerNorm.bias", &[h])?)?)?;
            layers.push(layer);
        }
        Ok(Self {
            dev: dev.clone(),
            cfg: cfg.clone(),
            precision,
            scaling: ActivationScaling::Current,
            calibrated: false,
            host_pooling: false,
            fp8_gemms: Fp8Gemms::ALL,
            word,
            pos,
            emb_norm,
            layers,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The weight precision.
    pub fn precision(&self) -> WeightPrecision {
        self.precision
    }

    /// The activation scaling (meaningful with FP8 weights).
    pub fn scaling(&self) -> ActivationScaling {
        self.scaling
    }

    /// Chooses the activation scaling; [`ActivationScaling::Calibrated`] needs
    /// [`Bert::calibrate`] before the next forward.
    pub fn set_scaling(&mut self, scaling: ActivationScaling) {
        self.scaling = scaling;
    }

    /// Bytes of every parameter on the device: embedding tables and norms (BF16) and the layers'
    /// GEMM weights (BF16, or E4M3 codes plus one f32 `scale_inv` each) and biases.
    pub fn weight_bytes(&self) -> usize {
        self.embedding_bytes() + self.layer_weight_bytes()
    }

    /// Bytes of the embedding tables and the embedding norm.
    pub fn embedding_bytes(&self) -> usize {
        let n = self.emb_norm.params();
        let word = match &self.word {
            WordTable::High(t) => t.num_bytes(),
            WordTable::Fp8(t) => t.num_bytes(),
        };
        word + self.pos.num_bytes() + n.weight().num_bytes() + n.bias().map_or(0, Tensor::num_bytes)
    }

    /// Bytes of the transformer layers' parameters (GEMM weights, biases, norms).
    pub fn layer_weight_bytes(&self) -> usize {
        use crate::modules::{Module, ParamKind};
        let mut total = 0usize;
        for layer in &self.layers {
            let _ = layer.visit("", &mut |_: &str, _: ParamKind, p: &dyn crate::modules::Param| {
                total += match p.fp8_tensor() {
                    Some(f) => f.num_bytes(),
                    None => p.tensor().map_or(0, Tensor::num_bytes),
                };
                Ok(())
            });
        }
        total
    }

    fn recipe(&self) -> Recipe {
        match self.scaling {
            ActivationScaling::Current => Recipe::Current(Float8CurrentScaling::default()),
            ActivationScaling::Calibrated => Recipe::Delayed(DelayedScaling::default()),
        }
    }

    /// Final hidden states `[b, s, hidden]` (BF16) for `ids: [b, s]` (row-major, padded with
    /// any valid id) and the real length of each row.
    ///
    /// # Errors
    /// [`BertError::Input`] for an empty batch, `s` above `max_position_embeddings`, lengths
    /// outside `1..=s` or ids outside the vocabulary; [`BertError::Runtime`] for device
    /// failures, or for [`ActivationScaling::Calibrated`] before [`Bert::calibrate`].
    pub fn hidden_states(&mut self, ids: &[i32], batch: usize, seq: usize, lens: &[usize]) -> BertResult<Tensor> {
        self.check_input(ids, batch, seq, lens)?;
        let fp8 = self.precision == WeightPrecision::Fp8;
        if fp8 && self.scaling == ActivationScaling::Calibrated && !self.calibrated {
            return Err(BertError::Input {
                message: "calibrated FP8 scaling needs Bert::calibrate on sample text first (or use current scaling)"
                    .into(),
            });
        }
        let x = self.embed_tokens(ids, batch, seq)?;
        let recipe = self.recipe();
        let gemms = self.fp8_gemms;
        let dev = self.dev.clone();
        let layers = &mut self.layers;
        let inputs = AttentionInputs { seq_lens: Some(lens), ..Default::default() };
        let y = fp8_autocast(fp8, recipe, || {
            let mut x = x;
            for layer in layers.iter_mut() {
                x = if !fp8 || gemms == Fp8Gemms::ALL {
                    layer.infer_with(&x, inputs)?
                } else {
                    layer_infer_split(&dev, layer, &x, inputs, gemms, recipe)?
                };
            }
            Ok(x)
        })?;
        Ok(y)
    }

    /// Which blocks' GEMMs run in FP8 with [`WeightPrecision::Fp8`] (default: all).
    pub fn fp8_gemms(&self) -> Fp8Gemms {
        self.fp8_gemms
    }

    /// Chooses which blocks' GEMMs run in FP8; the others run in BF16 on their FP8 weights
    /// dequantized at each call (weights stay 1 byte per parameter).
    pub fn set_fp8_gemms(&mut self, gemms: Fp8Gemms) {
        self.fp8_gemms = gemms;
    }

    fn check_input(&self, ids: &[i32], batch: usize, seq: usize, lens: &[usize]) -> BertResult<()> {
        let bad = |message: String| Err(BertError::Input { message });
        if batch == 0 || seq == 0 {
            return bad("empty batch".into());
        }
        if seq > self.cfg.max_position_embeddings {
            return bad(format!(
                "sequence length {seq} exceeds max_position_embeddings = {}; truncate the input",
                self.cfg.max_position_embeddings
            ));
        }
        if ids.len() != batch * seq || lens.len() != batch {
            return bad(format!("{} ids and {} lengths for a [{batch}, {seq}] batch", ids.len(), lens.len()));
        }
        if let Some(l) = lens.iter().find(|&&l| l == 0 || l > seq) {
            return bad(format!("length {l} outside 1..={seq}"));
        }
        if let Some(id) = ids.iter().find(|&&i| i < 0 || i as usize >= self.cfg.vocab_size) {
            return bad(format!("token id {id} outside the vocabulary of {}", self.cfg.vocab_size));
        }
        Ok(())
    }

    /// `LN(word[ids] + pos[j])`, `[b, s, hidden]` BF16.
    fn embed_tokens(&self, ids: &[i32], batch: usize, seq: usize) -> BertResult<Tensor> {
        let h = self.cfg.hidden_size;
        let tokens = TokenIds::from_host(&self.dev, &[batch * seq], ids)?;
        let positions: Vec<i32> = (0..batch).flat_map(|_| 0..seq as i32).collect();
        let positions = TokenIds::from_host(&self.dev, &[batch * seq], &positions)?;
        let mut w = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        match &self.word {
            WordTable::High(t) => embedding_forward(&self.dev, t, tokens.data(), &mut w)?,
            WordTable::Fp8(t) => embedding_forward_fp8(&self.dev, t, tokens.data(), &mut w)?,
        }
        let mut p = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        embedding_forward(&self.dev, &self.pos, positions.data(), &mut p)?;
        let mut sum = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        add(&self.dev, &w, &p, &mut sum)?;
        Ok(self.emb_norm.infer(&sum)?)
    }

    /// Sentence embeddings (mean over the real tokens, L2-normalised, f32 `[hidden]` each) of
    /// `seqs`, token ids with `[CLS]`/`[SEP]`, as one batch padded (with id 0) to the longest
    /// length rounded up to a multiple of 16 (the FP8 GEMMs' granularity).
    ///
    /// # Errors
    /// [`BertError::Input`] for an empty sequence or one longer than `max_position_embeddings`
    /// (truncate before); as [`Bert::hidden_states`].
    pub fn embed(&mut self, seqs: &[Vec<u32>]) -> BertResult<Vec<Vec<f32>>> {
        Ok(self.embed_batches(std::slice::from_ref(&seqs.to_vec()))?.remove(0))
    }

    /// [`Bert::embed`] of several batches with one host synchronisation: every batch is
    /// enqueued (embeddings, layers, pooling GEMM) before the first pooled sums are copied back,
    /// so the device never waits for the host between batches. Results per batch, in order.
    ///
    /// # Errors
    /// As [`Bert::embed`], for the first failing batch.
    pub fn embed_batches(&mut self, batches: &[Vec<Vec<u32>>]) -> BertResult<Vec<Vec<Vec<f32>>>> {
        let h = self.cfg.hidden_size;
        let mut pending = Vec::with_capacity(batches.len());
        for seqs in batches {
            let (ids, batch, seq, lens) = pad_batch(seqs, self.cfg.max_position_embeddings)?;
            let hidden = self.hidden_states(&ids, batch, seq, &lens)?;
            if !self.host_pooling {
                match self.pool_on_device(&hidden, batch, seq, &lens) {
                    Ok(sums) => {
                        pending.push(Pooled::Device(sums));
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!("pooling on the device failed ({e}); pooling on the host from now on");
                        self.host_pooling = true;
                    }
                }
            }
            let host = hidden.to_f32(&self.dev)?;
            pending.push(Pooled::Host(mean_pool_normalize(&host, seq, h, &lens)));
        }
        pending
            .into_iter()
            .map(|p| match p {
                Pooled::Device(sums) => Ok(sums.to_f32(&self.dev)?.chunks_exact(h).map(l2_normalize).collect()),
                Pooled::Host(v) => Ok(v),
            })
            .collect()
    }

    /// Per-sequence sums of the real tokens' hidden states, `[b, hidden]` f32 on the device: one
    /// strided batched GEMM `sum_i[1, hidden] = m_i[1, s] · H_i[s, hidden]` with `m_i` the 0/1
    /// mask of real tokens (the mean's `1 / len` cancels in the L2 normalisation), so only
    /// `b · hidden` floats cross to the host, later.
    fn pool_on_device(&self, hidden: &Tensor, batch: usize, seq: usize, lens: &[usize]) -> BertResult<Tensor> {
        use crate::gemm::{gemm_strided_batched, GemmConfig, MatrixView, StridedBatch};
        let h = self.cfg.hidden_size;
        let mask: Vec<f32> = lens.iter().flat_map(|&l| (0..seq).map(move |t| if t < l { 1.0 } else { 0.0 })).collect();
        let mask = Tensor::from_f32(&self.dev, hidden.dtype(), &[batch, seq], &mask)?;
        let mut sums = Tensor::empty(&self.dev, DType::F32, &[batch, h])?;
        let geometry = StridedBatch {
            count: batch,
            a: MatrixView { offset: 0, rows: 1, cols: seq, row_stride: seq, batch_stride: seq },
            a_transposed: false,
            b: MatrixView::contiguous(seq, h),
            b_transposed: true,
            d: MatrixView { offset: 0, rows: 1, cols: h, row_stride: h, batch_stride: h },
        };
        gemm_strided_batched(&self.dev, &mask, hidden, &mut sums, &geometry, &GemmConfig::default())?;
        Ok(sums)
    }

    /// Whether [`Bert::embed`] pools on the device (false after [`Bert::set_host_pooling`] or a
    /// failed device pooling).
    pub fn pools_on_device(&self) -> bool {
        !self.host_pooling
    }

    /// Pools on the host instead of the device (a debugging switch; the device path falls back
    /// to it by itself when its GEMM fails).
    pub fn set_host_pooling(&mut self, host: bool) {
        self.host_pooling = host;
    }

    /// Runs the batches in `fp8_autocast(calibrating = true)` with a delayed-scaling recipe:
    /// GEMMs in BF16, every FP8 input's amax recorded; at the scope's exit the scales are set
    /// from them, and the model switches to [`ActivationScaling::Calibrated`]. A no-op (but
    /// the switch) with BF16 weights.
    ///
    /// # Errors
    /// As [`Bert::embed`].
    pub fn calibrate(&mut self, batches: &[Vec<Vec<u32>>]) -> BertResult<()> {
        self.scaling = ActivationScaling::Calibrated;
        if self.precision != WeightPrecision::Fp8 {
            self.calibrated = true;
            return Ok(());
        }
        let recipe = DelayedScaling::default();
        let guard = Fp8Autocast::calibrating(recipe).enter()?;
        for b in batches {
            let (ids, batch, seq, lens) = pad_batch(b, self.cfg.max_position_embeddings)?;
            self.check_input(&ids, batch, seq, &lens)?;
            let mut x = self.embed_tokens(&ids, batch, seq)?;
            let inputs = AttentionInputs { seq_lens: Some(&lens), ..Default::default() };
            for layer in self.layers.iter_mut() {
                x = layer.infer_with(&x, inputs)?;
            }
        }
        guard.exit()?;
        self.calibrated = true;
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
}

fn set_linear(
    dev: &Arc<Device>,
    params: &mut crate::modules::LinearParams,
    w: &[f32],
    b: &[f32],
    shape: [usize; 2],
    fp8: bool,
) -> BertResult<()> {
    let wt = upload(dev, &shape, w)?;
    if fp8 {
        params.set_fp8_weight(quantize_e4m3(dev, &wt)?)?;
    } else {
        params.set_weight(wt)?;
    }
    params.set_bias(upload(dev, &[shape[0]], b)?)?;
    Ok(())
}

/// E4M3 codes of `t` scaled by its own amax (current scaling), no transpose.
fn quantize_e4m3(dev: &Arc<Device>, t: &Tensor) -> BertResult<Float8Tensor> {
    let q = Float8CurrentScalingQuantizer::new(dev, DType::E4M3, Float8CurrentScaling::default())?;
    Ok(q.quantize(t, false, None)?)
}

/// Pads token-id sequences into one `[b, s]` batch: `s` is the longest length rounded up to a
/// multiple of 16, but never above `max_len` (unless the longest itself is); pads with id 0;
/// returns `(ids, b, s, lengths)`.
///
/// # Errors
/// [`BertError::Input`] for no sequences, an empty sequence, or one longer than `max_len`.
pub fn pad_batch(seqs: &[Vec<u32>], max_len: usize) -> BertResult<(Vec<i32>, usize, usize, Vec<usize>)> {
    let bad = |message: String| Err(BertError::Input { message });
    if seqs.is_empty() {
        return bad("no sequences".into());
    }
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if seqs.iter().any(Vec::is_empty) {
        return bad("an empty token sequence (a tokenized sentence holds at least [CLS] and [SEP])".into());
    }
    if longest > max_len {
        return bad(format!("a sequence of {longest} tokens exceeds the maximum of {max_len}; truncate it"));
    }
    let seq = (longest.div_ceil(16) * 16).min(max_len).max(longest);
    let mut ids = vec![0i32; seqs.len() * seq];
    for (row, s) in ids.chunks_exact_mut(seq).zip(seqs) {
        for (d, &t) in row.iter_mut().zip(s) {
            *d = i32::try_from(t).unwrap_or(i32::MAX);
        }
    }
    Ok((ids, seqs.len(), seq, seqs.iter().map(Vec::len).collect()))
}

/// Mean over the first `lens[i]` rows of each `[s, hidden]` block of `hidden: [b, s, hidden]`,
/// then L2 normalisation (sentence-transformers' `Pooling(mean)` + `Normalize`, which divides by
/// `max(‖v‖, 1e-12)`).
pub fn mean_pool_normalize(hidden: &[f32], seq: usize, width: usize, lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(b, &len)| {
            let mut v = vec![0f64; width];
            for t in 0..len.min(seq) {
                let row = &hidden[(b * seq + t) * width..(b * seq + t + 1) * width];
                for (a, &x) in v.iter_mut().zip(row) {
                    *a += f64::from(x);
                }
            }
            let n = len.max(1) as f64;
            let norm = v.iter().map(|x| (x / n) * (x / n)).sum::<f64>().sqrt().max(1e-12);
            v.iter().map(|x| (x / n / norm) as f32).collect()
        })
        .collect()
}

/// `v / max(‖v‖, 1e-12)` in f64, rounded to f32.
pub fn l2_normalize(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt().max(1e-12);
    v.iter().map(|&x| (f64::from(x) / norm) as f32).collect()
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_parses_minilm_and_names_unsupported_fields() {
        let text = r#"{"architectures":["BertModel"],"hidden_act":"gelu","hidden_size":384,"intermediate_size":1536,
            "layer_norm_eps":1e-12,"max_position_embeddings":512,"model_type":"bert","num_attention_heads":12,
            "num_hidden_layers":6,"position_embedding_type":"absolute","type_vocab_size":2,"vocab_size":30522}"#;
        assert_eq!(BertConfig::from_json(text).unwrap(), BertConfig::minilm_l6());
        let e = BertConfig::from_json(&text.replace("\"gelu\"", "\"silu\"")).unwrap_err();
        assert!(matches!(e, BertError::Unsupported { field: "hidden_act", .. }), "{e}");
        let e = BertConfig::from_json(&text.replace("absolute", "relative_key")).unwrap_err();
        assert!(e.to_string().contains("position_embedding_type"), "{e}");
        let e = BertConfig::from_json(&text.replace("\"num_attention_heads\":12", "\"num_attention_heads\":7"))
            .unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let e = BertConfig::from_json(&text.replace("\"hidden_size\":384,", "")).unwrap_err();
        assert!(e.to_string().contains("hidden_size"), "{e}");
        let tanh = BertConfig::from_json(&text.replace("\"gelu\"", "\"gelu_new\"")).unwrap();
        assert_eq!(tanh.activation, Activation::Gelu);
    }

    #[test]
    fn padding_rounds_to_16_and_rejects_long_inputs() {
        let (ids, b, s, lens) = pad_batch(&[vec![101, 7, 102], vec![101; 17]], 512).unwrap();
        assert_eq!((b, s, lens.clone()), (2, 32, vec![3, 17]));
        assert_eq!(&ids[..4], &[101, 7, 102, 0]);
        assert!(pad_batch(&[vec![1; 513]], 512).is_err());
        assert!(pad_batch(&[vec![]], 512).is_err());
        assert!(pad_batch(&[], 512).is_err());
        // At the maximum the batch is not padded past it.
        assert_eq!(pad_batch(&[vec![1; 500]], 500).unwrap().2, 500);
    }

    #[test]
    fn pooling_ignores_padding_and_normalises() {
        let hidden = [1.0, 0.0, 3.0, 4.0, 100.0, 100.0];
        let v = mean_pool_normalize(&hidden, 3, 2, &[2]);
        let want = [2.0 / 8f32.sqrt(), 2.0 / 8f32.sqrt()];
        assert!((v[0][0] - want[0]).abs() < 1e-6 && (v[0][1] - want[1]).abs() < 1e-6, "{v:?}");
        assert!((cosine(&[1.0, 0.0], &[2.0, 0.0]) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn weights_report_missing_and_mismatched_tensors() {
        let mut t = HashMap::new();
        t.insert("embeddings.LayerNorm.weight".to_string(), HostTensor { shape: vec![4], data: vec![1.0; 4] });
        let w = BertWeights::from_tensors(t);
        let e = w.get("embeddings.LayerNorm.weight", &[8]).unwrap_err();
        assert!(e.to_string().contains("[4]") && e.to_string().contains("[8]"), "{e}");
        let e = w.validate(&BertConfig::minilm_l6()).unwrap_err();
        assert!(e.to_string().contains("word_embeddings"), "{e}");
    }
}
