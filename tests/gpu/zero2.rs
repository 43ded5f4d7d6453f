//! ZeRO stage 2 (the gradients sharded too: each piece of a gradient reduced to the rank whose
//! optimizer owns it, the gradients a rank owns nothing of released during the backward;
//! `te_nn::parallel::DataParallel::set_grad_shards`, `te_train::optim::AdamW::new_zero_stage`,
//! `Trainer::with_zero(ZeroStage::Gradients)`) on two ranks against ZeRO-1 and the replicated
//! optimizer:
//!
//! - `ParamMut::take_grad` takes one parameter's gradient out of its layer (one GPU);
//! - `ProcessGroup::reduce` / `reduce_range` / `reduce_range_shared`: the root gets the
//!   reduction, the others keep their values, and on two ranks an averaged range is the
//!   all-reduce's bit for bit; the typed refusals;
//! - a ZeRO-2 backward and step of a GPT on each rank's own batch: the owner's pieces of the
//!   gradients are the all-reduced gradients bit for bit, the gradients a rank owns nothing of
//!   are gone at the end of the backward (the device memory in use lower than ZeRO-1's by their
//!   bytes), and the steps (norms, clipping, parameters) are ZeRO-1's bit for bit; the refusals;
//! - training runs through the `Trainer` with `--zero 2` equal the replicated and ZeRO-1 runs bit
//!   for bit (BF16 with and without clipping, FP8, and with gradient accumulation);
//! - a ZeRO-2 checkpoint resumes bit for bit, and ZeRO-1 and ZeRO-2 checkpoints load into each
//!   other's runs.
//!
//! Each multi-GPU test re-runs this binary as its ranks (`multi_gpu::on_ranks`); skipped with
//! fewer than two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use crate::common::randn;
use crate::multi_gpu::{on_ranks, Layout};
use crate::train::{CheckpointOptions, Precision, TrainConfig};
use crate::zero::{base_config, bits, run, state_file_bits, stopped_at, values, zero_config};
use std::path::Path;
use std::sync::Arc;
use te_models::gpt::{Gpt, GptConfig};
use te_nn::modules::{Param, ParamKind, TokenIds};
use te_nn::parallel::{DataParallel, GradShards, Parallel};
use te_nn::Module;
use te_runtime::dist::ReduceOp;
use te_runtime::ops::optimizer::CHUNK;
use te_runtime::{DType, Device, Error, Tensor};
use te_train::optim::{AdamW, ZeroStage};

const MIB: f64 = (1u64 << 20) as f64;

/// Reductions to a root: f32 sums of a whole tensor and of a range, bf16 averages of a range
/// equal to the all-reduce's bits, several ranges of one shared tensor to different roots in one
/// NCCL group, and the typed refusals.
#[test]
fn reduce_to_a_root_in_place() {
    let test = "zero2::reduce_to_a_root_in_place";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let (r, n) = (env.rank, 2);
        let data = |rank: usize| randn(70 + rank as u64, 1000, 2.0);
        let all: Vec<Vec<f32>> = (0..n).map(data).collect();
        let sum: Vec<f32> = (0..1000).map(|i| all[0][i] + all[1][i]).collect();
        // Whole tensor, f32 sum to rank 1: rank 0 keeps its values.
        let mut t = Tensor::from_f32(dev, DType::F32, &[10, 100], &data(r)).unwrap();
        pg.reduce(&mut t, 1, ReduceOp::Sum).unwrap();
        let got = t.to_f32(dev).unwrap();
        assert_eq!(got, if r == 1 { sum.clone() } else { data(r) }, "rank {r}: reduce to 1");
        // A range to rank 0: elements outside it unchanged everywhere.
        let mut t = Tensor::from_f32(dev, DType::F32, &[1000], &data(r)).unwrap();
        pg.reduce_range(&mut t, 100..350, 0, ReduceOp::Sum).unwrap();
        let got = t.to_f32(dev).unwrap();
        let mut want = data(r);
        if r == 0 {
            want[100..350].copy_from_slice(&sum[100..350]);
        }
        assert_eq!(got, want, "rank {r}: reduce_range");
        // bf16 averages of two ranges of one shared tensor to two roots, in one NCCL group: each
        // root's range is the all-reduce's bits.
        let mine = Tensor::from_f32(dev, DType::BF16, &[1000], &data(r)).unwrap();
        let clone = mine.clone();
        pg.grouped(|| {
            pg.reduce_range_shared(&mine, 0..512, 0, ReduceOp::Avg)?;
            pg.reduce_range_shared(&mine, 512..1000, 1, ReduceOp::Avg)
        })
        .unwrap();
        let mut all_reduced = Tensor::from_f32(dev, DType::BF16, &[1000], &data(r)).unwrap();
        pg.all_reduce(&mut all_reduced, ReduceOp::Avg).unwrap();
        let (got, clone_got, want) =
            (mine.to_bytes(dev).unwrap(), clone.to_bytes(dev).unwrap(), all_reduced.to_bytes(dev).unwrap());
        assert_eq!(got, clone_got, "rank {r}: in place, every clone sees it");
        let owned = if r == 0 { 0..1024 } else { 1024..2000 };
        assert_eq!(got[owned.clone()], want[owned.clone()], "rank {r}: the averaged range is the all-reduce's");
        let original = Tensor::from_f32(dev, DType::BF16, &[1000], &data(r)).unwrap().to_bytes(dev).unwrap();
        let other = if r == 0 { 1024..2000 } else { 0..1024 };
        assert_eq!(got[other.clone()], original[other], "rank {r}: the other rank's range is untouched");
        // Refusals, before NCCL sees anything (the same on both ranks).
        let mut t = Tensor::from_f32(dev, DType::F32, &[8], &[1.0; 8]).unwrap();
        let e = pg.reduce_range(&mut t, 4..9, 0, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("inside the buffer"), "{e}");
        let e = pg.reduce(&mut t, 2, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("root 2"), "{e}");
        let mut fp8 = Tensor::zeros(dev, DType::E4M3, &[8]).unwrap();
        let e = pg.reduce(&mut fp8, 0, ReduceOp::Sum).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{e}");
        pg.barrier().unwrap();
    });
}

/// `ParamMut::take_grad` (how ZeRO-2 releases a gradient) takes one parameter's gradient out of
/// its layer, whole and unchanged, leaving the others (a GEMM's bias when its weight's is taken,
/// a norm's beta when its gamma's is); a second take finds none.
#[test]
fn take_grad_takes_one_parameters_gradient() {
    let Some(dev) = crate::common::device() else { return };
    let cfg = GptConfig { num_layers: 1, seq_length: 16, hidden_dropout: 0.0, ..GptConfig::tiny() };
    let mut model = Gpt::new(&dev, cfg).unwrap();
    let ids: Vec<i32> = (0..32).map(|i| i * 5 % 256).collect();
    let x = TokenIds::from_host(&dev, &[16, 2], &ids).unwrap();
    let (_, ctx) = model.forward_loss(&x, &x).unwrap();
    model.backward(ctx).unwrap();
    let before = grad_bytes(&model, &dev);
    assert!(before.iter().all(|(_, g)| g.is_some()), "every parameter has a gradient after a backward");
    // Take every other parameter's gradient (weights and biases, gammas and betas alternate).
    let mut taken = Vec::new();
    let mut i = 0;
    model
        .visit_mut("", &mut |path: &str,
                             _: ParamKind,
                             p: &mut dyn te_nn::modules::ParamMut|
         -> te_runtime::Result<()> {
            if i % 2 == 0 {
                let g = p.take_grad().unwrap_or_else(|| panic!("{path}: a gradient to take"));
                taken.push((i, g.to_bytes(&dev)?));
                assert!(p.grad().is_none() && p.take_grad().is_none(), "{path}: taken once");
            }
            i += 1;
            Ok(())
        })
        .unwrap();
    let after = grad_bytes(&model, &dev);
    for (i, ((path, b), (_, a))) in before.iter().zip(&after).enumerate() {
        match i % 2 {
            0 => {
                assert!(a.is_none(), "{path}: taken");
                let t = taken.iter().find(|(j, _)| *j == i).map(|(_, t)| t);
                assert!(t == b.as_ref(), "{path}: the taken gradient is the one it held");
            }
            _ => assert!(a == b, "{path}: left as it was"),
        }
    }
}

/// Each parameter's gradient bytes (`None`: no gradient), by traversal index.
fn grad_bytes(model: &Gpt, dev: &Arc<Device>) -> Vec<(String, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    model
        .visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> te_runtime::Result<()> {
            out.push((path.to_owned(), p.grad().map(|g| g.to_bytes(dev)).transpose()?));
            Ok(())
        })
        .unwrap();
    out
}

/// Device memory in use once the stream is idle (bytes).
fn in_use(dev: &Device) -> u64 {
    dev.synchronize().unwrap();
    dev.memory_in_use().unwrap()
}

/// Three data-parallel steps of a 4-layer GPT on each rank's own batch, ZeRO-1 (all-reduced
/// gradients, `AdamW::new_zero`) beside ZeRO-2 (gradients reduced to their owners,
/// `AdamW::new_zero_stage`), with and without clipping: at the end of each backward the ZeRO-2
/// rank holds exactly the gradients of the parameters it owns a piece of, their owned elements
/// the all-reduced gradients' bits; the memory in use is lower by the released gradients' bytes;
/// each step's norm, clip coefficient and parameters equal ZeRO-1's bit for bit.
#[test]
fn a_zero_2_backward_releases_the_other_ranks_gradients_and_steps_as_zero_1() {
    let test = "zero2::a_zero_2_backward_releases_the_other_ranks_gradients_and_steps_as_zero_1";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        // Hidden 320: the fc weights are 320 × 1280 = 409 600 elements (12.5 chunks), so the
        // boundary between the ranks falls inside a parameter; about 5 M parameters, 10 MB of
        // BF16 gradients.
        let cfg = GptConfig {
            num_layers: 4,
            hidden_size: 320,
            num_attention_heads: 5,
            ffn_hidden_size: 1280,
            seq_length: 48,
            hidden_dropout: 0.0,
            seed: 5,
            ..GptConfig::tiny()
        };
        let (s, b) = (48, 3);
        // Each rank's own batch: the reduction matters.
        let ids: Vec<i32> = (0..s * b).map(|i| ((i * 7 + i / 5 + 31 * env.rank) % 256) as i32).collect();
        let targets: Vec<i32> = (0..s * b).map(|i| ((i * 11 + 3 + 17 * env.rank) % 256) as i32).collect();
        let x = TokenIds::from_host(dev, &[s, b], &ids).unwrap();
        let y = TokenIds::from_host(dev, &[s, b], &targets).unwrap();
        for clip in [None, Some(0.05)] {
            let what = format!("clip {clip:?} rank {}", env.rank);
            let mut one = Gpt::new(dev, cfg.clone()).unwrap();
            let mut two = Gpt::new(dev, cfg.clone()).unwrap();
            let mut dp1 = DataParallel::new(group.clone()).unwrap();
            let mut dp2 = DataParallel::new(group.clone()).unwrap();
            let mut z1 = AdamW::new_zero(dev, &one, zero_config(clip), group.clone()).unwrap();
            let mut z2 =
                AdamW::new_zero_stage(dev, &two, zero_config(clip), group.clone(), ZeroStage::Gradients).unwrap();
            assert_eq!((z1.zero_stage(), z2.zero_stage()), (ZeroStage::OptimizerStates, ZeroStage::Gradients));
            assert!(z1.grad_shards().is_none());
            let shards: GradShards = z2.grad_shards().cloned().expect("a ZeRO-2 optimizer shards the gradients");
            assert_eq!(z2.state_bytes(), z1.state_bytes(), "{what}: the same optimizer state as ZeRO-1");
            dp2.set_grad_shards(Some(shards.clone())).unwrap();
            let (kept, released) = shards.kept_and_released_bytes(env.rank, 2);
            assert!(released > 0 && kept > 0, "{what}: {kept} kept, {released} released");

            for step in 1..=3 {
                // ZeRO-1: every gradient all-reduced.
                let base = in_use(dev) as i64;
                let (_, ctx) = one.forward_loss(&x, &y).unwrap();
                one.backward_with(ctx, &mut |part| dp1.reduce_grads(part)).unwrap();
                dp1.finish().unwrap();
                let one_bytes = in_use(dev) as i64 - base;
                // ZeRO-2: each piece to its owner, the rest released during the backward.
                let base = in_use(dev) as i64;
                dev.reset_peak_memory().unwrap();
                dp2.begin_step(&two).unwrap();
                let (_, ctx) = two.forward_loss(&x, &y).unwrap();
                two.backward_with(ctx, &mut |part| dp2.reduce_grads(part)).unwrap();
                dp2.finish().unwrap();
                let two_bytes = in_use(dev) as i64 - base;
                let two_peak = dev.peak_memory().unwrap() as i64 - base;
                assert_eq!(dp2.released_bytes(), released, "{what} step {step}");

                // The owner's pieces are the all-reduced gradients; the others are gone.
                let (g1, g2) = (grad_bytes(&one, dev), grad_bytes(&two, dev));
                for (i, ((path, a), (_, z))) in g1.iter().zip(&g2).enumerate() {
                    let a = a.as_ref().expect("ZeRO-1 keeps every gradient");
                    let piece = z2.states()[i].piece.clone();
                    match (shards.owns(env.rank, i), z) {
                        (true, Some(z)) => {
                            let bytes = 2 * piece.start..2 * piece.end;
                            assert!(a[bytes.clone()] == z[bytes], "{what} step {step}: {path} {piece:?} differs");
                        }
                        (false, None) => {}
                        (owns, z) => panic!("{what} step {step}: {path}: owns {owns}, gradient {:?}", z.is_some()),
                    }
                }
                let reduced = dp2.reduced().expect("sharded").to_vec();
                assert!(reduced.iter().all(|&r| r), "{what}: every parameter reduced");

                // Memory at the end of the backward: lower by the released gradients.
                let saved = one_bytes as f64 - two_bytes as f64;
                eprintln!(
                    "{what} step {step}: end of backward {:.2} MiB (ZeRO-1) vs {:.2} MiB (ZeRO-2), saved {:.2} MiB, \
                     released {:.2} MiB of {:.2} MiB of gradients; ZeRO-2 backward peak {:.2} MiB above its start",
                    one_bytes as f64 / MIB,
                    two_bytes as f64 / MIB,
                    saved / MIB,
                    released as f64 / MIB,
                    (kept + released) as f64 / MIB,
                    two_peak as f64 / MIB
                );
                if step > 1 {
                    // (Step 1 also allocates what the first backward of each model sets up.)
                    let r = released as f64;
                    assert!(saved >= 0.9 * r && saved <= 1.1 * r + MIB, "{what} step {step}: saved {saved} of {r}");
                }

                let s1 = z1.step(&mut one).unwrap();
                let e = z2.step(&mut two).unwrap_err();
                assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("step_reduced"), "{e}");
                let s2 = z2.step_reduced(&mut two, &reduced).unwrap();
                assert_eq!(s1.grad_norm.to_bits(), s2.grad_norm.to_bits(), "{what} step {step}: the norm");
                assert_eq!(s1.clip_coef.to_bits(), s2.clip_coef.to_bits(), "{what} step {step}");
                assert_eq!(s1.params_updated, s2.params_updated, "{what} step {step}");
                if clip.is_some() {
                    assert!(s1.clip_coef < 1.0, "{what}: the gradients are clipped ({})", s1.grad_norm);
                }
                let (v1, v2) = (values(&one, dev), values(&two, dev));
                for ((path, p), (_, q)) in v1.iter().zip(&v2) {
                    assert!(p == q, "{what} step {step}: {path} differs from ZeRO-1's");
                }
                one.zero_grad();
                two.zero_grad();
            }
        }

        // Refusals: shards over another group size; a bucket before begin_step; another model.
        let cfg2 = GptConfig { num_layers: 1, ..cfg.clone() };
        let mut model = Gpt::new(dev, cfg.clone()).unwrap();
        let opt = AdamW::new_zero_stage(dev, &model, zero_config(None), group.clone(), ZeroStage::Gradients).unwrap();
        let mut dp = DataParallel::new(group.clone()).unwrap();
        let e = dp.set_grad_shards(Some(GradShards::new(3, Vec::new()).unwrap())).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("over 3 ranks"), "{e}");
        dp.set_grad_shards(opt.grad_shards().cloned()).unwrap();
        let e = dp.reduce_grads(&mut model).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("begin_step"), "{e}");
        let e = dp.begin_step(&Gpt::new(dev, cfg2).unwrap()).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("parameters"), "{e}");
        group.barrier().unwrap();
    });
}

/// Whether two model files hold the same tensors, bit for bit.
fn same_model_file(a: &Path, b: &Path) -> bool {
    let tensors = |p: &Path| {
        let bytes = std::fs::read(p.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut v: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
        v.sort();
        v
    };
    tensors(a) == tensors(b)
}

/// Six data-parallel steps of the small GPT with `--zero 2` equal the replicated and ZeRO-1 runs
/// bit for bit: losses, gradient norms, the final model and optimizer state (BF16 without
/// clipping and with a threshold every step crosses, FP8 with the default 1.0, and BF16 with two
/// micro-batches a step), with the same optimizer bytes as ZeRO-1, about half the gradients
/// released per rank and a peak no higher than ZeRO-1's.
#[test]
fn zero_2_training_equals_the_replicated_and_zero_1_runs_bit_for_bit() {
    let test = "zero2::zero_2_training_equals_the_replicated_and_zero_1_runs_bit_for_bit";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        let root = std::env::temp_dir().join(format!("te-zero2-train-{}", env.master_port));
        let cases = [(Precision::Bf16, f32::INFINITY, 1), (Precision::Bf16, 0.05, 1), (Precision::Fp8, 1.0, 1)];
        let cases = cases.into_iter().chain([(Precision::Bf16, 1.0, 2)]);
        for (precision, clip, grad_accum) in cases {
            let cfg = TrainConfig { max_grad_norm: clip, grad_accum, ..base_config(6) };
            let what = format!("{precision:?} clip {clip} accum {grad_accum} rank {}", env.rank);
            let mut outs = Vec::new();
            for zero in [ZeroStage::Replicated, ZeroStage::OptimizerStates, ZeroStage::Gradients] {
                let dir = root.join(format!("{}-{clip}-{grad_accum}-{}", precision.name(), zero.number()));
                let ckpt = CheckpointOptions { dir: Some(dir.clone()), interval: 6, ..CheckpointOptions::default() };
                let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
                let (summary, norms, memory) = run(dev, &corpus, &cfg, precision, &ckpt, &mut parallel, zero);
                assert_eq!(summary.records.len(), 6, "{what}");
                outs.push((summary, norms, memory, dir.join(precision.name()).join("step-0000006")));
            }
            let (rep, rep_norms, _, rep_dir) = &outs[0];
            let (one, _, one_mem, one_dir) = &outs[1];
            let (two, two_norms, two_mem, two_dir) = &outs[2];
            assert_eq!(bits(&two.records), bits(&rep.records), "{what}: the losses");
            assert_eq!(bits(&one.records), bits(&rep.records), "{what}: the losses (ZeRO-1)");
            assert_eq!(two_norms, rep_norms, "{what}: the gradient norms");
            if clip < 1.0 {
                assert!(rep_norms.iter().all(|&n| f32::from_bits(n) > clip), "{what}: every step is clipped");
            }
            // ZeRO-1's optimizer bytes; about half the gradients released.
            assert_eq!((two_mem.stage, two_mem.ranks), (ZeroStage::Gradients, 2), "{what}");
            assert_eq!(two_mem.bytes_per_rank, one_mem.bytes_per_rank, "{what}");
            assert_eq!(two_mem.gradient_bytes, one_mem.gradient_bytes, "{what}");
            assert_eq!(one_mem.released_gradient_bytes, 0, "{what}");
            let fraction = two_mem.released_gradient_bytes as f64 / two_mem.gradient_bytes as f64;
            assert!(fraction > 0.0 && fraction < 1.0, "{what}: {}", two_mem.describe());
            eprintln!(
                "{what}: {}; peak {:.2} MiB (ZeRO-2) vs {:.2} MiB (ZeRO-1) vs {:.2} MiB (replicated)",
                two_mem.describe(),
                two.peak_memory as f64 / MIB,
                one.peak_memory as f64 / MIB,
                rep.peak_memory as f64 / MIB
            );
            assert!(two.peak_memory <= one.peak_memory + (2 << 20), "{what}: ZeRO-2's peak above ZeRO-1's");
            world.barrier().unwrap();
            if env.rank == 0 {
                // The same final weights and (gathered) optimizer state.
                assert!(same_model_file(two_dir, rep_dir), "{what}: the final model differs");
                assert!(same_model_file(one_dir, rep_dir), "{what}: the final model differs (ZeRO-1)");
                let opt = |d: &Path| state_file_bits(dev, &cfg, &d.join("optimizer.safetensors"));
                assert!(opt(two_dir) == opt(rep_dir), "{what}: the final optimizer state differs");
            }
            world.barrier().unwrap();
        }
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}

/// A ZeRO-2 run checkpointed at step 3 and resumed finishes bit for bit as the straight run (and
/// as the ZeRO-1 run); a ZeRO-1 checkpoint resumes as ZeRO-2 and a ZeRO-2 checkpoint as ZeRO-1,
/// both bit for bit (the state file is the same format; the runs are the same steps).
#[test]
fn zero_2_checkpoints_resume_bit_exactly_and_load_across_stages() {
    let test = "zero2::zero_2_checkpoints_resume_bit_exactly_and_load_across_stages";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        let root = std::env::temp_dir().join(format!("te-zero2-resume-{}", env.master_port));
        let cfg = TrainConfig { max_grad_norm: 0.05, ..base_config(6) };
        let precision = Precision::Bf16;
        let ckpt = |dir: &Path, resume: bool| CheckpointOptions {
            dir: Some(dir.to_path_buf()),
            interval: 3,
            resume,
            ..CheckpointOptions::default()
        };
        let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
        let mut go = |dir: &Path, resume: bool, zero| {
            run(dev, &corpus, &cfg, precision, &ckpt(dir, resume), &mut parallel, zero)
        };
        let (two_dir, one_dir) = (root.join("zero2"), root.join("zero1"));
        let (straight, norms, _) = go(&two_dir, false, ZeroStage::Gradients);
        let (one, one_norms, _) = go(&one_dir, false, ZeroStage::OptimizerStates);
        let what = format!("rank {}", env.rank);
        assert_eq!(bits(&straight.records), bits(&one.records), "{what}: ZeRO-2 vs ZeRO-1");
        assert_eq!(norms, one_norms, "{what}");
        for (name, src, zero) in [
            ("ZeRO-2 resumed as ZeRO-2", &two_dir, ZeroStage::Gradients),
            ("ZeRO-1 resumed as ZeRO-2", &one_dir, ZeroStage::Gradients),
            ("ZeRO-2 resumed as ZeRO-1", &two_dir, ZeroStage::OptimizerStates),
        ] {
            let dst = root.join(name.replace(' ', "-"));
            stopped_at(&world, env.rank, src, &dst, precision, 3);
            let (resumed, resumed_norms, _) = go(&dst, true, zero);
            assert_eq!(bits(&resumed.records), bits(&straight.records), "{what}: {name}");
            assert_eq!(resumed_norms[..], norms[3..], "{what}: {name}: the norms of steps 4 to 6");
            world.barrier().unwrap();
            if env.rank == 0 {
                let last = |d: &Path| d.join(precision.name()).join("step-0000006");
                let (a, b) = (last(&dst), last(&two_dir));
                assert!(same_model_file(&a, &b), "{what}: {name}: the step-6 model differs from the straight run's");
                let state = |d: &Path| state_file_bits(dev, &cfg, &d.join("optimizer.safetensors"));
                let (sa, sb) = (state(&a), state(&b));
                assert_eq!(sa.0, 6, "{name}");
                assert!(sa == sb, "{what}: {name}: the step-6 optimizer state differs from the straight run's");
            }
            world.barrier().unwrap();
        }
        // The chunk alignment that makes the norms bit-exact holds for the gradient shards too.
        let model = Gpt::new(dev, cfg.model.clone()).unwrap();
        let opt = AdamW::new_zero_stage(dev, &model, cfg.adamw_config(), world.clone(), ZeroStage::Gradients).unwrap();
        let shards = opt.grad_shards().unwrap();
        for i in 0..shards.len() {
            for s in shards.shards(i) {
                assert_eq!(s.range.start % CHUNK, 0, "{what}: parameter {i} piece {s:?}");
            }
        }
        world.barrier().unwrap();
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}
