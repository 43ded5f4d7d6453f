//! `TrainConfig::cuda_graph` (`te train --cuda-graph`): after one eager step the whole step
//! (forward, backward, FP8 scale updates, AdamW) is captured and replayed, and the run is bit for
//! bit the eager run: every step's loss and every evaluation, with dropout, gradient
//! accumulation (`is_first_microbatch`), FP8 delayed scaling, and a stop and resume in the middle
//! of the replays.

use crate::common::device;
use crate::train::{config, corpus, losses, train, CheckpointOptions, Precision, TrainConfig, TrainError};
use te_nn::parallel::Parallel;

#[test]
fn graphed_steps_are_bit_exact_with_eager_steps() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    for (precision, grad_accum) in [(Precision::Bf16, 1), (Precision::Fp8, 2), (Precision::Bf16, 2)] {
        let what = format!("{} grad_accum {grad_accum}", precision.name());
        let cfg = TrainConfig { grad_accum, ..config(7) };
        assert!(cfg.model.hidden_dropout > 0.0, "the dropout stream is part of what must match");
        let none = CheckpointOptions::default();
        let eager = train(&dev, &corpus, &cfg, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(eager.graphed_steps, 0);
        let graphed_cfg = TrainConfig { cuda_graph: true, ..cfg.clone() };
        let graphed =
            train(&dev, &corpus, &graphed_cfg, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(graphed.graphed_steps, 6, "{what}: every step after the first replays the graph");
        assert_eq!(losses(&graphed.records), losses(&eager.records), "{what}: the graphed run differs");
        assert!(graphed.records.iter().any(|r| r.val_loss.is_some()), "{what}: evaluations between replays");
    }
}

#[test]
fn a_graphed_run_stops_and_resumes_bit_exact() {
    let Some(dev) = device() else { return };
    let corpus = corpus();
    let cfg = TrainConfig { cuda_graph: true, ..config(6) };
    let precision = Precision::Fp8;
    let none = CheckpointOptions::default();
    let eager = TrainConfig { cuda_graph: false, ..cfg.clone() };
    let straight = train(&dev, &corpus, &eager, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let ckpt = CheckpointOptions {
        dir: Some(dir.path().to_path_buf()),
        interval: 3,
        resume: false,
        stop: Some(stop.clone()),
        model_source: None,
    };
    // Stopped after step 4: three replays, the checkpoint written from the replayed state.
    let request = |step: u64, _: f32| stop.store(step == 4, std::sync::atomic::Ordering::Relaxed);
    let e = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), request).unwrap_err();
    assert!(matches!(e, TrainError::Interrupted { step: 4, .. }), "{e}");
    let ckpt = CheckpointOptions {
        dir: Some(dir.path().to_path_buf()),
        interval: 3,
        resume: true,
        stop: None,
        model_source: None,
    };
    let resumed = train(&dev, &corpus, &cfg, precision, &ckpt, &mut Parallel::default(), |_, _| {}).unwrap();
    // Step 5 eager (the resumed process's first), step 6 replayed.
    assert_eq!(resumed.graphed_steps, 1);
    assert_eq!(losses(&resumed.records), losses(&straight.records), "the resumed graphed run differs");
}
