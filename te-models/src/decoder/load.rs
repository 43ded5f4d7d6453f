//! A decoder LLM and its tokenizer from what users have on disk: a GGUF file (llama.cpp,
//! Ollama) or a Hugging Face model directory (`config.json`, `*.safetensors`,
//! `tokenizer.json`) — [`load_model`]; its configuration and tokenizer alone — [`load_config`].

use super::{DecoderConfig, DecoderError, DecoderResult, DecoderWeights};
use crate::gguf::GgufFile;
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// Where a [`LoadedModel`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A GGUF file: its path and the ggml types its tensors were stored in (`Q4_K`, `Q8_0`, ...).
    Gguf {
        /// The file.
        path: PathBuf,
        /// The distinct ggml types of its tensors, sorted.
        types: Vec<String>,
    },
    /// A Hugging Face model directory.
    HuggingFace {
        /// The directory.
        dir: PathBuf,
    },
}

/// A decoder's weights (f32, Hugging Face layout mapped onto TE names) with its tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// The configuration and weights.
    pub weights: DecoderWeights,
    /// The tokenizer (`tokenizer.json` of the directory, or the GGUF file's vocabulary).
    pub tokenizer: Tokenizer,
    /// Where it came from.
    pub source: ModelSource,
}

/// The tokenizer of the model at `path` without its weights (what tokenizing a dataset needs): a
/// `.gguf` file's vocabulary ([`Tokenizer::from_gguf`]; the file's metadata is read, its tensors
/// are not) or a Hugging Face directory's `tokenizer.json` ([`Tokenizer::from_hf_dir`]).
///
/// # Errors
/// [`DecoderError::MissingFile`] for a path that is neither; the GGUF reader's errors;
/// [`DecoderError::Tokenizer`].
pub fn load_tokenizer(path: &Path) -> DecoderResult<Tokenizer> {
    if path.is_dir() {
        Ok(Tokenizer::from_hf_dir(path)?)
    } else if path.is_file() {
        Ok(Tokenizer::from_gguf(GgufFile::open(path)?.metadata())?)
    } else {
        Err(DecoderError::MissingFile { path: path.to_path_buf() })
    }
}

/// The configuration and tokenizer of the decoder at `path` without its weights (what training
/// one from scratch needs: `te train --model DIR --init random`): a Hugging Face directory's
/// `config.json` and `tokenizer.json` (no `*.safetensors` is read, none need be there), or a
/// `.gguf` file's metadata (its tensors are not read). The tokenizer's vocabulary must fit the
/// model's.
///
/// # Errors
/// As [`load_model`], without the weights' errors.
pub fn load_config(path: &Path) -> DecoderResult<(DecoderConfig, Tokenizer, ModelSource)> {
    let (cfg, tokenizer, source) = if path.is_dir() {
        let cfg = DecoderConfig::from_hf_config(&path.join("config.json"))?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        (cfg, tokenizer, ModelSource::HuggingFace { dir: path.to_path_buf() })
    } else if path.is_file() {
        let file = GgufFile::open(path)?;
        let cfg = DecoderConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(file.metadata())?;
        (cfg, tokenizer, ModelSource::Gguf { path: path.to_path_buf(), types: Vec::new() })
    } else {
        return Err(DecoderError::MissingFile { path: path.to_path_buf() });
    };
    check_vocab(&tokenizer, cfg.vocab_size)?;
    Ok((cfg, tokenizer, source))
}

/// Fails when the tokenizer has more tokens than the model's embedding has rows.
fn check_vocab(tokenizer: &Tokenizer, vocab: usize) -> DecoderResult<()> {
    if tokenizer.vocab_size() > vocab {
        return Err(DecoderError::config(
            "vocab_size",
            format!(
                "the tokenizer has {} tokens and the model's embedding {vocab} rows: they are not of the same model",
                tokenizer.vocab_size()
            ),
        ));
    }
    Ok(())
}

/// Loads the decoder at `path`: a `.gguf` file ([`DecoderWeights::from_gguf`],
/// [`Tokenizer::from_gguf`]) or a Hugging Face directory ([`DecoderWeights::from_hf_dir`],
/// [`Tokenizer::from_hf_dir`]). The tokenizer's vocabulary must cover the model's.
///
/// # Errors
/// [`DecoderError::MissingFile`] for a path that is neither; the errors of the readers (each
/// naming the file, key or tensor); [`DecoderError::Tokenizer`]; [`DecoderError::Config`] when
/// the tokenizer has more tokens than the embedding has rows.
pub fn load_model(path: &Path) -> DecoderResult<LoadedModel> {
    let (weights, tokenizer, source) = if path.is_dir() {
        let weights = DecoderWeights::from_hf_dir(path)?;
        let tokenizer = Tokenizer::from_hf_dir(path)?;
        (weights, tokenizer, ModelSource::HuggingFace { dir: path.to_path_buf() })
    } else if path.is_file() {
        let file = GgufFile::open(path)?;
        let weights = DecoderWeights::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(file.metadata())?;
        let mut types: Vec<String> = file.tensors().iter().map(|t| format!("{:?}", t.ggml_type())).collect();
        types.sort();
        types.dedup();
        (weights, tokenizer, ModelSource::Gguf { path: path.to_path_buf(), types })
    } else {
        return Err(DecoderError::MissingFile { path: path.to_path_buf() });
    };
    check_vocab(&tokenizer, weights.config().vocab_size)?;
    Ok(LoadedModel { weights, tokenizer, source })
}
