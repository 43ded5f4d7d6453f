//! The fused QKV tensor: the QKV projection's output `[a, b, (h + 2g) · d]` (`[s, b, ..]` in
//! sbhd, `[b, s, ..]` in bshd), each position's row holding all q heads, then all k heads, then
//! all v heads (the rows of `MultiheadAttention`'s QKV weight). The fused backend reads the heads
//! in place and writes `dq`, `dk`, `dv` into one such gradient; the unfused backend and RoPE work
//! on q, k, v copied apart ([`split`]) and concatenate their gradients back ([`concat`]).

use super::{
    check_dtype, check_shape, high, AttentionCtx, DType, DotProductAttention, DotProductAttentionConfig,
    Fp8OutputRequest, Inputs, Output, Qkv, QkvFormat, MODULE,
};
use te_runtime::ops::attention_shape::{AttentionShape, HeadStrides};
use te_runtime::ops::copy::copy_columns;
use te_runtime::{Device, Error, Result, Tensor};

/// Elements per position of the fused tensor: `(h + 2g) · d`.
pub(super) fn width(dims: &AttentionShape) -> usize {
    (dims.heads + 2 * dims.groups) * dims.head_dim
}

/// The shape of the fused tensor (and of its gradient) for `dims` (self-attention: `sq = sk`;
/// bshd or sbhd).
///
/// # Errors
/// [`Error::Internal`] for `thd`, which has no fused QKV tensor.
pub(super) fn shape(dims: &AttentionShape) -> Result<[usize; 3]> {
    let [a, b, _, _] = format(dims)?.shape(dims.batch, dims.sq, 1, 1);
    Ok([a, b, width(dims)])
}

/// The format of the fused tensor.
///
/// # Errors
/// [`Error::Internal`] for `thd`, which has no fused QKV tensor.
fn format(dims: &AttentionShape) -> Result<QkvFormat> {
    dims.layout.format().ok_or_else(|| Error::internal(MODULE, "a fused QKV tensor in thd"))
}

/// Where the heads of q, k and v sit in the fused tensor: one set of strides for all three (rows
/// [`width`] apart), and the element offsets of q's, k's and v's first head. (A `thd` shape, which
/// has no fused tensor, reads as bshd.)
pub(super) fn strides(dims: &AttentionShape) -> (HeadStrides, [usize; 3]) {
    let (w, d) = (width(dims), dims.head_dim);
    let strides = match dims.layout.format() {
        Some(QkvFormat::Sbhd) => HeadStrides { batch: w, row: dims.batch * w, head: d },
        Some(QkvFormat::Bshd) | None => HeadStrides { batch: dims.sq * w, row: w, head: d },
    };
    (strides, [0, dims.heads * d, (dims.heads + dims.groups) * d])
}

/// The problem of self-attention over the fused `qkv` for the module's configuration: its
/// heads, groups and head dim, format, mask, window and scale (`DotProductAttentionConfig::shape`),
/// `sq = sk` the positions of `qkv`; checked ([`AttentionShape::validate`]).
///
/// # Errors
/// [`Error::Shape`] when `qkv` is not 3-D with last dim `(heads + 2 · groups) · head_dim`, or a
/// batch or sequence of 0.
pub(super) fn problem(qkv: &Tensor, cfg: &DotProductAttentionConfig) -> Result<AttentionShape> {
    let (heads, groups, head_dim) = (cfg.num_attention_heads, cfg.groups(), cfg.kv_channels);
    let want = (heads + 2 * groups) * head_dim;
    let &[a, b, w] = qkv.shape() else {
        return Err(Error::Shape {
            op: MODULE,
            message: format!(
                "the fused QKV tensor must be 3-D [s, b, (h + 2g)·d] (sbhd) or [b, s, (h + 2g)·d] (bshd), got {:?}",
                qkv.shape()
            ),
        });
    };
    if w != want {
        return Err(Error::Shape {
            op: MODULE,
            message: format!(
                "the fused QKV tensor's last dim must be (num_attention_heads + 2 · num_gqa_groups) · kv_channels = \
                 ({heads} + 2 · {groups}) · {head_dim} = {want}, got {w}"
            ),
        });
    }
    let (batch, seq) = cfg.qkv_format.batch_seq([a, b, 1, 1]);
    if batch == 0 || seq == 0 {
        return Err(Error::Shape {
            op: MODULE,
            message: format!("batch and sequence must be ≥ 1, got {batch} and {seq}"),
        });
    }
    let dims = AttentionShape { head_dim_v: head_dim, ..cfg.shape(batch, (seq, seq)) };
    dims.validate(MODULE)?;
    Ok(dims)
}

/// q `[a, b, h, d]`, k and v `[a, b, g, d]` copied out of the fused `qkv`.
///
/// # Errors
/// Allocation and copy failures.
pub(super) fn split(dev: &Device, qkv: &Tensor, dims: &AttentionShape) -> Result<[Tensor; 3]> {
    let [a, b, _] = shape(dims)?;
    let d = dims.head_dim;
    let (_, offsets) = strides(dims);
    let part = |offset: usize, heads: usize| -> Result<Tensor> {
        let mut t = Tensor::empty(dev, qkv.dtype(), &[a * b, heads * d])?;
        copy_columns(dev, qkv, offset, &mut t, 0, heads * d)?;
        t.reshape(&[a, b, heads, d])
    };
    Ok([part(offsets[0], dims.heads)?, part(offsets[1], dims.groups)?, part(offsets[2], dims.groups)?])
}

/// The fused gradient `[a, b, (h + 2g) · d]` of `dq`, `dk`, `dv` (q's, k's and v's shapes).
///
/// # Errors
/// Allocation and copy failures.
pub(super) fn concat(dev: &Device, [dq, dk, dv]: [&Tensor; 3], dims: &AttentionShape) -> Result<Tensor> {
    let [a, b, w] = shape(dims)?;
    let d = dims.head_dim;
    let (_, offsets) = strides(dims);
    let mut d_qkv = Tensor::empty(dev, dq.dtype(), &[a, b, w])?;
    for ((t, offset), heads) in [dq, dk, dv].into_iter().zip(offsets).zip([dims.heads, dims.groups, dims.groups]) {
        copy_columns(dev, &t.reshape(&[a * b, heads * d])?, 0, &mut d_qkv, offset, heads * d)?;
    }
    Ok(d_qkv)
}

impl DotProductAttention {
    /// Self-attention over the fused QKV tensor `qkv` `[s, b, (h + 2g) · d]` (sbhd) or `[b, s,
    /// (h + 2g) · d]` (bshd), each position's row holding all q heads, then all k heads, then
    /// all v heads (the output of `MultiheadAttention`'s QKV projection; q's dtype rules as
    /// [`DotProductAttention::forward`]). The fused backend reads the heads in place (no split
    /// copies); the unfused one copies q, k and v apart first. `seq_lens` and the output as in
    /// [`DotProductAttention::forward`] with `sq = sk = s`. Take the gradient with
    /// [`DotProductAttention::backward_packed`].
    ///
    /// # Errors
    /// As [`DotProductAttention::forward`]; [`Error::Shape`] when `qkv` is not 3-D with last dim
    /// `(num_attention_heads + 2 · num_gqa_groups) · kv_channels`; [`Error::Config`] when the
    /// config sets a `head_dim_v` other than `kv_channels`.
    pub fn forward_packed(&mut self, qkv: &Tensor, seq_lens: Option<&[usize]>) -> Result<(Tensor, AttentionCtx)> {
        let (out, ctx) = self.forward_packed_to(qkv, (seq_lens, None), None)?;
        Ok((high(out)?, ctx))
    }

    /// [`DotProductAttention::forward_packed`] whose output an FP8 consumer may take in E4M3
    /// (TE `fp8_mha`, see [`Fp8OutputRequest`]); without a request the output is 16-bit.
    pub(crate) fn forward_packed_to(
        &mut self,
        qkv: &Tensor,
        seq_lens: (Option<&[usize]>, Option<&super::PaddingSeqlens>),
        out_fp8: Option<Fp8OutputRequest<'_>>,
    ) -> Result<(Output, AttentionCtx)> {
        check_dtype(MODULE, "qkv", qkv, DType::is_high_precision, "f32, bf16 or f16")?;
        let cfg = &self.cfg;
        if cfg.kv_channels_v() != cfg.kv_channels {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "a fused QKV tensor holds one head dim for q, k and v (as TE's MultiheadAttention), but head_dim_v = \
                     {} differs from kv_channels = {}: pass q, k and v apart to forward",
                    cfg.kv_channels_v(),
                    cfg.kv_channels
                ),
            });
        }
        let dims = problem(qkv, cfg)?;
        self.run_forward(dims, Inputs::Packed(qkv.clone()), seq_lens, true, out_fp8)
    }

    /// Backward of [`DotProductAttention::forward_packed`]: the gradient of the fused QKV tensor,
    /// its shape and dtype, for `d_out` the gradient of the output. The fused backend writes it
    /// in place (no concatenation copies).
    ///
    /// # Errors
    /// [`Error::Context`] for a context made by another module or by
    /// [`DotProductAttention::forward`] (use [`DotProductAttention::backward`] there); otherwise
    /// as [`DotProductAttention::backward`].
    pub fn backward_packed(&mut self, ctx: AttentionCtx, d_out: &Tensor) -> Result<Tensor> {
        if ctx.module_id == self.id && !ctx.packed {
            return Err(Error::Context {
                module: MODULE,
                message: "the context was made by forward (q, k, v apart): take its gradients with backward".into(),
            });
        }
        let dims = ctx.shape;
        match self.run_backward(ctx, d_out)? {
            Qkv::Apart([dq, dk, dv]) => concat(&self.dev, [&dq, &dk, &dv], &dims),
            Qkv::Packed(d_qkv, _) => Ok(d_qkv),
        }
    }

    /// q `[a, b, h, d]`, k and v `[a, b, g, d]` copied out of the fused QKV tensor (for callers
    /// that transform them first, as RoPE does).
    ///
    /// # Errors
    /// As [`DotProductAttention::forward_packed`]'s shape checks; allocation and copy failures.
    pub(crate) fn split_packed(&self, qkv: &Tensor) -> Result<[Tensor; 3]> {
        split(&self.dev, qkv, &problem(qkv, &self.cfg)?)
    }

    /// The fused QKV gradient `[a, b, (h + 2g) · d]` of `dq`, `dk`, `dv` (shapes of
    /// [`DotProductAttention::split_packed`]'s results).
    ///
    /// # Errors
    /// [`Error::Shape`] for a `dq` that is not `[a, b, h, d]`; allocation and copy failures.
    pub(crate) fn concat_packed(&self, [dq, dk, dv]: [&Tensor; 3]) -> Result<Tensor> {
        let (h, g, d) = (self.cfg.num_attention_heads, self.cfg.groups(), self.cfg.kv_channels);
        let &[a, b, ..] = dq.shape() else {
            return Err(Error::Shape { op: MODULE, message: format!("dq must be 4-D, got {:?}", dq.shape()) });
        };
        let (batch, seq) = self.cfg.qkv_format.batch_seq([a, b, 1, 1]);
        let dims = AttentionShape { head_dim_v: d, ..self.cfg.shape(batch, (seq, seq)) };
        check_shape(MODULE, "dq", dq, &self.cfg.qkv_format.shape(batch, seq, h, d))?;
        for (name, t) in [("dk", dk), ("dv", dv)] {
            check_shape(MODULE, name, t, &self.cfg.qkv_format.shape(batch, seq, g, d))?;
        }
        concat(&self.dev, [dq, dk, dv], &dims)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_runtime::ops::attention_shape::QkvLayout;

    #[test]
    fn heads_sit_at_their_columns() {
        let dims = AttentionShape::new(QkvLayout::Sbhd, 3, (5, 5), (4, 2), 8);
        assert_eq!((width(&dims), shape(&dims).unwrap()), (64, [5, 3, 64]));
        let (s, offsets) = strides(&dims);
        assert_eq!((s, offsets), (HeadStrides { batch: 64, row: 192, head: 8 }, [0, 32, 48]));
        let bshd = AttentionShape { layout: QkvLayout::Bshd, ..dims };
        assert_eq!(shape(&bshd).unwrap(), [3, 5, 64]);
        assert_eq!(strides(&bshd).0, HeadStrides { batch: 320, row: 64, head: 8 });
        let thd = AttentionShape { layout: QkvLayout::Thd, ..dims };
        assert!(matches!(shape(&thd), Err(Error::Internal { .. })));
    }
}
