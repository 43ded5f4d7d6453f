//! The fused backend (TE's `FlashAttention` / `FusedAttention` backends): the FlashAttention-2
//! kernels of [`crate::ops::flash_attention`] straight on the `bshd`/`sbhd` tensors. The
//! context keeps the output and the f32 `softmax_lse [batch, heads, sq]` (4 bytes per query and
//! head, instead of the unfused backend's `[batch, heads, sq, sk]` probabilities).

use super::plan::Dims;
use super::{AttnMaskType, MODULE};
use crate::ops::flash_attention::{self, CuSeqlens, FlashAttnParams, HeadStrides};
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

/// The kernels' parameters for a call: dense q, k, v and output in `dims.format`, the mask as
/// its resolved window (causal: right bound 0) and diagonal alignment.
fn params(dims: &Dims, (mask, window): (AttnMaskType, (i64, i64)), scale: f32) -> FlashAttnParams {
    let d = dims.head_dim;
    let q = HeadStrides::dense(dims.format, dims.batch, dims.sq, dims.heads, d);
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
        kv: HeadStrides::dense(dims.format, dims.batch, dims.sk, dims.groups, d),
        o: q,
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
/// `seq_lens` checked by the caller (given exactly for padding masks).
pub(super) fn forward(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    seq_lens: Option<&[usize]>,
    qkv: [&Tensor; 3],
    scale: f32,
) -> Result<(Tensor, FusedSaved)> {
    let p = params(dims, mask, scale);
    let cu = seq_lens.map(|lens| cu_seqlens(dev, lens, dims)).transpose()?;
    let mut out = Tensor::empty(dev, qkv[0].dtype(), &dims.out_shape())?;
    // SAFETY: f32 has no invalid bit patterns; the forward writes every element.
    let mut lse = unsafe { dev.stream().alloc::<f32>(dims.batch * dims.heads * dims.sq) }?;
    let cu_ref = cu.as_ref().map(|(q, kv)| CuSeqlens { q, kv });
    flash_attention::forward(dev, &p, qkv, cu_ref, &mut out, &mut lse)?;
    Ok((out.clone(), FusedSaved { out, lse, cu }))
}

/// `(dq, dk, dv)` in q's, k's and v's shapes from the forward's tensors and state.
pub(super) fn backward(
    dev: &Device,
    dims: &Dims,
    mask: (AttnMaskType, (i64, i64)),
    qkv: [&Tensor; 3],
    saved: &FusedSaved,
    d_out: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let p = params(dims, mask, scale);
    let dtype = qkv[0].dtype();
    let mut dq = Tensor::empty(dev, dtype, qkv[0].shape())?;
    let mut dk = Tensor::empty(dev, dtype, qkv[1].shape())?;
    let mut dv = Tensor::empty(dev, dtype, qkv[2].shape())?;
    flash_attention::backward(dev, &p, qkv, &saved.out, d_out, &saved.lse, saved.cu(), [&mut dq, &mut dk, &mut dv])?;
    Ok((dq, dk, dv))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modules::attention::QkvFormat;

    #[test]
    fn dense_strides_follow_the_format() {
        let dims = Dims { format: QkvFormat::Sbhd, batch: 3, sq: 5, sk: 7, heads: 4, groups: 2, head_dim: 64 };
        let p = params(&dims, (AttnMaskType::Causal, (-1, 0)), 0.125);
        assert_eq!(p.q, HeadStrides { batch: 256, row: 3 * 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 128, row: 3 * 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((-1, 0), false));
        let bshd = Dims { format: QkvFormat::Bshd, ..dims };
        let p = params(&bshd, (AttnMaskType::PaddingCausalBottomRight, (4, 0)), 0.125);
        assert_eq!(p.q, HeadStrides { batch: 5 * 256, row: 256, head: 64 });
        assert_eq!(p.kv, HeadStrides { batch: 7 * 128, row: 128, head: 64 });
        assert_eq!((p.window, p.bottom_right), ((4, 0), true));
    }
}
