//! [`ProcessGroup`]: the ranks of a run (or a subset: a tensor- or data-parallel group) and their
//! NCCL communicator, with the collectives TE's distributed code needs, issued on the device's
//! stream (their code is `nccl_ops` and `nccl_reduce`): all-reduce (sum, max: TE's amax
//! reduction, `reduce_amax_max`), all-gather, reduce-scatter, reduce to a root, broadcast,
//! barrier. PyTorch's
//! `torch.distributed` names and semantics.
//!
//! Every entry point checks first that NCCL loads ([`nccl_available`]; cudarc panics otherwise)
//! and starts NCCL with NVLink multicast off (`NCCL_NVLS_ENABLE=0` unless the user set it: see
//! [`nccl_available`]). Arguments are checked before NCCL sees them: shapes, dtypes, the GPU a
//! buffer lives on; a failed NCCL call is [`Error::Nccl`] with NCCL's own explanation.
//!
//! The collectives are asynchronous on the device's stream, like every op of this crate: later
//! work on the stream sees their results; [`Device::synchronize`] (or [`ProcessGroup::barrier`])
//! waits for them. A group made by [`ProcessGroup::with_side_stream`] runs them on a stream of its
//! own instead, after the device stream's work issued before each call, and the device stream
//! waits for them only at [`ProcessGroup::wait`] (PyTorch's `async_op=True` and `work.wait()`):
//! how the gradients of a data-parallel backward are reduced while the backward goes on. Every
//! rank of the group must issue the same collectives in the same order with matching shapes, or
//! NCCL waits forever (NCCL's rule, not checkable locally).

use super::nccl_args::{group_members, CommBuffer};
use super::nccl_lib::{nccl_available, nccl_error};
use super::watchdog::Watchdog;
use super::{rendezvous, DistEnv};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{sys as cuda, CudaEvent, CudaStream};
use cudarc::nccl::result::{self, NcclError, NcclStatus};
use cudarc::nccl::sys;
use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

/// An NCCL communicator handle; used under the group's lock (NCCL's communicators are not
/// thread-safe), destroyed by [`ProcessGroup`]'s `Drop` or [`ProcessGroup::abort`].
#[derive(Debug)]
struct RawComm(sys::ncclComm_t);

// SAFETY: NCCL allows a communicator to be used from any thread, one call at a time: every use
// is under `ProcessGroup::comm`'s mutex.
unsafe impl Send for RawComm {}

/// The ranks of a group and their NCCL communicator on one GPU (TE's and PyTorch's process
/// group: `torch.distributed.ProcessGroup` with the NCCL backend).
///
/// Made by [`ProcessGroup::init`] (every rank of a `torchrun`-style run), [`ProcessGroup::single`]
/// (one process), and from a group by [`ProcessGroup::split`] and [`ProcessGroup::new_group`]
/// (tensor- and data-parallel groups; NCCL's `ncclCommSplit`). Dropping it destroys the
/// communicator (`ncclCommDestroy`, which waits for its pending work); [`ProcessGroup::abort`]
/// does not wait.
#[derive(Debug)]
pub struct ProcessGroup {
    /// Dropped before `dev` (fields drop in order): the context outlives the communicator.
    /// Null after `Drop`, [`ProcessGroup::abort`] or the watchdog's abort.
    comm: Arc<Mutex<RawComm>>,
    /// The same communicator for the watchdog, which aborts it without the lock (a thread
    /// blocked inside an NCCL call holds that; NCCL's abort is made for this): whoever swaps
    /// it to null first aborts or destroys it.
    handle: Arc<AtomicPtr<sys::ncclComm>>,
    /// Times out collectives that never complete ([`super::watchdog`]); `None` in a group of
    /// one process.
    watchdog: Option<Watchdog>,
    /// Where the collectives run: the device's stream, or a side stream of this group's own.
    stream: Arc<CudaStream>,
    /// `stream` is a side stream: each collective first waits for the device stream.
    side: bool,
    /// Side stream: the tensors of the collectives issued since the last [`ProcessGroup::wait`]
    /// (or, for the oldest, [`ProcessGroup::wait_mark`]), kept allocated until then (a tensor
    /// dropped by the caller is freed in the device stream's order, which does not wait for the
    /// side stream). Dropped after `comm`, whose destruction waits for the collectives.
    in_flight: Mutex<InFlight>,
    pub(super) dev: Arc<Device>,
    rank: usize,
    /// Global rank (`RANK`) of each member, by rank in this group.
    ranks: Vec<usize>,
}

/// A point in the collectives of a side-stream group ([`ProcessGroup::mark`]), which
/// [`ProcessGroup::wait_mark`] makes the device's stream wait for. Pass it to the group that
/// made it.
#[derive(Debug)]
pub struct SideMark {
    /// Recorded on the side stream after the collectives; `None`: a group on the device's
    /// stream, nothing to wait for.
    event: Option<CudaEvent>,
    /// Tensors held for the collectives issued before the mark (counted since the group was
    /// made).
    held: u64,
}

/// The tensors a side-stream group keeps allocated for its collectives, oldest first, and how
/// many it let go of before them.
#[derive(Debug)]
struct InFlight<T = Tensor> {
    held: VecDeque<T>,
    released: u64,
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        Self { held: VecDeque::new(), released: 0 }
    }
}

impl<T> InFlight<T> {
    /// Keeps `t` until its collective has been waited for.
    fn hold(&mut self, t: T) {
        self.held.push_back(t);
    }

    /// Tensors held so far, let go of or not.
    fn issued(&self) -> u64 {
        self.released + self.held.len() as u64
    }

    /// Lets go of the tensors held before the `issued`-th.
    fn release_through(&mut self, issued: u64) {
        while self.released < issued && self.held.pop_front().is_some() {
            self.released += 1;
        }
    }

    /// Lets go of every tensor.
    fn release_all(&mut self) {
        self.released += self.held.len() as u64;
        self.held.clear();
    }
}

impl SideMark {
    /// Whether the collectives before the mark have completed on the GPU (an event query: the
    /// host does not wait). Always for a mark of a group on the device's stream.
    pub fn is_reached(&self) -> bool {
        self.event.as_ref().is_none_or(CudaEvent::is_complete)
    }
}

impl ProcessGroup {
    /// The group of every rank of the run `env` describes (PyTorch's
    /// `init_process_group("nccl")`), on `dev` (the GPU of this process, usually
    /// `Device::new(env.local_rank)`). Rank 0 makes the NCCL unique id (`ncclGetUniqueId`) and
    /// hands it to the others through the TCP rendezvous at `MASTER_ADDR:MASTER_PORT`
    /// ([`rendezvous::broadcast_bytes`], bounded by `TE_DIST_TIMEOUT_S`); then every rank
    /// creates its communicator (`ncclCommInitRank`, which returns once every rank has joined).
    /// With `WORLD_SIZE` 1 there is no TCP. Every rank of the run must call it.
    ///
    /// # Errors
    /// [`Error::NcclMissing`] / [`Error::Nccl`] from [`nccl_available`]; [`Error::Dist`]: the
    /// rendezvous failed (see [`rendezvous::broadcast_bytes`]), rank 0 sent an id of the wrong
    /// size, a rank or world size NCCL cannot take; [`Error::Nccl`]: `ncclGetUniqueId` or
    /// `ncclCommInitRank` failed (two ranks on one GPU is `ncclInvalidUsage`); driver errors.
    pub fn init(dev: &Arc<Device>, env: &DistEnv) -> Result<Self> {
        let dist = |message: String| Error::Dist { message };
        if env.world_size == 0 || env.rank >= env.world_size || c_int::try_from(env.world_size).is_err() {
            return Err(dist(format!(
                "ProcessGroup::init: rank {} of world size {}: the rank must be below the world size, which must be \
                 in [1, {}]",
                env.rank,
                env.world_size,
                c_int::MAX
            )));
        }
        nccl_available()?;
        let make = || -> Result<Vec<u8>> {
            let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e, None))?;
            Ok(id.internal.iter().map(|&c| c as u8).collect())
        };
        let bytes = rendezvous::broadcast_bytes(env, make, rendezvous::timeout_from_env())?;
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if bytes.len() != id.internal.len() {
            return Err(dist(format!(
                "rank {}: rank 0 sent {} bytes as the NCCL unique id, not {}: do all ranks run the same build?",
                env.rank,
                bytes.len(),
                id.internal.len()
            )));
        }
        for (c, b) in id.internal.iter_mut().zip(&bytes) {
            *c = *b as std::ffi::c_char;
        }
        dev.context().bind_to_thread()?;
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` is a valid out-pointer; the world size and rank fit in c_int (checked);
        // the id is rank 0's, as NCCL requires. NCCL takes the current device (bound above).
        unsafe { result::comm_init_rank(&mut comm, env.world_size as c_int, id, env.rank as c_int) }
            .map_err(|e| nccl_error("ncclCommInitRank", e, None))?;
        Ok(Self::from_comm(comm, dev, env.rank, (0..env.world_size).collect()))
    }

    /// The group of the live communicator `comm` on the device's stream, rank `rank` of the
    /// global `ranks`, watched when it has more than one rank.
    fn from_comm(comm: sys::ncclComm_t, dev: &Arc<Device>, rank: usize, ranks: Vec<usize>) -> Self {
        let handle = Arc::new(AtomicPtr::new(comm));
        let comm = Arc::new(Mutex::new(RawComm(comm)));
        let watchdog = (ranks.len() > 1)
            .then(|| {
                let who = format!("rank {rank} of a group of {} (global ranks {ranks:?})", ranks.len());
                let (slot, ptr, ctx) = (comm.clone(), handle.clone(), dev.context().clone());
                let abort = Box::new(move || {
                    let raw = ptr.swap(std::ptr::null_mut(), Ordering::SeqCst);
                    if raw.is_null() {
                        return; // dropped or aborted already
                    }
                    // Unreachable for later calls when the lock is free; a thread blocked in an
                    // NCCL call holds it, and NCCL's abort ends that call.
                    if let Ok(mut c) = slot.try_lock() {
                        c.0 = std::ptr::null_mut();
                    }
                    let _ = ctx.bind_to_thread();
                    // SAFETY: the communicator was live (this swap took it first); ncclCommAbort
                    // may run while another thread is inside a call on it.
                    let _ = unsafe { result::comm_abort(raw) };
                });
                Watchdog::start(dev.context().clone(), who, rendezvous::timeout_from_env(), abort)
            })
            .flatten();
        Self {
            comm,
            handle,
            watchdog,
            stream: dev.stream().clone(),
            side: false,
            in_flight: Mutex::default(),
            dev: dev.clone(),
            rank,
            ranks,
        }
    }

    /// A group of this process alone (world size 1; no TCP): every collective is the identity
    /// (a copy for all-gather and reduce-scatter). For single-GPU runs of code written for groups.
    ///
    /// # Errors
    /// As [`ProcessGroup::init`].
    pub fn single(dev: &Arc<Device>) -> Result<Self> {
        Self::init(dev, &DistEnv { local_rank: dev.context().ordinal(), ..DistEnv::single() })
    }

    /// This process's rank in the group, `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The global rank (`RANK` of the run) of each member, by rank in this group.
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }

    /// The GPU the group's collectives run on (their stream is its stream).
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Sub-groups (`ncclCommSplit`): every rank `r` of this group with `color(r) = Some(c)` joins
    /// the group of color `c`, ranked in this group's order; ranks with `None` join none and get
    /// `None`. A sub-group runs its collectives where this group does (the device's stream, or
    /// this group's side stream, which it shares). Every rank of this group must call it with
    /// the same `color` (a function of the rank: Megatron's tensor-parallel groups are
    /// `|r| Some(r / tp)`, its data-parallel ones `|r| Some(r % tp)`); it returns once the ranks
    /// of this group have all called it.
    ///
    /// # Errors
    /// [`Error::Argument`]: a color above `i32::MAX`; [`Error::Nccl`]: `ncclCommSplit` failed;
    /// [`Error::Dist`]: the new group is not the one `color` describes (ranks passed different
    /// functions).
    pub fn split(&self, color: impl Fn(usize) -> Option<usize>) -> Result<Option<ProcessGroup>> {
        let op = "ProcessGroup::split";
        let colors: Vec<Option<usize>> = (0..self.size()).map(&color).collect();
        let mine = colors[self.rank];
        let nccl_color = match mine {
            None => -1, // NCCL_SPLIT_NOCOLOR
            Some(c) => c_int::try_from(c).map_err(|_| Error::Argument {
                op,
                message: format!("color {c} of rank {} is above {}: use smaller colors", self.rank, c_int::MAX),
            })?,
        };
        // Members of this rank's new group, by rank in this group (the key keeps that order).
        let members: Vec<usize> = (0..self.size()).filter(|&r| mine.is_some() && colors[r] == mine).collect();
        let mut new: sys::ncclComm_t = std::ptr::null_mut();
        let comm = self.live_comm(op)?;
        self.dev.context().bind_to_thread()?;
        // SAFETY: the communicator is live (owned by self, used under its lock); `new` is a
        // valid out-pointer; a null config makes the child inherit the parent's.
        unsafe { sys::ncclCommSplit(comm.0, nccl_color, self.rank as c_int, &mut new, std::ptr::null_mut()) }
            .result()
            .map_err(|e| nccl_error("ncclCommSplit", e, Some(comm.0)))?;
        drop(comm);
        if mine.is_none() || new.is_null() {
            return Ok(None);
        }
        let rank = members.iter().position(|&r| r == self.rank).unwrap_or(0);
        let mut group = ProcessGroup::from_comm(new, &self.dev, rank, members.iter().map(|&r| self.ranks[r]).collect());
        group.stream = self.stream.clone();
        group.side = self.side;
        // SAFETY: `new` is the live communicator NCCL just made.
        let (count, user_rank) = unsafe { (result::comm_count(new), result::comm_user_rank(new)) };
        let (count, user_rank) = (
            count.map_err(|e| nccl_error("ncclCommCount", e, Some(new)))?,
            user_rank.map_err(|e| nccl_error("ncclCommUserRank", e, Some(new)))?,
        );
        if count as usize != group.size() || user_rank as usize != group.rank {
            return Err(Error::Dist {
                message: format!(
                    "{op}: rank {} expected rank {} of a group of {} ({:?}), NCCL made rank {user_rank} of {count}: \
                     every rank must pass the same color function",
                    self.rank,
                    group.rank,
                    group.size(),
                    group.ranks
                ),
            });
        }
        Ok(Some(group))
    }

    /// The group of `ranks` (ranks of this group; PyTorch's `new_group(ranks)`): its members get
    /// it, ranked in sorted order of `ranks`, the other ranks `None`. Every rank of this group
    /// must call it with the same `ranks` (`ncclCommSplit`, as [`ProcessGroup::split`]).
    ///
    /// # Errors
    /// [`Error::Argument`]: `ranks` empty, with a rank twice or out of range; as
    /// [`ProcessGroup::split`].
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let members = group_members(self.size(), ranks)?;
        self.split(|r| members.binary_search(&r).is_ok().then_some(0))
    }

    /// The same ranks with a communicator of their own (`ncclCommSplit`, every rank in one
    /// color) whose collectives run on a new stream of this group's device. Each collective first
    /// waits for the work issued on the device's stream before it (the kernels that wrote its
    /// inputs); the device's stream does not wait for the collective until
    /// [`ProcessGroup::wait`]. Meanwhile the caller must not read or write the buffers (PyTorch's
    /// `async_op=True`); tensors are kept allocated until then even if the caller drops them,
    /// `CudaSlice<f32>` buffers must be kept by the caller. Every rank of this group must call it
    /// (collective).
    ///
    /// A communicator of its own keeps the order of collectives identical on every rank: the
    /// side stream's collectives are ordered among themselves, and never interleave with the
    /// device stream's collectives of this group.
    ///
    /// # Errors
    /// As [`ProcessGroup::split`]; driver errors creating the stream.
    pub fn with_side_stream(&self) -> Result<ProcessGroup> {
        let mut group = self.split(|_| Some(0))?.ok_or_else(|| {
            Error::internal("ProcessGroup::with_side_stream", "a split in which every rank has color 0 left a rank out")
        })?;
        group.stream = self.dev.stream().fork()?;
        group.side = true;
        Ok(group)
    }

    /// Makes the device's stream wait for every collective this group issued so far (PyTorch's
    /// `work.wait()`): work issued on the device's stream afterwards sees their results. A
    /// no-op for a group on the device's stream, whose collectives are ordered already.
    ///
    /// # Errors
    /// Driver errors.
    pub fn wait(&self) -> Result<()> {
        if self.side {
            self.dev.stream().join(&self.stream)?;
            // Freed from here on in the device stream's order, which now follows the collectives.
            self.in_flight.lock().unwrap_or_else(PoisonError::into_inner).release_all();
        }
        Ok(())
    }

    /// The point this side-stream group's collectives have reached (an event recorded on its
    /// stream after every collective issued so far, NCCL groups included once they ended),
    /// for [`ProcessGroup::wait_mark`]: how a data-parallel backward frees a bucket's
    /// gradients once its reductions are done, without waiting for the later buckets'
    /// (`te_nn::parallel::DataParallel` under ZeRO-2). A group on the device's stream returns a
    /// mark that is already reached.
    ///
    /// # Errors
    /// Driver errors recording the event.
    pub fn mark(&self) -> Result<SideMark> {
        if !self.side {
            return Ok(SideMark { event: None, held: 0 });
        }
        self.dev.context().bind_to_thread()?;
        let event = self.stream.record_event(Some(cuda::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        let held = self.in_flight.lock().unwrap_or_else(PoisonError::into_inner).issued();
        Ok(SideMark { event: Some(event), held })
    }

    /// Makes the device's stream wait for the collectives issued before `mark` (this group's
    /// [`ProcessGroup::mark`]), not for the later ones, and lets go of the tensors those
    /// collectives kept allocated: dropped by the caller, they are freed in the device stream's
    /// order, after the collectives that read them ([`ProcessGroup::wait`] for all of them). A
    /// no-op for a group on the device's stream.
    ///
    /// # Errors
    /// Driver errors.
    pub fn wait_mark(&self, mark: &SideMark) -> Result<()> {
        let Some(event) = &mark.event else { return Ok(()) };
        self.dev.context().bind_to_thread()?;
        self.dev.stream().wait(event)?;
        self.in_flight.lock().unwrap_or_else(PoisonError::into_inner).release_through(mark.held);
        Ok(())
    }

    /// Keeps `bufs` allocated until [`ProcessGroup::wait`] when the collectives run on a side
    /// stream.
    pub(super) fn hold<B: CommBuffer>(&self, buf: &B) {
        if self.side {
            if let Some(t) = buf.keep_alive() {
                self.in_flight.lock().unwrap_or_else(PoisonError::into_inner).hold(t);
            }
        }
    }

    /// Whether the collectives run on a side stream ([`ProcessGroup::with_side_stream`]).
    pub fn is_side_stream(&self) -> bool {
        self.side
    }

    /// Issues one NCCL call with the communicator and this group's stream, under the lock; a
    /// side stream first waits for the work issued on the device's stream.
    pub(super) fn issue(
        &self,
        op: &'static str,
        call: impl FnOnce(sys::ncclComm_t, sys::cudaStream_t) -> std::result::Result<NcclStatus, NcclError>,
    ) -> Result<()> {
        let comm = self.live_comm(op)?;
        self.dev.context().bind_to_thread()?;
        if self.side {
            let ready = self.dev.stream().record_event(Some(cuda::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
            self.stream.wait(&ready)?;
        }
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        // Watched from before the call: NCCL may block inside it (a peer's first connection).
        let ticket = self.watch_begin(op);
        let called = call(comm.0, stream).map(|_| ()).map_err(|e| nccl_error(op, e, Some(comm.0)));
        drop(comm);
        self.watch_end(ticket, called.is_ok())?;
        called
    }

    /// The communicator under its lock; [`Error::Dist`] once the watchdog aborted it (or it was
    /// aborted otherwise).
    fn live_comm(&self, op: &'static str) -> Result<std::sync::MutexGuard<'_, RawComm>> {
        if let Some(w) = &self.watchdog {
            w.check()?;
        }
        let comm = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
        if comm.0.is_null() || self.handle.load(Ordering::SeqCst).is_null() {
            if let Some(w) = &self.watchdog {
                w.check()?;
            }
            return Err(Error::Dist {
                message: format!("{op}: the group's communicator was aborted: make a new group"),
            });
        }
        Ok(comm)
    }

    /// Hands the collective about to be issued to the watchdog (not inside a CUDA graph
    /// capture, whose events belong to the graph): its ticket, `None` when unwatched.
    fn watch_begin(&self, op: &'static str) -> Option<u64> {
        match &self.watchdog {
            Some(w) if !self.dev.capturing() => Some(w.begin(op)),
            _ => None,
        }
    }

    /// The call of `ticket` returned (`ok`: it issued its work on the group's stream).
    fn watch_end(&self, ticket: Option<u64>, ok: bool) -> Result<()> {
        match (&self.watchdog, ticket) {
            (Some(w), Some(t)) => w.issued(t, ok.then_some(&*self.stream)),
            _ => Ok(()),
        }
    }

    /// Runs `f`, whose collectives (of this group, from this thread) become one NCCL group
    /// (`ncclGroupStart` … `ncclGroupEnd`): NCCL launches them together, as one bucket, instead
    /// of one kernel each. Every rank must issue the same collectives in the group. The group
    /// ends even when `f` fails.
    ///
    /// # Errors
    /// `f`'s error first; then [`Error::Nccl`] from `ncclGroupEnd` (where NCCL reports most
    /// failures of grouped calls).
    pub fn grouped<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        nccl_available()?;
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e, None))?;
        let out = f();
        // The events of the calls inside were recorded before NCCL launched them (at the end
        // of the group): this one follows them, watched from before the end (which may block).
        let ticket = self.watch_begin("ncclGroupEnd");
        let end = result::group_end().map_err(|e| nccl_error("ncclGroupEnd", e, None));
        self.watch_end(ticket, end.is_ok())?;
        let v = out?;
        end?;
        Ok(v)
    }

    /// Destroys the communicator without waiting for its pending work (`ncclCommAbort`): after a
    /// failed collective or a rank that died, where dropping (which waits) could hang.
    pub fn abort(self) {
        let comm = {
            let mut slot = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
            slot.0 = std::ptr::null_mut();
            self.handle.swap(std::ptr::null_mut(), Ordering::SeqCst)
        };
        if !comm.is_null() {
            let _ = self.dev.context().bind_to_thread();
            // SAFETY: the communicator is live and no longer reachable from `self`.
            let _ = unsafe { result::comm_abort(comm) };
        }
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        // Taken out under the lock and destroyed after it; a watchdog that took it first
        // aborts it instead.
        let comm = {
            let mut slot = self.comm.lock().unwrap_or_else(PoisonError::into_inner);
            slot.0 = std::ptr::null_mut();
            self.handle.swap(std::ptr::null_mut(), Ordering::SeqCst)
        };
        if comm.is_null() {
            return;
        }
        let _ = self.dev.context().bind_to_thread();
        // SAFETY: the communicator is live, owned by this group and used by no one else now.
        if let Err(e) = unsafe { result::comm_destroy(comm) } {
            tracing::warn!("ncclCommDestroy failed: {:?}", e.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A group can be shared by the modules of a model across threads (its calls are serialized
    /// by the lock around the communicator).
    #[test]
    fn groups_are_send_and_sync() {
        fn shareable<T: Send + Sync>() {}
        shareable::<ProcessGroup>();
        shareable::<SideMark>();
    }

    /// A mark lets go of what was held before it only, once; a full wait of everything; marks
    /// made after a full wait count on from there.
    #[test]
    fn marks_let_go_of_what_was_held_before_them() {
        let mut f = InFlight::<u32>::default();
        f.hold(1);
        f.hold(2);
        let first = f.issued();
        f.hold(3);
        let second = f.issued();
        assert_eq!((first, second), (2, 3));
        f.release_through(first);
        assert_eq!(f.held, [3]);
        f.release_through(first);
        assert_eq!(f.held, [3], "a mark reached already lets go of nothing more");
        f.hold(4);
        f.release_all();
        assert!(f.held.is_empty());
        assert_eq!(f.issued(), 4);
        f.release_through(second);
        f.hold(5);
        assert_eq!(f.held, [5], "a mark older than a full wait lets go of nothing");
        f.release_through(f.issued());
        assert!(f.held.is_empty() && f.issued() == 5);
    }
}
