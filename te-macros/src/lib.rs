//! Derive macros of the Transformer Engine for Rust.
//!
//! `#[derive(Module)]` (path-keyed parameter traversal, FP8 state, the model's kernel specs)
//! arrives with the model-structs issue; this crate holds the workspace slot for it.
