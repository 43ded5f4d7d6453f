//! The ring (p2p) forward and backward of [`DotProductAttention`] with context parallelism
//! (TE's `AttnFuncWithCPAndKVP2P`; the schedule and the reasoning are in
//! `te_nn::parallel::cp_ring`): the keys and values travel around the ring on a side stream
//! while the fused attention of the ones in hand runs, and each step's output and
//! `softmax_lse` are merged by their log-sum-exp in f32 (`te_runtime::ops::attn_merge`). The
//! backward replays the ring with the merged output and LSE: the query gradient accumulates on
//! the rank, the key and value gradients travel one step behind their keys and values and reach
//! their rank after the last step.

use super::{backend, AttnMaskType, DotProductAttention, MODULE};
use crate::fp8::{fp8_mode, Fp8Mode};
use crate::parallel::cp_ring::{ring_schedule, Halves, RingStep};
use crate::parallel::ContextParallel;
use cudarc::driver::CudaSlice;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::attn_merge::{self, MergeAcc};
use te_runtime::ops::elementwise::add_assign_rows;
use te_runtime::ops::flash_attention::{self, FlashAttnParams, Qkv};
use te_runtime::{Error, Result, Tensor};

/// What the ring's forward keeps for its backward.
#[derive(Debug)]
pub(super) struct RingCtx {
    module_id: u64,
    /// This rank's q, k and v (`[2c, b, h, d]`, `[2c, b, g, d]`, `[2c, b, g, dv]`; shared).
    qkv: [Tensor; 3],
    /// The merged output `[2c, b, h · dv]` (shared with the caller's).
    out: Tensor,
    /// The merged `softmax_lse` `[b, h, 2c]` and its second half `[b, h, c]` per (sequence,
    /// head).
    lse: CudaSlice<f32>,
    lse_half: CudaSlice<f32>,
    /// Each step and its problem (its dropout stream included).
    steps: Vec<(RingStep, AttentionShape)>,
    /// Tokens a chunk (`c`).
    chunk: usize,
}

impl RingCtx {
    /// Device bytes held only for the backward: the merged LSE and its second half.
    pub(super) fn saved_bytes(&self) -> usize {
        (self.lse.len() + self.lse_half.len()) * 4
    }
}

impl DotProductAttention {
    /// Why the ring cannot run this module's calls of `dtype` (a typed error with the fix).
    fn check_ring(&self, dtype: te_codegen::DType) -> Result<()> {
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        if let Fp8Mode::Fp8(r) | Fp8Mode::Calibrating(r) = fp8_mode() {
            if r.fp8_dpa() {
                return config(
                    "FP8 attention (fp8_dpa) with context parallelism is not built: run attention in BF16 (fp8_dpa \
                     off)"
                        .into(),
                );
            }
        }
        if self.cfg.backend == super::AttentionBackend::Unfused {
            return config("the ring (cp_comm_type p2p) runs the fused kernels: use cp_comm_type all_gather".into());
        }
        if let Some(why) = backend::fused_unsupported(&self.cfg, dtype, self.dev.arch(), true) {
            return config(format!(
                "the ring (cp_comm_type p2p) runs the fused kernels, but {why}: use cp_comm_type all_gather"
            ));
        }
        Ok(())
    }

    /// The ring's forward (see the module docs) of this rank's `q: [2c, b, h, d]`, `k: [2c, b,
    /// g, d]`, `v: [2c, b, g, dv]` (checked by the caller: sbhd, equal even lengths, a causal
    /// bottom-right or no mask, no window): the merged output `[2c, b, h · dv]` and the context
    /// of [`DotProductAttention::ring_backward`].
    pub(super) fn ring_forward(
        &mut self,
        cp: &ContextParallel,
        [q, k, v]: [&Tensor; 3],
        causal: bool,
    ) -> Result<(Tensor, RingCtx)> {
        self.check_ring(q.dtype())?;
        // Shapes, dtypes and head counts as a one-GPU call of the local rows checks them.
        let local = self.problem(q, k, v)?;
        let dev = self.dev.clone();
        let (c, batch) = (local.sq / 2, local.batch);
        let steps = ring_schedule(cp.size(), cp.rank(), causal);
        let q_second = match steps.iter().any(|s| s.queries == Halves::Second) {
            true => Some(q.narrow(&dev, c..2 * c)?),
            false => None,
        };
        let mut acc = MergeAcc::new(&dev, &local)?;
        let mut kv = (k.clone(), v.clone());
        let mut planned = Vec::with_capacity(steps.len());
        for step in steps {
            let next = if step.step + 1 < cp.size() {
                let mut next = (Tensor::empty(&dev, k.dtype(), k.shape())?, Tensor::empty(&dev, v.dtype(), v.shape())?);
                cp.ring_exchange(&[&kv.0, &kv.1], &mut [&mut next.0, &mut next.1])?;
                Some(next)
            } else {
                None
            };
            let queries = step.queries.rows(c);
            let mask = if step.causal { AttnMaskType::Causal } else { AttnMaskType::NoMask };
            let drop = self.next_dropout();
            let shape = self
                .cfg
                .shape(batch, (queries.len(), step.keys.rows(c).len()))
                .with_mask(mask, None)
                .with_dropout((drop.p > 0.0).then_some(drop));
            let q_t = match step.queries {
                Halves::Second => q_second.as_ref().ok_or_else(|| Error::internal(MODULE, "the second query chunk"))?,
                _ => q,
            };
            let mut out = Tensor::empty(&dev, q.dtype(), &[queries.len(), batch, shape.heads * shape.head_dim_v])?;
            // SAFETY: f32 has no invalid bit patterns; the forward writes every element.
            let mut lse = unsafe { dev.stream().alloc::<f32>(shape.lse_len()) }?;
            // The first key chunk is the first c rows of the tensors: the kernels read sk rows.
            let p = FlashAttnParams::dense(shape);
            flash_attention::forward(&dev, &p, Qkv::Apart([q_t, &kv.0, &kv.1]), None, &mut out, &mut lse)?;
            attn_merge::merge_step(&dev, &mut acc, &shape, &out, &lse, queries.start, step.step == 0)?;
            if let Some(next) = next {
                cp.ring_wait()?;
                kv = next;
            }
            planned.push((step, shape));
        }
        let mut out = Tensor::empty(&dev, q.dtype(), &[2 * c, batch, local.heads * local.head_dim_v])?;
        // SAFETY: f32 has no invalid bit patterns; the finishing kernel writes every element.
        let mut lse_half = unsafe { dev.stream().alloc::<f32>(local.lse_len() / 2) }?;
        attn_merge::merge_finish(&dev, &mut acc, &mut out, &mut lse_half)?;
        let ctx = RingCtx {
            module_id: self.id,
            qkv: [q.clone(), k.clone(), v.clone()],
            out: out.clone(),
            lse: acc.into_lse(),
            lse_half,
            steps: planned,
            chunk: c,
        };
        Ok((out, ctx))
    }

    /// The ring's backward for `d_out: [2c, b, h · dv]`: `(dq, dk, dv)` in the shapes of this
    /// rank's q, k and v. Every rank of the group calls it (the key and value gradients travel
    /// the ring).
    ///
    /// # Errors
    /// [`Error::Context`] for a context of another module; [`Error::Shape`] for a `d_out` of
    /// another shape; the kernels', NCCL and allocation errors.
    pub(super) fn ring_backward(
        &mut self,
        cp: &ContextParallel,
        ctx: RingCtx,
        d_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if ctx.module_id != self.id {
            return Err(Error::Context {
                module: MODULE,
                message: "the context was made by another DotProductAttention's forward".into(),
            });
        }
        let dev = self.dev.clone();
        let RingCtx { qkv: [q, k, v], out, lse, lse_half, steps, chunk: c, .. } = ctx;
        if d_out.shape() != out.shape() || d_out.dtype() != out.dtype() {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("d_out {:?} must have the output's shape {:?} and dtype", d_out.shape(), out.shape()),
            });
        }
        // The second query chunk's rows, for the steps that attend with it alone.
        let second = match steps.iter().any(|(s, _)| s.queries == Halves::Second) {
            true => Some([q.narrow(&dev, c..2 * c)?, out.narrow(&dev, c..2 * c)?, d_out.narrow(&dev, c..2 * c)?]),
            false => None,
        };
        let last = steps.len() - 1;
        let mut kv = (k.clone(), v.clone());
        let mut dq: Option<Tensor> = None;
        // The key/value gradients summed so far for the keys and values in hand (after the wait).
        let mut dkv_sent: Option<(Tensor, Tensor)> = None;
        for (step, shape) in steps {
            let mut sends: Vec<Tensor> = Vec::new();
            let mut recvs: Vec<Tensor> = Vec::new();
            if step.step < last {
                sends.extend([kv.0.clone(), kv.1.clone()]);
                recvs.extend([Tensor::empty(&dev, k.dtype(), k.shape())?, Tensor::empty(&dev, v.dtype(), v.shape())?]);
            }
            if let Some((dk, dv)) = dkv_sent.take() {
                sends.extend([dk, dv]);
                recvs.extend([Tensor::empty(&dev, k.dtype(), k.shape())?, Tensor::empty(&dev, v.dtype(), v.shape())?]);
            }
            if !sends.is_empty() {
                let send: Vec<&Tensor> = sends.iter().collect();
                let mut recv: Vec<&mut Tensor> = recvs.iter_mut().collect();
                cp.ring_exchange(&send, &mut recv)?;
            }
            let (q_t, out_t, d_t, lse_t) = match (&step.queries, &second) {
                (Halves::Second, Some([q2, o2, d2])) => (q2, o2, d2, &lse_half),
                (Halves::Second, None) => return Err(Error::internal(MODULE, "the second query chunk's rows")),
                _ => (&q, &out, d_out, &lse),
            };
            let mut g_q = Tensor::empty(&dev, q.dtype(), q_t.shape())?;
            let key_rows = step.keys.rows(c).len();
            let mut g_k = Tensor::empty(&dev, k.dtype(), &with_first(k.shape(), key_rows))?;
            let mut g_v = Tensor::empty(&dev, v.dtype(), &with_first(v.shape(), key_rows))?;
            let p = FlashAttnParams::dense(shape);
            let grads = Qkv::Apart([&mut g_q, &mut g_k, &mut g_v]);
            flash_attention::backward(&dev, &p, Qkv::Apart([q_t, &kv.0, &kv.1]), out_t, d_t, lse_t, None, grads)?;
            match dq.as_mut() {
                None => dq = Some(g_q),
                Some(acc) => add_assign_rows(&dev, acc, step.queries.rows(c).start, &g_q)?,
            }
            cp.ring_wait()?;
            let mut recvs = recvs.into_iter();
            if step.step < last {
                let (k_next, v_next) = (recvs.next(), recvs.next());
                kv = (k_next.ok_or_else(missing)?, v_next.ok_or_else(missing)?);
            }
            // This step's key/value gradients added to what the earlier ranks summed for them.
            let (dk, dv) = match (recvs.next(), recvs.next()) {
                (Some(mut dk), Some(mut dv)) => {
                    add_assign_rows(&dev, &mut dk, step.keys.rows(c).start, &g_k)?;
                    add_assign_rows(&dev, &mut dv, step.keys.rows(c).start, &g_v)?;
                    (dk, dv)
                }
                _ if step.step == 0 => (g_k, g_v),
                _ => return Err(Error::internal(MODULE, "a step's key/value gradients were not received")),
            };
            dkv_sent = Some((dk, dv));
        }
        let (dk, dv) = dkv_sent.ok_or_else(missing)?;
        let (dk, dv) = if last == 0 {
            (dk, dv)
        } else {
            // The sums went one rank too far: each goes back to the rank whose keys they are.
            let mut back = (Tensor::empty(&dev, k.dtype(), k.shape())?, Tensor::empty(&dev, v.dtype(), v.shape())?);
            cp.ring_exchange(&[&dk, &dv], &mut [&mut back.0, &mut back.1])?;
            cp.ring_wait()?;
            back
        };
        Ok((dq.ok_or_else(missing)?, dk, dv))
    }
}

/// A step's tensors that the schedule says exist.
fn missing() -> Error {
    Error::internal(MODULE, "a ring step's tensor was not made")
}

/// `shape` with its first dim set to `first`.
fn with_first(shape: &[usize], first: usize) -> Vec<usize> {
    let mut out = shape.to_vec();
    out[0] = first;
    out
}
