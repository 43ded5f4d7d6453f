//! What GGUF vocabularies share, whatever their model: token types, the checks of the per-token
//! arrays and of the special ids, and llama.cpp's end-of-generation tokens found by text.

use ahash::AHashMap;

use super::error::{TokenizerError, TokenizerResult};

/// The type of a token, GGUF's `tokenizer.ggml.token_type` (gguf-py's `TokenType`, llama.cpp's
/// `llama_token_type`; SentencePiece's `ModelProto.SentencePiece.Type` plus undefined).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 0: no type; decodes to nothing (llama.cpp's `LLAMA_TOKEN_ATTR_UNDEFINED`).
    Undefined,
    /// 1: an ordinary piece of text.
    Normal,
    /// 2: the unknown token (`<unk>`); special.
    Unknown,
    /// 3: a control token (`<bos>`, `<eos>`, `<start_of_turn>`); special.
    Control,
    /// 4: a user-defined token, matched as a whole in the text before the model splits it.
    UserDefined,
    /// 5: a reserved, unused slot; decodes to nothing.
    Unused,
    /// 6: a byte `<0xXX>`, SentencePiece's byte fallback.
    Byte,
}

impl TokenType {
    /// The type of GGUF's integer code, `None` outside 0..=6.
    pub fn from_gguf(code: i32) -> Option<Self> {
        Some(match code {
            0 => Self::Undefined,
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }

    /// Control and unknown tokens: what `skip_special` leaves out of decoded text and what
    /// llama.cpp only matches in text when it parses special tokens (`attr_special` of
    /// `llama_vocab::impl::token_to_piece`).
    pub fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// The texts llama.cpp treats as end of generation whatever the metadata says
/// (`llama_vocab::impl::load`, `special_eog_ids`), less those it only keeps under per-model
/// workarounds (gpt-oss's `<|return|>`/`<|call|>`, Solar's `<|flush|>`/`<|calls|>`, Gemma 4's
/// `<turn|>`/`<|tool_response>`, MiniMax's `[e~[`) and less `</s>` (PaddleOCR's there), which
/// Gemma 3's vocabulary holds as a user-defined HTML tag (strikethrough's end): generation must
/// not stop at it. Where `</s>` is the EOS (Llama 2), `tokenizer.ggml.eos_token_id` names it.
pub const EOG_TEXTS: [&str; 14] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// The ids of `tokens` whose text is one of [`EOG_TEXTS`], in id order: the end-of-generation
/// tokens llama.cpp adds to the EOS of a GGUF vocabulary (Gemma's `<end_of_turn>`, Llama 3's
/// `<|eot_id|>`, Qwen's `<|im_end|>`).
pub fn eog_ids_by_text(tokens: &[String]) -> Vec<u32> {
    tokens.iter().zip(0u32..).filter(|(t, _)| EOG_TEXTS.contains(&t.as_str())).map(|(_, id)| id).collect()
}

/// The checked types of a vocabulary: `codes` parallel to `tokens`, or empty (the GGUF key is
/// absent: every token normal, as llama.cpp).
pub(crate) fn token_types(tokens: &[String], codes: &[i32]) -> TokenizerResult<Vec<TokenType>> {
    if codes.is_empty() {
        return Ok(vec![TokenType::Normal; tokens.len()]);
    }
    check_len("tokenizer.ggml.token_type", tokens.len(), codes.len())?;
    tokens
        .iter()
        .zip(codes)
        .zip(0u32..)
        .map(|((text, &value), id)| {
            TokenType::from_gguf(value).ok_or_else(|| TokenizerError::BadTokenType { id, text: text.clone(), value })
        })
        .collect()
}

/// Errs when a per-token array's length `got` is not the number of tokens.
pub(crate) fn check_len(field: &'static str, expected: usize, got: usize) -> TokenizerResult<()> {
    if expected == got {
        Ok(())
    } else {
        Err(TokenizerError::LengthMismatch { field, expected, got })
    }
}

/// Text → id of every non-empty token (an empty token can never be matched; llama.cpp renames
/// it), erring on a text held by two ids.
pub(crate) fn piece_map(tokens: &[String]) -> TokenizerResult<AHashMap<Box<str>, u32>> {
    if tokens.is_empty() {
        return Err(TokenizerError::EmptyVocab);
    }
    let mut map = AHashMap::with_capacity(tokens.len());
    for (text, id) in tokens.iter().zip(0u32..) {
        if text.is_empty() {
            continue;
        }
        if let Some(first) = map.insert(Box::<str>::from(text.as_str()), id) {
            return Err(TokenizerError::DuplicateToken { text: text.clone(), first, second: id });
        }
    }
    Ok(map)
}

/// Errs when a special id is outside the vocabulary.
pub(crate) fn check_id(name: &'static str, id: Option<u32>, vocab_size: usize) -> TokenizerResult<()> {
    match id {
        Some(id) if id as usize >= vocab_size => Err(TokenizerError::SpecialIdOutOfRange { name, id, vocab_size }),
        _ => Ok(()),
    }
}

/// The special tokens of a vocabulary and what encode does with them, checked against its size.
#[derive(Clone, Debug)]
pub(crate) struct Specials {
    /// The BOS id, prepended when `add_bos`.
    pub bos: Option<u32>,
    /// The EOS id, appended when `add_eos`.
    pub eos: Option<u32>,
    /// Every end-of-generation id (EOS first), without repeats.
    pub eos_ids: Vec<u32>,
    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub add_bos: bool,
    /// Whether `encode(.., add_special = true)` appends EOS.
    pub add_eos: bool,
}

impl Specials {
    /// Checks every id against `vocab_size` and the flags against the ids; `eos_ids` gets `eos`
    /// first, then `more` in order, each once.
    pub fn new(
        bos: Option<u32>,
        eos: Option<u32>,
        more: impl IntoIterator<Item = u32>,
        add_bos: bool,
        add_eos: bool,
        vocab_size: usize,
    ) -> TokenizerResult<Self> {
        check_id("BOS", bos, vocab_size)?;
        check_id("EOS", eos, vocab_size)?;
        let mut eos_ids: Vec<u32> = eos.into_iter().collect();
        for id in more {
            check_id("end-of-generation", Some(id), vocab_size)?;
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        if add_bos && bos.is_none() {
            return Err(TokenizerError::MissingSpecial { name: "BOS", key: "bos", flag: "add_bos" });
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::MissingSpecial { name: "EOS", key: "eos", flag: "add_eos" });
        }
        Ok(Self { bos, eos, eos_ids, add_bos, add_eos })
    }
}
