//! The training job of `te train`: one GPT, trained with the same seed and data order in FP8
//! (DelayedScaling, HYBRID) and in BF16, with AdamW (FP32 master weights, global-norm clipping,
//! warmup + cosine LR) and gradient accumulation (`is_first_microbatch`), reporting step time,
//! tokens/s, peak GPU memory and train/validation loss, saving checkpoints and resuming from
//! them bit for bit.
//!
//! Data parallel (one process a GPU, `te train --nproc-per-node N` or a `torchrun`-style launch):
//! each rank reads its shard of every global batch of `N × batch` sequences, the gradients are
//! averaged over the ranks while the backward runs ([`DataParallel`]), the FP8 amaxes are
//! reduced over them (`fp8_group`), so every rank takes the same step; rank 0 writes the
//! checkpoints, in the single-GPU format.
//!
//! Checkpoints: [`crate::run_checkpoint`].

use crate::data::{Batcher, Corpus, DataError};
use crate::run_checkpoint::{Checkpointer, RunState};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use te_models::gpt::{Gpt, GptConfig, GptLoss, MicroBatch};
use te_nn::checkpoint::tp::{shard_path, TP_RANK_KEY, TP_SIZE_KEY};
use te_nn::checkpoint::{self, LoadOptions, SaveOptions};
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, Fp8Autocast, Recipe, ScalingState};
use te_nn::modules::{ModuleVisitor, Param, ParamKind, TokenIds};
use te_nn::parallel::Parallel;
use te_nn::parallel::TpConfig;
use te_nn::Module;
use te_runtime::Device;
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

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
    /// the run finished `step` and wrote `checkpoint` (none without a checkpoint directory).
    #[error("stopped on request after step {step}: {}", match checkpoint {
        Some(c) => format!("checkpoint written at {}; continue with --resume", c.display()),
        None => "no checkpoint (--no-checkpoint)".into(),
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

/// The numeric format of a run (`fp8` or `bf16` in config files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
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

    /// The precision [`Precision::name`] names; a message for another name.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "fp8" => Ok(Precision::Fp8),
            "bf16" => Ok(Precision::Bf16),
            p => Err(format!("precision `{p}`: expected fp8 or bf16")),
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
    /// Blockwise FP8 (TE's `Float8BlockScaling`) for [`Precision::Fp8`] runs instead of
    /// `recipe` (Hopper GPUs, or the CPU path).
    pub block_scaling: Option<Float8BlockScaling>,
    /// Steps with a NaN or infinite loss or gradient norm that are skipped (weights not
    /// updated) before the run stops ([`NonFiniteGuard`]); 0: the first one stops it.
    pub skip_nonfinite_steps: u64,
}

impl TrainConfig {
    /// The recipe of [`Precision::Fp8`] runs: `block_scaling` when set, else `recipe`.
    pub fn fp8_recipe(&self) -> Recipe {
        self.block_scaling.map_or(self.recipe.into(), Recipe::from)
    }
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
    /// time), of all ranks together in a data-parallel run; NaN when it ran fewer than two.
    pub tokens_per_s: f64,
    /// Processes the run trained with: the data-parallel ranks, one a GPU (1 on a single GPU
    /// and on the CPU path); the tokens/s of one is `tokens_per_s / ranks`.
    pub ranks: usize,
    /// Peak device memory held by this run's allocations (the memory pool's high-water mark:
    /// parameters, gradients, optimizer state, activations, workspaces), bytes; 0 on the CPU.
    pub peak_memory: u64,
    /// Parameters of the model.
    pub parameters: usize,
}

/// Trains `cfg.model` on `corpus` in `precision` on the GPU, calling `progress(step, loss)` after
/// each step; saves and resumes checkpoints as `ckpt` says. With `dp`, as one rank of a
/// data-parallel run (see the module docs): every rank calls it with the same settings; the
/// loss `progress` gets and the records hold are the mean over the ranks.
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
    parallel: &mut Parallel,
    mut progress: impl FnMut(u64, f32),
) -> Result<RunSummary, TrainError> {
    dev.synchronize()?;
    let fp8 = precision == Precision::Fp8;
    let (_, tp_size) = parallel.tensor_rank();
    dev.check_free_memory(Gpt::tensor_parallel_training_bytes(&cfg.model, cfg.batch, fp8, tp_size), || {
        let m = &cfg.model;
        format!(
            "training a {}-layer GPT of hidden size {} ({} parameters) on micro-batches of {} × {} tokens in {}              (the weights, AdamW state and activations, estimated before allocating)",
            m.num_layers,
            m.hidden_size,
            m.num_parameters(),
            cfg.batch,
            m.seq_length,
            if fp8 { "FP8" } else { "BF16" }
        )
    })?;
    dev.reset_peak_memory()?;
    let tp = parallel.tensor().cloned();
    let mut model = match &tp {
        Some(tp) => Gpt::with_tensor_parallel(dev, cfg.model.clone(), tp.clone())?,
        None => Gpt::new(dev, cfg.model.clone())?,
    };
    if let Some(dp) = parallel.data() {
        // Every rank builds the model from the same seed; the broadcast makes sure.
        dp.broadcast_parameters(&mut model)?;
    }
    let mut opt = AdamW::new(dev, &model, adamw_config(cfg))?;
    if let Some(tp) = &tp {
        opt = opt.with_tensor_parallel(tp.group.clone());
    }
    let (tp_rank, tp_size) = parallel.tensor_rank();
    let recipe = fp8.then(|| cfg.fp8_recipe());
    let mut run = GpuRun { model, opt, tp, recipe };
    let seq = cfg.model.seq_length;
    // The ranks of a tensor-parallel group read the same data; data-parallel ranks their shards.
    let (rank, world) = parallel.data_rank();
    let mut train_batches = Batcher::sharded(cfg.data_seed, seq, cfg.batch, rank, world);
    let mut records = Vec::new();
    let mut checkpoints =
        Checkpointer::new(ckpt, cfg, precision).data_parallel(rank, world).tensor_parallel(tp_rank, tp_size);
    let done = checkpoints.resume(&mut run, &mut records)?;
    train_batches.skip(&corpus.train, done * cfg.grad_accum as u64, "train")?;
    // The amaxes are reduced over every rank (TE's default fp8_group): one set of scales.
    let autocast = Fp8Autocast::new(cfg.fp8_recipe()).with_group(parallel.world().cloned());
    let mut times = Vec::new();
    let mut guard = NonFiniteGuard::new(cfg.skip_nonfinite_steps);
    for step in done + 1..=cfg.steps {
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
                Precision::Fp8 => autocast.clone().run(|| run.model.forward_loss_with(&ids, &targets, mb))?,
                Precision::Bf16 => run.model.forward_loss_with(&ids, &targets, mb)?,
            };
            match parallel.data() {
                // The last micro-batch's backward reduces each part's gradients as they complete.
                Some(dp) if micro + 1 == cfg.grad_accum => {
                    run.model.backward_with(ctx, &mut |part| dp.reduce_grads(part))?;
                    dp.finish()?;
                }
                _ => run.model.backward(ctx)?,
            }
            losses.push(loss);
        }
        let stats = run.opt.step(&mut run.model)?;
        // Read after the step was issued: the host never waited for the device mid-step.
        let loss_sum = losses.iter().map(GptLoss::value).sum::<Result<f32, _>>()?;
        let mut train_loss = loss_sum / cfg.grad_accum as f32;
        // The ranks' mean loss (a NaN on one is a NaN on all: they skip and stop together).
        train_loss = parallel.mean(train_loss)?;
        guard.check(step, (train_loss, stats.grad_norm, stats.skipped), checkpoints.last())?;
        run.model.zero_grad();
        dev.synchronize()?;
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        times.push(step_ms);
        let val_loss = if step % cfg.eval_interval == 0 || step == cfg.steps {
            Some(evaluate(dev, &mut run.model, corpus, cfg, precision, &autocast)?)
        } else {
            None
        };
        records.push(Record { step, train_loss, val_loss, step_ms });
        progress(step, train_loss);
        // A stop requested on any rank stops every rank after this step.
        let stop = parallel.mean(f32::from(u8::from(ckpt.stop_requested())))? > 0.0;
        checkpoints.after_step(step, &run, &records, stop)?;
    }
    let mut after_first: Vec<f64> = times.iter().skip(1).copied().collect();
    let median_ms = median(&mut after_first);
    let tokens = (seq * cfg.batch * cfg.grad_accum * world) as f64;
    Ok(RunSummary {
        precision,
        records,
        tokens_per_s: tokens / (median_ms / 1e3),
        ranks: parallel.world_size(),
        peak_memory: dev.peak_memory()?,
        // The whole model's, also when each rank holds a tensor-parallel slice of it.
        parameters: cfg.model.num_parameters(),
    })
}

/// The GPU run's model and optimizer, the tensor-parallel group its layers split over, and the
/// FP8 recipe it trains with (recorded in its checkpoints, checked when they load).
struct GpuRun {
    model: Gpt,
    opt: AdamW,
    tp: Option<TpConfig>,
    recipe: Option<Recipe>,
}

impl GpuRun {
    /// `dir/<name>.safetensors`, or this tensor-parallel rank's file of it
    /// (`<name>.tp-<rank>-of-<size>.safetensors`, the files `te checkpoint merge` reads).
    fn file(&self, dir: &Path, name: &str) -> PathBuf {
        let path = dir.join(format!("{name}.safetensors"));
        match &self.tp {
            Some(tp) => shard_path(&path, tp.group.rank(), tp.size()),
            None => path,
        }
    }
}

impl RunState for GpuRun {
    fn save_files(&self, dir: &Path, step: u64) -> Result<(), TrainError> {
        let mut options = SaveOptions { recipe: self.recipe, ..SaveOptions::default() };
        options.metadata.insert("step".into(), step.to_string());
        if let Some(tp) = &self.tp {
            options.metadata.insert(TP_RANK_KEY.into(), tp.group.rank().to_string());
            options.metadata.insert(TP_SIZE_KEY.into(), tp.size().to_string());
        }
        checkpoint::save(&self.model, self.file(dir, "model"), &options)?;
        self.opt.save_state(self.file(dir, "optimizer"))?;
        Ok(())
    }

    fn load_files(&mut self, dir: &Path) -> Result<u64, TrainError> {
        let (model, optimizer) = (self.file(dir, "model"), self.file(dir, "optimizer"));
        checkpoint::load(&mut self.model, model, &LoadOptions { recipe: self.recipe, ..LoadOptions::default() })?;
        self.opt.load_state(optimizer)?;
        Ok(self.opt.step_count())
    }

    fn files_written(&self) -> Result<(), TrainError> {
        if let Some(tp) = &self.tp {
            tp.group.barrier()?;
        }
        Ok(())
    }

    fn dropout_offset(&self) -> u64 {
        self.model.dropout_offset()
    }

    fn set_dropout_offset(&mut self, offset: u64) -> Result<(), TrainError> {
        self.model.set_dropout_offset(offset);
        Ok(())
    }

    fn nonfinite_states(&self) -> Result<Vec<String>, TrainError> {
        let mut bad = Vec::new();
        self.model.visit("", &mut FiniteStates(&mut bad))?;
        Ok(bad)
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
/// in evaluation mode (no dropout; the training run's dropout stream does not move). FP8 runs
/// evaluate under `autocast` (the run's recipe and amax reduction group: every rank of a
/// data-parallel run evaluates the same batches, and their scales stay equal).
fn evaluate(
    dev: &Arc<Device>,
    model: &mut Gpt,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    autocast: &Fp8Autocast,
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
            // The language-model loss alone: a MoE model's aux losses are left out of validation.
            let mb = MicroBatch::default();
            let (loss, _ctx) = match precision {
                Precision::Fp8 => autocast.clone().run(|| model.forward_loss_with(&ids, &targets, mb))?,
                Precision::Bf16 => model.forward_loss_with(&ids, &targets, mb)?,
            };
            sum += loss.lm_value()?;
        }
        Ok(sum / cfg.eval_batches as f32)
    };
    let mean = run();
    model.set_training(true);
    mean
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

/// The results of `runs` as the Markdown summary `te train` prints and writes (what
/// docs/training.md holds): `where_` the device line, `preset` the preset's name; the tokens/s of
/// all GPUs and of one for a data-parallel run.
pub fn summary_table(where_: &str, preset: &str, cfg: &TrainConfig, runs: &[RunSummary]) -> String {
    let mut s = format!(
        "{where_}, {}; preset {preset}, {} parameters, {} steps × {} sequences × {} tokens\n\n",
        date(),
        runs.first().map_or(0, |r| r.parameters),
        cfg.steps,
        cfg.batch * cfg.grad_accum,
        cfg.model.seq_length
    );
    // Data parallel: the tokens/s of all ranks and of one, and one GPU's peak memory.
    let ranks = runs.first().map_or(1, |r| r.ranks);
    if ranks > 1 {
        s.push_str(&format!(
            "| run | final train loss | final validation loss | tokens/s ({ranks} GPUs) | tokens/s per GPU | peak memory \
             per GPU (GiB) |\n"
        ));
        s.push_str("|---|---|---|---|---|---|\n");
    } else {
        s.push_str("| run | final train loss | final validation loss | tokens/s | peak memory (GiB) |\n");
        s.push_str("|---|---|---|---|---|\n");
    }
    for r in runs {
        let last = r.records.last();
        let val = r.records.iter().rev().find_map(|r| r.val_loss);
        let per_gpu = if ranks > 1 { format!(" {:.0} |", r.tokens_per_s / r.ranks as f64) } else { String::new() };
        s.push_str(&format!(
            "| {} | {:.4} | {} | {:.0} |{per_gpu} {:.2} |\n",
            r.precision.name(),
            last.map_or(f32::NAN, |l| l.train_loss),
            val.map_or("–".into(), |v| format!("{v:.4}")),
            r.tokens_per_s,
            r.peak_memory as f64 / (1u64 << 30) as f64
        ));
    }
    if let [a, b] = runs {
        if let (Some(va), Some(vb)) =
            (a.records.iter().rev().find_map(|r| r.val_loss), b.records.iter().rev().find_map(|r| r.val_loss))
        {
            s.push_str(&format!(
                "\nFP8 ÷ BF16: validation loss {:.4}, tokens/s {:.3}, peak memory {:.3}\n",
                va / vb,
                a.tokens_per_s / b.tokens_per_s,
                a.peak_memory as f64 / b.peak_memory.max(1) as f64
            ));
        }
    }
    s
}

/// Today's date (UTC).
fn date() -> String {
    humantime::format_rfc3339_seconds(std::time::SystemTime::now()).to_string()[..10].to_owned()
}
