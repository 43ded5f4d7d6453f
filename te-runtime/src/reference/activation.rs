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

/// The element-wise part of `act` (GELU for GeGLU, SiLU for SwiGLU) and its derivative.
pub fn elementwise(act: Activation) -> (fn(f32) -> f32, fn(f32) -> f32) {
    match act {
        Activation::Gelu | Activation::Geglu => (gelu, dgelu),
        Activation::Relu => (relu, drelu),
        Activation::Swiglu => (silu, dsilu),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derivatives_match_finite_differences() {
        for (f, df) in [(gelu as fn(f32) -> f32, dgelu as fn(f32) -> f32), (silu, dsilu)] {
            for i in -40..=40 {
                let x = i as f64 * 0.1 + 0.03;
                let h = 1e-3;
                let fd = (f((x + h) as f32) as f64 - f((x - h) as f32) as f64) / (2.0 * h);
                assert!((fd - df(x as f32) as f64).abs() < 2e-3, "x={x}: fd {fd} vs {}", df(x as f32));
            }
        }
        assert_eq!((relu(-1.0), relu(2.0), drelu(-1.0), drelu(2.0)), (0.0, 2.0, 0.0, 1.0));
    }
}
