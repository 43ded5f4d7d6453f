//! The non-finite policy of a run: how many steps with a NaN or infinite loss or gradient norm
//! are skipped before it stops ([`crate::TrainConfig::skip_nonfinite_steps`], Megatron-LM's
//! skipped iterations).

use crate::error::TrainError;
use std::path::Path;

/// Counts the steps whose loss or gradient norm is NaN or infinite and stops the run at the
/// first one beyond the allowed count: the optimizer skips such a step on its own
/// (`AdamWConfig::skip_nonfinite`), so the weights stay those of the last good step.
#[derive(Debug, Clone)]
pub struct NonFiniteGuard {
    allowed: u64,
    seen: u64,
}

impl NonFiniteGuard {
    /// A guard that lets `allowed` non-finite steps be skipped.
    pub fn new(allowed: u64) -> Self {
        Self { allowed, seen: 0 }
    }

    /// The non-finite steps seen so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Checks step `step`'s mean `loss` and `grad_norm` (`skipped`: the optimizer skipped it);
    /// `checkpoint` is the newest good checkpoint, if any.
    ///
    /// # Errors
    /// [`TrainError::NonFinite`] once more steps than allowed were non-finite, saying what
    /// happened to the weights, where the last good checkpoint is and what to change.
    pub fn check(
        &mut self,
        step: u64,
        (loss, grad_norm, skipped): (f32, f32, bool),
        checkpoint: Option<&Path>,
    ) -> Result<(), TrainError> {
        if loss.is_finite() && grad_norm.is_finite() {
            return Ok(());
        }
        self.seen += 1;
        if self.seen <= self.allowed {
            tracing::warn!(
                "step {step}: loss {loss}, gradient norm {grad_norm}; step skipped ({} of --skip-nonfinite-steps {})",
                self.seen,
                self.allowed
            );
            return Ok(());
        }
        let weights = if skipped {
            "the optimizer skipped the step: the weights are those of the step before"
        } else {
            "the gradient norm was finite, so the optimizer applied the step"
        };
        let resume = match checkpoint {
            Some(c) => format!("the last good checkpoint is {} (continue from it with --resume)", c.display()),
            None => "no checkpoint was written yet".into(),
        };
        Err(TrainError::NonFinite {
            step,
            message: format!(
                "the training loss is {loss} and the gradient norm {grad_norm} (non-finite); {weights}; {resume}. \
                 Lower --lr (TrainConfig::lr), or pass --skip-nonfinite-steps N (TrainConfig::skip_nonfinite_steps) to \
                 skip up to N such steps ({} allowed now)",
                self.allowed
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finite_steps_pass_and_nonfinite_ones_are_counted_up_to_the_allowance() {
        let mut guard = NonFiniteGuard::new(2);
        guard.check(1, (2.5, 0.7, false), None).unwrap();
        assert_eq!(guard.seen(), 0);
        guard.check(2, (f32::NAN, 0.7, false), None).unwrap();
        guard.check(3, (2.5, f32::INFINITY, true), None).unwrap();
        assert_eq!(guard.seen(), 2);
        let ckpt = Path::new("/runs/fp8/step-0000003");
        let e = guard.check(4, (f32::NAN, f32::NAN, true), Some(ckpt)).unwrap_err();
        let message = e.to_string();
        assert!(matches!(e, TrainError::NonFinite { step: 4, .. }), "{message}");
        assert!(message.starts_with("step 4: the training loss is NaN"), "{message}");
        assert!(message.contains("skipped the step") && message.contains("step-0000003"), "{message}");
        assert!(message.contains("--skip-nonfinite-steps") && message.contains("2 allowed now"), "{message}");
    }

    #[test]
    fn the_first_nonfinite_step_stops_a_run_that_allows_none() {
        let mut guard = NonFiniteGuard::new(0);
        let e = guard.check(7, (f32::INFINITY, 1.0, false), None).unwrap_err().to_string();
        assert!(e.contains("no checkpoint was written yet") && e.contains("applied the step"), "{e}");
    }
}
