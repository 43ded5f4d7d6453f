//! Per-module delayed-scaling state (TE `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]`); the casts
//! that read it are [`super::DelayedScalingQuantizer`]'s.

use super::DelayedScaling;
use cudarc::driver::CudaSlice;
use std::sync::{Arc, Mutex, MutexGuard};
use te_codegen::spec::AmaxComputeAlgo;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::Fp8Scaling;
use te_runtime::{Device, Error, Result};

/// Device buffers of `n` FP8 tensor slots of one direction (forward or backward) of a module.
#[derive(Debug)]
pub(crate) struct ScalingBuffers {
    /// f32 `[n, history_len]`, tensor-major, `[slot][0]` the newest amax (where casts max into).
    pub amax_history: CudaSlice<f32>,
    /// f32 `[n]`: the scale each slot is cast with.
    pub scale: CudaSlice<f32>,
    /// f32 `[n]`: `1 / scale`.
    pub scale_inv: CudaSlice<f32>,
    /// Entries per slot history.
    pub history_len: usize,
    /// The slots' FP8 format (one per direction: E4M3 forward, E5M2 or E4M3 backward).
    pub dtype: DType,
    /// The recipe's margin.
    pub margin: f32,
    /// The recipe's amax algorithm.
    pub algo: AmaxComputeAlgo,
}

impl ScalingBuffers {
    /// Scaling views of `slot`: its scale and newest amax entry, and the `scale_inv` the cast
    /// writes (`out_scale_inv`, the FP8 tensor's own copy).
    pub(crate) fn scaling<'a>(&'a mut self, slot: usize, out_scale_inv: &'a mut CudaSlice<f32>) -> Fp8Scaling<'a> {
        let h = slot * self.history_len;
        Fp8Scaling {
            scale: self.scale.slice(slot..slot + 1),
            amax: self.amax_history.slice_mut(h..h + 1),
            scale_inv: out_scale_inv.slice_mut(0..1),
        }
    }
}

/// Host copy of one direction's scaling state (for checkpoints and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct ScalingSnapshot {
    /// `[n, history_len]`, tensor-major.
    pub amax_history: Vec<f32>,
    /// `[n]`.
    pub scale: Vec<f32>,
    /// `[n]`.
    pub scale_inv: Vec<f32>,
    /// Entries per slot.
    pub history_len: usize,
}

/// The delayed-scaling state of one direction of one module: `n` slots (a Linear has 3 forward
/// slots — input, weight, output — and 1 backward slot — grad_output), each with
/// an amax history, a scale and a scale_inv. Initial scale 1, history zero.
///
/// Shared (`Arc`) between the module and the autocast scope that updates it.
#[derive(Debug)]
pub struct ScalingState {
    dev: Arc<Device>,
    slots: usize,
    inner: Mutex<ScalingBuffers>,
}

impl ScalingState {
    /// A fresh state of `slots` slots of FP8 `dtype` for `recipe`.
    pub(crate) fn new(dev: &Arc<Device>, slots: usize, dtype: DType, recipe: &DelayedScaling) -> Result<Arc<Self>> {
        let s = dev.stream();
        let buffers = ScalingBuffers {
            amax_history: s.alloc_zeros(slots * recipe.amax_history_len)?,
            scale: s.htod(&vec![1.0f32; slots])?,
            scale_inv: s.htod(&vec![1.0f32; slots])?,
            history_len: recipe.amax_history_len,
            dtype,
            margin: recipe.margin,
            algo: recipe.amax_compute_algo,
        };
        Ok(Arc::new(Self { dev: dev.clone(), slots, inner: Mutex::new(buffers) }))
    }

    /// The device the buffers live on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Locks the buffers (a poisoned lock still holds consistent device buffers: no host
    /// invariant spans a panic, so it is recovered).
    pub(crate) fn lock(&self) -> MutexGuard<'_, ScalingBuffers> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Entries per slot history (the recipe's `amax_history_len` of the last FP8 pass, or a
    /// restored checkpoint's).
    pub fn history_len(&self) -> usize {
        self.lock().history_len
    }

    /// The FP8 format of the slots.
    pub fn dtype(&self) -> DType {
        self.lock().dtype
    }

    /// Adapts the state to `recipe` and `dtype` when they changed since the last use (TE
    /// `adjust_amax_history_length`): a shorter history keeps its newest entries, a longer one
    /// is padded with zeros; margin and algorithm are taken as given; scales are kept.
    pub(crate) fn conform(&self, recipe: &DelayedScaling, dtype: DType) -> Result<()> {
        let mut b = self.lock();
        (b.margin, b.algo, b.dtype) = (recipe.margin, recipe.amax_compute_algo, dtype);
        let (old, new) = (b.history_len, recipe.amax_history_len);
        if old == new {
            return Ok(());
        }
        let s = self.dev.stream();
        let host = s.dtoh(&b.amax_history)?;
        let mut resized = vec![0.0f32; self.slots * new];
        for (dst, src) in resized.chunks_exact_mut(new).zip(host.chunks_exact(old)) {
            let n = old.min(new);
            dst[..n].copy_from_slice(&src[..n]);
        }
        b.amax_history = s.htod(&resized)?;
        b.history_len = new;
        Ok(())
    }

    /// The state copied to the host.
    ///
    /// # Errors
    /// Driver failures.
    pub fn snapshot(&self) -> Result<ScalingSnapshot> {
        let b = self.lock();
        let s = self.dev.stream();
        Ok(ScalingSnapshot {
            amax_history: s.dtoh(&b.amax_history)?,
            scale: s.dtoh(&b.scale)?,
            scale_inv: s.dtoh(&b.scale_inv)?,
            history_len: b.history_len,
        })
    }

    /// Overwrites the state with `snap` (a checkpoint's values).
    ///
    /// # Errors
    /// [`Error::Shape`] when `snap` has another slot count; driver failures.
    pub fn restore(&self, snap: &ScalingSnapshot) -> Result<()> {
        let n = self.slots;
        if snap.scale.len() != n || snap.scale_inv.len() != n || snap.amax_history.len() != n * snap.history_len {
            return Err(Error::Shape {
                op: "ScalingState::restore",
                message: format!(
                    "the state has {n} slots; the snapshot has {} scales, {} scale_invs and {} history entries \
                     of length {}",
                    snap.scale.len(),
                    snap.scale_inv.len(),
                    snap.amax_history.len(),
                    snap.history_len
                ),
            });
        }
        let mut b = self.lock();
        let s = self.dev.stream();
        b.amax_history = s.htod(&snap.amax_history)?;
        b.scale = s.htod(&snap.scale)?;
        b.scale_inv = s.htod(&snap.scale_inv)?;
        b.history_len = snap.history_len;
        Ok(())
    }
}
