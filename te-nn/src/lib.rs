//! The neural-network layer of the Transformer Engine for Rust, on top of `te-runtime`: FP8
//! recipes, FP8 tensors, scaling state and `fp8_autocast` ([`fp8`]); TE's modules with explicit
//! forward/backward ([`modules`]: `Linear`, `LayerNormLinear`, `LayerNormMLP`,
//! `DotProductAttention`, `MultiheadAttention`, `TransformerLayer`, `GroupedLinear`, `MoeMLP`, ...)
//! and their `#[derive(Module)]` traversal; parallelism, below the modules ([`parallel`]: the
//! device mesh, the tensor-parallel config, the hooks the modules call around their GEMMs and
//! token shards, the sharding arithmetic, data parallelism); checkpoints of any
//! [`Module`] ([`checkpoint`]: safetensors with TE's names and the FP8 state, the optimizer's
//! state file, tensor-parallel split and merge); and what to compile ahead of time for a layer
//! configuration ([`prewarm`]).
//!
//! ```no_run
//! use te_nn::fp8::{fp8_autocast, DelayedScaling};
//! use te_nn::modules::{Linear, LinearConfig};
//! use te_runtime::{DType, Device, Tensor};
//!
//! # fn main() -> te_runtime::Result<()> {
//! let dev = Device::new(0)?;
//! let mut fc = Linear::new(&dev, LinearConfig::new(4096, 16384))?;
//! let x = Tensor::zeros(&dev, DType::BF16, &[8192, 4096])?;
//! let (y, ctx) = fp8_autocast(true, DelayedScaling::default(), || fc.forward(&x))?;
//! let dx = fc.backward(ctx, &Tensor::zeros(&dev, DType::BF16, y.shape())?)?;
//! # Ok(()) }
//! ```

pub mod checkpoint;
pub mod fp8;
pub mod modules;
pub mod parallel;
pub mod prewarm;

pub use modules::Module;
/// `#[derive(Module)]`: the path-keyed traversal of a model struct (see [`modules::Module`]).
pub use te_macros::Module;
pub use te_runtime::{Arch, DType, Device, Error, Result, Tensor};
