//! Typed kernel specifications: one struct per fused-kernel family.
//!
//! A [`KernelSpec`] names everything a kernel is specialized on (dtypes, the feature dimension,
//! tile/vector/thread shape, fused epilogues, target arch). It renders to exactly one CUDA source
//! (see [`crate::render`]), has a deterministic [`KernelSpec::name`] and a content
//! [`KernelSpec::hash`]. Specs are plain data: building and hashing them needs no GPU.
//!
//! # Adding a family
//! 1. A file here with the spec struct, its constructors and its [`Family`] impl: name parts,
//!    template context, validation (FP8 feature sizes through [`crate::check_fp8_dim`]).
//! 2. Its arguments, declared once: one `pub const XXX_ARGS: &'static [KernelArg]` per
//!    entry-point signature on the spec (see [`CastSpec::QUANTIZE_ARGS`]), each [`KernelArg`]
//!    with its name, C type, role ([`KernelArg::read`], [`KernelArg::write`],
//!    [`KernelArg::read_write`], [`KernelArg::scalar`]) and doc, and `.when(ArgCond::X)` for an
//!    optional one. [`Family::args`] returns the list of an entry point, [`Family::has`] says which
//!    [`ArgCond`]s the spec has (add a variant when a new option gates an argument).
//! 3. One line in the `kernel_families!` list below (variant, spec type, templates).
//! 4. The template writes `{{ name }}({{ params.0 }})` (and `{{ name }}_suffix({{ params.1 }})`
//!    for a second entry point): the renderer fills the parameter lists from the declaration.
//! 5. The launcher in `te-runtime/src/ops/` pushes by name, in the declared order
//!    (`Launch::new(op, stream, &f, &spec, entry)`, then `.ptr("x", ..)` / `.scalar("n", &n)`):
//!    a wrong name, order or count is an internal error before anything launches.
//! 6. Specs spanning its options in [`crate::catalog::spec_catalog`]: CI compiles them all and
//!    checks their rendered signatures against the declarations.

mod activation;
mod argmax;
mod args;
mod attention;
mod attn_merge;
mod block_quantize;
mod cast;
mod cast_transpose;
mod cross_entropy;
mod decode_attention;
mod dropout;
mod elementwise;
mod embedding;
mod flash_attention;
#[cfg(test)]
mod fuzz;
mod gemv;
mod grouped_gemm;
mod moe;
mod moe_router;
mod norm;
mod optimizer;
mod qkv_rope;
mod rope;
mod scaling;
mod softmax;

pub use activation::{Activation, ActivationSpec};
pub use argmax::ArgmaxSpec;
pub use args::{ArgCond, ArgRole, KernelArg, TMA_DESC};
pub use attention::{AttnMaskType, QkvFormat};
pub use attn_merge::AttnMergeSpec;
pub use block_quantize::BlockQuantizeSpec;
pub use cast::{CastKind, CastSpec};
pub use cast_transpose::CastTransposeSpec;
pub use cross_entropy::CrossEntropySpec;
pub use decode_attention::{DecodeAttnSpec, DECODE_MAX_HEAD_DIM};
pub use dropout::DropoutSpec;
pub use elementwise::{ElementwiseOp, ElementwiseSpec};
pub use embedding::EmbeddingSpec;
pub use flash_attention::{FlashAttnSpec, FLASH_HEAD_DIMS};
pub use gemv::{GemvEpilogue, GemvPrologue, GemvSpec};
pub use grouped_gemm::{GroupedGemmSpec, GroupedSplit};
pub use moe::MoePermuteSpec;
pub use moe_router::MoeRouterSpec;
pub use norm::{NormKind, NormSpec};
pub use optimizer::{OptimizerKind, OptimizerSpec};
pub use qkv_rope::QkvRopeSpec;
pub use rope::{RopeFormat, RopeSpec};
pub use scaling::{AmaxComputeAlgo, ScalingKind, ScalingSpec};
pub use softmax::{MaskKind, SoftmaxSpec};

use crate::{Arch, Error, Result};
use serde::{Deserialize, Serialize};

/// Version of the spec → source mapping; part of every hash and cache key. Bump it when a
/// change to the Rust side changes what a spec means without changing its fields.
pub const SCHEMA_VERSION: u32 = 1;

/// Forward or backward pass of a kernel family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Direction {
    /// The forward pass.
    Fwd,
    /// The backward pass (gradients).
    Bwd,
}

impl Direction {
    /// `fwd` or `bwd`.
    pub const fn name(self) -> &'static str {
        match self {
            Direction::Fwd => "fwd",
            Direction::Bwd => "bwd",
        }
    }
}

/// What every family's spec provides to the renderer.
pub trait Family: std::fmt::Debug {
    /// The family's name in kernel names (`cast`, `cast_transpose`, `layernorm`, ...).
    fn family(&self) -> &'static str;
    /// Template file under `te-codegen/templates/` that renders this spec.
    fn template(&self) -> &'static str;
    /// The parameters that make this kernel distinct, as a name fragment (`bf16_e4m3_c4096`).
    fn name_parts(&self) -> String;
    /// The target architecture.
    fn arch(&self) -> Arch;
    /// Template variables (besides `name` and `arch`, which the renderer sets).
    fn context(&self, ctx: &mut tera::Context);
    /// Suffixes appended to [`KernelSpec::name`] for each `extern "C"` entry point the module
    /// defines. Most families define one kernel (`[""]`).
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &[""]
    }
    /// Checks that the combination is one the template supports; the error says what to change.
    fn validate(&self) -> std::result::Result<(), String>;
    /// The declared arguments of entry point `entry` (in [`Family::entry_suffixes`] order),
    /// optional ones included: the one list the template's signature is rendered from and the
    /// launcher pushes against.
    fn args(&self, entry: usize) -> &'static [KernelArg];
    /// Whether this spec has `cond`, the option an optional argument depends on.
    fn has(&self, cond: ArgCond) -> bool {
        let _ = cond;
        false
    }
    /// The arguments of entry point `entry` this spec passes: [`Family::args`] less the optional
    /// ones whose option it does not have.
    fn params(&self, entry: usize) -> Vec<&'static KernelArg> {
        self.args(entry).iter().filter(|a| a.when.is_none_or(|c| self.has(c))).collect()
    }
}

/// The kernel families: each line gives the [`KernelSpec`] variant (with its doc), the spec type,
/// and the templates under `te-codegen/templates/` that render it. It generates the enum,
/// [`KernelSpec::family`], the `From<Spec>` impls and the template list of the renderer
/// ([`crate::render::templates`]): a new family is one line here (see `docs/architecture.md`).
macro_rules! kernel_families {
    ($($(#[doc = $doc:literal])* $variant:ident($ty:ty) => [$($template:literal),+ $(,)?],)*) => {
        /// One specialized kernel module of any family.
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum KernelSpec {
            $($(#[doc = $doc])* $variant($ty),)*
        }

        impl KernelSpec {
            /// The family's spec as a trait object.
            pub fn family(&self) -> &dyn Family {
                match self {
                    $(KernelSpec::$variant(s) => s,)*
                }
            }
        }

        $(impl From<$ty> for KernelSpec {
            fn from(s: $ty) -> Self {
                KernelSpec::$variant(s)
            }
        })*

        /// The families' templates, by file name under `te-codegen/templates/`.
        pub(crate) const FAMILY_TEMPLATES: &[(&str, &str)] = &[
            $($(($template, include_str!(concat!("../../templates/", $template))),)+)*
        ];
    };
}

kernel_families! {
    /// Family 1: quantize to FP8 with amax, dequantize, amax only.
    Cast(CastSpec) => ["cast.cu.tera"],
    /// Families 2, 3 and the dact backward of 4: cast + transpose (+ dbias) (+ dact), and the
    /// byte transpose of FP8 codes.
    CastTranspose(CastTransposeSpec) => ["cast_transpose.cu.tera", "transpose.cu.tera"],
    /// Family 4: bias + activation (+ FP8 cast) forward, activation backward.
    Activation(ActivationSpec) => ["activation.cu.tera"],
    /// Family 5: LayerNorm / RMSNorm forward and backward.
    Norm(NormSpec) => ["norm_fwd.cu.tera", "norm_bwd.cu.tera"],
    /// Family 6: scaled (masked) softmax forward and backward.
    Softmax(SoftmaxSpec) => ["softmax.cu.tera"],
    /// Family 7: delayed-scaling update and current-scaling scale computation.
    Scaling(ScalingSpec) => ["scaling.cu.tera"],
    /// Family 8: element-wise add and in-place add of high-precision tensors.
    Elementwise(ElementwiseSpec) => ["elementwise.cu.tera"],
    /// Family 9: rotary position embedding forward and backward.
    Rope(RopeSpec) => ["rope.cu.tera"],
    /// Family 10: dropout (fused bias + dropout + residual add) with Philox, and its backward.
    Dropout(DropoutSpec) => ["dropout.cu.tera"],
    /// Family 11: multi-tensor gradient norm and fused AdamW step.
    Optimizer(OptimizerSpec) => ["optimizer.cu.tera"],
    /// Family 12: embedding lookup and its deterministic scatter-add backward.
    Embedding(EmbeddingSpec) => ["embedding.cu.tera"],
    /// Family 13: fused softmax cross-entropy loss and gradient.
    CrossEntropy(CrossEntropySpec) => ["cross_entropy.cu.tera"],
    /// Family 14: fused attention (FlashAttention-2) forward with softmax_lse, deterministic
    /// backward.
    FlashAttn(FlashAttnSpec) => ["flash_attn_fwd.cu.tera", "flash_attn_bwd.cu.tera", "flash_attn_bwd_fp8.cu.tera"],
    /// Family 15: decode attention over a KV cache (split-K, FlashDecoding) and the cache append.
    DecodeAttn(DecodeAttnSpec) => ["decode_attn.cu.tera"],
    /// Family 16: blockwise FP8 quantization (1x128 / 128x1 tiles or 128x128 blocks, f32 scales).
    BlockQuantize(BlockQuantizeSpec) => ["block_quantize.cu.tera"],
    /// Family 17: MoE token permutation (routing map, permute, unpermute, probabilities' gradient).
    MoePermute(MoePermuteSpec) => ["moe_permute.cu.tera"],
    /// Family 18: MoE top-k softmax router and auxiliary load-balancing loss, forward and
    /// backward.
    MoeRouter(MoeRouterSpec) => ["moe_router.cu.tera"],
    /// Family 19: grouped GEMM with the group sizes on the device (Hopper wgmma).
    GroupedGemm(GroupedGemmSpec) => ["grouped_gemm.cu.tera"],
    /// Family 20: the attention input of a generation step fused: qk-norm, RoPE at each token's
    /// position, queries out and keys and values appended to the KV cache.
    QkvRope(QkvRopeSpec) => ["qkv_rope.cu.tera"],
    /// Family 21: row-wise argmax (greedy decoding on the device).
    Argmax(ArgmaxSpec) => ["argmax.cu.tera"],
    /// Family 22: the GEMV of a decode step with its norm, bias, activation and residual fused.
    Gemv(GemvSpec) => ["gemv.cu.tera"],
    /// Family 23: partial attention outputs merged by their log-sum-exp (the ring of context
    /// parallelism).
    AttnMerge(AttnMergeSpec) => ["attn_merge.cu.tera"],
}

impl KernelSpec {
    /// Deterministic kernel name: `te_<family>_<parameters>_<arch>`, a valid C identifier.
    pub fn name(&self) -> String {
        let f = self.family();
        format!("te_{}_{}_{}", f.family(), f.name_parts(), f.arch().name())
    }

    /// The `extern "C"` entry points of the rendered module, in the family's order.
    pub fn entry_points(&self) -> Vec<String> {
        let name = self.name();
        self.family().entry_suffixes().iter().map(|s| format!("{name}{s}")).collect()
    }

    /// The target architecture.
    pub fn arch(&self) -> Arch {
        self.family().arch()
    }

    /// Content hash of the spec (BLAKE3 over the schema version and every field), hex encoded.
    /// The disk cache keys on the rendered source instead, so template edits invalidate it too.
    pub fn hash(&self) -> String {
        let mut h = blake3::Hasher::new();
        h.update(&SCHEMA_VERSION.to_le_bytes());
        h.update(format!("{self:?}").as_bytes());
        h.finalize().to_hex().to_string()
    }

    /// Checks that the template supports this combination.
    ///
    /// # Errors
    /// [`Error::InvalidSpec`] naming the kernel and what to change.
    pub fn validate(&self) -> Result<()> {
        self.family().validate().map_err(|reason| Error::InvalidSpec { kernel: self.name(), reason })
    }
}

/// Largest vector width (elements) ≤ `max_bytes / elem_bytes` that divides `n`.
pub(crate) fn vector_width(n: usize, elem_bytes: usize, max_bytes: usize) -> usize {
    let mut v = (max_bytes / elem_bytes).max(1);
    while v > 1 && n % v != 0 {
        v /= 2;
    }
    v
}
