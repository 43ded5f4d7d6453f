//! The collective watchdog of a [`ProcessGroup`](super::ProcessGroup) (PyTorch's NCCL watchdog
//! with `TORCH_NCCL_ASYNC_ERROR_HANDLING`): when a rank dies or stops issuing collectives, the
//! others wait in their next collective for ever (NCCL's kernels spin for the missing peer), and
//! the host thread waits with them at its next synchronization. No launcher on another node can
//! see it; this thread does.
//!
//! Each collective a group issues records an event after it on the group's stream
//! (`Watchdog::watch`); a thread of the group polls the oldest unfinished one. When one has
//! not completed `TE_DIST_TIMEOUT_S` seconds (default 300, [`super::rendezvous::timeout_from_env`])
//! after it was issued, the thread prints what happened and what to do, aborts the communicator
//! (`ncclCommAbort`: NCCL's kernels see the abort flag and return, so the host's wait ends),
//! marks the group aborted (its next collective is an [`Error::Dist`] that says so, which the
//! training loop returns: no checkpoint is written after it) and, if the process is still alive
//! [`EXIT_GRACE`] later, ends it with status [`DIST_TIMEOUT_EXIT`]: a rank never hangs.
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

/// How long an aborted process may take to end on its own before the watchdog ends it.
pub const EXIT_GRACE: Duration = Duration::from_secs(10);

/// The exit status of a process the watchdog ends (that of `te train`'s other errors).
pub const DIST_TIMEOUT_EXIT: i32 = 1;

/// One collective in flight: the event recorded after it, when and what was issued.
struct Pending {
    event: CudaEvent,
    issued: Instant,
    op: &'static str,
}

/// What the polling thread and the group share.
struct Shared {
    pending: Mutex<VecDeque<Pending>>,
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
        let shared =
            Arc::new(Shared { pending: Mutex::default(), aborted: AtomicBool::new(false), timeout, who, ctx, abort });
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

    /// Watches the collective `op` just issued on `stream`: an event recorded after it, which
    /// must complete within the timeout. Also forgets the collectives already done.
    ///
    /// # Errors
    /// Driver errors recording the event.
    pub(crate) fn watch(&self, stream: &CudaStream, op: &'static str) -> Result<()> {
        let event = stream.record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        let mut q = self.shared.pending.lock().unwrap_or_else(PoisonError::into_inner);
        while q.front().is_some_and(|p| p.event.is_complete()) {
            q.pop_front();
        }
        q.push_back(Pending { event, issued: Instant::now(), op });
        Ok(())
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
        // A failed query (an error of earlier work) ends the watch of that event: the stream's
        // next synchronization reports the error itself.
        while q.front().is_some_and(|p| p.event.try_is_complete().unwrap_or(true)) {
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
        (self.abort)();
        std::thread::sleep(EXIT_GRACE);
        std::process::exit(DIST_TIMEOUT_EXIT);
    }
}
