//! The context-parallel forward and backward of [`DotProductAttention`] (TE's
//! `AttnFuncWithCPAndKVAllGather`): this rank's two query chunks over every rank's keys and
//! values, through the hook of [`ContextParallel`] (see `te_nn::parallel`'s context-parallel
//! docs for the split).

use super::{AttentionCtx, AttnMaskType, DotProductAttention, QkvFormat, MODULE};
use crate::parallel::context_parallel::{local_shape, pad_rows, stack};
use crate::parallel::ContextParallel;
use te_runtime::ops::elementwise::add_assign;
use te_runtime::{Error, Result, Tensor};

/// What [`DotProductAttention::forward_context_parallel`] keeps for the backward: the contexts
/// of its two attention calls and the sizes of the problem.
#[derive(Debug)]
pub struct CpAttentionCtx {
    /// The calls of the rank's first and second query chunks.
    calls: [AttentionCtx; 2],
    /// Tokens a chunk (`c`).
    chunk: usize,
    /// The shapes of the rank's k and v: `[2c, b, g, d]`, `[2c, b, g, dv]`.
    kv_shapes: [Vec<usize>; 2],
}

impl CpAttentionCtx {
    /// The contexts of the rank's two attention calls (its first and second query chunk).
    pub fn calls(&self) -> &[AttentionCtx; 2] {
        &self.calls
    }
}

impl DotProductAttention {
    /// Sets the mask type of the module's next calls: a context-parallel
    /// `MultiheadAttention` runs its causal attention as
    /// [`AttnMaskType::CausalBottomRight`] (the same mask where queries and keys are equally
    /// many) and back.
    ///
    /// # Errors
    /// The configuration's checks ([`Error::Config`]) for a mask its window does not fit.
    pub(crate) fn set_attn_mask_type(&mut self, mask: AttnMaskType) -> Result<()> {
        let mut cfg = self.cfg.clone();
        cfg.attn_mask_type = mask;
        cfg.validate()?;
        self.cfg = cfg;
        Ok(())
    }

    /// Causal (or unmasked) attention of this rank's queries over every rank of `cp`'s keys and
    /// values: `q: [2c, b, h, d]`, `k: [2c, b, g, d]`, `v: [2c, b, g, dv]` (sbhd; this rank's
    /// two chunks, [`ContextParallel::shard`]'s layout). The keys and values are all-gathered in
    /// global order and each query chunk attends over the keys up to its own end
    /// ([`ContextParallel::key_ends`]), one fused call each. Returns the output `[2c, b, h · dv]`
    /// (this rank's rows of the whole sequence's attention output) and the context for
    /// [`DotProductAttention::backward_context_parallel`]. Every rank of the group calls it
    /// with its part of the same sequences.
    ///
    /// # Errors
    /// [`Error::Config`] for a layout other than `sbhd`, a mask other than
    /// [`AttnMaskType::CausalBottomRight`] or [`AttnMaskType::NoMask`] (a top-left causal mask
    /// would mask a chunk's queries against its own position instead of the global one: use
    /// `CausalBottomRight`, the same mask where queries and keys are equally many), or an FP8
    /// attention (`fp8_dpa`; not built with context parallelism); [`Error::Shape`] for parts of
    /// an odd or mismatched length; the attention's, NCCL, allocation and copy errors.
    pub fn forward_context_parallel(
        &mut self,
        cp: &ContextParallel,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, CpAttentionCtx)> {
        let dev = self.dev.clone();
        if self.cfg.qkv_format != QkvFormat::Sbhd {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "context parallelism splits the first dim: use qkv_format sbhd, not {:?}",
                    self.cfg.qkv_format
                ),
            });
        }
        let causal = match self.cfg.attn_mask_type {
            AttnMaskType::CausalBottomRight => true,
            AttnMaskType::NoMask => false,
            other => {
                return Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "attn_mask_type {other:?}: context parallelism takes causal_bottom_right (the causal mask at \
                         each chunk's global position; the same as causal where queries and keys are equally many) \
                         or no_mask"
                    ),
                })
            }
        };
        let local = q.shape().first().copied().unwrap_or(0);
        if local == 0 || local % 2 != 0 || k.shape().first() != Some(&local) || v.shape().first() != Some(&local) {
            return Err(Error::Shape {
                op: MODULE,
                message: format!(
                    "q {:?}, k {:?}, v {:?}: a rank's parts hold two chunks of equal length, the same for all three",
                    q.shape(),
                    k.shape(),
                    v.shape()
                ),
            });
        }
        let c = local / 2;
        let k_all = cp.gather_sequence(&dev, k, c)?;
        let v_all = cp.gather_sequence(&dev, v, c)?;
        let mut outs = Vec::with_capacity(2);
        let mut calls = Vec::with_capacity(2);
        for (half, end) in cp.key_ends(c, causal).into_iter().enumerate() {
            let q_half = q.narrow(&dev, half * c..(half + 1) * c)?;
            let (k_pre, v_pre) = (k_all.narrow(&dev, 0..end)?, v_all.narrow(&dev, 0..end)?);
            let (out, ctx) = self.forward(&q_half, &k_pre, &v_pre, None)?;
            if ctx.fp8() {
                return Err(Error::Config {
                    module: MODULE,
                    message: "FP8 attention (fp8_dpa) with context parallelism is not built: run attention in BF16 \
                              (fp8_dpa off)"
                        .into(),
                });
            }
            outs.push(out);
            calls.push(ctx);
        }
        let out = stack(&dev, &outs, &local_shape(outs[0].shape(), c))?;
        let calls: [AttentionCtx; 2] =
            calls.try_into().map_err(|_| Error::internal(MODULE, "two attention calls, two contexts"))?;
        Ok((out, CpAttentionCtx { calls, chunk: c, kv_shapes: [k.shape().to_vec(), v.shape().to_vec()] }))
    }

    /// The backward of [`DotProductAttention::forward_context_parallel`] for `d_out: [2c, b, h ·
    /// dv]` (this rank's rows of the output's gradient): `(dq, dk, dv)` in the shapes of this
    /// rank's q, k and v. The key and value gradients of all ranks' queries are summed over the
    /// group (a reduce-scatter), so every rank calls it.
    ///
    /// # Errors
    /// [`Error::Shape`] for a `d_out` of another length; the attention's, NCCL, allocation and
    /// copy errors.
    pub fn backward_context_parallel(
        &mut self,
        cp: &ContextParallel,
        ctx: CpAttentionCtx,
        d_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = self.dev.clone();
        let CpAttentionCtx { calls, chunk: c, kv_shapes: [k_shape, v_shape] } = ctx;
        if d_out.shape().first() != Some(&(2 * c)) {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("d_out {:?} must hold the rank's {} tokens", d_out.shape(), 2 * c),
            });
        }
        let seq = 2 * cp.size() * c;
        let mut dqs: [Option<Tensor>; 2] = [None, None];
        let mut dk_all: Option<Tensor> = None;
        let mut dv_all: Option<Tensor> = None;
        // The second chunk's keys reach at least as far as the first's: its gradients start the
        // sums, the first's are added over their prefix.
        for (half, call) in calls.into_iter().enumerate().rev() {
            let d_half = d_out.narrow(&dev, half * c..(half + 1) * c)?;
            let (dq, dk, dv) = self.backward(call, &d_half)?;
            dqs[half] = Some(dq);
            for (sum, part) in [(&mut dk_all, dk), (&mut dv_all, dv)] {
                let whole = pad_rows(&dev, &part, seq)?;
                match sum {
                    Some(s) => add_assign(&dev, s, &whole)?,
                    None => *sum = Some(whole),
                }
            }
        }
        let missing = || Error::internal(MODULE, "a chunk's gradient was not computed");
        let [a, b] = dqs;
        let dqs = [a.ok_or_else(missing)?, b.ok_or_else(missing)?];
        let dq = stack(&dev, &dqs, &local_shape(dqs[0].shape(), c))?;
        let dk = cp.scatter_sequence(&dev, &dk_all.ok_or_else(missing)?, c, &k_shape)?;
        let dv = cp.scatter_sequence(&dev, &dv_all.ok_or_else(missing)?, c, &v_shape)?;
        Ok((dq, dk, dv))
    }
}
