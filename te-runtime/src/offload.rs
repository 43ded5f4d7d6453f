//! Activation offload to pinned host memory (TE's `get_cpu_offload_context`): a tensor a
//! forward saves for its backward is copied to page-locked host memory on a side stream, its
//! device copy freed once the copy finished, and copied back before the backward needs it.
//!
//! The values only travel (byte copies), so a run with offload trains bit for bit as one
//! without. Every copy is stream ordered, no host synchronization:
//!
//! - **out** ([`HostOffload::offload`]): the side stream waits on an event recorded on the
//!   device's stream after the kernel that wrote the tensor, copies it to a pinned buffer and
//!   records `done`; [`OffloadedTensor::release`] (called once later work was issued, e.g. after
//!   the next layer's forward) makes the device's stream wait on `done` and drops the device
//!   copy, so the stream-ordered pool frees it after the copy, not before;
//! - **in** ([`OffloadedTensor::prefetch`]): a device buffer is allocated on the device's stream,
//!   the side stream waits for it, copies the pinned bytes in and records `done`;
//!   [`OffloadedTensor::fetch`] makes the device's stream wait on `done` and hands the tensor
//!   back.
//!
//! Pinned buffers come from a pool ([`HostOffload`]) keyed by their byte size and go back to it
//! when an [`OffloadedTensor`] is fetched or dropped, so a training step allocates none after the
//! first (`cuMemHostAlloc` synchronizes the device, so the first step's allocations are the one
//! host synchronization). [`HostOffload::pinned_bytes`] reports what the pool holds.
//!
//! [`OffloadPlan`] is the schedule of a stack of layers of which the first `n` are offloaded.

use crate::{Device, Error, Result, Tensor};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream, PinnedHostSlice};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use te_codegen::DType;

const OP: &str = "HostOffload";

/// Pinned buffers not in use, any sizes.
type Pool = Arc<Mutex<Vec<PinnedHostSlice<u8>>>>;

/// The side stream and the pinned buffers of activation offload (see the module docs). One per
/// model; cheap to clone (the clones share the stream and the pool).
#[derive(Debug, Clone)]
pub struct HostOffload {
    dev: Arc<Device>,
    side: Arc<CudaStream>,
    pool: Pool,
    /// Bytes of pinned host memory allocated so far (in the pool or lent out).
    pinned: Arc<AtomicU64>,
}

impl HostOffload {
    /// A side stream on `dev` and an empty pool (no pinned memory until the first offload).
    ///
    /// # Errors
    /// Driver failures creating the stream.
    pub fn new(dev: &Arc<Device>) -> Result<Self> {
        let side = dev.context().new_stream()?;
        Ok(Self { dev: dev.clone(), side, pool: Arc::new(Mutex::new(Vec::new())), pinned: Arc::new(AtomicU64::new(0)) })
    }

    /// Bytes of pinned host memory allocated (reused across steps: after the first step of a
    /// fixed shape this stays put).
    pub fn pinned_bytes(&self) -> u64 {
        self.pinned.load(Ordering::Relaxed)
    }

    /// Starts copying `t` (any dtype and shape, contiguous) to a pinned buffer on the side
    /// stream, after the work the device's stream issued so far. The device copy stays alive
    /// until [`OffloadedTensor::release`] (or a fetch). An empty tensor is kept as it is.
    ///
    /// # Errors
    /// [`Error::Config`] while a CUDA graph capture runs (the copies are not captured: train
    /// eagerly) or when the host cannot pin the buffer; driver failures.
    pub fn offload(&self, t: Tensor) -> Result<OffloadedTensor> {
        let n = t.num_bytes();
        let (shape, dtype) = (t.shape().to_vec(), t.dtype());
        let mut out = OffloadedTensor { owner: self.clone(), shape, dtype, host: None, state: State::Resident(None) };
        if n == 0 {
            out.state = State::Resident(Some(t));
            return Ok(out);
        }
        if self.dev.capturing() {
            return Err(Error::Config {
                module: OP,
                message: "activation offload does not run inside a CUDA graph capture: train eagerly (drop \
                          --cuda-graph) or without --offload-activations"
                    .into(),
            });
        }
        let mut host = self.take(n)?;
        let main = self.dev.stream();
        let written = main.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        self.side.wait(&written)?;
        self.side.memcpy_dtoh(&t.data().slice(0..n), &mut host)?;
        let done = self.side.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        out.host = Some(host);
        out.state = State::Out { device: t, done };
        Ok(out)
    }

    /// A pinned buffer of exactly `n` bytes: one of the pool's, else a new one.
    fn take(&self, n: usize) -> Result<PinnedHostSlice<u8>> {
        {
            let mut pool = self.pool.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = pool.iter().position(|b| b.len() == n) {
                return Ok(pool.swap_remove(i));
            }
        }
        // SAFETY: the bytes are unset until the copy out writes all `n` of them; nothing reads
        // them before (the copy in is ordered after the copy out on the side stream).
        let buf = unsafe { self.dev.context().alloc_pinned_with_flags::<u8>(n, 0) }.map_err(|e| Error::Config {
            module: OP,
            message: format!(
                "cannot pin {n} bytes of host memory for activation offload ({e}): offload fewer layers \
                 (--offload-activations) or free host memory"
            ),
        })?;
        self.pinned.fetch_add(n as u64, Ordering::Relaxed);
        Ok(buf)
    }

    /// Hands a pinned buffer back to the pool.
    fn give(&self, buf: PinnedHostSlice<u8>) {
        self.pool.lock().unwrap_or_else(PoisonError::into_inner).push(buf);
    }
}

/// Where an offloaded tensor is.
#[derive(Debug)]
enum State {
    /// On the device, no copy involved: an empty tensor, or one fetched.
    Resident(Option<Tensor>),
    /// Being copied out: the device copy lives until the device's stream waited on `done`.
    Out { device: Tensor, done: CudaEvent },
    /// Only in the pinned buffer.
    Host,
    /// Being copied in to `device` (allocated on the device's stream).
    In { device: Tensor, done: CudaEvent },
}

/// A tensor [`HostOffload::offload`] is moving to pinned host memory and back. Dropping it
/// without a fetch is safe: the device's stream waits for a copy in flight before its device
/// buffer is freed, and the pinned buffer goes back to the pool.
#[derive(Debug)]
pub struct OffloadedTensor {
    owner: HostOffload,
    shape: Vec<usize>,
    dtype: DType,
    host: Option<PinnedHostSlice<u8>>,
    state: State,
}

impl OffloadedTensor {
    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The tensor's dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes held on the device now (0 once released, until a prefetch).
    pub fn device_bytes(&self) -> usize {
        match &self.state {
            State::Host | State::Resident(None) => 0,
            State::Resident(Some(t)) | State::Out { device: t, .. } | State::In { device: t, .. } => t.num_bytes(),
        }
    }

    /// Frees the device copy once the copy out finished (the device's stream waits on the
    /// copy's event, no host wait): call it after issuing the work the copy should overlap.
    /// A no-op in any other state.
    ///
    /// # Errors
    /// Driver failures.
    pub fn release(&mut self) -> Result<()> {
        if let State::Out { done, .. } = &self.state {
            self.owner.dev.stream().wait(done)?;
            self.state = State::Host;
        }
        Ok(())
    }

    /// Starts copying the tensor back to a new device buffer on the side stream (a no-op unless
    /// it is only on the host): call it a layer ahead of [`OffloadedTensor::fetch`].
    ///
    /// # Errors
    /// Allocation (out of memory) and driver failures.
    pub fn prefetch(&mut self) -> Result<()> {
        if !matches!(self.state, State::Host) {
            return Ok(());
        }
        let host = self.host.as_ref().ok_or_else(|| Error::internal(OP, "an offloaded tensor without its buffer"))?;
        let n = host.len();
        let dev = &self.owner.dev;
        let mut device = Tensor::empty(dev, self.dtype, &self.shape)?;
        let side = &self.owner.side;
        let allocated = dev.stream().record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        side.wait(&allocated)?;
        side.memcpy_htod(host, &mut device.data_mut()?.slice_mut(0..n))?;
        let done = side.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        self.state = State::In { device, done };
        Ok(())
    }

    /// The tensor on the device, ready for the device's stream (which waits on the copy in;
    /// the copy starts here unless [`OffloadedTensor::prefetch`] started it). The pinned
    /// buffer goes back to the pool.
    ///
    /// # Errors
    /// As [`OffloadedTensor::prefetch`].
    pub fn fetch(mut self) -> Result<Tensor> {
        self.prefetch()?;
        let main = self.owner.dev.stream().clone();
        match std::mem::replace(&mut self.state, State::Resident(None)) {
            State::Resident(Some(t)) => Ok(t),
            State::Out { device, done } | State::In { device, done } => {
                main.wait(&done)?;
                Ok(device)
            }
            State::Resident(None) | State::Host => Err(Error::internal(OP, "an offloaded tensor lost its data")),
        }
    }
}

impl Drop for OffloadedTensor {
    fn drop(&mut self) {
        // A device buffer a side-stream copy still reads or writes is freed after the copy.
        if let State::Out { done, .. } | State::In { done, .. } = &self.state {
            let _ = self.owner.dev.stream().wait(done);
        }
        if let Some(buf) = self.host.take() {
            self.owner.give(buf);
        }
    }
}

/// The offload setting of a model's stack of layers: how many of the first layers have their
/// saved inputs offloaded, and the [`HostOffload`] (side stream and pinned pool) they use, kept
/// across changes of the count. What `DecoderLm` and `Gpt` hold.
#[derive(Debug, Clone, Default)]
pub struct LayerOffload(Option<(usize, HostOffload)>);

impl LayerOffload {
    /// Offloads the first `n` of `layers` layers from now on (0: none), making the side stream
    /// on `dev` the first time.
    ///
    /// # Errors
    /// [`Error::Config`] for `n` above `layers`; driver failures creating the side stream.
    pub fn set(&mut self, dev: &Arc<Device>, layers: usize, n: usize) -> Result<()> {
        OffloadPlan::new(layers, n)?;
        self.0 = match (n, self.0.take()) {
            (0, _) => None,
            (n, Some((_, host))) => Some((n, host)),
            (n, None) => Some((n, HostOffload::new(dev)?)),
        };
        Ok(())
    }

    /// The layers offloaded (0: none).
    pub fn layers(&self) -> usize {
        self.0.as_ref().map_or(0, |(n, _)| *n)
    }

    /// The side stream and pool, when any layer is offloaded.
    pub fn host(&self) -> Option<&HostOffload> {
        self.0.as_ref().map(|(_, h)| h)
    }

    /// Bytes of pinned host memory held (0 before the first offload).
    pub fn pinned_bytes(&self) -> u64 {
        self.host().map_or(0, HostOffload::pinned_bytes)
    }
}

/// Which layers of a stack of `layers` offload their saved input, and when each copy runs:
/// the first `offloaded` layers (TE's `num_layers` of `get_cpu_offload_context`).
///
/// Forward: layer `l`'s input goes out before layer `l`'s forward is issued (after the kernel
/// that wrote it) and its device copy is released after layer `l + 1`'s (so the copy overlaps
/// both forwards; at most two inputs in flight). Backward (layers in reverse): before layer `l`'s backward its input is fetched
/// (prefetched while layer `l + 1`'s ran) and layer `l − 1`'s prefetched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadPlan {
    /// Layers in the stack.
    pub layers: usize,
    /// Layers offloaded, the first ones (at most `layers`).
    pub offloaded: usize,
}

/// One step of an [`OffloadPlan`]'s schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadStep {
    /// Layer `l`'s forward is issued.
    Forward(usize),
    /// Layer `l`'s input starts its copy out (before its forward).
    Out(usize),
    /// Layer `l`'s input's device copy is freed after its copy out.
    Release(usize),
    /// Layer `l`'s input starts its copy in.
    Prefetch(usize),
    /// The device's stream waits for layer `l`'s input.
    Fetch(usize),
    /// Layer `l`'s backward is issued.
    Backward(usize),
}

impl OffloadPlan {
    /// The plan offloading the first `offloaded` of `layers`.
    ///
    /// # Errors
    /// [`Error::Config`] when `offloaded` exceeds `layers`.
    pub fn new(layers: usize, offloaded: usize) -> Result<Self> {
        if offloaded > layers {
            return Err(Error::Config {
                module: OP,
                message: format!(
                    "cannot offload the inputs of {offloaded} layers of a model of {layers}: pass at most {layers} \
                     (usually {}, all but the last)",
                    layers.saturating_sub(1)
                ),
            });
        }
        Ok(Self { layers, offloaded })
    }

    /// [`OffloadPlan::new`] for a forward of `module` that keeps only its layers' inputs
    /// (`full_recompute`; what the offload moves): what `Gpt` and `DecoderLm` check before
    /// each forward.
    ///
    /// # Errors
    /// [`Error::Config`] for layers offloaded without full recompute (naming the flag to add),
    /// and as [`OffloadPlan::new`].
    pub fn for_forward(module: &'static str, layers: usize, offloaded: usize, full_recompute: bool) -> Result<Self> {
        if offloaded > 0 && !full_recompute {
            return Err(Error::Config {
                module,
                message: format!(
                    "offloading the activations of {offloaded} layers is built for full recompute (each layer saves \
                     its input only): add Recompute::Full (te train --recompute full)"
                ),
            });
        }
        Self::new(layers, offloaded)
    }

    /// A training estimate `base` (bytes, every layer input on the device) with the inputs of
    /// the first `offloaded` of `layers` in host memory, inputs of `input_bytes` each: the
    /// device keeps the other layers' inputs and two offloaded ones in flight
    /// ([`OffloadPlan::resident_inputs`]).
    pub fn device_estimate(base: u64, layers: usize, offloaded: usize, input_bytes: u64) -> u64 {
        let plan = Self { layers, offloaded: offloaded.min(layers) };
        base.saturating_sub(layers as u64 * input_bytes - plan.resident_inputs(input_bytes))
    }

    /// Whether layer `l` offloads its input.
    pub fn is_offloaded(&self, l: usize) -> bool {
        l < self.offloaded
    }

    /// The layer whose device copy is released once layer `l`'s forward was issued.
    pub fn release_after_forward(&self, l: usize) -> Option<usize> {
        l.checked_sub(1).filter(|&p| self.is_offloaded(p))
    }

    /// The layer prefetched before layer `l`'s backward.
    pub fn prefetch_before_backward(&self, l: usize) -> Option<usize> {
        l.checked_sub(1).filter(|&p| self.is_offloaded(p))
    }

    /// The whole schedule of one forward and backward, in issue order (what the models do).
    pub fn schedule(&self) -> Vec<OffloadStep> {
        let mut s = Vec::new();
        for l in 0..self.layers {
            if self.is_offloaded(l) {
                s.push(OffloadStep::Out(l));
            }
            s.push(OffloadStep::Forward(l));
            if let Some(p) = self.release_after_forward(l) {
                s.push(OffloadStep::Release(p));
            }
        }
        if self.offloaded == self.layers && self.layers > 0 {
            s.push(OffloadStep::Release(self.layers - 1));
        }
        for l in (0..self.layers).rev() {
            if self.is_offloaded(l) {
                s.push(OffloadStep::Fetch(l));
            }
            if let Some(p) = self.prefetch_before_backward(l) {
                s.push(OffloadStep::Prefetch(p));
            }
            s.push(OffloadStep::Backward(l));
        }
        s
    }

    /// Device bytes of layer inputs the plan keeps at a time, for inputs of `input_bytes` each:
    /// the layers not offloaded plus two in flight (one being copied while the next is used).
    pub fn resident_inputs(&self, input_bytes: u64) -> u64 {
        let kept = (self.layers - self.offloaded) as u64 + (self.offloaded as u64).min(2);
        kept * input_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use OffloadStep::*;

    #[test]
    fn all_but_the_last_layer_go_out_and_come_back_a_layer_ahead() {
        let plan = OffloadPlan::new(3, 2).unwrap();
        assert_eq!(
            plan.schedule(),
            vec![
                Out(0),
                Forward(0),
                Out(1),
                Forward(1),
                Release(0),
                Forward(2),
                Release(1),
                Prefetch(1),
                Backward(2),
                Fetch(1),
                Prefetch(0),
                Backward(1),
                Fetch(0),
                Backward(0),
            ]
        );
    }

    #[test]
    fn every_layer_offloaded_releases_the_last_after_the_stack() {
        let s = OffloadPlan::new(2, 2).unwrap().schedule();
        assert_eq!(s[..5], [Out(0), Forward(0), Out(1), Forward(1), Release(0)]);
        assert_eq!(s[5], Release(1));
        assert_eq!(s[6..], [Fetch(1), Prefetch(0), Backward(1), Fetch(0), Backward(0)]);
    }

    #[test]
    fn nothing_offloaded_is_the_plain_schedule_and_too_many_is_refused() {
        let s = OffloadPlan::new(2, 0).unwrap().schedule();
        assert_eq!(s, vec![Forward(0), Forward(1), Backward(1), Backward(0)]);
        let e = OffloadPlan::new(2, 3).unwrap_err().to_string();
        assert!(e.contains("at most 2") && e.contains("all but the last"), "{e}");
    }

    #[test]
    fn resident_inputs_count_the_kept_layers_and_two_in_flight() {
        assert_eq!(OffloadPlan::new(8, 7).unwrap().resident_inputs(10), 30);
        assert_eq!(OffloadPlan::new(8, 0).unwrap().resident_inputs(10), 80);
        assert_eq!(OffloadPlan::new(8, 1).unwrap().resident_inputs(10), 80);
        assert_eq!(OffloadPlan::new(1, 1).unwrap().resident_inputs(10), 10);
    }
}
