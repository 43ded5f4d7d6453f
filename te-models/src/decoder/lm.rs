//! [`CausalLm`]: what `te generate --model` and `te eval --model` need of a decoder, whichever
//! device runs it — the CPU model ([`crate::cpu::decoder::DecoderRef`]) or the GPU one.

use super::{DecoderConfig, DecoderResult};
use crate::generate::SamplingConfig;

/// How [`CausalLm::generate`] continues the prompts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeOptions {
    /// New tokens per sequence at most.
    pub max_new_tokens: usize,
    /// How each token is drawn.
    pub sampling: SamplingConfig,
    /// The Philox stream of the draws.
    pub seed: u64,
    /// Stop a sequence at an end-of-sequence token of the configuration (`eos_token_ids`).
    pub stop_at_eos: bool,
}

impl DecodeOptions {
    /// Greedy decoding of up to `max_new_tokens` tokens, stopping at EOS.
    pub fn greedy(max_new_tokens: usize) -> Self {
        Self { max_new_tokens, sampling: SamplingConfig::greedy(), seed: 0, stop_at_eos: true }
    }
}

/// The result of [`CausalLm::perplexity`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Perplexity {
    /// Mean negative log-likelihood per scored token (nats).
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Tokens scored: every token but the first, and but the first of each window when windows
    /// are disjoint (`stride = max_length`: such a token has no context in its window).
    pub tokens: usize,
}

/// A causal language model of the decoder family that generates and scores token ids.
///
/// Token ids are `i32` (the embedding's row indices, `0 ≤ id < vocab_size`); a BOS is the
/// caller's to put first (the tokenizer's `encode(text, add_bos)`).
pub trait CausalLm {
    /// The configuration.
    fn config(&self) -> &DecoderConfig;

    /// Where and how it runs, for logs (`"CPU, f32"`, `"NVIDIA H100 …, bf16"`).
    fn describe(&self) -> String;

    /// Continues each prompt of `prompts` (token ids, any lengths ≥ 1, batched without padding
    /// semantics: a sequence's tokens do not depend on the others) by up to
    /// `opts.max_new_tokens` tokens. `on_token(j, token)` gets each new token of sequence `j` as
    /// soon as it is drawn; an error it returns ends the generation. Returns the new tokens of
    /// each prompt (ending with its EOS where one stopped it).
    ///
    /// # Errors
    /// [`super::DecoderError::Input`] for no prompt, an empty one, an id outside the vocabulary
    /// or a prompt plus `max_new_tokens` beyond what the model takes; bad sampling settings;
    /// the device's errors; `on_token`'s errors.
    fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        on_token: &mut dyn FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>>;

    /// The perplexity of `tokens`: windows of at most `max_length` tokens every `stride` tokens,
    /// each token scored once (transformers' "Perplexity of fixed-length models" recipe; see
    /// [`crate::cpu::decoder::DecoderRef::perplexity`]).
    ///
    /// # Errors
    /// [`super::DecoderError::Input`] for fewer than 2 tokens, `max_length < 2`, a `stride` of 0
    /// or above `max_length`, an id outside the vocabulary; the device's errors.
    fn perplexity(&mut self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity>;
}
