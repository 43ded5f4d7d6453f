//! Whole models built from the modules: the GPT of the training job.

pub mod gpt;

pub use gpt::{Gpt, GptConfig, GptCtx, GptLoss, MicroBatch, IGNORE_INDEX};
