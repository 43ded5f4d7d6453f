//! Family 11 reference: the global gradient norm, PyTorch's clip coefficient and one AdamW step
//! with FP32 master weights (Loshchilov & Hutter 2019; PyTorch `torch.optim.AdamW`,
//! `torch.nn.utils.clip_grad_norm_`).
//!
//! Mirrors `te-codegen/templates/optimizer.cu.tera`: the per-step scalars come from the library's
//! [`AdamWScalars::new`], the same values the runtime fills the kernel's arguments with, and each element's update is the
//! same sequence of f32 operations, each rounded once (the kernel uses `__f*_rn`, no
//! contraction), so masters, moments and parameters match the kernel bit for bit. The norm is
//! summed here in f64; the kernel's f32 partial sums agree within f32 rounding.

use te_codegen::DType;
use te_runtime::numerics::round_to;
use te_runtime::ops::optimizer::scalars::AdamWScalars;

/// PyTorch's `clip_grad_norm_` guard against a zero norm.
pub const CLIP_EPS: f32 = 1e-6;

/// The global L2 norm `sqrt(Σ_t Σ_i g_ti²)` over every gradient (values already in their
/// dtypes), accumulated in f64 and rounded to f32.
pub fn global_norm(grads: &[&[f32]]) -> f32 {
    let sum: f64 = grads.iter().flat_map(|g| g.iter()).map(|&x| f64::from(x) * f64::from(x)).sum();
    sum.sqrt() as f32
}

/// PyTorch's clip coefficient `min(1, max_norm / (norm + 1e-6))` in f32, as the finalize kernel
/// computes it: NaN for a NaN norm (the step then writes NaN, as PyTorch's does without
/// `error_if_nonfinite`), 1 for `max_norm = inf`.
pub fn clip_coef(norm: f32, max_norm: f32) -> f32 {
    let c = max_norm / (norm + CLIP_EPS);
    if c > 1.0 {
        1.0
    } else {
        c
    }
}

/// One AdamW step of one parameter in place: `grad` (values of its dtype) times `clip`, the f32
/// `master`, `exp_avg`, `exp_avg_sq`; returns the parameter rounded to `param_dtype` (widened
/// to f32). Per element: `g = grad * clip`; `p = master * decay`; `m += (g - m) * (1 - beta1)`;
/// `v = v * beta2 + (g * g) * (1 - beta2)`; `p -= step_size * (m / (sqrt(v) / bc2_sqrt + eps))`.
///
/// # Panics
/// When the slices differ in length (a caller bug).
pub fn adamw_step(
    s: &AdamWScalars,
    clip: f32,
    grad: &[f32],
    master: &mut [f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    param_dtype: DType,
) -> Vec<f32> {
    let n = grad.len();
    assert!(master.len() == n && exp_avg.len() == n && exp_avg_sq.len() == n, "lengths must agree");
    (0..n)
        .map(|i| {
            let g = grad[i] * clip;
            let mut p = master[i] * s.decay;
            let m = exp_avg[i] + (g - exp_avg[i]) * s.one_minus_beta1;
            let v = exp_avg_sq[i] * s.beta2 + (g * g) * s.one_minus_beta2;
            let denom = v.sqrt() / s.bc2_sqrt + s.eps;
            p -= s.step_size * (m / denom);
            (master[i], exp_avg[i], exp_avg_sq[i]) = (p, m, v);
            round_to(param_dtype, p)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_runtime::ops::optimizer::scalars::AdamWHyper;

    fn hyper(step: u64, weight_decay: f32) -> AdamWHyper {
        AdamWHyper { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step }
    }

    #[test]
    fn the_first_step_moves_by_lr_times_the_sign_of_the_gradient() {
        // Step 1: m = 0.1 g, v = 0.001 g²; bias correction gives m̂ = g, v̂ = g², so the update
        // is lr * g / (|g| + eps) ≈ lr * sign(g), whatever the gradient's size.
        let s = AdamWScalars::new(&hyper(1, 0.0));
        // Python floats: the f32 hyper-parameters widened to f64, each scalar rounded once.
        let (lr, b1, b2) = (f64::from(1e-3f32), f64::from(0.9f32), f64::from(0.999f32));
        assert_eq!(s.step_size, (lr / (1.0 - b1)) as f32);
        assert_eq!(s.bc2_sqrt, (1.0 - b2).sqrt() as f32);
        let (mut p, mut m, mut v) = (vec![1.0f32, 1.0, 1.0], vec![0.0; 3], vec![0.0; 3]);
        let out = adamw_step(&s, 1.0, &[0.5, -4.0, 1e-3], &mut p, &mut m, &mut v, DType::F32);
        for (got, want) in out.iter().zip([1.0 - 1e-3, 1.0 + 1e-3, 1.0 - 1e-3]) {
            assert!((got - want).abs() < 2e-7, "{got} vs {want}");
        }
        assert_eq!(m, [0.5 * s.one_minus_beta1, -4.0 * s.one_minus_beta1, 1e-3 * s.one_minus_beta1]);
        assert_eq!(v[1], 16.0 * s.one_minus_beta2);
    }

    #[test]
    fn a_hand_computed_second_step() {
        // p0 = 2, g1 = 1, g2 = 3, lr 0.1, betas (0.5, 0.75), eps 0, wd 0.
        // After step 1: m = 0.5, v = 0.25, p = 2 - 0.1 * (0.5/0.5) / (0.5/0.5) = 1.9.
        // Step 2: m = 0.5 + (3 - 0.5) * 0.5 = 1.75; v = 0.25 * 0.75 + 9 * 0.25 = 2.4375;
        // m̂ = 1.75 / 0.75; v̂ = 2.4375 / 0.4375; p = 1.9 - 0.1 * m̂ / sqrt(v̂).
        let h = |step| AdamWHyper { lr: 0.1, beta1: 0.5, beta2: 0.75, eps: 0.0, weight_decay: 0.0, step };
        let (mut p, mut m, mut v) = (vec![2.0f32], vec![0.0], vec![0.0]);
        adamw_step(&AdamWScalars::new(&h(1)), 1.0, &[1.0], &mut p, &mut m, &mut v, DType::F32);
        assert_eq!((p[0], m[0], v[0]), (1.9, 0.5, 0.25));
        adamw_step(&AdamWScalars::new(&h(2)), 1.0, &[3.0], &mut p, &mut m, &mut v, DType::F32);
        assert_eq!((m[0], v[0]), (1.75, 2.4375));
        let want = 1.9 - 0.1 * (1.75 / 0.75) / (2.4375f64 / 0.4375).sqrt();
        assert!((f64::from(p[0]) - want).abs() < 1e-6, "{} vs {want}", p[0]);
    }

    #[test]
    fn weight_decay_is_decoupled_from_the_gradient() {
        // A zero gradient leaves the moments at 0 and the parameter shrinks by lr * wd exactly:
        // decay is applied to the weight, not added to the gradient (which Adam would normalize).
        let s = AdamWScalars::new(&AdamWHyper { weight_decay: 0.1, ..hyper(1, 0.0) });
        assert_eq!(s.decay, (1.0 - f64::from(1e-3f32) * f64::from(0.1f32)) as f32);
        let (mut p, mut m, mut v) = (vec![3.0f32, -5.0], vec![0.0; 2], vec![0.0; 2]);
        let out = adamw_step(&s, 1.0, &[0.0, 0.0], &mut p, &mut m, &mut v, DType::BF16);
        assert_eq!(p, [3.0 * s.decay, -5.0 * s.decay]);
        assert_eq!((m, v), (vec![0.0; 2], vec![0.0; 2]));
        assert_eq!(out, [round_to(DType::BF16, p[0]), round_to(DType::BF16, p[1])], "params are the rounded masters");
    }

    #[test]
    fn clipping_scales_gradients_only_above_max_norm() {
        let norm = global_norm(&[&[3.0], &[0.0, 4.0]]);
        assert_eq!(norm, 5.0);
        assert_eq!(clip_coef(norm, 10.0), 1.0);
        assert_eq!(clip_coef(norm, 1.0), 1.0 / (5.0 + CLIP_EPS));
        assert_eq!(clip_coef(norm, f32::INFINITY), 1.0);
        assert!(clip_coef(f32::NAN, 1.0).is_nan(), "a NaN norm is not hidden");
        // A clipped gradient changes m and v, and the step of a rescaled gradient differs only
        // through eps (Adam is scale invariant).
        let s = AdamWScalars::new(&hyper(1, 0.0));
        let (mut p, mut m, mut v) = (vec![0.0f32], vec![0.0], vec![0.0]);
        adamw_step(&s, 0.5, &[2.0], &mut p, &mut m, &mut v, DType::F32);
        assert_eq!(m[0], 1.0 * s.one_minus_beta1);
    }
}
