//! The process groups of a run that combines tensor and data parallelism, in Megatron-LM's rank
//! layout (`megatron/core/parallel_state.py`): the `tp` ranks of a tensor-parallel group are
//! consecutive (`r / tp` names the group; on one node they share its NVLink), and the ranks with
//! the same tensor-parallel rank (`r % tp`) form a data-parallel group. The FP8 amaxes are
//! reduced over all ranks (TE's default `fp8_group`, the world), so every rank casts with the
//! same scales.

use super::data_parallel::{mean, DataParallel};
use crate::modules::TpConfig;
use std::sync::Arc;
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

const MODULE: &str = "Parallel";

/// The tensor-parallel group of rank `r` with groups of `tp` ranks: consecutive ranks.
fn tensor_group(r: usize, tp: usize) -> usize {
    r / tp
}

/// The data-parallel group of rank `r`: the ranks with its tensor-parallel rank.
fn data_group(r: usize, tp: usize) -> usize {
    r % tp
}

/// How one rank of a run takes part: data parallel (gradient averaging over its
/// data-parallel group), tensor parallel (the layers split over its tensor-parallel group), or
/// both; [`Parallel::default`] is a single GPU.
#[derive(Debug, Default)]
pub struct Parallel {
    world: Option<Arc<ProcessGroup>>,
    data: Option<DataParallel>,
    tensor: Option<TpConfig>,
}

impl Parallel {
    /// The groups of `world`'s ranks with tensor-parallel groups of `tensor_parallel` ranks
    /// (with `sequence_parallel`) and data parallelism over the `world / tensor_parallel`
    /// groups. A size-1 part is left out (no group, no collectives). Every rank of `world`
    /// must call it with the same arguments.
    ///
    /// # Errors
    /// [`Error::Config`] for a tensor-parallel size of 0 or one that does not divide the world
    /// size, or sequence parallelism without tensor parallelism; NCCL errors of the splits.
    pub fn new(world: Arc<ProcessGroup>, tensor_parallel: usize, sequence_parallel: bool) -> Result<Self> {
        let (n, tp) = (world.size(), tensor_parallel);
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        if tp == 0 || n % tp != 0 {
            return config(format!(
                "a tensor-parallel size of {tp} does not divide the {n} ranks: choose a divisor of the world size"
            ));
        }
        if sequence_parallel && tp == 1 {
            return config(
                "sequence parallelism splits the sequence over a tensor-parallel group: give a \
                           tensor-parallel size above 1"
                    .into(),
            );
        }
        let split = |color: fn(usize, usize) -> usize| -> Result<Arc<ProcessGroup>> {
            let group = world.split(|r| Some(color(r, tp)))?;
            group.map(Arc::new).ok_or_else(|| Error::internal(MODULE, "a rank got no group of its color"))
        };
        let tensor = match tp {
            1 => None,
            _ if tp == n => Some(TpConfig::new(world.clone()).with_sequence_parallel(sequence_parallel)),
            _ => Some(TpConfig::new(split(tensor_group)?).with_sequence_parallel(sequence_parallel)),
        };
        let data = match n / tp {
            1 => None,
            _ if tp == 1 => Some(DataParallel::new(world.clone())?),
            _ => Some(DataParallel::new(split(data_group)?)?),
        };
        Ok(Self { world: Some(world), data, tensor })
    }

    /// Data parallelism over all of `world`'s ranks.
    ///
    /// # Errors
    /// As [`Parallel::new`].
    pub fn data_parallel(world: Arc<ProcessGroup>) -> Result<Self> {
        Self::new(world, 1, false)
    }

    /// All ranks of the run (`None` on a single GPU): the FP8 amax reduction group
    /// (`Fp8Autocast::fp8_group`).
    pub fn world(&self) -> Option<&Arc<ProcessGroup>> {
        self.world.as_ref()
    }

    /// The gradient averaging of this rank's data-parallel group (`None` without data
    /// parallelism).
    pub fn data(&mut self) -> Option<&mut DataParallel> {
        self.data.as_mut()
    }

    /// The tensor-parallel group the model's layers split over (`None` without tensor
    /// parallelism).
    pub fn tensor(&self) -> Option<&TpConfig> {
        self.tensor.as_ref()
    }

    /// This rank's `(rank, size)` in the data-parallel dimension: which shard of the data it
    /// reads; `(0, 1)` without data parallelism.
    pub fn data_rank(&self) -> (usize, usize) {
        self.data.as_ref().map_or((0, 1), |d| (d.rank(), d.size()))
    }

    /// This rank's `(rank, size)` in the tensor-parallel dimension; `(0, 1)` without it.
    pub fn tensor_rank(&self) -> (usize, usize) {
        self.tensor.as_ref().map_or((0, 1), |t| (t.group.rank(), t.size()))
    }

    /// Ranks in the run (1 on a single GPU).
    pub fn world_size(&self) -> usize {
        self.world.as_ref().map_or(1, |w| w.size())
    }

    /// This rank in the run (0 on a single GPU).
    pub fn rank(&self) -> usize {
        self.world.as_ref().map_or(0, |w| w.rank())
    }

    /// The mean of every rank's host `value` (`value` itself on a single GPU).
    ///
    /// # Errors
    /// NCCL, allocation and copy errors.
    pub fn mean(&self, value: f32) -> Result<f32> {
        match &self.world {
            Some(world) => mean(world, value),
            None => Ok(value),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 8 ranks at TP=2: tensor-parallel pairs of consecutive ranks, data-parallel groups of the
    /// ranks with the same place in their pair (Megatron-LM's layout).
    #[test]
    fn groups_follow_megatrons_layout() {
        let groups = |color: fn(usize, usize) -> usize| {
            let mut g: Vec<Vec<usize>> = Vec::new();
            for r in 0..8 {
                let c = color(r, 2);
                if g.len() <= c {
                    g.resize(c + 1, Vec::new());
                }
                g[c].push(r);
            }
            g
        };
        assert_eq!(groups(tensor_group), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(groups(data_group), [[0, 2, 4, 6], [1, 3, 5, 7]]);
    }
}
