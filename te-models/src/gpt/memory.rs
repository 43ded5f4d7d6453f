//! How much device memory a [`Gpt`] needs, estimated on the host before anything is allocated,
//! so that `te train` and `te generate` refuse a configuration the GPU cannot hold with the
//! numbers instead of failing somewhere inside the first step.

use super::{Gpt, GptConfig};

/// cuBLASLt workspaces, the optimizer's norm buffers and other fixed allocations (bytes).
const FIXED_BYTES: f64 = (256u64 << 20) as f64;

impl Gpt {
    /// An upper estimate of the device memory (bytes; the memory pool's high-water mark, as
    /// `Device::peak_memory` reads it) of training a GPT of `cfg` on micro-batches of `batch`
    /// sequences of `cfg.seq_length` tokens (`t = batch · seq`), in FP8 (`fp8`) or in the
    /// parameters' dtype, with AdamW:
    /// - parameters and their gradients in `params_dtype` (`P` elements each), AdamW's FP32
    ///   master weights and two moments (`12 · P` bytes); under FP8 the E4M3 weights of the
    ///   GEMMs and their transposes (2 bytes per GEMM weight);
    /// - per layer, what the forward keeps for the backward, per token in 16-bit elements: the
    ///   layer input, the two norm outputs, the fused QKV output, the attention output and the
    ///   residual (`8h`), the MLP's pre-activation and activation (`2f`), two dropout masks
    ///   (`2h` bytes) and `softmax_lse` (4 bytes per head), the fused attention keeping no
    ///   `[s, s]` scores;
    /// - the final norm output, f32 logits and their gradient (`t · (2h + 8v)`);
    /// - the backward's transient gradients of one layer (`t · (8h + 2f)` 16-bit elements) and
    ///   fixed workspaces (256 MiB).
    ///
    /// With `moe`, `f` above is `topk · ffn` (each token's rows in `topk` experts), each layer
    /// also keeps the permuted input and output rows (`2 · topk · h` elements) and f32 routing
    /// buffers (`4 · (E + 3 · topk)` bytes per token), and the GEMM weights are `E` experts' (not
    /// measured on a GPU yet).
    ///
    /// Measured against the high-water mark of a training step on an H100 by the GPU test
    /// `train::memory_estimate_bounds_the_peak` (within 1.5× above it).
    pub fn training_bytes(cfg: &GptConfig, batch: usize, fp8: bool) -> u64 {
        // f64: an estimate, and sizes far past any machine saturate instead of overflowing.
        let (h, v) = (cfg.hidden_size as f64, cfg.vocab_size as f64);
        let layers = cfg.num_layers as f64;
        let t = batch as f64 * cfg.seq_length as f64;
        let e = cfg.params_dtype.size_bytes() as f64;
        let lm_head = if cfg.fp8_lm_head { v * h } else { 0.0 };
        let ffn = cfg.ffn_hidden_size as f64;
        let (f, experts) = match cfg.moe {
            Some(m) => (m.topk as f64 * ffn, m.num_experts as f64),
            None => (ffn, 1.0),
        };
        let gemm_weights = layers * (4.0 * h * h + 2.0 * h * ffn * experts) + lm_head;
        let params = cfg.num_parameters() as f64 * (2.0 * e + 12.0) + if fp8 { 2.0 * gemm_weights } else { 0.0 };
        let saved = t * layers * Self::saved_bytes_per_layer_token(cfg);
        let head = t * (2.0 * h + 8.0 * v);
        let transient = t * (8.0 * h + 2.0 * f) * 2.0;
        (params + saved + head + transient + FIXED_BYTES) as u64
    }

    /// What one layer's forward keeps for its backward, in bytes a token (the per-layer term of
    /// [`Gpt::training_bytes`]): `(8h + 2f) · 2 + 2h + 4 · heads`, with MoE's `f = topk · ffn`
    /// plus its permuted rows (`2 · topk · h` 16-bit elements) and f32 routing buffers (`4 · (E
    /// + 3 · topk)` bytes).
    pub(crate) fn saved_bytes_per_layer_token(cfg: &GptConfig) -> f64 {
        let (h, heads, ffn) = (cfg.hidden_size as f64, cfg.num_attention_heads as f64, cfg.ffn_hidden_size as f64);
        // MoE: the activations of topk experts per token, the permuted rows and the routing
        // buffers.
        let (f, moe_extra) = match cfg.moe {
            Some(m) => {
                let k = m.topk as f64;
                (k * ffn, 2.0 * k * h * 2.0 + 4.0 * (m.num_experts as f64 + 3.0 * k))
            }
            None => (ffn, 0.0),
        };
        (8.0 * h + 2.0 * f) * 2.0 + 2.0 * h + 4.0 * heads + moe_extra
    }

    /// [`Gpt::training_bytes`] per GPU of a model whose layers split over `tp` ranks
    /// ([`Gpt::with_tensor_parallel`]): the whole estimate over `tp`, plus the parts every rank
    /// holds whole, the embeddings and the LM head with their gradients and AdamW state
    /// (`(vocab + seq + vocab) · h · (2e + 12)` bytes) and the fixed workspaces. The replicated
    /// activations (the residual stream without sequence parallelism, the logits) are within
    /// the margin of the whole estimate: GPT `large` at batch 2 in FP8 on two H100s peaked at
    /// 12.38 GiB a GPU against 13.95 GiB estimated here (one GPU: 23.42 GiB peak, 27.24 GiB
    /// estimated). `tp = 1` is [`Gpt::training_bytes`].
    pub fn tensor_parallel_training_bytes(cfg: &GptConfig, batch: usize, fp8: bool, tp: usize) -> u64 {
        let whole = Self::training_bytes(cfg, batch, fp8);
        if tp <= 1 {
            return whole;
        }
        let e = cfg.params_dtype.size_bytes() as f64;
        let (h, v, s) = (cfg.hidden_size as f64, cfg.vocab_size as f64, cfg.seq_length as f64);
        let replicated = (2.0 * v + s) * h * (2.0 * e + 12.0) + FIXED_BYTES;
        (whole as f64 / tp as f64 + replicated) as u64
    }

    /// An upper estimate of the device memory (bytes) of generating with a GPT of `cfg` in
    /// its `params_dtype`: the weights, a KV cache of `batch` sequences of `max_seq` positions
    /// (`2 · layers · batch · max_seq · h` 16-bit elements), the prefill of `batch` prompts of
    /// `prompt` tokens (one layer's activations at a time: `t · (8h + 2f)` elements, and f32
    /// logits `t · v`) and fixed workspaces (256 MiB).
    pub fn generation_bytes(cfg: &GptConfig, batch: usize, prompt: usize, max_seq: usize) -> u64 {
        let (h, v) = (cfg.hidden_size as f64, cfg.vocab_size as f64);
        let f = cfg.ffn_hidden_size as f64 * cfg.moe.map_or(1.0, |m| m.topk as f64);
        let e = cfg.params_dtype.size_bytes() as f64;
        let weights = cfg.num_parameters() as f64 * e;
        let cache = 2.0 * cfg.num_layers as f64 * h * e * batch as f64 * max_seq as f64;
        let t = batch as f64 * prompt as f64;
        let prefill = t * ((8.0 * h + 2.0 * f) * e + 4.0 * v);
        (weights + cache + prefill + FIXED_BYTES) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_grow_with_the_configuration() {
        let small = GptConfig::small();
        let bf16 = Gpt::training_bytes(&small, 8, false);
        // Parameters alone: 16 bytes each (bf16 value and gradient, f32 master and moments).
        assert!(bf16 > 16 * small.num_parameters() as u64 + (256 << 20));
        assert!(Gpt::training_bytes(&small, 16, false) > bf16 && Gpt::training_bytes(&small, 8, true) > bf16);
        // large at batch 64 × 2048 needs more than any single GPU of today holds.
        assert!(Gpt::training_bytes(&GptConfig::large(), 64, false) > 200 << 30);
        // Absurd sizes saturate instead of overflowing.
        let huge = GptConfig { seq_length: usize::MAX / 2, ..small.clone() };
        assert_eq!(Gpt::training_bytes(&huge, usize::MAX, true), u64::MAX);
        // Tensor parallelism: about the whole over the ranks, never below it for one rank.
        let large = GptConfig::large();
        let (one, two) =
            (Gpt::training_bytes(&large, 2, true), Gpt::tensor_parallel_training_bytes(&large, 2, true, 2));
        assert_eq!(Gpt::tensor_parallel_training_bytes(&large, 2, true, 1), one);
        assert!(two > one / 2 && two < one * 3 / 4, "{two} vs {one}");
        let g = Gpt::generation_bytes(&small, 1, 128, 1024);
        assert!(g > 2 * small.num_parameters() as u64 && Gpt::generation_bytes(&small, 32, 128, 1024) > g);
    }
}
