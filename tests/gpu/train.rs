//! The training job on the GPU (`te_train::Trainer` on `Backend::Gpu`): a run resumed from a checkpoint continues bit for
//! bit as if it had never stopped (weights, FP8 state, optimizer state, dropout stream and data
//! order all restored), in FP8 and BF16, with gradient accumulation through
//! `is_first_microbatch`; a checkpoint made with other settings is refused; evaluation does not
//! move the training run; the peak memory is counted per run, and given back after it.

use crate::common::device;
use std::sync::Arc;
use te_models::{Gpt, GptConfig};
use te_nn::fp8::DelayedScaling;
use te_nn::parallel::Parallel;
use te_runtime::Device;
use te_train::data::Corpus;
use te_train::{Backend, RunSummary, Trainer};
pub(crate) use te_train::{CheckpointOptions, Precision, Record, TrainConfig, TrainError};

/// One run of `cfg` in `precision` on `dev` through the [`Trainer`], as rank `parallel` of a
/// parallel run (given back to `parallel` afterwards), calling `progress(step, loss)`.
pub(crate) fn train(
    dev: &Arc<Device>,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    parallel: &mut Parallel,
    mut progress: impl FnMut(u64, f32),
) -> Result<RunSummary, TrainError> {
    let trainer = Trainer::new(cfg.clone(), Backend::Gpu(dev.clone()))?.with_checkpoints(ckpt.clone());
    let mut trainer = trainer.with_parallel(std::mem::take(parallel))?;
    let run = trainer.train(corpus, precision, |p| progress(p.step, p.train_loss));
    *parallel = trainer.into_parallel();
    run
}

/// Deterministic text of a few hundred kilobytes with some structure to learn.
pub(crate) fn corpus() -> Corpus {
    let words = ["to", "be", "or", "not", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "mind"];
    let mut x = 12345u64;
    let mut text = Vec::new();
    while text.len() < 200_000 {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        text.extend_from_slice(words[(x >> 33) as usize % words.len()].as_bytes());
        text.push(if (x >> 20) % 9 == 0 { b'\n' } else { b' ' });
    }
    Corpus::split(text, 0.1)
}

pub(crate) fn config(steps: u64) -> TrainConfig {
    TrainConfig {
        model: GptConfig { seq_length: 64, ..GptConfig::tiny() },
        steps,
        batch: 4,
        grad_accum: 2,
        lr: 1e-3,
        warmup_steps: 2,
        min_lr: None,
        weight_decay: 0.1,
        max_grad_norm: 1.0,
        eval_interval: 3,
        eval_batches: 2,
        data_seed: 7,
        recipe: DelayedScaling::default().into(),
        skip_nonfinite_steps: 0,
        cuda_graph: false,
    }
}

pub(crate) fn losses(records: &[Record]) -> Vec<(u64, u32, Option<u32>)> {
    records.iter().map(|r| (r.step, r.train_loss.to_bits(), r.val_loss.map(f32::to_bits))).collect()
}

/// A finished run gives its memory back: the memory this process can allocate
/// ([`Device::memory_info`]: the driver's free memory and the memory pool's freed blocks) is back
/// within the kernels the run loaded of where it was, so that `te train --precision both` starts
/// its second run with the first one's memory available (its estimate once saw only the driver's
/// free memory, and refused GPT `large`'s BF16 run after the FP8 one on an 80 GB H100).
#[test]
fn a_finished_run_gives_its_memory_back() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let cfg = TrainConfig { model: GptConfig { seq_length: 512, ..GptConfig::small() }, batch: 8, ..config(2) };
    let ckpt = CheckpointOptions::default();
    let mib = |b: u64| b >> 20;
    for precision in [Precision::Fp8, Precision::Bf16] {
        dev.synchronize().unwrap();
        let (start, _) = dev.memory_info().unwrap();
        let run = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap();
        dev.synchronize().unwrap();
        let (end, _) = dev.memory_info().unwrap();
        let what = format!(
            "{precision:?}: {} MiB available before, {} after, peak {}",
            mib(start),
            mib(end),
            mib(run.peak_memory)
        );
        assert!(run.peak_memory > 1 << 30, "{what}: the run must be large enough to tell");
        assert!(end + (256 << 20) >= start, "{what}");
    }
}

#[test]
fn resume_is_bit_exact_with_never_stopping() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let cfg = config(6);
    for precision in [Precision::Fp8, Precision::Bf16] {
        let dir = tempfile::tempdir().unwrap();
        let straight_dir = dir.path().join("straight");
        let ckpt = CheckpointOptions { dir: Some(straight_dir.clone()), interval: 3, ..Default::default() };
        let straight = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(straight.records.len(), 6);
        assert!(straight.records.iter().all(|r| r.train_loss.is_finite()));
        assert!(straight.peak_memory > 0, "peak memory is counted");
        // The step-3 checkpoint (the one before the newest is kept) as a stopped run's.
        let run = precision.name();
        let stopped = dir.path().join("stopped");
        std::fs::create_dir_all(stopped.join(run)).unwrap();
        let src = straight_dir.join(run).join("step-0000003");
        let dst = stopped.join(run).join("step-0000003");
        std::fs::create_dir_all(&dst).unwrap();
        for f in ["model.safetensors", "optimizer.safetensors", "history.csv", "trainer.toml"] {
            std::fs::copy(src.join(f), dst.join(f)).unwrap();
        }
        let latest = std::fs::read_to_string(straight_dir.join(run).join("latest.toml")).unwrap();
        assert!(latest.contains("step-0000006"), "{latest}");
        std::fs::copy(dst.join("trainer.toml"), stopped.join(run).join("latest.toml")).unwrap();
        let ckpt = CheckpointOptions { dir: Some(stopped.clone()), interval: 3, resume: true, ..Default::default() };
        let resumed = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(losses(&resumed.records), losses(&straight.records), "{run}: resumed run differs");

        // A stop request (SIGTERM) after step 4: that step is checkpointed though the interval
        // is 3, and --resume finishes the run as if it never stopped.
        let preempted = dir.path().join("preempted");
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let ckpt = CheckpointOptions {
            dir: Some(preempted.clone()),
            interval: 3,
            resume: false,
            stop: Some(stop.clone()),
            model_source: None,
        };
        let request = |step: u64, _: f32| stop.store(step == 4, std::sync::atomic::Ordering::Relaxed);
        let e = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), request).unwrap_err();
        match &e {
            TrainError::Interrupted { step: 4, checkpoint: Some(c) } => assert!(c.ends_with("step-0000004"), "{e}"),
            _ => panic!("{run}: expected an interruption after step 4, got {e}"),
        }
        let ckpt =
            CheckpointOptions { dir: Some(preempted), interval: 3, resume: true, stop: None, model_source: None };
        let resumed = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(losses(&resumed.records), losses(&straight.records), "{run}: run resumed after a stop differs");

        // Other settings are refused, naming them.
        let other = TrainConfig { batch: 8, ..cfg.clone() };
        let e = train(&dev, &corpus, &other, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap_err();
        assert!(matches!(e, TrainError::Resume { .. }) && e.to_string().contains("batch 4 (checkpoint) vs 8"), "{e}");
    }
}

#[test]
fn gradient_accumulation_matches_one_big_batch() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let none = CheckpointOptions::default();
    // f32 parameters and no dropout: 2 micro-batches of 4 sequences are the same data as one
    // batch of 8 (the batcher draws the same windows in the same order), so the runs agree up
    // to float rounding. In FP8 the weights are cast once per step (is_first_microbatch) and the
    // runs agree up to FP8 rounding.
    let model = GptConfig { params_dtype: te_runtime::DType::F32, hidden_dropout: 0.0, ..config(4).model };
    let accum = TrainConfig { model: model.clone(), ..config(4) };
    let big = TrainConfig { model, batch: 8, grad_accum: 1, ..config(4) };
    for (precision, tol) in [(Precision::Bf16, 1e-4), (Precision::Fp8, 2e-2)] {
        let a = train(&dev, &corpus, &accum, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
        let b = train(&dev, &corpus, &big, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
        for (x, y) in a.records.iter().zip(&b.records) {
            let rel = ((x.train_loss - y.train_loss) / y.train_loss).abs();
            assert!(rel < tol, "{precision:?} step {}: {} (2 × 4) vs {} (1 × 8)", x.step, x.train_loss, y.train_loss);
        }
        assert!(a.records[3].train_loss < a.records[0].train_loss, "{:?}", a.records);
    }
}

/// A diverging run (learning rate 1e30) stops at its first non-finite step with a typed error
/// naming the step and the last good checkpoint; with `skip_nonfinite_steps` it skips them and
/// finishes, its weights those of the last finite step.
#[test]
fn nonfinite_steps_stop_the_run_or_are_skipped() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointOptions { dir: Some(dir.path().to_path_buf()), interval: 1, ..Default::default() };
    let cfg = TrainConfig { lr: 1e30, warmup_steps: 1, ..config(6) };
    let e = train(&dev, &corpus, &cfg, Precision::Bf16, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap_err();
    let message = e.to_string();
    assert!(matches!(e, TrainError::NonFinite { .. }), "{message}");
    assert!(message.contains("non-finite") && message.contains("--skip-nonfinite-steps"), "{message}");
    assert!(message.contains("last good checkpoint is") && message.contains("step-"), "{message}");
    let skipping = TrainConfig { skip_nonfinite_steps: 6, ..cfg };
    let run = train(
        &dev,
        &corpus,
        &skipping,
        Precision::Bf16,
        &CheckpointOptions::default(),
        &mut Parallel::default(),
        |_, _| {},
    )
    .unwrap();
    assert_eq!(run.records.len(), 6);
    assert!(run.records.iter().any(|r| !r.train_loss.is_finite()), "the run diverged");
}

/// `Gpt::training_bytes`, what `train` checks against the free memory before it allocates,
/// bounds the measured high-water mark of short runs (two steps with evaluation) from above and
/// stays within 1.5× of it: `small` at batch 8 × 1024 and a wider 4-layer model at 4 × 1024, in
/// BF16 and FP8.
#[test]
fn memory_estimate_bounds_the_peak() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let wide = GptConfig {
        num_layers: 4,
        hidden_size: 2048,
        num_attention_heads: 16,
        ffn_hidden_size: 8192,
        seq_length: 1024,
        ..GptConfig::small()
    };
    for (model, batch) in [(GptConfig::small(), 8), (wide, 4)] {
        for precision in [Precision::Bf16, Precision::Fp8] {
            let cfg = TrainConfig { model: model.clone(), batch, grad_accum: 1, eval_interval: 2, ..config(2) };
            let run = train(
                &dev,
                &corpus,
                &cfg,
                precision,
                &CheckpointOptions::default(),
                &mut Parallel::default(),
                |_, _| {},
            )
            .unwrap();
            let estimate = Gpt::training_bytes(&model, batch, precision == Precision::Fp8);
            let (peak, mib) = (run.peak_memory, |b: u64| b >> 20);
            eprintln!(
                "{} layers h{} b{batch} {precision:?}: peak {} MiB, estimate {} MiB ({:.2}×)",
                model.num_layers,
                model.hidden_size,
                mib(peak),
                mib(estimate),
                estimate as f64 / peak as f64
            );
            assert!(peak <= estimate && estimate as f64 <= 1.5 * peak as f64, "peak {peak}, estimate {estimate}");
        }
    }
}

/// A configuration the GPU cannot hold (the 1.2 B `large` preset at batch 64 × 2048) fails with
/// a typed out-of-memory error giving the sizes and the flags to change, from the estimate,
/// before anything is allocated; the process goes on training a small model afterwards.
#[test]
fn out_of_memory_is_a_typed_error_and_the_process_goes_on() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let big = TrainConfig { model: GptConfig::large(), batch: 64, steps: 2, ..config(2) };
    let e =
        train(&dev, &corpus, &big, Precision::Bf16, &CheckpointOptions::default(), &mut Parallel::default(), |_, _| {})
            .unwrap_err();
    let message = e.to_string();
    assert!(
        matches!(&e, TrainError::Runtime(te_runtime::Error::OutOfMemory { requested, total, .. }) if requested > &0 && total > &0),
        "{message}"
    );
    assert!(message.contains("out of GPU memory") && message.contains("--batch"), "{message}");
    assert!(message.contains("estimated before allocating"), "refused by the estimate: {message}");
    let small = train(
        &dev,
        &corpus,
        &config(2),
        Precision::Bf16,
        &CheckpointOptions::default(),
        &mut Parallel::default(),
        |_, _| {},
    )
    .unwrap();
    assert!(small.records.iter().all(|r| r.train_loss.is_finite()));
}
