//! Reductions to one rank (`ncclReduce`, PyTorch's `torch.distributed.reduce`): of a whole
//! buffer, or of a range of its elements in place. How a ZeRO-2 backward hands each piece of a
//! gradient to the rank that owns it (DeepSpeed's stage 2; Megatron-LM's distributed optimizer
//! reduce-scatters its gradient buffer instead, the same volume): every rank sends its
//! elements, the root receives their reduction, the other ranks' buffers are left as they were.

use super::nccl::ProcessGroup;
use super::nccl_args::{check_root, reducible, CommBuffer, ReduceOp};
use crate::{Error, Result, Tensor};
use cudarc::driver::DevicePtr;
use cudarc::nccl::{result, sys};
use std::ffi::c_int;
use std::ops::Range;

impl ProcessGroup {
    /// Reduces every rank's `buf` into rank `root`'s, in place (`ncclReduce`): afterwards `root`
    /// holds `op` over the ranks' `buf`s, elementwise; the other ranks' `buf` is unchanged.
    /// f32, bf16 and f16; any shape (the same on every rank). A shared
    /// [`Tensor`](crate::Tensor) is copied first, as [`ProcessGroup::all_reduce`] does. With
    /// two ranks the result is bit for bit what [`ProcessGroup::all_reduce`] gives (one sum of
    /// two values, in either order); with more, NCCL may sum in another order.
    ///
    /// # Errors
    /// [`Error::DType`] for FP8; [`Error::Argument`]: `root` not below [`ProcessGroup::size`],
    /// `buf` on another GPU; [`Error::Nccl`].
    pub fn reduce<B: CommBuffer>(&self, buf: &mut B, root: usize, op: ReduceOp) -> Result<()> {
        let count: usize = buf.dims().iter().product();
        self.reduce_range(buf, 0..count, root, op)
    }

    /// [`ProcessGroup::reduce`] of the elements `range` of `buf` (flattened, row-major), in
    /// place: rank `root`'s elements there become `op` over every rank's, everything else stays
    /// as it is. Every rank passes the same `range`, `root` and `op`. An empty range is nothing
    /// to do. A shared [`Tensor`](crate::Tensor) is copied first: use
    /// [`ProcessGroup::reduce_range_shared`] to reduce into the storage its clones see (several
    /// ranges of one tensor, each to its own root).
    ///
    /// # Errors
    /// [`Error::DType`] for FP8; [`Error::Argument`]: `root` not below [`ProcessGroup::size`],
    /// `range` reversed or past the buffer's elements, `buf` on another GPU; [`Error::Nccl`].
    pub fn reduce_range<B: CommBuffer>(
        &self,
        buf: &mut B,
        range: Range<usize>,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let name = "ProcessGroup::reduce_range";
        let datatype = reducible(name, "buf", buf.dtype())?;
        let elem = self.check_range(name, buf, &range, root)?;
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (ptr, sync) = buf.write(&stream)?;
        let issued = self.reduce_elements(ptr + (range.start * elem) as u64, range.len(), datatype, root, op);
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }

    /// [`ProcessGroup::reduce_range`] into `tensor`'s own storage, which its clones share (as
    /// [`ProcessGroup::broadcast_range_shared`] writes): the root's clones see the reduced
    /// elements. How a ZeRO-2 bucket reduces each piece of a gradient to its owner, several
    /// pieces of one gradient to several roots in one NCCL group
    /// (`te_nn::parallel::DataParallel`).
    ///
    /// # Errors
    /// As [`ProcessGroup::reduce_range`].
    pub fn reduce_range_shared(&self, tensor: &Tensor, range: Range<usize>, root: usize, op: ReduceOp) -> Result<()> {
        let name = "ProcessGroup::reduce_range_shared";
        let datatype = reducible(name, "tensor", tensor.dtype())?;
        let elem = self.check_range(name, tensor, &range, root)?;
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        // Written through a shared borrow: in place into the storage the clones share (this
        // method's documented purpose); no Rust reference to device memory is made.
        let (ptr, sync) = tensor.data().device_ptr(&stream);
        let issued = self.reduce_elements(ptr + (range.start * elem) as u64, range.len(), datatype, root, op);
        drop(sync);
        issued?;
        self.hold(tensor);
        Ok(())
    }

    /// `ncclReduce` of `count` elements of `datatype` at device address `ptr`, in place, to
    /// `root`.
    fn reduce_elements(
        &self,
        ptr: u64,
        count: usize,
        datatype: sys::ncclDataType_t,
        root: usize,
        op: ReduceOp,
    ) -> Result<()> {
        check_root("ProcessGroup::reduce", root, self.size())?;
        let root = c_int::try_from(root).map_err(|_| Error::Argument {
            op: "ProcessGroup::reduce",
            message: format!("root {root} does not fit NCCL's int"),
        })?;
        let p = ptr as *mut std::ffi::c_void;
        // SAFETY: the callers pass `count` elements of `datatype` inside a live buffer on this
        // group's GPU (checked range), whose stream guard they hold across the call; in place
        // (send = receive) is allowed, and only the root writes; ordered on the group's stream
        // (a side stream after the device stream's work; `hold` keeps a tensor allocated until
        // `wait` or `wait_mark`).
        self.issue("ncclReduce", |comm, s| unsafe { result::reduce(p, p, count, datatype, op.nccl(), root, comm, s) })
    }
}
