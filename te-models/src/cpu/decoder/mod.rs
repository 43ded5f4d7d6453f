//! The CPU decoder of the Llama / Qwen / Gemma family ([`DecoderRef`]): the forward of
//! [`crate::decoder`]'s layer in f32 on the host, built from the per-kernel oracles of
//! [`te_reference`] (embedding lookup, [`NormRef`] norms, RoPE, attention with GQA, causal and
//! sliding-window masks through [`AttentionShape`](te_runtime::ops::attention_shape::AttentionShape), the activations, the f64-accumulated GEMM,
//! soft-capping), with a KV cache for generation ([`DecoderKvCache`]), the decode loop
//! ([`DecoderRef::generate`]) and perplexity ([`DecoderRef::perplexity`]).
//!
//! # Batches
//!
//! A batch is a list of sequences of any lengths, **packed without padding** (TE's `thd`
//! layout): the `T = Σ lenᵢ` tokens run through the embedding, norms and GEMMs as one `[T,
//! hidden]` matrix, sequence after sequence; RoPE and attention run per sequence at its own
//! positions. So prompts of different lengths need no padding and no padding mask, and a
//! sequence's logits do not depend on the others in its batch. Logits of a whole batch are
//! `[T, vocab]` in the same order ([`DecoderRef::logits`]).
//!
//! # Arithmetic
//!
//! Activations and accumulations are f32 (the oracles accumulate GEMMs, norms and attention in
//! f64 and round once). [`DecoderPrecision::Bf16`] rounds every GEMM input (weights once, at
//! construction; activations at each GEMM) to BF16 as the GPU reads them, and the embedding
//! multiplier to BF16 as transformers does for a BF16 model.
//!
//! Files: this one holds the model, its parameters and the forward; `cache` the KV cache;
//! `generate` the decode loop; `perplexity` the teacher-forced evaluation.

mod cache;
mod generate;
mod layer;
mod perplexity;
#[cfg(test)]
mod tests;

pub use crate::decoder::{DecodeOptions, Perplexity};
pub use cache::DecoderKvCache;

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult, DecoderWeights};
use layer::Layer;
use rayon::prelude::*;
use std::path::Path;
use te_codegen::DType;
use te_nn::fp8::{HostCast, Recipe};
use te_reference::modules::NormRef;
use te_runtime::numerics::round_to;

/// How the GEMMs read their inputs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum DecoderPrecision {
    /// f32 inputs (the model as stored, widened): the reference against transformers in f32.
    #[default]
    F32,
    /// Inputs rounded to BF16 (weights once, activations at each GEMM) and the embedding
    /// multiplier rounded to BF16: what the GPU's BF16 GEMMs read.
    Bf16,
    /// The GPU decoder's FP8 GEMMs emulated (`GpuPrecision::Fp8` without the FP8 LM head): every
    /// layer GEMM reads its BF16 weight and input cast as the recipe's quantizers cast them
    /// (`te_nn::fp8::ScalingRecipe::host_forward_casts`: current scaling's per-tensor amax,
    /// blockwise scaling's 1×128 tiles and 128×128 blocks); the embedding and the LM head stay
    /// BF16. Delayed scaling keeps amax histories across steps and is not emulated here.
    Fp8(Recipe),
}

impl DecoderPrecision {
    /// The dtype the GEMM inputs are rounded to (BF16 before any FP8 cast).
    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 | Self::Fp8(_) => DType::BF16,
        }
    }

    /// How a layer GEMM of `dims = [tokens, n_out, n_in]` reads its input and weight under FP8.
    fn fp8_casts(self, dims: [usize; 3]) -> Option<[HostCast; 2]> {
        match self {
            Self::Fp8(recipe) => Some(recipe.scaling().host_forward_casts(None, dims).0),
            _ => None,
        }
    }
}

/// A norm's parameters: `gamma` as stored (`γ − 1` under zero-centered gamma) and LayerNorm's
/// `beta`.
#[derive(Debug, Clone)]
struct Norm {
    gamma: Vec<f32>,
    beta: Option<Vec<f32>>,
}

/// A GEMM layer: `w` `[n_out, in]` (rounded to the precision) and an optional bias `[n_out]`.
#[derive(Debug, Clone)]
struct Dense {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    n_out: usize,
}

/// The CPU decoder (see the module docs).
#[derive(Debug, Clone)]
pub struct DecoderRef {
    cfg: DecoderConfig,
    precision: DecoderPrecision,
    /// `[vocab, hidden]` (rounded to the precision).
    embedding: Vec<f32>,
    layers: Vec<Layer>,
    final_norm: Norm,
    /// The LM head; `None` when tied to the embedding.
    lm_head: Option<Dense>,
}

/// Takes the parameter `name` out of `tensors`.
fn take(
    tensors: &mut std::collections::BTreeMap<String, crate::decoder::WeightTensor>,
    name: &str,
) -> DecoderResult<Vec<f32>> {
    tensors.remove(name).map(|t| t.data).ok_or_else(|| DecoderError::input(format!("parameter `{name}` is missing")))
}

impl DecoderRef {
    /// The model of `weights` (checked against their configuration when they were built).
    ///
    /// # Errors
    /// [`DecoderError::Input`] for a parameter the configuration needs that `weights` lacks
    /// (not for weights from [`DecoderWeights`]' constructors, which check them).
    pub fn new(weights: DecoderWeights, precision: DecoderPrecision) -> DecoderResult<Self> {
        let (cfg, mut t) = weights.into_parts();
        if let DecoderPrecision::Fp8(recipe) = precision {
            if recipe.scaling().host_state().is_some() {
                return Err(DecoderError::config(
                    "precision",
                    format!(
                        "{} keeps amax histories across steps: emulate FP8 inference with current or block scaling",
                        recipe.name()
                    ),
                ));
            }
        }
        let dtype = precision.dtype();
        let round = |mut v: Vec<f32>| {
            if dtype != DType::F32 {
                v.iter_mut().for_each(|x| *x = round_to(dtype, *x));
            }
            v
        };
        // A layer GEMM's weight `[n_out, n_in]`: rounded, then cast as the FP8 recipe casts it.
        let weight = |v: Vec<f32>, n_out: usize| match precision.fp8_casts([1, n_out, v.len() / n_out.max(1)]) {
            Some([_, w]) => w.apply(&round(v)),
            None => round(v),
        };
        let embedding = round(take(&mut t, "embedding.weight")?);
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            layers.push(Layer::take(&cfg, l, &mut t, &weight)?);
        }
        let final_norm = layer::take_final_norm(&cfg, &mut t)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            let w = round(take(&mut t, "lm_head.weight")?);
            Some(Dense { w, b: None, n_out: cfg.vocab_size })
        };
        Ok(Self { cfg, precision, embedding, layers, final_norm, lm_head })
    }

    /// Imports a Hugging Face directory ([`DecoderWeights::from_hf_dir`]) into a model.
    ///
    /// # Errors
    /// As [`DecoderWeights::from_hf_dir`].
    pub fn from_hf_dir(dir: &Path, precision: DecoderPrecision) -> DecoderResult<Self> {
        Self::new(DecoderWeights::from_hf_dir(dir)?, precision)
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// How the GEMMs read their inputs.
    pub fn precision(&self) -> DecoderPrecision {
        self.precision
    }

    fn norm<'a>(&self, n: &'a Norm) -> NormRef<'a> {
        NormRef {
            kind: self.cfg.normalization,
            gamma: &n.gamma,
            beta: n.beta.as_deref(),
            eps: self.cfg.layernorm_epsilon,
            zero_centered_gamma: self.cfg.zero_centered_gamma,
        }
    }

    /// `x [rows, n_in] · wᵀ + b` for `w` `[n_out, n_in]` through
    /// [`te_reference::gemm::gemm_tn`], `x` rounded to the precision first; the output features
    /// split over the rayon pool (each block is the oracle's own product, so the result does not
    /// depend on the split).
    fn gemm(&self, x: &[f32], rows: usize, w: &[f32], b: Option<&[f32]>, n_out: usize) -> Vec<f32> {
        self.gemm_cast(x, rows, (w, b, n_out), None)
    }

    /// [`DecoderRef::gemm`] with the input cast by `cast` after its rounding (a layer GEMM under
    /// FP8).
    fn gemm_cast(
        &self,
        x: &[f32],
        rows: usize,
        (w, b, n_out): (&[f32], Option<&[f32]>, usize),
        cast: Option<HostCast>,
    ) -> Vec<f32> {
        let dtype = self.precision.dtype();
        let mut xr: Vec<f32> =
            if dtype == DType::F32 { x.to_vec() } else { x.iter().map(|&v| round_to(dtype, v)).collect() };
        if let Some(c) = cast {
            xr = c.apply(&xr);
        }
        let (n, k) = (n_out, w.len() / n_out.max(1));
        let block = n.div_ceil(4 * rayon::current_num_threads()).max(16);
        let starts: Vec<usize> = (0..n).step_by(block).collect();
        let parts: Vec<(usize, Vec<f32>)> = starts
            .into_par_iter()
            .map(|c0| {
                let c1 = (c0 + block).min(n);
                (c0, te_reference::gemm::gemm_tn(&xr, &w[c0 * k..c1 * k], rows, c1 - c0, k))
            })
            .collect();
        let mut y = vec![0.0; rows * n];
        for (c0, part) in parts {
            let width = part.len() / rows.max(1);
            for (r, row) in part.chunks_exact(width.max(1)).enumerate() {
                y[r * n + c0..r * n + c0 + width].copy_from_slice(row);
            }
        }
        if let Some(b) = b {
            y.chunks_exact_mut(n).for_each(|row| row.iter_mut().zip(b).for_each(|(v, b)| *v += b));
        }
        y
    }

    /// [`DecoderRef::gemm`] of a [`Dense`] layer.
    fn linear(&self, x: &[f32], rows: usize, d: &Dense) -> Vec<f32> {
        self.gemm(x, rows, &d.w, d.b.as_deref(), d.n_out)
    }

    /// A layer's GEMM: [`DecoderRef::linear`] with the input cast as the FP8 recipe casts it
    /// (the weight was cast at construction).
    fn layer_linear(&self, x: &[f32], rows: usize, d: &Dense) -> Vec<f32> {
        let cast = self.precision.fp8_casts([rows, d.n_out, d.w.len() / d.n_out.max(1)]).map(|[x, _]| x);
        self.gemm_cast(x, rows, (&d.w, d.b.as_deref(), d.n_out), cast)
    }

    /// Checks token ids against the vocabulary.
    fn check_ids<S: AsRef<[i32]>>(&self, sequences: &[S]) -> DecoderResult<()> {
        let v = self.cfg.vocab_size;
        for (j, s) in sequences.iter().enumerate() {
            if let Some(&t) = s.as_ref().iter().find(|&&t| usize::try_from(t).map_or(true, |t| t >= v)) {
                return Err(DecoderError::input(format!("sequence {j}: token id {t} outside the vocabulary [0, {v})")));
            }
        }
        Ok(())
    }

    /// Runs the new tokens `new[j]` of each sequence `j` of `cache` at the positions after its
    /// cached ones through every layer, appending their keys and values; returns the final
    /// norm's output `[T, hidden]`, sequences packed in order.
    fn hidden(&self, cache: &mut DecoderKvCache, new: &[&[i32]]) -> DecoderResult<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let ids: Vec<i32> = new.iter().flat_map(|s| s.iter().copied()).collect();
        let scale = self.cfg.embedding_scale(self.precision.dtype());
        let mut x = te_reference::embedding::forward(&self.embedding, h, &ids);
        if scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= scale);
        }
        let lens: Vec<usize> = new.iter().map(|s| s.len()).collect();
        for (l, layer) in self.layers.iter().enumerate() {
            x = layer.forward(self, l, x, &lens, cache)?;
        }
        cache.advance(&lens);
        Ok(self.norm(&self.final_norm).forward(&x))
    }

    /// The logits of the rows of `hidden` (`[rows, hidden]`, after the final norm): the LM head
    /// (the embedding when tied), then the final soft-cap.
    fn head(&self, hidden: &[f32], rows: usize) -> Vec<f32> {
        let logits = match &self.lm_head {
            Some(d) => self.linear(hidden, rows, d),
            None => self.gemm(hidden, rows, &self.embedding, None, self.cfg.vocab_size),
        };
        match self.cfg.final_logit_softcapping {
            Some(cap) => te_reference::elementwise::softcap(&logits, cap),
            None => logits,
        }
    }

    /// The logits `[T, vocab]` of every position of each sequence (`T` the total length; the
    /// sequences packed in order, each from position 0): row `t` predicts the token after token
    /// `t`.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for no sequence, an empty one, or an id outside the vocabulary.
    pub fn logits<S: AsRef<[i32]>>(&self, sequences: &[S]) -> DecoderResult<Vec<f32>> {
        if sequences.is_empty() || sequences.iter().any(|s| s.as_ref().is_empty()) {
            return Err(DecoderError::input("the batch needs at least one sequence, each of at least one token"));
        }
        self.check_ids(sequences)?;
        let mut cache = self.kv_cache(sequences.len());
        let new: Vec<&[i32]> = sequences.iter().map(AsRef::as_ref).collect();
        let hidden = self.hidden(&mut cache, &new)?;
        Ok(self.head(&hidden, hidden.len() / self.cfg.hidden_size))
    }

    /// An empty KV cache for `batch` sequences (see [`DecoderKvCache`]).
    pub fn kv_cache(&self, batch: usize) -> DecoderKvCache {
        DecoderKvCache::new(&self.cfg, batch)
    }

    /// Runs `new[j]` (zero or more tokens) of each sequence `j` of `cache` at the positions after
    /// its cached ones, attending over the cache, appends their keys and values, and returns the
    /// logits of each sequence's last new token (`[vocab]`; empty for a sequence given no token).
    /// Prefill is a call with the prompts, a decode step a call with one token per sequence.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for `new` of another length than the cache's batch, a cache made
    /// by a model of another shape, or an id outside the vocabulary; the cache is unchanged then.
    pub fn forward_cached<S: AsRef<[i32]>>(
        &self,
        cache: &mut DecoderKvCache,
        new: &[S],
    ) -> DecoderResult<Vec<Vec<f32>>> {
        cache.check(&self.cfg)?;
        if new.len() != cache.batch() {
            return Err(DecoderError::input(format!(
                "{} sequences of new tokens for a KV cache of batch {}: give one (maybe empty) per cached sequence",
                new.len(),
                cache.batch()
            )));
        }
        self.check_ids(new)?;
        let new: Vec<&[i32]> = new.iter().map(AsRef::as_ref).collect();
        let hidden = self.hidden(cache, &new)?;
        let h = self.cfg.hidden_size;
        let mut last = Vec::new();
        let mut at = 0;
        for s in &new {
            at += s.len();
            if !s.is_empty() {
                last.extend_from_slice(&hidden[(at - 1) * h..at * h]);
            }
        }
        let rows = last.len() / h;
        let logits = self.head(&last, rows);
        let v = self.cfg.vocab_size;
        let mut rows_iter = logits.chunks_exact(v);
        Ok(new
            .iter()
            .map(|s| if s.is_empty() { Vec::new() } else { rows_iter.next().map_or_else(Vec::new, <[f32]>::to_vec) })
            .collect())
    }
}

impl crate::decoder::CausalLm for DecoderRef {
    fn config(&self) -> &DecoderConfig {
        DecoderRef::config(self)
    }

    fn describe(&self) -> String {
        let precision = match self.precision {
            DecoderPrecision::F32 => "f32".to_string(),
            DecoderPrecision::Bf16 => "bf16 GEMM inputs".to_string(),
            DecoderPrecision::Fp8(r) => format!("fp8 GEMM inputs emulated ({})", r.name()),
        };
        format!("CPU ({} threads), {precision}", rayon::current_num_threads())
    }

    fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        opts: &DecodeOptions,
        on_token: &mut dyn FnMut(usize, i32) -> DecoderResult<()>,
    ) -> DecoderResult<Vec<Vec<i32>>> {
        DecoderRef::generate(self, prompts, opts, on_token)
    }

    fn perplexity(&mut self, tokens: &[i32], max_length: usize, stride: usize) -> DecoderResult<Perplexity> {
        DecoderRef::perplexity(self, tokens, max_length, stride)
    }
}
