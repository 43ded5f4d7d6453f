//! Family 7 launchers: the bulk delayed-scaling update and current-scaling scales.

use super::launch::Launch;
use super::launch_1d;
use crate::{Device, Error, Result};
use cudarc::driver::{CudaSlice, DevicePtrMut, SyncOnDrop};
use std::sync::Arc;
use te_codegen::spec::{AmaxComputeAlgo, ScalingSpec};
use te_codegen::KernelSpec;

const OP_DELAYED: &str = "delayed_scaling_update";
const F32_BYTES: u64 = std::mem::size_of::<f32>() as u64;

/// The delayed-scaling state of `n` FP8 tensor slots that share a format and a margin: in TE,
/// one module's forward (or backward) slots.
///
/// Every buffer must be allocated on the [`Device`] that runs the update.
#[derive(Debug)]
pub struct ScalingGroup<'a> {
    /// f32 `[n, history_len]`, tensor-major: row `t` is slot `t`'s history, `[t][0]` the newest
    /// amax (where the casts accumulate).
    pub amax_history: &'a mut CudaSlice<f32>,
    /// f32 `[n]`: the scales (read, and rewritten when the amax is usable).
    pub scale: &'a mut CudaSlice<f32>,
    /// f32 `[n]`: written, `1 / scale`.
    pub scale_inv: &'a mut CudaSlice<f32>,
    /// Entries per history row, ≥ 1.
    pub history_len: usize,
    /// Largest finite value of the group's FP8 format (448 for E4M3, 57344 for E5M2).
    pub fp8_max: f32,
    /// The recipe's margin: scales are divided by `2^margin`.
    pub margin: f32,
}

/// One slot of the device table, uploaded as the kernel's `ScalingSlot` (40 bytes: the four
/// words, the f32 and the padding, little-endian, as `static_assert`ed by the kernel).
#[derive(Debug, Clone, Copy)]
struct SlotEntry {
    history: u64,
    scale: u64,
    scale_inv: u64,
    len: u64,
    scaled_max: f32,
    pad: u32,
}

/// The slot table of a delayed-scaling update, on the device: built once from the groups,
/// launched any number of times (each launch is one update step).
///
/// It borrows the groups' buffers mutably for its whole life, so they can neither be used
/// elsewhere nor freed while the table holds their device pointers. [`delayed_scaling_update`]
/// builds one and launches it once; building and launching separately lets benchmarks time the
/// kernel without the table upload.
#[derive(Debug)]
pub struct DelayedScalingTable<'a> {
    dev: &'a Device,
    /// `[n_slots]` entries (40 bytes each), from the device's upload cache
    /// ([`Device::upload_cached`]): the same states make the same table, uploaded once.
    slots: Arc<CudaSlice<u8>>,
    n_slots: usize,
    /// cudarc's use-tracking guards of the group buffers. They must drop after the last launch
    /// that writes the buffers: they record the write events when cudarc tracks events (on a
    /// [`Device`] it does not, and they do nothing).
    _guards: Vec<SyncOnDrop<'a>>,
}

impl<'a> DelayedScalingTable<'a> {
    /// Validates the groups and uploads one entry per slot (its history row, scale and
    /// scale_inv pointers, `history_len` and `fp8_max * 2^-margin`), slots numbered group by
    /// group in order.
    ///
    /// The table goes through the device's upload cache ([`Device::upload_cached`], keyed by
    /// the entries): the states of a training step make the same entries every step, so the
    /// table is uploaded once and a CUDA graph capture of the step finds it there (no host
    /// upload inside the capture). The cache holds the device copy as long as it is among the
    /// latest keys, and the table holds it too, so it outlives every launch issued with it.
    ///
    /// Host synchronization: a new table comes from pageable host memory, and for such copies
    /// the CUDA documentation lets the driver synchronize with the stream to stage the bytes
    /// (the call may then block until the stream's earlier work has finished). Nothing else
    /// here waits for the device.
    ///
    /// # Errors
    /// [`Error::Shape`] for an empty group list, a group with no slots or `history_len = 0`,
    /// `scale`/`scale_inv`/`amax_history` sizes that disagree (`[n]`, `[n]`,
    /// `[n, history_len]`), or more than `i32::MAX` slots in all (one grid dimension);
    /// allocation and copy failures.
    pub fn new(dev: &'a Device, groups: &'a mut [ScalingGroup<'_>]) -> Result<Self> {
        let n_slots = count_slots(
            groups.iter().map(|g| (g.amax_history.len(), g.scale.len(), g.scale_inv.len(), g.history_len)),
        )?;
        let stream = dev.stream();
        let mut entries = Vec::with_capacity(n_slots);
        let mut guards = Vec::with_capacity(3 * groups.len());
        for g in groups.iter_mut() {
            let (n, len) = (g.scale.len(), g.history_len);
            let scaled_max = g.fp8_max * (-g.margin).exp2();
            let (history, h_guard) = g.amax_history.device_ptr_mut(stream);
            let (scale, s_guard) = g.scale.device_ptr_mut(stream);
            let (scale_inv, si_guard) = g.scale_inv.device_ptr_mut(stream);
            guards.extend([h_guard, s_guard, si_guard]);
            entries.extend((0..n as u64).map(|t| SlotEntry {
                history: history + t * len as u64 * F32_BYTES,
                scale: scale + t * F32_BYTES,
                scale_inv: scale_inv + t * F32_BYTES,
                len: len as u64,
                scaled_max,
                pad: 0,
            }));
        }
        // The key: a word of its own, then each entry's 5 words (the bytes of the table).
        let mut key = Vec::with_capacity(1 + 5 * entries.len());
        key.push(u64::from_le_bytes(*b"dscaling"));
        for e in &entries {
            key.extend([e.history, e.scale, e.scale_inv, e.len, u64::from(e.scaled_max.to_bits())]);
        }
        let slots = dev.upload_cached(&key, || {
            let mut bytes = Vec::with_capacity(40 * entries.len());
            for e in &entries {
                for w in [e.history, e.scale, e.scale_inv, e.len] {
                    bytes.extend(w.to_le_bytes());
                }
                bytes.extend(e.scaled_max.to_le_bytes());
                bytes.extend(e.pad.to_le_bytes());
            }
            bytes
        })?;
        Ok(Self { dev, slots, n_slots: entries.len(), _guards: guards })
    }

    /// Slots in the table (blocks per launch).
    pub fn n_slots(&self) -> usize {
        self.n_slots
    }

    /// One update step of every slot in one launch (one block per slot), on the device's
    /// stream. See [`delayed_scaling_update`] for the rules.
    ///
    /// # Errors
    /// Kernel load and launch failures.
    pub fn launch(&mut self, algo: AmaxComputeAlgo) -> Result<()> {
        let spec = ScalingSpec::delayed(algo, self.dev.arch());
        let f = self.dev.function(&KernelSpec::Scaling(spec), 0)?;
        let mut b = Launch::new("delayed_scaling_update", self.dev.stream(), &f, &spec, 0);
        b.ptr("slots", &*self.slots);
        // SAFETY: the argument matches the delayed-update signature documented on
        // `ScalingKind::DelayedUpdate`: one entry per block; each entry points at a history row
        // of `len` floats and one scale and scale_inv float inside buffers that `new` checked
        // and that stay mutably borrowed by `self`; no two entries share memory (the groups hold
        // distinct `&mut` buffers and the rows and elements of one group are disjoint).
        unsafe { b.launch(launch_1d(self.n_slots(), spec.threads, 0)) }?;
        Ok(())
    }
}

/// Checks each group's sizes `(amax_history floats, scale len, scale_inv len, history_len)`
/// and returns the number of slots in all (see [`DelayedScalingTable::new`] for the errors).
fn count_slots(groups: impl ExactSizeIterator<Item = (usize, usize, usize, usize)>) -> Result<usize> {
    let shape_err = |message: String| Error::Shape { op: OP_DELAYED, message };
    if groups.len() == 0 {
        return Err(shape_err("no scaling groups to update; pass at least one".into()));
    }
    let mut n_slots = 0usize;
    for (i, (history_floats, n, n_inv, len)) in groups.enumerate() {
        if n == 0 || len == 0 {
            return Err(shape_err(format!(
                "group {i} needs at least one slot and history_len ≥ 1 (n = {n}, history_len = {len})"
            )));
        }
        if n_inv != n {
            return Err(shape_err(format!("group {i}: scale has {n} entries but scale_inv has {n_inv}")));
        }
        if n.checked_mul(len) != Some(history_floats) {
            return Err(shape_err(format!(
                "group {i}: amax_history must be [n, history_len] = [{n}, {len}], got {history_floats} floats"
            )));
        }
        n_slots = n_slots.saturating_add(n);
    }
    if n_slots > i32::MAX as usize {
        return Err(shape_err(format!(
            "{n_slots} slots exceed one launch's grid ({} blocks); split the groups over several calls",
            i32::MAX
        )));
    }
    Ok(n_slots)
}

/// Delayed-scaling update of every slot of every group in one launch (TE
/// `delayed_scaling.cu`, the bulk update when the outermost `fp8_autocast` exits).
///
/// Per slot: amax = max of its history (or the newest entry, `MostRecent`); `scale =
/// fp8_max * 2^-margin / amax` (the group's format and margin) when amax is finite and
/// positive, else unchanged; an infinite scale becomes `f32::MAX`; `scale_inv = 1/scale`; the
/// history rolls by one and its newest entry is zeroed, unless the newest amax was 0. Groups
/// may differ in `history_len`, `fp8_max` and `margin`.
///
/// Builds a [`DelayedScalingTable`] (host table of `n_slots × 40` bytes, uploaded on the
/// stream: the copy from pageable memory may synchronize with the stream, see
/// [`DelayedScalingTable::new`]), launches it once and drops it (a stream-ordered free).
///
/// # Errors
/// As [`DelayedScalingTable::new`] and [`DelayedScalingTable::launch`].
pub fn delayed_scaling_update(dev: &Device, groups: &mut [ScalingGroup<'_>], algo: AmaxComputeAlgo) -> Result<()> {
    DelayedScalingTable::new(dev, groups)?.launch(algo)
}

/// Current-scaling scales of `n` tensors from their amaxes (TE `current_scaling.cu`).
///
/// `amax`, `scale`, `scale_inv`: f32 `[n]`. `a = max(amax, amax_epsilon)` (NaN kept);
/// `scale = 1` when `a` is 0, inf or NaN, else `fp8_max / a` (inf → `f32::MAX`), rounded down
/// to a power of two when `power_2_scale`; `scale_inv = 1/scale`.
///
/// # Errors
/// [`Error::Shape`] when the sizes disagree or are empty; launch failures.
// The kernel's buffers and TE's recipe knobs (amax_epsilon, power_2_scale), one argument each.
#[allow(clippy::too_many_arguments)]
pub fn current_scaling(
    dev: &Device,
    amax: &CudaSlice<f32>,
    scale: &mut CudaSlice<f32>,
    scale_inv: &mut CudaSlice<f32>,
    fp8_max: f32,
    amax_epsilon: f32,
    power_2_scale: bool,
) -> Result<()> {
    let n = amax.len();
    if n == 0 || scale.len() != n || scale_inv.len() != n {
        return Err(Error::Shape {
            op: "current_scaling",
            message: format!(
                "amax, scale and scale_inv must have the same non-zero length; got {n}, {}, {}",
                scale.len(),
                scale_inv.len()
            ),
        });
    }
    let spec = ScalingSpec::current(power_2_scale, dev.arch());
    let f = dev.function(&KernelSpec::Scaling(spec), 0)?;
    let n64 = n as u64;
    let mut b = Launch::new("current_scaling", dev.stream(), &f, &spec, 0);
    b.ptr("amax", amax)
        .ptr("scale", scale)
        .ptr("scale_inv", scale_inv)
        .scalar("n", &n64)
        .scalar("fp8_max", &fp8_max)
        .scalar("amax_epsilon", &amax_epsilon);
    // SAFETY: arguments match the current-scale signature documented on `ScalingKind`; every
    // buffer holds n floats (checked above).
    unsafe { b.launch(launch_1d(n.div_ceil(spec.threads).min(1024), spec.threads, 0)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(groups: &[(usize, usize, usize, usize)]) -> String {
        match count_slots(groups.iter().copied()) {
            Err(e @ Error::Shape { .. }) => e.to_string(),
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn group_sizes_are_validated() {
        assert_eq!(count_slots([(15, 3, 3, 5), (2, 1, 1, 2)].into_iter()).unwrap(), 4);
        assert!(err(&[]).contains("no scaling groups"));
        assert!(err(&[(15, 3, 3, 5), (0, 0, 0, 4)]).contains("group 1 needs at least one slot"));
        assert!(err(&[(0, 3, 3, 0)]).contains("history_len = 0"));
        assert!(err(&[(15, 3, 2, 5)]).contains("scale_inv has 2"));
        assert!(err(&[(14, 3, 3, 5)]).contains("[3, 5], got 14 floats"));
        assert!(err(&[(usize::MAX, 3, 3, usize::MAX / 2)]).contains("amax_history must be"));
        let half = i32::MAX as usize / 2 + 1;
        assert!(err(&[(half, half, half, 1), (half, half, half, 1)]).contains("exceed one launch's grid"));
    }
}
