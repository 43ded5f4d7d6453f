//! Family 1 reference: quantize with amax, dequantize, amax.

use te_codegen::DType;
use te_runtime::numerics::{dequantize as deq, quantize as q8};

/// TE's amax of `x`: `max |x_i|` with NaN skipped (`fmaxf`), 0 for an empty input.
pub fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |a, &v| a.max(v.abs()))
}

/// FP8 codes of `x * scale` in `out` (f32 multiply, then the saturating cast), the amax of
/// `x`, and `scale_inv = 1 / scale`.
pub fn quantize(x: &[f32], out: DType, scale: f32) -> (Vec<u8>, f32, f32) {
    let q = x.iter().map(|&v| q8(out, v * scale)).collect();
    (q, amax(x), 1.0 / scale)
}

/// `q * scale_inv` in f32 (round the result to the output type with [`te_runtime::numerics::round_to`]).
pub fn dequantize(q: &[u8], input: DType, scale_inv: f32) -> Vec<f32> {
    q.iter().map(|&c| deq(input, c) * scale_inv).collect()
}
