//! Generation with the GPU GPT: the cached forward of a step ([`Gpt::forward_cached`] over
//! [`InferenceParams`], TE's `inference_params`) and [`Gpt::generate`], the decode loop of
//! [`crate::generate::decode`] on it: the prompt in one prefill (the fused attention over the
//! prompt), then one token per sequence per step (the decode kernels over the cache), each step
//! replayed from a CUDA graph captured at the second one (the first is its warm-up: kernels
//! loaded, GEMM algorithms chosen). The step's token ids and positions are static inputs the
//! host refills before each replay, the cached lengths a device array ([`InferenceParams::
//! begin_step`]); the logits come back to the host for the sampler.

use super::{Gpt, MODEL};
use crate::generate::decode::{generate, Decoder};
use crate::generate::SamplingConfig;
use te_codegen::DType;
use te_nn::fp8::{fp8_autocast, Recipe};
use te_nn::modules::{InferenceParams, TokenIds};
use te_runtime::graph::{Graph, HostCopies};
use te_runtime::ops::argmax::argmax;
use te_runtime::ops::elementwise::add;
use te_runtime::{Error, Result, Tensor};

/// How [`Gpt::generate`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct GenerateOptions {
    /// The GEMMs in FP8 under this recipe (`fp8_autocast` around every step; every GEMM's token
    /// count, `batch` in a decode step, must then be a multiple of 16), or `None`: the model's
    /// precision.
    pub fp8: Option<Recipe>,
    /// Replay the decode steps from a CUDA graph (captured at the second step); `false`: every
    /// step issued eagerly.
    pub cuda_graph: bool,
}

impl Gpt {
    /// A KV cache for `batch` sequences of up to `capacity` tokens (prompt and new ones) of this
    /// model: per layer `[batch, capacity, heads, head_dim]` keys and values in the model's dtype.
    ///
    /// # Errors
    /// [`Error::Shape`] for a zero size or a capacity beyond the model's context (`seq_length`,
    /// its position table); [`InferenceParams::new`]'s errors (head dims the decode kernels do
    /// not take, an f32 model).
    pub fn inference_params(&self, batch: usize, capacity: usize) -> Result<InferenceParams> {
        self.cache(batch, capacity, self.cfg.params_dtype)
    }

    /// [`Gpt::inference_params`] with the keys and values stored as E4M3 codes (half the
    /// cache's bytes; per-tensor scales 1 until [`InferenceParams::set_kv_scales`]): the decode
    /// steps read them through `ops::decode_attention::decode_fp8`, the prompt's attention runs
    /// on its 16-bit keys and values.
    ///
    /// # Errors
    /// As [`Gpt::inference_params`].
    pub fn inference_params_fp8(&self, batch: usize, capacity: usize) -> Result<InferenceParams> {
        self.cache(batch, capacity, DType::E4M3)
    }

    /// A cache of `dtype` for `batch` sequences of `capacity` tokens.
    fn cache(&self, batch: usize, capacity: usize, dtype: DType) -> Result<InferenceParams> {
        let context = self.cfg.seq_length;
        if capacity > context {
            return Err(Error::Shape {
                op: MODEL,
                message: format!(
                    "a KV cache of {capacity} positions exceeds the model's context of {context} (seq_length)"
                ),
            });
        }
        let heads = self.cfg.num_attention_heads;
        let head_dim = self.cfg.hidden_size / heads.max(1);
        if !matches!(self.cfg.params_dtype, DType::BF16 | DType::F16) {
            return Err(Error::DType {
                op: MODEL,
                arg: "params_dtype",
                expected: "bf16 or f16 (the decode kernels' queries)".into(),
                got: self.cfg.params_dtype,
            });
        }
        InferenceParams::new(&self.dev, self.cfg.num_layers, batch, capacity, [heads, head_dim], dtype)
    }

    /// The forward of a generation step over `params` (a step of `s` tokens per sequence begun
    /// with [`InferenceParams::begin_step`]): token ids and positions `[s, b]` (row-major, token
    /// `i · b + j` of sequence `j`), every layer through `TransformerLayer::infer_cached`, the
    /// final norm and the LM head (in high precision unless `fp8_lm_head`, as in training).
    /// Returns the logits `[s · b, vocab]` in the model's dtype. Nothing is kept for backward;
    /// run it in evaluation mode (no dropout: [`Gpt::set_training`]).
    ///
    /// # Errors
    /// [`Error::Shape`] for ids that are not `[s, b]`, positions of another shape, a step not
    /// begun for `s` tokens of `b` sequences; the errors of the parts.
    pub fn forward_cached(
        &mut self,
        ids: &TokenIds,
        positions: &TokenIds,
        params: &mut InferenceParams,
    ) -> Result<Tensor> {
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        let &[s, b] = ids.shape() else {
            return shape(format!("ids must be [s, b], got {:?}", ids.shape()));
        };
        if positions.shape() != ids.shape() {
            return shape(format!("positions {:?} must have the ids' shape {:?}", positions.shape(), ids.shape()));
        }
        if params.pending() != s || params.batch() != b {
            return shape(format!(
                "ids [{s}, {b}] for a step of {} tokens of a cache of batch {}: begin_step(s) first, with the cache's \
                 batch",
                params.pending(),
                params.batch()
            ));
        }
        let h = self.cfg.hidden_size;
        let tok = self.embedding.infer(ids)?;
        let wpe = self.position_embedding.infer(positions)?;
        let mut x = Tensor::empty(&self.dev, self.cfg.params_dtype, &[s, b, h])?;
        add(&self.dev, &tok, &wpe, &mut x)?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            x = layer.infer_cached(&x, params.layer(l)?)?;
        }
        let y = self.final_norm.infer(&x)?.reshape(&[s * b, h])?;
        let lm_head = &mut self.lm_head;
        if self.cfg.fp8_lm_head {
            lm_head.infer(&y)
        } else {
            fp8_autocast(false, Recipe::default(), || lm_head.infer(&y))
        }
    }

    /// Continues each prompt of `prompts` (token ids, all of one length ≥ 1; `params.batch()` of
    /// them) by `max_new_tokens` tokens drawn with `sampling` from the Philox stream of `seed`,
    /// over `params` (reset first), as the CPU twin's `GptRef::generate_cached` draws them:
    /// `on_tokens(i, next)` gets the `i`-th new token of every sequence as soon as it is drawn.
    /// Returns the new tokens of each prompt.
    ///
    /// # Errors
    /// [`Error::Shape`] for no prompt, an empty prompt, prompts of different lengths or another
    /// number than the cache's batch, a prompt plus `max_new_tokens` beyond the cache's capacity;
    /// [`Error::Argument`] for ids outside the vocabulary; the sampler's, the model's and
    /// `on_tokens`' errors.
    pub fn generate(
        &mut self,
        params: &mut InferenceParams,
        prompts: &[Vec<i32>],
        max_new_tokens: usize,
        (sampling, seed): (&SamplingConfig, u64),
        options: GenerateOptions,
        mut on_tokens: impl FnMut(usize, &[i32]) -> Result<()>,
    ) -> Result<Vec<Vec<i32>>> {
        let v = self.cfg.vocab_size as i32;
        if let Some(t) = prompts.iter().flatten().find(|&&t| !(0..v).contains(&t)) {
            return Err(Error::Argument { op: MODEL, message: format!("token id {t} outside [0, {v})") });
        }
        let mut decoder = GpuDecoder { model: self, params, options, inputs: None, graph: None, eager_steps: 0 };
        generate(&mut decoder, prompts, max_new_tokens, sampling, seed, &mut on_tokens)
    }
}

/// The static inputs of a decode step: one token id and position per sequence.
struct StepInputs {
    ids: TokenIds,
    positions: TokenIds,
}

/// [`Gpt::generate`]'s [`Decoder`].
struct GpuDecoder<'a> {
    model: &'a mut Gpt,
    params: &'a mut InferenceParams,
    options: GenerateOptions,
    inputs: Option<StepInputs>,
    /// The captured decode step and its logits (valid after each replay).
    graph: Option<(Graph, Tensor)>,
    eager_steps: usize,
}

/// The cached forward under the options' precision.
fn run(
    model: &mut Gpt,
    ids: &TokenIds,
    positions: &TokenIds,
    params: &mut InferenceParams,
    fp8: Option<Recipe>,
) -> Result<Tensor> {
    match fp8 {
        Some(recipe) => fp8_autocast(true, recipe, || model.forward_cached(ids, positions, params)),
        None => model.forward_cached(ids, positions, params),
    }
}

impl Decoder for GpuDecoder<'_> {
    fn vocab_size(&self) -> usize {
        self.model.cfg.vocab_size
    }

    fn capacity(&self) -> (usize, String) {
        let (capacity, context) = (self.params.capacity(), self.model.cfg.seq_length);
        if capacity < context {
            (capacity, format!("the KV cache's {capacity} positions"))
        } else {
            (context, format!("the model's context of {context} (seq_length)"))
        }
    }

    fn batch(&self) -> Option<usize> {
        Some(self.params.batch())
    }

    fn prefill(&mut self, ids: &[i32], len: usize, b: usize) -> Result<Vec<f32>> {
        let logits = self.prefill_logits(ids, len, b)?;
        self.last_rows(&logits, b)
    }

    fn step(&mut self, next: &[i32], position: usize) -> Result<Vec<f32>> {
        let logits = self.step_logits(next, position)?;
        self.last_rows(&logits, next.len())
    }

    fn prefill_greedy(&mut self, ids: &[i32], len: usize, b: usize) -> Result<Vec<i32>> {
        let logits = self.prefill_logits(ids, len, b)?;
        self.picks(&logits, b)
    }

    fn step_greedy(&mut self, next: &[i32], position: usize) -> Result<Vec<i32>> {
        let logits = self.step_logits(next, position)?;
        self.picks(&logits, next.len())
    }
}

impl GpuDecoder<'_> {
    /// The logits of the last `b` rows, on the host as f32.
    fn last_rows(&self, logits: &Tensor, b: usize) -> Result<Vec<f32>> {
        let all = logits.to_f32(&self.model.dev)?;
        let v = self.model.cfg.vocab_size;
        Ok(all[all.len() - b * v..].to_vec())
    }

    /// The greedy picks of the last `b` rows of `logits`, chosen on the device (kernel family 21):
    /// one id a row comes to the host, not the row.
    fn picks(&self, logits: &Tensor, b: usize) -> Result<Vec<i32>> {
        let dev = &self.model.dev;
        let rows = logits.numel() / self.model.cfg.vocab_size.max(1);
        // SAFETY: i32 has no invalid bit patterns; the kernel writes one value a row.
        let mut out = unsafe { dev.stream().alloc::<i32>(rows) }?;
        argmax(dev, logits, &mut out)?;
        let picks = dev.stream().dtoh(&out)?;
        let last = &picks[rows - b..];
        if let Some(j) = last.iter().position(|&t| t < 0) {
            return Err(Error::Argument {
                op: MODEL,
                message: format!("sequence {j}: a logit is NaN: the model's output is not finite"),
            });
        }
        Ok(last.to_vec())
    }

    /// The prefill's logits `[len · b, vocab]` on the device.
    fn prefill_logits(&mut self, ids: &[i32], len: usize, b: usize) -> Result<Tensor> {
        self.params.reset();
        (self.graph, self.inputs, self.eager_steps) = (None, None, 0);
        let dev = self.model.dev.clone();
        let ids = TokenIds::from_host(&dev, &[len, b], ids)?;
        let positions: Vec<i32> = (0..len * b).map(|t| (t / b) as i32).collect();
        let positions = TokenIds::from_host(&dev, &[len, b], &positions)?;
        self.params.begin_step(len)?;
        let logits = run(self.model, &ids, &positions, self.params, self.options.fp8);
        self.params.end_step();
        logits
    }

    /// A decode step's logits `[b, vocab]` on the device (valid until the next step).
    fn step_logits(&mut self, next: &[i32], position: usize) -> Result<Tensor> {
        let dev = self.model.dev.clone();
        let b = next.len();
        let pos = vec![position as i32; b];
        let inputs = match &mut self.inputs {
            Some(i) => {
                i.ids.update(&dev, next)?;
                i.positions.update(&dev, &pos)?;
                i
            }
            None => self.inputs.insert(StepInputs {
                ids: TokenIds::from_host(&dev, &[1, b], next)?,
                positions: TokenIds::from_host(&dev, &[1, b], &pos)?,
            }),
        };
        self.params.begin_step(1)?;
        let fp8 = self.options.fp8;
        let logits = match &self.graph {
            Some((graph, logits)) => graph.replay().map(|()| logits.clone()),
            // The first decode step runs eagerly: it loads every kernel and chooses every GEMM
            // algorithm the capture needs.
            None if self.options.cuda_graph && self.eager_steps > 0 => {
                let (model, params) = (&mut *self.model, &mut *self.params);
                let captured = Graph::capture(&dev, || run(model, &inputs.ids, &inputs.positions, params, fp8));
                match captured {
                    Ok((graph, logits)) => {
                        let replayed = graph.replay().map(|()| logits.clone());
                        self.graph = Some((graph, logits));
                        replayed
                    }
                    Err(e) => Err(e),
                }
            }
            None => {
                self.eager_steps += 1;
                run(self.model, &inputs.ids, &inputs.positions, self.params, fp8)
            }
        };
        self.params.end_step();
        logits
    }
}
