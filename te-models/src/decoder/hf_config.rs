//! [`DecoderConfig::from_hf_config`]: a Hugging Face `config.json` of `LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Gemma3ForCausalLM` or
//! `Gemma3ForConditionalGeneration` (its `text_config`) as a [`DecoderConfig`].
//!
//! Both layouts of RoPE are read: transformers 4's `rope_theta` + `rope_scaling` (+ Gemma 3's
//! `rope_local_base_freq`) and transformers 5's `rope_parameters` (flat, or per layer type
//! `full_attention` / `sliding_attention`). The sizes (`vocab_size`, `hidden_size`,
//! `intermediate_size`, `num_hidden_layers`, `num_attention_heads`) are required; every other
//! field takes its default in the transformers configuration class (`configuration_llama.py`,
//! `configuration_qwen2.py`, `configuration_qwen3.py`, `configuration_gemma3.py`), as
//! transformers does. A nested Gemma 3 `text_config` takes `Gemma3TextConfig`'s defaults for the
//! sizes too, since transformers writes it without them.

use super::config::{DecoderActivation, DecoderConfig, LayerAttention, MAX_LAYERS, MAX_SIZE};
use super::rope::{RopeConfig, RopeScaling};
use super::{read_file, DecoderError, DecoderResult};
use serde_json::Value;
use std::path::Path;
use te_nn::modules::NormKind;

/// The Hugging Face model classes the family imports (`config.json`'s `architectures[0]`, or its
/// `model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HfArchitecture {
    /// `LlamaForCausalLM` (`model_type` `llama`).
    Llama,
    /// `Qwen2ForCausalLM` (`qwen2`).
    Qwen2,
    /// `Qwen3ForCausalLM` (`qwen3`).
    Qwen3,
    /// `Gemma3ForCausalLM` (`gemma3_text`).
    Gemma3,
    /// `Gemma3ForConditionalGeneration` (`gemma3`): its text model only.
    Gemma3Multimodal,
}

impl HfArchitecture {
    /// Every architecture.
    pub const ALL: [HfArchitecture; 5] = [Self::Llama, Self::Qwen2, Self::Qwen3, Self::Gemma3, Self::Gemma3Multimodal];

    /// The transformers class name.
    pub const fn class_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
            Self::Gemma3Multimodal => "Gemma3ForConditionalGeneration",
        }
    }

    /// The `model_type` of its configuration.
    pub const fn model_type(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Gemma3 => "gemma3_text",
            Self::Gemma3Multimodal => "gemma3",
        }
    }

    /// The prefixes of the text model's tensors in its checkpoints, tried in order
    /// (`model.layers.0…`; the multimodal Gemma's `model.language_model.` of transformers ≥ 4.52 and
    /// `language_model.model.` before).
    pub const fn weight_prefixes(self) -> &'static [&'static str] {
        match self {
            Self::Gemma3Multimodal => &["model.language_model.", "language_model.model."],
            _ => &["model."],
        }
    }

    /// Tensor-name prefixes of other parts of the checkpoint, skipped on import (the multimodal
    /// Gemma's vision tower and projector).
    pub const fn ignored_prefixes(self) -> &'static [&'static str] {
        match self {
            Self::Gemma3Multimodal => {
                &["model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector."]
            }
            _ => &[],
        }
    }

    /// The architecture of a parsed `config.json`: `architectures[0]`, else `model_type`.
    ///
    /// # Errors
    /// [`DecoderError::Architecture`] for another one; [`DecoderError::Config`] when neither
    /// field is there.
    pub fn of_config(v: &Value) -> DecoderResult<Self> {
        if let Some(name) = v.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str) {
            return Self::ALL
                .into_iter()
                .find(|a| a.class_name() == name)
                .ok_or_else(|| DecoderError::Architecture { found: name.to_string() });
        }
        match v.get("model_type").and_then(Value::as_str) {
            Some(t) => Self::ALL
                .into_iter()
                .find(|a| a.model_type() == t)
                .ok_or_else(|| DecoderError::Architecture { found: format!("model_type {t}") }),
            None => Err(DecoderError::config(
                "architectures",
                "missing, and no model_type either: is this a transformers config.json?",
            )),
        }
    }
}

/// Typed reads of one JSON object, naming the field (with `prefix`) in errors.
struct Fields<'a> {
    v: &'a Value,
    prefix: &'a str,
}

impl Fields<'_> {
    fn name(&self, field: &str) -> String {
        format!("{}{field}", self.prefix)
    }

    fn bad(&self, field: &str, expected: &str) -> DecoderError {
        let got = self.v.get(field).map_or("nothing".to_string(), |x| x.to_string());
        DecoderError::config(self.name(field), format!("expected {expected}, got {got}"))
    }

    /// The field, `None` when absent or null.
    fn get(&self, field: &str) -> Option<&Value> {
        self.v.get(field).filter(|x| !x.is_null())
    }

    /// A positive integer; `default` when absent (`None`: required).
    fn size(&self, field: &str, default: Option<usize>) -> DecoderResult<usize> {
        match self.get(field) {
            None => default.ok_or_else(|| DecoderError::config(self.name(field), "missing: the model's size needs it")),
            Some(x) => match x.as_u64() {
                Some(n) if n > 0 && n <= MAX_SIZE as u64 => Ok(n as usize),
                _ => Err(self.bad(field, &format!("a positive integer of at most {MAX_SIZE}"))),
            },
        }
    }

    /// A number, `default` when absent or null.
    fn number(&self, field: &str, default: Option<f64>) -> DecoderResult<Option<f64>> {
        match self.get(field) {
            None => Ok(default),
            Some(x) => x.as_f64().map(Some).ok_or_else(|| self.bad(field, "a number")),
        }
    }

    fn boolean(&self, field: &str, default: bool) -> DecoderResult<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(x) => x.as_bool().ok_or_else(|| self.bad(field, "true or false")),
        }
    }

    fn string(&self, field: &str) -> DecoderResult<Option<&str>> {
        match self.get(field) {
            None => Ok(None),
            Some(x) => x.as_str().map(Some).ok_or_else(|| self.bad(field, "a string")),
        }
    }

    /// A token id or a list of them (`eos_token_id`); `default` when absent.
    fn token_ids(&self, field: &str, default: &[u32]) -> DecoderResult<Vec<u32>> {
        let id = |x: &Value| x.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.v.get(field) {
            None => Ok(default.to_vec()),
            Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(a)) => a.iter().map(|x| id(x).ok_or_else(|| self.bad(field, "token ids"))).collect(),
            Some(x) => id(x).map(|t| vec![t]).ok_or_else(|| self.bad(field, "a token id or a list of them")),
        }
    }
}

/// What differs between the architectures before the shared parsing.
struct Family {
    gemma: bool,
    qwen2: bool,
    qwen3: bool,
    /// Defaults of the configuration class.
    head_dim: Option<usize>,
    max_position_embeddings: usize,
    tie_word_embeddings: bool,
    bos: Option<u32>,
    eos: &'static [u32],
    theta: f64,
}

impl Family {
    fn of(arch: HfArchitecture) -> Self {
        let base = Family {
            gemma: false,
            qwen2: false,
            qwen3: false,
            head_dim: None,
            max_position_embeddings: 2048,
            tie_word_embeddings: false,
            bos: None,
            eos: &[],
            theta: 10000.0,
        };
        match arch {
            HfArchitecture::Llama => Family { bos: Some(1), eos: &[2], ..base },
            HfArchitecture::Qwen2 => Family { qwen2: true, max_position_embeddings: 32768, ..base },
            HfArchitecture::Qwen3 => {
                Family { qwen3: true, head_dim: Some(128), max_position_embeddings: 32768, ..base }
            }
            HfArchitecture::Gemma3 | HfArchitecture::Gemma3Multimodal => Family {
                gemma: true,
                head_dim: Some(256),
                max_position_embeddings: 131072,
                tie_word_embeddings: true,
                bos: Some(2),
                eos: &[1],
                theta: 1e6,
                ..base
            },
        }
    }
}

/// The gated activation of a `hidden_act` name (every model of the family has a gated MLP).
fn gated_activation(name: &str) -> Option<DecoderActivation> {
    match name {
        "silu" | "swish" => Some(DecoderActivation::Swiglu),
        "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(DecoderActivation::Geglu),
        "gelu" => Some(DecoderActivation::GegluErf),
        "relu" => Some(DecoderActivation::Reglu),
        _ => None,
    }
}

/// One RoPE dictionary (`rope_theta`, `rope_type` or `type`, and the factors of its type).
fn rope_params(f: &Fields<'_>, default_theta: f64) -> DecoderResult<RopeConfig> {
    let theta = f.number("rope_theta", Some(default_theta))?.unwrap_or(default_theta) as f32;
    if let Some(p) = f.number("partial_rotary_factor", None)? {
        if p != 1.0 {
            return Err(f.bad("partial_rotary_factor", "1 (partial rotary embeddings are not supported)"));
        }
    }
    let kind = match f.string("rope_type")? {
        Some(t) => t,
        None => f.string("type")?.unwrap_or("default"),
    };
    let factor = |name: &str| -> DecoderResult<f32> {
        f.number(name, None)?.map(|x| x as f32).ok_or_else(|| f.bad(name, "a number (the rope type needs it)"))
    };
    let scaling = match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor("factor")? },
        "llama3" => RopeScaling::Llama3 {
            factor: factor("factor")?,
            low_freq_factor: factor("low_freq_factor")?,
            high_freq_factor: factor("high_freq_factor")?,
            original_max_position_embeddings: f.size("original_max_position_embeddings", None)?,
        },
        other => {
            return Err(DecoderError::config(
                f.name("rope_type"),
                format!("`{other}` is not supported: the family takes default, linear and llama3 RoPE"),
            ))
        }
    };
    Ok(RopeConfig { theta, scaling })
}

/// `(global, local)` RoPE from either layout (see the module docs).
fn rope(f: &Fields<'_>, fam: &Family) -> DecoderResult<(RopeConfig, Option<RopeConfig>)> {
    if f.number("partial_rotary_factor", None)?.is_some_and(|p| p != 1.0) {
        return Err(f.bad("partial_rotary_factor", "1 (partial rotary embeddings are not supported)"));
    }
    let local_theta = f.number("rope_local_base_freq", Some(10000.0))?.unwrap_or(10000.0);
    if let Some(p) = f.get("rope_parameters") {
        if !p.is_object() {
            return Err(f.bad("rope_parameters", "an object"));
        }
        let prefix = f.name("rope_parameters.");
        let nested = |kind: &str| p.get(kind).filter(|x| x.is_object());
        if nested("full_attention").is_some() || nested("sliding_attention").is_some() {
            let part = |kind: &str, theta: f64| -> DecoderResult<Option<RopeConfig>> {
                let prefix = format!("{prefix}{kind}.");
                nested(kind).map(|v| rope_params(&Fields { v, prefix: &prefix }, theta)).transpose()
            };
            let global = part("full_attention", fam.theta)?.unwrap_or(RopeConfig::new(fam.theta as f32));
            let local = part("sliding_attention", local_theta)?;
            return Ok((global, local.or(fam.gemma.then(|| RopeConfig::new(local_theta as f32)))));
        }
        let global = rope_params(
            &Fields { v: p, prefix: &prefix },
            f.number("rope_theta", Some(fam.theta))?.unwrap_or(fam.theta),
        )?;
        return Ok((global, fam.gemma.then(|| RopeConfig::new(local_theta as f32))));
    }
    let theta = f.number("rope_theta", Some(fam.theta))?.unwrap_or(fam.theta);
    let global = match f.get("rope_scaling") {
        None => RopeConfig::new(theta as f32),
        Some(s) if s.is_object() => {
            let prefix = f.name("rope_scaling.");
            rope_params(&Fields { v: s, prefix: &prefix }, theta).map(|r| RopeConfig { theta: theta as f32, ..r })?
        }
        Some(_) => return Err(f.bad("rope_scaling", "an object or null")),
    };
    Ok((global, fam.gemma.then(|| RopeConfig::new(local_theta as f32))))
}

/// Each layer's attention: `layer_types`, else Gemma's `sliding_window_pattern` or Qwen's
/// `use_sliding_window` / `max_window_layers`.
fn layer_types(f: &Fields<'_>, fam: &Family, layers: usize) -> DecoderResult<Vec<LayerAttention>> {
    if let Some(types) = f.get("layer_types") {
        let list = types.as_array().ok_or_else(|| f.bad("layer_types", "a list"))?;
        return list
            .iter()
            .map(|t| match t.as_str() {
                Some("full_attention") => Ok(LayerAttention::Global),
                Some("sliding_attention") => Ok(LayerAttention::Sliding),
                _ => Err(DecoderError::config(
                    f.name("layer_types"),
                    format!("entry {t} is not supported: the family takes full_attention and sliding_attention"),
                )),
            })
            .collect();
    }
    if fam.gemma {
        let pattern = match f.get("sliding_window_pattern") {
            Some(_) => f.size("sliding_window_pattern", None)?,
            None => f.size("_sliding_window_pattern", Some(6))?,
        };
        let kind = |i: usize| if (i + 1) % pattern != 0 { LayerAttention::Sliding } else { LayerAttention::Global };
        return Ok((0..layers).map(kind).collect());
    }
    let sliding = (fam.qwen2 || fam.qwen3) && f.boolean("use_sliding_window", false)?;
    let first = if sliding { f.size("max_window_layers", Some(28))? } else { layers };
    Ok((0..layers).map(|i| if i >= first { LayerAttention::Sliding } else { LayerAttention::Global }).collect())
}

/// The configuration of `arch` from its (text) configuration object `f`.
fn parse(f: &Fields<'_>, arch: HfArchitecture, outer: &Fields<'_>) -> DecoderResult<DecoderConfig> {
    let fam = Family::of(arch);
    let nested_gemma = arch == HfArchitecture::Gemma3Multimodal;
    let size = |field: &str, gemma_default: usize| f.size(field, nested_gemma.then_some(gemma_default));
    let hidden_size = size("hidden_size", 2304)?;
    let heads = size("num_attention_heads", 8)?;
    let num_layers = size("num_hidden_layers", 26)?;
    if num_layers > MAX_LAYERS {
        return Err(f.bad("num_hidden_layers", &format!("at most {MAX_LAYERS} layers")));
    }
    let head_dim = match (f.get("head_dim"), fam.head_dim) {
        (Some(_), _) => f.size("head_dim", None)?,
        (None, Some(d)) => d,
        (None, None) if hidden_size % heads == 0 => hidden_size / heads,
        (None, None) => {
            return Err(DecoderError::config(
                f.name("head_dim"),
                format!("missing, and num_attention_heads = {heads} does not divide hidden_size = {hidden_size}"),
            ))
        }
    };
    let act_field = if fam.gemma && f.get("hidden_activation").is_some() { "hidden_activation" } else { "hidden_act" };
    let act_name = f.string(act_field)?.unwrap_or(if fam.gemma { "gelu_pytorch_tanh" } else { "silu" });
    let activation = gated_activation(act_name).ok_or_else(|| {
        DecoderError::config(
            f.name(act_field),
            format!("`{act_name}` is not supported: silu, gelu, gelu_pytorch_tanh, gelu_new, relu"),
        )
    })?;
    if fam.gemma && f.boolean("use_bidirectional_attention", false)? {
        return Err(f.bad("use_bidirectional_attention", "false (bidirectional attention is not a decoder)"));
    }
    let attention_bias = f.boolean("attention_bias", false)?;
    let (rope, rope_local) = rope(f, &fam)?;
    let layer_types = layer_types(f, &fam, num_layers)?;
    // Gemma3TextConfig and Qwen2Config / Qwen3Config default the window to 4096.
    let default_window = (fam.gemma || fam.qwen2 || fam.qwen3).then_some(4096);
    let sliding_window = match layer_types.contains(&LayerAttention::Sliding) {
        false => None,
        true if f.get("sliding_window").is_none() => default_window,
        true => Some(f.size("sliding_window", None)?),
    };
    // Special tokens sit at the top level of a multimodal config.
    let tokens = if nested_gemma && f.v.get("eos_token_id").is_none() { outer } else { f };
    let softcap = |field: &str| -> DecoderResult<Option<f32>> { Ok(f.number(field, None)?.map(|x| x as f32)) };
    let cfg = DecoderConfig {
        vocab_size: size("vocab_size", 262208)?,
        hidden_size,
        ffn_hidden_size: size("intermediate_size", 9216)?,
        num_layers,
        num_attention_heads: heads,
        num_gqa_groups: f.size("num_key_value_heads", Some(if nested_gemma { 4 } else { heads }))?,
        head_dim,
        normalization: NormKind::RmsNorm,
        layernorm_epsilon: f.number("rms_norm_eps", Some(1e-6))?.unwrap_or(1e-6) as f32,
        zero_centered_gamma: fam.gemma,
        sandwich_norm: fam.gemma,
        qk_norm: fam.gemma || fam.qwen3,
        activation,
        rope,
        rope_local,
        layer_types,
        sliding_window,
        qkv_bias: fam.qwen2 || attention_bias,
        proj_bias: !fam.qwen2 && attention_bias,
        mlp_bias: arch == HfArchitecture::Llama && f.boolean("mlp_bias", false)?,
        tie_word_embeddings: match outer.get("tie_word_embeddings") {
            Some(_) => outer.boolean("tie_word_embeddings", fam.tie_word_embeddings)?,
            None => f.boolean("tie_word_embeddings", fam.tie_word_embeddings)?,
        },
        scale_embeddings: fam.gemma,
        query_pre_attn_scalar: if fam.gemma {
            f.number("query_pre_attn_scalar", Some(256.0))?.map(|x| x as f32)
        } else {
            None
        },
        final_logit_softcapping: if fam.gemma { softcap("final_logit_softcapping")? } else { None },
        // transformers' Gemma3Attention does not pass `attn_logit_softcapping` to the attention
        // (Gemma 2's does): it is read and not applied, as there.
        attn_logit_softcapping: None,
        max_position_embeddings: f.size("max_position_embeddings", Some(fam.max_position_embeddings))?,
        bos_token_id: tokens.token_ids("bos_token_id", fam.bos.as_slice())?.first().copied(),
        eos_token_ids: tokens.token_ids("eos_token_id", fam.eos)?,
    };
    if fam.gemma {
        softcap("attn_logit_softcapping")?;
    }
    cfg.validate()?;
    Ok(cfg)
}

impl DecoderConfig {
    /// Parses a Hugging Face `config.json` text (see the module docs).
    ///
    /// # Errors
    /// [`DecoderError::Json`] for text that is not a JSON object; [`DecoderError::Architecture`]
    /// for an architecture the family does not import; [`DecoderError::Config`] naming a missing,
    /// mistyped or unsupported field (a RoPE type other than default / linear / llama3, an
    /// activation other than silu / gelu / gelu_pytorch_tanh / relu, bidirectional attention)
    /// and the checks of [`DecoderConfig::validate`].
    pub fn from_hf_json(text: &str) -> DecoderResult<Self> {
        Ok(Self::from_hf_json_with_architecture(text)?.0)
    }

    /// [`DecoderConfig::from_hf_json`] and the architecture it names.
    ///
    /// # Errors
    /// As [`DecoderConfig::from_hf_json`].
    pub fn from_hf_json_with_architecture(text: &str) -> DecoderResult<(Self, HfArchitecture)> {
        let json = |message: String| DecoderError::Json { path: "config.json".into(), message };
        let v: Value = serde_json::from_str(text).map_err(|e| json(e.to_string()))?;
        if !v.is_object() {
            return Err(json("not a JSON object".into()));
        }
        let arch = HfArchitecture::of_config(&v)?;
        let outer = Fields { v: &v, prefix: "" };
        let cfg = if arch == HfArchitecture::Gemma3Multimodal {
            let text_cfg = v.get("text_config").filter(|t| t.is_object()).ok_or_else(|| {
                DecoderError::config(
                    "text_config",
                    "missing: Gemma3ForConditionalGeneration keeps its text model's configuration there",
                )
            })?;
            parse(&Fields { v: text_cfg, prefix: "text_config." }, arch, &outer)?
        } else {
            parse(&outer, arch, &outer)?
        };
        Ok((cfg, arch))
    }

    /// Reads a `config.json`: `path` is the file or the model directory holding it.
    ///
    /// # Errors
    /// [`DecoderError::MissingFile`] / [`DecoderError::Io`]; as [`DecoderConfig::from_hf_json`],
    /// JSON errors naming the file.
    pub fn from_hf_config(path: &Path) -> DecoderResult<Self> {
        Ok(read_hf_config(path)?.0)
    }
}

/// The configuration and architecture of `path` (a `config.json` or the directory holding one).
pub(super) fn read_hf_config(path: &Path) -> DecoderResult<(DecoderConfig, HfArchitecture)> {
    let file = if path.is_dir() { path.join("config.json") } else { path.to_path_buf() };
    let bytes = read_file(&file)?;
    let text =
        String::from_utf8(bytes).map_err(|e| DecoderError::Json { path: file.clone(), message: e.to_string() })?;
    DecoderConfig::from_hf_json_with_architecture(&text).map_err(|e| match e {
        DecoderError::Json { message, .. } => DecoderError::Json { path: file, message },
        e => e,
    })
}
