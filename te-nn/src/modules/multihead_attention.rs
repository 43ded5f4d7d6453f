//! `MultiheadAttention` (TE `pytorch/attention/multi_head_attention.py`): fused QKV projection
//! (behind the input norm when `input_layernorm`), the q/k norms (`qk_norm_type`) and rotary
//! embedding of q and k, dot-product attention, output projection.
//!
//! The QKV weight is `[(h + 2g) · d, hidden]` with rows `[q heads | k heads | v heads]`. Without
//! RoPE or q/k norms its output goes to `DotProductAttention::forward_packed` as it is (the fused
//! backend reads the heads in place and writes one fused gradient); with either, q, k and v are
//! copied apart (the norms and RoPE write new q and k) and their gradients concatenated back.
//!
//! Under a recipe with `fp8_mha` (TE's FP8 MHA) the attention hands its output to the output
//! projection as E4M3 codes cast with the projection's input scale (see
//! [`super::attention`]); the QKV projection's output stays 16-bit, because the FP8 attention's
//! `_quantize` writes Vᵀ in its kernel's key order, which a GEMM epilogue cannot.

use super::attention::{
    AttentionCtx, AttnMaskType, CpAttentionCtx, DotProductAttention, Fp8OutputRequest, PaddingSeqlens, QkvFormat,
    ThdSeqlens,
};
use super::inference::KvLayer;
use super::layernorm_linear::{LayerNormLinear, LayerNormLinearCtx};
use super::linear::{Linear, LinearCtx, LinearInput};
use super::visit::{join_path, Module, ModuleVisitor, ModuleVisitorMut};
use super::{next_module_id, ForwardOptions, LinearParams, NormParams, Output};
use super::{KernelSpec, KernelTarget};
use crate::fp8::{fp8_mode, Fp8Mode};
use crate::parallel::ContextParallel;
use qk::{QkCtx, QkNorm, QkPrep};
use std::sync::Arc;
use te_codegen::spec::GemvEpilogue;
use te_codegen::DType;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::decode_attention::Strided;
use te_runtime::ops::gemv::{gemv, max_rows, GemvInput, DECODE_MAX_ROWS};
use te_runtime::{Device, Error, Result, Tensor};

mod config;
mod context_parallel;
mod qk;

pub use config::MultiheadAttentionConfig;
pub(crate) use config::QkvProjConfig;

const MODULE: &str = "MultiheadAttention";

/// Per-call inputs beyond the hidden states.
#[derive(Debug, Clone, Copy, Default)]
pub struct AttentionInputs<'a> {
    /// Valid length of each sequence, for padding masks.
    pub seq_lens: Option<&'a [usize]>,
    /// Rotary angles, f32 `[s, d2]` (or `[s, 1, 1, d2]`), applied to q and k (TE
    /// `rotary_pos_emb`); `None` for none. With `thd`, each token's angles `[tokens, d2]`
    /// (positions restarting at each document).
    pub rotary_pos_emb: Option<&'a Tensor>,
    /// Packed documents (TE's `qkv_format = "thd"`, `cu_seqlens_q` / `cu_seqlens_kv`): the
    /// hidden states are `[tokens, 1, hidden]` (sbhd with one column), the documents one after
    /// another as the tables say, and each token attends within its document only (the fused
    /// backend). `None`: every column is one sequence.
    pub thd: Option<ThdSeqlens<'a>>,
    /// Gradient accumulation: passed to every projection (and, in a `TransformerLayer`, to the
    /// MLP) as [`ForwardOptions::is_first_microbatch`] — `Some(true)` casts the FP8 weights and
    /// caches them, `Some(false)` reuses the cache (TE's `is_first_microbatch`).
    pub is_first_microbatch: Option<bool>,
    /// The device tables of `seq_lens` made before ([`PaddingSeqlens`], the same lengths):
    /// the fused attention reads them instead of uploading its own, so the forward makes no
    /// host upload (a CUDA graph of it replays with the tables refilled). `None`: uploaded per
    /// call.
    pub padding: Option<&'a PaddingSeqlens>,
}

#[derive(Debug)]
enum QkvProj {
    Norm(Box<LayerNormLinear>),
    Plain(Box<Linear>),
}

#[derive(Debug)]
enum QkvCtx {
    Norm(LayerNormLinearCtx),
    Plain(LinearCtx),
}

/// What [`MultiheadAttention::forward`] saves for backward.
#[derive(Debug)]
pub struct MultiheadAttentionCtx {
    module_id: u64,
    qkv: QkvCtx,
    attn: AttnCtx,
    proj: LinearCtx,
    /// q and k's norms and RoPE (`None`: the attention ran on the packed projection).
    qk: Option<QkCtx>,
    /// The tokens of a `thd` call (the attention's gradient is `[tokens, h·d]`).
    thd: Option<usize>,
}

impl MultiheadAttentionCtx {
    /// The attention's context (its backend and FP8 flags); with context parallelism, that of
    /// the rank's first query chunk under the all-gather, `None` under the ring (which runs the
    /// fused kernels a step at a time, [`CpAttentionCtx::calls`]).
    pub fn attention(&self) -> Option<&AttentionCtx> {
        match &self.attn {
            AttnCtx::Local(c) => Some(c),
            AttnCtx::Cp(c) => c.calls().map(|calls| &calls[0]),
        }
    }
}

/// The dot-product attention's context: one call, or the context-parallel pair.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one a layer and step; the common variant stays unboxed
enum AttnCtx {
    Local(AttentionCtx),
    Cp(Box<CpAttentionCtx>),
}

/// The attention's context and, where q and k were copied apart, their norms' and RoPE's.
type AttendCtx = (AttnCtx, Option<QkCtx>);

/// Self-attention over hidden states `[s, b, hidden]` (or `[b, s, hidden]`), output of the same
/// shape and dtype.
#[derive(Debug)]
pub struct MultiheadAttention {
    dev: Arc<Device>,
    id: u64,
    cfg: MultiheadAttentionConfig,
    qkv: QkvProj,
    attention: DotProductAttention,
    qk_norm: Option<QkNorm>,
    proj: Linear,
    /// The context-parallel group the sequence is split over
    /// ([`MultiheadAttention::set_context_parallel`]).
    cp: Option<ContextParallel>,
}

impl MultiheadAttention {
    /// A block initialized as TE does.
    ///
    /// # Errors
    /// [`Error::Config`] when the heads do not divide the hidden size (without `kv_channels`) or
    /// the groups do not divide the heads, and the errors of the projections and attention.
    pub fn new(dev: &Arc<Device>, cfg: MultiheadAttentionConfig) -> Result<Self> {
        let parts = cfg.parts()?;
        let split = Some(parts.qkv_split);
        let qkv = match parts.qkv {
            QkvProjConfig::Norm(c) => QkvProj::Norm(Box::new(LayerNormLinear::with_split(dev, c, split)?)),
            QkvProjConfig::Plain(c) => QkvProj::Plain(Box::new(Linear::with_split(dev, c, split)?)),
        };
        let attention = DotProductAttention::new(dev, parts.attention)?;
        let qk_norm = match parts.qk_norm {
            Some((kind, c)) => Some(QkNorm::new(dev, kind, c, cfg.qk_norm_before_rope)?),
            None => None,
        };
        let proj = Linear::new(dev, parts.proj)?;
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, qkv, attention, qk_norm, proj, cp: None })
    }

    /// The configuration.
    pub fn config(&self) -> &MultiheadAttentionConfig {
        &self.cfg
    }

    /// Training mode (the default) or evaluation mode (no attention dropout); see
    /// [`DotProductAttention::set_training`].
    pub fn set_training(&mut self, training: bool) {
        self.attention.set_training(training);
    }

    /// The QKV projection's weight `[(h + 2g)·d, hidden]` and bias.
    pub fn qkv_params(&self) -> &LinearParams {
        match &self.qkv {
            QkvProj::Norm(m) => m.params(),
            QkvProj::Plain(m) => m.params(),
        }
    }

    /// The QKV projection's parameters, mutably.
    pub fn qkv_params_mut(&mut self) -> &mut LinearParams {
        match &mut self.qkv {
            QkvProj::Norm(m) => m.params_mut(),
            QkvProj::Plain(m) => m.params_mut(),
        }
    }

    /// The input norm's parameters (with `input_layernorm`).
    pub fn norm_params(&self) -> Option<&NormParams> {
        match &self.qkv {
            QkvProj::Norm(m) => Some(m.norm_params()),
            QkvProj::Plain(_) => None,
        }
    }

    /// The input norm's parameters, mutably.
    pub fn norm_params_mut(&mut self) -> Option<&mut NormParams> {
        match &mut self.qkv {
            QkvProj::Norm(m) => Some(m.norm_params_mut()),
            QkvProj::Plain(_) => None,
        }
    }

    /// The output projection `[hidden, h·d]`.
    pub fn proj_params(&self) -> &LinearParams {
        self.proj.params()
    }

    /// The output projection, mutably.
    pub fn proj_params_mut(&mut self) -> &mut LinearParams {
        self.proj.params_mut()
    }

    /// The first dim of the attention's input: `x`'s, times the tensor-parallel size when `x`
    /// is this rank's token shard (the QKV projection gathers the shards).
    fn whole_first_dim(&self, a: usize) -> usize {
        let qkv = match &self.qkv {
            QkvProj::Norm(m) => m.gemm_parallel(),
            QkvProj::Plain(m) => m.gemm_parallel(),
        };
        qkv.input_tokens(a)
    }

    /// Self-attention of `x` with no padding and no rotary embedding.
    ///
    /// # Errors
    /// As [`MultiheadAttention::forward_with`].
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, MultiheadAttentionCtx)> {
        self.forward_with(x, AttentionInputs::default())
    }

    /// Self-attention of `x: [s, b, hidden]` (sbhd) or `[b, s, hidden]` (bshd).
    ///
    /// # Errors
    /// [`Error::Shape`] when `x` is not 3-D with last dim `hidden_size`; the errors of the
    /// projections (FP8 dims), of the attention (mask and `seq_lens`) and of RoPE (`freqs`).
    pub fn forward_with(&mut self, x: &Tensor, inputs: AttentionInputs<'_>) -> Result<(Tensor, MultiheadAttentionCtx)> {
        let &[a, b, _] = x.shape() else {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("hidden states must be 3-D [s, b, hidden] or [b, s, hidden], got {:?}", x.shape()),
            });
        };
        let opts = ForwardOptions { is_first_microbatch: inputs.is_first_microbatch, fp8_output: false };
        let (qkv, qkv_ctx) = match &mut self.qkv {
            QkvProj::Norm(m) => {
                let (y, c) = m.forward_with(x, opts)?;
                (y.out.into_high(&self.dev, x.dtype())?, QkvCtx::Norm(c))
            }
            QkvProj::Plain(m) => {
                let (y, c) = m.forward_with(x, opts)?;
                (y.into_high(&self.dev, x.dtype())?, QkvCtx::Plain(c))
            }
        };
        let a = self.whole_first_dim(a);
        self.check_thd(&inputs, b)?;
        let (y, proj, (attn, qk)) = self.attend_project(&qkv, [a, b], &inputs, opts, true)?;
        let proj = proj.ok_or_else(|| Error::internal(MODULE, "a training forward of the projection saved nothing"))?;
        let y = y.into_high(&self.dev, x.dtype())?;
        let thd = inputs.thd.map(|_| a);
        let ctx = MultiheadAttentionCtx { module_id: self.id, qkv: qkv_ctx, attn, proj, qk, thd };
        Ok((y, ctx))
    }

    /// Attention over the QKV projection's output (`[a·b, (h + 2g)·d]` or `[a, b, ..]`), then the
    /// output projection: the projection's output, its context (with `grad`) and the attention's.
    /// Attention runs in place on the fused QKV tensor without RoPE, on q, k, v copied apart (and
    /// rotated) with it. Under a recipe with `fp8_mha` the projection's input quantizer is handed
    /// to the attention, whose FP8 forward writes its output as E4M3 codes the projection's GEMM
    /// reads (TE's FP8 MHA; the attention falls back to a 16-bit output where it cannot).
    fn attend_project(
        &mut self,
        qkv: &Tensor,
        [a, b]: [usize; 2],
        inputs: &AttentionInputs<'_>,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Output, Option<LinearCtx>, AttendCtx)> {
        let qkv = qkv.reshape(&[a, b, qkv.numel() / (a * b).max(1)])?;
        let mha = matches!(fp8_mode(), Fp8Mode::Fp8(r) if r.fp8_mha());
        let (dev, format, attention) = (&*self.dev, self.cfg.rope_format(), &mut self.attention);
        let qk_norm = self.qk_norm.as_mut();
        let cp = self.cp.as_ref();
        context_parallel::check_inputs(cp, inputs)?;
        self.proj.forward_produced(qkv.dtype(), opts, grad, |quantizer| {
            let request = quantizer.filter(|_| mha).map(|quantizer| Fp8OutputRequest { quantizer, backward: grad });
            let (out, ctx, qk) = match (inputs.rotary_pos_emb, qk_norm, inputs.thd, cp) {
                (None, None, None, None) => {
                    let (out, ctx) = attention.forward_packed_to(&qkv, (inputs.seq_lens, inputs.padding), request)?;
                    (out, AttnCtx::Local(ctx), None)
                }
                (freqs, norm, thd, cp) => {
                    let [q, k, v] = attention.split_packed(&qkv)?;
                    let ([q, k], qk) = QkPrep { dev, norm, format }.forward([q, k], freqs)?;
                    let (out, ctx) = match (thd, cp) {
                        // Checked above: no thd with context parallelism.
                        (_, Some(cp)) => {
                            let (out, ctx) = attention.forward_context_parallel(cp, &q, &k, &v)?;
                            (Output::High(out), AttnCtx::Cp(Box::new(ctx)))
                        }
                        (None, None) => {
                            let (out, ctx) =
                                attention.forward_to(&q, &k, &v, (inputs.seq_lens, inputs.padding), request)?;
                            (out, AttnCtx::Local(ctx))
                        }
                        (Some(seqs), None) => {
                            // [tokens, 1, heads, d] → [tokens, heads, d]; the output back to
                            // [tokens, 1, heads · d].
                            let rows = |t: &Tensor| t.reshape(&[a, t.shape()[2], t.shape()[3]]);
                            let (out, ctx) = attention.forward_thd(&rows(&q)?, &rows(&k)?, &rows(&v)?, seqs)?;
                            let width = out.shape()[1];
                            (Output::High(out.reshape(&[a, 1, width])?), AttnCtx::Local(ctx))
                        }
                    };
                    (out, ctx, Some(qk))
                }
            };
            let input = match out {
                Output::High(t) => LinearInput::High(t),
                Output::Fp8(mut f) => {
                    if grad {
                        f.ensure_transpose(dev)?;
                    }
                    LinearInput::Fp8(f)
                }
            };
            Ok((input, (ctx, qk)))
        })
    }

    /// A `thd` call takes sbhd hidden states of one column and no padding lengths.
    fn check_thd(&self, inputs: &AttentionInputs<'_>, b: usize) -> Result<()> {
        if inputs.thd.is_some() && (b != 1 || self.cfg.qkv_format != QkvFormat::Sbhd || inputs.seq_lens.is_some()) {
            return Err(Error::Shape {
                op: MODULE,
                message: format!(
                    "packed documents (thd) take sbhd hidden states [tokens, 1, hidden] and no seq_lens, got {} \
                     columns in {:?}{}",
                    b,
                    self.cfg.qkv_format,
                    if inputs.seq_lens.is_some() { " with seq_lens" } else { "" }
                ),
            });
        }
        Ok(())
    }

    /// Self-attention for inference (TE under `torch.no_grad()`): the projections run through
    /// their `infer` paths (no transposes, FP8-only weights allowed), nothing is kept for
    /// backward. Same shapes as [`MultiheadAttention::forward_with`].
    ///
    /// # Errors
    /// As [`MultiheadAttention::forward_with`].
    pub fn infer_with(&mut self, x: &Tensor, inputs: AttentionInputs<'_>) -> Result<Tensor> {
        let &[a, b, _] = x.shape() else {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("hidden states must be 3-D [s, b, hidden] or [b, s, hidden], got {:?}", x.shape()),
            });
        };
        let qkv = match &mut self.qkv {
            QkvProj::Norm(m) => m.infer(x)?,
            QkvProj::Plain(m) => m.infer(x)?,
        };
        let a = self.whole_first_dim(a);
        self.check_thd(&inputs, b)?;
        let (y, _, _) = self.attend_project(&qkv, [a, b], &inputs, ForwardOptions::default(), false)?;
        y.into_high(&self.dev, x.dtype())
    }

    /// Self-attention of `s` new tokens per sequence over a KV cache, for generation (TE's
    /// `forward(..., inference_params=...)`): `x` `[s, b, hidden]` (sbhd) of the tokens at
    /// positions `kv.past..kv.past + s`. Their keys and values are appended to `kv`; the first
    /// step of a cache (`past = 0`, the prompt) runs the normal causal attention over them, each
    /// later step (one token per sequence) the decode kernels over the cache. Nothing is kept
    /// for backward; the projections run their `infer` paths. Output `[s, b, hidden]`.
    ///
    /// # Errors
    /// [`Error::Config`] for a module the cache does not serve (bshd hidden states, a mask other
    /// than causal or a sliding window, a separate `head_dim_v`, tensor parallelism); [`Error::Shape`] for `x` not `[s,
    /// b, hidden]` with `s` the step's tokens and `b` the cache's batch, or `s > 1` after the
    /// prompt (chunked prefill is not supported); the errors of the parts.
    pub fn infer_cached(&mut self, x: &Tensor, mut kv: KvLayer<'_>) -> Result<Tensor> {
        let (p, s, [h, g, d]) = self.check_cached(x, &kv)?;
        let b = p.batch;
        let qkv = match &mut self.qkv {
            QkvProj::Norm(m) => m.infer(x)?,
            QkvProj::Plain(m) => m.infer(x)?,
        };
        let row = (h + 2 * g) * d;
        let new = |offset| Strided { tensor: &qkv, offset, row };
        kv.append(&self.dev, &p, s, [new(h * d), new((h + g) * d)])?;
        let ctx_out = if kv.past == 0 {
            self.attention.forward_packed(&qkv.reshape(&[s, b, row])?, None)?.0
        } else {
            let mut out = Tensor::empty(&self.dev, qkv.dtype(), &[s, b, h * d])?;
            kv.attend(&self.dev, &p, new(0), (&mut out, h * d))?;
            out
        };
        self.proj.infer(&ctx_out)
    }

    /// The checks of [`MultiheadAttention::infer_cached`]: the decode problem, the step's tokens
    /// per sequence and `[heads, groups, head_dim]`.
    fn check_cached(&self, x: &Tensor, kv: &KvLayer<'_>) -> Result<(AttentionShape, usize, [usize; 3])> {
        let a = self.attention.config();
        let causal = matches!(a.attn_mask_type, AttnMaskType::Causal | AttnMaskType::CausalBottomRight);
        if self.cfg.qkv_format != QkvFormat::Sbhd
            || !causal
            || a.window_size.is_some()
            || a.head_dim_v.is_some()
            || self.qk_norm.is_some()
        {
            return Err(Error::Config {
                module: MODULE,
                message: "a KV cache serves sbhd hidden states with a causal mask, no sliding window, no q/k norms \
                          and one head dim for q, k and v (te_models::decoder runs the decoder family's cache)"
                    .into(),
            });
        }
        if self.cfg.tp.is_some() {
            return Err(Error::Config {
                module: MODULE,
                message: "generation with a KV cache under tensor parallelism is not supported yet: make the \
                          model for generation without tp"
                    .into(),
            });
        }
        let (h, g, d) = (a.num_attention_heads, a.groups(), a.kv_channels);
        let p = kv.params(h, a.scale());
        let shape = |message: String| Err(Error::Shape { op: MODULE, message });
        let &[s, b, _] = x.shape() else {
            return shape(format!("hidden states must be [s, b, hidden], got {:?}", x.shape()));
        };
        if s != kv.new || b != p.batch || g != p.groups || d != p.head_dim {
            return shape(format!(
                "hidden states {:?} with {g} groups of {d} channels do not fit the step of {} tokens of a cache \
                 {:?}",
                x.shape(),
                kv.new,
                kv.shape
            ));
        }
        if kv.past > 0 && s != 1 {
            return shape(format!(
                "{s} new tokens per sequence after {} cached: steps after the prompt take one token",
                kv.past
            ));
        }
        Ok((p, s, [h, g, d]))
    }

    /// Whether [`MultiheadAttention::decode_gemv`] serves the step of `x` over `kv`: one new
    /// token for each of at most two sequences after the prompt, a pre-norm QKV projection
    /// (`input_layernorm`), BF16 (or per-tensor FP8-only) weights, no FP8 autocast, widths the
    /// decode GEMV takes (`ops::gemv::max_rows`).
    pub(crate) fn decode_gemv_ok(&self, x: &Tensor, kv: &KvLayer<'_>) -> bool {
        let Ok((p, s, [h, _, d])) = self.check_cached(x, kv) else { return false };
        let QkvProj::Norm(ln) = &self.qkv else { return false };
        let rows = p.batch;
        let fits = |k: usize| k % 16 == 0 && rows <= max_rows(k);
        kv.past > 0
            && s == 1
            && rows <= DECODE_MAX_ROWS
            && fp8_mode() == Fp8Mode::HighPrecision
            && x.dtype() == DType::BF16
            && fits(self.cfg.hidden_size)
            && fits(h * d)
            && ln.norm_params().gemv_norm().is_some()
            && ln.params().gemv_matrix().is_some()
            && self.proj.params().gemv_matrix().is_some()
    }

    /// The attention of a decode step [`MultiheadAttention::decode_gemv_ok`] accepts, through the
    /// fused GEMVs: the pre-norm + QKV (+ bias) in one launch, the cache append and the decode
    /// kernels, the projection (+ bias) in one launch. Returns the output `[1, b, hidden]` before
    /// the residual add, as [`MultiheadAttention::infer_cached`] returns it.
    ///
    /// # Errors
    /// As [`MultiheadAttention::infer_cached`]; [`Error::Internal`] for a module it does not serve.
    pub(crate) fn decode_gemv(&mut self, x: &Tensor, mut kv: KvLayer<'_>) -> Result<Tensor> {
        let (p, s, [h, g, d]) = self.check_cached(x, &kv)?;
        let not_served = || Error::internal(MODULE, "decode_gemv on a module decode_gemv_ok refuses");
        let QkvProj::Norm(ln) = &self.qkv else { return Err(not_served()) };
        let (kind, norm) = ln.norm_params().gemv_norm().ok_or_else(not_served)?;
        let qkv_w = ln.params().gemv_matrix().ok_or_else(not_served)?;
        let proj_w = self.proj.params().gemv_matrix().ok_or_else(not_served)?;
        let (b, hidden) = (p.batch, self.cfg.hidden_size);
        let row = (h + 2 * g) * d;
        let x2 = x.reshape(&[b, hidden])?;
        let mut qkv = Tensor::empty(&self.dev, DType::BF16, &[b, row])?;
        gemv(&self.dev, GemvInput::Norm { x: &x2, kind, norm }, qkv_w, GemvEpilogue::Store, &mut qkv)?;
        let new = |offset| Strided { tensor: &qkv, offset, row };
        kv.append(&self.dev, &p, s, [new(h * d), new((h + g) * d)])?;
        let mut ctx_out = Tensor::empty(&self.dev, DType::BF16, &[b, h * d])?;
        kv.attend(&self.dev, &p, new(0), (&mut ctx_out, h * d))?;
        let mut out = Tensor::empty(&self.dev, DType::BF16, &[b, hidden])?;
        gemv(&self.dev, GemvInput::Plain(&ctx_out), proj_w, GemvEpilogue::Store, &mut out)?;
        out.reshape(&[1, b, hidden])
    }

    /// Backward: `dx` for `d_out`; every parameter gradient accumulates.
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; the errors of the parts.
    pub fn backward(&mut self, ctx: MultiheadAttentionCtx, d_out: &Tensor) -> Result<Tensor> {
        if ctx.module_id != self.id {
            return Err(Error::Context { module: MODULE, message: "the context was made by another module".into() });
        }
        let d_ctx = self.proj.backward(ctx.proj, d_out)?;
        let d_qkv = match (ctx.qk, ctx.attn) {
            (None, AttnCtx::Local(attn)) => self.attention.backward_packed(attn, &d_ctx)?,
            (None, AttnCtx::Cp(_)) => {
                return Err(Error::internal(MODULE, "a context-parallel attention without q and k apart"))
            }
            (Some(qk), attn) => {
                let (dq, dk, dv) = match (ctx.thd, attn) {
                    (_, AttnCtx::Cp(attn)) => self.backward_context_parallel(*attn, &d_ctx)?,
                    (None, AttnCtx::Local(attn)) => self.attention.backward(attn, &d_ctx)?,
                    (Some(tokens), AttnCtx::Local(attn)) => {
                        // [tokens, 1, h · d] ↔ the thd call's [tokens, h · d]; its [tokens, heads,
                        // d] gradients back to [tokens, 1, heads, d].
                        let d_ctx = d_ctx.reshape(&[tokens, d_ctx.numel() / tokens.max(1)])?;
                        let (dq, dk, dv) = self.attention.backward(attn, &d_ctx)?;
                        let col = |t: Tensor| t.reshape(&[tokens, 1, t.shape()[1], t.shape()[2]]);
                        (col(dq)?, col(dk)?, col(dv)?)
                    }
                };
                let prep = QkPrep { dev: &self.dev, norm: self.qk_norm.as_mut(), format: self.cfg.rope_format() };
                let [dq, dk] = prep.backward(qk, [dq, dk])?;
                self.attention.concat_packed([&dq, &dk, &dv])?
            }
        };
        match (&mut self.qkv, ctx.qkv) {
            (QkvProj::Norm(m), QkvCtx::Norm(c)) => m.backward(c, &d_qkv),
            (QkvProj::Plain(m), QkvCtx::Plain(c)) => m.backward(c, &d_qkv),
            _ => Err(Error::internal(MODULE, "a QKV context of the other projection kind")),
        }
    }
}

impl Module for MultiheadAttention {
    /// TE's names: `layernorm_qkv.*` (with `input_layernorm`) or `qkv.*`, Megatron's
    /// `q_layernorm.*`, `k_layernorm.*` (with `qk_norm_type`), then `proj.*`.
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        match &self.qkv {
            QkvProj::Norm(m) => m.visit(&join_path(prefix, "layernorm_qkv"), visitor)?,
            QkvProj::Plain(m) => m.visit(&join_path(prefix, "qkv"), visitor)?,
        }
        if let Some(n) = &self.qk_norm {
            n.visit(prefix, visitor)?;
        }
        self.attention.visit(&join_path(prefix, "core_attention"), visitor)?;
        self.proj.visit(&join_path(prefix, "proj"), visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        match &mut self.qkv {
            QkvProj::Norm(m) => m.visit_mut(&join_path(prefix, "layernorm_qkv"), visitor)?,
            QkvProj::Plain(m) => m.visit_mut(&join_path(prefix, "qkv"), visitor)?,
        }
        if let Some(n) = &mut self.qk_norm {
            n.visit_mut(prefix, visitor)?;
        }
        self.attention.visit_mut(&join_path(prefix, "core_attention"), visitor)?;
        self.proj.visit_mut(&join_path(prefix, "proj"), visitor)
    }

    /// [`MultiheadAttentionConfig::kernel_specs`] of its config.
    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.cfg.kernel_specs(target, specs);
    }
}
