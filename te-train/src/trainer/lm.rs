//! [`TrainLm`]: what the GPU training loop needs of a language model, for the byte-level GPT
//! (`te_models::gpt::Gpt`, trained from scratch) and the decoder family
//! (`te_models::decoder::train::DecoderLm`, fine-tuned from a checkpoint).

use std::sync::Arc;
use te_models::decoder::train::{DecoderLm, DecoderLmCtx, Packing};
use te_models::gpt::{Gpt, GptCtx, GptLoss, MicroBatch};
use te_nn::modules::{Module, Recompute, TokenIds};
use te_nn::parallel::{ContextParallel, GradShards};
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result, Tensor};

/// A causal language model the GPU trainer steps: a loss forward over `[s, b]` ids and
/// targets that saves a context, its backward with a per-part hook (the data-parallel
/// reduction), training and evaluation modes, and the dropout stream a checkpoint keeps.
pub trait TrainLm: Module {
    /// What the forward saves for the backward.
    type Ctx;

    /// The micro-batch's mean next-token loss (on the device) and the context.
    ///
    /// # Errors
    /// The model's shape and runtime errors.
    fn forward_loss_with(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
    ) -> Result<(GptLoss, Self::Ctx)>;

    /// The loss forward over packed documents (`[tokens, 1]` ids and targets, TE's `thd`
    /// tables).
    ///
    /// # Errors
    /// The model's; [`Error::Config`] for a model that trains on windows only.
    fn forward_loss_thd(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        packing: Packing<'_>,
        micro: MicroBatch,
    ) -> Result<(GptLoss, Self::Ctx)>;

    /// The backward of that loss, calling `grads_ready` with each part as its gradients
    /// complete.
    ///
    /// # Errors
    /// The model's and the hook's errors.
    fn backward_with(
        &mut self,
        ctx: Self::Ctx,
        grads_ready: &mut dyn FnMut(&mut dyn Module) -> Result<()>,
    ) -> Result<()>;

    /// Training mode (dropout) or evaluation mode.
    fn set_training(&mut self, training: bool);

    /// The dropout stream position (0 for a model without dropout).
    fn dropout_offset(&self) -> u64;

    /// Moves the dropout stream to `offset`.
    fn set_dropout_offset(&mut self, offset: u64);

    /// What the training forward keeps for the backward ([`Recompute`]): the whole contexts,
    /// or (full recompute) each layer's input, its forward run again in the backward.
    ///
    /// # Errors
    /// [`Error::Config`] for a mode the model does not support.
    fn set_recompute(&mut self, mode: Recompute) -> Result<()>;

    /// Splits every sequence of the next forwards over `cp`'s ranks (context parallelism: the
    /// ids and targets are then each rank's chunks of the windows); `None`: whole sequences.
    /// The default refuses a group.
    ///
    /// # Errors
    /// [`Error::Config`] for a model that is not split along the sequence.
    fn set_context_parallel(&mut self, cp: Option<ContextParallel>) -> Result<()> {
        match cp {
            None => Ok(()),
            Some(_) => Err(Error::Config {
                module: "TrainLm",
                message: "this model does not split its sequences over a context-parallel group: train the decoder \
                          family (--model) or drop --context-parallel"
                    .into(),
            }),
        }
    }

    /// Whether the model routes tokens to experts (MoE), whose row counts the host reads
    /// every step: such a step is not captured in a CUDA graph. The default: `false`.
    fn is_moe(&self) -> bool {
        false
    }

    /// The layers whose saved inputs go to pinned host memory (`DecoderLm::set_offload_activations`);
    /// the default: none.
    fn offload_activations(&self) -> usize {
        0
    }

    /// ZeRO-3: shards the layers' weights over the data-parallel `group` as `shards` says
    /// (`DecoderLm::set_zero3`). The default refuses.
    ///
    /// # Errors
    /// [`Error::Config`] for a model that does not shard its weights, and the model's.
    fn set_zero3(&mut self, group: Arc<ProcessGroup>, shards: GradShards) -> Result<()> {
        let _ = (group, shards);
        Err(Error::Config {
            module: "TrainLm",
            message: "ZeRO-3 shards the layers of the decoder family (--model); the GPT presets shard up to the \
                      gradients: use --zero 2"
                .into(),
        })
    }

    /// Whether the layers' weights are sharded ([`TrainLm::set_zero3`]).
    fn is_zero3(&self) -> bool {
        false
    }

    /// ZeRO-3: this rank's pieces of the sharded weights by traversal index, what
    /// `AdamW::step_sharded` writes; `None` when not sharded.
    fn zero3_pieces(&self) -> Option<Vec<Option<Tensor>>> {
        None
    }

    /// ZeRO-3: bytes of the sharded weights this rank keeps and of all of them whole; `(0, 0)`
    /// when not sharded.
    fn zero3_bytes(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Calls `f` with the model with all of its parameters whole (ZeRO-3: gathered for the
    /// call, a collective every rank joins); the default: the model itself.
    ///
    /// # Errors
    /// The gathers' and `f`'s errors.
    fn with_whole_parameters(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()>
    where
        Self: Sized,
    {
        f(self)
    }

    /// ZeRO-3, after a checkpoint load set whole values: keeps this rank's pieces again. The
    /// default: nothing to do.
    ///
    /// # Errors
    /// The model's.
    fn zero3_reshard(&mut self) -> Result<()> {
        Ok(())
    }

    /// ZeRO-3 off: the layers' weights whole again (the end of a run). The default: nothing
    /// to do.
    ///
    /// # Errors
    /// The model's.
    fn zero3_unshard(&mut self) -> Result<()> {
        Ok(())
    }
}

impl TrainLm for Gpt {
    type Ctx = GptCtx;

    fn forward_loss_with(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
    ) -> Result<(GptLoss, GptCtx)> {
        Gpt::forward_loss_with(self, ids, targets, micro)
    }

    /// The byte-level GPT (learned positions, no `thd` attention path) trains on windows.
    fn forward_loss_thd(
        &mut self,
        _: &TokenIds,
        _: &TokenIds,
        _: Packing<'_>,
        _: MicroBatch,
    ) -> Result<(GptLoss, GptCtx)> {
        Err(Error::Config {
            module: "Gpt",
            message: "the byte-level GPT trains on windows: packed documents (thd) are the decoder family's".into(),
        })
    }

    fn backward_with(&mut self, ctx: GptCtx, grads_ready: &mut dyn FnMut(&mut dyn Module) -> Result<()>) -> Result<()> {
        Gpt::backward_with(self, ctx, grads_ready)
    }

    fn set_training(&mut self, training: bool) {
        Gpt::set_training(self, training);
    }

    fn dropout_offset(&self) -> u64 {
        Gpt::dropout_offset(self)
    }

    fn set_dropout_offset(&mut self, offset: u64) {
        Gpt::set_dropout_offset(self, offset);
    }

    fn is_moe(&self) -> bool {
        self.config().moe.is_some()
    }

    fn set_recompute(&mut self, mode: Recompute) -> Result<()> {
        Gpt::set_recompute(self, mode)
    }

    fn offload_activations(&self) -> usize {
        Gpt::offload_activations(self)
    }
}

impl TrainLm for DecoderLm {
    type Ctx = DecoderLmCtx;

    fn forward_loss_with(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        micro: MicroBatch,
    ) -> Result<(GptLoss, DecoderLmCtx)> {
        DecoderLm::forward_loss_with(self, ids, targets, micro)
    }

    fn forward_loss_thd(
        &mut self,
        ids: &TokenIds,
        targets: &TokenIds,
        packing: Packing<'_>,
        micro: MicroBatch,
    ) -> Result<(GptLoss, DecoderLmCtx)> {
        DecoderLm::forward_loss_thd(self, ids, targets, packing, micro)
    }

    fn backward_with(
        &mut self,
        ctx: DecoderLmCtx,
        grads_ready: &mut dyn FnMut(&mut dyn Module) -> Result<()>,
    ) -> Result<()> {
        DecoderLm::backward_with(self, ctx, grads_ready)
    }

    fn set_training(&mut self, training: bool) {
        DecoderLm::set_training(self, training);
    }

    /// The decoder family trains without dropout.
    fn dropout_offset(&self) -> u64 {
        0
    }

    fn set_dropout_offset(&mut self, _offset: u64) {}

    fn set_recompute(&mut self, mode: Recompute) -> Result<()> {
        DecoderLm::set_recompute(self, mode)
    }

    fn set_context_parallel(&mut self, cp: Option<ContextParallel>) -> Result<()> {
        DecoderLm::set_context_parallel(self, cp)
    }

    fn offload_activations(&self) -> usize {
        DecoderLm::offload_activations(self)
    }

    fn set_zero3(&mut self, group: Arc<ProcessGroup>, shards: GradShards) -> Result<()> {
        DecoderLm::set_zero3(self, group, shards)
    }

    fn is_zero3(&self) -> bool {
        DecoderLm::is_zero3(self)
    }

    fn zero3_pieces(&self) -> Option<Vec<Option<Tensor>>> {
        DecoderLm::zero3_pieces(self)
    }

    fn zero3_bytes(&self) -> (u64, u64) {
        DecoderLm::zero3_bytes(self).unwrap_or((0, 0))
    }

    fn with_whole_parameters(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        DecoderLm::with_whole_parameters(self, f)
    }

    fn zero3_reshard(&mut self) -> Result<()> {
        DecoderLm::zero3_reshard(self)
    }

    fn zero3_unshard(&mut self) -> Result<()> {
        DecoderLm::zero3_unshard(self)
    }
}
