//! Which backend runs an attention call (TE's `get_attention_backend` in
//! `pytorch/attention/dot_product_attention/utils.py`, reduced to this project's two backends).

use super::{DotProductAttentionConfig, MODULE};
use te_codegen::{Arch, DType};
use te_runtime::ops::flash_attention::unsupported_reason;
use te_runtime::{Error, Result};

/// The attention backend (TE's `NVTE_FLASH_ATTN` / `NVTE_FUSED_ATTN` / `NVTE_UNFUSED_ATTN`
/// switches).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum AttentionBackend {
    /// The fused kernels wherever they support the call, else the unfused backend. Setting
    /// `NVTE_FUSED_ATTN=0` or `NVTE_FLASH_ATTN=0` in the environment turns the fused kernels
    /// off (our one fused backend stands for both of TE's).
    #[default]
    Auto,
    /// The FlashAttention-2 kernels ([`te_runtime::ops::flash_attention`]); a call they do not
    /// support is an [`Error::Config`] saying why.
    Fused,
    /// Batched GEMMs around the softmax kernel, `P` kept for backward.
    Unfused,
}

impl AttentionBackend {
    /// `"auto"`, `"fused"` or `"unfused"`.
    pub fn name(self) -> &'static str {
        match self {
            AttentionBackend::Auto => "auto",
            AttentionBackend::Fused => "fused",
            AttentionBackend::Unfused => "unfused",
        }
    }
}

/// Whether the environment turns the fused backend off.
fn env_disables_fused() -> bool {
    ["NVTE_FUSED_ATTN", "NVTE_FLASH_ATTN"].iter().any(|v| std::env::var(v).is_ok_and(|s| s.trim() == "0"))
}

/// Why the fused kernels cannot run a call of `dtype` on `arch` (`training`: a backward may
/// follow), or `None`. Attention dropout runs in both backends.
pub(super) fn fused_unsupported(
    cfg: &DotProductAttentionConfig,
    dtype: DType,
    arch: Arch,
    training: bool,
) -> Option<String> {
    unsupported_reason(arch, dtype, cfg.kv_channels, cfg.kv_channels_v(), training)
}

/// The backend (never `Auto`) for a call of `dtype` on `arch`.
///
/// # Errors
/// [`Error::Config`] when [`AttentionBackend::Fused`] is forced for a call it does not support.
pub(super) fn select(
    cfg: &DotProductAttentionConfig,
    dtype: DType,
    arch: Arch,
    training: bool,
) -> Result<AttentionBackend> {
    let why = fused_unsupported(cfg, dtype, arch, training);
    match (cfg.backend, why) {
        (AttentionBackend::Unfused, _) => Ok(AttentionBackend::Unfused),
        (AttentionBackend::Fused, None) => Ok(AttentionBackend::Fused),
        (AttentionBackend::Fused, Some(why)) => Err(Error::Config {
            module: MODULE,
            message: format!("backend = fused was forced, but {why}: use AttentionBackend::Auto or Unfused"),
        }),
        (AttentionBackend::Auto, None) if !env_disables_fused() => Ok(AttentionBackend::Fused),
        (AttentionBackend::Auto, _) => Ok(AttentionBackend::Unfused),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_fused_where_it_applies_and_forcing_it_elsewhere_is_an_error() {
        let cfg = DotProductAttentionConfig::new(8, 128);
        let fused = if env_disables_fused() { AttentionBackend::Unfused } else { AttentionBackend::Fused };
        assert_eq!(select(&cfg, DType::BF16, Arch::Sm90a, true).unwrap(), fused);
        assert_eq!(select(&cfg, DType::F32, Arch::Sm90a, true).unwrap(), AttentionBackend::Unfused);
        // Head dim 256 trains fused on Hopper only; Ada runs its inference fused and its training
        // unfused.
        let d256 = DotProductAttentionConfig::new(8, 256);
        assert_eq!(select(&d256, DType::F16, Arch::Sm90a, true).unwrap(), fused);
        assert_eq!(select(&d256, DType::F16, Arch::Sm89, true).unwrap(), AttentionBackend::Unfused);
        assert_eq!(select(&d256, DType::F16, Arch::Sm89, false).unwrap(), fused);
        let forced =
            DotProductAttentionConfig { backend: AttentionBackend::Fused, ..DotProductAttentionConfig::new(8, 80) };
        match select(&forced, DType::BF16, Arch::Sm89, true) {
            Err(Error::Config { message, .. }) => assert!(message.contains("head_dim = 80"), "{message}"),
            other => panic!("expected a config error, got {other:?}"),
        }
        let unfused = DotProductAttentionConfig { backend: AttentionBackend::Unfused, ..cfg };
        assert_eq!(select(&unfused, DType::BF16, Arch::Sm89, true).unwrap(), AttentionBackend::Unfused);
    }
}
