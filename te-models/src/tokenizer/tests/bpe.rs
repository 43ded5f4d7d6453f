//! GGUF byte-level BPE vocabularies (`gpt2` model) through the `tokenizers` crate.

use std::sync::LazyLock;

use proptest::prelude::*;

use super::*;

const SPECIALS: [&str; 3] = ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>"];
const MERGED: [&str; 10] = ["He", "ll", "Hell", "Hello", "Ġw", "12", "123", "45", "Ġworld", "<tool>"];
/// The token of byte 0xFC (never in UTF-8), "ü" in the alphabet, typed user-defined: a token in
/// plain text, as deepseek-coder's vocabulary has.
const U_UMLAUT: u32 = 3 + 0xFC;
const MERGES: [&str; 8] = ["H e", "l l", "He ll", "Hell o", "Ġ w", "1 2", "12 3", "4 5"];

/// The id of the byte of ASCII character `c`.
fn b(c: char) -> u32 {
    3 + u32::from(c as u8)
}

/// Ids of the merged tokens: 259 + their index in MERGED.
fn m(text: &str) -> u32 {
    259 + MERGED.iter().position(|&t| t == text).unwrap() as u32
}

fn vocab(pre: Option<&str>) -> BpeVocab {
    let tokens = byte_level_tokens(&SPECIALS, &MERGED);
    let mut token_types = vec![NORMAL; tokens.len()];
    token_types[..3].fill(CONTROL);
    token_types[m("<tool>") as usize] = USER;
    token_types[U_UMLAUT as usize] = USER;
    BpeVocab {
        tokens,
        token_types,
        merges: MERGES.iter().map(|s| s.to_string()).collect(),
        pre: pre.map(str::to_string),
        bos: Some(0),
        eos: Some(1),
        ..BpeVocab::default()
    }
}

fn tok(pre: &str) -> Tokenizer {
    Tokenizer::from_bpe(vocab(Some(pre))).unwrap()
}

#[test]
fn the_pre_tokenizer_follows_tokenizer_ggml_pre() {
    let text = "Hello world 12345";
    // Llama 3: "Hello" " world" " " "123" "45"; whole words in the vocabulary are taken without
    // merges (Ġworld has none); BOS by default.
    let t = tok("llama-bpe");
    assert!(t.add_bos());
    assert_eq!(t.encode(text, true).unwrap(), [0, m("Hello"), m("Ġworld"), b(' '), m("123"), m("45")]);
    // Qwen 2: digits one by one, merges only: Ġ w → Ġw, then o r l d alone; no BOS.
    let t = tok("qwen2");
    assert!(!t.add_bos());
    let qwen = [m("Hello"), m("Ġw"), b('o'), b('r'), b('l'), b('d'), b(' '), b('1'), b('2'), b('3'), b('4'), b('5')];
    assert_eq!(t.encode(text, true).unwrap(), qwen);
    // GPT-2: " 12345" is one piece: 1 2 (rank 5), 12 3 (rank 6), 4 5 (rank 7).
    let t = tok("gpt-2");
    let gpt2 = [m("Hello"), m("Ġw"), b('o'), b('r'), b('l'), b('d'), b(' '), m("123"), m("45")];
    assert_eq!(t.encode(text, false).unwrap(), gpt2);
    for t in [tok("llama-bpe"), tok("qwen2"), tok("gpt-2"), Tokenizer::from_bpe(vocab(None)).unwrap()] {
        let ids = t.encode(text, true).unwrap();
        assert_eq!(t.decode(&ids, true).unwrap(), text);
    }
}

#[test]
fn control_and_user_defined_tokens_match_whole() {
    let t = tok("qwen2");
    let ids = t.encode("<|im_start|>use<tool>", false).unwrap();
    assert_eq!(ids, [2, b('u'), b('s'), b('e'), m("<tool>")]);
    assert_eq!(t.decode(&ids, true).unwrap(), "use<tool>");
    assert_eq!(t.decode(&ids, false).unwrap(), "<|im_start|>use<tool>");
    // A user-defined token decodes to its text as it is, as llama.cpp's token_to_piece (through
    // the byte alphabet "ü" would be the byte 0xFC, not UTF-8).
    let ids = t.encode("Führer", false).unwrap();
    assert_eq!(ids, [b('F'), U_UMLAUT, b('h'), b('r'), b('e'), b('r')]);
    assert_eq!(t.decode(&ids, true).unwrap(), "Führer");
    // <|eot_id|> ends generation (the EOS here, and by its text).
    assert_eq!(t.eos_ids(), [1]);
}

#[test]
fn bytes_come_back_as_utf8() {
    let t = tok("qwen2");
    let ids = t.encode("é", false).unwrap();
    assert_eq!(ids, [3 + 0xC3, 3 + 0xA9]);
    assert_eq!(t.decode(&ids[..1], true).unwrap(), "\u{fffd}");
    assert_eq!(streamed(&t, &ids, true), "é");
    let mut s = t.decode_stream(true);
    assert_eq!((s.push(ids[0]).unwrap(), s.finish().unwrap()), (String::new(), "\u{fffd}".to_string()));
    let e = t.decode(&[270], true).unwrap_err();
    assert!(matches!(e, TokenizerError::IdOutOfRange { id: 270, vocab_size: 269 }), "{e}");
}

#[test]
fn bad_vocabularies_are_refused() {
    let e = Tokenizer::from_bpe(vocab(Some("tekken"))).unwrap_err();
    assert!(matches!(&e, TokenizerError::Unsupported { message } if message.contains("tekken")), "{e}");
    let mut v = vocab(Some("qwen2"));
    v.merges.push("nospace".into());
    assert!(matches!(Tokenizer::from_bpe(v).unwrap_err(), TokenizerError::BadMerge { index: 8, .. }));
    // A merge whose result is no token: the tokenizers crate says so.
    let mut v = vocab(Some("qwen2"));
    v.merges.push("Q Z".into());
    let e = Tokenizer::from_bpe(v).unwrap_err();
    assert!(matches!(e, TokenizerError::Hf { .. }), "{e}");
    let mut v = vocab(Some("qwen2"));
    v.token_types.pop();
    assert!(matches!(Tokenizer::from_bpe(v).unwrap_err(), TokenizerError::LengthMismatch { .. }));
    let mut v = vocab(Some("llama-bpe"));
    v.bos = None;
    assert!(matches!(Tokenizer::from_bpe(v).unwrap_err(), TokenizerError::MissingSpecial { name: "BOS", .. }));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn byte_level_round_trips_and_streams(text in "[^<]{0,40}", ids in prop::collection::vec(0u32..269, 0..16)) {
        static TOKS: LazyLock<[Tokenizer; 3]> = LazyLock::new(|| [tok("llama-bpe"), tok("qwen2"), tok("gpt-2")]);
        for t in TOKS.iter() {
            prop_assert_eq!(&t.decode(&t.encode(&text, false).unwrap(), true).unwrap(), &text);
            for skip in [false, true] {
                prop_assert_eq!(streamed(t, &ids, skip), t.decode(&ids, skip).unwrap());
            }
        }
    }
}
