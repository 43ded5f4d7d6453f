//! Optimizers of the training job: [`AdamW`] with FP32 master weights, global-norm gradient
//! clipping and an [`LrSchedule`], stepping every parameter of a [`crate::Module`] with one fused
//! multi-tensor kernel ([`crate::ops::optimizer`]); [`scalars`]: the per-step scalars that kernel is
//! launched with.

mod adamw;
pub mod scalars;
mod schedule;
pub(crate) mod state_file;

pub use adamw::{AdamW, AdamWConfig, ParamState, StepStats};
pub use schedule::LrSchedule;
