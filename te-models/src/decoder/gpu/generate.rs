//! Generation and perplexity on [`Decoder`], and its [`CausalLm`] implementation: the same
//! conventions as the CPU twin ([`crate::cpu::decoder::DecoderRef`]): prompts of any lengths in
//! one prefill, one token per unfinished sequence per step, each drawn by
//! [`crate::generate::SamplingConfig`] from the Philox stream `(seed, position)` row `j` (greedy
//! picks on the device, `ops::argmax`), EOS ending a sequence; the prefill eager or replayed
//! from its length bucket's CUDA graph ([`super::PrefillGraphs`]), the decode steps replayed from a
//! CUDA graph; perplexity with transformers' sliding windows, the loss from the fused
//! cross-entropy kernel (or on the host when the model soft-caps its logits).

use super::cache::{self, DecodeTables};
use super::{Decoder, DecoderCache};
use crate::decoder::lm::{check_prompts, windowed_perplexity};
use crate::decoder::{CausalLm, DecodeOptions, DecoderConfig, DecoderError, DecoderResult, Perplexity};
use crate::gpt::IGNORE_INDEX;
use te_runtime::graph::{Graph, HostCopies};
use te_runtime::ops::argmax::argmax;
use te_runtime::ops::cross_entropy::cross_entropy;
use te_runtime::Tensor;

/// The decode steps of one generation: their tables, the captured graph with its logits, the
/// eager steps run, whether the capture failed.
struct DecodeSteps {
    tables: Option<DecodeTables>,
    graph: Option<(Graph, Tensor)>,
    eager: usize,
    failed: bool,
}

/// Rows of logits computed at once in perplexity.
const ROWS: usize = 512;

impl Decoder {
    /// Continues each prompt (see [`CausalLm::generate`]).
    ///
    /// # Errors
    /// As [`CausalLm::generate`].
    pub fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        on_token: &mut dyn FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>> {
        check_prompts(prompts, opts)?;
        self.check_ids(prompts)?;
        if opts.max_new_tokens == 0 {
            return Ok(vec![Vec::new(); prompts.len()]);
        }
        let capacity = prompts.iter().map(Vec::len).max().unwrap_or(1) + opts.max_new_tokens;
        self.graph_fallback = None;
        // The prefill: the logits of the last position of each prompt.
        let (mut held, logits) = self.prefill(prompts, capacity)?;
        let out = self.decode_all(held.cache_mut(), prompts, opts, logits, on_token);
        // A prefill graph's cache goes back to the decoder (with its graphs) for the next call.
        self.restore(held);
        out
    }

    /// The decode loop of [`Decoder::generate`] after the prefill left the prompts in `cache`
    /// and the logits `[batch, vocab]` of their last positions in `logits_dev`.
    fn decode_all(
        &mut self,
        cache: &mut DecoderCache,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        mut logits_dev: Tensor,
        on_token: &mut dyn FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>> {
        let b = prompts.len();
        let mut out: Vec<Vec<i32>> = vec![Vec::with_capacity(opts.max_new_tokens); b];
        let eos: Vec<i32> = self.cfg.eos_token_ids.iter().map(|&e| e as i32).collect();
        let mut active = vec![true; b];
        let v = self.cfg.vocab_size;
        let mut steps = DecodeSteps { tables: None, graph: None, eager: 0, failed: false };
        // Greedy decoding picks on the device (one i32 a sequence comes back, not its 262k
        // logits); soft-capping is monotonic, so it does not change the pick.
        let greedy = opts.sampling.temperature == 0.0;
        for step in 0..opts.max_new_tokens {
            let (logits, picks) = if greedy {
                (Vec::new(), self.argmax_rows(&logits_dev)?)
            } else {
                let mut logits = logits_dev.to_f32(&self.dev)?;
                self.softcap(&mut logits);
                (logits, Vec::new())
            };
            let mut next = Vec::with_capacity(b);
            for j in 0..b {
                // Finished sequences keep stepping with their last token (their draws unused), so
                // every step is one token per sequence: the decode kernels' shape, one graph.
                let prev = *out[j].last().unwrap_or(&prompts[j][prompts[j].len() - 1]);
                if !active[j] {
                    next.push(prev);
                    continue;
                }
                let position = prompts[j].len() + out[j].len();
                let token = if greedy {
                    match picks[j] {
                        -1 => {
                            return Err(DecoderError::input(format!(
                                "sequence {j}: a logit at position {position} is NaN: the model's output is not finite"
                            )))
                        }
                        t => t,
                    }
                } else {
                    opts.sampling.sample(&logits[j * v..(j + 1) * v], opts.seed, position as u64, j as u64)? as i32
                };
                out[j].push(token);
                on_token(j, token)?;
                if opts.stop_at_eos && eos.contains(&token) {
                    active[j] = false;
                }
                next.push(token);
            }
            if step + 1 == opts.max_new_tokens || !active.contains(&true) {
                break;
            }
            logits_dev = self.decode_step(cache, &mut steps, &next)?;
        }
        Ok(out)
    }

    /// One decode step outside [`Decoder::generate`] (llama.cpp's `llama_decode` of one token a
    /// sequence): `next[j]` appended to sequence `j` of `cache` through the path `generate`'s
    /// steps take (the fused GEMVs unless [`Decoder::set_fused_decode`] turned them off; eager,
    /// no graph). Returns the logits `[batch, vocab]` f32 on the host, soft-capped.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for another number of tokens than the cache's batch, an id
    /// outside the vocabulary, a full cache; the device's errors.
    pub fn step_logits(&mut self, cache: &mut DecoderCache, next: &[i32]) -> DecoderResult<Vec<f32>> {
        if next.len() != cache.batch() {
            return Err(DecoderError::input(format!(
                "{} tokens for a cache of batch {}: a decode step takes one token a sequence",
                next.len(),
                cache.batch()
            )));
        }
        self.check_ids(&[next])?;
        cache.make_room(&self.dev, &vec![1; next.len()])?;
        let mut tables = DecodeTables::new(&self.dev, cache, next)?;
        let logits = self.decode_logits(cache, &mut tables)?;
        cache::advance(cache, &vec![1; next.len()]);
        let mut out = logits.to_f32(&self.dev)?;
        self.softcap(&mut out);
        Ok(out)
    }

    /// Each row's argmax of `logits: [rows, vocab]` on the device (`-1` for a row with a NaN).
    fn argmax_rows(&self, logits: &Tensor) -> DecoderResult<Vec<i32>> {
        let stream = self.dev.stream();
        let rows = logits.shape()[0];
        // SAFETY: i32 has no invalid bit patterns; the kernel writes one value a row.
        let mut out = unsafe { stream.alloc::<i32>(rows) }.map_err(te_runtime::Error::from)?;
        argmax(&self.dev, logits, &mut out)?;
        Ok(stream.dtoh(&out)?)
    }

    /// One decode step of the tokens `next` (one per sequence): eagerly the first time (it loads
    /// every kernel and picks every GEMM algorithm), captured into a CUDA graph the second time,
    /// replayed after (when [`Decoder::set_cuda_graph`] is on; a capture that fails falls back
    /// to eager steps and says why in [`Decoder::graph_fallback`]). Returns the logits `[batch,
    /// vocab]`, valid until the next step.
    fn decode_step(
        &mut self,
        cache: &mut DecoderCache,
        steps: &mut DecodeSteps,
        next: &[i32],
    ) -> DecoderResult<Tensor> {
        // Outside any capture: a sliding-window layer's rows may move to the front here.
        cache.make_room(&self.dev, &vec![1; next.len()])?;
        match &mut steps.tables {
            Some(t) => t.update(&self.dev, cache, next)?,
            None => steps.tables = Some(DecodeTables::new(&self.dev, cache, next)?),
        }
        let Some(tables) = steps.tables.as_mut() else {
            return Err(DecoderError::input("no decode tables"));
        };
        let logits = match &steps.graph {
            Some((graph, logits)) => {
                graph.replay()?;
                logits.clone()
            }
            None if self.cuda_graph && steps.eager > 0 && !steps.failed => {
                let dev = self.dev.clone();
                let captured = Graph::capture(&dev, || {
                    self.decode_logits(cache, tables).map_err(|e| match e {
                        DecoderError::Runtime(e) => e,
                        other => te_runtime::Error::internal("Decoder::decode_step", other.to_string()),
                    })
                });
                match captured {
                    Ok((graph, logits)) => {
                        graph.replay()?;
                        steps.graph = Some((graph, logits.clone()));
                        logits
                    }
                    Err(e) => {
                        steps.failed = true;
                        self.note_fallback(format!("decode step: {e}"));
                        self.decode_logits(cache, tables)?
                    }
                }
            }
            None => {
                steps.eager += 1;
                self.decode_logits(cache, tables)?
            }
        };
        cache::advance(cache, &vec![1; next.len()]);
        Ok(logits)
    }

    /// The perplexity of `tokens` (see [`CausalLm::perplexity`]).
    ///
    /// # Errors
    /// As [`CausalLm::perplexity`].
    pub fn perplexity(&mut self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity> {
        self.check_ids(&[tokens])?;
        let mut cache = self.cache(1, max_length.min(tokens.len()).max(1))?;
        windowed_perplexity(tokens, (max_length, stride), |window, rows| {
            cache.clear();
            let hidden = self.forward_step(&mut cache, &[window])?;
            let mut total = 0.0;
            for r0 in rows.clone().step_by(ROWS) {
                let r1 = (r0 + ROWS).min(rows.end);
                let logits = self.head(&self.gather_rows(&hidden, &(r0..r1).collect::<Vec<_>>())?)?;
                total += self.loss_sum(&logits, &window[r0 + 1..r1 + 1])?;
            }
            Ok(total)
        })
    }

    /// Σ of the per-token cross-entropy of `logits: [rows, vocab]` against `targets`: the fused
    /// kernel, or the host reference after soft-capping when the model caps its logits.
    fn loss_sum(&self, logits: &Tensor, targets: &[i32]) -> DecoderResult<f64> {
        if self.cfg.final_logit_softcapping.is_some() {
            let mut host = logits.to_f32(&self.dev)?;
            self.softcap(&mut host);
            let (loss, _) =
                te_reference::cross_entropy::cross_entropy(&host, self.cfg.vocab_size, targets, IGNORE_INDEX, 0.0);
            return Ok(loss.iter().map(|&l| f64::from(l)).sum());
        }
        let stream = self.dev.stream();
        let targets_dev = stream.htod(targets)?;
        // SAFETY: f32 has no invalid bit patterns; the kernel writes one loss per row.
        let mut loss = unsafe { stream.alloc::<f32>(targets.len()) }.map_err(te_runtime::Error::from)?;
        cross_entropy(&self.dev, logits, &targets_dev, IGNORE_INDEX, &mut loss, None)?;
        Ok(stream.dtoh(&loss)?.iter().map(|&l| f64::from(l)).sum())
    }
}

impl CausalLm for Decoder {
    fn config(&self) -> &DecoderConfig {
        Decoder::config(self)
    }

    fn describe(&self) -> String {
        format!("{} (GPU), {}", self.dev.name(), self.precision.describe())
    }

    fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        on_token: &mut dyn FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>> {
        Decoder::generate(self, prompts, opts, on_token)
    }

    fn perplexity(&mut self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity> {
        Decoder::perplexity(self, tokens, max_length, stride)
    }
}
