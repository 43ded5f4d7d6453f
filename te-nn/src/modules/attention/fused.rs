//! The fused backend (TE's `FlashAttention` / `FusedAttention` backends): the FlashAttention-2
//! kernels of [`te_runtime::ops::flash_attention`] straight on the `bshd`/`sbhd` tensors. The
//! context keeps the output and the f32 `softmax_lse [batch, heads, sq]` (4 bytes per query and
//! head, instead of the unfused backend's `[batch, heads, sq, sk]` probabilities).

use super::plan::Dims;
use super::{packed, AttnMaskType, MODULE};
use crate::fp8::{Float8Tensor, Quantizer};
use crate::modules::Output;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::dropout::DropoutParams;
use te_runtime::ops::flash_attention::{self, CuSeqlens, FlashAttnParams, HeadStrides, Qkv};
use te_runtime::ops::flash_attention_fp8::{self as fa8, Fp8BwdScaleInv, Fp8Grad, Fp8Operand, Fp8Operands};
use te_runtime::{Device, Error, Result, Tensor};

/// The valid lengths (and for `thd` the token offsets) of a call's sequences, on the device.
#[derive(Debug)]
pub(super) struct DeviceSeqlens {
    /// `cu_seqlens_q` and `cu_seqlens_kv`.
    cu: (CudaSlice<i32>, CudaSlice<i32>),
    /// `thd`: where each sequence's tokens start in q / o and in k / v.
    offsets: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
}

impl DeviceSeqlens {
    fn get(&self) -> CuSeqlens<'_> {
        CuSeqlens { q: &self.cu.0, kv: &self.cu.1, offsets: self.offsets.as_ref().map(|(q, kv)| (q, kv)) }
    }

    /// Uploads i32 prefix sums (`offsets` given for `thd`).
    pub(super) fn upload(dev: &Device, cu: [&[i32]; 2], offsets: Option<[&[i32]; 2]>) -> Result<Self> {
        let stream = dev.stream();
        let cu = (stream.htod(cu[0])?, stream.htod(cu[1])?);
        let offsets = match offsets {
            Some([q, kv]) => Some((stream.htod(q)?, stream.htod(kv)?)),
            None => None,
        };
        Ok(Self { cu, offsets })
    }
}

/// How a fused forward runs in FP8 (TE `fp8_dpa`): q, k, v cast by `quantizer`; `keep`: the
/// codes of the FP8 backward kept too; `out`: the output written as E4M3 codes by this quantizer
/// (TE `fp8_mha`: the output projection's input quantizer, which fuses its cast), else 16-bit.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fp8Call<'a> {
    pub quantizer: &'a dyn Quantizer,
    pub keep: bool,
    pub out: Option<&'a dyn Quantizer>,
}

/// What the fused forward keeps for its backward.
#[derive(Debug)]
pub(super) struct FusedSaved {
    /// The output: 16-bit, or its E4M3 codes (`out_scale_inv` set; TE `fp8_mha`).
    out: Tensor,
    out_scale_inv: Option<Arc<CudaSlice<f32>>>,
    lse: CudaSlice<f32>,
    /// The sequence lengths of a padding mask or of `thd`.
    seqs: Option<DeviceSeqlens>,
    /// The forward's attention dropout (its stream replayed by the backward).
    dropout: Option<DropoutParams>,
    /// An FP8 forward's codes for the FP8 backward ([`backward_fp8`]).
    fp8: Option<Fp8Saved>,
}

/// What an FP8 forward keeps for the FP8 backward: the codes of q, k, v (with the backward's
/// transposed ones) and their one `scale_inv`, and the shapes and layout of the gradients (the
/// 16-bit q, k, v themselves are not needed: the module releases them).
#[derive(Debug)]
struct Fp8Saved {
    operands: Fp8Operands,
    scale_inv: Arc<CudaSlice<f32>>,
    grads: Qkv<Vec<usize>>,
    layout: Layout,
}

impl FusedSaved {
    /// Device bytes kept only for the backward: `softmax_lse`, the sequence tables, and an FP8
    /// forward's codes (the output is the caller's).
    pub(super) fn bytes(&self) -> usize {
        let seqs = self.seqs.as_ref().map_or(0, |s| {
            let tables =
                [Some(&s.cu.0), Some(&s.cu.1), s.offsets.as_ref().map(|o| &o.0), s.offsets.as_ref().map(|o| &o.1)];
            tables.into_iter().flatten().map(|t| t.len() * 4).sum()
        });
        let codes = self.fp8.as_ref().map_or(0, |f| {
            let o = &f.operands;
            let bwd = o.backward.as_ref().map_or(0, |b| b.qt.num_bytes() + b.kt.num_bytes() + b.v.num_bytes());
            o.q.num_bytes() + o.k.num_bytes() + o.vt.num_bytes() + bwd
        });
        self.lse.len() * 4 + seqs + codes
    }

    /// Whether the forward wrote the output as E4M3 codes.
    pub(super) fn fp8_output(&self) -> bool {
        self.out_scale_inv.is_some()
    }

    /// Whether the forward kept the codes of the FP8 backward.
    pub(super) fn has_fp8_backward(&self) -> bool {
        self.fp8.is_some()
    }
}

/// Where q, k, v and the output sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Layout {
    /// Tensors of their own in `dims.format`.
    Dense,
    /// Inside one fused QKV tensor in `dims.format` ([`packed`]).
    Packed,
    /// `thd`: `[tokens, heads, head_dim]`, sequences one after another.
    Thd,
}

/// The kernels' parameters for a call: q, k, v and the output where `layout` puts them, the
/// mask as its resolved window (causal: right bound 0) and diagonal alignment.
fn params(
    dims: &Dims,
    (mask, window): (AttnMaskType, (i64, i64)),
    dropout: Option<DropoutParams>,
    scale: f32,
    layout: Layout,
) -> FlashAttnParams {
    let (d, dv) = (dims.head_dim, dims.head_dim_v);
    let dense = |seq, heads, w| HeadStrides::dense(dims.format, dims.batch, seq, heads, w);
    let tokens = |heads: usize, w: usize| HeadStrides { batch: 0, row: heads * w, head: w };
    let (q, kv, v, o) = match layout {
        Layout::Dense => (
            dense(dims.sq, dims.heads, d),
            dense(dims.sk, dims.groups, d),
            dense(dims.sk, dims.groups, dv),
            dense(dims.sq, dims.heads, dv),
        ),
        // One head dim (`forward_packed` checks it).
        Layout::Packed => {
            let s = packed::strides(dims).0;
            (s, s, s, dense(dims.sq, dims.heads, d))
        }
        Layout::Thd => (tokens(dims.heads, d), tokens(dims.groups, d), tokens(dims.groups, dv), tokens(dims.heads, dv)),
    };
    FlashAttnParams {
        batch: dims.batch,
        sq: dims.sq,
        sk: dims.sk,
        heads: dims.heads,
        groups: dims.groups,
        head_dim: d,
        head_dim_v: dv,
        scale,
        window,
        bottom_right: mask.is_bottom_right(),
        dropout,
        q,
        kv,
        v,
        o,
    }
}

/// `cu_seqlens_q` / `_kv` for padding lengths: sequence `b` has `min(len, sq)` valid queries and
/// `min(len, sk)` valid keys (the unfused byte mask's rule).
pub(super) fn padding_seqlens(dev: &Device, seq_lens: &[usize], dims: &Dims) -> Result<DeviceSeqlens> {
    let prefix = |cap: usize| -> Result<Vec<i32>> {
        let mut cu = vec![0i32];
        let mut total = 0usize;
        for &len in seq_lens {
            total += len.min(cap);
            cu.push(i32::try_from(total).map_err(|_| Error::Shape {
                op: MODULE,
                message: format!("the valid positions of the batch, {total}, exceed i32 cu_seqlens: split the batch"),
            })?);
        }
        Ok(cu)
    };
    DeviceSeqlens::upload(dev, [&prefix(dims.sq)?, &prefix(dims.sk)?], None)
}

/// `out = softmax(scale · Q · Kᵀ, mask) · V` (dense `[.., heads · head_dim]` in the layout's
/// order, `out_shape`) and the saved state; `seqs` checked and uploaded by the caller. With
/// `fp8` the forward runs on E4M3 q, k, v ([`Fp8Call`]; the caller checked that the FP8 kernels
/// take the call), keeps the codes of the FP8 backward ([`backward_fp8`]) when asked, and writes
/// the output in E4M3 when asked (an [`Output::Fp8`]); else it serves the 16-bit backward.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    dev: &Device,
    dims: &Dims,
    (mask, drop): ((AttnMaskType, (i64, i64)), DropoutParams),
    seqs: Option<DeviceSeqlens>,
    (qkv, layout): (Qkv<&Tensor>, Layout),
    out_shape: &[usize],
    scale: f32,
    fp8: Option<Fp8Call<'_>>,
) -> Result<(Output, FusedSaved)> {
    let dropout = (drop.p > 0.0).then_some(drop);
    let p = params(dims, mask, dropout, scale, layout);
    let dtype = match &qkv {
        Qkv::Apart([q, _, _]) | Qkv::Packed(q, _) => q.dtype(),
    };
    let out_dtype = fp8.and_then(|f| f.out).map_or(dtype, |q| q.dtype());
    // thd: tokens between padded sequences are not written by the kernel; zeros there.
    let mut out = if layout == Layout::Thd {
        Tensor::zeros(dev, out_dtype, out_shape)?
    } else {
        Tensor::empty(dev, out_dtype, out_shape)?
    };
    // SAFETY: f32 has no invalid bit patterns; the forward writes every element.
    let mut lse = unsafe { dev.stream().alloc::<f32>(dims.batch * dims.heads * dims.sq) }?;
    let cu = seqs.as_ref().map(DeviceSeqlens::get);
    let (fp8, out_scale_inv) = match fp8 {
        None => {
            flash_attention::forward(dev, &p, qkv, cu, &mut out, &mut lse)?;
            (None, None)
        }
        Some(call) => {
            let grads = shapes(&qkv);
            let (operands, scale_inv, out_scale_inv) =
                forward_fp8(dev, &p, qkv, cu, (&mut out, dtype, &mut lse), call)?;
            (call.keep.then_some(Fp8Saved { operands, scale_inv, grads, layout }), out_scale_inv)
        }
    };
    let output = match &out_scale_inv {
        Some(si) => Output::Fp8(Float8Tensor::from_parts(out.clone(), None, si.clone())?),
        None => Output::High(out.clone()),
    };
    Ok((output, FusedSaved { out, out_scale_inv, lse, seqs, dropout, fp8 }))
}

/// The FP8 forward: q, k and v cast to their E4M3 operands with one scale (`call.quantizer`'s:
/// the amax of all three under current scaling, the module's QKV slot under delayed scaling),
/// then [`fa8::forward`] (or [`fa8::forward_fp8_out`] cast by `call.out`); the codes (with the
/// backward's when `call.keep`), their scale, and the E4M3 output's scale.
#[allow(clippy::type_complexity)]
fn forward_fp8(
    dev: &Device,
    p: &FlashAttnParams,
    qkv: Qkv<&Tensor>,
    cu: Option<CuSeqlens<'_>>,
    (out, dtype, lse): (&mut Tensor, DType, &mut CudaSlice<f32>),
    call: Fp8Call<'_>,
) -> Result<(Fp8Operands, Arc<CudaSlice<f32>>, Option<Arc<CudaSlice<f32>>>)> {
    let mut operands = if call.keep { Fp8Operands::with_backward(dev, p)? } else { Fp8Operands::new(dev, p)? };
    let inputs: Vec<&Tensor> = match &qkv {
        Qkv::Apart(t) => t.to_vec(),
        Qkv::Packed(t, _) => vec![*t],
    };
    let parts = qkv.parts();
    let scale_inv = call.quantizer.cast_inputs(&inputs, &mut |s| {
        for (which, x) in [Fp8Operand::Q, Fp8Operand::K, Fp8Operand::V].into_iter().zip(parts) {
            fa8::quantize(dev, p, which, x, s, &mut operands)?;
        }
        Ok(())
    })?;
    let qkv_scale_inv = [&*scale_inv; 3];
    let out_scale_inv = match call.out {
        None => {
            fa8::forward(dev, p, &operands, qkv_scale_inv, cu, out, lse)?;
            None
        }
        Some(q) => Some(q.fused_cast(&mut |s| {
            fa8::forward_fp8_out(dev, p, &operands, qkv_scale_inv, cu, (&mut *out, dtype), s, &mut *lse)
        })?),
    };
    Ok((operands, scale_inv, out_scale_inv))
}

/// The gradients of q, k and v from the forward's tensors and state: `(dq, dk, dv)` in q's, k's
/// and v's shapes for inputs apart, one fused `d_qkv` ([`packed::shape`]) for packed inputs.
pub(super) fn backward(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    (qkv, layout): (Qkv<&Tensor>, Layout),
    saved: &FusedSaved,
    d_out: &Tensor,
    scale: f32,
) -> Result<Qkv<Tensor>> {
    let p = params(dims, mask, saved.dropout, scale, layout);
    let (out, lse, cu) = (&saved.out, &saved.lse, saved.seqs.as_ref().map(DeviceSeqlens::get));
    let mut grads = new_grads(dev, out.dtype(), &shapes(&qkv), layout)?;
    flash_attention::backward(dev, &p, qkv, out, d_out, lse, cu, grads_mut(&mut grads))?;
    Ok(grads)
}

/// The FP8 backward ([`fa8::backward`]) of an FP8 forward that kept its codes: `d_out` cast with
/// `d_o` (E5M2 under HYBRID), dS quantized with `ds` (a delayed-scaling slot: its scale, its amax
/// recorded); the gradients as [`backward`] gives them, from the codes alone.
pub(super) fn backward_fp8(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    saved: &FusedSaved,
    d_out: &Tensor,
    scale: f32,
    (d_o, ds): (&dyn Quantizer, &dyn Quantizer),
) -> Result<Qkv<Tensor>> {
    let fp8 =
        saved.fp8.as_ref().ok_or_else(|| Error::internal(MODULE, "the FP8 backward of a forward without codes"))?;
    let p = params(dims, mask, saved.dropout, scale, fp8.layout);
    let (out, lse, cu) = (&saved.out, &saved.lse, saved.seqs.as_ref().map(DeviceSeqlens::get));
    let mut g8 = Fp8Grad::new(dev, &p, d_o.dtype())?;
    let d_o_scale_inv = d_o.cast_inputs(&[d_out], &mut |s| fa8::quantize_grad(dev, &p, d_out, s, &mut g8))?;
    let mut grads = new_grads(dev, d_out.dtype(), &fp8.grads, fp8.layout)?;
    let scale_inv =
        Fp8BwdScaleInv { qkv: [&*fp8.scale_inv; 3], d_o: &d_o_scale_inv, o: saved.out_scale_inv.as_deref() };
    ds.fused_cast(&mut |s| {
        let g = grads_mut(&mut grads);
        fa8::backward(dev, &p, (&fp8.operands, &g8), scale_inv, s, (out, d_out), lse, cu, g)
    })?;
    Ok(grads)
}

/// The shapes of the inputs (those of their gradients).
fn shapes(qkv: &Qkv<&Tensor>) -> Qkv<Vec<usize>> {
    match qkv {
        Qkv::Apart(t) => Qkv::Apart(t.map(|t| t.shape().to_vec())),
        Qkv::Packed(t, offsets) => Qkv::Packed(t.shape().to_vec(), *offsets),
    }
}

/// Uninitialized gradients of `shapes` (zeros for `thd`, whose gaps between sequences the
/// kernels do not write).
fn new_grads(dev: &Device, dtype: DType, shapes: &Qkv<Vec<usize>>, layout: Layout) -> Result<Qkv<Tensor>> {
    let new = |shape: &Vec<usize>| {
        if layout == Layout::Thd {
            Tensor::zeros(dev, dtype, shape)
        } else {
            Tensor::empty(dev, dtype, shape)
        }
    };
    Ok(match shapes {
        Qkv::Apart([q, k, v]) => Qkv::Apart([new(q)?, new(k)?, new(v)?]),
        Qkv::Packed(t, offsets) => Qkv::Packed(new(t)?, *offsets),
    })
}

fn grads_mut(g: &mut Qkv<Tensor>) -> Qkv<&mut Tensor> {
    match g {
        Qkv::Apart([a, b, c]) => Qkv::Apart([a, b, c]),
        Qkv::Packed(t, offsets) => Qkv::Packed(t, *offsets),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modules::attention::QkvFormat;

    #[test]
    fn dense_strides_follow_the_format() {
        let dims =
            Dims { format: QkvFormat::Sbhd, batch: 3, sq: 5, sk: 7, heads: 4, groups: 2, head_dim: 64, head_dim_v: 64 };
        let p = params(&dims, (AttnMaskType::Causal, (-1, 0)), None, 0.125, Layout::Dense);
        assert_eq!(p.q, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 128, row: 3 * 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((-1, 0), false));
        let bshd = Dims { format: QkvFormat::Bshd, ..dims };
        let p = params(&bshd, (AttnMaskType::PaddingCausalBottomRight, (4, 0)), None, 0.125, Layout::Dense);
        assert_eq!(p.q, HeadStrides { batch: 5 * 256, row: 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 7 * 128, row: 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((4, 0), true));
        let packed = Dims { sk: 5, ..dims };
        let p = params(&packed, (AttnMaskType::Causal, (-1, 0)), None, 0.125, Layout::Packed);
        assert_eq!((p.q, p.kv), (packed::strides(&packed).0, packed::strides(&packed).0));
        assert_eq!(p.o, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        let p = params(&dims, (AttnMaskType::PaddingCausal, (-1, 0)), None, 0.125, Layout::Thd);
        assert_eq!(
            (p.q, p.kv, p.o),
            (
                HeadStrides { batch: 0, row: 256, head: 64 },
                HeadStrides { batch: 0, row: 128, head: 64 },
                HeadStrides { batch: 0, row: 256, head: 64 }
            )
        );
    }
}
