//! The kernel set of a model configuration, and compiling it ahead of time.
//!
//! [`ModelConfig::kernel_specs`] is the one list of kernels a TE-style transformer layer of a
//! given geometry needs; `te prewarm` and (later) the model derive macro both call it.
//! [`spec_catalog`] spans every discrete choice the templates offer, so CI can prove that every
//! kind of kernel the project can produce renders and compiles.

use crate::compiler::{CompileOutcome, KernelCompiler};
use crate::spec::*;
use crate::{Arch, DType, Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// FP8 recipe family of a model (the recipe's own knobs do not change the kernels).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RecipeKind {
    /// `DelayedScaling`: amax histories, bulk scale update.
    Delayed,
    /// `Float8CurrentScaling`: amax of each tensor right before its cast.
    Current,
}

/// FP8 format choice (TE `Format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Fp8Format {
    /// E4M3 everywhere.
    E4m3,
    /// E4M3 forward, E5M2 gradients (TE's default).
    Hybrid,
}

/// How a model encodes positions (Megatron's `position_embedding_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEmbedding {
    /// Rotary embedding of queries and keys over the whole head dimension (RoPE kernels).
    Rope,
    /// A learned table added to the token embeddings (no per-layer kernel).
    LearnedAbsolute,
    /// No position information.
    None,
}

fn default_dtype() -> DType {
    DType::BF16
}
fn default_recipe() -> RecipeKind {
    RecipeKind::Delayed
}
fn default_format() -> Fp8Format {
    Fp8Format::Hybrid
}
fn default_activation() -> Activation {
    Activation::Gelu
}
fn default_norm() -> NormKind {
    NormKind::LayerNorm
}
fn default_seq() -> usize {
    2048
}
fn default_mask() -> MaskKind {
    MaskKind::Causal
}
fn default_algo() -> AmaxComputeAlgo {
    AmaxComputeAlgo::Max
}
fn default_position_embedding() -> PositionEmbedding {
    PositionEmbedding::Rope
}

/// Geometry and precision of a transformer model, as `te prewarm --config FILE` reads it (TOML).
///
/// ```toml
/// hidden_size = 4096
/// ffn_hidden_size = 16384
/// num_attention_heads = 32
/// # optional, with their defaults:
/// num_gqa_groups = 32          # = num_attention_heads
/// seq_length = 2048
/// params_dtype = "bf16"
/// recipe = "delayed"           # or "current"
/// fp8_format = "hybrid"        # or "e4m3"
/// amax_compute_algo = "max"    # or "most_recent"
/// activation = "gelu"          # gelu_erf, relu, swiglu, geglu
/// normalization = "layernorm"  # or "rmsnorm"
/// zero_centered_gamma = false
/// attn_mask_type = "causal"    # or "none", "padding"
/// position_embedding_type = "rope"  # or "learned_absolute", "none"
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// Model width.
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub ffn_hidden_size: usize,
    /// Attention heads.
    pub num_attention_heads: usize,
    /// Key/value head groups (GQA); `None` = one per head.
    #[serde(default)]
    pub num_gqa_groups: Option<usize>,
    /// Sequence length (the softmax kernels specialize the key length).
    #[serde(default = "default_seq")]
    pub seq_length: usize,
    /// Type of parameters and activations.
    #[serde(default = "default_dtype")]
    pub params_dtype: DType,
    /// FP8 recipe.
    #[serde(default = "default_recipe")]
    pub recipe: RecipeKind,
    /// FP8 format.
    #[serde(default = "default_format")]
    pub fp8_format: Fp8Format,
    /// Delayed scaling: how the amax history is reduced.
    #[serde(default = "default_algo")]
    pub amax_compute_algo: AmaxComputeAlgo,
    /// MLP activation.
    #[serde(default = "default_activation")]
    pub activation: Activation,
    /// Normalization.
    #[serde(default = "default_norm")]
    pub normalization: NormKind,
    /// LayerNorm/RMSNorm gamma stored as `gamma - 1`.
    #[serde(default)]
    pub zero_centered_gamma: bool,
    /// Self-attention mask.
    #[serde(default = "default_mask")]
    pub attn_mask_type: MaskKind,
    /// Position embedding: RoPE adds its kernels for `head_dim = hidden / heads`.
    #[serde(default = "default_position_embedding")]
    pub position_embedding_type: PositionEmbedding,
}

impl ModelConfig {
    /// A config with the given sizes and every other field at its default.
    pub fn new(hidden_size: usize, ffn_hidden_size: usize, num_attention_heads: usize) -> Self {
        Self {
            hidden_size,
            ffn_hidden_size,
            num_attention_heads,
            num_gqa_groups: None,
            seq_length: default_seq(),
            params_dtype: default_dtype(),
            recipe: default_recipe(),
            fp8_format: default_format(),
            amax_compute_algo: default_algo(),
            activation: default_activation(),
            normalization: default_norm(),
            zero_centered_gamma: false,
            attn_mask_type: default_mask(),
            position_embedding_type: default_position_embedding(),
        }
    }

    /// Reads a TOML config file.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and what is wrong.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::Config { path: path.into(), message: e.to_string() })?;
        let cfg: Self =
            toml::from_str(&text).map_err(|e| Error::Config { path: path.into(), message: e.to_string() })?;
        cfg.check().map_err(|message| Error::Config { path: path.into(), message })?;
        Ok(cfg)
    }

    /// Checks sizes; the message says what to change.
    ///
    /// # Errors
    /// A description of the first problem.
    pub fn check(&self) -> std::result::Result<(), String> {
        let heads = self.num_attention_heads;
        if heads == 0 || self.hidden_size % heads != 0 {
            return Err(format!("num_attention_heads = {heads} must divide hidden_size = {}", self.hidden_size));
        }
        let groups = self.num_gqa_groups.unwrap_or(heads);
        if groups == 0 || heads % groups != 0 {
            return Err(format!("num_gqa_groups = {groups} must divide num_attention_heads = {heads}"));
        }
        for (name, v) in [("hidden_size", self.hidden_size), ("ffn_hidden_size", self.ffn_hidden_size)] {
            if v == 0 || v % 16 != 0 {
                return Err(format!(
                    "{name} = {v} must be a multiple of 16 for FP8 GEMMs (pad to {})",
                    v.div_ceil(16).max(1) * 16
                ));
            }
        }
        if self.params_dtype.is_fp8() {
            return Err(format!("params_dtype must be f32, bf16 or f16, not {}", self.params_dtype));
        }
        let d = self.hidden_size / heads;
        if self.position_embedding_type == PositionEmbedding::Rope && (d % 2 != 0 || d > RopeSpec::MAX_D) {
            return Err(format!(
                "RoPE needs an even head dimension of at most {}: hidden_size / num_attention_heads = {d}",
                RopeSpec::MAX_D
            ));
        }
        if self.seq_length == 0 || self.seq_length > 16384 {
            return Err(format!("seq_length = {} must be in [1, 16384]", self.seq_length));
        }
        Ok(())
    }

    /// Width of the fused QKV projection's output: `hidden + 2 * kv_channels * gqa_groups`.
    pub fn qkv_size(&self) -> usize {
        self.hidden_size + 2 * self.head_dim() * self.num_gqa_groups.unwrap_or(self.num_attention_heads)
    }

    /// Channels per attention head: `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Every kernel a transformer layer of this config uses on `arch`, deduplicated and sorted.
    pub fn kernel_specs(&self, arch: Arch) -> Vec<KernelSpec> {
        let dt = self.params_dtype;
        let fwd8 = DType::E4M3;
        let bwd8 = match self.fp8_format {
            Fp8Format::E4m3 => DType::E4M3,
            Fp8Format::Hybrid => DType::E5M2,
        };
        let (h, f, act) = (self.hidden_size, self.ffn_hidden_size, self.activation);
        let fc1_out = if act.is_gated() { 2 * f } else { f };
        let mut v: Vec<KernelSpec> = Vec::new();

        // Norms: FP8 output feeding LayerNormLinear's GEMM, plain output, backward.
        for out in [fwd8, dt] {
            v.push(
                NormSpec::new(self.normalization, Direction::Fwd, dt, out, dt, h, self.zero_centered_gamma, arch)
                    .into(),
            );
        }
        v.push(NormSpec::new(self.normalization, Direction::Bwd, dt, dt, dt, h, self.zero_centered_gamma, arch).into());

        // Element-wise casts: weights and inputs forward, gradients backward, and dequantize.
        for q in [fwd8, bwd8] {
            v.push(CastSpec::quantize(dt, q, arch).into());
            v.push(CastSpec::dequantize(q, dt, arch).into());
        }
        if self.recipe == RecipeKind::Current {
            v.push(CastSpec::amax(dt, arch).into());
        }

        // Cast + transpose of GEMM inputs saved for wgrad (proj and fc2 inputs).
        for cols in [h, f] {
            v.push(CastTransposeSpec::new(dt, fwd8, cols, false, None, arch).into());
        }
        // Byte transposes of the FP8 codes fused producers write: the norm output feeding the QKV
        // projection and fc1, and the activation output feeding fc2.
        for cols in [h, f] {
            v.push(CastTransposeSpec::transpose(fwd8, cols, arch).into());
        }
        // Gradients: cast + transpose + dbias of dY for proj/fc2 (hidden), qkv, fc1.
        for cols in [h, self.qkv_size(), fc1_out] {
            v.push(CastTransposeSpec::new(dt, bwd8, cols, true, None, arch).into());
        }
        // MLP activation: forward to FP8 (bias fused or not) and backward.
        for bias in [false, true] {
            v.push(ActivationSpec::new(act, Direction::Fwd, dt, fwd8, f, bias, arch).into());
        }
        if act.is_gated() {
            v.push(ActivationSpec::new(act, Direction::Bwd, dt, dt, f, false, arch).into());
        } else {
            v.push(CastTransposeSpec::new(dt, bwd8, f, true, Some(act), arch).into());
        }

        // Residual adds; gradient accumulation into an f32 main_grad and into bias gradients.
        v.push(ElementwiseSpec::add(dt, dt, dt, arch).into());
        v.push(ElementwiseSpec::add_assign(DType::F32, dt, arch).into());
        v.push(ElementwiseSpec::add_assign(dt, dt, arch).into());

        // Attention softmax, dropout of the probabilities and its backward.
        v.push(SoftmaxSpec::new(self.attn_mask_type, Direction::Fwd, dt, self.seq_length, arch).into());
        v.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dt, self.seq_length, arch).into());
        v.push(DropoutSpec::forward(dt, dt, false, false, arch).into());
        v.push(DropoutSpec::backward(dt, dt, arch).into());

        // Hidden dropout after proj and fc2: residual + dropout(x + bias).
        v.push(DropoutSpec::forward(dt, dt, true, true, arch).into());

        // Rotary embedding of queries and keys ([s, b, h, d], Megatron's layout).
        if self.position_embedding_type == PositionEmbedding::Rope {
            let d = self.head_dim();
            for dir in [Direction::Fwd, Direction::Bwd] {
                v.push(RopeSpec::new(dir, RopeFormat::Sbhd, dt, d, d, arch).into());
            }
        }

        // The optimizer step: gradient norm (clipping) and AdamW.
        v.push(OptimizerSpec::grad_norm(arch).into());
        v.push(OptimizerSpec::adamw(arch).into());

        // Scaling updates.
        v.push(match self.recipe {
            RecipeKind::Delayed => ScalingSpec::delayed(self.amax_compute_algo, arch).into(),
            RecipeKind::Current => ScalingSpec::current(false, arch).into(),
        });

        v.sort();
        v.dedup();
        v
    }
}

/// Specs covering every discrete option of every template on `arch` (all dtype pairs, fusions,
/// activations, masks, directions), at feature sizes that are and are not tile multiples.
pub fn spec_catalog(arch: Arch) -> Vec<KernelSpec> {
    let hp = [DType::F32, DType::BF16, DType::F16];
    let fp8 = [DType::E4M3, DType::E5M2];
    let mut v: Vec<KernelSpec> = Vec::new();
    for &i in &hp {
        v.push(CastSpec::amax(i, arch).into());
        for &q in &fp8 {
            v.push(CastSpec::quantize(i, q, arch).into());
            v.push(CastSpec::dequantize(q, i, arch).into());
            for cols in [784, 4096] {
                v.push(CastTransposeSpec::new(i, q, cols, false, None, arch).into());
                v.push(CastTransposeSpec::new(i, q, cols, true, None, arch).into());
            }
            for act in [Activation::Gelu, Activation::GeluErf, Activation::Relu] {
                v.push(CastTransposeSpec::new(i, q, 784, true, Some(act), arch).into());
                v.push(CastTransposeSpec::new(i, q, 784, false, Some(act), arch).into());
            }
        }
        for act in Activation::ALL {
            for out in [i, DType::E4M3, DType::E5M2] {
                for bias in [false, true] {
                    v.push(ActivationSpec::new(act, Direction::Fwd, i, out, 784, bias, arch).into());
                }
                v.push(ActivationSpec::new(act, Direction::Bwd, i, out, 784, false, arch).into());
            }
        }
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            for zc in [false, true] {
                for hidden in [784, 4096] {
                    for out in [i, DType::E4M3, DType::E5M2] {
                        v.push(NormSpec::new(kind, Direction::Fwd, i, out, i, hidden, zc, arch).into());
                    }
                    v.push(NormSpec::new(kind, Direction::Bwd, i, i, i, hidden, zc, arch).into());
                }
                v.push(NormSpec::new(kind, Direction::Fwd, i, i, i, 1000, zc, arch).into());
            }
        }
        for mask in [MaskKind::None, MaskKind::Causal, MaskKind::Padding] {
            for sk in [77, 1024, 4096] {
                v.push(SoftmaxSpec::new(mask, Direction::Fwd, i, sk, arch).into());
            }
        }
        for sk in [77, 1024, 4096] {
            v.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, i, sk, arch).into());
        }
        v.push(EmbeddingSpec::forward(i, arch).into());
        v.push(EmbeddingSpec::forward_fp8(DType::E4M3, i, arch).into());
        for grad in [false, true] {
            v.push(CrossEntropySpec::new(i, grad, arch).into());
        }
        for &j in &hp {
            v.push(EmbeddingSpec::backward(i, j, arch).into());
            v.push(ElementwiseSpec::add_assign(i, j, arch).into());
            for &o in &hp {
                v.push(ElementwiseSpec::add(i, j, o, arch).into());
            }
        }
    }
    for &i in &hp {
        for dir in [Direction::Fwd, Direction::Bwd] {
            for format in [RopeFormat::Sbhd, RopeFormat::Bshd] {
                // Full rotation, partial rotation (copy jobs), an odd half (scalar accesses).
                for (d, d2) in [(128, 128), (128, 64), (80, 30)] {
                    v.push(RopeSpec::new(dir, format, i, d, d2, arch).into());
                }
            }
        }
        for &o in &hp {
            for bias in [false, true] {
                for residual in [false, true] {
                    v.push(DropoutSpec::forward(i, o, bias, residual, arch).into());
                }
            }
            v.push(DropoutSpec::backward(i, o, arch).into());
        }
    }
    for &q in &fp8 {
        for cols in [784, 4096] {
            v.push(CastTransposeSpec::transpose(q, cols, arch).into());
        }
    }
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        v.push(ScalingSpec::delayed(algo, arch).into());
    }
    for p2 in [false, true] {
        v.push(ScalingSpec::current(p2, arch).into());
    }
    v.push(OptimizerSpec::grad_norm(arch).into());
    v.push(OptimizerSpec::adamw(arch).into());
    v.sort();
    v.dedup();
    v
}

/// What a [`prewarm`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrewarmReport {
    /// Kernels compiled by NVRTC now.
    pub compiled: usize,
    /// Kernels already in the disk cache.
    pub cached: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// Compiles `specs` into the compiler's disk cache with `workers` threads, calling `progress`
/// after each kernel. Stops at the first error.
///
/// # Errors
/// The first compile error (see [`crate::Error`]).
pub fn prewarm(
    compiler: &KernelCompiler,
    specs: &[KernelSpec],
    workers: usize,
    progress: impl Fn(&KernelSpec, CompileOutcome) + Sync,
) -> Result<PrewarmReport> {
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let compiled = AtomicUsize::new(0);
    let cached = AtomicUsize::new(0);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, specs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                if first_error.lock().map(|e| e.is_some()).unwrap_or(true) {
                    break;
                }
                match compiler.compile(spec) {
                    Ok((_, outcome)) => {
                        match outcome {
                            CompileOutcome::Compiled => compiled.fetch_add(1, Ordering::Relaxed),
                            CompileOutcome::Cached => cached.fetch_add(1, Ordering::Relaxed),
                        };
                        progress(spec, outcome);
                    }
                    Err(e) => {
                        if let Ok(mut slot) = first_error.lock() {
                            slot.get_or_insert(e);
                        }
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(PrewarmReport { compiled: compiled.into_inner(), cached: cached.into_inner(), elapsed: start.elapsed() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_specs_are_valid_and_deduplicated() {
        let cfg = ModelConfig::new(4096, 16384, 32);
        let specs = cfg.kernel_specs(Arch::Sm90a);
        assert!(specs.len() >= 15, "{} specs", specs.len());
        for s in &specs {
            s.validate().unwrap();
        }
        let mut names: Vec<_> = specs.iter().map(|s| s.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), specs.len(), "names are unique");
    }

    #[test]
    fn config_errors_say_what_to_change() {
        let mut cfg = ModelConfig::new(4100, 16384, 32);
        assert!(cfg.check().unwrap_err().contains("must divide"));
        cfg = ModelConfig::new(4104, 16384, 8);
        assert!(cfg.check().unwrap_err().contains("pad to 4112"));
        let bad: std::result::Result<ModelConfig, _> =
            toml::from_str("hidden_size = 64\nffn_hidden_size = 256\nnum_attention_heads = 4\nhiden = 3");
        assert!(bad.unwrap_err().to_string().contains("hiden"));
        cfg = ModelConfig::new(48, 64, 16);
        assert!(cfg.check().unwrap_err().contains("even head dimension"), "head_dim = 3");
        cfg.position_embedding_type = PositionEmbedding::LearnedAbsolute;
        cfg.check().unwrap();
    }

    #[test]
    fn rope_kernels_follow_the_position_embedding() {
        let mut cfg = ModelConfig::new(4096, 16384, 32);
        let rope = |cfg: &ModelConfig| {
            cfg.kernel_specs(Arch::Sm90a).into_iter().filter(|s| matches!(s, KernelSpec::Rope(_))).collect::<Vec<_>>()
        };
        let specs = rope(&cfg);
        assert_eq!(specs.len(), 2, "forward and backward");
        assert!(specs.iter().all(|s| matches!(s, KernelSpec::Rope(r) if r.d == 128 && r.d2 == 128)));
        let parsed: ModelConfig = toml::from_str(
            "hidden_size = 4096\nffn_hidden_size = 16384\nnum_attention_heads = 32\nposition_embedding_type = \"learned_absolute\"",
        )
        .unwrap();
        cfg.position_embedding_type = PositionEmbedding::LearnedAbsolute;
        assert_eq!(parsed, cfg);
        assert!(rope(&cfg).is_empty());
    }

    /// BERT's exact GELU: `activation = "gelu_erf"` in a config, its kernels in the model's set,
    /// names distinct from the tanh GELU's.
    #[test]
    fn gelu_erf_parses_and_has_its_own_kernels() {
        let parsed: ModelConfig = toml::from_str(
            "hidden_size = 384\nffn_hidden_size = 1536\nnum_attention_heads = 12\nactivation = \"gelu_erf\"",
        )
        .unwrap();
        assert_eq!(parsed.activation, Activation::GeluErf);
        assert_eq!("gelu_erf".parse::<Activation>(), Ok(Activation::GeluErf));
        assert_eq!("GELU".parse::<Activation>(), Ok(Activation::Gelu));
        for a in Activation::ALL {
            assert_eq!(a.name().parse::<Activation>(), Ok(a));
        }
        let names: Vec<String> = parsed.kernel_specs(Arch::Sm90a).iter().map(KernelSpec::name).collect();
        assert!(names.iter().any(|n| n.contains("act_gelu_erf_fwd")), "{names:?}");
        assert!(!names.iter().any(|n| n.contains("act_gelu_fwd")), "{names:?}");
    }
}
