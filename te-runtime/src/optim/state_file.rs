//! [`AdamW`]'s state in a safetensors file, next to the model's checkpoint: per parameter
//! `<path>.master`, `<path>.exp_avg`, `<path>.exp_avg_sq` (f32, the parameter's shape) and
//! `<path>.step` (u64 `[1]`), the optimizer's step count in the metadata. With the model's
//! checkpoint (weights and FP8 state) it is everything a resumed run needs to continue bit for
//! bit (PyTorch's `optimizer.state_dict()`).

use super::AdamW;
use crate::checkpoint::format::parse;
use crate::checkpoint::write_atomic;
use crate::{Error, Result};
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::Path;

/// The `__metadata__` key holding the optimizer's step count.
const STEP_KEY: &str = "te.adamw.step";
/// The `__metadata__` key naming the format.
const FORMAT_KEY: &str = "te.format";
/// Its value.
const FORMAT: &str = "te-adamw-state-v1";

fn checkpoint_error(path: &Path, message: impl std::fmt::Display) -> Error {
    Error::Checkpoint { message: format!("{}: {message}", path.display()) }
}

impl AdamW {
    /// Writes the optimizer's state to `path` (atomically: an existing file stays intact until
    /// the new one is complete). Every device→host copy is issued on the stream into a pinned
    /// buffer, then the stream is waited for once.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for an I/O failure; driver failures of the copies.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let stream = self.dev.stream();
        crate::graph::refuse_in_capture(stream, "the optimizer's state save")?;
        let mut pinned = Vec::with_capacity(3 * self.params.len());
        for s in &self.params {
            for slice in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
                // SAFETY: the buffer is uninitialized until the copy issued next fills all of it;
                // it is read only after the stream has been synchronized below.
                let mut host = unsafe { stream.context().alloc_pinned::<f32>(slice.len()) }?;
                stream.memcpy_dtoh(slice, &mut host)?;
                pinned.push(host);
            }
        }
        stream.synchronize()?;
        let mut copies = pinned.iter();
        let mut host: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::with_capacity(4 * self.params.len());
        for s in &self.params {
            for suffix in ["master", "exp_avg", "exp_avg_sq"] {
                let values = copies.next().map(|p| p.as_slice()).transpose()?.unwrap_or_default();
                let bytes = values.iter().flat_map(|x| x.to_le_bytes()).collect();
                host.push((format!("{}.{suffix}", s.path), s.shape.clone(), Dtype::F32, bytes));
            }
            host.push((format!("{}.step", s.path), vec![1], Dtype::U64, s.step.to_le_bytes().to_vec()));
        }
        let views = host
            .iter()
            .map(|(name, shape, dtype, bytes)| {
                TensorView::new(*dtype, shape.clone(), bytes)
                    .map(|v| (name.as_str(), v))
                    .map_err(|e| checkpoint_error(path, format!("{name}: {e}")))
            })
            .collect::<Result<Vec<_>>>()?;
        let meta =
            HashMap::from([(FORMAT_KEY.to_owned(), FORMAT.to_owned()), (STEP_KEY.to_owned(), self.step.to_string())]);
        write_atomic(path, |tmp| {
            safetensors::serialize_to_file(views, Some(meta), tmp)
                .map_err(|e| checkpoint_error(tmp, format!("cannot write: {e}")))
        })
    }

    /// Replaces the optimizer's state by the one [`AdamW::save_state`] wrote to `path`, for the
    /// same model (every parameter's tensors, by path). Nothing changes unless all of them fit.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a missing, truncated or corrupt file, a file of another format,
    /// and tensors that are missing or mis-shaped (all listed); copy failures.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
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
        let mut found = Vec::with_capacity(self.params.len());
        for s in &self.params {
            let mut get = |suffix: &str, dtype: Dtype, shape: &[usize]| {
                let name = format!("{}.{suffix}", s.path);
                match file.tensor(&name) {
                    Ok(t) if t.dtype() == dtype && t.shape() == shape => Some(t),
                    Ok(t) => {
                        problems.push(format!(
                            "{name} is {:?} {:?}, expected {dtype:?} {shape:?}",
                            t.dtype(),
                            t.shape()
                        ));
                        None
                    }
                    Err(_) => {
                        problems.push(format!("{name} is missing"));
                        None
                    }
                }
            };
            let tensors = [
                get("master", Dtype::F32, &s.shape),
                get("exp_avg", Dtype::F32, &s.shape),
                get("exp_avg_sq", Dtype::F32, &s.shape),
                get("step", Dtype::U64, &[1]),
            ];
            if let [Some(master), Some(m), Some(v), Some(step)] = tensors {
                found.push([master, m, v, step]);
            }
        }
        if !problems.is_empty() {
            return Err(checkpoint_error(path, format!("does not fit the optimizer: {}", problems.join("; "))));
        }
        let stream = self.dev.stream().clone();
        crate::graph::refuse_in_capture(&stream, "the optimizer's state load")?;
        for (s, [master, m, v, step]) in self.params.iter_mut().zip(found) {
            let f32s = |t: &TensorView<'_>| -> Vec<f32> {
                t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            };
            stream.memcpy_htod(&f32s(&master), &mut s.master)?;
            stream.memcpy_htod(&f32s(&m), &mut s.exp_avg)?;
            stream.memcpy_htod(&f32s(&v), &mut s.exp_avg_sq)?;
            let mut b = [0u8; 8];
            b.copy_from_slice(step.data());
            s.step = u64::from_le_bytes(b);
        }
        stream.synchronize()?;
        self.step = step;
        Ok(())
    }
}
