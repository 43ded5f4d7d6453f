//! Family 12: fused softmax cross-entropy over logits `[tokens, vocab]` with integer targets:
//! the per-token loss and, in the same kernel, `dlogits = (softmax - onehot) * grad_scale`.

use super::cast::check_threads;
use super::{ArgCond, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Cross-entropy of each row of `logits [tokens, vocab]` against `targets [tokens]` (`i32`),
/// one block per row (`tokens`, `vocab`, `ignore_index` and `grad_scale` are run-time
/// arguments; `vocab` ≤ [`CrossEntropySpec::MAX_VOCAB`]).
///
/// Math, in f32: an online max and sum of exponentials per thread (`expf` of `x - max`),
/// combined over the block; `loss[t] = max + log(sum) - x[target]`. With `grad`, the same kernel
/// writes `dlogits[t, c] = (exp(x[c] - max) / sum - (c == target)) * grad_scale`, rounded once
/// to the logits' dtype (`grad_scale = 1 / tokens` for a mean loss). A target equal to
/// `ignore_index` gives loss 0 and a zero gradient row; any other target outside `[0, vocab)`
/// gives a NaN loss (a data bug made visible) and a zero gradient row.
///
/// Entry point `<name>` ([`CrossEntropySpec::ARGS`]). `dlogits` may be `logits` itself (each element is read, then written,
/// by one thread; the pointers are not `__restrict__`). Launch: blocks stride over the rows;
/// each row is read twice (max/sum, then the gradient), the second time from L2.
///
/// Sources followed: Megatron `fused_vocab_parallel_cross_entropy` / PyTorch
/// `cross_entropy(reduction='none', ignore_index=...)` (the reduction and its `grad_scale` are
/// the caller's), Milakov & Gimelshein's online softmax for the one-pass max and sum.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CrossEntropySpec {
    /// Dtype of the logits (and of `dlogits`): f32, bf16 or f16.
    pub dtype: DType,
    /// Also write `dlogits` (training); without it only the loss (evaluation).
    pub grad: bool,
    /// Threads per block (one block per row).
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl CrossEntropySpec {
    /// Largest vocabulary a launch takes: the targets are `i32`, so every class must be an
    /// `i32` (the kernel indexes in 64 bits; a block takes a row of any length in two passes,
    /// Gemma 3's 262,144 classes included).
    pub const MAX_VOCAB: usize = i32::MAX as usize;

    /// The loss (and with `grad` the gradient) of `dtype` logits, 256 threads per row.
    pub fn new(dtype: DType, grad: bool, arch: Arch) -> Self {
        Self { dtype, grad, threads: 256, arch }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl CrossEntropySpec {
    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("logits", "const void*", "`[tokens, vocab]` logits (may be the same buffer as `dlogits`)"),
        KernelArg::read(
            "targets",
            "const int* __restrict__",
            "`[tokens]` i32 target ids (the ignore index skips a token)",
        ),
        KernelArg::write("loss", "float* __restrict__", "`[tokens]` f32 per-token loss"),
        KernelArg::write("dlogits", "void*", "`[tokens, vocab]` gradient of the logits (may overwrite them)")
            .when(ArgCond::Grad),
        KernelArg::scalar("grad_scale", "float", "multiplies the gradient (1 / counted tokens for a mean)")
            .when(ArgCond::Grad),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("vocab", "u64", "vocabulary size"),
        KernelArg::scalar("ignore_index", "int", "target id whose token counts no loss and gets a zero gradient"),
    ];
}

impl Family for CrossEntropySpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        let _ = entry;
        Self::ARGS
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Grad => self.grad,
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "cross_entropy"
    }
    fn template(&self) -> &'static str {
        "cross_entropy.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!("{}_{}_t{}", if self.grad { "grad" } else { "loss" }, self.dtype, self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("grad", &self.grad);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("cross_entropy takes f32, bf16 or f16 logits, not {}", self.dtype));
        }
        check_threads(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::KernelSpec;

    #[test]
    fn names_and_validation() {
        let s = CrossEntropySpec::new(DType::BF16, true, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!(KernelSpec::from(s).name(), "te_cross_entropy_grad_bf16_t256_sm_90a");
        let s = CrossEntropySpec::new(DType::F32, false, Arch::Sm89);
        assert_eq!(KernelSpec::from(s).name(), "te_cross_entropy_loss_f32_t256_sm_89");
        let e = CrossEntropySpec::new(DType::E4M3, true, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("not e4m3"), "{e}");
        let e = CrossEntropySpec { threads: 48, ..s }.validate().unwrap_err();
        assert!(e.contains("multiple of 32"), "{e}");
    }
}
