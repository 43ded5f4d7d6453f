//! A decoder from a GGUF file (llama.cpp's format, `llama.cpp/src/llama-model.cpp` and gguf-py's
//! `convert_hf_to_gguf.py`): the metadata read as the `config.json` transformers would have
//! written ([`DecoderConfig::from_gguf`]: one home for each family's defaults, the Hugging Face
//! parser's), the tensors dequantized to f32 and renamed to Hugging Face's names
//! ([`DecoderWeights::from_gguf`]), undoing what the converter changed:
//!
//! | GGUF | Hugging Face (`model.` prefix) |
//! |---|---|
//! | `token_embd`, `output_norm`, `output` | `embed_tokens`, `norm`, `lm_head` (no prefix; absent: tied) |
//! | `blk.{i}.attn_norm` | `layers.{i}.input_layernorm` |
//! | `blk.{i}.attn_{q,k,v}`, `attn_output` | `layers.{i}.self_attn.{q,k,v}_proj`, `o_proj` |
//! | `blk.{i}.attn_{q,k}_norm` | `layers.{i}.self_attn.{q,k}_norm` |
//! | `blk.{i}.ffn_norm` | `pre_feedforward_layernorm` (Gemma 3), `post_attention_layernorm` (Llama, Qwen) |
//! | `blk.{i}.post_attention_norm`, `post_ffw_norm` | `post_attention_layernorm`, `post_feedforward_layernorm` (Gemma 3) |
//! | `blk.{i}.ffn_{gate,up,down}` | `layers.{i}.mlp.{gate,up,down}_proj` |
//!
//! - Llama's q and k rows: the converter interleaves each head's two rotary halves for
//!   llama.cpp's "normal" RoPE (`LlamaModel.permute`); they are put back in transformers'
//!   half-split order. Qwen and Gemma are stored as they are (NeoX RoPE).
//! - Gemma's norms: the converter stores `1 + γ` (`Gemma3Model.modify_tensors`), so the decoder
//!   reads them as plain weights (`zero_centered_gamma` off).
//! - Gemma 3's values llama.cpp fixes in code rather than metadata: every sixth layer global,
//!   the others sliding, local RoPE base 10 000, the softmax scale `key_length^−½`
//!   (`llm_build_gemma3_iswa`), as `Gemma3TextConfig`'s defaults give.

use super::config::DecoderConfig;
use super::hf_config::HfArchitecture;
use super::weights::{DecoderWeights, WeightTensor};
use super::{DecoderError, DecoderResult};
use crate::gguf::{GgufFile, Metadata};
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;

/// The `general.architecture` values read, and the Hugging Face class each maps to.
const ARCHITECTURES: [(&str, HfArchitecture); 4] = [
    ("llama", HfArchitecture::Llama),
    ("qwen2", HfArchitecture::Qwen2),
    ("qwen3", HfArchitecture::Qwen3),
    ("gemma3", HfArchitecture::Gemma3),
];

/// The Hugging Face architecture of a GGUF file's `general.architecture`.
fn architecture(meta: &Metadata) -> DecoderResult<(&str, HfArchitecture)> {
    let arch = meta.architecture()?;
    ARCHITECTURES.iter().find(|(name, _)| *name == arch).map(|&(n, a)| (n, a)).ok_or_else(|| {
        DecoderError::config(
            "general.architecture",
            format!("`{arch}` is not supported: the decoder family reads GGUF files of llama, qwen2, qwen3 and gemma3"),
        )
    })
}

impl DecoderConfig {
    /// The configuration of a GGUF file (see the module docs): its `{arch}.*` keys as the
    /// `config.json` of the matching Hugging Face class, parsed by
    /// [`DecoderConfig::from_hf_json_with_architecture`]; `zero_centered_gamma` off for Gemma
    /// (the file stores `1 + γ`).
    ///
    /// # Errors
    /// [`DecoderError::Config`] for another architecture, a missing or mistyped key (named with
    /// its GGUF key), RoPE frequencies stored as a tensor (`rope_freqs`: Llama 3.1's scaling,
    /// not read yet), and what the Hugging Face parser refuses.
    pub fn from_gguf(file: &GgufFile) -> DecoderResult<DecoderConfig> {
        let meta = file.metadata();
        let (name, arch) = architecture(meta)?;
        if file.get_tensor("rope_freqs.weight").is_some() {
            return Err(DecoderError::config(
                "rope_freqs.weight",
                "RoPE frequency factors stored as a tensor (Llama 3.1's scaling) are not read yet: use the model's \
                 Hugging Face directory, whose config.json names the scaling",
            ));
        }
        let key = |suffix: &str| format!("{name}.{suffix}");
        let size = |suffix: &str| -> DecoderResult<Value> { Ok(json!(meta.get_u64(&key(suffix))?)) };
        let heads = meta.get_u64(&key("attention.head_count"))?;
        let mut c = Map::new();
        c.insert("architectures".into(), json!([arch.class_name()]));
        c.insert("hidden_size".into(), size("embedding_length")?);
        c.insert("intermediate_size".into(), size("feed_forward_length")?);
        c.insert("num_hidden_layers".into(), size("block_count")?);
        c.insert("num_attention_heads".into(), json!(heads));
        let kv = meta.optional(&key("attention.head_count_kv"), Metadata::get_u64)?.unwrap_or(heads);
        c.insert("num_key_value_heads".into(), json!(kv));
        if let Some(d) = meta.optional(&key("attention.key_length"), Metadata::get_u64)? {
            c.insert("head_dim".into(), json!(d));
        }
        c.insert("rms_norm_eps".into(), json!(meta.get_f32(&key("attention.layer_norm_rms_epsilon"))?));
        if let Some(theta) = meta.optional(&key("rope.freq_base"), Metadata::get_f32)? {
            c.insert("rope_theta".into(), json!(theta));
        }
        if let Some(kind) = meta.optional(&key("rope.scaling.type"), |m, k| m.get_str(k).map(str::to_string))? {
            if kind != "none" {
                let factor = meta.get_f32(&key("rope.scaling.factor"))?;
                c.insert("rope_scaling".into(), json!({ "rope_type": kind, "factor": factor }));
            }
        } else if let Some(factor) = meta.optional(&key("rope.scaling.factor"), Metadata::get_f32)? {
            c.insert("rope_scaling".into(), json!({ "rope_type": "linear", "factor": factor }));
        }
        if let Some(ctx) = meta.optional(&key("context_length"), Metadata::get_u64)? {
            c.insert("max_position_embeddings".into(), json!(ctx));
        }
        if let Some(window) = meta.optional(&key("attention.sliding_window"), Metadata::get_u64)? {
            c.insert("sliding_window".into(), json!(window));
        }
        if arch == HfArchitecture::Gemma3 {
            // llm_build_gemma3_iswa: scale 1/√key_length; 10 000 for the sliding layers' RoPE.
            if let Some(d) = meta.optional(&key("attention.key_length"), Metadata::get_u64)? {
                c.insert("query_pre_attn_scalar".into(), json!(d));
            }
            c.insert("rope_local_base_freq".into(), json!(10_000.0));
        }
        let vocab = meta.get_str_array("tokenizer.ggml.tokens").map(<[String]>::len);
        let vocab = match (vocab, file.get_tensor("token_embd.weight")) {
            (Ok(n), _) => n as u64,
            (Err(_), Some(t)) => t.shape().first().copied().unwrap_or(0) as u64,
            (Err(e), None) => return Err(e.into()),
        };
        c.insert("vocab_size".into(), json!(vocab));
        c.insert("tie_word_embeddings".into(), json!(file.get_tensor("output.weight").is_none()));
        for (gguf, hf) in
            [("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id")]
        {
            if let Some(id) = meta.optional(gguf, Metadata::get_u32)? {
                c.insert(hf.into(), json!(id));
            }
        }
        let text = Value::Object(c).to_string();
        let (mut cfg, _) = DecoderConfig::from_hf_json_with_architecture(&text)?;
        if arch == HfArchitecture::Gemma3 {
            cfg.zero_centered_gamma = false;
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The Hugging Face name of GGUF tensor `name` of `arch` (`None`: not a tensor of the model).
fn hf_name(arch: HfArchitecture, name: &str) -> Option<String> {
    match name {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output_norm.bias" => return Some("model.norm.bias".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, tail) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (base, kind) = tail.rsplit_once('.')?;
    let gemma = arch == HfArchitecture::Gemma3;
    let hf = match base {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" if gemma => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" if gemma => "post_attention_layernorm",
        "post_ffw_norm" if gemma => "post_feedforward_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Undoes `convert_hf_to_gguf.py`'s `LlamaModel.permute` of a q or k projection `[heads · d,
/// cols]`: the converter stores, per head, row `2i + j` ← row `j · d/2 + i` (the two rotary
/// halves interleaved); this puts each head's rows back as `[first half | second half]`.
fn unpermute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let rows = w.len() / cols.max(1);
    let d = rows / heads.max(1);
    let half = d / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = h * d + 2 * i + j;
                let to = h * d + j * half + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&w[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

impl DecoderWeights {
    /// The weights of a GGUF file with their configuration ([`DecoderConfig::from_gguf`]):
    /// every tensor dequantized to f32 (`gguf::dequantize_f32`: F32, F16, BF16, Q4_0 … Q8_K),
    /// renamed and un-permuted as the module docs say, then checked and mapped as
    /// [`DecoderWeights::from_hf_tensors`] does. A tensor of another model (unknown name) is
    /// reported as unexpected.
    ///
    /// # Errors
    /// The errors of [`DecoderConfig::from_gguf`]; [`DecoderError::Runtime`] for a tensor the
    /// reader cannot decode (naming it and its type); [`DecoderError::Weights`] listing every
    /// missing, unexpected or mis-shaped tensor.
    pub fn from_gguf(file: &GgufFile) -> DecoderResult<Self> {
        let cfg = DecoderConfig::from_gguf(file)?;
        let (_, arch) = architecture(file.metadata())?;
        let mut tensors = BTreeMap::new();
        for info in file.tensors() {
            let name = info.name();
            let hf = hf_name(arch, name).unwrap_or_else(|| format!("gguf:{name}"));
            let shape = info.shape();
            let mut data = file.tensor(name)?.to_f32()?;
            if arch == HfArchitecture::Llama && shape.len() == 2 {
                let cols = shape[1];
                if hf.ends_with("self_attn.q_proj.weight") {
                    data = unpermute(&data, cfg.num_attention_heads, cols);
                } else if hf.ends_with("self_attn.k_proj.weight") {
                    data = unpermute(&data, cfg.num_gqa_groups, cols);
                }
            }
            tensors.insert(hf, WeightTensor { shape, data });
        }
        let mut weights = DecoderWeights::from_hf_tensors(cfg, tensors)?;
        weights.architecture = Some(arch);
        Ok(weights)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inverse of gguf-py's `LlamaModel.permute` (written from its numpy:
    /// `w.reshape(heads, 2, d/2, cols).swapaxes(1, 2).reshape(...)`).
    fn permute(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
        let d = w.len() / cols / heads;
        let mut out = vec![0.0; w.len()];
        for h in 0..heads {
            for j in 0..2 {
                for i in 0..d / 2 {
                    let from = h * d + j * (d / 2) + i;
                    let to = h * d + 2 * i + j;
                    out[to * cols..(to + 1) * cols].copy_from_slice(&w[from * cols..(from + 1) * cols]);
                }
            }
        }
        out
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        let (heads, d, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..heads * d * cols).map(|i| i as f32).collect();
        assert_eq!(unpermute(&permute(&w, heads, cols), heads, cols), w);
        // Head 0, row 1 of the stored order is the first row of the second half.
        let p = permute(&w, heads, cols);
        assert_eq!(&p[cols..2 * cols], &w[(d / 2) * cols..(d / 2 + 1) * cols]);
    }

    #[test]
    fn names_map_to_hugging_face_by_family() {
        let g = HfArchitecture::Gemma3;
        assert_eq!(hf_name(g, "blk.3.ffn_norm.weight").unwrap(), "model.layers.3.pre_feedforward_layernorm.weight");
        assert_eq!(
            hf_name(g, "blk.3.post_ffw_norm.weight").unwrap(),
            "model.layers.3.post_feedforward_layernorm.weight"
        );
        let l = HfArchitecture::Llama;
        assert_eq!(hf_name(l, "blk.0.ffn_norm.weight").unwrap(), "model.layers.0.post_attention_layernorm.weight");
        assert_eq!(hf_name(l, "blk.0.attn_q.bias").unwrap(), "model.layers.0.self_attn.q_proj.bias");
        assert_eq!(hf_name(l, "output.weight").unwrap(), "lm_head.weight");
        assert!(hf_name(l, "blk.0.post_ffw_norm.weight").is_none() && hf_name(l, "rope_freqs.weight").is_none());
    }
}
