//! The process groups of a run that combines tensor and data parallelism, in Megatron-LM's rank
//! layout (`megatron/core/parallel_state.py`): the `tp` ranks of a tensor-parallel group are
//! consecutive (`r / tp` names the group; on one node they share its NVLink), and the ranks with
//! the same tensor-parallel rank (`r % tp`) form a data-parallel group. The FP8 amaxes are
//! reduced over all ranks (TE's default `fp8_group`, the world), so every rank casts with the
//! same scales.

use super::data_parallel::{mean, DataParallel};
use super::{DeviceMesh, MeshAxis, MeshShape, TpConfig};
use std::sync::Arc;
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

const MODULE: &str = "Parallel";

/// How one rank of a run takes part: data parallel (gradient averaging over its
/// data-parallel group), tensor parallel (the layers split over its tensor-parallel group), or
/// both, on a [`DeviceMesh`] of those two axes; [`Parallel::default`] is a single GPU.
#[derive(Debug, Default)]
pub struct Parallel {
    mesh: DeviceMesh,
    data: Option<DataParallel>,
    tensor: Option<TpConfig>,
}

impl Parallel {
    /// The groups of `world`'s ranks with tensor-parallel groups of `tensor_parallel` ranks
    /// (with `sequence_parallel`) and data parallelism over the `world / tensor_parallel`
    /// groups ([`MeshShape::tensor_data`]). A size-1 part is left out (no group, no
    /// collectives). Every rank of `world` must call it with the same arguments.
    ///
    /// # Errors
    /// [`Error::Config`] for a tensor-parallel size of 0 or one that does not divide the world
    /// size, or sequence parallelism without tensor parallelism; NCCL errors of the splits.
    pub fn new(world: Arc<ProcessGroup>, tensor_parallel: usize, sequence_parallel: bool) -> Result<Self> {
        let shape = MeshShape::tensor_data(world.size(), tensor_parallel)?;
        if sequence_parallel && tensor_parallel == 1 {
            return Err(Error::Config {
                module: MODULE,
                message: "sequence parallelism splits the sequence over a tensor-parallel group: give a \
                          tensor-parallel size above 1"
                    .into(),
            });
        }
        let mesh = DeviceMesh::new(world, shape)?;
        let tensor =
            mesh.group(MeshAxis::Tensor).map(|g| TpConfig::new(g.clone()).with_sequence_parallel(sequence_parallel));
        let data = mesh.group(MeshAxis::Data).map(|g| DataParallel::new(g.clone())).transpose()?;
        Ok(Self { mesh, data, tensor })
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
        self.mesh.world()
    }

    /// The run's ranks as a mesh of named axes (tensor × data) and this rank's group along each.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
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
        self.tensor.as_ref().map_or((0, 1), |t| (t.rank(), t.size()))
    }

    /// Ranks in the run (1 on a single GPU).
    pub fn world_size(&self) -> usize {
        self.mesh.world_size()
    }

    /// This rank in the run (0 on a single GPU).
    pub fn rank(&self) -> usize {
        self.mesh.rank()
    }

    /// The mean of every rank's host `value` (`value` itself on a single GPU).
    ///
    /// # Errors
    /// NCCL, allocation and copy errors.
    pub fn mean(&self, value: f32) -> Result<f32> {
        match self.mesh.world() {
            Some(world) => mean(world, value),
            None => Ok(value),
        }
    }
}
