//! A module's FP8 scaling-state slot as a writable traversal sees it: the state once an FP8
//! forward (or backward) made it, and the means to make it before that (a checkpoint load into a
//! fresh model).

use super::{DelayedScaling, ScalingState};
use std::sync::Arc;
use te_runtime::{Device, Result};

/// Which pass of a GEMM a scaling state serves: it decides the FP8 format of its slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Direction {
    /// Forward: input, weight and output slots (the recipe's forward format, E4M3).
    Forward,
    /// Backward: the grad_output slot (E5M2 under HYBRID).
    Backward,
}

/// The place where a module keeps one delayed-scaling state (`….fp8_fwd`, `….fp8_bwd`), handed
/// to [`crate::modules::ModuleVisitorMut::fp8_state_slot`]: empty until the module's first FP8 forward
/// (or backward) with delayed scaling, or until a visitor fills it with
/// [`Fp8StateSlot::get_or_create`].
#[derive(Debug)]
pub struct Fp8StateSlot<'a> {
    state: &'a mut Option<Arc<ScalingState>>,
    dev: Arc<Device>,
    slots: usize,
    direction: Fp8Direction,
}

impl<'a> Fp8StateSlot<'a> {
    /// The slot `state` of a module on `dev` whose state has `slots` FP8 tensor slots.
    pub(crate) fn new(
        state: &'a mut Option<Arc<ScalingState>>,
        dev: &Arc<Device>,
        slots: usize,
        direction: Fp8Direction,
    ) -> Self {
        Self { state, dev: dev.clone(), slots, direction }
    }

    /// The state, once made.
    pub fn state(&self) -> Option<&Arc<ScalingState>> {
        self.state.as_ref()
    }

    /// Number of FP8 tensor slots the module's state has (3 forward, 1 backward for a GEMM).
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Forward or backward.
    pub fn direction(&self) -> Fp8Direction {
        self.direction
    }

    /// The state; made first (scale 1, zero amax history of `recipe.amax_history_len`, the
    /// recipe's format for this direction) when the slot is empty, as the module's first FP8
    /// pass under `recipe` would make it. The module's next FP8 pass uses this state (adapting
    /// the history length, margin and format to its recipe, keeping the scales).
    ///
    /// # Errors
    /// Allocation failures.
    pub fn get_or_create(&mut self, recipe: &DelayedScaling) -> Result<Arc<ScalingState>> {
        if let Some(s) = self.state.as_ref() {
            return Ok(s.clone());
        }
        let dtype = match self.direction {
            Fp8Direction::Forward => recipe.fp8_format.forward_dtype(),
            Fp8Direction::Backward => recipe.fp8_format.backward_dtype(),
        };
        Ok(self.state.insert(ScalingState::new(&self.dev, self.slots, dtype, recipe)?).clone())
    }
}
