//! Real GGUF vocabularies, when present (neither is part of this repository; without them the
//! tests only say so):
//! - llama.cpp's own tokenizer fixtures: `models/ggml-vocab-<name>.gguf` (vocabulary-only GGUF
//!   files) with `.gguf.inp` (texts separated by `\n__ggml_vocab_test__\n`) and `.gguf.out` (the
//!   ids llama.cpp gives each text, `add_special` false; tests/test-tokenizer-0.cpp): set
//!   `TE_LLAMA_CPP_VOCABS` to a directory holding them (a llama.cpp checkout's `models/`);
//! - Gemma 3 270M's GGUF, issue 33's model (`scripts/fill-gemma` puts it in `.data/`, or set
//!   `TE_GEMMA3_GGUF`): llama.cpp's ids for "The capital of France is".

use std::collections::HashMap;
use std::path::Path;

use super::*;

/// A GGUF metadata value, as much as a vocabulary needs.
#[derive(Debug, Clone)]
enum Value {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

/// A minimal reader of GGUF's key-value section (version 2/3, little-endian), for these fixtures
/// only: the crate's GGUF reader lives elsewhere.
fn read_metadata(bytes: &[u8]) -> HashMap<String, Value> {
    let mut at = 0usize;
    let mut take = |n: usize| {
        let s = &bytes[at..at + n];
        at += n;
        s
    };
    assert_eq!(take(4), b"GGUF");
    let _version = u32::from_le_bytes(take(4).try_into().unwrap());
    let _tensors = u64::from_le_bytes(take(8).try_into().unwrap());
    let count = u64::from_le_bytes(take(8).try_into().unwrap());
    fn string(take: &mut impl FnMut(usize) -> Vec<u8>) -> String {
        let n = u64::from_le_bytes(take(8).try_into().unwrap()) as usize;
        String::from_utf8(take(n)).unwrap()
    }
    fn value(ty: u32, take: &mut impl FnMut(usize) -> Vec<u8>) -> Value {
        let mut int = |n: usize, signed: bool| {
            let b = take(n);
            let mut buf = [if signed && b[n - 1] & 0x80 != 0 { 0xff } else { 0 }; 8];
            buf[..n].copy_from_slice(&b);
            Value::Int(i64::from_le_bytes(buf))
        };
        match ty {
            0 => int(1, false),
            1 => int(1, true),
            2 => int(2, false),
            3 => int(2, true),
            4 => int(4, false),
            5 => int(4, true),
            6 => Value::Float(f64::from(f32::from_le_bytes(take(4).try_into().unwrap()))),
            7 => Value::Bool(take(1)[0] != 0),
            8 => Value::Str(string(take)),
            9 => {
                let inner = u32::from_le_bytes(take(4).try_into().unwrap());
                let n = u64::from_le_bytes(take(8).try_into().unwrap()) as usize;
                Value::Array((0..n).map(|_| value(inner, take)).collect())
            }
            10 | 11 => int(8, ty == 11),
            12 => Value::Float(f64::from_le_bytes(take(8).try_into().unwrap())),
            _ => panic!("GGUF value type {ty}"),
        }
    }
    let mut take = |n: usize| take(n).to_vec();
    (0..count)
        .map(|_| {
            let key = string(&mut take);
            let ty = u32::from_le_bytes(take(4).try_into().unwrap());
            (key, value(ty, &mut take))
        })
        .collect()
}

/// The tokenizer of a vocabulary-only GGUF, as the GGUF loader will build it.
fn tokenizer(meta: &HashMap<String, Value>) -> Result<Tokenizer, TokenizerError> {
    let strings = |k: &str| match meta.get(k) {
        Some(Value::Array(a)) => {
            a.iter().map(|v| if let Value::Str(s) = v { s.clone() } else { panic!("{k}") }).collect()
        }
        _ => Vec::new(),
    };
    let ints = |k: &str| match meta.get(k) {
        Some(Value::Array(a)) => a.iter().map(|v| if let Value::Int(i) = v { *i } else { panic!("{k}") }).collect(),
        _ => Vec::<i64>::new(),
    };
    let id = |k: &str| match meta.get(k) {
        Some(Value::Int(i)) => Some(*i as u32),
        _ => None,
    };
    let flag = |k: &str| match meta.get(k) {
        Some(Value::Bool(b)) => Some(*b),
        _ => None,
    };
    let tokens = strings("tokenizer.ggml.tokens");
    let token_types = ints("tokenizer.ggml.token_type").into_iter().map(|t| t as i32).collect();
    let eog = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"].iter().filter_map(|k| id(k)).collect();
    match meta.get("tokenizer.ggml.model") {
        Some(Value::Str(m)) if m == "llama" => {
            let scores = match meta.get("tokenizer.ggml.scores") {
                Some(Value::Array(a)) => {
                    a.iter().map(|v| if let Value::Float(f) = v { *f as f32 } else { panic!() }).collect()
                }
                _ => Vec::new(),
            };
            Tokenizer::from_spm(SpmVocab {
                tokens,
                scores,
                token_types,
                bos: id("tokenizer.ggml.bos_token_id"),
                eos: id("tokenizer.ggml.eos_token_id"),
                unk: id("tokenizer.ggml.unknown_token_id"),
                eog,
                add_bos: flag("tokenizer.ggml.add_bos_token"),
                add_eos: flag("tokenizer.ggml.add_eos_token"),
                add_space_prefix: flag("tokenizer.ggml.add_space_prefix"),
            })
        }
        Some(Value::Str(m)) if m == "gpt2" => Tokenizer::from_bpe(BpeVocab {
            tokens,
            token_types,
            merges: strings("tokenizer.ggml.merges"),
            pre: match meta.get("tokenizer.ggml.pre") {
                Some(Value::Str(p)) => Some(p.clone()),
                _ => None,
            },
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            eog,
            add_bos: flag("tokenizer.ggml.add_bos_token"),
            add_eos: flag("tokenizer.ggml.add_eos_token"),
        }),
        other => Err(TokenizerError::Unsupported { message: format!("model {other:?}") }),
    }
}

/// Compares one fixture; returns the number of texts and the mismatches.
fn compare(dir: &Path, name: &str) -> (usize, Vec<String>) {
    let path = dir.join(format!("ggml-vocab-{name}.gguf"));
    let meta = read_metadata(&std::fs::read(&path).unwrap());
    let t = match tokenizer(&meta) {
        Ok(t) => t,
        Err(e) => return (0, vec![format!("{name}: {e}")]),
    };
    let inp = std::fs::read_to_string(path.with_extension("gguf.inp")).unwrap();
    let out = std::fs::read_to_string(path.with_extension("gguf.out")).unwrap();
    let sep = "\n__ggml_vocab_test__\n";
    let mut texts: Vec<&str> = inp.split(sep).collect();
    // test-tokenizer-0 stops at the end of the text: a final separator opens no text.
    if inp.ends_with(sep) {
        texts.pop();
    }
    let expected: Vec<Vec<u32>> =
        out.lines().map(|l| l.split_whitespace().map(|i| i.parse().unwrap()).collect()).collect();
    assert_eq!(texts.len(), expected.len(), "{name}: fixture texts and outputs");
    let mut bad = Vec::new();
    for (text, want) in texts.iter().zip(&expected) {
        let got = t.encode(text, false).unwrap();
        if &got != want {
            bad.push(format!("{name}: {text:?}\n  llama.cpp {want:?}\n  here      {got:?}"));
        }
        let back = t.decode(&got, true).unwrap();
        if back != *text {
            bad.push(format!("{name}: {text:?} decodes to {back:?}"));
        }
    }
    (texts.len(), bad)
}

#[test]
fn llama_cpp_fixtures() {
    let Some(dir) = std::env::var_os("TE_LLAMA_CPP_VOCABS") else {
        eprintln!("TE_LLAMA_CPP_VOCABS is not set: llama.cpp's tokenizer fixtures are not compared");
        return;
    };
    let dir = Path::new(&dir);
    let mut all_bad = Vec::new();
    for name in ["llama-spm", "phi-3", "gpt-2", "mpt", "starcoder", "refact", "falcon", "deepseek-coder"] {
        if !dir.join(format!("ggml-vocab-{name}.gguf")).exists()
            || !dir.join(format!("ggml-vocab-{name}.gguf.out")).exists()
        {
            eprintln!("{name}: fixture absent");
            continue;
        }
        let (n, bad) = compare(dir, name);
        eprintln!("{name}: {n} texts, {} mismatches (ids as llama.cpp, decoded back to the text)", bad.len());
        all_bad.extend(bad);
    }
    assert!(all_bad.is_empty(), "{}", all_bad.join("\n"));
}

/// Gemma 3 270M's GGUF (issue 33's model, `scripts/fill-gemma`): `TE_GEMMA3_GGUF`, else the
/// workspace's `.data/gemma3-270m/gemma-3-270m-q4_k_m.gguf`.
fn gemma3_path() -> Option<std::path::PathBuf> {
    let path = std::env::var_os("TE_GEMMA3_GGUF")
        .map(Into::into)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.data/gemma3-270m/gemma-3-270m-q4_k_m.gguf"));
    path.exists().then_some(path)
}

#[test]
fn gemma3_vocabulary() {
    use std::io::Read;
    let Some(path) = gemma3_path() else {
        eprintln!("no Gemma 3 GGUF (scripts/fill-gemma, or TE_GEMMA3_GGUF): not compared");
        return;
    };
    // The metadata is at the start: the tokenizer's arrays are a few MB of the 253 MB.
    let mut head = Vec::new();
    std::fs::File::open(&path).unwrap().take(32 << 20).read_to_end(&mut head).unwrap();
    let meta = read_metadata(&head);
    let start = std::time::Instant::now();
    let t = tokenizer(&meta).unwrap();
    let build = start.elapsed();
    assert_eq!((t.vocab_size(), t.bos_id(), t.add_bos(), t.add_eos()), (262_144, Some(2), true, false));
    // <eos> and <end_of_turn>; not the user-defined HTML tag </s> (212).
    assert_eq!(t.eos_ids(), [1, 106]);
    // llama.cpp's tokenization of issue 33's prompt.
    let ids = t.encode("The capital of France is", true).unwrap();
    assert_eq!(ids, [2, 818, 5279, 529, 7001, 563]);
    assert_eq!(texts(&t, &ids), ["<bos>", "The", "▁capital", "▁of", "▁France", "▁is"]);
    assert_eq!(t.decode(&ids, true).unwrap(), "The capital of France is");
    // A chat turn: control tokens written in the text are matched whole.
    let chat = t.encode("<start_of_turn>user\nHi<end_of_turn>\n", false).unwrap();
    assert_eq!((chat[0], chat[chat.len() - 2]), (105, 106));

    let paragraph = "Gemma 3 reads <b>HTML</b> too; naïve café façade — 東京は日本の首都です。 \
                     Привет, мир! 1234567 + 89 = 1234656.\n\t  indented   spaces 😀🦙\n";
    let text = paragraph.repeat(if cfg!(debug_assertions) { 1_000 } else { 10_000 });
    let start = std::time::Instant::now();
    let ids = t.encode(&text, false).unwrap();
    let encode = start.elapsed();
    assert_eq!(t.decode(&ids, true).unwrap(), text);
    eprintln!("Gemma 3: build {build:?}; {} bytes → {} ids in {encode:?}", text.len(), ids.len());
}
