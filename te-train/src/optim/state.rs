//! [`AdamW`]'s state file: [`AdamW::save_state`] / [`AdamW::load_state`] in the format of
//! [`te_nn::checkpoint::optimizer_state`] (shared with the CPU twin's optimizer), the same for a
//! replicated and a sharded (ZeRO-1 or ZeRO-2) optimizer: each loads the other's files.

use super::AdamW;
use std::path::Path;
use te_nn::checkpoint::optimizer_state::{read_state_file, write_state_file, HostParamState};
use te_runtime::{Error, Result};

impl AdamW {
    /// Writes the optimizer's state to `path` (atomically: an existing file stays intact until
    /// the new one is complete). Every device→host copy is issued on the stream into a pinned
    /// buffer, then the stream is waited for once.
    ///
    /// A sharded optimizer ([`AdamW::new_zero`]) writes the same file as a replicated one:
    /// every rank of its group must call this (a collective: each parameter's pieces are
    /// gathered from their owners, one parameter at a time), and rank 0 of the group writes
    /// `path` (the others write nothing).
    ///
    /// # Errors
    /// `Error::Checkpoint` for an I/O failure; driver failures of the copies; NCCL errors of a
    /// sharded optimizer's gather.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let stream = self.dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "the optimizer's state save")?;
        if let Some(zero) = &self.zero {
            return self.save_state_zero(zero, path);
        }
        let mut pinned = Vec::with_capacity(3 * self.params.len());
        // A parameter of no elements holds no state: it is written empty.
        for s in self.params.iter().filter(|s| !s.piece.is_empty()) {
            for slice in [&s.master, &s.exp_avg, &s.exp_avg_sq] {
                // SAFETY: the buffer is uninitialized until the copy issued next fills all of it;
                // it is read only after the stream has been synchronized below.
                let mut host = unsafe { stream.context().alloc_pinned::<f32>(slice.len()) }?;
                stream.memcpy_dtoh(slice, &mut host)?;
                pinned.push(host);
            }
        }
        stream.synchronize()?;
        let slices = pinned.iter().map(|p| p.as_slice()).collect::<std::result::Result<Vec<_>, _>>()?;
        let mut held = slices.chunks_exact(3);
        let mut states: Vec<HostParamState<'_>> = Vec::with_capacity(self.params.len());
        for s in &self.params {
            let tensors = if s.piece.is_empty() {
                [&[][..]; 3]
            } else {
                let t = held.next().ok_or_else(|| {
                    Error::internal("AdamW::save_state", format!("{}'s state was not copied", s.path))
                })?;
                [t[0], t[1], t[2]]
            };
            states.push(HostParamState { path: &s.path, shape: &s.shape, tensors, step: s.step });
        }
        write_state_file(path, self.step, &states)
    }

    /// Replaces the optimizer's state by the one [`AdamW::save_state`] wrote to `path`, for the
    /// same model (every parameter's tensors, by path). Nothing changes unless all of them fit.
    /// A sharded optimizer ([`AdamW::new_zero`]) keeps its pieces of the file's tensors (every
    /// rank reads the file; no communication): a file of a replicated run loads into a sharded
    /// one and the reverse, at any group size.
    ///
    /// # Errors
    /// `Error::Checkpoint` for a missing, truncated or corrupt file, a file of another format,
    /// and tensors that are missing or mis-shaped (all listed); copy failures.
    pub fn load_state(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let wanted: Vec<(&str, &[usize])> = self.params.iter().map(|s| (s.path.as_str(), s.shape.as_slice())).collect();
        let (step, found) = read_state_file(path, &wanted)?;
        let stream = self.dev.stream().clone();
        te_runtime::graph::refuse_in_capture(&stream, "the optimizer's state load")?;
        for (s, state) in self.params.iter_mut().zip(found) {
            let piece = s.piece.clone();
            if !piece.is_empty() {
                let [master, exp_avg, exp_avg_sq] = &state.tensors;
                for (values, dst) in
                    [(master, &mut s.master), (exp_avg, &mut s.exp_avg), (exp_avg_sq, &mut s.exp_avg_sq)]
                {
                    let part = values.get(piece.clone()).ok_or_else(|| Error::Checkpoint {
                        message: format!(
                            "{}: {} holds {} values, its piece is {piece:?}",
                            path.display(),
                            s.path,
                            values.len()
                        ),
                    })?;
                    stream.memcpy_htod(part, dst)?;
                }
            }
            s.step = state.step;
        }
        stream.synchronize()?;
        self.step = step;
        Ok(())
    }
}
