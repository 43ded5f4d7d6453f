//! Multi-process runs (the multi-GPU issue): the launch environment ([`DistEnv`], `torchrun`'s
//! variables) and the rendezvous that hands rank 0's bytes (the NCCL unique id) to every rank
//! ([`rendezvous::broadcast_bytes`], bounded by a timeout); the NCCL process group
//! ([`ProcessGroup`]: all-reduce, all-gather, reduce-scatter, reduce to a root, broadcast,
//! barrier, point-to-point send and receive on the device's stream or on a side stream, whose progress a [`SideMark`] marks;
//! sub-groups by `ncclCommSplit`; [`reduce_amax_max`], TE's amax reduction), which checks that
//! NCCL loads before using it ([`nccl_available`]), with a watchdog that aborts a group whose
//! collective never completes (a rank died) after `TE_DIST_TIMEOUT_S` ([`watchdog`]). Processes
//! are one a GPU; nodes are described by the same variables, so multi-node runs need no other
//! code. The tensor-parallel sharding arithmetic (which slice of each weight a rank holds) is
//! `te-nn`'s `parallel::shard`.
mod env;
mod nccl;
mod nccl_args;
mod nccl_lib;
mod nccl_ops;
mod nccl_p2p;
mod nccl_reduce;
pub mod rendezvous;
pub mod watchdog;

pub use env::DistEnv;
pub use nccl::{ProcessGroup, SideMark};
pub use nccl_args::{CommBuffer, ReduceOp};
pub use nccl_lib::{nccl_available, MIN_NCCL_VERSION};
pub use nccl_ops::reduce_amax_max;
