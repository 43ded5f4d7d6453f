//! Tensor parallelism of the GEMM modules: TE's `parallel_mode` with a `tp_group` and
//! `sequence_parallel` (Megatron-LM's `ColumnParallelLinear` / `RowParallelLinear`, TE
//! `pytorch/module/linear.py`). A layer's config holds the whole layer's sizes; each rank keeps
//! its slice of the weight ([`crate::parallel::shard`]'s layout):
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
//! Blocks whose GEMMs' modes are fixed ([`TpConfig`]): `LayerNormMLP`, `MultiheadAttention`,
//! `TransformerLayer`; the parameter gradients of their norms under sequence parallelism are
//! summed over the group, and every parameter says whether it is a slice
//! (`Param::tensor_parallel`, which `AdamW::with_tensor_parallel` counts in its norm).

use super::params::{LinearParams, ParamsInit};
use crate::fp8::autocast::scales_shared_over;
use crate::fp8::{is_fp8_model_init, Float8Tensor, Quantizer};
use crate::parallel::shard::{ParallelMode, Split, TpRank};
use std::sync::Arc;
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Device, Error, Result, Tensor};

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

/// The tensor-parallel group of a block whose GEMMs' modes are fixed by the block (TE's
/// `tp_group`, `sequence_parallel` with `set_parallel_mode = True`): `LayerNormMLP` (fc1
/// column, fc2 row), `MultiheadAttention` (QKV column with the heads split, projection row),
/// `TransformerLayer` (both). Under sequence parallelism the block's input and output are the
/// rank's token shard `[tokens / tp, hidden]` (sbhd: `[s / tp, b, hidden]`), its norms run on
/// the shard and their parameter gradients are summed over the group.
#[derive(Debug, Clone)]
pub struct TpConfig {
    /// The tensor-parallel group (TE `tp_group`).
    pub group: Arc<ProcessGroup>,
    /// TE `sequence_parallel`.
    pub sequence_parallel: bool,
}

impl TpConfig {
    /// Tensor parallelism over `group`, without sequence parallelism.
    pub fn new(group: Arc<ProcessGroup>) -> Self {
        Self { group, sequence_parallel: false }
    }

    /// This with sequence parallelism on or off.
    pub fn with_sequence_parallel(self, sequence_parallel: bool) -> Self {
        Self { sequence_parallel, ..self }
    }

    /// TE's `tp_size`.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The column-parallel split over this group.
    pub fn column(&self) -> TensorParallel {
        TensorParallel::column(self.group.clone()).with_sequence_parallel(self.sequence_parallel)
    }

    /// The row-parallel split over this group.
    pub fn row(&self) -> TensorParallel {
        TensorParallel::row(self.group.clone()).with_sequence_parallel(self.sequence_parallel)
    }

    /// The group whose ranks hold token shards (with sequence parallelism): norms sum their
    /// parameter gradients over it.
    pub fn sequence_group(&self) -> Option<Arc<ProcessGroup>> {
        self.sequence_parallel.then(|| self.group.clone())
    }

    /// `count` (heads, features) split over the group: `count / tp_size`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `what` when it does not divide.
    pub(crate) fn split(&self, module: &'static str, what: &str, count: usize) -> Result<usize> {
        let n = self.size();
        if count % n != 0 {
            return Err(Error::Config {
                module,
                message: format!(
                    "{what} = {count} does not split over {n} tensor-parallel ranks: choose a tensor-parallel size \
                     that divides it"
                ),
            });
        }
        Ok(count / n)
    }
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

    /// How this mode splits a `[out, in]` weight: along dim 0 (column) or 1 (row).
    pub(crate) fn weight_split(&self) -> Split {
        match self.mode {
            ParallelMode::Column => Split::Dim(0),
            ParallelMode::Row => Split::Dim(1),
        }
    }

    /// This rank's parameters of a layer whose whole sizes are `init`'s: the whole layer's
    /// weight initialized from `init.seed` and sliced as `split` says ([`Split`], the layout
    /// checkpoints are split and merged by: a fused QKV projection by heads, a gated fc1 by
    /// halves; `None`: [`TensorParallel::weight_split`]), so the weights do not depend on the
    /// group's size; the bias (0) of the slice's size.
    ///
    /// # Errors
    /// [`Error::Config`] for a group on another GPU than `dev`, a split dimension that does not
    /// divide by the group's size, or `fp8_model_init` (FP8-only weights are not sliced yet);
    /// [`Error::Dist`] for a `split` that does not divide; the errors of [`LinearParams::new`].
    pub(crate) fn params(
        &self,
        dev: &Arc<Device>,
        module: &'static str,
        init: ParamsInit,
        split: Option<Split>,
    ) -> Result<LinearParams> {
        let config = |message: &str| Err(Error::Config { module, message: message.into() });
        if !Arc::ptr_eq(self.group.device(), dev) {
            return config(
                "the tensor-parallel group runs on another GPU than the layer: make the group on this layer's device",
            );
        }
        if is_fp8_model_init() {
            return config(
                "fp8_model_init with tensor parallelism is not supported yet: make the layer outside fp8_model_init",
            );
        }
        let (w_in, w_out) = (init.in_features, init.out_features);
        let (n_in, n_out) = self.local_features(module, w_in, w_out)?;
        let mut params = LinearParams::new(dev, module, ParamsInit { in_features: n_in, out_features: n_out, ..init })?;
        let whole: Vec<u8> =
            super::init::normal(w_in * w_out, init.init_std, init.seed).iter().flat_map(|v| v.to_le_bytes()).collect();
        let split = split.unwrap_or_else(|| self.weight_split());
        let slice = split.shard(module, &whole, &[w_out, w_in], 4, self.tp_rank())?;
        let slice: Vec<f32> = slice.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        params.set_weight(Tensor::from_f32(dev, init.params_dtype, &[n_out, n_in], &slice)?)?;
        // A row-parallel bias is whole on every rank.
        params.set_tensor_parallel([true, self.mode == ParallelMode::Column]);
        Ok(params)
    }

    /// Whether this rank's GEMM adds the bias in forward: column-parallel ranks add their slice;
    /// of the row-parallel ranks, rank 0 adds the whole bias to its partial output, so the sum
    /// holds it once.
    pub(crate) fn adds_bias(&self) -> bool {
        self.mode == ParallelMode::Column || self.group.rank() == 0
    }

    /// The whole tokens of a sequence-parallel shard: `x [d0, ...]` of every rank concatenated
    /// along the first dim, `[size · d0, ...]`.
    pub fn all_gather(&self, x: &Tensor) -> Result<Tensor> {
        let mut shape = x.shape().to_vec();
        if let Some(d0) = shape.first_mut() {
            *d0 *= self.group.size();
        }
        let mut out = Tensor::empty(self.group.device(), x.dtype(), &shape)?;
        self.group.all_gather(x, &mut out)?;
        self.group.wait()?;
        Ok(out)
    }

    /// Whether an input this layer all-gathers may travel as FP8 codes cast by `q` (TE's FP8
    /// all-gather, 1 byte an element): `q` casts in the producer's kernel with a scale every rank
    /// of the group shares (delayed scaling whose amaxes the autocast scope reduces over the
    /// group). Otherwise the 16-bit input is gathered and cast whole.
    pub(crate) fn gathers_fp8(&self, q: &dyn Quantizer) -> bool {
        self.gathers_input() && q.fuses_cast() && scales_shared_over(&self.group)
    }

    /// The whole tokens of a sequence-parallel shard `x` (16-bit) as FP8 codes cast by `q`, when
    /// `q` takes its scale from the tensor (current scaling): the amax of this rank's shard is
    /// all-reduced (max) over the group, every rank casts its shard with the whole's scale, and
    /// the codes are all-gathered (1 byte an element, TE's FP8 all-gather), with the whole's
    /// transpose with `transpose`. `None` for another quantizer (gather the 16-bit `x`).
    ///
    /// # Errors
    /// NCCL, cast and allocation errors.
    pub(crate) fn all_gather_cast(
        &self,
        x: &Tensor,
        q: &dyn Quantizer,
        transpose: bool,
    ) -> Result<Option<Float8Tensor>> {
        let group = &self.group;
        let shard = q.quantize_with_amax(x, false, &mut |amax| {
            group.all_reduce(amax, ReduceOp::Max)?;
            group.wait()
        })?;
        shard.map(|s| self.all_gather_fp8(&s, transpose)).transpose()
    }

    /// The whole tokens of a sequence-parallel shard of FP8 codes: `x`'s codes of every rank
    /// concatenated along the first dim, with `x`'s scale (the same on every rank, see
    /// [`TensorParallel::gathers_fp8`]), and the transpose of the whole with `transpose`.
    pub(crate) fn all_gather_fp8(&self, x: &Float8Tensor, transpose: bool) -> Result<Float8Tensor> {
        let data = self.all_gather(x.data())?;
        let mut whole = Float8Tensor::from_parts(data, None, x.scale_inv_shared())?;
        if transpose {
            whole.ensure_transpose(self.group.device())?;
        }
        Ok(whole)
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
