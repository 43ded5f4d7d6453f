//! The CPU backend through the [`Trainer`]: it learns, resumes bit for bit, stops on request,
//! applies the non-finite policy, and refuses what it cannot run.

use super::*;
use crate::checkpoint::read_latest;
use crate::{Backend, Trainer};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use te_models::gpt::GptConfig;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling};
use te_runtime::DType;

fn small() -> (Corpus, TrainConfig) {
    let text = b"to be or not to be, that is the question. ".repeat(40);
    let corpus = Corpus::split(text, 0.2);
    let model = GptConfig {
        num_layers: 1,
        hidden_size: 32,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 16,
        params_dtype: DType::F32,
        ..GptConfig::tiny()
    };
    let cfg = TrainConfig {
        model,
        steps: 12,
        batch: 4,
        grad_accum: 2,
        lr: 1e-2,
        warmup_steps: 2,
        min_lr: None,
        weight_decay: 0.1,
        max_grad_norm: 1.0,
        eval_interval: 6,
        eval_batches: 2,
        data_seed: 7,
        recipe: DelayedScaling::default().into(),
        skip_nonfinite_steps: 0,
        cuda_graph: false,
    };
    (corpus, cfg)
}

/// A CPU run of `cfg` in `precision` with `ckpt`, calling `progress`.
fn run(
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    progress: impl FnMut(&Progress),
) -> Result<RunSummary, TrainError> {
    Trainer::new(cfg.clone(), Backend::Cpu)?.with_checkpoints(ckpt.clone()).train(corpus, precision, progress)
}

fn none() -> CheckpointOptions {
    CheckpointOptions::default()
}

#[test]
fn a_few_steps_on_a_small_text_lower_the_loss() {
    let (corpus, cfg) = small();
    for precision in [Precision::Fp8, Precision::Bf16] {
        let mut seen = Vec::new();
        let run = run(&corpus, &cfg, precision, &none(), |p| seen.push(*p)).unwrap();
        assert_eq!((run.precision, seen.len(), run.records.len()), (precision, 12, 12));
        let losses: Vec<f32> = run.records.iter().map(|r| r.train_loss).collect();
        assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
        let (first, last) = (losses[..3].iter().sum::<f32>(), losses[9..].iter().sum::<f32>());
        assert!(last < 0.8 * first, "{precision:?}: {losses:?}");
        let vals: Vec<f32> = run.records.iter().filter_map(|r| r.val_loss).collect();
        assert_eq!(vals.len(), 2);
        assert!(vals[1] < vals[0], "{vals:?}");
        assert!(run.tokens_per_s > 0.0 && run.parameters == cfg.model.num_parameters());
        // The callback sees each step as the loss curve records it, with its rate and norm.
        for (p, r) in seen.iter().zip(&run.records) {
            assert_eq!(
                (p.precision, p.step, p.steps, p.train_loss, p.val_loss),
                (precision, r.step, 12, r.train_loss, r.val_loss)
            );
            assert!(p.grad_norm.is_finite() && p.grad_norm > 0.0, "{p:?}");
        }
        let schedule = cfg.adamw_config().lr;
        assert_eq!(seen[0].lr, schedule.lr(1));
        assert_eq!(seen[11].lr, cfg.lr / 10.0, "cosine decay to a tenth at the last step");
    }
}

/// Blockwise FP8 (`--recipe block`) trains on the CPU path as the other precisions do, and
/// its checkpoint records the recipe, so that te generate emulates it again.
#[test]
fn blockwise_fp8_trains_and_is_recorded() {
    let (corpus, cfg) = small();
    let block = Float8BlockScaling::default();
    let cfg = TrainConfig { recipe: block.into(), ..cfg };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointOptions { dir: Some(dir.path().to_path_buf()), ..Default::default() };
    let run = run(&corpus, &cfg, Precision::Fp8, &ckpt, |_| {}).unwrap();
    let losses: Vec<f32> = run.records.iter().map(|r| r.train_loss).collect();
    assert!(losses[9..].iter().sum::<f32>() < 0.8 * losses[..3].iter().sum::<f32>(), "{losses:?}");
    let latest = read_latest(&dir.path().join("fp8/latest.toml")).unwrap().unwrap();
    let section = latest.model.unwrap();
    assert_eq!((section.block_scaling, section.fp8_recipe()), (Some(block), cfg.recipe));
}

/// Every recipe trains on the CPU path: current scaling (each GEMM operand scaled by its own
/// amax) lowers the loss as delayed scaling does.
#[test]
fn current_scaling_trains_on_the_cpu() {
    let (corpus, cfg) = small();
    let cfg = TrainConfig { recipe: Float8CurrentScaling::default().into(), ..cfg };
    let run = run(&corpus, &cfg, Precision::Fp8, &none(), |_| {}).unwrap();
    let losses: Vec<f32> = run.records.iter().map(|r| r.train_loss).collect();
    assert!(losses.iter().all(|l| l.is_finite()), "{losses:?}");
    assert!(losses[losses.len() - 1] < losses[0], "{losses:?}");
    assert!(matches!(
        cpu_gemm_precision(Precision::Fp8, &cfg.recipe),
        Ok(GemmPrecision::Fp8(te_nn::fp8::Recipe::Current(_)))
    ));
    assert!(matches!(cpu_gemm_precision(Precision::Bf16, &cfg.recipe), Ok(GemmPrecision::Bf16)));
}

/// The CPU backend runs one process: a parallel layout of several ranks is refused (the
/// default layout, one rank, is taken).
#[test]
fn the_cpu_backend_takes_the_single_rank_layout_only() {
    let (_, cfg) = small();
    let trainer = Trainer::new(cfg, Backend::Cpu).unwrap();
    assert!(!trainer.backend().is_gpu() && trainer.parallel().world_size() == 1);
    let trainer = trainer.with_parallel(te_nn::parallel::Parallel::default()).unwrap();
    assert_eq!(trainer.into_parallel().data_rank(), (0, 1));
}

/// ZeRO-1, ZeRO-2 and ZeRO-3 shard over data-parallel GPUs: the CPU backend refuses them with
/// a typed error saying what to pass, and takes stage 0; a CPU run reports no GPU optimizer
/// state.
#[test]
fn the_cpu_backend_refuses_zero_1_and_2() {
    use crate::optim::ZeroStage;
    let (corpus, cfg) = small();
    for stage in [ZeroStage::OptimizerStates, ZeroStage::Gradients, ZeroStage::Parameters] {
        let trainer = Trainer::new(cfg.clone(), Backend::Cpu).unwrap();
        let e = trainer.with_zero(stage).unwrap_err();
        assert!(matches!(e, TrainError::Unsupported { .. }), "{e}");
        let stage = format!("ZeRO stage {}", stage.number());
        assert!(e.to_string().contains(&stage) && e.to_string().contains("--zero 0"), "{e}");
    }
    let cfg = TrainConfig { steps: 1, warmup_steps: 1, eval_interval: 1, ..cfg };
    let mut trainer = Trainer::new(cfg, Backend::Cpu).unwrap().with_zero(ZeroStage::Replicated).unwrap();
    assert_eq!(trainer.zero(), ZeroStage::Replicated);
    trainer.train(&corpus, Precision::Bf16, |_| {}).unwrap();
    assert_eq!(trainer.optimizer_memory(), None, "the CPU path's optimizer is not the GPU's");
}

/// An invalid configuration is refused when the trainer is made, naming the field.
#[test]
fn an_invalid_configuration_is_refused_up_front() {
    let (_, cfg) = small();
    let e = Trainer::new(TrainConfig { eval_interval: 0, ..cfg }, Backend::Cpu).unwrap_err();
    assert!(matches!(e, TrainError::Config { field: "eval_interval", .. }), "{e}");
}

/// A diverging run (learning rate 1e30) stops at its first non-finite step, naming it and
/// what to change; allowed to skip, it finishes with the steps skipped.
#[test]
fn nonfinite_steps_stop_the_run_or_are_skipped() {
    let (corpus, cfg) = small();
    let cfg = TrainConfig { lr: 1e30, warmup_steps: 1, steps: 5, ..cfg };
    let e = run(&corpus, &cfg, Precision::Bf16, &none(), |_| {}).unwrap_err();
    let message = e.to_string();
    assert!(matches!(e, TrainError::NonFinite { step, .. } if step >= 2), "{message}");
    assert!(message.contains("non-finite") && message.contains("--skip-nonfinite-steps"), "{message}");
    assert!(message.contains("no checkpoint was written yet") && message.contains("skipped the step"), "{message}");
    let skipping = TrainConfig { skip_nonfinite_steps: 5, ..cfg };
    let run = run(&corpus, &skipping, Precision::Bf16, &none(), |_| {}).unwrap();
    assert_eq!(run.records.len(), 5);
    assert!(run.records.iter().any(|r| !r.train_loss.is_finite()), "the run diverged");
}

/// A stop request ends the run after the step in progress, with the typed error, and
/// writes that step's checkpoint when there is a checkpoint directory.
#[test]
fn a_stop_request_ends_the_run_after_its_step() {
    let (corpus, cfg) = small();
    let dir = tempfile::tempdir().unwrap();
    for ckpt_dir in [None, Some(dir.path().join("checkpoints"))] {
        let stop = Arc::new(AtomicBool::new(false));
        let ckpt = CheckpointOptions { stop: Some(stop.clone()), dir: ckpt_dir.clone(), ..Default::default() };
        let request = |p: &Progress| {
            if p.step == 3 {
                stop.store(true, Ordering::Relaxed);
            }
        };
        let e = run(&corpus, &cfg, Precision::Bf16, &ckpt, request).unwrap_err();
        let written = ckpt_dir.map(|d| d.join("bf16").join("step-0000003"));
        assert!(matches!(&e, TrainError::Interrupted { step: 3, checkpoint } if *checkpoint == written), "{e}");
        assert!(e.to_string().contains("after step 3"), "{e}");
    }
}

/// A run stopped at step 5 (checkpoints every 2 steps and at the stop) and resumed finishes
/// with the loss curve of the run that never stopped, bit for bit (FP8 and BF16 emulation,
/// gradient accumulation, dropout, evaluations); a resume with other settings is refused.
#[test]
fn a_resumed_run_equals_the_straight_run() {
    let (corpus, cfg) = small();
    let cfg = TrainConfig { model: GptConfig { hidden_dropout: 0.1, ..cfg.model }, ..cfg };
    let losses = |run: &RunSummary| -> Vec<(u64, u32, Option<u32>)> {
        run.records.iter().map(|r| (r.step, r.train_loss.to_bits(), r.val_loss.map(f32::to_bits))).collect()
    };
    for precision in [Precision::Fp8, Precision::Bf16] {
        let dir = tempfile::tempdir().unwrap();
        let straight = run(&corpus, &cfg, precision, &none(), |_| {}).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let ckpt = CheckpointOptions {
            dir: Some(dir.path().to_path_buf()),
            interval: 2,
            resume: true,
            stop: Some(stop.clone()),
            model_source: None,
        };
        let request = |p: &Progress| stop.store(p.step == 5, Ordering::Relaxed);
        let e = run(&corpus, &cfg, precision, &ckpt, request).unwrap_err();
        assert!(matches!(e, TrainError::Interrupted { step: 5, checkpoint: Some(_) }), "{e}");
        stop.store(false, Ordering::Relaxed);
        let resumed = run(&corpus, &cfg, precision, &ckpt, |p| assert!(p.step > 5)).unwrap();
        assert_eq!(losses(&resumed), losses(&straight), "{precision:?}");
        // Only the newest checkpoint and the one before it are kept.
        let mut kept: Vec<String> = std::fs::read_dir(dir.path().join(precision.name()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-"))
            .collect();
        kept.sort();
        assert_eq!(kept, ["step-0000010", "step-0000012"], "{precision:?}");
        let other = TrainConfig { lr: cfg.lr * 2.0, ..cfg.clone() };
        let e = run(&corpus, &other, precision, &ckpt, |_| {}).unwrap_err();
        assert!(matches!(&e, TrainError::Resume { message, .. } if message.contains("lr")), "{e}");
        // Another recipe is another run.
        let block = TrainConfig { recipe: Float8BlockScaling::default().into(), ..cfg.clone() };
        let e = run(&corpus, &block, precision, &ckpt, |_| {}).unwrap_err();
        assert!(matches!(&e, TrainError::Resume { message, .. } if message.contains("recipe")), "{e}");
        let fewer = TrainConfig { steps: 4, warmup_steps: 1, ..cfg.clone() };
        let e = run(&corpus, &fewer, precision, &ckpt, |_| {}).unwrap_err();
        assert!(e.to_string().contains("beyond --steps 4"), "{e}");
    }
}

/// A corrupt `history.csv` or a checkpoint whose optimizer is at another step than its
/// `latest.toml` is refused when resuming, naming the file.
#[test]
fn an_inconsistent_checkpoint_is_refused() {
    let (corpus, cfg) = small();
    let cfg = TrainConfig { steps: 4, ..cfg };
    let dir = tempfile::tempdir().unwrap();
    let ckpt = CheckpointOptions {
        dir: Some(dir.path().to_path_buf()),
        interval: 2,
        resume: true,
        stop: None,
        model_source: None,
    };
    run(&corpus, &cfg, Precision::Bf16, &ckpt, |_| {}).unwrap();
    let run_dir = dir.path().join("bf16");
    // latest.toml of step 4 pointing at the step-2 files.
    let latest = std::fs::read_to_string(run_dir.join("latest.toml")).unwrap();
    std::fs::write(run_dir.join("latest.toml"), latest.replace("dir = \"step-0000004\"", "dir = \"step-0000002\""))
        .unwrap();
    let e = run(&corpus, &cfg, Precision::Bf16, &ckpt, |_| {}).unwrap_err();
    assert!(e.to_string().contains("optimizer.safetensors is at step 2, latest.toml at 4"), "{e}");
    std::fs::copy(run_dir.join("step-0000002/trainer.toml"), run_dir.join("latest.toml")).unwrap();
    std::fs::write(run_dir.join("step-0000002/history.csv"), "step,train_loss,val_loss,step_ms\nx\n").unwrap();
    let e = run(&corpus, &cfg, Precision::Bf16, &ckpt, |_| {}).unwrap_err();
    assert!(matches!(&e, TrainError::Resume { message, .. } if message.contains("line 2 is malformed")), "{e}");
}

/// A configuration the host cannot hold (the probe `--seq-length 100000` that used to abort
/// the process) is refused with the estimate and the flags to change.
#[test]
fn a_configuration_too_big_for_the_host_is_refused() {
    let (corpus, cfg) = small();
    let long = TrainConfig { model: GptConfig { seq_length: 100_000, ..GptConfig::tiny() }, ..cfg.clone() };
    let e = run(&corpus, &long, Precision::Bf16, &none(), |_| {}).unwrap_err();
    assert!(matches!(e, TrainError::HostMemory { needed, available } if needed > available), "{e}");
    assert!(e.to_string().contains("--seq-length"), "{e}");
    // The estimate grows with the square of the sequence and stays small for the tiny preset.
    let tiny = GptRef::training_bytes(&GptConfig::tiny(), 4);
    assert!(tiny < 1 << 30 && GptRef::training_bytes(&long.model, 4) > 1 << 40, "{tiny}");
}

/// A split shorter than one window is a typed data error naming the split.
#[test]
fn a_text_shorter_than_a_window_is_a_data_error() {
    let (_, cfg) = small();
    let corpus = Corpus::from_text("too short", 0.5);
    let e = run(&corpus, &cfg, Precision::Bf16, &none(), |_| {}).unwrap_err();
    assert!(matches!(e, TrainError::Data(crate::data::DataError::TooShort { split: "train", .. })), "{e}");
}
