//! Tokenizers of decoder LLMs: text ↔ token ids for the models imported from Hugging Face
//! directories and GGUF files (Llama, Qwen, Gemma 3), behind one [`Tokenizer`].
//!
//! Sources:
//! - **Hugging Face** ([`Tokenizer::from_hf_dir`], [`Tokenizer::from_hf_files`]): `tokenizer.json`
//!   through the `tokenizers` crate, the BOS/EOS flags and ids from `tokenizer_config.json` and
//!   `generation_config.json` when present (module `hf`).
//! - **GGUF SentencePiece** (`tokenizer.ggml.model = "llama"`: Llama 2, Gemma; [`Tokenizer::from_spm`]
//!   of an [`SpmVocab`]): this crate's implementation of llama.cpp's SPM tokenizer
//!   (src/llama-vocab.cpp, `llm_tokenizer_spm_session`): special and user-defined tokens matched
//!   whole first (`tokenizer_st_partition`), spaces as U+2581, the best-scoring adjacent pair
//!   merged first (ties: leftmost) through a priority queue, byte-token fallback; the text is cut
//!   where no token can span two characters, so each queue stays small. Hugging Face's own GGUF
//!   conversion is not used (it drops Gemma 3's BOS and splits words).
//! - **GGUF byte-level BPE** (`tokenizer.ggml.model = "gpt2"`: Llama 3, Qwen; [`Tokenizer::from_bpe`]
//!   of a [`BpeVocab`]): the `tokenizers` crate's BPE model from the tokens and merges, with the
//!   pre-tokenizer regexes llama.cpp picks from `tokenizer.ggml.pre`, for encoding; decoding by
//!   llama.cpp's `token_to_piece` rules (user-defined tokens as their text).
//!
//! Checked against llama.cpp's own fixtures (`models/ggml-vocab-*.gguf` with their `.inp`/`.out`:
//! Llama 2 and Phi-3 SentencePiece, GPT-2, MPT, StarCoder, Refact, Falcon, DeepSeek Coder BPE; all
//! 46 texts of each give llama.cpp's ids and decode back) when `TE_LLAMA_CPP_VOCABS` names a
//! directory holding them, and against Gemma 3 270M's GGUF when `.data/` holds it
//! (`scripts/fill-gemma`): "The capital of France is" → `[2, 818, 5279, 529, 7001, 563]`.
//!
//! Export ([`Tokenizer::to_hf_files`], module `export`): any of them as the `tokenizer.json` and
//! `tokenizer_config.json` of a Hugging Face directory; a GGUF SentencePiece vocabulary becomes
//! the byte-fallback BPE Hugging Face writes for Gemma and Llama 2, merges derived from the scores.
//!
//! Encoding ([`Tokenizer::encode`]) always matches special tokens written in the text (`<bos>`,
//! `<start_of_turn>`: Hugging Face's `encode` and llama.cpp's `parse_special`), so chat templates
//! are plain text; `add_special` adds BOS/EOS as the vocabulary's flags ask. Decoding concatenates
//! the pieces (▁ → space, byte tokens reassembled into UTF-8, lossy only at invalid sequences),
//! leaving control tokens out when `skip_special`; [`DecodeStream`] does it token by token.

mod bpe;
mod error;
mod export;
mod gguf;
mod hf;
mod pieces;
mod specials;
mod spm;
mod stream;
mod vocab;

#[cfg(test)]
mod tests;

pub use bpe::BpeVocab;
pub use error::{TokenizerError, TokenizerResult};
pub use export::HfTokenizerExtras;
pub use spm::{SpmVocab, SPACE_MARK};
pub use stream::DecodeStream;
pub use vocab::{eog_ids_by_text, TokenType, EOG_TEXTS};

use std::path::Path;

use pieces::Pieces;
use spm::SpmModel;
use vocab::Specials;

/// A tokenizer of a decoder LLM: encode text to ids, decode ids to text, its BOS and EOS ids.
/// Build it once (building indexes the vocabulary) and share it by reference: it is `Send + Sync`.
pub struct Tokenizer {
    backend: Backend,
    specials: Specials,
    vocab_size: usize,
}

enum Backend {
    /// GGUF SentencePiece: this module's encoder and pieces.
    Spm(Box<SpmModel>),
    /// GGUF byte-level BPE: the `tokenizers` crate encodes, the pieces decode.
    GgufBpe(Box<tokenizers::Tokenizer>, Box<Pieces>),
    /// Hugging Face `tokenizer.json`: the `tokenizers` crate both ways.
    Hf(Box<tokenizers::Tokenizer>),
}

/// What decodes a backend's ids.
enum Decoder<'a> {
    /// The pieces of a GGUF vocabulary.
    Pieces(&'a Pieces),
    /// The `tokenizers` crate's decoder of a `tokenizer.json`.
    Hf(&'a tokenizers::Tokenizer),
}

impl Backend {
    fn decoder(&self) -> Decoder<'_> {
        match self {
            Backend::Spm(m) => Decoder::Pieces(m.pieces()),
            Backend::GgufBpe(_, p) => Decoder::Pieces(p),
            Backend::Hf(t) => Decoder::Hf(t),
        }
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Spm(_) => "GGUF SentencePiece (llama.cpp's SPM)",
            Backend::GgufBpe(..) => "GGUF byte-level BPE",
            Backend::Hf(_) => "Hugging Face tokenizer.json",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size)
            .field("bos", &self.specials.bos)
            .field("eos_ids", &self.specials.eos_ids)
            .field("add_bos", &self.specials.add_bos)
            .field("add_eos", &self.specials.add_eos)
            .finish()
    }
}

impl Tokenizer {
    /// A SentencePiece tokenizer of GGUF metadata (`tokenizer.ggml.model = "llama"`).
    ///
    /// # Errors
    /// [`TokenizerError::EmptyVocab`], [`TokenizerError::LengthMismatch`] (scores or types not
    /// one per token), [`TokenizerError::BadTokenType`], [`TokenizerError::NanScore`],
    /// [`TokenizerError::DuplicateToken`], [`TokenizerError::BadByteToken`],
    /// [`TokenizerError::SpecialIdOutOfRange`], [`TokenizerError::MissingSpecial`] (`add_bos`
    /// without a BOS id).
    pub fn from_spm(vocab: SpmVocab) -> TokenizerResult<Self> {
        let (model, specials) = SpmModel::new(vocab)?;
        let vocab_size = model.vocab_size();
        Ok(Self { backend: Backend::Spm(Box::new(model)), specials, vocab_size })
    }

    /// A byte-level BPE tokenizer of GGUF metadata (`tokenizer.ggml.model = "gpt2"`).
    ///
    /// # Errors
    /// As [`Tokenizer::from_spm`]; [`TokenizerError::BadMerge`]; [`TokenizerError::Unsupported`]
    /// for a `tokenizer.ggml.pre` without a known pre-tokenizer; [`TokenizerError::Hf`] when the
    /// `tokenizers` crate refuses the merges (a merge of tokens not in the vocabulary).
    pub fn from_bpe(vocab: BpeVocab) -> TokenizerResult<Self> {
        let vocab_size = vocab.tokens.len();
        let (tok, pieces, specials) = bpe::build(vocab)?;
        Ok(Self { backend: Backend::GgufBpe(Box::new(tok), Box::new(pieces)), specials, vocab_size })
    }

    /// The tokenizer of a Hugging Face model directory: `tokenizer.json`, with
    /// `tokenizer_config.json` and `generation_config.json` when they exist.
    ///
    /// # Errors
    /// As [`Tokenizer::from_hf_files`].
    pub fn from_hf_dir(dir: &Path) -> TokenizerResult<Self> {
        let optional = |name: &str| Some(dir.join(name)).filter(|p| p.exists());
        let (config, generation) = (optional("tokenizer_config.json"), optional("generation_config.json"));
        Self::from_hf_files(&dir.join("tokenizer.json"), config.as_deref(), generation.as_deref())
    }

    /// The tokenizer of a `tokenizer.json`, its flags and special tokens from the configuration
    /// files given (see the `hf` module's rules when they are absent).
    ///
    /// # Errors
    /// [`TokenizerError::MissingFile`], [`TokenizerError::Io`]; [`TokenizerError::HfLoad`] for a
    /// `tokenizer.json` the `tokenizers` crate refuses; [`TokenizerError::Json`] for malformed
    /// configuration files or fields of the wrong type; [`TokenizerError::SpecialNotInVocab`],
    /// [`TokenizerError::SpecialIdOutOfRange`], [`TokenizerError::MissingSpecial`].
    pub fn from_hf_files(
        tokenizer_json: &Path,
        tokenizer_config: Option<&Path>,
        generation_config: Option<&Path>,
    ) -> TokenizerResult<Self> {
        let (tok, specials, vocab_size) = hf::load(tokenizer_json, tokenizer_config, generation_config)?;
        Ok(Self { backend: Backend::Hf(Box::new(tok)), specials, vocab_size })
    }

    /// Adds end-of-generation ids (e.g. a chat model's end-of-turn token) to [`Tokenizer::eos_ids`].
    ///
    /// # Errors
    /// [`TokenizerError::SpecialIdOutOfRange`].
    pub fn with_eos_ids(mut self, ids: &[u32]) -> TokenizerResult<Self> {
        for &id in ids {
            vocab::check_id("end-of-generation", Some(id), self.vocab_size)?;
            if !self.specials.eos_ids.contains(&id) {
                self.specials.eos_ids.push(id);
            }
        }
        Ok(self)
    }

    /// The ids of `text`. Special tokens written in the text are matched whole; with
    /// `add_special`, BOS is prepended when [`Tokenizer::add_bos`] and EOS appended when
    /// [`Tokenizer::add_eos`] (an empty text then gives `[BOS]`).
    ///
    /// # Errors
    /// [`TokenizerError::Unencodable`] for a character a SentencePiece vocabulary without byte
    /// tokens or unknown token cannot represent; a `tokenizers` failure.
    pub fn encode(&self, text: &str, add_special: bool) -> TokenizerResult<Vec<u32>> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.specials.add_bos {
            ids.extend(self.specials.bos);
        }
        match &self.backend {
            Backend::Spm(m) => m.encode(text, &mut ids)?,
            Backend::GgufBpe(t, _) | Backend::Hf(t) => {
                let enc = t.encode_fast(text, false).map_err(|e| TokenizerError::Hf { message: e.to_string() })?;
                ids.extend_from_slice(enc.get_ids());
            }
        }
        if add_special && self.specials.add_eos {
            ids.extend(self.specials.eos);
        }
        Ok(ids)
    }

    /// The text of `ids`: the pieces concatenated (▁ as space, byte tokens as their bytes, one
    /// U+FFFD per invalid UTF-8 sequence); control and unknown tokens left out when
    /// `skip_special`, else written as their text. A SentencePiece vocabulary with
    /// `add_space_prefix` drops the space its encoder put before the first piece.
    ///
    /// # Errors
    /// [`TokenizerError::IdOutOfRange`]; a `tokenizers` failure.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> TokenizerResult<String> {
        for &id in ids {
            self.check_id(id)?;
        }
        match self.backend.decoder() {
            Decoder::Pieces(_) => {
                let mut stream = self.decode_stream(skip_special);
                let mut text = String::new();
                for &id in ids {
                    text.push_str(&stream.push(id)?);
                }
                text.push_str(&stream.finish()?);
                Ok(text)
            }
            Decoder::Hf(t) => t.decode(ids, skip_special).map_err(|e| TokenizerError::Hf { message: e.to_string() }),
        }
    }

    /// A streaming decoder of a text from its start (what [`Tokenizer::decode`] of all its ids gives).
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special)
    }

    /// A streaming decoder of the ids that follow `context` (the prompt): the text of the new
    /// ids only, continuing the context's (a leading space is kept, a character the context
    /// began is finished).
    ///
    /// # Errors
    /// [`TokenizerError::IdOutOfRange`] for a context id outside the vocabulary; a `tokenizers` failure.
    pub fn decode_stream_after(&self, context: &[u32], skip_special: bool) -> TokenizerResult<DecodeStream<'_>> {
        DecodeStream::after(self, skip_special, context)
    }

    /// The BOS id, if the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.specials.bos
    }

    /// The EOS id appended by `encode` when [`Tokenizer::add_eos`].
    pub fn eos_id(&self) -> Option<u32> {
        self.specials.eos
    }

    /// Every id that ends generation: the EOS first, then the others configured (Gemma's
    /// `<end_of_turn>`, Llama 3's `<|eot_id|>`).
    pub fn eos_ids(&self) -> &[u32] {
        &self.specials.eos_ids
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.specials.eos_ids.contains(&id)
    }

    /// Whether `encode(.., add_special = true)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.specials.add_bos
    }

    /// Whether `encode(.., add_special = true)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.specials.add_eos
    }

    /// The number of ids (the largest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The id of a token's text (`<end_of_turn>`), if it is one token.
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        match &self.backend {
            Backend::Spm(m) => m.token_to_id(text),
            Backend::GgufBpe(t, _) | Backend::Hf(t) => t.token_to_id(text),
        }
    }

    /// The text of a token as the vocabulary stores it (`▁The`, `<0x0A>`, `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Spm(m) => m.id_to_token(id).map(str::to_string),
            Backend::GgufBpe(t, _) | Backend::Hf(t) => t.id_to_token(id),
        }
    }

    /// A blake3 hash of everything that decides the ids [`Tokenizer::encode`] gives: the kind of
    /// tokenizer; for a GGUF SentencePiece vocabulary its tokens, scores, types, unknown token and
    /// `add_space_prefix`; for the `tokenizers`-backed ones (GGUF byte-level BPE, Hugging Face
    /// `tokenizer.json`) the `tokenizers` crate's JSON serialization (the model's vocabulary and
    /// merges in id and rank order, added tokens, normalizer, pre-tokenizer, post-processor);
    /// then the vocabulary size, BOS, EOS, every end-of-generation id, `add_bos` and `add_eos`.
    /// Two tokenizers with the same fingerprint encode every text to the same ids; caches of
    /// tokenized data are keyed by it. Stable across runs and machines, not across versions of
    /// this crate or of `tokenizers` that change the serialization (a changed fingerprint only
    /// costs a re-tokenization).
    pub fn fingerprint(&self) -> [u8; 32] {
        fn put_len(h: &mut blake3::Hasher, n: usize) {
            h.update(&(n as u64).to_le_bytes());
        }
        fn put_id(h: &mut blake3::Hasher, id: Option<u32>) {
            match id {
                Some(id) => h.update(&[1]).update(&id.to_le_bytes()),
                None => h.update(&[0]),
            };
        }
        fn put_hf(h: &mut blake3::Hasher, t: &tokenizers::Tokenizer) {
            match t.to_string(false) {
                Ok(json) => {
                    put_len(h, json.len());
                    h.update(json.as_bytes());
                }
                // Never seen (every component serializes); the vocabulary then still separates
                // tokenizers, in id order.
                Err(e) => {
                    h.update(b"unserializable\0").update(e.to_string().as_bytes());
                    let mut vocab: Vec<(String, u32)> = t.get_vocab(true).into_iter().collect();
                    vocab.sort_unstable_by_key(|&(_, id)| id);
                    for (text, id) in vocab {
                        put_len(h, text.len());
                        h.update(text.as_bytes()).update(&id.to_le_bytes());
                    }
                }
            }
        }
        let mut h = blake3::Hasher::new();
        h.update(b"te-models tokenizer fingerprint 1\0");
        match &self.backend {
            Backend::Spm(m) => {
                h.update(b"gguf-spm\0");
                let (tokens, scores, types, unk, add_space_prefix) = m.export_view();
                put_len(&mut h, tokens.len());
                for t in tokens {
                    put_len(&mut h, t.len());
                    h.update(t.as_bytes());
                }
                for s in scores {
                    h.update(&s.to_bits().to_le_bytes());
                }
                for &ty in types {
                    h.update(&[ty as u8]);
                }
                put_id(&mut h, unk);
                h.update(&[u8::from(add_space_prefix)]);
            }
            Backend::GgufBpe(t, _) => {
                h.update(b"gguf-bpe\0");
                put_hf(&mut h, t);
            }
            Backend::Hf(t) => {
                h.update(b"hf\0");
                put_hf(&mut h, t);
            }
        }
        let s = &self.specials;
        put_len(&mut h, self.vocab_size);
        put_id(&mut h, s.bos);
        put_id(&mut h, s.eos);
        put_len(&mut h, s.eos_ids.len());
        for &id in &s.eos_ids {
            h.update(&id.to_le_bytes());
        }
        h.update(&[u8::from(s.add_bos), u8::from(s.add_eos)]);
        *h.finalize().as_bytes()
    }

    /// Errs when `id` is outside the vocabulary.
    fn check_id(&self, id: u32) -> TokenizerResult<()> {
        if (id as usize) < self.vocab_size {
            Ok(())
        } else {
            Err(TokenizerError::IdOutOfRange { id, vocab_size: self.vocab_size })
        }
    }
}

#[cfg(test)]
mod fingerprint_tests {
    use super::tests::{byte_level_tokens, spm_vocab, NORMAL, USER};
    use super::*;

    fn spm(edit: impl FnOnce(&mut SpmVocab)) -> [u8; 32] {
        let mut v = spm_vocab(&[("▁a", -1.0, NORMAL), ("▁ab", -2.0, NORMAL)], true);
        edit(&mut v);
        Tokenizer::from_spm(v).unwrap().fingerprint()
    }

    fn bpe(edit: impl FnOnce(&mut BpeVocab)) -> Tokenizer {
        let mut v = BpeVocab {
            tokens: byte_level_tokens(&["<s>", "</s>"], &["ab", "abc"]),
            merges: vec!["a b".into(), "ab c".into()],
            pre: Some("gpt-2".into()),
            bos: Some(0),
            eos: Some(1),
            ..BpeVocab::default()
        };
        edit(&mut v);
        Tokenizer::from_bpe(v).unwrap()
    }

    #[test]
    fn the_fingerprint_follows_what_changes_the_ids() {
        let base = spm(|_| {});
        assert_eq!(base, spm(|_| {}), "the same vocabulary, the same fingerprint");
        let changed = [
            spm(|v| v.scores[4] = -3.0),
            spm(|v| v.tokens[5] = "▁ac".into()),
            spm(|v| v.token_types[4] = USER),
            spm(|v| v.add_bos = Some(false)),
            spm(|v| v.add_eos = Some(true)),
            spm(|v| v.add_space_prefix = Some(true)),
            spm(|v| v.eos = Some(0)),
            spm(|v| {
                v.bos = None;
                v.add_bos = Some(false);
            }),
        ];
        for (i, f) in changed.iter().enumerate() {
            assert_ne!(*f, base, "change {i} must change the fingerprint");
            for (j, g) in changed.iter().enumerate().skip(i + 1) {
                assert_ne!(f, g, "changes {i} and {j}");
            }
        }

        let b = bpe(|_| {}).fingerprint();
        assert_eq!(b, bpe(|_| {}).fingerprint());
        assert_ne!(b, bpe(|v| v.merges.truncate(1)).fingerprint(), "merges");
        assert_ne!(b, bpe(|v| v.pre = Some("qwen2".into())).fingerprint(), "pre-tokenizer");
        assert_ne!(b, bpe(|v| v.add_bos = Some(true)).fingerprint(), "add_bos");
    }

    #[test]
    fn a_saved_hugging_face_tokenizer_has_a_stable_fingerprint() {
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("tokenizer.json");
        std::fs::write(&json, bpe(|_| {}).to_hf_json().unwrap()).unwrap();
        let load = |config: Option<&str>| {
            let cfg = dir.path().join("tokenizer_config.json");
            if let Some(c) = config {
                std::fs::write(&cfg, c).unwrap();
            }
            Tokenizer::from_hf_files(&json, config.map(|_| cfg.as_path()), None).unwrap().fingerprint()
        };
        let hf = load(None);
        assert_eq!(hf, load(None), "loading twice gives the same fingerprint");
        assert_ne!(hf, bpe(|_| {}).fingerprint(), "another backend");
        assert_ne!(hf, load(Some(r#"{"add_eos_token": true, "eos_token": "</s>"}"#)), "add_eos");
    }
}
