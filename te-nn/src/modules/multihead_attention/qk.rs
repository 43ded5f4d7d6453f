//! q and k between the QKV projection and the attention: TE's `qk_norm_type` (a norm over each
//! head's `d` channels, its weight `[d]` shared by the heads: Qwen3's and Gemma 3's `q_norm` /
//! `k_norm`, Megatron's `q_layernorm` / `k_layernorm`) and RoPE, in the order
//! `qk_norm_before_rope` says (transformers normalizes before RoPE; TE's default is after).
//! The backward runs the two in reverse.

use crate::modules::norm::{Norm, NormConfig, NormCtx, NormKind};
use crate::modules::visit::{join_path, Module, ModuleVisitor, ModuleVisitorMut};
use crate::modules::{KernelSpec, KernelTarget};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::ops::rope::{self, RopeFormat};
use te_runtime::{Device, Result, Tensor};

/// The q and k norms of a `MultiheadAttention` with `qk_norm_type` set.
#[derive(Debug)]
pub(super) struct QkNorm {
    q: Norm,
    k: Norm,
    before_rope: bool,
}

/// What [`QkPrep::forward`] saves: the norms' contexts and the rotary angles.
#[derive(Debug)]
pub(super) struct QkCtx {
    norms: Option<[NormCtx; 2]>,
    freqs: Option<Tensor>,
}

impl QkNorm {
    /// Norms of `kind` over `head_dim` channels (epsilon `eps`, TE's `zero_centered_gamma` as
    /// the block's input norm), applied before RoPE with `before_rope`.
    ///
    /// # Errors
    /// The norm's (a dtype that is not high precision).
    pub(super) fn new(dev: &Arc<Device>, kind: NormKind, cfg: NormConfig, before_rope: bool) -> Result<Self> {
        Ok(Self { q: Norm::new(dev, kind, cfg)?, k: Norm::new(dev, kind, cfg)?, before_rope })
    }
}

/// The q/k preparation of a `MultiheadAttention`: its optional [`QkNorm`] and the RoPE layout.
#[derive(Debug)]
pub(super) struct QkPrep<'a> {
    pub(super) dev: &'a Device,
    pub(super) norm: Option<&'a mut QkNorm>,
    pub(super) format: RopeFormat,
}

impl QkPrep<'_> {
    /// q `[a, b, h, d]` and k `[a, b, g, d]` normed and rotated by `freqs` (f32 angles, see
    /// `rope::forward`), each step only where configured, and the context of the backward.
    ///
    /// # Errors
    /// The norms' and RoPE's shape and dtype errors.
    pub(super) fn forward(self, [q, k]: [Tensor; 2], freqs: Option<&Tensor>) -> Result<([Tensor; 2], QkCtx)> {
        let (dev, format) = (self.dev, self.format);
        let rotate = |t: Tensor| -> Result<Tensor> {
            match freqs {
                None => Ok(t),
                Some(f) => {
                    let mut out = Tensor::empty(dev, t.dtype(), t.shape())?;
                    rope::forward(dev, format, &t, f, &mut out)?;
                    Ok(out)
                }
            }
        };
        let (q, k, norms) = match self.norm {
            None => (rotate(q)?, rotate(k)?, None),
            Some(n) if n.before_rope => {
                let (q, cq) = n.q.forward(&q)?;
                let (k, ck) = n.k.forward(&k)?;
                (rotate(q)?, rotate(k)?, Some([cq, ck]))
            }
            Some(n) => {
                let (q, cq) = n.q.forward(&rotate(q)?)?;
                let (k, ck) = n.k.forward(&rotate(k)?)?;
                (q, k, Some([cq, ck]))
            }
        };
        Ok(([q, k], QkCtx { norms, freqs: freqs.cloned() }))
    }

    /// The gradients of the forward's q and k inputs for those of its outputs; the norms'
    /// weight (and bias) gradients accumulate.
    ///
    /// # Errors
    /// [`te_runtime::Error::Context`] for norms' contexts of another module or a stale one;
    /// shape errors.
    pub(super) fn backward(self, ctx: QkCtx, [dq, dk]: [Tensor; 2]) -> Result<[Tensor; 2]> {
        let (dev, format) = (self.dev, self.format);
        let freqs = ctx.freqs.as_ref();
        let unrotate = |t: Tensor| -> Result<Tensor> {
            match freqs {
                None => Ok(t),
                Some(f) => {
                    let mut out = Tensor::empty(dev, t.dtype(), t.shape())?;
                    rope::backward(dev, format, &t, f, &mut out)?;
                    Ok(out)
                }
            }
        };
        match (self.norm, ctx.norms) {
            (None, None) => Ok([unrotate(dq)?, unrotate(dk)?]),
            (Some(n), Some([cq, ck])) if n.before_rope => {
                Ok([n.q.backward(cq, &unrotate(dq)?)?, n.k.backward(ck, &unrotate(dk)?)?])
            }
            (Some(n), Some([cq, ck])) => Ok([unrotate(n.q.backward(cq, &dq)?)?, unrotate(n.k.backward(ck, &dk)?)?]),
            _ => Err(te_runtime::Error::internal("MultiheadAttention", "a q/k context of another qk_norm setting")),
        }
    }
}

impl Module for QkNorm {
    /// Megatron's names: `q_layernorm.*`, `k_layernorm.*`.
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.q.visit(&join_path(prefix, "q_layernorm"), visitor)?;
        self.k.visit(&join_path(prefix, "k_layernorm"), visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.q.visit_mut(&join_path(prefix, "q_layernorm"), visitor)?;
        self.k.visit_mut(&join_path(prefix, "k_layernorm"), visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.q.kernel_specs(target, specs);
    }
}

/// A norm config over `head_dim` channels in `dtype`.
pub(super) fn norm_config(head_dim: usize, eps: f32, zero_centered_gamma: bool, dtype: DType) -> NormConfig {
    NormConfig { eps, zero_centered_gamma, params_dtype: dtype, ..NormConfig::new(head_dim) }
}
