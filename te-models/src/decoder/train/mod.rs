//! The decoder family trainable on the GPU ([`DecoderLm`]): Llama, Qwen2, Qwen3 and Gemma 3 as
//! TE modules with a backward, for fine-tuning a pretrained checkpoint (TE's `te_llama`
//! tutorial: the Hugging Face model's layers replaced by TE's, the weights copied over).
//!
//! The model is the formula of the [`crate::decoder`] docs over hidden states `[s, b, hidden]`
//! (Megatron's layout, every sequence of the batch from position 0): the embedding (times
//! [`DecoderConfig::embedding_scale`]), layers (each a te-nn `MultiheadAttention`
//! and `LayerNormMLP`, the sandwich norms), the final norm, the LM head (the embedding's table
//! when [`DecoderConfig::tie_word_embeddings`]) and the cross-entropy of next-token prediction.
//! Its parameters carry the family's internal names (the table of the [`crate::decoder`] docs),
//! so [`DecoderLm::from_weights`] loads what [`DecoderWeights`] imports (a Hugging Face
//! directory, a GGUF file) and [`DecoderLm::to_weights`] hands back what
//! [`DecoderWeights::save_hf_dir`] exports.
//!
//! FP8: run [`DecoderLm::forward_loss_with`] and [`DecoderLm::backward`] under
//! `te_nn::fp8::fp8_autocast` with a recipe, as for `crate::gpt::Gpt`; the LM head stays in
//! high precision (Megatron's output layer is not a TE module either). Full activation
//! recompute: [`DecoderLm::set_recompute`]; with it, the CPU offload of the layer inputs it
//! keeps (TE's `get_cpu_offload_context`): [`DecoderLm::set_offload_activations`]. Context
//! parallelism (every sequence split over a group of ranks, TE's all-gather `cp_group`):
//! [`DecoderLm::set_context_parallel`]. ZeRO-3 (each layer's weights sharded over the
//! data-parallel ranks, gathered around its forward and backward): [`DecoderLm::set_zero3`].

mod backward;
mod context_parallel;
mod layer;
mod memory;
mod offload;
mod recompute;
mod zero3;

pub use context_parallel::shard_rows;

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult, DecoderWeights, WeightTensor};
use crate::gpt::{GptLoss, MicroBatch, IGNORE_INDEX};
use layer::DecoderLayer;
use recompute::{LayerInputs, SavedLayer};
use std::collections::BTreeMap;
use std::sync::Arc;
use te_codegen::spec::CrossEntropySpec;
use te_codegen::DType;
use te_nn::fp8::{fp8_autocast, Float8Tensor, Recipe};
use te_nn::modules::{
    Embedding, EmbeddingConfig, EmbeddingCtx, ForwardOptions, Linear, LinearConfig, LinearCtx, Module, Norm,
    NormConfig, NormCtx, Param, ParamKind, ParamMut, Recompute, TokenIds,
};
use te_runtime::ops::cross_entropy::{cross_entropy, CrossEntropyGrad};
use te_runtime::ops::elementwise::scale_assign;
use te_runtime::ops::embedding::embedding_forward;
use te_runtime::{Device, Error, Result, Tensor};

const MODEL: &str = "DecoderLm";

/// How the tokens of a [`DecoderLm::forward_loss_thd`] call are packed (TE's `thd` tables).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Packing<'a> {
    /// Each token's position in its document (RoPE), `[tokens]`.
    pub position_ids: &'a [usize],
    /// The documents' lengths as prefix sums, `[documents + 1]` from 0 (TE's `cu_seqlens`).
    pub cu_seqlens: &'a [usize],
    /// Where each document starts when padding separates them, then the tokens
    /// (`[documents + 1]`, TE's `cu_seqlens_padded`); padding tokens get no output and no
    /// gradient. `None`: the documents end to end.
    pub cu_seqlens_padded: Option<&'a [usize]>,
}

/// A decoder of the family with its training forward and backward (see the module docs).
#[derive(Debug, te_nn::Module)]
pub struct DecoderLm {
    embedding: Embedding,
    layers: Vec<DecoderLayer>,
    final_norm: Norm,
    /// The untied LM head `[vocab, hidden]`; `None` when tied.
    lm_head: Option<Linear>,
    /// The tied head: a GEMM over the embedding's table (set before each forward, its weight
    /// gradient added to the table's after each backward; not a parameter of its own).
    #[module(skip)]
    tied_head: Option<Linear>,
    /// The embedding's [`Embedding::version`] the tied head's weight was last set at: the head
    /// (and its cached FP8 weight) is refreshed only after the table changed, not every
    /// micro-batch.
    #[module(skip)]
    tied_at: Option<u64>,
    /// f32 `[max_position_embeddings′, head_dim]` rotary angles of each distinct RoPE of the
    /// layers (grown on demand to the longest sequence seen).
    #[module(skip)]
    rope: Vec<(crate::decoder::RopeConfig, Option<Tensor>)>,
    #[module(skip)]
    cfg: DecoderConfig,
    /// The LM head's GEMMs in FP8 too under `fp8_autocast` ([`DecoderLm::set_fp8_lm_head`]).
    #[module(skip)]
    fp8_lm_head: bool,
    /// What the training forward keeps of each layer ([`DecoderLm::set_recompute`]).
    #[module(skip)]
    recompute: Recompute,
    /// The first layers whose saved inputs go to pinned host memory, and the side stream and
    /// buffers that move them ([`DecoderLm::set_offload_activations`]).
    #[module(skip)]
    offload: te_runtime::offload::LayerOffload,
    /// The context-parallel group every sequence is split over
    /// ([`DecoderLm::set_context_parallel`]).
    #[module(skip)]
    cp: Option<te_nn::parallel::ContextParallel>,
    /// The layers' weights sharded over the data-parallel ranks ([`DecoderLm::set_zero3`]).
    #[module(skip)]
    zero3: Option<zero3::Zero3>,
    /// ZeRO-3: gather the GEMM weights as FP8 codes where the recipe allows it
    /// ([`DecoderLm::set_zero3_fp8_gather`]).
    #[module(skip)]
    zero3_fp8_gather: bool,
    #[module(skip)]
    dtype: DType,
    #[module(skip)]
    dev: Arc<Device>,
}

/// What [`DecoderLm::forward_loss_with`] saves for [`DecoderLm::backward`].
#[derive(Debug)]
pub struct DecoderLmCtx {
    tokens: EmbeddingCtx,
    layers: Vec<SavedLayer>,
    /// The attention inputs the recomputed layers need again (full recompute only).
    inputs: Option<LayerInputs>,
    final_norm: NormCtx,
    lm_head: LinearCtx,
    dlogits: Dlogits,
    shape: [usize; 3],
}

impl DecoderLmCtx {
    /// The dtype of the logits' gradient the LM head's backward will read: the logits' own,
    /// or E5M2 where an FP8 head (`set_fp8_lm_head` under per-tensor FP8 scaling) reads the
    /// codes the cross-entropy writes (sm_90a, vocabularies of 16 384 classes and more in BF16).
    pub fn dlogits_dtype(&self) -> DType {
        match &self.dlogits {
            Dlogits::High(d) => d.dtype(),
            Dlogits::Fp8 { dy8, .. } => dy8.dtype(),
        }
    }
}

/// The loss's gradient of the logits the LM head's backward reads.
#[derive(Debug)]
enum Dlogits {
    /// In the logits' dtype.
    High(Tensor),
    /// E5M2 codes written by the cross-entropy itself (an FP8 head: `set_fp8_lm_head`), the
    /// hidden states' gradient to come out in `dtype`.
    Fp8 { dy8: Float8Tensor, dtype: DType },
}

impl DecoderLm {
    /// A model of `cfg` in `dtype` (BF16 to train, F32 for checks) with TE's initialization
    /// (weights to be loaded with [`DecoderLm::load`]).
    ///
    /// # Errors
    /// [`DecoderError::Config`] for what training on the GPU does not run: final or attention
    /// logit soft-capping, an activation without a fused kernel, a non-high-precision dtype;
    /// the configuration's own checks; the modules' errors (a head dim the fused attention does
    /// not take falls back to the unfused backend).
    pub fn new(dev: &Arc<Device>, cfg: DecoderConfig, dtype: DType) -> DecoderResult<Self> {
        cfg.validate()?;
        for (field, set) in [
            ("final_logit_softcapping", cfg.final_logit_softcapping.is_some()),
            ("attn_logit_softcapping", cfg.attn_logit_softcapping.is_some()),
        ] {
            if set {
                return Err(DecoderError::config(
                    field,
                    "training on the GPU has no soft-capping yet (Gemma 3 has none; Gemma 2 does): set it to null to \
                     train without it",
                ));
            }
        }
        if !dtype.is_high_precision() {
            return Err(DecoderError::config("torch_dtype", format!("train in bf16, f16 or f32, not {dtype}")));
        }
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embedding = Embedding::new(dev, EmbeddingConfig { params_dtype: dtype, ..EmbeddingConfig::new(v, h) })?;
        let mut rope: Vec<(crate::decoder::RopeConfig, Option<Tensor>)> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let r = cfg.layer_rope(l);
            let i = match rope.iter().position(|(c, _)| *c == r) {
                Some(i) => i,
                None => {
                    rope.push((r, None));
                    rope.len() - 1
                }
            };
            layers.push(DecoderLayer::new(dev, &cfg, l, i, dtype)?);
        }
        let nc = NormConfig {
            eps: cfg.layernorm_epsilon,
            zero_centered_gamma: cfg.zero_centered_gamma,
            params_dtype: dtype,
            ..NormConfig::new(h)
        };
        let final_norm = Norm::new(dev, cfg.normalization, nc)?;
        let head =
            |seed| Linear::new(dev, LinearConfig { bias: false, params_dtype: dtype, seed, ..LinearConfig::new(h, v) });
        let (lm_head, tied_head) =
            if cfg.tie_word_embeddings { (None, Some(head(1)?)) } else { (Some(head(1)?), None) };
        Ok(Self {
            embedding,
            layers,
            final_norm,
            lm_head,
            tied_head,
            tied_at: None,
            rope,
            cfg,
            fp8_lm_head: false,
            recompute: Recompute::None,
            offload: te_runtime::offload::LayerOffload::default(),
            cp: None,
            zero3: None,
            zero3_fp8_gather: true,
            dtype,
            dev: dev.clone(),
        })
    }

    /// A model of `weights`' configuration holding its tensors (rounded to `dtype`).
    ///
    /// # Errors
    /// As [`DecoderLm::new`] and [`DecoderLm::load`].
    pub fn from_weights(dev: &Arc<Device>, weights: &DecoderWeights, dtype: DType) -> DecoderResult<Self> {
        let mut m = Self::new(dev, weights.config().clone(), dtype)?;
        m.load(weights)?;
        Ok(m)
    }

    /// Copies every parameter from `weights` (internal names), rounded to the model's dtype.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for a parameter `weights` lacks or holds in another shape, or a
    /// tensor of `weights` the model has no parameter for (nothing is kept half-loaded: the
    /// check runs before the first copy); device errors.
    pub fn load(&mut self, weights: &DecoderWeights) -> DecoderResult<()> {
        let mut wanted = Vec::new();
        self.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            wanted.push((path.to_string(), p.shape().to_vec()));
            Ok(())
        })?;
        let mut problems = Vec::new();
        for (name, shape) in &wanted {
            match weights.get(name) {
                None => problems.push(format!("`{name}` {shape:?} is missing")),
                Some(t) if t.data.len() != shape.iter().product::<usize>() => {
                    problems.push(format!("`{name}` is {:?}, the model needs {shape:?}", t.shape))
                }
                Some(_) => {}
            }
        }
        let names: std::collections::BTreeSet<&str> = wanted.iter().map(|(n, _)| n.as_str()).collect();
        for name in weights.tensors().keys() {
            if !names.contains(name.as_str()) {
                problems.push(format!("`{name}` is not a parameter of the model"));
            }
        }
        if !problems.is_empty() {
            return Err(DecoderError::input(format!("the weights do not fit the model: {}", problems.join("; "))));
        }
        let (dev, dtype) = (self.dev.clone(), self.dtype);
        self.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
            let t = weights.get(path).ok_or_else(|| Error::internal(MODEL, "a parameter vanished while loading"))?;
            let shape = p.shape().to_vec();
            p.set(Tensor::from_f32(&dev, dtype, &shape, &t.data)?)
        })?;
        Ok(())
    }

    /// The parameters as [`DecoderWeights`] of the model's configuration (f32 copies on the
    /// host, internal names): what `save_hf_dir` writes as a Hugging Face directory.
    ///
    /// # Errors
    /// Copy failures; the configuration's checks; [`Error::Config`] while the layers are
    /// sharded ([`DecoderLm::set_zero3`]: call [`DecoderLm::zero3_unshard`] first).
    pub fn to_weights(&self) -> DecoderResult<DecoderWeights> {
        if self.zero3.is_some() {
            let message = "the layers are sharded (ZeRO-3): call zero3_unshard first".into();
            return Err(Error::Config { module: MODEL, message }.into());
        }
        let mut tensors = BTreeMap::new();
        let dev = &self.dev;
        self.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            let t = p.tensor().ok_or_else(|| Error::internal(MODEL, "an FP8-only parameter"))?;
            tensors.insert(path.to_string(), WeightTensor { shape: t.shape().to_vec(), data: t.to_f32(dev)? });
            Ok(())
        })?;
        DecoderWeights::from_tensors(self.cfg.clone(), tensors)
    }

    /// The configuration.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// Runs the LM head's GEMMs (forward, dgrad, wgrad; the tied one over the embedding's
    /// table, cast each step) in FP8 too under `fp8_autocast` (`te train --fp8-lm-head`); off by
    /// default, as in Megatron with TE: the logits over the whole vocabulary stay high precision.
    /// With delayed or current scaling on sm_90a the loss writes the logits' gradient as E5M2
    /// codes for the head's backward ([`DecoderLmCtx::dlogits_dtype`]): no cast of it, half
    /// its bytes.
    pub fn set_fp8_lm_head(&mut self, on: bool) {
        self.fp8_lm_head = on;
    }

    /// Training mode (the default) or evaluation mode.
    pub fn set_training(&mut self, training: bool) {
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }

    /// Each token's rotary angles, `[positions.len(), head_dim]` per table: its position's row
    /// of the cached table, gathered on the device (the embedding lookup), so no per-step
    /// table crosses from the host.
    fn freqs_at(&mut self, positions: &[usize]) -> Result<Vec<Tensor>> {
        let rows = positions.iter().max().map_or(1, |&m| m + 1);
        let pos: Vec<i32> = positions.iter().map(|&x| x as i32).collect();
        let pos = self.dev.stream().clone_htod(&pos)?;
        let d = self.cfg.head_dim;
        let mut tables = Vec::with_capacity(self.rope.len());
        for i in 0..self.rope.len() {
            let full = self.freqs(i, rows)?;
            let mut t = Tensor::empty(&self.dev, DType::F32, &[positions.len(), d])?;
            embedding_forward(&self.dev, &full, &pos, &mut t)?;
            tables.push(t);
        }
        Ok(tables)
    }

    /// The rotary angles of table `i` covering positions `0..s`.
    fn freqs(&mut self, i: usize, s: usize) -> Result<Tensor> {
        let d = self.cfg.head_dim;
        let (rope, table) = &mut self.rope[i];
        match table {
            Some(t) if t.shape()[0] >= s => Ok(t.clone()),
            _ => {
                let angles = rope.angles(d, 0..s);
                let t = Tensor::from_f32(&self.dev, DType::F32, &[s, d], &angles)?;
                *table = Some(t.clone());
                Ok(t)
            }
        }
    }

    /// The mean cross-entropy of next-token prediction over the targets that are not
    /// [`IGNORE_INDEX`], still on the device, and the context for [`DecoderLm::backward`].
    ///
    /// `ids`, `targets`: `[s, b]` (each column one sequence from position 0; targets usually
    /// the ids shifted by one). `micro` as for `Gpt::forward_loss_with`.
    ///
    /// # Errors
    /// [`Error::Shape`] for ids that are not `[s, b]`, `s` above `max_position_embeddings`, or
    /// targets of another shape; the modules' errors (FP8: `s · b` not a multiple of 16).
    pub fn forward_loss_with(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
    ) -> Result<(GptLoss, DecoderLmCtx)> {
        self.forward_impl(ids, targets, micro, None)
    }

    /// [`DecoderLm::forward_loss_with`] over packed documents (TE's `thd`, the `--pack thd` of
    /// fine-tuning): `ids`, `targets` `[tokens, 1]`, the documents one after another as
    /// `cu_seqlens` (`documents + 1` prefix sums from 0 to `tokens`) says, each attending within
    /// itself, token `t` at RoPE position `positions[t]` (usually its index in its document).
    /// The loss is the mean over the targets that are not [`IGNORE_INDEX`] (a document's last
    /// token usually has none).
    ///
    /// # Errors
    /// As [`DecoderLm::forward_loss_with`]; [`Error::Shape`] for ids that are not `[tokens, 1]`,
    /// `positions` of another length or at or past `max_position_embeddings`, and the
    /// attention's checks of `cu_seqlens`.
    pub fn forward_loss_thd(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        packing: Packing<'_>,
        micro: MicroBatch,
    ) -> Result<(GptLoss, DecoderLmCtx)> {
        let positions = packing.position_ids;
        let shape = |message: String| Error::Shape { op: MODEL, message };
        match *ids.shape() {
            [t, 1] if positions.len() == t => {}
            _ => {
                return Err(shape(format!(
                    "packed ids must be [tokens, 1] with a position each, got {:?} and {} positions",
                    ids.shape(),
                    positions.len()
                )))
            }
        }
        let max = self.cfg.max_position_embeddings;
        if let Some(p) = positions.iter().find(|&&p| p >= max) {
            return Err(shape(format!("position {p} is at or past max_position_embeddings = {max}")));
        }
        self.forward_impl(ids, targets, micro, Some(packing))
    }

    /// The forward of both: dense columns, or with `thd` packed documents.
    fn forward_impl(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
        thd: Option<Packing<'_>>,
    ) -> Result<(GptLoss, DecoderLmCtx)> {
        let MicroBatch { is_first_microbatch, grad_scale: loss_weight } = micro;
        let shape = |message: String| Error::Shape { op: MODEL, message };
        let [s, b] = *ids.shape() else {
            return Err(shape(format!("ids must be [s, b], got {:?}", ids.shape())));
        };
        // With context parallelism `s` is this rank's part of sequences of `s · cp` tokens.
        let positions = self.cp_positions(s, thd.is_some())?;
        let whole = positions.as_ref().map_or(s, |_| s * self.context_parallel_size());
        if thd.is_none() && whole > self.cfg.max_position_embeddings {
            return Err(shape(format!(
                "sequence length {whole} exceeds max_position_embeddings = {}",
                self.cfg.max_position_embeddings
            )));
        }
        if targets.shape() != ids.shape() {
            return Err(shape(format!(
                "targets must have the ids' shape {:?}, got {:?}",
                ids.shape(),
                targets.shape()
            )));
        }
        let h = self.cfg.hidden_size;
        let (mut x, tokens) = self.embedding.forward(ids)?;
        let scale = self.cfg.embedding_scale(self.dtype);
        if scale != 1.0 {
            scale_assign(&self.dev, &mut x, scale)?;
        }
        let freqs = match (thd, &positions) {
            (None, None) => (0..self.rope.len()).map(|i| self.freqs(i, s)).collect::<Result<Vec<_>>>()?,
            // This rank's tokens at their global positions (context parallelism).
            (None, Some(pos)) => self.freqs_at(pos)?,
            (Some(p), _) => self.freqs_at(p.position_ids)?,
        };
        let thd = thd.map(|p| (p.cu_seqlens.to_vec(), p.cu_seqlens_padded.map(<[usize]>::to_vec)));
        let inputs = LayerInputs { freqs, thd, is_first_microbatch };
        let plan = self.offload_plan()?;
        if let Some(z) = &mut self.zero3 {
            z.begin_forward(self.zero3_fp8_gather)?;
        }
        let mut layers: Vec<SavedLayer> = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let host = self.offload.host().filter(|_| plan.is_offloaded(l));
            // ZeRO-3: this layer's weights gathered, the next one's gather started.
            if let Some(z) = &mut self.zero3 {
                z.enter(l, layer, Some(l + 1))?;
            }
            let (y, c) = recompute::forward_layer(layer, &x, &inputs, self.recompute, host)?;
            if let Some(z) = &mut self.zero3 {
                z.leave(l, layer)?;
            }
            layers.push(c);
            // The previous input's copy out overlapped this layer's forward: free its device copy.
            if let Some(p) = plan.release_after_forward(l) {
                layers[p].release()?;
            }
            x = y;
        }
        if let Some(last) = layers.last_mut() {
            last.release()?;
        }
        // ZeRO-3: the backward's first layer gathered while the head runs.
        if let (Some(z), Some(last)) = (&mut self.zero3, self.layers.len().checked_sub(1)) {
            z.prefetch(last)?;
        }
        let inputs = self.recompute.is_full().then_some(inputs);
        let (y, final_norm) = self.final_norm.forward(&x)?;
        let y = y.reshape(&[s * b, h])?;
        if let Some(head) = self.tied_head.as_mut().filter(|_| self.tied_at != Some(self.embedding.version())) {
            head.params_mut().set_weight(self.embedding.weight().clone())?;
            self.tied_at = Some(self.embedding.version());
        }
        let head = match (&mut self.lm_head, &mut self.tied_head) {
            (Some(head), _) | (None, Some(head)) => head,
            (None, None) => return Err(Error::internal(MODEL, "no LM head")),
        };
        let opts = ForwardOptions { is_first_microbatch, fp8_output: false };
        // Without fp8_lm_head a disabled scope inside the caller's: the head in high precision,
        // and so its backward.
        let (logits, lm_head) = if self.fp8_lm_head {
            head.forward_with(&y, opts)?
        } else {
            fp8_autocast(false, Recipe::default(), || head.forward_with(&y, opts))?
        };
        let logits = logits.into_high(&self.dev, y.dtype())?;
        let counted = targets.host().iter().filter(|&&t| t != IGNORE_INDEX).count();
        let grad_scale = if counted == 0 { 0.0 } else { loss_weight / counted as f32 };
        // SAFETY: f32 has no invalid bit patterns; the kernel writes every token's loss.
        let mut loss = unsafe { self.dev.stream().alloc::<f32>(s * b) }?;
        // An FP8 head (per-tensor scales) reads E5M2 dlogits the loss writes where its cluster
        // kernel runs: |dlogits| ≤ grad_scale, so the power of two that maps the bound to E5M2's
        // largest value is their scale (no amax, no cast of 4 GB of BF16 gradients).
        let fp8_grad = self.fp8_lm_head
            && lm_head.takes_fp8_grad()
            && CrossEntropySpec::for_vocab(logits.dtype(), true, self.cfg.vocab_size, self.dev.arch()).cluster > 0;
        let dlogits = if fp8_grad {
            let e5m2 = DType::E5M2.fp8_max().unwrap_or(57344.0);
            let scale = if grad_scale > 0.0 { (e5m2 / grad_scale).log2().floor().exp2() } else { 1.0 };
            let mut codes = Tensor::empty(&self.dev, DType::E5M2, logits.shape())?;
            let grad = CrossEntropyGrad { dlogits: &mut codes, grad_scale: grad_scale * scale };
            cross_entropy(&self.dev, &logits, targets.data(), IGNORE_INDEX, &mut loss, Some(grad))?;
            let scale_inv = Arc::new(self.dev.stream().clone_htod(&[1.0 / scale])?);
            Dlogits::Fp8 { dy8: Float8Tensor::from_parts(codes, None, scale_inv)?, dtype: logits.dtype() }
        } else {
            let mut dlogits = Tensor::empty(&self.dev, logits.dtype(), logits.shape())?;
            let grad = CrossEntropyGrad { dlogits: &mut dlogits, grad_scale };
            cross_entropy(&self.dev, &logits, targets.data(), IGNORE_INDEX, &mut loss, Some(grad))?;
            Dlogits::High(dlogits)
        };
        let ctx = DecoderLmCtx { tokens, layers, inputs, final_norm, lm_head, dlogits, shape: [s, b, h] };
        Ok((GptLoss::new(loss, counted, None, self.dev.clone()), ctx))
    }

    /// [`DecoderLm::forward_loss_with`] of one whole batch, the loss copied to the host.
    ///
    /// # Errors
    /// As [`DecoderLm::forward_loss_with`].
    pub fn forward_loss(&mut self, ids: &TokenIds, targets: &TokenIds) -> Result<(f32, DecoderLmCtx)> {
        let (loss, ctx) = self.forward_loss_with(ids, targets, MicroBatch::default())?;
        Ok((loss.value()?, ctx))
    }

    /// Parameters (the tied head counted once).
    pub fn num_parameters(&self) -> usize {
        let mut n = 0;
        let _ = self.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            n += p.shape().iter().product::<usize>();
            Ok(())
        });
        n
    }
}
