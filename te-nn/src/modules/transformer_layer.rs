//! `TransformerLayer` (TE `pytorch/transformer.py`): self-attention and MLP, each followed by
//! dropout and a residual add (Megatron's fused `bias_dropout_add`).
//!
//! GPT-style pre-LN by default: `h = x + drop(attn(ln1(x)))`, `y = h + drop(mlp(ln2(h)))`, the
//! norms fused into the QKV projection and `LayerNormMLP`. BERT-style post-LN with
//! `output_layernorm` and `apply_residual_connection_post_layernorm` (as TE's BERT recipe):
//! `a = x + drop(attn(x))`, `h = ln2(a)`, `y = ln3(h + drop(mlp(h)))`.

use super::inference::KvLayer;
use super::layernorm_mlp::{LayerNormMLP, LayerNormMLPCtx};
use super::moe_mlp::{MoeMLP, MoeMLPCtx};
use super::multihead_attention::{AttentionInputs, MultiheadAttention, MultiheadAttentionCtx};
use super::norm::{Norm, NormCtx};
use super::visit::{join_path, Module, ModuleVisitor, ModuleVisitorMut};
use super::{next_module_id, BackwardOptions, ForwardOptions, KernelSpec, KernelTarget};
use crate::parallel::SequenceParallel;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::GemvEpilogue;
use te_codegen::DType;
use te_runtime::ops::dropout::{bias_dropout_add, dropout_backward, mask_bytes, DropoutParams};
use te_runtime::ops::elementwise::{add, add_assign};
use te_runtime::ops::gemv::{gemv, GemvInput};
use te_runtime::{Device, DeviceBuffer, Error, Result, Tensor};

const MODULE: &str = "TransformerLayer";

mod checkpointed;
mod config;
pub use checkpointed::TransformerLayerCheckpoint;
pub(crate) use config::MlpConfig;
pub use config::TransformerLayerConfig;

/// A layer's MLP block.
#[derive(Debug)]
enum Mlp {
    Dense(Box<LayerNormMLP>),
    Moe(Box<MoeMLP>),
}

/// What a layer's MLP saved for backward.
#[derive(Debug)]
enum MlpCtx {
    Dense(Box<LayerNormMLPCtx>),
    Moe(Box<MoeMLPCtx>),
}

/// What [`TransformerLayer::forward`] saves for backward.
#[derive(Debug)]
pub struct TransformerLayerCtx {
    module_id: u64,
    attn: MultiheadAttentionCtx,
    mask1: DeviceBuffer<u8>,
    mlp: MlpCtx,
    mask2: DeviceBuffer<u8>,
    out_norm: Option<NormCtx>,
    /// The hidden dropout probability the forward applied (0 in evaluation mode).
    p: f32,
}

impl TransformerLayerCtx {
    /// The MoE load-balancing loss of this forward (f32 `[1]` on the device, its coefficient
    /// included); `None` for a dense MLP.
    pub fn aux_loss(&self) -> Option<&CudaSlice<f32>> {
        match &self.mlp {
            MlpCtx::Moe(c) => Some(c.aux_loss()),
            MlpCtx::Dense(_) => None,
        }
    }

    /// The MoE aux loss's gradient the backward propagates ([`MoeMLPCtx::set_aux_loss_grad`];
    /// default 1); nothing for a dense MLP.
    pub fn set_aux_loss_grad(&mut self, grad: f32) {
        if let MlpCtx::Moe(c) = &mut self.mlp {
            c.set_aux_loss_grad(grad);
        }
    }

    /// The MoE block's context, `None` for a dense MLP.
    pub fn moe_ctx(&self) -> Option<&MoeMLPCtx> {
        match &self.mlp {
            MlpCtx::Moe(c) => Some(c),
            MlpCtx::Dense(_) => None,
        }
    }
}

/// One transformer block over hidden states `[s, b, hidden]` (or `[b, s, hidden]`).
#[derive(Debug)]
pub struct TransformerLayer {
    dev: Arc<Device>,
    id: u64,
    cfg: TransformerLayerConfig,
    attention: MultiheadAttention,
    mlp: Mlp,
    out_norm: Option<Norm>,
    /// The token shards of the residual stream (sequence parallelism; none without).
    sequence: SequenceParallel,
    /// Dropout stream counter: each training-mode call draws fresh masks.
    calls: u64,
    /// Training mode (dropout on), PyTorch's `module.training`.
    training: bool,
}

impl TransformerLayer {
    /// A layer initialized as TE does.
    ///
    /// # Errors
    /// [`Error::Config`] for heads that do not divide the hidden size, a dropout outside `[0, 1]`,
    /// `apply_residual_connection_post_layernorm` without `output_layernorm` or with `moe`, `moe`
    /// with `tp`; the errors of the parts.
    pub fn new(dev: &Arc<Device>, cfg: TransformerLayerConfig) -> Result<Self> {
        let config = |message: String| Error::Config { module: MODULE, message };
        if !(0.0..=1.0).contains(&cfg.hidden_dropout) {
            return Err(config(format!("hidden_dropout must be in [0, 1], got {}", cfg.hidden_dropout)));
        }
        if cfg.apply_residual_connection_post_layernorm && !cfg.output_layernorm {
            return Err(config(
                "apply_residual_connection_post_layernorm is supported with output_layernorm (BERT-style); for a \
                 pre-LN block leave it false"
                    .into(),
            ));
        }
        if cfg.apply_residual_connection_post_layernorm && cfg.moe.is_some() {
            return Err(config(
                "a MoE MLP does not return its norm's output: apply_residual_connection_post_layernorm is for dense \
                 layers"
                    .into(),
            ));
        }
        if cfg.moe.is_some() && cfg.tp.is_some() {
            return Err(config(
                "a MoE MLP under tensor parallelism is not supported yet: leave tp unset for MoE layers".into(),
            ));
        }
        let parts = cfg.parts();
        let attention = MultiheadAttention::new(dev, parts.attention)?;
        let mlp = match parts.mlp {
            MlpConfig::Dense(c) => Mlp::Dense(Box::new(LayerNormMLP::new(dev, c)?)),
            MlpConfig::Moe(c) => Mlp::Moe(Box::new(MoeMLP::new(dev, c)?)),
        };
        let sequence = SequenceParallel::of(cfg.tp.as_ref());
        let mut out_norm = parts.output_norm.map(|(kind, c)| Norm::new(dev, kind, c)).transpose()?;
        if let Some(norm) = out_norm.as_mut() {
            norm.set_sequence_parallel(sequence.clone());
        }
        Ok(Self {
            dev: dev.clone(),
            id: next_module_id(),
            cfg,
            attention,
            mlp,
            out_norm,
            sequence,
            calls: 0,
            training: true,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &TransformerLayerConfig {
        &self.cfg
    }

    /// Training mode (the default: hidden and attention dropout apply) or evaluation mode (no
    /// dropout, the dropout streams do not advance); PyTorch's `module.train(mode)`.
    pub fn set_training(&mut self, training: bool) {
        self.training = training;
        self.attention.set_training(training);
    }

    /// Whether the layer is in training mode ([`TransformerLayer::set_training`]).
    pub fn is_training(&self) -> bool {
        self.training
    }

    /// Hidden-dropout masks drawn so far: the Philox offset of the next forward (the layer's
    /// seed is `config().seed`). Saved with a training checkpoint, so a resumed run draws the
    /// masks it would have drawn.
    pub fn dropout_offset(&self) -> u64 {
        self.calls
    }

    /// Sets the offset [`TransformerLayer::dropout_offset`] reports (a resumed run).
    pub fn set_dropout_offset(&mut self, offset: u64) {
        self.calls = offset;
    }

    /// The self-attention block.
    pub fn self_attention(&self) -> &MultiheadAttention {
        &self.attention
    }

    /// The self-attention block, mutably.
    pub fn self_attention_mut(&mut self) -> &mut MultiheadAttention {
        &mut self.attention
    }

    /// The dense MLP block (with its norm); `None` for a MoE layer.
    pub fn layernorm_mlp(&self) -> Option<&LayerNormMLP> {
        match &self.mlp {
            Mlp::Dense(m) => Some(m),
            Mlp::Moe(_) => None,
        }
    }

    /// The dense MLP block, mutably; `None` for a MoE layer.
    pub fn layernorm_mlp_mut(&mut self) -> Option<&mut LayerNormMLP> {
        match &mut self.mlp {
            Mlp::Dense(m) => Some(m),
            Mlp::Moe(_) => None,
        }
    }

    /// The mixture-of-experts MLP block (config `moe`); `None` for a dense layer.
    pub fn moe_mlp(&self) -> Option<&MoeMLP> {
        match &self.mlp {
            Mlp::Moe(m) => Some(m),
            Mlp::Dense(_) => None,
        }
    }

    /// The MoE block, mutably.
    pub fn moe_mlp_mut(&mut self) -> Option<&mut MoeMLP> {
        match &mut self.mlp {
            Mlp::Moe(m) => Some(m),
            Mlp::Dense(_) => None,
        }
    }

    /// The output norm (post-LN).
    pub fn output_norm(&self) -> Option<&Norm> {
        self.out_norm.as_ref()
    }

    /// The output norm, mutably.
    pub fn output_norm_mut(&mut self) -> Option<&mut Norm> {
        self.out_norm.as_mut()
    }

    /// The hidden dropout probability of a forward in the current mode.
    fn hidden_dropout(&self) -> f32 {
        if self.training {
            self.cfg.hidden_dropout
        } else {
            0.0
        }
    }

    /// `out = residual + dropout(x)` with a fresh mask.
    fn residual_dropout(&mut self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, DeviceBuffer<u8>)> {
        let p = self.hidden_dropout();
        self.calls += u64::from(p > 0.0);
        // Under sequence parallelism each rank's masks are its own (its tokens differ); rank 0's,
        // and those of whole tokens, are the layer's seed's.
        let seed = self.cfg.seed.wrapping_add((self.sequence.rank() as u64) << 32);
        let params = DropoutParams { p, seed, offset: self.calls };
        let mut out = Tensor::empty(&self.dev, residual.dtype(), residual.shape())?;
        // SAFETY: u8 has no invalid bit patterns; the kernel writes every mask byte.
        let mut mask = unsafe { self.dev.stream().alloc::<u8>(mask_bytes(x.numel()).max(1)) }?;
        bias_dropout_add(&self.dev, x, None, residual, params, &mut out, &mut mask)?;
        Ok((out, DeviceBuffer::new(mask)))
    }

    /// The layer on `x` with no padding and no rotary embedding.
    ///
    /// # Errors
    /// As [`TransformerLayer::forward_with`].
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, TransformerLayerCtx)> {
        self.forward_with(x, AttentionInputs::default())
    }

    /// The layer on `x: [s, b, hidden]` (or `[b, s, hidden]`) with padding lengths and rotary
    /// angles for the attention.
    ///
    /// # Errors
    /// The errors of the parts (shapes, FP8 dims, masks).
    pub fn forward_with(&mut self, x: &Tensor, inputs: AttentionInputs<'_>) -> Result<(Tensor, TransformerLayerCtx)> {
        let opts = ForwardOptions { is_first_microbatch: inputs.is_first_microbatch, fp8_output: false };
        let (a, attn) = self.attention.forward_with(x, inputs)?;
        let (h1, mask1) = self.residual_dropout(&a, x)?;
        // The MLP returns its norm's output exactly when the residual is taken after it (post-LN).
        let (m_out, ln_out, mlp) = match &mut self.mlp {
            Mlp::Dense(d) => {
                let (m, c) = d.forward_with(&h1, opts)?;
                (m.out.into_high(&self.dev, x.dtype())?, m.ln_out, MlpCtx::Dense(Box::new(c)))
            }
            Mlp::Moe(moe) => {
                let (y, c) = moe.forward_with(&h1, opts)?;
                (y, None, MlpCtx::Moe(Box::new(c)))
            }
        };
        let (y, mask2) = self.residual_dropout(&m_out, ln_out.as_ref().unwrap_or(&h1))?;
        let (y, out_norm) = match &mut self.out_norm {
            Some(n) => {
                let (y, c) = n.forward(&y)?;
                (y, Some(c))
            }
            None => (y, None),
        };
        let p = self.hidden_dropout();
        Ok((y, TransformerLayerCtx { module_id: self.id, attn, mask1, mlp, mask2, out_norm, p }))
    }

    /// The layer for inference (TE under `torch.no_grad()`, dropout off): every GEMM through its
    /// `infer` path (no transposes, FP8-only weights from `fp8_model_init` allowed), residual
    /// adds without dropout, nothing kept for backward. `x: [s, b, hidden]` (or `[b, s,
    /// hidden]`), output of the same shape and dtype.
    ///
    /// # Errors
    /// The errors of the parts (shapes, FP8 dims, masks).
    pub fn infer_with(&mut self, x: &Tensor, inputs: AttentionInputs<'_>) -> Result<Tensor> {
        let a = self.attention.infer_with(x, inputs)?;
        self.finish_infer(x, &a)
    }

    /// The layer for generation over a KV cache (TE's `inference_params`): as
    /// [`TransformerLayer::infer_with`], the attention through
    /// [`super::MultiheadAttention::infer_cached`] (`x`: `[s, b, hidden]`, the step's new tokens).
    ///
    /// # Errors
    /// The errors of the parts (the cache's, shapes, FP8 dims).
    pub fn infer_cached(&mut self, x: &Tensor, kv: KvLayer<'_>) -> Result<Tensor> {
        if self.decode_gemv_ok(x, &kv) {
            return self.decode_gemv(x, kv);
        }
        let a = self.attention.infer_cached(x, kv)?;
        self.finish_infer(x, &a)
    }

    /// Whether a decode step of `x` over `kv` runs through the fused GEMVs
    /// ([`TransformerLayer::decode_gemv`]): the attention takes it
    /// (`MultiheadAttention::decode_gemv_ok`: one token for each of at most two sequences, BF16
    /// or per-tensor FP8-only weights, no FP8 autocast) and the layer is pre-norm with a dense
    /// MLP and no output norm.
    fn decode_gemv_ok(&self, x: &Tensor, kv: &KvLayer<'_>) -> bool {
        let Mlp::Dense(mlp) = &self.mlp else { return false };
        let c = mlp.config();
        let rows = kv.shape[0];
        !self.cfg.apply_residual_connection_post_layernorm
            && self.out_norm.is_none()
            && c.tp.is_none()
            && c.ffn_hidden_size % 16 == 0
            && rows <= te_runtime::ops::gemv::max_rows(c.ffn_hidden_size)
            && mlp.norm_params().gemv_norm().is_some()
            && mlp.fc1().gemv_matrix().is_some()
            && mlp.fc2().gemv_matrix().is_some()
            && self.attention.decode_gemv_ok(x, kv)
    }

    /// A decode step through the fused GEMVs, four launches for the layer's GEMMs and what
    /// surrounds them: the norm + QKV, the attention (cache append, decode kernels), the
    /// projection, the residual add + MLP norm + fc1 + bias + activation, fc2 + bias + the residual
    /// add. The same sums as [`TransformerLayer::infer_cached`]'s kernels, rounded where they round.
    fn decode_gemv(&mut self, x: &Tensor, kv: KvLayer<'_>) -> Result<Tensor> {
        let a = self.attention.decode_gemv(x, kv)?;
        let not_served = || Error::internal(MODULE, "decode_gemv on a layer decode_gemv_ok refuses");
        let Mlp::Dense(mlp) = &self.mlp else { return Err(not_served()) };
        let c = mlp.config();
        let (kind, norm) = mlp.norm_params().gemv_norm().ok_or_else(not_served)?;
        let (fc1, fc2) =
            (mlp.fc1().gemv_matrix().ok_or_else(not_served)?, mlp.fc2().gemv_matrix().ok_or_else(not_served)?);
        let [_, b, hidden] = a.shape() else { return Err(not_served()) };
        let (b, hidden) = (*b, *hidden);
        let (x2, a2) = (x.reshape(&[b, hidden])?, a.reshape(&[b, hidden])?);
        let mut h = Tensor::empty(&self.dev, DType::BF16, &[b, hidden])?;
        let mut act = Tensor::empty(&self.dev, DType::BF16, &[b, c.ffn_hidden_size])?;
        let input = GemvInput::ResidualNorm { x: &x2, a: &a2, kind, norm, h_out: &mut h };
        gemv(&self.dev, input, fc1, GemvEpilogue::Act(c.activation), &mut act)?;
        gemv(&self.dev, GemvInput::Plain(&act), fc2, GemvEpilogue::Residual, &mut h)?;
        h.reshape(&[1, b, hidden])
    }

    /// The residual, MLP and output norm of [`TransformerLayer::infer_with`] after the attention
    /// output `a` of `x`.
    fn finish_infer(&mut self, x: &Tensor, a: &Tensor) -> Result<Tensor> {
        let mut h1 = Tensor::empty(&self.dev, x.dtype(), x.shape())?;
        add(&self.dev, a, x, &mut h1)?;
        let (mut y, ln_out) = match &mut self.mlp {
            Mlp::Dense(d) => {
                let m = d.infer_with(&h1, ForwardOptions::default())?;
                (m.out.into_high(&self.dev, x.dtype())?, m.ln_out)
            }
            Mlp::Moe(moe) => (moe.infer(&h1)?, None),
        };
        add_assign(&self.dev, &mut y, ln_out.as_ref().unwrap_or(&h1))?;
        match &self.out_norm {
            Some(n) => n.infer(&y),
            None => Ok(y),
        }
    }

    /// Backward: `dx` for `d_out`; every parameter gradient accumulates.
    ///
    /// # Errors
    /// [`Error::Context`] for another module's context; the errors of the parts.
    pub fn backward(&mut self, ctx: TransformerLayerCtx, d_out: &Tensor) -> Result<Tensor> {
        if ctx.module_id != self.id {
            return Err(Error::Context { module: MODULE, message: "the context was made by another layer".into() });
        }
        let p = ctx.p;
        let d_y = match (&mut self.out_norm, ctx.out_norm) {
            (Some(n), Some(c)) => n.backward(c, d_out)?,
            _ => d_out.clone(),
        };
        // y = residual + drop(mlp): the residual takes d_y as is.
        let mut d_m = Tensor::empty(&self.dev, d_y.dtype(), d_y.shape())?;
        dropout_backward(&self.dev, &d_y, &ctx.mask2, p, &mut d_m)?;
        // The residual took the MLP's norm output (post-LN) or its input (pre-LN).
        let post = self.cfg.apply_residual_connection_post_layernorm;
        let opts = BackwardOptions { grad_ln_out: post.then_some(&d_y), ..Default::default() };
        let mut d_h1 = match (&mut self.mlp, ctx.mlp) {
            (Mlp::Dense(d), MlpCtx::Dense(c)) => d
                .backward_with(*c, &d_m, opts)?
                .ok_or_else(|| Error::internal(MODULE, "no MLP input gradient with input_grad = true"))?,
            (Mlp::Moe(moe), MlpCtx::Moe(c)) => moe.backward(*c, &d_m)?,
            _ => return Err(Error::internal(MODULE, "the MLP context does not match the MLP")),
        };
        if !post {
            add_assign(&self.dev, &mut d_h1, &d_y)?;
        }
        let mut d_a = Tensor::empty(&self.dev, d_h1.dtype(), d_h1.shape())?;
        dropout_backward(&self.dev, &d_h1, &ctx.mask1, p, &mut d_a)?;
        let d_x = self.attention.backward(ctx.attn, &d_a)?;
        add_assign(&self.dev, &mut d_h1, &d_x)?;
        Ok(d_h1)
    }
}

impl Module for TransformerLayer {
    /// TE's names: `self_attention.*`, `layernorm_mlp.*` (or, MoE, Megatron's `mlp.*`: see
    /// [`MoeMLP`]'s names), and `layernorm.*` (post-LN).
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.attention.visit(&join_path(prefix, "self_attention"), visitor)?;
        match &self.mlp {
            Mlp::Dense(m) => m.visit(&join_path(prefix, "layernorm_mlp"), visitor)?,
            Mlp::Moe(m) => m.visit(&join_path(prefix, "mlp"), visitor)?,
        }
        self.out_norm.visit(&join_path(prefix, "layernorm"), visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.attention.visit_mut(&join_path(prefix, "self_attention"), visitor)?;
        match &mut self.mlp {
            Mlp::Dense(m) => m.visit_mut(&join_path(prefix, "layernorm_mlp"), visitor)?,
            Mlp::Moe(m) => m.visit_mut(&join_path(prefix, "mlp"), visitor)?,
        }
        self.out_norm.visit_mut(&join_path(prefix, "layernorm"), visitor)
    }

    /// [`TransformerLayerConfig::kernel_specs`] of its config.
    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.cfg.kernel_specs(target, specs);
    }
}
