//! Weight import from Hugging Face directories written here: single and sharded files, every
//! dtype read, the mapping onto internal names, and every problem reported at once.

use super::config::tests::gemma_like;
use super::safetensors_dir::{INDEX, SINGLE};
use super::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde_json::json;
use std::collections::BTreeMap;
use te_codegen::DType;

/// A tiny Gemma-3-shaped `config.json` matching [`gemma_like`]'s sizes.
fn gemma_config() -> serde_json::Value {
    json!({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 24, "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 30.0
    })
}

/// Every Hugging Face tensor of `cfg` with distinct values (`i`-th tensor, `k`-th element).
fn hf_tensors(cfg: &DecoderConfig) -> BTreeMap<String, WeightTensor> {
    hf_layout(cfg)
        .iter()
        .flat_map(|p| p.hf.clone())
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|k| ((i * 31 + k * 7) % 97) as f32 / 16.0 - 3.0).collect();
            (name, WeightTensor { shape, data })
        })
        .collect()
}

/// Writes `tensors` (renamed by `rename`) in `dtype` as one safetensors file.
fn write_file(path: &Path, tensors: &BTreeMap<String, WeightTensor>, dtype: DType, rename: impl Fn(&str) -> String) {
    let st = match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        _ => Dtype::F16,
    };
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, t)| (rename(n), t.shape.clone(), te_runtime::numerics::encode(dtype, &t.data)))
        .collect();
    let views: Vec<(String, TensorView<'_>)> =
        bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(st, s.clone(), b).unwrap())).collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

fn gemma_dir() -> (tempfile::TempDir, DecoderConfig, BTreeMap<String, WeightTensor>) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), gemma_config().to_string()).unwrap();
    let cfg = DecoderConfig::from_hf_config(dir.path()).unwrap();
    let tensors = hf_tensors(&cfg);
    (dir, cfg, tensors)
}

fn report_of(e: DecoderError) -> WeightReport {
    match e {
        DecoderError::Weights { report, .. } => report,
        e => panic!("expected a weight report, got {e}"),
    }
}

/// A BF16 directory loads: q|k|v and gate|up concatenated in order, values as stored.
#[test]
fn a_single_file_maps_onto_internal_names() {
    let (dir, cfg, tensors) = gemma_dir();
    write_file(&dir.path().join(SINGLE), &tensors, DType::BF16, str::to_string);
    let w = DecoderWeights::from_hf_dir(dir.path()).unwrap();
    assert_eq!(w.config(), &cfg);
    assert_eq!(w.architecture(), Some(HfArchitecture::Gemma3));
    assert_eq!(w.tensors().len(), hf_layout(&cfg).len());
    let bf16 = |v: &[f32]| -> Vec<f32> { v.iter().map(|&x| te_runtime::numerics::round_to(DType::BF16, x)).collect() };
    let qkv = w.get("layers.1.self_attention.layernorm_qkv.weight").unwrap();
    assert_eq!(qkv.shape, [128, 32]);
    let q = &tensors["model.layers.1.self_attn.q_proj.weight"].data;
    let v = &tensors["model.layers.1.self_attn.v_proj.weight"].data;
    assert_eq!(qkv.data[..q.len()], bf16(q)[..]);
    assert_eq!(qkv.data[qkv.data.len() - v.len()..], bf16(v)[..]);
    let fc1 = w.get("layers.2.layernorm_mlp.fc1_weight").unwrap();
    assert_eq!(fc1.data[48 * 32..], bf16(&tensors["model.layers.2.mlp.up_proj.weight"].data)[..]);
    assert_eq!(
        w.get("layers.0.post_mlp_layernorm.weight").unwrap().data,
        bf16(&tensors["model.layers.0.post_feedforward_layernorm.weight"].data)
    );
    // The same tensors in memory give the same weights.
    let mem = DecoderWeights::from_hf_tensors(cfg.clone(), tensors.clone()).unwrap();
    assert_eq!(mem.get("final_norm.weight").unwrap().data, tensors["model.norm.weight"].data);
    // Internal names round-trip through from_tensors.
    let (c, t) = w.clone().into_parts();
    assert_eq!(DecoderWeights::from_tensors(c, t).unwrap().tensors(), w.tensors());
}

/// Shards listed by `model.safetensors.index.json` load as one checkpoint (F32 and F16 shards,
/// an old RoPE buffer and a tied `lm_head.weight` ignored); an index naming an absent shard is an
/// error naming it.
#[test]
fn sharded_checkpoints_load_and_a_missing_shard_is_named() {
    let (dir, _, tensors) = gemma_dir();
    let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) =
        tensors.clone().into_iter().partition(|(n, _)| n.contains("layers.1."));
    let mut b = b;
    b.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        WeightTensor { shape: vec![8], data: vec![1.0; 8] },
    );
    b.insert("lm_head.weight".into(), tensors["model.embed_tokens.weight"].clone());
    write_file(&dir.path().join("model-00001-of-00002.safetensors"), &a, DType::F32, str::to_string);
    write_file(&dir.path().join("model-00002-of-00002.safetensors"), &b, DType::F16, str::to_string);
    let mut map = serde_json::Map::new();
    for n in a.keys() {
        map.insert(n.clone(), json!("model-00001-of-00002.safetensors"));
    }
    for n in b.keys() {
        map.insert(n.clone(), json!("model-00002-of-00002.safetensors"));
    }
    let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
    std::fs::write(dir.path().join(INDEX), index.to_string()).unwrap();
    let w = DecoderWeights::from_hf_dir(dir.path()).unwrap();
    let qkv = &w.get("layers.1.self_attention.layernorm_qkv.weight").unwrap().data;
    assert_eq!(qkv[..4], tensors["model.layers.1.self_attn.q_proj.weight"].data[..4], "F32 exactly");
    let f16 = |x: f32| te_runtime::numerics::round_to(DType::F16, x);
    assert_eq!(w.get("final_norm.weight").unwrap().data[3], f16(tensors["model.norm.weight"].data[3]));
    // An index naming a shard that is not there.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = DecoderWeights::from_hf_dir(dir.path()).unwrap_err();
    let text = e.to_string();
    assert!(matches!(e, DecoderError::Json { .. }), "{text}");
    assert!(text.contains("model-00002-of-00002.safetensors") && text.contains(INDEX), "{text}");
    // An index that is not JSON, and no weights at all.
    std::fs::write(dir.path().join(INDEX), "weights").unwrap();
    assert!(matches!(DecoderWeights::from_hf_dir(dir.path()), Err(DecoderError::Json { .. })));
    std::fs::remove_file(dir.path().join(INDEX)).unwrap();
    let e = DecoderWeights::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, DecoderError::MissingFile { path } if path.ends_with(SINGLE)), "{e}");
}

/// Missing, unexpected, mis-shaped and wrongly typed tensors are all listed in one error.
#[test]
fn every_problem_is_listed_at_once() {
    let (dir, _, mut tensors) = gemma_dir();
    tensors.remove("model.layers.2.self_attn.k_norm.weight");
    tensors.remove("model.norm.weight");
    tensors.insert("model.layers.0.mlp.extra.weight".into(), WeightTensor { shape: vec![2], data: vec![0.0; 2] });
    tensors.get_mut("model.layers.1.self_attn.o_proj.weight").unwrap().shape = vec![64, 32];
    write_file(&dir.path().join(SINGLE), &tensors, DType::BF16, str::to_string);
    // One tensor stored as I8.
    let bytes = std::fs::read(dir.path().join(SINGLE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut views: Vec<(String, TensorView<'_>)> = st.tensors();
    let int8 = vec![0u8; 64 * 32];
    views.retain(|(n, _)| n != "model.embed_tokens.weight");
    views.push(("model.embed_tokens.weight".into(), TensorView::new(Dtype::I8, vec![64, 32], &int8).unwrap()));
    let file = safetensors::serialize(views, None).unwrap();
    std::fs::write(dir.path().join(SINGLE), file).unwrap();
    let e = DecoderWeights::from_hf_dir(dir.path()).unwrap_err();
    let text = e.to_string();
    let r = report_of(e);
    assert_eq!(r.missing, ["model.layers.2.self_attn.k_norm.weight", "model.norm.weight"]);
    assert_eq!(r.unexpected, ["model.layers.0.mlp.extra.weight"]);
    assert_eq!(r.mismatched, ["model.layers.1.self_attn.o_proj.weight: [64, 32] where config.json implies [32, 64]"]);
    assert_eq!(r.unsupported_dtype, ["model.embed_tokens.weight: I8"]);
    for part in ["missing (2)", "unexpected (1)", "mismatched (1)", "unsupported dtype", dir.path().to_str().unwrap()] {
        assert!(text.contains(part), "{part} in {text}");
    }
}

/// A multimodal Gemma's text model loads from its prefixed names; the vision tower is skipped.
#[test]
fn the_multimodal_gemma_text_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mut text = gemma_config();
    text.as_object_mut().unwrap().remove("architectures");
    let cfg_json = json!({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text});
    std::fs::write(dir.path().join("config.json"), cfg_json.to_string()).unwrap();
    let cfg = DecoderConfig::from_hf_config(dir.path()).unwrap();
    let mut tensors = hf_tensors(&cfg);
    tensors.insert("vision_tower.encoder.weight".into(), WeightTensor { shape: vec![3], data: vec![0.0; 3] });
    let rename = |n: &str| match n.strip_prefix("model.") {
        Some(rest) => format!("language_model.model.{rest}"),
        None => n.to_string(),
    };
    write_file(&dir.path().join(SINGLE), &tensors, DType::F32, rename);
    let w = DecoderWeights::from_hf_dir(dir.path()).unwrap();
    assert_eq!(w.architecture(), Some(HfArchitecture::Gemma3Multimodal));
    assert_eq!(w.get("embedding.weight").unwrap().data, tensors["model.embed_tokens.weight"].data);
}

/// Tensors built in code are checked too: internal names, shapes and value counts.
#[test]
fn in_memory_tensors_are_checked() {
    let cfg = gemma_like();
    let mut tensors = hf_tensors(&cfg);
    tensors.get_mut("model.norm.weight").unwrap().data.pop();
    let r = report_of(DecoderWeights::from_hf_tensors(cfg.clone(), tensors).unwrap_err());
    assert_eq!(r.mismatched, ["model.norm.weight: 31 values for the shape [32]"]);
    let mut internal: BTreeMap<String, WeightTensor> = hf_layout(&cfg)
        .into_iter()
        .map(|p| {
            let n = p.shape.iter().product();
            (p.name, WeightTensor { shape: p.shape, data: vec![0.5; n] })
        })
        .collect();
    DecoderWeights::from_tensors(cfg.clone(), internal.clone()).unwrap();
    internal.remove("layers.0.self_attention.q_layernorm.weight");
    internal.insert("lm_head.weight".into(), WeightTensor { shape: vec![64, 32], data: vec![0.0; 64 * 32] });
    let r = report_of(DecoderWeights::from_tensors(cfg.clone(), internal).unwrap_err());
    assert_eq!(r.missing, ["layers.0.self_attention.q_layernorm.weight"]);
    assert_eq!(r.unexpected, ["lm_head.weight"], "tied: no LM head");
    let bad = DecoderConfig { num_gqa_groups: 3, ..cfg };
    assert!(matches!(DecoderWeights::from_tensors(bad, BTreeMap::new()), Err(DecoderError::Config { .. })));
}

/// A file that is not safetensors, or cut short, is an error naming it.
#[test]
fn corrupt_files_are_named() {
    let (dir, _, tensors) = gemma_dir();
    let path = dir.path().join(SINGLE);
    std::fs::write(&path, b"not a safetensors file").unwrap();
    assert!(matches!(DecoderWeights::from_hf_dir(dir.path()), Err(DecoderError::Safetensors { .. })));
    write_file(&path, &tensors, DType::BF16, str::to_string);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 10]).unwrap();
    let e = DecoderWeights::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, DecoderError::Safetensors { path: p, .. } if p == &path), "{e}");
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

        /// A mutated `model.safetensors` (bytes flipped, cut short, or other bytes) imports or is
        /// refused with a typed error; never a panic.
        #[test]
        fn mutated_weight_files_import_or_are_refused(m in te_nn::checkpoint::fuzz::mutation()) {
            let (dir, _, tensors) = gemma_dir();
            let path = dir.path().join(SINGLE);
            write_file(&path, &tensors, DType::BF16, str::to_string);
            let bytes = std::fs::read(&path).unwrap();
            std::fs::write(&path, m.apply(bytes)).unwrap();
            if let Err(e) = DecoderWeights::from_hf_dir(dir.path()) {
                prop_assert!(
                    matches!(e, DecoderError::Safetensors { .. } | DecoderError::Weights { .. }),
                    "{e}"
                );
            }
        }
    }
}
