//! Whole models of the Transformer Engine for Rust, built from `te-nn`'s modules: the GPT of the
//! training job ([`gpt`]), BERT encoders loaded from Hugging Face checkpoints ([`bert`]), the
//! decoder LLM family (Llama, Qwen2, Qwen3, Gemma 3: configuration and Hugging Face import,
//! [`decoder`]), the host side of text generation ([`generate`]: the sampler, UTF-8 streaming,
//! the decode loop), GGUF model files ([`gguf`]: the container, its metadata, dequantization of
//! ggml's tensor types) and the CPU twins of the models
//! ([`cpu`]: the GPT of `te train --preset tiny` without a GPU, the f32 BERT embedder), built on
//! the CPU oracle `te-reference`, and the tokenizers of decoder LLMs from Hugging Face and GGUF
//! files ([`tokenizer`]).

pub mod bert;
pub mod cpu;
pub mod decoder;
pub mod generate;
pub mod gguf;
pub mod gpt;
pub mod tokenizer;

pub use gpt::{GenerateOptions, Gpt, GptConfig, GptCtx, GptLoss, MicroBatch, IGNORE_INDEX};
