//! Timing harness: CUDA-event timing after warm-up, median and spread over repeats, bandwidth
//! against the device's copy bandwidth measured in the same run (or TFLOP/s for compute-bound
//! rows), a printed table and JSON. Rows with a [`Work`] also carry the keys on which
//! `benches/compare.py` joins them with the PyTorch anchors' rows.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use serde_json::json;
use std::sync::Arc;
use te_runtime::Device;

/// Median, min and max of one measurement, in microseconds.
#[derive(Debug, Clone, Copy)]
pub struct Stats {
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Stats {
    pub fn from_samples(mut us: Vec<f64>) -> Stats {
        us.sort_by(|a, b| a.total_cmp(b));
        Stats { median_us: us[us.len() / 2], min_us: us[0], max_us: us[us.len() - 1] }
    }
}

/// Times 3 generations of `new_tokens` tokens, the first a warm-up (it loads the kernels and
/// captures the graphs): `generate(mark)` runs one and calls `mark()` when the first new token
/// is drawn. Returns the prefill time (the prompts and the first token) and the time a step
/// over the other `new_tokens − 1` steps, in µs.
pub fn time_generation(new_tokens: usize, mut generate: impl FnMut(&mut dyn FnMut())) -> (Stats, Stats) {
    let mut runs = Vec::new();
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let mut first = None;
        generate(&mut || {
            first.get_or_insert_with(std::time::Instant::now);
        });
        let end = std::time::Instant::now();
        let first = first.unwrap_or(end);
        runs.push(((first - start).as_secs_f64() * 1e6, (end - first).as_secs_f64() * 1e6));
    }
    let timed = &runs[1..];
    let steps = new_tokens.saturating_sub(1).max(1) as f64;
    (
        Stats::from_samples(timed.iter().map(|r| r.0).collect()),
        Stats::from_samples(timed.iter().map(|r| r.1 / steps).collect()),
    )
}

/// One result row.
#[derive(Debug, Clone)]
pub struct Row {
    pub name: String,
    pub shape: String,
    pub stats: Stats,
    /// Bytes read + written (memory-bound rows).
    pub bytes: Option<u64>,
    /// Floating-point operations (compute-bound rows, e.g. `2·m·n·k` for a GEMM).
    pub flops: Option<u64>,
    /// Target as a fraction of copy bandwidth (bandwidth rows) or a time in µs (time rows).
    pub target: Option<Target>,
    /// The comparison keys (rows that have a PyTorch anchor).
    pub work: Option<Work>,
}

/// A row that `benches/compare.py` compares with the anchors' rows of the same `work`, `shape`
/// and `pass`. The anchors write the same fields (`benches/anchors/common.py`).
#[derive(Debug, Clone)]
pub struct Work {
    /// `gemm`, `attention`, `modules`, `gpt` or `generate`: the table the row goes to.
    pub section: &'static str,
    /// What runs: `linear`, `layernorm_mlp`, `gpt small`, `gemm`, ...
    pub work: String,
    /// `fwd`, `bwd`, `fwd+bwd`, `optimizer`, `step`, `gemm`, `prefill` or `decode step`.
    pub pass: &'static str,
    /// Which implementation: `ours bf16`, `ours fp8 delayed`, `ours fp8 current`, ...
    pub variant: String,
    /// `fp8` when the GEMMs run in FP8, else `bf16`.
    pub precision: &'static str,
    /// FLOPs of the row that run at the FP8 GEMM rate; the rest of `Row::flops` runs at the
    /// BF16 rate (compare.py's roofline floor).
    pub flops_fp8: u64,
    /// Tokens processed (GPT steps, a generation's prefill; sequences of a decode step): tokens/s.
    pub tokens: Option<u64>,
}

/// Events recorded between the phases of one timed step (see [`Bench::time_phases`]).
pub struct Marks<'a> {
    stream: &'a Arc<CudaStream>,
    events: Vec<CudaEvent>,
}

impl Marks<'_> {
    /// Ends the current phase (call it after each phase, the last one included).
    pub fn mark(&mut self) {
        self.events.push(self.stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event"));
    }
}

/// Per-phase and whole-step statistics of [`Bench::time_phases`].
#[derive(Debug, Clone)]
pub struct PhaseStats {
    pub phases: Vec<Stats>,
    pub total: Stats,
}

#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// Achieved bandwidth ≥ this fraction of the copy bandwidth.
    CopyFraction(f64),
    /// Median time ≤ this many µs.
    MaxMicros(f64),
}

/// A derived figure (a speedup, a memory ratio) and its bound.
#[derive(Debug, Clone)]
pub struct Ratio {
    pub name: String,
    pub value: f64,
    /// `(at_least, bound)`: the target is `value ≥ bound` or `value ≤ bound`.
    pub target: Option<(bool, f64)>,
}

pub struct Bench {
    pub dev: Option<Arc<Device>>,
    pub copy_gbps: f64,
    pub rows: Vec<Row>,
    pub ratios: Vec<Ratio>,
    filters: Vec<String>,
}

impl Bench {
    /// A bench running the benchmarks whose names contain one of `filters` (all when empty).
    pub fn new(dev: Option<Arc<Device>>, filters: Vec<String>) -> Bench {
        Bench { dev, copy_gbps: 0.0, rows: Vec::new(), ratios: Vec::new(), filters }
    }

    /// Whether benchmarks named `name` were asked for.
    pub fn enabled(&self, name: &str) -> bool {
        self.filters.is_empty() || self.filters.iter().any(|f| name.contains(f.as_str()))
    }

    pub fn dev(&self) -> &Arc<Device> {
        self.dev.as_ref().expect("GPU benches run only with a device")
    }

    /// Times `launch(i)` (`i` = iteration, for rotating buffers) with CUDA events around each
    /// call, after `warmup` untimed calls.
    pub fn time(&self, warmup: usize, iters: usize, mut launch: impl FnMut(usize)) -> Stats {
        let dev = self.dev();
        let s = dev.stream();
        for i in 0..warmup {
            launch(i);
        }
        s.synchronize().expect("warm-up failed");
        let mut events = Vec::with_capacity(iters);
        for i in 0..iters {
            let a = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
            launch(warmup + i);
            let b = s.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).expect("event");
            events.push((a, b));
        }
        s.synchronize().expect("timed launches failed");
        Stats::from_samples(events.iter().map(|(a, b)| a.elapsed_ms(b).expect("elapsed") as f64 * 1e3).collect())
    }

    /// Per-call time (µs) of `body` replayed from a CUDA graph of `reps` copies: launch gaps
    /// inside a graph count, host launch costs do not (a decode step runs so). One eager call
    /// first loads every kernel and picks every GEMM algorithm.
    pub fn graphed(&self, reps: usize, mut body: impl FnMut()) -> Stats {
        let dev = self.dev().clone();
        body();
        dev.stream().synchronize().unwrap();
        let (graph, ()) = te_runtime::graph::Graph::capture(&dev, || {
            for _ in 0..reps {
                body();
            }
            Ok(())
        })
        .unwrap();
        let st = self.time(3, 20, |_| graph.replay().unwrap());
        let per = |us: f64| us / reps as f64;
        Stats { median_us: per(st.median_us), min_us: per(st.min_us), max_us: per(st.max_us) }
    }

    /// Times a step of `phases` consecutive phases (e.g. forward, backward) with one CUDA event
    /// before the step and one after each phase: `step` calls [`Marks::mark`] once after each
    /// phase. `warmup` untimed steps first (their marks are recorded and ignored).
    ///
    /// # Panics
    /// When `step` marks a number of phases other than `phases`.
    pub fn time_phases(
        &self,
        warmup: usize,
        iters: usize,
        phases: usize,
        mut step: impl FnMut(&mut Marks),
    ) -> PhaseStats {
        let stream = self.dev().stream();
        let mut run = || {
            let mut m = Marks { stream, events: Vec::with_capacity(phases + 1) };
            m.mark();
            step(&mut m);
            assert_eq!(m.events.len(), phases + 1, "the step marked {} phases, expected {phases}", m.events.len() - 1);
            m.events
        };
        for _ in 0..warmup {
            run();
        }
        stream.synchronize().expect("warm-up failed");
        let steps: Vec<Vec<CudaEvent>> = (0..iters).map(|_| run()).collect();
        stream.synchronize().expect("timed steps failed");
        let us = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).expect("elapsed") as f64 * 1e3;
        PhaseStats {
            phases: (0..phases)
                .map(|p| Stats::from_samples(steps.iter().map(|e| us(&e[p], &e[p + 1])).collect()))
                .collect(),
            total: Stats::from_samples(steps.iter().map(|e| us(&e[0], &e[phases])).collect()),
        }
    }

    /// Measures device-to-device copy bandwidth (bytes read + written) on a 1 GiB buffer.
    pub fn measure_copy_bandwidth(&mut self) {
        let dev = self.dev().clone();
        let n = 1usize << 30;
        let src = dev.stream().alloc_zeros::<u8>(n).expect("alloc");
        let mut dst = dev.stream().alloc_zeros::<u8>(n).expect("alloc");
        let st = self.time(3, 20, |_| dev.stream().memcpy_dtod(&src, &mut dst).expect("copy"));
        self.copy_gbps = 2.0 * n as f64 / (st.median_us * 1e-6) / 1e9;
        self.rows.push(Row {
            name: "device copy (memcpy DtoD)".into(),
            shape: "1 GiB".into(),
            stats: st,
            bytes: Some(2 * n as u64),
            flops: None,
            target: None,
            work: None,
        });
    }

    pub fn record(&mut self, name: &str, shape: &str, stats: Stats, bytes: Option<u64>, target: Option<Target>) {
        self.rows.push(Row { name: name.into(), shape: shape.into(), stats, bytes, flops: None, target, work: None });
    }

    /// Records a row that has anchors: named `work pass variant`, with its `flops` (of which
    /// `work.flops_fp8` at the FP8 rate) and the `bytes` that bound it when it has no FLOPs.
    pub fn record_work(&mut self, shape: &str, stats: Stats, flops: u64, bytes: Option<u64>, work: Work) {
        self.rows.push(Row {
            name: format!("{} {} {}", work.work, work.pass, work.variant),
            shape: shape.into(),
            stats,
            bytes,
            flops: (flops > 0).then_some(flops),
            target: None,
            work: Some(work),
        });
    }

    /// Records a compute-bound row of `flops` floating-point operations (printed as TFLOP/s).
    pub fn record_flops(&mut self, name: &str, shape: &str, stats: Stats, flops: u64) {
        self.rows.push(Row {
            name: name.into(),
            shape: shape.into(),
            stats,
            bytes: None,
            flops: Some(flops),
            target: None,
            work: None,
        });
    }

    fn gbps(r: &Row) -> Option<f64> {
        r.bytes.map(|b| b as f64 / (r.stats.median_us * 1e-6) / 1e9)
    }

    fn tflops(r: &Row) -> Option<f64> {
        r.flops.map(|f| f as f64 / (r.stats.median_us * 1e-6) / 1e12)
    }

    fn verdict(&self, r: &Row) -> String {
        match r.target {
            Some(Target::CopyFraction(t)) => {
                let f = Self::gbps(r).unwrap_or(0.0) / self.copy_gbps;
                format!("{} (≥ {t:.2})", if f >= t { "MET" } else { "MISSED" })
            }
            Some(Target::MaxMicros(t)) => {
                format!("{} (≤ {t} µs)", if r.stats.median_us <= t { "MET" } else { "MISSED" })
            }
            None => String::new(),
        }
    }

    /// Records a derived figure with an optional target (`at_least`: `value ≥ bound`, else `≤`).
    pub fn record_ratio(&mut self, name: &str, value: f64, target: Option<(bool, f64)>) {
        self.ratios.push(Ratio { name: name.into(), value, target });
    }

    fn ratio_verdict(r: &Ratio) -> String {
        match r.target {
            Some((true, t)) => format!("≥ {t}: {}", if r.value >= t { "MET" } else { "MISSED" }),
            Some((false, t)) => format!("≤ {t}: {}", if r.value <= t { "MET" } else { "MISSED" }),
            None => String::new(),
        }
    }

    pub fn print_table(&self) {
        println!(
            "\n{:<48} {:>18} {:>10} {:>10} {:>10} {:>9} {:>7} {:>8}  target",
            "benchmark", "shape", "median µs", "min µs", "max µs", "GB/s", "÷copy", "TFLOP/s"
        );
        for r in &self.rows {
            let (gb, frac) = match Self::gbps(r) {
                Some(g) if self.copy_gbps > 0.0 => (format!("{g:.0}"), format!("{:.3}", g / self.copy_gbps)),
                _ => (String::new(), String::new()),
            };
            let tflops = Self::tflops(r).map(|t| format!("{t:.0}")).unwrap_or_default();
            println!(
                "{:<48} {:>18} {:>10.2} {:>10.2} {:>10.2} {:>9} {:>7} {:>8}  {}",
                r.name,
                r.shape,
                r.stats.median_us,
                r.stats.min_us,
                r.stats.max_us,
                gb,
                frac,
                tflops,
                self.verdict(r)
            );
        }
        for r in &self.ratios {
            println!("{:<80} {:>10.3}  {}", r.name, r.value, Self::ratio_verdict(r));
        }
    }

    /// Writes every row so far to `path` (main calls it after each family, so a run cut short
    /// keeps what it measured).
    pub fn write_json(&self, path: &std::path::Path) {
        let date = std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default();
        let (device, driver) = match &self.dev {
            Some(d) => {
                (d.name().to_string(), d.driver_version().map(|(a, b)| format!("CUDA {a}.{b}")).unwrap_or_default())
            }
            None => ("none (CPU only)".to_string(), String::new()),
        };
        let rows: Vec<_> = self
            .rows
            .iter()
            .map(|r| {
                let w = r.work.as_ref();
                json!({
                    "name": r.name, "shape": r.shape,
                    "median_us": r.stats.median_us, "min_us": r.stats.min_us, "max_us": r.stats.max_us,
                    "bytes": r.bytes, "gbps": Self::gbps(r),
                    "flops": r.flops, "tflops": Self::tflops(r),
                    "fraction_of_copy": Self::gbps(r).map(|g| g / self.copy_gbps),
                    "target": self.verdict(r),
                    "section": w.map(|w| w.section), "work": w.map(|w| &w.work), "pass": w.map(|w| w.pass),
                    "variant": w.map(|w| &w.variant), "precision": w.map(|w| w.precision), "flops_fp8": w.map(|w| w.flops_fp8),
                    "tokens": w.and_then(|w| w.tokens),
                })
            })
            .collect();
        let ratios: Vec<_> = self
            .ratios
            .iter()
            .map(|r| json!({ "name": r.name, "value": r.value, "target": Self::ratio_verdict(r) }))
            .collect();
        let doc = json!({
            "side": "ours", "device": device, "driver": driver, "date": date, "copy_gbps": self.copy_gbps,
            "rows": rows, "ratios": ratios,
        });
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        std::fs::write(path, serde_json::to_string_pretty(&doc).unwrap()).expect("write bench JSON");
    }
}

/// Host bytes of `n` random values in `dtype` (fixed seed), for bench inputs.
pub fn random_bytes(dtype: te_runtime::DType, n: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..n).map(|_| rng.random::<f32>() * 4.0 - 2.0).collect();
    te_runtime::numerics::encode(dtype, &v)
}
