//! How much device memory fine-tuning a [`DecoderLm`] takes, estimated on the host before
//! anything is allocated (as `Gpt::training_bytes` for the GPT presets), so that a run the GPU
//! cannot hold is refused with the numbers instead of failing inside its first step.

use super::DecoderLm;
use crate::decoder::DecoderConfig;

/// cuBLASLt workspaces, the optimizer's norm buffers and other fixed allocations (bytes).
const FIXED_BYTES: f64 = (256u64 << 20) as f64;

impl DecoderLm {
    /// An upper estimate of the device memory (bytes; the memory pool's high-water mark) of
    /// training a decoder of `cfg` in BF16 on micro-batches of `batch` sequences of `seq`
    /// tokens (`t = batch · seq`), in FP8 GEMMs (`fp8`) or BF16, with AdamW:
    /// - the parameters and their gradients in BF16 and AdamW's FP32 master weights and two
    ///   moments (`16` bytes a parameter, the tied embedding counted once); under FP8 the E4M3
    ///   weights of the layers' GEMMs and their transposes (2 bytes each);
    /// - per layer, what the forward keeps for the backward, per token in 16-bit elements: the
    ///   layer input, the two norm outputs, the residual and the two block outputs (`6h`, and
    ///   `2h` more with the sandwich norms), the fused QKV output (`(heads + 2·groups)·d`), q
    ///   and k copied apart, normed and rotated (`2·(heads + groups)·d`), the attention output
    ///   (`heads·d`), the MLP's pre-activation and activation (`fc1 + ffn`), and `softmax_lse`
    ///   (4 bytes a head); the fused attention keeps no `[s, s]` scores, and a sliding window
    ///   saves compute, not memory;
    /// - the final norm's output and the BF16 logits with their gradient (`t · (2h + 4v)`
    ///   bytes), the tied head's weight gradient before it joins the embedding's (`2·v·h`);
    /// - one layer's transient gradients (`t · (fc1 + ffn + 3·(heads + 2·groups)·d + 4h)`
    ///   16-bit elements) and fixed workspaces (256 MiB).
    ///
    /// Gemma 3 270M at batch 8 × 1024 on an H100 (2026-11-27): 17.3 GiB estimated against a
    /// 15.35 GiB high-water mark (BF16) and 15.22 GiB (FP8) of `te train --model`.
    pub fn training_bytes(cfg: &DecoderConfig, batch: usize, seq: usize, fp8: bool) -> u64 {
        // f64: an estimate, and sizes far past any machine saturate instead of overflowing.
        let (h, v, d) = (cfg.hidden_size as f64, cfg.vocab_size as f64, cfg.head_dim as f64);
        let (hq, g, layers) = (cfg.num_attention_heads as f64, cfg.num_gqa_groups as f64, cfg.num_layers as f64);
        let (fc1, ffn) = (cfg.fc1_size() as f64, cfg.ffn_hidden_size as f64);
        let t = batch as f64 * seq as f64;
        let qkv = (hq + 2.0 * g) * d;
        let gemm_weights = layers * ((cfg.qkv_size() + cfg.fc1_size()) as f64 * h + h * (hq * d + ffn));
        let params = cfg.num_parameters() as f64 * 16.0 + if fp8 { 2.0 * gemm_weights } else { 0.0 };
        let saved = t * layers * Self::saved_bytes_per_layer_token(cfg);
        let tied = if cfg.tie_word_embeddings { 2.0 * v * h } else { 0.0 };
        let head = t * (2.0 * h + 4.0 * v) + tied;
        let transient = t * (fc1 + ffn + 3.0 * qkv + 4.0 * h) * 2.0;
        (params + saved + head + transient + FIXED_BYTES) as u64
    }

    /// [`DecoderLm::training_bytes_with`] on one rank of a context-parallel run over `cp`
    /// ranks ([`DecoderLm::set_context_parallel`]): the activations, logits and transient
    /// gradients of the rank's `seq / cp` tokens a sequence, plus the keys and values
    /// all-gathered for one layer's attention (`2 · seq · groups · d` 16-bit elements a sequence,
    /// and their gradients' sums in the backward); the weights and optimizer state whole (they
    /// are replicated over the group). `cp` 1 is [`DecoderLm::training_bytes_with`].
    pub fn training_bytes_cp(
        cfg: &DecoderConfig,
        batch: usize,
        seq: usize,
        cp: usize,
        fp8: bool,
        mode: te_nn::modules::Recompute,
    ) -> u64 {
        let cp = cp.max(1);
        let local = Self::training_bytes_with(cfg, batch, seq / cp, fp8, mode);
        if cp == 1 {
            return local;
        }
        let kv = 2.0 * (cfg.num_gqa_groups * cfg.head_dim) as f64;
        // The gathered k and v and, in the backward, their gradients over the whole sequence.
        let gathered = batch as f64 * seq as f64 * kv * 2.0 * 2.0;
        local + gathered as u64
    }

    /// Bytes of one layer's 16-bit weights (BF16: 2 bytes a parameter; every layer of the
    /// family has the same parameters): what ZeRO-3 ([`DecoderLm::set_zero3`]) shards.
    pub fn layer_weight_bytes(cfg: &DecoderConfig) -> u64 {
        let (h, v) = (cfg.hidden_size as u64, cfg.vocab_size as u64);
        let norm = if cfg.normalization == te_nn::modules::NormKind::LayerNorm { 2 * h } else { h };
        let embeddings = v * h * if cfg.tie_word_embeddings { 1 } else { 2 };
        let layers = cfg.num_parameters().saturating_sub(embeddings + norm);
        2 * layers / cfg.num_layers.max(1) as u64
    }

    /// The bytes ZeRO-3 over `ranks` data-parallel ranks takes off [`DecoderLm::training_bytes`]
    /// on each: the layers' 16-bit weights are kept as pieces (about `1/ranks` of them), and
    /// the ring of whole buffers they are gathered into holds two layers
    /// (`(1 − 1/N) · L · layer − 2 · layer`, 0 when that is not positive); the embedding, final
    /// norm and LM head stay whole, and the gradients' share is ZeRO-2's, not counted here.
    pub fn zero3_weight_saving(cfg: &DecoderConfig, ranks: usize) -> u64 {
        let n = ranks.max(1) as u64;
        let layer = Self::layer_weight_bytes(cfg);
        let all = layer * cfg.num_layers as u64;
        (all / n * (n - 1)).saturating_sub(2 * layer)
    }

    /// What one layer's forward keeps for its backward, in bytes a token (the per-layer term of
    /// [`DecoderLm::training_bytes`]): `(6h + sandwich + qkv + 2 · (heads + groups) · d + heads ·
    /// d + fc1 + ffn) · 2 + 4 · heads`.
    pub(crate) fn saved_bytes_per_layer_token(cfg: &DecoderConfig) -> f64 {
        let (h, d) = (cfg.hidden_size as f64, cfg.head_dim as f64);
        let (hq, g) = (cfg.num_attention_heads as f64, cfg.num_gqa_groups as f64);
        let (fc1, ffn) = (cfg.fc1_size() as f64, cfg.ffn_hidden_size as f64);
        let qkv = (hq + 2.0 * g) * d;
        let sandwich = if cfg.sandwich_norm { 2.0 * h } else { 0.0 };
        (6.0 * h + sandwich + qkv + 2.0 * (hq + g) * d + hq * d + fc1 + ffn) * 2.0 + 4.0 * hq
    }

    /// The MLP block's share of [`DecoderLm::saved_bytes_per_layer_token`] (bytes a token): its
    /// norm output and output, Gemma's post-MLP norm input, fc1's output and the activation,
    /// `(2h + sandwich / 2 + fc1 + ffn) · 2`: what selective recompute
    /// ([`te_nn::modules::Recompute::Selective`]) does not keep. Its input, the residual, stays.
    pub(crate) fn saved_mlp_bytes_per_layer_token(cfg: &DecoderConfig) -> f64 {
        let h = cfg.hidden_size as f64;
        let (fc1, ffn) = (cfg.fc1_size() as f64, cfg.ffn_hidden_size as f64);
        let sandwich = if cfg.sandwich_norm { h } else { 0.0 };
        (2.0 * h + sandwich + fc1 + ffn) * 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemma3_270m_estimate_bounds_its_measured_peak() {
        let json = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
         "vocab_size": 262144, "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
         "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
         "query_pre_attn_scalar": 256, "max_position_embeddings": 32768,
         "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}"#;
        let cfg = DecoderConfig::from_hf_json(json).unwrap();
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let bf16 = gib(DecoderLm::training_bytes(&cfg, 8, 1024, false));
        // Measured on an H100: 15.35 GiB (BF16), 15.22 GiB (FP8).
        assert!((15.35..15.35 * 1.25).contains(&bf16), "{bf16} GiB");
        let fp8 = gib(DecoderLm::training_bytes(&cfg, 8, 1024, true));
        assert!(fp8 > bf16 && fp8 < bf16 * 1.05, "{fp8} GiB");
        // Linear in the tokens beyond the weights: twice the batch, about twice the rest.
        let weights = gib(DecoderLm::training_bytes(&cfg, 0, 1024, false));
        let double = gib(DecoderLm::training_bytes(&cfg, 16, 1024, false));
        assert!(((double - weights) / (bf16 - weights) - 2.0).abs() < 1e-6);
        // Context parallelism: a rank's activations are those of its seq / cp tokens (plus one
        // layer's gathered keys and values), so 8192 tokens over 8 ranks cost about what 1024
        // do on one; cp 1 is the plain estimate.
        let none = te_nn::modules::Recompute::None;
        let one = DecoderLm::training_bytes_with(&cfg, 8, 1024, false, none);
        assert_eq!(DecoderLm::training_bytes_cp(&cfg, 8, 1024, 1, false, none), one);
        let cp8 = DecoderLm::training_bytes_cp(&cfg, 8, 8192, 8, false, none);
        let whole = DecoderLm::training_bytes_with(&cfg, 8, 8192, false, none);
        assert!(cp8 > one && (cp8 - one) < (1 << 30) && cp8 < whole / 4, "{cp8} {one} {whole}");
        // ZeRO-3: the layers' weights are the parameters less the tied embedding and the final
        // norm; over N ranks a rank keeps 1/N of them plus two layers' whole buffers.
        let layer = DecoderLm::layer_weight_bytes(&cfg);
        let (h, v) = (640u64, 262_144u64);
        assert_eq!(layer * 18, 2 * (cfg.num_parameters() - v * h - h));
        assert_eq!(DecoderLm::zero3_weight_saving(&cfg, 1), 0, "one rank shards nothing");
        assert_eq!(DecoderLm::zero3_weight_saving(&cfg, 2), layer * 18 / 2 - 2 * layer);
        assert!(DecoderLm::zero3_weight_saving(&cfg, 8) > DecoderLm::zero3_weight_saving(&cfg, 4));
    }

    /// Selective recompute drops the MLP blocks' activations of all layers but one: its
    /// estimate lies between full recompute's and none's, by exactly that much below none's.
    #[test]
    fn selective_recompute_estimate_lies_between_none_and_full() {
        use te_nn::modules::Recompute;
        let json = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
         "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
         "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 8192, "hidden_act": "silu"}"#;
        let cfg = DecoderConfig::from_hf_json(json).unwrap();
        let at = |mode| DecoderLm::training_bytes_with(&cfg, 4, 4096, true, mode);
        let (none, selective, full) = (at(Recompute::None), at(Recompute::Selective), at(Recompute::Full));
        assert!(full < selective && selective < none, "{full} {selective} {none}");
        // (2h + 2·ffn + ffn) · 2 bytes a token (SwiGLU: fc1 is 2·ffn) for 15 of 16 layers.
        let mlp = (2 * 2048 + 3 * 8192) * 2;
        assert_eq!(DecoderLm::saved_mlp_bytes_per_layer_token(&cfg), mlp as f64);
        let dropped = 4 * 4096 * 15 * mlp as u64;
        assert!((none - selective).abs_diff(dropped) < 2, "{} vs {dropped}", none - selective);
        // The MLP is most of a Llama layer's activations.
        assert!(2.0 * DecoderLm::saved_mlp_bytes_per_layer_token(&cfg) > DecoderLm::saved_bytes_per_layer_token(&cfg));
        // Gemma's sandwich norm adds the post-MLP norm's input.
        let gemma = DecoderConfig { sandwich_norm: true, ..cfg.clone() };
        let extra =
            DecoderLm::saved_mlp_bytes_per_layer_token(&gemma) - DecoderLm::saved_mlp_bytes_per_layer_token(&cfg);
        assert_eq!(extra, 2.0 * 2048.0);
    }
}
