//! Tests of the tokenizer layer on small hand-made vocabularies whose tokenizations are derived
//! by hand in the comments (llama.cpp's rules), and the round trip of random text.

mod bpe;
mod export;
mod hf;
mod llama_cpp;
mod perf;
mod reference;
mod roundtrip;
mod spm;

use super::*;

/// Token types of GGUF.
pub(super) const NORMAL: i32 = 1;
pub(super) const UNKNOWN: i32 = 2;
pub(super) const CONTROL: i32 = 3;
pub(super) const USER: i32 = 4;
pub(super) const UNUSED: i32 = 5;
pub(super) const BYTE: i32 = 6;

/// An SPM vocabulary: `<pad>` 0, `<eos>` 1, `<bos>` 2, `<unk>` 3 (Gemma's order), then `pieces`
/// (text, score, type) from id 4, then the 256 byte tokens `<0x00>`..`<0xFF>` when `bytes`.
pub(super) fn spm_vocab(pieces: &[(&str, f32, i32)], bytes: bool) -> SpmVocab {
    let mut v = SpmVocab { bos: Some(2), eos: Some(1), add_space_prefix: Some(false), ..SpmVocab::default() };
    let head = [("<pad>", 0.0, CONTROL), ("<eos>", 0.0, CONTROL), ("<bos>", 0.0, CONTROL), ("<unk>", 0.0, UNKNOWN)];
    for &(t, s, ty) in head.iter().chain(pieces) {
        v.tokens.push(t.to_string());
        v.scores.push(s);
        v.token_types.push(ty);
    }
    if bytes {
        for b in 0..=255u8 {
            v.tokens.push(format!("<0x{b:02X}>"));
            v.scores.push(0.0);
            v.token_types.push(BYTE);
        }
    }
    v
}

/// The texts of `ids`, as the vocabulary stores them.
pub(super) fn texts(tok: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&id| tok.id_to_token(id).unwrap()).collect()
}

/// Encodes without special tokens and returns the tokens' texts.
pub(super) fn pieces(tok: &Tokenizer, text: &str) -> Vec<String> {
    texts(tok, &tok.encode(text, false).unwrap())
}

/// Every push of a stream over `ids` and its finish, concatenated.
pub(super) fn streamed(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> String {
    let mut s = tok.decode_stream(skip_special);
    let mut out: String = ids.iter().map(|&id| s.push(id).unwrap()).collect();
    out.push_str(&s.finish().unwrap());
    out
}

#[test]
fn tokenizer_is_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
}

/// GPT-2's byte → printable character map (`bytes_to_unicode`): printable Latin-1 bytes stand
/// for themselves, the others for U+0100 onwards in byte order (space is `Ġ`).
pub(super) fn byte_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        char::from(b)
    } else {
        let below = (0..b).filter(|&x| !printable(x)).count() as u32;
        char::from_u32(256 + below).unwrap()
    }
}

/// A byte-level BPE vocabulary: `specials` from id 0, the 256 byte characters (byte `b` at id
/// `specials.len() + b`), then `merged`.
pub(super) fn byte_level_tokens(specials: &[&str], merged: &[&str]) -> Vec<String> {
    let mut tokens: Vec<String> = specials.iter().map(|s| s.to_string()).collect();
    tokens.extend((0..=255u8).map(|b| byte_char(b).to_string()));
    tokens.extend(merged.iter().map(|s| s.to_string()));
    tokens
}

#[test]
fn the_byte_alphabet_is_gpt2s() {
    assert_eq!(byte_char(b' '), 'Ġ');
    assert_eq!(byte_char(b'\n'), 'Ċ');
    assert_eq!(byte_char(b'a'), 'a');
    assert_eq!(byte_char(0xAD), '\u{143}');
}
