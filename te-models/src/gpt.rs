//! A GPT (GPT-2's architecture, TE's building blocks): token embedding plus a learned absolute
//! position embedding, `num_layers` pre-LN [`TransformerLayer`]s (causal self-attention, GELU
//! MLP, biases), a final LayerNorm, an LM head without bias (not tied to the embedding) and the
//! fused cross-entropy. Byte-level vocabulary (256) by default.
//!
//! Positions: learned absolute (`position_embedding.weight`, `[seq_length, hidden]`, GPT-2's
//! `wpe`), added to the token embeddings; the alternative, RoPE through
//! [`te_nn::modules::AttentionInputs::rotary_pos_emb`], is not used here. FP8: wrap
//! [`Gpt::forward_loss`] and [`Gpt::backward`] in [`te_nn::fp8::fp8_autocast`]; the GEMMs of the
//! layers (and the LM head with [`GptConfig::fp8_lm_head`]) then run in FP8 (every GEMM dim,
//! `tokens = s * b` included, must be a multiple of 16; the byte vocabulary, 256, is).
//! Embeddings, norms, softmax and the loss stay in high precision, as in TE.
//!
//! Sources followed: GPT-2 (Radford et al. 2019; `openai/gpt-2` `model.py`), Megatron-LM's
//! `GPTModel` (`[s, b, h]` layout, `ignore_index`-style loss mask), nanoGPT's presets.

use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::prewarm::sorted;
use te_codegen::spec::{ArgmaxSpec, CrossEntropySpec, DecodeAttnSpec, ElementwiseSpec};
use te_codegen::DType;
use te_nn::fp8::{fp8_autocast, Recipe};
use te_nn::modules::{
    AttentionInputs, Embedding, EmbeddingConfig, EmbeddingCtx, ForwardOptions, KernelSpec, KernelTarget, Linear,
    LinearConfig, LinearCtx, Module, MoeConfig, MoeMLPConfig, Norm, NormConfig, NormCtx, NormKind, Recompute, TokenIds,
    TransformerLayer, TransformerLayerConfig, TransformerLayerCtx,
};
use te_nn::parallel::{SequenceParallel, TpConfig};
use te_runtime::graph::HostCopies;
use te_runtime::ops::cross_entropy::{cross_entropy, CrossEntropyGrad};
use te_runtime::ops::elementwise::add;
use te_runtime::{Device, Error, Result, Tensor};

mod config;
mod generate;
mod memory;
mod offload;
mod recompute;

pub use config::GptConfig;

pub use generate::GenerateOptions;

const MODEL: &str = "Gpt";

/// A target with this value is left out of the loss (and its gradient): padding.
pub const IGNORE_INDEX: i32 = -1;

/// How [`Gpt::forward_loss_with`] treats one micro-batch of an optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MicroBatch {
    /// Goes to every GEMM (TE's argument): `Some(true)` on a step's first micro-batch casts each
    /// FP8 weight once and caches it, `Some(false)` on the others reuses the cache (the weights
    /// do not change within a step), `None` (the default) casts every call.
    pub is_first_microbatch: Option<bool>,
    /// Weight of this micro-batch's mean loss in the step's objective: the gradient backward
    /// accumulates is `grad_scale ×` the gradient of the micro-batch's mean loss. `1 / n` for
    /// `n` micro-batches of equal size makes the step's gradient that of the mean loss over all
    /// of them (Megatron divides the loss by the number of micro-batches the same way). Default 1.
    pub grad_scale: f32,
}

impl Default for MicroBatch {
    fn default() -> Self {
        Self { is_first_microbatch: None, grad_scale: 1.0 }
    }
}

/// The mean loss of [`Gpt::forward_loss_with`], still on the device: per-token losses
/// `[s · b]` (f32, 0 for ignored targets) and how many targets counted.
#[derive(Debug)]
pub struct GptLoss {
    per_token: CudaSlice<f32>,
    counted: usize,
    /// f32 `[layers]`: each MoE layer's load-balancing loss (`None` for a dense model).
    aux: Option<CudaSlice<f32>>,
    dev: Arc<Device>,
}

impl GptLoss {
    /// A loss of `counted` targets from their per-token losses (and the MoE aux losses).
    pub(crate) fn new(
        per_token: CudaSlice<f32>,
        counted: usize,
        aux: Option<CudaSlice<f32>>,
        dev: Arc<Device>,
    ) -> Self {
        Self { per_token, counted, aux, dev }
    }

    /// The mean over the counted targets (0 when none counted); copies `s · b` floats to the
    /// host, waiting for the work issued before on the stream.
    ///
    /// # Errors
    /// Copy failures (and a failed kernel surfacing there).
    pub fn value(&self) -> Result<f32> {
        Ok(self.lm_value()? + self.aux_value()?)
    }

    /// The language-model loss alone: the mean cross-entropy over the counted targets (0 when
    /// none counted), without the MoE aux losses (what a dense model's [`GptLoss::value`] is).
    ///
    /// # Errors
    /// Copy failures.
    pub fn lm_value(&self) -> Result<f32> {
        if self.counted == 0 {
            return Ok(0.0);
        }
        let loss = self.dev.stream().dtoh(&self.per_token)?;
        Ok((loss.iter().map(|&l| f64::from(l)).sum::<f64>() / self.counted as f64) as f32)
    }

    /// The sum of the MoE layers' load-balancing losses (coefficients included; 0 for a dense
    /// model): the part of [`GptLoss::value`] that is not the language-model loss.
    ///
    /// # Errors
    /// Copy failures.
    pub fn aux_value(&self) -> Result<f32> {
        match &self.aux {
            Some(aux) => Ok(self.dev.stream().dtoh(aux)?.iter().map(|&l| f64::from(l)).sum::<f64>() as f32),
            None => Ok(0.0),
        }
    }
}

/// What [`Gpt::forward_loss`] saves for [`Gpt::backward`]: every part's context (or, under
/// [`Recompute::Full`], each layer's input) and the loss gradient of the logits.
#[derive(Debug)]
pub struct GptCtx {
    tokens: EmbeddingCtx,
    positions: EmbeddingCtx,
    layers: Vec<recompute::SavedLayer>,
    /// The micro-batch's weight, the MoE aux losses' gradient (what a recomputed layer gets).
    aux_grad: f32,
    final_norm: NormCtx,
    lm_head: LinearCtx,
    dlogits: Tensor,
    shape: [usize; 3],
}

/// The GPT: hidden states `[s, b, hidden]` (Megatron's layout), parameters named
/// `embedding.weight`, `position_embedding.weight`, `layers.N.*` (TE's names), `final_norm.*`,
/// `lm_head.weight`.
#[derive(Debug, te_nn::Module)]
pub struct Gpt {
    embedding: Embedding,
    position_embedding: Embedding,
    layers: Vec<TransformerLayer>,
    final_norm: Norm,
    lm_head: Linear,
    #[module(skip)]
    cfg: GptConfig,
    /// The layers' tensor parallelism (see [`Gpt::with_tensor_parallel`]).
    #[module(skip)]
    tp: Option<TpConfig>,
    /// The token shards of the layers and the final norm (sequence parallelism; none without).
    #[module(skip)]
    sequence: SequenceParallel,
    /// The position ids of the latest `[s, b]` shape, with their grouping for the position
    /// embedding's backward: built and uploaded once per shape, not per step (a CUDA graph of
    /// the step then makes no host upload).
    #[module(skip)]
    positions: Option<TokenIds>,
    /// What the training forward keeps of each layer ([`Gpt::set_recompute`]).
    #[module(skip)]
    recompute: Recompute,
    /// The first layers whose saved inputs go to pinned host memory, and the side stream and
    /// buffers that move them ([`Gpt::set_offload_activations`]).
    #[module(skip)]
    offload: te_runtime::offload::LayerOffload,
    #[module(skip)]
    dev: Arc<Device>,
}

impl Gpt {
    /// A freshly initialized model (GPT-2's init: embeddings `N(0, 0.02)` and `N(0, 0.01)`, TE's
    /// layer init, LM head `N(0, 0.023)`).
    ///
    /// # Errors
    /// [`Error::Config`] for a vocabulary outside `[1, i32::MAX]`, no layers or positions, and the
    /// errors of the parts (heads that do not divide the hidden size, a dropout outside
    /// `[0, 1]`, a non-high-precision dtype).
    pub fn new(dev: &Arc<Device>, cfg: GptConfig) -> Result<Self> {
        Self::build(dev, cfg, None)
    }

    /// A model whose layers are tensor-parallel over `tp`'s group (Megatron-LM's GPT with TE's
    /// layers, [`te_nn::modules::TransformerLayerConfig::tp`]): each rank holds its heads and
    /// ffn features of every layer, initialized as the slices of [`Gpt::new`]'s weights. The
    /// embeddings, the final norm and the LM head are replicated (the 256-byte vocabulary is not
    /// worth splitting). Every rank of the group takes the same ids and targets and computes the
    /// same loss. Under sequence parallelism each rank runs the layers and the final norm on
    /// its `s / tp` positions (the embeddings' output is split along `s`, the final norm's
    /// all-gathered for the LM head).
    ///
    /// # Errors
    /// As [`Gpt::new`]; [`Error::Config`] for a group size that does not divide the heads or
    /// the ffn size, or `moe` (MoE layers are not tensor-parallel yet).
    pub fn with_tensor_parallel(dev: &Arc<Device>, cfg: GptConfig, tp: TpConfig) -> Result<Self> {
        Self::build(dev, cfg, Some(tp))
    }

    fn build(dev: &Arc<Device>, cfg: GptConfig, tp: Option<TpConfig>) -> Result<Self> {
        cfg.check()?;
        let (h, dt, seed) = (cfg.hidden_size, cfg.params_dtype, cfg.seed);
        let embedding =
            Embedding::new(dev, EmbeddingConfig { params_dtype: dt, seed, ..EmbeddingConfig::new(cfg.vocab_size, h) })?;
        let position_embedding = Embedding::new(
            dev,
            EmbeddingConfig {
                params_dtype: dt,
                init_std: 0.01,
                seed: seed + 1,
                ..EmbeddingConfig::new(cfg.seq_length, h)
            },
        )?;
        let layer = |i| TransformerLayer::new(dev, TransformerLayerConfig { tp: tp.clone(), ..cfg.layer_config(i) });
        let layers = (0..cfg.num_layers).map(layer).collect::<Result<Vec<_>>>()?;
        let sequence = SequenceParallel::of(tp.as_ref());
        let mut final_norm = Norm::layer_norm(dev, NormConfig { params_dtype: dt, ..NormConfig::new(h) })?;
        final_norm.set_sequence_parallel(sequence.clone());
        let lm_head = Linear::new(
            dev,
            LinearConfig { bias: false, params_dtype: dt, seed: seed + 2, ..LinearConfig::new(h, cfg.vocab_size) },
        )?;
        Ok(Self {
            embedding,
            position_embedding,
            layers,
            final_norm,
            lm_head,
            cfg,
            tp,
            sequence,
            positions: None,
            recompute: Recompute::None,
            offload: te_runtime::offload::LayerOffload::default(),
            dev: dev.clone(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The layers' tensor parallelism, `None` for a model on one GPU.
    pub fn tensor_parallel(&self) -> Option<&TpConfig> {
        self.tp.as_ref()
    }

    /// Every kernel [`Gpt::forward_loss`] and [`Gpt::backward`] run for `target`, and the decode
    /// attention of [`Gpt::generate`] (the layers get
    /// no rotary angles: positions come from the embedding), sorted and deduplicated: those of
    /// the parameterized parts ([`Module::kernel_specs_for`]) and those the model runs itself,
    /// the sum of the token and position embeddings and the cross-entropy.
    /// [`GptConfig::kernel_specs`] gives the same list without a device.
    pub fn all_kernel_specs(&self, target: &KernelTarget) -> Vec<KernelSpec> {
        let target = KernelTarget { rotary: false, ..*target };
        let mut specs = Vec::new();
        self.kernel_specs(&target, &mut specs);
        self.cfg.loss_kernel_specs(&target.with_dtype(self.cfg.params_dtype), &mut specs);
        sorted(specs)
    }

    /// Training mode (the default: dropout applies) or evaluation mode (no dropout, the dropout
    /// streams do not advance: evaluating between steps leaves the training run unchanged);
    /// PyTorch's `model.train(mode)` / `model.eval()`.
    pub fn set_training(&mut self, training: bool) {
        for layer in &mut self.layers {
            layer.set_training(training);
        }
    }

    /// The dropout stream position (training-mode forwards so far times the masks each draws;
    /// the same in every layer, each of which has its own seed). A training checkpoint stores
    /// it; [`Gpt::set_dropout_offset`] restores it.
    pub fn dropout_offset(&self) -> u64 {
        self.layers.first().map_or(0, TransformerLayer::dropout_offset)
    }

    /// Moves every layer's dropout stream to `offset` (see [`Gpt::dropout_offset`]).
    pub fn set_dropout_offset(&mut self, offset: u64) {
        for layer in &mut self.layers {
            layer.set_dropout_offset(offset);
        }
    }

    /// The mean cross-entropy of next-token prediction over the targets that are not
    /// [`IGNORE_INDEX`] (0 when all are), plus (with `moe`) the layers' load-balancing losses,
    /// and the context for [`Gpt::backward`].
    ///
    /// `ids`, `targets`: `[s, b]` with `s ≤ seq_length` (targets are usually the ids shifted by
    /// one position). The loss is copied to the host (one stream synchronization).
    ///
    /// # Errors
    /// [`Error::Shape`] for ids that are not `[s, b]`, `s > seq_length`, or targets of another
    /// shape; the errors of the parts (FP8: `s * b` not a multiple of 16).
    pub fn forward_loss(&mut self, ids: &TokenIds, targets: &TokenIds) -> Result<(f32, GptCtx)> {
        let (loss, ctx) = self.forward_loss_with(ids, targets, MicroBatch::default())?;
        Ok((loss.value()?, ctx))
    }

    /// [`Gpt::forward_loss`] for one micro-batch of a step (gradient accumulation, see
    /// [`MicroBatch`]) that does not wait for the device: the loss stays there until
    /// [`GptLoss::value`] reads it (after the backward and the optimizer step, so the host keeps
    /// issuing work). The loss is the micro-batch's own mean, unscaled.
    ///
    /// # Errors
    /// As [`Gpt::forward_loss`].
    pub fn forward_loss_with(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
    ) -> Result<(GptLoss, GptCtx)> {
        let MicroBatch { is_first_microbatch, grad_scale: loss_weight } = micro;
        let shape = |message: String| Error::Shape { op: MODEL, message };
        let [s, b] = *ids.shape() else {
            return Err(shape(format!("ids must be [s, b], got {:?}", ids.shape())));
        };
        if s > self.cfg.seq_length {
            return Err(shape(format!("sequence length {s} exceeds seq_length = {}", self.cfg.seq_length)));
        }
        if targets.shape() != ids.shape() {
            return Err(shape(format!(
                "targets must have the ids' shape {:?}, got {:?}",
                ids.shape(),
                targets.shape()
            )));
        }
        let h = self.cfg.hidden_size;
        let pos = self.positions(s, b)?;
        let (tok, tokens) = self.embedding.forward(ids)?;
        let (wpe, positions) = self.position_embedding.forward(&pos)?;
        let mut x = Tensor::empty(&self.dev, self.cfg.params_dtype, &[s, b, h])?;
        add(&self.dev, &tok, &wpe, &mut x)?;
        // Sequence parallel: the layers run on this rank's positions `[s·r/n, s·(r+1)/n)`.
        x = self.sequence.scatter(MODEL, &self.dev, &x)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        let mut aux = match self.cfg.moe {
            Some(_) => Some(self.dev.stream().alloc_zeros::<f32>(self.layers.len())?),
            None => None,
        };
        let dev = &self.dev;
        let plan = offload::plan(self.layers.len(), self.recompute, self.offload.layers())?;
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let mut keep = |c: &mut TransformerLayerCtx| -> Result<()> {
                // The aux loss enters the objective with the micro-batch's weight.
                c.set_aux_loss_grad(loss_weight);
                if let (Some(all), Some(l)) = (aux.as_mut(), c.aux_loss()) {
                    let mut slot = all.slice_mut(i..i + 1);
                    dev.stream().memcpy_dtod(l, &mut slot)?;
                }
                Ok(())
            };
            let inputs = AttentionInputs { is_first_microbatch, ..Default::default() };
            let (y, mut saved) = recompute::forward_layer(layer, &x, inputs, self.recompute, &mut keep)?;
            if let Some(host) = self.offload.host().filter(|_| plan.is_offloaded(i)) {
                saved.offload(host)?;
            }
            layers.push(saved);
            // The previous input's copy out overlapped this layer's forward: free its device copy.
            if let Some(p) = plan.release_after_forward(i) {
                layers[p].release()?;
            }
            x = y;
        }
        if let Some(last) = layers.last_mut() {
            last.release()?;
        }
        let (y, final_norm) = self.final_norm.forward(&x)?;
        // The LM head (replicated) takes every position.
        let y = self.sequence.gather(&y)?;
        let opts = ForwardOptions { is_first_microbatch, fp8_output: false };
        let y = y.reshape(&[s * b, h])?;
        let lm_head = &mut self.lm_head;
        let (logits, lm_head) = if self.cfg.fp8_lm_head {
            lm_head.forward_with(&y, opts)?
        } else {
            // A disabled scope inside the caller's: high precision here, and so in backward.
            fp8_autocast(false, Recipe::default(), || lm_head.forward_with(&y, opts))?
        };
        let logits = logits.into_high(&self.dev, y.dtype())?;
        let counted = targets.host().iter().filter(|&&t| t != IGNORE_INDEX).count();
        let grad_scale = if counted == 0 { 0.0 } else { loss_weight / counted as f32 };
        let mut dlogits = Tensor::empty(&self.dev, logits.dtype(), logits.shape())?;
        // SAFETY: f32 has no invalid bit patterns; the kernel writes every token's loss.
        let mut loss = unsafe { self.dev.stream().alloc::<f32>(s * b) }?;
        let grad = CrossEntropyGrad { dlogits: &mut dlogits, grad_scale };
        cross_entropy(&self.dev, &logits, targets.data(), IGNORE_INDEX, &mut loss, Some(grad))?;
        let aux_grad = loss_weight;
        let ctx = GptCtx { tokens, positions, layers, aux_grad, final_norm, lm_head, dlogits, shape: [s, b, h] };
        Ok((GptLoss { per_token: loss, counted, aux, dev: self.dev.clone() }, ctx))
    }

    /// The position ids of `[s, b]` tokens (row-major element `i` is at position `i / b`), from
    /// the cache when the shape is the latest one.
    fn positions(&mut self, s: usize, b: usize) -> Result<TokenIds> {
        if let Some(p) = self.positions.as_ref().filter(|p| p.shape() == [s, b]) {
            return Ok(p.clone());
        }
        let pos: Vec<i32> = (0..s * b).map(|i| (i / b) as i32).collect();
        let pos = TokenIds::from_host(&self.dev, &[s, b], &pos)?.with_grad_index(&self.dev)?;
        self.positions = Some(pos.clone());
        Ok(pos)
    }

    /// Backward of the mean loss: every parameter gradient accumulates (call
    /// [`te_nn::Module::zero_grad`] between steps).
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another model or one made before a weight update;
    /// the errors of the parts.
    pub fn backward(&mut self, ctx: GptCtx) -> Result<()> {
        self.backward_with(ctx, &mut |_| Ok(()))
    }

    /// [`Gpt::backward`] that calls `grads_ready` with each part once its gradients of this
    /// backward are complete, in the order they complete: the LM head, the final norm, the
    /// layers from the last to the first, the token embedding, the position embedding. A
    /// data-parallel step starts each part's gradient reduction there, overlapping the rest of
    /// the backward (`te_nn::parallel::DataParallel::reduce_grads`; the hook's work is issued on
    /// the device's stream or after it, never waited for here).
    ///
    /// # Errors
    /// As [`Gpt::backward`]; the hook's first error (the backward stops there).
    pub fn backward_with(
        &mut self,
        ctx: GptCtx,
        grads_ready: &mut dyn FnMut(&mut dyn Module) -> Result<()>,
    ) -> Result<()> {
        let d = self.lm_head.backward(ctx.lm_head, &ctx.dlogits)?;
        grads_ready(&mut self.lm_head)?;
        // Sequence parallel: the LM head's input gradient is whole on every rank; this rank's
        // positions go back through its shard of the layers, whose input gradients are
        // all-gathered for the (replicated) embeddings.
        let d = self.sequence.scatter(MODEL, &self.dev, &d.reshape(&ctx.shape)?)?;
        let mut d = self.final_norm.backward(ctx.final_norm, &d)?;
        grads_ready(&mut self.final_norm)?;
        let mut saved = ctx.layers;
        if saved.len() != self.layers.len() {
            return Err(Error::Context {
                module: MODEL,
                message: format!("a context of {} layers for a model of {}", saved.len(), self.layers.len()),
            });
        }
        while let Some(s) = saved.pop() {
            // Layer l − 1's offloaded input comes back while layer l's backward runs.
            if let Some(prev) = saved.last_mut() {
                prev.prefetch()?;
            }
            let layer = &mut self.layers[saved.len()];
            d = recompute::backward_layer(layer, s, &d, ctx.aux_grad)?;
            grads_ready(layer)?;
        }
        let d = self.sequence.gather(&d)?;
        self.embedding.backward(ctx.tokens, &d)?;
        grads_ready(&mut self.embedding)?;
        self.position_embedding.backward(ctx.positions, &d)?;
        grads_ready(&mut self.position_embedding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_the_documented_sizes() {
        assert_eq!(GptConfig::tiny().num_parameters(), 2 * (12 * 128 * 128 + 13 * 128) + (256 + 128 + 256) * 128 + 256);
        let small = GptConfig::small().num_parameters();
        assert!((85_000_000..87_000_000).contains(&small), "{small}");
        let large = GptConfig::large().num_parameters();
        assert!(large >= 1_000_000_000, "large has {large} parameters");
        assert!(GptConfig::large().hidden_size >= 2048);
        for c in [GptConfig::tiny(), GptConfig::small(), GptConfig::large()] {
            c.check().unwrap();
            assert_eq!(c.vocab_size, 256);
            assert_eq!(c.hidden_size % c.num_attention_heads, 0);
        }
    }

    #[test]
    fn moe_small_has_dense_small_active_parameters() {
        let (moe, small) = (GptConfig::moe_small(), GptConfig::small());
        let total = moe.num_parameters();
        assert!((255_000_000..257_000_000).contains(&total), "{total}");
        // Active: 2 of 8 experts per token.
        let m = moe.moe.unwrap();
        let per_expert = te_nn::modules::MoeMLPConfig::new(768, 1536, 8, 2).num_parameters() - 2 * 768 - 8 * 768;
        let active = total - moe.num_layers * (m.num_experts - m.topk) * per_expert / m.num_experts;
        let dense = small.num_parameters();
        // The router (8 · 768) and the second active expert's fc2 bias (768) per layer.
        assert_eq!(active - dense, 12 * (8 * 768 + 768), "{active} vs {dense}");
        assert_eq!(GptConfig::by_name("moe-small"), Some(moe.clone()));
        assert!(GptConfig::PRESETS.iter().all(|p| GptConfig::by_name(p).is_some()));
        // Config files without the table read as dense.
        let text = toml::to_string(&small).unwrap();
        assert!(!text.contains("moe"));
        assert_eq!(toml::from_str::<GptConfig>(&text).unwrap(), small);
        assert_eq!(toml::from_str::<GptConfig>(&toml::to_string(&moe).unwrap()).unwrap(), moe);
        let specs = moe.kernel_specs(&KernelTarget::new(1024, te_runtime::Arch::Sm90a));
        assert!(specs.iter().any(|s| matches!(s, KernelSpec::MoeRouter(_))));
        assert!(specs.iter().any(|s| matches!(s, KernelSpec::MoePermute(_))));
    }

    #[test]
    fn preset_kernels_include_the_embedding_and_the_loss() {
        use te_codegen::spec::{ElementwiseSpec, EmbeddingSpec, FlashAttnSpec};
        let cfg = GptConfig::small();
        let target = KernelTarget::new(cfg.seq_length, te_runtime::Arch::Sm90a);
        let specs = cfg.kernel_specs(&target);
        let arch = target.arch;
        for spec in [
            CrossEntropySpec::new(DType::BF16, true, arch).into(),
            EmbeddingSpec::forward(DType::BF16, arch).into(),
            EmbeddingSpec::backward(DType::BF16, DType::BF16, arch).into(),
            // Attention on the fused backend (head_dim 64, bf16).
            FlashAttnSpec::new(te_codegen::spec::Direction::Bwd, DType::BF16, 64, arch).into(),
            ElementwiseSpec::add(DType::BF16, DType::BF16, DType::BF16, arch).into(),
        ] {
            assert!(specs.contains(&spec), "{spec:?} missing");
        }
        assert!(specs.iter().all(|s| !matches!(s, KernelSpec::Rope(_) | KernelSpec::Optimizer(_))));
        assert!(specs.contains(&DecodeAttnSpec::new(DType::BF16, 64, arch).into()), "generation's decode kernels");
        assert!(specs.contains(&ArgmaxSpec::new(DType::BF16, arch).into()), "greedy generation's argmax");
        // The decode GEMVs of one and two sequences, named as the launcher names them.
        use te_codegen::spec::{GemvEpilogue, GemvPrologue, NormKind};
        use te_runtime::ops::gemv::gemv_spec;
        let ln = (GemvPrologue::Norm, NormKind::LayerNorm, false);
        let residual_ln = (GemvPrologue::ResidualNorm, NormKind::LayerNorm, false);
        let plain = (GemvPrologue::None, NormKind::LayerNorm, false);
        for m in [1, 2] {
            for spec in [
                gemv_spec(arch, DType::BF16, (768, m), ln, (true, GemvEpilogue::Store)),
                gemv_spec(arch, DType::BF16, (768, m), plain, (true, GemvEpilogue::Store)),
                gemv_spec(
                    arch,
                    DType::BF16,
                    (768, m),
                    residual_ln,
                    (true, GemvEpilogue::Act(te_codegen::spec::Activation::Gelu)),
                ),
                gemv_spec(arch, DType::BF16, (3072, m), plain, (true, GemvEpilogue::Residual)),
            ] {
                assert!(specs.contains(&spec.into()), "{spec:?} missing");
            }
        }
        let f32_specs = GptConfig { params_dtype: DType::F32, ..GptConfig::tiny() }.kernel_specs(&target);
        assert!(f32_specs.contains(&CrossEntropySpec::new(DType::F32, true, arch).into()), "the model's dtype applies");
    }

    #[test]
    fn bad_configs_are_refused_before_any_allocation() {
        let e = GptConfig { vocab_size: 0, ..GptConfig::tiny() }.check().unwrap_err();
        assert!(e.to_string().contains("vocab_size = 0"), "{e}");
        // Gemma 3's 262,144 classes are fine; past i32::MAX the targets cannot name them.
        GptConfig { vocab_size: 262_144, ..GptConfig::tiny() }.check().unwrap();
        let e = GptConfig { vocab_size: i32::MAX as usize + 1, ..GptConfig::tiny() }.check().unwrap_err();
        assert!(e.to_string().contains("vocab_size = 2147483648"), "{e}");
        let e = GptConfig { num_layers: 0, ..GptConfig::tiny() }.check().unwrap_err();
        assert!(e.to_string().contains("num_layers"), "{e}");
    }

    #[test]
    fn the_list_holds_the_loss_and_the_parts_kernels() {
        use te_codegen::Arch;
        let t = KernelTarget::new(128, Arch::Sm90a);
        let specs = GptConfig::tiny().kernel_specs(&t);
        assert!(specs.contains(&CrossEntropySpec::new(DType::BF16, true, Arch::Sm90a).into()));
        assert!(specs.contains(&ElementwiseSpec::add(DType::BF16, DType::BF16, DType::BF16, Arch::Sm90a).into()));
        assert!(specs.windows(2).all(|w| w[0] < w[1]), "sorted and deduplicated");
    }
}
