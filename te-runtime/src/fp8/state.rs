//! Per-module delayed-scaling state (TE `fp8_meta["scaling_fwd"]` / `["scaling_bwd"]`) and the
//! casts that read it.

use super::{DelayedScaling, Float8CurrentScaling, Float8Tensor};
use crate::ops::cast_transpose::DbiasOut;
use crate::ops::{self, Fp8Scaling};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use std::sync::{Arc, Mutex, MutexGuard};
use te_codegen::spec::AmaxComputeAlgo;
use te_codegen::DType;

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
    fn scaling<'a>(&'a mut self, slot: usize, out_scale_inv: &'a mut CudaSlice<f32>) -> Fp8Scaling<'a> {
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
/// slots — input, weight, output — and 2 backward slots — grad_output, grad_input), each with
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
            scale: s.clone_htod(&vec![1.0f32; slots])?,
            scale_inv: s.clone_htod(&vec![1.0f32; slots])?,
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
        let host = s.clone_dtoh(&b.amax_history)?;
        let mut resized = vec![0.0f32; self.slots * new];
        for (dst, src) in resized.chunks_exact_mut(new).zip(host.chunks_exact(old)) {
            let n = old.min(new);
            dst[..n].copy_from_slice(&src[..n]);
        }
        b.amax_history = s.clone_htod(&resized)?;
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
            amax_history: s.clone_dtoh(&b.amax_history)?,
            scale: s.clone_dtoh(&b.scale)?,
            scale_inv: s.clone_dtoh(&b.scale_inv)?,
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
        b.amax_history = s.clone_htod(&snap.amax_history)?;
        b.scale = s.clone_htod(&snap.scale)?;
        b.scale_inv = s.clone_htod(&snap.scale_inv)?;
        b.history_len = snap.history_len;
        Ok(())
    }

    /// Casts `x` to the slot's format with the slot's scale, maxing `|x|` into the slot's newest
    /// amax; `with_transpose` also writes the transposed copy, and `dbias` the column sums.
    pub(crate) fn quantize(
        &self,
        x: &Tensor,
        slot: usize,
        with_transpose: bool,
        dbias: Option<DbiasOut<'_>>,
    ) -> Result<Float8Tensor> {
        let mut b = self.lock();
        let dtype = b.dtype;
        let mut scale_inv = self.dev.stream().alloc_zeros::<f32>(1)?;
        let mut scaling = b.scaling(slot, &mut scale_inv);
        let (data, transpose) = cast(&self.dev, x, dtype, &mut scaling, with_transpose, dbias)?;
        Float8Tensor::from_parts(data, transpose, Arc::new(scale_inv))
    }

    /// Runs a fused kernel that casts into this slot: `f` gets the slot's scale and newest amax
    /// and a fresh `scale_inv` (returned) that the kernel writes.
    pub(crate) fn cast_with<R>(
        &self,
        slot: usize,
        f: impl FnOnce(&mut Fp8Scaling<'_>) -> Result<R>,
    ) -> Result<(R, Arc<CudaSlice<f32>>)> {
        let mut b = self.lock();
        let mut scale_inv = self.dev.stream().alloc_zeros::<f32>(1)?;
        let r = f(&mut b.scaling(slot, &mut scale_inv))?;
        Ok((r, Arc::new(scale_inv)))
    }

    /// A device copy of the slot's current scale (kept by a module that recomputes a cast in
    /// backward, after the scope's update may have changed the slot).
    pub(crate) fn scale_copy(&self, slot: usize) -> Result<CudaSlice<f32>> {
        let b = self.lock();
        let s = self.dev.stream();
        let mut out = s.alloc_zeros::<f32>(1)?;
        s.memcpy_dtod(&b.scale.slice(slot..slot + 1), &mut out)?;
        Ok(out)
    }

    /// Maxes `|x|` into the slot's newest amax without casting (calibration).
    pub(crate) fn record_amax(&self, x: &Tensor, slot: usize) -> Result<()> {
        let mut b = self.lock();
        let h = slot * b.history_len;
        ops::cast::amax(&self.dev, x, &mut b.amax_history.slice_mut(h..h + 1))
    }

    /// Runs `f` with the slot's scale and newest-amax views (for a GEMM writing FP8 output with
    /// `D_SCALE` and `AMAX_D`), plus a fresh `scale_inv` buffer filled with the slot's current
    /// `scale_inv` for the output tensor.
    pub(crate) fn with_output_scaling<R>(
        &self,
        slot: usize,
        f: impl FnOnce(CudaView<'_, f32>, CudaViewMut<'_, f32>) -> Result<R>,
    ) -> Result<(R, Arc<CudaSlice<f32>>)> {
        let mut b = self.lock();
        let s = self.dev.stream();
        let mut scale_inv = s.alloc_zeros::<f32>(1)?;
        s.memcpy_dtod(&b.scale_inv.slice(slot..slot + 1), &mut scale_inv)?;
        let h = slot * b.history_len;
        let b = &mut *b;
        let r = f(b.scale.slice(slot..slot + 1), b.amax_history.slice_mut(h..h + 1))?;
        Ok((r, Arc::new(scale_inv)))
    }
}

/// Current scaling (TE `Float8CurrentScalingQuantizer`): the amax of `x` itself, then the scale,
/// then the cast — three launches, no state.
pub(crate) fn quantize_current(
    dev: &Device,
    x: &Tensor,
    dtype: DType,
    recipe: &Float8CurrentScaling,
    with_transpose: bool,
    dbias: Option<DbiasOut<'_>>,
) -> Result<Float8Tensor> {
    let mut meta = ops::Fp8Meta::new(dev, 1.0)?;
    ops::cast::amax(dev, x, &mut meta.amax.as_view_mut())?;
    let fp8_max = dtype.fp8_max().unwrap_or(1.0);
    ops::scaling::current_scaling(
        dev,
        &meta.amax,
        &mut meta.scale,
        &mut meta.scale_inv,
        fp8_max,
        recipe.amax_epsilon,
        recipe.power_2_scale,
    )?;
    let (data, transpose) = cast(dev, x, dtype, &mut meta.scaling(), with_transpose, dbias)?;
    Float8Tensor::from_parts(data, transpose, Arc::new(meta.scale_inv))
}

/// The cast itself: quantize, or cast_transpose (with dbias) when a transpose is asked for.
fn cast(
    dev: &Device,
    x: &Tensor,
    dtype: DType,
    scaling: &mut Fp8Scaling<'_>,
    with_transpose: bool,
    dbias: Option<DbiasOut<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut data = Tensor::empty(dev, dtype, x.shape())?;
    if with_transpose || dbias.is_some() {
        let (rows, cols) = x.as_2d("fp8 cast")?;
        let mut t = Tensor::empty(dev, dtype, &[cols, rows])?;
        ops::cast_transpose::cast_transpose(dev, x, &mut data, &mut t, scaling, dbias)?;
        Ok((data, Some(t)))
    } else {
        ops::cast::quantize(dev, x, &mut data, scaling)?;
        Ok((data, None))
    }
}
