//! [`TransformerLayerConfig`]: TE's `TransformerLayer` arguments and the one derivation of its
//! parts' configurations ([`TransformerLayerConfig::parts`]) that the layer is built from and
//! its kernel lists are made by.

use super::super::attention::{AttentionBackend, AttnMaskType, QkvFormat};
use super::super::layernorm_mlp::LayerNormMLPConfig;
use super::super::moe_mlp::{MoeConfig, MoeMLPConfig};
use super::super::multihead_attention::MultiheadAttentionConfig;
use super::super::norm::{NormConfig, NormKind};
use super::super::Activation;
use crate::parallel::TpConfig;
use te_codegen::DType;

/// Arguments of [`TransformerLayer::new`](super::TransformerLayer::new) (TE `TransformerLayer(hidden_size, ffn_hidden_size,
/// num_attention_heads, ...)`).
#[derive(Debug, Clone)]
pub struct TransformerLayerConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub ffn_hidden_size: usize,
    /// Query heads (must divide `hidden_size`).
    pub num_attention_heads: usize,
    /// Key/value heads (GQA); `None` = `num_attention_heads`.
    pub num_gqa_groups: Option<usize>,
    /// Norm epsilon. TE default 1e-5.
    pub layernorm_epsilon: f32,
    /// Dropout after the attention and MLP blocks. TE default 0.1.
    pub hidden_dropout: f32,
    /// Dropout on attention probabilities (TE default 0.1; 0 here by default).
    pub attention_dropout: f32,
    /// TE `self_attn_mask_type`. Default causal.
    pub self_attn_mask_type: AttnMaskType,
    /// Sliding window `(left, right)` of the self-attention (TE `window_size`; see
    /// `DotProductAttentionConfig::window_size`). `None`: no window.
    pub window_size: Option<(i64, i64)>,
    /// The self-attention's backend ([`AttentionBackend::Auto`] by default: fused where it
    /// applies; see `DotProductAttentionConfig::backend`).
    pub attention_backend: AttentionBackend,
    /// LayerNorm or RMSNorm.
    pub normalization: NormKind,
    /// MLP activation. Default GELU.
    pub activation: Activation,
    /// Take residuals after the norms (TE `apply_residual_connection_post_layernorm`); supported
    /// with `output_layernorm` (BERT).
    pub apply_residual_connection_post_layernorm: bool,
    /// Post-LN: no norm in front of the attention, a norm on the output (TE `output_layernorm`).
    pub output_layernorm: bool,
    /// TE `zero_centered_gamma`.
    pub zero_centered_gamma: bool,
    /// Layout of the hidden states. Default `[s, b, hidden]`.
    pub qkv_format: QkvFormat,
    /// Projections have biases.
    pub bias: bool,
    /// Parameter dtype.
    pub params_dtype: DType,
    /// Weight-init seed; also the dropout seed.
    pub seed: u64,
    /// A mixture-of-experts MLP ([`MoeMLP`](crate::modules::MoeMLP), each expert `ffn_hidden_size` wide) instead of
    /// `LayerNormMLP`. Default `None`. Pre-LN only (not with
    /// `apply_residual_connection_post_layernorm`).
    pub moe: Option<MoeConfig>,
    /// Tensor parallelism (TE `tp_group`, `sequence_parallel`, `set_parallel_mode=True`; see
    /// [`TpConfig`]): the attention's heads and the MLP's ffn features split over the group
    /// (Megatron-LM's layout, [`MultiheadAttentionConfig::tp`], [`LayerNormMLPConfig::tp`]).
    /// Under sequence parallelism the layer's input and output are this rank's shard of the
    /// first dim (`[s / tp, b, hidden]` in sbhd); the residuals, dropout and norms run on it
    /// (each rank's dropout masks its own tokens). Dense MLPs only. Default `None`.
    pub tp: Option<TpConfig>,
}

impl TransformerLayerConfig {
    /// TE's defaults (except `attention_dropout`, 0 here).
    pub fn new(hidden_size: usize, ffn_hidden_size: usize, num_attention_heads: usize) -> Self {
        Self {
            hidden_size,
            ffn_hidden_size,
            num_attention_heads,
            num_gqa_groups: None,
            layernorm_epsilon: 1e-5,
            hidden_dropout: 0.1,
            attention_dropout: 0.0,
            self_attn_mask_type: AttnMaskType::Causal,
            window_size: None,
            attention_backend: AttentionBackend::Auto,
            normalization: NormKind::LayerNorm,
            activation: Activation::Gelu,
            apply_residual_connection_post_layernorm: false,
            output_layernorm: false,
            zero_centered_gamma: false,
            qkv_format: QkvFormat::Sbhd,
            bias: true,
            params_dtype: DType::BF16,
            seed: 0,
            moe: None,
            tp: None,
        }
    }

    /// The configurations of the parts a [`TransformerLayer`](super::TransformerLayer) of this config is built from: the
    /// one derivation [`TransformerLayer::new`](super::TransformerLayer::new) builds them by and
    /// [`TransformerLayerConfig::kernel_specs`] lists their kernels by.
    pub(crate) fn parts(&self) -> TransformerLayerParts {
        let cfg = self;
        let attention = MultiheadAttentionConfig {
            num_gqa_groups: cfg.num_gqa_groups,
            input_layernorm: !cfg.output_layernorm,
            normalization: cfg.normalization,
            layernorm_epsilon: cfg.layernorm_epsilon,
            zero_centered_gamma: cfg.zero_centered_gamma,
            attn_mask_type: cfg.self_attn_mask_type,
            window_size: cfg.window_size,
            attention_backend: cfg.attention_backend,
            attention_dropout: cfg.attention_dropout,
            qkv_format: cfg.qkv_format,
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            seed: cfg.seed,
            tp: cfg.tp.clone(),
            ..MultiheadAttentionConfig::new(cfg.hidden_size, cfg.num_attention_heads)
        };
        let dense = LayerNormMLPConfig {
            eps: cfg.layernorm_epsilon,
            normalization: cfg.normalization,
            zero_centered_gamma: cfg.zero_centered_gamma,
            activation: cfg.activation,
            bias: cfg.bias,
            return_layernorm_output: cfg.apply_residual_connection_post_layernorm,
            params_dtype: cfg.params_dtype,
            seed: cfg.seed + 2,
            tp: cfg.tp.clone(),
            ..LayerNormMLPConfig::new(cfg.hidden_size, cfg.ffn_hidden_size)
        };
        let mlp = match cfg.moe {
            None => MlpConfig::Dense(dense),
            Some(moe) => MlpConfig::Moe(MoeMLPConfig {
                aux_loss_coeff: moe.aux_loss_coeff,
                pre_softmax: moe.pre_softmax,
                device_m_splits: moe.device_m_splits,
                eps: cfg.layernorm_epsilon,
                normalization: cfg.normalization,
                zero_centered_gamma: cfg.zero_centered_gamma,
                activation: cfg.activation,
                bias: cfg.bias,
                params_dtype: cfg.params_dtype,
                seed: cfg.seed + 2,
                ..MoeMLPConfig::new(cfg.hidden_size, cfg.ffn_hidden_size, moe.num_experts, moe.topk)
            }),
        };
        let output_norm = cfg.output_layernorm.then(|| {
            let norm_cfg = NormConfig {
                eps: cfg.layernorm_epsilon,
                zero_centered_gamma: cfg.zero_centered_gamma,
                params_dtype: cfg.params_dtype,
                ..NormConfig::new(cfg.hidden_size)
            };
            (cfg.normalization, norm_cfg)
        });
        TransformerLayerParts { attention, mlp, output_norm }
    }
}

/// The configurations of a [`TransformerLayer`](super::TransformerLayer)'s parts ([`TransformerLayerConfig::parts`]).
#[derive(Debug, Clone)]
pub(crate) struct TransformerLayerParts {
    /// The self-attention block (its input norm fused in pre-LN).
    pub(crate) attention: MultiheadAttentionConfig,
    /// The MLP with its norm.
    pub(crate) mlp: MlpConfig,
    /// The output norm's kind and config (post-LN, `output_layernorm`).
    pub(crate) output_norm: Option<(NormKind, NormConfig)>,
}

/// The config of a layer's MLP: dense or mixture-of-experts.
#[derive(Debug, Clone)]
pub(crate) enum MlpConfig {
    /// `LayerNormMLP`.
    Dense(LayerNormMLPConfig),
    /// `MoeMLP`.
    Moe(MoeMLPConfig),
}
