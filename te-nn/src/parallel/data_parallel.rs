//! Data parallelism, as PyTorch's `DistributedDataParallel` and Megatron-LM's DDP do it: every
//! rank holds the whole model and runs its own shard of the batch; after the backward, every
//! gradient is averaged over the ranks, so every rank takes the same optimizer step and the
//! weights stay equal.
//!
//! The averaging overlaps the backward: a model calls back as each part's gradients become
//! final (`Gpt::backward_with`; a transformer layer is a bucket of about `12·h²` elements), and
//! [`DataParallel::reduce_grads`] issues that bucket's all-reduces as one NCCL group on a side
//! stream, after the kernels that wrote them, while the device's stream goes on with the next
//! layer's backward. [`DataParallel::finish`] makes the device's stream wait for them before the
//! optimizer reads the gradients. The gradients are reduced in place, in the dtype the optimizer
//! reads (the f32 `main_grad` with `fuse_wgrad_accumulation`, else the parameter's dtype, as
//! PyTorch DDP reduces bf16 gradients of bf16 parameters), with `ncclAvg`.
//!
//! With gradient accumulation, reduce only after the last micro-batch's backward (PyTorch's
//! `no_sync()` for the others): the gradients are sums over the micro-batches until then.
//!
//! ZeRO-2 ([`DataParallel::set_grad_shards`]; DeepSpeed's stage 2, Megatron-LM's distributed
//! optimizer's reduce-scatter of its gradient buffer): each gradient is not all-reduced but
//! each of its pieces reduced (`ncclReduce`, `ncclAvg`) to the rank whose optimizer owns it
//! ([`GradShards`]), a bucket's calls in one NCCL group on the side stream; a rank then releases
//! the gradients of the parameters it owns no piece of. The release is deferred: when bucket
//! `k + 1` is handed over, the buckets whose reductions are done by then (an event query on the
//! host, no wait) and in any case bucket `k − 1` (whose reductions ran beside the backward of
//! buckets `k` and `k + 1`) are freed: the device's stream waits for their reductions
//! ([`ProcessGroup::wait_mark`]) and their gradients are dropped, so the memory pool frees them
//! in the device stream's order after the NCCL kernels that read them;
//! [`DataParallel::finish`] does the same for the rest. Which parameters
//! were reduced ([`DataParallel::reduced`]) is the same on every rank: what the optimizer
//! updates.

use super::GradShards;
use crate::modules::{Module, Param, ParamKind, ParamMut};
use cudarc::driver::DevicePtr;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use te_runtime::dist::{ProcessGroup, ReduceOp, SideMark};
use te_runtime::{Error, Result, Tensor};

const MODULE: &str = "DataParallel";

/// The gradient averaging and parameter broadcast of a data-parallel group (see the module
/// docs). Made by every rank of the group, with the same model.
#[derive(Debug)]
pub struct DataParallel {
    /// The data-parallel group, on the device's stream: the parameter broadcast, host scalars,
    /// and the amax reduction group of the FP8 scaling ([`DataParallel::group`]).
    group: Arc<ProcessGroup>,
    /// The same ranks on a side stream, for the gradient buckets.
    grads: ProcessGroup,
    /// Buckets issued since the last [`DataParallel::finish`].
    pending: usize,
    /// ZeRO-2: who owns which piece of each gradient, and this step's bookkeeping.
    sharded: Option<Sharded>,
}

/// A ZeRO-2 data-parallel step's state ([`DataParallel::set_grad_shards`]).
#[derive(Debug)]
struct Sharded {
    shards: GradShards,
    /// Each parameter's traversal index by the device address of its storage
    /// ([`DataParallel::begin_step`]).
    index: HashMap<u64, usize>,
    /// [`DataParallel::begin_step_reversed`]: the traversal index past the next part's last
    /// parameter (the parts come in the reverse of the traversal order); `None`: parameters
    /// are found by their storage.
    cursor: Option<usize>,
    /// Which parameters (traversal order) were reduced since [`DataParallel::begin_step`].
    reduced: Vec<bool>,
    /// Gradient bytes released since [`DataParallel::begin_step`].
    released_bytes: u64,
    /// The released gradients of the buckets whose reductions the device's stream has not
    /// waited for yet, oldest first, each with the point of the side stream after its
    /// reductions: dropped once the device's stream waits for that point.
    releasing: VecDeque<(SideMark, Vec<Tensor>)>,
}

impl DataParallel {
    /// Data parallelism over `group` (every rank of it must call this: it creates the
    /// gradient communicator, [`ProcessGroup::with_side_stream`]).
    ///
    /// # Errors
    /// NCCL and driver errors.
    pub fn new(group: Arc<ProcessGroup>) -> Result<Self> {
        let grads = group.with_side_stream()?;
        Ok(Self { group, grads, pending: 0, sharded: None })
    }

    /// The data-parallel group (on the device's stream): the group to pass as the FP8 amax
    /// reduction group (`Fp8Autocast::fp8_group`), so every rank casts with the same scales.
    pub fn group(&self) -> &Arc<ProcessGroup> {
        &self.group
    }

    /// This rank, `0..size()`.
    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Replaces every parameter of `model` by rank 0's (`ncclBroadcast`; PyTorch DDP does this
    /// when it wraps a model): ranks that built the model from different seeds, or loaded
    /// different files, start equal. Each parameter is received into a new tensor and set
    /// ([`ParamMut::set`]: cached FP8 weights are cast anew, contexts made before are stale);
    /// build the optimizer afterwards (it copies the parameters into its master weights).
    /// Every rank must call it with the same model.
    ///
    /// # Errors
    /// [`Error::Config`] for an FP8-only weight (`fp8_model_init`: nothing to train);
    /// NCCL, allocation and driver errors.
    pub fn broadcast_parameters<M: Module + ?Sized>(&self, model: &mut M) -> Result<()> {
        let group = &self.group;
        model.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
            let mut value = p.tensor().cloned().ok_or_else(|| fp8_only(path))?;
            // A clone shares the storage: the broadcast writes a copy, which then replaces it.
            group.broadcast(&mut value, 0)?;
            p.set(value)
        })
    }

    /// Shards the gradients as `shards` says from the next step on (ZeRO-2, see the module
    /// docs), or averages them whole again (`None`). `shards` describes the whole model's
    /// parameters in traversal order, the split of the optimizer's state
    /// (`te_train::optim::AdamW::grad_shards`); every rank passes the same. Each step then
    /// starts with [`DataParallel::begin_step`].
    ///
    /// # Errors
    /// [`Error::Config`] when `shards` is over another number of ranks than the group.
    pub fn set_grad_shards(&mut self, shards: Option<GradShards>) -> Result<()> {
        self.release_pending()?;
        self.sharded = match shards {
            Some(s) if s.world() != self.size() => {
                return Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "gradient shards over {} ranks for a data-parallel group of {}: split over this group",
                        s.world(),
                        self.size()
                    ),
                })
            }
            Some(shards) => Some(Sharded {
                cursor: None,
                reduced: vec![false; shards.len()],
                shards,
                index: HashMap::new(),
                released_bytes: 0,
                releasing: VecDeque::new(),
            }),
            None => None,
        };
        Ok(())
    }

    /// The gradient shards of a ZeRO-2 run ([`DataParallel::set_grad_shards`]); `None` when
    /// gradients are averaged whole.
    pub fn grad_shards(&self) -> Option<&GradShards> {
        self.sharded.as_ref().map(|s| &s.shards)
    }

    /// Before the backward of a step whose gradients are sharded (the last micro-batch's, the
    /// one that calls [`DataParallel::reduce_grads`]): indexes `model`'s parameters (the whole
    /// model, by the storage of each, so a bucket's parameters are found in the model's
    /// traversal order; call it again after parameters were replaced, e.g. by a checkpoint
    /// load) and clears the step's marks ([`DataParallel::reduced`]). Nothing to do when the
    /// gradients are averaged whole.
    ///
    /// # Errors
    /// [`Error::Config`] for a model of another parameter count than the shards describe, or
    /// with an FP8-only weight (`fp8_model_init`: nothing to train).
    pub fn begin_step<M: Module + ?Sized>(&mut self, model: &M) -> Result<()> {
        // A step that stopped before finish (an error) may have left gradients in flight.
        self.release_pending()?;
        let Some(sharded) = &mut self.sharded else { return Ok(()) };
        let stream = self.group.device().stream().clone();
        let mut index = HashMap::with_capacity(sharded.shards.len());
        model.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            let key = storage(p, &stream).ok_or_else(|| fp8_only(path))?;
            let i = index.len();
            match index.insert(key, i) {
                Some(_) => Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "{path} shares its storage with another parameter: sharded gradients find each parameter by \
                         its storage; visit a tied parameter once (#[module(skip)] on the other holder)"
                    ),
                }),
                None => Ok(()),
            }
        })?;
        if index.len() != sharded.shards.len() {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "the model has {} parameters, the gradient shards describe {}: shard the model this run trains",
                    index.len(),
                    sharded.shards.len()
                ),
            });
        }
        sharded.index = index;
        sharded.cursor = None;
        sharded.reduced.iter_mut().for_each(|r| *r = false);
        sharded.released_bytes = 0;
        Ok(())
    }

    /// [`DataParallel::begin_step`] for a model whose parameters cannot be told apart by their
    /// storage (ZeRO-3: a layer's weights are transient buffers shared from layer to layer,
    /// `ParamShards`): the backward must hand its parts to [`DataParallel::reduce_grads`] in
    /// the reverse of the traversal order, each part a contiguous run of it, together covering
    /// all `params` parameters (a decoder's head, final norm, layers from the last, embedding).
    /// A part's parameters are then the traversal indices just below the previous part's.
    ///
    /// # Errors
    /// [`Error::Config`] when `params` is not the number of parameters the shards describe.
    pub fn begin_step_reversed(&mut self, params: usize) -> Result<()> {
        self.release_pending()?;
        let Some(sharded) = &mut self.sharded else { return Ok(()) };
        if params != sharded.shards.len() {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "the model has {params} parameters, the gradient shards describe {}: shard the model this run trains",
                    sharded.shards.len()
                ),
            });
        }
        sharded.index.clear();
        sharded.cursor = Some(params);
        sharded.reduced.iter_mut().for_each(|r| *r = false);
        sharded.released_bytes = 0;
        Ok(())
    }

    /// ZeRO-2: which parameters (the model's traversal order) had their gradients reduced since
    /// [`DataParallel::begin_step`], the same on every rank: the parameters the step updates.
    /// `None` when gradients are averaged whole.
    pub fn reduced(&self) -> Option<&[bool]> {
        self.sharded.as_ref().map(|s| s.reduced.as_slice())
    }

    /// ZeRO-2: bytes of the gradients this rank released since [`DataParallel::begin_step`]
    /// (those of the parameters it owns no piece of); 0 when gradients are averaged whole.
    pub fn released_bytes(&self) -> u64 {
        self.sharded.as_ref().map_or(0, |s| s.released_bytes)
    }

    /// Starts averaging every gradient of `part` over the group (`ncclAvg`, in place), as one
    /// NCCL group on the side stream, after the work issued so far on the device's stream (the
    /// backward that produced them). Call it once a part's gradients are final for the step (its
    /// last backward of the step's last micro-batch), with the same parts in the same order on
    /// every rank. The gradients must not be read or written until [`DataParallel::finish`].
    /// A parameter without a gradient is skipped: it must have none on every rank (TE's
    /// modules give each parameter a gradient in every backward, zeros for an expert that got
    /// no tokens).
    ///
    /// With gradient shards ([`DataParallel::set_grad_shards`], after
    /// [`DataParallel::begin_step`]), each piece of each gradient is reduced to its owner
    /// instead (the averaged piece lands on the owner; the rest of a rank's gradient is stale),
    /// the gradients of parameters this rank owns no piece of are taken out of the model
    /// ([`ParamMut::take_grad`]) and freed once their reductions are done (seen when a later
    /// bucket is handed over; waited for two buckets later at the latest, or at
    /// [`DataParallel::finish`]), and the parameters are marked reduced
    /// ([`DataParallel::reduced`]). The part's parameters are found by their storage, or after
    /// [`DataParallel::begin_step_reversed`] (ZeRO-3) by their position: the run of traversal
    /// indices just below the previous part's.
    ///
    /// # Errors
    /// [`Error::Config`] for a parameter that has a gradient but cannot hand it out writable
    /// ([`ParamMut::grad_mut`] not implemented), and with shards for a parameter
    /// [`DataParallel::begin_step`] did not index (a part of another model, or parameters
    /// replaced since) or a gradient of another size than its shards; NCCL errors.
    pub fn reduce_grads<M: Module + ?Sized>(&mut self, part: &mut M) -> Result<()> {
        if self.sharded.is_some() {
            return self.reduce_grads_sharded(part);
        }
        let grads = &self.grads;
        grads.grouped(|| {
            part.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
                let has_grad = p.main_grad().is_some() || p.grad().is_some();
                match p.grad_mut() {
                    Some(g) => grads.all_reduce(g, ReduceOp::Avg),
                    None if has_grad => Err(not_writable(path)),
                    None => Ok(()),
                }
            })
        })?;
        self.pending += 1;
        Ok(())
    }

    /// Makes the device's stream wait for every reduction issued since the last call: the
    /// optimizer step issued afterwards reads the averaged gradients. Returns the number of
    /// buckets it waited for.
    ///
    /// # Errors
    /// Driver errors; [`Error::Config`] after [`DataParallel::begin_step_reversed`] when the
    /// parts handed over did not cover every parameter.
    pub fn finish(&mut self) -> Result<usize> {
        self.grads.wait()?;
        // The device's stream follows every reduction now: the last bucket's released
        // gradients are freed after them.
        if let Some(sharded) = &mut self.sharded {
            sharded.releasing.clear();
            if let Some(left) = sharded.cursor.take().filter(|&c| c > 0) {
                return Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "the backward handed over parts down to parameter {left} of {}: a backward after begin_step_reversed \
                         must hand over every part, from the last parameter to the first",
                        sharded.shards.len()
                    ),
                });
            }
        }
        Ok(std::mem::take(&mut self.pending))
    }

    /// Drops gradients released by a step that did not reach [`DataParallel::finish`], after
    /// the device's stream waited for every reduction (which may still read them).
    fn release_pending(&mut self) -> Result<()> {
        if let Some(sharded) = self.sharded.as_mut().filter(|s| !s.releasing.is_empty()) {
            self.grads.wait()?;
            sharded.releasing.clear();
        }
        Ok(())
    }

    /// [`DataParallel::reduce_grads`] with gradient shards: the bucket's [`GradShards::calls`]
    /// in one NCCL group on the side stream, then its [`GradShards::released`] gradients taken
    /// out of the model; the previous bucket's are dropped after the device's stream waits for
    /// its reductions.
    fn reduce_grads_sharded<M: Module + ?Sized>(&mut self, part: &mut M) -> Result<()> {
        let Some(sharded) = &mut self.sharded else { return Ok(()) };
        let (rank, stream) = (self.group.rank(), self.group.device().stream().clone());
        // The part's parameters' traversal indices, in its order: by their storage, or (after
        // begin_step_reversed) the run just below the previous part's.
        let mut order: Vec<usize> = Vec::new();
        match sharded.cursor {
            Some(end) => {
                let mut count = 0usize;
                part.visit("", &mut |_: &str, _: ParamKind, _: &dyn Param| -> Result<()> {
                    count += 1;
                    Ok(())
                })?;
                let start = end.checked_sub(count).ok_or_else(|| Error::Config {
                    module: MODULE,
                    message: format!(
                        "a part of {count} parameters handed over with {end} left: after begin_step_reversed the \
                         parts must come in the reverse of the traversal order, once each"
                    ),
                })?;
                order.extend(start..end);
                sharded.cursor = Some(start);
            }
            None => part.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
                let key = storage(p, &stream).ok_or_else(|| fp8_only(path))?;
                let i = *sharded.index.get(&key).ok_or_else(|| Error::Config {
                    module: MODULE,
                    message: format!(
                        "{path} is not a parameter DataParallel::begin_step indexed: call it with the whole model \
                         before each sharded backward (and after replacing parameters)"
                    ),
                })?;
                order.push(i);
                Ok(())
            })?,
        }
        // The bucket's parameters (traversal indices) with a gradient, and the gradients (clones
        // share the storage, which the reductions write in place).
        let mut bucket: Vec<(usize, Tensor)> = Vec::new();
        let mut k = 0usize;
        part.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
            let i = order.get(k).copied().ok_or_else(|| Error::internal(MODULE, "a part changed between visits"))?;
            k += 1;
            let has_grad = p.main_grad().is_some() || p.grad().is_some();
            match p.grad_mut() {
                Some(g) if g.numel() != sharded.shards.numel(i) => Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "{path}'s gradient holds {} elements, its shards {}: shard the model this run trains",
                        g.numel(),
                        sharded.shards.numel(i)
                    ),
                }),
                Some(g) => {
                    bucket.push((i, g.clone()));
                    Ok(())
                }
                None if has_grad => Err(not_writable(path)),
                None => Ok(()),
            }
        })?;
        let params: Vec<usize> = bucket.iter().map(|(i, _)| *i).collect();
        let calls = sharded.shards.calls(&params);
        let grads = &self.grads;
        grads.grouped(|| {
            calls.iter().try_for_each(|c| {
                let g = bucket.iter().find(|(i, _)| *i == c.param).map(|(_, g)| g);
                let g = g.ok_or_else(|| Error::internal(MODULE, "a reduction of a parameter not in the bucket"))?;
                grads.reduce_range_shared(g, c.range.clone(), c.root, ReduceOp::Avg)
            })
        })?;
        drop(bucket);
        for &i in &params {
            sharded.reduced[i] = true;
        }
        // The gradients of parameters this rank owns nothing of leave the model now; their
        // memory is freed once the device's stream has waited for these reductions.
        let release = sharded.shards.released(rank, &params);
        let mut released = Vec::with_capacity(release.len());
        if !release.is_empty() {
            let mut k = 0usize;
            part.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
                let releases = order.get(k).is_some_and(|i| release.contains(i));
                k += 1;
                if releases {
                    if let Some(g) = p.take_grad() {
                        sharded.released_bytes += g.num_bytes() as u64;
                        released.push(g);
                    }
                }
                Ok(())
            })?;
        }
        sharded.releasing.push_back((grads.mark()?, released));
        // Deferred: the earlier buckets' reductions run beside this bucket's backward. Those
        // done already are freed now (the device's stream waits for nothing); the bucket before
        // the previous one is waited for in any case, which bounds the memory held.
        let reached: Vec<bool> = sharded.releasing.iter().map(|(m, _)| m.is_reached()).collect();
        for _ in 0..releasable(&reached, PENDING_BUCKETS) {
            if let Some((mark, gradients)) = sharded.releasing.pop_front() {
                grads.wait_mark(&mark)?;
                drop(gradients);
            }
        }
        self.pending += 1;
        Ok(())
    }

    /// The mean of each rank's `value` (a host scalar, e.g. its shard's loss) over the group:
    /// an all-reduce of one f32 on the device's stream and a copy back (waits for the stream).
    ///
    /// # Errors
    /// NCCL, allocation and copy errors.
    pub fn mean(&self, value: f32) -> Result<f32> {
        mean(&self.group, value)
    }
}

/// The mean of each rank's host `value` over `group` (one f32 all-reduced on the device's
/// stream, copied back).
pub(super) fn mean(group: &ProcessGroup, value: f32) -> Result<f32> {
    let stream = group.device().stream();
    let mut buf = stream.clone_htod(&[value])?;
    group.all_reduce(&mut buf, ReduceOp::Avg)?;
    let host = stream.clone_dtoh(&buf)?;
    host.first().copied().ok_or_else(|| Error::internal(MODULE, "an all-reduce of one value returned none"))
}

/// How many buckets' released gradients may wait for their reductions at once (the one just
/// handed over and the one before it).
const PENDING_BUCKETS: usize = 2;

/// How many of the oldest pending buckets (`reached[i]`: bucket `i`'s reductions are done,
/// oldest first) to free: the leading ones already done, and as many more as keep at most
/// `keep` pending.
fn releasable(reached: &[bool], keep: usize) -> usize {
    let done = reached.iter().take_while(|&&r| r).count();
    done.max(reached.len().saturating_sub(keep))
}

/// The device address of `p`'s storage: what identifies a parameter across traversals of the
/// model and of its parts; `None` for an FP8-only weight.
fn storage(p: &dyn Param, stream: &cudarc::driver::CudaStream) -> Option<u64> {
    p.tensor().map(|t| t.data().device_ptr(stream).0)
}

/// The error for an FP8-only weight at `path`.
fn fp8_only(path: &str) -> Error {
    Error::Config {
        module: MODULE,
        message: format!(
            "{path} is an FP8-only weight (fp8_model_init): data-parallel training needs high-precision weights"
        ),
    }
}

/// The error for a gradient at `path` that is not handed out writable.
fn not_writable(path: &str) -> Error {
    Error::Config {
        module: MODULE,
        message: format!(
            "{path} has a gradient but does not hand it out writable (ParamMut::grad_mut): implement it to train the \
             parameter data-parallel"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The buckets done are freed at once; past two pending, the oldest are freed anyway.
    #[test]
    fn released_buckets_are_freed_when_done_or_two_behind() {
        assert_eq!(releasable(&[], 2), 0);
        assert_eq!(releasable(&[false], 2), 0, "the bucket just handed over waits");
        assert_eq!(releasable(&[true], 2), 1, "unless its reductions are done already");
        assert_eq!(releasable(&[false, false], 2), 0, "its predecessor may still be reducing");
        assert_eq!(releasable(&[true, false], 2), 1);
        assert_eq!(releasable(&[false, true], 2), 0, "in order: the oldest first");
        assert_eq!(releasable(&[false, false, false], 2), 1, "two buckets behind: waited for");
        assert_eq!(releasable(&[true, true, false], 2), 2);
        assert_eq!(releasable(&[true, true, true], 2), 3);
        assert_eq!(releasable(&[false, false, false, false], 2), 2);
    }
}
