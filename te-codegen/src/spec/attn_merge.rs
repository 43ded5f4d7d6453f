//! Family 23: the merge of partial attention outputs by their log-sum-exp (the ring of context
//! parallelism, TE's `cp_comm_type="p2p"`: each step attends over one rank's keys and values, and
//! the steps' outputs and `softmax_lse` are merged as TE's `flash_attn_fwd_out_correction` and
//! `flash_attn_fwd_softmax_lse_correction` do, in f32).
//!
//! For a query row whose keys are split into parts `i` with partial outputs `out_i` (each the
//! softmax over its own keys times their values) and `lse_i = ln Σ_{j ∈ i} exp(scale · s_j)`:
//! `lse = ln Σ_i exp(lse_i)` and `out = Σ_i exp(lse_i − lse) · out_i` — the attention over all of
//! them (the FlashAttention / blockwise-softmax identity). The kernel applies it one part at a
//! time to running f32 accumulators: `lse' = max + log1p(exp(min − max))` of `(lse, lse_i)`, then
//! `out' = exp(lse − lse') · out + exp(lse_i − lse') · out_i`.

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// The LSE merge of partial attention outputs of `dtype` (see the module docs).
///
/// Layout: outputs are `[.., sq, heads, head_dim_v]` at a batch stride and a row (query) stride
/// (sbhd or bshd; the heads of a row contiguous, `head_dim_v` channels each), `softmax_lse` f32
/// `[batch, heads, sq]` (the fused attention's). One warp per (sequence, head, query) row; any
/// number of rows (the grid strides over them).
///
/// Entry points:
/// - `<name>` ([`AttnMergeSpec::MERGE_ARGS`]): folds one part (`out_step`, `lse_step`: `sq` rows)
///   into the accumulators (`out_acc` f32, `lse_acc`: `sq_acc` rows) from accumulator row
///   `q_offset` on (a part may cover a later span of the queries: the second half of a rank's
///   queries in the ring). `init = 1` sets the accumulators to the part instead. A part's
///   `lse_step` of `+inf` (a row that saw no key, the fused kernels' convention) weighs 0.
/// - `<name>_finish` ([`AttnMergeSpec::FINISH_ARGS`]): the merged output rounded to `dtype`
///   (`out`, the accumulator's strides), `lse_acc` of a row that saw no key set back to `+inf`,
///   and the second half of each `(sequence, head)`'s LSE rows copied into `lse_half` `[batch,
///   heads, sq_acc / 2]` (what the backward of the ring's second-half steps reads).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AttnMergeSpec {
    /// Element type of the partial and merged outputs: bf16 or f16 (the fused attention's).
    pub dtype: DType,
    /// Threads per block: a multiple of 32 up to 1024 (a warp per row).
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl AttnMergeSpec {
    /// The spec with 256 threads (8 rows) a block.
    pub fn new(dtype: DType, arch: Arch) -> Self {
        Self { dtype, threads: 256, arch }
    }

    /// Arguments of `<name>`.
    pub const MERGE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("out_step", "const void* __restrict__", "the part's output, `dtype`, at the step strides"),
        KernelArg::read("lse_step", "const float* __restrict__", "f32 `[batch, heads, sq]`: the part's softmax_lse"),
        KernelArg::read_write("out_acc", "float* __restrict__", "f32 merged output so far, at the accumulator strides"),
        KernelArg::read_write("lse_acc", "float* __restrict__", "f32 `[batch, heads, sq_acc]`: merged LSE so far"),
        KernelArg::scalar("batch", "u64", "sequences"),
        KernelArg::scalar("heads", "u64", "query heads"),
        KernelArg::scalar("sq", "u64", "query rows of the part"),
        KernelArg::scalar("sq_acc", "u64", "query rows of the accumulators"),
        KernelArg::scalar("q_offset", "u64", "the accumulator row of the part's first row"),
        KernelArg::scalar("head_dim_v", "u64", "channels per head"),
        KernelArg::scalar("step_batch", "u64", "batch stride of out_step (elements)"),
        KernelArg::scalar("step_row", "u64", "row stride of out_step (elements)"),
        KernelArg::scalar("acc_batch", "u64", "batch stride of out_acc (elements)"),
        KernelArg::scalar("acc_row", "u64", "row stride of out_acc (elements)"),
        KernelArg::scalar("init", "int", "1: set the accumulators to the part"),
    ];

    /// Arguments of `<name>_finish`.
    pub const FINISH_ARGS: &'static [KernelArg] = &[
        KernelArg::read("out_acc", "const float* __restrict__", "f32 merged output, at the accumulator strides"),
        KernelArg::read_write("lse_acc", "float* __restrict__", "f32 `[batch, heads, sq_acc]`: merged LSE"),
        KernelArg::write("out", "void* __restrict__", "the merged output in `dtype`, at the accumulator strides"),
        KernelArg::write("lse_half", "float* __restrict__", "f32 `[batch, heads, sq_acc / 2]`: the second halves"),
        KernelArg::scalar("batch", "u64", "sequences"),
        KernelArg::scalar("heads", "u64", "query heads"),
        KernelArg::scalar("sq_acc", "u64", "query rows (even)"),
        KernelArg::scalar("head_dim_v", "u64", "channels per head"),
        KernelArg::scalar("acc_batch", "u64", "batch stride of out_acc and out (elements)"),
        KernelArg::scalar("acc_row", "u64", "row stride of out_acc and out (elements)"),
    ];
}

impl Family for AttnMergeSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            1 => Self::FINISH_ARGS,
            _ => Self::MERGE_ARGS,
        }
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &["", "_finish"]
    }
    fn family(&self) -> &'static str {
        "attn_merge"
    }
    fn template(&self) -> &'static str {
        "attn_merge.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!("{}_t{}", self.dtype, self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.dtype, DType::BF16 | DType::F16) {
            return Err(format!("the merged outputs are the fused attention's bf16 or f16, not {}", self.dtype));
        }
        if self.threads == 0 || self.threads % 32 != 0 || self.threads > 1024 {
            return Err(format!("threads = {} must be a multiple of 32 up to 1024", self.threads));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DiskCache, KernelCompiler};

    #[test]
    fn specs_validate_and_name_themselves() {
        let s = AttnMergeSpec::new(DType::BF16, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_attn_merge_bf16_t256_sm_90a");
        assert_eq!(super::super::KernelSpec::from(s).entry_points()[1], "te_attn_merge_bf16_t256_sm_90a_finish");
        assert!(AttnMergeSpec::new(DType::F32, Arch::Sm89).validate().unwrap_err().contains("bf16 or f16"));
        let s = AttnMergeSpec { threads: 48, ..AttnMergeSpec::new(DType::F16, Arch::Sm89) };
        assert!(s.validate().unwrap_err().contains("multiple of 32"));
    }

    /// Both dtypes render and compile to CUBINs for sm_90a and sm_89 (no GPU needed), with both
    /// entry points.
    #[test]
    fn every_merge_spec_compiles() {
        let c = KernelCompiler::new(DiskCache::disabled())
            .expect("NVRTC must be loadable: source scripts/env.sh, which installs it");
        for arch in [Arch::Sm90a, Arch::Sm89] {
            for dtype in [DType::BF16, DType::F16] {
                let spec = super::super::KernelSpec::from(AttnMergeSpec::new(dtype, arch));
                let (bin, _) = c.compile(&spec).unwrap_or_else(|e| panic!("{}: {e}", spec.name()));
                for e in spec.entry_points() {
                    assert!(bin.bytes.windows(e.len()).any(|w| w == e.as_bytes()), "{} lacks {e}", spec.name());
                }
            }
        }
    }
}
