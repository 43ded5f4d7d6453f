//! [`ModelConfig`]: the model configuration `te prewarm --config FILE` reads (TOML), mapped onto
//! a [`TransformerLayerConfig`] and a [`KernelTarget`].

use super::KernelTarget;
use crate::fp8::{parse_amax_compute_algo, Format, Recipe, RecipeOverrides};
use crate::modules::{Activation, AttnMaskType, NormKind, TransformerLayerConfig};
use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize};
use std::path::Path;
use te_codegen::prewarm::sorted;
use te_codegen::spec::{AmaxComputeAlgo, MaskKind, RopeSpec};
use te_codegen::{check_fp8_dim, Arch, DType, KernelSpec};
use te_runtime::{Error, Result};

/// Sequence length of a config that names none.
const DEFAULT_SEQ_LENGTH: usize = 2048;
/// The longest sequence a config may name.
const MAX_SEQ_LENGTH: usize = 16384;

/// How a model encodes positions (Megatron's `position_embedding_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEmbedding {
    /// Rotary embedding of queries and keys over the whole head dimension (RoPE kernels).
    #[default]
    Rope,
    /// A learned table added to the token embeddings (no per-layer kernel).
    LearnedAbsolute,
    /// No position information.
    None,
}

/// Geometry and precision of a transformer model, as `te prewarm --config FILE` reads it (TOML):
/// one TE-style [`TransformerLayerConfig`] and what its kernels are specialized for besides
/// (sequence length, FP8 recipe, RoPE).
///
/// ```toml
/// hidden_size = 4096
/// ffn_hidden_size = 16384
/// num_attention_heads = 32
/// # optional, with their defaults:
/// num_gqa_groups = 32          # = num_attention_heads
/// seq_length = 2048
/// params_dtype = "bf16"
/// recipe = "delayed"           # "current", "block", or TE's class names ("DelayedScaling", ...)
/// fp8_format = "hybrid"        # or "e4m3"
/// amax_history_len = 1024      # delayed only
/// amax_compute_algo = "max"    # or "most_recent"; delayed only
/// fp8_dpa = false              # true: attention's FP8 forward too (TE's fp8_dpa); not block
/// fp8_mha = false              # TE's fp8_mha (implies fp8_dpa); not block
/// activation = "gelu"          # gelu_erf, relu, swiglu, geglu
/// normalization = "layernorm"  # or "rmsnorm"
/// zero_centered_gamma = false
/// attn_mask_type = "causal"    # or "none", "padding"
/// position_embedding_type = "rope"  # or "learned_absolute", "none"
/// ```
///
/// The layer keys left out keep [`TransformerLayerConfig::new`]'s defaults. The recipe is
/// `recipe` parsed by name (its TE defaults; [`Recipe::default`], TE's `DelayedScaling()`,
/// without the key) with the other recipe keys applied ([`Recipe::with_overrides`]): a key the
/// recipe does not have is an error, as are unknown keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "ModelConfigFile")]
pub struct ModelConfig {
    /// The layer: `hidden_size`, `ffn_hidden_size`, `num_attention_heads`, `num_gqa_groups`,
    /// `params_dtype` (type of parameters and activations), `activation`, `normalization`,
    /// `zero_centered_gamma` and `attn_mask_type` (as `self_attn_mask_type`).
    pub layer: TransformerLayerConfig,
    /// Sequence length (the softmax kernels specialize the key length). Default 2048.
    pub seq_length: usize,
    /// FP8 recipe: `recipe` (its name) with `fp8_format`, `amax_history_len`,
    /// `amax_compute_algo`, `fp8_dpa` and `fp8_mha` applied.
    pub recipe: Recipe,
    /// Position embedding: RoPE adds its kernels for `head_dim = hidden / heads`.
    pub position_embedding_type: PositionEmbedding,
}

/// The keys of a config file as written; a key left out is `None` (see [`ModelConfig`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelConfigFile {
    hidden_size: usize,
    ffn_hidden_size: usize,
    num_attention_heads: usize,
    num_gqa_groups: Option<usize>,
    seq_length: Option<usize>,
    params_dtype: Option<DType>,
    #[serde(default, deserialize_with = "recipe_key")]
    recipe: Option<Recipe>,
    #[serde(default, deserialize_with = "fp8_format_key")]
    fp8_format: Option<Format>,
    amax_history_len: Option<usize>,
    #[serde(default, deserialize_with = "amax_compute_algo_key")]
    amax_compute_algo: Option<AmaxComputeAlgo>,
    fp8_dpa: Option<bool>,
    fp8_mha: Option<bool>,
    activation: Option<Activation>,
    normalization: Option<NormKind>,
    zero_centered_gamma: Option<bool>,
    attn_mask_type: Option<MaskKind>,
    position_embedding_type: Option<PositionEmbedding>,
}

impl TryFrom<ModelConfigFile> for ModelConfig {
    type Error = String;

    /// The file's keys over [`ModelConfig::new`]'s defaults.
    fn try_from(f: ModelConfigFile) -> std::result::Result<Self, String> {
        ModelConfig::from_keys(f, None, &RecipeOverrides::default())
    }
}

impl ModelConfigFile {
    /// The recipe keys other than `recipe`.
    fn recipe_overrides(&self) -> RecipeOverrides {
        RecipeOverrides {
            fp8_format: self.fp8_format,
            amax_history_len: self.amax_history_len,
            amax_compute_algo: self.amax_compute_algo,
            fp8_dpa: self.fp8_dpa,
            fp8_mha: self.fp8_mha,
        }
    }
}

/// A `recipe` key, parsed as it is read (`Recipe`'s `FromStr`: so that the parser's error
/// points at it).
fn recipe_key<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Recipe>, D::Error> {
    String::deserialize(d)?.parse().map(Some).map_err(D::Error::custom)
}

/// An `fp8_format` key, parsed as it is read ([`Format`]'s `FromStr`).
fn fp8_format_key<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Format>, D::Error> {
    String::deserialize(d)?.parse().map(Some).map_err(D::Error::custom)
}

/// An `amax_compute_algo` key, parsed as it is read ([`parse_amax_compute_algo`]).
fn amax_compute_algo_key<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<AmaxComputeAlgo>, D::Error> {
    parse_amax_compute_algo(&String::deserialize(d)?).map(Some).map_err(D::Error::custom)
}

impl ModelConfig {
    /// `f`'s keys over [`ModelConfig::new`]'s defaults, with the recipe `recipe` (else the
    /// file's) and the recipe keys of `overrides` over the file's.
    fn from_keys(
        f: ModelConfigFile,
        recipe: Option<Recipe>,
        overrides: &RecipeOverrides,
    ) -> std::result::Result<Self, String> {
        let mut cfg = ModelConfig::new(f.hidden_size, f.ffn_hidden_size, f.num_attention_heads);
        let layer = &mut cfg.layer;
        layer.num_gqa_groups = f.num_gqa_groups.or(layer.num_gqa_groups);
        layer.params_dtype = f.params_dtype.unwrap_or(layer.params_dtype);
        layer.activation = f.activation.unwrap_or(layer.activation);
        layer.normalization = f.normalization.unwrap_or(layer.normalization);
        layer.zero_centered_gamma = f.zero_centered_gamma.unwrap_or(layer.zero_centered_gamma);
        if let Some(mask) = f.attn_mask_type {
            layer.self_attn_mask_type = match mask {
                MaskKind::None => AttnMaskType::NoMask,
                MaskKind::Causal => AttnMaskType::Causal,
                MaskKind::Padding => AttnMaskType::Padding,
            };
        }
        let recipe = recipe.or(f.recipe).unwrap_or_default();
        cfg.recipe = recipe.with_overrides(&overrides.or(f.recipe_overrides())).map_err(|e| e.to_string())?;
        cfg.seq_length = f.seq_length.unwrap_or(cfg.seq_length);
        cfg.position_embedding_type = f.position_embedding_type.unwrap_or(cfg.position_embedding_type);
        Ok(cfg)
    }

    /// A config with the given sizes and every other field at its default: the layer at
    /// [`TransformerLayerConfig::new`]'s, TE's default recipe, 2048 positions with RoPE.
    pub fn new(hidden_size: usize, ffn_hidden_size: usize, num_attention_heads: usize) -> Self {
        Self {
            layer: TransformerLayerConfig::new(hidden_size, ffn_hidden_size, num_attention_heads),
            seq_length: DEFAULT_SEQ_LENGTH,
            recipe: Recipe::default(),
            position_embedding_type: PositionEmbedding::default(),
        }
    }

    /// Reads a TOML config file and checks it ([`ModelConfig::check`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and what is wrong: unreadable, not TOML, an unknown key,
    /// a missing size, a value outside those listed at [`ModelConfig`], a recipe key the recipe
    /// does not have, or sizes [`ModelConfig::check`] rejects.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_file_with(path, None, &RecipeOverrides::default())
    }

    /// [`ModelConfig::from_file`] with the recipe `recipe` instead of the file's (when given)
    /// and the recipe keys of `overrides` over the file's: what `te prewarm --config FILE
    /// --recipe NAME --fp8-format ...` reads. The recipe is `recipe` (else the file's `recipe`,
    /// else TE's default) with the file's and the flags' keys applied, so a flag naming another
    /// recipe keeps the file's keys: one the new recipe does not have is an error (say
    /// `amax_compute_algo` with `--recipe current`).
    ///
    /// # Errors
    /// As [`ModelConfig::from_file`].
    pub fn from_file_with(path: &Path, recipe: Option<Recipe>, overrides: &RecipeOverrides) -> Result<Self> {
        let error = |message: String| Error::Config {
            module: "ModelConfig",
            message: format!("{}: {message}", path.display()),
        };
        let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
        let file: ModelConfigFile = toml::from_str(&text).map_err(|e| error(e.to_string()))?;
        let cfg = Self::from_keys(file, recipe, overrides).map_err(error)?;
        cfg.check().map_err(error)?;
        Ok(cfg)
    }

    /// Checks the sizes; the message says what to change.
    ///
    /// # Errors
    /// A description of the first problem: heads that do not divide the hidden size, groups
    /// that do not divide the heads, a hidden or MLP width that is not a multiple of 16
    /// ([`check_fp8_dim`]), an FP8 `params_dtype`, a head dimension RoPE cannot take, a
    /// sequence length outside `[1, 16384]`.
    pub fn check(&self) -> std::result::Result<(), String> {
        let l = &self.layer;
        let heads = l.num_attention_heads;
        if heads == 0 || l.hidden_size % heads != 0 {
            return Err(format!("num_attention_heads = {heads} must divide hidden_size = {}", l.hidden_size));
        }
        let groups = l.num_gqa_groups.unwrap_or(heads);
        if groups == 0 || heads % groups != 0 {
            return Err(format!("num_gqa_groups = {groups} must divide num_attention_heads = {heads}"));
        }
        check_fp8_dim("hidden_size", l.hidden_size)?;
        check_fp8_dim("ffn_hidden_size", l.ffn_hidden_size)?;
        if l.params_dtype.is_fp8() {
            return Err(format!("params_dtype must be f32, bf16 or f16, not {}", l.params_dtype));
        }
        let d = l.hidden_size / heads;
        if self.position_embedding_type == PositionEmbedding::Rope && (d % 2 != 0 || d > RopeSpec::MAX_D) {
            return Err(format!(
                "RoPE needs an even head dimension of at most {}: hidden_size / num_attention_heads = {d}",
                RopeSpec::MAX_D
            ));
        }
        if self.seq_length == 0 || self.seq_length > MAX_SEQ_LENGTH {
            return Err(format!("seq_length = {} must be in [1, {MAX_SEQ_LENGTH}]", self.seq_length));
        }
        Ok(())
    }

    /// The target of this config's precision, recipe, sequence length and position embedding
    /// on `arch`.
    pub fn target(&self, arch: Arch) -> KernelTarget {
        KernelTarget {
            params_dtype: self.layer.params_dtype,
            recipe: self.recipe,
            seq_length: self.seq_length,
            rotary: self.position_embedding_type == PositionEmbedding::Rope,
            arch,
        }
    }

    /// Every kernel a transformer layer of this config and its optimizer step use on `arch`,
    /// deduplicated and sorted ([`TransformerLayerConfig::kernel_specs`] and
    /// `te_runtime::ops::optimizer::kernel_specs` for [`ModelConfig::target`]).
    pub fn kernel_specs(&self, arch: Arch) -> Vec<KernelSpec> {
        let target = self.target(arch);
        let mut specs = Vec::new();
        self.layer.kernel_specs(&target, &mut specs);
        specs.extend(te_runtime::ops::optimizer::kernel_specs(target.arch));
        sorted(specs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling};
    use crate::modules::DotProductAttentionConfig;
    use te_codegen::spec::*;

    /// `hidden_size = 1024`, `ffn_hidden_size = 2816`, 16 heads and the keys of `extra`.
    fn parse(extra: &str) -> ModelConfig {
        toml::from_str(&format!("hidden_size = 1024\nffn_hidden_size = 2816\nnum_attention_heads = 16\n{extra}"))
            .unwrap()
    }

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
        assert!(cfg.check().unwrap_err().contains("pad it to 4112"));
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
        assert_eq!(format!("{parsed:?}"), format!("{cfg:?}"));
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
        assert_eq!(parsed.layer.activation, Activation::GeluErf);
        assert_eq!("gelu_erf".parse::<Activation>(), Ok(Activation::GeluErf));
        assert_eq!("GELU".parse::<Activation>(), Ok(Activation::Gelu));
        for a in Activation::ALL {
            assert_eq!(a.name().parse::<Activation>(), Ok(a));
        }
        let names: Vec<String> = parsed.kernel_specs(Arch::Sm90a).iter().map(KernelSpec::name).collect();
        assert!(names.iter().any(|n| n.contains("act_gelu_erf_fwd")), "{names:?}");
        assert!(!names.iter().any(|n| n.contains("act_gelu_fwd")), "{names:?}");
    }

    #[test]
    fn recipe_keys_map_onto_the_recipe() {
        assert_eq!(parse("").recipe, Recipe::default());
        let current = parse("recipe = \"current\"\nfp8_format = \"e4m3\"").recipe;
        assert_eq!(current, Float8CurrentScaling { fp8_format: Format::E4M3, ..Default::default() }.into());
        assert_eq!(parse("recipe = \"Float8CurrentScaling\"\nfp8_format = \"E4M3\"").recipe, current);
        let delayed = parse("amax_compute_algo = \"most_recent\"\namax_history_len = 16").recipe;
        let most_recent = DelayedScaling {
            amax_compute_algo: AmaxComputeAlgo::MostRecent,
            amax_history_len: 16,
            ..Default::default()
        };
        assert_eq!(delayed, most_recent.into());
        let block = parse("recipe = \"block\"").recipe;
        assert_eq!(block, Float8BlockScaling::default().into());
        let hybrid = parse("recipe = \"block\"\nfp8_format = \"hybrid\"").recipe;
        assert_eq!(hybrid, Float8BlockScaling { fp8_format: Format::Hybrid, ..Default::default() }.into());
        let mha = parse("recipe = \"current\"\nfp8_mha = true").recipe;
        assert!(mha.fp8_mha() && mha.fp8_dpa());
        // The key adds the FP8 attention forward at head_dim 128.
        let dpa = parse("fp8_dpa = true").recipe;
        let fp8_fwd = |r: Recipe| {
            let cfg = ModelConfig { recipe: r, ..ModelConfig::new(4096, 16384, 32) };
            cfg.kernel_specs(Arch::Sm90a).iter().any(|s| matches!(s, KernelSpec::FlashAttn(f) if f.fp8))
        };
        assert!(fp8_fwd(dpa) && !fp8_fwd(Recipe::default()));
        // A key the recipe does not have, an unknown recipe or format: errors saying what to do.
        let refused = |extra: &str| {
            toml::from_str::<ModelConfig>(&format!(
                "hidden_size = 64\nffn_hidden_size = 256\nnum_attention_heads = 4\n{extra}"
            ))
            .unwrap_err()
            .to_string()
        };
        let e = refused("recipe = \"block\"\nfp8_dpa = true");
        assert!(e.contains("Float8BlockScaling (block) has no fp8_dpa") && e.contains("(delayed, current)"), "{e}");
        let e = refused("recipe = \"current\"\namax_history_len = 4");
        assert!(e.contains("has no amax_history_len"), "{e}");
        assert!(refused("amax_history_len = 0").contains("at least 1"));
        assert!(refused("recipe = \"mxfp8\"").contains("expected delayed, current or block"));
        assert!(refused("fp8_format = \"e5m2\"").contains("expected hybrid or e4m3"));
        assert!(refused("amax_compute_algo = \"mean\"").contains("expected max"));
    }

    /// Flags over a file: another recipe keeps the file's recipe keys (refusing one it does not
    /// have), and the flags' keys win.
    #[test]
    fn flags_apply_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.toml");
        let sizes = "hidden_size = 1024\nffn_hidden_size = 2816\nnum_attention_heads = 16\n";
        std::fs::write(&path, format!("{sizes}fp8_format = \"e4m3\"\nfp8_dpa = true\n")).unwrap();
        let none = RecipeOverrides::default();
        let current = ModelConfig::from_file_with(&path, Some("current".parse().unwrap()), &none).unwrap();
        let want = Float8CurrentScaling { fp8_format: Format::E4M3, fp8_dpa: true, ..Default::default() };
        assert_eq!(current.recipe, want.into());
        let hybrid = RecipeOverrides { fp8_format: Some(Format::Hybrid), ..Default::default() };
        let delayed = ModelConfig::from_file_with(&path, None, &hybrid).unwrap();
        assert_eq!(delayed.recipe, DelayedScaling { fp8_dpa: true, ..Default::default() }.into());
        assert_eq!(ModelConfig::from_file(&path).unwrap().recipe.format(), Format::E4M3);
        let e = ModelConfig::from_file_with(&path, Some("block".parse().unwrap()), &none).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("model.toml") && e.contains("has no fp8_dpa"), "{e}");
        std::fs::write(&path, format!("{sizes}recipe = \"block\"\n")).unwrap();
        let block = ModelConfig::from_file_with(&path, None, &hybrid).unwrap();
        assert_eq!(block.recipe, Float8BlockScaling { fp8_format: Format::Hybrid, ..Default::default() }.into());
        let dpa = RecipeOverrides { fp8_dpa: Some(true), ..Default::default() };
        assert!(ModelConfig::from_file_with(&path, None, &dpa).unwrap_err().to_string().contains("has no fp8_dpa"));
    }

    /// The list `ModelConfig::kernel_specs` returned before the building blocks, verbatim but for
    /// reading the old config's fields from the new one and the attention kernels of the fused
    /// backend where it runs.
    fn old_kernel_specs(cfg: &ModelConfig, arch: Arch) -> Vec<KernelSpec> {
        let l = &cfg.layer;
        let (normalization, zero_centered_gamma) = (l.normalization, l.zero_centered_gamma);
        let (attn_mask_type, seq_length) = (l.self_attn_mask_type.kernel_mask(), cfg.seq_length);
        let head_dim = l.hidden_size / l.num_attention_heads;
        let qkv_size = l.hidden_size + 2 * head_dim * l.num_gqa_groups.unwrap_or(l.num_attention_heads);
        let dt = l.params_dtype;
        let fwd8 = DType::E4M3;
        let bwd8 = match cfg.recipe.format() {
            Format::E4M3 => DType::E4M3,
            Format::Hybrid => DType::E5M2,
        };
        let (h, f, act) = (l.hidden_size, l.ffn_hidden_size, l.activation);
        let fc1_out = if act.is_gated() { 2 * f } else { f };
        let mut v: Vec<KernelSpec> = Vec::new();

        // Norms: FP8 output feeding LayerNormLinear's GEMM, plain output, backward.
        for out in [fwd8, dt] {
            v.push(NormSpec::new(normalization, Direction::Fwd, dt, out, dt, h, zero_centered_gamma, arch).into());
        }
        v.push(NormSpec::new(normalization, Direction::Bwd, dt, dt, dt, h, zero_centered_gamma, arch).into());

        // Element-wise casts: weights and inputs forward, gradients backward, and dequantize.
        for q in [fwd8, bwd8] {
            v.push(CastSpec::quantize(dt, q, arch).into());
            v.push(CastSpec::dequantize(q, dt, arch).into());
        }
        if matches!(cfg.recipe, Recipe::Current(_)) {
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
        for cols in [h, qkv_size, fc1_out] {
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

        // Attention softmax, dropout of the probabilities and its backward; since the fused
        // backend, its kernels instead where it runs.
        let attention = DotProductAttentionConfig {
            attention_dropout: l.attention_dropout,
            ..DotProductAttentionConfig::new(l.num_attention_heads, head_dim)
        };
        if attention.runs_fused(dt, arch) {
            for dir in [Direction::Fwd, Direction::Bwd] {
                v.push(FlashAttnSpec::new(dir, dt, head_dim, arch).with_dropout(l.attention_dropout > 0.0).into());
            }
            // The hidden dropout's backward (the same kernel).
            v.push(DropoutSpec::backward(dt, dt, arch).into());
        } else {
            v.push(SoftmaxSpec::new(attn_mask_type, Direction::Fwd, dt, seq_length, arch).into());
            v.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dt, seq_length, arch).into());
            v.push(DropoutSpec::forward(dt, dt, false, false, arch).into());
            v.push(DropoutSpec::backward(dt, dt, arch).into());
        }

        // Hidden dropout after proj and fc2: residual + dropout(x + bias).
        v.push(DropoutSpec::forward(dt, dt, true, true, arch).into());

        // Rotary embedding of queries and keys ([s, b, h, d], Megatron's layout).
        if cfg.position_embedding_type == PositionEmbedding::Rope {
            let d = head_dim;
            for dir in [Direction::Fwd, Direction::Bwd] {
                v.push(RopeSpec::new(dir, RopeFormat::Sbhd, dt, d, d, arch).into());
            }
        }

        // The optimizer step: gradient norm (clipping) and AdamW.
        v.push(OptimizerSpec::grad_norm(arch).into());
        v.push(OptimizerSpec::adamw(arch).into());

        // Scaling updates.
        match cfg.recipe {
            Recipe::Delayed(r) => v.push(ScalingSpec::delayed(r.amax_compute_algo, arch).into()),
            Recipe::Current(_) => v.push(ScalingSpec::current(false, arch).into()),
            Recipe::Block(b) => v.extend(b.quantize_specs(dt, arch)),
        }

        v.sort();
        v.dedup();
        v
    }

    #[test]
    fn building_blocks_keep_the_model_config_list() {
        let mut configs = vec![ModelConfig::new(4096, 16384, 32), ModelConfig::new(768, 3072, 12)];
        configs.push(parse("activation = \"swiglu\"\nnormalization = \"rmsnorm\""));
        configs.push(parse("zero_centered_gamma = true\nattn_mask_type = \"padding\""));
        configs.push(parse("recipe = \"current\"\nfp8_format = \"e4m3\""));
        configs.push(parse(
            "params_dtype = \"f32\"\namax_compute_algo = \"most_recent\"\n\
             position_embedding_type = \"learned_absolute\"\nseq_length = 77",
        ));
        for cfg in configs {
            // The additions, kernels the layer runs that the old list lacked: the residual
            // `x + dropout(y)` without a bias (the old list had only the bias-fused form), and
            // the activation in high precision (no FP8, current scaling) forward and backward.
            let (dt, ffn, act, arch) =
                (cfg.layer.params_dtype, cfg.layer.ffn_hidden_size, cfg.layer.activation, Arch::Sm90a);
            let mut want = old_kernel_specs(&cfg, arch);
            // The context-parallel ring's LSE merge, where attention runs fused.
            let (heads, hidden) = (cfg.layer.num_attention_heads, cfg.layer.hidden_size);
            if DotProductAttentionConfig::new(heads, hidden / heads).runs_fused(dt, arch) {
                want.push(AttnMergeSpec::new(dt, arch).into());
            }
            want.push(DropoutSpec::forward(dt, dt, false, true, arch).into());
            want.push(ActivationSpec::new(act, Direction::Fwd, dt, dt, ffn, false, arch).into());
            want.push(ActivationSpec::new(act, Direction::Bwd, dt, dt, ffn, false, arch).into());
            assert_eq!(cfg.kernel_specs(Arch::Sm90a), sorted(want), "{cfg:?}");
        }
    }

    #[test]
    fn gqa_adds_the_f32_key_gradient_sum_on_the_unfused_backend() {
        // head_dim 80 keeps attention unfused; the fused kernels (head_dim 128, with attention
        // dropout too) sum a group's heads themselves.
        let mut cfg = ModelConfig::new(2560, 10240, 32);
        cfg.layer.num_gqa_groups = Some(8);
        let sum: KernelSpec = ElementwiseSpec::add_assign(DType::BF16, DType::F32, Arch::Sm90a).into();
        assert!(cfg.kernel_specs(Arch::Sm90a).contains(&sum));
        let mut cfg = ModelConfig::new(4096, 16384, 32);
        cfg.layer.num_gqa_groups = Some(8);
        cfg.layer.attention_dropout = 0.1;
        assert!(!cfg.kernel_specs(Arch::Sm90a).contains(&sum));
        assert!(!ModelConfig::new(4096, 16384, 32).kernel_specs(Arch::Sm90a).contains(&sum));
    }
}
