//! The hook the GEMM core calls around its GEMM ([`GemmParallel`]): every GEMM module
//! (`Linear`, `LayerNormLinear`, the two GEMMs of `LayerNormMLP`, the projections of
//! `MultiheadAttention`) holds one and calls it unconditionally; its single-GPU form
//! ([`GemmParallel::single`]) is the identity, its tensor-parallel form runs the collectives of
//! its [`ParallelMode`] over a [`TpConfig`]'s group (see [`super::tensor_parallel`]):
//!
//! | when | column | row |
//! |---|---|---|
//! | init | this rank's output features and weight rows | its input features and weight columns |
//! | forward input | all-gathered token shards (sequence parallel; as FP8 codes where the scales are shared) | as is |
//! | forward output | as is | all-reduced (reduce-scattered, sequence parallel); bias added by rank 0 |
//! | backward output gradient | as is | all-gathered token shards (sequence parallel) |
//! | backward dgrad | all-reduced (reduce-scattered, sequence parallel) | as is |
//!
//! With [`TpConfig::tp_comm_overlap`] under sequence parallelism the gathers and reductions of
//! the forward and the dgrad's reduction run on a side stream, hidden behind the GEMMs
//! ([`super::overlap`]): the GEMM core asks [`GemmParallel::overlaps_gather`],
//! [`GemmParallel::overlaps_reduce_scatter`] and runs its GEMMs through
//! [`GemmParallel::gather_gemm`] / [`GemmParallel::gemm_reduce_scatter`], and starts the
//! dgrad's reduction before its wgrad GEMM ([`GemmParallel::start_reduce_dgrad`]).
//!
//! A module may ask it questions (is this rank's input a token shard, how many features are
//! this rank's), never branch on the mode itself.

use super::collectives::{all_gather_rows, sum_rows};
use super::overlap::{self, PendingReduce};
use super::shard::{Split, TpRank};
use super::tensor_parallel::split_count;
use super::{ParallelMode, SequenceParallel, TpConfig};
use crate::fp8::autocast::scales_shared_over;
use crate::fp8::{is_fp8_model_init, Float8Tensor, Quantizer};
use std::ops::Range;
use std::sync::Arc;
use te_runtime::dist::ReduceOp;
use te_runtime::{Device, Error, Result, Tensor};

/// How one GEMM takes part in the run's parallelism: the identity on a single GPU, or its
/// tensor-parallel split (see the module docs). Cheap to clone (the group is shared).
/// `Default` is [`GemmParallel::single`].
#[derive(Debug, Clone, Default)]
pub struct GemmParallel {
    tensor: Option<TensorGemm>,
}

/// A GEMM split over a tensor-parallel group.
#[derive(Debug, Clone)]
struct TensorGemm {
    mode: ParallelMode,
    tp: TpConfig,
}

impl GemmParallel {
    /// The whole GEMM on this GPU: every method is the identity.
    pub fn single() -> Self {
        Self { tensor: None }
    }

    /// The GEMM split over `tp`'s group as `mode` says; [`GemmParallel::single`] without `tp`.
    pub fn new(tp: Option<&TpConfig>, mode: ParallelMode) -> Self {
        Self { tensor: tp.map(|tp| TensorGemm { mode, tp: tp.clone() }) }
    }

    /// Whether the GEMM is whole on this GPU.
    pub fn is_single(&self) -> bool {
        self.tensor.is_none()
    }

    /// The split (`None` for a whole GEMM).
    pub fn mode(&self) -> Option<ParallelMode> {
        self.tensor.as_ref().map(|t| t.mode)
    }

    /// The tensor-parallel config the GEMM splits over (`None` for a whole GEMM).
    pub fn tensor_parallel(&self) -> Option<&TpConfig> {
        self.tensor.as_ref().map(|t| &t.tp)
    }

    /// This rank's place in the group (`rank 0 of 1` for a whole GEMM).
    pub fn tp_rank(&self) -> TpRank {
        self.tensor.as_ref().map_or(TpRank { rank: 0, size: 1 }, |t| t.tp.tp_rank())
    }

    /// The token shards of the activations around the GEMM (the norm in front of a
    /// column-parallel GEMM runs on them): none for a whole GEMM or without sequence parallelism.
    pub fn sequence(&self) -> SequenceParallel {
        SequenceParallel::of(self.tensor_parallel())
    }

    /// `count` heads or features of the layer split over the group (`count` for a whole GEMM).
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` and `what` when the group's size does not divide it.
    pub fn split_count(&self, module: &'static str, what: &str, count: usize) -> Result<usize> {
        split_count(module, what, count, self.tp_rank().size)
    }

    /// This rank's `(in, out)` features of a `[n_in → n_out]` layer (the whole layer's for a
    /// whole GEMM).
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` when the split dimension does not divide by the group's
    /// size.
    pub fn local_features(&self, module: &'static str, n_in: usize, n_out: usize) -> Result<(usize, usize)> {
        match &self.tensor {
            Some(t) => t.mode.local_features(module, n_in, n_out, t.tp.size()),
            None => Ok((n_in, n_out)),
        }
    }

    /// Whether `[weight, bias]` of this rank are slices (`[false, false]` for a whole GEMM).
    pub fn param_split(&self) -> [bool; 2] {
        self.mode().map_or([false; 2], ParallelMode::param_split)
    }

    /// Whether this rank's GEMM adds the bias in forward (see [`ParallelMode::adds_bias`]).
    pub fn adds_bias(&self) -> bool {
        self.tensor.as_ref().is_none_or(|t| t.mode.adds_bias(t.tp.rank()))
    }

    /// Checks that a layer on `dev` can be split: the group runs on `dev`, and the weights are
    /// not FP8-only (`fp8_model_init`). Nothing for a whole GEMM.
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` and what to change.
    pub fn check_init(&self, module: &'static str, dev: &Arc<Device>) -> Result<()> {
        let Some(t) = &self.tensor else { return Ok(()) };
        let config = |message: &str| Err(Error::Config { module, message: message.into() });
        if !Arc::ptr_eq(t.tp.group.device(), dev) {
            return config(
                "the tensor-parallel group runs on another GPU than the layer: make the group on this layer's device",
            );
        }
        if is_fp8_model_init() {
            return config(
                "fp8_model_init with tensor parallelism is not supported yet: make the layer outside fp8_model_init",
            );
        }
        Ok(())
    }

    /// This rank's slice of the layer's initial weight `[out, in] = shape`, the whole weight's
    /// values coming from `whole` (called only when the GEMM is split), sliced as `split` says
    /// (the layout checkpoints split and merge by: a fused QKV projection by heads, a gated fc1
    /// by halves; `None`: the mode's dim), so the weights do not depend on the group's size.
    /// `None` for a whole GEMM: the layer keeps its own init.
    ///
    /// # Errors
    /// [`Error::Dist`] for a `split` that does not divide, or `whole` not of `shape`.
    pub fn shard_weight(
        &self,
        module: &'static str,
        shape: [usize; 2],
        split: Option<Split>,
        whole: impl FnOnce() -> Vec<f32>,
    ) -> Result<Option<Vec<f32>>> {
        let Some(t) = &self.tensor else { return Ok(None) };
        let bytes: Vec<u8> = whole().iter().flat_map(|v| v.to_le_bytes()).collect();
        let split = split.unwrap_or_else(|| t.mode.weight_split());
        let slice = split.shard(module, &bytes, &shape, 4, t.tp.tp_rank())?;
        Ok(Some(slice.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()))
    }

    /// Refuses an FP8 output the ranks would have to sum (see
    /// [`ParallelMode::check_fp8_output`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` for `fp8_output` with row parallelism.
    pub fn check_fp8_output(&self, module: &'static str, fp8_output: bool) -> Result<()> {
        self.mode().map_or(Ok(()), |m| m.check_fp8_output(module, fp8_output))
    }

    /// Whether the forward's input is this rank's token shard, all-gathered before the GEMM
    /// (column, sequence parallel).
    pub fn gathers_input(&self) -> bool {
        self.tensor.as_ref().is_some_and(|t| t.mode.gathers_input(t.tp.sequence_parallel))
    }

    /// The GEMM's token count for `tokens` input tokens of this rank (times the group's size
    /// when the input is gathered).
    pub fn input_tokens(&self, tokens: usize) -> usize {
        match &self.tensor {
            Some(t) if self.gathers_input() => tokens * t.tp.size(),
            _ => tokens,
        }
    }

    /// The GEMM's input: the whole tokens of the ranks' shards `x` when the input is gathered
    /// (16-bit all-gather), else `x`.
    ///
    /// # Errors
    /// NCCL and allocation errors.
    pub fn gather_input(&self, x: &Tensor) -> Result<Tensor> {
        match &self.tensor {
            Some(t) if self.gathers_input() => all_gather_rows(&t.tp.group, x),
            _ => Ok(x.clone()),
        }
    }

    /// Whether a gathered input may travel as FP8 codes cast by `q` in the producer's kernel
    /// (TE's FP8 all-gather, 1 byte an element): `q` fuses its cast, and its scale is the same on
    /// every rank of the group (delayed scaling whose amaxes the autocast scope reduces over a
    /// group holding them). Otherwise the 16-bit input is gathered and cast whole.
    pub fn gathers_fp8(&self, q: &dyn Quantizer) -> bool {
        match &self.tensor {
            Some(t) => self.gathers_input() && q.fuses_cast() && scales_shared_over(&t.tp.group),
            None => false,
        }
    }

    /// The whole tokens of a token shard of FP8 codes `x` (cast with a scale every rank shares,
    /// see [`GemmParallel::gathers_fp8`]): the ranks' codes concatenated along the first dim with
    /// `x`'s scale, and the whole's transpose with `transpose`. `x` itself when the input is not
    /// gathered.
    ///
    /// # Errors
    /// NCCL, transpose and allocation errors.
    pub fn gather_fp8(&self, x: Float8Tensor, transpose: bool) -> Result<Float8Tensor> {
        match &self.tensor {
            Some(t) if self.gathers_input() => {
                let data = all_gather_rows(&t.tp.group, x.data())?;
                let mut whole = Float8Tensor::from_parts(data, None, x.scale_inv_shared())?;
                if transpose {
                    whole.ensure_transpose(t.tp.group.device())?;
                }
                Ok(whole)
            }
            _ => Ok(x),
        }
    }

    /// The whole tokens of a token shard `x` (16-bit) as FP8 codes cast by `q`, when the input is
    /// gathered and `q` takes its scale from the tensor (current scaling): the amax of this
    /// rank's shard is all-reduced (max) over the group, every rank casts its shard with the
    /// whole's scale, and the codes are all-gathered (1 byte an element, TE's FP8 all-gather),
    /// with the whole's transpose with `transpose`. `None` otherwise (gather the 16-bit `x` with
    /// [`GemmParallel::gather_input`]; the GEMM casts it).
    ///
    /// # Errors
    /// NCCL, cast and allocation errors.
    pub fn gather_cast(&self, x: &Tensor, q: &dyn Quantizer, transpose: bool) -> Result<Option<Float8Tensor>> {
        let Some(t) = self.tensor.as_ref().filter(|_| self.gathers_input()) else { return Ok(None) };
        let group = &t.tp.group;
        let shard = q.quantize_with_amax(x, false, &mut |amax| {
            group.all_reduce(amax, ReduceOp::Max)?;
            group.wait()
        })?;
        shard.map(|s| self.gather_fp8(s, transpose)).transpose()
    }

    /// Whether the forward's output is a partial sum the ranks reduce (row).
    pub fn reduces_output(&self) -> bool {
        self.mode().is_some_and(ParallelMode::reduces_output)
    }

    /// The layer's output from this rank's GEMM output `y` (16-bit): the ranks' sum (row; this
    /// rank's token shard of it under sequence parallelism), else `y`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` for a first dim that does not divide (sequence
    /// parallelism); NCCL errors.
    pub fn reduce_output(&self, module: &'static str, y: Tensor) -> Result<Tensor> {
        match &self.tensor {
            Some(t) if t.mode.reduces_output() => sum_rows(&t.tp.group, module, y, t.tp.sequence_parallel),
            _ => Ok(y),
        }
    }

    /// The output gradient the GEMMs' backward takes: the whole tokens of the ranks' shards
    /// `dy` (row, sequence parallel: 16-bit all-gather), else `dy`.
    ///
    /// # Errors
    /// NCCL and allocation errors.
    pub fn gather_grad_output(&self, dy: &Tensor) -> Result<Tensor> {
        match &self.tensor {
            Some(t) if t.mode.gathers_grad_output(t.tp.sequence_parallel) => all_gather_rows(&t.tp.group, dy),
            _ => Ok(dy.clone()),
        }
    }

    /// Whether the forward's input gather runs overlapped with the GEMM
    /// ([`GemmParallel::gather_gemm`]): column-parallel under sequence parallelism with
    /// [`TpConfig::tp_comm_overlap`].
    pub fn overlaps_gather(&self) -> bool {
        self.gathers_input() && self.tensor.as_ref().is_some_and(|t| t.tp.overlaps_comm())
    }

    /// Whether the forward's output reduce-scatter runs overlapped with the GEMM
    /// ([`GemmParallel::gemm_reduce_scatter`]): row-parallel under sequence parallelism with
    /// [`TpConfig::tp_comm_overlap`].
    pub fn overlaps_reduce_scatter(&self) -> bool {
        self.tensor.as_ref().is_some_and(|t| t.mode.reduces_output() && t.tp.overlaps_comm())
    }

    /// Whether the backward's output-gradient gather runs overlapped with the dgrad GEMM
    /// ([`GemmParallel::gather_gemm`] of the output gradient's shards; 16-bit backward):
    /// row-parallel under sequence parallelism with [`TpConfig::tp_comm_overlap`]. The wgrad
    /// GEMM then takes the whole gathered gradient, as without the overlap.
    pub fn overlaps_grad_gather(&self) -> bool {
        self.tensor.as_ref().is_some_and(|t| t.mode.gathers_grad_output(t.tp.sequence_parallel) && t.tp.overlaps_comm())
    }

    /// The overlapped all-gather of this rank's token shard `shard` with the GEMM `gemm` of
    /// each rank's shard (see [`super::overlap`]): the whole input (with `keep_input`) and the
    /// whole output, as [`GemmParallel::gather_input`] then one GEMM would give. Call only where
    /// [`GemmParallel::overlaps_gather`].
    ///
    /// # Errors
    /// [`Error::Internal`] without tensor parallelism; NCCL, allocation and copy errors;
    /// `gemm`'s errors.
    pub fn gather_gemm(
        &self,
        shard: &Tensor,
        keep_input: bool,
        gemm: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<(Option<Tensor>, Tensor)> {
        let t = self.split_gemm("GemmParallel::gather_gemm")?;
        overlap::gather_gemm(&*t.tp.side_group()?, shard, keep_input, gemm)
    }

    /// The overlapped reduce-scatter of a row-parallel GEMM whose whole output has `rows`
    /// first-dim rows, computed block by block by `gemm(rows)` in `chunks` chunks per owner
    /// ([`GemmParallel::reduce_scatter_chunks`]; see [`super::overlap`]): this rank's token
    /// shard of the ranks' sum, as one GEMM then [`GemmParallel::reduce_output`] would give.
    /// Call only where [`GemmParallel::overlaps_reduce_scatter`].
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` when `rows` does not divide by the group's size;
    /// [`Error::Internal`] without tensor parallelism; NCCL and allocation errors; `gemm`'s
    /// errors.
    pub fn gemm_reduce_scatter(
        &self,
        module: &'static str,
        rows: usize,
        chunks: usize,
        gemm: impl FnMut(Range<usize>) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let t = self.split_gemm(module)?;
        overlap::gemm_reduce_scatter(&*t.tp.side_group()?, module, rows, chunks, gemm)
    }

    /// The chunks per owner an overlapped reduce-scatter of a GEMM input of `shape` runs in
    /// ([`overlap::reduce_chunks`], with [`overlap::REDUCE_CHUNKS_ENV`]); 1: not overlapped
    /// (also for a first dim that does not divide by the group's size, whose error the
    /// reduce-scatter reports).
    pub fn reduce_scatter_chunks(&self, shape: &[usize]) -> usize {
        let size = self.tp_rank().size.max(1);
        match shape.split_first() {
            Some((&d0, rest)) if d0 % size == 0 => overlap::reduce_chunks(
                d0 / size,
                rest[..rest.len().saturating_sub(1)].iter().product(),
                overlap::forced_chunks(),
            ),
            _ => 1,
        }
    }

    fn split_gemm(&self, module: &'static str) -> Result<&TensorGemm> {
        self.tensor.as_ref().ok_or_else(|| Error::internal(module, "an overlapped collective of a whole GEMM"))
    }

    /// Starts the reduction of this rank's dgrad `dx` (what [`GemmParallel::reduce_dgrad`]
    /// does): with [`TpConfig::tp_comm_overlap`] under sequence parallelism its reduce-scatter
    /// is issued now on the side stream, to run while the wgrad GEMM issued next runs (TE's
    /// `ub_bulk_dgrad`; the same collective on the same data, so bit for bit the same result);
    /// otherwise it runs at [`PendingReduce::finish`], as [`GemmParallel::reduce_dgrad`].
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` for a first dim that does not divide; NCCL and
    /// allocation errors.
    pub fn start_reduce_dgrad(&self, module: &'static str, dx: Tensor) -> Result<PendingReduce> {
        match &self.tensor {
            Some(t) if t.mode.reduces_dgrad() && t.tp.overlaps_comm() => {
                PendingReduce::reduce_scatter(t.tp.side_group()?, module, dx)
            }
            Some(t) if t.mode.reduces_dgrad() => {
                Ok(PendingReduce::deferred(t.tp.group.clone(), module, dx, t.tp.sequence_parallel))
            }
            _ => Ok(PendingReduce::ready(dx)),
        }
    }

    /// The layer's input gradient from this rank's dgrad `dx`: the ranks' sum (column: each
    /// rank's dgrad is its output slice's part; reduce-scattered back to the token shards under
    /// sequence parallelism), else `dx`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` for a first dim that does not divide (sequence
    /// parallelism); NCCL errors.
    pub fn reduce_dgrad(&self, module: &'static str, dx: Tensor) -> Result<Tensor> {
        match &self.tensor {
            Some(t) if t.mode.reduces_dgrad() => sum_rows(&t.tp.group, module, dx, t.tp.sequence_parallel),
            _ => Ok(dx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The single-GPU hook is the identity: whole features and parameters, every rank adds the
    /// bias, nothing gathered or reduced, the layer keeps its own init (the whole weight is not
    /// even made), FP8 outputs allowed.
    #[test]
    fn the_single_gpu_hook_is_the_identity() {
        let one = GemmParallel::default();
        assert!(one.is_single() && one.mode().is_none() && one.tensor_parallel().is_none());
        assert_eq!(one.tp_rank(), TpRank { rank: 0, size: 1 });
        assert_eq!(one.local_features("Linear", 64, 33).unwrap(), (64, 33));
        assert_eq!(one.split_count("LayerNormMLP", "ffn_hidden_size", 99).unwrap(), 99);
        assert_eq!(one.param_split(), [false, false]);
        assert!(one.adds_bias());
        assert!(!one.gathers_input() && !one.reduces_output());
        assert_eq!(one.input_tokens(96), 96);
        assert!(one.check_fp8_output("Linear", true).is_ok());
        let whole = one.shard_weight("Linear", [4, 4], None, || unreachable!("a whole GEMM keeps its init"));
        assert_eq!(whole.unwrap(), None);
        assert!(!one.sequence().is_sharded());
        assert!(GemmParallel::new(None, ParallelMode::Row).is_single());
    }
}
