//! GGUF's byte-level BPE vocabularies (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen 2/2.5/3,
//! GPT-2), built into the `tokenizers` crate's BPE model: the token list as its vocabulary, the
//! merges in rank order, control and user-defined tokens as added tokens, and the pre-tokenizer
//! llama.cpp picks from `tokenizer.ggml.pre` (src/llama-vocab.cpp, `llm_tokenizer_bpe`: its regexes
//! split the text, each in turn, keeping matches and the text between them; then every byte is
//! mapped to GPT-2's printable alphabet, `ByteLevel`). Decoding is llama.cpp's `token_to_piece`:
//! normal tokens back from the alphabet to their bytes, control and user-defined tokens their text
//! as it is (the `tokenizers` crate would push those through the alphabet too, turning a
//! user-defined "ü" into the byte 0xFC), byte and unused tokens nothing; a character outside the
//! alphabet keeps its UTF-8 bytes (llama.cpp writes `[UNK_BYTE_0x..]`). llama.cpp's
//! `clean_spaces` post-pass of `detokenize` (" ." → ".") is not applied, as Hugging Face's
//! `tokenizers` does not.

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use super::error::{TokenizerError, TokenizerResult};
use super::pieces::Pieces;
use super::vocab::{self, Specials, TokenType};

/// A byte-level BPE vocabulary as plain vectors, what GGUF metadata holds (`tokenizer.ggml.*`);
/// [`Tokenizer::from_bpe`](super::Tokenizer::from_bpe) builds it. Absent flags keep llama.cpp's
/// defaults: `add_bos` true for the Llama 3 pre-tokenizers, false otherwise; `add_eos` false.
#[derive(Clone, Debug, Default)]
pub struct BpeVocab {
    /// `tokenizer.ggml.tokens`: byte-level texts (`Ġthe` for " the"), the id is the index.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type` (GGUF codes, see [`TokenType`]); empty: every token normal.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: `"left right"`, highest priority first.
    pub merges: Vec<String>,
    /// `tokenizer.ggml.pre`: the pre-tokenizer (`llama-bpe`, `qwen2`, `gpt-2`, ...); `None` is
    /// llama.cpp's `default`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// More end-of-generation ids (`eot_token_id`, `eom_token_id`); the texts of
    /// [`EOG_TEXTS`](super::EOG_TEXTS) are added by the constructor.
    pub eog: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`.
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`.
    pub add_eos: Option<bool>,
}

/// GPT-2's pattern (llama.cpp `LLAMA_VOCAB_PRE_TYPE_GPT2`).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's pattern (its tokenizer.json; llama.cpp `LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's pattern: Llama 3's with single digits (llama.cpp `LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regexes (applied in turn), `ignore_merges` and the default `add_bos` of a
/// `tokenizer.ggml.pre` value (llama.cpp's `llama_vocab::impl::load` and `llm_tokenizer_bpe`).
fn pre_tokenizer(pre: Option<&str>) -> TokenizerResult<(Vec<&'static str>, bool, bool)> {
    Ok(match pre.unwrap_or("default") {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "dbrx" | "smaug-bpe" => (vec![LLAMA3], true, true),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" => (vec![QWEN2], false, false),
        "gpt-2" | "phi-2" | "roberta-bpe" | "mpt" | "olmo" | "jais" | "jina-es" | "jina-de" | "gigachat"
        | "jina-v1-en" | "jina-v2-es" | "jina-v2-de" | "jina-v2-code" => (vec![GPT2], false, false),
        "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" => {
            (vec![r"\p{N}", GPT2], false, false)
        }
        "falcon" => (vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], false, false),
        "deepseek-coder" => (vec!["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[一-龥ࠀ-一가-퟿]+", r"\p{N}"], false, false),
        "default" => (
            vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            false,
            false,
        ),
        other => {
            return Err(TokenizerError::Unsupported {
                message: format!(
                    "GGUF `tokenizer.ggml.pre` {other:?} (BPE pre-tokenizer); supported: llama-bpe/llama3, qwen2, gpt-2, starcoder, falcon, deepseek-coder, their aliases and default"
                ),
            })
        }
    })
}

/// Builds the `tokenizers` BPE of `v` (for encoding), its pieces (for decoding) and its special
/// tokens.
pub(crate) fn build(v: BpeVocab) -> TokenizerResult<(tokenizers::Tokenizer, Pieces, Specials)> {
    vocab::piece_map(&v.tokens)?;
    let types = vocab::token_types(&v.tokens, &v.token_types)?;
    let (regexes, ignore_merges, default_add_bos) = pre_tokenizer(v.pre.as_deref())?;
    let hf = |e: Box<dyn std::error::Error + Send + Sync>| TokenizerError::Hf { message: e.to_string() };

    let merges: Merges = v
        .merges
        .iter()
        .enumerate()
        .map(|(index, m)| {
            // llama.cpp splits at the first space after the first byte.
            m.char_indices()
                .skip(1)
                .find(|&(_, c)| c == ' ')
                .map(|(at, _)| (m[..at].to_string(), m[at + 1..].to_string()))
                .filter(|(_, r)| !r.is_empty())
                .ok_or_else(|| TokenizerError::BadMerge { index, merge: m.clone() })
        })
        .collect::<TokenizerResult<_>>()?;
    let vocab: Vocab = v.tokens.iter().cloned().zip(0u32..).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).ignore_merges(ignore_merges).build().map_err(hf)?;

    let mut steps = regexes
        .iter()
        .map(|r| {
            Split::new(SplitPattern::Regex((*r).to_string()), SplitDelimiterBehavior::Isolated, false)
                .map(PreTokenizerWrapper::from)
                .map_err(hf)
        })
        .collect::<TokenizerResult<Vec<_>>>()?;
    steps.push(ByteLevel::new(false, true, false).into());

    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(Sequence::new(steps))).with_decoder(Some(ByteLevelDecoder::default()));
    // Control tokens are special (skipped by `skip_special`), user-defined ones are plain text;
    // both are matched whole before the pre-tokenizer, as llama.cpp's tokenizer_st_partition.
    let added: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(&types)
        .filter(|(t, ty)| {
            !t.is_empty() && matches!(ty, TokenType::Control | TokenType::Unknown | TokenType::UserDefined)
        })
        .map(|(t, ty)| AddedToken::from(t.clone(), ty.is_special()))
        .collect();
    tok.add_tokens(&added);

    let eog = v.eog.iter().copied().chain(vocab::eog_ids_by_text(&v.tokens));
    let specials = Specials::new(
        v.bos,
        v.eos,
        eog,
        v.add_bos.unwrap_or(default_add_bos),
        v.add_eos.unwrap_or(false),
        v.tokens.len(),
    )?;
    let alphabet = byte_alphabet();
    let pieces = Pieces::new(&v.tokens, types, false, |_, text, ty| {
        Ok(match ty {
            TokenType::Normal => byte_level_bytes(&alphabet, text).into(),
            TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().into(),
            TokenType::Byte | TokenType::Unused | TokenType::Undefined => Box::new([]),
        })
    })?;
    Ok((tok, pieces, specials))
}

/// GPT-2's `bytes_to_unicode` inverted: the byte of each character code of the alphabet
/// (printable Latin-1 stands for itself, U+0100 onwards for the other bytes in order).
fn byte_alphabet() -> Vec<Option<u8>> {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut table = vec![None; 256];
    for b in 0..=255u8 {
        if printable(b) {
            table[usize::from(b)] = Some(b);
        } else {
            table.push(Some(b));
        }
    }
    table
}

/// The bytes of a byte-level text: each character of the alphabet is one byte, any other
/// character its own UTF-8.
fn byte_level_bytes(alphabet: &[Option<u8>], text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match alphabet.get(c as usize).copied().flatten() {
            Some(b) => out.push(b),
            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
        }
    }
    out
}
