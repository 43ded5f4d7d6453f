//! CPU models: complete f32 models that run on the host, for the CLI's paths without a GPU
//! (`te train --preset tiny`, `te embed --precision cpu`) and as whole-model checks of the GPU
//! models.
//!
//! - [`gpt`]: [`gpt::GptRef`], the CPU twin of [`crate::gpt::Gpt`] (same parameters,
//!   init and dropout masks; GEMM inputs optionally rounded to BF16 or FP8 with delayed
//!   scaling), and [`gpt::GptAdamW`], its AdamW with the GPU optimizer's arithmetic;
//! - [`bert`]: the f32 BERT sentence embedder (Hugging Face `BertModel` plus
//!   sentence-transformers pooling);
//! - [`decoder`]: [`decoder::DecoderRef`], the f32 decoder LLM of [`crate::decoder`] (Llama,
//!   Qwen2, Qwen3, Gemma 3 from Hugging Face directories) with its KV cache, generation and
//!   perplexity.
//!
//! They are built from the per-kernel CPU oracle in [`te_reference`] (norms, embeddings,
//! dropout masks, the loss, scaling and AdamW arithmetic); the oracle itself knows nothing of
//! models.

pub mod bert;
pub mod decoder;
pub mod gpt;
