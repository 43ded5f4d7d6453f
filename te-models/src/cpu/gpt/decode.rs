//! Cached decoding on the CPU GPT: [`KvCache`] (TE's `InferenceParams`: every layer's keys and
//! values of the tokens seen so far, preallocated) and [`GptRef::forward_cached`], which runs new
//! tokens at the positions after the cached ones, attending over the cache and appending to it.
//! Prefill is a call with the prompt, each decode step a call with one token per sequence; the
//! logits equal those of the whole prefix through [`GptRef::logits`] (to f32 rounding: the
//! products are the same, the GEMMs' blocking may differ).

use super::math::{gemm, View};
use super::{GptRef, MODEL};
use rayon::prelude::*;
use te_runtime::{Error, Result};

/// The keys and values of every layer for `batch` sequences of up to `capacity` tokens: per
/// layer `K` and `V` `[batch, capacity, heads, head_dim]` f32, allocated once
/// ([`GptRef::kv_cache`]) and reused: [`KvCache::clear`] starts new sequences in the same memory.
#[derive(Debug, Clone)]
pub struct KvCache {
    /// `(K, V)` per layer.
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    batch: usize,
    capacity: usize,
    heads: usize,
    head_dim: usize,
    /// Tokens cached per sequence.
    len: usize,
}

impl KvCache {
    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence it can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens per sequence it holds (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets the cached tokens (the memory stays, for the next sequences).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// Writes layer `l`'s keys and values of `s` new tokens per sequence (from `qkv: [s·b,
    /// 3·heads·d]`, rows `[q | k | v]`) at positions `len..len + s`, and returns the causal
    /// attention of their queries over positions `0..len + s`: `[s·b, heads·d]` (the new token
    /// at position `len + i` sees the keys up to itself). [`KvCache::advance`] moves `len` once
    /// every layer has run.
    pub(super) fn attend(&mut self, l: usize, qkv: &[f32], s: usize, heads: usize, d: usize) -> Vec<f32> {
        let (b, cap, p0) = (self.batch, self.capacity, self.len);
        let (hd, w) = (heads * d, 3 * heads * d);
        let (k, v) = &mut self.layers[l];
        for i in 0..s {
            for j in 0..b {
                let (row, at) = (&qkv[(i * b + j) * w..], (j * cap + p0 + i) * hd);
                k[at..at + hd].copy_from_slice(&row[hd..2 * hd]);
                v[at..at + hd].copy_from_slice(&row[2 * hd..3 * hd]);
            }
        }
        let (k, v) = (&*k, &*v);
        let keys = p0 + s;
        let scale = 1.0 / (d as f32).sqrt();
        let blocks: Vec<Vec<f32>> = (0..b * heads)
            .into_par_iter()
            .map(|task| {
                let (j, hh) = (task / heads, task % heads);
                let base = j * cap * hd + hh * d;
                let mut p = vec![0.0; s * keys];
                let q = View { data: &qkv[j * w + hh * d..], rs: b * w, cs: 1 };
                gemm(s, d, keys, q, View { data: &k[base..], rs: 1, cs: hd }, 0.0, &mut p);
                for (i, row) in p.chunks_exact_mut(keys).enumerate() {
                    let seen = p0 + i + 1;
                    let m = row[..seen].iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x * scale));
                    let mut sum = 0.0f32;
                    for x in &mut row[..seen] {
                        *x = (*x * scale - m).exp();
                        sum += *x;
                    }
                    row[..seen].iter_mut().for_each(|x| *x /= sum);
                    row[seen..].fill(0.0);
                }
                let mut o = vec![0.0; s * d];
                gemm(s, keys, d, View::rows(&p, keys), View { data: &v[base..], rs: hd, cs: 1 }, 0.0, &mut o);
                o
            })
            .collect();
        let mut out = vec![0.0; s * b * hd];
        for (task, o) in blocks.into_iter().enumerate() {
            let (j, hh) = (task / heads, task % heads);
            for (i, row) in o.chunks_exact(d).enumerate() {
                let at = (i * b + j) * hd + hh * d;
                out[at..at + d].copy_from_slice(row);
            }
        }
        out
    }

    /// Counts `s` more tokens per sequence (after every layer has [`KvCache::attend`]ed).
    pub(super) fn advance(&mut self, s: usize) {
        self.len += s;
    }
}

impl GptRef {
    /// An empty [`KvCache`] for `batch` sequences of up to `capacity` tokens (prompt and new
    /// tokens): `2 · num_layers · batch · capacity · hidden` f32.
    ///
    /// # Errors
    /// [`Error::Shape`] for `batch = 0`, `capacity = 0`, or a capacity beyond the model's
    /// context (`seq_length`, its position table).
    pub fn kv_cache(&self, batch: usize, capacity: usize) -> Result<KvCache> {
        let context = self.cfg.seq_length;
        if batch == 0 || capacity == 0 || capacity > context {
            return Err(Error::Shape {
                op: MODEL,
                message: format!(
                    "a KV cache needs a batch ≥ 1 and 1 ≤ capacity ≤ the model's context of {context} tokens \
                     (seq_length), got batch {batch}, capacity {capacity}"
                ),
            });
        }
        let h = self.cfg.hidden_size;
        let heads = self.cfg.num_attention_heads;
        let n = batch * capacity * h;
        Ok(KvCache {
            layers: (0..self.cfg.num_layers).map(|_| (vec![0.0; n], vec![0.0; n])).collect(),
            batch,
            capacity,
            heads,
            head_dim: h / heads,
            len: 0,
        })
    }

    /// Runs the tokens `ids` `[s, b]` (row-major, token `i·b + j` of sequence `j`, `b` =
    /// [`KvCache::batch`]) at positions `cache.len()..` through the evaluation forward (no
    /// dropout; FP8 with the current scales, nothing recorded), attending over the cached tokens
    /// too, appends their keys and values, and returns the logits of the last new position of
    /// each sequence: `[b, vocab]`. The prefill is a call with the prompt; a decode step a call
    /// with `s = 1`.
    ///
    /// # Errors
    /// [`Error::Shape`] for `s = 0`, `ids` not `s · b` long, more tokens than the cache has room
    /// for, or a cache made by a model of another shape; [`Error::Argument`] for an id outside
    /// `[0, vocab)`. The cache is unchanged then.
    pub fn forward_cached(&self, cache: &mut KvCache, ids: &[i32], s: usize) -> Result<Vec<f32>> {
        let b = cache.batch;
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        let h = self.cfg.hidden_size;
        let fits = cache.layers.len() == self.cfg.num_layers
            && cache.heads == self.cfg.num_attention_heads
            && cache.heads * cache.head_dim == h
            && cache.capacity <= self.cfg.seq_length;
        if !fits {
            return shape(
                "the KV cache was made by a model of another shape: make it with this model's kv_cache".into(),
            );
        }
        if s == 0 || ids.len() != s * b {
            return shape(format!(
                "ids must be [s, b] = [s ≥ 1, {b}] (the cache's batch), got {} values for s = {s}",
                ids.len()
            ));
        }
        if cache.len + s > cache.capacity {
            return shape(format!(
                "{s} more tokens do not fit the KV cache ({} of {} positions used): make a larger one (at most \
                 the model's context of {} tokens)",
                cache.len, cache.capacity, self.cfg.seq_length
            ));
        }
        let v = self.cfg.vocab_size as i32;
        if let Some(t) = ids.iter().find(|&&t| !(0..v).contains(&t)) {
            return Err(Error::Argument { op: MODEL, message: format!("token id {t} outside [0, {v})") });
        }
        let logits = self.logits_of(ids, s, b, None, Some(cache)).logits;
        let vocab = self.cfg.vocab_size;
        Ok(logits[(s - 1) * b * vocab..].to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::gpt::GemmPrecision;
    use crate::gpt::GptConfig;
    use te_nn::fp8::DelayedScaling;

    fn model(precision: GemmPrecision) -> GptRef {
        let cfg = GptConfig {
            num_layers: 2,
            hidden_size: 48,
            num_attention_heads: 3,
            ffn_hidden_size: 96,
            seq_length: 40,
            seed: 11,
            ..GptConfig::tiny()
        };
        let mut m = GptRef::new(&cfg).unwrap();
        m.set_precision(precision).unwrap();
        m
    }

    fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
    }

    /// Prefill of 7 tokens then 9 single-token steps give, at every step, the logits of the
    /// whole prefix through the full forward (f32, BF16 and FP8 emulation with scales that are
    /// not 1); the cache can be cleared and reused.
    #[test]
    fn cached_logits_equal_the_full_prefix() {
        let fp8 = GemmPrecision::Fp8(DelayedScaling { amax_history_len: 2, ..Default::default() }.into());
        for precision in [GemmPrecision::F32, GemmPrecision::Bf16, fp8] {
            let mut m = model(precision);
            let b = 3;
            // Two training forwards so that the FP8 scales are not 1.
            for _ in 0..2 {
                let ids: Vec<i32> = (0..8 * b as i32).map(|i| (i * 37) % 256).collect();
                let _ = m.forward_loss(&ids, &ids, 8, b).unwrap();
            }
            let seqs: Vec<Vec<i32>> =
                (0..b as i32).map(|j| (0..16).map(|i| (i * 31 + j * 7 + 5) % 256).collect()).collect();
            let mut cache = m.kv_cache(b, 20).unwrap();
            for round in 0..2 {
                cache.clear();
                let prompt: Vec<i32> = (0..7 * b).map(|t| seqs[t % b][t / b]).collect();
                let mut got = m.forward_cached(&mut cache, &prompt, 7).unwrap();
                for pos in 7..16 {
                    let prefix: Vec<i32> = (0..pos * b).map(|t| seqs[t % b][t / b]).collect();
                    let full = m.logits(&prefix, pos, b).unwrap();
                    let want = &full[(pos - 1) * b * 256..];
                    assert!(close(&got, want, 1e-4), "{precision:?} round {round} position {pos}");
                    let next: Vec<i32> = (0..b).map(|j| seqs[j][pos]).collect();
                    got = m.forward_cached(&mut cache, &next, 1).unwrap();
                }
                assert_eq!(cache.len(), 16);
            }
        }
    }

    /// Bad calls are typed errors that leave the cache as it was.
    #[test]
    fn bad_calls_are_refused() {
        let m = model(GemmPrecision::F32);
        assert!(matches!(m.kv_cache(0, 8), Err(Error::Shape { .. })));
        assert!(matches!(m.kv_cache(1, 0), Err(Error::Shape { .. })));
        let e = m.kv_cache(1, 41).unwrap_err().to_string();
        assert!(e.contains("context of 40"), "{e}");
        let mut cache = m.kv_cache(2, 4).unwrap();
        assert!(matches!(m.forward_cached(&mut cache, &[1, 2, 3], 2), Err(Error::Shape { .. })));
        assert!(matches!(m.forward_cached(&mut cache, &[], 0), Err(Error::Shape { .. })));
        assert!(matches!(m.forward_cached(&mut cache, &[1, 300], 1), Err(Error::Argument { .. })));
        m.forward_cached(&mut cache, &[1, 2, 3, 4, 5, 6], 3).unwrap();
        let e = m.forward_cached(&mut cache, &[1, 2, 3, 4], 2).unwrap_err().to_string();
        assert!(e.contains("3 of 4 positions used"), "{e}");
        assert_eq!(cache.len(), 3);
        let other = GptRef::new(&GptConfig { num_attention_heads: 4, ..m.config().clone() }).unwrap();
        let e = other.forward_cached(&mut cache, &[1, 2], 1).unwrap_err().to_string();
        assert!(e.contains("another shape"), "{e}");
    }
}
