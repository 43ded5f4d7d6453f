//! Element conversions (FP8/BF16/F16 encode, decode, round) of host-side tensor I/O, FP8 tensors
//! and the CPU reference.
//!
//! FP8 rounding is the GPU's `cvt.rn.satfinite`: round to nearest even, saturate to ±max, NaN
//! kept. The `float8` crate implements this (it ports `cuda_fp8.hpp`'s saturating conversion)
//! except for NaN: it keeps the sign (and for E5M2 payload bits) where the GPU always writes
//! the canonical NaN `0x7f` (seen on an H200, 2026-11-22). [`quantize`] canonicalizes NaN; the
//! GPU tests prove the match bit for bit, special values included.

use float8::{F8E4M3, F8E5M2};
use half::{bf16, f16};
use te_codegen::DType;

/// The FP8 code of `x` (already multiplied by the scale) in `dtype`.
///
/// # Panics
/// If `dtype` is not an FP8 type (a caller bug).
pub fn quantize(dtype: DType, x: f32) -> u8 {
    const CANONICAL_NAN: u8 = 0x7f;
    if x.is_nan() && dtype.is_fp8() {
        return CANONICAL_NAN;
    }
    match dtype {
        DType::E4M3 => F8E4M3::from_f32(x).to_bits(),
        DType::E5M2 => F8E5M2::from_f32(x).to_bits(),
        other => panic!("quantize: {other} is not an FP8 type"),
    }
}

/// The value of FP8 code `q` in `dtype`.
///
/// # Panics
/// If `dtype` is not an FP8 type (a caller bug).
pub fn dequantize(dtype: DType, q: u8) -> f32 {
    match dtype {
        DType::E4M3 => F8E4M3::from_bits(q).to_f32(),
        DType::E5M2 => F8E5M2::from_bits(q).to_f32(),
        other => panic!("dequantize: {other} is not an FP8 type"),
    }
}

/// `x` rounded to `dtype` (nearest even) and widened back to f32.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::E4M3 | DType::E5M2 => dequantize(dtype, quantize(dtype, x)),
    }
}

/// Little-endian bytes of `values` in `dtype` (FP8: cast with scale 1).
pub fn encode(dtype: DType, values: &[f32]) -> Vec<u8> {
    match dtype {
        DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::BF16 => values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
        DType::E4M3 | DType::E5M2 => values.iter().map(|&v| quantize(dtype, v)).collect(),
    }
}

/// Values of little-endian `bytes` in `dtype`, widened to f32.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f32> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DType::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DType::E4M3 | DType::E5M2 => bytes.iter().map(|&q| dequantize(dtype, q)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_saturates_rounds_to_even_and_keeps_nan() {
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, 1000.0)), 448.0);
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, -1e30)), -448.0);
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, f32::INFINITY)), 448.0);
        assert_eq!(dequantize(DType::E5M2, quantize(DType::E5M2, 1e9)), 57344.0);
        assert!(dequantize(DType::E4M3, quantize(DType::E4M3, f32::NAN)).is_nan());
        assert_eq!(quantize(DType::E4M3, -f32::NAN), 0x7f, "NaN is canonical, as on the GPU");
        assert_eq!(quantize(DType::E5M2, -f32::NAN), 0x7f);
        assert!(dequantize(DType::E5M2, quantize(DType::E5M2, f32::NAN)).is_nan());
        // 1.0625 lies halfway between 1.0 and 1.125 in E4M3: ties go to the even mantissa (1.0).
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, 1.0625)), 1.0);
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, 1.1875)), 1.25);
        // Smallest E4M3 subnormal is 2^-9; half of it rounds to zero (even), a bit more up.
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, 2f32.powi(-10))), 0.0);
        assert_eq!(dequantize(DType::E4M3, quantize(DType::E4M3, 2f32.powi(-10) * 1.01)), 2f32.powi(-9));
    }

    #[test]
    fn every_fp8_code_roundtrips() {
        for dt in [DType::E4M3, DType::E5M2] {
            for q in 0..=255u8 {
                let v = dequantize(dt, q);
                if v.is_nan() || (dt == DType::E5M2 && v.is_infinite()) {
                    continue;
                }
                let back = quantize(dt, v);
                // ±0 both decode to 0; compare values.
                assert_eq!(dequantize(dt, back), v, "{dt} code {q:#04x}");
            }
        }
    }
}
