//! Optimizers of the training job: [`AdamW`] with FP32 master weights, global-norm gradient
//! clipping and an [`LrSchedule`], stepping every parameter of a [`te_nn::Module`] with one fused
//! multi-tensor kernel ([`te_runtime::ops::optimizer`], launched with the per-step scalars of
//! [`te_runtime::ops::optimizer::scalars`]), replicated on every rank or sharded over the
//! data-parallel group (ZeRO stage 1, [`AdamW::new_zero`], split as [`Partition`] says; stage 2,
//! [`AdamW::new_zero_stage`], with the gradients reduced to the same owners,
//! [`Partition::grad_shards`]; stage 3, [`AdamW::step_sharded`], writing the rank's pieces of
//! the sharded weights). Its state file is [`te_nn::checkpoint::optimizer_state`]'s either way.

mod adamw;
mod config;
mod partition;
mod schedule;
mod stage;
mod state;
mod zero;
mod zero3;

pub use adamw::{AdamW, ParamState, PendingStep, StepStats};
pub use config::AdamWConfig;
pub use partition::{Partition, Piece};
pub use schedule::LrSchedule;
pub use stage::{OptimizerMemory, ZeroStage};
