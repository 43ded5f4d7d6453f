//! [`DecoderConfig`]: one configuration for the decoder family (Llama, Qwen2, Qwen3, Gemma 3),
//! with TE/Megatron field names, the Hugging Face `config.json` key of each in its docs, and its
//! validation. Parsing a `config.json` is [`DecoderConfig::from_hf_config`] (`hf_config.rs`).

use super::rope::RopeConfig;
use super::{DecoderError, DecoderResult};
use te_codegen::DType;
use te_nn::modules::NormKind;
use te_runtime::numerics::round_to;

/// The largest head dimension the family takes (Gemma 3's 256; the fused attention kernels' limit).
pub const MAX_HEAD_DIM: usize = 256;

/// The largest value of any size field (vocabulary, widths, contexts): 2²⁶, far above any model,
/// low enough that no configuration asks for an absurd allocation.
pub const MAX_SIZE: usize = 1 << 26;

/// The most layers a configuration may have.
pub const MAX_LAYERS: usize = 1 << 16;

/// The MLP's activation (Megatron's names). Gated ones read `fc1`'s output `[gate | up]` and
/// compute `act(gate) · up` (transformers' `down_proj(act_fn(gate_proj(x)) * up_proj(x))`,
/// TE's `swiglu` / `geglu` layout).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecoderActivation {
    /// Exact (erf) GELU: transformers `gelu`.
    Gelu,
    /// GELU, tanh approximation: transformers `gelu_pytorch_tanh` / `gelu_new`.
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
    /// `x · sigmoid(x)` (transformers `silu` / `swish`).
    Silu,
    /// Gated SiLU: Llama, Qwen2, Qwen3 (`hidden_act = "silu"`).
    Swiglu,
    /// Gated tanh GELU: Gemma 3 (`hidden_activation = "gelu_pytorch_tanh"`).
    Geglu,
    /// Gated exact GELU (a gated model with `hidden_act = "gelu"`).
    GegluErf,
    /// Gated ReLU.
    Reglu,
}

impl DecoderActivation {
    /// Every activation.
    pub const ALL: [DecoderActivation; 8] =
        [Self::Gelu, Self::GeluTanh, Self::Relu, Self::Silu, Self::Swiglu, Self::Geglu, Self::GegluErf, Self::Reglu];

    /// Whether `fc1` has `2 · ffn_hidden_size` outputs `[gate | up]`.
    pub const fn is_gated(self) -> bool {
        matches!(self, Self::Swiglu | Self::Geglu | Self::GegluErf | Self::Reglu)
    }

    /// The element-wise function (of the gate when gated), from [`te_reference::activation`].
    pub fn function(self) -> fn(f32) -> f32 {
        use te_reference::activation::{gelu, gelu_erf, relu, silu};
        match self {
            Self::Gelu | Self::GegluErf => gelu_erf,
            Self::GeluTanh | Self::Geglu => gelu,
            Self::Relu | Self::Reglu => relu,
            Self::Silu | Self::Swiglu => silu,
        }
    }

    /// The TE kernel activation that computes it on the GPU, where one exists
    /// (`gelu` → `GeluErf`, `gelu_tanh` → `Gelu`, `relu`, `swiglu`, `geglu`).
    pub fn te_activation(self) -> Option<te_codegen::spec::Activation> {
        use te_codegen::spec::Activation as A;
        match self {
            Self::Gelu => Some(A::GeluErf),
            Self::GeluTanh => Some(A::Gelu),
            Self::Relu => Some(A::Relu),
            Self::Swiglu => Some(A::Swiglu),
            Self::Geglu => Some(A::Geglu),
            Self::Silu | Self::GegluErf | Self::Reglu => None,
        }
    }

    /// Megatron's name: `gelu`, `gelu_tanh`, `relu`, `silu`, `swiglu`, `geglu`, `geglu_erf`, `reglu`.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Gelu => "gelu",
            Self::GeluTanh => "gelu_tanh",
            Self::Relu => "relu",
            Self::Silu => "silu",
            Self::Swiglu => "swiglu",
            Self::Geglu => "geglu",
            Self::GegluErf => "geglu_erf",
            Self::Reglu => "reglu",
        }
    }
}

/// The attention of one layer (transformers' `layer_types`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerAttention {
    /// Causal attention over every earlier position (`full_attention`).
    Global,
    /// Causal attention over the last [`DecoderConfig::sliding_window`] positions, the query's
    /// own included (`sliding_attention`).
    Sliding,
}

/// One decoder-only transformer of the Llama / Qwen / Gemma family (see the module docs for the
/// layer's formula). Field names are TE's / Megatron's; the docs give the Hugging Face
/// `config.json` key. Build one with [`DecoderConfig::from_hf_config`] or in code, then
/// [`DecoderConfig::validate`].
#[derive(Debug, Clone, PartialEq)]
pub struct DecoderConfig {
    /// Rows of the embedding and the LM head (`vocab_size`).
    pub vocab_size: usize,
    /// Model width (`hidden_size`).
    pub hidden_size: usize,
    /// MLP width (`intermediate_size`); `fc1` has twice as many outputs when gated.
    pub ffn_hidden_size: usize,
    /// Transformer layers (`num_hidden_layers`).
    pub num_layers: usize,
    /// Query heads (`num_attention_heads`).
    pub num_attention_heads: usize,
    /// Key/value heads (TE `num_gqa_groups`, `num_key_value_heads`): divides the query heads;
    /// 1 is MQA.
    pub num_gqa_groups: usize,
    /// Channels per head (TE `kv_channels`, `head_dim`; `hidden_size / num_attention_heads` when
    /// absent): even, at most [`MAX_HEAD_DIM`]. Need not equal `hidden_size / heads` (Qwen3,
    /// Gemma 3).
    pub head_dim: usize,
    /// RMSNorm (every model of the family) or LayerNorm.
    pub normalization: NormKind,
    /// Norm epsilon (`rms_norm_eps`).
    pub layernorm_epsilon: f32,
    /// Norm weights stored as `γ − 1`, applied as `1 + γ` (TE `zero_centered_gamma`; Gemma's
    /// `Gemma3RMSNorm`). Applies to every norm, the q/k norms included.
    pub zero_centered_gamma: bool,
    /// Gemma's sandwich norms: a norm on the attention's output before the residual add
    /// (`post_attention_layernorm`) and on the MLP's (`post_feedforward_layernorm`).
    pub sandwich_norm: bool,
    /// RMSNorm over each head's channels of q and k before RoPE (`q_norm`, `k_norm`: Qwen3,
    /// Gemma 3).
    pub qk_norm: bool,
    /// MLP activation (`hidden_act` / `hidden_activation`).
    pub activation: DecoderActivation,
    /// RoPE of the global layers, and of the sliding ones unless `rope_local` is set
    /// (`rope_theta`, `rope_scaling`; `rope_parameters` in transformers 5).
    pub rope: RopeConfig,
    /// RoPE of the sliding-window layers when it differs (Gemma 3: `rope_local_base_freq`, no
    /// scaling).
    pub rope_local: Option<RopeConfig>,
    /// Each layer's attention (`layer_types`; `num_layers` entries).
    pub layer_types: Vec<LayerAttention>,
    /// Window of the sliding layers (`sliding_window`): a query attends itself and the
    /// `sliding_window − 1` positions before it (transformers'
    /// `masking_utils.sliding_window_overlay`: `kv_idx > q_idx − sliding_window`). Required
    /// when a layer slides.
    pub sliding_window: Option<usize>,
    /// Biases on the q, k and v projections (Qwen2; `attention_bias` elsewhere).
    pub qkv_bias: bool,
    /// Bias on the output projection (`attention_bias` in Llama and Qwen3; never in Qwen2).
    pub proj_bias: bool,
    /// Biases on the MLP's projections (`mlp_bias`, Llama).
    pub mlp_bias: bool,
    /// The LM head is the embedding table (`tie_word_embeddings`; no `lm_head.weight` then).
    pub tie_word_embeddings: bool,
    /// Embeddings multiplied by `√hidden_size` (Gemma's `Gemma3TextScaledWordEmbedding`), the
    /// factor rounded to the model's dtype as transformers does
    /// ([`DecoderConfig::embedding_scale`]).
    pub scale_embeddings: bool,
    /// Softmax scale `query_pre_attn_scalar^−½` (Gemma 3); `None`: `head_dim^−½`.
    pub query_pre_attn_scalar: Option<f32>,
    /// `cap · tanh(logits / cap)` on the final logits (`final_logit_softcapping`).
    pub final_logit_softcapping: Option<f32>,
    /// `cap · tanh(scores / cap)` on the attention scores before the mask
    /// (`attn_logit_softcapping`, Gemma 2's). [`DecoderConfig::from_hf_config`] leaves it unset
    /// for Gemma 3, whose `Gemma3Attention` reads the field and does not apply it.
    pub attn_logit_softcapping: Option<f32>,
    /// The context the model was trained for (`max_position_embeddings`): a natural
    /// `max_length` for perplexity. Informational: RoPE has no table, and nothing here refuses
    /// longer sequences.
    pub max_position_embeddings: usize,
    /// Beginning-of-sequence token (`bos_token_id`).
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (`eos_token_id`, an id or a list): generation stops a sequence at
    /// any of them.
    pub eos_token_ids: Vec<u32>,
}

impl DecoderConfig {
    /// Outputs of the fused QKV projection: `(heads + 2 · groups) · head_dim` (rows `[q | k | v]`).
    pub fn qkv_size(&self) -> usize {
        (self.num_attention_heads + 2 * self.num_gqa_groups) * self.head_dim
    }

    /// Width of the attention's output (input of the output projection): `heads · head_dim`.
    pub fn attention_size(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Outputs of `fc1`: `2 · ffn_hidden_size` when gated (`[gate | up]`), else `ffn_hidden_size`.
    pub fn fc1_size(&self) -> usize {
        if self.activation.is_gated() {
            2 * self.ffn_hidden_size
        } else {
            self.ffn_hidden_size
        }
    }

    /// The softmax scale: `query_pre_attn_scalar^−½` or `head_dim^−½` (computed in f64 as
    /// Python does, then f32).
    pub fn softmax_scale(&self) -> f32 {
        let s = self.query_pre_attn_scalar.map_or(self.head_dim as f64, f64::from);
        (1.0 / s.sqrt()) as f32
    }

    /// The embedding multiplier for a model whose weights are `dtype`: `√hidden_size` rounded to
    /// `dtype` (transformers multiplies by `embed_scale.to(weight.dtype)`: 25.25 rather than
    /// 25.298 for Gemma 3 270M in BF16), or 1 without embedding scaling.
    pub fn embedding_scale(&self, dtype: DType) -> f32 {
        if self.scale_embeddings {
            round_to(dtype, (self.hidden_size as f64).sqrt() as f32)
        } else {
            1.0
        }
    }

    /// The RoPE of layer `l`: [`DecoderConfig::rope_local`] for a sliding layer when set, else
    /// [`DecoderConfig::rope`].
    pub fn layer_rope(&self, l: usize) -> RopeConfig {
        match (self.layer_types.get(l), self.rope_local) {
            (Some(LayerAttention::Sliding), Some(local)) => local,
            _ => self.rope,
        }
    }

    /// The window `(left, 0)` of layer `l`'s attention in TE's `window_size` terms (`left =
    /// sliding_window − 1` earlier positions), or `None` for a global layer.
    pub fn layer_window(&self, l: usize) -> Option<(i64, i64)> {
        match (self.layer_types.get(l), self.sliding_window) {
            (Some(LayerAttention::Sliding), Some(w)) => Some((w as i64 - 1, 0)),
            _ => None,
        }
    }

    /// Checks the configuration: sizes ≥ 1, groups that divide the heads, an even head
    /// dimension of at most [`MAX_HEAD_DIM`], one layer type per layer, a window ≥ 1 when a
    /// layer slides, finite positive epsilon, RoPE parameters, scalar and softcaps, special
    /// tokens inside the vocabulary.
    ///
    /// # Errors
    /// [`DecoderError::Config`] naming the field (its Hugging Face key) and what to change.
    pub fn validate(&self) -> DecoderResult<()> {
        let bad = |field: &str, message: String| Err(DecoderError::config(field, message));
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.ffn_hidden_size),
            ("num_hidden_layers", self.num_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_gqa_groups),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((field, _)) = sizes.iter().find(|(_, n)| *n == 0) {
            return bad(field, "0; must be ≥ 1".into());
        }
        if let Some((field, n)) = sizes.iter().find(|(_, n)| *n > MAX_SIZE) {
            return bad(field, format!("{n}; at most {MAX_SIZE}"));
        }
        if self.num_layers > MAX_LAYERS {
            return bad("num_hidden_layers", format!("{}; at most {MAX_LAYERS}", self.num_layers));
        }
        if self.num_attention_heads % self.num_gqa_groups != 0 {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads = {}: each key/value head serves a whole group of query \
                     heads",
                    self.num_gqa_groups, self.num_attention_heads
                ),
            );
        }
        if self.head_dim % 2 != 0 || self.head_dim > MAX_HEAD_DIM {
            return bad(
                "head_dim",
                format!("{}; RoPE rotates channel pairs, so it must be even and at most {MAX_HEAD_DIM}", self.head_dim),
            );
        }
        if !(self.layernorm_epsilon.is_finite() && self.layernorm_epsilon > 0.0) {
            return bad("rms_norm_eps", format!("{}; must be a finite number > 0", self.layernorm_epsilon));
        }
        self.rope.validate("rope")?;
        if let Some(local) = &self.rope_local {
            local.validate("rope_local")?;
        }
        if self.layer_types.len() != self.num_layers {
            return bad(
                "layer_types",
                format!(
                    "{} entries for num_hidden_layers = {}: give one per layer",
                    self.layer_types.len(),
                    self.num_layers
                ),
            );
        }
        let slides = self.layer_types.contains(&LayerAttention::Sliding);
        match self.sliding_window {
            Some(0) => return bad("sliding_window", "0; must be ≥ 1 (a query attends at least itself)".into()),
            None if slides => {
                return bad(
                    "sliding_window",
                    "missing: layer_types has sliding_attention layers, which need a window".into(),
                )
            }
            _ => {}
        }
        let positive = |x: Option<f32>| x.is_none_or(|v| v.is_finite() && v > 0.0);
        for (field, value) in [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("final_logit_softcapping", self.final_logit_softcapping),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
        ] {
            if !positive(value) {
                return bad(field, format!("{value:?}; must be a finite number > 0 (or null)"));
            }
        }
        let ids = self
            .bos_token_id
            .iter()
            .map(|&t| ("bos_token_id", t))
            .chain(self.eos_token_ids.iter().map(|&t| ("eos_token_id", t)));
        for (field, id) in ids {
            if id as usize >= self.vocab_size {
                return bad(field, format!("{id} is outside the vocabulary of {} tokens", self.vocab_size));
            }
        }
        Ok(())
    }

    /// Parameters of the model (the embedding once when tied), computed in u128 and saturated.
    pub fn num_parameters(&self) -> u64 {
        let [h, v, f, d] = [self.hidden_size, self.vocab_size, self.ffn_hidden_size, self.head_dim].map(|x| x as u128);
        let [qkv, attn, fc1] = [self.qkv_size(), self.attention_size(), self.fc1_size()].map(|x| x as u128);
        let norm = if self.normalization == NormKind::LayerNorm { 2 * h } else { h };
        let flag = |on: bool, n: u128| if on { n } else { 0 };
        let layer = (qkv + attn + fc1) * h
            + h * f
            + 2 * norm
            + flag(self.sandwich_norm, 2 * norm)
            + flag(self.qk_norm, 2 * d)
            + flag(self.qkv_bias, qkv)
            + flag(self.proj_bias, h)
            + flag(self.mlp_bias, fc1 + h);
        let embeddings = v * h * if self.tie_word_embeddings { 1 } else { 2 };
        let total = embeddings + self.num_layers as u128 * layer + norm;
        u64::try_from(total).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::decoder::rope::RopeScaling;

    /// A small valid Gemma-3-shaped configuration.
    pub(crate) fn gemma_like() -> DecoderConfig {
        DecoderConfig {
            vocab_size: 64,
            hidden_size: 32,
            ffn_hidden_size: 48,
            num_layers: 3,
            num_attention_heads: 4,
            num_gqa_groups: 2,
            head_dim: 16,
            normalization: NormKind::RmsNorm,
            layernorm_epsilon: 1e-6,
            zero_centered_gamma: true,
            sandwich_norm: true,
            qk_norm: true,
            activation: DecoderActivation::Geglu,
            rope: RopeConfig { theta: 1e6, scaling: RopeScaling::Linear { factor: 2.0 } },
            rope_local: Some(RopeConfig::new(1e4)),
            layer_types: vec![LayerAttention::Sliding, LayerAttention::Global, LayerAttention::Sliding],
            sliding_window: Some(4),
            qkv_bias: false,
            proj_bias: false,
            mlp_bias: false,
            tie_word_embeddings: true,
            scale_embeddings: true,
            query_pre_attn_scalar: Some(24.0),
            final_logit_softcapping: Some(30.0),
            attn_logit_softcapping: None,
            max_position_embeddings: 128,
            bos_token_id: Some(2),
            eos_token_ids: vec![1, 3],
        }
    }

    #[test]
    fn derived_sizes_and_per_layer_settings() {
        let c = gemma_like();
        c.validate().unwrap();
        assert_eq!((c.qkv_size(), c.attention_size(), c.fc1_size()), ((4 + 4) * 16, 64, 96));
        assert_eq!(c.softmax_scale(), (1.0 / 24f64.sqrt()) as f32);
        assert_eq!(c.embedding_scale(DType::F32), 32f32.sqrt());
        assert_eq!(c.embedding_scale(DType::BF16), round_to(DType::BF16, 32f32.sqrt()));
        assert_eq!((c.layer_window(0), c.layer_window(1)), (Some((3, 0)), None));
        assert_eq!((c.layer_rope(0).theta, c.layer_rope(1).theta), (1e4, 1e6));
        let unscaled = DecoderConfig { scale_embeddings: false, ..c.clone() };
        assert_eq!(unscaled.embedding_scale(DType::BF16), 1.0);
        // Embedding (tied) + 3 layers + final norm.
        let layer = 128 * 32 + 64 * 32 + 96 * 32 + 32 * 48 + 4 * 32 + 2 * 16;
        assert_eq!(c.num_parameters(), (64 * 32 + 3 * layer + 32) as u64);
        assert!(DecoderActivation::ALL.iter().filter(|a| a.is_gated()).count() == 4);
        assert_eq!(DecoderActivation::Geglu.te_activation(), Some(te_codegen::spec::Activation::Geglu));
        assert_eq!((DecoderActivation::Silu.function())(0.0), 0.0);
    }

    #[test]
    fn validation_names_the_field() {
        let err = |c: DecoderConfig| c.validate().unwrap_err().to_string();
        let c = gemma_like();
        assert!(err(DecoderConfig { num_gqa_groups: 3, ..c.clone() }).contains("num_key_value_heads"));
        assert!(err(DecoderConfig { head_dim: 15, ..c.clone() }).contains("head_dim"));
        assert!(err(DecoderConfig { head_dim: 512, ..c.clone() }).contains("at most 256"));
        assert!(err(DecoderConfig { hidden_size: 0, ..c.clone() }).contains("hidden_size"));
        assert!(err(DecoderConfig { vocab_size: MAX_SIZE + 1, ..c.clone() }).contains("vocab_size"));
        assert!(err(DecoderConfig { num_layers: MAX_LAYERS + 1, ..c.clone() }).contains("num_hidden_layers"));
        assert!(err(DecoderConfig { sliding_window: Some(0), ..c.clone() }).contains("sliding_window"));
        assert!(err(DecoderConfig { sliding_window: None, ..c.clone() }).contains("sliding_window"));
        assert!(err(DecoderConfig { layer_types: vec![LayerAttention::Global], ..c.clone() }).contains("layer_types"));
        assert!(err(DecoderConfig { layernorm_epsilon: -1.0, ..c.clone() }).contains("rms_norm_eps"));
        assert!(err(DecoderConfig { final_logit_softcapping: Some(0.0), ..c.clone() }).contains("final_logit"));
        assert!(err(DecoderConfig { eos_token_ids: vec![64], ..c.clone() }).contains("eos_token_id"));
        assert!(err(DecoderConfig { rope: RopeConfig::new(-1.0), ..c.clone() }).contains("rope.rope_theta"));
        assert!(err(DecoderConfig { rope_local: Some(RopeConfig::new(f32::NAN)), ..c }).contains("rope_local"));
    }
}
