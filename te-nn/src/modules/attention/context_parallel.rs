//! The context-parallel forward and backward of [`DotProductAttention`]: this rank's two query
//! chunks over every rank's keys and values, through the hook of [`ContextParallel`] (see
//! `te_nn::parallel`'s context-parallel docs for the split), by the ring ([`CpCommType::P2p`],
//! TE's `AttnFuncWithCPAndKVP2P`, in `cp_ring.rs`) or the all-gather (TE's
//! `AttnFuncWithCPAndKVAllGather`, here).

use super::cp_ring::RingCtx;
use super::{AttentionCtx, AttnMaskType, DotProductAttention, QkvFormat, MODULE};
use crate::parallel::context_parallel::{local_shape, pad_rows, stack};
use crate::parallel::{ContextParallel, CpCommType};
use te_runtime::ops::elementwise::add_assign;
use te_runtime::{Error, Result, Tensor};

/// What [`DotProductAttention::forward_context_parallel`] keeps for the backward.
#[derive(Debug)]
pub struct CpAttentionCtx(CpSaved);

/// The all-gather's calls or the ring's state.
#[derive(Debug)]
enum CpSaved {
    AllGather {
        /// The calls of the rank's first and second query chunks.
        calls: Box<[AttentionCtx; 2]>,
        /// Tokens a chunk (`c`).
        chunk: usize,
        /// The shapes of the rank's k and v: `[2c, b, g, d]`, `[2c, b, g, dv]`.
        kv_shapes: [Vec<usize>; 2],
    },
    Ring(Box<RingCtx>),
}

impl CpAttentionCtx {
    /// The contexts of the all-gather's two attention calls (the rank's first and second query
    /// chunk); `None` for the ring, which runs the fused kernels a step at a time.
    pub fn calls(&self) -> Option<&[AttentionCtx; 2]> {
        match &self.0 {
            CpSaved::AllGather { calls, .. } => Some(calls),
            CpSaved::Ring(_) => None,
        }
    }

    /// The exchange that ran: [`CpCommType::P2p`] (the ring) or [`CpCommType::AllGather`].
    pub fn comm_type(&self) -> CpCommType {
        match &self.0 {
            CpSaved::AllGather { .. } => CpCommType::AllGather,
            CpSaved::Ring(_) => CpCommType::P2p,
        }
    }

    /// Device bytes held only for the backward: the two calls' ([`AttentionCtx::saved_bytes`]),
    /// or the ring's merged `softmax_lse` (f32 `[b, h, 2c]`) and its second half.
    pub fn saved_bytes(&self) -> usize {
        match &self.0 {
            CpSaved::AllGather { calls, .. } => calls.iter().map(AttentionCtx::saved_bytes).sum(),
            CpSaved::Ring(r) => r.saved_bytes(),
        }
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
    /// two chunks, [`ContextParallel::shard`]'s layout). Returns the output `[2c, b, h · dv]`
    /// (this rank's rows of the whole sequence's attention output) and the context for
    /// [`DotProductAttention::backward_context_parallel`]. Every rank of the group calls it
    /// with its part of the same sequences.
    ///
    /// Under [`CpCommType::P2p`] (the ring, `te_nn::parallel::cp_ring`) the keys and values
    /// travel around the group beside the fused attention of the ones in hand and the steps'
    /// outputs are merged by their LSE in f32; it runs the fused kernels (bf16/f16, their head
    /// dims) and a layer with a sliding window runs the all-gather instead (TE's ring takes no
    /// window). Under [`CpCommType::AllGather`] the keys and values are all-gathered in global
    /// order and each query chunk attends over the keys up to its own end
    /// ([`ContextParallel::key_ends`]), one call each.
    ///
    /// # Errors
    /// [`Error::Config`] for a layout other than `sbhd`, a mask other than
    /// [`AttnMaskType::CausalBottomRight`] or [`AttnMaskType::NoMask`] (a top-left causal mask
    /// would mask a chunk's queries against its own position instead of the global one: use
    /// `CausalBottomRight`, the same mask where queries and keys are equally many), or an FP8
    /// attention (`fp8_dpa`; not built with context parallelism), or under the ring a call the
    /// fused kernels do not take (dtype, head dim, a forced unfused backend: the message says
    /// to use all_gather); [`Error::Shape`] for parts of an odd or mismatched length; the
    /// attention's, NCCL, allocation and copy errors.
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
        // The ring takes no sliding window (TE's neither): a window that limits anything runs the
        // all-gather; an unbounded one ((-1, -1), or (-1, 0) of the causal mask) is none.
        let no_window =
            self.cfg.window_size.is_none_or(|(left, right)| left < 0 && (right < 0 || (causal && right == 0)));
        if cp.comm_type() == CpCommType::P2p && no_window {
            let (out, ring) = self.ring_forward(cp, [q, k, v], causal)?;
            return Ok((out, CpAttentionCtx(CpSaved::Ring(Box::new(ring)))));
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
        let kv_shapes = [k.shape().to_vec(), v.shape().to_vec()];
        Ok((out, CpAttentionCtx(CpSaved::AllGather { calls: Box::new(calls), chunk: c, kv_shapes })))
    }

    /// The backward of [`DotProductAttention::forward_context_parallel`] for `d_out: [2c, b, h ·
    /// dv]` (this rank's rows of the output's gradient): `(dq, dk, dv)` in the shapes of this
    /// rank's q, k and v. The key and value gradients of all ranks' queries are summed over the
    /// group (around the ring, one step behind their keys and values, in q's dtype as TE's ring
    /// does; or a reduce-scatter), so every rank calls it.
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another module; [`Error::Shape`] for a `d_out` of
    /// another length; the attention's, NCCL, allocation and copy errors.
    pub fn backward_context_parallel(
        &mut self,
        cp: &ContextParallel,
        ctx: CpAttentionCtx,
        d_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = self.dev.clone();
        let (calls, c, [k_shape, v_shape]) = match ctx.0 {
            CpSaved::Ring(ring) => return self.ring_backward(cp, *ring, d_out),
            CpSaved::AllGather { calls, chunk, kv_shapes } => (*calls, chunk, kv_shapes),
        };
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
