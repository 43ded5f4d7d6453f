//! Parsing of Hugging Face `config.json` files: each architecture in transformers 4 and 5
//! layouts, and every error naming its field.

use super::*;
use serde_json::{json, Value};

fn llama() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": true, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
        "max_position_embeddings": 131072, "attention_bias": false, "mlp_bias": false
    })
}

fn parse(v: &Value) -> DecoderResult<DecoderConfig> {
    DecoderConfig::from_hf_json(&v.to_string())
}

fn field_of(e: DecoderError) -> String {
    match e {
        DecoderError::Config { field, .. } => field,
        e => panic!("expected a config error, got {e}"),
    }
}

/// Llama 3.2 1B's configuration (transformers 4 layout: `rope_theta` + `rope_scaling`).
#[test]
fn llama_3_2_in_the_transformers_4_layout() {
    let c = parse(&llama()).unwrap();
    assert_eq!((c.vocab_size, c.hidden_size, c.ffn_hidden_size, c.num_layers), (128256, 2048, 8192, 16));
    assert_eq!((c.num_attention_heads, c.num_gqa_groups, c.head_dim), (32, 8, 64));
    assert_eq!(c.activation, DecoderActivation::Swiglu);
    assert_eq!(c.layernorm_epsilon, 1e-5);
    assert_eq!(c.rope.theta, 500000.0);
    assert_eq!(
        c.rope.scaling,
        RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    assert!(c.tie_word_embeddings && !c.qkv_bias && !c.qk_norm && !c.sandwich_norm && c.rope_local.is_none());
    assert_eq!((c.bos_token_id, c.eos_token_ids.clone()), (Some(128000), vec![128001, 128008, 128009]));
    assert!(c.layer_types.iter().all(|&t| t == LayerAttention::Global));
    assert_eq!(c.softmax_scale(), 0.125);
    // The same through `rope_parameters` (transformers 5) and with `type` for `rope_type`.
    let mut v5 = llama();
    let o = v5.as_object_mut().unwrap();
    let mut rope = o.remove("rope_scaling").unwrap();
    rope["rope_theta"] = o.remove("rope_theta").unwrap();
    o.insert("rope_parameters".into(), rope);
    assert_eq!(parse(&v5).unwrap(), c);
    let mut typed = llama();
    typed["rope_scaling"] = json!({"type": "linear", "factor": 2.0});
    assert_eq!(parse(&typed).unwrap().rope.scaling, RopeScaling::Linear { factor: 2.0 });
    // Defaults: no head_dim (hidden / heads), no num_key_value_heads (MHA), no rope_scaling.
    let mut bare = llama();
    for f in ["head_dim", "num_key_value_heads", "rope_scaling", "eos_token_id"] {
        bare.as_object_mut().unwrap().remove(f);
    }
    let b = parse(&bare).unwrap();
    assert_eq!((b.head_dim, b.num_gqa_groups, b.rope.scaling, b.eos_token_ids), (64, 32, RopeScaling::None, vec![2]));
}

/// Qwen2.5's biases and sliding layers, Qwen3's qk-norm, Gemma 3 1B (transformers 4) and the
/// multimodal Gemma's nested text configuration.
#[test]
fn qwen_and_gemma_configurations() {
    let qwen2 = json!({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "use_sliding_window": true, "sliding_window": 32768, "max_window_layers": 21,
        "eos_token_id": 151643, "bos_token_id": 151643, "hidden_act": "silu", "rms_norm_eps": 1e-6
    });
    let c = parse(&qwen2).unwrap();
    assert_eq!((c.head_dim, c.qkv_bias, c.proj_bias), (64, true, false));
    assert_eq!(c.layer_types.iter().filter(|&&t| t == LayerAttention::Sliding).count(), 3, "layers 21..24 slide");
    assert_eq!(c.sliding_window, Some(32768));
    let qwen3 = json!({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "rope_theta": 1000000, "tie_word_embeddings": true, "attention_bias": false, "sliding_window": null,
        "use_sliding_window": false, "rms_norm_eps": 1e-6
    });
    let c = parse(&qwen3).unwrap();
    assert!(c.qk_norm && !c.qkv_bias && c.layer_types.iter().all(|&t| t == LayerAttention::Global));
    assert_eq!((c.attention_size(), c.hidden_size), (2048, 1024), "head_dim need not be hidden / heads");
    let gemma = json!({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048,
        "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "rope_scaling": null, "sliding_window": 512, "sliding_window_pattern": 6,
        "final_logit_softcapping": null, "attn_logit_softcapping": null, "rms_norm_eps": 1e-6,
        "bos_token_id": 2, "eos_token_id": [1, 106], "max_position_embeddings": 32768
    });
    let c = parse(&gemma).unwrap();
    assert!(c.zero_centered_gamma && c.sandwich_norm && c.qk_norm && c.scale_embeddings && c.tie_word_embeddings);
    assert_eq!(c.activation, DecoderActivation::Geglu);
    let globals: Vec<usize> = (0..18).filter(|&l| c.layer_types[l] == LayerAttention::Global).collect();
    assert_eq!(globals, [5, 11, 17], "every 6th layer is global");
    assert_eq!((c.rope.theta, c.rope_local.map(|r| r.theta)), (1e6, Some(1e4)));
    assert_eq!((c.sliding_window, c.layer_window(0), c.layer_window(5)), (Some(512), Some((511, 0)), None));
    assert_eq!(c.softmax_scale(), 1.0 / 16.0);
    assert_eq!(c.eos_token_ids, [1, 106]);
    assert_eq!(c.num_parameters(), 268_098_176, "Gemma 3 270M");
    // Gemma3ForConditionalGeneration: the text model's configuration, defaults filled in.
    let multimodal = json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"hidden_size": 1152}
    });
    let (c, arch) = DecoderConfig::from_hf_json_with_architecture(&multimodal.to_string()).unwrap();
    assert_eq!(arch, HfArchitecture::Gemma3Multimodal);
    assert_eq!((c.vocab_size, c.num_attention_heads, c.num_gqa_groups, c.head_dim), (262208, 8, 4, 256));
    assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!(c.rope_local, Some(RopeConfig::new(10000.0)), "local layers are not scaled");
    assert_eq!(c.eos_token_ids, [1, 106]);
    let e = parse(&json!({"architectures": ["Gemma3ForConditionalGeneration"]})).unwrap_err();
    assert_eq!(field_of(e), "text_config");
}

/// Unknown architectures, missing, mistyped and unsupported fields are typed errors naming them.
#[test]
fn bad_configs_name_the_field() {
    let e = parse(&json!({"architectures": ["MistralForCausalLM"]})).unwrap_err();
    assert!(matches!(&e, DecoderError::Architecture { found } if found == "MistralForCausalLM"), "{e}");
    assert!(e.to_string().contains("Gemma3ForCausalLM"), "{e}");
    assert!(matches!(parse(&json!({"model_type": "phi3"})), Err(DecoderError::Architecture { .. })));
    assert_eq!(field_of(parse(&json!({"vocab_size": 3})).unwrap_err()), "architectures");
    assert!(matches!(DecoderConfig::from_hf_json("{"), Err(DecoderError::Json { .. })));
    assert!(matches!(DecoderConfig::from_hf_json("[1]"), Err(DecoderError::Json { .. })));
    let with = |field: &str, value: Value| {
        let mut v = llama();
        v[field] = value;
        parse(&v)
    };
    let without = |field: &str| {
        let mut v = llama();
        v.as_object_mut().unwrap().remove(field);
        parse(&v)
    };
    assert_eq!(field_of(without("hidden_size").unwrap_err()), "hidden_size");
    let e = with("hidden_size", json!("2048")).unwrap_err().to_string();
    assert!(e.contains("`hidden_size`") && e.contains("positive integer") && e.contains("\"2048\""), "{e}");
    assert_eq!(field_of(with("num_attention_heads", json!(0)).unwrap_err()), "num_attention_heads");
    assert_eq!(field_of(with("num_key_value_heads", json!(5)).unwrap_err()), "num_key_value_heads");
    assert_eq!(field_of(with("head_dim", json!(63)).unwrap_err()), "head_dim");
    assert_eq!(field_of(with("head_dim", json!(512)).unwrap_err()), "head_dim");
    assert_eq!(field_of(with("hidden_act", json!("tanh")).unwrap_err()), "hidden_act");
    assert_eq!(field_of(with("rms_norm_eps", json!("small")).unwrap_err()), "rms_norm_eps");
    assert_eq!(field_of(with("rms_norm_eps", json!(0.0)).unwrap_err()), "rms_norm_eps");
    assert_eq!(field_of(with("tie_word_embeddings", json!(1)).unwrap_err()), "tie_word_embeddings");
    assert_eq!(field_of(with("eos_token_id", json!([1, "x"])).unwrap_err()), "eos_token_id");
    assert_eq!(field_of(with("eos_token_id", json!(200000)).unwrap_err()), "eos_token_id");
    assert_eq!(
        field_of(with("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0})).unwrap_err()),
        "rope_scaling.rope_type"
    );
    assert_eq!(field_of(with("rope_scaling", json!({"rope_type": "linear"})).unwrap_err()), "rope_scaling.factor");
    let no_original = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0});
    assert_eq!(
        field_of(with("rope_scaling", no_original).unwrap_err()),
        "rope_scaling.original_max_position_embeddings"
    );
    assert_eq!(field_of(with("rope_scaling", json!(3)).unwrap_err()), "rope_scaling");
    assert_eq!(field_of(with("rope_theta", json!(-1.0)).unwrap_err()), "rope.rope_theta");
    assert_eq!(field_of(with("partial_rotary_factor", json!(0.5)).unwrap_err()), "partial_rotary_factor");
    assert_eq!(field_of(with("layer_types", json!(["full_attention"])).unwrap_err()), "layer_types");
    assert_eq!(field_of(with("layer_types", json!(3)).unwrap_err()), "layer_types");
    let mut chunked = vec![json!("full_attention"); 16];
    chunked[0] = json!("chunked_attention");
    assert_eq!(field_of(with("layer_types", json!(chunked)).unwrap_err()), "layer_types");
    let mut sliding = vec![json!("full_attention"); 16];
    sliding[3] = json!("sliding_attention");
    assert_eq!(field_of(with("layer_types", json!(sliding.clone())).unwrap_err()), "sliding_window", "no window");
    let mut windowed = llama();
    windowed["layer_types"] = json!(sliding);
    windowed["sliding_window"] = json!(0);
    assert_eq!(field_of(parse(&windowed).unwrap_err()), "sliding_window");
    windowed["sliding_window"] = json!(4096);
    assert_eq!(parse(&windowed).unwrap().layer_window(3), Some((4095, 0)));
    let gemma = json!({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2});
    parse(&gemma).unwrap();
    let mut bidirectional = gemma.clone();
    bidirectional["use_bidirectional_attention"] = json!(true);
    assert_eq!(field_of(parse(&bidirectional).unwrap_err()), "use_bidirectional_attention");
    let mut nested = gemma.clone();
    nested["rope_parameters"] = json!({"full_attention": {"rope_type": "dynamic", "factor": 2.0}});
    assert_eq!(field_of(parse(&nested).unwrap_err()), "rope_parameters.full_attention.rope_type");
    let mut capped = gemma;
    capped["final_logit_softcapping"] = json!(-30.0);
    assert_eq!(field_of(parse(&capped).unwrap_err()), "final_logit_softcapping");
}

/// `from_hf_config` reads a file or a directory and names the file in JSON errors.
#[test]
fn config_files_are_read_from_a_path_or_directory() {
    let dir = tempfile::tempdir().unwrap();
    let e = DecoderConfig::from_hf_config(dir.path()).unwrap_err();
    assert!(matches!(&e, DecoderError::MissingFile { path } if path.ends_with("config.json")), "{e}");
    std::fs::write(dir.path().join("config.json"), llama().to_string()).unwrap();
    assert_eq!(DecoderConfig::from_hf_config(dir.path()).unwrap().num_layers, 16);
    assert_eq!(DecoderConfig::from_hf_config(&dir.path().join("config.json")).unwrap().num_layers, 16);
    std::fs::write(dir.path().join("config.json"), "{ not json").unwrap();
    let e = DecoderConfig::from_hf_config(dir.path()).unwrap_err().to_string();
    assert!(e.contains("config.json") && e.contains(dir.path().to_str().unwrap()), "{e}");
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

        /// A mutated `config.json` (a field set to another JSON value, bytes flipped) parses to a
        /// configuration that validates, or is refused with a typed error; never a panic.
        #[test]
        fn mutated_configs_parse_or_are_refused(
            field in prop::sample::select(vec![
                "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_hidden_layers", "vocab_size", "rms_norm_eps", "hidden_act", "rope_theta", "rope_scaling",
                "eos_token_id", "layer_types", "sliding_window", "architectures", "tie_word_embeddings",
            ]),
            value in prop_oneof![
                any::<i64>().prop_map(|v| v.to_string()),
                any::<f64>().prop_map(|v| format!("{v:e}")),
                Just("null".to_string()),
                Just("\"silu\"".to_string()),
                Just("[\"sliding_attention\"]".to_string()),
                Just("{\"rope_type\": \"linear\", \"factor\": 0}".to_string()),
                Just("[]".to_string()),
            ],
            flips in prop::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        ) {
            let mut v = llama();
            v[field] = serde_json::from_str(&value).unwrap_or(Value::Null);
            let mut bytes = v.to_string().into_bytes();
            for (i, x) in flips {
                let i = i % bytes.len();
                bytes[i] ^= x;
            }
            if let Ok(cfg) = DecoderConfig::from_hf_json(&String::from_utf8_lossy(&bytes)) {
                prop_assert!(cfg.validate().is_ok());
            }
        }
    }
}
