//! `te generate --model`: text from a decoder LLM (a `.gguf` file or a Hugging Face directory,
//! opened by [`crate::model::open_causal_lm`]).
//!
//! Each prompt is encoded with the model's tokenizer, with its BOS when the tokenizer adds one
//! (`add_bos_token`), and continued by [`te_models::decoder::CausalLm::generate`]: the prompts
//! of a batch (repeated `--prompt`, each `--batch` times) in one prefill, packed without
//! padding, then one token per unfinished sample per step, drawn with [`SamplingConfig`]
//! (temperature, top-k, top-p) from the Philox stream of `--seed`. A sample ends at an
//! end-of-sequence token (the model's and the tokenizer's) or after `--max-new-tokens`. One
//! sample is streamed to the output as its tokens arrive ([`Tokenizer::decode_stream_after`]);
//! several are printed, each under a header, when all have finished. Special tokens (the EOS)
//! are not printed, nor ids past the tokenizer's vocabulary (an embedding padded beyond it, as
//! Qwen's is: they have no text; stderr counts them).
//!
//! `te generate --checkpoint` of a fine-tuning run (`te train --model`: its `trainer.toml` has
//! a `[model.decoder]` section) runs the same way over the pretrained model the run started
//! from, its weights replaced by the checkpoint's ([`fine_tuned`], [`run_with`]).

use crate::generate::{GenerateArgs, GenerateError, GenerateReport, KvCacheDtype, Located, DEFAULT_NEW_TOKENS};
use crate::model::{encode_with_bos, open_causal_lm_with, FineTuned, ModelError, ModelOptions, ModelPrecision};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;
use te_models::decoder::{DecodeOptions, DecoderError};
use te_models::generate::SamplingConfig;
use te_models::tokenizer::Tokenizer;

/// What one `te generate --model` did: tokens and times.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelGenerateReport {
    /// The model's device and precision ([`te_models::decoder::CausalLm::describe`]).
    pub device: String,
    /// Prompt tokens of each sample (with the BOS).
    pub prompt_tokens: Vec<usize>,
    /// New tokens of each sample (with the EOS that ended it, if one did).
    pub new_tokens: Vec<usize>,
    /// Prefill (the prompts through the model, and each sample's first token) in seconds.
    pub prefill_s: f64,
    /// The remaining decode steps in seconds.
    pub decode_s: f64,
    /// The text of each sample's new tokens.
    pub samples: Vec<String>,
}

impl ModelGenerateReport {
    /// The speeds as a line: prompt tokens per second of the prefill, new tokens per second
    /// (all samples, after each one's first) of the decode.
    pub fn speeds(&self) -> String {
        let rate = |tokens: usize, s: f64| {
            if tokens > 0 && s > 0.0 {
                format!("{:.1}", tokens as f64 / s)
            } else {
                "–".into()
            }
        };
        let prompt: usize = self.prompt_tokens.iter().sum();
        let decoded: usize = self.new_tokens.iter().map(|n| n.saturating_sub(1)).sum();
        let steps = self.new_tokens.iter().max().map_or(0, |n| n.saturating_sub(1));
        format!(
            "{}: {} sample{}; prefill {prompt} tokens in {:.1} ms ({} tokens/s); decode {decoded} tokens in {steps} \
             steps, {:.1} ms ({} tokens/s)",
            self.device,
            self.samples.len(),
            if self.samples.len() == 1 { "" } else { "s" },
            self.prefill_s * 1e3,
            rate(prompt, self.prefill_s),
            self.decode_s * 1e3,
            rate(decoded, self.decode_s)
        )
    }
}

/// What [`GenerateError::PretrainedModel`] says, for the model the checkpoint records.
pub(crate) fn pretrained_model_missing(recorded: Option<&Path>) -> String {
    let what = match recorded {
        Some(p) => format!("the pretrained model its fine-tuning run started from, {}, no longer exists", p.display()),
        None => "its trainer.toml does not name the pretrained model its fine-tuning run started from".into(),
    };
    format!(
        "{what}: pass that model (its .gguf file or Hugging Face directory) with --model PATH together with \
         --checkpoint"
    )
}

/// What one `te generate` did ([`crate::generate::run`]): a `te train` GPT checkpoint's
/// samples, or a decoder LLM's.
#[derive(Debug, Clone, PartialEq)]
pub enum Generated {
    /// A byte-level GPT of `te train`.
    Checkpoint(GenerateReport),
    /// A decoder LLM: `--model`, or a fine-tuning run's checkpoint.
    Decoder(ModelGenerateReport),
}

impl Generated {
    /// The speeds as a line ([`GenerateReport::speeds`], [`ModelGenerateReport::speeds`]).
    pub fn speeds(&self) -> String {
        match self {
            Generated::Checkpoint(r) => r.speeds(),
            Generated::Decoder(r) => r.speeds(),
        }
    }
}

/// The prompts' texts: each `--prompt`, or `--prompt-file`'s contents (UTF-8).
fn prompt_texts(a: &GenerateArgs) -> Result<Vec<String>, ModelError> {
    if let Some(f) = &a.prompt_file {
        let bytes = std::fs::read(f)
            .map_err(|source| ModelError::Io { what: format!("cannot read {}", f.display()), source })?;
        let text = String::from_utf8(bytes)
            .map_err(|e| ModelError::Request(format!("{}: not UTF-8 text ({e})", f.display())))?;
        return Ok(vec![text]);
    }
    if a.prompt.is_empty() {
        return Err(ModelError::Request("give --prompt TEXT (repeated for a batch) or --prompt-file FILE".into()));
    }
    Ok(a.prompt.clone())
}

/// Whether the tokenizer has token `id`: a model's embedding may have more rows than its
/// tokenizer has tokens (Qwen pads its vocabulary), and the ids past the tokenizer's have no
/// text.
fn has_text(tokenizer: &Tokenizer, id: i32) -> bool {
    usize::try_from(id).is_ok_and(|id| id < tokenizer.vocab_size())
}

/// The text of `new` after `prompt`, as a stream of it would show it (special tokens and ids the
/// tokenizer does not have left out).
fn continuation(tokenizer: &Tokenizer, prompt: &[i32], new: &[i32]) -> Result<String, ModelError> {
    let context: Vec<u32> = prompt.iter().map(|&t| t as u32).collect();
    let mut stream = tokenizer.decode_stream_after(&context, true)?;
    let mut text = String::new();
    for &t in new.iter().filter(|&&t| has_text(tokenizer, t)) {
        text.push_str(&stream.push(t as u32)?);
    }
    text.push_str(&stream.finish()?);
    Ok(text)
}

/// The pretrained model and the fine-tuned weights of `located` when it is a fine-tuning run's
/// checkpoint (its `[model.decoder]` section), `None` for a GPT run's: the model is `model`
/// (`--model`) when given, else the section's `source`.
///
/// # Errors
/// [`GenerateError::PretrainedModel`] when the section names no source and `model` is not
/// given, or names one that no longer exists.
pub fn fine_tuned(located: &Located, model: Option<&Path>) -> Result<Option<(PathBuf, FineTuned)>, GenerateError> {
    let Some(section) = located.latest.model.as_ref().and_then(|m| m.decoder.as_ref()) else { return Ok(None) };
    let source = match (model, &section.source) {
        (Some(path), _) => path.to_path_buf(),
        (None, Some(path)) if path.exists() => path.clone(),
        (None, recorded) => {
            return Err(GenerateError::PretrainedModel { checkpoint: located.dir.clone(), recorded: recorded.clone() })
        }
    };
    let tuned =
        FineTuned { dir: located.dir.clone(), step: located.latest.step, architecture: section.architecture.clone() };
    Ok(Some((source, tuned)))
}

/// Runs `te generate --model PATH`: opens the model, writes the prompt and its continuation to
/// `out` as it is drawn (one sample), or each sample under a header once all are drawn;
/// returns what it did.
///
/// # Errors
/// [`ModelError`]: the model (missing, unsupported, `--precision fp8` on the CPU), an empty
/// prompt, one (or one plus `--max-new-tokens`) beyond the model's context
/// (`max_position_embeddings`), bad sampling flags or `--batch 0` (checked before the model is
/// loaded), I/O.
pub fn run(a: &GenerateArgs, model_path: &Path, out: &mut dyn Write) -> Result<ModelGenerateReport, ModelError> {
    run_with(a, model_path, None, out)
}

/// [`run`] with `tuned`'s fine-tuned weights over the model at `model_path` (the pretrained
/// model of the run: [`fine_tuned`]); `te generate --checkpoint` of a fine-tuning run.
///
/// # Errors
/// As [`run`]; [`ModelError::Checkpoint`] as [`crate::model::open_causal_lm_with`] says.
pub fn run_with(
    a: &GenerateArgs,
    model_path: &Path,
    tuned: Option<&FineTuned>,
    out: &mut dyn Write,
) -> Result<ModelGenerateReport, ModelError> {
    let sampling = SamplingConfig { temperature: a.temperature, top_k: a.top_k, top_p: a.top_p };
    sampling.validate().map_err(|e| ModelError::Request(e.to_string()))?;
    if a.batch == 0 {
        return Err(ModelError::Request("--batch 0: draw at least one sample".into()));
    }
    let texts = prompt_texts(a)?;
    if let Some(k) = texts.iter().position(String::is_empty) {
        let which = if texts.len() == 1 { String::new() } else { format!(" {}", k + 1) };
        return Err(ModelError::Request(format!("the prompt{which} is empty: give at least one character")));
    }
    let precision = a.precision.as_deref().map(ModelPrecision::from_name).transpose()?;
    let opts = ModelOptions {
        cpu: a.cpu,
        precision,
        fp8_lm_head: a.fp8_lm_head,
        kv_cache_e4m3: a.kv_cache == KvCacheDtype::E4m3,
    };
    let (mut model, tokenizer) = open_causal_lm_with(model_path, &opts, tuned)?;
    let device = model.describe();
    eprintln!("running on {device}");
    let context = model.config().max_position_embeddings;
    let encoded: Vec<Vec<i32>> = texts.iter().map(|t| encode_with_bos(&tokenizer, t)).collect::<Result<_, _>>()?;
    let longest = encoded.iter().map(Vec::len).max().unwrap_or(0);
    for (k, ids) in encoded.iter().enumerate() {
        if ids.len() >= context {
            let which = if encoded.len() == 1 { String::new() } else { format!(" {}", k + 1) };
            return Err(ModelError::Request(format!(
                "the prompt{which} has {} tokens and the model's context is {context} tokens \
                 (max_position_embeddings): shorten it to fewer than {context} tokens",
                ids.len()
            )));
        }
    }
    let new_tokens = a.max_new_tokens.unwrap_or(DEFAULT_NEW_TOKENS.min(context - longest));
    if longest + new_tokens > context {
        return Err(ModelError::Request(format!(
            "a prompt of {longest} tokens and {new_tokens} new tokens exceed the model's context of {context} tokens \
             (max_position_embeddings): ask for at most {} new tokens (--max-new-tokens) or shorten the prompt",
            context - longest
        )));
    }
    // Each prompt `--batch` times, prompt after prompt.
    let prompts: Vec<Vec<i32>> = encoded.iter().flat_map(|p| std::iter::repeat_n(p.clone(), a.batch)).collect();
    let prompt_texts: Vec<&str> = texts.iter().flat_map(|t| std::iter::repeat_n(t.as_str(), a.batch)).collect();
    let opts = DecodeOptions { max_new_tokens: new_tokens, sampling, seed: a.seed, stop_at_eos: true };
    let io = |source| ModelError::Io { what: "cannot write the text".into(), source };
    let streaming = prompts.len() == 1;
    let mut stream = None;
    if streaming {
        out.write_all(prompt_texts[0].as_bytes()).and_then(|()| out.flush()).map_err(io)?;
        let context: Vec<u32> = prompts[0].iter().map(|&t| t as u32).collect();
        stream = Some(tokenizer.decode_stream_after(&context, true)?);
    }
    let mut write_error = None;
    let start = Instant::now();
    let mut first_token = None;
    let mut on_token = |_: usize, token: i32| -> Result<(), DecoderError> {
        first_token.get_or_insert_with(Instant::now);
        let Some(stream) = stream.as_mut().filter(|_| has_text(&tokenizer, token)) else { return Ok(()) };
        let text = stream.push(token as u32)?;
        if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
            write_error = Some(e);
            return Err(DecoderError::input("the output closed"));
        }
        Ok(())
    };
    let result = model.generate(&prompts, &opts, &mut on_token);
    let end = Instant::now();
    if let Some(e) = write_error {
        return Err(io(e));
    }
    let samples = result?;
    if let Some(mut stream) = stream {
        out.write_all(stream.finish()?.as_bytes()).map_err(io)?;
    }
    let textless: usize = samples.iter().flatten().filter(|&&t| !has_text(&tokenizer, t)).count();
    if textless > 0 {
        eprintln!(
            "note: {textless} drawn token{} past the tokenizer's {} tokens (the model's vocabulary has {}) left out of \
             the text",
            if textless == 1 { "" } else { "s" },
            tokenizer.vocab_size(),
            model.config().vocab_size
        );
    }
    let mut texts_out = Vec::with_capacity(samples.len());
    for (k, (prompt, new)) in prompts.iter().zip(&samples).enumerate() {
        let text = continuation(&tokenizer, prompt, new)?;
        if !streaming {
            if k > 0 {
                writeln!(out).map_err(io)?;
            }
            writeln!(out, "--- sample {} of {} ---", k + 1, samples.len()).map_err(io)?;
            out.write_all(prompt_texts[k].as_bytes()).map_err(io)?;
            out.write_all(text.as_bytes()).map_err(io)?;
            writeln!(out).map_err(io)?;
        }
        texts_out.push(text);
    }
    if streaming {
        writeln!(out).map_err(io)?;
    }
    out.flush().map_err(io)?;
    let first = first_token.unwrap_or(end);
    Ok(ModelGenerateReport {
        device,
        prompt_tokens: prompts.iter().map(Vec::len).collect(),
        new_tokens: samples.iter().map(Vec::len).collect(),
        prefill_s: (first - start).as_secs_f64(),
        decode_s: (end - first).as_secs_f64(),
        samples: texts_out,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generate::run as generate;
    use te_models::gpt::GptConfig;
    use te_train::checkpoint::{DecoderSection, Latest, ModelSection};
    use te_train::{Precision, TrainConfig};

    /// `te generate` with a greedy prompt on the CPU path, `--checkpoint` and maybe `--model`.
    fn args(checkpoint: &Path, model: Option<&Path>) -> GenerateArgs {
        GenerateArgs {
            checkpoint: Some(checkpoint.to_path_buf()),
            model: model.map(Path::to_path_buf),
            prompt: vec!["Hello".into()],
            prompt_file: None,
            max_new_tokens: Some(4),
            temperature: 0.0,
            top_k: None,
            top_p: None,
            seed: 0,
            batch: 1,
            precision: None,
            cpu: true,
            fp8_lm_head: false,
            kv_cache: KvCacheDtype::Bf16,
        }
    }

    /// A run's directory `root/fp8` whose checkpoint at step 2 is of a fine-tuning run of
    /// `decoder` (`None`: a GPT run), written by hand (no weights: nothing gets that far).
    fn checkpoint(root: &Path, decoder: Option<DecoderSection>) -> PathBuf {
        let run = root.join("fp8");
        let step = run.join("step-0000002");
        std::fs::create_dir_all(&step).unwrap();
        let cfg = TrainConfig::new(GptConfig { seq_length: 64, vocab_size: 300, ..GptConfig::tiny() }, 2);
        let latest = Latest {
            dir: "step-0000002".into(),
            step: 2,
            dropout_offset: 0,
            batch: cfg.batch,
            grad_accum: 1,
            seq_length: 64,
            lr: cfg.lr,
            data_seed: 0,
            model_seed: 0,
            tensor_parallel: None,
            data_parallel: None,
            model: Some(ModelSection { decoder, ..ModelSection::new(&cfg, Precision::Fp8) }),
        };
        let text = toml::to_string(&latest).unwrap();
        std::fs::write(step.join("trainer.toml"), &text).unwrap();
        std::fs::write(run.join("latest.toml"), &text).unwrap();
        run
    }

    fn llama(source: Option<PathBuf>) -> Option<DecoderSection> {
        Some(DecoderSection { architecture: "LlamaForCausalLM".into(), pack: "blocks".into(), source })
    }

    /// A fine-tuning checkpoint whose pretrained model is gone, or not recorded, is a typed
    /// error that says to pass it with --model together with --checkpoint.
    #[test]
    fn a_fine_tuning_checkpoint_without_its_pretrained_model_says_to_pass_it() {
        let root = tempfile::tempdir().unwrap();
        let gone = root.path().join("moved-away.gguf");
        for recorded in [Some(gone.clone()), None] {
            let run = checkpoint(root.path(), llama(recorded.clone()));
            let e = generate(&args(&run, None), &mut Vec::new()).unwrap_err();
            match &e {
                GenerateError::PretrainedModel { checkpoint, recorded: r } => {
                    assert_eq!((checkpoint, r), (&run.join("step-0000002"), &recorded));
                }
                _ => panic!("expected PretrainedModel, got {e}"),
            }
            let e = e.to_string();
            assert!(e.contains("pass that model") && e.contains("--model PATH together with --checkpoint"), "{e}");
            let why = if recorded.is_some() { "moved-away.gguf, no longer exists" } else { "does not name" };
            assert!(e.contains(why), "{e}");
        }
    }

    /// With its pretrained model (recorded, or given with --model) the checkpoint goes the
    /// --model way, whose loading needs the GPU: on the CPU path a typed error says what to
    /// sample instead, before anything is loaded. --model with a GPT checkpoint is refused.
    #[test]
    fn a_fine_tuning_checkpoint_samples_as_model_does_and_gpt_checkpoints_refuse_model() {
        let root = tempfile::tempdir().unwrap();
        let source = root.path().join("pretrained");
        std::fs::create_dir_all(&source).unwrap();
        for (recorded, model) in [(Some(source.clone()), None), (None, Some(source.as_path()))] {
            let run = checkpoint(root.path(), llama(recorded));
            let e = generate(&args(&run, model), &mut Vec::new()).unwrap_err();
            assert!(
                matches!(&e, GenerateError::Model(m) if matches!(**m, ModelError::Checkpoint { .. })),
                "expected ModelError::Checkpoint, got {e}"
            );
            let e = e.to_string();
            assert!(e.contains("load on the GPU") && e.contains("--cpu asks for the CPU path"), "{e}");
            assert!(e.contains("OUT/hf-fp8"), "{e}");
        }
        let run = checkpoint(root.path(), None);
        let e = generate(&args(&run, Some(&source)), &mut Vec::new()).unwrap_err();
        assert!(matches!(e, GenerateError::Request(_)), "{e}");
        assert!(e.to_string().contains("GPT checkpoint") && e.to_string().contains("drop one of them"), "{e}");
        let found = fine_tuned(&crate::generate::locate(&run, None).unwrap(), None).unwrap();
        assert!(found.is_none(), "a GPT run's checkpoint has no pretrained model");
    }

    /// `--checkpoint` and `--model` may come together; one of them must.
    #[test]
    fn checkpoint_and_model_may_come_together() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: GenerateArgs,
        }
        let both = Cli::try_parse_from(["te", "--checkpoint", "c", "--model", "m", "--prompt", "p"]).unwrap();
        assert_eq!((both.a.checkpoint, both.a.model), (Some("c".into()), Some("m".into())));
        assert!(Cli::try_parse_from(["te", "--prompt", "p"]).is_err());
    }
}
