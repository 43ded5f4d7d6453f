//! The decoder family on the GPU ([`Decoder`]): the model of [`crate::decoder`] (Llama, Qwen2,
//! Qwen3, Gemma 3) for inference, built from te-nn's `Norm` and `Linear` modules (BF16, or FP8
//! GEMMs with `fp8_model_init`-style one-byte weights) and te-runtime's kernels: the embedding
//! lookup, the fused qk-norm + RoPE + KV-cache append (`ops::qkv_rope`), the fused attention
//! over the cache for prompts and the split-K decode kernels for one-token steps, the gated
//! activations, and the fused cross-entropy for perplexity.
//!
//! Tokens run packed (TE's `thd`): a step is any number of new tokens per sequence, sequence
//! after sequence, each at its own position, so prompts of different lengths need no padding
//! ([`DecoderCache`]). Its CPU twin is [`crate::cpu::decoder::DecoderRef`].
//!
//! Files: this one holds the model and its forward; `layer` a layer; `cache` the KV cache and a
//! step's tables; `generate` generation, perplexity and [`crate::decoder::CausalLm`];
//! `prefill_plan` the buckets and padded tables of the prefill graphs, `prefill_graph` their
//! capture, replay and store ([`Decoder::set_prefill_graphs`]).

mod cache;
mod generate;
mod layer;
mod prefill_graph;
pub mod prefill_plan;

pub use cache::{DecoderCache, DEFAULT_PREFILL_CHUNK};
pub use prefill_graph::{PrefillGraphStats, PrefillGraphs};
pub use prefill_plan::{prefill_bucket, prefill_capacity, PREFILL_BUCKETS, PREFILL_GRAPH_MAX_TOKENS};

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult, DecoderWeights, WeightTensor};
use layer::{linear, linear_fp8, linear_from, norm, quantize_e4m3, DecodeStream, Layer};
use std::collections::BTreeMap;
use std::sync::Arc;
use te_codegen::spec::GemvEpilogue;
use te_codegen::DType;
use te_nn::fp8::{fp8_autocast, Float8Tensor, Fp8Autocast, Recipe};
use te_nn::modules::{Linear, Norm};
use te_runtime::graph::HostCopies;
use te_runtime::ops::elementwise::scale_assign;
use te_runtime::ops::embedding::{embedding_forward, embedding_forward_fp8};
use te_runtime::{Device, Tensor};

pub(crate) type Tensors = BTreeMap<String, WeightTensor>;

/// Takes `name` out of `t` and uploads it as BF16 of `shape`.
pub(crate) fn upload(dev: &Arc<Device>, t: &mut Tensors, name: &str, shape: &[usize]) -> DecoderResult<Tensor> {
    let w = t.remove(name).ok_or_else(|| DecoderError::input(format!("parameter `{name}` is missing")))?;
    if w.data.len() != shape.iter().product::<usize>() {
        return Err(DecoderError::input(format!("parameter `{name}` is {:?}, the model needs {shape:?}", w.shape)));
    }
    Ok(Tensor::from_f32(dev, DType::BF16, shape, &w.data)?)
}

/// How the GPU model computes its GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GpuPrecision {
    /// BF16 weights and activations, f32 accumulation (transformers' `torch_dtype=bfloat16`).
    #[default]
    Bf16,
    /// The layers' GEMMs in FP8: E4M3 one-byte weights (each scaled by its own amax, TE's
    /// `fp8_model_init`), activations quantized by `recipe`. The embedding and the LM head stay
    /// BF16 unless `lm_head` (then the tied head's GEMM is FP8 too; the lookup stays BF16).
    Fp8 {
        /// The activations' scaling recipe.
        recipe: Recipe,
        /// The LM head's GEMM in FP8 too (TE's `--fp8-lm-head`).
        lm_head: bool,
    },
}

impl GpuPrecision {
    fn fp8(self) -> Option<Recipe> {
        match self {
            Self::Bf16 => None,
            Self::Fp8 { recipe, .. } => Some(recipe),
        }
    }

    /// `bf16`, or `fp8 (<recipe>)` with `+ lm head`.
    pub fn describe(self) -> String {
        match self {
            Self::Bf16 => "bf16".into(),
            Self::Fp8 { recipe, lm_head } => {
                format!("fp8 ({}{})", recipe.name(), if lm_head { ", fp8 lm head" } else { "" })
            }
        }
    }
}

/// The embedding table: BF16, or E4M3 with its `scale_inv` when the tied head runs in FP8.
#[derive(Debug)]
enum Table {
    Bf16(Tensor),
    Fp8(Float8Tensor),
}

impl Table {
    fn num_bytes(&self) -> usize {
        match self {
            Self::Bf16(t) => t.num_bytes(),
            Self::Fp8(f) => f.num_bytes(),
        }
    }

    /// `out[t] = table[ids[t]]`.
    fn lookup(&self, dev: &Device, ids: &cudarc::driver::CudaSlice<i32>, out: &mut Tensor) -> DecoderResult<()> {
        match self {
            Self::Bf16(t) => embedding_forward(dev, t, ids, out)?,
            Self::Fp8(f) => embedding_forward_fp8(dev, f.data(), f.scale_inv(), ids, out)?,
        }
        Ok(())
    }
}

/// The decoder on the GPU (see the module docs).
#[derive(Debug)]
pub struct Decoder {
    dev: Arc<Device>,
    cfg: DecoderConfig,
    precision: GpuPrecision,
    /// `[vocab, hidden]`.
    embedding: Table,
    layers: Vec<Layer>,
    final_norm: Norm,
    /// `[vocab, hidden]`: the embedding itself when tied.
    lm_head: Linear,
    /// f32 `[head_dim / 2]` inverse frequencies of each distinct RoPE of the layers.
    inv_freq: Vec<Tensor>,
    /// Replay decode steps (and, with [`PrefillGraphs::On`], prefills) from CUDA graphs.
    cuda_graph: bool,
    /// Why the last generation ran a step eagerly although graphs were on (its decode step's
    /// capture, its prefill's).
    graph_fallback: Option<String>,
    /// The prefill graphs: their mode, caches and buckets.
    prefill: prefill_graph::PrefillStore,
    /// The most tokens a step feeds a sequence when the sliding-window layers keep only their
    /// window ([`DecoderCache::with_chunk`]).
    prefill_chunk: usize,
    /// Decode steps of at most this many tokens run through the fused GEMVs (0: never).
    fused_decode_rows: usize,
    /// What [`Decoder::cache`] holds: BF16 or E4M3.
    kv_cache_dtype: DType,
}

impl Decoder {
    /// Uploads `weights` (rounded to BF16; FP8 weights quantized under `precision`).
    ///
    /// # Errors
    /// [`DecoderError::Config`] for what the GPU path does not run (an activation without a
    /// fused kernel: silu, reglu, geglu with erf; attention logit soft-capping; a head dim the
    /// fused kernels do not take); [`DecoderError::Input`] for a missing parameter; the
    /// device's errors (out of memory).
    pub fn new(dev: &Arc<Device>, weights: DecoderWeights, precision: GpuPrecision) -> DecoderResult<Self> {
        let (cfg, mut t) = weights.into_parts();
        if cfg.attn_logit_softcapping.is_some() {
            return Err(DecoderError::config(
                "attn_logit_softcapping",
                "the fused attention has no logit soft-capping (Gemma 2): run the model with --cpu",
            ));
        }
        if let Some(reason) = te_runtime::ops::flash_attention::unsupported_reason(
            dev.arch(),
            DType::BF16,
            cfg.head_dim,
            cfg.head_dim,
            false,
        ) {
            return Err(DecoderError::config("head_dim", format!("the GPU path cannot run this model: {reason}")));
        }
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let fp8 = precision.fp8().is_some();
        let embedding = upload(dev, &mut t, "embedding.weight", &[v, h])?;
        let mut ropes: Vec<(crate::decoder::RopeConfig, Tensor)> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let rope = cfg.layer_rope(l);
            let index = match ropes.iter().position(|(r, _)| *r == rope) {
                Some(i) => i,
                None => {
                    let inv = rope.inv_freq(cfg.head_dim);
                    ropes.push((rope, Tensor::from_f32(dev, DType::F32, &[inv.len()], &inv)?));
                    ropes.len() - 1
                }
            };
            layers.push(Layer::new(dev, &cfg, l, &mut t, (index, fp8))?);
        }
        let final_norm = norm(dev, &cfg, &mut t, ("final_norm.weight", "final_norm.bias"), h)?;
        let fp8_head = matches!(precision, GpuPrecision::Fp8 { lm_head: true, .. });
        let (embedding, lm_head) = if cfg.tie_word_embeddings && fp8_head {
            // One E4M3 table serves the lookup and the head: no BF16 copy stays.
            let table = quantize_e4m3(dev, &embedding)?;
            let head = linear_fp8(dev, table.clone())?;
            (Table::Fp8(table), head)
        } else if cfg.tie_word_embeddings {
            let head = linear_from(dev, embedding.clone(), None, false)?;
            (Table::Bf16(embedding), head)
        } else {
            (Table::Bf16(embedding), linear(dev, &mut t, ("lm_head.weight", None), (v, h), fp8_head)?)
        };
        let inv_freq = ropes.into_iter().map(|(_, t)| t).collect();
        Ok(Self {
            dev: dev.clone(),
            cfg,
            precision,
            embedding,
            layers,
            final_norm,
            lm_head,
            inv_freq,
            cuda_graph: true,
            graph_fallback: None,
            prefill: Default::default(),
            prefill_chunk: cache::DEFAULT_PREFILL_CHUNK,
            fused_decode_rows: 0,
            kv_cache_dtype: DType::BF16,
        }
        .with_fused_decode(true))
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// How the GEMMs run.
    pub fn precision(&self) -> GpuPrecision {
        self.precision
    }

    /// Bytes of the parameters on the device: the embedding, every layer, the final norm and an
    /// untied LM head (a tied head shares the embedding's table).
    pub fn parameter_bytes(&self) -> usize {
        let norm = self.final_norm.params().weight().num_bytes()
            + self.final_norm.params().bias().map_or(0, Tensor::num_bytes);
        self.embedding.num_bytes()
            + self.layers.iter().map(Layer::parameter_bytes).sum::<usize>()
            + norm
            + if self.cfg.tie_word_embeddings { 0 } else { self.lm_head.params().parameter_bytes() }
    }

    /// A KV cache for `batch` sequences of up to `capacity` tokens.
    ///
    /// # Errors
    /// As [`DecoderCache::new`].
    pub fn cache(&self, batch: usize, capacity: usize) -> DecoderResult<DecoderCache> {
        DecoderCache::with_chunk_dtype(&self.dev, &self.cfg, batch, capacity, self.prefill_chunk, self.kv_cache_dtype)
    }

    /// What the caches of [`Decoder::cache`] (and so of `generate`) hold: BF16 (the default) or
    /// E4M3 codes with per-tensor scales 1 (vLLM's `kv_cache_dtype="fp8"`: half the bytes a
    /// decode step reads from the cache; see [`DecoderCache::with_chunk_dtype`]).
    ///
    /// # Errors
    /// [`DecoderError::Input`] for another dtype.
    pub fn set_kv_cache_dtype(&mut self, dtype: DType) -> DecoderResult<()> {
        cache::check_kv_dtype(dtype)?;
        self.kv_cache_dtype = dtype;
        Ok(())
    }

    /// What [`Decoder::cache`] holds.
    pub fn kv_cache_dtype(&self) -> DType {
        self.kv_cache_dtype
    }

    /// The most tokens a step feeds one sequence when the sliding-window layers keep only their
    /// window (default [`DEFAULT_PREFILL_CHUNK`]): their caches hold `window + chunk` rows
    /// a sequence (when fewer than the capacity), longer prompts run in chunks of `chunk` tokens.
    /// Smaller saves memory at long contexts; larger runs long prompts in fewer steps.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for 0.
    pub fn set_prefill_chunk(&mut self, chunk: usize) -> DecoderResult<()> {
        if chunk == 0 {
            return Err(DecoderError::input("the prefill chunk must be ≥ 1 token"));
        }
        self.prefill_chunk = chunk;
        Ok(())
    }

    /// Checks token ids against the vocabulary.
    fn check_ids<S: AsRef<[i32]>>(&self, sequences: &[S]) -> DecoderResult<()> {
        let v = self.cfg.vocab_size;
        for (j, s) in sequences.iter().enumerate() {
            if let Some(&id) = s.as_ref().iter().find(|&&id| id < 0 || id as usize >= v) {
                return Err(DecoderError::input(format!(
                    "sequence {j} holds the id {id}, outside the vocabulary of {v}"
                )));
            }
        }
        Ok(())
    }

    /// One step: `new[j]` (possibly empty) tokens of sequence `j` after the cached ones, through
    /// the embedding and every layer (appending to the cache) and the final norm. Returns the
    /// hidden states `[Σ new_j, hidden]` BF16 (packed, sequence after sequence). When the cache's
    /// sliding-window layers take fewer tokens a step ([`DecoderCache::max_step_tokens`]), the
    /// tokens run in chunks of that many and the hidden states come back in the same order.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for another number of sequences than the cache's batch, no new
    /// token at all, an id outside the vocabulary, a sequence past the cache's capacity; the
    /// device's errors.
    pub fn forward_step<S: AsRef<[i32]>>(&mut self, cache: &mut DecoderCache, new: &[S]) -> DecoderResult<Tensor> {
        self.check_ids(new)?;
        let longest = new.iter().map(|s| s.as_ref().len()).max().unwrap_or(0);
        let chunk = match cache.max_step_tokens() {
            Some(c) if longest > c => c,
            _ => return self.forward_chunk(cache, new),
        };
        // The sliding-window layers take `chunk` tokens a sequence at a time: chunk i feeds
        // tokens [i·chunk, (i+1)·chunk) of every sequence, and the hidden states are put back in
        // the packed order of `new`.
        let parts = longest.div_ceil(chunk);
        let mut per_seq: Vec<Vec<Tensor>> = vec![Vec::with_capacity(parts); new.len()];
        for i in 0..parts {
            let pieces: Vec<&[i32]> = new
                .iter()
                .map(|s| {
                    let s = s.as_ref();
                    &s[(i * chunk).min(s.len())..((i + 1) * chunk).min(s.len())]
                })
                .collect();
            let hidden = self.forward_chunk(cache, &pieces)?;
            let sizes: Vec<usize> = pieces.iter().map(|p| p.len()).collect();
            for (j, part) in hidden.split_rows(&self.dev, &sizes)?.into_iter().enumerate() {
                per_seq[j].push(part);
            }
        }
        Ok(Tensor::cat_rows(&self.dev, &per_seq.into_iter().flatten().collect::<Vec<_>>())?)
    }

    /// One step of at most [`DecoderCache::max_step_tokens`] new tokens a sequence (see
    /// [`Decoder::forward_step`]).
    fn forward_chunk<S: AsRef<[i32]>>(&mut self, cache: &mut DecoderCache, new: &[S]) -> DecoderResult<Tensor> {
        let counts: Vec<usize> = new.iter().map(|s| s.as_ref().len()).collect();
        if counts.len() != cache.batch() {
            return Err(DecoderError::input(format!(
                "{} sequences for a cache of batch {}",
                counts.len(),
                cache.batch()
            )));
        }
        cache.make_room(&self.dev, &counts)?;
        let mut tables = cache::plan(&self.dev, cache, &counts)?;
        let ids: Vec<i32> = new.iter().flat_map(|s| s.as_ref().iter().copied()).collect();
        let ids_dev = self.dev.stream().htod(&ids)?;
        let hidden = self.run(&ids_dev, cache::Step { cache, tables: &mut tables })?;
        cache::advance(cache, &counts);
        Ok(hidden)
    }

    /// The embedded rows `[ids, hidden]` BF16 of `ids` (scaled by the model's embedding scale).
    fn embed(&self, ids: &cudarc::driver::CudaSlice<i32>) -> DecoderResult<Tensor> {
        let mut x = Tensor::empty(&self.dev, DType::BF16, &[ids.len(), self.cfg.hidden_size])?;
        self.embedding.lookup(&self.dev, ids, &mut x)?;
        let scale = self.cfg.embedding_scale(DType::BF16);
        if scale != 1.0 {
            scale_assign(&self.dev, &mut x, scale)?;
        }
        Ok(x)
    }

    /// The embedding of `ids` (device, one per token of `step`), every layer and the final norm:
    /// device work only (no host transfer), so a decode step can be captured in a CUDA graph.
    fn run(&mut self, ids: &cudarc::driver::CudaSlice<i32>, mut step: cache::Step<'_>) -> DecoderResult<Tensor> {
        let dev = self.dev.clone();
        let mut x = self.embed(ids)?;
        let guard = match self.precision.fp8() {
            Some(recipe) => Some(Fp8Autocast::new(recipe).enter()?),
            None => None,
        };
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.forward(&dev, &self.cfg, &mut x, &mut step, (l, &self.inv_freq[layer.rope]))?;
        }
        if let Some(g) = guard {
            g.exit()?;
        }
        Ok(self.final_norm.infer(&x)?)
    }

    /// The logits `[batch, vocab]` of a decode step over `tables` (one token per sequence of
    /// `cache`, the tables filled for it); the cache's lengths are the caller's to advance.
    fn decode_logits(&mut self, cache: &mut DecoderCache, tables: &mut cache::DecodeTables) -> DecoderResult<Tensor> {
        let step = cache::Step { cache, tables: &mut tables.tables };
        if tables.ids.len() <= self.fused_decode_rows {
            return self.run_decode(&tables.ids, step);
        }
        let hidden = self.run(&tables.ids, step)?;
        self.head(&hidden)
    }

    /// [`Decoder::run`] and the LM head for a decode step of few tokens through the fused GEMVs
    /// (`Layer::forward_decode`; the final norm, after the last sandwich add, is the head's
    /// prologue). Returns the logits `[tokens, vocab]` BF16.
    fn run_decode(&mut self, ids: &cudarc::driver::CudaSlice<i32>, mut step: cache::Step<'_>) -> DecoderResult<Tensor> {
        let dev = self.dev.clone();
        let mut s = DecodeStream::new(self.embed(ids)?);
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.forward_decode(&dev, &self.cfg, &mut s, &mut step, (l, &self.inv_freq[layer.rope]))?;
        }
        let mut logits = Tensor::empty(&dev, DType::BF16, &[ids.len(), self.cfg.vocab_size])?;
        s.gemv(&dev, &self.final_norm, (&self.lm_head, GemvEpilogue::Store), &mut logits)?;
        Ok(logits)
    }

    /// Whether decode steps of one or two tokens (batch 1 or 2) run through the fused GEMVs: a layer's norms, GEMMs, bias,
    /// activation and residual adds in four launches, FP8 weights read as E4M3 with their scale
    /// and multiplied with BF16 activations (no activation cast). Default true; `false` runs them
    /// as the prefill does (GEMMs and separate kernels), as before.
    pub fn set_fused_decode(&mut self, on: bool) {
        self.fused_decode_rows = if on { self.fused_rows() } else { 0 };
    }

    fn with_fused_decode(mut self, on: bool) -> Self {
        self.set_fused_decode(on);
        self
    }

    /// The most tokens a fused decode step takes: the GEMVs' row limit over the model's widths
    /// (0 where a width is not a whole number of 16-byte weight vectors).
    fn fused_rows(&self) -> usize {
        let cfg = &self.cfg;
        let fp8 = self.precision.fp8().is_some();
        let widths = [cfg.hidden_size, cfg.attention_size(), cfg.ffn_hidden_size];
        let vec = if fp8 { 16 } else { 8 };
        if widths.iter().any(|k| k % vec != 0) {
            return 0;
        }
        let most = widths.iter().map(|&k| te_runtime::ops::gemv::max_rows(k)).min().unwrap_or(0);
        most.min(te_runtime::ops::gemv::DECODE_MAX_ROWS)
    }

    /// Whether [`Decoder::generate`] replays its decode steps from a CUDA graph (captured at the
    /// second step; the first runs eagerly and loads every kernel), and, under
    /// [`PrefillGraphs::On`] ([`Decoder::set_prefill_graphs`]), its prefills from one graph per
    /// length bucket. Default true; a step that cannot be captured runs eagerly
    /// ([`Decoder::graph_fallback`] says why). Off, the prefills of [`PrefillGraphs::On`] still
    /// run on their padded shape (eagerly: the same numbers).
    pub fn set_cuda_graph(&mut self, on: bool) {
        self.cuda_graph = on;
    }

    /// Why the last generation (or [`Decoder::prefill_logits`]) ran a step eagerly although CUDA
    /// graphs were on, if it did: its decode step's failed capture, its prefill bucket's (`;`
    /// between them).
    pub fn graph_fallback(&self) -> Option<&str> {
        self.graph_fallback.as_deref()
    }

    /// The LM head over `hidden` rows `[rows, hidden]`: logits `[rows, vocab]` BF16 (before any
    /// final soft-capping, which [`Decoder::logits`] and the samplers apply).
    ///
    /// # Errors
    /// The device's errors.
    pub fn head(&mut self, hidden: &Tensor) -> DecoderResult<Tensor> {
        let lm_head = &mut self.lm_head;
        Ok(match self.precision {
            GpuPrecision::Fp8 { recipe, lm_head: true } => fp8_autocast(true, recipe, || lm_head.infer(hidden))?,
            _ => lm_head.infer(hidden)?,
        })
    }

    /// Rows `rows` of `hidden` (`[tokens, hidden]`), gathered into `[rows.len(), hidden]`.
    ///
    /// # Errors
    /// The device's errors.
    pub fn gather_rows(&self, hidden: &Tensor, rows: &[usize]) -> DecoderResult<Tensor> {
        let ids: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
        let ids_dev = self.dev.stream().htod(&ids)?;
        let mut out = Tensor::empty(&self.dev, hidden.dtype(), &[rows.len(), self.cfg.hidden_size])?;
        embedding_forward(&self.dev, hidden, &ids_dev, &mut out)?;
        Ok(out)
    }

    /// `cap · tanh(x / cap)` over host logits when the model soft-caps its final logits.
    pub(crate) fn softcap(&self, logits: &mut [f32]) {
        if let Some(cap) = self.cfg.final_logit_softcapping {
            logits.iter_mut().for_each(|x| *x = cap * (*x / cap).tanh());
        }
    }

    /// Logits `[Σ lenᵢ, vocab]` (f32 on the host, soft-capped) of `sequences` (each from position
    /// 0, packed without padding as [`crate::cpu::decoder::DecoderRef::logits`] returns them).
    ///
    /// # Errors
    /// [`DecoderError::Input`] for no sequence, an empty one or an id outside the vocabulary;
    /// the device's errors.
    pub fn logits<S: AsRef<[i32]>>(&mut self, sequences: &[S]) -> DecoderResult<Vec<f32>> {
        if sequences.is_empty() || sequences.iter().any(|s| s.as_ref().is_empty()) {
            return Err(DecoderError::input("logits need at least one sequence, none of them empty"));
        }
        let capacity = sequences.iter().map(|s| s.as_ref().len()).max().unwrap_or(1);
        let mut cache = self.cache(sequences.len(), capacity)?;
        let hidden = self.forward_step(&mut cache, sequences)?;
        let mut out = Vec::with_capacity(hidden.shape()[0] * self.cfg.vocab_size);
        // Blocks of rows, so the logits of a long batch never sit on the device at once.
        let tokens = hidden.shape()[0];
        for r0 in (0..tokens).step_by(1024) {
            let rows: Vec<usize> = (r0..(r0 + 1024).min(tokens)).collect();
            let part = self.gather_rows(&hidden, &rows)?;
            out.extend(self.head(&part)?.to_f32(&self.dev)?);
        }
        self.softcap(&mut out);
        Ok(out)
    }
}
