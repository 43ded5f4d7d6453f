//! The per-device GEMM state: a cuBLASLt handle, the workspace every GEMM of the device shares,
//! and the algorithms the heuristic picked, cached by problem.

use super::lt::{Handle, Layout, MatmulDesc, Preference};
use super::AlgoKey;
use crate::graph::CaptureRule;
use crate::{Device, Error, Result};
use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys::{self, cublasLtMatmulAlgo_t, cublasLtMatmulPreferenceAttributes_t as Pref};
use cudarc::driver::{CudaSlice, DevicePtr};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// cuBLASLt's workspace recommendation (cuBLAS docs, `cublasLtMatmul`): 32 MiB on Hopper, as TE
/// allocates on sm90 (`get_cublasLt_workspace_size_bytes`), 4 MiB before. TE adds 1 KiB of slack
/// to move its pointer to a 256-byte boundary; a fresh device allocation already is on one
/// ([`Engine::new`] checks), so the slack is not needed here.
fn workspace_bytes(compute_capability_major: i32) -> usize {
    if compute_capability_major >= 9 {
        32 << 20
    } else {
        4 << 20
    }
}

/// The alignment cuBLASLt may assume for a device pointer: the largest power of two dividing it,
/// capped at 256 bytes (TE `_getAlignment`); 256 for a null pointer.
pub(crate) fn alignment(ptr: u64) -> u32 {
    1 << ptr.trailing_zeros().min(8)
}

/// cuBLASLt state of one device. All GEMMs run on the device's single stream, so they use the
/// workspace one after another and one workspace serves every caller thread.
#[derive(Debug)]
pub(crate) struct Engine {
    handle: Handle,
    workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    algos: Mutex<HashMap<AlgoKey, cublasLtMatmulAlgo_t>>,
    /// The device's CUDA graph capture flag: a capture takes algorithms from the cache only.
    capturing: Arc<AtomicBool>,
}

impl Engine {
    /// Loads cuBLASLt, creates the handle and allocates the workspace on `dev`'s stream.
    ///
    /// # Errors
    /// [`Error::CublasLtMissing`] when libcublasLt cannot be loaded; cuBLASLt and allocation
    /// failures.
    pub(crate) fn new(dev: &Device) -> Result<Self> {
        // SAFETY: only tries to dlopen libcublasLt; cudarc panics on first use when it is missing.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::CublasLtMissing);
        }
        dev.context().bind_to_thread()?;
        let handle = Handle::new()?;
        let workspace = dev.stream().alloc_zeros::<u8>(workspace_bytes(dev.compute_capability().0))?;
        let workspace_ptr = workspace.device_ptr(dev.stream()).0;
        if alignment(workspace_ptr) < 256 {
            return Err(Error::Gemm {
                message: format!("the cuBLASLt workspace at {workspace_ptr:#x} is not 256-byte aligned"),
            });
        }
        Ok(Self { handle, workspace, workspace_ptr, algos: Mutex::new(HashMap::new()), capturing: dev.capture_flag() })
    }

    /// The cuBLASLt handle.
    pub(crate) fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Device pointer and size in bytes of the workspace.
    pub(crate) fn workspace(&self) -> (u64, usize) {
        (self.workspace_ptr, self.workspace.len())
    }

    /// The algorithm for `key`: the heuristic's first pick for `desc` and the layouts `[A, B, C,
    /// D]` (cuBLASLt's operand order) under this workspace and the alignments in `key`, asked once
    /// per key. `problem` describes the GEMM for errors.
    ///
    /// # Errors
    /// [`Error::Gemm`] when cuBLASLt has no algorithm; other cuBLASLt failures.
    pub(crate) fn algo(
        &self,
        key: &AlgoKey,
        desc: &MatmulDesc,
        layouts: [&Layout; 4],
        problem: impl FnOnce() -> String,
    ) -> Result<cublasLtMatmulAlgo_t> {
        let mut algos = self.algos.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(algo) = algos.get(key) {
            return Ok(*algo);
        }
        if self.capturing.load(Ordering::SeqCst) {
            return Err(Error::Capture { rule: CaptureRule::GemmAlgorithmsChosenBefore, detail: problem() });
        }
        let mut pref = Preference::new()?;
        pref.set(Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, self.workspace.len() as u64)?;
        let [a, b, c, d] = key.alignments;
        pref.set(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, a)?;
        pref.set(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, b)?;
        pref.set(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, c)?;
        pref.set(Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, d)?;
        let [la, lb, lc, ld] = layouts;
        // SAFETY: every object is live for the call (borrowed from its owner); cudarc asks for one
        // result and turns "none found" into CUBLAS_STATUS_NOT_SUPPORTED.
        let found = unsafe {
            result::get_matmul_algo_heuristic(
                self.handle.raw(),
                desc.raw(),
                la.raw(),
                lb.raw(),
                lc.raw(),
                ld.raw(),
                pref.raw(),
            )
        };
        let algo = found.map_err(|e| unsupported(e, problem))?.algo;
        algos.insert(key.clone(), algo);
        Ok(algo)
    }
}

/// [`Error::Gemm`] naming the problem when cuBLASLt rejects it (`NOT_SUPPORTED`: no algorithm,
/// `INVALID_VALUE`: a combination it does not take), [`Error::Cublas`] for other failures.
pub(crate) fn unsupported(e: CublasError, problem: impl FnOnce() -> String) -> Error {
    use sys::cublasStatus_t::*;
    match e.0 {
        CUBLAS_STATUS_NOT_SUPPORTED | CUBLAS_STATUS_INVALID_VALUE => {
            Error::Gemm { message: format!("cuBLASLt has no algorithm for {} ({:?})", problem(), e.0) }
        }
        _ => Error::Cublas(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_256() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0080), 128);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
        assert_eq!(alignment(0x7f00_0000_0001), 1);
    }

    #[test]
    fn workspace_follows_cublaslt_recommendation() {
        assert_eq!(workspace_bytes(9), 32 << 20);
        assert_eq!(workspace_bytes(8), 4 << 20);
    }
}
