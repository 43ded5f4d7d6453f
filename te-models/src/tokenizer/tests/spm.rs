//! llama.cpp's SPM algorithm on hand-made vocabularies.

use super::*;

fn tok(pieces: &[(&str, f32, i32)]) -> Tokenizer {
    Tokenizer::from_spm(spm_vocab(pieces, true)).unwrap()
}

#[test]
fn the_highest_score_merges_first() {
    // "abc": pairs ab (1) and bc (2); bc first → a|bc; then a+bc = abc (3) → abc.
    let t = tok(&[
        ("a", 0.0, NORMAL),
        ("b", 0.0, NORMAL),
        ("c", 0.0, NORMAL),
        ("ab", 1.0, NORMAL),
        ("bc", 2.0, NORMAL),
        ("abc", 3.0, NORMAL),
    ]);
    assert_eq!(pieces(&t, "abc"), ["abc"]);
    // Without abc: a|bc stays.
    let t =
        tok(&[("a", 0.0, NORMAL), ("b", 0.0, NORMAL), ("c", 0.0, NORMAL), ("ab", 1.0, NORMAL), ("bc", 2.0, NORMAL)]);
    assert_eq!(pieces(&t, "abc"), ["a", "bc"]);
    // ab scores higher: ab|c, and abc is no token.
    let t =
        tok(&[("a", 0.0, NORMAL), ("b", 0.0, NORMAL), ("c", 0.0, NORMAL), ("ab", 2.0, NORMAL), ("bc", 1.0, NORMAL)]);
    assert_eq!(pieces(&t, "abc"), ["ab", "c"]);
}

#[test]
fn a_merge_the_greedy_path_cannot_reach_is_not_taken() {
    // "the" with a space prefix: ▁ t h e; pairs ▁t (-3), th (-2), he (-1).
    // he first → ▁ t he; th is stale (h grew); ▁t → ▁t he; ▁t+he = ▁the (-0.5) → ▁the.
    let v = [
        ("▁t", -3.0, NORMAL),
        ("th", -2.0, NORMAL),
        ("he", -1.0, NORMAL),
        ("▁th", -4.0, NORMAL),
        ("▁the", -0.5, NORMAL),
    ];
    let mut vocab = spm_vocab(&v, true);
    vocab.add_space_prefix = None; // llama.cpp's default for SPM: a space is prepended
    let t = Tokenizer::from_spm(vocab).unwrap();
    assert_eq!(pieces(&t, "the"), ["▁the"]);
    // "tea": ▁ t e a; only ▁t merges; e and a fall back to bytes.
    assert_eq!(pieces(&t, "tea"), ["▁t", "<0x65>", "<0x61>"]);
}

#[test]
fn ties_go_to_the_leftmost_pair() {
    let t = tok(&[("a", 0.0, NORMAL), ("aa", 0.0, NORMAL)]);
    // aaa: pairs (0,1) and (1,2) tie → (0,1) → aa|a; aaa is no token.
    assert_eq!(pieces(&t, "aaa"), ["aa", "a"]);
    // aaaa: (0,1) → aa a a; (1,2) is stale; (2,3) → aa|aa.
    assert_eq!(pieces(&t, "aaaa"), ["aa", "aa"]);
    // -0.0 and 0.0 tie as in C++: still the leftmost.
    let t = tok(&[("x", 0.0, NORMAL), ("y", 0.0, NORMAL), ("xy", 0.0, NORMAL), ("yx", -0.0, NORMAL)]);
    assert_eq!(pieces(&t, "yxy"), ["yx", "y"]);
}

#[test]
fn spaces_become_the_space_mark() {
    let v = [("a", 0.0, NORMAL), ("b", 0.0, NORMAL), ("▁", 0.0, NORMAL), ("▁b", 1.0, NORMAL)];
    let t = tok(&v);
    // No space prefix (Gemma): "a b" → a ▁b; two spaces → a ▁ ▁b (▁▁ is no token).
    assert_eq!(pieces(&t, "a b"), ["a", "▁b"]);
    assert_eq!(pieces(&t, "a  b"), ["a", "▁", "▁b"]);
    // With the prefix: "b" → ▁b.
    let mut vocab = spm_vocab(&v, true);
    vocab.add_space_prefix = Some(true);
    let t = Tokenizer::from_spm(vocab).unwrap();
    assert_eq!(pieces(&t, "b"), ["▁b"]);
    assert_eq!(pieces(&t, "a b"), ["▁", "a", "▁b"]);
}

#[test]
fn unknown_characters_fall_back_to_bytes() {
    let t = tok(&[("a", 0.0, NORMAL), ("b", 0.0, NORMAL), ("é", 0.0, NORMAL)]);
    // é is a token; € (E2 82 AC) and 😀 (F0 9F 98 80) are not.
    assert_eq!(pieces(&t, "aé"), ["a", "é"]);
    assert_eq!(pieces(&t, "a€b"), ["a", "<0xE2>", "<0x82>", "<0xAC>", "b"]);
    assert_eq!(pieces(&t, "😀"), ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]);
    // A space is ▁ (E2 96 81) before the fallback.
    assert_eq!(pieces(&t, " "), ["<0xE2>", "<0x96>", "<0x81>"]);
}

#[test]
fn without_byte_tokens_the_unknown_token_or_an_error() {
    let t = Tokenizer::from_spm(spm_vocab(&[("a", 0.0, NORMAL)], false)).unwrap();
    // No byte tokens: one <unk> (id 3, the first token of type unknown) per unknown character.
    assert_eq!(t.encode("a€a", false).unwrap(), [4, 3, 4]);
    let mut v = spm_vocab(&[("a", 0.0, NORMAL)], false);
    v.token_types[3] = NORMAL; // no unknown token at all
    let t = Tokenizer::from_spm(v).unwrap();
    let e = t.encode("a€", false).unwrap_err();
    assert!(matches!(&e, TokenizerError::Unencodable { text } if text == "€"), "{e}");
}

#[test]
fn special_and_user_defined_tokens_match_whole_first() {
    let v = [
        ("a", 0.0, NORMAL),
        ("b", 0.0, NORMAL),
        ("c", 0.0, NORMAL),
        ("ab", 1.0, USER),
        ("abc", 5.0, NORMAL),
        ("<start_of_turn>", 0.0, CONTROL),
        ("▁", 0.0, NORMAL),
        ("▁c", 2.0, NORMAL),
    ];
    let t = tok(&v);
    // The user-defined "ab" is taken before the merges, which would give "abc".
    assert_eq!(pieces(&t, "abc"), ["ab", "c"]);
    // Control tokens written in the text are matched too; the text around them is split alone.
    assert_eq!(pieces(&t, "<start_of_turn>c<bos>"), ["<start_of_turn>", "c", "<bos>"]);
    // With the space prefix, text after a special token gets a space too (llama.cpp).
    let mut vocab = spm_vocab(&v, true);
    vocab.add_space_prefix = Some(true);
    let t = Tokenizer::from_spm(vocab).unwrap();
    assert_eq!(pieces(&t, "c<start_of_turn>c"), ["▁c", "<start_of_turn>", "▁c"]);
    // Hand-derived ids: ▁c is id 4 + 7 = 11, <start_of_turn> 9.
    assert_eq!(t.encode("c<start_of_turn>c", true).unwrap(), [2, 11, 9, 11]);
}

#[test]
fn bos_and_eos_follow_the_flags() {
    let v = [("a", 0.0, NORMAL)];
    // add_bos unset: llama.cpp's SPM default, true; add_eos unset: false.
    let mut vocab = spm_vocab(&v, false);
    vocab.eog = vec![0];
    let t = Tokenizer::from_spm(vocab).unwrap();
    assert!(t.add_bos() && !t.add_eos());
    assert_eq!((t.bos_id(), t.eos_id(), t.eos_ids()), (Some(2), Some(1), &[1, 0][..]));
    assert!(t.is_eos(0) && t.is_eos(1) && !t.is_eos(2));
    assert_eq!(t.encode("", true).unwrap(), [2]);
    assert_eq!(t.encode("", false).unwrap(), Vec::<u32>::new());
    assert_eq!(t.encode("a", true).unwrap(), [2, 4]);
    let t = t.with_eos_ids(&[4, 1]).unwrap();
    assert_eq!(t.eos_ids(), [1, 0, 4]);
    assert!(matches!(t.with_eos_ids(&[99]), Err(TokenizerError::SpecialIdOutOfRange { id: 99, .. })));

    let mut vocab = spm_vocab(&v, false);
    (vocab.add_bos, vocab.add_eos) = (Some(false), Some(true));
    let t = Tokenizer::from_spm(vocab).unwrap();
    assert_eq!(t.encode("a", true).unwrap(), [4, 1]);
    assert_eq!(t.vocab_size(), 5);
}

#[test]
fn eog_tokens_are_found_by_text() {
    // Gemma: <end_of_turn> ends generation beside <eos>, as llama.cpp decides by its text.
    let t = tok(&[("<start_of_turn>", 0.0, CONTROL), ("<end_of_turn>", 0.0, CONTROL)]);
    assert_eq!(t.eos_ids(), [1, 5]);
    assert_eq!(t.token_to_id("<end_of_turn>"), Some(5));
    assert_eq!(eog_ids_by_text(&["x".into(), "<|im_end|>".into(), "<|eot_id|>".into()]), [1, 2]);
}

#[test]
fn decode_joins_pieces() {
    let v = [("The", 0.0, NORMAL), ("▁cap", 0.0, NORMAL), ("<unused0>", 0.0, UNUSED), ("<br>", 0.0, USER)];
    let t = tok(&v);
    // <bos> The ▁cap <0xC3> <0xA9> <unused0> <br> <eos>
    let ids = [2, 4, 5, 8 + 0xC3, 8 + 0xA9, 6, 7, 1];
    assert_eq!(t.decode(&ids, true).unwrap(), "The capé<br>");
    assert_eq!(t.decode(&ids, false).unwrap(), "<bos>The capé<br><eos>");
    // Bytes that are not UTF-8: one U+FFFD per invalid sequence, the rest kept.
    assert_eq!(t.decode(&[8 + 0xFF, 4], true).unwrap(), "\u{fffd}The");
    assert_eq!(t.decode(&[8 + 0xC3], true).unwrap(), "\u{fffd}");
    // The stream gives the same text.
    assert_eq!(streamed(&t, &ids, true), "The capé<br>");
    let e = t.decode(&[4, 264], true).unwrap_err();
    assert!(matches!(e, TokenizerError::IdOutOfRange { id: 264, vocab_size: 264 }), "{e}");
}

#[test]
fn decode_drops_the_dummy_prefix() {
    let v = [
        ("▁", 0.0, NORMAL),
        ("t", 0.0, NORMAL),
        ("h", 0.0, NORMAL),
        ("e", 0.0, NORMAL),
        ("c", 0.0, NORMAL),
        ("a", 0.0, NORMAL),
        ("▁t", -3.0, NORMAL),
        ("▁th", -2.0, NORMAL),
        ("▁the", -1.0, NORMAL),
        ("▁c", -3.0, NORMAL),
        ("▁ca", -2.0, NORMAL),
        ("▁cat", -1.0, NORMAL),
    ];
    let mut vocab = spm_vocab(&v, true);
    vocab.add_space_prefix = Some(true);
    let t = Tokenizer::from_spm(vocab).unwrap();
    // "▁the▁cat": ▁t and ▁c tie at -3 (▁t is leftmost), then ▁th (-2) beats ▁c, ▁the (-1);
    // then ▁c, ▁ca, ▁cat.
    let ids = t.encode("the cat", true).unwrap();
    assert_eq!(texts(&t, &ids), ["<bos>", "▁the", "▁cat"]);
    assert_eq!(ids, [2, 12, 15]);
    assert_eq!(t.decode(&ids, true).unwrap(), "the cat");
    assert_eq!(t.decode(&ids[1..], true).unwrap(), "the cat");
    // Written out, <bos> comes first and the space stays (llama.cpp's detokenize).
    assert_eq!(t.decode(&ids, false).unwrap(), "<bos> the cat");
    // A stream after a prompt keeps the space of its first token.
    let mut s = t.decode_stream_after(&ids[..2], true).unwrap();
    assert_eq!(s.push(15).unwrap(), " cat");
}

#[test]
fn only_the_first_piece_loses_the_dummy_prefix() {
    let mut vocab = spm_vocab(&[("▁", 0.0, NORMAL), ("a", 0.0, NORMAL), ("▁a", 1.0, NORMAL)], true);
    vocab.add_space_prefix = Some(true);
    let t = Tokenizer::from_spm(vocab).unwrap();
    // " a" → "▁▁a": ▁▁ is no token, ▁a is → ▁ ▁a; the first piece's space goes, the second's stays.
    let ids = t.encode(" a", false).unwrap();
    assert_eq!(texts(&t, &ids), ["▁", "▁a"]);
    assert_eq!(t.decode(&ids, true).unwrap(), " a");
}

#[test]
fn the_stream_holds_bytes_until_a_character_is_complete() {
    let t = tok(&[("a", 0.0, NORMAL)]);
    let ids = t.encode("a😀a", false).unwrap();
    let mut s = t.decode_stream(true);
    let parts: Vec<String> = ids.iter().map(|&id| s.push(id).unwrap()).collect();
    assert_eq!(parts, ["a", "", "", "", "😀", "a"]);
    // Cut inside the emoji: finish reports the unfinished character.
    let mut s = t.decode_stream(true);
    assert_eq!(s.push(ids[1]).unwrap() + &s.push(ids[2]).unwrap() + &s.finish().unwrap(), "\u{fffd}");
    // A prompt ending inside a character: the stream after it completes the character.
    let mut s = t.decode_stream_after(&ids[..3], true).unwrap();
    assert_eq!(s.push(ids[3]).unwrap(), "");
    assert_eq!(s.push(ids[4]).unwrap(), "😀");
    assert!(matches!(t.decode_stream_after(&[9999], true), Err(TokenizerError::IdOutOfRange { .. })));
    assert!(matches!(s.push(9999), Err(TokenizerError::IdOutOfRange { .. })));
}

#[test]
fn malformed_vocabularies_are_refused() {
    let base = || spm_vocab(&[("a", 0.0, NORMAL)], false);
    let err = |v: SpmVocab| Tokenizer::from_spm(v).unwrap_err();

    let mut v = base();
    v.scores.pop();
    assert!(matches!(err(v), TokenizerError::LengthMismatch { field: "tokenizer.ggml.scores", expected: 5, got: 4 }));
    let mut v = base();
    v.token_types.push(NORMAL);
    assert!(matches!(
        err(v),
        TokenizerError::LengthMismatch { field: "tokenizer.ggml.token_type", expected: 5, got: 6 }
    ));
    let mut v = base();
    v.token_types[4] = 7;
    assert!(matches!(err(v), TokenizerError::BadTokenType { id: 4, value: 7, .. }));
    let mut v = base();
    v.scores[4] = f32::NAN;
    assert!(matches!(err(v), TokenizerError::NanScore { id: 4, .. }));
    let mut v = base();
    v.tokens[4] = "<bos>".into();
    assert!(matches!(err(v), TokenizerError::DuplicateToken { first: 2, second: 4, .. }));
    let mut v = base();
    v.token_types[4] = BYTE;
    assert!(matches!(err(v), TokenizerError::BadByteToken { id: 4, .. }));
    let mut v = base();
    v.bos = Some(5);
    let e = err(v);
    assert!(matches!(e, TokenizerError::SpecialIdOutOfRange { name: "BOS", id: 5, vocab_size: 5 }), "{e}");
    let mut v = base();
    v.eog = vec![7];
    assert!(matches!(err(v), TokenizerError::SpecialIdOutOfRange { name: "end-of-generation", id: 7, .. }));
    let mut v = base();
    v.unk = Some(70);
    assert!(matches!(err(v), TokenizerError::SpecialIdOutOfRange { name: "unknown", .. }));
    let mut v = base();
    v.bos = None;
    let e = err(v);
    assert!(matches!(e, TokenizerError::MissingSpecial { name: "BOS", .. }), "{e}");
    assert!(e.to_string().contains("tokenizer.ggml.bos_token_id"), "{e}");
    assert!(matches!(err(SpmVocab::default()), TokenizerError::EmptyVocab));
    // Absent scores and types are allowed: every score 0, every token normal.
    let mut v = base();
    (v.scores, v.token_types, v.add_bos) = (vec![], vec![], Some(false));
    let t = Tokenizer::from_spm(v).unwrap();
    // <bos> is a normal token now: matched by the merges, decoded as its text.
    assert_eq!(t.decode(&[2, 4], true).unwrap(), "<bos>a");
}
