//! A [`Tokenizer`] as the files of a Hugging Face model directory ([`Tokenizer::to_hf_files`]):
//! `tokenizer.json` (the `tokenizers` library's serialization, what transformers' fast
//! tokenizers load), `tokenizer_config.json` (`add_bos_token`, `bos_token`, `eos_token`, ...) and
//! `generation_config.json` (the end-of-generation ids).
//!
//! - **GGUF SentencePiece** (Gemma, Llama 2): written as Hugging Face writes these models
//!   (transformers' `convert_slow_tokenizer.py`, `GemmaConverter` / `LlamaConverter`): a `BPE`
//!   model with `byte_fallback`, its merges derived from the scores as `generate_merges` in
//!   `tokenization_utils_base.py` does (every split of a token into two tokens is a merge; the
//!   merges ordered by the token's score, highest first, then the longer left part, the longer
//!   right part, the token's id and the parts' ids), a `Replace(" " → "▁")` normalizer behind a
//!   `Prepend("▁")` when the vocabulary prefixes a space (`tokenizer.ggml.add_space_prefix`), the
//!   decoder `Replace("▁" → " ")`, `ByteFallback`, `Fuse` (and `Strip` of the prefix space),
//!   control and unknown tokens as special added tokens, user-defined ones as plain added tokens
//!   (matched whole before the model, as llama.cpp does). The highest-score-first merges of
//!   llama.cpp's SentencePiece tokenizer are then the lowest-rank-first merges of BPE: both give
//!   the same ids, except where two different tokens have exactly the same score and their
//!   merges compete (llama.cpp takes the leftmost, BPE the lower rank), or where a token holds a
//!   character that is no token (SentencePiece can merge it, BPE falls back to its bytes first).
//! - **GGUF byte-level BPE** (Llama 3, Qwen): the `tokenizers` model this crate encodes with
//!   (tokens, merges, the pre-tokenizer regexes of `tokenizer.ggml.pre`, `ByteLevel`), as it is.
//! - **Hugging Face**: the loaded `tokenizer.json`, as it is (an export from a Hugging Face
//!   directory copies the files instead).
//!
//! A `TemplateProcessing` post-processor adds BOS (and EOS) as the vocabulary's flags say, so that
//! `tokenizers`' `encode(text, add_special_tokens=True)` gives [`Tokenizer::encode`]`(text, true)`.
//! An empty token (llama.cpp renames them) is written as `<te_empty_ID>` to keep every id.

use std::borrow::Cow;
use std::path::Path;

use ahash::AHashMap;
use serde_json::{json, Map, Value};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, SplitDelimiterBehavior};

use super::spm::SpmModel;
use super::{Backend, TokenType, Tokenizer, TokenizerError, TokenizerResult, SPACE_MARK};

/// What a GGUF file holds beside the vocabulary that the Hugging Face files carry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HfTokenizerExtras {
    /// The padding token (`tokenizer.ggml.padding_token_id`): `pad_token`.
    pub pad_token_id: Option<u32>,
    /// The Jinja chat template (`tokenizer.chat_template`): `chat_template`.
    pub chat_template: Option<String>,
}

fn hf_err(e: impl std::fmt::Display) -> TokenizerError {
    TokenizerError::Hf { message: e.to_string() }
}

/// The merges of a SentencePiece vocabulary (see the module docs): `names` by id, `ids` their
/// inverse. Every token is split at each character boundary, two hash lookups per split.
fn spm_merges(names: &[Cow<'_, str>], scores: &[f32], ids: &AHashMap<&str, u32>) -> Vec<(String, String)> {
    // (score, left chars, right chars, token id, left id, right id): sorted as transformers does.
    let mut found: Vec<(f32, usize, usize, u32, u32, u32)> = Vec::new();
    for (id, piece) in (0u32..).zip(names) {
        let mut left_chars = 0;
        let total = piece.chars().count();
        for (at, _) in piece.char_indices().skip(1) {
            left_chars += 1;
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                found.push((
                    scores.get(id as usize).copied().unwrap_or(0.0),
                    left_chars,
                    total - left_chars,
                    id,
                    li,
                    ri,
                ));
            }
        }
    }
    found.sort_by(|a, b| {
        b.0.total_cmp(&a.0).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)).then((a.3, a.4, a.5).cmp(&(b.3, b.4, b.5)))
    });
    found.into_iter().map(|(.., l, r)| (names[l as usize].to_string(), names[r as usize].to_string())).collect()
}

/// The `tokenizers` BPE tokenizer of a SentencePiece vocabulary (see the module docs).
fn spm_tokenizer(m: &SpmModel) -> TokenizerResult<tokenizers::Tokenizer> {
    let (tokens, scores, types, unk, add_space_prefix) = m.export_view();
    let names: Vec<Cow<'_, str>> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| if t.is_empty() { Cow::Owned(format!("<te_empty_{id}>")) } else { Cow::Borrowed(t.as_str()) })
        .collect();
    let mut ids: AHashMap<&str, u32> = AHashMap::with_capacity(names.len());
    for (name, id) in names.iter().zip(0u32..) {
        if let Some(first) = ids.insert(name, id) {
            return Err(TokenizerError::DuplicateToken { text: name.to_string(), first, second: id });
        }
    }
    let merges = spm_merges(&names, scores, &ids);
    let byte_fallback = (0..=255u8).any(|b| ids.contains_key(format!("<0x{b:02X}>").as_str()));
    let vocab: AHashMap<String, u32> = ids.iter().map(|(&t, &id)| (t.to_string(), id)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(byte_fallback).fuse_unk(false);
    if let Some(u) = unk {
        builder = builder.unk_token(names[u as usize].to_string());
    }
    let mut tok = tokenizers::Tokenizer::new(builder.build().map_err(hf_err)?);

    let mark = SPACE_MARK.to_string();
    let replace = Replace::new(" ", mark.as_str()).map_err(hf_err)?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(mark.clone()).into(), replace.into()]).into()
    } else {
        replace.into()
    };
    let mut decoders: Vec<DecoderWrapper> =
        vec![Replace::new(mark.as_str(), " ").map_err(hf_err)?.into(), ByteFallback::new().into(), Fuse::new().into()];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    // A no-op after the normalizer (no spaces are left), as Hugging Face's Gemma files have it.
    let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
        .map_err(hf_err)?;
    tok.with_normalizer(Some(normalizer))
        .with_pre_tokenizer(Some(split))
        .with_decoder(Some(DecoderSequence::new(decoders)));
    let added: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(t, ty)| {
            !t.is_empty() && matches!(ty, TokenType::Control | TokenType::Unknown | TokenType::UserDefined)
        })
        .map(|(t, ty)| AddedToken::from(t.clone(), ty.is_special()).normalized(false))
        .collect();
    tok.add_tokens(&added);
    Ok(tok)
}

/// `[BOS] $A [EOS]` (pair: both sequences so) as the flags say; `None` when nothing is added.
fn template(t: &Tokenizer) -> TokenizerResult<Option<TemplateProcessing>> {
    let text = |id: Option<u32>| id.and_then(|i| t.id_to_token(i).map(|s| (s, i)));
    let bos = text(t.bos_id()).filter(|_| t.add_bos());
    let eos = text(t.eos_id()).filter(|_| t.add_eos());
    if bos.is_none() && eos.is_none() {
        return Ok(None);
    }
    let mut special_tokens = Map::new();
    let mut sequence = |seq: &str, type_id: u32| {
        let mut out = Vec::new();
        let mut special = |(s, id): &(String, u32), out: &mut Vec<Value>| {
            out.push(json!({ "SpecialToken": { "id": s, "type_id": type_id } }));
            special_tokens.insert(s.clone(), json!({ "id": s, "ids": [id], "tokens": [s] }));
        };
        if let Some(b) = &bos {
            special(b, &mut out);
        }
        out.push(json!({ "Sequence": { "id": seq, "type_id": type_id } }));
        if let Some(e) = &eos {
            special(e, &mut out);
        }
        out
    };
    let single = sequence("A", 0);
    let mut pair = single.clone();
    pair.extend(sequence("B", 1));
    let v = json!({ "type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special_tokens });
    serde_json::from_value(v).map(Some).map_err(hf_err)
}

impl Tokenizer {
    /// The `tokenizer.json` text of this tokenizer (see the module docs): the `tokenizers`
    /// library loads it, and encodes as [`Tokenizer::encode`] does.
    ///
    /// # Errors
    /// [`TokenizerError::DuplicateToken`] when an empty token's placeholder is a token;
    /// [`TokenizerError::Hf`] when the `tokenizers` library refuses the model or cannot
    /// serialize it.
    pub fn to_hf_json(&self) -> TokenizerResult<String> {
        let mut tok = match &self.backend {
            Backend::Spm(m) => spm_tokenizer(m)?,
            Backend::GgufBpe(t, _) => (**t).clone(),
            Backend::Hf(t) => (**t).clone(),
        };
        if !matches!(self.backend, Backend::Hf(_)) {
            if let Some(t) = template(self)? {
                tok.with_post_processor(Some(t));
            }
        }
        tok.with_padding(None).with_truncation(None).map_err(hf_err)?;
        tok.to_string(false).map_err(hf_err)
    }

    /// The `tokenizer_config.json` of this tokenizer: `tokenizer_class` `PreTrainedTokenizerFast`
    /// (transformers then loads `tokenizer.json` as it is), `add_bos_token`, `add_eos_token`,
    /// `bos_token`, `eos_token`, `unk_token` and `pad_token` (those that exist) and the
    /// `chat_template` of `extras`.
    pub fn hf_tokenizer_config(&self, extras: &HfTokenizerExtras) -> Value {
        let text = |id: Option<u32>| id.and_then(|i| self.id_to_token(i)).map_or(Value::Null, Value::from);
        let unk = match &self.backend {
            Backend::Spm(m) => m.export_view().3,
            _ => None,
        };
        let mut c = Map::new();
        c.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        c.insert("add_bos_token".into(), json!(self.add_bos()));
        c.insert("add_eos_token".into(), json!(self.add_eos()));
        c.insert("bos_token".into(), text(self.bos_id()));
        c.insert("eos_token".into(), text(self.eos_id()));
        c.insert("unk_token".into(), text(unk));
        c.insert("pad_token".into(), text(extras.pad_token_id));
        c.insert("clean_up_tokenization_spaces".into(), json!(false));
        c.insert("spaces_between_special_tokens".into(), json!(false));
        if let Some(t) = &extras.chat_template {
            c.insert("chat_template".into(), json!(t));
        }
        Value::Object(c)
    }

    /// The `generation_config.json` of this tokenizer's special tokens: `bos_token_id`, every
    /// end-of-generation id as `eos_token_id` (one id, or a list: Gemma's `<eos>` and
    /// `<end_of_turn>`), `pad_token_id` of `extras`. It is where transformers (and
    /// [`Tokenizer::from_hf_dir`]) find the end-of-generation ids beyond the EOS.
    pub fn hf_generation_config(&self, extras: &HfTokenizerExtras) -> Value {
        let eos = match self.eos_ids() {
            [] => Value::Null,
            [one] => json!(one),
            many => json!(many),
        };
        json!({ "bos_token_id": self.bos_id(), "eos_token_id": eos, "pad_token_id": extras.pad_token_id })
    }

    /// `tokenizer.json`, `tokenizer_config.json` and `generation_config.json` (their names and
    /// bytes).
    ///
    /// # Errors
    /// As [`Tokenizer::to_hf_json`].
    pub fn to_hf_files(&self, extras: &HfTokenizerExtras) -> TokenizerResult<Vec<(&'static str, Vec<u8>)>> {
        let pretty = |v: &Value| -> TokenizerResult<Vec<u8>> {
            let mut bytes = serde_json::to_vec_pretty(v).map_err(hf_err)?;
            bytes.push(b'\n');
            Ok(bytes)
        };
        Ok(vec![
            ("tokenizer.json", self.to_hf_json()?.into_bytes()),
            ("tokenizer_config.json", pretty(&self.hf_tokenizer_config(extras))?),
            ("generation_config.json", pretty(&self.hf_generation_config(extras))?),
        ])
    }

    /// Writes [`Tokenizer::to_hf_files`] into `dir` (which must exist).
    ///
    /// # Errors
    /// As [`Tokenizer::to_hf_json`]; [`TokenizerError::Io`] naming the file that cannot be written.
    pub fn save_hf_files(&self, dir: &Path, extras: &HfTokenizerExtras) -> TokenizerResult<()> {
        for (name, bytes) in self.to_hf_files(extras)? {
            let path = dir.join(name);
            std::fs::write(&path, bytes).map_err(|source| TokenizerError::Io { path, source })?;
        }
        Ok(())
    }
}
