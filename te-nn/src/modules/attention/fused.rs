//! The fused backend (TE's `FlashAttention` / `FusedAttention` backends): the FlashAttention-2
//! kernels of [`te_runtime::ops::flash_attention`] straight on the `bshd`/`sbhd` tensors. The
//! context keeps the output and the f32 `softmax_lse [batch, heads, sq]` (4 bytes per query and
//! head, instead of the unfused backend's `[batch, heads, sq, sk]` probabilities).

use super::{packed, MODULE};
use crate::fp8::{Float8Tensor, Quantizer};
use crate::modules::Output;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::flash_attention::{self, CuSeqlens, FlashAttnParams, Qkv};
use te_runtime::ops::flash_attention_fp8::{self as fa8, Fp8BwdScaleInv, Fp8Grad, Fp8Operand, Fp8Operands};
use te_runtime::{Device, DeviceBuffer, Error, Result, Tensor};

/// The valid lengths (and for `thd` the token offsets) of a call's sequences, on the device.
#[derive(Debug)]
pub(super) struct DeviceSeqlens {
    /// `cu_seqlens_q` and `cu_seqlens_kv` (shared with a [`super::PaddingSeqlens`]'s tables).
    cu: (Arc<CudaSlice<i32>>, Arc<CudaSlice<i32>>),
    /// `thd`: where each sequence's tokens start in q / o and in k / v.
    offsets: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
}

impl DeviceSeqlens {
    fn get(&self) -> CuSeqlens<'_> {
        CuSeqlens { q: &self.cu.0, kv: &self.cu.1, offsets: self.offsets.as_ref().map(|(q, kv)| (q, kv)) }
    }

    /// Self-attention's tables made before (a [`super::PaddingSeqlens`]'s): queries and keys
    /// share them.
    pub(super) fn shared(cu: Arc<CudaSlice<i32>>) -> Self {
        Self { cu: (cu.clone(), cu), offsets: None }
    }

    /// Uploads i32 prefix sums (`offsets` given for `thd`).
    pub(super) fn upload(dev: &Device, cu: [&[i32]; 2], offsets: Option<[&[i32]; 2]>) -> Result<Self> {
        let stream = dev.stream();
        let cu = (Arc::new(stream.htod(cu[0])?), Arc::new(stream.htod(cu[1])?));
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
    lse: DeviceBuffer<f32>,
    /// The sequence lengths of a padding mask or of `thd`.
    seqs: Option<DeviceSeqlens>,
    /// An FP8 forward's codes for the FP8 backward ([`backward_fp8`]).
    fp8: Option<Fp8Saved>,
}

/// What an FP8 forward keeps for the FP8 backward: the codes of q, k, v (with the backward's
/// transposed ones) and their one `scale_inv`, and the shapes of the gradients (apart, or one
/// fused tensor and the heads' offsets; the 16-bit q, k, v themselves are not needed: the module
/// releases them).
#[derive(Debug)]
struct Fp8Saved {
    operands: Fp8Operands,
    scale_inv: Arc<CudaSlice<f32>>,
    grads: Qkv<Vec<usize>>,
}

impl FusedSaved {
    /// Device bytes kept only for the backward: `softmax_lse`, the sequence tables, and an FP8
    /// forward's codes (the output is the caller's).
    pub(super) fn bytes(&self) -> usize {
        let seqs = self.seqs.as_ref().map_or(0, |s| {
            let tables =
                [Some(&*s.cu.0), Some(&*s.cu.1), s.offsets.as_ref().map(|o| &o.0), s.offsets.as_ref().map(|o| &o.1)];
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

/// The kernels' parameters for the call `shape`: q, k, v and the output dense in its layout, or
/// with q, k and v inside one fused QKV tensor (`packed`, [`packed::strides`]; one head dim).
fn params(shape: &AttentionShape, packed: bool) -> FlashAttnParams {
    let dense = FlashAttnParams::dense(*shape);
    if !packed {
        return dense;
    }
    let s = packed::strides(shape).0;
    FlashAttnParams { q: s, kv: s, v: s, ..dense }
}

/// `cu_seqlens_q` / `_kv` for padding lengths: sequence `b` has the valid queries and keys
/// [`AttentionShape::valid_lengths`] gives it (the unfused byte mask's rule).
pub(super) fn padding_seqlens(dev: &Device, seq_lens: &[usize], shape: &AttentionShape) -> Result<DeviceSeqlens> {
    let prefix = |side: fn((usize, usize)) -> usize| -> Result<Vec<i32>> {
        let mut cu = vec![0i32];
        let mut total = 0usize;
        for &len in seq_lens {
            total += side(shape.valid_lengths(Some(len)));
            cu.push(i32::try_from(total).map_err(|_| Error::Shape {
                op: MODULE,
                message: format!("the valid positions of the batch, {total}, exceed i32 cu_seqlens: split the batch"),
            })?);
        }
        Ok(cu)
    };
    DeviceSeqlens::upload(dev, [&prefix(|(q, _)| q)?, &prefix(|(_, k)| k)?], None)
}

/// `out = softmax(scale · Q · Kᵀ, mask) · V` for the call `shape` (mask, window, scale and
/// dropout included; dense `[.., heads · head_dim_v]` in the layout's order, `out_shape`) and the
/// saved state; `seqs` checked and uploaded by the caller. With `fp8` the forward runs on E4M3 q,
/// k, v ([`Fp8Call`]; the caller checked that the FP8 kernels take the call), keeps the codes of
/// the FP8 backward ([`backward_fp8`]) when asked, and writes the output in E4M3 when asked (an
/// [`Output::Fp8`]); else it serves the 16-bit backward.
pub(super) fn forward(
    dev: &Device,
    shape: &AttentionShape,
    seqs: Option<DeviceSeqlens>,
    qkv: Qkv<&Tensor>,
    out_shape: &[usize],
    fp8: Option<Fp8Call<'_>>,
) -> Result<(Output, FusedSaved)> {
    let p = params(shape, matches!(qkv, Qkv::Packed(..)));
    let dtype = match &qkv {
        Qkv::Apart([q, _, _]) | Qkv::Packed(q, _) => q.dtype(),
    };
    let out_dtype = fp8.and_then(|f| f.out).map_or(dtype, |q| q.dtype());
    // thd: tokens between padded sequences are not written by the kernel; zeros there.
    let mut out = if shape.layout == QkvLayout::Thd {
        Tensor::zeros(dev, out_dtype, out_shape)?
    } else {
        Tensor::empty(dev, out_dtype, out_shape)?
    };
    // SAFETY: f32 has no invalid bit patterns; the forward writes every element.
    let mut lse = DeviceBuffer::new(unsafe { dev.stream().alloc::<f32>(shape.lse_len()) }?);
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
            (call.keep.then_some(Fp8Saved { operands, scale_inv, grads }), out_scale_inv)
        }
    };
    let output = match &out_scale_inv {
        Some(si) => Output::Fp8(Float8Tensor::from_parts(out.clone(), None, si.clone())?),
        None => Output::High(out.clone()),
    };
    Ok((output, FusedSaved { out, out_scale_inv, lse, seqs, fp8 }))
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

/// The gradients of q, k and v from the forward's tensors and state (`shape` the forward's, its
/// dropout stream replayed): `(dq, dk, dv)` in q's, k's and v's shapes for inputs apart, one fused
/// `d_qkv` ([`packed::shape`]) for packed inputs.
pub(super) fn backward(
    dev: &Device,
    shape: &AttentionShape,
    qkv: Qkv<&Tensor>,
    saved: &FusedSaved,
    d_out: &Tensor,
) -> Result<Qkv<Tensor>> {
    let p = params(shape, matches!(qkv, Qkv::Packed(..)));
    let (out, lse, cu) = (&saved.out, &saved.lse, saved.seqs.as_ref().map(DeviceSeqlens::get));
    let mut grads = new_grads(dev, out.dtype(), &shapes(&qkv), shape.layout)?;
    flash_attention::backward(dev, &p, qkv, out, d_out, lse, cu, grads_mut(&mut grads))?;
    Ok(grads)
}

/// The FP8 backward ([`fa8::backward`]) of an FP8 forward that kept its codes: `d_out` cast with
/// `d_o` (E5M2 under HYBRID), dS quantized with `ds` (a delayed-scaling slot: its scale, its amax
/// recorded); the gradients as [`backward`] gives them, from the codes alone.
pub(super) fn backward_fp8(
    dev: &Device,
    shape: &AttentionShape,
    saved: &FusedSaved,
    d_out: &Tensor,
    (d_o, ds): (&dyn Quantizer, &dyn Quantizer),
) -> Result<Qkv<Tensor>> {
    let fp8 =
        saved.fp8.as_ref().ok_or_else(|| Error::internal(MODULE, "the FP8 backward of a forward without codes"))?;
    let p = params(shape, matches!(fp8.grads, Qkv::Packed(..)));
    let (out, lse, cu) = (&saved.out, &saved.lse, saved.seqs.as_ref().map(DeviceSeqlens::get));
    let mut g8 = Fp8Grad::new(dev, &p, d_o.dtype())?;
    let d_o_scale_inv = d_o.cast_inputs(&[d_out], &mut |s| fa8::quantize_grad(dev, &p, d_out, s, &mut g8))?;
    let mut grads = new_grads(dev, d_out.dtype(), &fp8.grads, shape.layout)?;
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
fn new_grads(dev: &Device, dtype: DType, shapes: &Qkv<Vec<usize>>, layout: QkvLayout) -> Result<Qkv<Tensor>> {
    let new = |shape: &Vec<usize>| {
        if layout == QkvLayout::Thd {
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
    use te_codegen::spec::AttnMaskType;
    use te_runtime::ops::flash_attention::HeadStrides;

    #[test]
    fn strides_follow_the_layout() {
        let dims = AttentionShape::new(QkvLayout::Sbhd, 3, (5, 7), (4, 2), 64).with_mask(AttnMaskType::Causal, None);
        let p = params(&dims, false);
        assert_eq!(p.q, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 128, row: 3 * 128, head: 64 });
        assert_eq!((p.shape.window, p.shape.bottom_right()), ((-1, 0), false));
        let bshd = AttentionShape { layout: QkvLayout::Bshd, ..dims }
            .with_mask(AttnMaskType::PaddingCausalBottomRight, Some((4, 0)));
        let p = params(&bshd, false);
        assert_eq!(p.q, HeadStrides { batch: 5 * 256, row: 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 7 * 128, row: 128, head: 64 });
        assert_eq!((p.shape.window, p.shape.bottom_right()), ((4, 0), true));
        let packed = AttentionShape { sk: 5, ..dims };
        let p = params(&packed, true);
        assert_eq!((p.q, p.kv), (packed::strides(&packed).0, packed::strides(&packed).0));
        assert_eq!(p.o, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        let thd = AttentionShape { layout: QkvLayout::Thd, ..dims }.with_mask(AttnMaskType::PaddingCausal, None);
        let p = params(&thd, false);
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
