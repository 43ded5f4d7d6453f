//! Text generation on the CPU GPT through the decode loop of [`crate::generate::decode`]:
//! [`GptRef::generate_cached`], what `te generate` runs on the CPU (prefill, then one token per
//! sequence per step over a [`KvCache`], each token handed to a callback as it comes), and
//! [`GptRef::generate`], its reference: every step runs the whole prefix through the evaluation
//! forward ([`GptRef::logits`]), no cache. Both draw the token at position `i` of sequence `j`
//! from row `j` of the Philox stream `(seed, i)` ([`SamplingConfig::sample`]), so they agree
//! token for token wherever their logits do.

use super::{GptRef, KvCache};
use crate::generate::decode::{generate, Decoder};
use crate::generate::SamplingConfig;
use te_runtime::Result;

/// The model's context as a limit, for messages.
fn context_room(model: &GptRef) -> (usize, String) {
    let context = model.config().seq_length;
    (context, format!("the model's context of {context} (seq_length)"))
}

/// The reference decoder: the whole prefix through [`GptRef::logits`] at every step.
struct FullPrefix<'a> {
    model: &'a GptRef,
    /// `[s, b]` row-major so far.
    ids: Vec<i32>,
    batch: usize,
}

impl Decoder for FullPrefix<'_> {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }
    fn capacity(&self) -> (usize, String) {
        context_room(self.model)
    }
    fn batch(&self) -> Option<usize> {
        None
    }
    fn prefill(&mut self, ids: &[i32], _: usize, batch: usize) -> Result<Vec<f32>> {
        (self.ids, self.batch) = (ids.to_vec(), batch);
        self.last_logits()
    }
    fn step(&mut self, next: &[i32], _: usize) -> Result<Vec<f32>> {
        self.ids.extend_from_slice(next);
        self.last_logits()
    }
}

impl FullPrefix<'_> {
    fn last_logits(&self) -> Result<Vec<f32>> {
        let (b, v) = (self.batch, self.model.config().vocab_size);
        let s = self.ids.len() / b;
        let logits = self.model.logits(&self.ids, s, b)?;
        Ok(logits[(s - 1) * b * v..].to_vec())
    }
}

/// The cached decoder: [`GptRef::forward_cached`] over a [`KvCache`].
struct Cached<'a> {
    model: &'a GptRef,
    cache: &'a mut KvCache,
}

impl Decoder for Cached<'_> {
    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }
    fn capacity(&self) -> (usize, String) {
        let capacity = self.cache.capacity();
        if capacity < self.model.config().seq_length {
            (capacity, format!("the KV cache's {capacity} positions"))
        } else {
            context_room(self.model)
        }
    }
    fn batch(&self) -> Option<usize> {
        Some(self.cache.batch())
    }
    fn prefill(&mut self, ids: &[i32], len: usize, _: usize) -> Result<Vec<f32>> {
        self.cache.clear();
        self.model.forward_cached(self.cache, ids, len)
    }
    fn step(&mut self, next: &[i32], _: usize) -> Result<Vec<f32>> {
        self.model.forward_cached(self.cache, next, 1)
    }
}

impl GptRef {
    /// Continues each prompt of `prompts` (token ids, all of one length ≥ 1) by `max_new_tokens`
    /// tokens drawn with `sampling` (see the module docs), without a cache: the reference of
    /// [`GptRef::generate_cached`]. Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// [`te_runtime::Error::Shape`] for no prompt, an empty prompt, prompts of different lengths, or a
    /// prompt plus `max_new_tokens` longer than the model's context (`seq_length`: its position
    /// table); [`te_runtime::Error::Argument`] for an id outside the vocabulary and the sampler's
    /// errors.
    pub fn generate(
        &self,
        prompts: &[Vec<i32>],
        max_new_tokens: usize,
        sampling: &SamplingConfig,
        seed: u64,
    ) -> Result<Vec<Vec<i32>>> {
        let mut decoder = FullPrefix { model: self, ids: Vec::new(), batch: 1 };
        generate(&mut decoder, prompts, max_new_tokens, sampling, seed, &mut |_, _| Ok(()))
    }

    /// Continues each prompt of `prompts` by `max_new_tokens` tokens as [`GptRef::generate`]
    /// does, over `cache` (cleared first; its batch must be `prompts.len()`): the prompts in one
    /// prefill, then one token per sequence per step. `on_tokens(i, next)` gets the `i`-th new
    /// token of every sequence as soon as it is drawn (`i = 0` right after the prefill); an
    /// error it returns ends the generation. Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// As [`GptRef::generate`], with the cache's capacity in place of the context;
    /// [`te_runtime::Error::Shape`] for a cache of another batch or model; `on_tokens`' errors.
    pub fn generate_cached(
        &self,
        cache: &mut KvCache,
        prompts: &[Vec<i32>],
        max_new_tokens: usize,
        sampling: &SamplingConfig,
        seed: u64,
        mut on_tokens: impl FnMut(usize, &[i32]) -> Result<()>,
    ) -> Result<Vec<Vec<i32>>> {
        let mut decoder = Cached { model: self, cache };
        generate(&mut decoder, prompts, max_new_tokens, sampling, seed, &mut on_tokens)
    }
}

#[cfg(test)]
mod tests {
    use crate::cpu::gpt::GptRef;
    use crate::generate::SamplingConfig;
    use crate::gpt::GptConfig;
    use te_runtime::Error;

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
        let err = |r: te_runtime::Result<Vec<Vec<i32>>>| r.unwrap_err().to_string();
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
