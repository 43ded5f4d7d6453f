//! The training job of `te train`: one GPT, trained with the same seed and data order in FP8
//! (DelayedScaling, HYBRID) and in BF16, with AdamW (FP32 master weights, global-norm clipping,
//! warmup + cosine LR) and gradient accumulation (`is_first_microbatch`), reporting step time,
//! tokens/s, peak GPU memory and train/validation loss, saving checkpoints and resuming from
//! them bit for bit.
//!
//! A checkpoint of a run is a directory `<checkpoint_dir>/<precision>/step-NNNNNNN/` holding
//! `model.safetensors` (weights and FP8 state, [`te_runtime::checkpoint`]),
//! `optimizer.safetensors` ([`AdamW::save_state`]), `history.csv` (the loss curve so far) and
//! `trainer.toml` (the step, the dropout stream position and the settings the run must be
//! resumed with); `<checkpoint_dir>/<precision>/latest.toml`, a copy of the newest complete
//! one's `trainer.toml`, is what `resume` starts from. It is rewritten (atomically) only after
//! the new directory is complete, and the checkpoint before stays on disk, so a crash while
//! saving never loses the last good checkpoint; copying an older `trainer.toml` over it resumes
//! from that one.

use crate::data::{Batcher, Corpus, DataError};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use te_runtime::checkpoint::{self, write_atomic, LoadOptions, SaveOptions};
use te_runtime::fp8::{fp8_autocast, DelayedScaling, ScalingState};
use te_runtime::models::gpt::{Gpt, GptConfig, GptLoss, MicroBatch};
use te_runtime::modules::{ModuleVisitor, Param, ParamKind, TokenIds};
use te_runtime::optim::{AdamW, AdamWConfig, LrSchedule};
use te_runtime::{Device, Module};

/// Errors of the job.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The data pipeline.
    #[error(transparent)]
    Data(#[from] DataError),
    /// The runtime (device, kernels, modules, checkpoint files).
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
    /// A checkpoint that cannot be resumed from.
    #[error("cannot resume from {path}: {message}")]
    Resume {
        /// The checkpoint's `latest.toml` or file.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A stop was requested ([`CheckpointOptions::stop`]: SIGTERM or SIGINT to `te train`):
    /// the run finished `step` and wrote `checkpoint` (none on the CPU path or without a
    /// checkpoint directory).
    #[error("stopped on request after step {step}: {}", match checkpoint {
        Some(c) => format!("checkpoint written at {}; continue with --resume", c.display()),
        None => "no checkpoint (the CPU path and --no-checkpoint write none)".into(),
    })]
    Interrupted {
        /// The last step completed.
        step: u64,
        /// The checkpoint of that step.
        checkpoint: Option<PathBuf>,
    },
    /// The configuration needs more host memory than the machine has available (the CPU path).
    #[error(
        "the CPU path needs about {} MiB for this configuration and {} MiB are available: lower --seq-length \
         (the attention probabilities grow with its square) or --batch",
        needed >> 20,
        available >> 20
    )]
    HostMemory {
        /// The estimate in bytes.
        needed: u64,
        /// `MemAvailable` in bytes.
        available: u64,
    },
    /// A NaN or infinite loss, gradient norm or FP8 scaling state: the run stops.
    #[error("step {step}: {message}")]
    NonFinite {
        /// The optimizer step.
        step: u64,
        /// What was not finite, what happened to the weights, where the last good checkpoint
        /// is and what to change.
        message: String,
    },
}

/// Counts the steps whose loss or gradient norm is NaN or infinite and stops the run at the
/// first one beyond `--skip-nonfinite-steps` (Megatron-LM's skipped iterations): the optimizer
/// skips such a step on its own (`skip_nonfinite`), so the weights stay those of the last good
/// step.
#[derive(Debug)]
pub struct NonFiniteGuard {
    allowed: u64,
    seen: u64,
}

impl NonFiniteGuard {
    /// A guard that lets `allowed` non-finite steps be skipped.
    pub fn new(allowed: u64) -> Self {
        Self { allowed, seen: 0 }
    }

    /// Checks step `step`'s mean `loss` and `grad_norm` (`skipped`: the optimizer skipped it);
    /// `checkpoint` is the newest good checkpoint, if any.
    ///
    /// # Errors
    /// [`TrainError::NonFinite`] once more steps than allowed were non-finite.
    pub fn check(
        &mut self,
        step: u64,
        (loss, grad_norm, skipped): (f32, f32, bool),
        checkpoint: Option<&Path>,
    ) -> Result<(), TrainError> {
        if loss.is_finite() && grad_norm.is_finite() {
            return Ok(());
        }
        self.seen += 1;
        if self.seen <= self.allowed {
            tracing::warn!(
                "step {step}: loss {loss}, gradient norm {grad_norm}; step skipped ({} of --skip-nonfinite-steps {})",
                self.seen,
                self.allowed
            );
            return Ok(());
        }
        let weights = if skipped {
            "the optimizer skipped the step: the weights are those of the step before"
        } else {
            "the gradient norm was finite, so the optimizer applied the step"
        };
        let resume = match checkpoint {
            Some(c) => format!("the last good checkpoint is {} (continue from it with --resume)", c.display()),
            None => "no checkpoint was written yet".into(),
        };
        Err(TrainError::NonFinite {
            step,
            message: format!(
                "the training loss is {loss} and the gradient norm {grad_norm} (non-finite); {weights}; {resume}. \
                 Lower --lr, or pass --skip-nonfinite-steps N to skip up to N such steps ({} allowed now)",
                self.allowed
            ),
        })
    }
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
    /// Micro-batches per optimizer step (gradients accumulate; FP8 weights are cast once per
    /// step through `is_first_microbatch`).
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
    /// The FP8 recipe of [`Precision::Fp8`] runs (TE's default `DelayedScaling`: HYBRID,
    /// amax history 1024, max).
    pub recipe: DelayedScaling,
    /// Steps with a NaN or infinite loss or gradient norm that are skipped (weights not
    /// updated) before the run stops ([`NonFiniteGuard`]); 0: the first one stops it.
    pub skip_nonfinite_steps: u64,
}

/// Checkpointing of a run.
#[derive(Debug, Clone, Default)]
pub struct CheckpointOptions {
    /// Where checkpoints go (`<dir>/<precision>/...`); `None`: no checkpoints.
    pub dir: Option<PathBuf>,
    /// Save every this many steps (and at the end); 0: only at the end.
    pub interval: u64,
    /// Continue from the newest checkpoint in `dir` when there is one.
    pub resume: bool,
    /// Preemption: once this flag is set (`te train` sets it on SIGTERM or SIGINT), the run
    /// finishes the step in progress, writes its checkpoint (when `dir` is set) and returns
    /// [`TrainError::Interrupted`]. Checked between steps; the CPU path honours it too.
    pub stop: Option<Arc<AtomicBool>>,
}

impl CheckpointOptions {
    /// Whether a stop was requested.
    pub fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(|s| s.load(Ordering::Relaxed))
    }
}

/// One row of the loss curve.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// The loss curve (from step 1, including steps before a resume).
    pub records: Vec<Record>,
    /// Training tokens per second over the steps this process ran after its first (median step
    /// time); NaN when it ran fewer than two.
    pub tokens_per_s: f64,
    /// Peak device memory held by this run's allocations (the memory pool's high-water mark:
    /// parameters, gradients, optimizer state, activations, workspaces), bytes; 0 on the CPU.
    pub peak_memory: u64,
    /// Parameters of the model.
    pub parameters: usize,
}

/// What `latest.toml` records about the newest checkpoint of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Latest {
    /// The checkpoint directory's name (`step-NNNNNNN`), relative to the run's directory.
    dir: String,
    /// Optimizer steps done.
    step: u64,
    /// The model's dropout stream position.
    dropout_offset: u64,
    /// Settings a resumed run must share (data order and schedule).
    batch: usize,
    grad_accum: usize,
    seq_length: usize,
    lr: f32,
    data_seed: u64,
    model_seed: u64,
}

/// The precision's checkpoint directory.
fn run_dir(dir: &Path, precision: Precision) -> PathBuf {
    dir.join(precision.name())
}

/// Trains `cfg.model` on `corpus` in `precision` on the GPU, calling `progress(step, loss)` after
/// each step; saves and resumes checkpoints as `ckpt` says.
///
/// # Errors
/// Data, runtime, device and checkpoint errors; [`TrainError::Resume`] for a checkpoint made
/// with other settings; [`TrainError::NonFinite`] past `cfg.skip_nonfinite_steps` non-finite
/// steps (or for a non-finite FP8 scaling state at a checkpoint); [`TrainError::Interrupted`]
/// after the step during which `ckpt.stop` was set, its checkpoint written.
pub fn train(
    dev: &Arc<Device>,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    mut progress: impl FnMut(u64, f32),
) -> Result<RunSummary, TrainError> {
    dev.synchronize()?;
    dev.reset_peak_memory()?;
    let mut model = Gpt::new(dev, cfg.model.clone())?;
    let mut opt = AdamW::new(dev, &model, adamw_config(cfg))?;
    let seq = cfg.model.seq_length;
    let mut train_batches = Batcher::new(cfg.data_seed, seq, cfg.batch);
    let mut records = Vec::new();
    let mut start_step = 1;
    if let Some(dir) = ckpt.dir.as_deref().filter(|_| ckpt.resume) {
        if let Some(done) = resume(&run_dir(dir, precision), cfg, &mut model, &mut opt, &mut records)? {
            train_batches.skip(&corpus.train, done * cfg.grad_accum as u64, "train")?;
            start_step = done + 1;
        }
    }
    let recipe = cfg.recipe;
    let mut times = Vec::new();
    let mut guard = NonFiniteGuard::new(cfg.skip_nonfinite_steps);
    // The newest good checkpoint: the one resumed from, then each one saved.
    let mut last_checkpoint = match ckpt.dir.as_deref() {
        Some(dir) if start_step > 1 => {
            read_latest(&run_dir(dir, precision).join("latest.toml"))?.map(|l| run_dir(dir, precision).join(l.dir))
        }
        _ => None,
    };
    for step in start_step..=cfg.steps {
        let start = Instant::now();
        let mut losses = Vec::with_capacity(cfg.grad_accum);
        for micro in 0..cfg.grad_accum {
            let batch = train_batches.next(&corpus.train, "train")?;
            let ids = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.ids)?;
            let targets = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.targets)?;
            let mb = MicroBatch {
                is_first_microbatch: (cfg.grad_accum > 1).then_some(micro == 0),
                grad_scale: 1.0 / cfg.grad_accum as f32,
            };
            let (loss, ctx) = match precision {
                Precision::Fp8 => fp8_autocast(true, recipe, || model.forward_loss_with(&ids, &targets, mb))?,
                Precision::Bf16 => model.forward_loss_with(&ids, &targets, mb)?,
            };
            model.backward(ctx)?;
            losses.push(loss);
        }
        let stats = opt.step(&mut model)?;
        // Read after the step was issued: the host never waited for the device mid-step.
        let loss_sum = losses.iter().map(GptLoss::value).sum::<Result<f32, _>>()?;
        let train_loss = loss_sum / cfg.grad_accum as f32;
        guard.check(step, (train_loss, stats.grad_norm, stats.skipped), last_checkpoint.as_deref())?;
        model.zero_grad();
        dev.synchronize()?;
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        times.push(step_ms);
        let val_loss = if step % cfg.eval_interval == 0 || step == cfg.steps {
            Some(evaluate(dev, &mut model, corpus, cfg, precision)?)
        } else {
            None
        };
        records.push(Record { step, train_loss, val_loss, step_ms });
        progress(step, train_loss);
        let stop = ckpt.stop_requested() && step < cfg.steps;
        if let Some(dir) = &ckpt.dir {
            if (ckpt.interval > 0 && step % ckpt.interval == 0) || step == cfg.steps || stop {
                last_checkpoint = Some(save(&run_dir(dir, precision), cfg, step, &model, &opt, &records)?);
            }
        }
        if stop {
            return Err(TrainError::Interrupted { step, checkpoint: last_checkpoint });
        }
    }
    let mut after_first: Vec<f64> = times.iter().skip(1).copied().collect();
    let median_ms = median(&mut after_first);
    let tokens = (seq * cfg.batch * cfg.grad_accum) as f64;
    Ok(RunSummary {
        precision,
        records,
        tokens_per_s: tokens / (median_ms / 1e3),
        peak_memory: dev.peak_memory()?,
        parameters: model.num_parameters(),
    })
}

/// The median of `xs` (NaN when empty).
pub fn median(xs: &mut [f64]) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs.get(xs.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The job's AdamW: betas (0.9, 0.95), weight decay 0.1 on GEMM weights only, clipping at
/// `max_grad_norm`, warmup then cosine decay to a tenth of the peak (nanoGPT's GPT-2 recipe).
pub fn adamw_config(cfg: &TrainConfig) -> AdamWConfig {
    let schedule = LrSchedule::WarmupCosine {
        peak: cfg.lr,
        warmup_steps: cfg.warmup_steps,
        total_steps: cfg.steps,
        min_lr: cfg.lr / 10.0,
    };
    AdamWConfig {
        max_grad_norm: Some(cfg.max_grad_norm),
        weight_decay: 0.1,
        betas: (0.9, 0.95),
        decay_biases_and_norms: false,
        // A non-finite step leaves the weights alone; `NonFiniteGuard` decides whether to go on.
        skip_nonfinite: true,
        ..AdamWConfig::new(schedule)
    }
}

/// The validation batches of every evaluation: the same fixed windows each time, on the GPU
/// and on the CPU path.
pub fn eval_batcher(cfg: &TrainConfig) -> Batcher {
    Batcher::new(cfg.data_seed ^ 0x5eed, cfg.model.seq_length, cfg.batch)
}

/// Mean validation loss over `cfg.eval_batches` fixed batches (the same for every evaluation),
/// in evaluation mode (no dropout; the training run's dropout stream does not move).
fn evaluate(
    dev: &Arc<Device>,
    model: &mut Gpt,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
) -> Result<f32, TrainError> {
    let seq = cfg.model.seq_length;
    let mut batches = eval_batcher(cfg);
    model.set_training(false);
    let mut run = || -> Result<f32, TrainError> {
        let mut sum = 0.0f32;
        for _ in 0..cfg.eval_batches {
            let batch = batches.next(&corpus.val, "validation")?;
            let ids = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.ids)?;
            let targets = TokenIds::from_host(dev, &[seq, cfg.batch], &batch.targets)?;
            let (loss, _ctx) = match precision {
                Precision::Fp8 => fp8_autocast(true, cfg.recipe, || model.forward_loss(&ids, &targets))?,
                Precision::Bf16 => model.forward_loss(&ids, &targets)?,
            };
            sum += loss;
        }
        Ok(sum / cfg.eval_batches as f32)
    };
    let mean = run();
    model.set_training(true);
    mean
}

/// Saves step `step` of a run into `run_dir`, then points `latest.toml` at it and removes the
/// checkpoints older than the previous one.
fn save(
    run_dir: &Path,
    cfg: &TrainConfig,
    step: u64,
    model: &Gpt,
    opt: &AdamW,
    records: &[Record],
) -> Result<PathBuf, TrainError> {
    check_fp8_states(model, step)?;
    let name = format!("step-{step:07}");
    let dir = run_dir.join(&name);
    std::fs::create_dir_all(&dir).map_err(|source| TrainError::Output { path: dir.clone(), source })?;
    let mut options = SaveOptions::default();
    options.metadata.insert("step".into(), step.to_string());
    checkpoint::save(model, dir.join("model.safetensors"), &options)?;
    opt.save_state(dir.join("optimizer.safetensors"))?;
    write_history(&dir.join("history.csv"), records)?;
    let latest = Latest {
        dir: name.clone(),
        step,
        dropout_offset: model.dropout_offset(),
        batch: cfg.batch,
        grad_accum: cfg.grad_accum,
        seq_length: cfg.model.seq_length,
        lr: cfg.lr,
        data_seed: cfg.data_seed,
        model_seed: cfg.model.seed,
    };
    let path = run_dir.join("latest.toml");
    let previous = read_latest(&path)?.map(|l| l.dir);
    let text =
        toml::to_string(&latest).map_err(|e| TrainError::Resume { path: path.clone(), message: e.to_string() })?;
    // The step's own copy (to resume from it by copying it over latest.toml), then the pointer.
    for file in [dir.join("trainer.toml"), path] {
        write_text(&file, &text)?;
    }
    // Keep the newest and the one before it; older ones are no longer needed.
    let entries = std::fs::read_dir(run_dir).map_err(|source| TrainError::Output { path: run_dir.into(), source })?;
    for entry in entries.flatten() {
        let n = entry.file_name().to_string_lossy().into_owned();
        if n.starts_with("step-") && n != name && Some(&n) != previous.as_ref() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(dir)
}

/// Refuses to checkpoint FP8 scaling states holding a NaN or infinite scale, `scale_inv` or
/// amax (they would come back with `--resume`).
fn check_fp8_states(model: &Gpt, step: u64) -> Result<(), TrainError> {
    let mut bad = Vec::new();
    let mut visitor = FiniteStates(&mut bad);
    model.visit("", &mut visitor)?;
    match bad.first() {
        None => Ok(()),
        Some(path) => Err(TrainError::NonFinite {
            step,
            message: format!(
                "the FP8 scaling state {path} holds a NaN or infinite value ({} states in all); the checkpoint was \
                 not written. The previous checkpoint is kept: continue from it with --resume, with a lower --lr",
                bad.len()
            ),
        }),
    }
}

/// Collects the paths of FP8 scaling states that are not all finite.
struct FiniteStates<'a>(&'a mut Vec<String>);

impl ModuleVisitor for FiniteStates<'_> {
    fn param(&mut self, _: &str, _: ParamKind, _: &dyn Param) -> te_runtime::Result<()> {
        Ok(())
    }

    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> te_runtime::Result<()> {
        let s = state.snapshot()?;
        if !s.amax_history.iter().chain(&s.scale).chain(&s.scale_inv).all(|x| x.is_finite()) {
            self.0.push(path.to_owned());
        }
        Ok(())
    }
}

/// `latest.toml` of a run, or `None` when there is none.
fn read_latest(path: &Path) -> Result<Option<Latest>, TrainError> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text)
            .map(Some)
            .map_err(|e| TrainError::Resume { path: path.to_path_buf(), message: format!("unreadable: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TrainError::Output { path: path.to_path_buf(), source }),
    }
}

/// Restores model, optimizer, dropout stream and loss curve from the newest checkpoint in
/// `run_dir`; the steps it had done, or `None` when there is no checkpoint.
fn resume(
    run_dir: &Path,
    cfg: &TrainConfig,
    model: &mut Gpt,
    opt: &mut AdamW,
    records: &mut Vec<Record>,
) -> Result<Option<u64>, TrainError> {
    let path = run_dir.join("latest.toml");
    let Some(latest) = read_latest(&path)? else { return Ok(None) };
    let err = |message: String| TrainError::Resume { path: path.clone(), message };
    let want = [
        ("batch", latest.batch.to_string(), cfg.batch.to_string()),
        ("grad_accum", latest.grad_accum.to_string(), cfg.grad_accum.to_string()),
        ("seq_length", latest.seq_length.to_string(), cfg.model.seq_length.to_string()),
        ("lr", latest.lr.to_string(), cfg.lr.to_string()),
        ("seed", latest.data_seed.to_string(), cfg.data_seed.to_string()),
        ("model seed", latest.model_seed.to_string(), cfg.model.seed.to_string()),
    ];
    let differ: Vec<String> =
        want.iter().filter(|(_, a, b)| a != b).map(|(n, a, b)| format!("{n} {a} (checkpoint) vs {b}")).collect();
    if !differ.is_empty() {
        return Err(err(format!(
            "the run was made with other settings: {}; resume with the checkpoint's, or use another --out",
            differ.join(", ")
        )));
    }
    if latest.step > cfg.steps {
        return Err(err(format!("it is at step {}, beyond --steps {}", latest.step, cfg.steps)));
    }
    let dir = run_dir.join(&latest.dir);
    checkpoint::load(model, dir.join("model.safetensors"), &LoadOptions::default())?;
    opt.load_state(dir.join("optimizer.safetensors"))?;
    if opt.step_count() != latest.step {
        return Err(err(format!(
            "optimizer.safetensors is at step {}, latest.toml at {}",
            opt.step_count(),
            latest.step
        )));
    }
    model.set_dropout_offset(latest.dropout_offset);
    *records = read_history(&dir.join("history.csv"))?;
    Ok(Some(latest.step))
}

/// Writes a loss curve as `step,train_loss,val_loss,step_ms` (atomically).
fn write_history(path: &Path, records: &[Record]) -> Result<(), TrainError> {
    let mut text = String::from("step,train_loss,val_loss,step_ms\n");
    for r in records {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        text.push_str(&format!("{},{},{val},{}\n", r.step, r.train_loss, r.step_ms));
    }
    write_text(path, &text)
}

/// Writes `text` to `path` atomically (a crash leaves the old file or the new one).
fn write_text(path: &Path, text: &str) -> Result<(), TrainError> {
    write_atomic(path, |tmp| {
        std::fs::write(tmp, text)
            .map_err(|e| te_runtime::Error::Checkpoint { message: format!("{}: {e}", tmp.display()) })
    })?;
    Ok(())
}

/// Reads what [`write_history`] wrote (floats round-trip exactly through their shortest form).
fn read_history(path: &Path) -> Result<Vec<Record>, TrainError> {
    let bad =
        |line: usize| TrainError::Resume { path: path.to_path_buf(), message: format!("line {line} is malformed") };
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Output { path: path.into(), source })?;
    text.lines()
        .enumerate()
        .skip(1)
        .map(|(i, line)| {
            let f: Vec<&str> = line.split(',').collect();
            let [step, train, val, ms] = f[..] else { return Err(bad(i + 1)) };
            Ok(Record {
                step: step.parse().map_err(|_| bad(i + 1))?,
                train_loss: train.parse().map_err(|_| bad(i + 1))?,
                val_loss: if val.is_empty() { None } else { Some(val.parse().map_err(|_| bad(i + 1))?) },
                step_ms: ms.parse().map_err(|_| bad(i + 1))?,
            })
        })
        .collect()
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.csv");
        let records = vec![
            Record { step: 1, train_loss: 5.545_177_5, val_loss: None, step_ms: 12.345_678 },
            Record { step: 2, train_loss: 0.1 + 0.2, val_loss: Some(1.0 / 3.0), step_ms: 0.001 },
        ];
        write_history(&path, &records).unwrap();
        assert_eq!(read_history(&path).unwrap(), records);
        std::fs::write(&path, "step,train_loss,val_loss,step_ms\n1,2\n").unwrap();
        let e = read_history(&path).unwrap_err();
        assert!(e.to_string().contains("line 2 is malformed"), "{e}");
    }

    #[test]
    fn latest_toml_round_trips_and_missing_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest.toml");
        assert!(read_latest(&path).unwrap().is_none());
        let l = Latest {
            dir: "step-0000010".into(),
            step: 10,
            dropout_offset: 20,
            batch: 8,
            grad_accum: 2,
            seq_length: 128,
            lr: 6e-4,
            data_seed: 1,
            model_seed: 1,
        };
        std::fs::write(&path, toml::to_string(&l).unwrap()).unwrap();
        assert_eq!(read_latest(&path).unwrap(), Some(l));
        std::fs::write(&path, "dir = 3").unwrap();
        assert!(matches!(read_latest(&path), Err(TrainError::Resume { .. })));
    }
}
