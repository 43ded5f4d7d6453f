//! The `te` tool: concurrent prewarm processes sharing one cache, counts, errors, `te info`.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `te` binary: cargo's, or the packed one on the GPU machine (which has no cargo tree).
fn te() -> Command {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_te"));
    Command::new(if built.exists() { built } else { PathBuf::from(".gpu/bin/te") })
}

fn prewarm(cache: &std::path::Path, extra: &[&str]) -> Command {
    let mut c = te();
    c.args([
        "prewarm",
        "--hidden-size",
        "512",
        "--ffn-hidden-size",
        "2048",
        "--num-attention-heads",
        "8",
        "--jobs",
        "2",
    ])
    .args(extra)
    .env("TE_KERNEL_CACHE_DIR", cache)
    .env_remove("TE_KERNEL_CACHE_DISABLE");
    c
}

fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

#[test]
fn concurrent_prewarms_share_one_cache() {
    let dir = tempfile::tempdir().unwrap();
    let children: Vec<_> = (0..3).map(|_| prewarm(dir.path(), &[]).output()).collect();
    for c in children {
        let o = c.unwrap();
        assert!(o.status.success(), "{}", text(&o));
        assert!(text(&o).contains("already cached"), "{}", text(&o));
    }
    let o = prewarm(dir.path(), &[]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains(" 0 compiled"), "a warm cache compiles nothing: {}", text(&o));
}

#[test]
fn prewarm_reads_a_config_file() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("model.toml");
    std::fs::write(&cfg, "hidden_size = 256\nffn_hidden_size = 1024\nnum_attention_heads = 4\nactivation = \"swiglu\"\nnormalization = \"rmsnorm\"\nrecipe = \"current\"\n").unwrap();
    let o =
        prewarm(&dir.path().join("cache"), &["--config", cfg.to_str().unwrap(), "--arch", "sm_89"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("for sm_89"), "{}", text(&o));
}

#[test]
fn bad_configs_fail_with_a_message() {
    let dir = tempfile::tempdir().unwrap();
    let o = te()
        .args(["prewarm", "--hidden-size", "1000", "--ffn-hidden-size", "4096", "--num-attention-heads", "8"])
        .env("TE_KERNEL_CACHE_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("pad to 1008"), "{}", text(&o));
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "hidden_size = 256\n").unwrap();
    let o = te().args(["prewarm", "--config", cfg.to_str().unwrap()]).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("bad.toml") && text(&o).contains("ffn_hidden_size"), "{}", text(&o));
}

#[test]
fn info_reports_nvrtc_and_cache() {
    let dir = tempfile::tempdir().unwrap();
    let o = te().arg("info").env("TE_KERNEL_CACHE_DIR", dir.path()).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("nvrtc:") && t.contains(&dir.path().display().to_string()), "{t}");
}
