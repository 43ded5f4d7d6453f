//! The `te` tool: concurrent prewarm processes sharing one cache, counts, errors, `te info`;
//! `te generate --model` and `te eval` in the `model` module.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Output};

#[path = "cli/model.rs"]
mod model;

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
fn prewarm_fails_when_the_cache_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    let o = prewarm(&file, &[]).output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(!o.status.success(), "nothing was persisted: {}", text(&o));
    assert!(!stdout.contains("prewarmed"), "claims success: {}", text(&o));
    let why = format!("cannot write the kernel cache at {}: it is not a directory", file.display());
    assert!(stderr.contains(&why) && stderr.contains("set TE_KERNEL_CACHE_DIR to a writable directory"), "{stderr}");
    // A line per kernel, after the count.
    let failed = stderr.lines().filter(|l| l.starts_with("  te_") && l.contains(&why)).count();
    assert!(
        failed > 1 && stderr.contains(&format!("error: {failed} of {failed} kernels were not prewarmed")),
        "{stderr}"
    );
    assert!(std::fs::read(&file).unwrap() == b"x", "the file is left alone");

    // --cache-dir wins over the environment: the message says so.
    let o = prewarm(&dir.path().join("unused"), &["--cache-dir", file.to_str().unwrap()]).output().unwrap();
    assert!(!o.status.success() && !String::from_utf8_lossy(&o.stdout).contains("prewarmed"), "{}", text(&o));
    assert!(text(&o).contains(&why) && text(&o).contains("--cache-dir"), "{}", text(&o));
    assert!(!dir.path().join("unused").exists(), "{}", text(&o));
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
    assert!(text(&o).contains("pad it to 1008"), "{}", text(&o));
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "hidden_size = 256\n").unwrap();
    let o = te().args(["prewarm", "--config", cfg.to_str().unwrap()]).output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("bad.toml") && text(&o).contains("ffn_hidden_size"), "{}", text(&o));
}

/// `--recipe` takes the recipe parser's names (short or TE's class names); the recipe flags
/// apply on top, and a flag the recipe does not have fails before anything is compiled.
#[test]
fn prewarm_recipe_flags_go_through_the_recipe_parser() {
    let dir = tempfile::tempdir().unwrap();
    let fails = |extra: &[&str], want: &[&str]| {
        let o = prewarm(dir.path(), extra).output().unwrap();
        assert!(!o.status.success() && !text(&o).contains("prewarmed"), "{extra:?}: {}", text(&o));
        for w in want {
            assert!(text(&o).contains(w), "{extra:?}: no `{w}` in {}", text(&o));
        }
    };
    fails(&["--recipe", "mxfp8"], &["unknown recipe `mxfp8`", "delayed, current or block", "Float8BlockScaling"]);
    fails(&["--recipe", "Float8BlockScaling", "--fp8-dpa"], &["Float8BlockScaling (block) has no fp8_dpa"]);
    fails(&["--recipe", "current", "--amax-compute-algo", "most_recent"], &["has no amax_compute_algo"]);
    fails(&["--fp8-format", "e5m2"], &["expected hybrid or e4m3"]);
    let cfg = dir.path().join("model.toml");
    std::fs::write(&cfg, "hidden_size = 256\nffn_hidden_size = 1024\nnum_attention_heads = 4\nfp8_dpa = true\n")
        .unwrap();
    fails(&["--config", cfg.to_str().unwrap(), "--recipe", "block"], &["model.toml", "has no fp8_dpa"]);
}

#[test]
fn info_reports_nvrtc_and_cache() {
    let dir = tempfile::tempdir().unwrap();
    let o = te().arg("info").env("TE_KERNEL_CACHE_DIR", dir.path()).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("nvrtc:") && t.contains(&dir.path().display().to_string()), "{t}");
}

#[test]
fn train_tiny_runs_on_the_cpu_and_writes_its_results() {
    let dir = tempfile::tempdir().unwrap();
    let corpus: String = (0..400).map(|i| format!("line {i}: to be or not to be, that is the question.\n")).collect();
    std::fs::write(dir.path().join("text.txt"), corpus).unwrap();
    let out = dir.path().join("out");
    let o = te()
        .args(["train", "--cpu", "--preset", "tiny", "--steps", "3", "--batch", "2", "--seq-length", "32"])
        .args(["--eval-interval", "3", "--data"])
        .arg(dir.path().join("text.txt"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("CPU reference path"), "says where it runs: {}", text(&o));
    for f in ["loss.csv", "loss.png", "summary.md"] {
        assert!(out.join(f).exists(), "{f} written: {}", text(&o));
    }
    let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 2 * 3, "a header and 3 steps per precision: {csv}");
    for p in ["fp8", "bf16"] {
        assert!(out.join("checkpoints").join(p).join("latest.toml").exists(), "{p} checkpoint written");
    }
    generate_samples_from_the_checkpoint(&out);
    split_and_merge_the_checkpoint(&out);
    // Current scaling on the CPU path too (each GEMM operand scaled by its own amax); its
    // checkpoint samples with the recipe it records.
    let current = dir.path().join("current");
    let o = te()
        .args(["train", "--cpu", "--preset", "tiny", "--steps", "2", "--batch", "2", "--seq-length", "32"])
        .args(["--recipe", "current", "--precision", "fp8", "--data"])
        .arg(dir.path().join("text.txt"))
        .arg("--out")
        .arg(&current)
        .output()
        .unwrap();
    assert!(o.status.success() && text(&o).contains("FP8 with current scaling"), "{}", text(&o));
    let o = te()
        .args(["generate", "--cpu", "--max-new-tokens", "4", "--prompt", "to be", "--checkpoint"])
        .arg(current.join("checkpoints/fp8/latest"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

/// `te checkpoint split` into 2 tensor-parallel ranks' files and `merge` back: the merged
/// checkpoint samples the original's text; a split one is refused where it cannot be used;
/// sizes that do not divide the heads are refused.
fn split_and_merge_the_checkpoint(out: &std::path::Path) {
    let step = out.join("checkpoints/fp8/step-0000003");
    let (split, merged) = (out.join("split"), out.join("merged"));
    let o = te()
        .args(["checkpoint", "split", "--tensor-parallel", "2"])
        .arg(&step)
        .arg("--out")
        .arg(&split)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for f in
        ["model.tp-0-of-2.safetensors", "model.tp-1-of-2.safetensors", "optimizer.tp-1-of-2.safetensors", "history.csv"]
    {
        assert!(split.join(f).exists(), "{f}: {}", text(&o));
    }
    let toml = std::fs::read_to_string(split.join("trainer.toml")).unwrap();
    assert!(toml.contains("tensor_parallel = 2"), "{toml}");
    let sample = |dir: &std::path::Path| {
        te().args(["generate", "--cpu", "--prompt", "to be", "--max-new-tokens", "12", "--seed", "5", "--checkpoint"])
            .arg(dir)
            .output()
            .unwrap()
    };
    let o = sample(&split);
    assert!(!o.status.success() && text(&o).contains("merge it first"), "{}", text(&o));
    let o = te().args(["checkpoint", "merge"]).arg(&split).arg("--out").arg(&merged).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let (a, b) = (sample(&step), sample(&merged));
    assert!(a.status.success() && b.status.success(), "{}{}", text(&a), text(&b));
    assert_eq!(a.stdout, b.stdout, "the merged checkpoint is the original");
    let o = te()
        .args(["checkpoint", "split", "--tensor-parallel", "3"])
        .arg(&step)
        .arg("--out")
        .arg(out.join("x"))
        .output()
        .unwrap();
    assert!(!o.status.success() && text(&o).contains("does not split over 3"), "{}", text(&o));
    let o = te().args(["checkpoint", "merge"]).arg(&step).arg("--out").arg(out.join("y")).output().unwrap();
    assert!(!o.status.success() && text(&o).contains("not a tensor-parallel checkpoint"), "{}", text(&o));
}

/// `te generate` on the checkpoints of a CPU run: the prompt and the new tokens on stdout, the
/// speeds on stderr, the same text for the same seed, every precision and way of naming the
/// checkpoint; typed errors for what does not fit.
fn generate_samples_from_the_checkpoint(out: &std::path::Path) {
    // The CPU path wherever the test runs (--cpu), the GPU path where there is one.
    let generate = |args: &[&str]| te().args(["generate", "--cpu"]).args(args).output().unwrap();
    let fp8 = out.join("checkpoints/fp8/latest");
    let fp8 = fp8.to_str().unwrap();
    let a = generate(&["--checkpoint", fp8, "--prompt", "to be", "--max-new-tokens", "20", "--seed", "3"]);
    assert!(a.status.success(), "{}", text(&a));
    assert!(a.stdout.starts_with(b"to be") && a.stdout.len() > 20, "{}", text(&a));
    let err = String::from_utf8_lossy(&a.stderr);
    assert!(
        err.contains("fp8 precision") && err.contains("prefill 5 tokens") && err.contains("decode 19 steps"),
        "{err}"
    );
    let b = generate(&["--checkpoint", fp8, "--prompt", "to be", "--max-new-tokens", "20", "--seed", "3"]);
    assert_eq!(a.stdout, b.stdout, "the same seed gives the same text");
    // A run's directory, the output directory with --precision, a step directory; BF16 and
    // greedy, a batch of samples, a BF16 run in FP8 (calibrated).
    let step = out.join("checkpoints/bf16/step-0000003");
    let out_dir = out.to_str().unwrap();
    for args in [
        vec!["--checkpoint", out_dir, "--precision", "bf16", "--temperature", "0"],
        vec!["--checkpoint", step.to_str().unwrap(), "--batch", "3", "--top-k", "5", "--top-p", "0.9"],
        vec!["--checkpoint", step.to_str().unwrap(), "--precision", "fp8"],
    ] {
        let o = generate(&[&args[..], &["--prompt", "line", "--max-new-tokens", "8"]].concat());
        assert!(o.status.success() && o.stdout.starts_with(b"line"), "{args:?}: {}", text(&o));
    }
    let errors: [(&[&str], &str); 5] = [
        (&["--checkpoint", out_dir, "--prompt", "x"], "name one"),
        (&["--checkpoint", fp8, "--prompt", &"x".repeat(32)], "context is 32 tokens"),
        (&["--checkpoint", fp8, "--prompt", "x", "--max-new-tokens", "40"], "at most 31 new tokens"),
        (&["--checkpoint", fp8, "--prompt", "x", "--batch", "0"], "--batch 0"),
        (&["--checkpoint", "/nonexistent", "--prompt", "x"], "no such file"),
    ];
    for (args, want) in errors {
        let o = generate(args);
        assert!(!o.status.success() && text(&o).contains(want), "{args:?}: {}", text(&o));
        assert!(o.stdout.is_empty(), "nothing written before the error: {}", text(&o));
    }
    if te_runtime::device::gpu_available() {
        let gpu = |args: &[&str]| te().arg("generate").args(args).output().unwrap();
        let o = gpu(&["--checkpoint", fp8, "--prompt", "to be", "--max-new-tokens", "20", "--batch", "2"]);
        assert!(o.status.success() && o.stdout.starts_with(b"to be"), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("bf16 precision on") && err.contains("CUDA graphs") && err.contains("decode 19 steps"),
            "{err}"
        );
        let o = gpu(&["--checkpoint", fp8, "--prompt", "x", "--precision", "fp8"]);
        assert!(!o.status.success() && text(&o).contains("--cpu"), "{}", text(&o));
    }
}

/// SIGTERM (preemption) lets `te train` finish its step, write its checkpoint and exit with
/// status 75; a second signal exits at once.
#[test]
fn train_stops_cleanly_on_sigterm() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let corpus: String = (0..400).map(|i| format!("line {i}: to be or not to be, that is the question.\n")).collect();
    std::fs::write(dir.path().join("text.txt"), corpus).unwrap();
    let spawn = || {
        // Steps long enough that two signals 5 ms apart land in one: 16 384 tokens, about 1.1 s on
        // 2 cores and a good 100 ms on 16 (16 × 128 tokens took under 50 ms a step on the GPU
        // machine's cores, and the second signal of a 50 ms gap came after the clean stop).
        te().args(["train", "--cpu", "--preset", "tiny", "--steps", "100000", "--batch", "64", "--seq-length", "256"])
            .args(["--precision", "bf16", "--data"])
            .arg(dir.path().join("text.txt"))
            .arg("--out")
            .arg(dir.path().join("out"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Signals from this process (libc::kill), not a `kill` child: on a loaded machine spawning
    // one can take longer than the clean stop, and the second signal then came after the exit.
    let signal = |pid: u32, n: usize| {
        for i in 0..n {
            if i > 0 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            // SAFETY: kill(2) with the pid of our own child and SIGTERM; no memory is involved.
            let rc = unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
            assert_eq!(rc, 0, "kill -TERM {pid}");
        }
    };
    // Once the first line is out, training is under way and the handler installed.
    let mut child = spawn();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    assert!(first.contains("CPU reference path"), "{first}");
    std::thread::sleep(std::time::Duration::from_millis(500));
    signal(child.id(), 1);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(75), "{}", text(&o));
    assert!(text(&o).contains("stopped on request after step"), "{}", text(&o));
    assert!(text(&o).contains("checkpoint written at") && dir.path().join("out/checkpoints/bf16/latest.toml").exists());
    // Two signals: the second exits at once (128 + SIGTERM).
    let mut child = spawn();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    signal(child.id(), 2);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(143), "{status:?}");
}

/// SIGKILL at random points (mid-step, mid-checkpoint-save: a checkpoint every step), 20
/// times on the GPU path (8 on the slower CPU path, which runs without a GPU), each run
/// resuming the one before: no partial checkpoint is ever loaded, and the loss curve of the run
/// finished at last equals an uninterrupted run's bit for bit.
#[test]
fn train_survives_sigkill_at_random_points() {
    use rand::{Rng, SeedableRng};
    let gpu = te_runtime::device::gpu_available();
    if !gpu {
        assert_ne!(std::env::var("TE_REQUIRE_GPU").as_deref(), Ok("1"), "TE_REQUIRE_GPU=1 but no GPU");
    }
    // (arguments, kills): about 60 ms a step on the CPU path with a checkpoint each step.
    let (shape, kills_wanted): (&[&str], usize) = if gpu {
        (&["--steps", "3000", "--batch", "4", "--seq-length", "64"], 20)
    } else {
        (&["--cpu", "--steps", "60", "--batch", "2", "--seq-length", "32"], 8)
    };
    let dir = tempfile::tempdir().unwrap();
    let corpus: String = (0..2000).map(|i| format!("line {i}: to be or not to be, that is the question.\n")).collect();
    let data = dir.path().join("text.txt");
    std::fs::write(&data, corpus).unwrap();
    let run = |out: &std::path::Path| {
        let mut c = te();
        c.args(["train", "--preset", "tiny"])
            .args(shape)
            .args(["--precision", "bf16", "--checkpoint-interval", "1", "--eval-interval", "500", "--resume"])
            .arg("--data")
            .arg(&data)
            .arg("--out")
            .arg(out)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped());
        c
    };
    // The loss curve without the step times: (precision, step, train, val) per row.
    let curve = |out: &std::path::Path| -> Vec<String> {
        let csv = std::fs::read_to_string(out.join("loss.csv")).unwrap();
        csv.lines().map(|l| l.split(',').take(4).collect::<Vec<_>>().join(",")).collect()
    };
    let straight = dir.path().join("straight");
    let o = run(&straight).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let killed = dir.path().join("killed");
    let mut rng = rand::rngs::StdRng::seed_from_u64(20);
    let mut kills = 0;
    for _ in 0..kills_wanted {
        let mut child = run(&killed).spawn().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(rng.random_range(200..1500)));
        match child.try_wait().unwrap() {
            // Finished (or failed) before the kill: a resumed run must never fail.
            Some(status) => {
                let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap_or_default();
                assert!(status.success(), "a resumed run failed: {err}");
            }
            None => {
                child.kill().unwrap();
                child.wait().unwrap();
                kills += 1;
            }
        }
    }
    assert_eq!(kills, kills_wanted, "runs finished before they were killed: make the run longer");
    let o = run(&killed).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(curve(&killed), curve(&straight), "the curve of a run killed {kills} times differs");
}

#[test]
fn train_refuses_what_it_cannot_run() {
    let run = |args: &[&str]| te().arg("train").args(args).output().unwrap();
    let o = run(&["--cpu", "--preset", "small"]);
    assert!(!o.status.success() && text(&o).contains("--cpu runs the tiny preset only"), "{}", text(&o));
    if !te_runtime::device::gpu_available() {
        let o = run(&["--preset", "large"]);
        assert!(!o.status.success() && text(&o).contains("needs a CUDA GPU"), "{}", text(&o));
    }
    // Training a decoder from scratch needs its configuration and tokenizer (--model).
    let o = run(&["--cpu", "--init", "random"]);
    assert!(!o.status.success() && text(&o).contains("--init random goes with --model PATH"), "{}", text(&o));
    let o = run(&["--init", "zeros"]);
    assert!(o.status.code() == Some(2) && text(&o).contains("[possible values: pretrained, random]"), "{}", text(&o));
    // Data parallelism: one process a GPU; the CPU path runs one, and bad launch options say why.
    let o = run(&["--cpu", "--nproc-per-node", "2"]);
    assert!(!o.status.success() && text(&o).contains("one process a GPU"), "{}", text(&o));
    let o = run(&["--nproc-per-node", "0"]);
    assert!(!o.status.success() && text(&o).contains("--nproc-per-node"), "{}", text(&o));
    // Tensor parallelism needs as many ranks; sequence parallelism needs tensor parallelism.
    let o = run(&["--cpu", "--tensor-parallel", "2", "--steps", "1"]);
    assert!(!o.status.success() && text(&o).contains("--tensor-parallel 2 needs as many ranks"), "{}", text(&o));
    let o = run(&["--cpu", "--sequence-parallel", "--steps", "1"]);
    assert!(!o.status.success() && text(&o).contains("--sequence-parallel needs"), "{}", text(&o));
    let o = run(&["--cpu", "--tp-comm-overlap", "--steps", "1"]);
    assert!(!o.status.success() && text(&o).contains("--tp-comm-overlap overlaps"), "{}", text(&o));
    // Activation offload runs on a GPU, with --recompute full.
    let o = run(&["--cpu", "--offload-activations", "2", "--steps", "1"]);
    assert!(!o.status.success() && text(&o).contains("drop --offload-activations"), "{}", text(&o));
    if te_runtime::device::gpu_available() {
        let o = run(&["--preset", "tiny", "--offload-activations", "2", "--steps", "1"]);
        assert!(!o.status.success() && text(&o).contains("add --recompute full"), "{}", text(&o));
    }
    // Fine-tuning a pretrained decoder runs on a GPU.
    let o = run(&["--cpu", "--model", "model.gguf"]);
    assert!(!o.status.success() && text(&o).contains("--model fine-tunes on a GPU"), "{}", text(&o));
    if te_runtime::device::gpu_available() {
        let o = run(&["--model", "no-such-model.gguf"]);
        assert!(!o.status.success() && text(&o).contains("--model no-such-model.gguf"), "{}", text(&o));
    }
    // Device m_splits: a mixture-of-experts preset on the GPU.
    let o = run(&["--cpu", "--moe-device-splits", "--steps", "1"]);
    assert!(!o.status.success() && text(&o).contains("needs a mixture-of-experts preset"), "{}", text(&o));
    // FP8 recipes: the flags a recipe has no field for and settings out of range are refused
    // before any run starts.
    let refused: [(&[&str], &str); 3] = [
        (&["--cpu", "--recipe", "block", "--fp8-dpa", "--steps", "1"], "Float8BlockScaling (block) has no fp8_dpa"),
        (&["--cpu", "--recipe", "current", "--amax-history-len", "16"], "has no amax_history_len"),
        (&["--cpu", "--eval-interval", "0", "--steps", "1"], "invalid training configuration: eval_interval"),
    ];
    let out = tempfile::tempdir().unwrap();
    let out = out.path().join("out");
    for (args, want) in refused {
        let o = te().arg("train").args(args).arg("--out").arg(&out).output().unwrap();
        assert!(!o.status.success() && text(&o).contains(want), "{args:?}: {}", text(&o));
        assert!(!text(&o).contains("CPU reference path"), "refused before the run starts: {}", text(&o));
        assert!(!out.exists(), "{args:?}: refused before anything is written");
    }
    // A rank of a multi-process run (WORLD_SIZE > 1) on the CPU path is refused, not run alone.
    let o = te().args(["train", "--cpu"]).env("WORLD_SIZE", "2").env("RANK", "1").output().unwrap();
    assert!(!o.status.success() && text(&o).contains("multi-process run"), "{}", text(&o));
    let o = te().args(["train", "--cpu"]).env("WORLD_SIZE", "2").env("RANK", "5").output().unwrap();
    assert!(!o.status.success() && text(&o).contains("RANK"), "{}", text(&o));
}

#[test]
fn export_writes_a_hugging_face_directory() {
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("te-models/tests/fixtures/decoder/gemma3");
    let root = tempfile::tempdir().unwrap();
    let out = root.path().join("gemma-hf");
    let export = |extra: &[&str]| {
        te().arg("export").arg("--model").arg(&fixture).arg("--out").arg(&out).args(extra).output().unwrap()
    };
    let o = export(&["--dtype", "f32"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("as Gemma3ForCausalLM") && text(&o).contains("model.safetensors"), "{}", text(&o));
    let original = te_models::decoder::DecoderWeights::from_hf_dir(&fixture).unwrap();
    let back = te_models::decoder::DecoderWeights::from_hf_dir(&out).unwrap();
    assert_eq!((back.config(), back.tensors()), (original.config(), original.tensors()));
    let o = export(&[]);
    assert!(!o.status.success() && text(&o).contains("--force"), "a second export needs --force: {}", text(&o));
    let o = export(&["--force", "--dtype", "bf16"]);
    assert!(o.status.success() && text(&o).contains("BF16"), "{}", text(&o));
}
