//! CUDA graphs: capture the device work of a closure once, replay it with one launch (TE's
//! `make_graphed_callables`; PyTorch's `torch.cuda.graph`). The host cost of issuing a step's
//! hundreds of kernels one by one is what bounds small models; a replay issues them all at once.
//!
//! [`Graph::capture`] runs the closure with the device's stream in capture mode (stream capture,
//! `cuStreamBeginCapture`, through cudarc): kernels, GEMMs, copies and allocations are recorded,
//! not run. [`Graph::replay`] launches the recording on the stream. The rules, as CUDA's and
//! PyTorch's:
//!
//! - **Shapes are fixed per graph.** A replay runs on the same buffers with the same sizes: the
//!   caller keeps static input tensors alive and fills them before each replay
//!   ([`crate::Tensor::copy_from`]), and reads the outputs the closure returned after it.
//! - **No host transfers inside.** A read of device data to the host (`to_f32`), a
//!   synchronization, or an upload of host data cannot be recorded: do them before or after.
//! - **Everything is prepared before the capture.** Every kernel the closure launches must be
//!   loaded and every cuBLASLt algorithm chosen: run the closure once eagerly first (a warm-up
//!   step), as PyTorch's docs ask too.
//! - **Allocations come from the device's memory pool and live with the graph.** Tensors the
//!   closure allocates become the graph's memory (the same addresses at every replay); the
//!   tensors it returns hold the values of the latest replay and are only valid after one. Each
//!   replay frees what the previous one left allocated (`AUTO_FREE_ON_LAUNCH`).
//! - **One capture at a time** per device.
//!
//! A capture that breaks a rule returns [`Error::Capture`] naming it ([`CaptureRule`]); the capture
//! is ended and discarded, and the device stays usable. Nothing hangs and no partial graph is
//! ever replayed. Tensors the capture allocated may be dropped at any time, even before the first
//! replay (when their memory does not exist yet): `graph_memory` frees them after that replay, or
//! not at all when the graph never runs.

use crate::{graph_memory, Device, Error, Result};
use cudarc::driver::sys::{self, cudaError_enum as E, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr, DeviceRepr, DriverError, HostSlice};
use std::fmt;
use std::sync::Arc;

/// The rule of [`Graph::capture`] a capture broke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureRule {
    /// A kernel was not loaded before the capture (it would be compiled inside it).
    KernelsLoadedBefore,
    /// A GEMM shape met for the first time inside the capture (its cuBLASLt algorithm unchosen).
    GemmAlgorithmsChosenBefore,
    /// A host read, synchronization or upload inside the capture.
    NoHostTransfers,
    /// A capture started while one was running on the device.
    OneCaptureAtATime,
}

impl fmt::Display for CaptureRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CaptureRule::KernelsLoadedBefore => {
                "every kernel must be loaded before the capture: run the closure once eagerly first (a warm-up call)"
            }
            CaptureRule::GemmAlgorithmsChosenBefore => {
                "every GEMM shape must have run before the capture (its cuBLASLt algorithm chosen): run the closure \
                 once eagerly first (a warm-up call)"
            }
            CaptureRule::NoHostTransfers => {
                "no host reads, synchronizations or uploads inside a capture: move them before or after it"
            }
            CaptureRule::OneCaptureAtATime => "one capture at a time per device: end the running one first",
        })
    }
}

/// A captured CUDA graph ([`Graph::capture`]): replays the device work of one closure.
pub struct Graph {
    graph: CudaGraph,
    dev: Arc<Device>,
    /// The capture's id in `graph_memory`.
    id: u64,
    launched: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph").field("device", &self.dev.name()).finish_non_exhaustive()
    }
}

impl Graph {
    /// Captures the device work `f` issues on `dev`'s stream (see the module docs for the rules),
    /// and returns the graph with what `f` returned (its output tensors: valid after the first
    /// [`Graph::replay`]). The work is recorded, not run.
    ///
    /// # Errors
    /// [`Error::Capture`] when `f` breaks a rule (the capture is discarded, the device usable);
    /// `f`'s own errors; driver failures of the capture.
    pub fn capture<T>(dev: &Arc<Device>, f: impl FnOnce() -> Result<T>) -> Result<(Graph, T)> {
        let Some(_capturing) = dev.begin_capture_mode() else {
            return Err(Error::Capture { rule: CaptureRule::OneCaptureAtATime, detail: String::new() });
        };
        let stream = dev.stream();
        // Thread-local: this thread's unsafe calls (a synchronous allocation or copy) fail the
        // capture at once instead of corrupting it; other threads are not restricted.
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let id = graph_memory::begin_capture(stream);
        let out = f();
        let end = stream.end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        let captured = matches!((&out, &end), (Ok(_), Ok(Some(_))));
        graph_memory::end_capture(stream, id, captured);
        let failed = |e: Error| {
            // Drops and frees of the discarded capture may have left a driver error on the
            // context; it belongs to the capture, not to the next call.
            let _ = dev.context().check_err();
            Err(capture_error(e))
        };
        match (out, end) {
            (Ok(value), Ok(Some(graph))) => {
                let launched = std::sync::atomic::AtomicBool::new(false);
                Ok((Graph { graph, dev: dev.clone(), id, launched }, value))
            }
            (Ok(_), Ok(None)) => Err(Error::internal("graph capture", "the driver ended the capture without a graph")),
            (Err(e), _) => failed(e),
            (Ok(_), Err(e)) => failed(e.into()),
        }
    }

    /// Launches the captured work on the device's stream (asynchronous, as the eager calls are):
    /// it reads the static inputs as they are now and overwrites the outputs.
    ///
    /// # Errors
    /// Driver failures of the launch.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch()?;
        if !self.launched.swap(true, std::sync::atomic::Ordering::SeqCst) {
            // The graph's memory exists now: captured tensors dropped before are freed.
            graph_memory::launched(self.id);
        }
        Ok(())
    }

    /// The device the graph runs on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        if !*self.launched.get_mut() {
            // Never launched: what it would have allocated never was.
            graph_memory::discard(self.id);
        }
    }
}

/// Fails with [`CaptureRule::NoHostTransfers`] while `stream` is capturing a graph: a host copy
/// there would be recorded, not run (a read would return what the device held before the
/// capture; an upload would replay from a host buffer long freed), so every host transfer of
/// this crate asks first ([`HostCopies`]).
///
/// # Errors
/// That error; driver failures of the query.
pub fn refuse_in_capture(stream: &CudaStream, what: &str) -> Result<()> {
    match stream.capture_status()? {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => Ok(()),
        _ => Err(Error::Capture { rule: CaptureRule::NoHostTransfers, detail: what.to_string() }),
    }
}

/// Whether `stream` is capturing a graph now (a caller that prepares device data on the host
/// takes it from a buffer filled before the capture then).
///
/// # Errors
/// Driver failures of the query.
pub fn is_capturing(stream: &CudaStream) -> Result<bool> {
    Ok(stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// cudarc's host copies with [`refuse_in_capture`] first: the crate's only way to move data
/// between host and device.
pub trait HostCopies {
    /// A device copy of `src` (`clone_htod`).
    fn htod<T: DeviceRepr, Src: HostSlice<T> + ?Sized>(&self, src: &Src) -> Result<CudaSlice<T>>;
    /// A host copy of `src` (`clone_dtoh`, synchronous).
    fn dtoh<T: DeviceRepr, Src: DevicePtr<T>>(&self, src: &Src) -> Result<Vec<T>>;
}

impl HostCopies for Arc<CudaStream> {
    fn htod<T: DeviceRepr, Src: HostSlice<T> + ?Sized>(&self, src: &Src) -> Result<CudaSlice<T>> {
        refuse_in_capture(self, "a host upload")?;
        Ok(self.clone_htod(src)?)
    }
    fn dtoh<T: DeviceRepr, Src: DevicePtr<T>>(&self, src: &Src) -> Result<Vec<T>> {
        refuse_in_capture(self, "a host read")?;
        Ok(self.clone_dtoh(src)?)
    }
}

/// [`Error::Capture`] for the driver's capture failures (a host transfer or synchronization
/// invalidates the capture); other errors as they are.
fn capture_error(e: Error) -> Error {
    match e {
        Error::Driver(DriverError(code)) if is_capture_failure(code) => {
            Error::Capture { rule: CaptureRule::NoHostTransfers, detail: format!("the driver said {code:?}") }
        }
        e => e,
    }
}

/// The driver's error codes of an unsupported or invalidated stream capture.
fn is_capture_failure(code: sys::cudaError_enum) -> bool {
    matches!(
        code,
        E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
            | E::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
            | E::CUDA_ERROR_STREAM_CAPTURE_MERGE
            | E::CUDA_ERROR_STREAM_CAPTURE_UNMATCHED
            | E::CUDA_ERROR_STREAM_CAPTURE_UNJOINED
            | E::CUDA_ERROR_STREAM_CAPTURE_ISOLATION
            | E::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
            | E::CUDA_ERROR_CAPTURED_EVENT
            | E::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capture_failures_of_the_driver_name_the_host_transfer_rule() {
        let e = capture_error(Error::Driver(DriverError(E::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)));
        assert!(matches!(e, Error::Capture { rule: CaptureRule::NoHostTransfers, .. }), "{e}");
        assert!(e.to_string().contains("no host reads"), "{e}");
        let other = capture_error(Error::Driver(DriverError(E::CUDA_ERROR_OUT_OF_MEMORY)));
        assert!(matches!(other, Error::Driver(_)), "{other}");
        for rule in [
            CaptureRule::KernelsLoadedBefore,
            CaptureRule::GemmAlgorithmsChosenBefore,
            CaptureRule::NoHostTransfers,
            CaptureRule::OneCaptureAtATime,
        ] {
            let text = Error::Capture { rule, detail: "x".into() }.to_string();
            assert!(text.starts_with("CUDA graph capture: ") && text.len() > 60, "{text}");
        }
    }
}
