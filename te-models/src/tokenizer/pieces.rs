//! What each token of a GGUF vocabulary decodes to, computed once (llama.cpp's
//! `cache_token_to_piece` of `llama_vocab::impl::token_to_piece`), and the rules of joining them:
//! control and unknown tokens only when not skipped, unused and undefined ones never, and the
//! dummy-prefix space of a SentencePiece vocabulary dropped from the first piece of a text.

use super::error::TokenizerResult;
use super::vocab::TokenType;

/// The bytes of every token and its type.
#[derive(Debug, Clone)]
pub(crate) struct Pieces {
    types: Vec<TokenType>,
    bytes: Vec<Box<[u8]>>,
    /// SentencePiece's `add_dummy_prefix` (`add_space_prefix`): the encoder put a space before
    /// the text, the decoder takes it off the first normal piece.
    strip_first_space: bool,
}

impl Pieces {
    /// The pieces of `tokens`, each decoded by `decode(id, text, type)`.
    pub fn new(
        tokens: &[String],
        types: Vec<TokenType>,
        strip_first_space: bool,
        decode: impl Fn(u32, &str, TokenType) -> TokenizerResult<Box<[u8]>>,
    ) -> TokenizerResult<Self> {
        let bytes = tokens
            .iter()
            .zip(&types)
            .zip(0u32..)
            .map(|((t, &ty), id)| decode(id, t, ty))
            .collect::<TokenizerResult<_>>()?;
        Ok(Self { types, bytes, strip_first_space })
    }

    /// The type of every token.
    pub fn types(&self) -> &[TokenType] {
        &self.types
    }

    /// The bytes token `id` adds to a text: nothing when skipped (control and unknown tokens
    /// under `skip_special`, llama.cpp's `attr_special`) or out of range; `at_start` (no visible
    /// piece yet) drops the dummy-prefix space and is cleared by the first visible piece
    /// (SentencePiece's decoder; llama.cpp's `detokenize` strips the first token the same way).
    pub fn visible(&self, id: u32, skip_special: bool, at_start: &mut bool) -> &[u8] {
        let (Some(&ty), Some(bytes)) = (self.types.get(id as usize), self.bytes.get(id as usize)) else {
            return &[];
        };
        if (skip_special && ty.is_special()) || bytes.is_empty() {
            return &[];
        }
        let strip = *at_start && self.strip_first_space && ty == TokenType::Normal;
        *at_start = false;
        if strip {
            bytes.strip_prefix(b" ").unwrap_or(bytes)
        } else {
            bytes
        }
    }
}
