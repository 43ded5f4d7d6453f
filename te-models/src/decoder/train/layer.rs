//! One trainable layer of [`super::DecoderLm`]: te-nn's `MultiheadAttention` (the input norm
//! fused into the QKV GEMM, GQA, the q/k norms, RoPE, the sliding window, the fused attention)
//! and `LayerNormMLP` (the norm fused into fc1, the gated activation), Gemma's sandwich norms as
//! `Norm` modules, and the two residual adds: the formula of the [`crate::decoder`] docs, with
//! a backward.

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult};
use std::sync::Arc;
use te_codegen::DType;
use te_nn::modules::{
    AttentionBackend, AttentionInputs, AttnMaskType, ForwardOptions, LayerNormMLP, LayerNormMLPConfig, LayerNormMLPCtx,
    MultiheadAttention, MultiheadAttentionConfig, MultiheadAttentionCtx, Norm, NormConfig, NormCtx, QkvFormat,
    ThdSeqlens,
};
use te_runtime::ops::elementwise::{add, add_assign};
use te_runtime::{Device, Result, Tensor};

/// Layer `l` of a [`super::DecoderLm`], its parameters under the decoder family's internal
/// names (`self_attention.*`, `post_attention_layernorm.*`, `layernorm_mlp.*`,
/// `post_mlp_layernorm.*`).
#[derive(Debug, te_nn::Module)]
pub(super) struct DecoderLayer {
    self_attention: MultiheadAttention,
    /// Gemma's norm of the attention block's output (`sandwich_norm`).
    post_attention_layernorm: Option<Norm>,
    layernorm_mlp: LayerNormMLP,
    /// Gemma's norm of the MLP's output (`sandwich_norm`).
    post_mlp_layernorm: Option<Norm>,
    /// Index of the layer's rotary table in the model's.
    #[module(skip)]
    pub(super) rope: usize,
    #[module(skip)]
    dev: Arc<Device>,
}

/// What [`DecoderLayer::forward`] saves for its backward: the attention block's context and
/// the MLP block's.
#[derive(Debug)]
pub(super) struct DecoderLayerCtx {
    attn: AttentionBlockCtx,
    mlp: MlpBlockCtx,
}

/// What the attention block ([`DecoderLayer::forward_attention`]) saves for its backward: the
/// attention's context and Gemma's post-attention norm's.
#[derive(Debug)]
pub(super) struct AttentionBlockCtx {
    attn: MultiheadAttentionCtx,
    post_attn: Option<NormCtx>,
}

/// What the MLP block ([`DecoderLayer::forward_mlp`]) saves for its backward: the
/// `LayerNormMLP`'s context (its input, the norm statistics, fc1's output, the activation or
/// their FP8 codes) and Gemma's post-MLP norm's.
#[derive(Debug)]
pub(super) struct MlpBlockCtx {
    mlp: LayerNormMLPCtx,
    post_mlp: Option<NormCtx>,
}

impl DecoderLayer {
    /// Layer `l` of `cfg` in `dtype` (weights initialized as TE does; the model loads them),
    /// its rotary table `rope`.
    ///
    /// # Errors
    /// [`DecoderError::Config`] for an activation without a fused kernel; the modules' errors.
    pub(super) fn new(
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        l: usize,
        rope: usize,
        dtype: DType,
    ) -> DecoderResult<Self> {
        let activation = cfg.activation.te_activation().ok_or_else(|| {
            DecoderError::config(
                "activation",
                format!("training on the GPU has no fused kernel for {} yet", cfg.activation.name()),
            )
        })?;
        let (h, eps) = (cfg.hidden_size, cfg.layernorm_epsilon);
        let attention = MultiheadAttentionConfig {
            kv_channels: Some(cfg.head_dim),
            num_gqa_groups: Some(cfg.num_gqa_groups),
            input_layernorm: true,
            normalization: cfg.normalization,
            layernorm_epsilon: eps,
            zero_centered_gamma: cfg.zero_centered_gamma,
            attn_mask_type: AttnMaskType::Causal,
            window_size: cfg.layer_window(l),
            attention_backend: AttentionBackend::Auto,
            qkv_format: QkvFormat::Sbhd,
            bias: cfg.proj_bias,
            qkv_bias: Some(cfg.qkv_bias),
            qk_norm_type: cfg.qk_norm.then_some(cfg.normalization),
            qk_norm_eps: eps,
            qk_norm_before_rope: true,
            softmax_scale: Some(cfg.softmax_scale()),
            params_dtype: dtype,
            seed: l as u64,
            ..MultiheadAttentionConfig::new(h, cfg.num_attention_heads)
        };
        let mlp = LayerNormMLPConfig {
            eps,
            normalization: cfg.normalization,
            zero_centered_gamma: cfg.zero_centered_gamma,
            activation,
            bias: cfg.mlp_bias,
            params_dtype: dtype,
            seed: l as u64 + 1,
            ..LayerNormMLPConfig::new(h, cfg.ffn_hidden_size)
        };
        let sandwich = || -> DecoderResult<Option<Norm>> {
            if !cfg.sandwich_norm {
                return Ok(None);
            }
            let nc = NormConfig {
                eps,
                zero_centered_gamma: cfg.zero_centered_gamma,
                params_dtype: dtype,
                ..NormConfig::new(h)
            };
            Ok(Some(Norm::new(dev, cfg.normalization, nc)?))
        };
        Ok(Self {
            self_attention: MultiheadAttention::new(dev, attention)?,
            post_attention_layernorm: sandwich()?,
            layernorm_mlp: LayerNormMLP::new(dev, mlp)?,
            post_mlp_layernorm: sandwich()?,
            rope,
            dev: dev.clone(),
        })
    }

    /// Training mode or evaluation mode (the attention's dropout; the decoder family has none
    /// by default).
    pub(super) fn set_training(&mut self, training: bool) {
        self.self_attention.set_training(training);
    }

    /// Splits the attention's sequences over `cp` (`None`: whole sequences on this rank).
    ///
    /// # Errors
    /// As `MultiheadAttention::set_context_parallel`.
    pub(super) fn set_context_parallel(&mut self, cp: Option<te_nn::parallel::ContextParallel>) -> Result<()> {
        self.self_attention.set_context_parallel(cp)
    }

    /// `x [s, b, hidden]` → the layer's output and its context; `freqs`: the rotary angles of
    /// positions `0..s` (f32 `[≥ s, head_dim]`), or with `thd` (`x` `[tokens, 1, hidden]`,
    /// packed documents) each token's.
    ///
    /// # Errors
    /// The modules' errors.
    pub(super) fn forward(
        &mut self,
        x: &Tensor,
        rope: (&Tensor, Option<ThdSeqlens<'_>>),
        is_first_microbatch: Option<bool>,
    ) -> Result<(Tensor, DecoderLayerCtx)> {
        let (h, attn) = self.forward_attention(x, rope, is_first_microbatch)?;
        let (y, mlp) = self.forward_mlp(&h, is_first_microbatch)?;
        Ok((y, DecoderLayerCtx { attn, mlp }))
    }

    /// The attention block: `x [s, b, hidden]` → `h = x + post_attn(attention(x))` (same shape
    /// and dtype, the MLP block's input) and the block's context; arguments as
    /// [`DecoderLayer::forward`].
    ///
    /// # Errors
    /// The modules' errors.
    pub(super) fn forward_attention(
        &mut self,
        x: &Tensor,
        (freqs, thd): (&Tensor, Option<ThdSeqlens<'_>>),
        is_first_microbatch: Option<bool>,
    ) -> Result<(Tensor, AttentionBlockCtx)> {
        let inputs = AttentionInputs { rotary_pos_emb: Some(freqs), thd, is_first_microbatch, ..Default::default() };
        let (a, attn) = self.self_attention.forward_with(x, inputs)?;
        let (a, post_attn) = norm_forward(self.post_attention_layernorm.as_mut(), a)?;
        let mut h = Tensor::empty(&self.dev, x.dtype(), x.shape())?;
        add(&self.dev, x, &a, &mut h)?;
        Ok((h, AttentionBlockCtx { attn, post_attn }))
    }

    /// The MLP block: `h [s, b, hidden]` (the attention block's output) → the layer's output
    /// `y = h + post_mlp(mlp(h))` (same shape and dtype) and the block's context. Selective
    /// recompute runs it again in the backward on the same `h`, under the first forward's FP8
    /// scales (`te_nn::modules::Fp8Replay`).
    ///
    /// # Errors
    /// The modules' errors.
    pub(super) fn forward_mlp(
        &mut self,
        h: &Tensor,
        is_first_microbatch: Option<bool>,
    ) -> Result<(Tensor, MlpBlockCtx)> {
        let opts = ForwardOptions { is_first_microbatch, fp8_output: false };
        let (m, mlp) = self.layernorm_mlp.forward_with(h, opts)?;
        let m = m.out.into_high(&self.dev, h.dtype())?;
        let (m, post_mlp) = norm_forward(self.post_mlp_layernorm.as_mut(), m)?;
        let mut y = Tensor::empty(&self.dev, h.dtype(), h.shape())?;
        add(&self.dev, h, &m, &mut y)?;
        Ok((y, MlpBlockCtx { mlp, post_mlp }))
    }

    /// The layer's MLP (`LayerNormMLP`), whose FP8 scaling states are all the MLP block's (the
    /// sandwich norm has none): what selective recompute captures for its replay.
    pub(super) fn mlp_module(&self) -> &LayerNormMLP {
        &self.layernorm_mlp
    }

    /// The input gradient for the output gradient `dy`; every parameter gradient accumulates.
    ///
    /// # Errors
    /// The modules' errors ([`te_runtime::Error::Context`] for a context of another layer).
    pub(super) fn backward(&mut self, ctx: DecoderLayerCtx, dy: &Tensor) -> Result<Tensor> {
        let dh = self.backward_mlp(ctx.mlp, dy)?;
        self.backward_attention(ctx.attn, &dh)
    }

    /// The MLP block's backward: the gradient of its input `h` (the residual's `dy` included)
    /// for the layer's output gradient `dy`; the MLP's and post-MLP norm's gradients accumulate.
    ///
    /// # Errors
    /// The modules' errors ([`te_runtime::Error::Context`] for a context of another layer).
    pub(super) fn backward_mlp(&mut self, ctx: MlpBlockCtx, dy: &Tensor) -> Result<Tensor> {
        let dm = norm_backward(self.post_mlp_layernorm.as_mut(), ctx.post_mlp, dy)?;
        let mut dh = self.layernorm_mlp.backward(ctx.mlp, &dm)?;
        add_assign(&self.dev, &mut dh, dy)?;
        Ok(dh)
    }

    /// The attention block's backward: the layer input's gradient for `dh`, the gradient of
    /// the MLP block's input ([`DecoderLayer::backward_mlp`]); the attention's and
    /// post-attention norm's gradients accumulate.
    ///
    /// # Errors
    /// The modules' errors ([`te_runtime::Error::Context`] for a context of another layer).
    pub(super) fn backward_attention(&mut self, ctx: AttentionBlockCtx, dh: &Tensor) -> Result<Tensor> {
        let da = norm_backward(self.post_attention_layernorm.as_mut(), ctx.post_attn, dh)?;
        let mut dx = self.self_attention.backward(ctx.attn, &da)?;
        add_assign(&self.dev, &mut dx, dh)?;
        Ok(dx)
    }
}

fn norm_forward(norm: Option<&mut Norm>, x: Tensor) -> Result<(Tensor, Option<NormCtx>)> {
    match norm {
        Some(n) => {
            let (y, c) = n.forward(&x)?;
            Ok((y, Some(c)))
        }
        None => Ok((x, None)),
    }
}

fn norm_backward(norm: Option<&mut Norm>, ctx: Option<NormCtx>, dy: &Tensor) -> Result<Tensor> {
    match (norm, ctx) {
        (Some(n), Some(c)) => n.backward(c, dy),
        (None, None) => Ok(dy.clone()),
        _ => Err(te_runtime::Error::internal("DecoderLm", "a sandwich-norm context of another layer")),
    }
}
