//! What to compile ahead of time: the [`ModelConfig`] of `te prewarm --config FILE` (one TE-style transformer layer of a
//! given geometry, precision and recipe).
//!
//! The lists themselves are the module configs' (`LinearConfig::kernel_specs`, ...,
//! `TransformerLayerConfig::kernel_specs`, in `modules/kernel_specs.rs`); `te_codegen::prewarm`
//! compiles a list into the disk cache. [`KernelTarget`] (what a list is specialized for besides
//! a module's sizes) lives with the modules and is re-exported here.

mod config;

pub use crate::modules::KernelTarget;
pub use config::{ModelConfig, PositionEmbedding};
