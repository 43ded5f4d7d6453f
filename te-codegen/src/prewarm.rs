//! Compiling a kernel list ahead of time: [`prewarm`] fills the disk cache with NVRTC, on any
//! machine (no GPU needed); [`sorted`] is the form kernel lists are handed over in. What a model
//! runs is listed by `te-runtime` (its module configs' `kernel_specs`, `ModelConfig` of
//! `te prewarm --config`).

use crate::compiler::{CompileOutcome, KernelCompiler};
use crate::{Error, KernelSpec, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Sorts and deduplicates `specs`: the form kernel lists are returned in (by [`crate::catalog`],
/// and by `te-runtime`'s model and module lists).
pub fn sorted(mut specs: Vec<KernelSpec>) -> Vec<KernelSpec> {
    specs.sort();
    specs.dedup();
    specs
}

/// What a [`prewarm`] run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrewarmReport {
    /// Kernels compiled by NVRTC now.
    pub compiled: usize,
    /// Kernels already in the disk cache.
    pub cached: usize,
    /// Wall time.
    pub elapsed: Duration,
}

/// Compiles `specs` into the compiler's disk cache with `workers` threads, calling `progress`
/// after each kernel. Stops at the first error.
///
/// # Errors
/// The first compile error (see [`crate::Error`]).
pub fn prewarm(
    compiler: &KernelCompiler,
    specs: &[KernelSpec],
    workers: usize,
    progress: impl Fn(&KernelSpec, CompileOutcome) + Sync,
) -> Result<PrewarmReport> {
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let compiled = AtomicUsize::new(0);
    let cached = AtomicUsize::new(0);
    let first_error: Mutex<Option<Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..workers.clamp(1, specs.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(spec) = specs.get(i) else { break };
                if first_error.lock().map(|e| e.is_some()).unwrap_or(true) {
                    break;
                }
                match compiler.compile(spec) {
                    Ok((_, outcome)) => {
                        match outcome {
                            CompileOutcome::Compiled => compiled.fetch_add(1, Ordering::Relaxed),
                            CompileOutcome::Cached => cached.fetch_add(1, Ordering::Relaxed),
                        };
                        progress(spec, outcome);
                    }
                    Err(e) => {
                        if let Ok(mut slot) = first_error.lock() {
                            slot.get_or_insert(e);
                        }
                        break;
                    }
                }
            });
        }
    });
    if let Some(e) = first_error.into_inner().ok().flatten() {
        return Err(e);
    }
    Ok(PrewarmReport { compiled: compiled.into_inner(), cached: cached.into_inner(), elapsed: start.elapsed() })
}
