//! The softmax mask of one unfused attention call: none, the kernel's (top-left) causal mask, or
//! for every other mask (padding, bottom-right, sliding windows) a `[batch, sq, sk]` byte mask
//! built on the host (nonzero = masked out, TE's convention), uploaded, and kept for the next call
//! with the same lengths and sizes (by this module, and by the device for the other layers of the
//! same batch).

use super::{AttnMaskType, MODULE};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::MaskKind;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::softmax::Mask;
use te_runtime::{Device, Result};

/// What an uploaded byte mask was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MaskKey {
    seq_lens: Option<Vec<usize>>,
    batch: usize,
    sq: usize,
    sk: usize,
    kind: AttnMaskType,
    window: (i64, i64),
}

/// The last padding mask uploaded.
#[derive(Debug, Default)]
pub(super) struct MaskCache {
    entry: Option<(MaskKey, Arc<CudaSlice<u8>>)>,
}

/// The softmax kernel's mask for `kind` with the resolved `window`: its own for `no_mask` and
/// the top-left `causal` without a window, else a byte mask ([`MaskKind::Padding`]).
pub(super) fn kernel_mask(kind: AttnMaskType, window: (i64, i64)) -> MaskKind {
    match kind.window(None) {
        Ok(plain) if plain == window => kind.kernel_mask(),
        _ => MaskKind::Padding,
    }
}

/// `[batch, sq, sk]` bytes, 1 where query `i` of sequence `b` must not see key `j`: outside the
/// one contiguous range of keys [`AttentionShape::keys`] gives it (the rule of
/// [`AttentionShape::attends`], which the oracle and the fused kernels follow), for the valid
/// lengths of each sequence ([`AttentionShape::valid_lengths`]: `seq_lens` of padding masks, else
/// `sq` and `sk`).
pub(super) fn byte_mask(shape: &AttentionShape, seq_lens: Option<&[usize]>) -> Vec<u8> {
    let (batch, sq, sk) = (shape.batch, shape.sq, shape.sk);
    let mut mask = vec![1u8; batch * sq * sk];
    for b in 0..batch {
        let lengths = shape.valid_lengths(seq_lens.and_then(|lens| lens.get(b).copied()));
        for i in 0..lengths.0 {
            mask[(b * sq + i) * sk..][shape.keys(lengths, i)].fill(0);
        }
    }
    mask
}

impl MaskCache {
    /// The softmax mask for the call `shape` (its mask and resolved window) with its `seq_lens`,
    /// uploading a new byte mask when the mask, lengths or sizes changed.
    ///
    /// # Errors
    /// [`AttentionShape::check_seq_lens`]'s; upload failures.
    pub(super) fn mask(
        &mut self,
        dev: &Device,
        shape: &AttentionShape,
        seq_lens: Option<&[usize]>,
    ) -> Result<Mask<'_>> {
        shape.check_seq_lens(MODULE, seq_lens)?;
        let (kind, window) = (shape.mask, shape.window);
        match kernel_mask(kind, window) {
            MaskKind::None => return Ok(Mask::None),
            MaskKind::Causal => return Ok(Mask::Causal),
            MaskKind::Padding => {}
        }
        let (batch, sq, sk) = (shape.batch, shape.sq, shape.sk);
        let key = MaskKey { seq_lens: seq_lens.map(<[usize]>::to_vec), batch, sq, sk, kind, window };
        let entry = match self.entry.take() {
            Some((cached, mask)) if cached == key => (cached, mask),
            _ => {
                let kind_index = AttnMaskType::ALL.iter().position(|&k| k == kind).unwrap_or(0);
                // A word of its own first: the device's upload cache serves other callers too.
                let mut id: Vec<u64> = vec![u64::from_le_bytes(*b"attnmask")];
                id.extend([batch, sq, sk, kind_index].iter().map(|&v| v as u64));
                id.extend([window.0, window.1].map(|w| w as u64));
                id.extend(seq_lens.unwrap_or_default().iter().map(|&l| l as u64));
                let mask = dev.upload_cached(&id, || byte_mask(shape, seq_lens))?;
                (key, mask)
            }
        };
        Ok(Mask::Padding(&self.entry.insert(entry).1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_runtime::ops::attention_shape::QkvLayout;

    fn padding_mask(seq_lens: &[usize], sq: usize, sk: usize, causal: bool) -> Vec<u8> {
        let kind = if causal { AttnMaskType::PaddingCausal } else { AttnMaskType::Padding };
        let shape = AttentionShape::new(QkvLayout::Bshd, seq_lens.len(), (sq, sk), (1, 1), 1).with_mask(kind, None);
        byte_mask(&shape, Some(seq_lens))
    }

    #[test]
    fn padding_masks_keys_and_queries_past_the_length() {
        let m = padding_mask(&[3, 1], 3, 4, false);
        #[rustfmt::skip]
        let want = [
            0, 0, 0, 1,   0, 0, 0, 1,   0, 0, 0, 1,
            0, 1, 1, 1,   1, 1, 1, 1,   1, 1, 1, 1,
        ];
        assert_eq!(m, want);
    }

    #[test]
    fn padding_causal_adds_the_top_left_triangle() {
        let m = padding_mask(&[3], 3, 4, true);
        assert_eq!(m, [0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1]);
        assert!(padding_mask(&[0], 2, 2, true).iter().all(|&b| b == 1), "length 0 masks everything");
    }

    /// Every mask type and a few windows against the elementwise rule, sq < sk and sq > sk.
    #[test]
    fn byte_masks_match_the_reference_rule() {
        let lens = [5, 2, 0];
        for (sq, sk) in [(3, 6), (6, 3), (4, 4)] {
            for kind in AttnMaskType::ALL {
                for window in [None, Some((1, 0)), Some((0, 0)), Some((2, 1)), Some((-1, -1))] {
                    let shape = AttentionShape::new(QkvLayout::Bshd, 3, (sq, sk), (1, 1), 1).with_mask(kind, window);
                    if shape.validate(MODULE).is_err() {
                        continue;
                    }
                    let seq_lens = kind.is_padding().then_some(&lens[..]);
                    let m = byte_mask(&shape, seq_lens);
                    for (b, i, j) in (0..3).flat_map(|b| (0..sq).flat_map(move |i| (0..sk).map(move |j| (b, i, j)))) {
                        let lengths = shape.valid_lengths(seq_lens.map(|l| l[b]));
                        let masked = m[(b * sq + i) * sk + j] != 0;
                        assert_eq!(
                            masked,
                            !shape.attends(lengths, i, j),
                            "{} {window:?} {sq}x{sk} ({b}, {i}, {j})",
                            kind.name()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn only_plain_no_mask_and_causal_use_the_kernels_own_mask() {
        assert_eq!(kernel_mask(AttnMaskType::Causal, (-1, 0)), MaskKind::Causal);
        assert_eq!(kernel_mask(AttnMaskType::NoMask, (-1, -1)), MaskKind::None);
        assert_eq!(kernel_mask(AttnMaskType::Causal, (8, 0)), MaskKind::Padding);
        assert_eq!(kernel_mask(AttnMaskType::CausalBottomRight, (-1, 0)), MaskKind::Padding);
        assert_eq!(kernel_mask(AttnMaskType::NoMask, (2, 2)), MaskKind::Padding);
    }
}
