//! Activation recompute of a [`DecoderLm`] ([`DecoderLm::set_recompute`]): full (TE's
//! `checkpoint` around every layer, Megatron-LM's full recompute) and selective (Megatron-LM's
//! `--recompute-granularity selective --recompute-modules mlp`: each layer's MLP block only).
//! What each layer's training forward keeps, the layer forward and backward of each mode, the
//! attention inputs a recomputed forward needs again, and the memory estimate that accounts for
//! it.

use super::layer::{AttentionBlockCtx, DecoderLayer, DecoderLayerCtx};
use super::DecoderLm;
use crate::decoder::DecoderConfig;
use te_nn::modules::{Fp8Replay, Recompute, ThdSeqlens};
use te_runtime::offload::{HostOffload, OffloadedTensor};
use te_runtime::{Error, Result, Tensor};

/// What the forward kept of one layer.
#[derive(Debug)]
pub(super) enum SavedLayer {
    /// The layer's whole context ([`Recompute::None`]).
    Ctx(Box<DecoderLayerCtx>),
    /// The layer's input (on the device, or offloaded to pinned host memory) and FP8 state;
    /// its forward runs again in the backward.
    Checkpoint { input: OffloadedTensor, fp8: Fp8Replay },
    /// The layer's input kept on the device, and FP8 state.
    Resident { input: Tensor, fp8: Fp8Replay },
    /// [`Recompute::Selective`]: the attention block's context, the MLP block's input
    /// (`[s, b, hidden]`, the hidden state after the attention's residual add, in the model's
    /// dtype) and its FP8 state, and the forward's `is_first_microbatch`; the MLP's forward runs
    /// again in the backward.
    Selective { attn: Box<AttentionBlockCtx>, mlp_input: Tensor, fp8: Fp8Replay, is_first_microbatch: Option<bool> },
}

impl SavedLayer {
    /// Frees an offloaded input's device copy once its copy out finished (stream ordered).
    pub(super) fn release(&mut self) -> Result<()> {
        match self {
            SavedLayer::Checkpoint { input, .. } => input.release(),
            _ => Ok(()),
        }
    }

    /// Starts copying an offloaded input back to the device.
    pub(super) fn prefetch(&mut self) -> Result<()> {
        match self {
            SavedLayer::Checkpoint { input, .. } => input.prefetch(),
            _ => Ok(()),
        }
    }
}

/// The attention inputs of a forward, owned, for the recomputed forwards of its backward: the
/// rotary tables (shared with the model's cache, no copy), the `thd` tables (host copies) and
/// `is_first_microbatch`.
#[derive(Debug)]
pub(super) struct LayerInputs {
    pub(super) freqs: Vec<Tensor>,
    /// `cu_seqlens` and `cu_seqlens_padded` of packed documents.
    pub(super) thd: Option<(Vec<usize>, Option<Vec<usize>>)>,
    pub(super) is_first_microbatch: Option<bool>,
}

impl LayerInputs {
    /// The `thd` tables as the attention takes them.
    pub(super) fn seqs(&self) -> Option<ThdSeqlens<'_>> {
        self.thd.as_ref().map(|(cu, padded)| ThdSeqlens {
            cu_seqlens_q_padded: padded.as_deref(),
            cu_seqlens_kv_padded: padded.as_deref(),
            ..ThdSeqlens::new(cu, cu)
        })
    }
}

/// One layer's forward on `x` in `mode`: its output and what the backward needs. Under
/// [`Recompute::Full`] the context is dropped once [`Fp8Replay::capture`] took over its FP8
/// bookkeeping (call it inside the forward's `fp8_autocast` scope), and with `offload` the
/// input starts its copy to pinned host memory before the layer's forward is issued. Under
/// [`Recompute::Selective`] only the MLP block's context is dropped, its FP8 bookkeeping
/// captured the same way.
pub(super) fn forward_layer(
    layer: &mut DecoderLayer,
    x: &Tensor,
    inputs: &LayerInputs,
    mode: Recompute,
    offload: Option<&HostOffload>,
) -> Result<(Tensor, SavedLayer)> {
    let freqs = &inputs.freqs[layer.rope];
    match mode {
        Recompute::Selective => forward_selective(layer, x, inputs),
        Recompute::None => {
            let (y, ctx) = layer.forward(x, (freqs, inputs.seqs()), inputs.is_first_microbatch)?;
            Ok((y, SavedLayer::Ctx(Box::new(ctx))))
        }
        Recompute::Full => {
            // The copy out starts before the layer's forward, after the kernel that wrote `x`.
            let offloaded = offload.map(|host| host.offload(x.clone())).transpose()?;
            let (y, ctx) = layer.forward(x, (freqs, inputs.seqs()), inputs.is_first_microbatch)?;
            let fp8 = Fp8Replay::capture(&*layer, None)?;
            drop(ctx);
            match offloaded {
                Some(input) => Ok((y, SavedLayer::Checkpoint { input, fp8 })),
                None => Ok((y, SavedLayer::Resident { input: x.clone(), fp8 })),
            }
        }
    }
}

/// [`forward_layer`] under [`Recompute::Selective`]: the attention block, then the MLP block,
/// whose context is dropped once [`Fp8Replay::capture`] took over the MLP's FP8 bookkeeping.
fn forward_selective(layer: &mut DecoderLayer, x: &Tensor, inputs: &LayerInputs) -> Result<(Tensor, SavedLayer)> {
    let freqs = &inputs.freqs[layer.rope];
    let is_first_microbatch = inputs.is_first_microbatch;
    let (h, attn) = layer.forward_attention(x, (freqs, inputs.seqs()), is_first_microbatch)?;
    let (y, mlp) = layer.forward_mlp(&h, is_first_microbatch)?;
    let fp8 = Fp8Replay::capture(layer.mlp_module(), None)?;
    drop(mlp);
    Ok((y, SavedLayer::Selective { attn: Box::new(attn), mlp_input: h, fp8, is_first_microbatch }))
}

/// One layer's backward for `dy` (a checkpointed layer runs its forward again on `inputs`
/// first, with the first forward's FP8 scales; under selective recompute its MLP block's
/// forward runs again just before the MLP's backward): the input gradient.
pub(super) fn backward_layer(
    layer: &mut DecoderLayer,
    saved: SavedLayer,
    dy: &Tensor,
    inputs: Option<&LayerInputs>,
) -> Result<Tensor> {
    match saved {
        SavedLayer::Ctx(c) => layer.backward(*c, dy),
        SavedLayer::Checkpoint { input, fp8 } => recomputed(layer, input.fetch()?, fp8, dy, inputs),
        SavedLayer::Resident { input, fp8 } => recomputed(layer, input, fp8, dy, inputs),
        SavedLayer::Selective { attn, mlp_input, mut fp8, is_first_microbatch } => {
            // The MLP block's forward again with the first forward's FP8 scales, its backward,
            // the recompute's FP8 hold released, then the attention block's backward (the
            // order of the backward without recompute).
            let ((_, mlp), hold) = fp8.replay(|| layer.forward_mlp(&mlp_input, is_first_microbatch))?;
            let dh = layer.backward_mlp(mlp, dy)?;
            fp8.finish(hold)?;
            layer.backward_attention(*attn, &dh)
        }
    }
}

/// The backward of a checkpointed layer: its forward again on `input` with the first forward's
/// FP8 scales, then its backward.
fn recomputed(
    layer: &mut DecoderLayer,
    input: Tensor,
    mut fp8: Fp8Replay,
    dy: &Tensor,
    inputs: Option<&LayerInputs>,
) -> Result<Tensor> {
    let inputs = inputs.ok_or_else(|| Error::internal("DecoderLm", "a checkpointed layer without inputs"))?;
    let freqs = &inputs.freqs[layer.rope];
    let (recomputed, hold) =
        fp8.replay(|| layer.forward(&input, (freqs, inputs.seqs()), inputs.is_first_microbatch))?;
    let (_, ctx) = recomputed;
    let dx = layer.backward(ctx, dy)?;
    fp8.finish(hold)?;
    Ok(dx)
}

impl DecoderLm {
    /// What the training forward keeps for the backward (default [`Recompute::None`]):
    /// [`Recompute::Full`] keeps each layer's input only (`[s, b, hidden]` in the model's
    /// dtype) and runs the layer's forward again in the backward with the same FP8 scales (no
    /// amax history updated twice; see [`te_nn::modules::recompute`]): the same losses and
    /// gradients bit for bit, one more forward of the layers a step, peak activation memory of
    /// the layer inputs plus one layer's context. [`Recompute::Selective`] (Megatron-LM's
    /// `--recompute-granularity selective --recompute-modules mlp`) keeps each layer's attention
    /// context and the MLP block's input (`[s, b, hidden]`, the hidden state after the
    /// attention's residual add), and runs the MLP block's forward (the `LayerNormMLP` and
    /// Gemma's post-MLP norm) again just before its backward, with the same FP8 replay: the same
    /// bits again, one more MLP forward a layer, peak activation memory of the attention
    /// contexts and MLP inputs plus one MLP's context. Applies to the next forward. The backward
    /// runs outside any `fp8_autocast` scope or inside the forward's. Works with context
    /// parallelism in every mode (the MLP is token-local).
    ///
    /// # Errors
    /// [`Error::Config`] for a mode other than [`Recompute::Full`] while the layers are
    /// sharded ([`DecoderLm::set_zero3`]); FP8 attention (`fp8_dpa`) with recompute (full or
    /// selective) is refused at the forward ([`Error::Config`]), and so is the activation
    /// offload without [`Recompute::Full`] ([`DecoderLm::set_offload_activations`]).
    pub fn set_recompute(&mut self, mode: Recompute) -> Result<()> {
        if self.zero3.is_some() && !mode.is_full() {
            return Err(Error::Config {
                module: "DecoderLm",
                message: "the layers are sharded (ZeRO-3), which needs full recompute: call zero3_unshard first".into(),
            });
        }
        self.recompute = mode;
        Ok(())
    }

    /// The activation recompute mode ([`DecoderLm::set_recompute`]).
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// [`DecoderLm::training_bytes`] for a run in recompute mode `mode`: with
    /// [`Recompute::Full`], the saved activations of all layers but one are replaced by the
    /// layer inputs (`t · h` BF16 elements a layer); with [`Recompute::Selective`], the MLP
    /// blocks' saved activations of all layers but one are dropped (the MLP input they keep is
    /// the residual the estimate already counts). The per-layer activation bytes are the
    /// estimate's own (`(6h + sandwich + qkv + 2·(heads + groups)·d + heads·d + fc1 + ffn) · 2 +
    /// 4 · heads` bytes a token, of which the MLP block's are `(2h + sandwich / 2 + fc1 + ffn) ·
    /// 2`; one home in `decoder/train/memory.rs`).
    pub fn training_bytes_with(cfg: &DecoderConfig, batch: usize, seq: usize, fp8: bool, mode: Recompute) -> u64 {
        let base = Self::training_bytes(cfg, batch, seq, fp8);
        let (h, layers) = (cfg.hidden_size as f64, cfg.num_layers as f64);
        let t = batch as f64 * seq as f64;
        let (dropped, inputs) = match mode {
            Recompute::None => return base,
            Recompute::Full => (Self::saved_bytes_per_layer_token(cfg), h * 2.0),
            Recompute::Selective => (Self::saved_mlp_bytes_per_layer_token(cfg), 0.0),
        };
        let dropped = t * (layers - 1.0).max(0.0) * dropped;
        (base as f64 - dropped + t * layers * inputs).max(0.0) as u64
    }
}
