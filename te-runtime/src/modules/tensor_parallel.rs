//! Tensor parallelism of the GEMM modules: TE's `parallel_mode` with a `tp_group` and
//! `sequence_parallel` (Megatron-LM's `ColumnParallelLinear` / `RowParallelLinear`, TE
//! `pytorch/module/linear.py`). A layer's config holds the whole layer's sizes; each rank keeps
//! its slice of the weight ([`crate::dist::shard`]'s layout):
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
//! Collectives run in the activations' 16-bit dtype on the group's stream. FP8 casts use each
//! rank's own amaxes unless the autocast scope reduces them (`Fp8Autocast::fp8_group`: pass the
//! group of all ranks, as TE's default `fp8_group` is).

use crate::dist::shard::{ParallelMode, TpRank};
use crate::dist::{ProcessGroup, ReduceOp};
use crate::{Error, Result, Tensor};
use std::sync::Arc;

/// How a GEMM module splits over a tensor-parallel group (TE's `parallel_mode`, `tp_group`,
/// `sequence_parallel`).
#[derive(Debug, Clone)]
pub struct TensorParallel {
    /// Column (output features split) or row (input features split).
    pub mode: ParallelMode,
    /// The tensor-parallel group (TE `tp_group`); its size is TE's `tp_size`.
    pub group: Arc<ProcessGroup>,
    /// Inputs of column-parallel layers and outputs of row-parallel layers are split over the
    /// ranks along the first (token or sequence) dim (TE `sequence_parallel`, Megatron-LM's
    /// sequence parallelism); the norms and dropout between them then run on the shards.
    pub sequence_parallel: bool,
}

impl TensorParallel {
    /// Column-parallel over `group`, without sequence parallelism.
    pub fn column(group: Arc<ProcessGroup>) -> Self {
        Self { mode: ParallelMode::Column, group, sequence_parallel: false }
    }

    /// Row-parallel over `group`, without sequence parallelism.
    pub fn row(group: Arc<ProcessGroup>) -> Self {
        Self { mode: ParallelMode::Row, group, sequence_parallel: false }
    }

    /// This with sequence parallelism on or off.
    pub fn with_sequence_parallel(self, sequence_parallel: bool) -> Self {
        Self { sequence_parallel, ..self }
    }

    /// This rank's place in the group.
    pub fn tp_rank(&self) -> TpRank {
        TpRank { rank: self.group.rank(), size: self.group.size() }
    }

    /// The `(in, out)` features of this rank's slice of a `[in → out]` layer.
    ///
    /// # Errors
    /// [`Error::Config`] when the split dimension does not divide by the group's size.
    pub(crate) fn local_features(&self, module: &'static str, n_in: usize, n_out: usize) -> Result<(usize, usize)> {
        let n = self.group.size();
        let (name, dim) = match self.mode {
            ParallelMode::Column => ("out_features", n_out),
            ParallelMode::Row => ("in_features", n_in),
        };
        if dim % n != 0 {
            return Err(Error::Config {
                module,
                message: format!(
                    "{name} = {dim} does not split over {n} tensor-parallel ranks ({:?}-parallel): choose a \
                     tensor-parallel size that divides it",
                    self.mode
                ),
            });
        }
        Ok(match self.mode {
            ParallelMode::Column => (n_in, n_out / n),
            ParallelMode::Row => (n_in / n, n_out),
        })
    }

    /// This rank's slice of a whole `[n_out, n_in]` weight (row-major host values): rows
    /// (column-parallel) or columns (row-parallel). Every rank initializes the whole weight from
    /// the same seed and keeps its slice, so a layer's weights do not depend on the group's size.
    pub(crate) fn slice_weight(&self, whole: &[f32], n_in: usize, n_out: usize) -> Vec<f32> {
        let TpRank { rank, size } = self.tp_rank();
        match self.mode {
            ParallelMode::Column => {
                let rows = n_out / size;
                whole[rank * rows * n_in..(rank + 1) * rows * n_in].to_vec()
            }
            ParallelMode::Row => {
                let cols = n_in / size;
                (0..n_out).flat_map(|o| whole[o * n_in + rank * cols..o * n_in + (rank + 1) * cols].to_vec()).collect()
            }
        }
    }

    /// Whether this rank's GEMM adds the bias in forward: column-parallel ranks add their slice;
    /// of the row-parallel ranks, rank 0 adds the whole bias to its partial output, so the sum
    /// holds it once.
    pub(crate) fn adds_bias(&self) -> bool {
        self.mode == ParallelMode::Column || self.group.rank() == 0
    }

    /// The whole tokens of a sequence-parallel shard: `x [d0, ...]` of every rank concatenated
    /// along the first dim, `[size · d0, ...]`.
    pub(crate) fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        let mut shape = x.shape().to_vec();
        if let Some(d0) = shape.first_mut() {
            *d0 *= self.group.size();
        }
        let mut out = Tensor::empty(self.group.device(), x.dtype(), &shape)?;
        self.group.all_gather(x, &mut out)?;
        self.group.wait()?;
        Ok(out)
    }

    /// The sum of every rank's partial `x`: whole (all-reduce), or with sequence parallelism
    /// this rank's token shard of it (reduce-scatter along the first dim, which must divide by
    /// the group's size).
    ///
    /// # Errors
    /// [`Error::Shape`] for a first dim that does not divide (sequence parallelism); NCCL errors.
    pub(crate) fn reduce(&self, module: &'static str, mut x: Tensor) -> Result<Tensor> {
        if !self.sequence_parallel {
            self.group.all_reduce(&mut x, ReduceOp::Sum)?;
            self.group.wait()?;
            return Ok(x);
        }
        let n = self.group.size();
        let mut shape = x.shape().to_vec();
        match shape.first_mut() {
            Some(d0) if *d0 % n == 0 => *d0 /= n,
            _ => {
                return Err(Error::Shape {
                    op: module,
                    message: format!(
                        "sequence parallelism splits the first dim of {:?} over {n} ranks: make it a multiple of {n}",
                        x.shape()
                    ),
                })
            }
        }
        let mut out = Tensor::empty(self.group.device(), x.dtype(), &shape)?;
        self.group.reduce_scatter(&x, &mut out, ReduceOp::Sum)?;
        self.group.wait()?;
        Ok(out)
    }

    /// Whether the forward's input is a token shard to all-gather (column, sequence parallel).
    pub(crate) fn gathers_input(&self) -> bool {
        self.mode == ParallelMode::Column && self.sequence_parallel
    }

    /// Whether the backward's output gradient is a token shard to all-gather (row, sequence
    /// parallel).
    pub(crate) fn gathers_grad_output(&self) -> bool {
        self.mode == ParallelMode::Row && self.sequence_parallel
    }
}
