//! Compiling a kernel list ahead of time: [`prewarm`] fills the disk cache with NVRTC, on any
//! machine (no GPU needed), and reports what became of each kernel ([`PrewarmReport`]);
//! [`sorted`] is the form kernel lists are handed over in. What a model runs is listed by
//! `te-runtime` (its module configs' `kernel_specs`, `ModelConfig` of `te prewarm --config`).

use crate::compiler::{CompileOutcome, KernelCompiler};
use crate::{Error, KernelSpec, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Sorts and deduplicates `specs`: the form kernel lists are returned in (by [`crate::catalog`],
/// and by `te-runtime`'s model and module lists).
pub fn sorted(mut specs: Vec<KernelSpec>) -> Vec<KernelSpec> {
    specs.sort();
    specs.dedup();
    specs
}

/// What became of one kernel in a [`prewarm`] run.
#[derive(Debug)]
pub enum KernelStatus {
    /// Compiled by NVRTC now and written to the disk cache (when the cache is enabled).
    Compiled,
    /// Already in the disk cache.
    Cached,
    /// Not prewarmed: the spec, its template or NVRTC failed, or the disk cache could not store
    /// the binary ([`Error::CacheWrite`]).
    Failed(Error),
}

/// One kernel of a [`prewarm`] run.
#[derive(Debug)]
pub struct PrewarmedKernel {
    /// The kernel.
    pub spec: KernelSpec,
    /// What became of it.
    pub status: KernelStatus,
}

/// What a [`prewarm`] run did.
#[derive(Debug, Default)]
pub struct PrewarmReport {
    /// Kernels compiled by NVRTC now (and written to the disk cache, when it is enabled).
    pub compiled: usize,
    /// Kernels already in the disk cache.
    pub cached: usize,
    /// Every kernel with its status, in the order of the list given.
    pub kernels: Vec<PrewarmedKernel>,
    /// Wall time.
    pub elapsed: Duration,
}

impl PrewarmReport {
    /// The report of `kernels`, counted.
    fn new(kernels: Vec<PrewarmedKernel>, elapsed: Duration) -> Self {
        let count = |f: fn(&KernelStatus) -> bool| kernels.iter().filter(|k| f(&k.status)).count();
        let compiled = count(|s| matches!(s, KernelStatus::Compiled));
        let cached = count(|s| matches!(s, KernelStatus::Cached));
        Self { compiled, cached, kernels, elapsed }
    }

    /// The kernels that failed, with their errors.
    pub fn failures(&self) -> impl Iterator<Item = (&KernelSpec, &Error)> {
        self.kernels.iter().filter_map(|k| match &k.status {
            KernelStatus::Failed(e) => Some((&k.spec, e)),
            KernelStatus::Compiled | KernelStatus::Cached => None,
        })
    }

    /// Whether every kernel is in the disk cache (compiled and stored now, or found there).
    pub fn is_complete(&self) -> bool {
        self.failures().next().is_none()
    }

    /// `<n> of <total> kernels were not prewarmed:` and a line per failed kernel: its name and
    /// error (what [`Error::Prewarm`] displays).
    pub fn failure_summary(&self) -> String {
        let mut s = format!("{} of {} kernels were not prewarmed:", self.failures().count(), self.kernels.len());
        for (spec, e) in self.failures() {
            s.push_str(&format!("\n  {}: {e}", spec.name()));
        }
        s
    }
}

/// Compiles `specs` into the compiler's disk cache with `workers` threads, calling `progress`
/// after each kernel (failed ones included). Every kernel is tried, and one compiled now must
/// reach the disk cache when it is enabled ([`KernelCompiler::compile_persisted`]).
///
/// # Errors
/// [`Error::Prewarm`] when any kernel failed (an invalid spec, a render or compile error, or a
/// cache write error): its report has every kernel's status.
pub fn prewarm(
    compiler: &KernelCompiler,
    specs: &[KernelSpec],
    workers: usize,
    progress: impl Fn(&KernelSpec, &KernelStatus) + Sync,
) -> Result<PrewarmReport> {
    let start = Instant::now();
    let next = AtomicUsize::new(0);
    let work = || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let Some(spec) = specs.get(i) else { break };
            let status = match compiler.compile_persisted(spec) {
                Ok((_, CompileOutcome::Compiled)) => KernelStatus::Compiled,
                Ok((_, CompileOutcome::Cached)) => KernelStatus::Cached,
                Err(e) => KernelStatus::Failed(e),
            };
            progress(spec, &status);
            done.push((i, PrewarmedKernel { spec: spec.clone(), status }));
        }
        done
    };
    let mut done: Vec<(usize, PrewarmedKernel)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers.clamp(1, specs.len().max(1))).map(|_| s.spawn(work)).collect();
        // A worker panics only if `progress` does: that panic goes on to the caller.
        handles.into_iter().flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    done.sort_by_key(|(i, _)| *i);
    let report = PrewarmReport::new(done.into_iter().map(|(_, k)| k).collect(), start.elapsed());
    if report.is_complete() {
        Ok(report)
    } else {
        Err(Error::Prewarm { report: Box::new(report) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::CastSpec;
    use crate::{Arch, DType, DiskCache};

    fn compiler(cache: DiskCache) -> KernelCompiler {
        KernelCompiler::new(cache).expect("NVRTC must be loadable: source scripts/env.sh, which installs it")
    }

    fn specs() -> Vec<KernelSpec> {
        vec![
            CastSpec::quantize(DType::BF16, DType::E4M3, Arch::Sm90a).into(),
            // Invalid: quantize goes from a 16/32-bit type to FP8.
            CastSpec::quantize(DType::E4M3, DType::BF16, Arch::Sm90a).into(),
            CastSpec::amax(DType::BF16, Arch::Sm90a).into(),
        ]
    }

    fn failed_report(r: Result<PrewarmReport>) -> PrewarmReport {
        match r {
            Err(Error::Prewarm { report }) => *report,
            other => panic!("expected Error::Prewarm, got {other:?}"),
        }
    }

    #[test]
    fn reports_each_kernel_and_fails_on_any_failure() {
        let dir = tempfile::tempdir().unwrap();
        let c = compiler(DiskCache::at(dir.path()));
        let specs = specs();
        let seen = AtomicUsize::new(0);
        let report = failed_report(prewarm(&c, &specs, 2, |_, _| {
            seen.fetch_add(1, Ordering::Relaxed);
        }));
        assert_eq!(seen.into_inner(), 3, "progress is called for failed kernels too");
        assert_eq!((report.compiled, report.cached, report.kernels.len()), (2, 0, 3));
        let in_order: Vec<_> = report.kernels.iter().map(|k| k.spec.clone()).collect();
        assert_eq!(in_order, specs, "the report keeps the order of the list");
        assert!(matches!(report.kernels[1].status, KernelStatus::Failed(Error::InvalidSpec { .. })));
        assert!(!report.is_complete());
        let summary = report.failure_summary();
        assert!(summary.starts_with("1 of 3 kernels were not prewarmed:"), "{summary}");
        assert!(summary.contains(&format!("\n  {}: invalid kernel spec", specs[1].name())), "{summary}");

        // The valid ones are in the cache now.
        let ok = [specs[0].clone(), specs[2].clone()];
        let report = prewarm(&compiler(DiskCache::at(dir.path())), &ok, 2, |_, _| {}).unwrap();
        assert_eq!((report.compiled, report.cached), (0, 2));
        assert!(report.is_complete() && report.kernels.iter().all(|k| matches!(k.status, KernelStatus::Cached)));
    }

    #[test]
    fn an_unwritable_cache_fails_every_kernel_it_compiles() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, b"not a directory").unwrap();
        let c = compiler(DiskCache::at(&file));
        let ok = [specs()[0].clone(), specs()[2].clone()];
        let report = failed_report(prewarm(&c, &ok, 2, |_, _| {}));
        assert_eq!((report.compiled, report.cached, report.failures().count()), (0, 0, 2));
        for (_, e) in report.failures() {
            assert!(matches!(e, Error::CacheWrite { dir, .. } if *dir == file), "{e}");
        }
        let msg = Error::Prewarm { report: Box::new(report) }.to_string();
        assert!(msg.contains("cannot write the kernel cache at") && msg.contains("is not a directory"), "{msg}");
        assert!(msg.contains("set TE_KERNEL_CACHE_DIR to a writable directory"), "{msg}");
        // The lenient path (te train, te embed) still works, from memory.
        assert_eq!(c.compile(&ok[0]).unwrap().1, CompileOutcome::Compiled);
    }
}
