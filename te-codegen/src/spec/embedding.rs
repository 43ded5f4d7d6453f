//! Family 11: token embedding lookup `out[t, :] = table[ids[t], :]` and its backward, the
//! deterministic scatter-add `dtable[ids[t], :] += dout[t, :]`.

use super::cast::check_threads;
use super::{Direction, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Embedding lookup over a table `[vocab, hidden]` with `i32` ids `[tokens]` (`vocab`, `hidden`
/// and `tokens` are run-time arguments).
///
/// Forward: `out[t, c] = table[ids[t], c]`, a copy in the table's dtype; an id outside
/// `[0, vocab)` (e.g. a padding `-1`) gives a zero row. Arguments: [`EmbeddingSpec::FWD_ARGS`]. Launch:
/// blocks stride over the tokens, a block's threads over the row's columns.
///
/// FP8 forward ([`EmbeddingSpec::forward_fp8`]): an E4M3/E5M2 table (1 byte per element, one
/// per-tensor `scale_inv`) dequantized row by row, `out[t, c] = f32(table[ids[t], c]) *
/// scale_inv` rounded to the output dtype (f32, bf16 or f16). Arguments: [`EmbeddingSpec::FWD_FP8_ARGS`].
///
/// Backward: `dtable[v, c] = round(f32(dtable[v, c]) + Σ_{t: ids[t] = v} f32(dout[t, c]))`: the
/// sum over tokens in f32, in token order, added once to the gradient (which keeps its dtype, so
/// repeated backwards accumulate like `add_assign`); ids outside `[0, vocab)` are skipped.
/// Deterministic, without atomics: the ids come with their grouping by id (`index`, built on
/// the host: the token positions sorted stably by id, where each id's run starts, and the ids
/// present), blocks stride over the ids present and the block owning id `v` sums its tokens in
/// token order, each thread accumulating [`EmbeddingSpec::COLS_PER_THREAD`] columns in
/// registers. Cost: `O(tokens * hidden)` whatever the vocabulary (a 262,144-entry vocabulary
/// costs what a byte-level one does). Arguments: [`EmbeddingSpec::BWD_ARGS`].
///
/// Sources followed: PyTorch `embedding_dense_backward` (sum per row of the table, no
/// `padding_idx` here: out-of-range ids are skipped instead); Megatron's `VocabParallelEmbedding`
/// zeroes rows of out-of-range ids the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EmbeddingSpec {
    /// Lookup (forward) or gradient scatter-add (backward).
    pub direction: Direction,
    /// Forward: dtype of the table (f32, bf16, f16, or E4M3/E5M2 for the FP8 lookup). Backward:
    /// dtype of `dout` (f32, bf16 or f16).
    pub dtype: DType,
    /// Backward: dtype of `dtable` (f32, bf16 or f16). Forward: the output's dtype, equal to
    /// `dtype` except for an FP8 table (then f32, bf16 or f16).
    pub grad: DType,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl EmbeddingSpec {
    /// Columns each backward thread accumulates in registers per scan of the ids.
    pub const COLS_PER_THREAD: usize = 4;

    /// The lookup of a `dtype` table, 256 threads per block.
    pub fn forward(dtype: DType, arch: Arch) -> Self {
        Self { direction: Direction::Fwd, dtype, grad: dtype, threads: 256, arch }
    }

    /// The lookup of an FP8 `table` (E4M3 or E5M2, per-tensor `scale_inv`) dequantized into
    /// `out` (f32, bf16 or f16), 256 threads per block.
    pub fn forward_fp8(table: DType, out: DType, arch: Arch) -> Self {
        Self { direction: Direction::Fwd, dtype: table, grad: out, threads: 256, arch }
    }

    /// Whether this is the FP8 (dequantizing) lookup.
    pub const fn is_fp8_lookup(&self) -> bool {
        matches!(self.direction, Direction::Fwd) && self.dtype.is_fp8() && self.grad.is_high_precision()
    }

    /// The scatter-add of a `dout` gradient into a `grad` table gradient, 256 threads per block.
    pub fn backward(dout: DType, grad: DType, arch: Arch) -> Self {
        Self { direction: Direction::Bwd, dtype: dout, grad, threads: 256, arch }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl EmbeddingSpec {
    /// Arguments of the `fwd_fp8` entry point.
    pub const FWD_FP8_ARGS: &'static [KernelArg] = &[
        KernelArg::read("table", "const void* __restrict__", "`[vocab, hidden]` FP8 codes"),
        KernelArg::read("ids", "const int* __restrict__", "`[tokens]` i32 ids (outside `[0, vocab)`: a zero row)"),
        KernelArg::write("out", "void* __restrict__", "`[tokens, hidden]` rows"),
        KernelArg::read("scale_inv_ptr", "const float* __restrict__", "`[1]` scale_inv of the table"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("vocab", "u64", "table rows"),
        KernelArg::scalar("hidden", "u64", "row width"),
    ];

    /// Arguments of the `fwd` entry point.
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("table", "const void* __restrict__", "`[vocab, hidden]` table"),
        KernelArg::read("ids", "const int* __restrict__", "`[tokens]` i32 ids (outside `[0, vocab)`: a zero row)"),
        KernelArg::write("out", "void* __restrict__", "`[tokens, hidden]` rows"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("vocab", "u64", "table rows"),
        KernelArg::scalar("hidden", "u64", "row width"),
    ];

    /// Arguments of the `bwd` entry point.
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dout", "const void* __restrict__", "`[tokens, hidden]` output gradient"),
        KernelArg::read(
            "index",
            "const int* __restrict__",
            "`[3 * tokens + 2]` i32: the count `n` of ids present, the token positions sorted stably by id \
             `[tokens]`, where each id's run starts `[tokens + 1]` (`n + 1` used), the ids present `[tokens]` \
             (`n` used)",
        ),
        KernelArg::read_write("dtable", "void* __restrict__", "`[vocab, hidden]` table gradient, accumulated into"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("vocab", "u64", "table rows"),
        KernelArg::scalar("hidden", "u64", "row width"),
    ];
}

impl Family for EmbeddingSpec {
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match (self.direction, self.is_fp8_lookup()) {
            (Direction::Fwd, true) => Self::FWD_FP8_ARGS,
            (Direction::Fwd, false) => Self::FWD_ARGS,
            (Direction::Bwd, _) => Self::BWD_ARGS,
        }
    }
    fn family(&self) -> &'static str {
        "embedding"
    }
    fn template(&self) -> &'static str {
        "embedding.cu.tera"
    }
    fn name_parts(&self) -> String {
        match self.direction {
            Direction::Fwd if self.is_fp8_lookup() => format!("fwd_{}_{}_t{}", self.dtype, self.grad, self.threads),
            Direction::Fwd => format!("fwd_{}_t{}", self.dtype, self.threads),
            Direction::Bwd => format!("bwd_{}_{}_t{}", self.dtype, self.grad, self.threads),
        }
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("direction", self.direction.name());
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("g", self.grad.type_tag());
        ctx.insert("cols", &Self::COLS_PER_THREAD);
        ctx.insert("fp8_table", &self.is_fp8_lookup());
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if self.is_fp8_lookup() {
            return check_threads(self.threads);
        }
        for (arg, dt) in [("dtype", self.dtype), ("grad", self.grad)] {
            if !dt.is_high_precision() {
                return Err(format!("embedding takes f32, bf16 or f16; `{arg}` is {dt}"));
            }
        }
        if self.direction == Direction::Fwd && self.grad != self.dtype {
            return Err(format!(
                "the embedding forward copies rows: grad = {} must equal dtype = {}",
                self.grad, self.dtype
            ));
        }
        check_threads(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::KernelSpec;

    #[test]
    fn names_say_direction_and_dtypes() {
        let f = EmbeddingSpec::forward(DType::BF16, Arch::Sm90a);
        f.validate().unwrap();
        assert_eq!(KernelSpec::from(f).name(), "te_embedding_fwd_bf16_t256_sm_90a");
        let b = EmbeddingSpec::backward(DType::BF16, DType::F32, Arch::Sm89);
        b.validate().unwrap();
        assert_eq!(KernelSpec::from(b).name(), "te_embedding_bwd_bf16_f32_t256_sm_89");
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let e = EmbeddingSpec::forward(DType::E4M3, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("`dtype` is e4m3"), "{e}");
        let f = EmbeddingSpec::forward(DType::BF16, Arch::Sm90a);
        let e = EmbeddingSpec { grad: DType::F32, ..f }.validate().unwrap_err();
        assert!(e.contains("must equal"), "{e}");
        let f8 = EmbeddingSpec::forward_fp8(DType::E4M3, DType::BF16, Arch::Sm90a);
        f8.validate().unwrap();
        assert_eq!(KernelSpec::from(f8).name(), "te_embedding_fwd_e4m3_bf16_t256_sm_90a");
        let e = EmbeddingSpec::backward(DType::BF16, DType::E5M2, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("`grad` is e5m2"), "{e}");
    }
}
