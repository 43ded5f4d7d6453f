//! The FP8 scaling of one GEMM of a module (TE `fp8_meta["scaling_fwd"]`, `["scaling_bwd"]`):
//! its delayed-scaling states and the quantizers each pass builds from the autocast scope's
//! recipe. This is the one place that turns a [`Recipe`] into quantizers.

use super::autocast::{backward_ticket, register_forward, BackwardTicket};
use super::quantizer::{DelayedScalingQuantizer, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Quantizer};
use super::{DelayedScaling, Recipe, ScalingState};
use super::{Fp8Direction, Fp8StateSlot};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::{Device, Result};

/// Forward slot of the GEMM input (TE `FP8FwdTensors.GEMM1_INPUT`).
pub(crate) const FWD_INPUT: usize = 0;
/// Forward slot of the weight.
pub(crate) const FWD_WEIGHT: usize = 1;
/// Forward slot of the output (an FP8 output for an FP8 consumer, `fp8_output`).
pub(crate) const FWD_OUTPUT: usize = 2;
/// Slots of a forward state: input, weight, output.
pub(crate) const FWD_SLOTS: usize = 3;
/// Backward slot of the output gradient (TE `FP8BwdTensors.GRAD_OUTPUT1`).
pub(crate) const BWD_GRAD_OUTPUT: usize = 0;
/// Slots of a backward state: the output gradient only. (TE also reserves `GRAD_INPUT1` for an
/// FP8 dgrad output; no module here makes one, so no slot is kept for it. Checkpoints of format
/// version 1 hold that unused slot; loading drops it.)
pub(crate) const BWD_SLOTS: usize = 1;

/// The quantizers of one forward of a GEMM: its input `x`, its weight `W` and its output `y`.
#[derive(Debug)]
pub(crate) struct ForwardQuantizers {
    /// Casts the input (E4M3).
    pub input: Box<dyn Quantizer>,
    /// Casts the weight (E4M3).
    pub weight: Box<dyn Quantizer>,
    /// Casts the output when the next op takes FP8 (E4M3).
    pub output: Box<dyn Quantizer>,
}

/// What a training forward under FP8 keeps for its backward's gradient casts: the recipe it ran
/// with (backward uses its forward's recipe, wherever it is called) and, with delayed scaling, its
/// ticket of the scope's backward group (the last backward updates the gradient scales).
#[derive(Debug)]
pub(crate) struct GradScaling {
    recipe: Recipe,
    ticket: Option<BackwardTicket>,
}

impl GradScaling {
    /// Marks this forward's backward done (the last one of the scope updates the scales).
    ///
    /// # Errors
    /// Errors of the scale update.
    pub(crate) fn finish(self) -> Result<()> {
        match self.ticket {
            Some(t) => t.finish(),
            None => Ok(()),
        }
    }
}

/// The FP8 scaling of one GEMM: the delayed-scaling states (made at the first FP8 pass with a
/// delayed recipe, conformed to the recipe of each later pass), and the quantizers built from
/// them.
#[derive(Debug)]
pub(crate) struct GemmScaling {
    dev: Arc<Device>,
    fwd: Option<Arc<ScalingState>>,
    bwd: Option<Arc<ScalingState>>,
}

impl GemmScaling {
    /// No state yet.
    pub(crate) fn new(dev: &Arc<Device>) -> Self {
        Self { dev: dev.clone(), fwd: None, bwd: None }
    }

    /// The quantizers of a forward under `recipe`. With delayed scaling the forward state is
    /// registered with the autocast scope, whose exit updates its scales.
    pub(crate) fn forward(&mut self, recipe: &Recipe) -> Result<ForwardQuantizers> {
        Ok(ForwardQuantizers {
            input: self.forward_slot(recipe, FWD_INPUT)?,
            weight: self.forward_slot(recipe, FWD_WEIGHT)?,
            output: self.forward_slot(recipe, FWD_OUTPUT)?,
        })
    }

    /// The quantizer of forward slot `slot` ([`FWD_INPUT`], [`FWD_WEIGHT`], [`FWD_OUTPUT`])
    /// under `recipe`, registered as [`GemmScaling::forward`] does: what a module with an
    /// op of its own uses (attention casts q, k and v through [`FWD_INPUT`]).
    pub(crate) fn forward_slot(&mut self, recipe: &Recipe, slot: usize) -> Result<Box<dyn Quantizer>> {
        let dtype = recipe.format().forward_dtype();
        match recipe {
            Recipe::Delayed(r) => {
                let s = conform(&mut self.fwd, &self.dev, FWD_SLOTS, dtype, r)?;
                register_forward(&s);
                Ok(Box::new(DelayedScalingQuantizer::new(s, slot)?))
            }
            Recipe::Current(c) => Ok(Box::new(Float8CurrentScalingQuantizer::new(&self.dev, dtype, *c)?)),
            // The output is the next layer's input: tiled as inputs are.
            Recipe::Block(b) => {
                let dim = if slot == FWD_WEIGHT { b.w_block_scaling_dim } else { b.x_block_scaling_dim };
                Ok(Box::new(Float8BlockQuantizer::new(&self.dev, dtype, dim, b)?))
            }
        }
    }

    /// What the backward of a training forward under `recipe` needs for its gradient casts.
    pub(crate) fn grad(&mut self, recipe: &Recipe) -> Result<GradScaling> {
        let ticket = match recipe {
            Recipe::Delayed(r) => Some(backward_ticket(&self.bwd_state(r)?)),
            Recipe::Current(_) | Recipe::Block(_) => None,
        };
        Ok(GradScaling { recipe: *recipe, ticket })
    }

    /// The quantizer of the output gradient `dy` in the backward of a forward that kept `g`
    /// (E5M2 under HYBRID).
    pub(crate) fn grad_output(&mut self, g: &GradScaling) -> Result<Box<dyn Quantizer>> {
        match &g.recipe {
            Recipe::Delayed(r) => Ok(Box::new(DelayedScalingQuantizer::new(self.bwd_state(r)?, BWD_GRAD_OUTPUT)?)),
            Recipe::Current(c) => {
                Ok(Box::new(Float8CurrentScalingQuantizer::new(&self.dev, c.fp8_format.backward_dtype(), *c)?))
            }
            Recipe::Block(b) => Ok(Box::new(Float8BlockQuantizer::new(
                &self.dev,
                b.fp8_format.backward_dtype(),
                b.grad_block_scaling_dim,
                b,
            )?)),
        }
    }

    fn bwd_state(&mut self, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
        conform(&mut self.bwd, &self.dev, BWD_SLOTS, r.fp8_format.backward_dtype(), r)
    }

    /// The forward state (input, weight, output slots), once a delayed-scaling pass made it.
    pub(crate) fn fwd_state(&self) -> Option<&Arc<ScalingState>> {
        self.fwd.as_ref()
    }

    /// The backward state (the output gradient's slot).
    pub(crate) fn bwd_state_opt(&self) -> Option<&Arc<ScalingState>> {
        self.bwd.as_ref()
    }

    /// The forward and backward state slots, for a writable traversal (checkpoint loads).
    pub(crate) fn state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        [
            Fp8StateSlot::new(&mut self.fwd, &self.dev, FWD_SLOTS, Fp8Direction::Forward),
            Fp8StateSlot::new(&mut self.bwd, &self.dev, BWD_SLOTS, Fp8Direction::Backward),
        ]
    }
}

/// The state of `slot` for this recipe and format: created on first use, conformed after.
fn conform(
    slot: &mut Option<Arc<ScalingState>>,
    dev: &Arc<Device>,
    n: usize,
    dtype: DType,
    r: &DelayedScaling,
) -> Result<Arc<ScalingState>> {
    match slot {
        Some(s) => {
            s.conform(r, dtype)?;
            Ok(s.clone())
        }
        None => Ok(slot.insert(ScalingState::new(dev, n, dtype, r)?).clone()),
    }
}
