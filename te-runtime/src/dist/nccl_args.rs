//! The arguments of [`ProcessGroup`](super::ProcessGroup)'s collectives: the reduction, the
//! buffers they take ([`CommBuffer`]), and the checks that run before NCCL sees them (shapes,
//! dtypes, roots, group members), each a typed error that says what to allocate or pass.

use crate::{Error, Result, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::nccl::sys;
use std::sync::Arc;
use te_codegen::DType;

/// The reduction of [`ProcessGroup::all_reduce`](super::ProcessGroup::all_reduce) and
/// [`ProcessGroup::reduce_scatter`](super::ProcessGroup::reduce_scatter)
/// (`torch.distributed.ReduceOp`; NCCL's `ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum (`ncclSum`): gradients.
    Sum,
    /// Elementwise maximum (`ncclMax`): amaxes ([`reduce_amax_max`](super::reduce_amax_max)).
    Max,
    /// Elementwise minimum (`ncclMin`).
    Min,
    /// Elementwise mean over the ranks (`ncclAvg`): the sum divided by the group's size.
    Avg,
}

impl ReduceOp {
    pub(crate) fn nccl(self) -> sys::ncclRedOp_t {
        match self {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        }
    }
}

mod private {
    use super::*;

    /// The device memory behind a [`CommBuffer`](super::CommBuffer) (sealed: only this crate's
    /// buffer types implement it).
    pub trait Buffer {
        /// Element type.
        fn dtype(&self) -> DType;
        /// Shape: a tensor's, `[len]` for a slice.
        fn dims(&self) -> Vec<usize>;
        /// The context the memory was allocated in.
        fn context(&self) -> &Arc<CudaContext>;
        /// The address, for reading on `stream`.
        fn read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>);
        /// The address, for writing on `stream` (a shared tensor is copied first).
        fn write<'a>(&'a mut self, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)>;
        /// A handle that keeps the memory allocated while a side-stream collective uses it
        /// (a tensor's clone); `None` for a slice, which the caller must keep.
        fn keep_alive(&self) -> Option<Tensor>;
    }

    impl Buffer for Tensor {
        fn dtype(&self) -> DType {
            Tensor::dtype(self)
        }
        fn dims(&self) -> Vec<usize> {
            self.shape().to_vec()
        }
        fn context(&self) -> &Arc<CudaContext> {
            self.data().context()
        }
        fn read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
            self.data().device_ptr(stream)
        }
        fn write<'a>(&'a mut self, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
            Ok(self.data_mut()?.device_ptr_mut(stream))
        }
        fn keep_alive(&self) -> Option<Tensor> {
            Some(self.clone())
        }
    }

    impl Buffer for CudaSlice<f32> {
        fn dtype(&self) -> DType {
            DType::F32
        }
        fn dims(&self) -> Vec<usize> {
            vec![self.len()]
        }
        fn context(&self) -> &Arc<CudaContext> {
            CudaSlice::context(self)
        }
        fn read<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
            self.device_ptr(stream)
        }
        fn write<'a>(&'a mut self, stream: &'a CudaStream) -> Result<(u64, SyncOnDrop<'a>)> {
            Ok(self.device_ptr_mut(stream))
        }
        fn keep_alive(&self) -> Option<Tensor> {
            None
        }
    }
}

/// A device buffer the collectives take: a [`Tensor`] (f32, bf16, f16, E4M3, E5M2; any shape,
/// the first dim is the one gathered and scattered) or a `CudaSlice<f32>` (shape `[len]`).
/// Sealed: implemented by this crate only.
pub trait CommBuffer: private::Buffer {}

impl CommBuffer for Tensor {}
impl CommBuffer for CudaSlice<f32> {}

/// NCCL's element type for a reduction over `dtype`: f32, bf16, f16. FP8 codes are not reduced
/// (TE gathers FP8 and reduces in bf16/f32: a sum of FP8 codes overflows and loses bits).
///
/// # Errors
/// [`Error::DType`] for E4M3 and E5M2.
pub(crate) fn reducible(op: &'static str, arg: &'static str, dtype: DType) -> Result<sys::ncclDataType_t> {
    match dtype {
        DType::F32 => Ok(sys::ncclDataType_t::ncclFloat32),
        DType::BF16 => Ok(sys::ncclDataType_t::ncclBfloat16),
        DType::F16 => Ok(sys::ncclDataType_t::ncclFloat16),
        DType::E4M3 | DType::E5M2 => Err(Error::DType {
            op,
            arg,
            expected: "f32, bf16 or f16 (FP8 codes are not reduced: reduce the bf16/f32 values and cast, as TE \
                       does; all_gather and broadcast take FP8)"
                .into(),
            got: dtype,
        }),
    }
}

/// Checks a gather/scatter pair: `whole` must be `world` copies of `part` concatenated along the
/// first dim (`[world * d0, d1, ...]` for `part = [d0, d1, ...]`), of the same dtype. `part_arg`
/// and `whole_arg` name them in the error.
///
/// # Errors
/// [`Error::DType`] when the dtypes differ; [`Error::Shape`] for a scalar `part` or a `whole`
/// of another shape, naming the shape to allocate.
pub(crate) fn check_concat(
    op: &'static str,
    world: usize,
    (part_arg, part_dtype, part): (&'static str, DType, &[usize]),
    (whole_arg, whole_dtype, whole): (&'static str, DType, &[usize]),
) -> Result<()> {
    if whole_dtype != part_dtype {
        return Err(Error::DType {
            op,
            arg: whole_arg,
            expected: format!("{part_dtype}, as `{part_arg}`"),
            got: whole_dtype,
        });
    }
    let Some((&d0, rest)) = part.split_first() else {
        return Err(Error::Shape {
            op,
            message: format!(
                "`{part_arg}` is a scalar: reshape it to [1] (ranks are concatenated along the first dim)"
            ),
        });
    };
    let mut want = vec![world * d0];
    want.extend_from_slice(rest);
    if whole != want.as_slice() {
        return Err(Error::Shape {
            op,
            message: format!(
                "`{whole_arg}` is {whole:?}; with `{part_arg}` {part:?} on each of {world} ranks (concatenated along \
                 the first dim) it must be {want:?}: allocate it so, e.g. Tensor::empty(dev, {part_dtype}, \
                 &{want:?})"
            ),
        });
    }
    Ok(())
}

/// Checks that a `root` rank is in a group of `size`.
pub(crate) fn check_root(op: &'static str, root: usize, size: usize) -> Result<()> {
    if root >= size {
        return Err(Error::Argument {
            op,
            message: format!("root {root} is not a rank of this group of {size}: give a rank in 0..{size}"),
        });
    }
    Ok(())
}

/// The members of `torch.distributed.new_group(ranks)` in a group of `size`: `ranks` sorted (a
/// member's rank in the new group is its place in that order, as PyTorch does).
///
/// # Errors
/// [`Error::Argument`]: `ranks` empty, with a rank twice, or with a rank not below `size`.
pub(crate) fn group_members(size: usize, ranks: &[usize]) -> Result<Vec<usize>> {
    let op = "ProcessGroup::new_group";
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    if sorted.is_empty() {
        return Err(Error::Argument { op, message: "no ranks: a group needs at least one".into() });
    }
    if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
        return Err(Error::Argument { op, message: format!("rank {} is listed twice in {ranks:?}", w[0]) });
    }
    if let Some(&bad) = sorted.last().filter(|&&r| r >= size) {
        return Err(Error::Argument {
            op,
            message: format!("rank {bad} in {ranks:?} is not a rank of this group of {size} (ranks are 0..{size})"),
        });
    }
    Ok(sorted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_and_scatters_are_checked_with_the_shape_to_allocate() {
        let op = "ProcessGroup::all_gather";
        let ok = check_concat(op, 4, ("input", DType::BF16, &[3, 8]), ("output", DType::BF16, &[12, 8]));
        assert!(ok.is_ok());
        assert!(check_concat(op, 1, ("input", DType::E4M3, &[5]), ("output", DType::E4M3, &[5])).is_ok());
        let e = check_concat(op, 4, ("input", DType::BF16, &[3, 8]), ("output", DType::BF16, &[3, 32])).unwrap_err();
        let text = e.to_string();
        assert!(
            matches!(e, Error::Shape { .. }) && text.contains("[12, 8]") && text.contains("Tensor::empty"),
            "{text}"
        );
        let e = check_concat(op, 2, ("input", DType::F32, &[3]), ("output", DType::BF16, &[6])).unwrap_err();
        assert!(matches!(e, Error::DType { arg: "output", got: DType::BF16, .. }), "{e}");
        let e = check_concat(op, 2, ("input", DType::F32, &[]), ("output", DType::F32, &[2])).unwrap_err();
        assert!(e.to_string().contains("scalar: reshape it to [1]"), "{e}");
        let rs = "ProcessGroup::reduce_scatter";
        let e = check_concat(rs, 2, ("output", DType::F32, &[4, 2]), ("input", DType::F32, &[4, 2])).unwrap_err();
        assert!(e.to_string().contains("`input` is [4, 2]") && e.to_string().contains("[8, 2]"), "{e}");
    }

    #[test]
    fn fp8_is_moved_but_not_reduced() {
        for d in [DType::F32, DType::BF16, DType::F16] {
            assert!(reducible("ProcessGroup::all_reduce", "buf", d).is_ok(), "{d}");
        }
        for d in [DType::E4M3, DType::E5M2] {
            let e = reducible("ProcessGroup::all_reduce", "buf", d).unwrap_err();
            assert!(matches!(e, Error::DType { got, .. } if got == d), "{e}");
            assert!(e.to_string().contains("all_gather and broadcast take FP8"), "{e}");
        }
    }

    #[test]
    fn roots_and_group_ranks_are_checked() {
        assert!(check_root("ProcessGroup::broadcast", 0, 1).is_ok());
        let e = check_root("ProcessGroup::broadcast", 2, 2).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("0..2"), "{e}");
        assert_eq!(group_members(8, &[6, 2, 4]).unwrap(), [2, 4, 6], "sorted, as PyTorch");
        assert_eq!(group_members(1, &[0]).unwrap(), [0]);
        for (ranks, says) in
            [(&[][..], "at least one"), (&[1, 3, 1][..], "rank 1 is listed twice"), (&[0, 4][..], "rank 4")]
        {
            let e = group_members(4, ranks).unwrap_err();
            assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains(says), "{ranks:?}: {e}");
        }
    }

    #[test]
    fn reduce_ops_map_to_nccl() {
        assert_eq!(ReduceOp::Sum.nccl(), sys::ncclRedOp_t::ncclSum);
        assert_eq!(ReduceOp::Max.nccl(), sys::ncclRedOp_t::ncclMax);
        assert_eq!(ReduceOp::Min.nccl(), sys::ncclRedOp_t::ncclMin);
        assert_eq!(ReduceOp::Avg.nccl(), sys::ncclRedOp_t::ncclAvg);
    }
}
