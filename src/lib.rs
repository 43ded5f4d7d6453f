//! Application code of the `te` command-line tool: the training job's data pipeline and loop,
//! and `te embed` (BERT sentence embeddings: model fetching, tokenizer, CLI) (the models,
//! kernels and FP8 machinery are in `te-runtime` and `te-codegen`).

pub mod checkpoint_cmd;
pub mod data;
pub mod embed;
pub mod generate;
pub mod hf;
pub mod launch;
pub mod plot;
pub mod run_checkpoint;
pub mod train;
pub mod train_cpu;

/// Exit status of a `te train` stopped by SIGTERM or SIGINT after finishing its step and
/// writing its checkpoint (`EX_TEMPFAIL`: run it again with `--resume`).
pub const EXIT_INTERRUPTED: u8 = 75;
