//! AdamW's state (`te_train::optim::AdamW::save_state`, and the CPU twin's) in a safetensors file, next to the model's checkpoint: per parameter
//! `<path>.master`, `<path>.exp_avg`, `<path>.exp_avg_sq` (f32, the parameter's shape) and
//! `<path>.step` (u64 `[1]`), the optimizer's step count in the metadata. With the model's
//! checkpoint (weights and FP8 state) it is everything a resumed run needs to continue bit for
//! bit (PyTorch's `optimizer.state_dict()`).

use crate::checkpoint::format::parse;
use crate::checkpoint::write_atomic;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::Path;
use te_runtime::{Error, Result};

/// The `__metadata__` key holding the optimizer's step count.
const STEP_KEY: &str = "te.adamw.step";
/// The `__metadata__` key naming the format.
const FORMAT_KEY: &str = "te.format";
/// Its value.
const FORMAT: &str = "te-adamw-state-v1";

fn checkpoint_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Checkpoint { message: format!("{}: {message}", path.display()) }
}

/// One parameter's AdamW state on the host, as [`write_state_file`] writes it.
#[derive(Debug, Clone, Copy)]
pub struct HostParamState<'a> {
    /// The parameter's path in the model.
    pub path: &'a str,
    /// Its shape.
    pub shape: &'a [usize],
    /// f32 master weight, first and second moment (one value per element each).
    pub tensors: [&'a [f32]; 3],
    /// Updates of this parameter so far.
    pub step: u64,
}

/// One parameter's AdamW state as [`read_state_file`] reads it.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnedParamState {
    /// f32 master weight, first and second moment.
    pub tensors: [Vec<f32>; 3],
    /// Updates of this parameter so far.
    pub step: u64,
}

/// The suffixes of a parameter's three f32 tensors, in [`HostParamState::tensors`] order.
const SUFFIXES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// Writes an optimizer's state (`step` optimizer steps, `params`) to `path`, atomically: an
/// existing file stays intact until the new one is complete. The one writer of the format, for
/// the device optimizer and the CPU twin's.
///
/// # Errors
/// [`Error::Checkpoint`] for tensors that do not fill their shape, or an I/O failure.
pub fn write_state_file(path: &Path, step: u64, params: &[HostParamState<'_>]) -> Result<()> {
    let mut host: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::with_capacity(4 * params.len());
    for p in params {
        for (suffix, values) in SUFFIXES.iter().zip(p.tensors) {
            let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
            host.push((format!("{}.{suffix}", p.path), p.shape.to_vec(), Dtype::F32, bytes));
        }
        host.push((format!("{}.step", p.path), vec![1], Dtype::U64, p.step.to_le_bytes().to_vec()));
    }
    let views = host
        .iter()
        .map(|(name, shape, dtype, bytes)| {
            TensorView::new(*dtype, shape.clone(), bytes)
                .map(|v| (name.as_str(), v))
                .map_err(|e| checkpoint_error(path, format!("{name}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([(FORMAT_KEY.to_owned(), FORMAT.to_owned()), (STEP_KEY.to_owned(), step.to_string())]);
    write_atomic(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp)
            .map_err(|e| checkpoint_error(tmp, format!("cannot write: {e}")))
    })
}

/// Reads what [`write_state_file`] wrote to `path` for an optimizer of the parameters `params`
/// (`(path, shape)`): its step count and each parameter's state, in `params` order. Every
/// tensor is checked before anything is returned.
///
/// # Errors
/// [`Error::Checkpoint`] for a missing, truncated or corrupt file, a file of another format,
/// and tensors that are missing or mis-shaped (all listed).
pub fn read_state_file(path: &Path, params: &[(&str, &[usize])]) -> Result<(u64, Vec<OwnedParamState>)> {
    let bytes = std::fs::read(path).map_err(|e| checkpoint_error(path, format!("cannot read: {e}")))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| checkpoint_error(path, format!("not a complete safetensors file: {e}")))?;
    let meta = meta.metadata().clone().unwrap_or_default();
    if meta.get(FORMAT_KEY).map(String::as_str) != Some(FORMAT) {
        return Err(checkpoint_error(path, format!("not an AdamW state file ({FORMAT_KEY} is not {FORMAT})")));
    }
    let step: u64 = meta
        .get(STEP_KEY)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| checkpoint_error(path, format!("metadata {STEP_KEY} is missing or not a number")))?;
    let file = parse(&bytes, path)?;
    let mut problems = Vec::new();
    let mut found = Vec::with_capacity(params.len());
    for &(param, shape) in params {
        let mut get = |suffix: &str, dtype: Dtype, shape: &[usize]| {
            let name = format!("{param}.{suffix}");
            match file.tensor(&name) {
                Ok(t) if t.dtype() == dtype && t.shape() == shape => Some(t),
                Ok(t) => {
                    problems.push(format!("{name} is {:?} {:?}, expected {dtype:?} {shape:?}", t.dtype(), t.shape()));
                    None
                }
                Err(_) => {
                    problems.push(format!("{name} is missing"));
                    None
                }
            }
        };
        let tensors = [
            get(SUFFIXES[0], Dtype::F32, shape),
            get(SUFFIXES[1], Dtype::F32, shape),
            get(SUFFIXES[2], Dtype::F32, shape),
            get("step", Dtype::U64, &[1]),
        ];
        if let [Some(master), Some(m), Some(v), Some(step)] = tensors {
            let f32s = |t: &TensorView<'_>| -> Vec<f32> {
                t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            let mut b = [0u8; 8];
            b.copy_from_slice(step.data());
            found.push(OwnedParamState { tensors: [f32s(&master), f32s(&m), f32s(&v)], step: u64::from_le_bytes(b) });
        }
    }
    if !problems.is_empty() {
        return Err(checkpoint_error(path, format!("does not fit the optimizer: {}", problems.join("; "))));
    }
    Ok((step, found))
}
