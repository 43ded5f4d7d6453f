//! Batching and pooling on the host: padding token sequences into one batch, mean pooling with
//! L2 normalisation (sentence-transformers' `Pooling(mean)` + `Normalize`) and cosine similarity.

use super::{BertError, BertResult};

/// Pads token-id sequences into one `[b, s]` batch: `s` is the longest length rounded up to a
/// multiple of 16, but never above `max_len` (unless the longest itself is); pads with id 0;
/// returns `(ids, b, s, lengths)`.
///
/// # Errors
/// [`BertError::Input`] for no sequences, an empty sequence, or one longer than `max_len`.
pub fn pad_batch(seqs: &[Vec<u32>], max_len: usize) -> BertResult<(Vec<i32>, usize, usize, Vec<usize>)> {
    let bad = |message: String| Err(BertError::Input { message });
    if seqs.is_empty() {
        return bad("no sequences".into());
    }
    let longest = seqs.iter().map(Vec::len).max().unwrap_or(0);
    if seqs.iter().any(Vec::is_empty) {
        return bad("an empty token sequence (a tokenized sentence holds at least [CLS] and [SEP])".into());
    }
    if longest > max_len {
        return bad(format!("a sequence of {longest} tokens exceeds the maximum of {max_len}; truncate it"));
    }
    let seq = (longest.div_ceil(16) * 16).min(max_len).max(longest);
    let mut ids = vec![0i32; seqs.len() * seq];
    for (row, s) in ids.chunks_exact_mut(seq).zip(seqs) {
        for (d, &t) in row.iter_mut().zip(s) {
            *d = i32::try_from(t).unwrap_or(i32::MAX);
        }
    }
    Ok((ids, seqs.len(), seq, seqs.iter().map(Vec::len).collect()))
}

/// Mean over the first `lens[i]` rows of each `[s, hidden]` block of `hidden: [b, s, hidden]`,
/// then L2 normalisation (sentence-transformers' `Pooling(mean)` + `Normalize`, which divides by
/// `max(‖v‖, 1e-12)`).
pub fn mean_pool_normalize(hidden: &[f32], seq: usize, width: usize, lens: &[usize]) -> Vec<Vec<f32>> {
    lens.iter()
        .enumerate()
        .map(|(b, &len)| {
            let mut v = vec![0f64; width];
            for t in 0..len.min(seq) {
                let row = &hidden[(b * seq + t) * width..(b * seq + t + 1) * width];
                for (a, &x) in v.iter_mut().zip(row) {
                    *a += f64::from(x);
                }
            }
            let n = len.max(1) as f64;
            let norm = v.iter().map(|x| (x / n) * (x / n)).sum::<f64>().sqrt().max(1e-12);
            v.iter().map(|x| (x / n / norm) as f32).collect()
        })
        .collect()
}

/// `v / max(‖v‖, 1e-12)` in f64, rounded to f32.
pub fn l2_normalize(v: &[f32]) -> Vec<f32> {
    let norm = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>().sqrt().max(1e-12);
    v.iter().map(|&x| (f64::from(x) / norm) as f32).collect()
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (f64::from(x), f64::from(y));
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        ab / (aa.sqrt() * bb.sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_rounds_to_16_and_rejects_long_inputs() {
        let (ids, b, s, lens) = pad_batch(&[vec![101, 7, 102], vec![101; 17]], 512).unwrap();
        assert_eq!((b, s, lens.clone()), (2, 32, vec![3, 17]));
        assert_eq!(&ids[..4], &[101, 7, 102, 0]);
        assert!(pad_batch(&[vec![1; 513]], 512).is_err());
        assert!(pad_batch(&[vec![]], 512).is_err());
        assert!(pad_batch(&[], 512).is_err());
        // At the maximum the batch is not padded past it.
        assert_eq!(pad_batch(&[vec![1; 500]], 500).unwrap().2, 500);
    }

    #[test]
    fn pooling_ignores_padding_and_normalises() {
        let hidden = [1.0, 0.0, 3.0, 4.0, 100.0, 100.0];
        let v = mean_pool_normalize(&hidden, 3, 2, &[2]);
        let want = [2.0 / 8f32.sqrt(), 2.0 / 8f32.sqrt()];
        assert!((v[0][0] - want[0]).abs() < 1e-6 && (v[0][1] - want[1]).abs() < 1e-6, "{v:?}");
        assert!((cosine(&[1.0, 0.0], &[2.0, 0.0]) - 1.0).abs() < 1e-12);
    }
}
