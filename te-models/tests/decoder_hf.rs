//! The CPU decoder against Hugging Face transformers: tiny random Llama, Qwen2, Qwen3 and Gemma 3
//! models that transformers created and saved (`tests/fixtures/decoder/*`, made by
//! `scripts/decoder-fixtures.py`), imported from their directories, their logits compared with
//! the ones transformers computed in f32 on the same token ids, their greedy continuations with
//! transformers' `generate`, and the KV-cache decode with the full forward.
//!
//! Tolerance: both sides compute in f32 from the same (BF16- or F16-representable) weights;
//! transformers accumulates in f32, the oracles of `te-reference` in f64, so logits agree to f32
//! rounding of the sums (observed: < 2e-5 on logits of magnitude ≤ 9); `1e-4 · (1 + |logit|)` leaves
//! room for other BLAS orderings. The top-1 token agrees at every position.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use te_models::cpu::decoder::{DecodeOptions, DecoderPrecision, DecoderRef};
use te_models::decoder::{DecoderConfig, DecoderWeights, HfArchitecture, LayerAttention, RopeScaling};

const MODELS: [&str; 4] = ["llama", "qwen2", "qwen3", "gemma3"];
const TOLERANCE: f32 = 1e-4;

fn dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/decoder").join(model)
}

/// transformers' results: the sequences, their logits `[T, vocab]` and greedy continuations.
struct Reference {
    seqs: Vec<Vec<i32>>,
    logits: Vec<f32>,
    greedy: Vec<Vec<i32>>,
}

fn reference(model: &str) -> Reference {
    let bytes = std::fs::read(dir(model).join("reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<i32> {
        st.tensor(name).unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
    };
    let (ids, lens) = (ints("ids"), ints("lens"));
    let mut seqs = Vec::new();
    let mut at = 0;
    for &n in &lens {
        seqs.push(ids[at..at + n as usize].to_vec());
        at += n as usize;
    }
    let greedy_view = st.tensor("greedy").unwrap();
    let new = greedy_view.shape()[1];
    let greedy =
        ints("greedy").chunks_exact(new).map(|r| r.iter().copied().take_while(|&t| t >= 0).collect()).collect();
    let logits = te_runtime::numerics::decode(te_runtime::DType::F32, st.tensor("logits").unwrap().data());
    Reference { seqs, logits, greedy }
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
}

#[test]
fn configs_parse_into_the_family() {
    let (llama, arch) = DecoderConfig::from_hf_json_with_architecture(
        &std::fs::read_to_string(dir("llama").join("config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(arch, HfArchitecture::Llama);
    assert!(llama.qkv_bias && llama.proj_bias && llama.mlp_bias && !llama.tie_word_embeddings);
    assert!(matches!(
        llama.rope.scaling,
        RopeScaling::Llama3 { factor: 8.0, original_max_position_embeddings: 64, .. }
    ));
    let qwen2 = DecoderConfig::from_hf_config(&dir("qwen2")).unwrap();
    assert!(qwen2.qkv_bias && !qwen2.proj_bias && qwen2.tie_word_embeddings && !qwen2.qk_norm);
    assert_eq!((qwen2.head_dim, qwen2.num_gqa_groups), (32, 1));
    let qwen3 = DecoderConfig::from_hf_config(&dir("qwen3").join("config.json")).unwrap();
    assert!(qwen3.qk_norm && !qwen3.qkv_bias && !qwen3.zero_centered_gamma);
    assert_eq!((qwen3.head_dim, qwen3.eos_token_ids.as_slice()), (64, &[3, 4][..]));
    let gemma = DecoderConfig::from_hf_config(&dir("gemma3")).unwrap();
    assert!(gemma.zero_centered_gamma && gemma.sandwich_norm && gemma.qk_norm && gemma.scale_embeddings);
    assert_eq!(gemma.layer_types, [LayerAttention::Sliding, LayerAttention::Global]);
    assert_eq!((gemma.sliding_window, gemma.query_pre_attn_scalar), (Some(8), Some(24.0)));
    assert_eq!(gemma.rope.scaling, RopeScaling::Linear { factor: 4.0 });
    assert_eq!(gemma.rope_local.map(|r| r.theta), Some(10000.0));
    assert_eq!(gemma.final_logit_softcapping, Some(2.0));
}

/// Every position's logits within the tolerance of transformers', the same top-1 everywhere
/// (Qwen2's directory is sharded: `model.safetensors.index.json` and three F16 shards).
#[test]
fn logits_match_transformers() {
    assert!(
        dir("qwen2").join("model.safetensors.index.json").exists() && !dir("qwen2").join("model.safetensors").exists()
    );
    for model in MODELS {
        let m = DecoderRef::from_hf_dir(&dir(model), DecoderPrecision::F32).unwrap();
        let r = reference(model);
        let got = m.logits(&r.seqs).unwrap();
        assert_eq!(got.len(), r.logits.len(), "{model}");
        let v = m.config().vocab_size;
        let mut worst = 0.0f32;
        for (t, (g, w)) in got.chunks_exact(v).zip(r.logits.chunks_exact(v)).enumerate() {
            for (a, b) in g.iter().zip(w) {
                let err = (a - b).abs() / (1.0 + b.abs());
                worst = worst.max(err);
                assert!(err <= TOLERANCE, "{model} row {t}: {a} vs transformers' {b}");
            }
            assert_eq!(argmax(g), argmax(w), "{model} row {t}: top-1");
        }
        eprintln!("{model}: worst |Δ| / (1 + |logit|) = {worst:.2e}");
    }
}

/// Greedy continuations equal transformers' `generate(do_sample=False)`, each prompt alone and
/// the two together in one batch of different lengths.
#[test]
fn greedy_generation_matches_transformers() {
    for model in MODELS {
        let m = DecoderRef::from_hf_dir(&dir(model), DecoderPrecision::F32).unwrap();
        let r = reference(model);
        let new = r.greedy.iter().map(Vec::len).max().unwrap();
        let opts = DecodeOptions::greedy(new);
        let together = m.generate(&r.seqs, &opts, |_, _| Ok(())).unwrap();
        for (j, seq) in r.seqs.iter().enumerate() {
            let alone = m.generate(std::slice::from_ref(seq), &opts, |_, _| Ok(())).unwrap();
            assert_eq!(alone[0], r.greedy[j], "{model} prompt {j} alone");
            assert_eq!(together[j], r.greedy[j], "{model} prompt {j} in the batch");
        }
    }
}

/// Prefill of a ragged batch, then one token per step: each step's logits equal the full
/// forward's at that position (sliding layers keep only their window), to f32 rounding.
#[test]
fn cached_decode_equals_the_full_forward() {
    for model in MODELS {
        let m = DecoderRef::from_hf_dir(&dir(model), DecoderPrecision::F32).unwrap();
        let r = reference(model);
        let v = m.config().vocab_size;
        let prompt = [3usize, 6];
        let mut cache = m.kv_cache(2);
        let first: Vec<Vec<i32>> = r.seqs.iter().zip(prompt).map(|(s, p)| s[..p].to_vec()).collect();
        let mut got = m.forward_cached(&mut cache, &first).unwrap();
        let mut pos = prompt;
        let starts = [0, r.seqs[0].len()];
        loop {
            for j in 0..2 {
                if got[j].is_empty() {
                    continue;
                }
                let row = starts[j] + pos[j] - 1;
                let want = &r.logits[row * v..(row + 1) * v];
                for (a, b) in got[j].iter().zip(want) {
                    assert!((a - b).abs() <= TOLERANCE * (1.0 + b.abs()), "{model} seq {j} pos {}: {a} vs {b}", pos[j]);
                }
            }
            let next: Vec<Vec<i32>> =
                (0..2).map(|j| r.seqs[j].get(pos[j]).map(|&t| vec![t]).unwrap_or_default()).collect();
            if next.iter().all(Vec::is_empty) {
                break;
            }
            (0..2).for_each(|j| pos[j] += next[j].len());
            got = m.forward_cached(&mut cache, &next).unwrap();
        }
        assert_eq!(cache.lens(), [r.seqs[0].len(), r.seqs[1].len()]);
        for l in 0..m.config().num_layers {
            let kept = cache.kept(l, 0).unwrap();
            match m.config().layer_types[l] {
                LayerAttention::Global => assert_eq!(kept, r.seqs[0].len(), "{model} layer {l}"),
                LayerAttention::Sliding => {
                    assert_eq!(kept, m.config().sliding_window.unwrap() - 1, "{model} layer {l}")
                }
            }
        }
    }
}

/// With BF16 GEMM inputs the logits move by BF16 rounding only: close to the f32 ones, mostly
/// the same top-1.
#[test]
fn bf16_gemm_inputs_stay_close() {
    for model in MODELS {
        let w = DecoderWeights::from_hf_dir(&dir(model)).unwrap();
        let (f32m, bf16m) = (
            DecoderRef::new(w.clone(), DecoderPrecision::F32).unwrap(),
            DecoderRef::new(w, DecoderPrecision::Bf16).unwrap(),
        );
        let r = reference(model);
        let (a, b) = (f32m.logits(&r.seqs).unwrap(), bf16m.logits(&r.seqs).unwrap());
        let v = f32m.config().vocab_size;
        let same = a.chunks_exact(v).zip(b.chunks_exact(v)).filter(|(x, y)| argmax(x) == argmax(y)).count();
        let rows = a.len() / v;
        assert!(same * 10 >= rows * 8, "{model}: top-1 agrees on {same} of {rows} rows");
        let scale = a.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
        let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(worst > 0.0 && worst < 0.1 * scale, "{model}: BF16 moved logits by {worst} (scale {scale})");
    }
}

/// The FP8 emulation (the GPU decoder's FP8 GEMMs: current scaling, and block scaling) moves the
/// logits more than BF16 but keeps them close: finite, the top-1 of most rows, a mean move under
/// a twentieth of the logits' scale (these random models are sensitive: one Qwen2 logit moves
/// by 2.9 of 8); each recipe's casts differ from the BF16 ones and from each other; delayed
/// scaling (amax histories) is refused with the recipes that work named.
#[test]
fn fp8_emulation_stays_close_and_refuses_delayed_scaling() {
    use te_nn::fp8::Recipe;
    for model in MODELS {
        let w = DecoderWeights::from_hf_dir(&dir(model)).unwrap();
        let r = reference(model);
        let bf16 = DecoderRef::new(w.clone(), DecoderPrecision::Bf16).unwrap().logits(&r.seqs).unwrap();
        let v = w.config().vocab_size;
        let scale = r.logits.iter().map(|x| x.abs()).fold(0.0f32, f32::max);
        let mut outs = Vec::new();
        for recipe in ["current", "block"] {
            let recipe: Recipe = recipe.parse().unwrap();
            let m = DecoderRef::new(w.clone(), DecoderPrecision::Fp8(recipe)).unwrap();
            let got = m.logits(&r.seqs).unwrap();
            assert!(got.iter().all(|x| x.is_finite()), "{model} {}: a logit is not finite", recipe.name());
            let same =
                got.chunks_exact(v).zip(r.logits.chunks_exact(v)).filter(|(x, y)| argmax(x) == argmax(y)).count();
            let rows = got.len() / v;
            assert!(same * 10 >= rows * 6, "{model} {}: top-1 agrees on {same} of {rows} rows", recipe.name());
            let mean = got.iter().zip(&r.logits).map(|(x, y)| (x - y).abs()).sum::<f32>() / got.len() as f32;
            eprintln!("{model} {}: top-1 {same} of {rows}, mean |Δ| {mean} (scale {scale})", recipe.name());
            assert!(
                mean < scale / 20.0,
                "{model} {}: FP8 moved logits by {mean} on average (scale {scale})",
                recipe.name()
            );
            assert_ne!(got, bf16, "{model} {}: the FP8 casts ran", recipe.name());
            outs.push(got);
        }
        assert_ne!(outs[0], outs[1], "{model}: current and block scaling cast differently");
    }
    let delayed: Recipe = "delayed".parse().unwrap();
    let e = DecoderRef::new(DecoderWeights::from_hf_dir(&dir("llama")).unwrap(), DecoderPrecision::Fp8(delayed))
        .unwrap_err()
        .to_string();
    assert!(e.contains("current or block"), "{e}");
}

/// Perplexity of a sequence in one window equals exp of the mean cross-entropy of transformers'
/// logits; sliding windows score every token once.
#[test]
fn perplexity_is_the_teacher_forced_mean_nll() {
    for model in MODELS {
        let m = DecoderRef::from_hf_dir(&dir(model), DecoderPrecision::F32).unwrap();
        let r = reference(model);
        let v = m.config().vocab_size;
        let seq = &r.seqs[0];
        let mut nll = 0.0f64;
        for t in 0..seq.len() - 1 {
            let row = &r.logits[t * v..(t + 1) * v];
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = max + row.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            nll += lse - row[seq[t + 1] as usize] as f64;
        }
        let want = nll / (seq.len() - 1) as f64;
        let p = m.perplexity(seq, 64, 64).unwrap();
        assert_eq!(p.tokens, seq.len() - 1);
        assert!((p.mean_nll - want).abs() < 1e-4 * (1.0 + want), "{model}: {} vs {want}", p.mean_nll);
        assert!((p.perplexity - want.exp()).abs() < 1e-3 * want.exp());
        let windows = m.perplexity(seq, 8, 4).unwrap();
        assert_eq!(windows.tokens, seq.len() - 1, "overlapping windows score each token once");
        let disjoint = m.perplexity(seq, 8, 8).unwrap();
        assert_eq!(disjoint.tokens, seq.len() - 1 - (seq.len() - 1) / 8);
    }
}
