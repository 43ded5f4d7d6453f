//! What to compile ahead of time: the [`KernelTarget`] a module's kernel list is specialized for,
//! and the [`ModelConfig`] of `te prewarm --config FILE` (one TE-style transformer layer of a
//! given geometry, precision and recipe).
//!
//! The lists themselves are the module configs' (`LinearConfig::kernel_specs`, ...,
//! `TransformerLayerConfig::kernel_specs`, in `modules/kernel_specs.rs`); `te_codegen::prewarm`
//! compiles a list into the disk cache.

mod config;
mod target;

pub use config::{override_recipe, parse_fp8_format, ModelConfig, PositionEmbedding};
pub use target::KernelTarget;
