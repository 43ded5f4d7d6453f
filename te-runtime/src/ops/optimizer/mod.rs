//! Family 11 launchers: one fused optimizer step over many tensors: the global gradient norm
//! and PyTorch's clip coefficient (on the device), then AdamW with FP32 master weights, each in
//! one launch over a device table of chunks (apex `multi_tensor_apply`: a block per chunk of
//! [`CHUNK`] elements of one tensor).

pub mod scalars;

use super::launch::Launch;
use super::launch_1d;
use crate::graph::HostCopies;
use crate::ops::optimizer::scalars::{AdamWHyper, AdamWScalars};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use te_codegen::spec::OptimizerSpec;
use te_codegen::{DType, KernelSpec};

/// The kernels of one optimizer step on `arch`: the gradient norm (clipping) and AdamW (what
/// `te prewarm` compiles for an optimizer).
pub fn kernel_specs(arch: te_codegen::Arch) -> [KernelSpec; 2] {
    [OptimizerSpec::grad_norm(arch).into(), OptimizerSpec::adamw(arch).into()]
}

const OP: &str = "adamw_step";

/// Elements per chunk (one block each). A multiple of the kernels' 4-element accesses, so every
/// chunk starts aligned.
pub const CHUNK: usize = 32 * 1024;

/// One tensor of an AdamW step.
#[derive(Debug)]
pub struct AdamWTensor<'a> {
    /// Read: the gradient, f32, bf16 or f16, any shape with the parameter's element count.
    pub grad: &'a Tensor,
    /// Written in place: the model's parameter, f32, bf16 or f16: the new master rounded to its
    /// type. Every clone sharing the tensor's storage sees the new values (PyTorch's in-place
    /// `param.copy_`), so the parameter keeps its address: what a CUDA graph of a whole
    /// training step needs, its forward reading the weights the previous replay wrote.
    pub param: &'a Tensor,
    /// Updated: the f32 master weight, one per element.
    pub master: &'a mut CudaSlice<f32>,
    /// Updated: the f32 first moment (`exp_avg`).
    pub exp_avg: &'a mut CudaSlice<f32>,
    /// Updated: the f32 second moment (`exp_avg_sq`).
    pub exp_avg_sq: &'a mut CudaSlice<f32>,
    /// Decoupled weight decay of this tensor (0 to exclude it).
    pub weight_decay: f32,
    /// This tensor's step number, 1 for its first update (bias correction).
    pub step: u64,
    /// Its gradient counts in the global norm. `false` for a copy another rank counts: a
    /// parameter replicated over a tensor-parallel group counts on its rank 0 only, so the sum
    /// of the ranks' partial norms is the model's (Megatron-LM's
    /// `param_is_not_tensor_parallel_duplicate`).
    pub in_norm: bool,
}

/// The hyper-parameters shared by every tensor of a step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWArgs {
    /// Learning rate of this step.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f32,
    /// Clip the gradients to this global L2 norm (`f32::INFINITY`: no clipping).
    pub max_grad_norm: f32,
    /// A NaN or infinite gradient norm skips the whole update on the device: masters and
    /// moments stay, each parameter is rewritten from its master (Megatron-LM's skipped
    /// iteration). `false`: PyTorch's arithmetic, which spreads the NaN.
    pub skip_nonfinite: bool,
}

/// One chunk entry of the device table, laid out as the kernels' `Chunk` (64 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct ChunkEntry {
    grad: u64,
    param: u64,
    master: u64,
    exp_avg: u64,
    exp_avg_sq: u64,
    n: u32,
    dtypes: u32,
    decay: f32,
    step_size: f32,
    bc2_sqrt: f32,
    norm_weight: f32,
}

// SAFETY: plain `repr(C)` data without implicit padding (5 × u64 + 2 × u32 + 4 × f32 =
// 64 bytes, the layout `static_assert`ed by the kernels); any bit pattern is valid.
unsafe impl DeviceRepr for ChunkEntry {}

/// The kernels' type code of a high-precision dtype.
fn type_code(dt: DType) -> Option<u32> {
    match dt {
        DType::F32 => Some(0),
        DType::BF16 => Some(1),
        DType::F16 => Some(2),
        _ => None,
    }
}

/// One fused AdamW step of every tensor (PyTorch `torch.optim.AdamW` arithmetic with FP32
/// masters, after `clip_grad_norm_(max_grad_norm)`), all on the device's stream, no host sync:
///
/// 1. the global L2 norm of all gradients, deterministic run to run (per-chunk f32 partials,
///    then one block sums them in a fixed order), into `norm_out[0]`;
/// 2. `clip_coef = min(1, max_grad_norm / (norm + 1e-6))` into `norm_out[1]`;
/// 3. unless `skip_nonfinite` and the norm is NaN or infinite (then each parameter is only
///    rewritten from its unchanged master), per element, with `g = grad * clip_coef` (f32;
///    apex-style: the scaled gradient is not
///    rounded to the gradient's type, unlike PyTorch's in-place `grad.mul_`), the update of
///    `te_reference::optimizer::adamw_step` with the scalars of
///    [`AdamWScalars::new`] for each tensor's `weight_decay` and `step`; the new master is
///    rounded to the parameter's type.
///
/// Three launches (norm, finalize, AdamW) whatever the number of tensors. The chunk table
/// (64 bytes per [`CHUNK`] elements) is uploaded from pageable memory, which may synchronize
/// with the stream (see [`super::scaling::DelayedScalingTable::new`]); it and the partials are
/// freed stream-ordered after the launches.
///
/// # Errors
/// [`Error::Shape`] for an empty list, an empty tensor, or a grad, param, master or moment whose
/// element counts differ (the message names the tensor's index); [`Error::DType`] for a grad or
/// param that is not f32, bf16 or f16; [`Error::Argument`] unless `max_grad_norm > 0` (inf
/// allowed) or unless `norm_out` holds 2 floats; compile, allocation and launch failures.
pub fn adamw_step(
    dev: &Device,
    tensors: &mut [AdamWTensor<'_>],
    args: &AdamWArgs,
    norm_out: &mut CudaSlice<f32>,
) -> Result<()> {
    adamw_step_reduced(dev, tensors, args, norm_out, &mut |_| Ok(()))
}

/// [`adamw_step`] whose per-chunk partial sums of squares go through `reduce` (issued on the
/// device's stream between the norm and the finalize launches) before they are summed: a
/// tensor-parallel run all-reduces them over its group, so every rank clips by the norm of the
/// whole model (each rank's tensors must then make the same chunks: the same shapes).
///
/// # Errors
/// As [`adamw_step`]; `reduce`'s.
pub fn adamw_step_reduced(
    dev: &Device,
    tensors: &mut [AdamWTensor<'_>],
    args: &AdamWArgs,
    norm_out: &mut CudaSlice<f32>,
    reduce: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
) -> Result<()> {
    adamw_step_table(dev, tensors, args, norm_out, reduce, &mut AdamWTable::default())
}

/// The scalars of one tensor's update: `args` with its `weight_decay` and `step`.
fn step_scalars(args: &AdamWArgs, weight_decay: f32, step: u64) -> AdamWScalars {
    AdamWScalars::new(&AdamWHyper {
        lr: args.lr,
        beta1: args.beta1,
        beta2: args.beta2,
        eps: args.eps,
        weight_decay,
        step,
    })
}

/// The chunk table of AdamW steps kept from one step to the next (an optimizer's): its device
/// buffer keeps its address, so a CUDA graph that captured a step ([`adamw_step_table`] inside
/// a capture) replays with the per-step scalars [`AdamWTable::refresh`] writes into it before
/// each replay (the learning rate and the bias corrections of the step: kernel arguments
/// would be frozen in the graph).
#[derive(Debug, Default)]
pub struct AdamWTable {
    /// One entry per chunk, as the last step built them (the scalars of that step).
    entries: Vec<ChunkEntry>,
    /// Per entry: the index of its tensor in that step's list and the tensor's weight decay.
    owners: Vec<(usize, f32)>,
    /// The device copy; `None` before the first step outside a capture.
    device: Option<CudaSlice<ChunkEntry>>,
}

impl AdamWTable {
    /// Rewrites every chunk's per-step scalars for `args` (its `lr`; the betas and eps of the
    /// step that built the table) and `steps[i]`, the step number of tensor `i` of that step's
    /// list, then uploads the table, ordered on the stream before what is issued after (the
    /// replay). A host upload: not inside a capture.
    ///
    /// # Errors
    /// [`Error::Argument`] for a table no step has built or `steps` of another length than
    /// that step's tensors; [`crate::Error::Capture`] inside a capture; copy failures.
    pub fn refresh(&mut self, dev: &Device, args: &AdamWArgs, steps: &[u64]) -> Result<()> {
        let tensors = self.owners.last().map_or(0, |o| o.0 + 1);
        if self.entries.is_empty() || steps.len() != tensors {
            return Err(Error::Argument {
                op: OP,
                message: format!(
                    "refreshing a table of {tensors} tensors with {} step numbers; run a step with the table first",
                    steps.len()
                ),
            });
        }
        for (e, &(t, weight_decay)) in self.entries.iter_mut().zip(&self.owners) {
            let sc = step_scalars(args, weight_decay, steps[t]);
            (e.decay, e.step_size, e.bc2_sqrt) = (sc.decay, sc.step_size, sc.bc2_sqrt);
        }
        self.upload(dev)
    }

    /// Copies the entries into the device buffer (a new one when the count changed).
    fn upload(&mut self, dev: &Device) -> Result<()> {
        let stream = dev.stream();
        crate::graph::refuse_in_capture(stream, "the AdamW chunk table")?;
        match &mut self.device {
            Some(d) if d.len() == self.entries.len() => stream.memcpy_htod(&self.entries, d)?,
            slot => *slot = Some(stream.htod(&self.entries)?),
        }
        Ok(())
    }
}

/// [`adamw_step_reduced`] with the chunk table kept in `table`: outside a capture the step's
/// table is uploaded into it; inside a capture ([`crate::graph::Graph::capture`]) nothing is
/// uploaded and the launches read `table`'s device buffer, which a step outside the capture
/// must have sized (the same tensors), and which [`AdamWTable::refresh`] fills before each
/// replay.
///
/// # Errors
/// As [`adamw_step_reduced`]; [`crate::Error::Capture`] inside a capture when no step outside
/// it built a table of as many chunks.
pub fn adamw_step_table(
    dev: &Device,
    tensors: &mut [AdamWTensor<'_>],
    args: &AdamWArgs,
    norm_out: &mut CudaSlice<f32>,
    reduce: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    table: &mut AdamWTable,
) -> Result<()> {
    if tensors.is_empty() {
        return Err(Error::Shape { op: OP, message: "no tensors to update; pass at least one".into() });
    }
    step(dev, tensors, None, args, norm_out, Partials::Reduce(reduce), table)
}

/// What a rank holds of the whole model's per-chunk partial sums of squares, handed to the
/// `gather` of [`adamw_step_sharded`]: its own chunks' partials (`None` when it updates no
/// piece), in its tensors' order.
pub type LocalPartials<'a> = Option<&'a CudaSlice<f32>>;

/// One AdamW step of pieces of tensors (ZeRO stage 1, Megatron-LM's distributed optimizer
/// `megatron/core/optimizer/distrib_optimizer.py`: each data-parallel rank keeps the masters and
/// moments of its own contiguous piece of the model and updates only that piece of each
/// parameter): `tensors[i]`'s `master`, `exp_avg` and `exp_avg_sq` hold the elements
/// `offsets[i] .. offsets[i] + master.len()` of its `grad` and `param` (flattened, row-major),
/// and only those elements of `param` are written. A `param` of exactly `master.len()`
/// elements (and fewer than its grad's) is the piece alone, written from its element 0 (ZeRO
/// stage 3, where a rank keeps only its pieces of the weights). The arithmetic of each element is
/// [`adamw_step`]'s, bit for bit.
///
/// The clipping norm is the whole model's: the norm launch writes one partial sum of squares
/// per chunk of the pieces (chunks of [`CHUNK`] elements from each piece's start), then
/// `gather` (issued on the device's stream) returns the list the finalize launch sums, in
/// order: every rank's partials, concatenated in the order of the ranks' pieces. When the
/// pieces start at multiples of [`CHUNK`] within their tensors, the chunks are those of a
/// replicated step over the whole tensors, and so is the norm, bit for bit. `tensors` may be
/// empty (a rank that owns no piece still joins `gather`, and gets the norm).
///
/// # Errors
/// [`Error::Shape`] for a piece that is empty or reaches past its tensor, a grad of another
/// element count than its param, moments of another length than the master, or an offset that
/// is not a multiple of 4 elements (the kernels' vector accesses); [`Error::Argument`] for
/// `offsets` of another length than `tensors`, `gather` returning no partials, and as
/// [`adamw_step`]; [`crate::Error::Capture`] inside a capture (as [`adamw_step_table`]);
/// `gather`'s errors; compile, allocation and launch failures.
pub fn adamw_step_sharded(
    dev: &Device,
    tensors: &mut [AdamWTensor<'_>],
    offsets: &[usize],
    args: &AdamWArgs,
    norm_out: &mut CudaSlice<f32>,
    gather: &mut dyn FnMut(LocalPartials<'_>) -> Result<CudaSlice<f32>>,
    table: &mut AdamWTable,
) -> Result<()> {
    if offsets.len() != tensors.len() {
        return Err(Error::Argument {
            op: OP,
            message: format!("{} offsets for {} tensors: pass one per tensor", offsets.len(), tensors.len()),
        });
    }
    step(dev, tensors, Some(offsets), args, norm_out, Partials::Gather(gather), table)
}

/// Elements a piece's start must be a multiple of within its tensor: the kernels' vector
/// accesses (`OptimizerSpec::vec`, 4 elements: 16 bytes of f32, 8 of bf16/f16).
pub const PIECE_ALIGN: usize = 4;

/// How the norm launch's partials become the list the finalize launch sums.
enum Partials<'r> {
    /// Reduced in place (a tensor-parallel all-reduce; the identity on one GPU).
    Reduce(&'r mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>),
    /// Gathered into the whole model's list (ZeRO).
    Gather(&'r mut dyn FnMut(LocalPartials<'_>) -> Result<CudaSlice<f32>>),
}

/// A table's entries and, per entry, its tensor's index and weight decay.
type TableEntries = (Vec<ChunkEntry>, Vec<(usize, f32)>);

/// The chunk entries of `tensors` (pieces at `offsets`, or whole tensors) and their owners.
fn build_entries<'a>(
    dev: &'a Device,
    tensors: &'a mut [AdamWTensor<'_>],
    offsets: Option<&[usize]>,
    args: &AdamWArgs,
    guards: &mut Vec<cudarc::driver::SyncOnDrop<'a>>,
) -> Result<TableEntries> {
    let stream = dev.stream();
    let mut entries = Vec::new();
    let mut owners = Vec::new();
    for (i, t) in tensors.iter_mut().enumerate() {
        let whole = t.param.numel();
        // Where the piece starts in `param`: at its offset when the param is whole, at 0 when
        // the param holds the piece only (ZeRO-3: a rank keeps its pieces of the weights).
        let mut param_base = 0u64;
        let (offset, n) = match offsets {
            None => {
                let counts = [t.grad.numel(), t.master.len(), t.exp_avg.len(), t.exp_avg_sq.len()];
                if whole == 0 || counts.iter().any(|&c| c != whole) {
                    return Err(Error::Shape {
                        op: OP,
                        message: format!(
                            "tensor {i}: param, grad, master, exp_avg and exp_avg_sq must hold the same non-zero \
                             number of elements, got {whole}, {counts:?}"
                        ),
                    });
                }
                (0, whole)
            }
            Some(offsets) => {
                let (offset, n) = (offsets[i], t.master.len());
                let whole = t.grad.numel();
                let fits = n > 0 && offset.checked_add(n).is_some_and(|end| end <= whole);
                let param_fits = t.param.numel() == whole || t.param.numel() == n;
                if !fits || !param_fits || t.exp_avg.len() != n || t.exp_avg_sq.len() != n || offset % PIECE_ALIGN != 0
                {
                    return Err(Error::Shape {
                        op: OP,
                        message: format!(
                            "piece {i}: elements {offset}..{offset}+{n} of a grad of {whole} elements, a param of {} \
                             and moments of {} and {}: the piece must be non-empty, inside the grad, start at a \
                             multiple of {PIECE_ALIGN}, the param must be whole or the piece alone, and the master \
                             and moments must match",
                            t.param.numel(),
                            t.exp_avg.len(),
                            t.exp_avg_sq.len()
                        ),
                    });
                }
                if t.param.numel() == whole {
                    param_base = offset as u64;
                }
                (offset, n)
            }
        };
        let code =
            |arg, dt| type_code(dt).ok_or(Error::DType { op: OP, arg, expected: "f32, bf16 or f16".into(), got: dt });
        let dtypes = code("grad", t.grad.dtype())? | code("param", t.param.dtype())? << 8;
        let s = step_scalars(args, t.weight_decay, t.step);
        let (g_bytes, p_bytes) = (t.grad.dtype().size_bytes() as u64, t.param.dtype().size_bytes() as u64);
        let (grad, g_guard) = t.grad.data().device_ptr(stream);
        // The parameter is written through a shared borrow: in place, as documented on
        // `AdamWTensor::param`.
        let (param, p_guard) = t.param.data().device_ptr(stream);
        let (master, ms_guard) = t.master.device_ptr_mut(stream);
        let (exp_avg, m_guard) = t.exp_avg.device_ptr_mut(stream);
        let (exp_avg_sq, v_guard) = t.exp_avg_sq.device_ptr_mut(stream);
        guards.extend([g_guard, p_guard, ms_guard, m_guard, v_guard]);
        let base = offset as u64;
        entries.extend((0..n).step_by(CHUNK).map(|start| {
            let off = start as u64;
            ChunkEntry {
                grad: grad + (base + off) * g_bytes,
                param: param + (param_base + off) * p_bytes,
                master: master + off * 4,
                exp_avg: exp_avg + off * 4,
                exp_avg_sq: exp_avg_sq + off * 4,
                n: (n - start).min(CHUNK) as u32,
                dtypes,
                decay: s.decay,
                step_size: s.step_size,
                bc2_sqrt: s.bc2_sqrt,
                norm_weight: if t.in_norm { 1.0 } else { 0.0 },
            }
        }));
        owners.resize(entries.len(), (i, t.weight_decay));
    }
    Ok((entries, owners))
}

/// The three launches of a step (norm, finalize, AdamW; the first and last left out when
/// there is no chunk), with the partials made whole as `partials` says.
fn step(
    dev: &Device,
    tensors: &mut [AdamWTensor<'_>],
    offsets: Option<&[usize]>,
    args: &AdamWArgs,
    norm_out: &mut CudaSlice<f32>,
    partials: Partials<'_>,
    table: &mut AdamWTable,
) -> Result<()> {
    if args.max_grad_norm.is_nan() || args.max_grad_norm <= 0.0 || norm_out.len() != 2 {
        return Err(Error::Argument {
            op: OP,
            message: format!(
                "max_grad_norm must be > 0 (inf: no clipping), got {}; norm_out must hold 2 floats, got {}",
                args.max_grad_norm,
                norm_out.len()
            ),
        });
    }
    let stream = dev.stream();
    // The guards of the buffers' device pointers: they live until the launches are queued.
    let mut guards = Vec::with_capacity(5 * tensors.len());
    let (entries, owners) = build_entries(dev, tensors, offsets, args, &mut guards)?;
    // The kernel-wide scalars (betas, eps) do not depend on a tensor's step or decay.
    let s = step_scalars(args, 0.0, 1);
    if entries.len() > i32::MAX as usize {
        return Err(Error::Shape {
            op: OP,
            message: format!("{} chunks exceed one launch's grid; split the tensors over several steps", entries.len()),
        });
    }
    let n_entries = entries.len();
    table.entries = entries;
    table.owners = owners;
    let norm_spec = OptimizerSpec::grad_norm(dev.arch());
    let mut local = if n_entries == 0 {
        None
    } else {
        if crate::graph::is_capturing(stream)? {
            if table.device.as_ref().map(CudaSlice::len) != Some(n_entries) {
                return Err(Error::Capture {
                    rule: crate::graph::CaptureRule::NoHostTransfers,
                    detail: format!(
                        "the AdamW chunk table of {n_entries} chunks was never uploaded: run a step of the same \
                         tensors outside the capture first"
                    ),
                });
            }
        } else {
            table.upload(dev)?;
        }
        let Some(chunks) = table.device.as_ref() else {
            return Err(Error::internal(OP, "the chunk table has no device copy after its upload"));
        };
        let mut partials = stream.alloc_zeros::<f32>(n_entries)?;
        let norm = dev.function(&KernelSpec::Optimizer(norm_spec), 0)?;
        let mut b = Launch::new("adamw_step", stream, &norm, &norm_spec, 0);
        b.ptr("chunks", chunks).ptr("partials", &mut partials);
        // SAFETY: the arguments follow the GradNorm signature documented on `OptimizerKind`: one
        // entry per block, each pointing at `n` elements of its grad type inside a tensor checked
        // above and borrowed for this call; `partials` holds one float per block.
        unsafe { b.launch(launch_1d(n_entries, norm_spec.threads, 0)) }?;
        Some(partials)
    };
    let gathered;
    let partials: &CudaSlice<f32> = match partials {
        Partials::Reduce(reduce) => {
            let p = local.as_mut().ok_or_else(|| Error::internal(OP, "a reduced step without chunks"))?;
            reduce(p)?;
            p
        }
        Partials::Gather(gather) => {
            gathered = gather(local.as_ref())?;
            &gathered
        }
    };
    if partials.is_empty() {
        return Err(Error::Argument {
            op: OP,
            message: "the gathered partial norms are empty: gather must return every rank's partials".into(),
        });
    }

    let finalize = dev.function(&KernelSpec::Optimizer(norm_spec), 1)?;
    let n_partials = partials.len() as u64;
    let mut b = Launch::new("adamw_step", stream, &finalize, &norm_spec, 1);
    b.ptr("partials", partials)
        .scalar("n_partials", &n_partials)
        .ptr("out", &mut *norm_out)
        .scalar("max_norm", &args.max_grad_norm);
    // SAFETY: the finalize signature documented on `OptimizerKind`: `partials` holds
    // `n_partials` floats, `norm_out` 2 (checked above); one block.
    unsafe { b.launch(launch_1d(1, norm_spec.threads, 0)) }?;
    if n_entries == 0 {
        return Ok(());
    }
    let Some(chunks) = table.device.as_ref() else {
        return Err(Error::internal(OP, "the chunk table has no device copy after its upload"));
    };
    let adam_spec = OptimizerSpec::adamw(dev.arch());
    let adam = dev.function(&KernelSpec::Optimizer(adam_spec), 0)?;
    let skip = i32::from(args.skip_nonfinite);
    let mut b = Launch::new("adamw_step", stream, &adam, &adam_spec, 0);
    b.ptr("chunks", chunks)
        .scalar("beta1", &s.beta1)
        .scalar("one_minus_beta1", &s.one_minus_beta1)
        .scalar("beta2", &s.beta2)
        .scalar("one_minus_beta2", &s.one_minus_beta2)
        .scalar("eps", &s.eps)
        .ptr("norm_clip", &*norm_out)
        .scalar("skip_nonfinite", &skip);
    // SAFETY: the AdamW signature documented on `OptimizerKind`: each entry points at `n`
    // elements of its grad and param types and `n` floats of master and moments, all inside
    // buffers checked above and borrowed for this call (the masters and moments mutably; each
    // param is the caller's to write in place, see `AdamWTensor::param`; a piece's `n` elements
    // start at its offset, inside the param), so no two entries overlap in what they write;
    // `norm_out` holds the 2 floats the finalize launch wrote before this one on the same
    // stream. Inside a capture the table's entries are the ones built above once
    // `AdamWTable::refresh` uploads them, before any replay.
    unsafe { b.launch(launch_1d(n_entries, adam_spec.threads, 0)) }?;
    drop(guards);
    Ok(())
}
