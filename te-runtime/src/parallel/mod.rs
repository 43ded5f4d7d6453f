//! Parallel training built on modules and process groups: data parallelism
//! ([`DataParallel`]: gradients averaged over the ranks in buckets on a side stream, overlapped
//! with the backward; parameters broadcast from rank 0). The collectives themselves are in
//! [`crate::dist`]; the amax reduction of FP8 scaling is the autocast scope's
//! ([`crate::fp8::Fp8Autocast::fp8_group`]).

mod data_parallel;

pub use data_parallel::DataParallel;
