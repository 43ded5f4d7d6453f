//! The CUDA device: context, stream, arch and the kernels loaded on it.

use crate::gemm::Engine;
use crate::graph::HostCopies;
use crate::kernels::KernelCache;
use crate::{Error, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use te_codegen::{Arch, DType, KernelCompiler, KernelSpec};

/// True when libcuda loads and reports at least one device. Never panics.
pub fn gpu_available() -> bool {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
}

/// The number of CUDA GPUs this process sees (0 when libcuda does not load). Never panics.
pub fn device_count() -> usize {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { sys::is_culib_present() } {
        return 0;
    }
    CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

/// One GPU: a context, the stream all work is issued on, and its JIT-loaded kernels.
#[derive(Debug)]
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    name: String,
    compute_capability: (i32, i32),
    sm_count: usize,
    kernels: KernelCache,
    /// cuBLASLt state, created by the first GEMM (`None` until then, and after a failed try).
    gemm: Mutex<Option<Arc<Engine>>>,
    /// The latest host-built constants uploaded by [`Device::upload_cached`] with their keys,
    /// the most recent first, at most `UPLOAD_SLOTS`.
    uploads: Mutex<Vec<KeyedUpload>>,
    /// A CUDA graph capture is running on the stream ([`crate::graph::Graph::capture`]): kernels
    /// and GEMM algorithms must come from the caches then. Shared with the GEMM engine.
    capturing: Arc<AtomicBool>,
    /// `[1]` u64 every dropout kernel adds to its Philox offset ([`Device::philox_offset_base`]).
    philox_offset_base: CudaSlice<u64>,
}

/// Ends the device's capture mode when dropped ([`Device::begin_capture_mode`]).
pub(crate) struct CaptureMode<'a>(&'a AtomicBool);

impl Drop for CaptureMode<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// An uploaded constant and the key it was built for.
type KeyedUpload = (Vec<u64>, Arc<CudaSlice<u8>>);

/// Constants [`Device::upload_cached`] keeps: a batch's padding mask and the delayed-scaling
/// tables of a forward and a backward, with room to spare.
const UPLOAD_SLOTS: usize = 8;

impl Device {
    /// Opens device `ordinal` with the disk cache the environment asks for.
    ///
    /// # Errors
    /// [`Error::DriverMissing`], [`Error::NoDevice`], [`Error::UnsupportedArch`] (no FP8), or
    /// [`te_codegen::Error::NvrtcMissing`] wrapped in [`Error::Codegen`].
    pub fn new(ordinal: usize) -> Result<Arc<Device>> {
        Self::with_compiler(ordinal, KernelCompiler::from_env()?)
    }

    /// Opens device `ordinal`, compiling kernels with `compiler`.
    ///
    /// # Errors
    /// As [`Device::new`].
    pub fn with_compiler(ordinal: usize, compiler: KernelCompiler) -> Result<Arc<Device>> {
        // SAFETY: only tries to dlopen the driver library.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::DriverMissing);
        }
        let count = CudaContext::device_count()? as usize;
        if ordinal >= count {
            return Err(Error::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = Arch::from_compute_capability(major, minor).ok_or_else(|| Error::UnsupportedArch {
            device: name.clone(),
            major,
            minor,
        })?;
        let sm_count = ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize;
        // All work goes to one stream, so cudarc's per-buffer event tracking is pure overhead.
        // SAFETY: no buffer has been allocated on this context yet.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own, not the legacy default stream, which CUDA graphs cannot capture.
        let stream = ctx.new_stream()?;
        let philox_offset_base = stream.alloc_zeros::<u64>(1)?;
        let dev = Device {
            ctx,
            stream,
            arch,
            name,
            compute_capability: (major, minor),
            sm_count,
            kernels: KernelCache::new(compiler),
            gemm: Mutex::new(None),
            uploads: Mutex::new(Vec::new()),
            capturing: Arc::new(AtomicBool::new(false)),
            philox_offset_base,
        };
        dev.keep_freed_memory()?;
        Ok(Arc::new(dev))
    }

    /// Makes the stream's memory pool keep what is freed instead of handing it back to the
    /// driver at every synchronization (its default release threshold is 0): a training step
    /// frees and allocates its activations again each step, and re-mapping gigabytes per step
    /// costs milliseconds (PyTorch's caching allocator keeps freed blocks the same way). The
    /// pool still grows only to the peak in use ([`Device::peak_memory`]).
    fn keep_freed_memory(&self) -> Result<()> {
        self.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
    }

    /// The CUDA context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every op of this crate runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The compile target of this GPU.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The GPU's name, e.g. `NVIDIA H100 80GB HBM3`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Compute capability `(major, minor)`.
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// The driver's CUDA version `(major, minor)`, e.g. `(13, 0)`.
    ///
    /// # Errors
    /// Driver failures.
    pub fn driver_version(&self) -> Result<(i32, i32)> {
        let mut v = 0;
        // SAFETY: the driver is loaded (a context exists); `v` is a valid out-pointer.
        unsafe { sys::cuDriverGetVersion(&mut v) }.result()?;
        Ok((v / 1000, (v % 1000) / 10))
    }

    /// Number of streaming multiprocessors.
    pub fn sm_count(&self) -> usize {
        self.sm_count
    }

    /// The kernels loaded on this device.
    pub fn kernels(&self) -> &KernelCache {
        &self.kernels
    }

    /// Entry point `entry` (index into [`KernelSpec::entry_points`]) of `spec`, compiled and
    /// loaded on first use.
    ///
    /// # Errors
    /// Compile and load failures.
    /// Inside a CUDA graph capture only kernels loaded before it are given
    /// ([`crate::graph::CaptureRule::KernelsLoadedBefore`]).
    pub fn function(&self, spec: &KernelSpec, entry: usize) -> Result<CudaFunction> {
        if self.capturing() {
            return self.kernels.loaded_function(spec, entry).unwrap_or_else(|| {
                Err(Error::Capture { rule: crate::graph::CaptureRule::KernelsLoadedBefore, detail: spec.name() })
            });
        }
        self.kernels.function(&self.ctx, spec, entry)
    }

    /// Whether a CUDA graph capture is running on the stream.
    pub fn capturing(&self) -> bool {
        self.capturing.load(Ordering::SeqCst)
    }

    /// The capture flag, shared with the GEMM engine.
    pub(crate) fn capture_flag(&self) -> Arc<AtomicBool> {
        self.capturing.clone()
    }

    /// Enters capture mode, or `None` when a capture is already running.
    pub(crate) fn begin_capture_mode(&self) -> Option<CaptureMode<'_>> {
        let was = self.capturing.swap(true, Ordering::SeqCst);
        (!was).then_some(CaptureMode(&self.capturing))
    }

    /// The cuBLASLt handle, workspace and algorithm cache of this device, created on first use.
    ///
    /// # Errors
    /// [`Error::CublasLtMissing`], cuBLASLt and allocation failures; a later call tries again.
    pub(crate) fn gemm_engine(&self) -> Result<Arc<Engine>> {
        let mut slot = self.gemm.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(engine) = slot.as_ref() {
            return Ok(engine.clone());
        }
        if self.capturing() {
            // Its workspace would become graph memory, freed at the next replay.
            let rule = crate::graph::CaptureRule::GemmAlgorithmsChosenBefore;
            return Err(Error::Capture { rule, detail: "the first GEMM on this device".into() });
        }
        let engine = Arc::new(Engine::new(self)?);
        *slot = Some(engine.clone());
        Ok(engine)
    }

    /// Device memory this process can still allocate, and the device's total, in bytes: the
    /// driver's free memory (`cuMemGetInfo`) plus what the stream's memory pool keeps of freed
    /// allocations (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT − USED_MEM_CURRENT`: the pool's release
    /// threshold is the maximum, so it keeps what is freed for the next allocations). A second
    /// run in one process (`te train --precision both`) so sees the first run's memory as
    /// available, as `torch.cuda.mem_get_info` plus the caching allocator's free blocks would.
    ///
    /// # Errors
    /// Driver failures.
    pub fn memory_info(&self) -> Result<(u64, u64)> {
        let (free, total) = self.ctx.mem_get_info()?;
        let reserved = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        let used = self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        Ok((free as u64 + reserved.saturating_sub(used), total as u64))
    }

    /// A u64-valued attribute of the default pool.
    fn pool_attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut value = 0u64;
        // SAFETY: the pool is the device's default pool (it lives as long as the context); the
        // attributes read here are u64 (cuuint64_t) values, as the driver API specifies.
        unsafe { sys::cuMemPoolGetAttribute(self.default_mem_pool()?, attr, (&mut value as *mut u64).cast()) }
            .result()?;
        Ok(value)
    }

    /// The error of a failed allocation of `bytes` for a `dtype` tensor of `shape`:
    /// [`Error::OutOfMemory`] with the device's free memory when the driver ran out, else the
    /// driver error.
    pub(crate) fn alloc_error(&self, e: DriverError, bytes: usize, dtype: DType, shape: &[usize]) -> Error {
        if e.0 != sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
            return e.into();
        }
        let (free, total) = self.memory_info().unwrap_or((0, 0));
        Error::OutOfMemory { what: format!("a {dtype} tensor {shape:?}"), requested: bytes as u64, free, total }
    }

    /// The most device memory the stream's allocations held at once (bytes) since the device
    /// was created or since [`Device::reset_peak_memory`]: the default memory pool's
    /// `CU_MEMPOOL_ATTR_USED_MEM_HIGH`, which counts every tensor, workspace and optimizer
    /// state allocated through the stream (PyTorch's `torch.cuda.max_memory_allocated`).
    /// Memory the driver or cuBLASLt holds outside the pool is not counted.
    ///
    /// # Errors
    /// Driver failures.
    pub fn peak_memory(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Device memory the stream's allocations hold now (bytes): the default memory pool's
    /// `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`, every tensor, workspace and optimizer state
    /// allocated through the stream (PyTorch's `torch.cuda.memory_allocated`). Read after a
    /// [`Device::synchronize`] for a settled value.
    ///
    /// # Errors
    /// Driver failures.
    pub fn memory_in_use(&self) -> Result<u64> {
        self.pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Restarts [`Device::peak_memory`] from the memory in use now (the driver takes only 0
    /// for USED_MEM_HIGH, which resets it to the current usage).
    ///
    /// # Errors
    /// Driver failures.
    pub fn reset_peak_memory(&self) -> Result<()> {
        self.set_pool_attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)
    }

    /// Waits for the stream, then hands the memory the default pool keeps after frees back to
    /// the driver (PyTorch's `torch.cuda.empty_cache()`; the pool keeps it otherwise, see
    /// `keep_freed_memory`): before a CUDA graph capture, whose allocations come from the
    /// driver's graph memory pool, not from this one, so the eager steps' cached activations
    /// do not sit idle beside the graph's.
    ///
    /// # Errors
    /// [`Error::Capture`] inside a capture; driver failures (a failed kernel surfaces here).
    pub fn release_cached_memory(&self) -> Result<()> {
        self.synchronize()?;
        // SAFETY: the device's default pool; trimming to 0 releases only unused memory.
        unsafe { sys::cuMemPoolTrimTo(self.default_mem_pool()?, 0) }.result()?;
        Ok(())
    }

    /// Sets a u64-valued attribute (release threshold, high-water marks) of the default pool.
    fn set_pool_attribute(&self, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
        let mut value = value;
        // SAFETY: the pool is the device's default pool (it lives as long as the context); the
        // attributes passed here take a u64 (cuuint64_t) value, as the driver API specifies.
        unsafe { sys::cuMemPoolSetAttribute(self.default_mem_pool()?, attr, (&mut value as *mut u64).cast()) }
            .result()?;
        Ok(())
    }

    /// The default memory pool of the device, which the stream's asynchronous allocations use.
    fn default_mem_pool(&self) -> Result<sys::CUmemoryPool> {
        self.ctx.bind_to_thread()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: `pool` is a valid out-pointer; the device ordinal is this context's device.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, self.ctx.cu_device()) }.result()?;
        Ok(pool)
    }

    /// The bytes `build` makes, uploaded once for calls with the same `key` while it is among
    /// the latest eight keys: the padding mask of an attention batch, which every
    /// layer of the batch reads (one host build and one upload per batch instead of one per
    /// layer), and the delayed-scaling update's table of its states' addresses
    /// ([`crate::ops::scaling::DelayedScalingTable`], the same every step). A cached key makes
    /// no upload, so a CUDA graph capture can take it (see [`crate::graph`]). Keys are the
    /// callers' to keep apart (each starts with words of its own).
    ///
    /// # Errors
    /// Upload failures ([`Error::Capture`] for a new key inside a capture).
    pub fn upload_cached(&self, key: &[u64], build: impl FnOnce() -> Vec<u8>) -> Result<Arc<CudaSlice<u8>>> {
        let mut slots = self.uploads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = slots.iter().position(|(k, _)| k == key) {
            let hit = slots.remove(i);
            let bytes = hit.1.clone();
            slots.insert(0, hit);
            return Ok(bytes);
        }
        let bytes = Arc::new(self.stream.htod(&build())?);
        slots.insert(0, (key.to_vec(), bytes.clone()));
        slots.truncate(UPLOAD_SLOTS);
        Ok(bytes)
    }

    /// The graph-safe Philox base: one u64 in device memory that every dropout kernel adds to
    /// the offset it is launched with (PyTorch's CUDA generator reads its offset from device
    /// memory inside graphs the same way, `philox_cuda_state`). It is 0 unless a graph replay
    /// set it: a captured step's dropout offsets are frozen in the graph, so before replaying
    /// it `n` steps later the trainer sets the base to `n` × the offsets one step advances,
    /// and the replay draws the masks the eager step would have drawn.
    pub fn philox_offset_base(&self) -> &CudaSlice<u64> {
        &self.philox_offset_base
    }

    /// Sets [`Device::philox_offset_base`], ordered on the stream (after the work issued
    /// before, before the work issued after). A host upload: not inside a capture.
    ///
    /// # Errors
    /// [`Error::Capture`] inside a capture; copy failures.
    pub fn set_philox_offset_base(&self, base: u64) -> Result<()> {
        crate::graph::refuse_in_capture(&self.stream, "Device::set_philox_offset_base")?;
        let (dst, _guard) = self.philox_offset_base.device_ptr(&self.stream);
        // SAFETY: the buffer (8 bytes) lives as long as `self`; the copy is ordered on its
        // stream, and from pageable memory it returns once `base` is staged, so the stack
        // value may go. The only writer of the buffer is this stream-ordered copy.
        unsafe { sys::cuMemcpyHtoDAsync_v2(dst, (&base as *const u64).cast(), 8, self.stream.cu_stream()) }.result()?;
        Ok(())
    }

    /// Waits for all work on the stream.
    ///
    /// # Errors
    /// A failed kernel surfaces here.
    pub fn synchronize(&self) -> Result<()> {
        crate::graph::refuse_in_capture(&self.stream, "a synchronization")?;
        Ok(self.stream.synchronize()?)
    }

    /// Fails with [`Error::OutOfMemory`] (`what`, the estimate, the free and total memory) when
    /// `needed` bytes exceed the memory this process can still allocate ([`Device::memory_info`]:
    /// the driver's free memory and the pool's freed blocks): the check before a run allocates
    /// anything.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`]; driver failures reading the free memory.
    pub fn check_free_memory(&self, needed: u64, what: impl FnOnce() -> String) -> Result<()> {
        let (free, total) = self.memory_info()?;
        if needed > free {
            return Err(Error::OutOfMemory { what: what(), requested: needed, free, total });
        }
        Ok(())
    }
}
