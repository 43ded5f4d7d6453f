//! The parameters of a decoder: internal (TE/Megatron) names and shapes, and the Hugging Face
//! tensors each is made of ([`hf_layout`]; the table is in the [module docs](super)).

use super::config::DecoderConfig;
use te_nn::modules::NormKind;

/// One internal parameter and the Hugging Face tensors it is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSource {
    /// The internal name (`layers.0.self_attention.layernorm_qkv.weight`).
    pub name: String,
    /// Its shape (row-major).
    pub shape: Vec<usize>,
    /// The Hugging Face tensors (names under the `model.` prefix of `LlamaForCausalLM`, or
    /// `lm_head.weight`) and their shapes, concatenated along dimension 0 in this order.
    pub hf: Vec<(String, Vec<usize>)>,
}

impl ParamSource {
    fn one(name: String, shape: Vec<usize>, hf: String) -> Self {
        Self { hf: vec![(hf, shape.clone())], name, shape }
    }
}

/// The norm tensors of one norm: `(internal, hf)` name pairs for the weight and, for LayerNorm,
/// the bias; `internal` is `(weight name, bias name)`.
fn norm(cfg: &DecoderConfig, out: &mut Vec<ParamSource>, (weight, bias): (String, String), hf: &str, width: usize) {
    out.push(ParamSource::one(weight, vec![width], format!("{hf}.weight")));
    if cfg.normalization == NormKind::LayerNorm {
        out.push(ParamSource::one(bias, vec![width], format!("{hf}.bias")));
    }
}

/// Every parameter of a model of `cfg`, in order (embedding, layers, final norm, LM head when
/// untied), with its Hugging Face sources.
pub fn hf_layout(cfg: &DecoderConfig) -> Vec<ParamSource> {
    let (h, v, d) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
    let (f, attn) = (cfg.ffn_hidden_size, cfg.attention_size());
    let kv = cfg.num_gqa_groups * d;
    let mut out = vec![ParamSource::one("embedding.weight".into(), vec![v, h], "model.embed_tokens.weight".into())];
    for l in 0..cfg.num_layers {
        let (p, hp) = (format!("layers.{l}."), format!("model.layers.{l}."));
        let pair = |base: &str, w: &str, b: &str| (format!("{p}{base}.{w}"), format!("{p}{base}.{b}"));
        let qkv = format!("{p}self_attention.layernorm_qkv");
        norm(
            cfg,
            &mut out,
            pair("self_attention.layernorm_qkv", "layer_norm_weight", "layer_norm_bias"),
            &format!("{hp}input_layernorm"),
            h,
        );
        let proj = |kind: &str| {
            [("q", attn), ("k", kv), ("v", kv)].map(|(x, n)| (format!("{hp}self_attn.{x}_proj.{kind}"), n))
        };
        out.push(ParamSource {
            name: format!("{qkv}.weight"),
            shape: vec![cfg.qkv_size(), h],
            hf: proj("weight").into_iter().map(|(name, n)| (name, vec![n, h])).collect(),
        });
        if cfg.qkv_bias {
            out.push(ParamSource {
                name: format!("{qkv}.bias"),
                shape: vec![cfg.qkv_size()],
                hf: proj("bias").into_iter().map(|(name, n)| (name, vec![n])).collect(),
            });
        }
        if cfg.qk_norm {
            for (x, internal) in [("q", "q_layernorm"), ("k", "k_layernorm")] {
                norm(
                    cfg,
                    &mut out,
                    pair(&format!("self_attention.{internal}"), "weight", "bias"),
                    &format!("{hp}self_attn.{x}_norm"),
                    d,
                );
            }
        }
        out.push(ParamSource::one(
            format!("{p}self_attention.proj.weight"),
            vec![h, attn],
            format!("{hp}self_attn.o_proj.weight"),
        ));
        if cfg.proj_bias {
            out.push(ParamSource::one(
                format!("{p}self_attention.proj.bias"),
                vec![h],
                format!("{hp}self_attn.o_proj.bias"),
            ));
        }
        let mlp_norm = pair("layernorm_mlp", "layer_norm_weight", "layer_norm_bias");
        if cfg.sandwich_norm {
            norm(
                cfg,
                &mut out,
                pair("post_attention_layernorm", "weight", "bias"),
                &format!("{hp}post_attention_layernorm"),
                h,
            );
            norm(cfg, &mut out, mlp_norm, &format!("{hp}pre_feedforward_layernorm"), h);
        } else {
            norm(cfg, &mut out, mlp_norm, &format!("{hp}post_attention_layernorm"), h);
        }
        let fc1_parts: &[&str] = if cfg.activation.is_gated() { &["gate_proj", "up_proj"] } else { &["up_proj"] };
        out.push(ParamSource {
            name: format!("{p}layernorm_mlp.fc1_weight"),
            shape: vec![cfg.fc1_size(), h],
            hf: fc1_parts.iter().map(|x| (format!("{hp}mlp.{x}.weight"), vec![f, h])).collect(),
        });
        if cfg.mlp_bias {
            out.push(ParamSource {
                name: format!("{p}layernorm_mlp.fc1_bias"),
                shape: vec![cfg.fc1_size()],
                hf: fc1_parts.iter().map(|x| (format!("{hp}mlp.{x}.bias"), vec![f])).collect(),
            });
        }
        out.push(ParamSource::one(
            format!("{p}layernorm_mlp.fc2_weight"),
            vec![h, f],
            format!("{hp}mlp.down_proj.weight"),
        ));
        if cfg.mlp_bias {
            out.push(ParamSource::one(
                format!("{p}layernorm_mlp.fc2_bias"),
                vec![h],
                format!("{hp}mlp.down_proj.bias"),
            ));
        }
        if cfg.sandwich_norm {
            norm(
                cfg,
                &mut out,
                pair("post_mlp_layernorm", "weight", "bias"),
                &format!("{hp}post_feedforward_layernorm"),
                h,
            );
        }
    }
    norm(cfg, &mut out, ("final_norm.weight".into(), "final_norm.bias".into()), "model.norm", h);
    if !cfg.tie_word_embeddings {
        out.push(ParamSource::one("lm_head.weight".into(), vec![v, h], "lm_head.weight".into()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decoder::config::tests::gemma_like;
    use crate::decoder::DecoderActivation;

    #[test]
    fn gemma_layout_maps_the_sandwich_norms_and_fuses_qkv_and_fc1() {
        let cfg = gemma_like();
        let layout = hf_layout(&cfg);
        assert_eq!(
            layout.iter().map(|p| p.shape.iter().product::<usize>()).sum::<usize>() as u64,
            cfg.num_parameters()
        );
        let get = |name: &str| layout.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("{name}"));
        let qkv = get("layers.1.self_attention.layernorm_qkv.weight");
        assert_eq!(qkv.shape, [128, 32]);
        let hf: Vec<&str> = qkv.hf.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            hf,
            [
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",
                "model.layers.1.self_attn.v_proj.weight"
            ]
        );
        assert_eq!(qkv.hf[1].1, [32, 32]);
        assert_eq!(
            get("layers.0.post_attention_layernorm.weight").hf[0].0,
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            get("layers.0.layernorm_mlp.layer_norm_weight").hf[0].0,
            "model.layers.0.pre_feedforward_layernorm.weight"
        );
        assert_eq!(
            get("layers.2.post_mlp_layernorm.weight").hf[0].0,
            "model.layers.2.post_feedforward_layernorm.weight"
        );
        assert_eq!(get("layers.0.self_attention.k_layernorm.weight").shape, [16]);
        assert_eq!(get("layers.0.layernorm_mlp.fc1_weight").hf.len(), 2);
        assert!(layout.iter().all(|p| p.name != "lm_head.weight"), "tied");
    }

    #[test]
    fn llama_layout_maps_post_attention_layernorm_to_the_mlp_norm() {
        let cfg = DecoderConfig {
            sandwich_norm: false,
            qk_norm: false,
            zero_centered_gamma: false,
            tie_word_embeddings: false,
            qkv_bias: true,
            mlp_bias: true,
            normalization: NormKind::LayerNorm,
            activation: DecoderActivation::Gelu,
            ..gemma_like()
        };
        let layout = hf_layout(&cfg);
        assert_eq!(
            layout.iter().map(|p| p.shape.iter().product::<usize>()).sum::<usize>() as u64,
            cfg.num_parameters()
        );
        let get = |name: &str| layout.iter().find(|p| p.name == name).unwrap_or_else(|| panic!("{name}"));
        assert_eq!(
            get("layers.0.layernorm_mlp.layer_norm_weight").hf[0].0,
            "model.layers.0.post_attention_layernorm.weight"
        );
        assert_eq!(
            get("layers.0.layernorm_mlp.layer_norm_bias").hf[0].0,
            "model.layers.0.post_attention_layernorm.bias"
        );
        assert_eq!(get("layers.0.self_attention.layernorm_qkv.bias").shape, [128]);
        assert_eq!(
            get("layers.0.layernorm_mlp.fc1_weight").hf,
            [("model.layers.0.mlp.up_proj.weight".to_string(), vec![48, 32])]
        );
        assert_eq!(get("lm_head.weight").hf[0].0, "lm_head.weight");
        assert_eq!(get("final_norm.bias").hf[0].0, "model.norm.bias");
    }
}
