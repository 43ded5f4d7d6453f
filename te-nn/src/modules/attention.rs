//! `DotProductAttention`: `softmax(scale · Q · Kᵀ, masked) · V` for every (batch, head), and its
//! backward (TE `pytorch/attention/dot_product_attention/dot_product_attention.py`).
//!
//! Two backends, picked per call ([`AttentionBackend`], TE's `get_attention_backend`):
//!
//! **Fused** (the default wherever it applies: bf16/f16, head_dim in
//! [`te_codegen::spec::FLASH_HEAD_DIMS`] (up to 128 in training)): the FlashAttention-2 kernels of
//! [`te_runtime::ops::flash_attention`]: no `[sq, sk]` buffer, the context keeps the output and the f32
//! `softmax_lse [batch, heads, sq]`, and the backward recomputes the probabilities,
//! deterministically (no atomics). No limit on `sk`. Attention dropout draws its keep mask in the
//! kernels, forward and backward, from the same Philox stream and element indices as the unfused
//! backend's dropout kernel: both backends drop the same probabilities.
//!
//! **FP8** (TE's `fp8_dpa`): under `fp8_autocast` with a recipe whose `fp8_dpa` is set, a fused
//! call the FP8 kernels take (Hopper, head_dim 128 or 256, not `thd`:
//! [`te_runtime::ops::flash_attention_fp8`]) casts q, k and v to E4M3 with one scale (the module's
//! delayed-scaling slot, TE's `META_QKV`, visited as `fp8_fwd`; or their current amax) and runs
//! `Q · Kᵀ` and `P · V` on E4M3 tensor cores; the output is 16-bit. In training the backward runs
//! in FP8 too where its kernels take the call (head_dim 128 or 256, no attention dropout; TE's default
//! `NVTE_FP8_DPA_BWD=1`): dO cast to E5M2 under HYBRID (the module's backward slot `fp8_bwd`, or
//! its current amax), dS quantized in the kernels with a delayed scale (`fp8_dp`, TE's dP
//! quantizer; history 1 under current scaling, as TE), every product on 8-bit tensor cores,
//! 16-bit gradients. Setting `NVTE_FP8_DPA_BWD=0` keeps the backward 16-bit, from the 16-bit q,
//! k, v and the FP8 forward's LSE. Other calls run in 16 bits as without the flag
//! ([`AttentionCtx::fp8`] and [`AttentionCtx::fp8_backward`] say which ran).
//!
//! **FP8 output** (TE's `fp8_mha`, a recipe flag implying `fp8_dpa`): inside `MultiheadAttention`
//! the FP8 forward writes its output as E4M3 codes, cast in the kernel's epilogue with the output
//! projection's input scale (delayed scaling; the codes equal a cast of the 16-bit output bit for
//! bit), and the projection's GEMM reads them: the 16-bit output is never written nor cast. The
//! FP8 backward reads those codes for `rowsum(dO ⊙ O)`, as TE's does. Where that cannot run
//! (current scaling, whose scale needs the amax first; a 16-bit backward; a 16-bit forward) the
//! output stays 16-bit and the projection casts it ([`AttentionCtx::fp8_output`] says which).
//!
//! **Unfused** (TE's `UnfusedDotProductAttention` in `backends.py`), in the inputs' precision,
//! under `fp8_autocast` too (TE's FP8 attention needs a fused kernel):
//! - forward: `S = Q · Kᵀ` (strided batched cuBLASLt GEMMs straight on the `bshd`/`sbhd` tensors,
//!   [`te_runtime::gemm::gemm_strided_batched`], no copies), `P = softmax(scale · S)` with the mask (the
//!   fused softmax kernel, [`te_runtime::ops::softmax`], which applies the scale), `O = P · V`;
//! - backward: `dV = Pᵀ · dO`, `dP = dO · Vᵀ`, `dS = scale · P ⊙ (dP − rowsum(dP ⊙ P))` (the
//!   softmax backward kernel), `dQ = dS · K`, `dK = dSᵀ · Q`. With GQA/MQA the key and value
//!   gradients sum over the heads sharing a group, in f32 for bf16/f16 inputs (rounded once,
//!   as TE's `repeat_interleave` backward does).
//!
//! `S`, `P`, `dP` and `dS` are `[batch, heads, sq, sk]` in the inputs' dtype; the context keeps `P`
//! for backward (`2 · batch · heads · sq · sk` bytes in bf16), as TE's unfused backend does.
//!
//! Both give a query that sees no key (a padded query) a zero output and zero gradients.

mod backend;
mod config;
mod context_parallel;
mod cp_ring;
mod fp8;
mod fused;
mod mask;
mod packed;
mod padding;
mod plan;
mod thd;
mod unfused;

use super::visit::{visit_slots, visit_states, Module, ModuleVisitor, ModuleVisitorMut};
use super::{next_module_id, KernelSpec, KernelTarget, Output};
use crate::fp8::ScalingState;
pub use backend::AttentionBackend;
pub use config::DotProductAttentionConfig;
pub use context_parallel::CpAttentionCtx;
pub(crate) use fp8::Fp8OutputRequest;
use mask::MaskCache;
pub use padding::PaddingSeqlens;
use std::sync::Arc;
pub use te_codegen::spec::{AttnMaskType, QkvFormat};
use te_codegen::DType;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::dropout::DropoutParams;
use te_runtime::ops::flash_attention::Qkv;
use te_runtime::ops::softmax::MAX_SK;
use te_runtime::ops::{check_dtype, check_shape};
use te_runtime::{Device, Error, Result, Tensor};
pub use thd::ThdSeqlens;

/// The 16-bit output of a forward that was not asked for an FP8 one.
fn high(out: Output) -> Result<Tensor> {
    match out {
        Output::High(t) => Ok(t),
        Output::Fp8(_) => Err(Error::internal(MODULE, "an E4M3 attention output no consumer asked for")),
    }
}

const MODULE: &str = "DotProductAttention";

/// The context a [`DotProductAttention::forward`] (or `forward_packed`) saves for its
/// backward: q, k, v (shared with the caller's tensors, not copied; the fused QKV tensor on the
/// fused backend) and the backend's state: the output and `softmax_lse` (fused), or the
/// probabilities `P` `[batch, heads, sq, sk]` (unfused). When the backward runs in FP8
/// ([`AttentionCtx::fp8_backward`]) it holds the E4M3 codes of q, k, v instead (dense and
/// transposed: 6 bytes per element of q, k and v together, as their 16-bit values take), not
/// the 16-bit tensors.
#[derive(Debug)]
pub struct AttentionCtx {
    module_id: u64,
    /// The forward's problem (its dropout stream included).
    shape: AttentionShape,
    inputs: Inputs,
    /// Made by `forward_packed`: the gradient is one fused `d_qkv`.
    packed: bool,
    /// The output's shape (that of `d_out`).
    out_shape: Vec<usize>,
    saved: Saved,
    /// The forward ran on E4M3 q, k, v (TE `fp8_dpa`).
    fp8: bool,
    /// The backward runs in FP8: the casts' scalings.
    fp8_backward: Option<fp8::Fp8Backward>,
}

/// q, k and v as the backward reads them.
#[derive(Debug)]
enum Inputs {
    Apart([Tensor; 3]),
    /// The fused QKV tensor, read in place (fused backend only).
    Packed(Tensor),
    /// `thd` tensors `[tokens, heads, head_dim]` (fused backend only).
    Thd([Tensor; 3]),
    /// Released after an FP8 forward whose backward reads the codes it kept (their dtype).
    Released(DType),
}

impl Inputs {
    fn dtype(&self) -> DType {
        match self {
            Inputs::Apart([q, _, _]) | Inputs::Packed(q) | Inputs::Thd([q, _, _]) => q.dtype(),
            Inputs::Released(dtype) => *dtype,
        }
    }

    /// The tensors holding q, k and v (one for the fused QKV tensor).
    fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Inputs::Apart(t) | Inputs::Thd(t) => t.iter().collect(),
            Inputs::Packed(t) => vec![t],
            Inputs::Released(_) => Vec::new(),
        }
    }

    /// The kernels' view of the inputs: apart (dense or `thd`, as the shape's layout says), or the
    /// heads inside the fused QKV tensor.
    ///
    /// # Errors
    /// [`Error::Internal`] for released inputs.
    fn fused(&self, shape: &AttentionShape) -> Result<Qkv<&Tensor>> {
        Ok(match self {
            Inputs::Apart([q, k, v]) | Inputs::Thd([q, k, v]) => Qkv::Apart([q, k, v]),
            Inputs::Packed(t) => Qkv::Packed(t, packed::strides(shape).1),
            Inputs::Released(_) => return Err(Error::internal(MODULE, "q, k, v were released after the forward")),
        })
    }
}

/// The backend-specific part of an [`AttentionCtx`].
#[derive(Debug)]
enum Saved {
    Fused(Box<fused::FusedSaved>),
    Unfused { probs: Tensor, dropout: Option<unfused::ProbsDropout> },
}

impl AttentionCtx {
    /// The backend that ran the forward (and runs the backward).
    pub fn backend(&self) -> AttentionBackend {
        match self.saved {
            Saved::Fused(_) => AttentionBackend::Fused,
            Saved::Unfused { .. } => AttentionBackend::Unfused,
        }
    }

    /// Whether the forward ran in FP8 (E4M3 q, k, v on the fused backend: an `fp8_autocast`
    /// recipe with `fp8_dpa` and a call the FP8 kernels take).
    pub fn fp8(&self) -> bool {
        self.fp8
    }

    /// Whether the backward runs in FP8 (a training forward in FP8 whose backward the FP8
    /// kernels take, `NVTE_FP8_DPA_BWD` not `0`); else it is 16-bit.
    pub fn fp8_backward(&self) -> bool {
        self.fp8_backward.is_some()
    }

    /// Whether the forward wrote its output as E4M3 codes for an FP8 consumer (TE `fp8_mha`:
    /// `MultiheadAttention`'s projection under a recipe that sets it); else it is 16-bit.
    pub fn fp8_output(&self) -> bool {
        match &self.saved {
            Saved::Fused(s) => s.fp8_output(),
            Saved::Unfused { .. } => false,
        }
    }

    /// Device bytes the context holds only for the backward: unfused, the probabilities `P
    /// [batch, heads, sq, sk]` in the inputs' dtype (and attention dropout's keep mask); fused,
    /// the f32 `softmax_lse [batch, heads, sq]`, the sequence tables, and under an FP8 backward
    /// the E4M3 codes of q, k, v (which replace the 16-bit tensors). q, k, v and the output are
    /// the caller's tensors, shared, not counted.
    pub fn saved_bytes(&self) -> usize {
        match &self.saved {
            Saved::Fused(s) => s.bytes(),
            Saved::Unfused { probs, dropout } => probs.num_bytes() + dropout.as_ref().map_or(0, |d| d.bytes()),
        }
    }
}

/// Scaled dot-product attention over heads, `O = softmax(scale · Q · Kᵀ, masked) · V`, with
/// GQA/MQA (TE `DotProductAttention`); see the module docs for the math.
///
/// Shapes (`bshd`; `sbhd` swaps the first two dims): q `[batch, sq, h, d]`, k and v `[batch, sk,
/// g, d]`, output `[batch, sq, h · d]` (TE returns the hidden size as the last dim), all bf16,
/// f16 or f32.
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// use te_nn::modules::{DotProductAttention, DotProductAttentionConfig};
/// use te_runtime::{DType, Device, Tensor};
///
/// let dev = Device::new(0)?;
/// let mut attn = DotProductAttention::new(&dev, DotProductAttentionConfig::new(32, 128))?; // sbhd, causal
/// let q = Tensor::zeros(&dev, DType::BF16, &[2048, 4, 32, 128])?;
/// let (out, ctx) = attn.forward(&q, &q, &q, None)?; // [2048, 4, 4096]
/// let d_out = Tensor::zeros(&dev, DType::BF16, out.shape())?;
/// let (dq, dk, dv) = attn.backward(ctx, &d_out)?; // each [2048, 4, 32, 128]
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DotProductAttention {
    dev: Arc<Device>,
    cfg: DotProductAttentionConfig,
    id: u64,
    masks: MaskCache,
    /// Philox key of the attention dropout (the module's id unless set).
    dropout_seed: u64,
    /// Forward calls in training mode: the dropout stream offset (each call draws a fresh mask).
    calls: u64,
    /// Training mode (dropout on), PyTorch's `module.training`.
    training: bool,
    /// The backend of the last forward and whether it ran in FP8 (logged when it changes).
    last_backend: Option<(AttentionBackend, bool)>,
    /// The FP8 scaling of q, k, v, dO and dS (TE `fp8_meta` of the module), used under a recipe
    /// with `fp8_dpa`.
    scaling: fp8::Fp8Scalings,
}

impl DotProductAttention {
    /// A module on `dev` (it has no parameters).
    ///
    /// # Errors
    /// [`Error::Config`] for zero heads or channels, `num_gqa_groups` not dividing
    /// `num_attention_heads`, `attention_dropout` outside `[0, 1]`, or a
    /// `softmax_scale` that is not finite and positive.
    pub fn new(dev: &Arc<Device>, cfg: DotProductAttentionConfig) -> Result<Self> {
        cfg.validate()?;
        let id = next_module_id();
        Ok(Self {
            dev: dev.clone(),
            cfg,
            id,
            masks: MaskCache::default(),
            dropout_seed: id,
            calls: 0,
            training: true,
            last_backend: None,
            scaling: fp8::Fp8Scalings::new(dev),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DotProductAttentionConfig {
        &self.cfg
    }

    /// Sets the attention dropout's random stream: the next forward that drops anything draws
    /// its mask from Philox key `seed` and counter offset `offset + 1`, the one after from
    /// `offset + 2`, and so on (both backends draw the same mask from the same stream). By
    /// default `seed` is the module's id and `offset` 0. The use of TE's RNG state tracker:
    /// replaying a forward (activation recomputation) or matching another module's masks.
    pub fn set_dropout_rng(&mut self, seed: u64, offset: u64) {
        self.dropout_seed = seed;
        self.calls = offset;
    }

    /// Training mode (the default: attention dropout applies) or evaluation mode (no dropout,
    /// the dropout stream does not advance); PyTorch's `module.train(mode)`.
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    /// Attention of `q` over `k`, `v`; returns the output and the context for
    /// [`DotProductAttention::backward`].
    ///
    /// - `q`: `[batch, sq, h, d]` (bshd) or `[sq, batch, h, d]` (sbhd), bf16, f16 or f32, with `h
    ///   = num_attention_heads`, `d = kv_channels`.
    /// - `k`: `[batch, sk, g, d]` / `[sk, batch, g, d]` of q's dtype, `g = num_gqa_groups`, `sk
    ///   >= 1` (at most 16384 on the unfused backend); `v`: the same with `head_dim_v` channels
    ///   (`d` by default).
    /// - `seq_lens`: for padding masks (required there, refused otherwise), the valid length of
    ///   each of the `batch` sequences, at most `max(sq, sk)`: keys `j >= seq_lens[b]` are masked
    ///   out and queries `i >= seq_lens[b]` give zeros. The fused backend reads them as
    ///   `cu_seqlens`; the unfused one builds a `[batch, sq, sk]` byte mask on the host, kept for
    ///   the next call with the same lengths and sizes.
    ///
    /// Output: `[batch, sq, h · dv]` (bshd) or `[sq, batch, h · dv]` (sbhd), q's dtype, `dv =
    /// head_dim_v`.
    ///
    /// # Errors
    /// - [`Error::DType`]: q not bf16/f16/f32, or k, v of another dtype than q.
    /// - [`Error::Shape`]: tensors not 4-D in the format, head counts or head_dim other than the
    ///   configuration's, k and v not of one batch and length, batch or lengths of zero, `sk` above 16384 on the
    ///   unfused backend, `seq_lens` of another length than the batch or with a length above
    ///   `max(sq, sk)`.
    /// - [`Error::Config`]: `seq_lens` missing for a padding mask or given for another;
    ///   [`AttentionBackend::Fused`] forced for a call it does not support (the message says why).
    /// - GEMM and kernel failures.
    pub fn forward(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seq_lens: Option<&[usize]>,
    ) -> Result<(Tensor, AttentionCtx)> {
        let (out, ctx) = self.forward_to(q, k, v, (seq_lens, None), None)?;
        Ok((high(out)?, ctx))
    }

    /// [`DotProductAttention::forward`] whose output an FP8 consumer may take in E4M3 (TE
    /// `fp8_mha`, see [`fp8::Fp8OutputRequest`]); without a request the output is 16-bit.
    pub(crate) fn forward_to(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seq_lens: (Option<&[usize]>, Option<&PaddingSeqlens>),
        out_fp8: Option<fp8::Fp8OutputRequest<'_>>,
    ) -> Result<(Output, AttentionCtx)> {
        let shape = self.problem(q, k, v)?;
        self.run_forward(shape, Inputs::Apart([q.clone(), k.clone(), v.clone()]), seq_lens, false, out_fp8)
    }

    /// The forward of the problem `shape` (the configuration's, for the inputs' sizes) on the
    /// backend [`backend::select`] picks, with the next dropout stream; packed inputs are split
    /// apart for the unfused backend. The output is E4M3 where `out_fp8` asks for it and the FP8
    /// forward can write it ([`fp8::Fp8OutputRequest::takes`]).
    fn run_forward(
        &mut self,
        shape: AttentionShape,
        inputs: Inputs,
        (seq_lens, padding): (Option<&[usize]>, Option<&PaddingSeqlens>),
        packed: bool,
        out_fp8: Option<fp8::Fp8OutputRequest<'_>>,
    ) -> Result<(Output, AttentionCtx)> {
        let dtype = inputs.dtype();
        let backend = backend::select(&self.cfg, dtype, self.dev.arch(), self.training)?;
        let drop = self.next_dropout();
        let shape = shape.with_dropout((drop.p > 0.0).then_some(drop));
        let fp8 = if backend == AttentionBackend::Fused {
            self.scaling.forward(&self.dev, &inputs, &shape, self.training, shape.dropout.is_some())?
        } else {
            None
        };
        self.log_backend(backend, fp8.is_some(), &shape, dtype);
        let out_shape = plan::out_shape(&shape)?;
        let (out, saved, inputs) = if backend == AttentionBackend::Fused {
            shape.check_seq_lens(MODULE, seq_lens)?;
            let seqs = match padding {
                Some(p) => Some(p.device_seqlens(&shape, seq_lens)?),
                None => seq_lens.map(|lens| fused::padding_seqlens(&self.dev, lens, &shape)).transpose()?,
            };
            let (out, saved) = fused::forward(
                &self.dev,
                &shape,
                seqs,
                inputs.fused(&shape)?,
                &out_shape,
                fp8.as_ref().map(|f| fused::Fp8Call {
                    quantizer: &*f.quantizer,
                    keep: f.backward.is_some(),
                    out: out_fp8.and_then(|r| r.takes(f)),
                }),
            )?;
            // The FP8 backward reads the codes the forward kept: q, k, v are not held.
            let inputs = if saved.has_fp8_backward() { Inputs::Released(dtype) } else { inputs };
            (out, Saved::Fused(Box::new(saved)), inputs)
        } else {
            if shape.sk > MAX_SK {
                return Err(Error::Shape {
                    op: MODULE,
                    message: format!(
                        "sk = {} keys exceed the unfused softmax kernel's limit of {MAX_SK} (TE's unfused limit too): \
                         shorten the key sequence, or use the fused backend (bf16/f16, head_dim in {:?})",
                        shape.sk,
                        te_codegen::spec::FLASH_HEAD_DIMS
                    ),
                });
            }
            let [q, k, v] = match inputs {
                Inputs::Apart(qkv) | Inputs::Thd(qkv) => qkv,
                Inputs::Packed(t) => packed::split(&self.dev, &t, &shape)?,
                Inputs::Released(_) => return Err(Error::internal(MODULE, "a forward of released inputs")),
            };
            let mask = self.masks.mask(&self.dev, &shape, seq_lens)?;
            let (out, probs, dropout) = unfused::forward(&self.dev, &shape, [&q, &k, &v], mask)?;
            (Output::High(out), Saved::Unfused { probs, dropout }, Inputs::Apart([q, k, v]))
        };
        let (fp8, fp8_backward) = match fp8 {
            Some(f) => (true, f.backward),
            None => (false, None),
        };
        let ctx = AttentionCtx { module_id: self.id, shape, inputs, packed, out_shape, saved, fp8, fp8_backward };
        Ok((out, ctx))
    }

    /// The attention dropout of the next forward: `p` in training (0 in evaluation), and a fresh
    /// Philox stream per call that drops anything (keyed by the module, counted by its calls).
    fn next_dropout(&mut self) -> DropoutParams {
        let p = if self.training { self.cfg.attention_dropout } else { 0.0 };
        self.calls += u64::from(p > 0.0);
        DropoutParams { p, seed: self.dropout_seed, offset: self.calls }
    }

    /// Logs the backend at debug level when it changes (TE's debug log).
    fn log_backend(&mut self, backend: AttentionBackend, fp8: bool, shape: &AttentionShape, dtype: DType) {
        if self.last_backend != Some((backend, fp8)) {
            tracing::debug!(
                "DotProductAttention: {} backend{} (d = {}, dv = {}, {}, {})",
                backend.name(),
                if fp8 { " in FP8 (E4M3 q, k, v)" } else { "" },
                shape.head_dim,
                shape.head_dim_v,
                dtype,
                self.cfg.attn_mask_type.name()
            );
            self.last_backend = Some((backend, fp8));
        }
    }

    /// The FP8 scaling state of q, k, v (`fp8_fwd`), once a forward with `fp8_dpa` under
    /// delayed scaling (or calibration) made it.
    pub fn fp8_forward_state(&self) -> Option<&Arc<ScalingState>> {
        self.scaling.states()[0].1
    }

    /// Backward of [`DotProductAttention::forward`]: `(dq, dk, dv)` in the shapes and dtype of
    /// q, k and v, for `d_out` the gradient of the output (its shape and dtype).
    ///
    /// # Errors
    /// [`Error::Context`] for a context made by another module; [`Error::Shape`] /
    /// [`Error::DType`] when `d_out` does not have the output's shape and dtype; GEMM and kernel
    /// failures.
    pub fn backward(&mut self, ctx: AttentionCtx, d_out: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let shape = ctx.shape;
        match self.run_backward(ctx, d_out)? {
            Qkv::Apart([dq, dk, dv]) => Ok((dq, dk, dv)),
            Qkv::Packed(d_qkv, _) => {
                let [dq, dk, dv] = packed::split(&self.dev, &d_qkv, &shape)?;
                Ok((dq, dk, dv))
            }
        }
    }

    /// The gradients of the context's inputs, in their arrangement.
    fn run_backward(&mut self, ctx: AttentionCtx, d_out: &Tensor) -> Result<Qkv<Tensor>> {
        if ctx.module_id != self.id {
            return Err(Error::Context {
                module: MODULE,
                message: "the context was made by another DotProductAttention's forward".into(),
            });
        }
        let dtype = ctx.inputs.dtype();
        check_dtype(MODULE, "d_out", d_out, |d| d == dtype, &format!("{dtype} (the dtype of the forward's q)"))?;
        check_shape(MODULE, "d_out", d_out, &ctx.out_shape)?;
        let shape = &ctx.shape;
        match &ctx.saved {
            Saved::Fused(saved) => {
                let Some(b) = ctx.fp8_backward else {
                    let qkv = ctx.inputs.fused(shape)?;
                    return fused::backward(&self.dev, shape, qkv, saved, d_out);
                };
                if !saved.has_fp8_backward() {
                    return Err(Error::internal(MODULE, "an FP8 backward planned without the forward's codes"));
                }
                let (d_o, ds) = self.scaling.backward(&b)?;
                let grads = fused::backward_fp8(&self.dev, shape, saved, d_out, (&*d_o, &*ds))?;
                b.finish()?;
                Ok(grads)
            }
            Saved::Unfused { probs, dropout } => match ctx.inputs.fused(shape)? {
                Qkv::Apart(qkv) => {
                    let (dq, dk, dv) = unfused::backward(&self.dev, shape, qkv, probs, dropout.as_ref(), d_out)?;
                    Ok(Qkv::Apart([dq, dk, dv]))
                }
                Qkv::Packed(..) => {
                    Err(Error::internal(MODULE, "the unfused backend saved the fused QKV tensor instead of q, k, v"))
                }
            },
        }
    }

    /// Checks q, k, v against the configuration and each other; the problem they pose.
    fn problem(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<AttentionShape> {
        check_dtype(MODULE, "q", q, DType::is_high_precision, "f32, bf16 or f16")?;
        let same = format!("{} (the dtype of `q`)", q.dtype());
        check_dtype(MODULE, "k", k, |d| d == q.dtype(), &same)?;
        check_dtype(MODULE, "v", v, |d| d == q.dtype(), &same)?;
        let format = self.cfg.qkv_format;
        let (h, g, d) = (self.cfg.num_attention_heads, self.cfg.groups(), self.cfg.kv_channels);
        let shape_error = |message: String| Err(Error::Shape { op: MODULE, message });
        let four_d = |arg: &str, t: &Tensor| -> Result<[usize; 4]> {
            t.shape().try_into().map_err(|_| Error::Shape {
                op: MODULE,
                message: format!("`{arg}` must be 4-D {}, got {:?}", format.describe(), t.shape()),
            })
        };
        let q_shape = four_d("q", q)?;
        let (batch, sq) = format.batch_seq(q_shape);
        if q_shape != format.shape(batch, sq, h, d) {
            return shape_error(format!(
                "`q` {q_shape:?} must hold num_attention_heads = {h} heads of kv_channels = {d} in {}",
                format.describe()
            ));
        }
        let k_shape = four_d("k", k)?;
        let sk = format.batch_seq(k_shape).1;
        let want = format.shape(batch, sk, g, d);
        if k_shape != want {
            return shape_error(format!(
                "`k` must be {want:?}: q's batch of {batch}, num_gqa_groups = {g} heads of kv_channels = {d} in {}, \
                 got {k_shape:?}",
                format.describe()
            ));
        }
        let dv = self.cfg.kv_channels_v();
        let want = format.shape(batch, sk, g, dv);
        if v.shape() != want {
            return shape_error(format!(
                "`v` must be {want:?}: k's batch and length, num_gqa_groups = {g} heads of head_dim_v = {dv} in {}, \
                 got {:?}",
                format.describe(),
                v.shape()
            ));
        }
        let shape = self.cfg.shape(batch, (sq, sk));
        shape.validate(MODULE)?;
        Ok(shape)
    }
}

impl Module for DotProductAttention {
    /// No parameters; the FP8 scaling states once made: q, k, v as `prefix.fp8_fwd`, dO as
    /// `prefix.fp8_bwd`, dS as `prefix.fp8_dp`.
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_states(prefix, &self.scaling.states(), |path, s| visitor.fp8_state(path, s))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_slots(prefix, self.scaling.state_slots(), visitor)
    }

    /// [`DotProductAttentionConfig::kernel_specs`] of its config.
    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.cfg.kernel_specs(target, specs);
    }
}
