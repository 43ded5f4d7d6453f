//! Whole models built from the modules: the GPT of the training job and BERT encoders loaded
//! from Hugging Face checkpoints (sentence embeddings).

pub mod bert;
pub mod gpt;

pub use gpt::{GenerateOptions, Gpt, GptConfig, GptCtx, GptLoss, MicroBatch, IGNORE_INDEX};
