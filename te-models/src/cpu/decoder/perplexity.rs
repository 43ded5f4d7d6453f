//! Perplexity on [`DecoderRef`]: the teacher-forced mean negative log-likelihood of a token
//! sequence, with transformers' recipe for a text longer than the model's window ("Perplexity of
//! fixed-length models"): windows of at most `max_length` tokens starting every `stride` tokens,
//! each scoring only the tokens no earlier window scored, with the window's earlier tokens as
//! their context. The losses are [`te_reference::cross_entropy`]'s, summed in f64; the LM head
//! runs on blocks of rows, so the logits of a whole window are never held at once.

use super::DecoderRef;
use crate::decoder::lm::windowed_perplexity;
use crate::decoder::{DecoderResult, Perplexity};
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
    /// [`crate::decoder::DecoderError::Input`] for fewer than 2 tokens, `max_length < 2`, a `stride` of 0 or
    /// above `max_length`, or an id outside the vocabulary.
    pub fn perplexity(&self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity> {
        self.check_ids(&[tokens])?;
        let (h, v) = (self.config().hidden_size, self.config().vocab_size);
        windowed_perplexity(tokens, (max_length, stride), |window, rows| {
            let mut cache = self.kv_cache(1);
            let hidden = self.hidden(&mut cache, &[window])?;
            let mut total = 0.0;
            for r0 in rows.clone().step_by(ROWS) {
                let r1 = (r0 + ROWS).min(rows.end);
                let logits = self.head(&hidden[r0 * h..r1 * h], r1 - r0);
                let (loss, _) =
                    te_reference::cross_entropy::cross_entropy(&logits, v, &window[r0 + 1..r1 + 1], IGNORE_INDEX, 0.0);
                total += loss.iter().map(|&l| f64::from(l)).sum::<f64>();
            }
            Ok(total)
        })
    }
}
