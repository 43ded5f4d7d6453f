//! The softmax mask of one attention call: none, the kernel's causal mask, or for padding masks a
//! `[batch, sq, sk]` byte mask built on the host (nonzero = masked out, TE's convention),
//! uploaded, and kept for the next call with the same lengths and sizes.

use super::plan::Dims;
use super::{AttnMaskType, MODULE};
use crate::ops::softmax::Mask;
use crate::{Device, Error, Result};
use cudarc::driver::CudaSlice;

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
    entry: Option<(MaskKey, CudaSlice<u8>)>,
}

/// `[seq_lens.len(), sq, sk]` bytes, 1 where query `i` of sequence `b` must not see key `j`: `i`
/// or `j` at or past `seq_lens[b]`, or with `causal`, `j > i`.
pub(super) fn padding_mask(seq_lens: &[usize], sq: usize, sk: usize, causal: bool) -> Vec<u8> {
    let mut mask = Vec::with_capacity(seq_lens.len() * sq * sk);
    for &len in seq_lens {
        for i in 0..sq {
            mask.extend((0..sk).map(|j| u8::from(i >= len || j >= len || (causal && j > i))));
        }
    }
    mask
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
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        let seq_lens = match (kind, seq_lens) {
            (AttnMaskType::NoMask, None) => return Ok(Mask::None),
            (AttnMaskType::Causal, None) => return Ok(Mask::Causal),
            (_, Some(lens)) if kind.is_padding() => lens,
            (_, Some(_)) => {
                return config(format!(
                    "seq_lens are only read by padding masks; attn_mask_type = {} takes None (or configure \
                     padding / padding_causal)",
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
        let key = MaskKey { seq_lens: seq_lens.to_vec(), sq, sk, causal: kind.is_causal() };
        let entry = match self.entry.take() {
            Some((cached, mask)) if cached == key => (cached, mask),
            _ => {
                let bytes = padding_mask(seq_lens, sq, sk, key.causal);
                (key, dev.stream().clone_htod(&bytes)?)
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
