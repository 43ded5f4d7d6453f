//! `te generate`: text sampled from a `te train` checkpoint, streamed to stdout as it comes.
//!
//! The checkpoint's `trainer.toml` names the model (its `[model]` section: architecture,
//! precision, FP8 recipe) and `model.safetensors` holds its weights and FP8 scaling states. The
//! prompt's bytes are the first tokens (the models of `te train` are byte-level); each new
//! token is drawn with the sampler of [`te_models::generate::SamplingConfig`] (temperature,
//! top-k, top-p, Hugging Face `generate`'s order) from the Philox stream of `--seed`, so a
//! seed gives the same text every time. The decode runs over a KV cache
//! ([`te_models::cpu::gpt::KvCache`]): the prompt in one prefill, then one token per sample
//! per step. Prefill and decode speed go to stderr.
//!
//! On a GPU it runs the GPU model ([`Gpt::generate`]: BF16, the prompt through the fused
//! attention, every decode step replayed from a CUDA graph); without one (or with `--cpu`) the
//! CPU reference path ([`GptRef`]: f32 arithmetic, the GEMM inputs rounded to BF16 or
//! fake-quantized to FP8 with the checkpoint's recipe and scaling state,
//! [`te_train::cpu_gemm_precision`]).
//!
//! A fine-tuning run's checkpoint (`te train --model`: a `[model.decoder]` section in its
//! `trainer.toml`) holds a decoder LLM's weights: [`run`] samples it as `--model` samples the
//! pretrained model it started from, with the checkpoint's weights in place of its own
//! ([`crate::model_generate::run_with`]).

use crate::model::ModelError;
pub use crate::model_generate::Generated;
use crate::model_generate::{fine_tuned, pretrained_model_missing};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use te_models::cpu::gpt::{GptRef, KvCache};
use te_models::generate::{SamplingConfig, Utf8Stream};
use te_models::{GenerateOptions, Gpt, GptConfig};
use te_nn::checkpoint::{self, LoadOptions};
use te_nn::fp8::Recipe;
use te_nn::modules::InferenceParams;
use te_runtime::Device;
use te_train::checkpoint::{read_latest, Latest};
use te_train::Precision;

/// Tokens `te generate` draws when `--max-new-tokens` is not given (fewer when the model's
/// context ends first).
pub const DEFAULT_NEW_TOKENS: usize = 256;

/// The options of `te generate`: a `te train` checkpoint (`--checkpoint`) or a decoder LLM
/// (`--model`, [`crate::model_generate`]); both for a fine-tuning run's checkpoint whose
/// pretrained model is no longer where the run recorded it.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("source").required(true).multiple(true).args(["checkpoint", "model"])))]
pub struct GenerateArgs {
    /// A `te train` checkpoint: a run's directory (`train-out/checkpoints/fp8`), its `latest`
    /// (`latest.toml`), one `step-NNNNNNN` directory, or `train-out` / `train-out/checkpoints`
    /// (with both runs there, --precision picks one). A `te train --model` run's checkpoint
    /// samples the fine-tuned decoder as --model does (on the GPU).
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// A decoder LLM (Llama, Qwen2, Qwen3, Gemma 3): a `.gguf` file or a Hugging Face model
    /// directory (config.json, *.safetensors, tokenizer.json). With --checkpoint of a `te train
    /// --model` run: the pretrained model the run started from, where it is now.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text to continue; with --model, repeat it for a batch of prompts of any lengths (each
    /// sample printed under a header once all have finished).
    #[arg(long, required_unless_present = "prompt_file", conflicts_with = "prompt_file")]
    pub prompt: Vec<String>,
    /// A file whose contents are the text to continue (its bytes for a checkpoint, UTF-8 text
    /// for --model).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// Tokens to draw per sample (default: 256, or what fits the model's context after the
    /// prompt); with --model a sample also ends at an end-of-sequence token.
    #[arg(long)]
    pub max_new_tokens: Option<usize>,
    /// Softmax temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Keep the most likely tokens up to this cumulative probability (nucleus sampling).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the draws (the same seed gives the same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Samples of the prompt, drawn together as a batch (the first is streamed, the others
    /// printed after it); with --model, samples of each prompt, all printed under headers.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// GEMM precision: fp8 (with the checkpoint's FP8 scales, or scales calibrated on the
    /// prompt for a BF16 checkpoint; the CPU path only for now) or bf16; default: the run's on
    /// the CPU, bf16 on a GPU. With --model: f32 (the CPU default), bf16, or fp8 (the GPU path
    /// only).
    #[arg(long, value_parser = ["fp8", "bf16", "f32"])]
    pub precision: Option<String>,
    /// Run on the CPU reference path even when a GPU is present.
    #[arg(long)]
    pub cpu: bool,
    /// With --model (or a `te train --model` checkpoint) and --precision fp8: the LM head's GEMM
    /// in FP8 too (one E4M3 table for the tied embedding and head).
    #[arg(long)]
    pub fp8_lm_head: bool,
    /// What the GPU's KV cache holds: bf16, or e4m3 (one-byte codes with per-tensor scales 1,
    /// vLLM's `kv_cache_dtype="fp8"`: half the bytes a decode step reads from the cache, values
    /// up to 448 kept). The GPU path only.
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Bf16)]
    pub kv_cache: KvCacheDtype,
}

/// What a generation's KV cache holds (`--kv-cache`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum KvCacheDtype {
    /// The model's 16-bit keys and values.
    #[default]
    Bf16,
    /// E4M3 codes with per-tensor scales (the GPU path).
    E4m3,
}

/// Errors of `te generate`.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The checkpoint cannot be found, read or used.
    #[error("checkpoint {path}: {message}")]
    Checkpoint {
        /// What was given or read.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// The request does not fit the model.
    #[error("{0}")]
    Request(String),
    /// A fine-tuning run's checkpoint whose pretrained model is not recorded, or no longer
    /// where it was.
    #[error("checkpoint {}: {}", .checkpoint.display(), pretrained_model_missing(.recorded.as_deref()))]
    PretrainedModel {
        /// The checkpoint's directory.
        checkpoint: PathBuf,
        /// The pretrained model its `[model.decoder]` names, if it names one.
        recorded: Option<PathBuf>,
    },
    /// The decoder LLM of `--model` or of a fine-tuning run's checkpoint.
    #[error(transparent)]
    Model(Box<ModelError>),
    /// The runtime (model, sampler).
    #[error(transparent)]
    Runtime(#[from] te_runtime::Error),
    /// Reading the prompt or writing the text.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl From<ModelError> for GenerateError {
    fn from(e: ModelError) -> Self {
        GenerateError::Model(Box::new(e))
    }
}

/// What one `te generate` of a `te train` GPT checkpoint did: tokens and times.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateReport {
    /// The model's precision in this run.
    pub precision: Precision,
    /// Where it ran: `the CPU reference path`, or the GPU's name.
    pub device: String,
    /// Prompt tokens per sample.
    pub prompt_tokens: usize,
    /// New tokens per sample.
    pub new_tokens: usize,
    /// Samples.
    pub batch: usize,
    /// Prefill (the prompt through the model, and the first token) in seconds.
    pub prefill_s: f64,
    /// The remaining decode steps in seconds.
    pub decode_s: f64,
    /// The new tokens of each sample.
    pub samples: Vec<Vec<u8>>,
}

impl GenerateReport {
    /// The speeds as a line: prompt tokens per second of the prefill, new tokens per second
    /// (all samples) of the decode.
    pub fn speeds(&self) -> String {
        let rate = |tokens: usize, s: f64| {
            if tokens > 0 && s > 0.0 {
                format!("{:.0}", tokens as f64 / s)
            } else {
                "–".into()
            }
        };
        let steps = self.new_tokens.saturating_sub(1);
        format!(
            "{} precision on {}: prefill {} tokens × {} in {:.1} ms ({} tokens/s); decode {steps} steps × {} in {:.1} ms \
             ({} tokens/s)",
            self.precision.name(),
            self.device,
            self.prompt_tokens,
            self.batch,
            self.prefill_s * 1e3,
            rate(self.prompt_tokens * self.batch, self.prefill_s),
            self.batch,
            self.decode_s * 1e3,
            rate(steps * self.batch, self.decode_s)
        )
    }
}

/// A checkpoint found from what `--checkpoint` names: its step directory and `trainer.toml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Located {
    /// The `step-NNNNNNN` directory (`model.safetensors` inside).
    pub dir: PathBuf,
    /// Its `trainer.toml` (or the run's `latest.toml`).
    pub latest: Latest,
}

/// Finds the checkpoint `path` names (see [`GenerateArgs::checkpoint`]); `precision` picks a
/// run where a directory holds both.
///
/// # Errors
/// [`GenerateError::Checkpoint`] saying what was looked for.
pub fn locate(path: &Path, precision: Option<Precision>) -> Result<Located, GenerateError> {
    let bad = |message: String| GenerateError::Checkpoint { path: path.to_path_buf(), message };
    let read = |toml: &Path| -> Result<Option<Latest>, GenerateError> {
        read_latest(toml).map_err(|e| GenerateError::Checkpoint { path: toml.to_path_buf(), message: e.to_string() })
    };
    // A file: latest.toml (its directory holds the step directories) or a step's trainer.toml.
    let file = if path.is_file() {
        Some(path.to_path_buf())
    } else if path.file_name().is_some_and(|n| n == "latest") && path.with_extension("toml").is_file() {
        Some(path.with_extension("toml"))
    } else {
        None
    };
    if let Some(file) = file {
        let Some(latest) = read(&file)? else { return Err(bad("cannot be read".into())) };
        let parent = file.parent().unwrap_or(Path::new("."));
        let dir = if file.file_name().is_some_and(|n| n == "trainer.toml") {
            parent.into()
        } else {
            parent.join(&latest.dir)
        };
        return Ok(Located { dir, latest });
    }
    if !path.is_dir() {
        return Err(bad("no such file or directory: give a run's checkpoint directory (train-out/checkpoints/fp8), \
                        its latest.toml, or a step-NNNNNNN directory"
            .into()));
    }
    if let Some(latest) = read(&path.join("trainer.toml"))? {
        return Ok(Located { dir: path.to_path_buf(), latest });
    }
    if let Some(latest) = read(&path.join("latest.toml"))? {
        return Ok(Located { dir: path.join(&latest.dir), latest });
    }
    // train-out or train-out/checkpoints: the runs below it.
    let base = if path.join("checkpoints").is_dir() { path.join("checkpoints") } else { path.to_path_buf() };
    let runs: Vec<Precision> = [Precision::Fp8, Precision::Bf16]
        .into_iter()
        .filter(|p| base.join(p.name()).join("latest.toml").is_file())
        .collect();
    match (runs.as_slice(), precision) {
        ([], _) => {
            Err(bad("holds no checkpoint (no latest.toml, trainer.toml, or fp8/ or bf16/ run with one): train \
                            with `te train` first"
                .into()))
        }
        // One run: it, in the precision asked for (a BF16 run in FP8 calibrates its scales).
        ([only], _) => locate(&base.join(only.name()), None),
        (_, Some(p)) => locate(&base.join(p.name()), None),
        (_, None) => Err(bad("holds an fp8 and a bf16 run: name one (…/fp8 or …/bf16) or pass --precision".into())),
    }
}

/// The model `located` holds: its config, the run's precision, and the FP8 recipe it trained
/// with (or would have, for a BF16 run).
///
/// # Errors
/// [`GenerateError::Checkpoint`] for a checkpoint without a model section or of a model this
/// version cannot build.
pub fn model_config(located: &Located) -> Result<(GptConfig, Precision, Recipe), GenerateError> {
    let bad = |message: String| GenerateError::Checkpoint { path: located.dir.clone(), message };
    let Some(section) = &located.latest.model else {
        return Err(bad(
            "its trainer.toml has no [model] section (written before te generate): train again with this \
                        version, or resume the run for a step to rewrite it"
                .into(),
        ));
    };
    if let Some(n) = located.latest.tensor_parallel.filter(|&n| n > 1) {
        return Err(bad(format!(
            "it holds the files of {n} tensor-parallel ranks: merge it first (te checkpoint merge DIR --out NEW_DIR)"
        )));
    }
    Ok((section.config.clone(), section.precision, section.fp8_recipe()))
}

/// Loads the model of `located` on the CPU for `precision` (default: the run's).
///
/// # Errors
/// As [`model_config`]; [`GenerateError::Checkpoint`] for a missing or mismatched
/// `model.safetensors`, or FP8 with a recipe the CPU model does not emulate; runtime errors.
pub fn load_model(located: &Located, precision: Option<Precision>) -> Result<(GptRef, Precision), GenerateError> {
    let (cfg, run_precision, recipe) = model_config(located)?;
    let precision = precision.unwrap_or(run_precision);
    let gemms = te_train::cpu_gemm_precision(precision, &recipe).map_err(|e| GenerateError::Checkpoint {
        path: located.dir.clone(),
        message: format!("{e}; or sample it with --precision bf16"),
    })?;
    let mut model = GptRef::new(&cfg)?;
    model.set_precision(gemms)?;
    let file = located.dir.join("model.safetensors");
    model
        .load(&file, &LoadOptions::default())
        .map_err(|e| GenerateError::Checkpoint { path: located.dir.clone(), message: e.to_string() })?;
    Ok((model, precision))
}

/// Loads the model of `located` on `dev` (BF16 GEMMs), in evaluation mode.
///
/// # Errors
/// As [`load_model`].
pub fn load_gpu_model(dev: &Arc<Device>, located: &Located) -> Result<Gpt, GenerateError> {
    let (cfg, _, _) = model_config(located)?;
    let mut model = Gpt::new(dev, cfg)?;
    let file = located.dir.join("model.safetensors");
    checkpoint::load(&mut model, &file, &LoadOptions::default())
        .map_err(|e| GenerateError::Checkpoint { path: located.dir.clone(), message: e.to_string() })?;
    model.set_training(false);
    Ok(model)
}

/// Where the decode runs: the CPU twin over its KV cache, or the GPU model over its own.
enum Backend {
    Cpu(Box<(GptRef, KvCache)>),
    Gpu(Box<(Gpt, InferenceParams)>),
}

impl Backend {
    fn generate(
        &mut self,
        prompts: &[Vec<i32>],
        new_tokens: usize,
        sampling: &SamplingConfig,
        seed: u64,
        on_tokens: impl FnMut(usize, &[i32]) -> te_runtime::Result<()>,
    ) -> te_runtime::Result<Vec<Vec<i32>>> {
        match self {
            Backend::Cpu(b) => {
                let (model, cache) = &mut **b;
                model.generate_cached(cache, prompts, new_tokens, sampling, seed, on_tokens)
            }
            Backend::Gpu(b) => {
                let (model, params) = &mut **b;
                let options = GenerateOptions { cuda_graph: true, ..Default::default() };
                model.generate(params, prompts, new_tokens, (sampling, seed), options, on_tokens)
            }
        }
    }
}

/// The prompt's bytes: `--prompt`, or `--prompt-file`'s contents.
fn prompt_bytes(a: &GenerateArgs) -> Result<Vec<u8>, GenerateError> {
    match (a.prompt.as_slice(), &a.prompt_file) {
        ([p], _) => Ok(p.as_bytes().to_vec()),
        ([_, _, ..], _) => Err(GenerateError::Request(
            "several --prompt are for --model: a checkpoint continues one prompt (--batch N draws N samples of it)"
                .into(),
        )),
        ([], Some(f)) => std::fs::read(f)
            .map_err(|source| GenerateError::Io { what: format!("cannot read {}", f.display()), source }),
        ([], None) => Err(GenerateError::Request("give --prompt TEXT or --prompt-file FILE".into())),
    }
}

/// Runs `te generate`: writes the prompt and the first sample to `out` as it is drawn, then the
/// other samples; returns what it did. A decoder LLM (`--model`, or a fine-tuning run's
/// checkpoint over its pretrained model) runs [`crate::model_generate::run_with`].
///
/// # Errors
/// [`GenerateError`]: the checkpoint, a prompt that is empty or does not fit the model's
/// context with the tokens asked for, a batch of 0, bad sampling options, I/O;
/// [`GenerateError::PretrainedModel`] for a fine-tuning checkpoint without its pretrained
/// model; [`GenerateError::Request`] for `--model` with a GPT checkpoint; the decoder's
/// ([`GenerateError::Model`]).
pub fn run(a: &GenerateArgs, out: &mut dyn Write) -> Result<Generated, GenerateError> {
    let Some(checkpoint) = &a.checkpoint else {
        let Some(model) = &a.model else {
            return Err(GenerateError::Request("give --checkpoint DIR or --model PATH".into()));
        };
        return Ok(Generated::Decoder(crate::model_generate::run(a, model, out)?));
    };
    // --precision picks the run where a directory holds two (f32 is a decoder's precision only).
    let located = locate(checkpoint, a.precision.as_deref().and_then(|p| Precision::from_name(p).ok()))?;
    if let Some((model, tuned)) = fine_tuned(&located, a.model.as_deref())? {
        return Ok(Generated::Decoder(crate::model_generate::run_with(a, &model, Some(&tuned), out)?));
    }
    if a.model.is_some() {
        return Err(GenerateError::Request(format!(
            "{} is a te train GPT checkpoint, not a fine-tuned decoder's: --model goes with --checkpoint only to name \
             the pretrained model of a te train --model run; drop one of them",
            located.dir.display()
        )));
    }
    run_checkpoint(a, &located, out).map(Generated::Checkpoint)
}

/// Samples the GPT of `located` (a `te train` checkpoint).
fn run_checkpoint(a: &GenerateArgs, located: &Located, out: &mut dyn Write) -> Result<GenerateReport, GenerateError> {
    let asked = a.precision.as_deref().map(Precision::from_name).transpose().map_err(GenerateError::Request)?;
    if a.fp8_lm_head {
        return Err(GenerateError::Request(
            "--fp8-lm-head is for a decoder LLM (--model, or a te train --model checkpoint)".into(),
        ));
    }
    let (cfg, _, _) = model_config(located)?;
    let gpu = !a.cpu && te_runtime::device::gpu_available();
    if gpu && asked == Some(Precision::Fp8) {
        return Err(GenerateError::Request(
            "--precision fp8 runs on the CPU path only for now (FP8 GEMMs on the GPU need token counts in multiples \
             of 16, a decode step has one per sequence): add --cpu, or use --precision bf16"
                .into(),
        ));
    }
    if !gpu && a.kv_cache == KvCacheDtype::E4m3 {
        return Err(GenerateError::Request(
            "--kv-cache e4m3 runs on the GPU path (the CPU path keeps an f32 cache): leave it out or drop --cpu".into(),
        ));
    }
    if cfg.vocab_size != 256 {
        return Err(GenerateError::Request(format!(
            "the model's vocabulary has {} tokens: te generate reads and writes bytes (256)",
            cfg.vocab_size
        )));
    }
    let prompt = prompt_bytes(a)?;
    let context = cfg.seq_length;
    if prompt.is_empty() {
        return Err(GenerateError::Request("the prompt is empty: give at least one byte".into()));
    }
    if prompt.len() >= context {
        return Err(GenerateError::Request(format!(
            "the prompt has {} bytes and the model's context is {context} tokens (seq_length): shorten it to at most \
             {} bytes",
            prompt.len(),
            context - 1
        )));
    }
    let new_tokens = a.max_new_tokens.unwrap_or(DEFAULT_NEW_TOKENS.min(context - prompt.len()));
    if prompt.len() + new_tokens > context {
        return Err(GenerateError::Request(format!(
            "a prompt of {} bytes and {new_tokens} new tokens exceed the model's context of {context} tokens \
             (seq_length): ask for at most {} new tokens (--max-new-tokens) or shorten the prompt",
            prompt.len(),
            context - prompt.len()
        )));
    }
    if a.batch == 0 {
        return Err(GenerateError::Request("--batch 0: draw at least one sample".into()));
    }
    let sampling = SamplingConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    sampling.validate()?;
    let ids: Vec<i32> = prompt.iter().map(|&b| i32::from(b)).collect();
    let prompts = vec![ids.clone(); a.batch];
    let capacity = (prompt.len() + new_tokens).min(context);
    let (mut backend, precision, device) = if gpu {
        let dev = Device::new(0)?;
        let (cfg, _, _) = model_config(located)?;
        let needed = Gpt::generation_bytes(&cfg, a.batch, prompt.len(), capacity);
        dev.check_free_memory(needed, || {
            format!(
                "generating {} samples of {capacity} tokens (the weights, the KV cache and the prefill, estimated; \
                 lower --batch or --max-new-tokens)",
                a.batch
            )
        })?;
        let model = load_gpu_model(&dev, located)?;
        let params = match a.kv_cache {
            KvCacheDtype::E4m3 => model.inference_params_fp8(a.batch, capacity)?,
            KvCacheDtype::Bf16 => model.inference_params(a.batch, capacity)?,
        };
        (Backend::Gpu(Box::new((model, params))), Precision::Bf16, format!("{} (CUDA graphs)", dev.name()))
    } else {
        let (mut model, precision) = load_model(located, asked)?;
        if precision == Precision::Fp8 && located.latest.model.as_ref().is_some_and(|m| m.precision != Precision::Fp8) {
            // A BF16 run has no FP8 scales: take them from the prompt's amaxes (TE's calibration).
            model.calibrate(&ids, ids.len(), 1)?;
        }
        let cache = model.kv_cache(a.batch, capacity)?;
        (Backend::Cpu(Box::new((model, cache))), precision, "the CPU reference path".to_string())
    };
    let io = |source| GenerateError::Io { what: "cannot write the text".into(), source };
    out.write_all(&prompt).map_err(io)?;
    out.flush().map_err(io)?;
    let mut stream = Utf8Stream::new();
    let start = Instant::now();
    let mut first_token = None;
    let samples = backend.generate(&prompts, new_tokens, &sampling, a.seed, |i, next| {
        if i == 0 {
            first_token = Some(Instant::now());
        }
        let text = stream.push(next[0] as u8);
        out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(|e| te_runtime::Error::Argument {
            op: "te generate",
            message: format!("cannot write the text: {e}"),
        })
    })?;
    let end = Instant::now();
    let rest = stream.finish();
    out.write_all(rest.as_bytes()).map_err(io)?;
    let samples: Vec<Vec<u8>> = samples.into_iter().map(|s| s.into_iter().map(|t| t as u8).collect()).collect();
    for (k, s) in samples.iter().enumerate().skip(1) {
        write!(out, "\n\n--- sample {} of {} ---\n", k + 1, a.batch).map_err(io)?;
        out.write_all(&prompt).map_err(io)?;
        out.write_all(String::from_utf8_lossy(s).as_bytes()).map_err(io)?;
    }
    writeln!(out).map_err(io)?;
    let first = first_token.unwrap_or(end);
    Ok(GenerateReport {
        precision,
        device,
        prompt_tokens: prompt.len(),
        new_tokens,
        batch: a.batch,
        prefill_s: (first - start).as_secs_f64(),
        decode_s: (end - first).as_secs_f64(),
        samples,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn latest(dir: &str, model: bool) -> Latest {
        let cfg = te_train::TrainConfig { batch: 1, lr: 1e-3, ..te_train::TrainConfig::new(GptConfig::tiny(), 1) };
        Latest {
            dir: dir.into(),
            step: 3,
            dropout_offset: 6,
            batch: 1,
            grad_accum: 1,
            seq_length: 128,
            lr: 1e-3,
            data_seed: 0,
            model_seed: 0,
            tensor_parallel: None,
            data_parallel: None,
            model: model.then(|| te_train::checkpoint::ModelSection::new(&cfg, Precision::Fp8)),
        }
    }

    /// Every way of naming a checkpoint finds the same step directory; a directory with two
    /// runs needs --precision; what holds no checkpoint says so.
    #[test]
    fn checkpoints_are_found_from_every_name() {
        let root = tempfile::tempdir().unwrap();
        let out = root.path().join("train-out");
        let runs = out.join("checkpoints");
        for p in ["fp8", "bf16"] {
            let step = runs.join(p).join("step-0000003");
            std::fs::create_dir_all(&step).unwrap();
            let text = toml::to_string(&latest("step-0000003", true)).unwrap();
            std::fs::write(step.join("trainer.toml"), &text).unwrap();
            std::fs::write(runs.join(p).join("latest.toml"), &text).unwrap();
        }
        let want = runs.join("fp8").join("step-0000003");
        let fp8 = runs.join("fp8");
        for name in [fp8.clone(), fp8.join("latest"), fp8.join("latest.toml"), want.clone(), want.join("trainer.toml")]
        {
            assert_eq!(locate(&name, None).unwrap().dir, want, "{}", name.display());
        }
        for name in [&out, &runs] {
            assert_eq!(locate(name, Some(Precision::Fp8)).unwrap().dir, want);
            let e = locate(name, None).unwrap_err().to_string();
            assert!(e.contains("name one"), "{e}");
        }
        let e = locate(root.path(), None).unwrap_err().to_string();
        assert!(e.contains("holds no checkpoint"), "{e}");
        let e = locate(&root.path().join("none"), None).unwrap_err().to_string();
        assert!(e.contains("no such file"), "{e}");
        std::fs::write(fp8.join("latest.toml"), "dir = 3").unwrap();
        let e = locate(&fp8, None).unwrap_err().to_string();
        assert!(e.contains("unreadable"), "{e}");
    }

    /// A run trained with current scaling samples in FP8 on the CPU with that recipe (the CPU
    /// model casts each GEMM operand with its own amax).
    #[test]
    fn a_current_scaling_checkpoint_samples_with_its_recipe() {
        let cfg = te_train::TrainConfig {
            recipe: te_nn::fp8::Float8CurrentScaling::default().into(),
            ..te_train::TrainConfig::new(GptConfig::tiny(), 1)
        };
        let latest = Latest {
            model: Some(te_train::checkpoint::ModelSection::new(&cfg, Precision::Fp8)),
            ..latest("step-0000003", false)
        };
        let located = Located { dir: "x".into(), latest };
        let (_, precision, recipe) = model_config(&located).unwrap();
        assert_eq!((precision, recipe), (Precision::Fp8, cfg.recipe));
        let gemms = te_train::cpu_gemm_precision(precision, &recipe).unwrap();
        assert!(matches!(gemms, te_models::cpu::gpt::GemmPrecision::Fp8(te_nn::fp8::Recipe::Current(_))), "{gemms:?}");
    }

    /// A checkpoint written before the model section cannot be rebuilt: the error says what to
    /// do.
    #[test]
    fn a_checkpoint_without_a_model_section_is_refused() {
        let located = Located { dir: "x".into(), latest: latest("step-0000003", false) };
        let e = load_model(&located, None).unwrap_err().to_string();
        assert!(e.contains("no [model] section"), "{e}");
    }
}
