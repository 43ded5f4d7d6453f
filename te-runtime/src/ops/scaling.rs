//! Family 7 launchers: the bulk delayed-scaling update and current-scaling scales.

use super::launch_1d;
use crate::{Device, Error, Result};
use cudarc::driver::{CudaSlice, PushKernelArg};
use te_codegen::spec::{AmaxComputeAlgo, ScalingSpec};
use te_codegen::KernelSpec;

const OP_DELAYED: &str = "delayed_scaling_update";

/// Delayed-scaling update of `n` tensors in one launch (TE `delayed_scaling.cu`).
///
/// `amax_history`: f32 `[n, history_len]`, tensor-major, `[t][0]` the newest amax (where the
/// casts accumulate); `scale`, `scale_inv`: f32 `[n]`. For each tensor: amax = max of the history
/// (or the newest, `MostRecent`); `scale = fp8_max * 2^-margin / amax` when amax is finite and
/// positive, else unchanged; an infinite scale becomes `f32::MAX`; `scale_inv = 1/scale`; the
/// history rolls by one and its newest slot is zeroed, unless the newest amax was 0.
///
/// # Errors
/// [`Error::Shape`] when the buffer sizes disagree or are empty; launch failures.
#[allow(clippy::too_many_arguments)]
pub fn delayed_scaling_update(
    dev: &Device,
    amax_history: &mut CudaSlice<f32>,
    scale: &mut CudaSlice<f32>,
    scale_inv: &mut CudaSlice<f32>,
    history_len: usize,
    algo: AmaxComputeAlgo,
    fp8_max: f32,
    margin: f32,
) -> Result<()> {
    let n = scale.len();
    let shape_err = |message: String| Error::Shape { op: OP_DELAYED, message };
    if n == 0 || history_len == 0 {
        return Err(shape_err(format!(
            "need at least one tensor and history_len ≥ 1 (n = {n}, history_len = {history_len})"
        )));
    }
    if scale_inv.len() != n {
        return Err(shape_err(format!("scale has {n} entries but scale_inv has {}", scale_inv.len())));
    }
    if amax_history.len() != n * history_len {
        return Err(shape_err(format!(
            "amax_history must be [n, history_len] = [{n}, {history_len}] ({} floats), got {} floats",
            n * history_len,
            amax_history.len()
        )));
    }
    if n > i32::MAX as usize {
        return Err(shape_err(format!("{n} tensors exceed one launch's grid; split the update")));
    }
    let spec = ScalingSpec::delayed(algo, dev.arch());
    let f = dev.function(&KernelSpec::Scaling(spec), 0)?;
    let (len, scaled_max) = (history_len as u64, fp8_max * (-margin).exp2());
    let mut b = dev.stream().launch_builder(&f);
    b.arg(amax_history).arg(scale).arg(scale_inv).arg(&len).arg(&scaled_max);
    // SAFETY: arguments match the delayed-update signature documented on `ScalingKind`; the
    // buffers hold n * len, n and n floats (checked above); one block per tensor.
    unsafe { b.launch(launch_1d(n, spec.threads, 0)) }?;
    Ok(())
}

/// Current-scaling scales of `n` tensors from their amaxes (TE `current_scaling.cu`).
///
/// `amax`, `scale`, `scale_inv`: f32 `[n]`. `a = max(amax, amax_epsilon)` (NaN kept);
/// `scale = 1` when `a` is 0, inf or NaN, else `fp8_max / a` (inf → `f32::MAX`), rounded down
/// to a power of two when `power_2_scale`; `scale_inv = 1/scale`.
///
/// # Errors
/// [`Error::Shape`] when the sizes disagree or are empty; launch failures.
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
    let mut b = dev.stream().launch_builder(&f);
    b.arg(amax).arg(scale).arg(scale_inv).arg(&n64).arg(&fp8_max).arg(&amax_epsilon);
    // SAFETY: arguments match the current-scale signature documented on `ScalingKind`; every
    // buffer holds n floats (checked above).
    unsafe { b.launch(launch_1d(n.div_ceil(spec.threads).min(1024), spec.threads, 0)) }?;
    Ok(())
}
