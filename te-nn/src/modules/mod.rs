//! TE's modules with explicit autograd: `forward` returns the output and a saved context,
//! `backward` consumes the context, returns the input gradients and accumulates the parameter
//! gradients (TE's `torch.autograd.Function`s, made explicit).
//!
//! Their parallelism is [`crate::parallel`]'s: a module's config takes a
//! [`crate::parallel::TpConfig`], every GEMM holds a [`crate::parallel::GemmParallel`] its core
//! calls around the GEMM, and the norms and residuals between GEMMs ask a
//! [`crate::parallel::SequenceParallel`] about token shards; both are the identity on one GPU.

pub mod attention;
pub mod embedding;
pub mod grouped_linear;
pub mod inference;
mod init;
mod kernel_specs;
mod kernel_target;
pub mod layernorm_linear;
pub mod layernorm_mlp;
pub mod linear;
pub mod moe_mlp;
pub mod multihead_attention;
pub mod norm;
mod params;
pub mod recompute;
pub mod token_ids;
pub mod transformer_layer;
pub mod visit;

pub use crate::fp8::{Fp8Direction, Fp8StateSlot};
pub use attention::{
    AttentionBackend, AttentionCtx, AttnMaskType, CpAttentionCtx, DotProductAttention, DotProductAttentionConfig,
    PaddingSeqlens, QkvFormat, ThdSeqlens,
};
pub use embedding::{Embedding, EmbeddingConfig, EmbeddingCtx};
pub use grouped_linear::{GroupedLinear, GroupedLinearConfig, GroupedLinearCtx};
pub use inference::{InferenceParams, KvLayer};
pub use kernel_target::KernelTarget;
pub use layernorm_linear::{LayerNormLinear, LayerNormLinearConfig, LayerNormLinearCtx, LayerNormLinearOutput};
pub use layernorm_mlp::{LayerNormMLP, LayerNormMLPConfig, LayerNormMLPCtx};
pub use linear::{BackwardOptions, ForwardOptions, Linear, LinearConfig, LinearCtx};
pub use moe_mlp::{MoeConfig, MoeMLP, MoeMLPConfig, MoeMLPCtx};
pub use multihead_attention::{AttentionInputs, MultiheadAttention, MultiheadAttentionConfig, MultiheadAttentionCtx};
pub use norm::{LayerNorm, Norm, NormConfig, NormCtx, NormKind, NormParams, RMSNorm};
pub use params::LinearParams;
pub use recompute::{Fp8Replay, Recompute, ReplayHold};
pub use te_codegen::spec::Activation;
pub use te_codegen::KernelSpec;
pub use token_ids::TokenIds;
pub use transformer_layer::{
    TransformerLayer, TransformerLayerCheckpoint, TransformerLayerConfig, TransformerLayerCtx,
};
pub use visit::{
    join_path, visit_linear_params, visit_linear_params_mut, visit_norm_params, visit_norm_params_mut, Module,
    ModuleVisitor, ModuleVisitorMut, NamedParameter, Param, ParamKind, ParamMut,
};

use crate::fp8::Float8Tensor;
use std::sync::atomic::{AtomicU64, Ordering};
use te_codegen::DType;
use te_runtime::{Device, Result, Tensor};

/// A module output: high precision, or FP8 when the next op asked for it (TE `fp8_output`).
#[derive(Debug, Clone)]
pub enum Output {
    /// In the input's dtype.
    High(Tensor),
    /// E4M3, cast with the module's output scale.
    Fp8(Float8Tensor),
}

impl Output {
    /// The high-precision tensor, dequantizing an FP8 output to `dtype`.
    ///
    /// # Errors
    /// Dequantize failures.
    pub fn into_high(self, dev: &Device, dtype: DType) -> Result<Tensor> {
        match self {
            Output::High(t) => Ok(t),
            Output::Fp8(f) => f.dequantize(dev, dtype),
        }
    }

    /// Shape of the output.
    pub fn shape(&self) -> &[usize] {
        match self {
            Output::High(t) => t.shape(),
            Output::Fp8(f) => f.shape(),
        }
    }
}

/// A process-unique module id (contexts record it so a backward can refuse another module's).
fn next_module_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Which module made a forward context, and the write counts ("versions") of its `N` parameter
/// groups then: a backward refuses a context of another module, or one made before its
/// parameters changed (the forward's saved tensors would not match the weights any more).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Stamp<const N: usize> {
    module_id: u64,
    versions: [u64; N],
}

impl<const N: usize> Stamp<N> {
    /// The stamp of module `module_id` with parameter versions `versions`.
    pub(crate) fn new(module_id: u64, versions: [u64; N]) -> Self {
        Self { module_id, versions }
    }

    /// Fails unless this context stamp matches the module's stamp `now`.
    ///
    /// # Errors
    /// [`te_runtime::Error::Context`] naming `module` and what is wrong.
    pub(crate) fn check(&self, module: &'static str, now: Stamp<N>) -> Result<()> {
        let context = |message: String| te_runtime::Error::Context { module, message };
        if self.module_id != now.module_id {
            return Err(context(format!("the context was made by another {module}'s forward")));
        }
        if self.versions != now.versions {
            return Err(context(
                "the parameters changed after the forward that made this context (stale context); run forward \
                 again after updating the weights"
                    .into(),
            ));
        }
        Ok(())
    }
}
