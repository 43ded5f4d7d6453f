//! [`AdamWConfig`]: AdamW's settings (PyTorch `torch.optim.AdamW`'s defaults, Megatron-LM's and
//! nanoGPT's weight-decay grouping, Megatron-LM's skipped iterations) and their checks.

use super::LrSchedule;
use te_runtime::{Error, Result};

const MODULE: &str = "AdamW";

/// AdamW's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// The learning rate per step.
    pub lr: LrSchedule,
    /// `(beta1, beta2)`, each in `[0, 1)`. PyTorch's default `(0.9, 0.999)`.
    pub betas: (f32, f32),
    /// Added to the bias-corrected `sqrt(v)`, ≥ 0. PyTorch's default `1e-8`.
    pub eps: f32,
    /// Decoupled weight decay, ≥ 0. PyTorch's default `0.01`.
    pub weight_decay: f32,
    /// Clip the gradients to this global L2 norm (> 0) before the update; `None`: no clipping.
    pub max_grad_norm: Option<f32>,
    /// Apply weight decay to biases and norm parameters too (PyTorch: `true`, one group);
    /// `false` decays only GEMM weights ([`te_nn::modules::ParamKind::Weight`]), as Megatron-LM and nanoGPT do.
    pub decay_biases_and_norms: bool,
    /// Skip a step whose gradient norm is NaN or infinite (Megatron-LM's skipped iteration):
    /// decided on the device, nothing is updated and the step does not count
    /// ([`super::StepStats::skipped`]). PyTorch's default `false` updates with the NaN.
    pub skip_nonfinite: bool,
}

impl AdamWConfig {
    /// PyTorch's defaults with the given schedule: betas `(0.9, 0.999)`, eps `1e-8`, weight
    /// decay `0.01` on every parameter, no clipping.
    pub fn new(lr: LrSchedule) -> Self {
        Self {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            max_grad_norm: None,
            decay_biases_and_norms: true,
            skip_nonfinite: false,
        }
    }

    /// Checks every field's range.
    ///
    /// # Errors
    /// [`Error::Argument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        self.lr.validate()?;
        let bad = |message: String| Err(Error::Argument { op: MODULE, message });
        let (b1, b2) = self.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return bad(format!("betas must be in [0, 1), got ({b1}, {b2})"));
        }
        let non_negative = |x: f32| x.is_finite() && x >= 0.0;
        if !non_negative(self.eps) || !non_negative(self.weight_decay) {
            return bad(format!(
                "eps and weight_decay must be finite and ≥ 0, got {} and {}",
                self.eps, self.weight_decay
            ));
        }
        match self.max_grad_norm {
            Some(m) if m.is_nan() || m <= 0.0 => bad(format!("max_grad_norm must be > 0 (None: no clipping), got {m}")),
            _ => Ok(()),
        }
    }
}
