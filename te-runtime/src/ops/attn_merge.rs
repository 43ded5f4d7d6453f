//! Family 23 launchers: partial attention outputs merged by their log-sum-exp
//! ([`te_codegen::spec::AttnMergeSpec`]), in f32: the ring of context parallelism (TE's
//! `cp_comm_type="p2p"`) attends over one rank's keys and values a step and folds each step's
//! output and `softmax_lse` into running accumulators ([`merge_step`]), then rounds the result
//! to the output's dtype ([`merge_finish`]). The formula (TE's
//! `flash_attn_fwd_softmax_lse_correction` and `flash_attn_fwd_out_correction`): `lse = ln Σ_i
//! exp(lse_i)`, `out = Σ_i exp(lse_i − lse) · out_i`.

use super::attention_shape::{AttentionShape, HeadStrides, QkvLayout};
use super::launch::Launch;
use super::{check_dtype, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::AttnMergeSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "attention merge";

/// The f32 accumulators of a merge over the queries of an [`AttentionShape`] (`batch`, `sq`,
/// `heads`, `head_dim_v`, its dense layout): the merged output `[.., sq, heads, head_dim_v]`
/// at the shape's output strides, and the merged `softmax_lse` `[batch, heads, sq]`.
#[derive(Debug)]
pub struct MergeAcc {
    shape: AttentionShape,
    out: CudaSlice<f32>,
    lse: CudaSlice<f32>,
}

impl MergeAcc {
    /// Accumulators for the queries of `shape` (bshd or sbhd), written by the first
    /// [`merge_step`] (with `init`).
    ///
    /// # Errors
    /// [`Error::Shape`] for a `thd` shape; allocation failures.
    pub fn new(dev: &Device, shape: &AttentionShape) -> Result<Self> {
        if shape.layout == QkvLayout::Thd {
            return Err(Error::Shape { op: OP, message: "the merge takes bshd or sbhd outputs, not thd".into() });
        }
        let stream = dev.stream();
        // SAFETY: f32 has no invalid bit patterns; the first merge step (`init`, every row) writes
        // every element before any is read (checked by `merge_step`).
        let (out, lse) = unsafe { (stream.alloc::<f32>(shape.out_len())?, stream.alloc::<f32>(shape.lse_len())?) };
        Ok(Self { shape: *shape, out, lse })
    }

    /// The merged `softmax_lse` so far: f32 `[batch, heads, sq]`.
    pub fn lse(&self) -> &CudaSlice<f32> {
        &self.lse
    }

    /// Hands over the merged `softmax_lse` (after [`merge_finish`]).
    pub fn into_lse(self) -> CudaSlice<f32> {
        self.lse
    }
}

/// The output strides of `shape`, checked to hold each row's heads contiguous.
fn out_strides(shape: &AttentionShape) -> Result<HeadStrides> {
    let s = shape.o_strides();
    if s.head != shape.head_dim_v {
        return Err(Error::internal(OP, "dense outputs hold a row's heads contiguous"));
    }
    Ok(s)
}

/// Folds one partial attention into `acc`: `out_step` (`dtype` bf16 or f16, dense `[.., sq,
/// heads, head_dim_v]` in `step`'s layout: the fused forward's output of the part) and its
/// `lse_step` (f32 `[batch, heads, sq]`, `+inf` for a row that saw no key) are the part's
/// attention over some of the keys of queries `q_offset .. q_offset + step.sq` of the
/// accumulator's. `init`: the part covers every query (`q_offset` 0, `step.sq` the
/// accumulator's) and becomes the accumulators' value; else `lse ← ln(exp(lse) +
/// exp(lse_step))` and `out ← exp(lse_old − lse) · out + exp(lse_step − lse) · out_step` for
/// those rows, in f32.
///
/// # Errors
/// [`Error::DType`] for an `out_step` other than bf16/f16; [`Error::Shape`] for a `step` whose
/// batch, heads, head_dim_v or layout differ from the accumulator's, rows past its queries, an
/// `init` part that does not cover them, or an `out_step` / `lse_step` of another size; compile
/// and launch failures.
pub fn merge_step(
    dev: &Device,
    acc: &mut MergeAcc,
    step: &AttentionShape,
    out_step: &Tensor,
    lse_step: &CudaSlice<f32>,
    q_offset: usize,
    init: bool,
) -> Result<()> {
    check_dtype(OP, "out_step", out_step, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    let a = acc.shape;
    let same = (step.batch, step.heads, step.head_dim_v, step.layout) == (a.batch, a.heads, a.head_dim_v, a.layout);
    let shape_err = |message: String| Err(Error::Shape { op: OP, message });
    if !same || q_offset + step.sq > a.sq || (init && (q_offset != 0 || step.sq != a.sq)) {
        return shape_err(format!(
            "a part of {} queries from row {q_offset} (batch {}, heads {}, head_dim_v {}, {:?}{}) does not fit \
             accumulators of {} queries (batch {}, heads {}, head_dim_v {}, {:?})",
            step.sq,
            step.batch,
            step.heads,
            step.head_dim_v,
            step.layout,
            if init { ", the first part: every query" } else { "" },
            a.sq,
            a.batch,
            a.heads,
            a.head_dim_v,
            a.layout
        ));
    }
    if out_step.numel() != step.out_len() || lse_step.len() != step.lse_len() {
        return shape_err(format!(
            "out_step {:?} and lse_step of {} must hold {} and {} elements",
            out_step.shape(),
            lse_step.len(),
            step.out_len(),
            step.lse_len()
        ));
    }
    let (ss, sa) = (out_strides(step)?, out_strides(&a)?);
    let spec = AttnMergeSpec::new(out_step.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::AttnMerge(spec), 0)?;
    let v = |x: usize| x as u64;
    let sizes = [v(a.batch), v(a.heads), v(step.sq), v(a.sq), v(q_offset), v(a.head_dim_v)];
    let strides = [v(ss.batch), v(ss.row), v(sa.batch), v(sa.row)];
    let init = i32::from(init);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("out_step", out_step.data()).ptr("lse_step", lse_step).ptr("out_acc", &mut acc.out);
    l.ptr("lse_acc", &mut acc.lse);
    l.scalar("batch", &sizes[0]).scalar("heads", &sizes[1]).scalar("sq", &sizes[2]).scalar("sq_acc", &sizes[3]);
    l.scalar("q_offset", &sizes[4]).scalar("head_dim_v", &sizes[5]);
    l.scalar("step_batch", &strides[0]).scalar("step_row", &strides[1]);
    l.scalar("acc_batch", &strides[2]).scalar("acc_row", &strides[3]).scalar("init", &init);
    let rows = step.lse_len();
    // SAFETY: the arguments follow `AttnMergeSpec::MERGE_ARGS`: out_step holds the part's
    // `step.out_len()` elements of the spec's dtype at its dense strides and lse_step its rows
    // (checked), the accumulators `a.out_len()` and `a.lse_len()` f32 and the part's rows lie
    // inside them (checked); they are distinct allocations (`&mut`).
    unsafe { l.launch(launch_1d(rows.div_ceil(spec.threads / 32).min(65_535), spec.threads, 0)) }
}

/// The merged attention of `acc` rounded to `out`'s dtype (bf16 or f16, dense in the
/// accumulator's layout: `[.., sq, heads · head_dim_v]`); the merged LSE of a row that saw no key
/// set to `+inf` (the fused kernels' convention) and the second half of each `(sequence, head)`'s
/// LSE rows written to `lse_half` (f32 `[batch, heads, sq / 2]`, what the ring's backward of the
/// second half of the queries reads).
///
/// # Errors
/// [`Error::DType`] for an `out` other than bf16/f16; [`Error::Shape`] for an `out` or
/// `lse_half` of another size or an odd `sq`; compile and launch failures.
pub fn merge_finish(dev: &Device, acc: &mut MergeAcc, out: &mut Tensor, lse_half: &mut CudaSlice<f32>) -> Result<()> {
    check_dtype(OP, "out", out, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    let a = acc.shape;
    if out.numel() != a.out_len() || a.sq % 2 != 0 || lse_half.len() != a.lse_len() / 2 {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "out {:?} must hold {} elements, lse_half {} (half of an even number of queries, {})",
                out.shape(),
                a.out_len(),
                a.lse_len() / 2,
                a.sq
            ),
        });
    }
    let sa = out_strides(&a)?;
    let spec = AttnMergeSpec::new(out.dtype(), dev.arch());
    let f = dev.function(&KernelSpec::AttnMerge(spec), 1)?;
    let v = |x: usize| x as u64;
    let sizes = [v(a.batch), v(a.heads), v(a.sq), v(a.head_dim_v), v(sa.batch), v(sa.row)];
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 1);
    l.ptr("out_acc", &acc.out).ptr("lse_acc", &mut acc.lse).ptr("out", out.data_mut()?).ptr("lse_half", lse_half);
    l.scalar("batch", &sizes[0]).scalar("heads", &sizes[1]).scalar("sq_acc", &sizes[2]);
    l.scalar("head_dim_v", &sizes[3]).scalar("acc_batch", &sizes[4]).scalar("acc_row", &sizes[5]);
    // SAFETY: the arguments follow `AttnMergeSpec::FINISH_ARGS`: the accumulators hold the
    // shape's rows, `out` as many elements of the spec's dtype at the same strides, `lse_half`
    // half the LSE rows (checked); all distinct allocations.
    unsafe { l.launch(launch_1d(a.lse_len().div_ceil(spec.threads / 32).min(65_535), spec.threads, 0)) }
}
