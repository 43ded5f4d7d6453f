//! The FP8 scaling of one GEMM of a module (TE `fp8_meta["scaling_fwd"]`, `["scaling_bwd"]`):
//! its scaling states and the quantizers each pass gets from the autocast scope's recipe. The
//! recipe decides ([`super::ScalingRecipe::forward_quantizer`] and the rest); this file
//! matches on none.

use super::autocast::{backward_ticket, BackwardTicket};
use super::quantizer::Quantizer;
use super::{Fp8Direction, Fp8StateSlot};
use super::{Recipe, ScalingState};
use std::sync::Arc;
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

/// Which forward tensor of a GEMM a quantizer casts (TE `FP8FwdTensors`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmTensor {
    /// The input `x` (attention casts q, k and v through it).
    Input,
    /// The weight `W`.
    Weight,
    /// The output `y`, when the next op takes FP8 (the next layer's input).
    Output,
}

impl GemmTensor {
    /// Its slot in a forward scaling state.
    pub(crate) fn slot(self) -> usize {
        match self {
            GemmTensor::Input => FWD_INPUT,
            GemmTensor::Weight => FWD_WEIGHT,
            GemmTensor::Output => FWD_OUTPUT,
        }
    }
}

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
/// with (backward uses its forward's recipe, wherever it is called) and, for a recipe with a
/// backward state, its ticket of the scope's backward group (the last backward updates the
/// gradient scales).
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

/// The FP8 scaling of one GEMM of a module: its device, and the forward and backward scaling
/// states of the recipes that keep one (made at the first FP8 pass with such a recipe,
/// conformed to the recipe of each later pass). Modules hold one per GEMM; recipes make
/// quantizers from it ([`super::ScalingRecipe::forward_quantizer`]).
#[derive(Debug)]
pub struct GemmScaling {
    pub(crate) dev: Arc<Device>,
    pub(crate) fwd: Option<Arc<ScalingState>>,
    pub(crate) bwd: Option<Arc<ScalingState>>,
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
            input: self.forward_tensor(recipe, GemmTensor::Input)?,
            weight: self.forward_tensor(recipe, GemmTensor::Weight)?,
            output: self.forward_tensor(recipe, GemmTensor::Output)?,
        })
    }

    /// The quantizer of forward tensor `tensor` under `recipe`, registered as
    /// [`GemmScaling::forward`] does: what a module with an op of its own uses (attention casts
    /// q, k and v through [`GemmTensor::Input`]).
    pub(crate) fn forward_tensor(&mut self, recipe: &Recipe, tensor: GemmTensor) -> Result<Box<dyn Quantizer>> {
        recipe.scaling().forward_quantizer(self, tensor)
    }

    /// What the backward of a training forward under `recipe` needs for its gradient casts.
    pub(crate) fn grad(&mut self, recipe: &Recipe) -> Result<GradScaling> {
        let ticket = recipe.scaling().backward_state(self)?.map(|s| backward_ticket(&s));
        Ok(GradScaling { recipe: *recipe, ticket })
    }

    /// The quantizer of the output gradient `dy` in the backward of a forward that kept `g`
    /// (E5M2 under HYBRID).
    pub(crate) fn grad_output(&mut self, g: &GradScaling) -> Result<Box<dyn Quantizer>> {
        g.recipe.scaling().grad_output_quantizer(self)
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
