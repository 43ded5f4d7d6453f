//! Full activation recompute of a [`Gpt`] ([`Gpt::set_recompute`]; TE's `checkpoint` around
//! every layer, Megatron-LM's `--recompute-granularity full --recompute-method uniform
//! --recompute-num-layers 1`): what each layer's training forward keeps, the layer forward and
//! backward of either mode, and the memory estimate that accounts for it.

use super::{Gpt, GptConfig, MODEL};
use te_nn::modules::{AttentionInputs, Recompute, TransformerLayer, TransformerLayerCheckpoint, TransformerLayerCtx};
use te_runtime::{Error, Result, Tensor};

/// What [`Gpt::forward_loss_with`] kept of one layer for the backward.
#[derive(Debug)]
pub(super) enum SavedLayer {
    /// The layer's whole context ([`Recompute::None`]).
    Ctx(Box<TransformerLayerCtx>),
    /// The layer's input, its forward run again in the backward ([`Recompute::Full`]).
    Checkpoint(TransformerLayerCheckpoint),
}

impl SavedLayer {
    /// Starts the copy of a checkpointed layer's input to pinned host memory.
    pub(super) fn offload(&mut self, host: &te_runtime::offload::HostOffload) -> Result<()> {
        match self {
            SavedLayer::Checkpoint(k) => k.offload(host),
            SavedLayer::Ctx(_) => Ok(()),
        }
    }

    /// Frees an offloaded input's device copy once its copy out finished (stream ordered).
    pub(super) fn release(&mut self) -> Result<()> {
        match self {
            SavedLayer::Checkpoint(k) => k.release(),
            SavedLayer::Ctx(_) => Ok(()),
        }
    }

    /// Starts copying an offloaded input back to the device.
    pub(super) fn prefetch(&mut self) -> Result<()> {
        match self {
            SavedLayer::Checkpoint(k) => k.prefetch(),
            SavedLayer::Ctx(_) => Ok(()),
        }
    }
}

/// One layer's forward on `x` in `mode`: its output and what the backward needs. `keep` gets
/// the forward's context before it is kept or dropped.
pub(super) fn forward_layer(
    layer: &mut TransformerLayer,
    x: &Tensor,
    inputs: AttentionInputs<'_>,
    mode: Recompute,
    keep: &mut dyn FnMut(&mut TransformerLayerCtx) -> Result<()>,
) -> Result<(Tensor, SavedLayer)> {
    match mode {
        Recompute::None => {
            let (y, mut c) = layer.forward_with(x, inputs)?;
            keep(&mut c)?;
            Ok((y, SavedLayer::Ctx(Box::new(c))))
        }
        Recompute::Full => {
            let (y, k) = layer.forward_checkpointed(x, inputs, keep)?;
            Ok((y, SavedLayer::Checkpoint(k)))
        }
        // `Gpt::set_recompute` refuses it first.
        Recompute::Selective => {
            Gpt::check_recompute(mode)?;
            Err(Error::internal(MODEL, "selective recompute of a GPT layer"))
        }
    }
}

/// One layer's backward for `d` (a checkpointed layer runs its forward again first, its MoE
/// aux-loss gradient set to `aux_grad` as the first forward's was): the input gradient.
pub(super) fn backward_layer(
    layer: &mut TransformerLayer,
    saved: SavedLayer,
    d: &Tensor,
    aux_grad: f32,
) -> Result<Tensor> {
    match saved {
        SavedLayer::Ctx(c) => layer.backward(*c, d),
        SavedLayer::Checkpoint(k) => {
            let mut keep = |c: &mut TransformerLayerCtx| {
                c.set_aux_loss_grad(aux_grad);
                Ok(())
            };
            layer.backward_checkpointed(k, d, AttentionInputs::default(), &mut keep)
        }
    }
}

impl Gpt {
    /// What the training forward keeps for the backward (default [`Recompute::None`]):
    /// [`Recompute::Full`] keeps each layer's input only (`[s, b, hidden]` in `params_dtype`,
    /// sequence-parallel: this rank's positions) and runs the layer's forward again in
    /// [`Gpt::backward`], with the same dropout masks and FP8 scales (no amax history updated
    /// twice; TE's `checkpoint` rules, see [`te_nn::modules::recompute`]): the same losses and
    /// gradients bit for bit, one more forward of the layers per step, and peak activation
    /// memory of the layer inputs plus one layer's context instead of every layer's. Applies to
    /// the next forward (a context made before keeps its mode). Forward and backward as before:
    /// the forward inside the `fp8_autocast` scope, the backward outside any scope or inside the
    /// forward's.
    ///
    /// # Errors
    /// [`Error::Config`] for [`Recompute::Selective`] (built for the decoder family only: see
    /// [`Gpt::check_recompute`]) and for [`Recompute::Full`] on a MoE model (its routing is not
    /// replayed yet). FP8 attention (`fp8_dpa`) with [`Recompute::Full`] is refused at the
    /// forward.
    pub fn set_recompute(&mut self, mode: Recompute) -> Result<()> {
        Self::check_recompute(mode)?;
        if mode.is_full() && self.cfg.moe.is_some() {
            return Err(Error::Config {
                module: MODEL,
                message: "full activation recompute of a MoE GPT is not supported yet: use --recompute none with \
                          the MoE presets"
                    .into(),
            });
        }
        self.recompute = mode;
        Ok(())
    }

    /// Whether the GPT presets run recompute mode `mode`: [`Recompute::None`] and
    /// [`Recompute::Full`] (the MoE check is [`Gpt::set_recompute`]'s).
    ///
    /// # Errors
    /// [`Error::Config`] for [`Recompute::Selective`], which is built for the decoder family
    /// (`DecoderLm`, `te train --model`) only: it names `full` and `none`.
    pub fn check_recompute(mode: Recompute) -> Result<()> {
        if mode.is_selective() {
            return Err(Error::Config {
                module: MODEL,
                message: "selective activation recompute (the MLP only) is built for the decoder family (--model); \
                          the GPT presets take --recompute full or --recompute none"
                    .into(),
            });
        }
        Ok(())
    }

    /// The activation recompute mode ([`Gpt::set_recompute`]).
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// [`Gpt::tensor_parallel_training_bytes`] for a run in recompute mode `mode`: with
    /// [`Recompute::Full`], the saved activations of all layers but one (the one being
    /// recomputed) are replaced by the layer inputs (`t · h` elements a layer of
    /// `params_dtype`, over `tp` ranks as the estimate's activations are). The per-layer
    /// activation bytes are the estimate's own (`(8h + 2f) · 2 + 2h + 4 · heads` bytes a token,
    /// MoE's permuted rows and routing buffers included; one home in `gpt/memory.rs`).
    pub fn training_bytes_with(cfg: &GptConfig, batch: usize, fp8: bool, tp: usize, mode: Recompute) -> u64 {
        let base = Self::tensor_parallel_training_bytes(cfg, batch, fp8, tp);
        if !mode.is_full() {
            return base;
        }
        let h = cfg.hidden_size as f64;
        let per_token_layer = Self::saved_bytes_per_layer_token(cfg);
        let t = batch as f64 * cfg.seq_length as f64;
        let layers = cfg.num_layers as f64;
        let e = cfg.params_dtype.size_bytes() as f64;
        let tp = tp.max(1) as f64;
        let dropped = t * (layers - 1.0).max(0.0) * per_token_layer / tp;
        let inputs = t * layers * h * e / tp;
        (base as f64 - dropped + inputs).max(0.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_recompute_estimates_less_memory() {
        let small = GptConfig::small();
        let none = Gpt::training_bytes_with(&small, 8, true, 1, Recompute::None);
        assert_eq!(none, Gpt::training_bytes(&small, 8, true));
        let full = Gpt::training_bytes_with(&small, 8, true, 1, Recompute::Full);
        // 11 of 12 layers' activations (26 160 bytes a token each) give way to the 12 inputs
        // (1 536 bytes a token each).
        let t = 8.0 * 1024.0;
        let saved = (none - full) as f64;
        let want = t * (11.0 * 26_160.0 - 12.0 * 1_536.0);
        assert!((saved - want).abs() < 1e-6 * want, "{none} → {full}: saved {saved}, want {want}");
        // One layer: nothing to drop, the input is kept on top.
        let one = GptConfig { num_layers: 1, ..GptConfig::tiny() };
        let (a, b) = (
            Gpt::training_bytes_with(&one, 4, false, 1, Recompute::None),
            Gpt::training_bytes_with(&one, 4, false, 1, Recompute::Full),
        );
        assert!(b >= a, "{a} {b}");
        // Tensor parallel: the drop is shared by the ranks.
        let tp = Gpt::training_bytes_with(&small, 8, true, 2, Recompute::Full);
        assert!(tp < Gpt::tensor_parallel_training_bytes(&small, 8, true, 2), "{tp}");
    }

    /// Selective recompute is the decoder family's: the GPT presets refuse it, naming the modes
    /// they take.
    #[test]
    fn the_gpt_presets_refuse_selective_recompute() {
        let e = Gpt::check_recompute(Recompute::Selective).unwrap_err();
        let message = e.to_string();
        assert!(matches!(e, Error::Config { .. }) && message.contains("--recompute full"), "{message}");
        assert!(message.contains("--recompute none") && message.contains("--model"), "{message}");
        assert!(Gpt::check_recompute(Recompute::Full).is_ok() && Gpt::check_recompute(Recompute::None).is_ok());
    }
}
