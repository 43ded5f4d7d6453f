//! The process groups of a run that combines tensor, context and data parallelism, in
//! Megatron-LM's rank layout (`megatron/core/parallel_state.py`, `tp-cp-dp`): the `tp` ranks of
//! a tensor-parallel group are consecutive (`r / tp` names the group; on one node they share
//! its NVLink), the context-parallel ranks come next (`(r / tp) % cp`), and the ranks with the
//! same tensor- and context-parallel coordinates form a data-parallel group.
//!
//! **Gradient averaging.** Every rank holding a replica of a parameter averages its gradient
//! with the others: with context parallelism over context × data (Megatron's "data-parallel
//! group with context parallelism", `get_data_parallel_group(with_context_parallel=True)`),
//! since the CP ranks of one data rank hold the same parameters and each computed the gradient
//! of its own tokens. The data loader's index is the data coordinate alone: the CP ranks of
//! one data rank read the same sequences ([`Parallel::data_rank`]). The FP8 amaxes are reduced
//! over all ranks (TE's default `fp8_group`, the world), so every rank casts with the same
//! scales.

use super::data_parallel::{mean, DataParallel};
use super::{ContextParallel, CpCommType, DeviceMesh, MeshAxis, MeshShape, TpConfig};
use std::sync::Arc;
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

const MODULE: &str = "Parallel";

/// How one rank of a run takes part: data parallel (gradient averaging over the ranks that
/// hold a replica of the parameters), tensor parallel (the layers split over its
/// tensor-parallel group), context parallel (every sequence split over its context-parallel
/// group, [`ContextParallel`]), or a combination, on a [`DeviceMesh`] of those axes;
/// [`Parallel::default`] is a single GPU.
#[derive(Debug, Default)]
pub struct Parallel {
    mesh: DeviceMesh,
    /// The gradient averaging over context × data (the replicas of the parameters).
    data: Option<DataParallel>,
    tensor: Option<TpConfig>,
    context: Option<ContextParallel>,
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
        Self::with_context(world, tensor_parallel, 1, sequence_parallel)
    }

    /// The groups of `world`'s ranks as tensor × context × data ([`MeshShape::tensor_context_data`],
    /// Megatron-LM's `tp-cp-dp`): tensor-parallel groups of `tensor_parallel` ranks (with
    /// `sequence_parallel`), context-parallel groups of `context_parallel` ranks (each
    /// sequence split over them, [`Parallel::context`]; the ring exchange, its side-stream group
    /// made at the first forward unless [`Parallel::with_cp_comm_type`] made it or picked
    /// all-gather), data parallelism over the rest, and
    /// the gradients averaged over context × data ([`Parallel::data`]). A size-1 part is left
    /// out (no group, no collectives). Every rank of `world` must call it with the same
    /// arguments.
    ///
    /// # Errors
    /// [`Error::Config`] for a size of 0, sizes whose product does not divide the world size,
    /// sequence parallelism without tensor parallelism, or tensor × context parallelism (not
    /// built: the attention's context-parallel hook runs on whole heads); NCCL errors of the
    /// splits.
    pub fn with_context(
        world: Arc<ProcessGroup>,
        tensor_parallel: usize,
        context_parallel: usize,
        sequence_parallel: bool,
    ) -> Result<Self> {
        let shape = MeshShape::tensor_context_data(world.size(), tensor_parallel, context_parallel)?;
        if sequence_parallel && tensor_parallel == 1 {
            return Err(Error::Config {
                module: MODULE,
                message: "sequence parallelism splits the sequence over a tensor-parallel group: give a \
                          tensor-parallel size above 1"
                    .into(),
            });
        }
        if tensor_parallel > 1 && context_parallel > 1 {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "tensor parallelism ({tensor_parallel}) with context parallelism ({context_parallel}) is not built \
                     yet: use one of them"
                ),
            });
        }
        let mesh = DeviceMesh::new(world, shape)?;
        let tensor =
            mesh.group(MeshAxis::Tensor).map(|g| TpConfig::new(g.clone()).with_sequence_parallel(sequence_parallel));
        let context = mesh.group(MeshAxis::Context).map(|g| ContextParallel::new(g.clone())).transpose()?;
        let data = mesh.group_of(&[MeshAxis::Context, MeshAxis::Data])?.map(DataParallel::new).transpose()?;
        Ok(Self { mesh, data, tensor, context })
    }

    /// Turns the tensor-parallel communication overlap on or off (`TpConfig::tp_comm_overlap`,
    /// TE's `tp_comm_overlap`; see `te_nn::parallel`'s overlap docs): with sequence parallelism,
    /// the input all-gathers and output reduce-scatters run on a side stream beside the GEMMs.
    /// Collective when turned on (every rank of the tensor group makes the side-stream group):
    /// every rank calls it at the same point, before the model's first forward and before any
    /// CUDA graph capture. Nothing to do without tensor parallelism.
    ///
    /// # Errors
    /// NCCL errors making the side-stream group.
    pub fn with_tp_comm_overlap(mut self, on: bool) -> Result<Self> {
        if let Some(tp) = self.tensor.take() {
            let tp = tp.with_comm_overlap(on);
            tp.prepare_comm_overlap()?;
            self.tensor = Some(tp);
        }
        Ok(self)
    }

    /// Sets how the context-parallel attention exchanges keys and values (TE's `cp_comm_type`;
    /// [`CpCommType::P2p`], the ring, unless set): under p2p the ring's side-stream group is
    /// made here (collective: every rank calls it at the same point, before the model's first
    /// forward and any CUDA graph capture). Nothing to do without context parallelism.
    ///
    /// # Errors
    /// NCCL errors making the side-stream group.
    pub fn with_cp_comm_type(mut self, comm_type: CpCommType) -> Result<Self> {
        if let Some(cp) = self.context.take() {
            let cp = cp.with_comm_type(comm_type);
            cp.prepare()?;
            self.context = Some(cp);
        }
        Ok(self)
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

    /// The run's ranks as a mesh of named axes (tensor × context × data) and this rank's group
    /// along each.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The gradient averaging over the ranks that hold a replica of the parameters: the
    /// data-parallel group, with context parallelism context × data (`None` on one replica).
    /// What ZeRO shards the optimizer state over.
    pub fn data(&mut self) -> Option<&mut DataParallel> {
        self.data.as_mut()
    }

    /// The tensor-parallel group the model's layers split over (`None` without tensor
    /// parallelism).
    pub fn tensor(&self) -> Option<&TpConfig> {
        self.tensor.as_ref()
    }

    /// The context-parallel group every sequence is split over (`None` without context
    /// parallelism).
    pub fn context(&self) -> Option<&ContextParallel> {
        self.context.as_ref()
    }

    /// This rank's `(rank, size)` in the data-parallel dimension: which shard of the data it
    /// reads (the data coordinate of the mesh: the context-parallel ranks of one data rank read
    /// the same sequences); `(0, 1)` without data parallelism.
    pub fn data_rank(&self) -> (usize, usize) {
        (self.mesh.coord(MeshAxis::Data), self.mesh.shape().size(MeshAxis::Data))
    }

    /// This rank's `(rank, size)` in the gradient-averaging group ([`Parallel::data`]: data
    /// × context); `(0, 1)` on one replica. Rank 0 of it writes a run's checkpoints; ZeRO's
    /// pieces are numbered by it.
    pub fn replica_rank(&self) -> (usize, usize) {
        self.data.as_ref().map_or((0, 1), |d| (d.rank(), d.size()))
    }

    /// This rank's `(rank, size)` in the context-parallel dimension; `(0, 1)` without it.
    pub fn context_rank(&self) -> (usize, usize) {
        self.context.as_ref().map_or((0, 1), |c| (c.rank(), c.size()))
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

    /// The mean of host `value` over the context-parallel group (`value` itself without
    /// context parallelism): a loss each rank computed over its part of the sequences.
    ///
    /// # Errors
    /// NCCL, allocation and copy errors.
    pub fn context_mean(&self, value: f32) -> Result<f32> {
        match &self.context {
            Some(cp) => mean(cp.group(), value),
            None => Ok(value),
        }
    }
}
