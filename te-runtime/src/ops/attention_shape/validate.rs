//! The checks of an [`AttentionShape`], each in one place: the shape itself, the host lengths of a
//! call's sequences, and the sequence tables a kernel call passes.

use super::{AttentionShape, QkvLayout};
use crate::{Error, Result};

impl AttentionShape {
    /// Checks the shape; errors name `op`, the caller.
    ///
    /// # Errors
    /// - [`Error::Shape`]: a size of 0 (`batch`, `sq`, `sk`, `heads`, `groups`, either head dim),
    ///   `groups` not dividing `heads`.
    /// - [`Error::Argument`]: `scale` not finite and positive; dropout `p` outside `(0, 1]`; a
    ///   window bound below −1, or a window the mask does not take (TE's `check_set_window_size`,
    ///   [`AttnMaskType::window`](te_codegen::spec::AttnMaskType::window): causal masks `(left, 0)`, the others `(-1, -1)` or both bounds
    ///   ≥ 0).
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let argument = |message: String| Err(Error::Argument { op, message });
        let sizes = [self.batch, self.sq, self.sk, self.heads, self.groups];
        if sizes.contains(&0) || self.heads % self.groups != 0 {
            return Err(Error::Shape {
                op,
                message: format!(
                    "batch, sq, sk, heads and groups must be ≥ 1 with groups dividing heads (each key/value head \
                     serves heads / groups query heads), got {}, {}, {}, {} and {}",
                    self.batch, self.sq, self.sk, self.heads, self.groups
                ),
            });
        }
        if self.head_dim == 0 || self.head_dim_v == 0 {
            return Err(Error::Shape {
                op,
                message: format!("head_dim and head_dim_v must be ≥ 1, got {} and {}", self.head_dim, self.head_dim_v),
            });
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return argument(format!("softmax_scale must be finite and > 0, got {}", self.scale));
        }
        if let Some(d) = self.dropout {
            if !(d.p > 0.0 && d.p <= 1.0) {
                return argument(format!("attention dropout p must be in (0, 1] (None for no dropout), got {}", d.p));
            }
        }
        match self.mask.window(Some(self.window)) {
            Ok(w) if w == self.window => Ok(()),
            Ok(w) => argument(format!(
                "attn_mask_type = {} resolves window {:?} to {w:?}: set the resolved window (AttentionShape::with_mask \
                 resolves TE's window_size)",
                self.mask.name(),
                self.window
            )),
            Err(message) => argument(message),
        }
    }

    /// Checks the host lengths of a call's sequences against the mask and the layout: padding
    /// masks on bshd / sbhd need `seq_lens`, the valid length of each sequence, at most `max(sq,
    /// sk)` ([`AttentionShape::valid_lengths`] caps it by each); other masks and `thd` (whose
    /// lengths are its `cu_seqlens`) take none.
    ///
    /// # Errors
    /// [`Error::Config`] (naming `op`) for `seq_lens` missing with a padding mask or given with
    /// another mask or `thd`; [`Error::Shape`] for `seq_lens` not one per sequence or a length above
    /// `max(sq, sk)`.
    pub fn check_seq_lens(&self, op: &'static str, seq_lens: Option<&[usize]>) -> Result<()> {
        let config = |message: String| Err(Error::Config { module: op, message });
        let needs = self.mask.is_padding() && self.layout != QkvLayout::Thd;
        let lens = match seq_lens {
            None if !needs => return Ok(()),
            None => {
                return config(format!(
                    "attn_mask_type = {} needs seq_lens: the valid length of each sequence of the batch",
                    self.mask.name()
                ))
            }
            Some(_) if self.layout == QkvLayout::Thd => {
                return config("thd reads the lengths of its sequences from cu_seqlens: pass no seq_lens".into())
            }
            Some(_) if !needs => {
                return config(format!(
                    "seq_lens are only read by padding masks; attn_mask_type = {} takes None (or configure padding / \
                     padding_causal)",
                    self.mask.name()
                ))
            }
            Some(lens) => lens,
        };
        let shape = |message: String| Err(Error::Shape { op, message });
        if lens.len() != self.batch {
            return shape(format!("seq_lens must hold one length per sequence ({}), got {}", self.batch, lens.len()));
        }
        let (sq, sk) = (self.sq, self.sk);
        if let Some((b, &len)) = lens.iter().enumerate().find(|(_, &len)| len > sq.max(sk)) {
            return shape(format!("seq_lens[{b}] = {len} exceeds the sequence lengths (sq = {sq}, sk = {sk})"));
        }
        Ok(())
    }

    /// Checks which sequence tables a kernel call passes against the layout and the mask:
    /// `cu_seqlens` (the valid lengths, i32 `[batch + 1]` prefix sums) and, for `thd`, the token
    /// offsets of each sequence. `thd` needs both; bshd / sbhd take `cu_seqlens` with a padding
    /// mask (and need them there), never token offsets.
    ///
    /// # Errors
    /// [`Error::Shape`] (naming `op`) for `thd` without both tables or token offsets on bshd /
    /// sbhd; [`Error::Config`] for `cu_seqlens` missing with a padding mask or given with another.
    pub fn check_tables(&self, op: &'static str, cu_seqlens: bool, offsets: bool) -> Result<()> {
        let shape = |message: String| Err(Error::Shape { op, message });
        let config = |message: String| Err(Error::Config { module: op, message });
        match self.layout {
            QkvLayout::Thd if !(cu_seqlens && offsets) => shape(
                "thd needs cu_seqlens and the token offsets of each sequence (cu_seqlens_*_padded, or the \
                 cu_seqlens themselves)"
                    .into(),
            ),
            QkvLayout::Thd => Ok(()),
            _ if offsets => shape(format!(
                "token offsets place the sequences of thd; q, k and v are {}: set the layout to thd or pass no \
                 offsets",
                self.layout.name()
            )),
            _ if self.mask.is_padding() && !cu_seqlens => config(format!(
                "attn_mask_type = {} needs cu_seqlens: the valid length of each sequence",
                self.mask.name()
            )),
            _ if !self.mask.is_padding() && cu_seqlens => config(format!(
                "cu_seqlens are read by padding masks (and thd); attn_mask_type = {} takes none (or configure a \
                 padding mask)",
                self.mask.name()
            )),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::dropout::DropoutParams;
    use te_codegen::spec::AttnMaskType::*;

    const OP: &str = "test";

    fn shape() -> AttentionShape {
        AttentionShape::new(QkvLayout::Bshd, 2, (3, 5), (4, 2), 8)
    }

    #[test]
    fn validation_errors_are_typed_and_say_what_to_change() {
        shape().validate(OP).unwrap();
        for (bad, says) in [
            (AttentionShape { groups: 3, ..shape() }, "groups dividing heads"),
            (AttentionShape { groups: 0, ..shape() }, "got 2, 3, 5, 4 and 0"),
            (AttentionShape { sk: 0, ..shape() }, "must be ≥ 1"),
        ] {
            let e = bad.validate(OP).unwrap_err();
            assert!(matches!(e, Error::Shape { op: OP, .. }) && e.to_string().contains(says), "{e}");
        }
        let e = shape().with_head_dim_v(0).validate(OP).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("head_dim_v must be ≥ 1"), "{e}");
        let drop = |p| Some(DropoutParams { p, seed: 1, offset: 2 });
        shape().with_dropout(drop(1.0)).validate(OP).unwrap();
        for (bad, says) in [
            (shape().with_scale(0.0), "softmax_scale"),
            (shape().with_scale(f32::NAN), "softmax_scale"),
            (shape().with_dropout(drop(0.0)), "dropout p must be in (0, 1]"),
            (shape().with_dropout(drop(1.5)), "dropout p"),
            (AttentionShape { window: (-2, 0), ..shape() }, "≥ 0, or −1"),
            (AttentionShape { window: (-1, 0), ..shape() }, "set attn_mask_type = causal"),
            (AttentionShape { window: (-1, 4), ..shape().with_mask(Padding, None) }, "one-sided"),
            (
                AttentionShape { window: (-1, -1), ..shape().with_mask(CausalBottomRight, None) },
                "resolves window (-1, -1) to (-1, 0)",
            ),
        ] {
            let e = bad.validate(OP).unwrap_err();
            assert!(matches!(e, Error::Argument { op: OP, .. }) && e.to_string().contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn seq_lens_and_tables_follow_the_mask_and_layout() {
        let padded = shape().with_mask(PaddingCausal, None);
        padded.check_seq_lens(OP, Some(&[5, 0])).unwrap();
        shape().check_seq_lens(OP, None).unwrap();
        let config = |r: Result<()>, says: &str| match r {
            Err(Error::Config { module: OP, message }) => assert!(message.contains(says), "{message}"),
            other => panic!("expected a config error saying {says}, got {other:?}"),
        };
        config(padded.check_seq_lens(OP, None), "needs seq_lens");
        config(shape().check_seq_lens(OP, Some(&[1, 1])), "only read by padding masks");
        let thd = AttentionShape { layout: QkvLayout::Thd, ..padded };
        thd.check_seq_lens(OP, None).unwrap();
        config(thd.check_seq_lens(OP, Some(&[1, 1])), "cu_seqlens");
        let e = padded.check_seq_lens(OP, Some(&[3])).unwrap_err();
        assert!(
            matches!(e, Error::Shape { .. }) && e.to_string().contains("one length per sequence (2), got 1"),
            "{e}"
        );
        let e = padded.check_seq_lens(OP, Some(&[3, 6])).unwrap_err();
        assert!(e.to_string().contains("seq_lens[1] = 6 exceeds"), "{e}");

        padded.check_tables(OP, true, false).unwrap();
        shape().check_tables(OP, false, false).unwrap();
        thd.check_tables(OP, true, true).unwrap();
        config(padded.check_tables(OP, false, false), "needs cu_seqlens");
        config(shape().check_tables(OP, true, false), "read by padding masks");
        for (s, cu, offsets, says) in [
            (thd, true, false, "thd needs"),
            (thd, false, false, "thd needs"),
            (shape(), true, true, "set the layout to thd"),
        ] {
            let e = s.check_tables(OP, cu, offsets).unwrap_err();
            assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(says), "{e}");
        }
    }
}
