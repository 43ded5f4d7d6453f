//! The training job of `te train`: one GPT, trained with the same seed and data order in FP8
//! (DelayedScaling, HYBRID) and in BF16, with AdamW (FP32 master weights, global-norm clipping,
//! warmup + cosine LR), reporting step time, tokens/s, peak GPU memory and train/validation loss.

use crate::data::{Batcher, Corpus, DataError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use te_runtime::fp8::{fp8_autocast, DelayedScaling};
use te_runtime::models::gpt::{Gpt, GptConfig};
use te_runtime::modules::TokenIds;
use te_runtime::optim::{AdamW, AdamWConfig, LrSchedule};
use te_runtime::{Device, Module};

/// Errors of the job.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The data pipeline.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The runtime (device, kernels, modules).
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
    /// Writing results.
    #[error("cannot write {path}: {source}")]
    Output {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The numeric format of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// GEMMs in FP8 under `fp8_autocast` with TE's default `DelayedScaling` (HYBRID).
    Fp8,
    /// Everything in BF16.
    Bf16,
}

impl Precision {
    /// `fp8` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp8 => "fp8",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Settings of one training run.
#[derive(Debug, Clone)]
pub struct TrainConfig {
    /// The model.
    pub model: GptConfig,
    /// Optimizer steps.
    pub steps: u64,
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Micro-batches per optimizer step (gradients accumulate).
    pub grad_accum: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Linear warmup steps.
    pub warmup_steps: u64,
    /// Global-norm clipping threshold.
    pub max_grad_norm: f32,
    /// Evaluate every this many steps (and at the end).
    pub eval_interval: u64,
    /// Validation batches per evaluation.
    pub eval_batches: usize,
    /// Seed of the data order (the model seed is in `model`).
    pub data_seed: u64,
}

/// One row of the loss curve.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    /// Optimizer step (1-based).
    pub step: u64,
    /// Mean training loss of the step's micro-batches.
    pub train_loss: f32,
    /// Validation loss, at evaluation steps.
    pub val_loss: Option<f32>,
    /// Wall time of the step (device synchronized), ms.
    pub step_ms: f64,
}

/// The outcome of one run.
#[derive(Debug, Clone)]
pub struct RunSummary {
    /// FP8 or BF16.
    pub precision: Precision,
    /// The loss curve.
    pub records: Vec<Record>,
    /// Training tokens per second over the steps after the first (median step time).
    pub tokens_per_s: f64,
    /// Peak device memory in use during the run (driver-reported, all allocations), bytes.
    pub peak_memory: u64,
    /// Parameters of the model.
    pub parameters: usize,
}

/// Device memory in use now (total − free), bytes.
fn used_memory(dev: &Device) -> u64 {
    dev.context().mem_get_info().map(|(free, total)| (total - free) as u64).unwrap_or(0)
}

/// Trains `cfg.model` on `corpus` in `precision`, calling `progress(step, loss)` after each step.
///
/// # Errors
/// Data, runtime and device errors.
pub fn train(
    dev: &Arc<Device>,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    mut progress: impl FnMut(u64, f32),
) -> Result<RunSummary, TrainError> {
    let mut model = Gpt::new(dev, cfg.model.clone())?;
    let schedule = LrSchedule::WarmupCosine {
        peak: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
        min_lr: cfg.lr / 10.0,
    };
    let opt_cfg = AdamWConfig {
        max_grad_norm: Some(cfg.max_grad_norm),
        weight_decay: 0.1,
        betas: (0.9, 0.95),
        decay_biases_and_norms: false,
        ..AdamWConfig::new(schedule)
    };
    let mut opt = AdamW::new(dev, &model, opt_cfg)?;
    let seq = cfg.model.seq_length;
    let mut train_batches = Batcher::new(cfg.data_seed, seq, cfg.batch);
    let recipe = DelayedScaling::default();
    let mut records = Vec::new();
    let mut peak = used_memory(dev);
    for step in 1..=cfg.steps {
        let start = Instant::now();
        let mut loss_sum = 0.0f32;
        for _ in 0..cfg.grad_accum {
            let batch = train_batches.next(&corpus.train, "train")?;
            let ids = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.ids)?;
            let targets = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.targets)?;
            let (loss, ctx) = match precision {
                Precision::Fp8 => fp8_autocast(true, recipe, || model.forward_loss(&ids, &targets))?,
                Precision::Bf16 => model.forward_loss(&ids, &targets)?,
            };
            model.backward(ctx)?;
            loss_sum += loss;
        }
        opt.step(&mut model)?;
        model.zero_grad();
        dev.synchronize()?;
        peak = peak.max(used_memory(dev));
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        let train_loss = loss_sum / cfg.grad_accum as f32;
        let val_loss = if step % cfg.eval_interval == 0 || step == cfg.steps {
            Some(evaluate(dev, &mut model, corpus, cfg, precision)?)
        } else {
            None
        };
        records.push(Record { step, train_loss, val_loss, step_ms });
        progress(step, train_loss);
    }
    let mut times: Vec<f64> = records.iter().skip(1).map(|r| r.step_ms).collect();
    times.sort_by(f64::total_cmp);
    let median_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    let tokens = (seq * cfg.batch * cfg.grad_accum) as f64;
    Ok(RunSummary {
        precision,
        records,
        tokens_per_s: tokens / (median_ms / 1e3),
        peak_memory: peak,
        parameters: model.num_parameters(),
    })
}

/// Mean validation loss over `cfg.eval_batches` fixed batches (the same for every evaluation).
fn evaluate(
    dev: &Arc<Device>,
    model: &mut Gpt,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
) -> Result<f32, TrainError> {
    let seq = cfg.model.seq_length;
    let mut batches = Batcher::new(cfg.data_seed ^ 0x5eed, seq, cfg.batch);
    let mut sum = 0.0f32;
    for _ in 0..cfg.eval_batches {
        let batch = batches.next(&corpus.val, "validation")?;
        let ids = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.ids)?;
        let targets = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.targets)?;
        let (loss, _ctx) = match precision {
            Precision::Fp8 => fp8_autocast(true, DelayedScaling::default(), || model.forward_loss(&ids, &targets))?,
            Precision::Bf16 => model.forward_loss(&ids, &targets)?,
        };
        sum += loss;
    }
    Ok(sum / cfg.eval_batches as f32)
}

/// Writes the loss curves of `runs` as CSV: `precision,step,train_loss,val_loss,step_ms`.
///
/// # Errors
/// [`TrainError::Output`] when the file cannot be written.
pub fn write_csv(path: &Path, runs: &[RunSummary]) -> Result<(), TrainError> {
    let out = |source| TrainError::Output { path: path.to_path_buf(), source };
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).map_err(out)?);
    writeln!(f, "precision,step,train_loss,val_loss,step_ms").map_err(out)?;
    for run in runs {
        for r in &run.records {
            let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
            writeln!(f, "{},{},{},{val},{:.3}", run.precision.name(), r.step, r.train_loss, r.step_ms).map_err(out)?;
        }
    }
    f.flush().map_err(out)
}
