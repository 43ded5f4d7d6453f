//! The training job of `te train` on the CPU, for machines without a GPU: the same GPT
//! ([`GptRef`], the CPU twin of the GPU model), data order, AdamW settings, LR schedule,
//! clipping and evaluation as [`crate::train::train`], with the GPU's GEMM numerics emulated on
//! the GEMM inputs (FP8 with `cfg.recipe`, the LM head in BF16 unless `fp8_lm_head`, or BF16;
//! everything else in f32).
//! Meant for the `tiny` preset: 200 steps of 4 × 128 tokens (with evaluations) take 15–20 s
//! per run on two cores. Checkpoints and `--resume` work as on the GPU, in the same files
//! ([`crate::run_checkpoint`]).

use crate::data::{Batcher, Corpus};
use crate::run_checkpoint::{Checkpointer, RunState};
use crate::train::{
    adamw_config, eval_batcher, median, CheckpointOptions, NonFiniteGuard, Precision, Record, RunSummary, TrainConfig,
    TrainError,
};
use std::path::Path;
use std::time::Instant;
use te_models::cpu::gpt::{GemmPrecision, GptAdamW, GptAdamWConfig, GptRef};
use te_nn::checkpoint::{LoadOptions, SaveOptions};

/// Trains `cfg.model` on `corpus` on the CPU in `precision` (emulated, see the module docs),
/// calling `progress(step, loss)` after each step. Validation runs without dropout (the GPU
/// job's evaluation keeps it). [`RunSummary::peak_memory`] is the process's peak resident set
/// size (Linux `VmHWM`; 0 where it cannot be read), not device memory. Checkpoints are saved
/// and resumed as `ckpt` says, as on the GPU.
///
/// # Errors
/// [`TrainError::Data`] when a split is shorter than one window; [`TrainError::Runtime`] for a
/// model configuration the CPU model refuses (heads that do not divide the hidden size, ...),
/// an invalid LR schedule, or `batch` or `seq_length` of 0; [`TrainError::Resume`],
/// [`TrainError::NonFinite`] and [`TrainError::Interrupted`] as [`crate::train::train`].
pub fn train_cpu(
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    mut progress: impl FnMut(u64, f32),
) -> Result<RunSummary, TrainError> {
    // Refuse what the machine cannot hold instead of aborting on an allocation.
    let needed = GptRef::training_bytes(&cfg.model, cfg.batch);
    if let Some(available) = available_memory().filter(|&a| needed > a) {
        return Err(TrainError::HostMemory { needed, available });
    }
    let mut model = GptRef::new(&cfg.model)?;
    model.set_precision(match precision {
        Precision::Fp8 => match cfg.block_scaling {
            Some(block) => GemmPrecision::Fp8Block(block),
            None => GemmPrecision::Fp8(cfg.recipe),
        },
        Precision::Bf16 => GemmPrecision::Bf16,
    })?;
    // The GPU job's AdamW settings and schedule.
    let gpu = adamw_config(cfg);
    let schedule = gpu.lr;
    schedule.validate()?;
    let opt_cfg = GptAdamWConfig {
        betas: gpu.betas,
        eps: gpu.eps,
        weight_decay: gpu.weight_decay,
        max_grad_norm: gpu.max_grad_norm,
        skip_nonfinite: gpu.skip_nonfinite,
    };
    let opt = GptAdamW::new(&model, opt_cfg);
    let mut run = CpuRun { model, opt };
    let (seq, batch) = (cfg.model.seq_length, cfg.batch);
    let mut train_batches = Batcher::new(cfg.data_seed, seq, batch);
    let mut records = Vec::new();
    let mut checkpoints = Checkpointer::new(ckpt, cfg, precision);
    let done = checkpoints.resume(&mut run, &mut records)?;
    train_batches.skip(&corpus.train, done * cfg.grad_accum as u64, "train")?;
    let mut times = Vec::new();
    let mut guard = NonFiniteGuard::new(cfg.skip_nonfinite_steps);
    for step in done + 1..=cfg.steps {
        let start = Instant::now();
        let mut loss_sum = 0.0f32;
        let mut grads: Vec<(String, Vec<f32>)> = Vec::new();
        for _ in 0..cfg.grad_accum {
            let b = train_batches.next(&corpus.train, "train")?;
            let (loss, ctx) = run.model.forward_loss(&b.ids, &b.targets, seq, batch)?;
            let g = run.model.backward(ctx)?;
            // The step's gradient is that of the mean loss over its micro-batches: each
            // micro-batch's weighs 1 / grad_accum, as `MicroBatch::grad_scale` on the GPU.
            let w = 1.0 / cfg.grad_accum as f32;
            if grads.is_empty() {
                grads = g.into_iter().map(|(n, v)| (n, v.into_iter().map(|x| x * w).collect())).collect();
            } else {
                for ((_, acc), (_, g)) in grads.iter_mut().zip(g) {
                    acc.iter_mut().zip(g).for_each(|(a, g)| *a += g * w);
                }
            }
            loss_sum += loss;
        }
        let stats = run.opt.step(&mut run.model, &grads, schedule.lr(step))?;
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        times.push(step_ms);
        let train_loss = loss_sum / cfg.grad_accum as f32;
        guard.check(step, (train_loss, stats.grad_norm, stats.skipped), checkpoints.last())?;
        let val_loss = if step % cfg.eval_interval.max(1) == 0 || step == cfg.steps {
            Some(evaluate(&run.model, corpus, cfg)?)
        } else {
            None
        };
        records.push(Record { step, train_loss, val_loss, step_ms });
        progress(step, train_loss);
        checkpoints.after_step(step, &run, &records, ckpt.stop_requested())?;
    }
    // Over the steps this process ran (a resumed run's records include the earlier ones).
    let median_ms = median(&mut times.into_iter().skip(1).collect::<Vec<_>>());
    let tokens = (seq * batch * cfg.grad_accum) as f64;
    Ok(RunSummary {
        precision,
        records,
        tokens_per_s: tokens / (median_ms / 1e3),
        ranks: 1,
        peak_memory: peak_rss(),
        parameters: run.model.num_parameters(),
    })
}

/// The CPU run's model and optimizer.
struct CpuRun {
    model: GptRef,
    opt: GptAdamW,
}

impl RunState for CpuRun {
    fn save_files(&self, dir: &Path, step: u64) -> Result<(), TrainError> {
        let mut options = SaveOptions::default();
        options.metadata.insert("step".into(), step.to_string());
        self.model.save(dir.join("model.safetensors"), &options)?;
        self.opt.save_state(&self.model, dir.join("optimizer.safetensors"))?;
        Ok(())
    }

    fn load_files(&mut self, dir: &Path) -> Result<u64, TrainError> {
        self.model.load(dir.join("model.safetensors"), &LoadOptions::default())?;
        // The master weights replace the stored (params_dtype) ones.
        self.opt.load_state(&mut self.model, dir.join("optimizer.safetensors"))?;
        Ok(self.opt.step_count())
    }

    fn dropout_offset(&self) -> u64 {
        self.model.dropout_offset()
    }

    fn set_dropout_offset(&mut self, offset: u64) -> Result<(), TrainError> {
        Ok(self.model.set_dropout_offset(offset)?)
    }

    fn nonfinite_states(&self) -> Result<Vec<String>, TrainError> {
        Ok(self.model.nonfinite_fp8_states())
    }
}

/// Mean validation loss over `cfg.eval_batches` fixed batches (those of the GPU job).
fn evaluate(model: &GptRef, corpus: &Corpus, cfg: &TrainConfig) -> Result<f32, TrainError> {
    let (seq, batch) = (cfg.model.seq_length, cfg.batch);
    let mut batches = eval_batcher(cfg);
    let mut sum = 0.0f32;
    for _ in 0..cfg.eval_batches {
        let b = batches.next(&corpus.val, "validation")?;
        sum += model.loss(&b.ids, &b.targets, seq, batch)?;
    }
    Ok(sum / cfg.eval_batches.max(1) as f32)
}

/// The host memory available to a new allocation in bytes (`MemAvailable` of
/// `/proc/meminfo`), `None` where it cannot be read.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok());
    kb.map(|kb| kb * 1024)
}

/// Peak resident set size of this process in bytes (`VmHWM` of `/proc/self/status`), 0 where
/// it cannot be read.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb =
        status.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().strip_suffix("kB")?.trim().parse::<u64>().ok());
    kb.unwrap_or(0) * 1024
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_models::gpt::GptConfig;
    use te_nn::fp8::DelayedScaling;
    use te_runtime::DType;

    fn small() -> (Corpus, TrainConfig) {
        let text = b"to be or not to be, that is the question. ".repeat(40);
        let corpus = Corpus::split(text, 0.2);
        let model = GptConfig {
            num_layers: 1,
            hidden_size: 32,
            num_attention_heads: 2,
            ffn_hidden_size: 64,
            seq_length: 16,
            params_dtype: DType::F32,
            ..GptConfig::tiny()
        };
        let cfg = TrainConfig {
            model,
            steps: 12,
            batch: 4,
            grad_accum: 2,
            lr: 1e-2,
            warmup_steps: 2,
            max_grad_norm: 1.0,
            eval_interval: 6,
            eval_batches: 2,
            data_seed: 7,
            recipe: DelayedScaling::default(),
            block_scaling: None,
            skip_nonfinite_steps: 0,
        };
        (corpus, cfg)
    }

    #[test]
    fn a_few_steps_on_a_small_text_lower_the_loss() {
        let (corpus, cfg) = small();
        for precision in [Precision::Fp8, Precision::Bf16] {
            let mut seen = 0;
            let run = train_cpu(&corpus, &cfg, precision, &CheckpointOptions::default(), |_, _| seen += 1).unwrap();
            assert_eq!((run.precision, seen, run.records.len()), (precision, 12, 12));
            let losses: Vec<f32> = run.records.iter().map(|r| r.train_loss).collect();
            assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
            let (first, last) = (losses[..3].iter().sum::<f32>(), losses[9..].iter().sum::<f32>());
            assert!(last < 0.8 * first, "{precision:?}: {losses:?}");
            let vals: Vec<f32> = run.records.iter().filter_map(|r| r.val_loss).collect();
            assert_eq!(vals.len(), 2);
            assert!(vals[1] < vals[0], "{vals:?}");
            assert!(run.tokens_per_s > 0.0 && run.parameters == cfg.model.num_parameters());
        }
    }

    /// Blockwise FP8 (`--recipe block`) trains on the CPU path as the other precisions do, and
    /// its checkpoint records the recipe, so that te generate emulates it again.
    #[test]
    fn blockwise_fp8_trains_and_is_recorded() {
        let (corpus, cfg) = small();
        let cfg = TrainConfig { block_scaling: Some(te_nn::fp8::Float8BlockScaling::default()), ..cfg };
        let dir = tempfile::tempdir().unwrap();
        let ckpt = CheckpointOptions { dir: Some(dir.path().to_path_buf()), ..Default::default() };
        let run = train_cpu(&corpus, &cfg, Precision::Fp8, &ckpt, |_, _| {}).unwrap();
        let losses: Vec<f32> = run.records.iter().map(|r| r.train_loss).collect();
        assert!(losses[9..].iter().sum::<f32>() < 0.8 * losses[..3].iter().sum::<f32>(), "{losses:?}");
        let latest = crate::run_checkpoint::read_latest(&dir.path().join("fp8/latest.toml")).unwrap().unwrap();
        assert_eq!(latest.model.unwrap().block_scaling, cfg.block_scaling);
    }

    /// A diverging run (learning rate 1e30) stops at its first non-finite step, naming it and
    /// what to change; allowed to skip, it finishes with the steps skipped.
    #[test]
    fn nonfinite_steps_stop_the_run_or_are_skipped() {
        let (corpus, cfg) = small();
        let cfg = TrainConfig { lr: 1e30, warmup_steps: 1, steps: 5, ..cfg };
        let e = train_cpu(&corpus, &cfg, Precision::Bf16, &CheckpointOptions::default(), |_, _| {}).unwrap_err();
        let message = e.to_string();
        assert!(matches!(e, TrainError::NonFinite { step, .. } if step >= 2), "{message}");
        assert!(message.contains("non-finite") && message.contains("--skip-nonfinite-steps"), "{message}");
        assert!(message.contains("no checkpoint was written yet") && message.contains("skipped the step"), "{message}");
        let skipping = TrainConfig { skip_nonfinite_steps: 5, ..cfg };
        let run = train_cpu(&corpus, &skipping, Precision::Bf16, &CheckpointOptions::default(), |_, _| {}).unwrap();
        assert_eq!(run.records.len(), 5);
        assert!(run.records.iter().any(|r| !r.train_loss.is_finite()), "the run diverged");
    }

    /// A stop request ends the run after the step in progress, with the typed error, and
    /// writes that step's checkpoint when there is a checkpoint directory.
    #[test]
    fn a_stop_request_ends_the_run_after_its_step() {
        let (corpus, cfg) = small();
        let dir = tempfile::tempdir().unwrap();
        for ckpt_dir in [None, Some(dir.path().join("checkpoints"))] {
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let ckpt = CheckpointOptions { stop: Some(stop.clone()), dir: ckpt_dir.clone(), ..Default::default() };
            let request = |step: u64, _: f32| {
                if step == 3 {
                    stop.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            };
            let e = train_cpu(&corpus, &cfg, Precision::Bf16, &ckpt, request).unwrap_err();
            let written = ckpt_dir.map(|d| d.join("bf16").join("step-0000003"));
            assert!(matches!(&e, TrainError::Interrupted { step: 3, checkpoint } if *checkpoint == written), "{e}");
            assert!(e.to_string().contains("after step 3"), "{e}");
        }
    }

    /// A run stopped at step 5 (checkpoints every 2 steps and at the stop) and resumed finishes
    /// with the loss curve of the run that never stopped, bit for bit (FP8 and BF16 emulation,
    /// gradient accumulation, dropout, evaluations); a resume with other settings is refused.
    #[test]
    fn a_resumed_run_equals_the_straight_run() {
        let (corpus, cfg) = small();
        let cfg = TrainConfig { model: GptConfig { hidden_dropout: 0.1, ..cfg.model }, ..cfg };
        let losses = |run: &RunSummary| -> Vec<(u64, f32, Option<f32>)> {
            run.records.iter().map(|r| (r.step, r.train_loss, r.val_loss)).collect()
        };
        for precision in [Precision::Fp8, Precision::Bf16] {
            let dir = tempfile::tempdir().unwrap();
            let straight = train_cpu(&corpus, &cfg, precision, &CheckpointOptions::default(), |_, _| {}).unwrap();
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let ckpt = CheckpointOptions {
                dir: Some(dir.path().to_path_buf()),
                interval: 2,
                resume: true,
                stop: Some(stop.clone()),
            };
            let request = |step: u64, _: f32| stop.store(step == 5, std::sync::atomic::Ordering::Relaxed);
            let e = train_cpu(&corpus, &cfg, precision, &ckpt, request).unwrap_err();
            assert!(matches!(e, TrainError::Interrupted { step: 5, checkpoint: Some(_) }), "{e}");
            stop.store(false, std::sync::atomic::Ordering::Relaxed);
            let resumed = train_cpu(&corpus, &cfg, precision, &ckpt, |step, _| assert!(step > 5)).unwrap();
            assert_eq!(losses(&resumed), losses(&straight), "{precision:?}");
            let other = TrainConfig { lr: cfg.lr * 2.0, ..cfg.clone() };
            let e = train_cpu(&corpus, &other, precision, &ckpt, |_, _| {}).unwrap_err();
            assert!(matches!(&e, TrainError::Resume { message, .. } if message.contains("lr")), "{e}");
        }
    }

    /// A configuration the host cannot hold (the probe `--seq-length 100000` that used to abort
    /// the process) is refused with the estimate and the flags to change.
    #[test]
    fn a_configuration_too_big_for_the_host_is_refused() {
        let (corpus, cfg) = small();
        let long = TrainConfig { model: GptConfig { seq_length: 100_000, ..GptConfig::tiny() }, ..cfg.clone() };
        let e = train_cpu(&corpus, &long, Precision::Bf16, &CheckpointOptions::default(), |_, _| {}).unwrap_err();
        assert!(matches!(e, TrainError::HostMemory { needed, available } if needed > available), "{e}");
        assert!(e.to_string().contains("--seq-length"), "{e}");
        // The estimate grows with the square of the sequence and stays small for the tiny preset.
        let tiny = GptRef::training_bytes(&GptConfig::tiny(), 4);
        assert!(tiny < 1 << 30 && GptRef::training_bytes(&long.model, 4) > 1 << 40, "{tiny}");
    }
}
