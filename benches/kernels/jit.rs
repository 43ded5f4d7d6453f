//! JIT costs: NVRTC compile time per kernel, a kernel load from a warm disk cache (render, key,
//! read, checksum, and the module load when a GPU is present), and `te prewarm` of the
//! hidden 4096 / FFN 16384 model, on whatever machine runs the bench.

use crate::harness::{Bench, Stats, Target};
use std::time::Instant;
use te_codegen::prewarm::prewarm;
use te_codegen::{Arch, DiskCache, KernelCompiler};
use te_nn::prewarm::ModelConfig;

pub fn run(b: &mut Bench) {
    if !b.enabled("jit") {
        return;
    }
    let arch = b.dev.as_ref().map(|d| d.arch()).unwrap_or(Arch::Sm90a);
    let specs = ModelConfig::new(4096, 16384, 32).kernel_specs(arch);
    let dir = tempfile::tempdir().expect("tempdir");

    // NVRTC compile per kernel, one at a time, no cache.
    let nocache = KernelCompiler::new(DiskCache::disabled()).expect("NVRTC");
    let compile_ms: Vec<f64> = specs
        .iter()
        .map(|s| {
            let t = Instant::now();
            nocache.compile(s).expect("compile");
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    b.record(
        "jit: NVRTC compile per kernel",
        &format!("{} kernels", specs.len()),
        Stats::from_samples(compile_ms),
        None,
        Some(Target::MaxMicros(60_000.0)),
    );

    // Prewarm with 2 workers into an empty cache.
    let cached = KernelCompiler::new(DiskCache::at(dir.path())).expect("NVRTC");
    let t = Instant::now();
    let report = prewarm(&cached, &specs, 2, |_, _| {}).expect("prewarm");
    let us = t.elapsed().as_secs_f64() * 1e6;
    assert_eq!(report.compiled, specs.len());
    b.record(
        "jit: te prewarm h4096/ffn16384, 2 workers",
        &format!("{} kernels", specs.len()),
        Stats { median_us: us, min_us: us, max_us: us },
        None,
        Some(Target::MaxMicros(10_000_000.0)),
    );

    // Warm disk cache: a fresh compiler (empty in-process state) per load.
    let load_us: Vec<f64> = specs
        .iter()
        .map(|s| {
            let c = KernelCompiler::new(DiskCache::at(dir.path())).expect("NVRTC");
            let t = Instant::now();
            let (bin, outcome) = c.compile(s).expect("cached");
            assert_eq!(outcome, te_codegen::CompileOutcome::Cached);
            if let Some(dev) = &b.dev {
                let m = dev.context().load_module(cudarc::nvrtc::Ptx::from_binary(bin.bytes)).expect("module load");
                drop(m);
            }
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    let what = if b.dev.is_some() {
        "jit: warm disk cache → loaded module"
    } else {
        "jit: warm disk cache → binary (no GPU)"
    };
    b.record(
        what,
        &format!("{} kernels", specs.len()),
        Stats::from_samples(load_us),
        None,
        Some(Target::MaxMicros(2_000.0)),
    );
}
