//! GPU tests: every kernel family against the CPU reference on random inputs with fixed seeds,
//! at shapes that are and are not tile multiples. Without a GPU each test skips, unless
//! `TE_REQUIRE_GPU=1` (set by `.gpu/run-tests`), where a missing GPU fails.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

mod activation;
mod argmax;
mod attention;
mod attn_merge;
mod bert;
mod bert_graph;
mod block_quantize;
mod cast;
mod cast_transpose;
mod checkpoint;
mod context_parallel;
mod context_parallel_train;
mod copy;
mod decode_attention;
mod decode_attention_fp8;
mod decoder;
mod decoder_train;
mod dist_failure;
mod dropout;
mod elementwise;
mod fp8_attention;
mod fp8_attention_bwd;
mod fp8_dpa;
mod fp8_mha;
mod fused_attention;
mod gemm;
mod gemv;
mod generate;
mod gpt;
mod gpt_reference;
mod graph;
mod grouped_gemm;
mod grouped_linear;
mod head_dim_v;
mod jit;
mod kernel_specs;
mod linear;
mod modules;
mod moe;
mod moe_mlp;
mod moe_router;
mod multi_gpu;
mod multi_gpu_tp;
mod nccl;
mod norm;
mod offload;
mod optimizer;
mod prefill_graph;
mod qkv_rope;
mod rank_death;
mod recompute;
mod rope;
mod scaling;
mod soak;
mod softmax;
mod tp_overlap;
mod train;
mod train_graph;
mod visit;
mod zero;
mod zero2;
mod zero3;
mod zero3_fp8;
