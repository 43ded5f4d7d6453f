//! Generation on [`DecoderRef`]: the prompts (of any lengths, packed without padding) in one
//! prefill over a [`super::DecoderKvCache`], then one token per unfinished sequence per step,
//! each drawn with [`SamplingConfig`] (greedy, temperature, top-k, top-p) from the logits of its
//! last position. The token at position `p` of sequence `j` comes from row `j` of the Philox
//! stream `(seed, p)` ([`SamplingConfig::sample`]), the convention of
//! [`crate::generate::decode`]; a sequence whose token is an end-of-sequence id of the
//! configuration stops there (the EOS is its last token) while the others go on.

use super::DecoderRef;
use crate::decoder::lm::check_prompts;
use crate::decoder::DecodeOptions;
use crate::decoder::DecoderResult;

impl DecoderRef {
    /// Continues each prompt of `prompts` (token ids, any lengths ≥ 1; a BOS is the caller's to
    /// put first) by up to `opts.max_new_tokens` tokens (see the module docs).
    /// `on_token(j, token)` gets each new token of sequence `j` as soon as it is drawn; an error
    /// it returns ends the generation. Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// [`crate::decoder::DecoderError::Input`] for no prompt, an empty one or an id outside the vocabulary;
    /// [`crate::decoder::DecoderError::Runtime`] for bad sampling settings; `on_token`'s errors.
    pub fn generate(
        &self,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        mut on_token: impl FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>> {
        check_prompts(prompts, opts)?;
        let b = prompts.len();
        let mut out: Vec<Vec<i32>> = vec![Vec::with_capacity(opts.max_new_tokens); b];
        if opts.max_new_tokens == 0 {
            return Ok(out);
        }
        let eos = &self.config().eos_token_ids;
        let mut cache = self.kv_cache(b);
        let mut logits = self.forward_cached(&mut cache, prompts)?;
        let mut active = vec![true; b];
        for step in 0..opts.max_new_tokens {
            let mut next: Vec<Vec<i32>> = vec![Vec::new(); b];
            for j in 0..b {
                if !active[j] {
                    continue;
                }
                let position = prompts[j].len() + out[j].len();
                let token = opts.sampling.sample(&logits[j], opts.seed, position as u64, j as u64)? as i32;
                out[j].push(token);
                on_token(j, token)?;
                if opts.stop_at_eos && eos.iter().any(|&e| e as i32 == token) {
                    active[j] = false;
                } else {
                    next[j].push(token);
                }
            }
            if step + 1 == opts.max_new_tokens || !active.contains(&true) {
                break;
            }
            logits = self.forward_cached(&mut cache, &next)?;
        }
        Ok(out)
    }
}
