//! Hugging Face tokenizers: `tokenizer.json` through the `tokenizers` crate, and what
//! `transformers` reads beside it: `tokenizer_config.json` (`add_bos_token`, `add_eos_token`,
//! `bos_token`, `eos_token`; the flags rebuild the BOS/EOS template of `LlamaTokenizerFast` and
//! `GemmaTokenizerFast`) and `generation_config.json` (`eos_token_id`, one id or a list: Gemma 3
//! lists `<eos>` and `<end_of_turn>`; `bos_token_id`).
//!
//! Without a configuration the tokenizer's own post-processor decides: the special tokens it puts
//! around an empty text give the BOS (the first) and whether encode adds it; the EOS ids then are
//! the special tokens among the vocabulary's [`EOG_TEXTS`](super::EOG_TEXTS) and `</s>`.

use std::path::Path;

use serde_json::Value;

use super::error::{TokenizerError, TokenizerResult};
use super::vocab::Specials;

/// What `tokenizer_config.json` and `generation_config.json` say about special tokens.
#[derive(Debug, Default)]
struct HfConfig {
    add_bos: Option<bool>,
    add_eos: Option<bool>,
    bos: Option<u32>,
    eos: Option<u32>,
    eos_ids: Vec<u32>,
}

/// Reads a file, erring on a missing one with [`TokenizerError::MissingFile`].
fn read(path: &Path) -> TokenizerResult<Vec<u8>> {
    if !path.exists() {
        return Err(TokenizerError::MissingFile { path: path.to_path_buf() });
    }
    std::fs::read(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })
}

fn parse_json(path: &Path) -> TokenizerResult<Value> {
    serde_json::from_slice(&read(path)?)
        .map_err(|e| TokenizerError::Json { path: path.to_path_buf(), message: e.to_string() })
}

/// Loads `tokenizer.json` and the special tokens of the optional configuration files.
pub(crate) fn load(
    tokenizer_json: &Path,
    tokenizer_config: Option<&Path>,
    generation_config: Option<&Path>,
) -> TokenizerResult<(tokenizers::Tokenizer, Specials, usize)> {
    let bytes = read(tokenizer_json)?;
    let load_err = |e: Box<dyn std::error::Error + Send + Sync>| TokenizerError::HfLoad {
        path: tokenizer_json.to_path_buf(),
        message: e.to_string(),
    };
    // The `tokenizers` crate (0.22) panics on some malformed files instead of returning its
    // error (a `decoder` of no known shape: `expect("Helper")`, found by the fuzz test): the
    // panic is caught here and refused like any bad file.
    let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(&bytes)).map_err(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic".into());
        TokenizerError::HfLoad {
            path: tokenizer_json.to_path_buf(),
            message: format!("the tokenizers crate failed on it ({what}): a damaged or unsupported file"),
        }
    })?;
    let mut tok = parsed.map_err(load_err)?;
    // Padding and truncation saved in the file would change a prompt's ids: encode gives the
    // text's ids only, the caller decides about lengths.
    tok.with_padding(None).with_truncation(None).map_err(load_err)?;
    // The largest id + 1: added tokens may sit past the model's vocabulary.
    let vocab_size = tok.get_vocab(true).values().map(|&id| id as usize + 1).max().unwrap_or(0);
    if vocab_size == 0 {
        return Err(TokenizerError::EmptyVocab);
    }

    let mut cfg = HfConfig::default();
    if let Some(path) = tokenizer_config {
        read_tokenizer_config(path, &tok, &mut cfg)?;
    }
    if let Some(path) = generation_config {
        read_generation_config(path, &mut cfg)?;
    }

    // The special tokens the post-processor puts around an empty text (HF's encode with
    // add_special_tokens): [<bos>] for Llama and Gemma, [] for Qwen.
    let template = tok.encode_fast("", true).map_err(|e| TokenizerError::Hf { message: e.to_string() })?;
    let template = template.get_ids();
    let bos = cfg.bos.or_else(|| template.first().copied());
    let add_bos = cfg.add_bos.unwrap_or_else(|| bos.is_some() && template.first() == bos.as_ref());
    let mut eos_ids = cfg.eos_ids;
    if eos_ids.is_empty() {
        // Only tokens the file marks special: Gemma's `</s>` is a plain (HTML) added token.
        let special = tok.get_added_tokens_decoder();
        let is_special = |id: &u32| special.get(id).is_some_and(|t| t.special);
        let texts = super::EOG_TEXTS.iter().chain(&["</s>"]);
        eos_ids.extend(texts.filter_map(|t| tok.token_to_id(t)).filter(is_special));
    }
    let eos = cfg.eos.or_else(|| eos_ids.first().copied());
    // A template that is only the BOS says nothing of EOS.
    let only_bos = template.len() == 1 && add_bos;
    let add_eos = cfg.add_eos.unwrap_or_else(|| eos.is_some() && template.last() == eos.as_ref() && !only_bos);
    let specials = Specials::new(bos, eos, eos_ids, add_bos, add_eos, vocab_size)?;
    Ok((tok, specials, vocab_size))
}

/// `add_bos_token`, `add_eos_token`, `bos_token`, `eos_token` (a string, `{"content": ..}` or null).
fn read_tokenizer_config(path: &Path, tok: &tokenizers::Tokenizer, cfg: &mut HfConfig) -> TokenizerResult<()> {
    let json = parse_json(path)?;
    let wrong = |field: &str, want: &str| TokenizerError::Json {
        path: path.to_path_buf(),
        message: format!("`{field}` must be {want}"),
    };
    for (field, slot) in [("add_bos_token", &mut cfg.add_bos), ("add_eos_token", &mut cfg.add_eos)] {
        match json.get(field) {
            None | Some(Value::Null) => {}
            Some(v) => *slot = Some(v.as_bool().ok_or_else(|| wrong(field, "true or false"))?),
        }
    }
    for (field, slot) in [("bos_token", &mut cfg.bos), ("eos_token", &mut cfg.eos)] {
        let text = match json.get(field) {
            None | Some(Value::Null) => continue,
            Some(Value::String(s)) => s.as_str(),
            Some(Value::Object(o)) => match o.get("content") {
                Some(Value::String(s)) => s.as_str(),
                _ => return Err(wrong(field, "a string or an object with a string `content`")),
            },
            Some(_) => return Err(wrong(field, "a string or an object with a string `content`")),
        };
        let id = tok.token_to_id(text).ok_or_else(|| TokenizerError::SpecialNotInVocab {
            path: path.to_path_buf(),
            field,
            text: text.to_string(),
        })?;
        *slot = Some(id);
    }
    cfg.eos_ids.extend(cfg.eos);
    Ok(())
}

/// `eos_token_id` (an id or a list of ids) and `bos_token_id`.
fn read_generation_config(path: &Path, cfg: &mut HfConfig) -> TokenizerResult<()> {
    let json = parse_json(path)?;
    let id = |v: &Value, field: &str| {
        v.as_u64().and_then(|i| u32::try_from(i).ok()).ok_or_else(|| TokenizerError::Json {
            path: path.to_path_buf(),
            message: format!("`{field}` must be a token id or a list of token ids, not {v}"),
        })
    };
    match json.get("eos_token_id") {
        None | Some(Value::Null) => {}
        Some(Value::Array(ids)) => {
            for v in ids {
                let i = id(v, "eos_token_id")?;
                if !cfg.eos_ids.contains(&i) {
                    cfg.eos_ids.push(i);
                }
            }
        }
        Some(v) => {
            let i = id(v, "eos_token_id")?;
            if !cfg.eos_ids.contains(&i) {
                cfg.eos_ids.push(i);
            }
        }
    }
    if cfg.bos.is_none() {
        if let Some(v) = json.get("bos_token_id").filter(|v| !v.is_null()) {
            cfg.bos = Some(id(v, "bos_token_id")?);
        }
    }
    Ok(())
}
