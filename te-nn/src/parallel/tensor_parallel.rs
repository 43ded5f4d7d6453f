//! The tensor-parallel configuration of a module: TE's `tp_group` and `sequence_parallel`
//! (Megatron-LM's `ColumnParallelLinear` / `RowParallelLinear`, TE
//! `pytorch/module/linear.py`). It is the one config every tensor-parallel module takes
//! (`LinearConfig::tp`, `LayerNormLinearConfig::tp`, `LayerNormMLPConfig::tp`,
//! `MultiheadAttentionConfig::tp`, `TransformerLayerConfig::tp`, `Gpt::with_tensor_parallel`);
//! how each GEMM splits over the group ([`ParallelMode`], TE's `parallel_mode`) is a value given
//! where the split is chosen: [`TpConfig::gemm`] makes the GEMM's hook ([`GemmParallel`]).
//! A layer's config holds the whole layer's sizes; each rank keeps its slice of the weight
//! ([`super::shard`]'s layout):
//!
//! - **column**: output features split. The input is whole on every rank (under sequence
//!   parallelism each rank holds `1/tp` of the tokens, all-gathered before the GEMM); the output
//!   stays split (`[tokens, out / tp]`), the bias too. Backward: the partial input gradients are
//!   all-reduced (reduce-scattered back to the token shards under sequence parallelism).
//! - **row**: input features split (the column-parallel layer's output as it is). The partial
//!   outputs are all-reduced (reduce-scattered to the token shards under sequence
//!   parallelism); the bias is whole, added once (by rank 0's GEMM epilogue, before the sum).
//!   Backward: the output gradient is whole on every rank (all-gathered from the token shards
//!   under sequence parallelism), so every rank computes the same bias gradient.
//!
//! Collectives run on the group's stream in the activations' 16-bit dtype, except the
//! sequence-parallel all-gather of a norm output the norm cast to FP8 with scales every rank
//! shares (1 byte an element, TE's FP8 all-gather: under delayed scaling whose amaxes the
//! autocast scope reduces over a group holding the tensor-parallel ranks, and under current
//! scaling, whose shards' amax is all-reduced before the cast). FP8 casts use each
//! rank's own amaxes unless the autocast scope reduces them (`Fp8Autocast::fp8_group`: pass the
//! group of all ranks, as TE's default `fp8_group` is).
//!
//! Blocks fix their GEMMs' modes (TE's `set_parallel_mode = True`): `LayerNormMLP` (fc1
//! column, fc2 row), `MultiheadAttention` (QKV column with the heads split, projection row),
//! `TransformerLayer` (both). Under sequence parallelism a block's input and output are the
//! rank's token shard `[tokens / tp, hidden]` (sbhd: `[s / tp, b, hidden]`), its norms run on
//! the shard and their parameter gradients are summed over the group ([`SequenceParallel`]);
//! every parameter says whether it is a slice (`Param::tensor_parallel`, which
//! `AdamW::with_tensor_parallel` counts in its norm).
//!
//! **Communication overlap** ([`TpConfig::tp_comm_overlap`], TE's `tp_comm_overlap`; off by
//! default, or on with the environment variable [`TP_COMM_OVERLAP_ENV`]`=1` read by
//! [`TpConfig::new`]): the sequence-parallel collectives run on a side stream of their own,
//! hidden behind the GEMMs (see [`super::overlap`]).

use super::shard::TpRank;
use super::{GemmParallel, ParallelMode, SequenceParallel};
use std::sync::{Arc, OnceLock};
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

/// The tensor-parallel group of a module and whether the tokens between its GEMMs are split
/// over it (TE's `tp_group`, `sequence_parallel`); see the module docs.
#[derive(Debug, Clone)]
pub struct TpConfig {
    /// The tensor-parallel group (TE `tp_group`); its size is TE's `tp_size`.
    pub group: Arc<ProcessGroup>,
    /// Inputs of column-parallel layers and outputs of row-parallel layers are split over the
    /// ranks along the first (token or sequence) dim (TE `sequence_parallel`, Megatron-LM's
    /// sequence parallelism); the norms and dropout between them then run on the shards.
    pub sequence_parallel: bool,
    /// Hide the sequence-parallel collectives behind the GEMMs (TE's `tp_comm_overlap`: its
    /// Userbuffers `ub_overlap_ag`, `ub_overlap_rs`, `ub_bulk_dgrad`; torchtitan's async tensor
    /// parallelism), with NCCL on a side stream: the all-gather of a column-parallel GEMM's input
    /// piece by piece while the GEMMs of the arrived pieces run, the reduce-scatter of a
    /// row-parallel GEMM's output block by block while the next block computes, the dgrad's
    /// reduction while the wgrad GEMM runs (see [`super::overlap`]). Only with
    /// `sequence_parallel` (without it, nothing changes). The results are the same sums of the
    /// same products; see [`super::overlap`] for what is bit for bit the same.
    pub tp_comm_overlap: bool,
    /// The side-stream copy of `group` the overlapped collectives run on, made at the first
    /// overlapped collective (every rank reaches it at the same point of the same module
    /// sequence), shared by the clones of this config.
    side: Arc<OnceLock<Arc<ProcessGroup>>>,
}

/// The environment variable [`TpConfig::new`] reads for [`TpConfig::tp_comm_overlap`]: `1`
/// (or `true`) turns it on. A stopgap until the trainer sets it with
/// [`TpConfig::with_comm_overlap`].
pub const TP_COMM_OVERLAP_ENV: &str = "TE_TP_COMM_OVERLAP";

/// Whether [`TP_COMM_OVERLAP_ENV`] asks for the overlap.
fn overlap_from_env() -> bool {
    overlap_flag(std::env::var(TP_COMM_OVERLAP_ENV).ok().as_deref())
}

/// Whether a value of [`TP_COMM_OVERLAP_ENV`] turns the overlap on: `1`, `true`, `yes`.
fn overlap_flag(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes"))
}

impl TpConfig {
    /// Tensor parallelism over `group`, without sequence parallelism; the communication
    /// overlap on when [`TP_COMM_OVERLAP_ENV`] is `1` (then its side-stream group is made here,
    /// as by [`TpConfig::prepare_comm_overlap`]: every rank builds its config at the same point;
    /// a failure is reported again at the first overlapped collective).
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        let tp = Self { group, sequence_parallel: false, tp_comm_overlap: overlap_from_env(), side: Arc::default() };
        if tp.tp_comm_overlap && tp.size() > 1 {
            // Retried (and its error returned) at the first overlapped collective.
            let _ = tp.side_group();
        }
        tp
    }

    /// Makes the side-stream group of the communication overlap now (collective: every rank of
    /// the group calls it), instead of at the first overlapped collective: before capturing a
    /// CUDA graph of the step, which cannot make communicators. Nothing when the overlap is off
    /// ([`TpConfig::overlaps_comm`]).
    ///
    /// # Errors
    /// As [`ProcessGroup::with_side_stream`].
    pub fn prepare_comm_overlap(&self) -> Result<()> {
        if self.overlaps_comm() {
            self.side_group()?;
        }
        Ok(())
    }

    /// This with the communication overlap on or off ([`TpConfig::tp_comm_overlap`]; it acts
    /// only under sequence parallelism). Every rank of the group must pass the same value.
    pub fn with_comm_overlap(self, tp_comm_overlap: bool) -> Self {
        Self { tp_comm_overlap, ..self }
    }

    /// Whether the collectives of this config's GEMMs are overlapped with them: the overlap
    /// asked for, sequence parallelism on, more than one rank.
    pub fn overlaps_comm(&self) -> bool {
        self.tp_comm_overlap && self.sequence_parallel && self.size() > 1
    }

    /// The side-stream copy of the group the overlapped collectives run on
    /// ([`ProcessGroup::with_side_stream`]), made at the first call (collective: every rank
    /// calls it at the same point, as every rank runs the same modules).
    ///
    /// # Errors
    /// As [`ProcessGroup::with_side_stream`].
    pub(crate) fn side_group(&self) -> Result<Arc<ProcessGroup>> {
        if let Some(g) = self.side.get() {
            return Ok(g.clone());
        }
        let made = Arc::new(self.group.with_side_stream()?);
        Ok(self.side.get_or_init(|| made).clone())
    }

    /// This with sequence parallelism on or off.
    pub fn with_sequence_parallel(self, sequence_parallel: bool) -> Self {
        Self { sequence_parallel, ..self }
    }

    /// TE's `tp_size`.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// This rank in the group (TE's `tp_rank`).
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// This rank's place in the group, as the sharding arithmetic takes it.
    pub fn tp_rank(&self) -> TpRank {
        TpRank { rank: self.rank(), size: self.size() }
    }

    /// The hook of a GEMM split over this group as `mode` says.
    pub fn gemm(&self, mode: ParallelMode) -> GemmParallel {
        GemmParallel::new(Some(self), mode)
    }

    /// The token shards between the GEMMs: over this group with sequence parallelism, else
    /// none.
    pub fn sequence(&self) -> SequenceParallel {
        SequenceParallel::of(Some(self))
    }

    /// `count` (heads, features) split over the group: `count / tp_size`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` and `what` when it does not divide.
    pub fn split_count(&self, module: &'static str, what: &str, count: usize) -> Result<usize> {
        split_count(module, what, count, self.size())
    }
}

/// `count` split over `size` ranks.
///
/// # Errors
/// [`Error::Config`] naming `module` and `what` when `size` does not divide it (or is 0).
pub(crate) fn split_count(module: &'static str, what: &str, count: usize, size: usize) -> Result<usize> {
    if size == 0 || count % size != 0 {
        return Err(Error::Config {
            module,
            message: format!(
                "{what} = {count} does not split over {size} tensor-parallel ranks: choose a tensor-parallel size \
                 that divides it"
            ),
        });
    }
    Ok(count / size)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Heads and features split evenly or not at all: the error names the count and the size.
    #[test]
    fn counts_split_evenly_or_are_typed_errors() {
        assert_eq!(split_count("m", "num_attention_heads", 16, 4).unwrap(), 4);
        assert_eq!(split_count("m", "ffn_hidden_size", 96, 1).unwrap(), 96);
        let e = split_count("MultiheadAttention", "num_attention_heads", 3, 2).unwrap_err().to_string();
        assert!(e.contains("num_attention_heads = 3") && e.contains("2 tensor-parallel ranks"), "{e}");
        assert!(split_count("m", "ffn_hidden_size", 8, 0).is_err());
    }

    /// `TE_TP_COMM_OVERLAP`: 1, true or yes turn the overlap on; anything else (or unset) not.
    #[test]
    fn the_overlap_variable_takes_one_true_or_yes() {
        for on in ["1", "true", "TRUE", " yes "] {
            assert!(overlap_flag(Some(on)), "{on}");
        }
        for off in ["0", "false", "", "2", "on?"] {
            assert!(!overlap_flag(Some(off)), "{off}");
        }
        assert!(!overlap_flag(None));
    }
}
