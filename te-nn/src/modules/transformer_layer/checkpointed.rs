//! [`TransformerLayer`] under full activation recompute ([`crate::modules::Recompute::Full`];
//! TE's `checkpoint(layer, x)`, Megatron-LM's full recompute): the training forward keeps the
//! layer's input instead of its context, and the backward runs the forward again, with the same
//! dropout masks and FP8 scales ([`Fp8Replay`]), before the layer's backward.

use super::{Mlp, TransformerLayer, TransformerLayerCtx, MODULE};
use crate::modules::multihead_attention::AttentionInputs;
use crate::modules::recompute::Fp8Replay;
use te_runtime::offload::{HostOffload, OffloadedTensor};
use te_runtime::{Error, Result, Tensor};

/// What [`TransformerLayer::forward_checkpointed`] keeps for
/// [`TransformerLayer::backward_checkpointed`]: the layer's input (`[s, b, hidden]`, shared with
/// the caller's tensor, no copy), the dropout offset and mode of the forward, its
/// `is_first_microbatch`, and its FP8 state ([`Fp8Replay`]: two f32 per FP8 tensor slot).
#[derive(Debug)]
pub struct TransformerLayerCheckpoint {
    module_id: u64,
    input: SavedInput,
    /// The hidden-dropout offset before the forward (the masks it drew follow it).
    dropout_offset: u64,
    training: bool,
    is_first_microbatch: Option<bool>,
    fp8: Fp8Replay,
}

/// Where a checkpoint's input is.
#[derive(Debug)]
enum SavedInput {
    /// On the device.
    Device(Tensor),
    /// Offloaded to pinned host memory ([`TransformerLayerCheckpoint::offload`]).
    Host(Box<OffloadedTensor>),
}

impl TransformerLayerCheckpoint {
    /// The layer input it keeps, `[s, b, hidden]` (or `[b, s, hidden]`); `None` while it is
    /// offloaded ([`TransformerLayerCheckpoint::offload`]).
    pub fn input(&self) -> Option<&Tensor> {
        match &self.input {
            SavedInput::Device(t) => Some(t),
            SavedInput::Host(_) => None,
        }
    }

    /// Starts copying the kept input to pinned host memory on `host`'s side stream (TE's
    /// `get_cpu_offload_context`; see `te_runtime::offload`); the backward copies it back.
    /// The device copy lives until [`TransformerLayerCheckpoint::release`].
    ///
    /// # Errors
    /// As [`HostOffload::offload`].
    pub fn offload(&mut self, host: &HostOffload) -> Result<()> {
        if let SavedInput::Device(t) = &self.input {
            self.input = SavedInput::Host(Box::new(host.offload(t.clone())?));
        }
        Ok(())
    }

    /// Frees an offloaded input's device copy once its copy out finished (stream ordered; a
    /// no-op otherwise).
    ///
    /// # Errors
    /// Driver failures.
    pub fn release(&mut self) -> Result<()> {
        match &mut self.input {
            SavedInput::Host(t) => t.release(),
            SavedInput::Device(_) => Ok(()),
        }
    }

    /// Starts copying an offloaded input back to the device (a no-op otherwise): call it a
    /// layer ahead of the backward.
    ///
    /// # Errors
    /// Allocation and driver failures.
    pub fn prefetch(&mut self) -> Result<()> {
        match &mut self.input {
            SavedInput::Host(t) => t.prefetch(),
            SavedInput::Device(_) => Ok(()),
        }
    }
}

impl TransformerLayer {
    /// Refuses what the recompute cannot replay bit for bit yet.
    fn check_recompute(&self) -> Result<()> {
        let refuse = |message: &str| Err(Error::Config { module: MODULE, message: message.into() });
        if matches!(self.mlp, Mlp::Moe(_)) {
            return refuse(
                "full activation recompute of a MoE layer is not supported yet (its routing and aux loss are not \
                 replayed): use --recompute none with MoE models",
            );
        }
        if self.training && self.cfg.attention_dropout > 0.0 {
            return refuse(
                "full activation recompute with attention dropout is not supported yet (the attention's dropout \
                 offset is not replayed): set attention_dropout = 0 or use --recompute none",
            );
        }
        Ok(())
    }

    /// [`TransformerLayer::forward_with`] that keeps only what
    /// [`TransformerLayer::backward_checkpointed`] needs to run it again: the output (`x`'s
    /// shape and dtype) and a [`TransformerLayerCheckpoint`]. The context the forward made is
    /// handed to `inspect` (to read what the caller needs of it, such as a MoE aux loss) and
    /// then dropped, so that only one layer's context is alive at a time. Call it inside the
    /// `fp8_autocast` scope the layer should run under, as the forward.
    ///
    /// # Errors
    /// [`Error::Config`] for a MoE MLP, attention dropout in training mode, or FP8 attention
    /// ([`Fp8Replay::capture`]) — what the recompute does not replay yet; the forward's errors;
    /// `inspect`'s.
    pub fn forward_checkpointed(
        &mut self,
        x: &Tensor,
        inputs: AttentionInputs<'_>,
        inspect: &mut dyn FnMut(&mut TransformerLayerCtx) -> Result<()>,
    ) -> Result<(Tensor, TransformerLayerCheckpoint)> {
        self.check_recompute()?;
        let dropout_offset = self.calls;
        let is_first_microbatch = inputs.is_first_microbatch;
        let (y, mut ctx) = self.forward_with(x, inputs)?;
        inspect(&mut ctx)?;
        let tp = self.cfg.tp.as_ref().map(|t| &t.group);
        // Before the context drops: its tickets of the scope's backward group are taken over.
        let fp8 = Fp8Replay::capture(self, tp)?;
        drop(ctx);
        let checkpoint = TransformerLayerCheckpoint {
            module_id: self.id,
            input: SavedInput::Device(x.clone()),
            dropout_offset,
            training: self.training,
            is_first_microbatch,
            fp8,
        };
        Ok((y, checkpoint))
    }

    /// The backward of a [`TransformerLayer::forward_checkpointed`]: runs the forward again on
    /// the kept input (the same dropout masks, training mode, `is_first_microbatch` and FP8
    /// scales, no amax recorded a second time), hands its context to `inspect` (to set what the
    /// caller set on the first one, such as the MoE aux-loss gradient), and runs
    /// [`TransformerLayer::backward`] on it. `inputs`: the forward's attention inputs (the
    /// same padding and rotary angles; its `is_first_microbatch` is replaced by the first
    /// forward's). Returns `dx` for `d_out`; every parameter gradient accumulates. The dropout
    /// stream is left where it was.
    ///
    /// # Errors
    /// [`Error::Context`] for another layer's checkpoint; the forward's and the backward's
    /// errors; `inspect`'s; the FP8 scale updates'.
    pub fn backward_checkpointed(
        &mut self,
        checkpoint: TransformerLayerCheckpoint,
        d_out: &Tensor,
        inputs: AttentionInputs<'_>,
        inspect: &mut dyn FnMut(&mut TransformerLayerCtx) -> Result<()>,
    ) -> Result<Tensor> {
        if checkpoint.module_id != self.id {
            return Err(Error::Context { module: MODULE, message: "the checkpoint was made by another layer".into() });
        }
        let TransformerLayerCheckpoint { input, dropout_offset, training, is_first_microbatch, mut fp8, .. } =
            checkpoint;
        let input = match input {
            SavedInput::Device(t) => t,
            SavedInput::Host(t) => (*t).fetch()?,
        };
        let inputs = AttentionInputs { is_first_microbatch, ..inputs };
        let (now, mode) = (self.calls, self.training);
        self.calls = dropout_offset;
        self.set_training(training);
        let recomputed = fp8.replay(|| self.forward_with(&input, inputs));
        self.calls = now;
        self.set_training(mode);
        let ((_, mut ctx), hold) = recomputed?;
        inspect(&mut ctx)?;
        let dx = self.backward(ctx, d_out)?;
        fp8.finish(hold)?;
        Ok(dx)
    }
}
