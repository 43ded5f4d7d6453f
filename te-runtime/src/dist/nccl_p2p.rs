//! Point-to-point transfers of a [`ProcessGroup`] (`ncclSend` / `ncclRecv`; PyTorch's
//! `isend` / `irecv`, `batch_isend_irecv` when issued inside [`ProcessGroup::grouped`]): how the
//! ring of context parallelism (TE's `cp_comm_type="p2p"`) passes keys and values to the next
//! rank while the attention of the ones in hand runs.
//!
//! A send and the matching receive are issued on the two ranks with the same byte count;
//! a rank that sends to its successor and receives from its predecessor must issue both inside
//! one [`ProcessGroup::grouped`] call, or two ranks that both send first wait for each other
//! (NCCL's rule; not checkable locally).

use super::nccl::ProcessGroup;
use super::nccl_args::CommBuffer;
use crate::{Error, Result};
use cudarc::nccl::result;
use cudarc::nccl::sys;
use std::ffi::c_int;

impl ProcessGroup {
    /// The checked arguments of a transfer of `buf` with rank `peer`: NCCL's peer and the byte
    /// count, or `None` for an empty buffer (nothing to transfer).
    fn p2p_args<B: CommBuffer>(&self, op: &'static str, buf: &B, peer: usize) -> Result<Option<(c_int, usize)>> {
        let peer = self.check_peer(op, peer)?;
        self.check_device(op, "buf", buf)?;
        let bytes = buf.dims().iter().product::<usize>() * buf.dtype().size_bytes();
        Ok((bytes > 0).then_some((peer, bytes)))
    }

    /// Checks a peer rank of a transfer.
    fn check_peer(&self, op: &'static str, peer: usize) -> Result<c_int> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::Argument {
                op,
                message: format!(
                    "peer {peer} in a group of {} ranks (this is rank {}): pass another rank of the group",
                    self.size(),
                    self.rank()
                ),
            });
        }
        c_int::try_from(peer).map_err(|_| Error::Argument { op, message: format!("peer {peer} is above i32") })
    }

    /// Sends `buf` (every element, as bytes: any dtype, FP8 codes included) to rank `peer` of
    /// this group (`ncclSend`), whose [`ProcessGroup::recv`] takes a buffer of as many bytes.
    /// Asynchronous on the group's stream (a side stream: after the device stream's earlier
    /// work, `buf` kept allocated until [`ProcessGroup::wait`]); the caller must not write `buf`
    /// before then.
    ///
    /// # Errors
    /// [`Error::Argument`]: `peer` out of the group or this rank, `buf` on another GPU;
    /// [`Error::Nccl`].
    pub fn send<B: CommBuffer>(&self, buf: &B, peer: usize) -> Result<()> {
        let Some((peer, bytes)) = self.p2p_args("ProcessGroup::send", buf, peer)? else {
            return Ok(());
        };
        let stream = self.dev.stream().clone();
        let (src, sync) = buf.read(&stream);
        let src = src as *const std::ffi::c_void;
        let u8 = sys::ncclDataType_t::ncclUint8;
        // SAFETY: `src` holds `bytes` bytes on this group's GPU, kept alive by the guard across
        // the call and by `hold` until `wait` on a side stream; ordered on the group's stream.
        let issued = self.issue("ncclSend", |comm, s| unsafe { result::send(src, bytes, u8, peer, comm, s) });
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }

    /// Receives into `buf` (every element, as bytes) what rank `peer` of this group sends with
    /// [`ProcessGroup::send`] (`ncclRecv`). Asynchronous on the group's stream: on a side stream
    /// the device stream sees the bytes after [`ProcessGroup::wait`]. A shared
    /// [`Tensor`](crate::Tensor) is copied first (its clones keep the old values): pass a buffer
    /// of its own.
    ///
    /// # Errors
    /// As [`ProcessGroup::send`].
    pub fn recv<B: CommBuffer>(&self, buf: &mut B, peer: usize) -> Result<()> {
        let Some((peer, bytes)) = self.p2p_args("ProcessGroup::recv", &*buf, peer)? else {
            return Ok(());
        };
        let stream = self.dev.stream().clone();
        let (dst, sync) = buf.write(&stream)?;
        let dst = dst as *mut std::ffi::c_void;
        let u8 = sys::ncclDataType_t::ncclUint8;
        // SAFETY: `dst` holds `bytes` bytes on this group's GPU, written by nothing else until
        // the transfer is waited for; ordered on the group's stream.
        let issued = self.issue("ncclRecv", |comm, s| unsafe { result::recv(dst, bytes, u8, peer, comm, s) });
        drop(sync);
        issued?;
        self.hold(buf);
        Ok(())
    }
}
