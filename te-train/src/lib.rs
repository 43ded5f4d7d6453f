//! Training with the Transformer Engine for Rust: optimizers and learning-rate schedules
//! ([`optim`]: AdamW with FP32 master weights and one fused multi-tensor kernel).

pub mod optim;
