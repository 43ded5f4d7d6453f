//! The GPU backend: `te_models::Gpt` trained from its seed, or a pretrained decoder of the family
//! (`te_models::decoder::train::DecoderLm`) fine-tuned on tokenized text, in FP8 (under
//! `fp8_autocast` with the config's recipe) or BF16, with AdamW (FP32 master weights, global-norm clipping, warmup + cosine LR)
//! and gradient accumulation (`is_first_microbatch`), reporting step time, tokens/s, peak GPU
//! memory and train/validation loss, saving checkpoints and resuming from them bit for bit.
//!
//! Data parallel (one process a GPU): each rank reads its shard of every global batch of
//! `N × batch` sequences, the gradients are averaged over the ranks while the backward runs
//! ([`te_nn::parallel::DataParallel`]), the FP8 amaxes are reduced over them (`fp8_group`), so
//! every rank takes the same step; rank 0 writes the checkpoints, in the single-GPU format.
//! With ZeRO the AdamW state is sharded over the data-parallel ranks (stage 1), and at stage 2
//! the gradients too: the last micro-batch's backward reduces each gradient piece to its owner
//! and frees the gradients a rank owns nothing of, and the step updates the parameters the
//! backward reduced ([`crate::optim::AdamW::step_reduced`]).
//! Tensor parallel: the layers split over the tensor-parallel group, each rank writing its
//! files of every checkpoint.

use super::batches::{check_context_seq, Pack, StepBatch, Tokens};
use super::eval::{calibrate, evaluate};
use super::graphed::{self, forward_backward, GraphedStep};
use super::lm::TrainLm;
use super::memory::MemoryPlan;
use crate::checkpoint::{CheckpointOptions, Checkpointer, DecoderSection, RunState};
use crate::config::{Precision, TrainConfig};
use crate::data::{Corpus, TokenId, TokenSplit};
use crate::error::TrainError;
use crate::nonfinite::NonFiniteGuard;
use crate::optim::{AdamW, OptimizerMemory, ZeroStage};
use crate::summary::{median, Progress, Record, RunSummary};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use te_models::decoder::train::DecoderLm;
use te_models::gpt::{Gpt, GptLoss};
use te_nn::checkpoint::tp::{shard_path, TP_RANK_KEY, TP_SIZE_KEY};
use te_nn::checkpoint::{self, LoadOptions, SaveOptions};
use te_nn::fp8::{Fp8Autocast, Recipe, ScalingState};
use te_nn::modules::{ModuleVisitor, Param, ParamKind, Recompute};
use te_nn::parallel::Parallel;
use te_nn::parallel::TpConfig;
use te_runtime::Device;

/// Trains `cfg.model` on `corpus` in `precision` on `dev`, calling `progress` after each step;
/// saves and resumes checkpoints as `ckpt` says; keeps activations as `recompute` says and
/// offloads the inputs of the first `offload` layers to pinned host memory (full recompute only;
/// the memory estimate accounts for both). With `parallel`, as one rank of a data- and/or
/// tensor-parallel run: every rank calls it with the same settings; the loss `progress` gets
/// and the records hold are the mean over the ranks.
///
/// # Errors
/// Data, runtime, device (out of memory, from the estimate before allocating) and checkpoint
/// errors; [`TrainError::Resume`] for a checkpoint made with other settings;
/// [`TrainError::NonFinite`] past `cfg.skip_nonfinite_steps` non-finite steps (or for a
/// non-finite FP8 scaling state at a checkpoint); [`TrainError::Interrupted`] after the step
/// during which `ckpt.stop` was set, its checkpoint written.
#[allow(clippy::too_many_arguments)] // the run's settings, each named as in finetune
pub(super) fn train(
    dev: &Arc<Device>,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    (parallel, zero, recompute): (&mut Parallel, ZeroStage, Recompute),
    offload: usize,
    progress: &mut dyn FnMut(&Progress),
) -> Result<(RunSummary, OptimizerMemory), TrainError> {
    if let Some(cp) = parallel.context() {
        return Err(TrainError::Unsupported {
            message: format!(
                "context parallelism ({} ranks) trains the decoder family (--model): the byte-level GPT presets have \
                 learned absolute positions and are not split yet; drop --context-parallel",
                cp.size()
            ),
        });
    }
    if zero.shards_parameters() {
        return Err(TrainError::Unsupported {
            message: "ZeRO-3 shards the layers of the decoder family (--model); the GPT presets shard up to the \
                      gradients: use --zero 2"
                .into(),
        });
    }
    // Before the memory check, which would otherwise price a mode the GPT presets refuse.
    Gpt::check_recompute(recompute)?;
    dev.synchronize()?;
    let fp8 = precision == Precision::Fp8;
    let (_, tp_size) = parallel.tensor_rank();
    let estimate = |r: Recompute| Gpt::training_bytes_offloaded(&cfg.model, cfg.batch, fp8, tp_size, r, offload);
    let suggested = cfg.model.num_layers.saturating_sub(1);
    let offloaded = || Gpt::training_bytes_offloaded(&cfg.model, cfg.batch, fp8, tp_size, Recompute::Full, suggested);
    let plan = MemoryPlan {
        parameters: cfg.model.num_parameters() as u64,
        gradient_bytes: cfg.model.num_parameters() as u64 * cfg.model.params_dtype.size_bytes() as u64,
        micro_batches: cfg.grad_accum,
        data_parallel: parallel.replica_rank().1,
        zero,
        recompute,
        recompute_possible: cfg.model.moe.is_none(),
        selective_possible: false,
        zero3_saving: None,
        estimate: &estimate,
        offload: (offload == 0 && suggested > 0).then_some((suggested, &offloaded as &dyn Fn() -> u64)),
    };
    plan.check(dev, 0, |advice| {
        let m = &cfg.model;
        format!(
            "training a {}-layer GPT of hidden size {} ({} parameters) on micro-batches of {} × {} tokens in {} (the \
             weights, AdamW state and activations{}, estimated before allocating{advice})",
            m.num_layers,
            m.hidden_size,
            m.num_parameters(),
            cfg.batch,
            m.seq_length,
            if fp8 { "FP8" } else { "BF16" },
            if recompute.is_full() { " with full recompute" } else { "" }
        )
    })?;
    dev.reset_peak_memory()?;
    let tp = parallel.tensor().cloned();
    let mut model = match &tp {
        Some(tp) => Gpt::with_tensor_parallel(dev, cfg.model.clone(), tp.clone())?,
        None => Gpt::new(dev, cfg.model.clone())?,
    };
    model.set_recompute(recompute)?;
    model.set_offload_activations(offload)?;
    if let Some(dp) = parallel.data() {
        // Every rank builds the model from the same seed; the broadcast makes sure.
        dp.broadcast_parameters(&mut model)?;
    }
    let data = Tokens::Windows { train: &corpus.train[..], val: &corpus.val[..], seq: cfg.model.seq_length };
    let ckpt = (ckpt, None);
    let layout = (parallel, zero, recompute);
    run(dev, &mut model, tp, data, cfg, precision, ckpt, layout, progress, cfg.model.num_parameters())
}

/// Fine-tunes `model` on `data`'s token ids in rows of `seq` tokens packed as `pack` says, as
/// [`train`] trains a GPT (data parallel over `parallel`'s ranks; no tensor parallelism yet),
/// after checking the memory estimate and, in FP8 with delayed scaling, calibrating.
///
/// # Errors
/// As [`train`]; [`TrainError::Unsupported`] for a tensor-parallel layout.
#[allow(clippy::too_many_arguments)] // the run's settings, each named as in train
pub(super) fn finetune(
    dev: &Arc<Device>,
    model: &mut DecoderLm,
    data: &TokenSplit,
    (seq, pack): (usize, Pack),
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    (parallel, zero, recompute): (&mut Parallel, ZeroStage, Recompute),
    progress: &mut dyn FnMut(&Progress),
) -> Result<(RunSummary, OptimizerMemory), TrainError> {
    if parallel.tensor().is_some() {
        return Err(TrainError::Unsupported {
            message: "fine-tuning a decoder of the family is data (and context) parallel only: drop --tensor-parallel"
                .into(),
        });
    }
    let (_, cp) = parallel.context_rank();
    if cp > 1 && pack == Pack::Thd {
        return Err(TrainError::Unsupported {
            message: format!(
                "--pack thd with --context-parallel {cp} is not built (packed documents are not split over ranks \
                 yet): use --pack blocks or drop --context-parallel"
            ),
        });
    }
    check_context_seq(seq, cp)?;
    if zero.shards_parameters() && !recompute.is_full() {
        return Err(TrainError::Unsupported {
            message: "--zero 3 gathers each layer's weights for its forward and again for its backward, which needs \
                      full activation recompute (without it the saved contexts keep every layer's weights): add \
                      --recompute full, or use --zero 2"
                .into(),
        });
    }
    dev.synchronize()?;
    // The estimate less the BF16 weights already on the device.
    let fp8 = precision == Precision::Fp8;
    let m = model.config();
    let resident = model.num_parameters() as u64 * 2;
    // With context parallelism each rank's activations are those of its seq / cp tokens.
    // Offloaded layer inputs (full recompute) leave the device: what they save on a rank's
    // seq / cp tokens.
    let offload_saving = |n: usize| {
        let local = seq / cp;
        let on = DecoderLm::training_bytes_with(m, cfg.batch, local, fp8, Recompute::Full);
        on - DecoderLm::training_bytes_offloaded(m, cfg.batch, local, fp8, Recompute::Full, n)
    };
    let offloading = model.offload_activations();
    let estimate = |r: Recompute| {
        let base = DecoderLm::training_bytes_cp(m, cfg.batch, seq, cp, fp8, r);
        if r.is_full() {
            base.saturating_sub(offload_saving(offloading))
        } else {
            base
        }
    };
    let suggested = m.num_layers.saturating_sub(1);
    let offloaded = || {
        DecoderLm::training_bytes_cp(m, cfg.batch, seq, cp, fp8, Recompute::Full)
            .saturating_sub(offload_saving(suggested))
    };
    let plan = MemoryPlan {
        parameters: model.num_parameters() as u64,
        // BF16 gradients, as the estimate counts them.
        gradient_bytes: model.num_parameters() as u64 * 2,
        micro_batches: cfg.grad_accum,
        data_parallel: parallel.replica_rank().1,
        zero,
        recompute,
        recompute_possible: true,
        selective_possible: true,
        zero3_saving: Some(DecoderLm::zero3_weight_saving(m, parallel.replica_rank().1)),
        estimate: &estimate,
        offload: (offloading == 0 && suggested > 0).then_some((suggested, &offloaded as &dyn Fn() -> u64)),
    };
    // With context parallelism the rank's share; without it, the flag that would split it.
    let (split, hint) = if cp > 1 {
        (format!(", {} tokens a sequence on each of {cp} context-parallel ranks", seq / cp), "")
    } else {
        (String::new(), "; --context-parallel N splits each sequence over N GPUs")
    };
    plan.check(dev, resident, |advice| {
        format!(
            "fine-tuning a {}-layer decoder of hidden size {} and vocabulary {} on micro-batches of {} × {seq} tokens in \
             {}{split} (the gradients, AdamW state, activations and logits, estimated before allocating; fewer tokens a \
             batch need less{hint}{advice})",
            m.num_layers,
            m.hidden_size,
            m.vocab_size,
            cfg.batch,
            if fp8 { "FP8" } else { "BF16" },
        )
    })?;
    dev.reset_peak_memory()?;
    model.set_recompute(recompute)?;
    TrainLm::set_context_parallel(model, parallel.context().cloned())?;
    if let Some(dp) = parallel.data() {
        dp.broadcast_parameters(model)?;
    }
    let parameters = model.num_parameters();
    let tokens: Tokens<'_, u32> = match pack {
        Pack::Blocks => Tokens::Windows { train: data.train.tokens(), val: data.val.tokens(), seq },
        Pack::Thd => Tokens::Thd { train: &data.train, val: &data.val, seq },
    };
    if precision == Precision::Fp8 && cfg.recipe.calibrates() {
        calibrate(dev, model, &tokens, cfg, parallel)?;
    }
    // What its checkpoints record of the decoder, and a resumed run must share.
    let decoder = DecoderSection::new(model.config(), pack, ckpt.model_source.clone());
    let layout = (parallel, zero, recompute);
    run(dev, model, None, tokens, cfg, precision, (ckpt, Some(decoder)), layout, progress, parameters)
}

/// The steps of a run of `model` (built, its parameters equal on every rank), checkpointed as
/// `ckpt` says with the fine-tuned decoder it records (`None`: a GPT run).
#[allow(clippy::too_many_arguments)] // the run's settings, each named as in train
fn run<M: TrainLm, T: TokenId>(
    dev: &Arc<Device>,
    model: &mut M,
    tp: Option<TpConfig>,
    data: Tokens<'_, T>,
    cfg: &TrainConfig,
    precision: Precision,
    (ckpt, decoder): (&CheckpointOptions, Option<DecoderSection>),
    (parallel, zero, recompute): (&mut Parallel, ZeroStage, Recompute),
    progress: &mut dyn FnMut(&Progress),
    parameters: usize,
) -> Result<(RunSummary, OptimizerMemory), TrainError> {
    let fp8 = precision == Precision::Fp8;
    match recompute {
        Recompute::Full => tracing::info!(
            "activation recompute: full (each layer keeps its input; the backward runs the layer's forward again)"
        ),
        Recompute::Selective => tracing::info!(
            "activation recompute: selective (each layer keeps its attention context and its MLP's input; the \
             backward runs the MLP's forward again)"
        ),
        Recompute::None => {}
    }
    let offloaded = model.offload_activations();
    if offloaded > 0 {
        tracing::info!(
            "activation offload: the inputs of the first {offloaded} layers go to pinned host memory in the forward \
             and come back a layer ahead in the backward"
        );
    }
    let mut opt = match (zero, parallel.data(), &tp) {
        (zero, _, Some(_)) if zero.shards_optimizer() => {
            return Err(TrainError::Unsupported {
                message: format!(
                    "ZeRO stage {} with tensor parallelism is not built yet: drop --zero or --tensor-parallel",
                    zero.number()
                ),
            })
        }
        // ZeRO-3: the layers sharded first (each rank keeps the pieces it will hold the masters
        // of, a layer at a time), then the optimizer built from those pieces: the whole weights
        // and the optimizer state are never on the device together.
        (ZeroStage::Parameters, Some(dp), None) => {
            let group = dp.group().clone();
            model.set_zero3(group.clone(), AdamW::zero_shards(&*model, dp.size())?)?;
            let pieces = model.zero3_pieces().unwrap_or_default();
            AdamW::new_zero3(dev, &*model, cfg.adamw_config(), group, &pieces)?
        }
        // Sharded over the data-parallel group (on the device's stream); one rank holds it all.
        (zero, Some(dp), None) if zero.shards_optimizer() => {
            AdamW::new_zero_stage(dev, &*model, cfg.adamw_config(), dp.group().clone(), zero)?
        }
        _ => AdamW::new(dev, &*model, cfg.adamw_config())?,
    };
    if let Some(tp) = &tp {
        opt = opt.with_tensor_parallel(tp.group.clone());
    }
    // ZeRO-2: the backward reduces each gradient piece to its owner (whole all-reduces otherwise;
    // the layout may have run another stage before).
    let shards = opt.grad_shards().cloned();
    let (gradient_bytes, released_gradient_bytes) =
        gradient_bytes(&*model, shards.as_ref(), parallel.replica_rank().0)?;
    if let Some(dp) = parallel.data() {
        dp.set_grad_shards(shards)?;
    }
    let memory = OptimizerMemory {
        stage: zero,
        ranks: opt.zero_ranks().unwrap_or(1),
        bytes_per_rank: opt.state_bytes(),
        replicated_bytes: opt.replicated_state_bytes(),
        gradient_bytes,
        released_gradient_bytes,
        sharded_weight_bytes: model.zero3_bytes(),
    };
    tracing::info!("{}", memory.describe());
    let (tp_rank, tp_size) = parallel.tensor_rank();
    let recipe = fp8.then_some(cfg.recipe);
    let mut run = GpuRun { model, opt, tp, recipe };
    let seq = data.seq();
    // The ranks of a tensor-parallel group read the same data; data-parallel ranks their shards;
    // the context-parallel ranks of one data rank their chunks of the same windows.
    let (rank, world) = parallel.data_rank();
    let mut train_batches = data.train(cfg.data_seed, cfg.batch, (rank, world), parallel.context_rank())?;
    let mut records = Vec::new();
    let finetune = decoder.is_some();
    // Rank 0 of the replicas (data × context) writes; the others hold the same parameters.
    let (writer, _) = parallel.replica_rank();
    let mut checkpoints = Checkpointer::new(ckpt, cfg, precision)
        .data_parallel(writer, world)
        .tensor_parallel(tp_rank, tp_size)
        .decoder(decoder);
    let done = checkpoints.resume(&mut run, &mut records)?;
    train_batches.skip(done * cfg.grad_accum as u64)?;
    // The amaxes are reduced over every rank (TE's default fp8_group): one set of scales.
    let autocast = Fp8Autocast::new(cfg.recipe).with_group(parallel.world().cloned());
    let mut times = Vec::new();
    let mut guard = NonFiniteGuard::new(cfg.skip_nonfinite_steps);
    // --cuda-graph: the first step of this process runs eagerly, the next is captured.
    let mut graph_wanted = cfg.cuda_graph;
    if graph_wanted {
        let recomputes = recompute.recomputes();
        if let Some(why) = graphed::unsupported(parallel, run.model.is_moe(), data.is_windows(), finetune, recomputes) {
            tracing::warn!("--cuda-graph: {why}");
            graph_wanted = false;
        }
    }
    let mut graphed: Option<GraphedStep> = None;
    let mut graphed_steps = 0u64;
    for step in done + 1..=cfg.steps {
        let start = Instant::now();
        let mut replayed = None;
        if graph_wanted && step > done + 1 {
            let hosts = GraphedStep::next_hosts(&mut train_batches, cfg.grad_accum)?;
            if graphed.is_none() {
                let parts = (&mut *run.model, &mut run.opt);
                match GraphedStep::capture(dev, parts, (seq, cfg.batch, &hosts), precision, &autocast) {
                    Ok(g) => graphed = Some(g),
                    Err(TrainError::Runtime(e @ te_runtime::Error::Capture { .. })) => {
                        tracing::warn!("--cuda-graph: the step could not be captured ({e}); stepping eagerly");
                        graph_wanted = false;
                    }
                    Err(e) => return Err(e),
                }
            }
            match graphed.as_mut() {
                Some(g) => {
                    replayed = Some(g.replay(dev, (&mut *run.model, &mut run.opt), &hosts)?);
                    graphed_steps += 1;
                }
                None => {
                    // The capture failed: this step's batches run eagerly.
                    let batches = hosts
                        .iter()
                        .map(|h| StepBatch::windows(dev, seq, cfg.batch, h))
                        .collect::<te_runtime::Result<Vec<_>>>()?;
                    replayed = Some(eager_step(&mut run, &batches, (precision, &autocast), parallel)?);
                }
            }
        }
        let (mut train_loss, stats) = match replayed {
            Some(r) => r,
            None => {
                let batches = (0..cfg.grad_accum)
                    .map(|_| train_batches.next(dev, seq, cfg.batch))
                    .collect::<Result<Vec<_>, _>>()?;
                eager_step(&mut run, &batches, (precision, &autocast), parallel)?
            }
        };
        // The ranks' mean loss (a NaN on one is a NaN on all: they skip and stop together).
        train_loss = parallel.mean(train_loss)?;
        guard.check(step, (train_loss, stats.grad_norm, stats.skipped), checkpoints.last())?;
        run.model.zero_grad();
        dev.synchronize()?;
        let step_ms = start.elapsed().as_secs_f64() * 1e3;
        times.push(step_ms);
        let val_loss = if step % cfg.eval_interval == 0 || step == cfg.steps {
            Some(evaluate(dev, &mut *run.model, &data, cfg, (precision, &autocast), parallel)?)
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
            lr: stats.lr,
            step_ms,
        });
        // A stop requested on any rank stops every rank after this step.
        let stop = parallel.mean(f32::from(u8::from(ckpt.stop_requested())))? > 0.0;
        checkpoints.after_step(step, &run, &records, stop)?;
    }
    if let Some(dp) = parallel.data() {
        dp.set_grad_shards(None)?;
    }
    // The layers whole again for what reads the model after the run (export, generation). The
    // optimizer's state goes first: under ZeRO-3 the whole layers arrive beside the pieces, and
    // with the state still held that moment would be the run's peak (above ZeRO-2's step).
    let GpuRun { model, opt, .. } = run;
    drop(opt);
    model.zero3_unshard()?;
    let mut after_first: Vec<f64> = times.iter().skip(1).copied().collect();
    let median_ms = median(&mut after_first);
    // Each token once: the context-parallel ranks of a data rank share its windows.
    let tokens = (seq * cfg.batch * cfg.grad_accum * world) as f64;
    let summary = RunSummary {
        precision,
        records,
        tokens_per_s: tokens / (median_ms / 1e3),
        ranks: parallel.world_size(),
        peak_memory: dev.peak_memory()?,
        // The whole model's, also when each rank holds a tensor-parallel slice of it.
        parameters,
        graphed_steps,
    };
    Ok((summary, memory))
}

/// One eager step on `batches` (one a micro-batch): the micro-batches' mean loss, read after
/// the optimizer step was issued (the host never waits for the device mid-step), and the
/// optimizer's statistics.
fn eager_step<M: TrainLm>(
    run: &mut GpuRun<'_, M>,
    batches: &[StepBatch],
    (precision, autocast): (Precision, &Fp8Autocast),
    parallel: &mut Parallel,
) -> Result<(f32, crate::optim::StepStats), TrainError> {
    let losses = forward_backward(&mut *run.model, batches, precision, autocast, parallel)?;
    // ZeRO-2: the parameters the backward reduced (each rank holds its pieces' gradients only);
    // ZeRO-3: the update written into this rank's pieces of the layers' weights.
    let stats = match (parallel.data().and_then(|dp| dp.reduced().map(<[bool]>::to_vec)), run.model.zero3_pieces()) {
        (Some(reduced), Some(pieces)) => run.opt.step_sharded(&mut *run.model, &reduced, &pieces)?,
        (Some(reduced), None) => run.opt.step_reduced(&mut *run.model, &reduced)?,
        (None, _) => run.opt.step(&mut *run.model)?,
    };
    let sum = losses.iter().map(GptLoss::value).sum::<Result<f32, _>>()?;
    Ok((sum / losses.len() as f32, stats))
}

/// Bytes of all of `model`'s gradients (each parameter's elements in its dtype, the gradient's),
/// and of those `rank` releases under ZeRO-2's `shards` (the parameters it owns no piece of; 0
/// without shards).
fn gradient_bytes<M: TrainLm>(
    model: &M,
    shards: Option<&te_nn::parallel::GradShards>,
    rank: usize,
) -> Result<(u64, u64), TrainError> {
    let (mut all, mut released, mut i) = (0u64, 0u64, 0usize);
    model.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> te_runtime::Result<()> {
        let bytes = (p.numel() * p.dtype().size_bytes()) as u64;
        all += bytes;
        if shards.is_some_and(|s| !s.owns(rank, i)) {
            released += bytes;
        }
        i += 1;
        Ok(())
    })?;
    Ok((all, released))
}

/// The GPU run's model and optimizer, the tensor-parallel group its layers split over, and the
/// FP8 recipe it trains with (recorded in its checkpoints, checked when they load).
struct GpuRun<'a, M> {
    model: &'a mut M,
    opt: AdamW,
    tp: Option<TpConfig>,
    recipe: Option<Recipe>,
}

impl<M> GpuRun<'_, M> {
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

impl<M: TrainLm> RunState for GpuRun<'_, M> {
    fn save_files(&self, dir: &Path, step: u64) -> Result<(), TrainError> {
        let mut options = SaveOptions { recipe: self.recipe, ..SaveOptions::default() };
        options.metadata.insert("step".into(), step.to_string());
        if let Some(tp) = &self.tp {
            options.metadata.insert(TP_RANK_KEY.into(), tp.group.rank().to_string());
            options.metadata.insert(TP_SIZE_KEY.into(), tp.size().to_string());
        }
        // ZeRO-3: the layers' weights gathered whole for the save (every rank joins, join_save).
        let path = self.file(dir, "model");
        self.model.with_whole_parameters(&mut |m| checkpoint::save(m, &path, &options))?;
        self.opt.save_state(self.file(dir, "optimizer"))?;
        Ok(())
    }

    fn load_files(&mut self, dir: &Path) -> Result<u64, TrainError> {
        let (model, optimizer) = (self.file(dir, "model"), self.file(dir, "optimizer"));
        checkpoint::load(&mut *self.model, model, &LoadOptions { recipe: self.recipe, ..LoadOptions::default() })?;
        // ZeRO-3: the load set whole weights; each rank keeps its pieces of them again.
        self.model.zero3_reshard()?;
        self.opt.load_state(optimizer)?;
        Ok(self.opt.step_count())
    }

    fn join_save(&self, dir: &Path) -> Result<(), TrainError> {
        // ZeRO-3: the writer gathers the layers' weights whole; every rank joins the gathers.
        if self.model.is_zero3() {
            self.model.with_whole_parameters(&mut |_| Ok(()))?;
        }
        // A sharded optimizer's save gathers every rank's pieces to the writer (rank 0 of the
        // data-parallel group, which writes the file; here nothing is written).
        if self.opt.zero_ranks().is_some() {
            self.opt.save_state(self.file(dir, "optimizer"))?;
        }
        Ok(())
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
