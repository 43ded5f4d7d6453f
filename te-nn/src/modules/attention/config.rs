//! The configuration of `DotProductAttention` (TE's constructor arguments): its defaults, its
//! checks, and the problem ([`AttentionShape`]) it poses for the sizes of a call.

use super::{backend, mask, AttentionBackend, AttnMaskType, QkvFormat, MODULE};
use te_codegen::spec::MaskKind;
use te_codegen::{Arch, DType};
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::{Error, Result};

/// Arguments of [`DotProductAttention::new`](super::DotProductAttention::new) (TE `DotProductAttention(num_attention_heads,
/// kv_channels, num_gqa_groups, attention_dropout, qkv_format, attn_mask_type, softmax_scale)`).
#[derive(Debug, Clone, PartialEq)]
pub struct DotProductAttentionConfig {
    /// Query heads `h`.
    pub num_attention_heads: usize,
    /// Channels per head `d` (head_dim) of q and k, and of v unless `head_dim_v` says otherwise.
    pub kv_channels: usize,
    /// Channels per head of v and the output (TE's `kv_channels = (head_dim_qk, head_dim_v)`,
    /// multi-head latent attention's 192 / 128 for instance); `None` = `kv_channels`. The fused
    /// backend takes it on Hopper ([`te_runtime::ops::flash_attention::FlashAttnParams::shape`]),
    /// the unfused one everywhere; FP8 attention and the fused QKV tensor need one head dim.
    pub head_dim_v: Option<usize>,
    /// Key/value heads `g` (GQA; 1 = MQA); `None` = `num_attention_heads`. Must divide
    /// `num_attention_heads`: query head `i` reads key/value head `i / (h / g)`.
    pub num_gqa_groups: Option<usize>,
    /// Dropout probability on the attention probabilities, in `[0, 1]` (Philox keep mask kept
    /// for backward; TE `attention_dropout`).
    pub attention_dropout: f32,
    /// Layout of q, k, v and the output. TE's default: [`QkvFormat::Sbhd`].
    pub qkv_format: QkvFormat,
    /// The mask. TE's default: [`AttnMaskType::Causal`].
    pub attn_mask_type: AttnMaskType,
    /// Sliding window `(left, right)` (TE `window_size`): query `i` sees keys `j` with `t − left
    /// <= j <= t + right` around its diagonal `t` ([`AttnMaskType`] says which); −1 means
    /// unbounded. `None` (TE's default) is no window. Causal masks take `(left, 0)`; the others
    /// `(left, right)` with both bounds ≥ 0 ([`AttnMaskType::window`] has TE's rules).
    pub window_size: Option<(i64, i64)>,
    /// Multiplies `Q · Kᵀ` before the softmax; `None` = `1 / sqrt(kv_channels)`.
    pub softmax_scale: Option<f32>,
    /// Which backend runs: [`AttentionBackend::Auto`] (the default) picks the fused kernels
    /// wherever they apply, unless the environment says `NVTE_FUSED_ATTN=0` or
    /// `NVTE_FLASH_ATTN=0`.
    pub backend: AttentionBackend,
}

impl DotProductAttentionConfig {
    /// TE's defaults for `num_attention_heads` heads of `kv_channels`: no GQA, no dropout,
    /// `sbhd`, causal, scale `1 / sqrt(kv_channels)`.
    pub fn new(num_attention_heads: usize, kv_channels: usize) -> Self {
        Self {
            num_attention_heads,
            kv_channels,
            head_dim_v: None,
            num_gqa_groups: None,
            attention_dropout: 0.0,
            qkv_format: QkvFormat::Sbhd,
            attn_mask_type: AttnMaskType::Causal,
            window_size: None,
            softmax_scale: None,
            backend: AttentionBackend::Auto,
        }
    }

    /// The sliding window of the mask, `(−1, −1)` or `(−1, 0)` (causal) when there is none; a
    /// window [`DotProductAttentionConfig::validate`] refuses reads as none (no module runs it).
    pub(crate) fn window(&self) -> (i64, i64) {
        let mask = self.attn_mask_type;
        mask.window(self.window_size).unwrap_or(if mask.is_causal() { (-1, 0) } else { (-1, -1) })
    }

    /// The unfused softmax kernel's mask ([`mask::kernel_mask`]).
    pub(crate) fn softmax_mask(&self) -> MaskKind {
        mask::kernel_mask(self.attn_mask_type, self.window())
    }

    /// Channels per head of v and the output.
    pub(crate) fn kv_channels_v(&self) -> usize {
        self.head_dim_v.unwrap_or(self.kv_channels)
    }

    /// Key/value heads.
    pub(crate) fn groups(&self) -> usize {
        self.num_gqa_groups.unwrap_or(self.num_attention_heads)
    }

    /// The softmax scale.
    pub(crate) fn scale(&self) -> f32 {
        self.softmax_scale.unwrap_or(1.0 / (self.kv_channels as f32).sqrt())
    }

    /// The problem of a call of `batch` sequences of `(sq, sk)` queries and keys under this
    /// configuration: its heads, groups and head dims, `qkv_format`, mask with the resolved window,
    /// and scale; no dropout (a forward sets its own stream).
    pub(crate) fn shape(&self, batch: usize, (sq, sk): (usize, usize)) -> AttentionShape {
        let heads = (self.num_attention_heads, self.groups());
        AttentionShape::new(self.qkv_format.into(), batch, (sq, sk), heads, self.kv_channels)
            .with_head_dim_v(self.kv_channels_v())
            .with_mask(self.attn_mask_type, self.window_size)
            .with_scale(self.scale())
    }

    /// Whether training calls in `dtype` on `arch` run on the fused backend.
    pub(crate) fn runs_fused(&self, dtype: DType, arch: Arch) -> bool {
        matches!(backend::select(self, dtype, arch, true), Ok(AttentionBackend::Fused))
    }

    /// Fails for a configuration the module cannot run.
    pub(super) fn validate(&self) -> Result<()> {
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        let (h, d) = (self.num_attention_heads, self.kv_channels);
        if h == 0 || d == 0 || self.kv_channels_v() == 0 {
            return config(format!(
                "num_attention_heads, kv_channels and head_dim_v must be ≥ 1, got {h}, {d} and {}",
                self.kv_channels_v()
            ));
        }
        let g = self.groups();
        if g == 0 || h % g != 0 {
            return config(format!(
                "num_gqa_groups = {g} must divide num_attention_heads = {h} (each key/value head serves h / g query \
                 heads); use a divisor of {h}, or None for one key/value head per query head"
            ));
        }
        if !(0.0..=1.0).contains(&self.attention_dropout) {
            return config(format!("attention_dropout must be in [0, 1], got {}", self.attention_dropout));
        }
        if let Err(message) = self.attn_mask_type.window(self.window_size) {
            return config(message);
        }
        if let Some(s) = self.softmax_scale {
            if !(s.is_finite() && s > 0.0) {
                return config(format!("softmax_scale must be finite and > 0, got {s}"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(cfg: DotProductAttentionConfig) -> String {
        match cfg.validate() {
            Err(Error::Config { module: MODULE, message }) => message,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn defaults_follow_te() {
        let cfg = DotProductAttentionConfig::new(32, 128);
        assert_eq!((cfg.qkv_format, cfg.attn_mask_type), (QkvFormat::Sbhd, AttnMaskType::Causal));
        assert_eq!((cfg.groups(), cfg.scale()), (32, 1.0 / 128f32.sqrt()));
        cfg.validate().unwrap();
        let gqa = DotProductAttentionConfig { num_gqa_groups: Some(8), softmax_scale: Some(0.5), ..cfg };
        gqa.validate().unwrap();
        assert_eq!((gqa.groups(), gqa.scale()), (8, 0.5));
    }

    #[test]
    fn bad_configs_say_what_to_change() {
        let cfg = DotProductAttentionConfig::new(8, 64);
        let e = config_error(DotProductAttentionConfig { num_gqa_groups: Some(3), ..cfg.clone() });
        assert!(e.contains("num_gqa_groups = 3 must divide num_attention_heads = 8"), "{e}");
        let e = config_error(DotProductAttentionConfig { num_gqa_groups: Some(0), ..cfg.clone() });
        assert!(e.contains("num_gqa_groups = 0"), "{e}");
        let e = config_error(DotProductAttentionConfig { attention_dropout: 1.5, ..cfg.clone() });
        assert!(e.contains("attention_dropout must be in [0, 1], got 1.5"), "{e}");
        let e = config_error(DotProductAttentionConfig { attention_dropout: f32::NAN, ..cfg.clone() });
        assert!(e.contains("attention_dropout"), "{e}");
        let e = config_error(DotProductAttentionConfig { softmax_scale: Some(f32::INFINITY), ..cfg.clone() });
        assert!(e.contains("softmax_scale"), "{e}");
        let e = config_error(DotProductAttentionConfig { head_dim_v: Some(0), ..cfg.clone() });
        assert!(e.contains("head_dim_v must be ≥ 1"), "{e}");
        let e = config_error(DotProductAttentionConfig::new(0, 64));
        assert!(e.contains("≥ 1"), "{e}");
        let e = config_error(DotProductAttentionConfig { window_size: Some((4, 4)), ..cfg.clone() });
        assert!(e.contains("window_size must be (left, 0)"), "{e}");
        let no_mask = DotProductAttentionConfig { attn_mask_type: AttnMaskType::NoMask, ..cfg.clone() };
        let e = config_error(DotProductAttentionConfig { window_size: Some((-1, 0)), ..no_mask.clone() });
        assert!(e.contains("set attn_mask_type = causal"), "{e}");
        let windowed = DotProductAttentionConfig { window_size: Some((16, 0)), ..cfg };
        windowed.validate().unwrap();
        assert_eq!((windowed.window(), windowed.softmax_mask()), ((16, 0), MaskKind::Padding));
        assert_eq!((no_mask.window(), no_mask.softmax_mask()), ((-1, -1), MaskKind::None));
    }
}
