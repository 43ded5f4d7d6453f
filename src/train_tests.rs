//! Unit tests of `te train`'s flag handling (`src/train.rs`).

use super::*;
use clap::Parser;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling};
use te_train::{Precision, Record};

#[derive(Parser)]
pub(crate) struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

/// `te train`'s flags parsed from `flags` (shared by the flag tests of other modules).
pub(crate) fn args(flags: &[&str]) -> TrainArgs {
    Cli::try_parse_from(std::iter::once("te-train").chain(flags.iter().copied())).unwrap().train
}

/// Each recipe takes the flags it has fields for, with TE's defaults for the rest, and
/// refuses the others, naming the field and the recipes that have it.
#[test]
fn the_recipe_flags_apply_where_the_recipe_has_the_fields() {
    assert_eq!(recipe(&args(&[])).unwrap(), Recipe::default());
    let delayed = recipe(&args(&["--amax-history-len", "16", "--amax-compute-algo", "most_recent", "--fp8-mha"]));
    let want = DelayedScaling {
        amax_history_len: 16,
        amax_compute_algo: AmaxComputeAlgo::MostRecent,
        fp8_mha: true,
        ..DelayedScaling::default()
    };
    assert_eq!(delayed.unwrap(), want.into());
    let current = recipe(&args(&["--recipe", "current", "--fp8-dpa"])).unwrap();
    assert_eq!(current, Float8CurrentScaling { fp8_dpa: true, ..Default::default() }.into());
    assert_eq!(recipe(&args(&["--recipe", "block"])).unwrap(), Float8BlockScaling::default().into());
    assert_eq!(recipe(&args(&["--recipe", "Float8BlockScaling"])).unwrap(), Float8BlockScaling::default().into());
    let refused: [(&[&str], &str); 4] = [
        (&["--recipe", "current", "--amax-history-len", "16"], "has no amax_history_len"),
        (&["--recipe", "block", "--amax-compute-algo", "max"], "has no amax_compute_algo"),
        (&["--recipe", "block", "--fp8-dpa"], "has no fp8_dpa"),
        (&["--recipe", "block", "--fp8-mha"], "use a recipe that has it (delayed, current)"),
    ];
    for (flags, want) in refused {
        let e = recipe(&args(flags)).unwrap_err();
        assert!(matches!(e, te_runtime::Error::Recipe { .. }) && e.to_string().contains(want), "{flags:?}: {e}");
    }
    for bad in [["--recipe", "mxfp8"], ["--amax-compute-algo", "mean"]] {
        let e = Cli::try_parse_from(std::iter::once("te-train").chain(bad)).err().unwrap().to_string();
        assert!(e.contains(bad[1]) && (e.contains("delayed") || e.contains("most_recent")), "{e}");
    }
}

/// The config of the flags: the CPU and GPU defaults, the model's fields from the flags.
#[test]
fn the_config_defaults_by_where_it_runs() {
    let cpu = train_config(&args(&["--seq-length", "32", "--fp8-lm-head"]), GptConfig::tiny(), false).unwrap();
    assert_eq!((cpu.steps, cpu.batch, cpu.eval_interval, cpu.warmup_steps), (200, 4, 50, 10));
    assert_eq!((cpu.model.seq_length, cpu.model.seed, cpu.data_seed, cpu.model.fp8_lm_head), (32, 1234, 1234, true));
    cpu.validate().unwrap();
    let gpu = train_config(&args(&["--steps", "100", "--eval-interval", "7"]), GptConfig::small(), true).unwrap();
    assert_eq!((gpu.steps, gpu.batch, gpu.eval_interval, gpu.warmup_steps), (100, 8, 7, 5));
    assert_eq!((gpu.min_lr, gpu.weight_decay, gpu.max_grad_norm), (None, 0.1, 1.0));
    // The optimizer's flags; --grad-clip 0 turns clipping off.
    let flags = ["--warmup-steps", "3", "--min-lr", "1e-5", "--weight-decay", "0", "--grad-clip", "0"];
    let set = train_config(&args(&flags), GptConfig::tiny(), false).unwrap();
    assert_eq!((set.warmup_steps, set.min_lr, set.weight_decay), (3, Some(1e-5), 0.0));
    assert_eq!(set.adamw_config().max_grad_norm, None);
    set.validate().unwrap();
    let over = train_config(&args(&["--min-lr", "1e-2"]), GptConfig::tiny(), false).unwrap();
    assert!(over.validate().unwrap_err().to_string().contains("min_lr"));
    let e = train_config(&args(&["--recipe", "block", "--fp8-dpa"]), GptConfig::tiny(), false).unwrap_err();
    assert!(e.to_string().contains("has no fp8_dpa"), "{e}");
    assert!(cpu_path(&cpu.recipe).contains("FP8 with delayed scaling"));
    assert!(cpu_path(&Float8BlockScaling::default().into()).contains("blockwise scaling"));
    assert!(cpu_path(&Float8CurrentScaling::default().into()).contains("FP8 with current scaling"));
    let default = "CPU reference path (no GPU: FP8 with delayed scaling and BF16 are emulated by rounding the GEMM \
                   inputs; f32 elsewhere; slow, for trying the job out)";
    assert_eq!(cpu_path(&cpu.recipe), default, "the line of the default run is unchanged");
}

/// `--zero` takes the built stages only; stages 1 and 2 are refused on the CPU path and with
/// tensor parallelism, naming what to drop; stage 3 needs `--model` and `--recompute full`.
#[test]
fn the_zero_flag_takes_the_built_stages() {
    assert_eq!(zero_stage(&args(&[]), true), Ok(ZeroStage::Replicated));
    assert_eq!(zero_stage(&args(&["--zero", "0"]), false), Ok(ZeroStage::Replicated));
    assert_eq!(zero_stage(&args(&["--zero", "1"]), true), Ok(ZeroStage::OptimizerStates));
    assert_eq!(zero_stage(&args(&["--zero", "2"]), true), Ok(ZeroStage::Gradients));
    let e = zero_stage(&args(&["--zero", "1"]), false).unwrap_err();
    assert!(e.contains("CPU path") && e.contains("drop --zero"), "{e}");
    let e = zero_stage(&args(&["--zero", "2"]), false).unwrap_err();
    assert!(e.contains("--zero 2 shards the optimizer state and gradients") && e.contains("CPU path"), "{e}");
    for stage in ["1", "2"] {
        let e = zero_stage(&args(&["--zero", stage, "--tensor-parallel", "2"]), true).unwrap_err();
        assert!(e.contains(&format!("--zero {stage} with --tensor-parallel 2 is not built yet")), "{e}");
    }
    let three = args(&["--zero", "3", "--model", "m.gguf", "--recompute", "full"]);
    assert_eq!(zero_stage(&three, true), Ok(ZeroStage::Parameters));
    for partial in [&["--zero", "3", "--model", "m.gguf"][..], &["--zero", "3", "--recompute", "full"]] {
        let e = zero_stage(&args(partial), true).unwrap_err();
        assert!(e.contains("add --model and --recompute full"), "{e}");
    }
    for bad in ["4", "-1", "one"] {
        let parsed = Cli::try_parse_from(["te-train", "--zero", bad]);
        assert!(parsed.is_err(), "--zero {bad} must be refused by the parser");
    }
    for stage in ["1", "2"] {
        let e = train_config(&args(&["--zero", stage]), GptConfig::tiny(), false).unwrap_err();
        assert!(matches!(e, te_runtime::Error::Config { .. }) && e.to_string().contains("CPU path"), "{e}");
    }
}

/// `--offload-activations` is 0 by default and needs `--recompute full`.
#[test]
fn the_offload_flag_needs_full_recompute() {
    assert_eq!(offload_activations(&args(&[]), false).unwrap(), 0);
    let plain = args(&["--offload-activations", "3", "--model", "m.gguf"]);
    let e = offload_activations(&plain, true).unwrap_err();
    assert!(e.contains("add --recompute full"), "{e}");
    let e = offload_activations(&plain, false).unwrap_err();
    assert!(e.contains("CPU path") && e.contains("drop --offload-activations"), "{e}");
    let gpt = args(&["--offload-activations", "3", "--recompute", "full"]);
    assert_eq!(offload_activations(&gpt, true).unwrap(), 3);
    let full = args(&["--offload-activations", "3", "--recompute", "full", "--model", "m.gguf"]);
    assert_eq!(offload_activations(&full, true).unwrap(), 3);
}

/// `--recompute` takes none (the default), full and selective (with `--model`: the GPT
/// presets refuse it, naming the modes they take), nothing else.
#[test]
fn the_recompute_flag_names_the_mode() {
    assert_eq!(recompute(&args(&[])).unwrap(), Recompute::None);
    assert_eq!(recompute(&args(&["--recompute", "full"])).unwrap(), Recompute::Full);
    assert_eq!(recompute(&args(&["--recompute", "none"])).unwrap(), Recompute::None);
    let selective = args(&["--recompute", "selective", "--model", "m.gguf"]);
    assert_eq!(recompute(&selective).unwrap(), Recompute::Selective);
    let e = recompute(&args(&["--recompute", "selective"])).unwrap_err();
    let message = e.to_string();
    assert!(matches!(e, te_runtime::Error::Config { .. }), "{message}");
    assert!(message.contains("--model") && message.contains("--recompute full"), "{message}");
    let e = Cli::try_parse_from(["te-train", "--recompute", "attention"]).err().unwrap().to_string();
    assert!(e.contains("attention") && e.contains("selective") && e.contains("full"), "{e}");
}

#[test]
fn summary_and_csv_hold_both_runs() {
    let run = |precision, loss: f32| RunSummary {
        precision,
        records: vec![
            Record { step: 1, train_loss: loss + 1.0, val_loss: None, step_ms: 10.0 },
            Record { step: 2, train_loss: loss, val_loss: Some(loss + 0.5), step_ms: 12.5 },
        ],
        tokens_per_s: 1000.0,
        ranks: 1,
        peak_memory: 1 << 30,
        parameters: 42,
        graphed_steps: 0,
    };
    let runs = [run(Precision::Fp8, 2.0), run(Precision::Bf16, 2.0)];
    let cfg = TrainConfig { steps: 2, batch: 4, ..TrainConfig::new(GptConfig::tiny(), 2) };
    let s = summary_table("CPU reference path", "tiny", &cfg, &runs);
    assert!(s.contains("preset tiny, 42 parameters, 2 steps × 4 sequences × 128 tokens"), "{s}");
    assert!(s.contains("| fp8 | 2.0000 | 2.5000 | 1000 | 1.00 |"), "{s}");
    assert!(s.contains("FP8 ÷ BF16: validation loss 1.0000, tokens/s 1.000, peak memory 1.000"), "{s}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("loss.csv");
    write_csv(&path, &runs).unwrap();
    let csv = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        csv.lines().collect::<Vec<_>>()[..3],
        ["precision,step,train_loss,val_loss,step_ms", "fp8,1,3,,10.000", "fp8,2,2,2.5,12.500"]
    );
    let e = write_csv(&dir.path().join("missing/loss.csv"), &runs).unwrap_err();
    assert!(matches!(e, TrainError::Output { .. }), "{e}");
}
