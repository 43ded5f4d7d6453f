//! Application code of the `te` command-line tool: `te train`'s flags, default corpus and
//! reports (the training itself is `te-train`'s `Trainer`), the multi-process launcher, `te
//! generate`, `te checkpoint`, `te embed` (BERT sentence embeddings: model fetching,
//! tokenizer, CLI), and the decoder LLMs of `te generate --model` and `te eval` (`model`,
//! `model_generate`, `eval`).

pub mod checkpoint_cmd;
pub mod context_parallel;
pub mod data;
pub mod embed;
pub mod eval;
pub mod export;
pub mod finetune;
pub mod generate;
pub mod hf;
pub mod launch;
pub mod model;
pub mod model_generate;
pub mod plot;
pub mod train;

/// Exit status of a `te train` stopped by SIGTERM or SIGINT after finishing its step and
/// writing its checkpoint (`EX_TEMPFAIL`: run it again with `--resume`).
pub const EXIT_INTERRUPTED: u8 = 75;
