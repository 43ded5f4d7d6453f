//! Parallel training built on modules and process groups: data parallelism
//! ([`DataParallel`]: gradients averaged over the ranks in buckets on a side stream, overlapped
//! with the backward; parameters broadcast from rank 0) and the layout of a run that combines it
//! with tensor parallelism ([`Parallel`]; the tensor-parallel layers themselves are the modules'
//! [`crate::modules::TpConfig`]). The collectives are in [`te_runtime::dist`]; the amax reduction of
//! FP8 scaling is the autocast scope's ([`crate::fp8::Fp8Autocast::fp8_group`]).

mod data_parallel;
mod layout;
pub mod shard;

pub use data_parallel::DataParallel;
pub use layout::Parallel;
