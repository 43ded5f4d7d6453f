//! `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`) through the loader.

use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::models::wordlevel::WordLevel;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

use super::*;

/// A GPT-2-style byte-level BPE with a `<s> $A` template, saved as `dir/tokenizer.json`:
/// `<s>` 0, `</s>` 1, bytes from 2, then He (258), ll (259), Hell (260), Hello (261).
fn write_bpe(dir: &Path) {
    let tokens = byte_level_tokens(&["<s>", "</s>"], &["He", "ll", "Hell", "Hello"]);
    let merges = [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o")];
    let bpe = BPE::builder()
        .vocab_and_merges(
            tokens.iter().cloned().zip(0u32..).collect::<tokenizers::models::bpe::Vocab>(),
            merges.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
        )
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevelDecoder::default()))
        .with_post_processor(Some(
            TemplateProcessing::builder()
                .try_single("<s> $A")
                .unwrap()
                .special_tokens(vec![("<s>", 0)])
                .build()
                .unwrap(),
        ));
    tok.add_special_tokens(&[AddedToken::from("<s>", true), AddedToken::from("</s>", true)]);
    tok.save(dir.join("tokenizer.json"), false).unwrap();
}

#[test]
fn saved_padding_and_truncation_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    write_bpe(dir.path());
    let path = dir.path().join("tokenizer.json");
    let mut tok = tokenizers::Tokenizer::from_file(&path).unwrap();
    tok.with_padding(Some(tokenizers::PaddingParams {
        strategy: tokenizers::PaddingStrategy::Fixed(16),
        pad_id: 1,
        pad_token: "</s>".into(),
        ..Default::default()
    }))
    .with_truncation(Some(tokenizers::TruncationParams { max_length: 2, ..Default::default() }))
    .unwrap();
    tok.save(&path, false).unwrap();
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    // <s> Hello Ġ w o r l d: neither cut to 2 nor padded to 16.
    assert_eq!(t.encode("Hello world", true).unwrap().len(), 8);
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

#[test]
fn tokenizer_json_alone_takes_bos_from_its_template() {
    let dir = tempfile::tempdir().unwrap();
    write_bpe(dir.path());
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!((t.bos_id(), t.add_bos(), t.add_eos()), (Some(0), true, false));
    // No configuration: the EOS is found by text.
    assert_eq!((t.eos_id(), t.eos_ids()), (Some(1), &[1][..]));
    assert_eq!(t.vocab_size(), 262);
    // "Hello world": <s>, Hello (four merges), then Ġ w o r l d, bytes (byte b is id 2 + b).
    let ids = t.encode("Hello world", true).unwrap();
    let byte = |c: char| 2 + u32::from(c as u8);
    assert_eq!(ids, [0, 261, byte(' '), byte('w'), byte('o'), byte('r'), byte('l'), byte('d')]);
    assert_eq!(t.decode(&ids, true).unwrap(), "Hello world");
    assert_eq!(t.decode(&ids, false).unwrap(), "<s>Hello world");
    assert_eq!(streamed(&t, &ids, true), "Hello world");
    assert_eq!(t.encode("", true).unwrap(), [0]);
    assert_eq!(t.token_to_id("Hello"), Some(261));
    assert_eq!(t.id_to_token(261).as_deref(), Some("Hello"));
    let e = t.decode(&[262], true).unwrap_err();
    assert!(matches!(e, TokenizerError::IdOutOfRange { id: 262, vocab_size: 262 }), "{e}");
}

#[test]
fn the_configurations_set_flags_and_eos_ids() {
    let dir = tempfile::tempdir().unwrap();
    write_bpe(dir.path());
    write(
        dir.path(),
        "tokenizer_config.json",
        r#"{"add_bos_token": false, "add_eos_token": true, "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#,
    );
    write(dir.path(), "generation_config.json", r#"{"bos_token_id": 0, "eos_token_id": [1, 260]}"#);
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!((t.bos_id(), t.add_bos(), t.add_eos()), (Some(0), false, true));
    assert_eq!(t.eos_ids(), [1, 260]);
    assert_eq!(t.encode("Hello", true).unwrap(), [261, 1]);
    assert_eq!(t.encode("Hello", false).unwrap(), [261]);
    // One EOS id, not a list.
    write(dir.path(), "generation_config.json", r#"{"eos_token_id": 260}"#);
    let t = Tokenizer::from_hf_files(
        &dir.path().join("tokenizer.json"),
        None,
        Some(&dir.path().join("generation_config.json")),
    )
    .unwrap();
    assert_eq!((t.eos_id(), t.eos_ids(), t.add_bos()), (Some(260), &[260][..], true));
}

#[test]
fn bad_files_name_what_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(&e, TokenizerError::MissingFile { path } if path.ends_with("tokenizer.json")), "{e}");
    write(dir.path(), "tokenizer.json", "{ not json");
    assert!(matches!(Tokenizer::from_hf_dir(dir.path()).unwrap_err(), TokenizerError::HfLoad { .. }));

    write_bpe(dir.path());
    let bad = |name: &str, text: &str| {
        write(dir.path(), name, text);
        let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
        std::fs::remove_file(dir.path().join(name)).unwrap();
        e
    };
    let e = bad("tokenizer_config.json", "{ not json");
    assert!(matches!(&e, TokenizerError::Json { path, .. } if path.ends_with("tokenizer_config.json")), "{e}");
    let e = bad("tokenizer_config.json", r#"{"add_bos_token": "yes"}"#);
    assert!(e.to_string().contains("`add_bos_token` must be true or false"), "{e}");
    let e = bad("tokenizer_config.json", r#"{"bos_token": 3}"#);
    assert!(e.to_string().contains("`bos_token` must be a string"), "{e}");
    let e = bad("tokenizer_config.json", r#"{"eos_token": "<|nope|>"}"#);
    assert!(
        matches!(&e, TokenizerError::SpecialNotInVocab { field: "eos_token", text, .. } if text == "<|nope|>"),
        "{e}"
    );
    let e = bad("generation_config.json", r#"{"eos_token_id": "x"}"#);
    assert!(e.to_string().contains("`eos_token_id` must be a token id"), "{e}");
    let e = bad("generation_config.json", r#"{"eos_token_id": [1, 9999]}"#);
    assert!(matches!(e, TokenizerError::SpecialIdOutOfRange { id: 9999, vocab_size: 262, .. }), "{e}");
}

/// A Llama-2-style tokenizer.json: Metaspace (▁, prepended once) and its decoder, which drops the
/// first space of a text.
fn write_metaspace(dir: &Path) {
    let vocab = ["<unk>", "<s>", "▁the", "▁cat"];
    let model = WordLevel::builder()
        .vocab(vocab.iter().map(|s| s.to_string()).zip(0u32..).collect())
        .unk_token("<unk>".into())
        .build()
        .unwrap();
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::First, true))).with_decoder(Some(Metaspace::new(
        '▁',
        PrependScheme::First,
        true,
    )));
    tok.add_special_tokens(&[AddedToken::from("<s>", true)]);
    // An HTML tag, as in Gemma's vocabulary: a plain added token, no end of generation.
    tok.add_tokens(&[AddedToken::from("</s>", false)]);
    tok.save(dir.join("tokenizer.json"), false).unwrap();
}

#[test]
fn a_stream_after_the_prompt_keeps_the_space() {
    let dir = tempfile::tempdir().unwrap();
    write_metaspace(dir.path());
    write(dir.path(), "tokenizer_config.json", r#"{"add_bos_token": true, "bos_token": "<s>"}"#);
    let t = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!((t.eos_ids(), t.token_to_id("</s>")), (&[][..], Some(4)));
    let ids = t.encode("the cat", true).unwrap();
    assert_eq!(ids, [1, 2, 3]);
    assert_eq!(t.decode(&ids, true).unwrap(), "the cat");
    assert_eq!(streamed(&t, &ids, true), "the cat");
    // From the start the decoder drops the first space; after a prompt it is kept.
    let mut s = t.decode_stream(true);
    assert_eq!(s.push(3).unwrap(), "cat");
    let mut s = t.decode_stream_after(&ids[..2], true).unwrap();
    assert_eq!(s.push(3).unwrap(), " cat");
    assert_eq!(s.push(2).unwrap(), " the");
    assert_eq!(s.finish().unwrap(), "");
    // No EOS token anywhere: asking to append one is an error.
    write(dir.path(), "tokenizer_config.json", r#"{"add_eos_token": true}"#);
    let e = Tokenizer::from_hf_dir(dir.path()).unwrap_err();
    assert!(matches!(e, TokenizerError::MissingSpecial { name: "EOS", .. }), "{e}");
}

/// Damaged Hugging Face tokenizer files (te-nn's checkpoint mutations: bytes flipped, the file
/// cut short, grown, replaced or kept) through `Tokenizer::from_hf_dir`: `tokenizer.json`,
/// `tokenizer_config.json` and `generation_config.json` each load or are refused with a typed
/// error, and a tokenizer that loads encodes and decodes (or refuses to) without a panic.
mod fuzz {
    use super::*;
    use proptest::prelude::*;
    use te_nn::checkpoint::fuzz::{mutation, Mutation};

    const CONFIG: &str =
        r#"{"add_bos_token": true, "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>"}"#;
    const GENERATION: &str = r#"{"bos_token_id": 0, "eos_token_id": [1, 260]}"#;

    /// The three files, the one named `damaged` through `m`.
    fn loads_or_is_refused(damaged: &str, m: &Mutation) -> Result<(), TestCaseError> {
        let dir = tempfile::tempdir().unwrap();
        write_bpe(dir.path());
        write(dir.path(), "tokenizer_config.json", CONFIG);
        write(dir.path(), "generation_config.json", GENERATION);
        let path = dir.path().join(damaged);
        std::fs::write(&path, m.apply(std::fs::read(&path).unwrap())).unwrap();
        match Tokenizer::from_hf_dir(dir.path()) {
            Ok(t) => {
                if let Ok(ids) = t.encode("Hello world, héllo", true) {
                    let _ = t.decode(&ids, false);
                }
                let _ = t.decode(&[0, 1, 2, 260, 261, u32::MAX], true);
            }
            Err(e) => prop_assert!(!e.to_string().is_empty()),
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 400, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn damaged_tokenizer_json_loads_or_is_refused(m in mutation()) {
            loads_or_is_refused("tokenizer.json", &m)?;
        }

        #[test]
        fn damaged_tokenizer_config_loads_or_is_refused(m in mutation()) {
            loads_or_is_refused("tokenizer_config.json", &m)?;
        }

        #[test]
        fn damaged_generation_config_loads_or_is_refused(m in mutation()) {
            loads_or_is_refused("generation_config.json", &m)?;
        }
    }
}
