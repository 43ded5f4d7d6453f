//! [`AdamW`]'s state file: [`AdamW::save_state`] / [`AdamW::load_state`] in the format of
//! [`te_nn::checkpoint::optimizer_state`] (shared with the CPU twin's optimizer).

use super::AdamW;
use std::path::Path;
use te_nn::checkpoint::optimizer_state::{read_state_file, write_state_file, HostParamState};
use te_runtime::Result;

impl AdamW {
    /// Writes the optimizer's state to `path` (atomically: an existing file stays intact until
    /// the new one is complete). Every device→host copy is issued on the stream into a pinned
    /// buffer, then the stream is waited for once.
    ///
    /// # Errors
    /// `Error::Checkpoint` for an I/O failure; driver failures of the copies.
    pub fn save_state(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let stream = self.dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "the optimizer's state save")?;
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
        let slices = pinned.iter().map(|p| p.as_slice()).collect::<std::result::Result<Vec<_>, _>>()?;
        let states: Vec<HostParamState<'_>> = self
            .params
            .iter()
            .zip(slices.chunks_exact(3))
            .map(|(s, t)| HostParamState { path: &s.path, shape: &s.shape, tensors: [t[0], t[1], t[2]], step: s.step })
            .collect();
        write_state_file(path, self.step, &states)
    }

    /// Replaces the optimizer's state by the one [`AdamW::save_state`] wrote to `path`, for the
    /// same model (every parameter's tensors, by path). Nothing changes unless all of them fit.
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
            let [master, m, v] = &state.tensors;
            stream.memcpy_htod(master, &mut s.master)?;
            stream.memcpy_htod(m, &mut s.exp_avg)?;
            stream.memcpy_htod(v, &mut s.exp_avg_sq)?;
            s.step = state.step;
        }
        stream.synchronize()?;
        self.step = step;
        Ok(())
    }
}
