//! What a run reports: after each step ([`Progress`], to the progress callback), its loss curve
//! ([`Record`]) and its outcome ([`RunSummary`]).

use crate::config::Precision;

/// One step of a run as the progress callback of [`crate::Trainer::train`] sees it, after the
/// step (and its evaluation, at evaluation steps).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// The run's precision.
    pub precision: Precision,
    /// The optimizer step just finished (1-based).
    pub step: u64,
    /// The run's last step ([`crate::TrainConfig::steps`]).
    pub steps: u64,
    /// Mean training loss of the step's micro-batches (over the ranks of a data-parallel run),
    /// nats per token.
    pub train_loss: f32,
    /// Mean validation loss, at evaluation steps.
    pub val_loss: Option<f32>,
    /// The global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The learning rate of the step.
    pub lr: f32,
    /// Wall time of the step (device synchronized, evaluation excluded), ms.
    pub step_ms: f64,
}

/// One row of the loss curve.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Record {
    /// Optimizer step (1-based).
    pub step: u64,
    /// Mean training loss of the step's micro-batches, nats per token.
    pub train_loss: f32,
    /// Validation loss, at evaluation steps.
    pub val_loss: Option<f32>,
    /// Wall time of the step (device synchronized), ms.
    pub step_ms: f64,
}

/// The outcome of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// FP8 or BF16.
    pub precision: Precision,
    /// The loss curve (from step 1, including steps before a resume).
    pub records: Vec<Record>,
    /// Training tokens per second over the steps this process ran after its first (median step
    /// time), of all ranks together in a data-parallel run; NaN when it ran fewer than two.
    pub tokens_per_s: f64,
    /// Processes the run trained with: the data-parallel ranks, one a GPU (1 on a single GPU
    /// and on the CPU path); the tokens/s of one is `tokens_per_s / ranks`.
    pub ranks: usize,
    /// Peak memory of the run in bytes: on the GPU the memory pool's high-water mark of this
    /// run's allocations (parameters, gradients, optimizer state, activations, workspaces); on
    /// the CPU path the process's peak resident set size (0 where it cannot be read).
    pub peak_memory: u64,
    /// Steps replayed from a CUDA graph ([`crate::TrainConfig::cuda_graph`]); 0 for eager runs.
    pub graphed_steps: u64,
    /// Parameters of the model (the whole model's, also when each rank holds a tensor-parallel
    /// slice of it).
    pub parameters: usize,
}

impl RunSummary {
    /// The last training loss (NaN for a run without steps).
    pub fn final_train_loss(&self) -> f32 {
        self.records.last().map_or(f32::NAN, |r| r.train_loss)
    }

    /// The last validation loss, if the run evaluated.
    pub fn final_val_loss(&self) -> Option<f32> {
        self.records.iter().rev().find_map(|r| r.val_loss)
    }
}

/// The median of `xs` (NaN when empty).
pub(crate) fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_and_the_final_losses() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert!(median(&mut []).is_nan());
        let record = |step, val_loss| Record { step, train_loss: 3.0 - step as f32, val_loss, step_ms: 1.0 };
        let run = RunSummary {
            precision: Precision::Bf16,
            records: vec![record(1, Some(2.5)), record(2, None)],
            tokens_per_s: 1.0,
            ranks: 1,
            peak_memory: 0,
            parameters: 1,
            graphed_steps: 0,
        };
        assert_eq!((run.final_train_loss(), run.final_val_loss()), (1.0, Some(2.5)));
        let empty = RunSummary { records: vec![], ..run };
        assert!(empty.final_train_loss().is_nan() && empty.final_val_loss().is_none());
    }
}
