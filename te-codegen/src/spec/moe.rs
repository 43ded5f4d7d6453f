//! Family 17: mixture-of-experts token permutation (TE 2.x `moe_permute` / `moe_unpermute` with
//! an index routing map; `transformer_engine/common/permutation/permutation.cu`).

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// The permutation kernels of one activation dtype, four entry points (`tokens`, `k`,
/// `experts`, `hidden` run time):
///
/// - `<name>_map` ([`MoePermuteSpec::MAP_ARGS`]): from the routing indices (i32 `[tokens, k]`,
///   slot `j` of token `t` its `j`-th expert; `-1` or any index outside `[0, experts)` drops
///   the slot) the destination row of every slot, `row_id_map` (i32 `[k, tokens]`, TE's
///   layout; `-1` for a dropped slot), and the rows per expert `m_splits` (i32 `[experts]`).
///   Rows are grouped by expert in ascending order and, within an expert, in token order (a
///   stable counting sort: block `e` ranks expert `e`'s slots with a block-wide scan).
/// - `<name>` ([`MoePermuteSpec::PERMUTE_ARGS`]): `out[row_id_map[j, t]] = x[t] (· probs[t,
///   j])`, block `(t, j)`; rows of dropped slots are not written.
/// - `<name>_unpermute` ([`MoePermuteSpec::UNPERMUTE_ARGS`]): `out[t] = Σ_j probs[t, j] ·
///   y[row_id_map[j, t]]` (probs null: weight 1), summed in f32 in slot order, block `t`.
/// - `<name>_dprobs` ([`MoePermuteSpec::DPROBS_ARGS`]): the probabilities' gradient of
///   `unpermute`, `d_probs[t, j] = Σ_h d_out[t, h] · y[row_id_map[j, t], h]` (f32; 0 for a
///   dropped slot), block `(t, j)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MoePermuteSpec {
    /// Activations: bf16, f16 or f32.
    pub dtype: DType,
    /// Target architecture.
    pub arch: Arch,
}

impl MoePermuteSpec {
    /// Threads per block of every entry point.
    pub const THREADS: usize = 256;

    /// The kernels of `dtype` for `arch`.
    pub const fn new(dtype: DType, arch: Arch) -> Self {
        Self { dtype, arch }
    }

    /// Arguments of `_map` (entry point 0).
    pub const MAP_ARGS: &'static [KernelArg] = &[
        KernelArg::read("indices", "const int* __restrict__", "i32 `[tokens, k]` expert of each slot"),
        KernelArg::write("row_id_map", "int* __restrict__", "i32 `[k, tokens]` destination row of each slot, or -1"),
        KernelArg::write("m_splits", "int* __restrict__", "i32 `[experts]` rows per expert"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("k", "u64", "slots per token (top-k)"),
        KernelArg::scalar("experts", "u64", "experts"),
    ];

    /// Arguments of the permutation (entry point 1).
    pub const PERMUTE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[tokens, hidden]` activations"),
        KernelArg::read("row_id_map", "const int* __restrict__", "i32 `[k, tokens]` from `_map`"),
        KernelArg::read("probs", "const float* __restrict__", "f32 `[tokens, k]` row weights, or null"),
        KernelArg::write("out", "void* __restrict__", "`[rows, hidden]` permuted rows"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("k", "u64", "slots per token"),
        KernelArg::scalar("hidden", "u64", "elements per row"),
    ];

    /// Arguments of `_unpermute` (entry point 2).
    pub const UNPERMUTE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("y", "const void* __restrict__", "`[rows, hidden]` permuted rows"),
        KernelArg::read("row_id_map", "const int* __restrict__", "i32 `[k, tokens]` from `_map`"),
        KernelArg::read("probs", "const float* __restrict__", "f32 `[tokens, k]` weights, or null (1)"),
        KernelArg::write("out", "void* __restrict__", "`[tokens, hidden]` combined rows"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("k", "u64", "slots per token"),
        KernelArg::scalar("hidden", "u64", "elements per row"),
    ];

    /// Arguments of `_dprobs` (entry point 3).
    pub const DPROBS_ARGS: &'static [KernelArg] = &[
        KernelArg::read("d_out", "const void* __restrict__", "`[tokens, hidden]` gradient of unpermute's output"),
        KernelArg::read("y", "const void* __restrict__", "`[rows, hidden]` unpermute's input rows"),
        KernelArg::read("row_id_map", "const int* __restrict__", "i32 `[k, tokens]` from `_map`"),
        KernelArg::write("d_probs", "float* __restrict__", "f32 `[tokens, k]`"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("k", "u64", "slots per token"),
        KernelArg::scalar("hidden", "u64", "elements per row"),
    ];
}

impl Family for MoePermuteSpec {
    fn family(&self) -> &'static str {
        "moe_permute"
    }
    fn template(&self) -> &'static str {
        "moe_permute.cu.tera"
    }
    fn name_parts(&self) -> String {
        self.dtype.to_string()
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &["_map", "", "_unpermute", "_dprobs"]
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            0 => Self::MAP_ARGS,
            1 => Self::PERMUTE_ARGS,
            2 => Self::UNPERMUTE_ARGS,
            _ => Self::DPROBS_ARGS,
        }
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("threads", &Self::THREADS);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("MoE permutation moves bf16, f16 or f32 activations, not {}", self.dtype));
        }
        Ok(())
    }
}
