//! Family 11: the multi-tensor optimizer kernels of a training step: the deterministic global
//! L2 norm of the gradients (for clipping) and the fused AdamW update with FP32 master weights
//! (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"; PyTorch
//! `torch.optim.AdamW` arithmetic; the chunked pointer-table launch of apex
//! `csrc/multi_tensor_adam.cu` / `multi_tensor_l2norm_kernel.cu`).

use super::cast::{check_pow2, check_threads};
use super::{Family, KernelArg};
use crate::Arch;
use serde::{Deserialize, Serialize};

/// Which optimizer kernel an [`OptimizerSpec`] renders.
///
/// Both take the same device table of `n_chunks` 64-byte chunk entries, one block per entry,
/// C layout `{ void* grad; void* param; float* master; float* exp_avg; float* exp_avg_sq;
/// u32 n; u32 dtypes; float decay; float step_size; float bc2_sqrt; u32 pad; }`: each pointer
/// points at the chunk's first element (aligned to `vec` elements of its type), `n` elements
/// follow; `dtypes` holds the grad's type code in bits 0..8 and the param's in bits 8..16
/// (0 = f32, 1 = bf16, 2 = f16), so one launch mixes f32 `main_grad`s with bf16 gradients;
/// `decay = 1 - lr * weight_decay` (1 for a parameter without decay), `step_size = lr / (1 -
/// beta1^step)`, `bc2_sqrt = sqrt(1 - beta2^step)` (the step of that parameter). The norm
/// kernel reads only `grad`, `n` and `dtypes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// Global gradient norm in two entry points, deterministic run to run (a fixed reduction
    /// tree, no atomics).
    ///
    /// `<name>` ([`OptimizerSpec::GRAD_NORM_ARGS`]): block `b` writes `partials[b] = Σ f32(grad)²` over chunk `b`
    /// (f32 sums: per thread in element order, then a fixed shuffle tree over the block).
    /// `<name>_finalize` ([`OptimizerSpec::FINALIZE_ARGS`]): one block sums the
    /// partials (thread `t` takes `t, t + threads, ...` in order, then the same tree) and writes
    /// `out[0] = sqrt(sum)` (the norm) and `out[1] = clip_coef = min(1, max_norm / (norm +
    /// 1e-6))` (PyTorch `clip_grad_norm_`; NaN when the norm is NaN, 1 for `max_norm = inf`).
    GradNorm,
    /// `<name>` ([`OptimizerSpec::ADAMW_ARGS`]): per element, in f32 with IEEE round-to-nearest and no
    /// contraction, `g = f32(grad) * *clip_coef`; `p = master * decay`; `m = m + (g - m) *
    /// (1 - beta1)`; `v = v * beta2 + (g * g) * (1 - beta2)`; `denom = sqrt(v) / bc2_sqrt +
    /// eps`; `p = p - step_size * (m / denom)`; writes master `p`, `m`, `v` and the parameter
    /// `round(p)` in its own type. The clip coefficient is read on the device (`norm_clip`, the
    /// finalize's `out`), so clipping needs no host round trip. With `skip_nonfinite` and a NaN
    /// or infinite norm, nothing is updated: each parameter is rewritten `round(master)` from
    /// its unchanged master (Megatron-LM's skipped iteration, decided on the device).
    AdamW,
}

/// A multi-tensor optimizer kernel: one block per chunk entry, `vec`-element accesses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OptimizerSpec {
    /// Which kernel.
    pub kind: OptimizerKind,
    /// Elements per thread per access (f32 state: 4 = 16 bytes).
    pub vec: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl OptimizerSpec {
    /// The gradient-norm kernels with the default tuning (4-element accesses, 512 threads).
    pub fn grad_norm(arch: Arch) -> Self {
        Self { kind: OptimizerKind::GradNorm, vec: 4, threads: 512, arch }
    }

    /// The AdamW kernel with the default tuning (4-element accesses, 512 threads).
    pub fn adamw(arch: Arch) -> Self {
        Self { kind: OptimizerKind::AdamW, vec: 4, threads: 512, arch }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl OptimizerSpec {
    /// Arguments of the `grad_norm` entry point.
    pub const GRAD_NORM_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "chunks",
            "const Chunk* __restrict__",
            "`[blocks]` chunk table (tensor pointer, offset, length), built on the host",
        ),
        KernelArg::write("partials", "float* __restrict__", "`[blocks]` f32 partial sums of squares"),
    ];

    /// Arguments of the `finalize` entry point.
    pub const FINALIZE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("partials", "const float* __restrict__", "`[n_partials]` f32 partial sums of squares"),
        KernelArg::scalar("n_partials", "u64", "partial sums"),
        KernelArg::write("out", "float* __restrict__", "`[2]` f32: the global norm and the clip coefficient"),
        KernelArg::scalar("max_norm", "float", "clip threshold (≤ 0: no clipping)"),
    ];

    /// Arguments of the `adamw` entry point.
    pub const ADAMW_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "chunks",
            "const Chunk* __restrict__",
            "`[blocks]` chunk table (param, grad, m, v pointers, offset, length, lr, weight decay), built on the host",
        ),
        KernelArg::scalar("beta1", "float", "first-moment decay"),
        KernelArg::scalar("one_minus_beta1", "float", "`1 - beta1`"),
        KernelArg::scalar("beta2", "float", "second-moment decay"),
        KernelArg::scalar("one_minus_beta2", "float", "`1 - beta2`"),
        KernelArg::scalar("eps", "float", "denominator epsilon"),
        KernelArg::read(
            "norm_clip",
            "const float* __restrict__",
            "`[2]` the global gradient norm and the clip coefficient (from the grad-norm kernels)",
        ),
        KernelArg::scalar(
            "skip_nonfinite",
            "int",
            "1: a non-finite norm skips the update (parameters rewritten from the unchanged masters)",
        ),
    ];
}

impl Family for OptimizerSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match (self.kind, entry) {
            (OptimizerKind::GradNorm, 0) => Self::GRAD_NORM_ARGS,
            (OptimizerKind::GradNorm, _) => Self::FINALIZE_ARGS,
            (OptimizerKind::AdamW, _) => Self::ADAMW_ARGS,
        }
    }
    fn family(&self) -> &'static str {
        "optimizer"
    }
    fn template(&self) -> &'static str {
        "optimizer.cu.tera"
    }
    fn name_parts(&self) -> String {
        let kind = match self.kind {
            OptimizerKind::GradNorm => "grad_norm",
            OptimizerKind::AdamW => "adamw",
        };
        format!("{kind}_v{}_t{}", self.vec, self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        let kind = match self.kind {
            OptimizerKind::GradNorm => "grad_norm",
            OptimizerKind::AdamW => "adamw",
        };
        ctx.insert("kind", kind);
        ctx.insert("vec", &self.vec);
        ctx.insert("threads", &self.threads);
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        match self.kind {
            OptimizerKind::GradNorm => &["", "_finalize"],
            OptimizerKind::AdamW => &[""],
        }
    }
    fn validate(&self) -> Result<(), String> {
        check_pow2("vec", self.vec, 1, 4)?;
        check_threads(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::super::KernelSpec;
    use super::*;

    #[test]
    fn names_entry_points_and_validation() {
        let s = KernelSpec::from(OptimizerSpec::grad_norm(Arch::Sm90a));
        s.validate().unwrap();
        assert_eq!(s.name(), "te_optimizer_grad_norm_v4_t512_sm_90a");
        assert_eq!(s.entry_points()[1], "te_optimizer_grad_norm_v4_t512_sm_90a_finalize");
        let a = OptimizerSpec::adamw(Arch::Sm89);
        assert_eq!(KernelSpec::from(a).entry_points().len(), 1);
        let e = OptimizerSpec { vec: 8, ..a }.validate().unwrap_err();
        assert!(e.contains("vec"), "{e}");
    }
}
