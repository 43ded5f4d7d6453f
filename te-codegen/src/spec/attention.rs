//! Attention vocabulary (TE `DotProductAttention`'s `qkv_format` and `attn_mask_type`): the
//! layout of q, k, v and the mask. The runtime's attention module takes them as configuration
//! (re-exported from `te_runtime::modules`); attention kernel specs specialize on them. The
//! softmax kernel's own mask is [`MaskKind`] ([`AttnMaskType::kernel_mask`] maps one to the other).

use super::MaskKind;
use serde::{Deserialize, Serialize};

/// Memory layout of q, k, v and the output (TE `qkv_format`; `thd` is not supported yet).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QkvFormat {
    /// `[batch, seq, heads, head_dim]`.
    Bshd,
    /// `[seq, batch, heads, head_dim]` (TE's default, Megatron's layout).
    Sbhd,
}

impl QkvFormat {
    /// The shape of a q, k or v tensor of `heads` heads of `head_dim` over `seq` positions.
    pub fn shape(self, batch: usize, seq: usize, heads: usize, head_dim: usize) -> [usize; 4] {
        match self {
            QkvFormat::Bshd => [batch, seq, heads, head_dim],
            QkvFormat::Sbhd => [seq, batch, heads, head_dim],
        }
    }

    /// `(batch, seq)` of a shape [`QkvFormat::shape`] made (the inverse of its placement of
    /// `batch` and `seq`; `heads` and `head_dim` are the last two dimensions in both formats).
    pub fn batch_seq(self, shape: [usize; 4]) -> (usize, usize) {
        match self {
            QkvFormat::Bshd => (shape[0], shape[1]),
            QkvFormat::Sbhd => (shape[1], shape[0]),
        }
    }

    /// The layout in words (`"[batch, seq, heads, head_dim] (bshd)"`, ...), for error messages
    /// that say which shape a tensor must have.
    pub fn describe(self) -> &'static str {
        match self {
            QkvFormat::Bshd => "[batch, seq, heads, head_dim] (bshd)",
            QkvFormat::Sbhd => "[seq, batch, heads, head_dim] (sbhd)",
        }
    }
}

/// The attention mask (TE `attn_mask_type`). Masked-out keys get probability 0; a query whose
/// keys are all masked gets a zero output (TE's convention: `true` = masked out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnMaskType {
    /// Every query attends every key (`no_mask`).
    NoMask,
    /// Query `i` attends keys `j <= i`, top-left aligned (`causal`, as TE's softmax kernels).
    Causal,
    /// Sequence `b` has `seq_lens[b]` valid positions: keys `j >= seq_lens[b]` are masked out
    /// and queries `i >= seq_lens[b]` give zeros (`padding`).
    Padding,
    /// Both (`padding_causal`).
    PaddingCausal,
}

impl AttnMaskType {
    /// Whether the mask needs the sequence lengths.
    pub fn is_padding(self) -> bool {
        matches!(self, AttnMaskType::Padding | AttnMaskType::PaddingCausal)
    }

    /// The mask of the softmax kernel: a padding mask is a byte mask (causal included).
    pub fn kernel_mask(self) -> MaskKind {
        match self {
            AttnMaskType::NoMask => MaskKind::None,
            AttnMaskType::Causal => MaskKind::Causal,
            AttnMaskType::Padding | AttnMaskType::PaddingCausal => MaskKind::Padding,
        }
    }

    /// Whether the mask is causal.
    pub fn is_causal(self) -> bool {
        matches!(self, AttnMaskType::Causal | AttnMaskType::PaddingCausal)
    }

    /// TE's name.
    pub fn name(self) -> &'static str {
        match self {
            AttnMaskType::NoMask => "no_mask",
            AttnMaskType::Causal => "causal",
            AttnMaskType::Padding => "padding",
            AttnMaskType::PaddingCausal => "padding_causal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_place_batch_and_seq() {
        assert_eq!(QkvFormat::Bshd.shape(2, 7, 4, 8), [2, 7, 4, 8]);
        assert_eq!(QkvFormat::Sbhd.shape(2, 7, 4, 8), [7, 2, 4, 8]);
        for f in [QkvFormat::Bshd, QkvFormat::Sbhd] {
            assert_eq!(f.batch_seq(f.shape(2, 7, 4, 8)), (2, 7));
        }
        assert!(AttnMaskType::PaddingCausal.is_padding() && AttnMaskType::PaddingCausal.is_causal());
        assert!(!AttnMaskType::Causal.is_padding() && !AttnMaskType::Padding.is_causal());
    }
}
