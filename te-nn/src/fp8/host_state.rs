//! [`HostScalingState`]: the delayed-scaling state of one GEMM on the host (the CPU twins' copy
//! of a module's [`super::ScalingState`] pair), with TE's update
//! (`te_reference::scaling::delayed_update`, TE `common/recipe/delayed_scaling.cu`).

use super::{DelayedScaling, ScalingSnapshot};
use te_codegen::spec::AmaxComputeAlgo;
use te_codegen::DType;
use te_reference::scaling::{delayed_update, HostScalingGroup};

/// Delayed scaling of `n` operands sharing a format: TE's amax history and scales.
#[derive(Debug, Clone)]
struct Slots {
    /// `[n, history_len]`, `[slot][0]` the amax being recorded.
    history: Vec<f32>,
    scale: Vec<f32>,
    scale_inv: Vec<f32>,
    fp8_max: f32,
}

impl Slots {
    fn new(n: usize, dtype: DType, history_len: usize) -> Self {
        Self {
            history: vec![0.0; n * history_len],
            scale: vec![1.0; n],
            scale_inv: vec![1.0; n],
            fp8_max: dtype.fp8_max().unwrap_or(448.0),
        }
    }

    /// Folds this use's amaxes into the newest history entries.
    fn record(&mut self, amax: &[f32], len: usize) {
        for (slot, &a) in amax.iter().enumerate() {
            let h = &mut self.history[slot * len];
            *h = h.max(a);
        }
    }

    /// TE's update: scales from the histories, then the histories roll.
    fn update(&mut self, history_len: usize, margin: f32, algo: AmaxComputeAlgo) {
        let group = HostScalingGroup {
            amax_history: &mut self.history,
            scale: &mut self.scale,
            scale_inv: &mut self.scale_inv,
            history_len,
            fp8_max: self.fp8_max,
            margin,
        };
        delayed_update(&mut [group], algo);
    }

    /// The state as a checkpoint holds it, with `slots ≥ n` slots (the device model's forward
    /// state has an output slot no GEMM records: scale 1, zero history).
    fn snapshot(&self, slots: usize, history_len: usize) -> ScalingSnapshot {
        let pad = slots.saturating_sub(self.scale.len());
        let mut snap = ScalingSnapshot {
            amax_history: self.history.clone(),
            scale: self.scale.clone(),
            scale_inv: self.scale_inv.clone(),
            history_len,
        };
        snap.amax_history.extend(std::iter::repeat_n(0.0, pad * history_len));
        snap.scale.extend(std::iter::repeat_n(1.0, pad));
        snap.scale_inv.extend(std::iter::repeat_n(1.0, pad));
        snap
    }

    /// Takes the first slots of `snap` (a checkpoint's), its histories fitted to
    /// `history_len` as the device state's `conform` does (the newest entries kept, zeros
    /// added).
    fn restore(&mut self, snap: &ScalingSnapshot, history_len: usize) {
        let n = self.scale.len();
        let old = snap.history_len.max(1);
        self.history = vec![0.0; n * history_len];
        for (dst, src) in self.history.chunks_exact_mut(history_len).zip(snap.amax_history.chunks_exact(old)) {
            let k = old.min(history_len);
            dst[..k].copy_from_slice(&src[..k]);
        }
        self.scale = snap.scale.iter().copied().take(n).collect();
        self.scale_inv = snap.scale_inv.iter().copied().take(n).collect();
    }

    /// Back to a fresh state: scale 1, zero history.
    fn reset(&mut self) {
        self.history.iter_mut().for_each(|h| *h = 0.0);
        self.scale.iter_mut().for_each(|s| *s = 1.0);
        self.scale_inv.iter_mut().for_each(|s| *s = 1.0);
    }
}

/// The delayed-scaling state of one GEMM on the host: the input and weight slots (forward, the
/// recipe's forward format) and the output gradient's (backward format), with the recipe's
/// history length, margin and algorithm. Initial scale 1, zero histories, as a fresh GPU module
/// has. Made by [`super::ScalingRecipe::host_state`].
#[derive(Debug, Clone)]
pub struct HostScalingState {
    fwd: Slots,
    bwd: Slots,
    history_len: usize,
    margin: f32,
    algo: AmaxComputeAlgo,
}

impl HostScalingState {
    /// A fresh state for `recipe`.
    pub fn new(recipe: &DelayedScaling) -> Self {
        let len = recipe.amax_history_len;
        Self {
            fwd: Slots::new(2, recipe.fp8_format.forward_dtype(), len),
            bwd: Slots::new(1, recipe.fp8_format.backward_dtype(), len),
            history_len: len,
            margin: recipe.margin,
            algo: recipe.amax_compute_algo,
        }
    }

    /// Entries per history.
    pub fn history_len(&self) -> usize {
        self.history_len
    }

    /// The forward scales: `[input, weight]`.
    pub fn forward_scales(&self) -> &[f32] {
        &self.fwd.scale
    }

    /// The output gradient's scale.
    pub fn backward_scale(&self) -> f32 {
        self.bwd.scale.first().copied().unwrap_or(1.0)
    }

    /// Folds a forward's `[input, weight]` amaxes into the histories, then updates the forward
    /// scales (what an autocast scope's exit does on the device).
    pub fn update_forward(&mut self, amax: [f32; 2]) {
        self.fwd.record(&amax, self.history_len);
        self.fwd.update(self.history_len, self.margin, self.algo);
    }

    /// Folds a backward's output-gradient amax into its history, then updates its scale.
    pub fn update_backward(&mut self, amax: f32) {
        self.bwd.record(&[amax], self.history_len);
        self.bwd.update(self.history_len, self.margin, self.algo);
    }

    /// `[forward, backward]` as a checkpoint holds them: `[fwd_slots, 1]` slots (the device
    /// module's forward state has an output slot no GEMM records: scale 1, zero history).
    pub fn snapshots(&self, fwd_slots: usize) -> [ScalingSnapshot; 2] {
        [self.fwd.snapshot(fwd_slots, self.history_len), self.bwd.snapshot(1, self.history_len)]
    }

    /// Restores the forward (`0`) or backward (`1`) state from a checkpoint's snapshot (its
    /// histories fitted to this state's length, the newest entries kept), or resets it (`None`:
    /// the checkpoint holds none).
    pub fn restore(&mut self, direction: usize, snap: Option<&ScalingSnapshot>) {
        let s = if direction == 0 { &mut self.fwd } else { &mut self.bwd };
        match snap {
            Some(snap) => s.restore(snap, self.history_len),
            None => s.reset(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The update is TE's: the scale from the history's max, the history rolled; snapshots pad
    /// the forward state to the device's slots and restore fits the history length.
    #[test]
    fn updates_snapshots_and_restores() {
        let recipe = DelayedScaling { amax_history_len: 2, ..Default::default() };
        let mut s = HostScalingState::new(&recipe);
        assert_eq!((s.forward_scales(), s.backward_scale()), ([1.0, 1.0].as_slice(), 1.0));
        s.update_forward([2.0, 4.0]);
        assert_eq!(s.forward_scales(), [224.0, 112.0]);
        s.update_backward(57344.0 / 8.0);
        assert_eq!(s.backward_scale(), 8.0);
        let [fwd, bwd] = s.snapshots(3);
        assert_eq!((fwd.scale.len(), fwd.amax_history.len(), fwd.history_len), (3, 6, 2));
        assert_eq!(fwd.amax_history, [0.0, 2.0, 0.0, 4.0, 0.0, 0.0]);
        assert_eq!(bwd.scale, [8.0]);
        let mut longer = HostScalingState::new(&DelayedScaling { amax_history_len: 4, ..recipe });
        longer.restore(0, Some(&fwd));
        assert_eq!(longer.forward_scales(), [224.0, 112.0]);
        assert_eq!(longer.snapshots(2)[0].amax_history, [0.0, 2.0, 0.0, 0.0, 0.0, 4.0, 0.0, 0.0]);
        longer.restore(0, None);
        assert_eq!(longer.forward_scales(), [1.0, 1.0]);
    }
}
