//! The collectives of a [`ProcessGroup`] (PyTorch's `torch.distributed` names and semantics):
//! all-reduce, all-gather, reduce-scatter, broadcast and barrier, each checked before NCCL
//! sees it and issued on the group's stream ([`ProcessGroup`]'s `issue`, which the watchdog
//! watches); TE's amax reduction ([`reduce_amax_max`]).

use super::nccl::ProcessGroup;
use super::nccl_args::{check_concat, check_root, reducible, CommBuffer, ReduceOp};
use crate::{Error, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtr};
use cudarc::nccl::result;
use cudarc::nccl::sys;
use std::ffi::c_int;
use std::ops::Range;

impl ProcessGroup {
    /// Checks that `buf` lives on this group's GPU.
    pub(super) fn check_device(&self, op: &'static str, arg: &str, buf: &impl CommBuffer) -> Result<()> {
        let (have, want) = (buf.context().ordinal(), self.dev.context().ordinal());
        if have != want {
            return Err(Error::Argument {
                op,
                message: format!("`{arg}` is on GPU {have}, this group's device is GPU {want}: allocate it there"),
            });
        }
        Ok(())
    }

    /// Reduces `buf` over the group, in place (`ncclAllReduce`): afterwards every rank holds
    /// `op` over the ranks' `buf`s, elementwise. f32, bf16 and f16; any shape (the same on
    /// every rank). A shared [`Tensor`](crate::Tensor) is copied first (its clones keep the old values).
    ///
    /// # Errors
    /// [`Error::DType`] for FP8; [`Error::Argument`]: `buf` on another GPU; [`Error::Nccl`].
    pub fn all_reduce<B: CommBuffer>(&self, buf: &mut B, op: ReduceOp) -> Result<()> {
        let name = "ProcessGroup::all_reduce";
        let datatype = reducible(name, "buf", buf.dtype())?;
        self.check_device(name, "buf", buf)?;
        let count: usize = buf.dims().iter().product();
        if count == 0 {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (ptr, sync) = buf.write(&stream)?;
        let p = ptr as *mut std::ffi::c_void;
        // SAFETY: `p` addresses `count` live elements of `datatype` on this group's GPU; in place
        // (send = receive) is allowed; the call is ordered on this group's stream (a side stream
        // after the device stream's work; `hold` keeps a tensor allocated until `wait`).
        let issued = self
            .issue("ncclAllReduce", |comm, s| unsafe { result::all_reduce(p, p, count, datatype, op.nccl(), comm, s) });
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }

    /// [`ProcessGroup::all_reduce`] of each of `bufs`, in place, as one NCCL group (one launch
    /// for the lot, [`ProcessGroup::grouped`]: the amax histories of a scale update). Every
    /// rank passes buffers of the same dtypes and shapes in the same order.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce`], for the first buffer that fails (the others of the group
    /// may have been issued).
    pub fn all_reduce_many<B: CommBuffer>(&self, bufs: &mut [&mut B], op: ReduceOp) -> Result<()> {
        self.grouped(|| bufs.iter_mut().try_for_each(|b| self.all_reduce(&mut **b, op)))
    }

    /// Concatenates every rank's `input` along the first dim into `output` (`ncclAllGather`):
    /// `input` `[d0, d1, ...]` gives `output` `[size() * d0, d1, ...]`, rank `r`'s rows at
    /// `r * d0`. Any dtype (FP8 codes included: bytes are moved, not converted); `output` is the
    /// caller's, of `input`'s dtype.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`]: `output` not as above (the message gives the shape to
    /// allocate); [`Error::Argument`]: a buffer on another GPU; [`Error::Nccl`].
    pub fn all_gather<B: CommBuffer>(&self, input: &B, output: &mut B) -> Result<()> {
        let name = "ProcessGroup::all_gather";
        let (part, whole) = (input.dims(), output.dims());
        let dtype = input.dtype();
        check_concat(name, self.size(), ("input", dtype, &part), ("output", output.dtype(), &whole))?;
        self.check_device(name, "input", input)?;
        self.check_device(name, "output", output)?;
        let bytes = part.iter().product::<usize>() * dtype.size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (dst, out_sync) = output.write(&stream)?;
        let (src, in_sync) = input.read(&stream);
        let (src, dst) = (src as *const std::ffi::c_void, dst as *mut std::ffi::c_void);
        let u8 = sys::ncclDataType_t::ncclUint8;
        // SAFETY: `src` holds `bytes` bytes and `dst` `size() * bytes` (checked shapes); both on
        // this group's GPU; ordered on this group's stream (see all_reduce).
        let issued = self.issue("ncclAllGather", |comm, s| unsafe { result::all_gather(src, dst, bytes, u8, comm, s) });
        drop((out_sync, in_sync));
        issued?;
        self.hold(input);
        self.hold(output);
        Ok(())
    }

    /// Reduces every rank's `input` with `op` and scatters the result along the first dim
    /// (`ncclReduceScatter`): `input` `[size() * d0, d1, ...]` gives rank `r` the rows
    /// `r * d0 .. (r + 1) * d0` of the reduction in `output` `[d0, d1, ...]`. f32, bf16, f16
    /// (gradients: [`ReduceOp::Sum`]).
    ///
    /// # Errors
    /// [`Error::DType`] for FP8 or differing dtypes; [`Error::Shape`]: shapes not as above;
    /// [`Error::Argument`]: a buffer on another GPU; [`Error::Nccl`].
    pub fn reduce_scatter<B: CommBuffer>(&self, input: &B, output: &mut B, op: ReduceOp) -> Result<()> {
        let name = "ProcessGroup::reduce_scatter";
        let datatype = reducible(name, "input", input.dtype())?;
        let (whole, part) = (input.dims(), output.dims());
        check_concat(name, self.size(), ("output", output.dtype(), &part), ("input", input.dtype(), &whole))?;
        self.check_device(name, "input", input)?;
        self.check_device(name, "output", output)?;
        let count: usize = part.iter().product();
        if count == 0 {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (dst, out_sync) = output.write(&stream)?;
        let (src, in_sync) = input.read(&stream);
        let (src, dst) = (src as *const std::ffi::c_void, dst as *mut std::ffi::c_void);
        // SAFETY: `dst` holds `count` elements and `src` `size() * count` (checked shapes); both
        // on this group's GPU; ordered on this group's stream (see all_reduce).
        let issued = self.issue("ncclReduceScatter", |comm, s| unsafe {
            result::reduce_scatter(src, dst, count, datatype, op.nccl(), comm, s)
        });
        drop((out_sync, in_sync));
        issued?;
        self.hold(input);
        self.hold(output);
        Ok(())
    }

    /// Copies rank `root`'s `buf` into every rank's `buf`, in place (`ncclBroadcast`): initial
    /// weights, a seed. Any dtype and shape (the same on every rank).
    ///
    /// # Errors
    /// [`Error::Argument`]: `root` not below [`ProcessGroup::size`], `buf` on another GPU;
    /// [`Error::Nccl`].
    pub fn broadcast<B: CommBuffer>(&self, buf: &mut B, root: usize) -> Result<()> {
        let name = "ProcessGroup::broadcast";
        check_root(name, root, self.size())?;
        self.check_device(name, "buf", buf)?;
        let bytes = buf.dims().iter().product::<usize>() * buf.dtype().size_bytes();
        if bytes == 0 {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (ptr, sync) = buf.write(&stream)?;
        let p = ptr as *mut std::ffi::c_void;
        let u8 = sys::ncclDataType_t::ncclUint8;
        // SAFETY: `p` holds `bytes` bytes on this group's GPU; in place is allowed; ordered on the
        // group's stream (see all_reduce).
        let issued = self
            .issue("ncclBroadcast", |comm, s| unsafe { result::broadcast(p, p, bytes, u8, root as c_int, comm, s) });
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }

    /// [`ProcessGroup::broadcast`] of the elements `range` of `buf` (flattened, row-major), in
    /// place: rank `root`'s elements there replace every rank's, the others stay as they are
    /// (the pieces of a ZeRO checkpoint gather, each broadcast from its owner; in one NCCL group,
    /// [`ProcessGroup::grouped`], they move what an all-gather moves). A shared
    /// [`Tensor`](crate::Tensor) is copied first, as [`ProcessGroup::broadcast`] does: use
    /// [`ProcessGroup::broadcast_range_shared`] to write the storage its clones see. Every rank
    /// passes the same `range` and `root`. An empty range is nothing to do.
    ///
    /// # Errors
    /// [`Error::Argument`]: `root` not below [`ProcessGroup::size`], `range` reversed or past the
    /// buffer's elements, `buf` on another GPU; [`Error::Nccl`].
    pub fn broadcast_range<B: CommBuffer>(&self, buf: &mut B, range: Range<usize>, root: usize) -> Result<()> {
        let name = "ProcessGroup::broadcast_range";
        let elem = self.check_range(name, buf, &range, root)?;
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        let (ptr, sync) = buf.write(&stream)?;
        let issued = self.broadcast_bytes(ptr + (range.start * elem) as u64, range.len() * elem, root);
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }

    /// [`ProcessGroup::broadcast_range`] into `tensor`'s own storage, which its clones share:
    /// every clone sees the new elements, as with [`Tensor::copy_from`](crate::Tensor::copy_from)
    /// (PyTorch's in-place `dist.broadcast` of a parameter's shard: Megatron-LM's distributed
    /// optimizer gathers the updated parameters into the model's own buffers). How a ZeRO step
    /// makes every rank's parameters whole again after each rank updated its piece.
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast_range`].
    pub fn broadcast_range_shared(&self, tensor: &Tensor, range: Range<usize>, root: usize) -> Result<()> {
        let name = "ProcessGroup::broadcast_range_shared";
        let elem = self.check_range(name, tensor, &range, root)?;
        if range.is_empty() {
            return Ok(());
        }
        let stream = self.dev.stream().clone();
        // Written through a shared borrow: in place into the storage the clones share (this
        // method's documented purpose, as `Tensor::copy_from`); no Rust reference to device
        // memory is made.
        let (ptr, sync) = tensor.data().device_ptr(&stream);
        let issued = self.broadcast_bytes(ptr + (range.start * elem) as u64, range.len() * elem, root);
        drop(sync);
        issued?;
        self.hold(tensor);
        Ok(())
    }

    /// Checks a ranged collective's arguments (root, GPU, `range` inside the buffer); returns
    /// the element size in bytes.
    pub(super) fn check_range<B: CommBuffer>(
        &self,
        name: &'static str,
        buf: &B,
        range: &Range<usize>,
        root: usize,
    ) -> Result<usize> {
        check_root(name, root, self.size())?;
        self.check_device(name, "buf", buf)?;
        let count: usize = buf.dims().iter().product();
        if range.start > range.end || range.end > count {
            return Err(Error::Argument {
                op: name,
                message: format!(
                    "elements {}..{} of a buffer of {count}: pass a range inside the buffer",
                    range.start, range.end
                ),
            });
        }
        Ok(buf.dtype().size_bytes())
    }

    /// `ncclBroadcast` of `bytes` bytes at device address `ptr`, in place, from `root`.
    fn broadcast_bytes(&self, ptr: u64, bytes: usize, root: usize) -> Result<()> {
        let p = ptr as *mut std::ffi::c_void;
        let u8 = sys::ncclDataType_t::ncclUint8;
        // SAFETY: the callers pass `bytes` bytes inside a live buffer on this group's GPU
        // (checked range), whose stream guard they hold across the call; in place is allowed;
        // ordered on the group's stream (see all_reduce).
        self.issue("ncclBroadcast", |comm, s| unsafe { result::broadcast(p, p, bytes, u8, root as c_int, comm, s) })
    }

    /// Waits until every rank has reached it (PyTorch's `barrier()` with NCCL: an all-reduce of
    /// one element, then a wait for the device's stream, so this rank's earlier work is done too).
    ///
    /// # Errors
    /// [`Error::Nccl`]; driver errors (a failed earlier kernel surfaces here); refused inside a
    /// CUDA graph capture (it synchronizes).
    pub fn barrier(&self) -> Result<()> {
        let mut one = self.dev.stream().alloc_zeros::<f32>(1)?;
        self.all_reduce(&mut one, ReduceOp::Sum)?;
        self.dev.synchronize()
    }
}

/// TE's amax reduction (`reduce_amax` of `DelayedScaling`, with the amax reduction group): the
/// maximum of each amax over the group, in place, so that every rank derives the same FP8 scales
/// from the same amaxes. `amaxes` holds f32 amaxes (absolute maxima, ≥ 0), the same count on
/// every rank; one `ncclAllReduce` with `ncclMax`. A group of one leaves them as they are.
///
/// # Errors
/// As [`ProcessGroup::all_reduce`].
pub fn reduce_amax_max(group: &ProcessGroup, amaxes: &mut CudaSlice<f32>) -> Result<()> {
    group.all_reduce(amaxes, ReduceOp::Max)
}
