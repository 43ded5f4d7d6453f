//! Activation recompute (TE's `transformer_engine.pytorch.checkpoint`, Megatron-LM's
//! `--recompute-granularity full` and `selective`): a block's training forward keeps only its
//! input, and the backward runs the block's forward again to rebuild what the backward reads,
//! trading one more forward per block for the memory of every block's saved activations. Under
//! [`Recompute::Full`] the block is a whole layer; under [`Recompute::Selective`] it is the
//! layer's MLP only.
//!
//! The recomputed forward must compute what the first one computed, bit for bit. The dropout
//! masks are the caller's (it replays the block's Philox offsets); the FP8 state is
//! [`Fp8Replay`]'s, which follows TE's rules for the recompute phase (`distributed.py`
//! `checkpoint`, `fp8.py` `FP8GlobalStateManager.copy_forward_fp8_meta_tensors_for_recompute`,
//! `get_old_fp8_meta_tensors_for_recompute`, `restore_fp8_meta_tensors`,
//! `in_fp8_activation_recompute_phase`):
//! - the recompute runs under the `fp8_autocast` settings of the first forward (its recipe,
//!   enabled or calibrating), wherever the backward is called;
//! - delayed scaling: it casts with the scales the first forward cast with (the scope's exit
//!   has updated them since), and records its amaxes into a scratch history, so that no amax
//!   history is updated twice;
//! - the backward scale update of the first forward's scope (delayed scaling: one update after
//!   the last backward of the scope's modules) still happens once, after the last block's
//!   backward: the first forward's context is dropped right away, so [`Fp8Replay`] holds the
//!   scope's backward group open in its place, and the recomputed forward's own group is
//!   released on scratch buffers.

use super::visit::{Module, ModuleVisitor, Param, ParamKind};
use crate::fp8::autocast::{backward_ticket, scales_shared_over, BackwardTicket};
use crate::fp8::{fp8_mode, Fp8Autocast, Fp8Mode, ScalingState};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

const MODULE: &str = "Recompute";

/// What a training forward keeps for the backward (Megatron-LM's `--recompute-granularity`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Recompute {
    /// Every layer's context (what the backward reads) is kept from the forward to the backward.
    #[default]
    None,
    /// Each layer keeps its input only (`[s, b, hidden]` in the activations' dtype); the backward
    /// runs the layer's forward again to rebuild its context (TE's `checkpoint` around every
    /// layer, Megatron-LM's `--recompute-granularity full --recompute-method uniform
    /// --recompute-num-layers 1`). Peak activation memory: the layer inputs and one layer's
    /// context, for one more forward per layer.
    Full,
    /// Each layer keeps its attention block's context as with [`Recompute::None`], but its MLP
    /// block keeps only its input (the hidden state after the attention's residual add,
    /// `[tokens, hidden]` in the activations' dtype); the backward runs the MLP's forward again
    /// just before the MLP's backward (Megatron-LM's `--recompute-granularity selective
    /// --recompute-modules mlp`, `megatron/core/transformer/transformer_block.py` and
    /// `transformer_layer.py`'s `mlp` checkpoint). The MLP's saved activations (fc1's output
    /// `[tokens, fc1]`, the activation and its FP8 transpose, the norm output) are the largest
    /// part of a Llama-style layer's, and its forward costs less to redo than the layer's. Peak
    /// activation memory: every layer's attention context and MLP input, and one MLP's context.
    Selective,
}

impl Recompute {
    /// `none`, `full` or `selective` (`te train --recompute`).
    pub fn name(self) -> &'static str {
        match self {
            Recompute::None => "none",
            Recompute::Full => "full",
            Recompute::Selective => "selective",
        }
    }

    /// The mode [`Recompute::name`] names.
    ///
    /// # Errors
    /// [`Error::Config`] naming the names it knows, for another name.
    pub fn from_name(name: &str) -> Result<Self> {
        match name {
            "none" => Ok(Recompute::None),
            "full" => Ok(Recompute::Full),
            "selective" => Ok(Recompute::Selective),
            other => Err(Error::Config {
                module: MODULE,
                message: format!("activation recompute `{other}`: expected none, full or selective"),
            }),
        }
    }

    /// Whether whole layers recompute their forward in the backward ([`Recompute::Full`]).
    pub fn is_full(self) -> bool {
        self == Recompute::Full
    }

    /// Whether only the layers' MLPs recompute their forward ([`Recompute::Selective`]).
    pub fn is_selective(self) -> bool {
        self == Recompute::Selective
    }

    /// Whether any forward runs again in the backward ([`Recompute::Full`] or
    /// [`Recompute::Selective`]).
    pub fn recomputes(self) -> bool {
        self != Recompute::None
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Recompute {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Self::from_name(s)
    }
}

/// A forward scaling state and the scale and `scale_inv` (f32 `[slots]`) the first forward
/// cast with.
#[derive(Debug)]
struct SavedScales {
    state: Arc<ScalingState>,
    scale: CudaSlice<f32>,
    scale_inv: CudaSlice<f32>,
}

/// The FP8 side of one block's first forward under full recompute (see the module docs): the
/// `fp8_autocast` settings it ran under, the scales of its delayed-scaling forward states, and
/// its hold on the scope's backward scale update.
///
/// Use: [`Fp8Replay::capture`] right after the block's first forward, inside its scope, before
/// its context is dropped; [`Fp8Replay::replay`] around the recomputed forward in the backward;
/// [`Fp8Replay::finish`] after the block's backward. The backward must run outside any
/// `fp8_autocast` scope (as TE's training loops call it) or inside the scope of the forward;
/// not inside another scope (that scope's exit would update the recomputed forward's states).
#[derive(Debug)]
pub struct Fp8Replay {
    /// The scope to recompute under; `None`: the first forward ran in high precision.
    scope: Option<Fp8Autocast>,
    forward: Vec<SavedScales>,
    backward: Vec<Arc<ScalingState>>,
    /// Tickets of the first forward's backward group, one per backward state.
    hold: Vec<BackwardTicket>,
}

/// What [`Fp8Replay::replay`] hands back with the recomputed forward: the recomputed context's
/// hold on its own backward group, released by [`Fp8Replay::finish`].
#[derive(Debug)]
pub struct ReplayHold {
    tickets: Vec<BackwardTicket>,
}

/// Collects a module's FP8 scaling states, forward (`…fp8_fwd…`) and backward (the others).
struct States {
    forward: Vec<Arc<ScalingState>>,
    backward: Vec<Arc<ScalingState>>,
}

impl ModuleVisitor for States {
    fn param(&mut self, _: &str, _: ParamKind, _: &dyn Param) -> Result<()> {
        Ok(())
    }

    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> Result<()> {
        let name = path.rsplit('.').next().unwrap_or(path);
        let list = if name.contains("fp8_fwd") { &mut self.forward } else { &mut self.backward };
        if !list.iter().any(|s| Arc::ptr_eq(s, state)) {
            list.push(state.clone());
        }
        Ok(())
    }
}

impl Fp8Replay {
    /// The FP8 state of `block`'s forward that just ran under the current `fp8_autocast` scope
    /// (none: high precision). Copies the scales of its delayed-scaling forward states (two f32
    /// per tensor slot) and, under delayed scaling, takes a ticket of the scope's backward group
    /// for each of its backward states, so that dropping the forward's context does not run the
    /// backward scale update early. `tp_group`: the block's tensor-parallel group, when it has
    /// one: a recompute under sequence parallelism gathers FP8 codes exactly when the first
    /// forward did (the scope's amax reduction group holds the group's ranks).
    ///
    /// # Errors
    /// [`Error::Config`] for a recipe with `fp8_dpa` (FP8 attention keeps backward states whose
    /// scale updates the recompute does not replay yet: run attention in BF16 with recompute);
    /// allocation and copy failures.
    pub fn capture(block: &dyn Module, tp_group: Option<&Arc<ProcessGroup>>) -> Result<Self> {
        let (recipe, enabled) = match fp8_mode() {
            Fp8Mode::HighPrecision => {
                return Ok(Self { scope: None, forward: Vec::new(), backward: Vec::new(), hold: Vec::new() })
            }
            Fp8Mode::Fp8(r) => (r, true),
            Fp8Mode::Calibrating(r) => (r, false),
        };
        if recipe.fp8_dpa() {
            return Err(Error::Config {
                module: MODULE,
                message: "activation recompute (full or selective) with FP8 attention (fp8_dpa / fp8_mha) is not \
                          supported yet: drop --fp8-dpa/--fp8-mha, or --recompute"
                    .into(),
            });
        }
        let group = tp_group.filter(|g| scales_shared_over(g)).cloned();
        let scope = Fp8Autocast { enabled, calibrating: !enabled, recipe, fp8_group: group };
        let mut states = States { forward: Vec::new(), backward: Vec::new() };
        block.visit("", &mut states)?;
        let mut forward = Vec::with_capacity(states.forward.len());
        for state in states.forward {
            let (scale, scale_inv) = {
                let b = state.lock();
                let s = state.device().stream();
                (s.clone_dtod(&b.scale)?, s.clone_dtod(&b.scale_inv)?)
            };
            forward.push(SavedScales { state, scale, scale_inv });
        }
        // Delayed scaling: every GEMM's forward took a ticket for its backward state.
        let hold = if enabled && recipe.calibrates() {
            states.backward.iter().map(backward_ticket).collect()
        } else {
            Vec::new()
        };
        Ok(Self { scope: Some(scope), forward, backward: states.backward, hold })
    }

    /// Whether the first forward ran under FP8 (or calibration).
    pub fn is_fp8(&self) -> bool {
        self.scope.is_some()
    }

    /// Runs `forward` (the block's forward again, in the backward) as the first forward ran:
    /// under its `fp8_autocast` settings, its delayed-scaling forward states casting with the
    /// scales it cast with and recording amaxes into a scratch history (their own scales and
    /// histories are untouched). Returns `forward`'s result and the hold to pass to
    /// [`Fp8Replay::finish`] after the block's backward.
    ///
    /// # Errors
    /// `forward`'s; the scope's; allocation failures.
    pub fn replay<T>(&mut self, forward: impl FnOnce() -> Result<T>) -> Result<(T, ReplayHold)> {
        let Some(scope) = self.scope.clone() else {
            return Ok((forward()?, ReplayHold { tickets: Vec::new() }));
        };
        // Swap the first forward's scales and a scratch history in.
        let mut scratch = Vec::with_capacity(self.forward.len());
        for saved in &mut self.forward {
            let mut b = saved.state.lock();
            let history = saved.state.device().stream().alloc_zeros::<f32>(b.amax_history.len())?;
            let mut history = history;
            std::mem::swap(&mut b.amax_history, &mut history);
            std::mem::swap(&mut b.scale, &mut saved.scale);
            std::mem::swap(&mut b.scale_inv, &mut saved.scale_inv);
            scratch.push(history);
        }
        let out = scope.run(|| {
            let out = forward()?;
            // The recomputed context's backward group stays open until `finish` (see there).
            let tickets = match self.hold.is_empty() {
                true => Vec::new(),
                false => self.backward.iter().map(backward_ticket).collect(),
            };
            Ok((out, ReplayHold { tickets }))
        });
        // Swap back: the real history (holding the first forward's amaxes) and scales.
        for (saved, mut history) in self.forward.iter_mut().zip(scratch) {
            let mut b = saved.state.lock();
            std::mem::swap(&mut b.amax_history, &mut history);
            std::mem::swap(&mut b.scale, &mut saved.scale);
            std::mem::swap(&mut b.scale_inv, &mut saved.scale_inv);
        }
        out
    }

    /// After the block's backward: releases the recomputed forward's backward group on scratch
    /// buffers (its scale update, if it runs, changes nothing real), then the first forward's
    /// hold (the last block's runs the scope's one backward scale update, as the first
    /// forward's context would have).
    ///
    /// # Errors
    /// Errors of the scale updates; allocation failures.
    pub fn finish(self, hold: ReplayHold) -> Result<()> {
        if !hold.tickets.is_empty() {
            let mut saved = Vec::with_capacity(self.backward.len());
            for state in &self.backward {
                let mut b = state.lock();
                let s = state.device().stream();
                let mut parts = (
                    s.alloc_zeros::<f32>(b.amax_history.len())?,
                    s.alloc_zeros::<f32>(b.scale.len())?,
                    s.alloc_zeros::<f32>(b.scale_inv.len())?,
                );
                std::mem::swap(&mut b.amax_history, &mut parts.0);
                std::mem::swap(&mut b.scale, &mut parts.1);
                std::mem::swap(&mut b.scale_inv, &mut parts.2);
                saved.push(parts);
            }
            let released = hold.tickets.into_iter().try_for_each(BackwardTicket::finish);
            for (state, mut parts) in self.backward.iter().zip(saved) {
                let mut b = state.lock();
                std::mem::swap(&mut b.amax_history, &mut parts.0);
                std::mem::swap(&mut b.scale, &mut parts.1);
                std::mem::swap(&mut b.scale_inv, &mut parts.2);
            }
            released?;
        }
        self.hold.into_iter().try_for_each(BackwardTicket::finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_have_names() {
        for m in [Recompute::None, Recompute::Full, Recompute::Selective] {
            assert_eq!(Recompute::from_name(m.name()).unwrap(), m);
            assert_eq!(m.to_string().parse::<Recompute>().unwrap(), m);
        }
        assert_eq!(Recompute::default(), Recompute::None);
        assert!(Recompute::Full.is_full() && !Recompute::None.is_full() && !Recompute::Selective.is_full());
        assert!(Recompute::Selective.is_selective() && !Recompute::Full.is_selective());
        assert!(Recompute::Full.recomputes() && Recompute::Selective.recomputes() && !Recompute::None.recomputes());
        assert_eq!(Recompute::Selective.name(), "selective");
        // The serde names are the CLI's.
        assert_eq!(serde_json::to_string(&Recompute::Selective).unwrap(), "\"selective\"");
        let e = Recompute::from_name("attention").unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("expected none, full or selective"), "{e}");
    }

    #[test]
    fn a_high_precision_forward_keeps_no_fp8_state() {
        // No scope: nothing captured, the replay runs the forward as it is.
        struct Empty;
        impl Module for Empty {
            fn visit(&self, _: &str, _: &mut dyn ModuleVisitor) -> Result<()> {
                Ok(())
            }
            fn visit_mut(&mut self, _: &str, _: &mut dyn super::super::ModuleVisitorMut) -> Result<()> {
                Ok(())
            }
        }
        let mut replay = Fp8Replay::capture(&Empty, None).unwrap();
        assert!(!replay.is_fp8());
        let (v, hold) = replay.replay(|| Ok(7)).unwrap();
        assert_eq!(v, 7);
        replay.finish(hold).unwrap();
    }
}
