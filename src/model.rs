//! Decoder LLMs for `te generate --model` and `te eval --model`: [`open_causal_lm`] opens a
//! `.gguf` file or a Hugging Face model directory ([`te_models::decoder::load_model`]) as a
//! [`CausalLm`] on the device that runs it, with its [`Tokenizer`]; [`ModelError`] is what can go
//! wrong, for both commands.
//!
//! On a GPU the GPU decoder ([`Decoder`]) runs the model, BF16 by default or FP8
//! (`--precision fp8`); with `--cpu` (or without a GPU) the CPU decoder ([`DecoderRef`]), f32 by
//! default or with BF16 GEMM inputs (`--precision bf16`).
//!
//! [`open_causal_lm_with`] also puts a fine-tuning checkpoint's weights ([`FineTuned`], `te
//! generate --checkpoint` of a `te train --model` run) over the pretrained model first.

use std::path::{Path, PathBuf};
use std::time::Instant;
use te_models::cpu::decoder::{DecoderPrecision, DecoderRef};
use te_models::decoder::train::DecoderLm;
use te_models::decoder::{
    load_model, CausalLm, Decoder, DecoderError, DecoderWeights, GpuPrecision, HfArchitecture, LoadedModel, ModelSource,
};
use te_models::tokenizer::{Tokenizer, TokenizerError};
use te_nn::checkpoint::{self, LoadOptions};
use te_nn::fp8::Recipe;
use te_runtime::DType;
use te_train::checkpoint::DecoderSection;

/// The precision a decoder runs in (`--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelPrecision {
    /// f32 GEMM inputs (the CPU path's default).
    F32,
    /// BF16 GEMM inputs.
    Bf16,
    /// FP8 GEMMs (the GPU path only).
    Fp8,
}

impl ModelPrecision {
    /// The precision of a `--precision` value: `f32`, `bf16` or `fp8`.
    ///
    /// # Errors
    /// [`ModelError::Request`] for another name.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "fp8" => Ok(Self::Fp8),
            p => Err(ModelError::Request(format!("precision `{p}`: expected f32, bf16 or fp8"))),
        }
    }

    /// The name `--precision` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }
}

/// How [`open_causal_lm`] runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ModelOptions {
    /// Run on the CPU even when a GPU is present (`--cpu`).
    pub cpu: bool,
    /// The precision (`--precision`); `None`: the device's default (f32 on the CPU).
    pub precision: Option<ModelPrecision>,
    /// With `--precision fp8` on the GPU, the LM head's GEMM in FP8 too, the tied embedding kept
    /// as one E4M3 table (`--fp8-lm-head`: half the BF16 weight bytes).
    pub fp8_lm_head: bool,
    /// The GPU decoder's KV cache in E4M3 with per-tensor scales 1 (`--kv-cache e4m3`, vLLM's
    /// `kv_cache_dtype="fp8"`: half the cache bytes); `false`: BF16.
    pub kv_cache_e4m3: bool,
}

/// A fine-tuning checkpoint (of `te train --model`, `te_train::Trainer::finetune`) whose
/// weights [`open_causal_lm_with`] loads over the pretrained model they were tuned from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FineTuned {
    /// The checkpoint's `step-NNNNNNN` directory (`model.safetensors` inside).
    pub dir: PathBuf,
    /// The optimizer steps it holds.
    pub step: u64,
    /// The transformers class the run recorded (`[model.decoder]`'s `architecture`).
    pub architecture: String,
}

impl FineTuned {
    /// The weights file: `model.safetensors` of [`FineTuned::dir`].
    pub fn file(&self) -> PathBuf {
        self.dir.join("model.safetensors")
    }
}

/// Errors of `te generate --model` and `te eval`: each says what was wrong and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// `--model` names nothing.
    #[error(
        "model {}: no such file or directory: give a .gguf file or a Hugging Face model directory \
         (config.json, *.safetensors, tokenizer.json)",
        path.display()
    )]
    NotFound {
        /// The path given.
        path: PathBuf,
    },
    /// The model could not be loaded: a missing file (`config.json`, weights, `tokenizer.json`),
    /// an unsupported architecture, a bad configuration or tensors that do not match it.
    #[error("model {}: {source}", path.display())]
    Load {
        /// The path given.
        path: PathBuf,
        /// What the loader said.
        source: Box<DecoderError>,
    },
    /// A fine-tuning checkpoint's weights cannot go over the model: there is no GPU to load
    /// them on (`--cpu`, or none found), the model is of another architecture, or its
    /// `model.safetensors` does not fit the model.
    #[error("checkpoint {}: {message}", path.display())]
    Checkpoint {
        /// The checkpoint's directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// `--precision fp8` where the CPU decoder runs.
    #[error("--precision fp8 needs the GPU path: the CPU decoder runs f32 (the default) or bf16 (--precision bf16)")]
    Fp8OnCpu,
    /// A request the model or the command cannot take (an empty prompt, one beyond the model's
    /// context, bad sampling or window settings).
    #[error("{0}")]
    Request(String),
    /// The model failed while running.
    #[error(transparent)]
    Decoder(Box<DecoderError>),
    /// Encoding or decoding text.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Reading a prompt or data file, or writing the output.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: String,
        /// The cause.
        source: std::io::Error,
    },
}

impl From<DecoderError> for ModelError {
    fn from(e: DecoderError) -> Self {
        ModelError::Decoder(Box::new(e))
    }
}

/// Where [`open_causal_lm`] runs the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Cpu,
    Gpu,
}

/// The CPU decoder's precision for `precision` (`None`: f32).
///
/// # Errors
/// [`ModelError::Fp8OnCpu`].
fn cpu_precision(precision: Option<ModelPrecision>) -> Result<DecoderPrecision, ModelError> {
    match precision {
        None | Some(ModelPrecision::F32) => Ok(DecoderPrecision::F32),
        Some(ModelPrecision::Bf16) => Ok(DecoderPrecision::Bf16),
        Some(ModelPrecision::Fp8) => Err(ModelError::Fp8OnCpu),
    }
}

/// The CPU decoder of `weights`.
fn cpu_model(weights: DecoderWeights, precision: Option<ModelPrecision>) -> Result<Box<dyn CausalLm>, ModelError> {
    Ok(Box::new(DecoderRef::new(weights, cpu_precision(precision)?)?))
}

/// The GPU decoder of `weights` on GPU 0: BF16 by default, `fp8` with E4M3 one-byte weights
/// and current scaling of the activations (TE's `Float8CurrentScaling`: per-tensor scales from
/// each tensor's own amax, no history to warm up, which inference wants).
///
/// # Errors
/// [`ModelError::Request`] for `--precision f32` (the GPU decoder runs bf16 or fp8); the
/// device's and the model's errors (a configuration the GPU path does not run names `--cpu`).
fn gpu_model(weights: DecoderWeights, opts: &ModelOptions) -> Result<Box<dyn CausalLm>, ModelError> {
    let precision = match opts.precision {
        None | Some(ModelPrecision::Bf16) => GpuPrecision::Bf16,
        Some(ModelPrecision::Fp8) => {
            GpuPrecision::Fp8 { recipe: Recipe::Current(Default::default()), lm_head: opts.fp8_lm_head }
        }
        Some(ModelPrecision::F32) => {
            return Err(ModelError::Request(
                "--precision f32 runs on the CPU path only (add --cpu); the GPU decoder runs bf16 or fp8".into(),
            ))
        }
    };
    let dev = te_runtime::Device::new(0).map_err(DecoderError::from)?;
    let mut model = Decoder::new(&dev, weights, precision)?;
    if opts.kv_cache_e4m3 {
        model.set_kv_cache_dtype(te_codegen::DType::E4M3)?;
    }
    Ok(Box::new(model))
}

/// `weights` whose configuration also stops at the tokenizer's end-of-generation ids
/// (`generation_config.json`'s `eos_token_id` list, Gemma's `<end_of_turn>`), as transformers'
/// `generate` does.
fn with_tokenizer_eos(weights: DecoderWeights, tokenizer: &Tokenizer) -> Result<DecoderWeights, DecoderError> {
    let vocab = weights.config().vocab_size;
    let extra: Vec<u32> = tokenizer
        .eos_ids()
        .iter()
        .copied()
        .filter(|&id| (id as usize) < vocab && !weights.config().eos_token_ids.contains(&id))
        .collect();
    if extra.is_empty() {
        return Ok(weights);
    }
    let (mut cfg, tensors) = weights.into_parts();
    cfg.eos_token_ids.extend(extra);
    DecoderWeights::from_tensors(cfg, tensors)
}

/// One line about a loaded model: its file or directory, architecture, size and context.
fn describe_source(
    path: &Path,
    weights: &DecoderWeights,
    arch: Option<HfArchitecture>,
    source: &ModelSource,
) -> String {
    let cfg = weights.config();
    let arch = arch.map_or("decoder", |a| a.class_name());
    let params = cfg.num_parameters() as f64;
    let size = if params >= 1e9 { format!("{:.2} B", params / 1e9) } else { format!("{:.1} M", params / 1e6) };
    let kind = match source {
        ModelSource::Gguf { types, .. } => format!("GGUF, {}", types.join(" ")),
        ModelSource::HuggingFace { .. } => "Hugging Face directory".to_string(),
    };
    format!(
        "{} ({kind}): {arch}, {size} parameters, {} layers, hidden {}, vocabulary {}, context {}",
        path.display(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.vocab_size,
        cfg.max_position_embeddings
    )
}

/// `weights` with `tuned`'s fine-tuned parameters in place of theirs: the training model of the
/// run (BF16 on GPU 0) built from them, the checkpoint's `model.safetensors` loaded into it,
/// its parameters copied back (the training model freed before the caller builds another).
///
/// # Errors
/// [`ModelError::Checkpoint`] for a model of another architecture than the run's, or a file
/// that does not fit it (naming the file); the device's and the model's errors.
fn fine_tuned_weights(weights: DecoderWeights, tuned: &FineTuned) -> Result<DecoderWeights, ModelError> {
    let bad = |message: String| ModelError::Checkpoint { path: tuned.dir.clone(), message };
    let found = DecoderSection::architecture_of(weights.config());
    if found != tuned.architecture {
        return Err(bad(format!(
            "the run fine-tuned a {} and the pretrained model is a {found}: pass the model the run started from with \
             --model PATH",
            tuned.architecture
        )));
    }
    let dev = te_runtime::Device::new(0).map_err(DecoderError::from)?;
    let mut lm = DecoderLm::from_weights(&dev, &weights, DType::BF16)?;
    drop(weights);
    let file = tuned.file();
    checkpoint::load(&mut lm, &file, &LoadOptions::default()).map_err(|e| {
        bad(format!(
            "{}: {e}; the fine-tuned weights do not fit the pretrained model: pass the model the run started from \
             with --model PATH",
            file.display()
        ))
    })?;
    let weights = lm.to_weights()?;
    drop(lm);
    Ok(weights)
}

/// Opens the decoder LLM at `path` (a `.gguf` file or a Hugging Face directory: `config.json`,
/// `*.safetensors`, `tokenizer.json`) on the device `opts` picks, with its tokenizer. Its
/// configuration stops generation at the tokenizer's end-of-generation ids as well as its own.
///
/// Without `opts.cpu` it runs on the GPU when there is one; without one it runs on the CPU and
/// says so on stderr. It writes a line about the model (file, architecture, size, load time) to
/// stderr.
///
/// # Errors
/// [`ModelError::NotFound`]; [`ModelError::Fp8OnCpu`] (checked before loading);
/// [`ModelError::Load`] for a directory without `config.json`, weights or `tokenizer.json`, an
/// unsupported architecture, a bad configuration or mismatched tensors.
pub fn open_causal_lm(path: &Path, opts: &ModelOptions) -> Result<(Box<dyn CausalLm>, Tokenizer), ModelError> {
    open_causal_lm_with(path, opts, None)
}

/// [`open_causal_lm`], with `tuned`'s fine-tuned weights over the pretrained model at `path`
/// when given (`te generate --checkpoint` of a `te train --model` run: `path` is the model the
/// run started from, for its configuration and tokenizer). Loading them needs the GPU (the
/// run's training model reads its checkpoint); the model then runs as [`open_causal_lm`] runs
/// it. It writes a line about the checkpoint (directory, step) to stderr after the model's.
///
/// # Errors
/// As [`open_causal_lm`]; [`ModelError::Checkpoint`] with `tuned` and no GPU to load it on
/// (`--cpu`, or none found; checked before loading), a model of another architecture, or a
/// `model.safetensors` that does not fit it.
pub fn open_causal_lm_with(
    path: &Path,
    opts: &ModelOptions,
    tuned: Option<&FineTuned>,
) -> Result<(Box<dyn CausalLm>, Tokenizer), ModelError> {
    if !path.exists() {
        return Err(ModelError::NotFound { path: path.to_path_buf() });
    }
    if opts.fp8_lm_head && opts.precision != Some(ModelPrecision::Fp8) {
        return Err(ModelError::Request("--fp8-lm-head goes with --precision fp8 (on the GPU path)".into()));
    }
    let gpu = !opts.cpu && te_runtime::device::gpu_available();
    if opts.kv_cache_e4m3 && !gpu {
        let why = if opts.cpu { "--cpu asks for the CPU path" } else { "no GPU was found" };
        return Err(ModelError::Request(format!(
            "--kv-cache e4m3 runs on the GPU path, and {why}: leave it out (the CPU path keeps an f32 cache)"
        )));
    }
    if let Some(t) = tuned.filter(|_| !gpu) {
        let why = if opts.cpu { "--cpu asks for the CPU path" } else { "no GPU was found" };
        return Err(ModelError::Checkpoint {
            path: t.dir.clone(),
            message: format!(
                "a fine-tuning checkpoint's weights load on the GPU (into the training model that wrote them), and \
                 {why}: sample the Hugging Face directory the run saved (OUT/hf-fp8 or OUT/hf-bf16) with --model \
                 PATH instead, which runs on the CPU too"
            ),
        });
    }
    let target = if gpu {
        Target::Gpu
    } else {
        if !opts.cpu {
            eprintln!("no GPU found: running on the CPU path (--cpu says so and skips this check)");
        }
        Target::Cpu
    };
    if target == Target::Cpu {
        // Before the (slow) load.
        cpu_precision(opts.precision)?;
    }
    let start = Instant::now();
    let load = |source| ModelError::Load { path: path.to_path_buf(), source: Box::new(source) };
    let LoadedModel { weights, tokenizer, source } = load_model(path).map_err(load)?;
    let arch = weights.architecture();
    let weights = with_tokenizer_eos(weights, &tokenizer).map_err(load)?;
    let about = describe_source(path, &weights, arch, &source);
    eprintln!("model: {about}; loaded in {:.2} s", start.elapsed().as_secs_f64());
    let weights = match tuned {
        Some(t) => {
            let start = Instant::now();
            let weights = fine_tuned_weights(weights, t)?;
            eprintln!(
                "checkpoint: {} (step {}), its fine-tuned weights over the model; loaded in {:.2} s",
                t.dir.display(),
                t.step,
                start.elapsed().as_secs_f64()
            );
            weights
        }
        None => weights,
    };
    let model = match target {
        Target::Gpu => gpu_model(weights, opts)?,
        Target::Cpu => cpu_model(weights, opts.precision)?,
    };
    Ok((model, tokenizer))
}

/// The ids of `text` with the tokenizer's BOS when it adds one (`add_bos_token`), and not twice
/// when the text starts with the BOS's own text.
///
/// # Errors
/// [`ModelError::Tokenizer`] for text the vocabulary cannot encode.
pub fn encode_with_bos(tokenizer: &Tokenizer, text: &str) -> Result<Vec<i32>, ModelError> {
    let mut ids = tokenizer.encode(text, true)?;
    if let (true, Some(bos)) = (tokenizer.add_bos(), tokenizer.bos_id()) {
        if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
            ids.remove(0);
        }
    }
    // Ids are below the vocabulary size, which load_model checked against the embedding's rows.
    Ok(ids.into_iter().map(|id| id as i32).collect())
}
