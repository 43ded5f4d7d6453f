//! The unfused backend (TE `UnfusedDotProductAttention`): the per-head products as strided
//! batched cuBLASLt GEMMs ([`super::plan`]) around the fused softmax kernel, with the scores
//! `[batch, heads, sq, sk]` materialized in the inputs' dtype. The GEMMs run with alpha 1; the
//! softmax kernels apply the scale, forward and backward alike.

use super::plan::{self, Product};
use te_codegen::DType;
use te_runtime::gemm::{gemm_strided_batched, GemmConfig};
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::dropout::{dropout, dropout_backward, mask_bytes, DropoutParams};
use te_runtime::ops::elementwise;
use te_runtime::ops::softmax::{self, Mask};
use te_runtime::{Device, DeviceBuffer, Result, Tensor};

/// The keep mask of the attention dropout and its parameters (TE `attention_dropout`).
#[derive(Debug)]
pub(super) struct ProbsDropout {
    params: DropoutParams,
    mask: DeviceBuffer<u8>,
}

impl ProbsDropout {
    /// The mask's bytes.
    pub(super) fn bytes(&self) -> usize {
        self.mask.len()
    }
}

/// `out = dropout(softmax(scale · Q · Kᵀ, mask)) · V` per head for the call `dims` (its scale
/// and dropout); returns `(out, P, dropout)`: the output in [`plan::out_shape`], the
/// probabilities `[batch, heads, sq, sk]` before dropout (q's dtype), and the dropout mask with
/// dropout.
pub(super) fn forward(
    dev: &Device,
    dims: &AttentionShape,
    [q, k, v]: [&Tensor; 3],
    mask: Mask<'_>,
) -> Result<(Tensor, Tensor, Option<ProbsDropout>)> {
    let dtype = q.dtype();
    let mut scores = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    products(dev, dims, Product::QueryKeyT, dims.head_dim, q, k, &mut scores)?;
    let mut probs = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    softmax::forward(dev, &scores, mask, dims.scale, &mut probs)?;
    let mut out = Tensor::empty(dev, dtype, &plan::out_shape(dims)?)?;
    let Some(drop) = dims.dropout else {
        std::mem::drop(scores);
        products(dev, dims, Product::ScoresKey, dims.head_dim_v, &probs, v, &mut out)?;
        return Ok((out, probs, None));
    };
    // The scores buffer takes the dropped probabilities.
    // SAFETY: u8 has no invalid bit patterns; the kernel writes every mask byte.
    let mut keep = unsafe { dev.stream().alloc::<u8>(mask_bytes(probs.numel())) }?;
    dropout(dev, &probs, drop, &mut scores, &mut keep)?;
    products(dev, dims, Product::ScoresKey, dims.head_dim_v, &scores, v, &mut out)?;
    Ok((out, probs, Some(ProbsDropout { params: drop, mask: DeviceBuffer::new(keep) })))
}

/// `(dq, dk, dv)` of the call `dims` (its scale) from the forward's q, k, v, probabilities
/// `probs`, dropout mask and the output gradient `d_out` (checked by the caller).
pub(super) fn backward(
    dev: &Device,
    dims: &AttentionShape,
    [q, k, v]: [&Tensor; 3],
    probs: &Tensor,
    drop: Option<&ProbsDropout>,
    d_out: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dtype = q.dtype();
    let mut dp = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    let dv = match drop {
        None => key_grad(dev, dims, dims.head_dim_v, probs, d_out, dtype)?,
        Some(d) => {
            // The dropped probabilities the forward used, rebuilt from P and the mask.
            dropout_backward(dev, probs, &d.mask, d.params.p, &mut dp)?;
            key_grad(dev, dims, dims.head_dim_v, &dp, d_out, dtype)?
        }
    };
    products(dev, dims, Product::QueryKeyT, dims.head_dim_v, d_out, v, &mut dp)?;
    if let Some(d) = drop {
        let mut kept = Tensor::empty(dev, dtype, &dims.scores_shape())?;
        dropout_backward(dev, &dp, &d.mask, d.params.p, &mut kept)?;
        dp = kept;
    }
    let mut ds = Tensor::empty(dev, dtype, &dims.scores_shape())?;
    softmax::backward(dev, &dp, probs, dims.scale, &mut ds)?;
    std::mem::drop(dp);
    let mut dq = Tensor::empty(dev, dtype, q.shape())?;
    products(dev, dims, Product::ScoresKey, dims.head_dim, &ds, k, &mut dq)?;
    let dk = key_grad(dev, dims, dims.head_dim, &ds, q, dtype)?;
    Ok((dq, dk, dv))
}

/// `Σ_r scores_rᵀ · query_r` over the query heads `r` of each group: a key (`w = head_dim`) or
/// value (`head_dim_v`) gradient in k's or v's shape and `dtype`, summed in f32 when groups have
/// several heads (rounded once after).
fn key_grad(
    dev: &Device,
    dims: &AttentionShape,
    w: usize,
    scores: &Tensor,
    query: &Tensor,
    dtype: DType,
) -> Result<Tensor> {
    let sum_dtype = if dims.heads_per_group() > 1 { DType::F32 } else { dtype };
    let kv_shape = plan::kv_shape(dims, w)?;
    let mut sum = Tensor::empty(dev, sum_dtype, &kv_shape)?;
    products(dev, dims, Product::ScoresTQuery, w, scores, query, &mut sum)?;
    if sum_dtype == dtype {
        return Ok(sum);
    }
    let mut grad = Tensor::zeros(dev, dtype, &kv_shape)?;
    elementwise::add_assign(dev, &mut grad, &sum)?;
    Ok(grad)
}

/// Runs the GEMMs of `product` on head matrices of `w` channels with operands `a`, `b` into `d`.
fn products(
    dev: &Device,
    dims: &AttentionShape,
    product: Product,
    w: usize,
    a: &Tensor,
    b: &Tensor,
    d: &mut Tensor,
) -> Result<()> {
    for call in plan::calls(dims, product, w)? {
        let cfg = GemmConfig { accumulate: call.accumulate, ..Default::default() };
        gemm_strided_batched(dev, a, b, d, &call.batch, &cfg)?;
    }
    Ok(())
}
