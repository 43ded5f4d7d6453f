//! [`GptConfig`]: the geometry and training knobs of a [`Gpt`](super::Gpt), its presets,
//! checks, parameter count and the kernels a model of it runs.

use super::*;

/// Geometry and training knobs of a [`Gpt`] (a table of these fields in config files: a
/// training checkpoint's `trainer.toml`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Vocabulary: 256 for bytes; up to `i32::MAX` (the targets are `i32`).
    pub vocab_size: usize,
    /// Model width.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_layers: usize,
    /// Attention heads (divide `hidden_size`).
    pub num_attention_heads: usize,
    /// MLP width (4 × hidden in GPT-2).
    pub ffn_hidden_size: usize,
    /// Longest sequence (rows of the position embedding).
    pub seq_length: usize,
    /// Dropout after the attention and MLP blocks (GPT-2: 0.1).
    pub hidden_dropout: f32,
    /// Dtype of parameters, activations and gradients (BF16 for training, F32 for checks).
    pub params_dtype: DType,
    /// Init seed (each part derives its own from it) and dropout seed.
    pub seed: u64,
    /// Run the LM head's GEMMs in FP8 too under `fp8_autocast`. Off by default: like
    /// Megatron-LM with TE (its output layer is not a TE module) and torchao's usual filter, the
    /// LM head stays in high precision, where FP8 logits cost accuracy for little speed (its
    /// GEMMs are `vocab / (24·hidden)` of a layer's).
    pub fp8_lm_head: bool,
    /// Mixture-of-experts MLPs ([`te_nn::modules::MoeMLP`]) in every layer, each expert
    /// `ffn_hidden_size` wide; `None` (the default, and what a config file without the table
    /// reads as): dense MLPs. The layers' load-balancing losses are added to the training loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
}

impl GptConfig {
    /// A model for tests and CPU runs: 2 layers, hidden 128, 4 heads, ffn 512, seq 128 (about
    /// 0.5 M parameters).
    pub fn tiny() -> Self {
        Self::preset(2, 128, 4, 512, 128)
    }

    /// GPT-2 small: 12 layers, hidden 768, 12 heads, ffn 3072, seq 1024 (86 M parameters with
    /// the byte vocabulary).
    pub fn small() -> Self {
        Self::preset(12, 768, 12, 3072, 1024)
    }

    /// A 1.2 B-parameter model: 24 layers, hidden 2048, 16 heads, ffn 8192, seq 2048.
    pub fn large() -> Self {
        Self::preset(24, 2048, 16, 8192, 2048)
    }

    /// GPT-2 small with mixture-of-experts MLPs: 12 layers, hidden 768, 12 heads, seq 1024, 8
    /// experts of ffn 1536 (half of small's 3072) per layer, top-2 routing, aux loss coefficient
    /// 1e-2 (Megatron's default). 256 M parameters in all (8 × 2.36 M of experts per layer);
    /// a token runs 2 experts of 1536, so its active parameters (86.1 M: dense `small`'s 86.0 M
    /// plus the router's 6 k and one more fc2 bias per layer) and MLP FLOPs are dense `small`'s.
    pub fn moe_small() -> Self {
        Self { moe: Some(MoeConfig::new(8, 2)), ..Self::preset(12, 768, 12, 1536, 1024) }
    }

    /// The config of a preset by its `te train --preset` name (`tiny`, `small`, `moe-small`,
    /// `large`); `None` for another name.
    pub fn by_name(name: &str) -> Option<Self> {
        match name {
            "tiny" => Some(Self::tiny()),
            "small" => Some(Self::small()),
            "moe-small" => Some(Self::moe_small()),
            "large" => Some(Self::large()),
            _ => None,
        }
    }

    /// The names [`GptConfig::by_name`] knows.
    pub const PRESETS: [&'static str; 4] = ["tiny", "small", "moe-small", "large"];

    fn preset(num_layers: usize, hidden: usize, heads: usize, ffn: usize, seq: usize) -> Self {
        Self {
            vocab_size: 256,
            hidden_size: hidden,
            num_layers,
            num_attention_heads: heads,
            ffn_hidden_size: ffn,
            seq_length: seq,
            hidden_dropout: 0.1,
            params_dtype: DType::BF16,
            seed: 0,
            fp8_lm_head: false,
            moe: None,
        }
    }

    /// Parameter count of the model this config builds (what [`te_nn::Module::num_parameters`]
    /// reports): embeddings `(vocab + seq) · h`, per layer `12h² + 13h` for `ffn = 4h` (QKV
    /// `3h² + 3h`, projection `h² + h`, MLP `2·h·ffn + ffn + h`, two LayerNorms `4h`), the final
    /// LayerNorm `2h` and the LM head `vocab · h`. With `moe`, each layer's MLP is
    /// [`te_nn::modules::MoeMLPConfig::num_parameters`] instead (`E` experts of `2·h·ffn + ffn +
    /// h`, the router `E · h`, the norm `2h`).
    /// Saturates at `usize::MAX` for sizes no machine holds.
    pub fn num_parameters(&self) -> usize {
        let (h, f, v) = (self.hidden_size, self.ffn_hidden_size, self.vocab_size);
        let hh = h.saturating_mul(h);
        let mlp = match self.moe {
            None => h.saturating_mul(f).saturating_mul(2).saturating_add(f).saturating_add(h.saturating_mul(3)),
            Some(m) => MoeMLPConfig::new(h, f, m.num_experts, m.topk).num_parameters(),
        };
        let layer = hh.saturating_mul(4).saturating_add(mlp).saturating_add(h.saturating_mul(6));
        v.saturating_add(self.seq_length)
            .saturating_mul(h)
            .saturating_add(self.num_layers.saturating_mul(layer))
            .saturating_add(h.saturating_mul(2))
            .saturating_add(v.saturating_mul(h))
    }

    /// The config of layer `i` (GPT-2's: pre-LN, causal, GELU, biases; MoE with `moe`).
    pub(crate) fn layer_config(&self, i: usize) -> TransformerLayerConfig {
        TransformerLayerConfig {
            hidden_dropout: self.hidden_dropout,
            params_dtype: self.params_dtype,
            seed: self.seed + 16 * (i as u64 + 1),
            moe: self.moe,
            ..TransformerLayerConfig::new(self.hidden_size, self.ffn_hidden_size, self.num_attention_heads)
        }
    }

    pub(crate) fn check(&self) -> Result<()> {
        let config = |message: String| Error::Config { module: MODEL, message };
        if self.vocab_size == 0 || self.vocab_size > CrossEntropySpec::MAX_VOCAB {
            return Err(config(format!(
                "vocab_size = {} must be in [1, {}]",
                self.vocab_size,
                CrossEntropySpec::MAX_VOCAB
            )));
        }
        if self.num_layers == 0 || self.seq_length == 0 {
            return Err(config("num_layers and seq_length must be ≥ 1".into()));
        }
        Ok(())
    }
}

impl GptConfig {
    /// Every kernel `Gpt::forward_loss` and `Gpt::backward` of this config run for `target`, and
    /// the decode attention of `Gpt::generate` (the model's `params_dtype` applies; its layers
    /// get no rotary angles, positions come from the embedding), sorted and deduplicated, with no device: what `Gpt::all_kernel_specs`
    /// returns for a model of this config. The parts are those `Gpt::new` builds: the token and
    /// position embeddings, the layers (GPT-2's: pre-LN, causal, GELU, biases), the final
    /// LayerNorm and the LM head (no bias). Add the optimizer's (`te_train::optim::AdamW::kernel_specs`) for a
    /// training job.
    pub fn kernel_specs(&self, target: &KernelTarget) -> Vec<KernelSpec> {
        let (h, dt) = (self.hidden_size, self.params_dtype);
        let t = KernelTarget { rotary: false, ..target.with_dtype(dt) };
        let mut specs = Vec::new();
        // The token and the position table run the same kernels.
        EmbeddingConfig { params_dtype: dt, ..EmbeddingConfig::new(self.vocab_size, h) }.kernel_specs(&t, &mut specs);
        let layer = self.layer_config(0);
        layer.kernel_specs(&t, &mut specs);
        NormConfig { params_dtype: dt, ..NormConfig::new(h) }.kernel_specs(NormKind::LayerNorm, &t, &mut specs);
        let lm_head = LinearConfig { bias: false, params_dtype: dt, ..LinearConfig::new(h, self.vocab_size) };
        lm_head.kernel_specs(&t, &mut specs);
        self.loss_kernel_specs(&t, &mut specs);
        sorted(specs)
    }

    /// The kernels the GPT runs outside its parts, in `target`'s dtype: the sum of the token and
    /// position embeddings, the fused cross-entropy of the logits with and without their
    /// gradient (training and evaluation), the decode attention of generation
    /// ([`Gpt::generate`]; bf16/f16 models with a head dim the decode kernels take), the decode
    /// GEMVs of its layers and the argmax of greedy generation.
    pub(crate) fn loss_kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (target.params_dtype, target.arch);
        specs.push(ElementwiseSpec::add(dt, dt, dt, arch).into());
        for grad in [false, true] {
            specs.push(CrossEntropySpec::for_vocab(dt, grad, self.vocab_size, arch).into());
        }
        let decode = DecodeAttnSpec::new(dt, self.hidden_size / self.num_attention_heads.max(1), arch);
        if te_codegen::spec::Family::validate(&decode).is_ok() {
            specs.push(decode.into());
        }
        // Decode steps of one or two sequences run the decode GEMVs; greedy generation picks on
        // the device.
        self.layer_config(0).decode_gemv_specs(arch, specs);
        specs.push(ArgmaxSpec::new(dt, arch).into());
    }
}
