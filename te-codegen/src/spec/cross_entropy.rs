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
/// each row is read twice (max/sum, then the gradient).
///
/// With `cluster` = C > 0 (sm_90+, training, rows of a multiple of 16 bytes;
/// [`CrossEntropySpec::for_vocab`] picks it) a row is read from memory once: a thread-block
/// cluster of C blocks (`__cluster_dims__`) holds it in shared memory, each block a chunk of
/// `⌈vocab / (C · VEC)⌉` 16-byte vectors (VEC elements each: the launch's dynamic shared
/// memory); the blocks exchange their (max, sum) through distributed shared memory, and each
/// writes its chunk's gradient from shared memory. Its math: the chunk's max first, then
/// `exp2f(x·log₂e − max·log₂e)` (one FMA and one `ex2` a logit) for the sum and likewise for
/// the softmax, the one-hot subtracted in the target's vector only. Launch: `tokens · C`
/// blocks, one row a cluster. Traffic: the logits once and `dlogits` once, against twice and
/// once. With `grad_fp8`, `dlogits` are FP8 codes (the caller's `grad_scale` includes their
/// scale: the gradient is bounded by `grad_scale`, so a fixed power of two fits it), half the
/// bytes written, and no cast of them before an FP8 GEMM.
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
    /// Threads per block (one block per row, or one per chunk of a row with `cluster`).
    pub threads: usize,
    /// Blocks of the thread-block cluster that holds a row in shared memory (1, 2, 4 or 8);
    /// 0: no cluster, the row read twice. Only with `grad`, on sm_90a.
    #[serde(default)]
    pub cluster: u32,
    /// `dlogits` as FP8 codes of this dtype (E4M3 or E5M2; `grad_scale` then carries the
    /// quantization scale) instead of the logits' dtype: what an FP8 LM head's backward reads
    /// without a cast. Only with `cluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_fp8: Option<DType>,
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
        Self { dtype, grad, threads: 256, cluster: 0, grad_fp8: None, arch }
    }

    /// Rows shorter than this take the plain kernel.
    pub const MIN_CLUSTER_ROW_BYTES: usize = 32 << 10;

    /// Shared memory a cluster block aims at (three blocks an SM), and the most it takes.
    const CHUNK_BYTES: [usize; 2] = [64 << 10, 200 << 10];

    /// The kernel for rows of `vocab` classes: with `grad` on sm_90a, the row held in the
    /// shared memory of a cluster of the fewest blocks (1, 2, 4 or 8) whose chunks fit 64 KiB
    /// each, else 200 KiB, 512 threads a block; [`CrossEntropySpec::new`] otherwise (a row
    /// that is not a multiple of 16 bytes, shorter than [`CrossEntropySpec::MIN_CLUSTER_ROW_BYTES`]
    /// or longer than 8 × 200 KiB, evaluation, sm_89).
    pub fn for_vocab(dtype: DType, grad: bool, vocab: usize, arch: Arch) -> Self {
        let plain = Self::new(dtype, grad, arch);
        let vec = 16 / dtype.size_bytes().max(1);
        // Short rows stay in L1 between the two passes: one block strides over many of them.
        if !grad || arch != Arch::Sm90a || vocab % vec != 0 || vocab * dtype.size_bytes() < Self::MIN_CLUSTER_ROW_BYTES
        {
            return plain;
        }
        Self::CHUNK_BYTES
            .iter()
            .find_map(|&limit| [1u32, 2, 4, 8].into_iter().find(|&c| (vocab / vec).div_ceil(c as usize) * 16 <= limit))
            .map_or(plain, |cluster| Self { threads: 512, cluster, ..plain })
    }

    /// Dynamic shared memory of a cluster launch over rows of `vocab` classes: the block's
    /// chunk of 16-byte vectors (0 without a cluster).
    pub fn shared_bytes(&self, vocab: usize) -> usize {
        let vec = 16 / self.dtype.size_bytes().max(1);
        if self.cluster == 0 {
            return 0;
        }
        (vocab / vec).div_ceil(self.cluster as usize) * 16
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
        let cluster = if self.cluster > 0 { format!("_c{}", self.cluster) } else { String::new() };
        let fp8 = self.grad_fp8.map_or(String::new(), |g| format!("_g{g}"));
        format!("{}_{}_t{}{cluster}{fp8}", if self.grad { "grad" } else { "loss" }, self.dtype, self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("grad", &self.grad);
        ctx.insert("threads", &self.threads);
        ctx.insert("cluster", &self.cluster);
        ctx.insert("g", self.grad_fp8.unwrap_or(self.dtype).type_tag());
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("cross_entropy takes f32, bf16 or f16 logits, not {}", self.dtype));
        }
        if self.cluster > 0 {
            if !matches!(self.cluster, 1 | 2 | 4 | 8) {
                return Err(format!("cluster = {} must be 0, 1, 2, 4 or 8", self.cluster));
            }
            if !self.grad || self.arch != Arch::Sm90a {
                return Err("a cluster cross_entropy writes the gradient, on sm_90a (thread-block clusters)".into());
            }
        }
        if let Some(g) = self.grad_fp8 {
            if !g.is_fp8() || self.cluster == 0 {
                return Err(format!(
                    "grad_fp8 = {g}: FP8 dlogits are E4M3 or E5M2 codes, written by the cluster kernel only \
                     (CrossEntropySpec::for_vocab)"
                ));
            }
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

    /// The cluster is the fewest blocks whose chunks fit 64 KiB (else 200 KiB), only for
    /// training on sm_90a over rows of a multiple of 16 bytes.
    #[test]
    fn cluster_choice() {
        let pick = |dt, grad, vocab, arch| CrossEntropySpec::for_vocab(dt, grad, vocab, arch);
        let gemma = pick(DType::BF16, true, 262_144, Arch::Sm90a);
        assert_eq!((gemma.cluster, gemma.threads, gemma.shared_bytes(262_144)), (8, 512, 64 << 10));
        gemma.validate().unwrap();
        assert_eq!(KernelSpec::from(gemma).name(), "te_cross_entropy_grad_bf16_t512_c8_sm_90a");
        assert_eq!(pick(DType::BF16, true, 128_256, Arch::Sm90a).cluster, 4);
        assert_eq!(pick(DType::BF16, true, 32_000, Arch::Sm90a).cluster, 1);
        assert_eq!(pick(DType::F32, true, 262_144, Arch::Sm90a).cluster, 8);
        assert_eq!(pick(DType::F32, true, 262_144, Arch::Sm90a).shared_bytes(262_144), 128 << 10);
        assert_eq!(pick(DType::F32, true, 1 << 20, Arch::Sm90a).cluster, 0, "past 8 × 200 KiB");
        assert_eq!(pick(DType::BF16, true, 50_257, Arch::Sm90a).cluster, 0, "not 16-byte rows");
        assert_eq!(pick(DType::BF16, false, 262_144, Arch::Sm90a).cluster, 0, "evaluation");
        assert_eq!(pick(DType::BF16, true, 262_144, Arch::Sm89).cluster, 0, "no clusters");
        assert_eq!(pick(DType::BF16, true, 256, Arch::Sm90a).cluster, 0, "a short row");
        let fp8 = CrossEntropySpec { grad_fp8: Some(DType::E5M2), ..gemma };
        fp8.validate().unwrap();
        assert_eq!(KernelSpec::from(fp8).name(), "te_cross_entropy_grad_bf16_t512_c8_ge5m2_sm_90a");
        let bad =
            CrossEntropySpec { grad_fp8: Some(DType::E5M2), ..CrossEntropySpec::new(DType::BF16, true, Arch::Sm90a) };
        assert!(bad.validate().unwrap_err().contains("cluster kernel only"));
        let bad = CrossEntropySpec { grad_fp8: Some(DType::BF16), ..gemma }.validate().unwrap_err();
        assert!(bad.contains("E4M3 or E5M2"), "{bad}");
        let bad = CrossEntropySpec { cluster: 3, ..gemma }.validate().unwrap_err();
        assert!(bad.contains("cluster = 3"), "{bad}");
        let bad = CrossEntropySpec { arch: Arch::Sm89, ..gemma }.validate().unwrap_err();
        assert!(bad.contains("sm_90a"), "{bad}");
    }
}
