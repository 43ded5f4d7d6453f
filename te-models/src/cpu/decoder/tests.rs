//! The CPU decoder on random weights: the KV cache against the full forward (sliding windows,
//! chunks of several tokens, every option of the family), packing independence, the window's
//! reach, generation (greedy, sampled, EOS) and the typed errors. The comparison with
//! transformers is `te-models/tests/decoder_hf.rs`.

use super::*;
use crate::decoder::{hf_layout, DecoderActivation, LayerAttention, RopeConfig, RopeScaling, WeightTensor};
use crate::generate::SamplingConfig;
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::collections::BTreeMap;
use te_nn::modules::NormKind;

/// A Gemma-like configuration: GQA, qk-norm, sandwich norms, a window of 3 on layers 0 and 2.
fn gemma_cfg() -> DecoderConfig {
    DecoderConfig {
        vocab_size: 50,
        hidden_size: 24,
        ffn_hidden_size: 40,
        num_layers: 3,
        num_attention_heads: 4,
        num_gqa_groups: 2,
        head_dim: 8,
        normalization: NormKind::RmsNorm,
        layernorm_epsilon: 1e-6,
        zero_centered_gamma: true,
        sandwich_norm: true,
        qk_norm: true,
        activation: DecoderActivation::Geglu,
        rope: RopeConfig { theta: 1e6, scaling: RopeScaling::Linear { factor: 2.0 } },
        rope_local: Some(RopeConfig::new(1e4)),
        layer_types: vec![LayerAttention::Sliding, LayerAttention::Global, LayerAttention::Sliding],
        sliding_window: Some(3),
        qkv_bias: false,
        proj_bias: false,
        mlp_bias: false,
        tie_word_embeddings: true,
        scale_embeddings: true,
        query_pre_attn_scalar: Some(12.0),
        final_logit_softcapping: Some(5.0),
        attn_logit_softcapping: None,
        max_position_embeddings: 64,
        bos_token_id: Some(2),
        eos_token_ids: vec![1],
    }
}

/// Every other option: LayerNorm, a plain (non-gated) tanh GELU, MQA, biases everywhere, an
/// untied head, attention soft-capping, Llama-3 RoPE.
fn exotic_cfg() -> DecoderConfig {
    DecoderConfig {
        normalization: NormKind::LayerNorm,
        zero_centered_gamma: false,
        sandwich_norm: false,
        qk_norm: false,
        activation: DecoderActivation::GeluTanh,
        num_gqa_groups: 1,
        head_dim: 10,
        rope: RopeConfig {
            theta: 1e4,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            },
        },
        rope_local: None,
        layer_types: vec![LayerAttention::Global, LayerAttention::Sliding],
        num_layers: 2,
        sliding_window: Some(5),
        qkv_bias: true,
        proj_bias: true,
        mlp_bias: true,
        tie_word_embeddings: false,
        scale_embeddings: false,
        query_pre_attn_scalar: None,
        final_logit_softcapping: None,
        attn_logit_softcapping: Some(1.5),
        ..gemma_cfg()
    }
}

/// Seeded random parameters of `cfg` (internal names), of unit scale.
fn random_tensors(cfg: &DecoderConfig, seed: u64) -> BTreeMap<String, WeightTensor> {
    let mut rng = StdRng::seed_from_u64(seed);
    hf_layout(cfg)
        .into_iter()
        .map(|p| {
            let n: usize = p.shape.iter().product();
            let norm = p.name.contains("norm");
            let (base, std) = match p.shape.len() {
                2 if p.name == "embedding.weight" => (0.0, if cfg.scale_embeddings { 0.1 } else { 0.5 }),
                2 => (0.0, 1.5 / (p.shape[1] as f32).sqrt()),
                _ if norm && !p.name.ends_with("bias") => (if cfg.zero_centered_gamma { 0.0 } else { 1.0 }, 0.2),
                _ => (0.0, 0.2),
            };
            let data = (0..n).map(|_| base + std * (rng.random::<f32>() * 2.0 - 1.0) * 1.7).collect();
            (p.name, WeightTensor { shape: p.shape, data })
        })
        .collect()
}

/// A model of `cfg` with [`random_tensors`].
fn random_model(cfg: &DecoderConfig, seed: u64, precision: DecoderPrecision) -> DecoderRef {
    let weights = DecoderWeights::from_tensors(cfg.clone(), random_tensors(cfg, seed)).unwrap();
    DecoderRef::new(weights, precision).unwrap()
}

fn tokens(n: usize, salt: i32, vocab: usize) -> Vec<i32> {
    (0..n as i32).map(|i| (i * 17 + salt * 29 + 3) % vocab as i32).collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= 2e-5 * (1.0 + b.abs()), "{what} [{i}]: {a} vs {b}");
    }
}

/// The cache in chunks (prefill, single tokens, then 3 at a time) gives the full forward's logits
/// at every last position, for a ragged batch; sliding layers keep `window − 1` tokens.
#[test]
fn cached_chunks_equal_the_full_forward() {
    for (cfg, precision) in [
        (gemma_cfg(), DecoderPrecision::F32),
        (exotic_cfg(), DecoderPrecision::F32),
        (gemma_cfg(), DecoderPrecision::Bf16),
    ] {
        let m = random_model(&cfg, 7, precision);
        let v = cfg.vocab_size;
        let seqs = [tokens(17, 0, v), tokens(11, 1, v), tokens(14, 2, v)];
        let full: Vec<Vec<f32>> = seqs.iter().map(|s| m.logits(&[s]).unwrap()).collect();
        let mut cache = m.kv_cache(3);
        let mut at = [0usize; 3];
        for chunk in [4usize, 1, 1, 3, 3, 2, 5] {
            let new: Vec<Vec<i32>> =
                (0..3).map(|j| seqs[j][at[j]..(at[j] + chunk).min(seqs[j].len())].to_vec()).collect();
            let got = m.forward_cached(&mut cache, &new).unwrap();
            for j in 0..3 {
                at[j] += new[j].len();
                if new[j].is_empty() {
                    assert!(got[j].is_empty());
                    continue;
                }
                let row = at[j] - 1;
                assert_close(&got[j], &full[j][row * v..(row + 1) * v], &format!("{precision:?} seq {j} pos {row}"));
            }
        }
        assert_eq!(cache.lens(), [17, 11, 14]);
        for l in 0..cfg.num_layers {
            let kept = cache.kept(l, 0).unwrap();
            let want = cfg.layer_window(l).map_or(17, |(left, _)| left as usize);
            assert_eq!(kept, want, "layer {l}");
        }
        assert!(cache.bytes() > 0);
        cache.clear();
        assert_eq!((cache.lens(), cache.kept(0, 0)), (&[0, 0, 0][..], Some(0)));
    }
}

/// Packing: a sequence's logits do not depend on the others in its batch.
#[test]
fn batched_sequences_are_independent() {
    let cfg = gemma_cfg();
    let m = random_model(&cfg, 4, DecoderPrecision::F32);
    let (a, b) = (tokens(9, 4, 50), tokens(4, 5, 50));
    let both = m.logits(&[a.clone(), b.clone()]).unwrap();
    let v = cfg.vocab_size;
    assert_eq!(both[..9 * v], m.logits(&[a]).unwrap()[..]);
    assert_eq!(both[9 * v..], m.logits(&[b]).unwrap()[..]);
}

/// With one sliding layer of window 3, the last position sees only the last 3 tokens: changing
/// earlier ones leaves its logits as they were; with a global layer they change.
#[test]
fn the_window_bounds_what_a_position_sees() {
    let one = |t| DecoderConfig { num_layers: 1, layer_types: vec![t], ..gemma_cfg() };
    let sliding = random_model(&one(LayerAttention::Sliding), 5, DecoderPrecision::F32);
    let global = random_model(&one(LayerAttention::Global), 5, DecoderPrecision::F32);
    let a = tokens(10, 6, 50);
    let mut b = a.clone();
    b[..7].iter_mut().for_each(|t| *t = (*t + 11) % 50);
    let last = |m: &DecoderRef, s: &[i32]| m.logits(&[s]).unwrap()[9 * 50..].to_vec();
    assert_eq!(last(&sliding, &a), last(&sliding, &b));
    assert_ne!(last(&global, &a), last(&global, &b));
}

fn argmax(row: &[f32]) -> i32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| if v > bv { (i, v) } else { (bi, bv) }).0
        as i32
}

/// Greedy generation equals the argmax of the full forward, token after token, for prompts of
/// different lengths; an EOS token stops its sequence (and is its last token) while the other goes
/// on; sampling is reproducible from its seed; tokens stream in order.
#[test]
fn generation_follows_the_full_forward_and_stops_at_eos() {
    let mut cfg = gemma_cfg();
    cfg.eos_token_ids.clear();
    let m = random_model(&cfg, 4, DecoderPrecision::F32);
    let prompts = vec![tokens(5, 7, 50), tokens(2, 8, 50)];
    let opts = DecodeOptions::greedy(6);
    let mut streamed = Vec::new();
    let out = m
        .generate(&prompts, &opts, |j, t| {
            streamed.push((j, t));
            Ok(())
        })
        .unwrap();
    for (j, p) in prompts.iter().enumerate() {
        let mut seq = p.clone();
        for _ in 0..6 {
            let logits = m.logits(&[&seq]).unwrap();
            seq.push(argmax(&logits[(seq.len() - 1) * 50..]));
        }
        assert_eq!(out[j], seq[p.len()..], "prompt {j}");
    }
    assert_eq!(streamed.len(), 12);
    assert_eq!(streamed[..2], [(0, out[0][0]), (1, out[1][0])]);
    // EOS: make sequence 0's third token the end of sequence.
    cfg.eos_token_ids = vec![out[0][2] as u32];
    let m_eos = random_model(&cfg, 4, DecoderPrecision::F32);
    let stopped = m_eos.generate(&prompts, &opts, |_, _| Ok(())).unwrap();
    for j in 0..2 {
        let cut = out[j].iter().position(|&t| t == out[0][2]).map_or(6, |i| i + 1);
        assert_eq!(stopped[j], out[j][..cut], "sequence {j} stops after its first EOS");
    }
    assert_eq!((stopped[0].len(), stopped[1].len()), (3, 6), "{stopped:?}: sequence 1 goes on");
    let no_stop = DecodeOptions { stop_at_eos: false, ..opts };
    assert_eq!(m_eos.generate(&prompts, &no_stop, |_, _| Ok(())).unwrap(), out);
    // Sampling: the same seed draws the same tokens, in a batch or alone for the first prompt.
    let sampled = DecodeOptions {
        sampling: SamplingConfig { temperature: 0.9, top_k: Some(20), top_p: Some(0.95) },
        seed: 5,
        ..no_stop
    };
    let s1 = m.generate(&prompts, &sampled, |_, _| Ok(())).unwrap();
    assert_eq!(s1, m.generate(&prompts, &sampled, |_, _| Ok(())).unwrap());
    assert_eq!(s1[0], m.generate(&prompts[..1], &sampled, |_, _| Ok(())).unwrap()[0], "row 0 in both");
    let other = DecodeOptions { seed: 6, ..sampled };
    let draws: Vec<Vec<Vec<i32>>> =
        (0..4).map(|s| m.generate(&prompts, &DecodeOptions { seed: s, ..other }, |_, _| Ok(())).unwrap()).collect();
    assert!(draws.iter().any(|d| d != &s1), "seeds draw differently");
    assert_eq!(m.generate(&prompts, &DecodeOptions::greedy(0), |_, _| Ok(())).unwrap(), vec![Vec::<i32>::new(); 2]);
}

/// Bad inputs are typed errors naming what to change; the cache is unchanged by them.
#[test]
fn bad_inputs_are_refused() {
    let m = random_model(&gemma_cfg(), 1, DecoderPrecision::F32);
    let err = |r: DecoderResult<Vec<f32>>| r.unwrap_err().to_string();
    assert!(err(m.logits::<Vec<i32>>(&[])).contains("at least one sequence"));
    assert!(err(m.logits(&[vec![1], vec![]])).contains("at least one token"));
    assert!(err(m.logits(&[vec![1, 50]])).contains("token id 50 outside the vocabulary [0, 50)"));
    assert!(err(m.logits(&[vec![-1]])).contains("token id -1"));
    let mut cache = m.kv_cache(2);
    let e = m.forward_cached(&mut cache, &[vec![1]]).unwrap_err().to_string();
    assert!(e.contains("batch 2"), "{e}");
    assert!(m.forward_cached(&mut cache, &[vec![1], vec![99]]).is_err());
    assert_eq!(cache.lens(), [0, 0]);
    let other = random_model(
        &DecoderConfig { num_layers: 2, layer_types: vec![LayerAttention::Global; 2], ..gemma_cfg() },
        1,
        DecoderPrecision::F32,
    );
    let e = other.forward_cached(&mut cache, &[vec![1], vec![2]]).unwrap_err().to_string();
    assert!(e.contains("another shape"), "{e}");
    let g = DecodeOptions::greedy(3);
    assert!(m.generate(&[], &g, |_, _| Ok(())).unwrap_err().to_string().contains("no prompt"));
    assert!(m.generate(&[vec![1], vec![]], &g, |_, _| Ok(())).unwrap_err().to_string().contains("prompt 1 is empty"));
    let bad = DecodeOptions { sampling: SamplingConfig { temperature: -1.0, ..SamplingConfig::default() }, ..g };
    assert!(matches!(m.generate(&[vec![1]], &bad, |_, _| Ok(())), Err(DecoderError::Runtime(_))));
    let stop = m.generate(&[vec![1]], &g, |_, _| Err(DecoderError::input("stop"))).unwrap_err();
    assert!(stop.to_string().contains("stop"));
    for (tokens, max, stride) in
        [(vec![1], 8, 8), (vec![1, 2], 1, 1), (vec![1, 2], 8, 0), (vec![1, 2], 8, 9), (vec![1, 77], 8, 8)]
    {
        assert!(
            matches!(m.perplexity(&tokens, max, stride), Err(DecoderError::Input { .. })),
            "{tokens:?} {max} {stride}"
        );
    }
}
