//! The softmax mask of one unfused attention call: none, the kernel's (top-left) causal mask, or
//! for every other mask (padding, bottom-right, sliding windows) a `[batch, sq, sk]` byte mask
//! built on the host (nonzero = masked out, TE's convention), uploaded, and kept for the next call
//! with the same lengths and sizes (by this module, and by the device for the other layers of the
//! same batch).

use super::plan::Dims;
use super::{AttnMaskType, MODULE};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::MaskKind;
use te_runtime::ops::softmax::Mask;
use te_runtime::{Device, Error, Result};

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

/// `[batch, sq, sk]` bytes, 1 where query `i` of sequence `b` must not see key `j` (the rule of
/// [`AttnMaskType`] and [`te_reference::attention::AttentionCase::attends`]): each query
/// sees one contiguous range of keys, `[t − left, t + right]` around its diagonal `t` (causal:
/// right = 0), cut to the valid keys; queries past the valid ones see nothing. `seq_lens` gives
/// the valid positions of each sequence for padding masks (`None`: `sq` and `sk`).
pub(super) fn byte_mask(
    kind: AttnMaskType,
    window: (i64, i64),
    seq_lens: Option<&[usize]>,
    batch: usize,
    sq: usize,
    sk: usize,
) -> Vec<u8> {
    let mut mask = vec![1u8; batch * sq * sk];
    let (left, right) = window;
    for b in 0..batch {
        let (lq, lk) = seq_lens.map_or((sq, sk), |lens| (lens[b].min(sq), lens[b].min(sk)));
        let offset = if kind.is_bottom_right() { lk as i64 - lq as i64 } else { 0 };
        for i in 0..lq {
            let t = i as i64 + offset;
            let mut hi = lk as i64; // exclusive
            if kind.is_causal() {
                hi = hi.min(t + 1);
            }
            if right >= 0 {
                hi = hi.min(t + right + 1);
            }
            let lo = if left >= 0 { (t - left).max(0) } else { 0 };
            if lo < hi {
                mask[(b * sq + i) * sk..][lo as usize..hi as usize].fill(0);
            }
        }
    }
    mask
}

/// `seq_lens` after checking them against the mask and sizes: `Some` for padding masks.
///
/// # Errors
/// [`Error::Config`] for `seq_lens` missing with a padding mask or given with another;
/// [`Error::Shape`] for `seq_lens` not one per sequence or a length above `max(sq, sk)`.
pub(super) fn check_seq_lens<'a>(
    kind: AttnMaskType,
    seq_lens: Option<&'a [usize]>,
    dims: &Dims,
) -> Result<Option<&'a [usize]>> {
    let config = |message: String| Err(Error::Config { module: MODULE, message });
    let seq_lens = match (kind, seq_lens) {
        (_, None) if !kind.is_padding() => return Ok(None),
        (_, Some(lens)) if kind.is_padding() => lens,
        (_, Some(_)) => {
            return config(format!(
                "seq_lens are only read by padding masks; attn_mask_type = {} takes None (or configure padding / \
                 padding_causal)",
                kind.name()
            ))
        }
        (_, None) => {
            return config(format!(
                "attn_mask_type = {} needs seq_lens: the valid length of each sequence of the batch",
                kind.name()
            ))
        }
    };
    let (sq, sk) = (dims.sq, dims.sk);
    let shape_error = |message: String| Err(Error::Shape { op: MODULE, message });
    if seq_lens.len() != dims.batch {
        return shape_error(format!(
            "seq_lens must hold one length per sequence ({}), got {}",
            dims.batch,
            seq_lens.len()
        ));
    }
    if let Some((b, &len)) = seq_lens.iter().enumerate().find(|(_, &len)| len > sq.max(sk)) {
        return shape_error(format!("seq_lens[{b}] = {len} exceeds the sequence lengths (sq = {sq}, sk = {sk})"));
    }
    Ok(Some(seq_lens))
}

impl MaskCache {
    /// The softmax mask for `kind` with the resolved `window` and the call's `seq_lens`,
    /// uploading a new byte mask when the mask, lengths or sizes changed.
    ///
    /// # Errors
    /// [`Error::Config`] for `seq_lens` missing with a padding mask or given with another;
    /// [`Error::Shape`] for `seq_lens` not one per sequence or a length above `max(sq, sk)`;
    /// upload failures.
    pub(super) fn mask(
        &mut self,
        dev: &Device,
        kind: AttnMaskType,
        window: (i64, i64),
        seq_lens: Option<&[usize]>,
        dims: &Dims,
    ) -> Result<Mask<'_>> {
        let seq_lens = check_seq_lens(kind, seq_lens, dims)?;
        match kernel_mask(kind, window) {
            MaskKind::None => return Ok(Mask::None),
            MaskKind::Causal => return Ok(Mask::Causal),
            MaskKind::Padding => {}
        }
        let (batch, sq, sk) = (dims.batch, dims.sq, dims.sk);
        let key = MaskKey { seq_lens: seq_lens.map(<[usize]>::to_vec), batch, sq, sk, kind, window };
        let entry = match self.entry.take() {
            Some((cached, mask)) if cached == key => (cached, mask),
            _ => {
                let kind_index = AttnMaskType::ALL.iter().position(|&k| k == kind).unwrap_or(0);
                let mut id: Vec<u64> = [batch, sq, sk, kind_index].iter().map(|&v| v as u64).collect();
                id.extend([window.0, window.1].map(|w| w as u64));
                id.extend(seq_lens.unwrap_or_default().iter().map(|&l| l as u64));
                let mask = dev.upload_cached(&id, || byte_mask(kind, window, seq_lens, batch, sq, sk))?;
                (key, mask)
            }
        };
        Ok(Mask::Padding(&self.entry.insert(entry).1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_codegen::spec::QkvFormat;

    fn padding_mask(seq_lens: &[usize], sq: usize, sk: usize, causal: bool) -> Vec<u8> {
        let kind = if causal { AttnMaskType::PaddingCausal } else { AttnMaskType::Padding };
        byte_mask(kind, kind.window(None).unwrap(), Some(seq_lens), seq_lens.len(), sq, sk)
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

    /// Every mask type and a few windows against the reference's rule, sq < sk and sq > sk.
    #[test]
    fn byte_masks_match_the_reference_rule() {
        use te_reference::attention::AttentionCase;
        let lens = [5, 2, 0];
        for (sq, sk) in [(3, 6), (6, 3), (4, 4)] {
            for kind in AttnMaskType::ALL {
                for window in [None, Some((1, 0)), Some((0, 0)), Some((2, 1)), Some((-1, -1))] {
                    let Ok(window) = kind.window(window) else { continue };
                    let seq_lens = kind.is_padding().then_some(&lens[..]);
                    let m = byte_mask(kind, window, seq_lens, 3, sq, sk);
                    let case = AttentionCase {
                        format: QkvFormat::Bshd,
                        batch: 3,
                        sq,
                        sk,
                        heads: 1,
                        groups: 1,
                        head_dim: 1,
                        head_dim_v: 1,
                        mask: kind,
                        seq_lens,
                        scale: 1.0,
                        window,
                    };
                    for (b, i, j) in (0..3).flat_map(|b| (0..sq).flat_map(move |i| (0..sk).map(move |j| (b, i, j)))) {
                        let masked = m[(b * sq + i) * sk + j] != 0;
                        assert_eq!(
                            masked,
                            !case.attends(b, i, j),
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
