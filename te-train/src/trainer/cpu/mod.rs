//! The CPU backend, for machines without a GPU: the same GPT ([`GptRef`], the CPU twin of the
//! GPU model), data order, AdamW settings, LR schedule, clipping and evaluation as the GPU
//! backend, with the GPU's GEMM numerics emulated on the GEMM inputs (FP8 with the config's
//! delayed or blockwise recipe, the LM head in BF16 unless `fp8_lm_head`, or BF16; everything
//! else in f32; [`cpu_gemm_precision`]).
//! Meant for the `tiny` preset: 200 steps of 4 × 128 tokens (with evaluations) take 15–20 s
//! per run on two cores. Checkpoints and resuming work as on the GPU, in the same files.

use crate::checkpoint::{CheckpointOptions, Checkpointer, RunState};
use crate::config::{Precision, TrainConfig};
use crate::data::{Batcher, Corpus};
use crate::error::TrainError;
use crate::nonfinite::NonFiniteGuard;
use crate::summary::{median, Progress, Record, RunSummary};
use std::path::Path;
use std::time::Instant;
use te_models::cpu::gpt::{GemmPrecision, GptAdamW, GptAdamWConfig, GptRef};
use te_nn::checkpoint::{LoadOptions, SaveOptions};
use te_nn::fp8::Recipe;

#[cfg(test)]
mod tests;

/// How the CPU model ([`GptRef`]) emulates the GEMMs of a run in `precision` with the FP8
/// `recipe`: BF16-rounded inputs for [`Precision::Bf16`]; for [`Precision::Fp8`] the inputs
/// fake-quantized as the recipe casts them ([`GemmPrecision::from_recipe`]: delayed, current or
/// blockwise scaling).
///
/// # Errors
/// [`TrainError::Runtime`] for a recipe that does not validate.
pub fn cpu_gemm_precision(precision: Precision, recipe: &Recipe) -> Result<GemmPrecision, TrainError> {
    match precision {
        Precision::Bf16 => Ok(GemmPrecision::Bf16),
        Precision::Fp8 => Ok(GemmPrecision::from_recipe(recipe)?),
    }
}

/// Trains `cfg.model` on `corpus` on the CPU in `precision` (emulated, see the module docs),
/// calling `progress` after each step. Validation runs without dropout.
/// [`RunSummary::peak_memory`] is the process's peak resident set size (Linux `VmHWM`; 0 where
/// it cannot be read), not device memory. Checkpoints are saved and resumed as `ckpt` says, as
/// on the GPU.
///
/// # Errors
/// [`TrainError::HostMemory`] for a configuration the host cannot
/// hold; [`TrainError::Data`] when a split is shorter than one window; [`TrainError::Runtime`]
/// for a model configuration the CPU model refuses (heads that do not divide the hidden size,
/// ...); [`TrainError::Resume`], [`TrainError::NonFinite`] and [`TrainError::Interrupted`] as on
/// the GPU.
pub(super) fn train(
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    progress: &mut dyn FnMut(&Progress),
) -> Result<RunSummary, TrainError> {
    let gemms = cpu_gemm_precision(precision, &cfg.recipe)?;
    // Refuse what the machine cannot hold instead of aborting on an allocation.
    let needed = GptRef::training_bytes(&cfg.model, cfg.batch);
    if let Some(available) = available_memory().filter(|&a| needed > a) {
        return Err(TrainError::HostMemory { needed, available });
    }
    if cfg.cuda_graph {
        tracing::warn!("--cuda-graph: CUDA graphs are the GPU's; the CPU path steps as it always does");
    }
    let mut model = GptRef::new(&cfg.model)?;
    model.set_precision(gemms)?;
    // The GPU job's AdamW settings and schedule.
    let gpu = cfg.adamw_config();
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
        let lr = schedule.lr(step);
        let stats = run.opt.step(&mut run.model, &grads, lr)?;
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
        progress(&Progress {
            precision,
            step,
            steps: cfg.steps,
            train_loss,
            val_loss,
            grad_norm: stats.grad_norm,
            lr,
            step_ms,
        });
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
        graphed_steps: 0,
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

/// Mean validation loss over `cfg.eval_batches` fixed batches (those of the GPU backend).
fn evaluate(model: &GptRef, corpus: &Corpus, cfg: &TrainConfig) -> Result<f32, TrainError> {
    let (seq, batch) = (cfg.model.seq_length, cfg.batch);
    let mut batches = cfg.eval_batcher(cfg.model.seq_length);
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
