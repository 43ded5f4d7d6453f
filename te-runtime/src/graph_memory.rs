//! Graph-owned memory: the tensors a capture allocates ([`crate::graph::Graph::capture`]).
//!
//! Inside a capture an allocation is a node of the graph (stream-ordered `cuMemAllocAsync`): its
//! address is reserved, but the memory exists only once the graph has been launched. Freeing it
//! before that launch (`cuMemFreeAsync` on an address the graph has not allocated yet) is an
//! error the driver reports as `CUDA_ERROR_INVALID_VALUE`, and cudarc keeps it on the context, so
//! that every later call fails: the easy mistake of dropping a captured output (a forward's
//! context, say) between the capture and the first replay would take the device down.
//!
//! [`DeviceBuffer`] (a tensor's storage, and every device buffer a module's context keeps for its
//! backward) asks this registry when it is dropped:
//! - allocated by the capture still running: freed as usual (the free becomes a graph node);
//! - allocated by a captured graph not launched yet: kept, and freed right after that graph's first
//!   launch (stream-ordered after it, when the memory exists);
//! - allocated by a capture that failed or a graph dropped unlaunched: never allocated, so
//!   released without a free.
//!
//! Source for the rules: the CUDA Programming Guide, "Graph Memory Nodes" (allocations freed
//! outside the graph must be freed after the allocating launch).

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::collections::{HashMap, HashSet};
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// Captures running plus addresses tracked: when 0 (almost always), a drop takes no lock.
static TRACKED: AtomicUsize = AtomicUsize::new(0);
static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

#[derive(Default)]
struct Registry {
    /// The capture running on each stream (`CUstream` as an integer) and its graph id.
    capturing: HashMap<usize, u64>,
    /// Addresses allocated by a capture, with its graph id, until that graph's first launch.
    allocated: HashMap<u64, u64>,
    /// Buffers dropped before their graph's first launch.
    deferred: HashMap<u64, Vec<Box<dyn Release>>>,
    /// Graphs discarded unlaunched: their addresses were never allocated.
    discarded: HashSet<u64>,
    next_id: u64,
}

fn with<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut guard = REGISTRY.lock().unwrap_or_else(PoisonError::into_inner);
    f(guard.get_or_insert_with(Registry::default))
}

fn address<T>(slice: &CudaSlice<T>) -> u64 {
    // Event tracking is off on this crate's contexts: the guard records nothing.
    let (ptr, _guard) = slice.device_ptr(slice.stream());
    ptr
}

/// A buffer the registry holds: freed (dropped) or released without a free.
trait Release: Send {
    fn address(&self) -> u64;
    fn leak(self: Box<Self>);
}

impl<T: Send> Release for CudaSlice<T> {
    fn address(&self) -> u64 {
        address(self)
    }
    fn leak(self: Box<Self>) {
        CudaSlice::leak(*self);
    }
}

/// Starts tracking the allocations of a capture on `stream`; returns its graph id.
pub(crate) fn begin_capture(stream: &CudaStream) -> u64 {
    TRACKED.fetch_add(1, Ordering::SeqCst);
    with(|r| {
        r.next_id += 1;
        r.capturing.insert(stream.cu_stream() as usize, r.next_id);
        r.next_id
    })
}

/// The capture `id` on `stream` ended: a graph (`captured`) or nothing (its allocations were
/// never made: [`discard`]).
pub(crate) fn end_capture(stream: &CudaStream, id: u64, captured: bool) {
    with(|r| r.capturing.remove(&(stream.cu_stream() as usize)));
    TRACKED.fetch_sub(1, Ordering::SeqCst);
    if !captured {
        discard(id);
    }
}

/// Graph `id` was launched: its memory exists. The buffers dropped before are freed now (after
/// the launch on the same stream); the live ones become ordinary allocations.
pub(crate) fn launched(id: u64) {
    if TRACKED.load(Ordering::SeqCst) == 0 {
        return;
    }
    let freed = with(|r| {
        let before = r.allocated.len();
        r.allocated.retain(|_, g| *g != id);
        TRACKED.fetch_sub(before - r.allocated.len(), Ordering::SeqCst);
        r.deferred.remove(&id)
    });
    drop(freed);
}

/// Graph `id` will never be launched (a failed capture, a graph dropped unlaunched): its buffers
/// are released without a free, now or when dropped.
pub(crate) fn discard(id: u64) {
    if TRACKED.load(Ordering::SeqCst) == 0 {
        return;
    }
    let dropped = with(|r| {
        let dropped = r.deferred.remove(&id).unwrap_or_default();
        for slice in &dropped {
            if r.allocated.remove(&slice.address()).is_some() {
                TRACKED.fetch_sub(1, Ordering::SeqCst);
            }
        }
        // Buffers still alive release themselves without a free when dropped.
        if r.allocated.values().any(|g| *g == id) {
            r.discarded.insert(id);
        }
        dropped
    });
    for slice in dropped {
        slice.leak();
    }
}

/// A device buffer (`CudaSlice<T>`, which it dereferences to) whose drop follows the rules of the
/// module docs: what a tensor stores, and what a module's context keeps for its backward, so that
/// dropping either between a capture and its first replay is safe.
#[derive(Debug)]
pub struct DeviceBuffer<T: Send + 'static = u8>(ManuallyDrop<CudaSlice<T>>);

impl<T: Send + 'static> DeviceBuffer<T> {
    /// Wraps a new allocation, noting it when a capture on its stream made it.
    pub fn new(slice: CudaSlice<T>) -> Self {
        if TRACKED.load(Ordering::SeqCst) > 0 {
            let stream = slice.stream().cu_stream() as usize;
            let ptr = address(&slice);
            with(|r| {
                if let Some(&id) = r.capturing.get(&stream) {
                    r.allocated.insert(ptr, id);
                    TRACKED.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
        Self(ManuallyDrop::new(slice))
    }
}

impl<T: Send + 'static> From<CudaSlice<T>> for DeviceBuffer<T> {
    fn from(slice: CudaSlice<T>) -> Self {
        Self::new(slice)
    }
}

impl<T: Send + 'static> Deref for DeviceBuffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.0
    }
}

impl<T: Send + 'static> DerefMut for DeviceBuffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.0
    }
}

impl<T: Send + 'static> DeviceSlice<T> for DeviceBuffer<T> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.0.stream()
    }
}

impl<T: Send + 'static> DevicePtr<T> for DeviceBuffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr(stream)
    }
}

impl<T: Send + 'static> DevicePtrMut<T> for DeviceBuffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (CUdeviceptr, SyncOnDrop<'a>) {
        self.0.device_ptr_mut(stream)
    }
}

/// What a drop does with a buffer.
enum OnDrop {
    Free,
    /// Kept until its graph's first launch (handed to the registry).
    Deferred,
    /// Never allocated: released without a free.
    Leak,
}

impl<T: Send + 'static> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.0) };
        if TRACKED.load(Ordering::SeqCst) == 0 {
            return drop(slice);
        }
        let ptr = address(&slice);
        let stream = slice.stream().cu_stream() as usize;
        let mut slice = Some(slice);
        let action = with(|r| {
            let Some(&id) = r.allocated.get(&ptr) else { return OnDrop::Free };
            if r.capturing.get(&stream) == Some(&id) {
                // Freed inside its own capture: a free node of the graph.
                r.allocated.remove(&ptr);
                TRACKED.fetch_sub(1, Ordering::SeqCst);
                return OnDrop::Free;
            }
            if r.discarded.contains(&id) {
                r.allocated.remove(&ptr);
                TRACKED.fetch_sub(1, Ordering::SeqCst);
                if !r.allocated.values().any(|g| *g == id) {
                    r.discarded.remove(&id);
                }
                return OnDrop::Leak;
            }
            // The graph has not launched yet: keep the buffer (its address stays tracked).
            if let Some(s) = slice.take() {
                r.deferred.entry(id).or_default().push(Box::new(s));
            }
            OnDrop::Deferred
        });
        match (action, slice) {
            (OnDrop::Free, Some(s)) => drop(s),
            (OnDrop::Leak, Some(s)) => {
                s.leak();
            }
            _ => {}
        }
    }
}
