//! Fine-tunes a pretrained decoder of the family (Llama, Qwen2, Qwen3, Gemma 3: a `.gguf` file
//! or a Hugging Face directory) on a text corpus, on one GPU, in FP8 and/or BF16, as TE's
//! `te_llama` tutorial does with transformers: the model's own tokenizer and vocabulary, windows
//! packed across documents with EOS between them, AdamW with warmup and cosine decay, the
//! validation loss of the pretrained model first and along the run, and the fine-tuned model
//! saved as a Hugging Face directory that transformers loads.
//!
//! ```text
//! cargo run --release --example finetune -- --model MODEL --data FILE_OR_DIR ... \
//!     [--steps 100] [--seq 1024] [--batch 8] [--lr 2e-5] [--precision both|fp8|bf16] \
//!     [--recipe delayed|current|block] [--cache DIR] [--save-hf DIR]
//! ```
//!
//! Each precision starts from the checkpoint's weights (rounded to BF16) with the same data
//! order; FP8 with delayed scaling is calibrated on the first batches (TE's calibration mode).

use clap::Parser;
use std::path::PathBuf;
use std::time::Instant;
use te_models::decoder::train::DecoderLm;
use te_models::decoder::{load_model, LoadedModel};
use te_nn::fp8::Recipe;
use te_runtime::{DType, Device};
use te_train::data::TokenDataset;
use te_train::{Backend, Pack, Precision, TrainConfig, Trainer};

#[derive(Parser)]
struct Args {
    /// A `.gguf` file or a Hugging Face directory.
    #[arg(long)]
    model: PathBuf,
    /// Text files, directories or `.jsonl` files (repeatable).
    #[arg(long, required = true)]
    data: Vec<PathBuf>,
    /// Where the token cache goes (default: no cache).
    #[arg(long)]
    cache: Option<PathBuf>,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    steps: u64,
    /// Tokens per training window.
    #[arg(long, default_value_t = 1024)]
    seq: usize,
    /// Windows per batch.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 2e-5)]
    lr: f32,
    /// `both`, `fp8` or `bf16`.
    #[arg(long, default_value = "both")]
    precision: String,
    /// The FP8 recipe: delayed, current or block.
    #[arg(long, default_value = "delayed")]
    recipe: String,
    /// Fraction of the documents held out for validation.
    #[arg(long, default_value_t = 0.05)]
    val: f64,
    /// Save the (last run's) fine-tuned model here as a Hugging Face directory.
    #[arg(long)]
    save_hf: Option<PathBuf>,
    /// The LM head's GEMMs in FP8 too in FP8 runs.
    #[arg(long)]
    fp8_lm_head: bool,
    /// `blocks` (windows across documents) or `thd` (whole documents packed with cu_seqlens).
    #[arg(long, default_value = "blocks")]
    pack: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = Args::parse();
    let dev = Device::new(0)?;
    let t = Instant::now();
    let LoadedModel { weights, tokenizer, source } = load_model(&a.model)?;
    let cfg = weights.config().clone();
    println!(
        "{source:?}: {} layers, hidden {}, vocab {} (loaded in {:.1} s)",
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        t.elapsed().as_secs_f64()
    );
    let dataset = TokenDataset::build(&a.data, &tokenizer, a.cache.as_deref())?;
    let split = dataset.docs().split(a.val, 0)?;
    println!("{} training tokens, {} validation tokens", split.train.num_tokens(), split.val.num_tokens());
    let precisions = match a.precision.as_str() {
        "both" => vec![Precision::Fp8, Precision::Bf16],
        p => vec![Precision::from_name(p)?],
    };
    let recipe: Recipe = a.recipe.parse()?;
    // The GPT geometry of TrainConfig is not used by a fine-tuning run.
    let config = TrainConfig {
        batch: a.batch,
        lr: a.lr,
        min_lr: Some(a.lr / 10.0),
        weight_decay: 0.0,
        eval_interval: (a.steps / 5).max(1),
        recipe,
        ..TrainConfig::new(te_models::gpt::GptConfig::tiny(), a.steps)
    };
    let mut trainer = Trainer::new(config, Backend::Gpu(dev.clone()))?;
    // The pretrained model's validation loss (in BF16: FP8 delayed scaling has no scales before
    // calibration), the point each run's curve starts from.
    let mut model = DecoderLm::from_weights(&dev, &weights, DType::BF16)?;
    let pack = match a.pack.as_str() {
        "thd" => Pack::Thd,
        "blocks" => Pack::Blocks,
        p => return Err(format!("--pack {p}: expected blocks or thd").into()),
    };
    let before = trainer.validation_loss(&mut model, &split, (a.seq, pack), Precision::Bf16)?;
    println!("pretrained validation loss {before:.4} (perplexity {:.2})", before.exp());
    drop(model);
    let mut last = None;
    for precision in precisions {
        let mut model = DecoderLm::from_weights(&dev, &weights, DType::BF16)?;
        model.set_fp8_lm_head(a.fp8_lm_head);
        let run = trainer.finetune(&mut model, &split, (a.seq, pack), precision, |p| {
            if let Some(v) = p.val_loss {
                println!("  step {:>5}  train {:.4}  val {v:.4}  {:.1} ms", p.step, p.train_loss, p.step_ms);
            }
        })?;
        println!(
            "{}: validation loss {:.4} → {:.4}, {:.0} tokens/s, peak {:.2} GiB",
            precision.name(),
            before,
            run.final_val_loss().unwrap_or(f32::NAN),
            run.tokens_per_s,
            run.peak_memory as f64 / (1u64 << 30) as f64
        );
        last = Some(model);
    }
    if let (Some(dir), Some(model)) = (&a.save_hf, last) {
        let tuned = LoadedModel { weights: model.to_weights()?, tokenizer, source };
        tuned.save_hf_dir(dir, DType::BF16)?;
        println!("saved {}", dir.display());
    }
    Ok(())
}
