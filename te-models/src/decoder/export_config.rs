//! The `config.json` an export writes ([`hf_config`]): a [`DecoderConfig`] as the configuration of
//! `LlamaForCausalLM`, `Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `Gemma3ForCausalLM`, with
//! the fields transformers reads (`configuration_llama.py`, `configuration_qwen2.py`,
//! `configuration_qwen3.py`, `configuration_gemma3.py`).
//!
//! RoPE is written in both layouts: transformers 5's `rope_parameters` (Gemma 3: per layer type,
//! `full_attention` and `sliding_attention`) and transformers 4's `rope_theta` + `rope_scaling`
//! (+ `rope_local_base_freq`), which transformers 5 still reads (its
//! `convert_rope_params_to_dict` lets `rope_scaling` replace, for Gemma update, the first: the
//! two agree). Numbers are written as the shortest decimal of their f32 (`1e-06`, not
//! `9.999999974752427e-07`), so that transformers computes with the value the model was trained
//! with.
//!
//! The written text is parsed back with [`DecoderConfig::from_hf_json`] and must give the
//! configuration again, up to what has no effect (the window of a model without sliding layers,
//! the local RoPE of one whose sliding layers use the global one, a softmax scalar equal to
//! `head_dim`) and the norm-weight convention: Gemma's `config.json` means `1 + γ` norms
//! (`Gemma3RMSNorm`), the others plain `γ`, so weights stored the other way (a GGUF Gemma's `1 +
//! γ`, see `gguf.rs`) are shifted by [`HfConfigPlan::gamma_shift`] on export. Anything else that
//! would read back differently (a LayerNorm model, a Llama with sliding layers, a Qwen2 without
//! q/k/v biases, Gemma 2's attention softcapping...) is refused, naming the field.

use super::config::{DecoderActivation, DecoderConfig, LayerAttention};
use super::hf_config::HfArchitecture;
use super::rope::{RopeConfig, RopeScaling};
use super::{DecoderError, DecoderResult};
use serde_json::{json, Map, Value};
use te_codegen::DType;

/// What an export writes for a configuration.
#[derive(Debug, Clone)]
pub(super) struct HfConfigPlan {
    /// The class written (`architectures[0]`).
    pub arch: HfArchitecture,
    /// The `config.json` object.
    pub json: Value,
    /// Added to every norm weight on export: `−1` for weights stored as `1 + γ` under a Gemma
    /// `config.json` (which means `γ` applied as `1 + γ`), `+1` for zero-centered weights under
    /// a plain one, else 0.
    pub gamma_shift: f32,
}

/// The `torch_dtype` / `dtype` name of an export dtype.
///
/// # Errors
/// [`DecoderError::ExportDtype`] for an FP8 dtype.
pub(super) fn torch_dtype(dtype: DType) -> DecoderResult<&'static str> {
    match dtype {
        DType::F32 => Ok("float32"),
        DType::BF16 => Ok("bfloat16"),
        DType::F16 => Ok("float16"),
        DType::E4M3 | DType::E5M2 => Err(DecoderError::ExportDtype { dtype }),
    }
}

/// The class a model of `cfg` is written as: the one it was imported from (the multimodal Gemma's
/// text model as `Gemma3ForCausalLM`), else the one its features name (sandwich norms: Gemma 3;
/// q/k norms: Qwen3; q/k/v biases without an output bias: Qwen2; else Llama).
pub(super) fn export_architecture(cfg: &DecoderConfig, found: Option<HfArchitecture>) -> HfArchitecture {
    match found {
        Some(HfArchitecture::Gemma3Multimodal) => HfArchitecture::Gemma3,
        Some(a) => a,
        None if cfg.sandwich_norm || cfg.scale_embeddings => HfArchitecture::Gemma3,
        None if cfg.qk_norm => HfArchitecture::Qwen3,
        None if cfg.qkv_bias && !cfg.proj_bias => HfArchitecture::Qwen2,
        None => HfArchitecture::Llama,
    }
}

/// `x` as the shortest decimal that reads back as the same f32 (`1e-06` for `1e-6f32`).
fn number(x: f32) -> Value {
    let shortest: f64 = x.to_string().parse().unwrap_or(f64::from(x));
    let v = if shortest as f32 == x { shortest } else { f64::from(x) };
    json!(v)
}

/// `x` as an integer when it is one (fields transformers types as `int`), else [`number`].
fn integer_or_number(x: f32) -> Value {
    if x.fract() == 0.0 && x.abs() < 1e15 {
        json!(x as i64)
    } else {
        number(x)
    }
}

/// The `rope_type` and factors of a scaling (without `rope_theta`); `None` for no scaling.
fn scaling(s: &RopeScaling) -> Option<Map<String, Value>> {
    let v = match *s {
        RopeScaling::None => return None,
        RopeScaling::Linear { factor } => json!({ "rope_type": "linear", "factor": number(factor) }),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            json!({
                "rope_type": "llama3",
                "factor": number(factor),
                "low_freq_factor": number(low_freq_factor),
                "high_freq_factor": number(high_freq_factor),
                "original_max_position_embeddings": original_max_position_embeddings,
            })
        }
    };
    v.as_object().cloned()
}

/// One `rope_parameters` dictionary: `rope_type`, `rope_theta` and the factors.
fn rope_parameters(r: &RopeConfig) -> Value {
    let mut m = scaling(&r.scaling).unwrap_or_else(|| {
        let mut m = Map::new();
        m.insert("rope_type".into(), json!("default"));
        m
    });
    m.insert("rope_theta".into(), number(r.theta));
    Value::Object(m)
}

/// The `hidden_act` of an activation (the gated ones under their gate's name, as transformers
/// names them; a non-gated one under the same name, which reads back gated and is refused).
fn activation_name(a: DecoderActivation) -> &'static str {
    match a {
        DecoderActivation::Swiglu | DecoderActivation::Silu => "silu",
        DecoderActivation::Geglu | DecoderActivation::GeluTanh => "gelu_pytorch_tanh",
        DecoderActivation::GegluErf | DecoderActivation::Gelu => "gelu",
        DecoderActivation::Reglu | DecoderActivation::Relu => "relu",
    }
}

/// Gemma's `sliding_window_pattern`: `p` when every `p`-th layer is global and the others slide.
fn sliding_pattern(types: &[LayerAttention]) -> Option<usize> {
    let p = types.iter().position(|&t| t == LayerAttention::Global)? + 1;
    let fits = types.iter().enumerate().all(|(i, &t)| (t == LayerAttention::Global) == ((i + 1) % p == 0));
    fits.then_some(p)
}

/// `cfg` with what has no effect made canonical: no window without sliding layers, no local RoPE
/// when no layer slides or it equals the global one, no softmax scalar equal to `head_dim`.
fn effective(cfg: &DecoderConfig) -> DecoderConfig {
    let mut c = cfg.clone();
    let slides = c.layer_types.contains(&LayerAttention::Sliding);
    if !slides {
        c.sliding_window = None;
    }
    if !slides || c.rope_local == Some(c.rope) {
        c.rope_local = None;
    }
    if c.query_pre_attn_scalar == Some(c.head_dim as f32) {
        c.query_pre_attn_scalar = None;
    }
    c
}

/// `field: value (reads back as other)` for every field where `want` and `got` differ.
fn differences(want: &DecoderConfig, got: &DecoderConfig) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    macro_rules! compare {
        ($($field:ident),* $(,)?) => {$(
            if want.$field != got.$field {
                out.push((
                    stringify!($field),
                    format!("{}: {:?} would read back as {:?}", stringify!($field), want.$field, got.$field),
                ));
            }
        )*};
    }
    compare!(
        vocab_size,
        hidden_size,
        ffn_hidden_size,
        num_layers,
        num_attention_heads,
        num_gqa_groups,
        head_dim,
        normalization,
        layernorm_epsilon,
        zero_centered_gamma,
        sandwich_norm,
        qk_norm,
        activation,
        rope,
        rope_local,
        layer_types,
        sliding_window,
        qkv_bias,
        proj_bias,
        mlp_bias,
        tie_word_embeddings,
        scale_embeddings,
        query_pre_attn_scalar,
        final_logit_softcapping,
        attn_logit_softcapping,
        max_position_embeddings,
        bos_token_id,
        eos_token_ids,
    );
    out
}

/// The `config.json` of `cfg` written as `found`'s class (see [`export_architecture`]) with
/// weights in `dtype`; `pad_token_id` when the tokenizer has one.
///
/// # Errors
/// [`DecoderError::ExportDtype`] for an FP8 dtype; the errors of [`DecoderConfig::validate`];
/// [`DecoderError::Config`] naming the first field that the class cannot express (every such
/// field in the message).
pub(super) fn hf_config(
    cfg: &DecoderConfig,
    found: Option<HfArchitecture>,
    dtype: DType,
    pad_token_id: Option<u32>,
) -> DecoderResult<HfConfigPlan> {
    cfg.validate()?;
    let dtype_name = torch_dtype(dtype)?;
    let arch = export_architecture(cfg, found);
    let (gemma, llama) = (arch == HfArchitecture::Gemma3, arch == HfArchitecture::Llama);
    let mut c = Map::new();
    let mut put = |k: &str, v: Value| {
        c.insert(k.to_string(), v);
    };
    put("architectures", json!([arch.class_name()]));
    put("model_type", json!(arch.model_type()));
    put("vocab_size", json!(cfg.vocab_size));
    put("hidden_size", json!(cfg.hidden_size));
    put("intermediate_size", json!(cfg.ffn_hidden_size));
    put("num_hidden_layers", json!(cfg.num_layers));
    put("num_attention_heads", json!(cfg.num_attention_heads));
    put("num_key_value_heads", json!(cfg.num_gqa_groups));
    put("head_dim", json!(cfg.head_dim));
    put("rms_norm_eps", number(cfg.layernorm_epsilon));
    put("max_position_embeddings", json!(cfg.max_position_embeddings));
    put("tie_word_embeddings", json!(cfg.tie_word_embeddings));
    put("bos_token_id", json!(cfg.bos_token_id));
    put(
        "eos_token_id",
        match cfg.eos_token_ids.as_slice() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        },
    );
    if let Some(pad) = pad_token_id {
        // Absent otherwise: the class's default (Gemma's 0) then applies.
        put("pad_token_id", json!(pad));
    }
    put("dtype", json!(dtype_name));
    put("torch_dtype", json!(dtype_name));
    put("use_cache", json!(true));
    put("attention_dropout", json!(0.0));
    put(if gemma { "hidden_activation" } else { "hidden_act" }, json!(activation_name(cfg.activation)));
    if arch != HfArchitecture::Qwen2 {
        // Qwen2 always has q/k/v biases and never an output bias: no field.
        put("attention_bias", json!(cfg.qkv_bias));
    }
    if llama {
        put("mlp_bias", json!(cfg.mlp_bias));
    }
    let slides = cfg.layer_types.contains(&LayerAttention::Sliding);
    let names: Vec<&str> = cfg
        .layer_types
        .iter()
        .map(|t| match t {
            LayerAttention::Global => "full_attention",
            LayerAttention::Sliding => "sliding_attention",
        })
        .collect();
    if !llama {
        // LlamaConfig has no layer types: a sliding Llama reads back global and is refused.
        put("layer_types", json!(names));
        put("sliding_window", json!(cfg.sliding_window.filter(|_| slides)));
    }
    if matches!(arch, HfArchitecture::Qwen2 | HfArchitecture::Qwen3) {
        let first = cfg.layer_types.iter().position(|&t| t == LayerAttention::Sliding).unwrap_or(cfg.num_layers);
        put("use_sliding_window", json!(slides));
        put("max_window_layers", json!(first));
    }
    let legacy_scaling = scaling(&cfg.rope.scaling).map_or(Value::Null, Value::Object);
    if gemma {
        let local = cfg.rope_local.unwrap_or(cfg.rope);
        put(
            "rope_parameters",
            json!({ "full_attention": rope_parameters(&cfg.rope), "sliding_attention": rope_parameters(&local) }),
        );
        put("rope_local_base_freq", number(local.theta));
        if let Some(p) = sliding_pattern(&cfg.layer_types) {
            put("sliding_window_pattern", json!(p));
        }
        let scalar = cfg.query_pre_attn_scalar.unwrap_or(cfg.head_dim as f32);
        put("query_pre_attn_scalar", integer_or_number(scalar));
        put("final_logit_softcapping", cfg.final_logit_softcapping.map_or(Value::Null, number));
        put("attn_logit_softcapping", cfg.attn_logit_softcapping.map_or(Value::Null, number));
        put("use_bidirectional_attention", json!(false));
    } else {
        put("rope_parameters", rope_parameters(&cfg.rope));
    }
    put("rope_theta", number(cfg.rope.theta));
    put("rope_scaling", legacy_scaling);
    let json = Value::Object(c);

    // The text must read back as the configuration (see the module docs).
    let back = DecoderConfig::from_hf_json(&json.to_string())?;
    let want = DecoderConfig { zero_centered_gamma: gemma, ..cfg.clone() };
    let diffs = differences(&effective(&want), &effective(&back));
    if let Some((field, _)) = diffs.first() {
        let all: Vec<String> = diffs.iter().map(|(_, d)| d.clone()).collect();
        return Err(DecoderError::config(
            *field,
            format!("a {} config.json cannot express this model: {}", arch.class_name(), all.join("; ")),
        ));
    }
    let gamma_shift = match (cfg.zero_centered_gamma, gemma) {
        (false, true) => -1.0,
        (true, false) => 1.0,
        _ => 0.0,
    };
    Ok(HfConfigPlan { arch, json, gamma_shift })
}
