//! The kernel set of a model configuration, and compiling it ahead of time.
//!
//! [`KernelTarget`]'s building blocks add the kernels of one kind of module (a linear layer, a
//! norm, attention, ...) for the target's precision and recipe; `te_runtime::Module::kernel_specs`
//! (which `#[derive(Module)]` generates) and [`ModelConfig::kernel_specs`], the list of one
//! TE-style transformer layer of a given geometry that `te prewarm` warms, are built on them.
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

    /// The target of this config's precision, recipe and sequence length on `arch`.
    pub fn target(&self, arch: Arch) -> KernelTarget {
        KernelTarget {
            params_dtype: self.params_dtype,
            recipe: self.recipe,
            fp8_format: self.fp8_format,
            amax_compute_algo: self.amax_compute_algo,
            seq_length: self.seq_length,
            rotary: self.position_embedding_type == PositionEmbedding::Rope,
            arch,
        }
    }

    /// Every kernel a transformer layer of this config and its optimizer step use on `arch`,
    /// deduplicated and sorted ([`KernelTarget::transformer_layer`], [`KernelTarget::optimizer`]).
    pub fn kernel_specs(&self, arch: Arch) -> Vec<KernelSpec> {
        let target = self.target(arch);
        let mut specs = Vec::new();
        target.transformer_layer(self, &mut specs);
        target.optimizer(&mut specs);
        sorted(specs)
    }
}

/// What kernels are specialized for besides a module's own sizes: the precision of the run, its
/// FP8 recipe, the attention key length and the GPU. Modules add their kernels for a target
/// (`te_runtime::Module::kernel_specs`); the building blocks here are what they add.
///
/// Every block adds the kernels of both the FP8 path and (where it differs) the
/// high-precision one, forward and backward: a superset of what one step loads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelTarget {
    /// Type of parameters, activations and gradients (a module's own `params_dtype` overrides it
    /// for that module's kernels).
    pub params_dtype: DType,
    /// FP8 recipe family.
    pub recipe: RecipeKind,
    /// FP8 format: E4M3 forward, and E5M2 (hybrid) or E4M3 gradients.
    pub fp8_format: Fp8Format,
    /// Delayed scaling: how the amax history is reduced.
    pub amax_compute_algo: AmaxComputeAlgo,
    /// Attention key length of the batches (the softmax kernels specialize it).
    pub seq_length: usize,
    /// Whether attention forwards get rotary angles (RoPE kernels of the head dimension).
    pub rotary: bool,
    /// GPU architecture.
    pub arch: Arch,
}

impl KernelTarget {
    /// A BF16 target with TE's default recipe (delayed scaling, hybrid format, max of the amax
    /// history), no RoPE, for keys of `seq_length` on `arch`.
    pub fn new(seq_length: usize, arch: Arch) -> Self {
        Self {
            params_dtype: default_dtype(),
            recipe: default_recipe(),
            fp8_format: default_format(),
            amax_compute_algo: default_algo(),
            seq_length,
            rotary: false,
            arch,
        }
    }

    /// This target with another `params_dtype` (a module's own).
    pub fn with_dtype(self, params_dtype: DType) -> Self {
        Self { params_dtype, ..self }
    }

    /// FP8 type of forward tensors (inputs, weights): E4M3.
    pub fn fwd_fp8(&self) -> DType {
        DType::E4M3
    }

    /// FP8 type of gradients: E5M2 with the hybrid format, else E4M3.
    pub fn bwd_fp8(&self) -> DType {
        match self.fp8_format {
            Fp8Format::E4m3 => DType::E4M3,
            Fp8Format::Hybrid => DType::E5M2,
        }
    }

    /// What every FP8 module needs: casts of weights and inputs forward and of gradients
    /// backward, their dequantize, the amax of current scaling, and the scaling update.
    pub fn fp8_common(&self, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        for q in [self.fwd_fp8(), self.bwd_fp8()] {
            specs.push(CastSpec::quantize(dt, q, arch).into());
            specs.push(CastSpec::dequantize(q, dt, arch).into());
        }
        if self.recipe == RecipeKind::Current {
            specs.push(CastSpec::amax(dt, arch).into());
        }
        specs.push(match self.recipe {
            RecipeKind::Delayed => ScalingSpec::delayed(self.amax_compute_algo, arch).into(),
            RecipeKind::Current => ScalingSpec::current(false, arch).into(),
        });
    }

    /// A LayerNorm or RMSNorm over `hidden`: forward with an FP8 output (feeding a GEMM) and a
    /// plain one, and backward.
    pub fn norm(&self, kind: NormKind, hidden: usize, zero_centered_gamma: bool, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        for out in [self.fwd_fp8(), dt] {
            specs.push(NormSpec::new(kind, Direction::Fwd, dt, out, dt, hidden, zero_centered_gamma, arch).into());
        }
        specs.push(NormSpec::new(kind, Direction::Bwd, dt, dt, dt, hidden, zero_centered_gamma, arch).into());
    }

    /// A GEMM layer `[in] → [out]` (TE `Linear`): [`KernelTarget::fp8_common`], the cast +
    /// transpose of the input (and weight) saved for wgrad, the byte transpose of an FP8 input
    /// or cached weight, the cast + transpose (+ dbias with `bias`) of `dY`, and gradient
    /// accumulation (into the `params_dtype` gradients and an f32 `main_grad`).
    pub fn linear(&self, in_features: usize, out_features: usize, bias: bool, specs: &mut Vec<KernelSpec>) {
        self.fp8_common(specs);
        self.gemm_input(in_features, specs);
        self.gemm_grad(out_features, bias, specs);
    }

    /// A norm followed by a GEMM (TE `LayerNormLinear`): [`KernelTarget::norm`] and
    /// [`KernelTarget::linear`].
    pub fn layernorm_linear(
        &self,
        kind: NormKind,
        zero_centered_gamma: bool,
        in_features: usize,
        out_features: usize,
        bias: bool,
        specs: &mut Vec<KernelSpec>,
    ) {
        self.norm(kind, in_features, zero_centered_gamma, specs);
        self.linear(in_features, out_features, bias, specs);
    }

    /// A norm, fc1, the activation and fc2 (TE `LayerNormMLP`): fc1 as
    /// [`KernelTarget::layernorm_linear`] (`2 · ffn` outputs when gated), the activation forward
    /// into FP8 (bias fused or not) and in high precision (no FP8, current scaling), its
    /// backward, the fused dact + cast + transpose + dbias of fc1's `dY` (GELU, ReLU), and fc2 as
    /// [`KernelTarget::linear`].
    #[allow(clippy::too_many_arguments)]
    pub fn layernorm_mlp(
        &self,
        kind: NormKind,
        zero_centered_gamma: bool,
        hidden: usize,
        ffn_hidden: usize,
        act: Activation,
        bias: bool,
        specs: &mut Vec<KernelSpec>,
    ) {
        let (dt, arch) = (self.params_dtype, self.arch);
        let fc1_out = if act.is_gated() { 2 * ffn_hidden } else { ffn_hidden };
        self.layernorm_linear(kind, zero_centered_gamma, hidden, fc1_out, bias, specs);
        for fused_bias in [false, true] {
            specs.push(
                ActivationSpec::new(act, Direction::Fwd, dt, self.fwd_fp8(), ffn_hidden, fused_bias, arch).into(),
            );
        }
        specs.push(ActivationSpec::new(act, Direction::Fwd, dt, dt, ffn_hidden, false, arch).into());
        specs.push(ActivationSpec::new(act, Direction::Bwd, dt, dt, ffn_hidden, false, arch).into());
        if !act.is_gated() {
            specs.push(CastTransposeSpec::new(dt, self.bwd_fp8(), ffn_hidden, bias, Some(act), arch).into());
        }
        self.linear(ffn_hidden, hidden, bias, specs);
    }

    /// Unfused dot-product attention with `heads` query heads in `gqa_groups` key/value groups:
    /// the softmax forward for `mask` and its backward at [`KernelTarget::seq_length`] keys,
    /// dropout of the probabilities and its backward, and (GQA) the f32 sum of the key/value
    /// gradients over the heads of a group.
    pub fn attention(&self, mask: MaskKind, heads: usize, gqa_groups: usize, specs: &mut Vec<KernelSpec>) {
        let (dt, arch, sk) = (self.params_dtype, self.arch, self.seq_length);
        specs.push(SoftmaxSpec::new(mask, Direction::Fwd, dt, sk, arch).into());
        specs.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dt, sk, arch).into());
        specs.push(DropoutSpec::forward(dt, dt, false, false, arch).into());
        specs.push(DropoutSpec::backward(dt, dt, arch).into());
        if gqa_groups < heads {
            specs.push(ElementwiseSpec::add_assign(dt, DType::F32, arch).into());
        }
    }

    /// Rotary embedding of queries and keys over the whole head dimension `head_dim`, forward
    /// and backward.
    pub fn rope(&self, format: RopeFormat, head_dim: usize, specs: &mut Vec<KernelSpec>) {
        for dir in [Direction::Fwd, Direction::Bwd] {
            specs.push(RopeSpec::new(dir, format, self.params_dtype, head_dim, head_dim, self.arch).into());
        }
    }

    /// The residual connections of a transformer layer: `residual + dropout(x)` (with and
    /// without a fused bias), its backward, the add of two branches and the accumulation of the
    /// residual gradient.
    pub fn residual(&self, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        for bias in [false, true] {
            specs.push(DropoutSpec::forward(dt, dt, bias, true, arch).into());
        }
        specs.push(DropoutSpec::backward(dt, dt, arch).into());
        specs.push(ElementwiseSpec::add(dt, dt, dt, arch).into());
        specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
    }

    /// A transformer layer of `cfg`'s geometry (TE `TransformerLayer`, pre-LN, self-attention
    /// with a fused QKV projection, causal or `cfg`'s mask): [`KernelTarget::layernorm_linear`]
    /// (QKV), [`KernelTarget::attention`], [`KernelTarget::rope`] with RoPE, the projection
    /// ([`KernelTarget::linear`]), [`KernelTarget::layernorm_mlp`] and
    /// [`KernelTarget::residual`]. `cfg`'s precision fields are ignored: the target's apply.
    pub fn transformer_layer(&self, cfg: &ModelConfig, specs: &mut Vec<KernelSpec>) {
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let (kind, zc) = (cfg.normalization, cfg.zero_centered_gamma);
        self.layernorm_linear(kind, zc, h, cfg.qkv_size(), true, specs);
        self.attention(cfg.attn_mask_type, heads, cfg.num_gqa_groups.unwrap_or(heads), specs);
        if cfg.position_embedding_type == PositionEmbedding::Rope {
            self.rope(RopeFormat::Sbhd, cfg.head_dim(), specs);
        }
        self.linear(h, h, true, specs);
        self.layernorm_mlp(kind, zc, h, cfg.ffn_hidden_size, cfg.activation, true, specs);
        self.residual(specs);
    }

    /// A token or position embedding table: the gather forward and the scatter-add backward
    /// into a `params_dtype` gradient.
    pub fn embedding(&self, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        specs.push(EmbeddingSpec::forward(dt, arch).into());
        specs.push(EmbeddingSpec::backward(dt, dt, arch).into());
    }

    /// The fused cross-entropy of the logits, with and without their gradient (training and
    /// evaluation).
    pub fn cross_entropy(&self, specs: &mut Vec<KernelSpec>) {
        for grad in [false, true] {
            specs.push(CrossEntropySpec::new(self.params_dtype, grad, self.arch).into());
        }
    }

    /// The optimizer step: the gradient norm (clipping) and AdamW.
    pub fn optimizer(&self, specs: &mut Vec<KernelSpec>) {
        specs.push(OptimizerSpec::grad_norm(self.arch).into());
        specs.push(OptimizerSpec::adamw(self.arch).into());
    }

    /// Gradient casts, cast + transpose of a GEMM input of `cols` features (and of a weight with
    /// `cols` inputs), and the byte transpose of its FP8 codes.
    fn gemm_input(&self, cols: usize, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        specs.push(CastTransposeSpec::new(dt, self.fwd_fp8(), cols, false, None, arch).into());
        specs.push(CastTransposeSpec::transpose(self.fwd_fp8(), cols, arch).into());
    }

    /// Cast + transpose (+ dbias) of a GEMM's `dY` of `cols` outputs, and the accumulation of
    /// its weight gradient (`params_dtype`, f32 `main_grad`) and bias gradient.
    fn gemm_grad(&self, cols: usize, bias: bool, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        specs.push(CastTransposeSpec::new(dt, self.bwd_fp8(), cols, bias, None, arch).into());
        specs.push(ElementwiseSpec::add_assign(DType::F32, dt, arch).into());
        specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
    }
}

/// Sorts and deduplicates `specs`: the form every kernel list of this crate is returned in.
pub fn sorted(mut specs: Vec<KernelSpec>) -> Vec<KernelSpec> {
    specs.sort();
    specs.dedup();
    specs
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

    /// The list `ModelConfig::kernel_specs` returned before the building blocks, verbatim.
    fn old_kernel_specs(cfg: &ModelConfig, arch: Arch) -> Vec<KernelSpec> {
        let this = cfg;
        let dt = this.params_dtype;
        let fwd8 = DType::E4M3;
        let bwd8 = match this.fp8_format {
            Fp8Format::E4m3 => DType::E4M3,
            Fp8Format::Hybrid => DType::E5M2,
        };
        let (h, f, act) = (this.hidden_size, this.ffn_hidden_size, this.activation);
        let fc1_out = if act.is_gated() { 2 * f } else { f };
        let mut v: Vec<KernelSpec> = Vec::new();

        // Norms: FP8 output feeding LayerNormLinear's GEMM, plain output, backward.
        for out in [fwd8, dt] {
            v.push(
                NormSpec::new(this.normalization, Direction::Fwd, dt, out, dt, h, this.zero_centered_gamma, arch)
                    .into(),
            );
        }
        v.push(NormSpec::new(this.normalization, Direction::Bwd, dt, dt, dt, h, this.zero_centered_gamma, arch).into());

        // Element-wise casts: weights and inputs forward, gradients backward, and dequantize.
        for q in [fwd8, bwd8] {
            v.push(CastSpec::quantize(dt, q, arch).into());
            v.push(CastSpec::dequantize(q, dt, arch).into());
        }
        if this.recipe == RecipeKind::Current {
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
        for cols in [h, this.qkv_size(), fc1_out] {
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
        v.push(SoftmaxSpec::new(this.attn_mask_type, Direction::Fwd, dt, this.seq_length, arch).into());
        v.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dt, this.seq_length, arch).into());
        v.push(DropoutSpec::forward(dt, dt, false, false, arch).into());
        v.push(DropoutSpec::backward(dt, dt, arch).into());

        // Hidden dropout after proj and fc2: residual + dropout(x + bias).
        v.push(DropoutSpec::forward(dt, dt, true, true, arch).into());

        // Rotary embedding of queries and keys ([s, b, h, d], Megatron's layout).
        if this.position_embedding_type == PositionEmbedding::Rope {
            let d = this.head_dim();
            for dir in [Direction::Fwd, Direction::Bwd] {
                v.push(RopeSpec::new(dir, RopeFormat::Sbhd, dt, d, d, arch).into());
            }
        }

        // The optimizer step: gradient norm (clipping) and AdamW.
        v.push(OptimizerSpec::grad_norm(arch).into());
        v.push(OptimizerSpec::adamw(arch).into());

        // Scaling updates.
        v.push(match this.recipe {
            RecipeKind::Delayed => ScalingSpec::delayed(this.amax_compute_algo, arch).into(),
            RecipeKind::Current => ScalingSpec::current(false, arch).into(),
        });

        v.sort();
        v.dedup();
        v
    }

    #[test]
    fn building_blocks_keep_the_model_config_list() {
        let mut configs = vec![ModelConfig::new(4096, 16384, 32), ModelConfig::new(768, 3072, 12)];
        let base = ModelConfig::new(1024, 2816, 16);
        configs.push(ModelConfig { activation: Activation::Swiglu, normalization: NormKind::RmsNorm, ..base.clone() });
        configs.push(ModelConfig { zero_centered_gamma: true, attn_mask_type: MaskKind::Padding, ..base.clone() });
        configs.push(ModelConfig { recipe: RecipeKind::Current, fp8_format: Fp8Format::E4m3, ..base.clone() });
        configs.push(ModelConfig {
            params_dtype: DType::F32,
            amax_compute_algo: AmaxComputeAlgo::MostRecent,
            position_embedding_type: PositionEmbedding::LearnedAbsolute,
            seq_length: 77,
            ..base.clone()
        });
        for cfg in configs {
            // The additions, kernels the layer runs that the old list lacked: the residual
            // `x + dropout(y)` without a bias (the old list had only the bias-fused form), and
            // the activation in high precision (no FP8, current scaling) forward and backward.
            let (dt, ffn, act, arch) = (cfg.params_dtype, cfg.ffn_hidden_size, cfg.activation, Arch::Sm90a);
            let mut want = old_kernel_specs(&cfg, arch);
            want.push(DropoutSpec::forward(dt, dt, false, true, arch).into());
            want.push(ActivationSpec::new(act, Direction::Fwd, dt, dt, ffn, false, arch).into());
            want.push(ActivationSpec::new(act, Direction::Bwd, dt, dt, ffn, false, arch).into());
            assert_eq!(cfg.kernel_specs(Arch::Sm90a), sorted(want), "{cfg:?}");
        }
    }

    #[test]
    fn gqa_adds_the_f32_key_gradient_sum() {
        let cfg = ModelConfig { num_gqa_groups: Some(8), ..ModelConfig::new(4096, 16384, 32) };
        let sum: KernelSpec = ElementwiseSpec::add_assign(DType::BF16, DType::F32, Arch::Sm90a).into();
        assert!(cfg.kernel_specs(Arch::Sm90a).contains(&sum));
        assert!(!ModelConfig::new(4096, 16384, 32).kernel_specs(Arch::Sm90a).contains(&sum));
    }

    #[test]
    fn blocks_follow_the_target() {
        let t = KernelTarget::new(1024, Arch::Sm90a);
        let mut specs = Vec::new();
        t.linear(768, 256, false, &mut specs);
        let dy: KernelSpec = CastTransposeSpec::new(DType::BF16, DType::E5M2, 256, false, None, Arch::Sm90a).into();
        assert!(specs.contains(&dy), "no dbias without a bias");
        let e4m3 =
            KernelTarget { fp8_format: Fp8Format::E4m3, recipe: RecipeKind::Current, ..t.with_dtype(DType::F16) };
        specs.clear();
        e4m3.fp8_common(&mut specs);
        assert!(specs.iter().all(|s| !matches!(s, KernelSpec::Cast(c) if c.output == DType::E5M2)));
        assert!(specs.contains(&CastSpec::amax(DType::F16, Arch::Sm90a).into()));
        specs.clear();
        t.attention(MaskKind::Causal, 12, 12, &mut specs);
        t.embedding(&mut specs);
        t.cross_entropy(&mut specs);
        assert!(
            specs.contains(&SoftmaxSpec::new(MaskKind::Causal, Direction::Fwd, DType::BF16, 1024, Arch::Sm90a).into())
        );
        assert!(specs.contains(&EmbeddingSpec::backward(DType::BF16, DType::BF16, Arch::Sm90a).into()));
        assert!(specs.contains(&CrossEntropySpec::new(DType::BF16, true, Arch::Sm90a).into()));
    }
}
