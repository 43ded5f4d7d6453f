//! Generation with the GPU decoder (`te_models::decoder::Decoder`: prompts of one length per
//! batch in one prefill through the fused attention, then one token per sequence per step through
//! the split-K decode kernels; greedy picks on the device) for Gemma 3 270M — the real GGUF when
//! `TE_GEMMA_GGUF` names it, else its architecture with random weights (the speed does not
//! depend on them) — at batch 1, 8 and 32 with prompts of 128 and 1024 tokens, 128 new tokens,
//! BF16 and FP8 (E4M3 weights, current scaling; with the LM head in FP8 too), the steps of batch 1
//! through the fused decode GEMVs and, as "unfused" at batch 1 and 8, through GEMMs and separate
//! kernels (`Decoder::set_fused_decode(false)`), and with an E4M3 KV cache at the 1024-token
//! prompts ("bf16 + e4m3 kv", `Decoder::set_kv_cache_dtype`). Wall-clock time, as `te generate` runs:
//! prefill tokens/s (the prompts and the first token) and decode tokens/s (all sequences) over
//! the other 127 steps. The decode floor: every weight read once (the 262k-row LM head is most of
//! it) plus the cached keys and values at the mean length, over this run's copy bandwidth.
//! `benches/anchors/decoder_generate.py` runs transformers' Gemma 3 on the same shapes.

use crate::harness::{time_generation, Bench, Work};
use std::collections::BTreeMap;
use std::path::Path;
use te_models::decoder::{
    load_model, DecodeOptions, Decoder, DecoderConfig, DecoderWeights, GpuPrecision, WeightTensor,
};
use te_nn::fp8::Recipe;

const NEW_TOKENS: usize = 128;

/// Gemma 3 270M's `config.json` (the GGUF's metadata gives the same sizes).
const GEMMA3_270M: &str = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
 "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
 "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
 "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
 "sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "sliding_attention",
 "sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
 "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
 "query_pre_attn_scalar": 256, "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh",
 "tie_word_embeddings": true, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}"#;

pub(crate) fn weights() -> (DecoderWeights, &'static str) {
    if let Ok(path) = std::env::var("TE_GEMMA_GGUF") {
        return (load_model(Path::new(&path)).unwrap().weights, "gguf weights");
    }
    (random_weights(GEMMA3_270M), "random weights")
}

/// The weights of the model a Hugging Face `config.json` (`json`) describes, filled with a cheap
/// deterministic pattern of ±0.02 (norm weights near 0; Gemma stores γ − 1): what a speed
/// measurement needs, not a trained model.
pub(crate) fn random_weights(json: &str) -> DecoderWeights {
    let cfg = DecoderConfig::from_hf_json(json).unwrap();
    let mut tensors = BTreeMap::new();
    let mut seed = 1u64;
    for te_models::decoder::ParamSource { name, shape, .. } in te_models::decoder::hf_layout(&cfg) {
        let n: usize = shape.iter().product();
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let data =
            (0..n).map(|i| ((((i as u64).wrapping_mul(2654435761) ^ seed) % 2001) as f32 - 1000.0) * 2e-5).collect();
        tensors.insert(name, WeightTensor { shape, data });
    }
    DecoderWeights::from_tensors(cfg, tensors).unwrap()
}

pub fn run(b: &mut Bench) {
    let work = "gemma3 270m generate";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let (w, source) = weights();
    let cfg = w.config().clone();
    println!("{work}: {source}");
    // Bytes of one cached position of every layer, per byte of a cached element.
    let kv_row_elems = (cfg.num_layers * 2 * cfg.num_gqa_groups * cfg.head_dim) as u64;
    let fp8 = |lm_head| GpuPrecision::Fp8 { recipe: Recipe::Current(Default::default()), lm_head };
    // The decode steps through the fused GEMVs (the default) and, at batch 1 and 8, as GEMMs and
    // separate kernels ("unfused").
    for (label, precision, fused, e4m3_kv) in [
        ("bf16", GpuPrecision::Bf16, true, false),
        ("bf16 unfused", GpuPrecision::Bf16, false, false),
        ("bf16 + e4m3 kv", GpuPrecision::Bf16, true, true),
        ("fp8", fp8(false), true, false),
        ("fp8 unfused", fp8(false), false, false),
        ("fp8 + fp8 lm head", fp8(true), true, false),
    ] {
        let mut model = Decoder::new(&dev, w.clone(), precision).unwrap();
        model.set_fused_decode(fused);
        if e4m3_kv {
            model.set_kv_cache_dtype(te_codegen::DType::E4M3).unwrap();
        }
        let kv_row_bytes = kv_row_elems * if e4m3_kv { 1 } else { 2 };
        // Every parameter once: the tied head reads the embedding's table whole.
        let weight_bytes = model.parameter_bytes() as u64;
        println!("{work} {label}: {:.1} MB of parameters", weight_bytes as f64 / 1e6);
        for (batch, prompt) in [(1, 128), (1, 1024), (8, 128), (8, 1024), (32, 128), (32, 1024)] {
            if (!fused && batch > 8) || (e4m3_kv && prompt < 1024) {
                continue;
            }
            let prompts: Vec<Vec<i32>> = (0..batch)
                .map(|j| (0..prompt).map(|i| (3 + (i * 7919 + j * 104_729) % 200_000) as i32).collect())
                .collect();
            let opts = DecodeOptions { stop_at_eos: false, ..DecodeOptions::greedy(NEW_TOKENS) };
            let (prefill, step) = time_generation(NEW_TOKENS, |mark| {
                model
                    .generate(&prompts, &opts, &mut |_, _| {
                        mark();
                        Ok(())
                    })
                    .unwrap();
            });
            if let Some(why) = model.graph_fallback() {
                println!("{work} {label} b{batch} prompt {prompt}: a step ran eagerly: {why}");
            }
            let shape = format!("{label} b{batch} prompt {prompt}");
            let mean_len = (prompt + NEW_TOKENS / 2) as u64;
            // The embedding table is read by the lookup only for the rows used; the tied head reads it whole.
            let kv_bytes = batch as u64 * mean_len * kv_row_bytes;
            // Rows beside `decoder_generate.py`'s (compare.py's section "generate").
            let row = |pass, tokens| Work {
                section: "generate",
                work: work.into(),
                pass,
                variant: format!("ours {label}"),
                precision: if label.starts_with("bf16") { "bf16" } else { "fp8" },
                flops_fp8: 0,
                tokens: Some(tokens as u64),
            };
            let anchor_shape = format!("b{batch} prompt {prompt}");
            b.record_work(&anchor_shape, prefill, 0, None, row("prefill", batch * prompt));
            b.record_work(&anchor_shape, step, 0, Some(weight_bytes + kv_bytes), row("decode step", batch));
            let prefill_tps = (batch * prompt) as f64 / (prefill.median_us * 1e-6);
            let decode_tps = batch as f64 / (step.median_us * 1e-6);
            let floor_us = (weight_bytes + kv_bytes) as f64 / (b.copy_gbps * 1e3);
            b.record_ratio(&format!("{work} {shape}: prefill tokens/s"), prefill_tps, None);
            b.record_ratio(&format!("{work} {shape}: decode tokens/s"), decode_tps, None);
            b.record_ratio(
                &format!("{work} {shape}: decode step ÷ floor"),
                step.median_us / floor_us,
                Some((false, 3.0)),
            );
            println!(
                "{work} {shape}: prefill {prefill_tps:.0} tokens/s, decode {decode_tps:.0} tokens/s ({:.1} µs a step, \
                 floor {floor_us:.1} µs)",
                step.median_us
            );
        }
    }
}
