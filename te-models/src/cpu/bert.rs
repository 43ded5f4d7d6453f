//! CPU f32 BERT embedder: a Hugging Face `BertModel` forward and the sentence-transformers
//! pooling (mean over tokens, L2 normalisation), the engine of `te embed --precision cpu` and
//! the fp32 model the device's BF16 and FP8 embeddings are compared against. One sequence at a
//! time, no padding (so no mask), written from the Hugging Face definition rather than from this
//! crate's modules:
//!
//! `x = LN(word[ids] + pos[0..n] + type[0])`; per layer `h = LN1(x + Wo·attn(Wq x, Wk x, Wv x))`,
//! `y = LN2(h + W2·gelu(W1 h))`; `softmax(q·kᵀ/√d)` per head. Products and sums in f32 (as
//! PyTorch on the CPU), norm statistics in f64.

use crate::bert::{mean_pool_normalize, BertConfig, BertError, BertResult, BertWeights};
use te_codegen::DType;
use te_reference::activation::elementwise;
use te_runtime::numerics::round_to;

/// `x` through E4M3 with a per-tensor scale from its own amax (`448 / amax`, TE's current
/// scaling with margin 0): `round_e4m3(x · s) / s`.
fn fake_e4m3(x: &[f32]) -> Vec<f32> {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        return x.to_vec();
    }
    let s = 448.0 / amax;
    x.iter().map(|&v| round_to(DType::E4M3, v * s) / s).collect()
}

/// `x` through [`fake_e4m3`] when `fp8`, else as is.
fn maybe_e4m3(x: &[f32], fp8: bool) -> std::borrow::Cow<'_, [f32]> {
    if fp8 {
        std::borrow::Cow::Owned(fake_e4m3(x))
    } else {
        std::borrow::Cow::Borrowed(x)
    }
}

/// `y[t, o] = Σ_i x[t, i] w[o, i] + b[o]` for `x: [rows, n_in]`, `w: [n_out, n_in]`.
fn dense(x: &[f32], w: &[f32], b: &[f32], n_in: usize) -> Vec<f32> {
    let n_out = b.len();
    let mut y = Vec::with_capacity(x.len() / n_in * n_out);
    for xr in x.chunks_exact(n_in) {
        for (wr, &bo) in w.chunks_exact(n_in).zip(b) {
            y.push(dot(xr, wr) + bo);
        }
    }
    y
}

/// f32 dot product with 8 partial sums (vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Row-wise LayerNorm in place (biased variance, statistics in f64).
fn layer_norm(x: &mut [f32], gamma: &[f32], beta: &[f32], eps: f32) {
    let h = gamma.len();
    for r in x.chunks_exact_mut(h) {
        let mean = r.iter().map(|&v| f64::from(v)).sum::<f64>() / h as f64;
        let var = r.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / h as f64;
        let inv = 1.0 / (var + f64::from(eps)).sqrt();
        for ((v, &g), &b) in r.iter_mut().zip(gamma).zip(beta) {
            *v = ((f64::from(*v) - mean) * inv) as f32 * g + b;
        }
    }
}

/// Final hidden states `[n, hidden]` of one sequence of `n` token ids (no padding).
///
/// # Errors
/// [`BertError::Input`] for an empty sequence, one over `max_position_embeddings` or an id
/// outside the vocabulary; [`BertError::Tensor`] for missing or mismatched weights;
/// [`BertError::Unsupported`] for a configuration [`BertConfig::validate`] refuses.
pub fn hidden_states(cfg: &BertConfig, w: &BertWeights, ids: &[u32]) -> BertResult<Vec<f32>> {
    hidden_states_with(cfg, w, ids, false)
}

/// [`hidden_states`], with `fp8` simulating FP8 inference on the CPU: every GEMM weight, every
/// GEMM input (per sequence) and the word table pass through E4M3 with a per-tensor scale from
/// their own amax (current scaling); products and everything else stay f32. An estimate of
/// what FP8 costs in accuracy, not a bit-exact model of the device.
///
/// # Errors
/// As [`hidden_states`].
pub fn hidden_states_with(cfg: &BertConfig, w: &BertWeights, ids: &[u32], fp8: bool) -> BertResult<Vec<f32>> {
    cfg.validate()?;
    let (h, f, n) = (cfg.hidden_size, cfg.intermediate_size, ids.len());
    let dense =
        |x: &[f32], wt: &[f32], b: &[f32], n_in: usize| dense(&maybe_e4m3(x, fp8), &maybe_e4m3(wt, fp8), b, n_in);
    if n == 0 || n > cfg.max_position_embeddings {
        return Err(BertError::Input {
            message: format!("{n} tokens; the reference takes 1..={}", cfg.max_position_embeddings),
        });
    }
    let word = w.get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?;
    // The table's per-tensor E4M3 scale, applied to the rows looked up.
    let word_scale = fp8.then(|| 448.0 / word.iter().fold(0f32, |m, v| m.max(v.abs()))).filter(|s| s.is_finite());
    let pos = w.get("embeddings.position_embeddings.weight", &[cfg.max_position_embeddings, h])?;
    let tt = &w.get("embeddings.token_type_embeddings.weight", &[cfg.type_vocab_size, h])?[..h];
    let mut x = Vec::with_capacity(n * h);
    for (p, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= cfg.vocab_size {
            return Err(BertError::Input { message: format!("token id {id} outside the vocabulary") });
        }
        let (wr, pr) = (&word[id * h..(id + 1) * h], &pos[p * h..(p + 1) * h]);
        let deq = |a: f32| word_scale.map_or(a, |s| round_to(DType::E4M3, a * s) / s);
        x.extend(wr.iter().zip(pr).zip(tt).map(|((&a, b), c)| deq(a) + b + c));
    }
    layer_norm(
        &mut x,
        w.get("embeddings.LayerNorm.weight", &[h])?,
        w.get("embeddings.LayerNorm.bias", &[h])?,
        cfg.layer_norm_eps,
    );
    let (heads, d) = (cfg.num_attention_heads, cfg.head_dim());
    let scale = 1.0 / (d as f32).sqrt();
    let (act, _) = elementwise(cfg.activation);
    for l in 0..cfg.num_hidden_layers {
        let g = |name: &str, shape: &[usize]| w.get(&format!("encoder.layer.{l}.{name}"), shape);
        let q = dense(&x, g("attention.self.query.weight", &[h, h])?, g("attention.self.query.bias", &[h])?, h);
        let k = dense(&x, g("attention.self.key.weight", &[h, h])?, g("attention.self.key.bias", &[h])?, h);
        let v = dense(&x, g("attention.self.value.weight", &[h, h])?, g("attention.self.value.bias", &[h])?, h);
        let mut ctx = vec![0f32; n * h];
        let mut p = vec![0f32; n];
        for hd in 0..heads {
            let cols = hd * d..(hd + 1) * d;
            for i in 0..n {
                let qi = &q[i * h..][cols.clone()];
                for (j, pj) in p.iter_mut().enumerate() {
                    *pj = dot(qi, &k[j * h..][cols.clone()]) * scale;
                }
                let m = p.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for pj in p.iter_mut() {
                    *pj = (*pj - m).exp();
                    sum += *pj;
                }
                let out = &mut ctx[i * h..][cols.clone()];
                for (j, &pj) in p.iter().enumerate() {
                    let vj = &v[j * h..][cols.clone()];
                    for (o, &vv) in out.iter_mut().zip(vj) {
                        *o += pj / sum * vv;
                    }
                }
            }
        }
        let a = dense(&ctx, g("attention.output.dense.weight", &[h, h])?, g("attention.output.dense.bias", &[h])?, h);
        let mut h1: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x + a).collect();
        layer_norm(
            &mut h1,
            g("attention.output.LayerNorm.weight", &[h])?,
            g("attention.output.LayerNorm.bias", &[h])?,
            cfg.layer_norm_eps,
        );
        let mut m = dense(&h1, g("intermediate.dense.weight", &[f, h])?, g("intermediate.dense.bias", &[f])?, h);
        m.iter_mut().for_each(|v| *v = act(*v));
        let o = dense(&m, g("output.dense.weight", &[h, f])?, g("output.dense.bias", &[h])?, f);
        x = h1.iter().zip(&o).map(|(a, b)| a + b).collect();
        layer_norm(&mut x, g("output.LayerNorm.weight", &[h])?, g("output.LayerNorm.bias", &[h])?, cfg.layer_norm_eps);
    }
    Ok(x)
}

/// The sentence embedding of one sequence: mean over its tokens, L2-normalised, `[hidden]`.
///
/// # Errors
/// As [`hidden_states`].
pub fn embed(cfg: &BertConfig, w: &BertWeights, ids: &[u32]) -> BertResult<Vec<f32>> {
    embed_with(cfg, w, ids, false)
}

/// [`embed`] with the FP8 simulation of [`hidden_states_with`].
///
/// # Errors
/// As [`hidden_states`].
pub fn embed_with(cfg: &BertConfig, w: &BertWeights, ids: &[u32], fp8: bool) -> BertResult<Vec<f32>> {
    let x = hidden_states_with(cfg, w, ids, fp8)?;
    Ok(mean_pool_normalize(&x, ids.len(), cfg.hidden_size, &[ids.len()]).remove(0))
}

/// [`embed`] of every sequence, spread over up to `threads` threads (in order).
///
/// # Errors
/// The first sequence's error, as [`hidden_states`].
pub fn embed_many(cfg: &BertConfig, w: &BertWeights, seqs: &[Vec<u32>], threads: usize) -> BertResult<Vec<Vec<f32>>> {
    embed_many_with(cfg, w, seqs, threads, false)
}

/// [`embed_many`] with the FP8 simulation of [`hidden_states_with`].
///
/// # Errors
/// The first sequence's error, as [`hidden_states`].
pub fn embed_many_with(
    cfg: &BertConfig,
    w: &BertWeights,
    seqs: &[Vec<u32>],
    threads: usize,
    fp8: bool,
) -> BertResult<Vec<Vec<f32>>> {
    let threads = threads.clamp(1, seqs.len().max(1));
    let chunk = seqs.len().div_ceil(threads).max(1);
    let parts: Vec<BertResult<Vec<Vec<f32>>>> = std::thread::scope(|s| {
        let handles: Vec<_> = seqs
            .chunks(chunk)
            .map(|c| s.spawn(move || c.iter().map(|ids| embed_with(cfg, w, ids, fp8)).collect::<BertResult<Vec<_>>>()))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| Err(BertError::Input { message: "a reference thread panicked".into() }))
            })
            .collect()
    });
    let mut out = Vec::with_capacity(seqs.len());
    for p in parts {
        out.extend(p?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bert::HostTensor;
    use std::collections::HashMap;
    use te_nn::modules::Activation;

    /// A 1-layer model, hidden 2, 1 head, ffn 2, checked against a hand computation: with zero
    /// attention/MLP weights each layer adds only biases, so the output is the norms of known
    /// vectors.
    #[test]
    fn tiny_model_matches_hand_computation() {
        let cfg = BertConfig {
            vocab_size: 3,
            hidden_size: 2,
            num_hidden_layers: 1,
            num_attention_heads: 1,
            intermediate_size: 2,
            max_position_embeddings: 4,
            type_vocab_size: 1,
            layer_norm_eps: 1e-12,
            activation: Activation::GeluErf,
        };
        let t = |shape: &[usize], data: Vec<f32>| HostTensor { shape: shape.to_vec(), data };
        let mut m = HashMap::new();
        m.insert("embeddings.word_embeddings.weight".into(), t(&[3, 2], vec![0.0, 0.0, 1.0, 3.0, 2.0, 0.0]));
        m.insert("embeddings.position_embeddings.weight".into(), t(&[4, 2], vec![0.0; 8]));
        m.insert("embeddings.token_type_embeddings.weight".into(), t(&[1, 2], vec![0.0, 0.0]));
        m.insert("embeddings.LayerNorm.weight".into(), t(&[2], vec![1.0, 1.0]));
        m.insert("embeddings.LayerNorm.bias".into(), t(&[2], vec![0.0, 0.0]));
        let p = "encoder.layer.0.";
        for name in ["query", "key", "value"] {
            m.insert(format!("{p}attention.self.{name}.weight"), t(&[2, 2], vec![0.0; 4]));
            m.insert(format!("{p}attention.self.{name}.bias"), t(&[2], vec![0.0; 2]));
        }
        m.insert(format!("{p}attention.output.dense.weight"), t(&[2, 2], vec![0.0; 4]));
        m.insert(format!("{p}attention.output.dense.bias"), t(&[2], vec![0.5, -0.5]));
        m.insert(format!("{p}attention.output.LayerNorm.weight"), t(&[2], vec![1.0, 1.0]));
        m.insert(format!("{p}attention.output.LayerNorm.bias"), t(&[2], vec![0.0, 0.0]));
        m.insert(format!("{p}intermediate.dense.weight"), t(&[2, 2], vec![1.0, 0.0, 0.0, 1.0]));
        m.insert(format!("{p}intermediate.dense.bias"), t(&[2], vec![0.0, 0.0]));
        m.insert(format!("{p}output.dense.weight"), t(&[2, 2], vec![1.0, 0.0, 0.0, 1.0]));
        m.insert(format!("{p}output.dense.bias"), t(&[2], vec![0.0, 0.0]));
        m.insert(format!("{p}output.LayerNorm.weight"), t(&[2], vec![2.0, 1.0]));
        m.insert(format!("{p}output.LayerNorm.bias"), t(&[2], vec![0.0, 1.0]));
        let w = BertWeights::from_tensors(m);
        w.validate(&cfg).unwrap();
        // Token 1 = (1, 3): LN → (-1, 1); + (0.5, -0.5) → (-0.5, 0.5); LN1 → (-1, 1);
        // + gelu(-1, 1) = (-1 - 0.158655, 1 + 0.841345); LN2 → (-1, 1) · (2, 1) + (0, 1) = (-2, 2).
        let x = hidden_states(&cfg, &w, &[1]).unwrap();
        assert!((x[0] + 2.0).abs() < 1e-5 && (x[1] - 2.0).abs() < 1e-5, "{x:?}");
        // Two tokens: the rows do not mix (V = 0); token 2 = (2, 0) → (1, -1) → ... → (2, 0).
        let x = hidden_states(&cfg, &w, &[1, 2]).unwrap();
        assert!((x[2] - 2.0).abs() < 1e-5 && x[3].abs() < 1e-5, "{x:?}");
        // Mean (0, 1) → normalised (0, 1).
        let e = embed(&cfg, &w, &[1, 2]).unwrap();
        assert!(e[0].abs() < 1e-5 && (e[1] - 1.0).abs() < 1e-5, "{e:?}");
        assert!(hidden_states(&cfg, &w, &[5]).is_err());
        assert!(hidden_states(&cfg, &w, &[1; 5]).is_err());
        assert_eq!(embed_many(&cfg, &w, &[vec![1, 2], vec![1]], 2).unwrap().len(), 2);
    }

    /// Fuzzing (reliability issue): random configurations (some invalid), weights (some missing
    /// or misshapen), ids and lengths through the CPU BERT: no panic, every rejection a typed
    /// error, every accepted call finite hidden states of the right size.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 800, failure_persistence: None, ..ProptestConfig::default() })]

            #[test]
            fn cpu_bert_takes_random_shapes_without_panicking(
                (vocab, heads, head_dim, layers, ffn, max_pos) in (1usize..12, 1usize..4, 1usize..5, 1usize..3, 1usize..10, 1usize..8),
                zero in 0usize..20,
                damage in (0usize..12, any::<usize>()),
                ids in prop::collection::vec(0u32..14, 0..10),
                (fp8, seed) in (any::<bool>(), any::<u64>()),
            ) {
                let mut cfg = BertConfig {
                    vocab_size: vocab,
                    hidden_size: heads * head_dim,
                    num_hidden_layers: layers,
                    num_attention_heads: heads,
                    intermediate_size: ffn,
                    max_position_embeddings: max_pos,
                    type_vocab_size: 1,
                    layer_norm_eps: 1e-12,
                    activation: Activation::GeluErf,
                };
                // One configuration in ten invalid.
                match zero {
                    0 => cfg.num_attention_heads = 0,
                    1 => cfg.hidden_size += 1,
                    2 => cfg.type_vocab_size = 0,
                    3 => cfg.layer_norm_eps = f32::NAN,
                    _ => {}
                }
                // The weights of the (valid) layout, one in six dropped or misshapen.
                let mut rng = seed;
                let mut next = || {
                    rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((rng >> 33) as f32 / (1u64 << 31) as f32) - 0.5
                };
                let valid = BertConfig { num_attention_heads: heads, hidden_size: heads * head_dim, type_vocab_size: 1, ..cfg.clone() };
                let mut m = HashMap::new();
                let layout = BertWeights::layout(&valid);
                let (kind, which) = damage;
                for (i, (name, mut shape)) in layout.iter().cloned().enumerate() {
                    let hit = i == which % layout.len();
                    if hit && kind == 0 {
                        continue;
                    }
                    if hit && kind == 1 {
                        shape[0] += 1;
                    }
                    let n = shape.iter().product();
                    m.insert(name, HostTensor { shape, data: (0..n).map(|_| next()).collect() });
                }
                let w = BertWeights::from_tensors(m);
                match hidden_states_with(&cfg, &w, &ids, fp8) {
                    Ok(x) => {
                        prop_assert_eq!(x.len(), ids.len() * cfg.hidden_size);
                        prop_assert!(x.iter().all(|v| v.is_finite()), "{cfg:?}");
                    }
                    Err(e) => prop_assert!(
                        matches!(e, BertError::Input { .. } | BertError::Tensor { .. } | BertError::Unsupported { .. }),
                        "{e}"
                    ),
                }
                let many = embed_many_with(&cfg, &w, &[ids.clone(), ids.iter().rev().copied().collect()], 2, fp8);
                if let Err(e) = many {
                    prop_assert!(
                        matches!(e, BertError::Input { .. } | BertError::Tensor { .. } | BertError::Unsupported { .. }),
                        "{e}"
                    );
                }
            }
        }
    }
}
