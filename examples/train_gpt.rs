//! The `te_train::Trainer` API: trains the tiny byte-level GPT (FP8, TE's default delayed
//! scaling) for a few steps and prints its losses, on the GPU when there is one, else on the CPU
//! path (the CPU twin of the model, FP8 emulated). Checkpoints go to a temporary directory.
//!
//! `cargo run --release --example train_gpt [TEXT_FILE_OR_DIR] [STEPS]`

use std::error::Error;
use std::path::Path;
use te_models::gpt::GptConfig;
use te_train::data::Corpus;
use te_train::{Backend, CheckpointOptions, Precision, TrainConfig, Trainer};

/// Hamlet, Act 3 Scene 1: the text trained on when no file is given.
const HAMLET: &str = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n\
The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n\
And by opposing end them. To die: to sleep;\nNo more; and by a sleep to say we end\n\
The heart-ache and the thousand natural shocks\nThat flesh is heir to, 'tis a consummation\n\
Devoutly to be wish'd. To die, to sleep;\nTo sleep: perchance to dream: ay, there's the rub;\n\
For in that sleep of death what dreams may come\nWhen we have shuffled off this mortal coil,\n\
Must give us pause: there's the respect\nThat makes calamity of so long life;\n";

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let corpus = match args.next() {
        Some(path) => Corpus::from_path(Path::new(&path), 0.1)?,
        None => Corpus::from_text(HAMLET.repeat(8), 0.1),
    };
    let steps: u64 = args.next().map(|s| s.parse()).transpose()?.unwrap_or(40);
    // The tiny preset (2 layers, hidden 128) on windows of 64 bytes, 4 a step.
    let model = GptConfig { seq_length: 64, ..GptConfig::tiny() };
    let config =
        TrainConfig { batch: 4, lr: 2e-3, eval_interval: 10, eval_batches: 2, ..TrainConfig::new(model, steps) };
    let backend = Backend::detect()?;
    let checkpoints = CheckpointOptions {
        dir: Some(std::env::temp_dir().join("te-example-train-gpt")),
        interval: 20,
        ..CheckpointOptions::default()
    };
    println!(
        "{} parameters, {steps} steps on the {}, {} training bytes",
        config.model.num_parameters(),
        if backend.is_gpu() { "GPU" } else { "CPU" },
        corpus.train.len()
    );
    let mut trainer = Trainer::new(config, backend)?.with_checkpoints(checkpoints);
    let run = trainer.train(&corpus, Precision::Fp8, |p| {
        let val = p.val_loss.map_or(String::new(), |v| format!("  validation {v:.4}"));
        println!("step {:>3}/{}  loss {:.4}  lr {:.2e}{val}", p.step, p.steps, p.train_loss, p.lr);
    })?;
    println!(
        "final loss {:.4} (from {:.4}), {:.0} tokens/s",
        run.final_train_loss(),
        run.records.first().map_or(f32::NAN, |r| r.train_loss),
        run.tokens_per_s
    );
    Ok(())
}
