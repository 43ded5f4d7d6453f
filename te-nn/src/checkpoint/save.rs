//! Saving a model: every parameter and FP8 scaling state copied device→host into pinned buffers
//! (all copies issued on the stream, one synchronization), then one safetensors file written
//! atomically.

use super::atomic::{io_error, write_atomic};
use super::format::{build_metadata, fp8_scale_inv_name, state_tensor_names, to_safetensors};
use super::SaveOptions;
use crate::fp8::ScalingState;
use crate::modules::{ModuleVisitor, Param, ParamKind};
use crate::Module;
use cudarc::driver::{CudaStream, CudaView, DeviceRepr, PinnedHostSlice, ValidAsZeroBits};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::{Error, Result};

/// Writes `model`'s parameters and FP8 scaling states to the safetensors file `path`:
///
/// - each parameter under its path (`layers.0.mlp.fc1_weight`) in its stored dtype (f32, bf16,
///   f16); an FP8-only weight as its E4M3 codes (`F8_E4M3`) plus `<path>.scale_inv` (f32 `[1]`);
/// - each scaling state (`layers.0.mlp.fc1_fp8_fwd`) as `<path>.amax_history` (f32
///   `[n, history_len]`), `<path>.scale` and `<path>.scale_inv` (f32 `[n]`);
/// - `__metadata__`: the format name and version, the library version, and
///   [`SaveOptions::metadata`].
///
/// The device→host copies are issued on the stream into pinned host buffers and waited for
/// once. The file is written to a temporary file in the same directory, synced and renamed over
/// `path`: an existing checkpoint at `path` stays intact when saving fails.
///
/// # Errors
/// [`Error::Checkpoint`] for a parameter without tensor, two things under one name, a reserved
/// metadata key, or an I/O failure; driver failures of the copies.
pub fn save<M: Module + ?Sized>(model: &M, path: impl AsRef<Path>, options: &SaveOptions) -> Result<()> {
    let path = path.as_ref();
    let meta = build_metadata(options)?;
    let mut stage = Stage::default();
    model.visit("", &mut stage)?;
    for s in &stage.streams {
        s.synchronize()?;
    }
    let views = stage
        .tensors
        .iter()
        .map(|t| {
            Ok((t.name.as_str(), Bytes { dtype: to_safetensors(t.dtype), shape: &t.shape, bytes: t.host.bytes()? }))
        })
        .collect::<Result<Vec<_>>>()?;
    write_atomic(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| io_error(tmp, "cannot write", e))
    })
}

/// A host copy in flight (pinned) or made (empty tensors).
enum Host {
    Bytes(PinnedHostSlice<u8>),
    F32(PinnedHostSlice<f32>),
    Empty,
}

impl Host {
    /// The bytes, once the stream has been synchronized.
    fn bytes(&self) -> Result<Cow<'_, [u8]>> {
        Ok(match self {
            Host::Bytes(p) => Cow::Borrowed(p.as_slice()?),
            Host::F32(p) => Cow::Owned(p.as_slice()?.iter().flat_map(|x| x.to_le_bytes()).collect()),
            Host::Empty => Cow::Borrowed(&[]),
        })
    }
}

/// A host tensor as the writer takes it.
struct Bytes<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    bytes: Cow<'a, [u8]>,
}

impl View for Bytes<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// One tensor of the file.
struct Staged {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    host: Host,
}

/// The visitor that issues every copy.
#[derive(Default)]
struct Stage {
    tensors: Vec<Staged>,
    names: HashSet<String>,
    /// The streams the copies were issued on (one in practice), to synchronize at the end.
    streams: Vec<Arc<CudaStream>>,
}

impl Stage {
    fn push(&mut self, name: String, dtype: DType, shape: Vec<usize>, host: Host) -> Result<()> {
        if !self.names.insert(name.clone()) {
            return Err(Error::Checkpoint { message: format!("two tensors are named `{name}`: paths must be unique") });
        }
        self.tensors.push(Staged { name, dtype, shape, host });
        Ok(())
    }

    /// Issues the copy of `src` into a fresh pinned buffer on `stream`.
    fn copy<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        stream: &Arc<CudaStream>,
        src: &CudaView<'_, T>,
    ) -> Result<PinnedHostSlice<T>> {
        te_runtime::graph::refuse_in_capture(stream, "a checkpoint save")?;
        // SAFETY: the buffer is uninitialized until the copy below fills all of it (it has
        // `src.len()` elements); it is read only through `as_slice`, after the stream has been
        // synchronized (and `as_slice` waits for the copy's event too).
        let mut host = unsafe { stream.context().alloc_pinned_with_flags::<T>(src.len(), 0) }?;
        stream.memcpy_dtoh(src, &mut host)?;
        if !self.streams.iter().any(|s| Arc::ptr_eq(s, stream)) {
            self.streams.push(stream.clone());
        }
        Ok(host)
    }

    /// Stages the `n` leading bytes of a device tensor's buffer.
    fn stage_tensor(&mut self, name: String, t: &te_runtime::Tensor) -> Result<()> {
        let n = t.num_bytes();
        let host = if n == 0 {
            Host::Empty
        } else {
            let data = t.data();
            Host::Bytes(self.copy(data.stream(), &data.slice(0..n))?)
        };
        self.push(name, t.dtype(), t.shape().to_vec(), host)
    }
}

impl ModuleVisitor for Stage {
    fn param(&mut self, path: &str, _: ParamKind, param: &dyn Param) -> Result<()> {
        if let Some(t) = param.tensor() {
            return self.stage_tensor(path.to_owned(), t);
        }
        let Some(f) = param.fp8_tensor() else {
            return Err(Error::Checkpoint { message: format!("parameter `{path}` has no tensor to save") });
        };
        self.stage_tensor(path.to_owned(), f.data())?;
        let si = f.scale_inv();
        let host = self.copy(si.stream(), &si.slice(0..1))?;
        self.push(fp8_scale_inv_name(path), DType::F32, vec![1], Host::F32(host))
    }

    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> Result<()> {
        let stream = state.device().stream().clone();
        let n = state.slots();
        let b = state.lock();
        let [amax_name, scale_name, scale_inv_name] = state_tensor_names(path);
        let amax = self.copy(&stream, &b.amax_history.slice(0..n * b.history_len))?;
        let scale = self.copy(&stream, &b.scale.slice(0..n))?;
        let scale_inv = self.copy(&stream, &b.scale_inv.slice(0..n))?;
        self.push(amax_name, DType::F32, vec![n, b.history_len], Host::F32(amax))?;
        self.push(scale_name, DType::F32, vec![n], Host::F32(scale))?;
        self.push(scale_inv_name, DType::F32, vec![n], Host::F32(scale_inv))
    }
}
