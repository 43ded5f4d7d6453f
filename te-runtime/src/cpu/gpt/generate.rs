//! Text generation on the CPU GPT: the reference of `te generate`'s decode loop. Every step runs
//! the whole prefix through the evaluation forward ([`GptRef::logits`]) and draws the next token
//! from the last position's logits: no KV cache, so it is what a cached decode must reproduce.

use super::{GptRef, MODEL};
use crate::generate::SamplingConfig;
use crate::{Error, Result};

impl GptRef {
    /// Continues each prompt of `prompts` (token ids, all of one length ≥ 1) by `max_new_tokens`
    /// tokens drawn with `sampling`: the token at position `i` of sequence `j` from row `j` of
    /// the Philox stream `(seed, i)` ([`SamplingConfig::sample`]), so that greedy decoding and
    /// a given seed give the same tokens every time. Returns the new tokens of each prompt.
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
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        sampling.validate()?;
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
        let context = self.config().seq_length;
        if len + max_new_tokens > context {
            return shape(format!(
                "a prompt of {len} tokens and {max_new_tokens} new ones exceed the model's context of {context} \
                 (seq_length): shorten the prompt or ask for fewer tokens"
            ));
        }
        let b = prompts.len();
        let mut seqs: Vec<Vec<i32>> = prompts.to_vec();
        for _ in 0..max_new_tokens {
            let s = seqs[0].len();
            // [s, b] row-major: token i·b + j is position i of sequence j.
            let ids: Vec<i32> = (0..s * b).map(|t| seqs[t % b][t / b]).collect();
            let logits = self.logits(&ids, s, b)?;
            let v = self.config().vocab_size;
            for (j, seq) in seqs.iter_mut().enumerate() {
                let row = &logits[((s - 1) * b + j) * v..][..v];
                let next = sampling.sample(row, seed, s as u64, j as u64)?;
                seq.push(next as i32);
            }
        }
        Ok(seqs.into_iter().map(|s| s[len..].to_vec()).collect())
    }
}
