//! Perplexity on [`DecoderRef`]: the teacher-forced mean negative log-likelihood of a token
//! sequence, with transformers' recipe for a text longer than the model's window ("Perplexity of
//! fixed-length models"): windows of at most `max_length` tokens starting every `stride` tokens,
//! each scoring only the tokens no earlier window scored, with the window's earlier tokens as
//! their context. The losses are [`te_reference::cross_entropy`]'s, summed in f64; the LM head
//! runs on blocks of rows, so the logits of a whole window are never held at once.

use super::DecoderRef;
use crate::decoder::{DecoderError, DecoderResult, Perplexity};
use crate::gpt::IGNORE_INDEX;

/// Rows of logits computed at once.
const ROWS: usize = 32;

impl DecoderRef {
    /// The perplexity of `tokens` (see the module docs): each token is scored at most once,
    /// from at most `max_length − 1` tokens of context; windows start every `stride` tokens
    /// (`stride = max_length`: disjoint windows, the fastest, whose first tokens are not scored;
    /// a smaller stride gives each token more context). A text of at most `max_length` tokens is
    /// one window: every token but the first is scored.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for fewer than 2 tokens, `max_length < 2`, a `stride` of 0 or
    /// above `max_length`, or an id outside the vocabulary.
    pub fn perplexity(&self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity> {
        if tokens.len() < 2 {
            return Err(DecoderError::input("perplexity needs at least 2 tokens (the first is never scored)"));
        }
        if max_length < 2 || stride == 0 || stride > max_length {
            return Err(DecoderError::input(format!(
                "perplexity needs max_length ≥ 2 and 1 ≤ stride ≤ max_length, got max_length {max_length}, stride \
                 {stride}"
            )));
        }
        self.check_ids(&[tokens])?;
        let (h, v) = (self.config().hidden_size, self.config().vocab_size);
        let (mut total, mut scored, mut prev_end) = (0.0f64, 0usize, 1usize);
        let mut begin = 0;
        loop {
            let end = (begin + max_length).min(tokens.len());
            let window = &tokens[begin..end];
            let mut cache = self.kv_cache(1);
            let hidden = self.hidden(&mut cache, &[window])?;
            // Window row r predicts token begin + r + 1; score the tokens prev_end..end that have
            // context in the window (not the window's first token).
            let first_row = prev_end.max(begin + 1) - begin - 1;
            for r0 in (first_row..window.len() - 1).step_by(ROWS) {
                let r1 = (r0 + ROWS).min(window.len() - 1);
                let logits = self.head(&hidden[r0 * h..r1 * h], r1 - r0);
                let targets = &tokens[begin + r0 + 1..begin + r1 + 1];
                let (loss, _) = te_reference::cross_entropy::cross_entropy(&logits, v, targets, IGNORE_INDEX, 0.0);
                total += loss.iter().map(|&l| f64::from(l)).sum::<f64>();
                scored += r1 - r0;
            }
            prev_end = end;
            if end == tokens.len() {
                break;
            }
            begin += stride;
        }
        let mean_nll = total / scored as f64;
        Ok(Perplexity { mean_nll, perplexity: mean_nll.exp(), tokens: scored })
    }
}
