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

use crate::modules::{Module, ParamKind, ParamMut};
use std::sync::Arc;
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Error, Result};

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
}

impl DataParallel {
    /// Data parallelism over `group` (every rank of it must call this: it creates the
    /// gradient communicator, [`ProcessGroup::with_side_stream`]).
    ///
    /// # Errors
    /// NCCL and driver errors.
    pub fn new(group: Arc<ProcessGroup>) -> Result<Self> {
        let grads = group.with_side_stream()?;
        Ok(Self { group, grads, pending: 0 })
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
            let mut value = p.tensor().cloned().ok_or_else(|| Error::Config {
                module: MODULE,
                message: format!(
                    "{path} is an FP8-only weight (fp8_model_init): data-parallel training needs high-precision weights"
                ),
            })?;
            // A clone shares the storage: the broadcast writes a copy, which then replaces it.
            group.broadcast(&mut value, 0)?;
            p.set(value)
        })
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
    /// # Errors
    /// [`Error::Config`] for a parameter that has a gradient but cannot hand it out writable
    /// ([`ParamMut::grad_mut`] not implemented); NCCL errors.
    pub fn reduce_grads<M: Module + ?Sized>(&mut self, part: &mut M) -> Result<()> {
        let grads = &self.grads;
        grads.grouped(|| {
            part.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
                let has_grad = p.main_grad().is_some() || p.grad().is_some();
                match p.grad_mut() {
                    Some(g) => grads.all_reduce(g, ReduceOp::Avg),
                    None if has_grad => Err(Error::Config {
                        module: MODULE,
                        message: format!(
                            "{path} has a gradient but does not hand it out writable (ParamMut::grad_mut): implement \
                             it to train the parameter data-parallel"
                        ),
                    }),
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
    /// Driver errors.
    pub fn finish(&mut self) -> Result<usize> {
        self.grads.wait()?;
        Ok(std::mem::take(&mut self.pending))
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
