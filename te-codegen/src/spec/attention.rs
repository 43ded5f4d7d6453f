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
///
/// With `lq` valid queries and `lk` valid keys in a sequence (`sq`, `sk`, or the padding
/// lengths), the causal masks let query `i` see keys `j <= i + off`, where `off = 0` for the
/// top-left masks (`causal`, `padding_causal`) and `off = lk − lq` for the bottom-right ones
/// (`causal_bottom_right`, `padding_causal_bottom_right`: the last query sees every key, as in
/// decoding with a KV cache). A sliding window (TE `window_size`) uses the same diagonal; for
/// `no_mask` and `padding` it is bottom-right aligned (TE's default `bottom_right_alignment`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttnMaskType {
    /// Every query attends every key (`no_mask`).
    NoMask,
    /// Query `i` attends keys `j <= i`, top-left aligned (`causal`, as TE's softmax kernels).
    Causal,
    /// Query `i` attends keys `j <= i + sk − sq`, bottom-right aligned (`causal_bottom_right`).
    CausalBottomRight,
    /// Sequence `b` has `seq_lens[b]` valid positions: keys `j >= seq_lens[b]` are masked out
    /// and queries `i >= seq_lens[b]` give zeros (`padding`).
    Padding,
    /// Both (`padding_causal`).
    PaddingCausal,
    /// Padding and the bottom-right causal mask over each sequence's valid lengths
    /// (`padding_causal_bottom_right`).
    PaddingCausalBottomRight,
}

impl AttnMaskType {
    /// Every mask type, in TE's order.
    pub const ALL: [AttnMaskType; 6] = [
        AttnMaskType::NoMask,
        AttnMaskType::Causal,
        AttnMaskType::CausalBottomRight,
        AttnMaskType::Padding,
        AttnMaskType::PaddingCausal,
        AttnMaskType::PaddingCausalBottomRight,
    ];

    /// Whether the mask needs the sequence lengths.
    pub fn is_padding(self) -> bool {
        matches!(self, AttnMaskType::Padding | AttnMaskType::PaddingCausal | AttnMaskType::PaddingCausalBottomRight)
    }

    /// The mask of the unfused softmax kernel: the top-left causal mask is the kernel's own, the
    /// others that mask anything are a byte mask built on the host.
    pub fn kernel_mask(self) -> MaskKind {
        match self {
            AttnMaskType::NoMask => MaskKind::None,
            AttnMaskType::Causal => MaskKind::Causal,
            AttnMaskType::CausalBottomRight
            | AttnMaskType::Padding
            | AttnMaskType::PaddingCausal
            | AttnMaskType::PaddingCausalBottomRight => MaskKind::Padding,
        }
    }

    /// Whether the mask is causal (either alignment).
    pub fn is_causal(self) -> bool {
        matches!(
            self,
            AttnMaskType::Causal
                | AttnMaskType::PaddingCausal
                | AttnMaskType::CausalBottomRight
                | AttnMaskType::PaddingCausalBottomRight
        )
    }

    /// Whether the diagonal (of the causal mask and of a sliding window) is bottom-right aligned:
    /// every mask but `causal` and `padding_causal`.
    pub fn is_bottom_right(self) -> bool {
        !matches!(self, AttnMaskType::Causal | AttnMaskType::PaddingCausal)
    }

    /// TE's name.
    pub fn name(self) -> &'static str {
        match self {
            AttnMaskType::NoMask => "no_mask",
            AttnMaskType::Causal => "causal",
            AttnMaskType::CausalBottomRight => "causal_bottom_right",
            AttnMaskType::Padding => "padding",
            AttnMaskType::PaddingCausal => "padding_causal",
            AttnMaskType::PaddingCausalBottomRight => "padding_causal_bottom_right",
        }
    }

    /// The sliding window `(left, right)` of this mask for TE's `window_size` (TE
    /// `check_set_window_size`): `None` is no window, `(−1, −1)` or `(−1, 0)` for the causal
    /// masks; −1 means unbounded. Causal masks see no key past the diagonal, so their window is
    /// `(left, 0)`.
    ///
    /// # Errors
    /// A message saying what to change for a bound below −1, a causal mask with a right bound
    /// other than 0 (or −1 with left −1), `(−1, 0)` on a non-causal mask (that is the causal mask:
    /// configure one), or a non-causal window with exactly one unbounded side (TE refuses it).
    pub fn window(self, window_size: Option<(i64, i64)>) -> Result<(i64, i64), String> {
        let causal = self.is_causal();
        let Some((left, right)) = window_size else {
            return Ok(if causal { (-1, 0) } else { (-1, -1) });
        };
        if left < -1 || right < -1 {
            return Err(format!("window_size bounds must be ≥ 0, or −1 for unbounded, got ({left}, {right})"));
        }
        match (causal, left, right) {
            (true, -1, -1) => Ok((-1, 0)),
            (true, _, 0) => Ok((left, 0)),
            (true, _, _) => Err(format!(
                "attn_mask_type = {} sees no key past the diagonal: window_size must be (left, 0) or (-1, -1), got                  ({left}, {right})",
                self.name()
            )),
            (false, -1, 0) => Err(format!(
                "window_size (-1, 0) is the causal mask: set attn_mask_type = causal (or {}), or give a window                  (left, right) with both bounds ≥ 0",
                if self.is_padding() { "padding_causal" } else { "causal_bottom_right" }
            )),
            (false, -1, -1) => Ok((-1, -1)),
            (false, l, r) if l >= 0 && r >= 0 => Ok((l, r)),
            (false, _, _) => Err(format!(
                "attn_mask_type = {} takes window_size (-1, -1) or (left, right) with both bounds ≥ 0, got ({left},                  {right}) (TE refuses a one-sided window without a causal mask)",
                self.name()
            )),
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
        assert!(AttnMaskType::PaddingCausalBottomRight.is_padding() && AttnMaskType::CausalBottomRight.is_causal());
        assert!(!AttnMaskType::PaddingCausal.is_bottom_right() && AttnMaskType::NoMask.is_bottom_right());
    }

    #[test]
    fn windows_follow_te_check_set_window_size() {
        use AttnMaskType::*;
        assert_eq!(Causal.window(None), Ok((-1, 0)));
        assert_eq!(NoMask.window(None), Ok((-1, -1)));
        assert_eq!(PaddingCausalBottomRight.window(Some((-1, -1))), Ok((-1, 0)));
        assert_eq!(CausalBottomRight.window(Some((128, 0))), Ok((128, 0)));
        assert_eq!(Padding.window(Some((3, 5))), Ok((3, 5)));
        assert!(Causal.window(Some((4, 2))).unwrap_err().contains("(left, 0)"));
        assert!(NoMask.window(Some((-1, 0))).unwrap_err().contains("attn_mask_type = causal"));
        assert!(Padding.window(Some((-1, 4))).unwrap_err().contains("one-sided"));
        assert!(NoMask.window(Some((-2, 4))).unwrap_err().contains("≥ 0, or −1"));
        let names: std::collections::BTreeSet<&str> = AttnMaskType::ALL.iter().map(|m| m.name()).collect();
        assert_eq!(names.len(), 6, "one TE name per mask type");
    }
}
