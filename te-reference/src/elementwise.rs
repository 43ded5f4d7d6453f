//! Family 8 reference: element-wise add and in-place add; soft-capping ([`softcap`]).
//!
//! Mirrors `te-codegen/templates/elementwise.cu.tera`: both operands (already values of their dtypes) are
//! added in f32 and the sum is rounded once, to nearest even, to the output type. Finite and
//! infinite results match the kernel bit for bit; a NaN result is NaN on both sides, but the GPU
//! writes the canonical NaN where the CPU may keep an input's sign and payload.

use te_codegen::DType;
use te_runtime::numerics::round_to;

/// `a[i] + b[i]` in f32, rounded to `out` (returned widened to f32).
///
/// # Panics
/// When `a` and `b` differ in length (a caller bug).
pub fn add(a: &[f32], b: &[f32], out: DType) -> Vec<f32> {
    assert_eq!(a.len(), b.len(), "a and b must have the same length");
    a.iter().zip(b).map(|(&x, &y)| round_to(out, x + y)).collect()
}

/// `dst[i] += src[i]` in f32, rounded to `dst_dtype`, the dtype `dst` stands for.
///
/// # Panics
/// When `dst` and `src` differ in length (a caller bug).
pub fn add_assign(dst: &mut [f32], dst_dtype: DType, src: &[f32]) {
    assert_eq!(dst.len(), src.len(), "dst and src must have the same length");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = round_to(dst_dtype, *d + s);
    }
}

/// `dst[i] · alpha` in f32, rounded to `dst_dtype` (`ops::elementwise::scale_assign`).
pub fn scale_assign(dst: &mut [f32], dst_dtype: DType, alpha: f32) {
    for d in dst.iter_mut() {
        *d = round_to(dst_dtype, *d * alpha);
    }
}

/// `cap · tanh(x / cap)` of each element in f32, in transformers' order (`x / cap`, `tanh`, `·
/// cap`): Gemma's `final_logit_softcapping` on the logits.
///
/// # Panics
/// If `cap` is not finite and > 0 (a caller bug).
pub fn softcap(x: &[f32], cap: f32) -> Vec<f32> {
    assert!(cap.is_finite() && cap > 0.0, "the softcap must be finite and > 0, got {cap}");
    x.iter().map(|&v| (v / cap).tanh() * cap).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softcap_squashes_into_the_cap_and_keeps_small_values() {
        let y = softcap(&[0.0, 1e-3, 30.0, -1e6, f32::INFINITY], 30.0);
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 1e-3).abs() < 1e-9, "near 0 it is the identity");
        assert!((y[2] - 30.0 * 1f32.tanh()).abs() < 1e-5);
        assert_eq!((y[3], y[4]), (-30.0, 30.0));
    }

    #[test]
    fn the_sum_is_rounded_once_to_nearest_even() {
        // bf16 keeps 7 mantissa bits: 1 + 2^-8 is halfway between 1 and 1 + 2^-7 and ties to 1
        // (even); 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
        let (a, b) = ([1.0f32, 1.0, 1.0], [2f32.powi(-8), 3.0 * 2f32.powi(-8), 2f32.powi(-9)]);
        assert_eq!(add(&a, &b, DType::BF16), [1.0, 1.0 + 2f32.powi(-6), 1.0]);
        // The same sum in f32 is exact.
        assert_eq!(add(&a, &b, DType::F32), [1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8), 1.0 + 2f32.powi(-9)]);
        // f16 overflows to inf past 65504 (+ half an ulp); f32 does not.
        assert_eq!(add(&[60000.0], &[10000.0], DType::F16), [f32::INFINITY]);
        assert_eq!(add(&[60000.0], &[10000.0], DType::F32), [70000.0]);
        let zeros: Vec<u32> = add(&[-0.0, 1.0], &[-0.0, -1.0], DType::F16).iter().map(|v| v.to_bits()).collect();
        assert_eq!(zeros, [(-0.0f32).to_bits(), 0], "-0 + -0 = -0, 1 + -1 = +0");
    }

    #[test]
    fn add_assign_accumulates_in_f32_and_keeps_the_dst_type() {
        // An f32 main_grad += bf16 gradients: the sum is rounded to f32, not to bf16.
        let g = round_to(DType::BF16, 0.1);
        let mut main_grad = vec![0.0f32; 3];
        for _ in 0..3 {
            add_assign(&mut main_grad, DType::F32, &[g, -g, 1.0]);
        }
        assert_eq!(main_grad, [(g + g) + g, (-g - g) - g, 3.0]);
        assert_ne!(main_grad[0], round_to(DType::BF16, main_grad[0]), "an f32 sum, not bf16");
        // A bf16 dst rounds every step.
        let mut bias_grad = vec![1.0f32];
        add_assign(&mut bias_grad, DType::BF16, &[2f32.powi(-8)]);
        assert_eq!(bias_grad, [1.0]);
        // Mixed inputs are exact values of their own dtypes.
        let (h, b) = (round_to(DType::F16, 0.1), round_to(DType::BF16, 0.1));
        assert_ne!(h, b);
        assert_eq!(add(&[h], &[b], DType::F32), [h + b]);
    }
}
