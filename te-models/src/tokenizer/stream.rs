//! Decoding as tokens come, for generation: each [`DecodeStream::push`] returns the text the
//! token completes, holding back what is not text yet (the bytes of an unfinished UTF-8
//! character, a byte-fallback sequence, a piece a decoder may still rewrite).

use super::error::{TokenizerError, TokenizerResult};
use super::pieces::Pieces;
use super::{Decoder, Tokenizer};
use crate::generate::Utf8Stream;

/// How many ids of the context a continuing stream keeps: enough for a 4-byte character in byte
/// tokens and for any decoder that looks at the previous piece.
const CONTEXT_IDS: usize = 8;

/// Streaming decoder of one [`Tokenizer`], from [`Tokenizer::decode_stream`] (a text from its
/// start: the same text as [`Tokenizer::decode`] of all the ids) or
/// [`Tokenizer::decode_stream_after`] (a continuation of ids already shown, e.g. the prompt: no
/// start-of-text rule, such as dropping SentencePiece's dummy-prefix space, applies).
///
/// GGUF vocabularies push each token's bytes through a [`Utf8Stream`] (lossy only at invalid
/// UTF-8). Hugging Face tokenizers (decoded by the `tokenizers` crate) use its prefix method
/// (`tokenizers::DecodeStream`): the ids since the last emitted text are decoded with the piece
/// before them and the new text is the part past that piece's, emitted once it does not end in
/// U+FFFD; [`DecodeStream::finish`] flushes what is still held.
#[derive(Debug)]
pub struct DecodeStream<'t> {
    tok: &'t Tokenizer,
    skip_special: bool,
    state: State<'t>,
}

#[derive(Debug)]
enum State<'t> {
    /// A GGUF vocabulary: its pieces' bytes; `at_start` until the first visible piece.
    Pieces { pieces: &'t Pieces, utf8: Utf8Stream, at_start: bool },
    /// A Hugging Face tokenizer: the ids since (and including) those of the last text emitted,
    /// that text, and where the ids after it begin.
    Hf { tok: &'t tokenizers::Tokenizer, ids: Vec<u32>, prefix: String, prefix_index: usize },
}

impl<'t> DecodeStream<'t> {
    /// A stream of a text from its start.
    pub(crate) fn new(tok: &'t Tokenizer, skip_special: bool) -> Self {
        let state = match tok.backend.decoder() {
            Decoder::Pieces(pieces) => State::Pieces { pieces, utf8: Utf8Stream::new(), at_start: true },
            Decoder::Hf(t) => State::Hf { tok: t, ids: Vec::new(), prefix: String::new(), prefix_index: 0 },
        };
        Self { tok, skip_special, state }
    }

    /// A stream of the ids that follow `context`.
    pub(crate) fn after(tok: &'t Tokenizer, skip_special: bool, context: &[u32]) -> TokenizerResult<Self> {
        let tail = &context[context.len().saturating_sub(CONTEXT_IDS)..];
        for &id in tail {
            tok.check_id(id)?;
        }
        let state = match tok.backend.decoder() {
            Decoder::Pieces(pieces) => {
                let mut utf8 = Utf8Stream::new();
                // The context's bytes, shown already: only an unfinished character stays pending.
                let mut at_start = false;
                for &id in tail {
                    utf8.push_bytes(pieces.visible(id, skip_special, &mut at_start));
                }
                State::Pieces { pieces, utf8, at_start }
            }
            Decoder::Hf(t) => {
                let ids = tail.to_vec();
                let mut prefix = if ids.is_empty() { String::new() } else { hf_decode(t, &ids, skip_special)? };
                // A context ending inside a character: the text from that character on is new.
                prefix.truncate(prefix.trim_end_matches(char::REPLACEMENT_CHARACTER).len());
                State::Hf { tok: t, prefix_index: ids.len(), ids, prefix }
            }
        };
        Ok(Self { tok, skip_special, state })
    }

    /// Adds token `id`; returns the text it completes ("" while it is held back).
    ///
    /// # Errors
    /// [`TokenizerError::IdOutOfRange`] for an id outside the vocabulary; a `tokenizers` failure.
    pub fn push(&mut self, id: u32) -> TokenizerResult<String> {
        self.tok.check_id(id)?;
        let skip = self.skip_special;
        match &mut self.state {
            State::Pieces { pieces, utf8, at_start } => Ok(utf8.push_bytes(pieces.visible(id, skip, at_start))),
            State::Hf { tok, ids, prefix, prefix_index } => {
                // tokenizers' step_decode_stream: `ids` = [piece already emitted | new ids].
                if prefix.is_empty() && !ids.is_empty() {
                    let p = hf_decode(tok, ids, skip)?;
                    if !p.ends_with(char::REPLACEMENT_CHARACTER) {
                        *prefix = p;
                        *prefix_index = ids.len();
                    }
                }
                ids.push(id);
                let text = hf_decode(tok, ids, skip)?;
                if text.len() <= prefix.len() || text.ends_with(char::REPLACEMENT_CHARACTER) {
                    return Ok(String::new());
                }
                let Some(new) = text.strip_prefix(prefix.as_str()) else {
                    return Err(TokenizerError::Hf {
                        message: format!(
                            "streaming decode: the text {text:?} of ids {ids:?} no longer starts with the text {prefix:?} already emitted"
                        ),
                    });
                };
                let new = new.to_string();
                let kept = ids.len() - *prefix_index;
                ids.drain(..*prefix_index);
                *prefix = hf_decode(tok, ids, skip)?;
                *prefix_index = kept;
                Ok(new)
            }
        }
    }

    /// Ends the stream: what is still held back (U+FFFD for an unfinished character), else "".
    ///
    /// # Errors
    /// A `tokenizers` failure.
    pub fn finish(&mut self) -> TokenizerResult<String> {
        let skip = self.skip_special;
        match &mut self.state {
            State::Pieces { utf8, .. } => Ok(utf8.finish()),
            State::Hf { tok, ids, prefix, prefix_index } => {
                let text = if ids.len() > *prefix_index { hf_decode(tok, ids, skip)? } else { String::new() };
                let rest = text.strip_prefix(prefix.as_str()).unwrap_or_default().to_string();
                ids.clear();
                prefix.clear();
                *prefix_index = 0;
                Ok(rest)
            }
        }
    }
}

fn hf_decode(t: &tokenizers::Tokenizer, ids: &[u32], skip_special: bool) -> TokenizerResult<String> {
    t.decode(ids, skip_special).map_err(|e| TokenizerError::Hf { message: e.to_string() })
}
