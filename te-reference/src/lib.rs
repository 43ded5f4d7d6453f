//! CPU reference of every kernel family: the oracle of the GPU tests and the path CI checks
//! numerics on. Each function mirrors its kernel's arithmetic (f32 math in the same order where
//! it decides rounding), so FP8 casts match bit for bit and reductions within float rounding.
//!
//! The oracle mirrors kernels, not the library: it uses `te_codegen`'s specs, [`te_runtime::numerics`]
//! and op-level vocabulary (dropout parameters, GEMM matrix views, the AdamW kernel's scalars in
//! [`te_runtime::ops::optimizer::scalars`]), never models, modules, FP8 state or checkpoints
//! (`scripts/check-layers` checks it). Whole CPU models built from it live in `te_models::cpu`.

pub mod activation;
pub mod argmax;
pub mod attention;
pub mod attn_merge;
pub mod block_scaling;
pub mod cast;
pub mod cast_transpose;
pub mod cross_entropy;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod gemm;
pub mod gemv;
pub mod linear;
pub mod modules;
pub mod moe;
pub mod moe_mlp;
pub mod norm;
pub mod optimizer;
pub mod qkv_rope;
pub mod rope;
pub mod scaling;
pub mod softmax;
pub mod transformer;
