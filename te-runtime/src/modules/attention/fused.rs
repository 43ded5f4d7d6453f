//! The fused backend (TE's `FlashAttention` / `FusedAttention` backends): the FlashAttention-2
//! kernels of [`crate::ops::flash_attention`] straight on the `bshd`/`sbhd` tensors. The
//! context keeps the output and the f32 `softmax_lse [batch, heads, sq]` (4 bytes per query and
//! head, instead of the unfused backend's `[batch, heads, sq, sk]` probabilities).

use super::plan::Dims;
use super::{packed, AttnMaskType, MODULE};
use crate::ops::flash_attention::{self, CuSeqlens, FlashAttnParams, HeadStrides, Qkv};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;

/// What the fused forward keeps for its backward.
#[derive(Debug)]
pub(super) struct FusedSaved {
    out: Tensor,
    lse: CudaSlice<f32>,
    /// `cu_seqlens_q` and `cu_seqlens_kv` of a padding mask.
    cu: Option<(CudaSlice<i32>, CudaSlice<i32>)>,
}

impl FusedSaved {
    fn cu(&self) -> Option<CuSeqlens<'_>> {
        self.cu.as_ref().map(|(q, kv)| CuSeqlens { q, kv })
    }
}

/// The kernels' parameters for a call: q, k, v dense in `dims.format` or (`packed`) inside one
/// fused QKV tensor, a dense output, the mask as its resolved window (causal: right bound 0)
/// and diagonal alignment.
fn params(dims: &Dims, (mask, window): (AttnMaskType, (i64, i64)), scale: f32, packed: bool) -> FlashAttnParams {
    let d = dims.head_dim;
    let o = HeadStrides::dense(dims.format, dims.batch, dims.sq, dims.heads, d);
    let (q, kv) = if packed {
        let s = packed::strides(dims).0;
        (s, s)
    } else {
        (o, HeadStrides::dense(dims.format, dims.batch, dims.sk, dims.groups, d))
    };
    FlashAttnParams {
        batch: dims.batch,
        sq: dims.sq,
        sk: dims.sk,
        heads: dims.heads,
        groups: dims.groups,
        head_dim: d,
        scale,
        window,
        bottom_right: mask.is_bottom_right(),
        q,
        kv,
        o,
    }
}

/// `cu_seqlens_q` / `_kv` for padding lengths: sequence `b` has `min(len, sq)` valid queries and
/// `min(len, sk)` valid keys (the unfused byte mask's rule).
fn cu_seqlens(dev: &Device, seq_lens: &[usize], dims: &Dims) -> Result<(CudaSlice<i32>, CudaSlice<i32>)> {
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
    let stream = dev.stream();
    Ok((stream.clone_htod(&prefix(dims.sq)?)?, stream.clone_htod(&prefix(dims.sk)?)?))
}

/// `out = softmax(scale · Q · Kᵀ, mask) · V` in [`Dims::out_shape`] and the saved state;
/// `seq_lens` checked by the caller (given exactly for padding masks); q, k, v apart or packed
/// ([`packed`]).
pub(super) fn forward(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    seq_lens: Option<&[usize]>,
    qkv: Qkv<&Tensor>,
    scale: f32,
) -> Result<(Tensor, FusedSaved)> {
    let p = params(dims, mask, scale, matches!(qkv, Qkv::Packed(..)));
    let dtype = match &qkv {
        Qkv::Apart([q, _, _]) | Qkv::Packed(q, _) => q.dtype(),
    };
    let cu = seq_lens.map(|lens| cu_seqlens(dev, lens, dims)).transpose()?;
    let mut out = Tensor::empty(dev, dtype, &dims.out_shape())?;
    // SAFETY: f32 has no invalid bit patterns; the forward writes every element.
    let mut lse = unsafe { dev.stream().alloc::<f32>(dims.batch * dims.heads * dims.sq) }?;
    let cu_ref = cu.as_ref().map(|(q, kv)| CuSeqlens { q, kv });
    flash_attention::forward(dev, &p, qkv, cu_ref, &mut out, &mut lse)?;
    Ok((out.clone(), FusedSaved { out, lse, cu }))
}

/// The gradients of q, k and v from the forward's tensors and state: `(dq, dk, dv)` in q's, k's
/// and v's shapes for inputs apart, one fused `d_qkv` ([`packed::shape`]) for packed inputs.
pub(super) fn backward(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    qkv: Qkv<&Tensor>,
    saved: &FusedSaved,
    d_out: &Tensor,
    scale: f32,
) -> Result<Qkv<Tensor>> {
    let p = params(dims, mask, scale, matches!(qkv, Qkv::Packed(..)));
    let (out, lse, cu) = (&saved.out, &saved.lse, saved.cu());
    match qkv {
        Qkv::Apart([q, k, v]) => {
            let dtype = q.dtype();
            let mut dq = Tensor::empty(dev, dtype, q.shape())?;
            let mut dk = Tensor::empty(dev, dtype, k.shape())?;
            let mut dv = Tensor::empty(dev, dtype, v.shape())?;
            let grads = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
            flash_attention::backward(dev, &p, Qkv::Apart([q, k, v]), out, d_out, lse, cu, grads)?;
            Ok(Qkv::Apart([dq, dk, dv]))
        }
        Qkv::Packed(t, offsets) => {
            let mut d_qkv = Tensor::empty(dev, t.dtype(), t.shape())?;
            let grads = Qkv::Packed(&mut d_qkv, offsets);
            flash_attention::backward(dev, &p, Qkv::Packed(t, offsets), out, d_out, lse, cu, grads)?;
            Ok(Qkv::Packed(d_qkv, offsets))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modules::attention::QkvFormat;

    #[test]
    fn dense_strides_follow_the_format() {
        let dims = Dims { format: QkvFormat::Sbhd, batch: 3, sq: 5, sk: 7, heads: 4, groups: 2, head_dim: 64 };
        let p = params(&dims, (AttnMaskType::Causal, (-1, 0)), 0.125, false);
        assert_eq!(p.q, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 128, row: 3 * 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((-1, 0), false));
        let bshd = Dims { format: QkvFormat::Bshd, ..dims };
        let p = params(&bshd, (AttnMaskType::PaddingCausalBottomRight, (4, 0)), 0.125, false);
        assert_eq!(p.q, HeadStrides { batch: 5 * 256, row: 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 7 * 128, row: 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((4, 0), true));
        let packed = Dims { sk: 5, ..dims };
        let p = params(&packed, (AttnMaskType::Causal, (-1, 0)), 0.125, true);
        assert_eq!((p.q, p.kv), (packed::strides(&packed).0, packed::strides(&packed).0));
        assert_eq!(p.o, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
    }
}
