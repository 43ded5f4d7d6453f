//! The softmax mask of one attention call: none, the kernel's causal mask, or for padding masks a
//! `[batch, sq, sk]` byte mask built on the host (nonzero = masked out, TE's convention),
//! uploaded, and kept for the next call with the same lengths and sizes (by this module, and by
//! the device for the other layers of the same batch).

use super::plan::Dims;
use super::{AttnMaskType, MODULE};
use crate::ops::softmax::Mask;
use crate::{Device, Error, Result};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// What an uploaded byte mask was built from.
#[derive(Debug, Clone, PartialEq, Eq)]
struct MaskKey {
    seq_lens: Vec<usize>,
    sq: usize,
    sk: usize,
    causal: bool,
}

/// The last padding mask uploaded.
#[derive(Debug, Default)]
pub(super) struct MaskCache {
    entry: Option<(MaskKey, Arc<CudaSlice<u8>>)>,
}

/// `[seq_lens.len(), sq, sk]` bytes, 1 where query `i` of sequence `b` must not see key `j`: `i`
/// or `j` at or past `seq_lens[b]`, or with `causal`, `j > i`.
pub(super) fn padding_mask(seq_lens: &[usize], sq: usize, sk: usize, causal: bool) -> Vec<u8> {
    let mut mask = vec![1u8; seq_lens.len() * sq * sk];
    for (b, &len) in seq_lens.iter().enumerate() {
        // Query i < len sees keys j < len (and j ≤ i when causal): a prefix of its row.
        for i in 0..sq.min(len) {
            let visible = if causal { len.min(i + 1) } else { len }.min(sk);
            mask[(b * sq + i) * sk..][..visible].fill(0);
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
    /// The softmax mask for `kind` with the call's `seq_lens`, uploading a new byte mask when
    /// the padding lengths or sizes changed.
    ///
    /// # Errors
    /// [`Error::Config`] for `seq_lens` missing with a padding mask or given with another;
    /// [`Error::Shape`] for `seq_lens` not one per sequence or a length above `max(sq, sk)`;
    /// upload failures.
    pub(super) fn mask(
        &mut self,
        dev: &Device,
        kind: AttnMaskType,
        seq_lens: Option<&[usize]>,
        dims: &Dims,
    ) -> Result<Mask<'_>> {
        let Some(seq_lens) = check_seq_lens(kind, seq_lens, dims)? else {
            return Ok(if kind.is_causal() { Mask::Causal } else { Mask::None });
        };
        let (sq, sk) = (dims.sq, dims.sk);
        let key = MaskKey { seq_lens: seq_lens.to_vec(), sq, sk, causal: kind.is_causal() };
        let entry = match self.entry.take() {
            Some((cached, mask)) if cached == key => (cached, mask),
            _ => {
                let mut id: Vec<u64> = [sq, sk, usize::from(key.causal)].iter().map(|&v| v as u64).collect();
                id.extend(seq_lens.iter().map(|&l| l as u64));
                let mask = dev.upload_cached(&id, || padding_mask(seq_lens, sq, sk, key.causal))?;
                (key, mask)
            }
        };
        Ok(Mask::Padding(&self.entry.insert(entry).1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
