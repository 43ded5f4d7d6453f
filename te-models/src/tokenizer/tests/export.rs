//! Export to `tokenizer.json`: the Hugging Face tokenizer read back from the exported files
//! encodes as the GGUF one (SentencePiece through derived merges, byte-level BPE as it is), on
//! hand-made vocabularies, random text and, when `.data/` holds it, Gemma 3's 262 144 tokens.

use std::path::Path;

use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;

/// Writes `t`'s Hugging Face files into a new directory and loads them back.
fn exported(t: &Tokenizer) -> (tempfile::TempDir, Tokenizer) {
    let dir = tempfile::tempdir().unwrap();
    t.save_hf_files(dir.path(), &HfTokenizerExtras::default()).unwrap();
    let back = Tokenizer::from_hf_dir(dir.path()).unwrap();
    (dir, back)
}

fn json_of(t: &Tokenizer) -> Value {
    serde_json::from_str(&t.to_hf_json().unwrap()).unwrap()
}

/// Pieces whose merges compete: "ab" and "bc" both merge "abc", scores decide.
fn spm(add_space_prefix: bool) -> Tokenizer {
    let pieces = [
        ("▁", -1.0, NORMAL),
        ("a", -2.0, NORMAL),
        ("b", -2.0, NORMAL),
        ("c", -2.0, NORMAL),
        ("ab", -3.0, NORMAL),
        ("bc", -1.5, NORMAL),
        ("abc", -0.5, NORMAL),
        ("▁a", -2.5, NORMAL),
        ("▁abc", -0.2, NORMAL),
        ("▁▁", -4.0, NORMAL),
        ("日", -5.0, NORMAL),
        ("本", -5.0, NORMAL),
        ("日本", -4.5, NORMAL),
        ("\n", -1.0, NORMAL),
        ("<start_of_turn>", 0.0, CONTROL),
        ("<html>", 0.0, USER),
        ("<unused0>", 0.0, UNUSED),
    ];
    let mut v = spm_vocab(&pieces, true);
    v.add_space_prefix = Some(add_space_prefix);
    Tokenizer::from_spm(v).unwrap()
}

#[test]
fn sentencepiece_becomes_a_byte_fallback_bpe() {
    let j = json_of(&spm(false));
    assert_eq!((j["model"]["type"].as_str(), &j["model"]["byte_fallback"]), (Some("BPE"), &json!(true)));
    assert_eq!(j["model"]["unk_token"], "<unk>");
    // Every split into two tokens, by score, longer left part first.
    let merges: Vec<Vec<String>> = serde_json::from_value(j["model"]["merges"].clone()).unwrap();
    let pairs: Vec<(&str, &str)> = merges.iter().map(|m| (m[0].as_str(), m[1].as_str())).collect();
    let want = [
        ("▁a", "bc"),
        ("▁", "abc"),
        ("ab", "c"),
        ("a", "bc"),
        ("b", "c"),
        ("▁", "a"),
        ("a", "b"),
        ("▁", "▁"),
        ("日", "本"),
    ];
    assert_eq!(pairs, want);
    assert_eq!(j["normalizer"], json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
    assert_eq!(j["post_processor"]["single"][0], json!({"SpecialToken": {"id": "<bos>", "type_id": 0}}));
    let added: Vec<(&str, bool)> = j["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["content"].as_str().unwrap(), t["special"] == true))
        .collect();
    assert_eq!(
        added,
        [
            ("<pad>", true),
            ("<eos>", true),
            ("<bos>", true),
            ("<unk>", true),
            ("<start_of_turn>", true),
            ("<html>", false)
        ]
    );
    let j = json_of(&spm(true));
    assert_eq!(j["normalizer"]["normalizers"][0], json!({"type": "Prepend", "prepend": "▁"}));
    assert_eq!(j["decoder"]["decoders"][3], json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
}

#[test]
fn the_exported_sentencepiece_encodes_the_same() {
    for prefix in [false, true] {
        let t = spm(prefix);
        let (_dir, back) = exported(&t);
        assert_eq!((back.bos_id(), back.add_bos(), back.eos_ids()), (t.bos_id(), t.add_bos(), t.eos_ids()));
        for text in ["abc", " abc abc", "ab c", "日本日", "<start_of_turn>abc<html>\n\nab", "  x\t😀 ", "", "<unused0>"]
        {
            let ids = t.encode(text, true).unwrap();
            assert_eq!(back.encode(text, true).unwrap(), ids, "prefix {prefix}, {text:?}");
            assert_eq!(back.decode(&ids, true).unwrap(), t.decode(&ids, true).unwrap(), "prefix {prefix}, {text:?}");
        }
    }
}

/// Text from pieces that merge, compete and fall back to bytes.
fn words() -> impl Strategy<Value = String> {
    let parts =
        vec!["abc", "ab", "bc", "a", " ", "  ", "c", "日本", "本", "é", "😀", "\n", "<html>", "<start_of_turn>", "x"];
    prop::collection::vec(prop::sample::select(parts), 0..20).prop_map(|p| p.concat())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_text_encodes_the_same_after_export(text in words(), prefix in any::<bool>()) {
        static TOKS: std::sync::LazyLock<Vec<(Tokenizer, Tokenizer, tempfile::TempDir)>> =
            std::sync::LazyLock::new(|| [false, true].map(|p| {
                let t = spm(p);
                let (dir, back) = exported(&t);
                (t, back, dir)
            }).into_iter().collect());
        let (t, back, _) = &TOKS[usize::from(prefix)];
        prop_assert_eq!(back.encode(&text, true).unwrap(), t.encode(&text, true).unwrap());
    }
}

#[test]
fn byte_level_bpe_exports_as_it_encodes() {
    let merged = ["He", "ll", "Hell", "Hello", "Ġw", "12", "123", "Ġworld"];
    let merges = ["H e", "l l", "He ll", "Hell o", "Ġ w", "1 2", "12 3"];
    for (pre, add_bos) in [("llama-bpe", true), ("qwen2", false), ("gpt-2", false)] {
        let v = BpeVocab {
            tokens: byte_level_tokens(&["<|begin_of_text|>", "<|eot_id|>"], &merged),
            token_types: [vec![CONTROL; 2], vec![NORMAL; 256 + merged.len()]].concat(),
            merges: merges.map(String::from).to_vec(),
            pre: Some(pre.into()),
            bos: Some(0),
            eos: Some(1),
            ..BpeVocab::default()
        };
        let t = Tokenizer::from_bpe(v).unwrap();
        let (_dir, back) = exported(&t);
        assert_eq!((back.add_bos(), back.bos_id()), (add_bos, Some(0)), "{pre}");
        for text in ["Hello world 12345", "<|begin_of_text|>Hello<|eot_id|>", " x  y\n\nz ü 😀", ""] {
            let ids = t.encode(text, true).unwrap();
            assert_eq!(back.encode(text, true).unwrap(), ids, "{pre} {text:?}");
            assert_eq!(back.decode(&ids, true).unwrap(), t.decode(&ids, true).unwrap(), "{pre} {text:?}");
        }
    }
}

#[test]
fn the_config_names_the_special_tokens() {
    let extras = HfTokenizerExtras { pad_token_id: Some(0), chat_template: Some("{{ messages }}".into()) };
    let c = spm(false).hf_tokenizer_config(&extras);
    assert_eq!(c["bos_token"], "<bos>");
    assert_eq!(
        (&c["eos_token"], &c["unk_token"], &c["pad_token"]),
        (&json!("<eos>"), &json!("<unk>"), &json!("<pad>"))
    );
    assert_eq!((&c["add_bos_token"], &c["add_eos_token"]), (&json!(true), &json!(false)));
    assert_eq!(c["chat_template"], "{{ messages }}");
    let e = spm(false).save_hf_files(Path::new("/nonexistent/dir"), &extras).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/dir/tokenizer.json"), "{e}");
}

/// Gemma 3 270M's GGUF vocabulary (`TE_GEMMA3_GGUF`, else `.data/gemma3-270m/`) exported: the
/// Hugging Face tokenizer gives the GGUF one's ids on varied text.
#[test]
fn gemma3_vocabulary_exports_with_the_same_ids() {
    let path = std::env::var_os("TE_GEMMA3_GGUF")
        .map(Into::into)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.data/gemma3-270m/gemma-3-270m-q4_k_m.gguf"));
    if !path.exists() {
        eprintln!("no Gemma 3 GGUF (scripts/fill-gemma, or TE_GEMMA3_GGUF): not compared");
        return;
    }
    let file = crate::gguf::GgufFile::open(&path).unwrap();
    let t = Tokenizer::from_gguf(file.metadata()).unwrap();
    let start = std::time::Instant::now();
    let dir = tempfile::tempdir().unwrap();
    t.save_hf_files(dir.path(), &HfTokenizerExtras::default()).unwrap();
    let written = start.elapsed();
    let back = Tokenizer::from_hf_dir(dir.path()).unwrap();
    assert_eq!((back.vocab_size(), back.bos_id(), back.add_bos()), (262_144, Some(2), true));
    assert_eq!(back.eos_ids(), t.eos_ids());
    assert_eq!(back.encode("The capital of France is", true).unwrap(), [2, 818, 5279, 529, 7001, 563]);
    let text = "Gemma 3 reads <b>HTML</b> too; naïve café façade — 東京は日本の首都です。 Привет, мир! \
                1234567 + 89 = 1234656.\n\t  indented   spaces 😀🦙\n\n\n<start_of_turn>user\nHi<end_of_turn>\n\
                fn main() {\n    println!(\"{}\", x[0] >= 1 && y != 'z');\n}\r\n  trailing  \u{a0}nbsp\u{200b}zw \
                ÀÉÎÕÜ ﬁ ½ ① 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 عربى हिन्दी ไทย 한국어 \u{1F1EB}\u{1F1F7} 👩‍👩‍👧";
    let ids = t.encode(text, true).unwrap();
    let start = std::time::Instant::now();
    let hf = back.encode(text, true).unwrap();
    let encode = start.elapsed();
    let first = ids.iter().zip(&hf).position(|(a, b)| a != b).unwrap_or(ids.len().min(hf.len()));
    assert_eq!(
        hf,
        ids,
        "first difference at {first}: {:?} vs {:?}",
        &hf[first.saturating_sub(2)..],
        &ids[first.saturating_sub(2)..]
    );
    assert_eq!(back.decode(&ids, true).unwrap(), t.decode(&ids, true).unwrap());
    let json: Value = serde_json::from_slice(&std::fs::read(dir.path().join("tokenizer.json")).unwrap()).unwrap();
    eprintln!(
        "Gemma 3: tokenizer.json with {} merges written in {written:?}; {} ids encoded in {encode:?}",
        json["model"]["merges"].as_array().unwrap().len(),
        ids.len()
    );
}
