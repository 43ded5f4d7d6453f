//! Optimizers of the training job: [`AdamW`] with FP32 master weights, global-norm gradient
//! clipping and an [`LrSchedule`], stepping every parameter of a [`te_nn::Module`] with one fused
//! multi-tensor kernel ([`te_runtime::ops::optimizer`], launched with the per-step scalars of
//! [`te_runtime::ops::optimizer::scalars`]). Its state file is
//! [`te_nn::checkpoint::optimizer_state`]'s.

mod adamw;
mod schedule;
mod state;

pub use adamw::{AdamW, AdamWConfig, ParamState, PendingStep, StepStats};
pub use schedule::LrSchedule;
