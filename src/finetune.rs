//! `te train --model`: fine-tuning a pretrained decoder LLM of the family (a `.gguf` file or a
//! Hugging Face directory) with [`te_train::Trainer::finetune`], or training one of its
//! configuration from scratch (`--init random`). This module holds what the
//! command adds around the library: the defaults of a fine-tuning run, the data (the model's
//! tokenizer over `--data`, or over the plays one document each, cached under `OUT/tokens`),
//! the pretrained model's validation loss, and the Hugging Face directory each run saves.

use crate::train::{Init, TrainArgs};
use std::path::{Path, PathBuf};
use te_models::decoder::train::DecoderLm;
use te_models::decoder::{
    load_config, load_model, DecoderConfig, DecoderWeights, ExportOptions, LoadedModel, ModelSource,
};
use te_models::gpt::GptConfig;
use te_models::tokenizer::Tokenizer;
use te_runtime::DType;
use te_train::data::{TokenDataset, TokenSplit};
use te_train::{Pack, Precision, Progress, RunSummary, TrainError, Trainer};

/// Tokens per window when `--seq-length` is not given (capped at the model's positions).
pub const DEFAULT_SEQ_LENGTH: usize = 1024;
/// Steps when `--steps` is not given.
pub const DEFAULT_STEPS: u64 = 200;
/// Peak learning rate when `--lr` is not given (fine-tuning, not pretraining).
pub const DEFAULT_LR: f32 = 2e-5;
/// Fraction of the documents held out for validation.
pub const VAL_FRACTION: f64 = 0.05;

/// A loaded model to fine-tune (or a configuration to train from scratch) and the window length
/// of its run.
pub struct Finetune {
    /// The model's configuration.
    pub config: DecoderConfig,
    /// The pretrained weights; `None`: the layers start from TE's initialization (`--init
    /// random`).
    pub weights: Option<DecoderWeights>,
    /// The tokenizer (`None` only while an export holds it).
    tokenizer: Option<Tokenizer>,
    /// Where the model came from.
    source: ModelSource,
    /// Tokens per window.
    pub seq: usize,
    /// The LM head's GEMMs in FP8 too in FP8 runs (`--fp8-lm-head`).
    pub fp8_lm_head: bool,
    /// ZeRO-3 FP8 runs under current scaling gather the layers' GEMM weights as FP8 codes
    /// (`--zero3-fp8-gather`).
    pub zero3_fp8_gather: bool,
    /// How documents are packed into batches (`--pack`).
    pub pack: Pack,
    path: PathBuf,
    /// The model [`Finetune::pretrained_loss`] built and evaluated, which the next run trains
    /// instead of building it again (an 8 B model's initialization takes tens of seconds).
    spare: Option<DecoderLm>,
}

impl Finetune {
    /// Loads the model at `path` for the run `a` asks for: its weights and tokenizer, or with
    /// `--init random` its configuration and tokenizer only (`te_models::decoder::load_config`).
    ///
    /// # Errors
    /// The loader's errors (a missing or unsupported model), as text; a `--seq-length` above
    /// the model's `max_position_embeddings`.
    pub fn load(path: &Path, a: &TrainArgs) -> Result<Self, String> {
        let err = |e: te_models::decoder::DecoderError| format!("--model {}: {e}", path.display());
        let (config, weights, tokenizer, source) = match a.init {
            Init::Pretrained => {
                let LoadedModel { weights, tokenizer, source } = load_model(path).map_err(err)?;
                (weights.config().clone(), Some(weights), tokenizer, source)
            }
            Init::Random => {
                let (config, tokenizer, source) = load_config(path).map_err(err)?;
                (config, None, tokenizer, source)
            }
        };
        let max = config.max_position_embeddings;
        let seq = match a.seq_length {
            Some(s) if s == 0 || s > max => {
                return Err(format!("--seq-length {s} must be in [1, {max}] (the model's max_position_embeddings)"))
            }
            Some(s) => s,
            None => DEFAULT_SEQ_LENGTH.min(max),
        };
        let pack = Pack::from_name(&a.pack).map_err(|e| format!("--pack: {e}"))?;
        Ok(Self {
            config,
            weights,
            tokenizer: Some(tokenizer),
            source,
            seq,
            fp8_lm_head: a.fp8_lm_head,
            zero3_fp8_gather: a.zero3_fp8_gather,
            pack,
            path: path.to_path_buf(),
            spare: None,
        })
    }

    /// Whether the run trains from scratch (`--init random`).
    pub fn from_scratch(&self) -> bool {
        self.weights.is_none()
    }

    /// The tokenizer.
    ///
    /// # Errors
    /// Only while an export holds it (never between calls).
    fn tokenizer(&self) -> Result<&Tokenizer, String> {
        self.tokenizer.as_ref().ok_or_else(|| "the tokenizer is held by an export".to_string())
    }

    /// The model's name in reports: its file or directory name.
    pub fn name(&self) -> String {
        self.path.file_name().map_or_else(|| self.path.display().to_string(), |n| n.to_string_lossy().into_owned())
    }

    /// `a` with the fine-tuning defaults where a flag was not given: [`DEFAULT_STEPS`] steps,
    /// [`DEFAULT_LR`], the run's sequence length.
    pub fn args(&self, a: &TrainArgs) -> TrainArgs {
        TrainArgs {
            steps: Some(a.steps.unwrap_or(DEFAULT_STEPS)),
            lr: Some(a.lr.unwrap_or(DEFAULT_LR)),
            seq_length: Some(self.seq),
            ..a.clone()
        }
    }

    /// The GPT configuration `te_train::TrainConfig` carries for the run's reports: only its
    /// sequence length and vocabulary mean anything for a fine-tuning run.
    pub fn report_config(&self) -> GptConfig {
        GptConfig { seq_length: self.seq, vocab_size: self.config.vocab_size, ..GptConfig::tiny() }
    }

    /// The run's documents tokenized with the model's tokenizer and split: `data` (text files, a
    /// directory, `.jsonl`), cached under `cache`, or `plays` (one document each, not cached).
    ///
    /// # Errors
    /// The data pipeline's errors, as text.
    pub fn data(
        &self,
        data: Option<&Path>,
        plays: impl FnOnce() -> Result<Vec<String>, String>,
        cache: &Path,
        seed: u64,
    ) -> Result<TokenSplit, String> {
        let tokenizer = self.tokenizer()?;
        let dataset = match data {
            Some(p) => TokenDataset::build(&[p], tokenizer, Some(cache)),
            None => TokenDataset::from_texts(&plays()?, tokenizer),
        }
        .map_err(|e| e.to_string())?;
        dataset.docs().split(VAL_FRACTION, seed).map_err(|e| e.to_string())
    }

    /// The model's weights as a trainable model in BF16, or the configuration's layers from TE's
    /// initialization (`--init random`; the same seeds every time, so every rank and every
    /// precision starts equal).
    ///
    /// # Errors
    /// The model's errors (what training on the GPU does not run), as text.
    pub fn model(&self, trainer: &Trainer) -> Result<DecoderLm, String> {
        let te_train::Backend::Gpu(dev) = trainer.backend() else {
            return Err("--model fine-tunes on a GPU".into());
        };
        let mut m = match &self.weights {
            Some(w) => DecoderLm::from_weights(dev, w, DType::BF16),
            None => DecoderLm::new(dev, self.config.clone(), DType::BF16),
        }
        .map_err(|e| e.to_string())?;
        m.set_fp8_lm_head(self.fp8_lm_head);
        m.set_zero3_fp8_gather(self.zero3_fp8_gather);
        Ok(m)
    }

    /// The pretrained model's validation loss (BF16: FP8 delayed scaling has no scales before
    /// its calibration), where each run's curve starts.
    ///
    /// # Errors
    /// As [`Finetune::model`]; the trainer's.
    pub fn pretrained_loss(&mut self, trainer: &Trainer, split: &TokenSplit) -> Result<f32, String> {
        let mut model = self.model(trainer)?;
        let loss = trainer
            .validation_loss(&mut model, split, (self.seq, self.pack), Precision::Bf16)
            .map_err(|e| e.to_string())?;
        // A BF16 evaluation changes no weight nor any FP8 state: the next run starts from it.
        self.spare = Some(model);
        Ok(loss)
    }

    /// One run in `precision` from the pretrained weights; saves the fine-tuned model as a
    /// Hugging Face directory `out/hf-<precision>` when `save` (rank 0 of a parallel run).
    ///
    /// # Errors
    /// The trainer's ([`TrainError::Interrupted`] included); the export's, as
    /// [`TrainError::Unsupported`] naming the directory.
    pub fn run(
        &mut self,
        trainer: &mut Trainer,
        split: &TokenSplit,
        precision: Precision,
        (out, save): (&Path, bool),
        progress: impl FnMut(&Progress),
    ) -> Result<RunSummary, TrainError> {
        let mut model = match self.spare.take() {
            Some(m) => m,
            None => self.model(trainer).map_err(|message| TrainError::Unsupported { message })?,
        };
        let run = trainer.finetune(&mut model, split, (self.seq, self.pack), precision, progress)?;
        if save {
            let dir = out.join(format!("hf-{}", precision.name()));
            let export = |e: te_models::decoder::DecoderError| TrainError::Unsupported {
                message: format!("saving the fine-tuned model to {}: {e}", dir.display()),
            };
            // The tuned weights with the model's tokenizer and source files, the tokenizer back
            // for the next run.
            let tuned = model.to_weights().map_err(export)?;
            let Some(tokenizer) = self.tokenizer.take() else {
                return Err(TrainError::Unsupported { message: "the tokenizer is held by an export".into() });
            };
            let loaded = LoadedModel { weights: tuned, tokenizer, source: self.source.clone() };
            let opts = ExportOptions { overwrite: true, ..ExportOptions::new(DType::BF16) };
            let saved = loaded.save_hf_dir_with(&dir, &opts);
            self.tokenizer = Some(loaded.tokenizer);
            saved.map_err(export)?;
        }
        Ok(run)
    }
}

/// The end of a fine-tuning report (what `te train --model` prints under its table and writes
/// into `summary.md`): the validation loss and perplexity (exp of the mean loss) of the
/// pretrained model (`before`) and of each run, e.g. `validation loss 4.0741 (perplexity 58.8)
/// → FP8 3.1103 (22.4), BF16 3.0976 (22.1)`, then the Hugging Face directory each run saved
/// under `out` (unless `exported` is false: `--no-export`) and, with `checkpoints`, how to sample
/// the first run's checkpoint.
pub fn outcome(before: f32, runs: &[RunSummary], out: &Path, (checkpoints, exported): (bool, bool)) -> String {
    let after: Vec<String> = runs
        .iter()
        .map(|r| {
            let name = r.precision.name().to_uppercase();
            match r.final_val_loss() {
                Some(v) => format!("{name} {v:.4} ({:.1})", v.exp()),
                None => format!("{name} – (no evaluation)"),
            }
        })
        .collect();
    let dirs: Vec<String> =
        runs.iter().map(|r| out.join(format!("hf-{}", r.precision.name())).display().to_string()).collect();
    let saved = if exported { dirs.join(", ") } else { "not saved (--no-export)".to_string() };
    let mut text = format!(
        "validation loss {before:.4} (perplexity {:.1}) → {}\nthe fine-tuned models: {saved}",
        before.exp(),
        after.join(", "),
    );
    if let (true, Some(r)) = (checkpoints, runs.first()) {
        let dir = out.join("checkpoints").join(r.precision.name());
        text.push_str(&format!("\nsample one: te generate --checkpoint {} --prompt \"...\"", dir.display()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_train::Record;

    /// The report gives each run's validation loss and perplexity after the pretrained one's,
    /// the saved directories, and the checkpoint to sample.
    #[test]
    fn the_outcome_gives_the_perplexity_before_and_after_each_run() {
        let run = |precision, val| RunSummary {
            precision,
            records: vec![Record { step: 1, train_loss: 3.0, val_loss: val, step_ms: 1.0 }],
            tokens_per_s: 1.0,
            ranks: 1,
            peak_memory: 0,
            parameters: 1,
            graphed_steps: 0,
        };
        let runs = [run(Precision::Fp8, Some(3.1103)), run(Precision::Bf16, Some(3.0976))];
        let text = outcome(4.0741, &runs, Path::new("out"), (true, true));
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "validation loss 4.0741 (perplexity 58.8) → FP8 3.1103 (22.4), BF16 3.0976 (22.1)");
        assert_eq!(lines[1], "the fine-tuned models: out/hf-fp8, out/hf-bf16");
        assert_eq!(lines[2], "sample one: te generate --checkpoint out/checkpoints/fp8 --prompt \"...\"");
        let text = outcome(4.0741, &[run(Precision::Bf16, None)], Path::new("out"), (false, true));
        assert_eq!(
            text,
            "validation loss 4.0741 (perplexity 58.8) → BF16 – (no evaluation)\nthe fine-tuned models: out/hf-bf16"
        );
        let text = outcome(4.0741, &[run(Precision::Bf16, None)], Path::new("out"), (false, false));
        assert!(text.ends_with("the fine-tuned models: not saved (--no-export)"), "{text}");
    }
}
