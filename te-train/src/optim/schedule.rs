//! Learning-rate schedules: constant, and linear warmup then cosine decay (Loshchilov & Hutter
//! 2017, "SGDR"; the GPT-3 / Megatron-LM `OptimizerParamScheduler` with `lr_decay_style =
//! cosine`).

use te_runtime::{Error, Result};

/// The learning rate as a function of the optimizer step (1 for the first step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant(f32),
    /// `peak * step / warmup_steps` for `step ≤ warmup_steps`; then `min_lr + (peak - min_lr) *
    /// (1 + cos(π * progress)) / 2` with `progress = (step - warmup_steps) / (total_steps -
    /// warmup_steps)`, clamped to 1 (so `min_lr` after `total_steps`). Computed in f64, rounded
    /// to f32 once.
    WarmupCosine {
        /// The rate at the end of the warmup.
        peak: f32,
        /// Steps of linear warmup (0: start at `peak`).
        warmup_steps: u64,
        /// The step at which the decay reaches `min_lr`, ≥ `warmup_steps`.
        total_steps: u64,
        /// The floor of the decay, ≤ `peak`.
        min_lr: f32,
    },
}

impl LrSchedule {
    /// The rate of optimizer step `step` (1-based; step 0 counts as the first).
    pub fn lr(&self, step: u64) -> f32 {
        match *self {
            LrSchedule::Constant(lr) => lr,
            LrSchedule::WarmupCosine { peak, warmup_steps, total_steps, min_lr } => {
                let step = step.max(1);
                let (peak, min_lr) = (f64::from(peak), f64::from(min_lr));
                if step <= warmup_steps {
                    return (peak * step as f64 / warmup_steps as f64) as f32;
                }
                let decay_steps = total_steps.saturating_sub(warmup_steps);
                let progress =
                    if decay_steps == 0 { 1.0 } else { ((step - warmup_steps) as f64 / decay_steps as f64).min(1.0) };
                (min_lr + (peak - min_lr) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())) as f32
            }
        }
    }

    /// Checks the rates are finite and ≥ 0, `min_lr ≤ peak` and `warmup_steps ≤ total_steps`.
    ///
    /// # Errors
    /// [`Error::Argument`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |message: String| Err(Error::Argument { op: "LrSchedule", message });
        let rate_ok = |r: f32| r.is_finite() && r >= 0.0;
        match *self {
            LrSchedule::Constant(lr) if !rate_ok(lr) => bad(format!("the rate must be finite and ≥ 0, got {lr}")),
            LrSchedule::WarmupCosine { peak, min_lr, .. } if !rate_ok(peak) || !rate_ok(min_lr) || min_lr > peak => {
                bad(format!("need 0 ≤ min_lr ≤ peak, both finite; got min_lr {min_lr}, peak {peak}"))
            }
            LrSchedule::WarmupCosine { warmup_steps, total_steps, .. } if warmup_steps > total_steps => {
                bad(format!("warmup_steps = {warmup_steps} exceeds total_steps = {total_steps}"))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_then_cosine_decays_to_min_lr() {
        let s = LrSchedule::WarmupCosine { peak: 1e-3, warmup_steps: 10, total_steps: 110, min_lr: 1e-4 };
        s.validate().unwrap();
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * b;
        assert!(close(s.lr(1), 1e-4) && close(s.lr(5), 5e-4), "{} {}", s.lr(1), s.lr(5));
        assert_eq!(s.lr(10), 1e-3);
        // Halfway through the decay the cosine is 0: the midpoint of peak and min_lr.
        assert!((s.lr(60) - 5.5e-4).abs() < 1e-9, "{}", s.lr(60));
        assert!(s.lr(11) < 1e-3 && s.lr(11) > s.lr(12));
        assert_eq!(s.lr(110), 1e-4);
        assert_eq!(s.lr(1000), 1e-4, "min_lr after total_steps");
        let no_warmup = LrSchedule::WarmupCosine { peak: 1.0, warmup_steps: 0, total_steps: 0, min_lr: 0.5 };
        assert_eq!((no_warmup.lr(0), no_warmup.lr(7)), (0.5, 0.5));
        assert_eq!(LrSchedule::Constant(0.3).lr(99), 0.3);
    }

    #[test]
    fn invalid_schedules_are_typed_errors() {
        let e = LrSchedule::WarmupCosine { peak: 1e-4, warmup_steps: 1, total_steps: 2, min_lr: 1e-3 }.validate();
        assert!(matches!(e, Err(Error::Argument { .. })), "{e:?}");
        let e = LrSchedule::WarmupCosine { peak: 1e-3, warmup_steps: 3, total_steps: 2, min_lr: 0.0 }.validate();
        assert!(e.unwrap_err().to_string().contains("warmup_steps = 3"));
        assert!(LrSchedule::Constant(f32::NAN).validate().is_err());
    }
}
