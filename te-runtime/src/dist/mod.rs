//! Multi-process runs (the multi-GPU issue): the launch environment ([`DistEnv`], `torchrun`'s
//! variables) and the rendezvous that hands rank 0's bytes (the NCCL unique id) to every rank
//! ([`rendezvous::broadcast_bytes`], bounded by a timeout); the tensor-parallel sharding
//! arithmetic (which slice of each weight a rank holds, [`shard`]). Processes are one a GPU;
//! nodes are described by the same variables, so multi-node runs need no other code.

mod env;
pub mod rendezvous;
pub mod shard;

pub use env::DistEnv;
