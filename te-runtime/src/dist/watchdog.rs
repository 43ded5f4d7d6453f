//! The collective watchdog of a [`ProcessGroup`](super::ProcessGroup) (PyTorch's NCCL watchdog
//! with `TORCH_NCCL_ASYNC_ERROR_HANDLING`): when a rank dies or stops issuing collectives, the
//! others wait in their next collective for ever (NCCL's kernels spin for the missing peer), and
//! the host thread waits with them at its next synchronization. No launcher on another node can
//! see it; this thread does.
//!
//! Each collective a group issues is watched from before its NCCL call (`Watchdog::begin`: a
//! call can block on the host, connecting to a dead peer at its first use of a channel) and
//! records an event after it on the group's stream once the call returns (`Watchdog::issued`);
//! a thread of the group polls the oldest unfinished one. When one has
//! not completed `TE_DIST_TIMEOUT_S` seconds (default 300, [`super::rendezvous::timeout_from_env`])
//! after it was issued, the thread prints what happened and what to do, aborts the communicator
//! (`ncclCommAbort`: NCCL's kernels see the abort flag and return, so the host's wait ends),
//! marks the group aborted (its next collective is an [`Error::Dist`] that says so, which the
//! training loop returns: no checkpoint is written after it) and, if the process is still alive
//! [`EXIT_GRACE`] later, ends it with status [`DIST_TIMEOUT_EXIT`] (`_exit`, from a thread
//! started before the abort, which may itself wait for the hung kernel): a rank never hangs.
//!
//! Collectives recorded inside a CUDA graph capture are not watched (their events belong to the
//! graph); a group of one process has no watchdog (its collectives wait for no one).

use crate::{Error, Result};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long an aborted process may take to end on its own before the watchdog ends it: short
/// enough that a survivor of a dead rank is gone within `TE_DIST_TIMEOUT_S` + 10 s counting the
/// watchdog's polling, long enough for the training loop to return its error and print it.
pub const EXIT_GRACE: Duration = Duration::from_secs(5);

/// The exit status of a process the watchdog ends (that of `te train`'s other errors).
pub const DIST_TIMEOUT_EXIT: i32 = 1;

/// One collective in flight: the event recorded after it, when and what was issued.
struct Pending {
    /// Recorded after the call returned; `None` while the host is still inside the NCCL call
    /// (a call can block on the host: connecting to a peer at its first use of a channel).
    event: Option<CudaEvent>,
    issued: Instant,
    op: &'static str,
    ticket: u64,
}

impl Pending {
    /// Done: its event completed (or cannot be queried: the stream's next synchronization
    /// reports that error itself).
    fn done(&self) -> bool {
        self.event.as_ref().is_some_and(|e| e.try_is_complete().unwrap_or(true))
    }
}

/// What the polling thread and the group share.
struct Shared {
    pending: Mutex<VecDeque<Pending>>,
    next_ticket: std::sync::atomic::AtomicU64,
    aborted: AtomicBool,
    timeout: Duration,
    /// "rank 1 of a group of 2 (global ranks [0, 1])".
    who: String,
    ctx: Arc<CudaContext>,
    /// Aborts the group's communicator (`ncclCommAbort`; a no-op once it is gone).
    abort: Box<dyn Fn() + Send + Sync>,
}

/// The watchdog of one group: the collectives in flight and the thread that polls them. The
/// thread ends at its next poll after the watchdog is dropped.
pub(crate) struct Watchdog {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Watchdog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchdog").field("who", &self.shared.who).field("timeout", &self.shared.timeout).finish()
    }
}

impl Watchdog {
    /// Starts the watchdog of the group `who` describes, on `ctx`, timing out after `timeout`;
    /// `abort` aborts the group's communicator. `None` when the thread cannot be started (the
    /// group then runs unwatched, as before; a warning says so).
    pub(crate) fn start(
        ctx: Arc<CudaContext>,
        who: String,
        timeout: Duration,
        abort: Box<dyn Fn() + Send + Sync>,
    ) -> Option<Self> {
        let shared = Arc::new(Shared {
            pending: Mutex::default(),
            next_ticket: std::sync::atomic::AtomicU64::new(0),
            aborted: AtomicBool::new(false),
            timeout,
            who,
            ctx,
            abort,
        });
        let weak = Arc::downgrade(&shared);
        let poll = (timeout / 20).clamp(Duration::from_millis(10), Duration::from_secs(1));
        let spawned = std::thread::Builder::new().name("te-nccl-watchdog".into()).spawn(move || loop {
            std::thread::sleep(poll);
            let Some(s) = weak.upgrade() else { return };
            if let Some((op, waited)) = s.overdue() {
                s.fire(op, waited);
                return;
            }
        });
        match spawned {
            Ok(_) => Some(Self { shared }),
            Err(e) => {
                tracing::warn!("no NCCL watchdog for {}: cannot start its thread: {e}", shared.who);
                None
            }
        }
    }

    /// Starts watching the collective `op` the caller is about to issue: from now on it must
    /// complete within the timeout, also if the NCCL call itself blocks on the host. Returns
    /// the ticket [`Watchdog::issued`] takes once the call returned.
    pub(crate) fn begin(&self, op: &'static str) -> u64 {
        let ticket = self.shared.next_ticket.fetch_add(1, Ordering::SeqCst);
        let mut q = self.shared.pending.lock().unwrap_or_else(PoisonError::into_inner);
        while q.front().is_some_and(Pending::done) {
            q.pop_front();
        }
        q.push_back(Pending { event: None, issued: Instant::now(), op, ticket });
        ticket
    }

    /// The call of `ticket` returned: `Some(stream)` records an event after the work it issued
    /// there, which must complete within the timeout counted from [`Watchdog::begin`]; `None`
    /// (the call failed, nothing was issued) forgets it.
    ///
    /// # Errors
    /// Driver errors recording the event.
    pub(crate) fn issued(&self, ticket: u64, stream: Option<&CudaStream>) -> Result<()> {
        let event = stream.map(|s| s.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))).transpose();
        let mut q = self.shared.pending.lock().unwrap_or_else(PoisonError::into_inner);
        let at = q.iter().position(|p| p.ticket == ticket);
        match (event, at) {
            (Ok(Some(e)), Some(i)) => {
                q[i].event = Some(e);
                Ok(())
            }
            (Ok(_), at) => {
                at.and_then(|i| q.remove(i));
                Ok(())
            }
            (Err(e), at) => {
                at.and_then(|i| q.remove(i));
                Err(e.into())
            }
        }
    }

    /// [`Error::Dist`] once the watchdog aborted the group.
    ///
    /// # Errors
    /// As said.
    pub(crate) fn check(&self) -> Result<()> {
        match self.shared.aborted.load(Ordering::SeqCst) {
            true => Err(Error::Dist { message: self.shared.aborted_message() }),
            false => Ok(()),
        }
    }
}

impl Shared {
    /// The oldest collective still running past the timeout: its name and how long it waited.
    fn overdue(&self) -> Option<(&'static str, Duration)> {
        let _ = self.ctx.bind_to_thread();
        let mut q = self.pending.lock().unwrap_or_else(PoisonError::into_inner);
        while q.front().is_some_and(Pending::done) {
            q.pop_front();
        }
        q.front().filter(|p| p.issued.elapsed() > self.timeout).map(|p| (p.op, p.issued.elapsed()))
    }

    /// The message of a group the watchdog aborted.
    fn aborted_message(&self) -> String {
        format!(
            "{}: the communicator was aborted because a collective did not complete within TE_DIST_TIMEOUT_S = {} s \
             (another rank died or stopped issuing collectives): restart the run (te train --resume continues from \
             the newest complete checkpoint)",
            self.who,
            self.timeout.as_secs_f64()
        )
    }

    /// Reports `op`, aborts the communicator, and ends the process if it does not end itself.
    fn fire(&self, op: &'static str, waited: Duration) {
        eprintln!(
            "error: distributed run: {}: NCCL {op} issued {:.1} s ago has not completed (TE_DIST_TIMEOUT_S = {} s): \
             another rank died or stopped issuing collectives. Aborting the communicator; this process exits with \
             status {DIST_TIMEOUT_EXIT} unless it ends within {} s. Restart the run (te train --resume continues from \
             the newest complete checkpoint).",
            self.who,
            waited.as_secs_f64(),
            self.timeout.as_secs_f64(),
            EXIT_GRACE.as_secs()
        );
        self.aborted.store(true, Ordering::SeqCst);
        // The deadline runs on a thread of its own, started before the abort: `ncclCommAbort`
        // itself may wait for the hung kernel, and the process must end all the same.
        let reaper = std::thread::Builder::new().name("te-dist-reaper".into()).spawn(|| {
            std::thread::sleep(EXIT_GRACE);
            end_process();
        });
        (self.abort)();
        match reaper {
            Ok(r) => {
                let _ = r.join();
            }
            Err(_) => {
                std::thread::sleep(EXIT_GRACE);
                end_process();
            }
        }
    }
}

/// Ends the process now with [`DIST_TIMEOUT_EXIT`], without exit handlers: `exit` would run the
/// CUDA runtime's and NCCL's teardown, which waits for the hung kernel (a survivor of a dead
/// rank stayed alive past its deadline that way); `_exit` leaves the cleanup to the kernel and
/// the driver, as a SIGKILL would.
fn end_process() {
    use std::io::Write;
    let _ = std::io::stderr().flush();
    // SAFETY: `_exit` ends the process at once; nothing after it runs and it takes no pointers.
    unsafe { libc::_exit(DIST_TIMEOUT_EXIT) }
}
