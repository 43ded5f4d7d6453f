//! [`CausalLm`]: what `te generate --model` and `te eval --model` need of a decoder, whichever
//! device runs it — the CPU model ([`crate::cpu::decoder::DecoderRef`]) or the GPU one.

use super::{DecoderConfig, DecoderError, DecoderResult};
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

/// transformers' perplexity recipe for a text longer than the model's window ("Perplexity of
/// fixed-length models"), shared by the CPU and GPU models: windows of at most `max_length`
/// tokens starting every `stride` tokens, each scoring only the tokens no earlier window scored,
/// with the window's earlier tokens as their context. `score(window, rows)` runs the model on
/// `window` (from position 0) and returns the Σ of the negative log-likelihoods (nats, f64) of
/// window rows `rows` (row `r` predicts `window[r + 1]`).
///
/// # Errors
/// [`DecoderError::Input`] for fewer than 2 tokens, `max_length < 2`, a `stride` of 0 or above
/// `max_length`; `score`'s errors.
pub(crate) fn windowed_perplexity<F>(
    tokens: &[i32],
    (max_length, stride): (usize, usize),
    mut score: F,
) -> DecoderResult<Perplexity>
where
    F: FnMut(&[i32], std::ops::Range<usize>) -> DecoderResult<f64>,
{
    if tokens.len() < 2 {
        return Err(DecoderError::input("perplexity needs at least 2 tokens (the first is never scored)"));
    }
    if max_length < 2 || stride == 0 || stride > max_length {
        return Err(DecoderError::input(format!(
            "perplexity needs max_length ≥ 2 and 1 ≤ stride ≤ max_length, got max_length {max_length}, stride {stride}"
        )));
    }
    let (mut total, mut scored, mut prev_end) = (0.0f64, 0usize, 1usize);
    let mut begin = 0;
    loop {
        let end = (begin + max_length).min(tokens.len());
        let window = &tokens[begin..end];
        // Score the tokens prev_end..end that have context in the window (not its first token).
        let first_row = prev_end.max(begin + 1) - begin - 1;
        total += score(window, first_row..window.len() - 1)?;
        scored += window.len() - 1 - first_row;
        prev_end = end;
        if end == tokens.len() {
            break;
        }
        begin += stride;
    }
    let mean_nll = total / scored as f64;
    Ok(Perplexity { mean_nll, perplexity: mean_nll.exp(), tokens: scored })
}

/// The checks every [`CausalLm::generate`] makes first: the sampling settings, at least one
/// prompt, no empty prompt.
///
/// # Errors
/// [`DecoderError::Runtime`] for bad sampling settings; [`DecoderError::Input`] for no prompt or
/// an empty one.
pub(crate) fn check_prompts(prompts: &[Vec<i32>], opts: &DecodeOptions) -> DecoderResult<()> {
    opts.sampling.validate()?;
    if prompts.is_empty() {
        return Err(DecoderError::input("no prompt: generation needs a batch of at least one"));
    }
    if let Some(j) = prompts.iter().position(Vec::is_empty) {
        return Err(DecoderError::input(format!("prompt {j} is empty: give at least one token (e.g. BOS)")));
    }
    Ok(())
}
