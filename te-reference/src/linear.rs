//! CPU reference of `te_nn::modules::Linear`: the same math with FP8 emulated — input, weight
//! and output gradient quantized with the given scales (bit-exact casts), GEMMs accumulated in
//! f64 over the dequantized values (the GPU accumulates in f32: the reference is the more exact
//! of the two). CI checks the FP8 numerics on this path; the GPU tests check the GPU against it.

use super::gemm::gemm_tn;
use te_codegen::DType;
use te_runtime::numerics;

/// Scales of one FP8 Linear step (forward: input, weight; backward: grad_output) and formats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Step {
    /// Scale of the input cast (E4M3).
    pub input: f32,
    /// Scale of the weight cast (E4M3).
    pub weight: f32,
    /// Scale of the grad_output cast.
    pub grad_output: f32,
    /// Format of grad_output: E5M2 under HYBRID, else E4M3.
    pub grad_dtype: DType,
}

/// `x` after an FP8 round trip: `decode(fp8(x * scale)) / scale`, computed as the GPU does
/// (`q * scale_inv` with `scale_inv = 1/scale` in f32).
pub fn fake_quantize(x: &[f32], dtype: DType, scale: f32) -> Vec<f32> {
    let scale_inv = 1.0 / scale;
    x.iter().map(|&v| numerics::dequantize(dtype, numerics::quantize(dtype, v * scale)) * scale_inv).collect()
}

/// `y [tokens, out] = x [tokens, in] · w [out, in]ᵀ + bias`, with `x` and `w` FP8-emulated when
/// `fp8` is given.
pub fn forward(x: &[f32], w: &[f32], bias: Option<&[f32]>, tokens: usize, fp8: Option<&Fp8Step>) -> Vec<f32> {
    let n_in = x.len() / tokens.max(1);
    let n_out = w.len() / n_in.max(1);
    let (xq, wq) = match fp8 {
        Some(s) => (fake_quantize(x, DType::E4M3, s.input), fake_quantize(w, DType::E4M3, s.weight)),
        None => (x.to_vec(), w.to_vec()),
    };
    let mut y = gemm_tn(&xq, &wq, tokens, n_out, n_in);
    if let Some(b) = bias {
        for row in y.chunks_exact_mut(n_out) {
            row.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
        }
    }
    y
}

/// Gradients of one backward.
#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    /// `[tokens, in]`.
    pub dx: Vec<f32>,
    /// `[out, in]`.
    pub dw: Vec<f32>,
    /// `[out]`: `Σ_tokens dy` of the unquantized `dy` (the cast kernel sums before it casts).
    pub dbias: Vec<f32>,
}

/// `dx = dy · w`, `dw = dyᵀ · x`, `dbias = Σ dy`, with `dy`, `x`, `w` FP8-emulated when `fp8` is
/// given (x and w with the forward's scales, dy with `grad_output`).
pub fn backward(dy: &[f32], x: &[f32], w: &[f32], tokens: usize, fp8: Option<&Fp8Step>) -> Grads {
    let n_in = x.len() / tokens.max(1);
    let n_out = dy.len() / tokens.max(1);
    let (dyq, xq, wq) = match fp8 {
        Some(s) => (
            fake_quantize(dy, s.grad_dtype, s.grad_output),
            fake_quantize(x, DType::E4M3, s.input),
            fake_quantize(w, DType::E4M3, s.weight),
        ),
        None => (dy.to_vec(), x.to_vec(), w.to_vec()),
    };
    let dx = gemm_tn(&dyq, &transpose(&wq, n_out, n_in), tokens, n_in, n_out);
    let dw = gemm_tn(&transpose(&dyq, tokens, n_out), &transpose(&xq, tokens, n_in), n_out, n_in, tokens);
    let mut dbias = vec![0.0f64; n_out];
    for row in dy.chunks_exact(n_out) {
        dbias.iter_mut().zip(row).for_each(|(s, &v)| *s += f64::from(v));
    }
    Grads { dx, dw, dbias: dbias.into_iter().map(|v| v as f32).collect() }
}

/// `[rows, cols]` → `[cols, rows]`.
pub fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0.0; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

/// Relative Frobenius error `‖got − want‖ / ‖want‖` (f64).
pub fn rel_frobenius(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (f64::from(g) - f64::from(w)).powi(2);
        den += f64::from(w).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scaling::current_scale;
    use rand::{Rng, SeedableRng};

    fn randn(seed: u64, n: usize, std: f32) -> Vec<f32> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                let (u1, u2): (f32, f32) = (rng.random::<f32>().max(1e-7), rng.random());
                std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect()
    }

    fn amax(x: &[f32]) -> f32 {
        x.iter().fold(0.0f32, |a, v| a.max(v.abs()))
    }

    /// Scales as current scaling would pick them (what delayed scaling converges to).
    fn step(x: &[f32], w: &[f32], dy: &[f32], grad_dtype: DType) -> Fp8Step {
        let s = |v: &[f32], d: DType| current_scale(amax(v), d.fp8_max().unwrap(), 0.0, false).0;
        Fp8Step { input: s(x, DType::E4M3), weight: s(w, DType::E4M3), grad_output: s(dy, grad_dtype), grad_dtype }
    }

    fn assert_tol(what: &str, got: &[f32], want: &[f32], rtol: f32, atol: f32) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= atol + rtol * w.abs(), "{what}[{i}]: {g} vs {w} (rtol {rtol}, atol {atol})");
        }
    }

    /// FP8 Linear against the exact math: TE's relative Frobenius bound and E4M3 / E5M2
    /// elementwise tolerances, at a shape that is no tile multiple.
    #[test]
    fn fp8_linear_matches_the_exact_math() {
        let (t, n_in, n_out) = (48, 80, 112);
        let x = randn(1, t * n_in, 1.0);
        let w = randn(2, n_out * n_in, 0.023);
        let b = randn(3, n_out, 0.1);
        let dy = randn(4, t * n_out, 1e-3);
        for grad_dtype in [DType::E5M2, DType::E4M3] {
            let s = step(&x, &w, &dy, grad_dtype);
            let y8 = forward(&x, &w, Some(&b), t, Some(&s));
            let y = forward(&x, &w, Some(&b), t, None);
            // Quantization error of E4M3 operands (3 mantissa bits): a few percent, not the 1e-2 the
            // GPU GEMM meets against the exact product of the *quantized* operands.
            assert!(rel_frobenius(&y8, &y) < 0.05, "fprop {}", rel_frobenius(&y8, &y));
            assert_tol("y", &y8, &y, 0.125, 0.0675);
            let g8 = backward(&dy, &x, &w, t, Some(&s));
            let g = backward(&dy, &x, &w, t, None);
            let bound = if grad_dtype == DType::E5M2 { 0.1 } else { 0.05 };
            assert!(rel_frobenius(&g8.dx, &g.dx) < bound, "dgrad {}", rel_frobenius(&g8.dx, &g.dx));
            assert!(rel_frobenius(&g8.dw, &g.dw) < bound, "wgrad {}", rel_frobenius(&g8.dw, &g.dw));
            // Gradients are tiny here: scale the atol with their magnitude.
            let (rtol, atol) = if grad_dtype == DType::E5M2 { (0.25, 0.125) } else { (0.125, 0.0675) };
            assert_tol("dx", &g8.dx, &g.dx, rtol, atol * amax(&g.dx));
            assert_tol("dw", &g8.dw, &g.dw, rtol, atol * amax(&g.dw));
            assert_eq!(g8.dbias, g.dbias, "dbias is summed before the cast");
        }
    }

    #[test]
    fn fake_quantize_is_exact_on_representable_values() {
        let x = [0.0, 1.0, -2.5, 448.0, 0.015625];
        assert_eq!(fake_quantize(&x, DType::E4M3, 1.0), x.to_vec());
        // Saturation: beyond ±448 clamps.
        assert_eq!(fake_quantize(&[1e6, -1e6], DType::E4M3, 1.0), vec![448.0, -448.0]);
        // A scale of 2 on a representable value round-trips exactly.
        assert_eq!(fake_quantize(&[3.0], DType::E5M2, 2.0), vec![3.0]);
    }

    #[test]
    fn transpose_round_trips() {
        let x: Vec<f32> = (0..12).map(|v| v as f32).collect();
        let t = transpose(&x, 3, 4);
        assert_eq!(t[1], 4.0);
        assert_eq!(transpose(&t, 4, 3), x);
    }
}
