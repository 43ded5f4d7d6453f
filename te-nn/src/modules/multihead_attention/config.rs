//! [`MultiheadAttentionConfig`]: the arguments of a `MultiheadAttention` and the configurations
//! of its parts that follow from them.

use super::super::attention::{AttentionBackend, AttnMaskType, DotProductAttentionConfig, QkvFormat};
use super::super::layernorm_linear::LayerNormLinearConfig;
use super::super::linear::LinearConfig;
use super::super::norm::NormKind;
use super::super::NormConfig;
use super::qk;
use super::MODULE;
use crate::parallel::{GemmParallel, ParallelMode, Split, TpConfig};
use te_codegen::DType;
use te_runtime::ops::rope::RopeFormat;
use te_runtime::{Error, Result};

/// Arguments of [`MultiheadAttention::new`](super::MultiheadAttention::new) (TE `MultiheadAttention(hidden_size,
/// num_attention_heads, ...)`).
#[derive(Debug, Clone)]
pub struct MultiheadAttentionConfig {
    /// Model width.
    pub hidden_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Channels per head; `None` = `hidden_size / num_attention_heads` (which must divide).
    pub kv_channels: Option<usize>,
    /// Key/value heads (GQA; 1 = MQA); `None` = `num_attention_heads`.
    pub num_gqa_groups: Option<usize>,
    /// The QKV projection has the input norm fused (TE `input_layernorm`; default false, the
    /// `TransformerLayer` sets it).
    pub input_layernorm: bool,
    /// LayerNorm or RMSNorm for the input norm.
    pub normalization: NormKind,
    /// Norm epsilon.
    pub layernorm_epsilon: f32,
    /// TE `zero_centered_gamma`.
    pub zero_centered_gamma: bool,
    /// The mask. TE's default: causal.
    pub attn_mask_type: AttnMaskType,
    /// Sliding window `(left, right)` of the mask (TE `window_size`; see
    /// [`DotProductAttentionConfig::window_size`]). `None`: no window.
    pub window_size: Option<(i64, i64)>,
    /// The attention backend ([`AttentionBackend::Auto`] by default; see
    /// `DotProductAttentionConfig::backend`).
    pub attention_backend: AttentionBackend,
    /// Dropout on the attention probabilities (see `DotProductAttention`).
    pub attention_dropout: f32,
    /// Layout of the hidden states: `[s, b, hidden]` (sbhd, TE's default) or `[b, s, hidden]`.
    pub qkv_format: QkvFormat,
    /// QKV and output projections have biases.
    pub bias: bool,
    /// The QKV projection's bias apart from the output projection's (Megatron's
    /// `add_qkv_bias`: Qwen2's q/k/v biases without an `o_proj` bias); `None` = `bias`.
    pub qkv_bias: Option<bool>,
    /// A norm of each head's q and of its k over the `d` channels, one weight `[d]` for all
    /// heads (TE's `qk_norm_type`: RMSNorm for Qwen3 and Gemma 3, `zero_centered_gamma` as the
    /// input norm's); `None` (the default): none.
    pub qk_norm_type: Option<NormKind>,
    /// The q/k norms' epsilon (TE's `qk_norm_eps`, default 1e-6).
    pub qk_norm_eps: f32,
    /// Norm q and k before RoPE (transformers' Qwen3 and Gemma 3 order) instead of after (TE's
    /// default, `qk_norm_before_rope = False`).
    pub qk_norm_before_rope: bool,
    /// The softmax scale (TE `DotProductAttention`'s `softmax_scale`; Gemma's
    /// `query_pre_attn_scalar^-½`); `None` = `1 / √d`.
    pub softmax_scale: Option<f32>,
    /// Parameter dtype.
    pub params_dtype: DType,
    /// Weight-init seed (the projections use `seed` and `seed + 1`).
    pub seed: u64,
    /// Tensor parallelism (TE `tp_group`, `sequence_parallel`, `set_parallel_mode=True`; see
    /// [`TpConfig`]): the QKV projection column-parallel with the heads split (each rank its
    /// `h / tp` query heads and `g / tp` key/value groups), attention over the rank's heads, the
    /// output projection row-parallel. Sizes stay the whole block's; `tp` must divide the heads
    /// and the groups. Under sequence parallelism the hidden states in and out are this rank's
    /// shard of the first dim (`[s / tp, b, hidden]` in sbhd). Default `None`.
    pub tp: Option<TpConfig>,
}

impl MultiheadAttentionConfig {
    /// TE's defaults (except `attention_dropout`, 0 here).
    pub fn new(hidden_size: usize, num_attention_heads: usize) -> Self {
        Self {
            hidden_size,
            num_attention_heads,
            kv_channels: None,
            num_gqa_groups: None,
            input_layernorm: false,
            normalization: NormKind::LayerNorm,
            layernorm_epsilon: 1e-5,
            zero_centered_gamma: false,
            attn_mask_type: AttnMaskType::Causal,
            window_size: None,
            attention_backend: AttentionBackend::Auto,
            attention_dropout: 0.0,
            qkv_format: QkvFormat::Sbhd,
            bias: true,
            qkv_bias: None,
            qk_norm_type: None,
            qk_norm_eps: 1e-6,
            qk_norm_before_rope: false,
            softmax_scale: None,
            params_dtype: DType::BF16,
            seed: 0,
            tp: None,
        }
    }

    /// The configurations of the parts a [`MultiheadAttention`](super::MultiheadAttention) of this config is built from:
    /// the one derivation [`MultiheadAttention::new`](super::MultiheadAttention::new) builds them by and
    /// [`MultiheadAttentionConfig::kernel_specs`] lists their kernels by.
    ///
    /// # Errors
    /// [`Error::Config`] when the heads do not divide the hidden size (without `kv_channels`),
    /// the groups do not divide the heads, or the tensor-parallel size does not divide the heads
    /// or the groups.
    pub(crate) fn parts(&self) -> Result<MultiheadAttentionParts> {
        let cfg = self;
        let config = |message: String| Error::Config { module: MODULE, message };
        let h = cfg.num_attention_heads;
        if h == 0 {
            return Err(config("num_attention_heads must be ≥ 1".into()));
        }
        let d = match cfg.kv_channels {
            Some(d) => d,
            None if cfg.hidden_size % h == 0 => cfg.hidden_size / h,
            None => {
                return Err(config(format!(
                    "hidden_size = {} is not divisible by num_attention_heads = {h}; choose a head count that divides \
                     it or set kv_channels",
                    cfg.hidden_size
                )))
            }
        };
        let g = cfg.num_gqa_groups.unwrap_or(h);
        if g == 0 || h % g != 0 {
            return Err(config(format!("num_gqa_groups = {g} must divide num_attention_heads = {h}")));
        }
        let qkv_out = (h + 2 * g) * d;
        // The QKV projection column-parallel: each rank holds its heads of q, k and v.
        let qkv_comm = GemmParallel::new(cfg.tp.as_ref(), ParallelMode::Column);
        let h_local = qkv_comm.split_count(MODULE, "num_attention_heads", h)?;
        let g_local = qkv_comm.split_count(MODULE, "num_gqa_groups", g)?;
        let qkv_bias = cfg.qkv_bias.unwrap_or(cfg.bias);
        let qkv = if cfg.input_layernorm {
            QkvProjConfig::Norm(LayerNormLinearConfig {
                eps: cfg.layernorm_epsilon,
                normalization: cfg.normalization,
                zero_centered_gamma: cfg.zero_centered_gamma,
                bias: qkv_bias,
                params_dtype: cfg.params_dtype,
                seed: cfg.seed,
                tp: cfg.tp.clone(),
                ..LayerNormLinearConfig::new(cfg.hidden_size, qkv_out)
            })
        } else {
            QkvProjConfig::Plain(LinearConfig {
                bias: qkv_bias,
                params_dtype: cfg.params_dtype,
                seed: cfg.seed,
                tp: cfg.tp.clone(),
                parallel_mode: ParallelMode::Column,
                ..LinearConfig::new(cfg.hidden_size, qkv_out)
            })
        };
        let attention = DotProductAttentionConfig {
            num_gqa_groups: Some(g_local),
            attention_dropout: cfg.attention_dropout,
            qkv_format: cfg.qkv_format,
            attn_mask_type: cfg.attn_mask_type,
            window_size: cfg.window_size,
            backend: cfg.attention_backend,
            softmax_scale: cfg.softmax_scale,
            ..DotProductAttentionConfig::new(h_local, d)
        };
        let qk_norm = cfg
            .qk_norm_type
            .map(|kind| (kind, qk::norm_config(d, cfg.qk_norm_eps, cfg.zero_centered_gamma, cfg.params_dtype)));
        let proj = LinearConfig {
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            seed: cfg.seed + 1,
            tp: cfg.tp.clone(),
            parallel_mode: ParallelMode::Row,
            ..LinearConfig::new(h * d, cfg.hidden_size)
        };
        let qkv_split = Split::Qkv { heads: h, groups: g, head_dim: d };
        Ok(MultiheadAttentionParts { qkv, qkv_split, attention, qk_norm, proj })
    }

    /// The RoPE kernels' layout of q and k: that of the hidden states.
    pub(crate) fn rope_format(&self) -> RopeFormat {
        match self.qkv_format {
            QkvFormat::Sbhd => RopeFormat::Sbhd,
            QkvFormat::Bshd => RopeFormat::Bshd,
        }
    }
}

/// The configurations of a [`MultiheadAttention`](super::MultiheadAttention)'s parts ([`MultiheadAttentionConfig::parts`]).
#[derive(Debug, Clone)]
pub(crate) struct MultiheadAttentionParts {
    /// The QKV projection `hidden → (h + 2g)·d`.
    pub(crate) qkv: QkvProjConfig,
    /// How its weight splits under tensor parallelism: by heads of q, k and v.
    pub(crate) qkv_split: Split,
    /// The dot-product attention.
    pub(crate) attention: DotProductAttentionConfig,
    /// The q/k norms' kind and config (over `d` channels), with `qk_norm_type`.
    pub(crate) qk_norm: Option<(NormKind, NormConfig)>,
    /// The output projection `h·d → hidden`.
    pub(crate) proj: LinearConfig,
}

/// The QKV projection's configuration: behind the input norm (`input_layernorm`) or plain.
#[derive(Debug, Clone)]
pub(crate) enum QkvProjConfig {
    /// A `LayerNormLinear`.
    Norm(LayerNormLinearConfig),
    /// A `Linear`.
    Plain(LinearConfig),
}
