//! The step of a ZeRO-3 [`AdamW`] ([`ZeroStage::Parameters`], built by
//! [`AdamW::new_zero_stage`]): the ZeRO-2 step, writing this rank's pieces of the sharded
//! weights ([`te_nn::parallel::ParamShards::local_pieces`]) instead of the model's parameters,
//! with no broadcast after it (the next forward's gathers carry the new values).

use super::partition::Partition;
use super::{AdamW, AdamWConfig, PendingStep, StepStats, ZeroStage};
use std::sync::Arc;
use te_nn::modules::{Module, Param, ParamKind};
use te_nn::parallel::GradShards;
use te_runtime::dist::ProcessGroup;
use te_runtime::ops::optimizer::CHUNK;
use te_runtime::{Device, Error, Result, Tensor};

impl AdamW {
    /// The split a sharded optimizer of `model` over `world` ranks uses (its
    /// [`Partition`], pieces aligned to the fused kernel's chunk) as the pieces each rank owns
    /// of each parameter: what [`AdamW::grad_shards`] of such an optimizer is, known before it
    /// is built, so a ZeRO-3 model can be sharded first
    /// (`te_models::decoder::train::DecoderLm::set_zero3`) and the optimizer built from its
    /// pieces ([`AdamW::new_zero3`]): the whole weights and the optimizer state are never on
    /// the device together.
    ///
    /// # Errors
    /// [`Error::Argument`] for `world` 0.
    pub fn zero_shards<M: Module + ?Sized>(model: &M, world: usize) -> Result<GradShards> {
        let mut numels = Vec::new();
        model.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            numels.push(p.numel());
            Ok(())
        })?;
        Partition::new(&numels, world, CHUNK)?.grad_shards()
    }

    /// A ZeRO-3 optimizer ([`ZeroStage::Parameters`], as [`AdamW::new_zero_stage`]) of a model
    /// whose sharded weights are the pieces `local` holds (by traversal index; `Some` for each
    /// sharded parameter, this rank's piece of it: `ParamShards::local_pieces` of a store built
    /// with [`AdamW::zero_shards`] over `group`): their masters come from those pieces, the
    /// others' from the model's whole tensors.
    ///
    /// # Errors
    /// As [`AdamW::new_zero_stage`]; [`Error::Config`] for a piece that is not this rank's
    /// piece of its parameter under the optimizer's split.
    pub fn new_zero3<M: Module + ?Sized>(
        dev: &Arc<Device>,
        model: &M,
        config: AdamWConfig,
        group: Arc<ProcessGroup>,
        local: &[Option<Tensor>],
    ) -> Result<Self> {
        let params = model.named_parameters().len();
        if local.len() != params {
            return Err(Error::Config {
                module: "AdamW",
                message: format!(
                    "{} local pieces for a model of {params} parameters: pass the model's pieces (one entry a \
                     parameter, ParamShards::local_pieces)",
                    local.len()
                ),
            });
        }
        Self::build(dev, model, config, Some((group, ZeroStage::Parameters)), Some(local))
    }

    /// The step of a ZeRO-3 optimizer: [`AdamW::step_reduced`] of the parameters `reduced`
    /// marks ([`te_nn::parallel::DataParallel::reduced`]), where each parameter `local` holds
    /// (by traversal index; [`te_nn::parallel::ParamShards::local_pieces`], the same pattern on
    /// every rank) is a sharded weight: the update of this rank's piece is written into that
    /// tensor (`[piece_len]`, in place: the store sees it), the model's transient tensor of it
    /// is left alone, and nothing of it is broadcast. The parameters `local` does not hold
    /// (the embedding, final norm and LM head) are updated and made whole as at stage 2. The
    /// arithmetic is ZeRO-2's: the same pieces, chunks, norm and update bit for bit.
    ///
    /// # Errors
    /// [`Error::Config`] for an optimizer of another stage, `local` of another parameter count,
    /// or a piece that is not this rank's piece of its parameter (element count or dtype); as
    /// [`AdamW::step_reduced`].
    pub fn step_sharded<M: Module + ?Sized>(
        &mut self,
        model: &mut M,
        reduced: &[bool],
        local: &[Option<Tensor>],
    ) -> Result<StepStats> {
        let pending = self.issue_sharded(model, reduced, local)?;
        self.finish(&pending)
    }

    /// [`AdamW::step_sharded`] queued on the device, as [`AdamW::issue`]; complete it with
    /// [`AdamW::finish`].
    ///
    /// # Errors
    /// As [`AdamW::step_sharded`].
    pub fn issue_sharded<M: Module + ?Sized>(
        &mut self,
        model: &mut M,
        reduced: &[bool],
        local: &[Option<Tensor>],
    ) -> Result<PendingStep> {
        if self.zero_stage() != ZeroStage::Parameters {
            return Err(Error::Config {
                module: "AdamW",
                message: format!(
                    "a ZeRO-{} optimizer updates whole parameters: step it with AdamW::step_reduced (step_sharded is \
                     ZeRO-3's, AdamW::new_zero_stage with ZeroStage::Parameters)",
                    self.zero_stage().number()
                ),
            });
        }
        if local.len() != self.params.len() {
            return Err(self.mismatch(format!("{} local pieces", local.len())));
        }
        let wrong = self.params.iter().zip(local).find_map(|(s, t)| {
            t.as_ref().filter(|t| t.numel() != s.piece.len() || t.dtype() != s.dtype).map(|t| (s, t))
        });
        if let Some((s, t)) = wrong {
            return Err(Error::Config {
                module: "AdamW",
                message: format!(
                    "the local piece of {} holds {} {} elements, this rank's piece is {:?} of {}: pass the pieces of \
                     the store built from this optimizer's grad_shards",
                    s.path,
                    t.numel(),
                    t.dtype(),
                    s.piece,
                    s.dtype
                ),
            });
        }
        self.issue_marked(model, Some(reduced), Some(local))
    }
}
