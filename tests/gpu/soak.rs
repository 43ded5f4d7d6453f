//! Soak runs (the reliability issue), on the device and not in CI: `#[ignore]`d, run with
//! `gpu-test --ignored soak:: --test-threads=1`. GPT `small` trained in FP8 for
//! `TE_SOAK_SECONDS` (default 1 200) or `TE_SOAK_STEPS` steps, whichever ends first, and GPT `small` generation requests in one process
//! (`TE_SOAK_REQUESTS`, default 10 000), sampling the device memory in use
//! (`Device::memory_in_use`, after a synchronization), the device memory the driver holds
//! outside the pool (graphs, modules, NCCL: the device's used memory less the pool's), the
//! host's resident memory and the process's open files: after the warm-up the pool's memory may
//! not grow at all, the driver's by at most [`DRIVER_GROWTH`], the host's by at most
//! [`HOST_GROWTH_KB`], the open files not at all, and the time of a step or a request may not
//! grow by more than 5 % between the first and the last tenth of the run. The time compared is
//! each tenth's 10th percentile: growing work (a leak that costs time, a table that is searched
//! longer) slows every step, the fastest ones too, while another tenant's burst on the host or
//! the GPU only slows some; the medians of the ten tenths are printed beside it.

use crate::common::device;
use crate::train::corpus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use te_models::generate::SamplingConfig;
use te_models::gpt::{GenerateOptions, Gpt, GptConfig};
use te_train::{Backend, CheckpointOptions, Precision, TrainConfig, TrainError, Trainer};

/// The growth of the host's resident memory a soak allows (KiB).
const HOST_GROWTH_KB: u64 = 64 << 10;
/// The growth of the device memory held outside the pool a soak allows (bytes): one 2 MiB
/// page of the driver's.
const DRIVER_GROWTH: u64 = 2 << 20;
/// The drift of the step (or request) time a soak allows.
const DRIFT: f64 = 0.05;

/// What one sample saw.
#[derive(Debug, Clone, Copy)]
struct Sample {
    at: u64,
    device_bytes: u64,
    driver_bytes: u64,
    rss_kb: u64,
    open_files: usize,
}

fn sample(dev: &te_runtime::Device, at: u64) -> Sample {
    dev.synchronize().unwrap();
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let rss_kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let open_files = std::fs::read_dir("/proc/self/fd").unwrap().count();
    let device_bytes = dev.memory_in_use().unwrap();
    // `memory_info`'s free counts the pool's cached blocks as free: total − free is the pool's
    // memory in use plus what the driver holds outside the pool.
    let (free, total) = dev.memory_info().unwrap();
    let driver_bytes = (total - free).saturating_sub(device_bytes);
    Sample { at, device_bytes, driver_bytes, rss_kb, open_files }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The `q`-quantile (0..=1, nearest rank) of `v`.
fn quantile(v: &[f64], q: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Checks the samples after the first (taken after the warm-up) and the times of the first and
/// last tenth of `times` (ms each); prints what it saw.
fn check(what: &str, samples: &[Sample], times: &[f64]) {
    let base = samples[0];
    for s in &samples[1..] {
        assert!(
            s.device_bytes <= base.device_bytes,
            "{what}: device memory in use grew from {} to {} bytes by {}",
            base.device_bytes,
            s.device_bytes,
            s.at
        );
        assert!(
            s.driver_bytes <= base.driver_bytes + DRIVER_GROWTH,
            "{what}: device memory outside the pool grew from {} to {} bytes by {}",
            base.driver_bytes,
            s.driver_bytes,
            s.at
        );
        assert!(
            s.rss_kb <= base.rss_kb + HOST_GROWTH_KB,
            "{what}: resident host memory grew from {} to {} KiB by {}",
            base.rss_kb,
            s.rss_kb,
            s.at
        );
        assert_eq!(s.open_files, base.open_files, "{what}: open files at {}", s.at);
    }
    let tenth = (times.len() / 10).max(1);
    let tenths: Vec<&[f64]> = times.chunks(tenth).take(10).collect();
    let medians: Vec<String> = tenths.iter().map(|t| format!("{:.3}", quantile(t, 0.5))).collect();
    let first = quantile(tenths[0], 0.1);
    let last = quantile(&times[times.len() - tenth..], 0.1);
    let last_sample = samples.last().unwrap();
    eprintln!(
        "{what}: {} samples to {}; pool memory {} → {} bytes; driver memory outside the pool {} → {} bytes; host \
         RSS {} → {} KiB; open files {}; 10th percentile {first:.3} → {last:.3} ms ({:+.2} %); medians of the \
         tenths [{}] ms",
        samples.len(),
        last_sample.at,
        base.device_bytes,
        last_sample.device_bytes,
        base.driver_bytes,
        last_sample.driver_bytes,
        base.rss_kb,
        last_sample.rss_kb,
        base.open_files,
        100.0 * (last / first - 1.0),
        medians.join(", ")
    );
    // Slower is a drift; faster (clocks and caches still warming in the first tenth) is not.
    assert!(last / first - 1.0 <= DRIFT, "{what}: the time drifted from {first:.3} to {last:.3} ms (10th percentile)");
}

#[test]
#[ignore = "a soak run on the device: gpu-test --ignored soak::"]
fn training_for_minutes_neither_grows_nor_drifts() {
    let Some(dev) = device() else { return };
    let limit = Duration::from_secs(env_or("TE_SOAK_SECONDS", 1200));
    let max_steps = env_or("TE_SOAK_STEPS", u64::MAX);
    let model = GptConfig::small();
    let cfg = TrainConfig { eval_interval: u64::MAX / 4, warmup_steps: 100, ..TrainConfig::new(model, u64::MAX / 4) };
    let stop = Arc::new(AtomicBool::new(false));
    let ckpt = CheckpointOptions { stop: Some(stop.clone()), ..Default::default() };
    let mut trainer = Trainer::new(cfg, Backend::Gpu(dev.clone())).unwrap().with_checkpoints(ckpt);
    let (start, warm_up, every) = (Instant::now(), 50, 200);
    let (mut samples, mut times) = (Vec::new(), Vec::new());
    let run = trainer.train(&corpus(), Precision::Fp8, |p| {
        if p.step > warm_up {
            times.push(p.step_ms);
        }
        if p.step == warm_up || (p.step > warm_up && p.step % every == 0) {
            samples.push(sample(&dev, p.step));
        }
        if start.elapsed() > limit || p.step >= max_steps {
            stop.store(true, Ordering::SeqCst);
        }
    });
    assert!(matches!(run, Err(TrainError::Interrupted { .. })), "the run ends on the stop: {run:?}");
    assert!(samples.len() >= 3, "{} samples: run longer (TE_SOAK_SECONDS)", samples.len());
    let steps = times.len() + warm_up as usize;
    check(
        &format!("GPT small FP8 training, {steps} steps in {:.0} s", start.elapsed().as_secs_f64()),
        &samples,
        &times,
    );
}

#[test]
#[ignore = "a soak run on the device: gpu-test --ignored soak::"]
fn generation_requests_in_one_process_neither_grow_nor_drift() {
    let Some(dev) = device() else { return };
    let requests = env_or("TE_SOAK_REQUESTS", 10_000);
    let mut model = Gpt::new(&dev, GptConfig::small()).unwrap();
    model.set_training(false);
    let (warm_up, every) = ((requests / 20).max(20), (requests / 20).max(1));
    let (mut samples, mut times) = (Vec::new(), Vec::new());
    let sampling = SamplingConfig { temperature: 0.8, top_k: Some(40), top_p: None };
    for r in 0..requests {
        let t = Instant::now();
        // A new cache per request, as `te generate` makes one per call.
        let mut params = model.inference_params(1, 64).unwrap();
        let prompt: Vec<i32> = (0..16).map(|i| ((r * 31 + i * 7) % 256) as i32).collect();
        let opts = GenerateOptions { cuda_graph: true, ..Default::default() };
        model.generate(&mut params, &[prompt], 32, (&sampling, r), opts, |_, _| Ok(())).unwrap();
        drop(params);
        if r >= warm_up {
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        if r == warm_up || (r > warm_up && r % every == 0) {
            samples.push(sample(&dev, r));
        }
    }
    check(&format!("GPT small generation, {requests} requests of 32 tokens"), &samples, &times);
}
