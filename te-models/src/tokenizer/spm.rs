//! SentencePiece vocabularies as GGUF holds them (`tokenizer.ggml.model = "llama"`: Llama 1/2,
//! Mistral, Gemma), tokenized as llama.cpp does (src/llama-vocab.cpp, `llm_tokenizer_spm_session`,
//! itself SentencePiece's BPE encoder): spaces become U+2581 (▁), the text is split into UTF-8
//! characters, then the adjacent pair whose concatenation is a token of the highest score is
//! merged, again and again (ties: the leftmost pair), and a piece that is no token falls back to
//! its bytes `<0xXX>`.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use ahash::{AHashMap, AHashSet};

use super::error::{TokenizerError, TokenizerResult};
use super::pieces::Pieces;
use super::specials::{Fragment, SpecialMatcher};
use super::vocab::{self, Specials, TokenType};

/// SentencePiece's whitespace mark, U+2581 (▁), which stands for a space in the pieces.
pub const SPACE_MARK: char = '\u{2581}';

/// A SentencePiece vocabulary as plain vectors, what GGUF metadata holds (`tokenizer.ggml.*`);
/// [`Tokenizer::from_spm`](super::Tokenizer::from_spm) checks and indexes it.
///
/// The flags are `Option`s so that an absent GGUF key keeps llama.cpp's default for this model
/// type (`llama_vocab::impl::load`): `add_bos` true, `add_eos` false, `add_space_prefix` true.
/// Gemma's GGUFs set `tokenizer.ggml.add_space_prefix = false` (no space is prepended:
/// "The" is one token).
#[derive(Clone, Debug, Default)]
pub struct SpmVocab {
    /// `tokenizer.ggml.tokens`: the text of each token, the id is the index.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: one per token, higher merges first; empty when the key is absent
    /// (every score 0, as llama.cpp).
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.token_type`: GGUF codes (see [`TokenType`]), one per token; empty when the
    /// key is absent (every token normal).
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.bos_token_id`.
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub eos: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`: emitted for a character with neither a token nor byte
    /// tokens; `None` takes the first token of type unknown, if any.
    pub unk: Option<u32>,
    /// More end-of-generation ids (`tokenizer.ggml.eot_token_id`, `eom_token_id`); the tokens
    /// whose text llama.cpp treats as end of generation ([`eog_ids_by_text`](super::eog_ids_by_text))
    /// are added by the constructor.
    pub eog: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token` (`None`: true).
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token` (`None`: false).
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix` (`None`: true): prepend a space to the text (and to text
    /// after a special token), SentencePiece's `add_dummy_prefix`.
    pub add_space_prefix: Option<bool>,
}

/// A checked, indexed SentencePiece vocabulary.
#[derive(Debug, Clone)]
pub(crate) struct SpmModel {
    tokens: Vec<String>,
    pieces: AHashMap<Box<str>, u32>,
    /// Every pair of adjacent characters inside a token: where two characters of the text are
    /// no such pair, no merge can ever cross between them, so the text is tokenized in
    /// independent runs there (the same result as one session over all of it, with small queues).
    bigrams: AHashSet<u64>,
    scores: Vec<f32>,
    /// What each token decodes to (llama.cpp's `token_to_piece`): normal tokens with ▁ as spaces,
    /// byte tokens their byte, special and user-defined tokens their text, unused nothing.
    pieces_out: Pieces,
    /// The token `<0xXX>` of each byte, for the fallback.
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    matcher: Option<SpecialMatcher>,
    add_space_prefix: bool,
}

impl SpmModel {
    /// Checks and indexes `v`; returns the model and its special tokens.
    pub fn new(v: SpmVocab) -> TokenizerResult<(Self, Specials)> {
        let pieces = vocab::piece_map(&v.tokens)?;
        let mut bigrams = AHashSet::new();
        for t in &v.tokens {
            bigrams.extend(t.chars().zip(t.chars().skip(1)).map(|(a, b)| char_pair(a, b)));
        }
        let types = vocab::token_types(&v.tokens, &v.token_types)?;
        let n = v.tokens.len();
        let scores = if v.scores.is_empty() { vec![0.0; n] } else { v.scores };
        vocab::check_len("tokenizer.ggml.scores", n, scores.len())?;
        if let Some((id, text)) =
            scores.iter().zip(0u32..).zip(&v.tokens).find(|((s, _), _)| s.is_nan()).map(|((_, id), t)| (id, t))
        {
            return Err(TokenizerError::NanScore { id, text: text.clone() });
        }
        let mut byte_ids = [None; 256];
        for (b, slot) in (0u8..=255).zip(byte_ids.iter_mut()) {
            // llama_vocab::byte_to_token: `<0xXX>`, upper-case hex. (Its second try, the byte as
            // a one-character token, never applies here: only a character that is no token falls
            // back, and an ASCII character that is no token has no such token either.)
            *slot = pieces.get(format!("<0x{b:02X}>").as_str()).copied();
        }
        vocab::check_id("unknown", v.unk, n)?;
        let unk = v.unk.or_else(|| types.iter().position(|&t| t == TokenType::Unknown).map(|i| i as u32));
        let matcher = SpecialMatcher::new(
            v.tokens
                .iter()
                .zip(&types)
                .zip(0u32..)
                .filter(|((_, t), _)| matches!(t, TokenType::Control | TokenType::Unknown | TokenType::UserDefined))
                .map(|((text, _), id)| (id, text.as_str()))
                .collect(),
        )?;
        let eog = v.eog.iter().copied().chain(vocab::eog_ids_by_text(&v.tokens));
        let specials = Specials::new(v.bos, v.eos, eog, v.add_bos.unwrap_or(true), v.add_eos.unwrap_or(false), n)?;
        let add_space_prefix = v.add_space_prefix.unwrap_or(true);
        let pieces_out = Pieces::new(&v.tokens, types, add_space_prefix, decode_piece)?;
        let model =
            Self { tokens: v.tokens, pieces, bigrams, scores, pieces_out, byte_ids, unk, matcher, add_space_prefix };
        Ok((model, specials))
    }

    /// The number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The id of a token's text.
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.pieces.get(text).copied()
    }

    /// The text of a token.
    pub fn id_to_token(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// What each token decodes to.
    pub fn pieces(&self) -> &Pieces {
        &self.pieces_out
    }

    /// What a Hugging Face export needs: the tokens, their scores and types, the unknown token
    /// and whether a space is prefixed.
    pub fn export_view(&self) -> (&[String], &[f32], &[TokenType], Option<u32>, bool) {
        (&self.tokens, &self.scores, self.pieces_out.types(), self.unk, self.add_space_prefix)
    }

    /// The ids of `text`, special tokens matched first, no BOS/EOS (llama.cpp's
    /// `llama_vocab::impl::tokenize`, the SPM case, with `parse_special`).
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> TokenizerResult<()> {
        let fragments = match &self.matcher {
            Some(m) => m.split(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Fragment::Text(text)],
        };
        // llama.cpp prefixes a space at the start and after every special token.
        let mut after_special = true;
        let mut escaped = String::new();
        let mut scratch = Scratch::default();
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    escaped.clear();
                    if self.add_space_prefix && after_special {
                        escaped.push(SPACE_MARK);
                    }
                    escaped.extend(t.chars().map(|c| if c == ' ' { SPACE_MARK } else { c }));
                    self.encode_fragment(&escaped, out, &mut scratch)?;
                    after_special = false;
                }
            }
        }
        Ok(())
    }

    /// One escaped fragment, cut where no merge can cross, each run through [`Self::session`].
    fn encode_fragment(&self, text: &str, out: &mut Vec<u32>, scratch: &mut Scratch) -> TokenizerResult<()> {
        let mut start = 0;
        let mut prev = None;
        for (at, c) in text.char_indices() {
            if prev.is_some_and(|p| !self.bigrams.contains(&char_pair(p, c))) {
                self.session(&text[start..at], out, scratch)?;
                start = at;
            }
            prev = Some(c);
        }
        if start < text.len() {
            self.session(&text[start..], out, scratch)?;
        }
        Ok(())
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` of one escaped run of text.
    fn session(&self, text: &str, out: &mut Vec<u32>, scratch: &mut Scratch) -> TokenizerResult<()> {
        let Scratch { symbols, queue } = scratch;
        symbols.clear();
        queue.clear();
        symbols.extend(text.char_indices().map(|(start, c)| Symbol {
            start,
            end: start + c.len_utf8(),
            prev: NONE,
            next: NONE,
        }));
        let n = symbols.len();
        for (i, s) in symbols.iter_mut().enumerate() {
            s.prev = if i == 0 { NONE } else { i - 1 };
            s.next = if i + 1 == n { NONE } else { i + 1 };
        }
        for i in 1..n {
            self.push_pair(queue, symbols, text, i - 1);
        }
        while let Some(pair) = queue.pop() {
            let l = pair.left;
            let r = symbols[l].next;
            // Stale: the left symbol was merged away, or one side grew since the pair was
            // queued (a symbol only grows by taking its right neighbour, so the sum of the two
            // lengths changes whenever either side changed; llama.cpp's check).
            if symbols[l].is_empty() || r == NONE || symbols[l].len() + symbols[r].len() != pair.len as usize {
                continue;
            }
            symbols[l].end = symbols[r].end;
            symbols[r].end = symbols[r].start;
            let after = symbols[r].next;
            symbols[l].next = after;
            if let Some(next) = symbols.get_mut(after) {
                next.prev = l;
            }
            let prev = symbols[l].prev;
            if prev != NONE {
                self.push_pair(queue, symbols, text, prev);
            }
            self.push_pair(queue, symbols, text, l);
        }
        let mut i = if n == 0 { NONE } else { 0 };
        while let Some(s) = symbols.get(i) {
            self.emit(&text[s.start..s.end], out)?;
            i = s.next;
        }
        Ok(())
    }

    /// Queues the pair of symbol `left` and its right neighbour when their concatenation is a
    /// token (llama.cpp's `try_add_bigram`: any token, whatever its type).
    fn push_pair(&self, queue: &mut BinaryHeap<Pair>, symbols: &[Symbol], text: &str, left: usize) {
        let l = &symbols[left];
        let Some(r) = symbols.get(l.next) else { return };
        let joined = &text[l.start..r.end];
        if let Some(&id) = self.pieces.get(joined) {
            // A token longer than 4 GiB cannot exist; saturating keeps the pair stale if it did.
            let len = u32::try_from(joined.len()).unwrap_or(u32::MAX);
            queue.push(Pair { score: self.scores[id as usize], len, left });
        }
    }

    /// The token of one final symbol: itself, else its bytes, else the unknown token (llama.cpp's
    /// `resegment`; a merged symbol is always a token, so only single characters fall back).
    fn emit(&self, piece: &str, out: &mut Vec<u32>) -> TokenizerResult<()> {
        if let Some(&id) = self.pieces.get(piece) {
            out.push(id);
            return Ok(());
        }
        let bytes: Option<Vec<u32>> = piece.bytes().map(|b| self.byte_ids[b as usize]).collect();
        match (bytes, self.unk) {
            (Some(ids), _) => out.extend(ids),
            (None, Some(unk)) => out.push(unk),
            (None, None) => return Err(TokenizerError::Unencodable { text: piece.replace(SPACE_MARK, " ") }),
        }
        Ok(())
    }
}

/// What token `id` of text `text` and type `ty` decodes to (llama.cpp's `token_to_piece`, SPM).
fn decode_piece(id: u32, text: &str, ty: TokenType) -> TokenizerResult<Box<[u8]>> {
    Ok(match ty {
        TokenType::Normal => text.replace(SPACE_MARK, " ").into_bytes().into(),
        TokenType::Control | TokenType::Unknown | TokenType::UserDefined => text.as_bytes().into(),
        TokenType::Byte => {
            // llama_vocab::impl::token_to_byte: the hex digits of `<0xXX>`.
            let byte = text
                .strip_prefix("<0x")
                .and_then(|t| t.strip_suffix('>'))
                .filter(|h| h.len() == 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| TokenizerError::BadByteToken { id, text: text.to_string() })?;
            Box::new([byte])
        }
        TokenType::Unused | TokenType::Undefined => Box::new([]),
    })
}

const NONE: usize = usize::MAX;

/// A run of the text, linked to its neighbours (llama.cpp's `llm_symbol`); empty once merged
/// into its left neighbour.
#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    end: usize,
    prev: usize,
    next: usize,
}

impl Symbol {
    fn len(&self) -> usize {
        self.end - self.start
    }

    fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// A candidate merge (llama.cpp's `llm_bigram_spm`) of symbol `left` and its right neighbour,
/// `len` bytes together when queued: the highest score first, then the leftmost.
#[derive(Debug, Clone, Copy)]
struct Pair {
    score: f32,
    len: u32,
    left: usize,
}

/// The buffers of [`SpmModel::session`], reused across the runs of one encode.
#[derive(Debug, Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Pair>,
}

/// Two characters as one key.
fn char_pair(a: char, b: char) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

impl Ord for Pair {
    fn cmp(&self, other: &Self) -> Ordering {
        // Scores are never NaN (checked at load); -0.0 and 0.0 tie, as in C++.
        match self.score.partial_cmp(&other.score) {
            Some(Ordering::Equal) | None => other.left.cmp(&self.left),
            Some(o) => o,
        }
    }
}

impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Pair {}
