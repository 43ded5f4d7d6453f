//! The communication of a sharded [`AdamW`] (ZeRO stages 1 and 2, [`AdamW::new_zero`],
//! [`AdamW::new_zero_stage`]; Megatron-LM's `megatron/core/optimizer/distrib_optimizer.py`): the
//! partition of the parameters over the data-parallel group (and, at stage 2, the gradient
//! shards it gives [`te_nn::parallel::DataParallel`]), the gather of every rank's partial
//! gradient norms, the in-place broadcasts that make the parameters whole after a step, and the
//! gather of the pieces a checkpoint writes.

use super::partition::Partition;
use super::{AdamW, AdamWConfig, PendingStep, StepStats, ZeroStage};
use cudarc::driver::CudaSlice;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use te_nn::checkpoint::optimizer_state::{write_state_file, HostParamState};
use te_nn::modules::Module;
use te_nn::parallel::GradShards;
use te_runtime::dist::ProcessGroup;
use te_runtime::ops::optimizer::CHUNK;
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "AdamW (ZeRO)";

/// Broadcasts per NCCL group: a model of many parameters issues its pieces in groups of this
/// many calls (NCCL launches a group's calls together; smaller groups bound its bookkeeping).
const BROADCASTS_PER_GROUP: usize = 256;

/// The data-parallel group a sharded [`AdamW`] splits its state over, and the split.
#[derive(Debug)]
pub(super) struct Zero {
    /// The data-parallel group, on the device's stream.
    group: Arc<ProcessGroup>,
    /// Which elements of which parameter each rank owns.
    partition: Partition,
    /// Stage 1, 2 or 3.
    stage: ZeroStage,
    /// Stages 2 and 3: the partition's pieces as the backward reduces the gradients to them.
    shards: Option<GradShards>,
}

impl Zero {
    /// The split of parameters of `numels` elements (traversal order) over `group`, pieces
    /// aligned to the fused kernel's [`CHUNK`] within their parameter (so the chunks of a rank's
    /// pieces are the replicated step's chunks, and so is the norm).
    ///
    /// At stage 2 the same pieces are the gradient shards ([`Partition::grad_shards`]).
    ///
    /// # Errors
    /// [`Error::Argument`] for a group on a side stream or on another GPU than `dev`, or for
    /// stage 0 (nothing sharded: build [`AdamW::new`]).
    pub(super) fn new(dev: &Device, group: Arc<ProcessGroup>, numels: &[usize], stage: ZeroStage) -> Result<Self> {
        if !stage.shards_optimizer() {
            return Err(Error::Argument {
                op: MODULE,
                message: "ZeRO stage 0 shards nothing: build a replicated optimizer (AdamW::new)".into(),
            });
        }
        if group.is_side_stream() {
            return Err(Error::Argument {
                op: MODULE,
                message: "the group runs its collectives on a side stream: pass the data-parallel group on the \
                          device's stream (DataParallel::group), which orders the parameter broadcasts after the \
                          update"
                    .into(),
            });
        }
        let (have, want) = (group.device().context().ordinal(), dev.context().ordinal());
        if have != want {
            return Err(Error::Argument {
                op: MODULE,
                message: format!("the group is on GPU {have}, the optimizer on GPU {want}: pass this GPU's group"),
            });
        }
        let partition = Partition::new(numels, group.size(), CHUNK)?;
        let shards = match stage.shards_gradients() {
            true => Some(partition.grad_shards()?),
            false => None,
        };
        Ok(Self { group, partition, stage, shards })
    }

    /// Ranks the state is split over.
    pub(super) fn world(&self) -> usize {
        self.partition.world()
    }

    /// Stage 1, 2 or 3.
    pub(super) fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The elements of parameter `param` this rank owns.
    pub(super) fn piece(&self, param: usize) -> Range<usize> {
        self.partition.piece(self.group.rank(), param)
    }

    /// The whole model's per-chunk partial norms from this rank's (`local`, its pieces' chunks
    /// in order): each rank's placed at its offset in rank order (the replicated step's chunk
    /// order: ranks own increasing element ranges), then broadcast from its owner, in one NCCL
    /// group on the device's stream. Every rank gets the same list, so every rank computes the
    /// same norm, clip coefficient and skip decision. The parameters with a gradient
    /// (`updated`) are the same on every rank (the data-parallel replicas of one model).
    ///
    /// # Errors
    /// [`Error::Internal`](te_runtime::Error) when `local` is not this rank's chunk count;
    /// allocation, copy and NCCL errors.
    pub(super) fn gather_partials(
        &self,
        dev: &Device,
        updated: &[bool],
        local: Option<&CudaSlice<f32>>,
    ) -> Result<CudaSlice<f32>> {
        let counts = self.partition.chunk_counts(updated, CHUNK);
        let rank = self.group.rank();
        let total: usize = counts.iter().sum();
        let mine = counts.get(rank).copied().unwrap_or(0);
        if total == 0 || local.map_or(0, CudaSlice::len) != mine {
            return Err(Error::internal(
                MODULE,
                format!(
                    "rank {rank} wrote {:?} partial norms, the partition gives it {mine} of {total}",
                    local.map(CudaSlice::len)
                ),
            ));
        }
        let stream = dev.stream();
        let mut all = stream.alloc_zeros::<f32>(total)?;
        let offset: usize = counts[..rank].iter().sum();
        if let Some(local) = local {
            let mut slot = all
                .try_slice_mut(offset..offset + mine)
                .ok_or_else(|| Error::internal(MODULE, "the rank's partial norms fall outside the gathered list"))?;
            stream.memcpy_dtod(local, &mut slot)?;
        }
        let group = &self.group;
        group.grouped(|| {
            let mut start = 0;
            for (root, &n) in counts.iter().enumerate() {
                group.broadcast_range(&mut all, start..start + n, root)?;
                start += n;
            }
            Ok(())
        })?;
        group.wait()?;
        Ok(all)
    }

    /// Makes every rank's `params` whole after a step that updated this rank's pieces of those
    /// `updated` marks: each piece broadcast in place from its owner (into the parameter's own
    /// storage, which the model's clones share), in NCCL groups on the device's stream, after
    /// the update kernel.
    ///
    /// # Errors
    /// NCCL errors.
    pub(super) fn broadcast_params(&self, params: &[Tensor], updated: &[bool]) -> Result<()> {
        let mut calls = Vec::new();
        for root in 0..self.world() {
            for piece in self.partition.pieces(root) {
                if let (Some(t), Some(true)) = (params.get(piece.param), updated.get(piece.param)) {
                    calls.push((t, piece.range.clone(), root));
                }
            }
        }
        let group = &self.group;
        for batch in calls.chunks(BROADCASTS_PER_GROUP) {
            group.grouped(|| {
                batch.iter().try_for_each(|(t, range, root)| group.broadcast_range_shared(t, range.clone(), *root))
            })?;
        }
        group.wait()
    }

    /// Parameter `param`'s whole state (`[master, exp_avg, exp_avg_sq]` of its `numel`
    /// elements, one after the other) on every rank: each rank's pieces copied into place and
    /// broadcast from their owners.
    fn gather_param(&self, opt: &AdamW, param: usize, numel: usize) -> Result<CudaSlice<f32>> {
        let stream = opt.dev.stream();
        let mut whole = stream.alloc_zeros::<f32>(3 * numel)?;
        let state = &opt.params[param];
        if !state.piece.is_empty() {
            for (k, part) in [&state.master, &state.exp_avg, &state.exp_avg_sq].into_iter().enumerate() {
                let at = k * numel + state.piece.start;
                let mut slot = whole
                    .try_slice_mut(at..at + part.len())
                    .ok_or_else(|| Error::internal(MODULE, format!("{}'s piece falls outside it", state.path)))?;
                stream.memcpy_dtod(part, &mut slot)?;
            }
        }
        let group = &self.group;
        group.grouped(|| {
            for root in 0..self.world() {
                let range = self.partition.piece(root, param);
                for k in 0..3 {
                    group.broadcast_range(&mut whole, k * numel + range.start..k * numel + range.end, root)?;
                }
            }
            Ok(())
        })?;
        Ok(whole)
    }
}

impl AdamW {
    /// The optimizer of [`AdamW::new`] held as `stage` says over the data-parallel `group`:
    /// [`ZeroStage::Replicated`] is [`AdamW::new`] (`group` unused),
    /// [`ZeroStage::OptimizerStates`] is [`AdamW::new_zero`], and [`ZeroStage::Gradients`]
    /// (ZeRO stage 2: DeepSpeed's `zero_optimization.stage = 2`; Megatron-LM's distributed
    /// optimizer, whose gradient buffer is reduce-scattered to the same owners) is
    /// [`AdamW::new_zero`]'s optimizer stepping on sharded gradients: the backward reduces each
    /// piece of each gradient to the rank that owns it ([`AdamW::grad_shards`], given to
    /// [`te_nn::parallel::DataParallel::set_grad_shards`]), which releases the gradients of
    /// the parameters this rank owns no piece of, and each step names the parameters the
    /// backward reduced ([`AdamW::step_reduced`]; the plain [`AdamW::step`] is refused, since
    /// the ranks hold different gradients). Its steps are [`AdamW::new_zero`]'s bit for bit on
    /// two ranks (each owner's piece is the averaged gradient the all-reduce gives, one sum of
    /// two values; with more ranks NCCL may sum in another order); its state file is the
    /// replicated optimizer's.
    ///
    /// # Errors
    /// As [`AdamW::new_zero`].
    pub fn new_zero_stage<M: Module + ?Sized>(
        dev: &Arc<Device>,
        model: &M,
        config: AdamWConfig,
        group: Arc<ProcessGroup>,
        stage: ZeroStage,
    ) -> Result<Self> {
        match stage {
            ZeroStage::Replicated => Self::build(dev, model, config, None, None),
            stage => Self::build(dev, model, config, Some((group, stage)), None),
        }
    }

    /// How the state is held: [`ZeroStage::Replicated`] unless built by [`AdamW::new_zero`] or
    /// [`AdamW::new_zero_stage`].
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero.as_ref().map_or(ZeroStage::Replicated, Zero::stage)
    }

    /// A ZeRO-2 or ZeRO-3 optimizer's gradient shards: each parameter's pieces (traversal
    /// order) with the rank that owns each, what
    /// [`te_nn::parallel::DataParallel::set_grad_shards`] reduces the gradients to (and, at
    /// stage 3, the pieces of the weights each rank keeps, [`te_nn::parallel::ParamShards`]);
    /// `None` at stages 0 and 1.
    pub fn grad_shards(&self) -> Option<&GradShards> {
        self.zero.as_ref().and_then(|z| z.shards.as_ref())
    }

    /// The step of a ZeRO-2 optimizer ([`AdamW::new_zero_stage`]): [`AdamW::step`] of the
    /// parameters `reduced` marks (the whole model's traversal order,
    /// [`te_nn::parallel::DataParallel::reduced`]: the same on every rank), each rank reading
    /// the gradients of its pieces only (the averaged pieces the backward reduced to it); a
    /// parameter it owns no piece of may have no gradient here (released). Also takes a
    /// replicated or ZeRO-1 optimizer, whose gradients are whole: the marked parameters are
    /// updated.
    ///
    /// # Errors
    /// As [`AdamW::step`]; [`Error::Config`] for marks of another parameter count, none
    /// set, or a marked parameter this rank holds state for without its gradient.
    pub fn step_reduced<M: Module + ?Sized>(&mut self, model: &mut M, reduced: &[bool]) -> Result<StepStats> {
        let pending = self.issue_reduced(model, reduced)?;
        self.finish(&pending)
    }

    /// [`AdamW::step_reduced`] queued on the device, as [`AdamW::issue`]; complete it with
    /// [`AdamW::finish`].
    ///
    /// # Errors
    /// As [`AdamW::step_reduced`].
    pub fn issue_reduced<M: Module + ?Sized>(&mut self, model: &mut M, reduced: &[bool]) -> Result<PendingStep> {
        self.issue_marked(model, Some(reduced), None)
    }

    /// Which parameters a step updates: those `reduced` marks, or those with a gradient. Each
    /// marked parameter this rank holds state for must have its gradient here.
    pub(super) fn updated(&self, grads: &[Option<Tensor>], reduced: Option<&[bool]>) -> Result<Vec<bool>> {
        let updated: Vec<bool> = match reduced {
            Some(marks) if marks.len() != self.params.len() => {
                return Err(self.mismatch(format!("{} parameters marked reduced", marks.len())))
            }
            Some(marks) => marks.to_vec(),
            None if self.zero.as_ref().is_some_and(|z| z.stage().shards_gradients()) => {
                return Err(Error::Config {
                    module: "AdamW",
                    message: "a ZeRO-2 optimizer's ranks hold different gradients (each its pieces'): step it with \
                              AdamW::step_reduced and the parameters DataParallel::reduced marks"
                        .into(),
                })
            }
            None => grads.iter().map(Option::is_some).collect(),
        };
        if !updated.contains(&true) {
            let what = match reduced {
                Some(_) => {
                    "no parameter was reduced (DataParallel::reduced); run a backward that reduces the \
                            gradients before step"
                }
                None => "no parameter has a gradient (grad or main_grad); run a backward before step",
            };
            return Err(Error::Config { module: "AdamW", message: what.into() });
        }
        let missing =
            self.params.iter().zip(grads).zip(&updated).find(|((s, g), &u)| u && g.is_none() && !s.piece.is_empty());
        if let Some(((s, _), _)) = missing {
            return Err(Error::Config {
                module: "AdamW",
                message: format!(
                    "{} is marked reduced but has no gradient on this rank, which holds its piece {:?}: keep the \
                     gradients of the parameters this rank owns a piece of",
                    s.path, s.piece
                ),
            });
        }
        Ok(updated)
    }

    /// [`AdamW::save_state`] of a sharded optimizer: every rank joins the gather of each
    /// parameter's pieces (one parameter at a time: the extra device memory is one parameter's
    /// state), rank 0 of the group writes the file.
    pub(super) fn save_state_zero(&self, zero: &Zero, path: &Path) -> Result<()> {
        let stream = self.dev.stream();
        let writer = zero.group.rank() == 0;
        let mut pinned = Vec::new();
        for (i, s) in self.params.iter().enumerate() {
            let numel = s.numel();
            if numel == 0 {
                continue;
            }
            let whole = zero.gather_param(self, i, numel)?;
            if writer {
                // SAFETY: the buffer is uninitialized until the copy issued next fills all of it;
                // it is read only after the stream has been synchronized below.
                let mut host = unsafe { stream.context().alloc_pinned::<f32>(whole.len()) }?;
                stream.memcpy_dtoh(&whole, &mut host)?;
                pinned.push((i, host));
            }
        }
        stream.synchronize()?;
        if !writer {
            return Ok(());
        }
        let mut slices: Vec<Option<&[f32]>> = vec![None; self.params.len()];
        for (i, host) in &pinned {
            slices[*i] = Some(host.as_slice()?);
        }
        let states: Vec<HostParamState<'_>> = self
            .params
            .iter()
            .zip(&slices)
            .map(|(s, whole)| {
                let n = s.numel();
                let whole = whole.unwrap_or(&[]);
                let part = |k: usize| whole.get(k * n..(k + 1) * n).unwrap_or(&[]);
                HostParamState { path: &s.path, shape: &s.shape, tensors: [part(0), part(1), part(2)], step: s.step }
            })
            .collect();
        write_state_file(path, self.step, &states)
    }
}
