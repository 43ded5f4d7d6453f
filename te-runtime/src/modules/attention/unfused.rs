//! The unfused backend (TE `UnfusedDotProductAttention`): the per-head products as strided
//! batched cuBLASLt GEMMs ([`super::plan`]) around the fused softmax kernel, with the scores
//! `[batch, heads, sq, sk]` materialized in the inputs' dtype. The GEMMs run with alpha 1; the
//! softmax kernels apply the scale, forward and backward alike.

use super::plan::{Dims, Product};
use crate::gemm::{gemm_strided_batched, GemmConfig};
use crate::ops::elementwise;
use crate::ops::softmax::{self, Mask};
use crate::{Device, Result, Tensor};
use te_codegen::DType;

/// `out = softmax(scale · Q · Kᵀ, mask) · V` per head; returns `(out, P)`: the output in
/// [`Dims::out_shape`] and the probabilities `[batch, heads, sq, sk]`, both in q's dtype.
pub(super) fn forward(
    dev: &Device,
    dims: &Dims,
    [q, k, v]: [&Tensor; 3],
    mask: Mask<'_>,
    scale: f32,
) -> Result<(Tensor, Tensor)> {
    let dtype = q.dtype();
    let mut scores = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    products(dev, dims, Product::QueryKeyT, q, k, &mut scores)?;
    let mut probs = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    softmax::forward(dev, &scores, mask, scale, &mut probs)?;
    drop(scores);
    let mut out = Tensor::empty(dev, dtype, &dims.out_shape())?;
    products(dev, dims, Product::ScoresKey, &probs, v, &mut out)?;
    Ok((out, probs))
}

/// `(dq, dk, dv)` from the forward's q, k, v, probabilities `probs` and the output gradient
/// `d_out` (checked by the caller).
pub(super) fn backward(
    dev: &Device,
    dims: &Dims,
    [q, k, v]: [&Tensor; 3],
    probs: &Tensor,
    d_out: &Tensor,
    scale: f32,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = q.dtype();
    let dv = key_grad(dev, dims, probs, d_out, dtype)?;
    let mut dp = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    products(dev, dims, Product::QueryKeyT, d_out, v, &mut dp)?;
    let mut ds = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    softmax::backward(dev, &dp, probs, scale, &mut ds)?;
    drop(dp);
    let mut dq = Tensor::empty(dev, dtype, q.shape())?;
    products(dev, dims, Product::ScoresKey, &ds, k, &mut dq)?;
    let dk = key_grad(dev, dims, &ds, q, dtype)?;
    Ok((dq, dk, dv))
}

/// `Σ_r scores_rᵀ · query_r` over the query heads `r` of each group: a key or value gradient in
/// k's shape and `dtype`, summed in f32 when groups have several heads (rounded once after).
fn key_grad(dev: &Device, dims: &Dims, scores: &Tensor, query: &Tensor, dtype: DType) -> Result<Tensor> {
    let sum_dtype = if dims.heads_per_group() > 1 { DType::F32 } else { dtype };
    let mut sum = Tensor::empty(dev, sum_dtype, &dims.kv_shape())?;
    products(dev, dims, Product::ScoresTQuery, scores, query, &mut sum)?;
    if sum_dtype == dtype {
        return Ok(sum);
    }
    let mut grad = Tensor::zeros(dev, dtype, &dims.kv_shape())?;
    elementwise::add_assign(dev, &mut grad, &sum)?;
    Ok(grad)
}

/// Runs the GEMMs of `product` with operands `a`, `b` into `d`.
fn products(dev: &Device, dims: &Dims, product: Product, a: &Tensor, b: &Tensor, d: &mut Tensor) -> Result<()> {
    for call in dims.calls(product) {
        let cfg = GemmConfig { accumulate: call.accumulate, ..Default::default() };
        gemm_strided_batched(dev, a, b, d, &call.batch, &cfg)?;
    }
    Ok(())
}
