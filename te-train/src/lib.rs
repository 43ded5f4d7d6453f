//! Training with the Transformer Engine for Rust.
//!
//! - [`Trainer`]: a GPT ([`te_models::gpt::GptConfig`]) trained on a byte [`data::Corpus`] in
//!   FP8 (any [`te_nn::fp8::Recipe`]) or BF16 with AdamW and a warmup + cosine schedule, on a
//!   GPU ([`Backend::Gpu`], optionally one rank of a data- and/or tensor-parallel run laid out
//!   by [`te_nn::parallel::Parallel`]) or on the CPU ([`Backend::Cpu`]); a progress callback
//!   ([`Progress`]), the non-finite policy ([`NonFiniteGuard`]), and atomic checkpoints that a
//!   stopped run (a stop flag set by a signal handler) resumes from bit for bit
//!   ([`checkpoint`]).
//! - [`data`]: the corpus, its validation split and the seeded, data-parallel-sharded batches;
//!   for a pretrained model's tokenizer, documents from text files, directories and `.jsonl`
//!   tokenized into a cached [`data::TokenDataset`], split by documents, and packed into
//!   fixed-length windows or `thd` rows with `cu_seqlens` ([`data::ThdPacker`]), which
//!   [`Trainer::finetune`] fine-tunes a pretrained decoder of the family on (its checkpoints
//!   record the decoder: [`checkpoint::DecoderSection`]).
//! - [`optim`]: AdamW with FP32 master weights and one fused multi-tensor kernel, and
//!   learning-rate schedules.
//!
//! `te train` is a thin command line over this crate; `examples/train_gpt.rs` at the
//! repository's root trains the tiny GPT in a few lines.

pub mod checkpoint;
mod config;
pub mod data;
mod error;
mod nonfinite;
pub mod optim;
mod summary;
mod trainer;

pub use checkpoint::CheckpointOptions;
pub use config::{Precision, TrainConfig};
pub use error::TrainError;
pub use nonfinite::NonFiniteGuard;
pub use summary::{Progress, Record, RunSummary};
pub use trainer::{check_context_seq, cpu_gemm_precision, Backend, Pack, TrainLm, Trainer, FP8_CALIBRATION_BATCHES};
