//! Family 10 reference: dropout with Philox4x32-10, mirroring `te-codegen/templates/dropout.cu.tera` bit
//! for bit: the same random words and keep rule, and the same f32 operations in the same order
//! (no fused multiply-add), each rounded, the result rounded once to the output type. Masks
//! always match; outputs match except that the GPU writes the canonical NaN where the CPU may
//! keep an input NaN's sign and payload.

use te_codegen::DType;
use te_runtime::numerics::round_to;
use te_runtime::ops::dropout::{keep_scale, keep_threshold, mask_bytes, DropoutParams};
use te_runtime::philox;

/// The random word of element `i`: word `i % 4` of Philox block `i / 4` of `(seed, offset)`.
pub fn random_word(seed: u64, offset: u64, i: u64) -> u32 {
    philox::block(seed, offset, i / 4)[(i % 4) as usize]
}

/// The bit-packed keep mask of `n` elements (bit `i % 8` of byte `i / 8` = element `i` kept).
pub fn keep_mask(n: usize, params: DropoutParams) -> Vec<u8> {
    let threshold = keep_threshold(params.p);
    let mut mask = vec![0u8; mask_bytes(n)];
    for q in 0..n.div_ceil(4) {
        let words = philox::block(params.seed, params.offset, q as u64);
        for (w, &r) in words.iter().enumerate().take(n - 4 * q) {
            if (r as u64) < threshold {
                let i = 4 * q + w;
                mask[i / 8] |= 1 << (i % 8);
            }
        }
    }
    mask
}

/// Whether element `i` is kept in `mask`.
pub fn kept(mask: &[u8], i: usize) -> bool {
    (mask[i / 8] >> (i % 8)) & 1 == 1
}

/// `out = [residual +] dropout(x [+ bias])` and the keep mask, as `ops::dropout::bias_dropout_add`
/// (with `bias` and `residual`) and `ops::dropout::dropout` (without) compute them: `x` and
/// `bias` (`[cols]`, broadcast over rows) hold values of their dtype, `residual` values of
/// `out`; the result is rounded to `out` (returned widened to f32).
///
/// # Panics
/// If `residual` differs from `x` in length or `x` is not whole rows of `bias` (caller bugs).
pub fn bias_dropout_add(
    x: &[f32],
    bias: Option<&[f32]>,
    residual: Option<&[f32]>,
    params: DropoutParams,
    out: DType,
) -> (Vec<f32>, Vec<u8>) {
    if let Some(b) = bias {
        assert!(!b.is_empty() && x.len() % b.len() == 0, "x is not rows of {} bias columns", b.len());
    }
    if let Some(r) = residual {
        assert_eq!(r.len(), x.len(), "residual and x must have the same length");
    }
    let mask = keep_mask(x.len(), params);
    let scale = keep_scale(params.p);
    let y = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let v = bias.map_or(v, |b| v + b[i % b.len()]);
            let d = if kept(&mask, i) { v * scale } else { 0.0 };
            round_to(out, residual.map_or(d, |r| r[i] + d))
        })
        .collect();
    (y, mask)
}

/// `dx = kept ? dout · keep_scale(p) : 0`, rounded to `dx`, with the forward's `mask`.
///
/// # Panics
/// If `mask` is not [`mask_bytes`]`(dout.len())` long (a caller bug).
pub fn dropout_backward(dout: &[f32], mask: &[u8], p: f32, dx: DType) -> Vec<f32> {
    assert_eq!(mask.len(), mask_bytes(dout.len()), "mask length");
    let scale = keep_scale(p);
    dout.iter().enumerate().map(|(i, &g)| round_to(dx, if kept(mask, i) { g * scale } else { 0.0 })).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(p: f32) -> DropoutParams {
        DropoutParams { p, seed: 0x1234_5678_9abc_def0, offset: 42 }
    }

    #[test]
    fn masks_use_the_word_of_each_element() {
        let p = params(0.5);
        let mask = keep_mask(13, p);
        for i in 0..13 {
            assert_eq!(kept(&mask, i), (random_word(p.seed, p.offset, i as u64) as u64) < keep_threshold(0.5), "{i}");
        }
    }

    #[test]
    fn words_come_from_philox_blocks_of_four() {
        let seed = 0x299f_31d0_a409_3822;
        let q = 0x05a3_08d3_243f_6a88u64;
        let block = philox::block(seed, 7, q);
        for w in 0..4 {
            assert_eq!(random_word(seed, 7, 4 * q + w), block[w as usize]);
        }
        assert_ne!(random_word(seed, 7, 0), random_word(seed, 8, 0), "another offset, another stream");
    }

    #[test]
    fn the_keep_fraction_is_1_minus_p_within_4_sigma() {
        let n = 200_003;
        for p in [0.1f32, 0.5, 0.9] {
            let mask = keep_mask(n, params(p));
            let count: u32 = mask.iter().map(|b| b.count_ones()).sum();
            let (mean, sigma) = (n as f64 * (1.0 - p as f64), (n as f64 * p as f64 * (1.0 - p as f64)).sqrt());
            assert!((count as f64 - mean).abs() < 4.0 * sigma, "p = {p}: {count} kept, expected {mean} ± {sigma}");
            assert_eq!(mask[n / 8] >> (n % 8), 0, "bits past n are 0");
        }
    }

    #[test]
    fn p_0_is_the_identity_and_p_1_keeps_only_the_residual() {
        let x = [1.5f32, -2.25, 3.0, 0.1, -0.0, 7.0, 8.0, 9.0, 10.0];
        let (y, mask) = bias_dropout_add(&x, None, None, params(0.0), DType::F32);
        assert_eq!(y, x);
        assert_eq!(mask, [0xff, 0x01]);
        let r = [1.0f32; 9];
        let (y, mask) = bias_dropout_add(&x, Some(&[1.0, 2.0, 3.0]), Some(&r), params(1.0), DType::F32);
        assert_eq!((y, mask), (r.to_vec(), vec![0, 0]));
    }

    #[test]
    fn kept_values_are_scaled_and_rounded_once() {
        let p = 0.5;
        let x: Vec<f32> = (0..64).map(|i| i as f32 * 0.37 - 11.0).collect();
        let bias = [0.25f32, -0.5, 1.0, 2.0];
        let residual: Vec<f32> = (0..64).map(|i| round_to(DType::BF16, i as f32 * 0.01)).collect();
        let (y, mask) = bias_dropout_add(&x, Some(&bias), Some(&residual), params(p), DType::BF16);
        assert_eq!(mask, keep_mask(64, params(p)));
        let mut dropped = 0;
        for i in 0..64 {
            let want = if kept(&mask, i) { (x[i] + bias[i % 4]) * 2.0 + residual[i] } else { residual[i] };
            dropped += usize::from(!kept(&mask, i));
            assert_eq!(y[i], round_to(DType::BF16, want), "element {i}");
        }
        assert!(dropped > 10 && dropped < 54, "{dropped} of 64 dropped at p = 0.5");
        // The backward keeps the same elements with the same scale.
        let dx = dropout_backward(&x, &mask, p, DType::F32);
        for i in 0..64 {
            assert_eq!(dx[i], if kept(&mask, i) { x[i] * 2.0 } else { 0.0 });
        }
    }
}
