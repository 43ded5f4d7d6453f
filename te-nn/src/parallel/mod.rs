//! Parallelism, below the modules: the one home of how a run spreads over ranks.
//!
//! - **The mesh** ([`MeshShape`], [`DeviceMesh`]): the run's ranks as a grid of named axes
//!   ([`MeshAxis`]: tensor, context, expert, ZeRO, data) in Megatron-LM's rank layout (tensor
//!   ranks consecutive), the rank → group-color arithmetic, and one process group per axis in
//!   use. [`Parallel`] is a run's TP × CP × DP mesh with its gradient averaging (over context
//!   × data: every replica of the parameters), its tensor-parallel config and its
//!   context-parallel group.
//! - **Tensor parallelism** ([`TpConfig`]): the group and `sequence_parallel`, the one config
//!   every tensor-parallel module and the GPT take; how a GEMM splits ([`ParallelMode`]) is
//!   given where the split is chosen.
//! - **The hooks** the modules call unconditionally, whose single-GPU forms are the identity:
//!   [`GemmParallel`] around every GEMM (the input gathered, the output reduced, the output
//!   gradient gathered, the dgrad reduced, who adds the bias, this rank's features and weight
//!   slice) and [`SequenceParallel`] for the token shards between GEMMs (scatter, gather, and
//!   the sum of the norms' parameter gradients).
//! - **The sharding arithmetic** ([`shard`]: [`Split`], [`TpRank`], [`TpLayout`]): which slice
//!   of each tensor a rank holds, shared by the modules' init and checkpoint split and merge.
//! - **Data parallelism** ([`DataParallel`]): gradients averaged over the ranks in buckets on a
//!   side stream, overlapped with the backward, or (ZeRO-2, [`GradShards`]) each piece reduced
//!   to the rank that owns it and the rest released; parameters broadcast from rank 0 (it walks
//!   the modules' parameters, so it is the one part above them).
//! - **Sharded parameters** ([`ParamShards`], ZeRO-3): each rank keeps its pieces of a group's
//!   (a layer's) parameters; the group's whole tensors are gathered into a ring of transient
//!   buffers just before they are read, the next group's gather prefetched on a side stream.
//!
//! - **Context parallelism** ([`ContextParallel`]): every sequence split over the ranks of the
//!   context axis in load-balanced chunks, attention over the other ranks' keys and values,
//!   passed around a ring beside the attention (TE's `cp_comm_type="p2p"`, the default,
//!   [`cp_ring`]) or all-gathered (`"all_gather"`, [`CpCommType`]);
//!   `MultiheadAttention::set_context_parallel` and `te_models`' `DecoderLm` train with it.
//!
//! The collectives are `te_runtime::dist`'s; the amax reduction of FP8 scaling is the autocast
//! scope's ([`crate::fp8::Fp8Autocast::with_group`]). Expert parallelism and ZeRO come next on
//! the same mesh: their axes and group arithmetic are here already ([`MeshAxis::Expert`],
//! [`MeshAxis::Zero`]); expert parallelism the token dispatch of `MoeMLP` over the expert axis,
//! ZeRO the optimizer state sharded over the ZeRO axis.

mod collectives;
pub(crate) mod context_parallel;
pub mod cp_ring;
mod data_parallel;
mod device_mesh;
mod gemm;
mod grad_shards;
mod layout;
mod mesh;
mod mode;
pub mod overlap;
mod param_shards;
mod sequence;
pub mod shard;
mod shard_ring;
pub mod tensor_parallel;

pub use context_parallel::ContextParallel;
pub use cp_ring::CpCommType;
pub use data_parallel::DataParallel;
pub use device_mesh::DeviceMesh;
pub use gemm::GemmParallel;
pub use grad_shards::{GradShards, ReduceCall, Shard};
pub use layout::Parallel;
pub use mesh::{MeshAxis, MeshShape};
pub use mode::ParallelMode;
pub use overlap::PendingReduce;
pub use param_shards::{local_piece, Gathered, ParamShards};
pub use sequence::SequenceParallel;
pub use shard::{Split, TpLayout, TpRank};
pub use tensor_parallel::TpConfig;
