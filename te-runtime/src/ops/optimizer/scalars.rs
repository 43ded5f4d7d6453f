//! The per-step scalars of one AdamW update (PyTorch `torch.optim.AdamW`, Loshchilov & Hutter
//! 2019): what the fused optimizer kernel is launched with ([`crate::ops::optimizer`]) and what the
//! CPU reference (`te_reference::optimizer`) steps with, so both use the same f32 values.

/// AdamW hyper-parameters of one step of one parameter.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate of this step.
    pub lr: f32,
    /// Decay of the first moment.
    pub beta1: f32,
    /// Decay of the second moment.
    pub beta2: f32,
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f32,
    /// Decoupled weight decay (0 for a parameter excluded from decay).
    pub weight_decay: f32,
    /// This parameter's step number, 1 for its first update (bias correction).
    pub step: u64,
}

/// The per-step scalars of PyTorch's single-tensor AdamW, each computed as PyTorch does on the
/// host (Python floats are f64) and rounded to f32 once.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWScalars {
    /// `1 - lr * weight_decay` (PyTorch `param.mul_(1 - lr * weight_decay)`).
    pub decay: f32,
    /// `beta1`.
    pub beta1: f32,
    /// `1 - beta1` (the `lerp_` weight).
    pub one_minus_beta1: f32,
    /// `beta2`.
    pub beta2: f32,
    /// `1 - beta2` (the `addcmul_` value).
    pub one_minus_beta2: f32,
    /// `eps`.
    pub eps: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
}

impl AdamWScalars {
    /// The scalars of `h` (`step ≥ 1`; step 0 is treated as 1).
    pub fn new(h: &AdamWHyper) -> Self {
        let step = h.step.max(1).min(i32::MAX as u64) as i32;
        let (lr, b1, b2) = (f64::from(h.lr), f64::from(h.beta1), f64::from(h.beta2));
        Self {
            decay: (1.0 - lr * f64::from(h.weight_decay)) as f32,
            beta1: h.beta1,
            one_minus_beta1: (1.0 - b1) as f32,
            beta2: h.beta2,
            one_minus_beta2: (1.0 - b2) as f32,
            eps: h.eps,
            step_size: (lr / (1.0 - b1.powi(step))) as f32,
            bc2_sqrt: (1.0 - b2.powi(step)).sqrt() as f32,
        }
    }
}
