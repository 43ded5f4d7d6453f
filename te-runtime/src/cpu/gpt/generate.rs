//! Text generation on the CPU GPT: [`GptRef::generate_cached`], the decode loop of `te generate`
//! on the CPU (prefill, then one token per sequence per step over a [`KvCache`], each token
//! handed to a callback as it comes), and [`GptRef::generate`], its reference: every step runs
//! the whole prefix through the evaluation forward ([`GptRef::logits`]), no cache. Both draw the
//! token at position `i` of sequence `j` from row `j` of the Philox stream `(seed, i)`
//! ([`SamplingConfig::sample`]), so they agree token for token wherever their logits do.

use super::{GptRef, KvCache, MODEL};
use crate::generate::SamplingConfig;
use crate::{Error, Result};

impl GptRef {
    /// The checks of a generation: at least one prompt, all of one length ≥ 1, that length
    /// plus `max_new_tokens` within `capacity`; returns the prompt length.
    fn check_prompts(&self, prompts: &[Vec<i32>], max_new_tokens: usize, capacity: usize) -> Result<usize> {
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        let Some(first) = prompts.first() else {
            return shape("no prompt: generation needs a batch of at least one".into());
        };
        let len = first.len();
        if len == 0 {
            return shape("an empty prompt: give at least one token".into());
        }
        if let Some(p) = prompts.iter().find(|p| p.len() != len) {
            return shape(format!("prompts of {len} and {} tokens: a batch takes prompts of one length", p.len()));
        }
        if len + max_new_tokens > capacity {
            let context = self.config().seq_length;
            let room = if capacity < context {
                format!("the KV cache's {capacity} positions")
            } else {
                format!("the model's context of {context} (seq_length)")
            };
            return shape(format!(
                "a prompt of {len} tokens and {max_new_tokens} new ones exceed {room}: shorten the prompt or ask for \
                 fewer tokens"
            ));
        }
        Ok(len)
    }

    /// The next token of each sequence from `logits` `[b, vocab]` of position `position - 1`.
    fn sample_rows(&self, logits: &[f32], sampling: &SamplingConfig, seed: u64, position: usize) -> Result<Vec<i32>> {
        let v = self.config().vocab_size;
        logits
            .chunks_exact(v)
            .enumerate()
            .map(|(j, row)| Ok(sampling.sample(row, seed, position as u64, j as u64)? as i32))
            .collect()
    }

    /// Continues each prompt of `prompts` (token ids, all of one length ≥ 1) by `max_new_tokens`
    /// tokens drawn with `sampling` (see the module docs), without a cache: the reference of
    /// [`GptRef::generate_cached`]. Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// [`Error::Shape`] for no prompt, an empty prompt, prompts of different lengths, or a
    /// prompt plus `max_new_tokens` longer than the model's context (`seq_length`: its position
    /// table); [`Error::Argument`] for an id outside the vocabulary and the sampler's errors.
    pub fn generate(
        &self,
        prompts: &[Vec<i32>],
        max_new_tokens: usize,
        sampling: &SamplingConfig,
        seed: u64,
    ) -> Result<Vec<Vec<i32>>> {
        sampling.validate()?;
        let len = self.check_prompts(prompts, max_new_tokens, self.config().seq_length)?;
        let b = prompts.len();
        let v = self.config().vocab_size;
        let mut seqs: Vec<Vec<i32>> = prompts.to_vec();
        for _ in 0..max_new_tokens {
            let s = seqs[0].len();
            // [s, b] row-major: token i·b + j is position i of sequence j.
            let ids: Vec<i32> = (0..s * b).map(|t| seqs[t % b][t / b]).collect();
            let logits = self.logits(&ids, s, b)?;
            let next = self.sample_rows(&logits[(s - 1) * b * v..], sampling, seed, s)?;
            seqs.iter_mut().zip(next).for_each(|(seq, t)| seq.push(t));
        }
        Ok(seqs.into_iter().map(|s| s[len..].to_vec()).collect())
    }

    /// Continues each prompt of `prompts` by `max_new_tokens` tokens as [`GptRef::generate`]
    /// does, over `cache` (cleared first; its batch must be `prompts.len()`): the prompts in one
    /// prefill, then one token per sequence per step. `on_tokens(i, next)` gets the `i`-th new
    /// token of every sequence as soon as it is drawn (`i = 0` right after the prefill); an
    /// error it returns ends the generation. Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// As [`GptRef::generate`], with the cache's capacity in place of the context; [`Error::Shape`]
    /// for a cache of another batch or model; `on_tokens`' errors.
    pub fn generate_cached(
        &self,
        cache: &mut KvCache,
        prompts: &[Vec<i32>],
        max_new_tokens: usize,
        sampling: &SamplingConfig,
        seed: u64,
        mut on_tokens: impl FnMut(usize, &[i32]) -> Result<()>,
    ) -> Result<Vec<Vec<i32>>> {
        sampling.validate()?;
        let len = self.check_prompts(prompts, max_new_tokens, cache.capacity())?;
        let b = prompts.len();
        if cache.batch() != b {
            return Err(Error::Shape {
                op: MODEL,
                message: format!("{b} prompts and a KV cache of batch {}: make the cache for the batch", cache.batch()),
            });
        }
        cache.clear();
        let mut out: Vec<Vec<i32>> = vec![Vec::with_capacity(max_new_tokens); b];
        if max_new_tokens == 0 {
            return Ok(out);
        }
        let ids: Vec<i32> = (0..len * b).map(|t| prompts[t % b][t / b]).collect();
        let mut logits = self.forward_cached(cache, &ids, len)?;
        for i in 0..max_new_tokens {
            let next = self.sample_rows(&logits, sampling, seed, len + i)?;
            on_tokens(i, &next)?;
            out.iter_mut().zip(&next).for_each(|(o, &t)| o.push(t));
            if i + 1 < max_new_tokens {
                logits = self.forward_cached(cache, &next, 1)?;
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::gpt::GptRef;
    use crate::generate::SamplingConfig;
    use crate::models::gpt::GptConfig;
    use crate::Error;

    fn model() -> GptRef {
        let cfg = GptConfig {
            num_layers: 2,
            hidden_size: 32,
            num_attention_heads: 2,
            ffn_hidden_size: 64,
            seq_length: 24,
            seed: 4,
            ..GptConfig::tiny()
        };
        GptRef::new(&cfg).unwrap()
    }

    /// The cached loop draws the reference loop's tokens (greedy and sampled), streams them in
    /// order, and reuses its cache across calls.
    #[test]
    fn cached_generation_equals_the_reference() {
        let m = model();
        let prompts = vec![vec![10, 20, 30, 40], vec![5, 6, 7, 8], vec![200, 1, 2, 3]];
        let mut cache = m.kv_cache(3, 24).unwrap();
        let sampled = SamplingConfig { temperature: 0.9, top_k: Some(50), top_p: Some(0.95) };
        for (sampling, seed) in [(SamplingConfig::greedy(), 0), (sampled, 7), (SamplingConfig::default(), 8)] {
            let want = m.generate(&prompts, 12, &sampling, seed).unwrap();
            let mut streamed: Vec<Vec<i32>> = vec![Vec::new(); 3];
            let mut steps = Vec::new();
            let got = m
                .generate_cached(&mut cache, &prompts, 12, &sampling, seed, |i, next| {
                    steps.push(i);
                    streamed.iter_mut().zip(next).for_each(|(s, &t)| s.push(t));
                    Ok(())
                })
                .unwrap();
            assert_eq!(got, want, "{sampling:?}");
            assert_eq!(streamed, want);
            assert_eq!(steps, (0..12).collect::<Vec<_>>());
        }
    }

    /// Errors: no prompt, an empty one, unequal ones, too long for the cache or the context, a
    /// cache of another batch, a bad sampler; a callback's error ends the generation.
    #[test]
    fn bad_generations_are_refused() {
        let m = model();
        let g = SamplingConfig::greedy();
        let mut cache = m.kv_cache(1, 10).unwrap();
        let nothing = |_: usize, _: &[i32]| Ok(());
        let err = |r: crate::Result<Vec<Vec<i32>>>| r.unwrap_err().to_string();
        assert!(err(m.generate_cached(&mut cache, &[], 1, &g, 0, nothing)).contains("no prompt"));
        assert!(err(m.generate_cached(&mut cache, &[vec![]], 1, &g, 0, nothing)).contains("empty prompt"));
        assert!(err(m.generate(&[vec![1], vec![1, 2]], 1, &g, 0)).contains("one length"));
        assert!(err(m.generate_cached(&mut cache, &[vec![1; 6]], 5, &g, 0, nothing)).contains("10 positions"));
        assert!(err(m.generate(&[vec![1; 20]], 5, &g, 0)).contains("context of 24"));
        assert!(err(m.generate_cached(&mut cache, &[vec![1], vec![2]], 1, &g, 0, nothing)).contains("batch 1"));
        let bad = SamplingConfig { temperature: -1.0, ..g };
        assert!(m.generate_cached(&mut cache, &[vec![1]], 1, &bad, 0, nothing).is_err());
        let stop = |i: usize, _: &[i32]| {
            if i == 2 {
                Err(Error::Argument { op: "test", message: "stop".into() })
            } else {
                Ok(())
            }
        };
        assert!(err(m.generate_cached(&mut cache, &[vec![1]], 5, &g, 0, stop)).contains("stop"));
        assert_eq!(m.generate_cached(&mut cache, &[vec![1]], 0, &g, 0, nothing).unwrap(), vec![Vec::<i32>::new()]);
    }
}
