//! The decode loop of text generation, for any model that decodes ([`Decoder`]): the prompts
//! in one prefill, then one token per sequence per step, each drawn with [`SamplingConfig`] from
//! the last position's logits and handed to a callback as soon as it is drawn. The CPU GPT (with
//! and without its KV cache) and the GPU GPT (eager or replaying a CUDA graph) run this same loop,
//! so they draw the same tokens wherever their logits agree: the token at position `i` of
//! sequence `j` comes from row `j` of the Philox stream `(seed, i)`.

use super::SamplingConfig;
use te_runtime::{Error, Result};

const OP: &str = "generate";

/// A model the decode loop drives: it keeps its sequences' state (a KV cache, or the prefix)
/// between calls.
pub trait Decoder {
    /// Logits per row.
    fn vocab_size(&self) -> usize;
    /// Tokens per sequence it can hold (prompt and new ones), and what that limit is, for
    /// messages: `"the model's context of 1024 (seq_length)"`, `"the KV cache's 300 positions"`.
    fn capacity(&self) -> (usize, String);
    /// Sequences per call it takes (`None`: any).
    fn batch(&self) -> Option<usize>;
    /// Starts new sequences from `ids` `[len, batch]` (row-major: token `i · batch + j` is
    /// position `i` of sequence `j`); returns the logits of the last position, `[batch, vocab]`.
    ///
    /// # Errors
    /// The model's errors.
    fn prefill(&mut self, ids: &[i32], len: usize, batch: usize) -> Result<Vec<f32>>;
    /// Appends one token per sequence (`next`, `[batch]`) at `position`; returns their logits,
    /// `[batch, vocab]`.
    ///
    /// # Errors
    /// The model's errors.
    fn step(&mut self, next: &[i32], position: usize) -> Result<Vec<f32>>;
    /// [`Decoder::prefill`] for greedy decoding: each sequence's token of the largest logit (the
    /// lowest id of ties), `[batch]`. By default the logits come to the host and are picked
    /// there; a GPU decoder picks on the device and sends one id a sequence.
    ///
    /// # Errors
    /// The model's errors; a logit that is NaN.
    fn prefill_greedy(&mut self, ids: &[i32], len: usize, batch: usize) -> Result<Vec<i32>> {
        let logits = self.prefill(ids, len, batch)?;
        sample_rows(&logits, self.vocab_size(), &SamplingConfig::greedy(), 0, len)
    }
    /// [`Decoder::step`] for greedy decoding, as [`Decoder::prefill_greedy`].
    ///
    /// # Errors
    /// As [`Decoder::prefill_greedy`].
    fn step_greedy(&mut self, next: &[i32], position: usize) -> Result<Vec<i32>> {
        let logits = self.step(next, position)?;
        sample_rows(&logits, self.vocab_size(), &SamplingConfig::greedy(), 0, position + 1)
    }
}

/// The checks of a generation: at least one prompt, all of one length ≥ 1, that length plus
/// `max_new_tokens` within `capacity` (described by `room`); returns the prompt length.
///
/// # Errors
/// [`Error::Shape`] saying which and what to change.
pub fn check_prompts(prompts: &[Vec<i32>], max_new_tokens: usize, (capacity, room): (usize, &str)) -> Result<usize> {
    let shape = |message: String| Err(Error::Shape { op: OP, message });
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
        return shape(format!(
            "a prompt of {len} tokens and {max_new_tokens} new ones exceed {room}: shorten the prompt or ask for fewer \
             tokens"
        ));
    }
    Ok(len)
}

/// The next token of each sequence from `logits` `[b, vocab]`, for position `position`.
///
/// # Errors
/// The sampler's errors.
pub fn sample_rows(
    logits: &[f32],
    vocab: usize,
    sampling: &SamplingConfig,
    seed: u64,
    position: usize,
) -> Result<Vec<i32>> {
    logits
        .chunks_exact(vocab.max(1))
        .enumerate()
        .map(|(j, row)| Ok(sampling.sample(row, seed, position as u64, j as u64)? as i32))
        .collect()
}

/// Continues each prompt of `prompts` (token ids, all of one length ≥ 1) by `max_new_tokens`
/// tokens drawn with `sampling` from the Philox stream of `seed`, through `decoder`: one
/// prefill, then `max_new_tokens − 1` steps. `on_tokens(i, next)` gets the `i`-th new token of
/// every sequence as soon as it is drawn (`i = 0` right after the prefill); an error it returns
/// ends the generation. Returns the new tokens of each prompt.
///
/// # Errors
/// [`Error::Shape`] for no prompt, an empty prompt, prompts of different lengths, a prompt plus
/// `max_new_tokens` beyond the decoder's capacity, or a batch the decoder does not take; the
/// sampler's errors (bad options); the decoder's and `on_tokens`' errors.
pub fn generate(
    decoder: &mut dyn Decoder,
    prompts: &[Vec<i32>],
    max_new_tokens: usize,
    sampling: &SamplingConfig,
    seed: u64,
    on_tokens: &mut dyn FnMut(usize, &[i32]) -> Result<()>,
) -> Result<Vec<Vec<i32>>> {
    sampling.validate()?;
    let (capacity, room) = decoder.capacity();
    let len = check_prompts(prompts, max_new_tokens, (capacity, &room))?;
    let b = prompts.len();
    if let Some(want) = decoder.batch().filter(|&w| w != b) {
        return Err(Error::Shape {
            op: OP,
            message: format!("{b} prompts and a KV cache of batch {want}: make the cache for the batch"),
        });
    }
    let mut out: Vec<Vec<i32>> = vec![Vec::with_capacity(max_new_tokens); b];
    if max_new_tokens == 0 {
        return Ok(out);
    }
    let vocab = decoder.vocab_size();
    let ids: Vec<i32> = (0..len * b).map(|t| prompts[t % b][t / b]).collect();
    // Greedy decoding lets the decoder pick (on the device, one id a sequence comes back).
    let greedy = sampling.temperature == 0.0;
    let mut next = if greedy {
        decoder.prefill_greedy(&ids, len, b)?
    } else {
        sample_rows(&decoder.prefill(&ids, len, b)?, vocab, sampling, seed, len)?
    };
    for i in 0..max_new_tokens {
        let position = len + i;
        on_tokens(i, &next)?;
        out.iter_mut().zip(&next).for_each(|(o, &t)| o.push(t));
        if i + 1 < max_new_tokens {
            next = if greedy {
                decoder.step_greedy(&next, position)?
            } else {
                sample_rows(&decoder.step(&next, position)?, vocab, sampling, seed, position + 1)?
            };
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A decoder whose logits favour `(last token + 1) mod vocab`: greedy decoding counts up.
    struct Counter {
        vocab: usize,
        calls: Vec<(usize, usize)>,
    }

    impl Counter {
        fn logits(&self, last: &[i32]) -> Vec<f32> {
            last.iter()
                .flat_map(|&t| (0..self.vocab).map(move |v| if v == (t as usize + 1) % 8 { 5.0 } else { 0.0 }))
                .collect()
        }
    }

    impl Decoder for Counter {
        fn vocab_size(&self) -> usize {
            self.vocab
        }
        fn capacity(&self) -> (usize, String) {
            (10, "the test's 10 positions".into())
        }
        fn batch(&self) -> Option<usize> {
            Some(2)
        }
        fn prefill(&mut self, ids: &[i32], len: usize, batch: usize) -> Result<Vec<f32>> {
            self.calls.push((len, batch));
            Ok(self.logits(&ids[(len - 1) * batch..]))
        }
        fn step(&mut self, next: &[i32], position: usize) -> Result<Vec<f32>> {
            self.calls.push((position, next.len()));
            Ok(self.logits(next))
        }
    }

    #[test]
    fn the_loop_prefills_then_steps_and_streams_each_token() {
        let mut d = Counter { vocab: 8, calls: Vec::new() };
        let mut seen = Vec::new();
        let got = generate(&mut d, &[vec![1, 2], vec![5, 6]], 4, &SamplingConfig::greedy(), 0, &mut |i, next| {
            seen.push((i, next.to_vec()));
            Ok(())
        })
        .unwrap();
        assert_eq!(got, [vec![3, 4, 5, 6], vec![7, 0, 1, 2]]);
        assert_eq!(d.calls, [(2, 2), (2, 2), (3, 2), (4, 2)], "prefill of 2, then steps at positions 2, 3, 4");
        assert_eq!(seen[0], (0, vec![3, 7]));
        assert_eq!(seen.len(), 4);
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        let mut d = Counter { vocab: 8, calls: Vec::new() };
        let g = SamplingConfig::greedy();
        let mut run =
            |prompts: &[Vec<i32>], n| generate(&mut d, prompts, n, &g, 0, &mut |_, _| Ok(())).unwrap_err().to_string();
        assert!(run(&[], 1).contains("no prompt"));
        assert!(run(&[vec![], vec![]], 1).contains("empty prompt"));
        assert!(run(&[vec![1], vec![1, 2]], 1).contains("one length"));
        assert!(run(&[vec![1; 6], vec![1; 6]], 5).contains("the test's 10 positions"));
        assert!(run(&[vec![1]], 1).contains("batch 2"));
        let bad = SamplingConfig { temperature: -1.0, ..g };
        assert!(generate(&mut d, &[vec![1], vec![1]], 1, &bad, 0, &mut |_, _| Ok(())).is_err());
        let stop = generate(&mut d, &[vec![1], vec![1]], 5, &g, 0, &mut |i, _| {
            if i == 2 {
                Err(Error::Argument { op: "test", message: "stop".into() })
            } else {
                Ok(())
            }
        });
        assert!(stop.unwrap_err().to_string().contains("stop"));
        assert_eq!(
            generate(&mut d, &[vec![1], vec![2]], 0, &g, 0, &mut |_, _| Ok(())).unwrap(),
            [vec![], vec![]] as [Vec<i32>; 2]
        );
    }
}
