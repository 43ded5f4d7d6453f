//! [`PaddingSeqlens`]: a padded batch's valid lengths with their `cu_seqlens` made once on the
//! device and refilled in place, so a CUDA graph of a padded forward (`te embed`'s batches)
//! replays with the next batch's lengths instead of uploading them inside the capture.

use super::fused::DeviceSeqlens;
use super::MODULE;
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_runtime::graph::{refuse_in_capture, HostCopies};
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::{Device, Error, Result};

/// The valid lengths of a self-attention batch padded to `s` tokens (TE's padding mask,
/// `cu_seqlens_q = cu_seqlens_kv`), on the host and as i32 prefix sums `[batch + 1]` on the
/// device, passed in [`crate::modules::AttentionInputs::padding`]: the fused attention reads
/// these tables instead of uploading its own at every call, and [`PaddingSeqlens::update`]
/// refills them in place (a CUDA graph's static input).
#[derive(Debug)]
pub struct PaddingSeqlens {
    lens: Vec<usize>,
    cu: Arc<CudaSlice<i32>>,
}

impl PaddingSeqlens {
    /// The tables of `lens` (one valid length per sequence, each ≥ 1), uploaded.
    ///
    /// # Errors
    /// [`Error::Shape`] for no sequences, a zero length or prefix sums beyond i32; copy failures.
    pub fn new(dev: &Device, lens: &[usize]) -> Result<Self> {
        let cu = dev.stream().htod(&prefix_sums(lens)?)?;
        Ok(Self { lens: lens.to_vec(), cu: Arc::new(cu) })
    }

    /// Refills the tables with `lens` (as many sequences as before), in place: the device
    /// buffer keeps its address. A host upload: not inside a capture.
    ///
    /// # Errors
    /// [`Error::Shape`] for another number of sequences or a zero length; [`Error::Argument`]
    /// while a forward's context still holds the tables; [`Error::Capture`] inside a capture;
    /// copy failures.
    pub fn update(&mut self, dev: &Device, lens: &[usize]) -> Result<()> {
        if lens.len() != self.lens.len() {
            return Err(Error::Shape {
                op: MODULE,
                message: format!("{} lengths for padding tables of {} sequences", lens.len(), self.lens.len()),
            });
        }
        let sums = prefix_sums(lens)?;
        refuse_in_capture(dev.stream(), "PaddingSeqlens::update")?;
        let cu = Arc::get_mut(&mut self.cu).ok_or_else(|| Error::Argument {
            op: MODULE,
            message: "the padding tables are held by a forward's context: drop it before refilling them".into(),
        })?;
        dev.stream().memcpy_htod(&sums, cu)?;
        self.lens = lens.to_vec();
        Ok(())
    }

    /// The valid lengths, one per sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// The tables for the call `shape` (checked against `seq_lens`, the call's host lengths):
    /// self-attention over `sq = sk` padded positions, every length within them.
    pub(super) fn device_seqlens(&self, shape: &AttentionShape, seq_lens: Option<&[usize]>) -> Result<DeviceSeqlens> {
        let bad = |message: String| Err(Error::Shape { op: MODULE, message });
        if seq_lens != Some(&self.lens[..]) {
            return bad(format!(
                "the padding tables hold lengths {:?} but the call's seq_lens are {seq_lens:?}: pass the same lengths",
                self.lens
            ));
        }
        if shape.sq != shape.sk || shape.batch != self.lens.len() || self.lens.iter().any(|&l| l > shape.sq) {
            return bad(format!(
                "padding tables serve self-attention with every length within the padded sequence; got {} sequences, \
                 sq {} and sk {}, lengths {:?}",
                shape.batch, shape.sq, shape.sk, self.lens
            ));
        }
        Ok(DeviceSeqlens::shared(self.cu.clone()))
    }
}

/// `[0, l0, l0 + l1, ...]` as i32.
fn prefix_sums(lens: &[usize]) -> Result<Vec<i32>> {
    let bad = |message: String| Error::Shape { op: MODULE, message };
    if lens.is_empty() || lens.contains(&0) {
        return Err(bad(format!("padding lengths must be ≥ 1 for at least one sequence, got {lens:?}")));
    }
    let mut cu = Vec::with_capacity(lens.len() + 1);
    cu.push(0i32);
    let mut total = 0usize;
    for &l in lens {
        total += l;
        cu.push(i32::try_from(total).map_err(|_| bad(format!("{total} valid positions exceed i32 cu_seqlens")))?);
    }
    Ok(cu)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_sums_and_bad_lengths() {
        assert_eq!(prefix_sums(&[3, 1, 4]).unwrap(), [0, 3, 4, 8]);
        for bad in [&[][..], &[2, 0][..]] {
            assert!(prefix_sums(bad).unwrap_err().to_string().contains("≥ 1"), "{bad:?}");
        }
        let e = prefix_sums(&[usize::MAX / 2, usize::MAX / 2]).unwrap_err().to_string();
        assert!(e.contains("exceed i32"), "{e}");
    }
}
