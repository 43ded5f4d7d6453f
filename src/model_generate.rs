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

use crate::generate::{GenerateArgs, DEFAULT_NEW_TOKENS};
use crate::model::{encode_with_bos, open_causal_lm, ModelError, ModelOptions, ModelPrecision};
use std::io::Write;
use std::path::Path;
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
    let (mut model, tokenizer) =
        open_causal_lm(model_path, &ModelOptions { cpu: a.cpu, precision, fp8_lm_head: a.fp8_lm_head })?;
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
