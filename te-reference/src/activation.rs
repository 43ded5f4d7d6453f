//! Family 4 reference: activations and their derivatives (TE `common/util/math.h`), in f32.

use te_codegen::spec::Activation;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// Tanh-approximated GELU.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// Derivative of [`gelu`].
pub fn dgelu(x: f32) -> f32 {
    let t = (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh();
    0.5 * x * ((1.0 - t * t) * (SQRT_2_OVER_PI + 3.0 * 0.044715 * SQRT_2_OVER_PI * x * x)) + 0.5 * (1.0 + t)
}

/// Exact GELU (erf form): `0.5 x (1 + erf(x / √2))`, evaluated in f64 as `0.5 x erfc(-x / √2)`
/// (no cancellation for negative x) and rounded.
pub fn gelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    (0.5 * x * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2)) as f32
}

/// Derivative of [`gelu_erf`]: `Φ(x) + x φ(x)`.
pub fn dgelu_erf(x: f32) -> f32 {
    let x = f64::from(x);
    let cdf = 0.5 * libm::erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
    let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    (cdf + x * pdf) as f32
}

/// `max(x, 0)`.
pub fn relu(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        0.0
    }
}

/// Derivative of [`relu`] (0 at 0).
pub fn drelu(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else {
        0.0
    }
}

/// `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Derivative of [`silu`].
pub fn dsilu(x: f32) -> f32 {
    let s = 1.0 / (1.0 + (-x).exp());
    s + x * s * (1.0 - s)
}

/// A scalar f32 function (an activation or its derivative).
pub type ScalarFn = fn(f32) -> f32;

/// The element-wise part of `act` (GELU for GeGLU, SiLU for SwiGLU) and its derivative.
pub fn elementwise(act: Activation) -> (ScalarFn, ScalarFn) {
    match act {
        Activation::Gelu | Activation::Geglu => (gelu, dgelu),
        Activation::GeluErf => (gelu_erf, dgelu_erf),
        Activation::Relu => (relu, drelu),
        Activation::Swiglu => (silu, dsilu),
    }
}

/// Width of the input rows of `act` for `cols` outputs (`2 * cols` when gated).
fn in_cols(act: Activation, cols: usize) -> usize {
    if act.is_gated() {
        2 * cols
    } else {
        cols
    }
}

/// The forward kernel's f32 result `act(x + bias)` for `x: [rows, in_cols]` (row-major,
/// `in_cols = 2 * cols` when gated, `[a | b]` → `act(a + bias_a) * (b + bias_b)`) and `bias:
/// [in_cols]`; returns `y: [rows, cols]`. Round to the output type with
/// [`te_runtime::numerics::round_to`], or quantize with [`super::cast::quantize`] (which also gives
/// the amax of `y` and `scale_inv`, as the FP8 kernel does).
///
/// # Panics
/// If `x` is not a whole number of rows or `bias` is not `in_cols` long (caller bugs).
pub fn forward(act: Activation, x: &[f32], bias: Option<&[f32]>, cols: usize) -> Vec<f32> {
    let w = in_cols(act, cols);
    assert!(cols > 0 && x.len() % w == 0, "x holds {} values, not rows of {w}", x.len());
    if let Some(b) = bias {
        assert_eq!(b.len(), w, "bias length");
    }
    let (f, _) = elementwise(act);
    let biased = |row: &[f32], c: usize| row[c] + bias.map_or(0.0, |b| b[c]);
    x.chunks_exact(w)
        .flat_map(|row| {
            (0..cols).map(
                move |c| {
                    if act.is_gated() {
                        f(biased(row, c)) * biased(row, cols + c)
                    } else {
                        f(biased(row, c))
                    }
                },
            )
        })
        .collect()
}

/// The backward kernel's f32 result for `dy: [rows, cols]` and the forward input `x: [rows,
/// in_cols]`: `dx = act'(x) * dy`, or for gated activations `da = dy * b * act'(a)` and
/// `db = dy * act(a)`; returns `dx: [rows, in_cols]`.
///
/// # Panics
/// If `dy` and `x` do not hold the same number of rows (caller bug).
pub fn backward(act: Activation, dy: &[f32], x: &[f32], cols: usize) -> Vec<f32> {
    let w = in_cols(act, cols);
    assert!(cols > 0 && dy.len() % cols == 0 && x.len() == dy.len() / cols * w, "dy/x row mismatch");
    let (f, df) = elementwise(act);
    let mut dx = vec![0.0f32; x.len()];
    for ((g, xr), out) in dy.chunks_exact(cols).zip(x.chunks_exact(w)).zip(dx.chunks_exact_mut(w)) {
        for c in 0..cols {
            if act.is_gated() {
                let (a, b) = (xr[c], xr[cols + c]);
                out[c] = g[c] * b * df(a);
                out[cols + c] = g[c] * f(a);
            } else {
                out[c] = df(xr[c]) * g[c];
            }
        }
    }
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivatives_match_finite_differences() {
        for (f, df) in [(gelu as ScalarFn, dgelu as ScalarFn), (gelu_erf, dgelu_erf), (silu, dsilu)] {
            for i in -40..=40 {
                let x = i as f64 * 0.1 + 0.03;
                let h = 1e-3;
                let fd = (f((x + h) as f32) as f64 - f((x - h) as f32) as f64) / (2.0 * h);
                assert!((fd - df(x as f32) as f64).abs() < 2e-3, "x={x}: fd {fd} vs {}", df(x as f32));
            }
        }
        assert_eq!((relu(-1.0), relu(2.0), drelu(-1.0), drelu(2.0)), (0.0, 2.0, 0.0, 1.0));
    }

    #[test]
    fn gelu_erf_known_values() {
        // PyTorch `gelu(x)` (erf form) in f64: 1 → 0.8413447460685429, -1 → -0.15865525393145707.
        assert!((f64::from(gelu_erf(1.0)) - 0.841_344_746_068_542_9).abs() < 1e-7);
        assert!((f64::from(gelu_erf(-1.0)) + 0.158_655_253_931_457_07).abs() < 1e-7);
        assert!((f64::from(gelu_erf(3.0)) - 2.995_950_2).abs() < 1e-6);
        // The tanh form differs from it by ~1e-4 around |x| ≈ 2.
        assert!((gelu(2.0) - gelu_erf(2.0)).abs() > 1e-5);
    }

    #[test]
    fn gated_forward_and_bias() {
        let x = [1.0f32, -2.0, 0.5, 3.0];
        let y = forward(Activation::Swiglu, &x, None, 2);
        assert_eq!(y, vec![silu(1.0) * 0.5, silu(-2.0) * 3.0]);
        let y = forward(Activation::Geglu, &x, Some(&[0.5, 0.0, -0.5, 1.0]), 2);
        assert_eq!(y, vec![gelu(1.5) * 0.0, gelu(-2.0) * 4.0]);
        let y = forward(Activation::Relu, &x, Some(&[0.0, 2.5, 0.0, 0.0]), 4);
        assert_eq!(y, vec![1.0, 0.5, 0.5, 3.0]);
    }

    /// The backward is the gradient of `Σ dy · forward(x)`, checked by central differences in
    /// f64 around the f32 reference.
    #[test]
    fn backward_matches_finite_differences_of_forward() {
        let cols = 3;
        for act in Activation::ALL {
            let w = in_cols(act, cols);
            let x: Vec<f32> = (0..2 * w).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.27 + 0.013).collect();
            let dy: Vec<f32> = (0..2 * cols).map(|i| ((i * 17 % 7) as f32 - 3.0) * 0.4 + 0.1).collect();
            let dx = backward(act, &dy, &x, cols);
            let loss = |x: &[f32]| -> f64 {
                forward(act, x, None, cols).iter().zip(&dy).map(|(&y, &g)| y as f64 * g as f64).sum()
            };
            for i in 0..x.len() {
                let h = 1e-2f32;
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += h;
                xm[i] -= h;
                let fd = (loss(&xp) - loss(&xm)) / (2.0 * h as f64);
                assert!((fd - dx[i] as f64).abs() < 2e-3 * (1.0 + fd.abs()), "{act} x[{i}]: fd {fd} vs {}", dx[i]);
            }
        }
    }
}
