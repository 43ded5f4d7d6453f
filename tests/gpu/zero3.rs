//! ZeRO stage 3 (the layers' 16-bit weights sharded too: `te_nn::parallel::ParamShards`,
//! `DecoderLm::set_zero3`, `AdamW::step_sharded`, `Trainer::with_zero(ZeroStage::Parameters)`,
//! `te train --zero 3`) on two ranks:
//!
//! - `ParamShards`: each rank keeps its pieces of uneven parameters; a gather (prefetched or not)
//!   rebuilds the whole tensors bit for bit in the ring's buffers, a gather after the pieces
//!   changed carries the new values, `gather_whole` and `scatter` round-trip;
//! - `Trainer::finetune` of a random Llama with `--zero 3 --recompute full` equals the ZeRO-2
//!   run with full recompute bit for bit (losses, gradient norms, the final checkpoint's model
//!   and optimizer files) in BF16 with and without clipping and in FP8 (delayed scaling), and
//!   follows one GPU on the same global batch (losses within 2e-2);
//! - its peak memory is below ZeRO-2's (a model whose layers dominate);
//! - a ZeRO-3 checkpoint resumes bit for bit, and a ZeRO-2 checkpoint resumes as ZeRO-3;
//! - the whole-parameter view a save reads gathers one layer at a time, bit for bit;
//! - the typed refusals (one GPU): ZeRO-3 without full recompute, for the GPT presets, a plain
//!   step of a ZeRO-3 optimizer, `step_sharded` of a ZeRO-2 one.
//!
//! Each multi-GPU test re-runs this binary as its ranks (`multi_gpu::on_ranks`); skipped with
//! fewer than two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use crate::common::{device, randn};
use crate::multi_gpu::{on_ranks, Layout};
use crate::zero::{bits, stopped_at};
use std::path::Path;
use std::sync::Arc;
use te_models::decoder::train::DecoderLm;
use te_models::decoder::{DecoderConfig, DecoderWeights};
use te_nn::fp8::{DelayedScaling, Recipe};
use te_nn::modules::{Module, Param, ParamKind, Recompute};
use te_nn::parallel::{Gathered, GradShards, Parallel, ParamShards, Shard};
use te_runtime::dist::ProcessGroup;
use te_runtime::{DType, Device, Error, Tensor};
use te_train::data::{TokenDocs, TokenSplit};
use te_train::optim::{AdamW, OptimizerMemory, ZeroStage};
use te_train::{Backend, CheckpointOptions, Pack, Precision, Record, RunSummary, TrainConfig, TrainError, Trainer};

const MIB: f64 = (1u64 << 20) as f64;
const SEQ: usize = 64;
const VOCAB: usize = 512;

/// A Llama (GQA) of `layers` layers of hidden size `hidden`: at 128, a layer's fc1 (98 304
/// elements) is split between the two ranks' pieces, so gathers take pieces from both.
fn config(layers: usize, hidden: usize) -> DecoderConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {VOCAB},
        "hidden_size": {hidden}, "intermediate_size": {}, "num_hidden_layers": {layers}, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": {}, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": false}}"#,
        3 * hidden,
        hidden / 4
    );
    DecoderConfig::from_hf_json(&json).unwrap()
}

/// Documents of a repeating token cycle, split for training and validation.
fn data() -> TokenSplit {
    let cycle: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
    let docs: Vec<Vec<u32>> = (0..40).map(|d| (0..300).map(|t| cycle[(t + d * 7) % cycle.len()]).collect()).collect();
    TokenDocs::from_documents(&docs).split(0.1, 1).unwrap()
}

/// `steps` steps of `batch` sequences a rank, clipping at `clip`, FP8 runs under delayed
/// scaling.
fn train_config(steps: u64, batch: usize, clip: f32) -> TrainConfig {
    let recipe: Recipe = DelayedScaling::default().into();
    TrainConfig {
        batch,
        grad_accum: 1,
        lr: 3e-3,
        max_grad_norm: clip,
        eval_interval: 3,
        eval_batches: 2,
        recipe,
        ..TrainConfig::new(te_models::gpt::GptConfig::tiny(), steps)
    }
}

/// One `Trainer::finetune` of the decoder `w` as a rank of `parallel` with `zero` and full
/// recompute: the summary, each step's gradient norm bits, the optimizer memory.
#[allow(clippy::too_many_arguments)]
fn finetune(
    dev: &Arc<Device>,
    w: &DecoderWeights,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    parallel: &mut Parallel,
    zero: ZeroStage,
) -> (RunSummary, Vec<u32>, OptimizerMemory) {
    let trainer = Trainer::new(cfg.clone(), Backend::Gpu(dev.clone())).unwrap().with_checkpoints(ckpt.clone());
    let trainer = trainer.with_parallel(std::mem::take(parallel)).unwrap().with_zero(zero).unwrap();
    let mut trainer = trainer.with_recompute(Recompute::Full).unwrap();
    let mut m = DecoderLm::from_weights(dev, w, DType::BF16).unwrap();
    let mut norms = Vec::new();
    let summary = trainer
        .finetune(&mut m, &data(), (SEQ, Pack::Blocks), precision, |p| norms.push(p.grad_norm.to_bits()))
        .unwrap();
    assert!(!m.is_zero3(), "the model is whole again after the run");
    let memory = trainer.optimizer_memory().unwrap();
    *parallel = trainer.into_parallel();
    (summary, norms, memory)
}

/// The tensors of a safetensors file by name, bytes and all.
fn tensors(path: &Path) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<u8>)> = st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
    v.sort();
    v
}

/// Whether two checkpoint directories hold the same model and optimizer tensors, bit for bit.
fn same_checkpoint(a: &Path, b: &Path) -> bool {
    ["model.safetensors", "optimizer.safetensors"].iter().all(|f| tensors(&a.join(f)) == tensors(&b.join(f)))
}

/// The records of two runs step by step where they differ (train and validation losses with
/// their bits; the gradient norms when given), printed before a bit-for-bit assertion so a
/// failure tells how far apart the runs are and from which step.
fn report_difference(what: &str, a: (&str, &[Record], &[u32]), b: (&str, &[Record], &[u32])) {
    let ((an, ar, anorm), (bn, br, bnorm)) = (a, b);
    if bits(ar) == bits(br) && anorm == bnorm {
        return;
    }
    eprintln!("{what}: {an} and {bn} differ ({} and {} records)", ar.len(), br.len());
    let val = |v: Option<f32>| v.map_or_else(|| "-".to_string(), |x| format!("{x:.7} ({:#010x})", x.to_bits()));
    for (k, (x, y)) in ar.iter().zip(br).enumerate() {
        let norms = match (anorm.get(k), bnorm.get(k)) {
            (Some(&p), Some(&q)) => format!("; grad norm {} vs {}", f32::from_bits(p), f32::from_bits(q)),
            _ => String::new(),
        };
        let same = x.train_loss.to_bits() == y.train_loss.to_bits()
            && x.val_loss.map(f32::to_bits) == y.val_loss.map(f32::to_bits)
            && anorm.get(k) == bnorm.get(k);
        eprintln!(
            "{what}: step {} {}: train {:.7} ({:#010x}) vs {:.7} ({:#010x}), diff {:.3e}; val {} vs {}{norms}",
            x.step,
            if same { "same" } else { "DIFFERS" },
            x.train_loss,
            x.train_loss.to_bits(),
            y.train_loss,
            y.train_loss.to_bits(),
            x.train_loss - y.train_loss,
            val(x.val_loss),
            val(y.val_loss),
        );
    }
}

/// `ParamShards` on two ranks over uneven pieces: every rank's gather of a group is the whole
/// tensors bit for bit (prefetched or not, through the ring of 2 slots), a gather after a
/// rank's piece changed carries the change, `gather_whole` agrees, and `scatter` takes a rank's
/// pieces of new values.
#[test]
fn param_shards_gather_rebuilds_the_whole_tensors() {
    let test = "zero3::param_shards_gather_rebuilds_the_whole_tensors";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        let s = |root, range| Shard { root, range };
        // 3 groups of 2 parameters: split unevenly, whole on one rank, whole on the other.
        let owners = vec![
            vec![s(0, 0..500), s(1, 500..1001)],
            vec![s(1, 0..37)],
            vec![s(0, 0..96), s(1, 96..333)],
            vec![s(0, 0..40)],
            vec![s(0, 0..200), s(1, 200..1001)],
            vec![s(1, 0..37)],
        ];
        let shards = GradShards::new(2, owners).unwrap();
        let shapes: [&[usize]; 6] = [&[7, 143], &[37], &[9, 37], &[40], &[7, 143], &[37]];
        let value = |i: usize| randn(100 + i as u64, shapes[i].iter().product(), 1.0);
        let whole: Vec<Tensor> =
            (0..6).map(|i| Tensor::from_f32(dev, DType::BF16, shapes[i], &value(i)).unwrap()).collect();
        let mut store = ParamShards::new(group.clone(), shards, 2).unwrap();
        for g in 0..3 {
            assert_eq!(
                store.add_group(&[(2 * g, whole[2 * g].clone()), (2 * g + 1, whole[2 * g + 1].clone())]).unwrap(),
                g
            );
        }
        let (local, all) = store.bytes();
        assert!(local < all && all == 2 * (1001 + 37 + 333 + 40 + 1001 + 37), "{local} of {all}");
        let check = |got: &[Tensor], g: usize, what: &str| {
            for (k, t) in got.iter().enumerate() {
                let want = whole[2 * g + k].to_bytes(dev).unwrap();
                assert_eq!(t.to_bytes(dev).unwrap(), want, "rank {} group {g} param {k}: {what}", env.rank);
            }
        };
        let high = |got: Vec<Gathered>| -> Vec<Tensor> {
            got.into_iter()
                .map(|v| match v {
                    Gathered::High(t) => t,
                    Gathered::Fp8(_) => panic!("no FP8 gather was asked for"),
                })
                .collect()
        };
        // Forward order with prefetch, then backward order.
        for g in 0..3 {
            let got = high(store.gather(g).unwrap());
            if g + 1 < 3 {
                store.prefetch(g + 1).unwrap();
            }
            check(&got, g, "forward");
            store.release(g);
        }
        for g in (0..3).rev() {
            let got = high(store.gather(g).unwrap());
            check(&got, g, "backward");
            store.release(g);
        }
        for g in 0..3 {
            check(&store.gather_whole(g).unwrap(), g, "gather_whole");
        }
        // Rank 1 changes its piece of parameter 0 in place (as an optimizer step does): the next
        // gather carries it on both ranks.
        let pieces = store.local_pieces();
        assert!(pieces.iter().all(Option::is_some), "every parameter is sharded");
        if env.rank == 1 {
            let p = pieces[0].as_ref().unwrap();
            assert_eq!(p.numel(), 501);
            p.copy_from(&Tensor::zeros(dev, DType::BF16, &[501]).unwrap()).unwrap();
        }
        store.release_all();
        let got = store.gather(0).unwrap()[0].data().to_f32(dev).unwrap();
        let mut want = Tensor::from_f32(dev, DType::BF16, shapes[0], &value(0)).unwrap().to_f32(dev).unwrap();
        want[500..].iter_mut().for_each(|x| *x = 0.0);
        assert_eq!(got, want, "rank {}: the changed piece gathered", env.rank);
        store.release(0);
        // Scatter of new values, then a gather gives them back.
        let new: Vec<Tensor> = (0..2)
            .map(|k| {
                Tensor::from_f32(
                    dev,
                    DType::BF16,
                    shapes[2 + k],
                    &randn(7 + k as u64, shapes[2 + k].iter().product(), 1.0),
                )
                .unwrap()
            })
            .collect();
        store.scatter(1, &new).unwrap();
        let got = high(store.gather(1).unwrap());
        for (t, n) in got.iter().zip(&new) {
            assert_eq!(t.to_bytes(dev).unwrap(), n.to_bytes(dev).unwrap(), "rank {}: scattered", env.rank);
        }
        // Refusals.
        let e = store.scatter(1, &new[..1]).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{e}");
        let e = store.prefetch(3).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("add it first"), "{e}");
        let e = store.add_group(&[(0, whole[0].clone())]).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("in a group already"), "{e}");
        group.barrier().unwrap();
    });
}

/// `Trainer::finetune` with `--zero 3 --recompute full` is the ZeRO-2 run with full recompute bit
/// for bit (the same pieces, gradients, norms and updates; only where the weights live
/// differs): losses, gradient norms and the final checkpoint, in BF16 without clipping and with
/// a threshold every step crosses, and in FP8 (delayed scaling). It also follows one GPU on the
/// same global batch, and the optimizer line reports the kept share of the layer weights.
#[test]
fn zero_3_finetune_equals_zero_2_bit_for_bit() {
    let test = "zero3::zero_3_finetune_equals_zero_2_bit_for_bit";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let world = Arc::new(pg);
        let w = DecoderLm::new(dev, config(3, 128), DType::BF16).unwrap().to_weights().unwrap();
        let root = std::env::temp_dir().join(format!("te-zero3-train-{}", env.master_port));
        for (precision, clip) in [(Precision::Bf16, f32::INFINITY), (Precision::Bf16, 0.05), (Precision::Fp8, 1.0)] {
            let cfg = train_config(6, 2, clip);
            let what = format!("{precision:?} clip {clip} rank {}", env.rank);
            let mut outs = Vec::new();
            for zero in [ZeroStage::Gradients, ZeroStage::Parameters] {
                let dir = root.join(format!("{}-{clip}-{}", precision.name(), zero.number()));
                let ckpt = CheckpointOptions { dir: Some(dir.clone()), interval: 6, ..CheckpointOptions::default() };
                let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
                let (summary, norms, memory) = finetune(dev, &w, &cfg, precision, &ckpt, &mut parallel, zero);
                assert_eq!(summary.records.len(), 6, "{what}");
                outs.push((summary, norms, memory, dir.join(precision.name()).join("step-0000006")));
            }
            let (two, two_norms, two_mem, two_dir) = &outs[0];
            let (three, three_norms, three_mem, three_dir) = &outs[1];
            report_difference(&what, ("ZeRO-3", &three.records, three_norms), ("ZeRO-2", &two.records, two_norms));
            assert_eq!(bits(&three.records), bits(&two.records), "{what}: the losses");
            assert_eq!(three_norms, two_norms, "{what}: the gradient norms");
            if clip < 1.0 {
                assert!(two_norms.iter().all(|&n| f32::from_bits(n) > clip), "{what}: every step is clipped");
            }
            assert_eq!((three_mem.stage, three_mem.ranks), (ZeroStage::Parameters, 2), "{what}");
            assert_eq!(three_mem.bytes_per_rank, two_mem.bytes_per_rank, "{what}: ZeRO-2's optimizer pieces");
            assert_eq!(three_mem.released_gradient_bytes, two_mem.released_gradient_bytes, "{what}");
            let (kept, all) = three_mem.sharded_weight_bytes;
            assert!(kept > 0 && kept < all, "{what}: {}", three_mem.describe());
            eprintln!(
                "{what}: {}; peak {:.2} MiB (ZeRO-3) vs {:.2} MiB (ZeRO-2)",
                three_mem.describe(),
                three.peak_memory as f64 / MIB,
                two.peak_memory as f64 / MIB
            );
            world.barrier().unwrap();
            if env.rank == 0 {
                assert!(same_checkpoint(three_dir, two_dir), "{what}: the final checkpoint differs");
            }
            world.barrier().unwrap();
        }
        // One GPU on the same global batch (2 × 2 sequences), replicated: the same losses to
        // rounding (the gradients are averaged over the ranks in BF16).
        let cfg = train_config(6, 2, 1.0);
        let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
        let ckpt = CheckpointOptions::default();
        let (three, _, _) = finetune(dev, &w, &cfg, Precision::Bf16, &ckpt, &mut parallel, ZeroStage::Parameters);
        let one_cfg = TrainConfig { batch: 4, ..cfg.clone() };
        let mut single = Parallel::default();
        let (one, _, _) = finetune(dev, &w, &one_cfg, Precision::Bf16, &ckpt, &mut single, ZeroStage::Replicated);
        for (g, o) in three.records.iter().zip(&one.records) {
            let e = (g.train_loss - o.train_loss).abs() / o.train_loss;
            eprintln!("step {}: ZeRO-3 on 2 GPUs {:.5}, one GPU {:.5}", g.step, g.train_loss, o.train_loss);
            assert!(e <= 2e-2, "rank {}: step {}: {} against {}", env.rank, g.step, g.train_loss, o.train_loss);
        }
        world.barrier().unwrap();
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}

/// ZeRO-3's peak memory is below ZeRO-2's on a model whose layers dominate (12 layers of
/// hidden 512: about 91 MiB of BF16 layer weights, of which each rank keeps about half plus
/// two layers' gather buffers).
#[test]
fn zero_3_peak_memory_is_below_zero_2() {
    let test = "zero3::zero_3_peak_memory_is_below_zero_2";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let world = Arc::new(pg);
        let cfg_model = config(12, 512);
        let w = DecoderLm::new(dev, cfg_model.clone(), DType::BF16).unwrap().to_weights().unwrap();
        let cfg = train_config(2, 2, 1.0);
        let ckpt = CheckpointOptions::default();
        let mut peaks = Vec::new();
        for zero in [ZeroStage::Gradients, ZeroStage::Parameters] {
            // Where the time goes (a run of this test was cut at 75 s without output).
            let start = std::time::Instant::now();
            eprintln!("rank {} {zero:?}: starting", env.rank);
            let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
            let (summary, _, memory) = finetune(dev, &w, &cfg, Precision::Bf16, &ckpt, &mut parallel, zero);
            let ms: Vec<String> = summary.records.iter().map(|r| format!("{:.0}", r.step_ms)).collect();
            eprintln!(
                "rank {} {zero:?}: peak {:.2} MiB; {}; {:.1} s, steps {} ms",
                env.rank,
                summary.peak_memory as f64 / MIB,
                memory.describe(),
                start.elapsed().as_secs_f64(),
                ms.join(", ")
            );
            peaks.push(summary.peak_memory);
        }
        let saving = DecoderLm::zero3_weight_saving(&cfg_model, 2);
        eprintln!("rank {}: the estimate's ZeRO-3 saving {:.2} MiB", env.rank, saving as f64 / MIB);
        assert!(peaks[1] < peaks[0], "rank {}: ZeRO-3 peak {} vs ZeRO-2 {}", env.rank, peaks[1], peaks[0]);
        world.barrier().unwrap();
    });
}

/// `DecoderLm::with_whole_parameters` under ZeRO-3 (what a checkpoint save reads) hands every
/// layer parameter whole, bit for bit the weights before sharding, while holding one layer whole
/// at a time: the peak above the memory in use stays below two layers' bytes (12 layers of
/// hidden 512). A rank whose closure visits nothing (a rank that writes no file) still joins
/// every gather, in order; a second visit of the view is refused.
#[test]
fn zero_3_whole_parameters_gathers_one_layer_at_a_time() {
    let test = "zero3::zero_3_whole_parameters_gathers_one_layer_at_a_time";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        let mut m = DecoderLm::new(dev, config(12, 512), DType::BF16).unwrap();
        let mut want: Vec<(String, Vec<u8>)> = Vec::new();
        m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> te_runtime::Result<()> {
            want.push((path.to_owned(), p.tensor().unwrap().to_bytes(dev)?));
            Ok(())
        })
        .unwrap();
        m.set_recompute(Recompute::Full).unwrap();
        m.set_zero3(group.clone(), AdamW::zero_shards(&m, 2).unwrap()).unwrap();
        let (_, all) = m.zero3_bytes().unwrap();
        let layer_bytes = all / 12;
        // Rank 1 first visits nothing while rank 0 reads everything: the same gathers.
        for round in 0..2 {
            dev.synchronize().unwrap();
            let base = dev.memory_in_use().unwrap();
            dev.reset_peak_memory().unwrap();
            let mut got: Vec<(String, Vec<u8>)> = Vec::new();
            let reads = env.rank == 0 || round == 1;
            m.with_whole_parameters(&mut |view: &dyn Module| {
                if !reads {
                    return Ok(());
                }
                view.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> te_runtime::Result<()> {
                    got.push((path.to_owned(), p.tensor().unwrap().to_bytes(dev)?));
                    Ok(())
                })?;
                let e =
                    view.visit("", &mut |_: &str, _: ParamKind, _: &dyn Param| -> te_runtime::Result<()> { Ok(()) });
                assert!(matches!(e, Err(Error::Config { .. })), "a second visit is refused");
                Ok(())
            })
            .unwrap();
            dev.synchronize().unwrap();
            let above = dev.peak_memory().unwrap().saturating_sub(base);
            eprintln!(
                "rank {} round {round}: {:.2} MiB above the memory in use; one layer {:.2} MiB",
                env.rank,
                above as f64 / MIB,
                layer_bytes as f64 / MIB
            );
            assert!(above < 2 * layer_bytes, "rank {}: {above} bytes above, a layer is {layer_bytes}", env.rank);
            if reads {
                assert_eq!(got.len(), want.len(), "rank {}", env.rank);
                for ((gp, gb), (wp, wb)) in got.iter().zip(&want) {
                    assert_eq!(gp, wp);
                    assert!(gb == wb, "rank {}: {gp} differs from the weights before sharding", env.rank);
                }
            }
            group.barrier().unwrap();
        }
        m.zero3_unshard().unwrap();
    });
}

/// A ZeRO-3 run checkpointed at step 3 and resumed finishes bit for bit as the straight run; a
/// ZeRO-2 checkpoint resumes as ZeRO-3 bit for bit (the same files, the same steps).
#[test]
fn zero_3_checkpoints_resume_bit_exactly() {
    let test = "zero3::zero_3_checkpoints_resume_bit_exactly";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let world = Arc::new(pg);
        let w = DecoderLm::new(dev, config(3, 128), DType::BF16).unwrap().to_weights().unwrap();
        let root = std::env::temp_dir().join(format!("te-zero3-resume-{}", env.master_port));
        let precision = Precision::Bf16;
        let cfg = train_config(6, 2, 0.05);
        let ckpt = |dir: &Path, resume: bool| CheckpointOptions {
            dir: Some(dir.to_path_buf()),
            interval: 3,
            resume,
            ..CheckpointOptions::default()
        };
        let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
        let mut go = |dir: &Path, resume: bool, zero| {
            finetune(dev, &w, &cfg, precision, &ckpt(dir, resume), &mut parallel, zero)
        };
        let (three_dir, two_dir) = (root.join("zero3"), root.join("zero2"));
        let (straight, norms, _) = go(&three_dir, false, ZeroStage::Parameters);
        let (two, two_norms, _) = go(&two_dir, false, ZeroStage::Gradients);
        let what = format!("rank {}", env.rank);
        report_difference(&what, ("ZeRO-3", &straight.records, &norms), ("ZeRO-2", &two.records, &two_norms));
        assert_eq!(bits(&straight.records), bits(&two.records), "{what}: ZeRO-3 vs ZeRO-2");
        assert_eq!(norms, two_norms, "{what}");
        for (name, src) in [("ZeRO-3 resumed as ZeRO-3", &three_dir), ("ZeRO-2 resumed as ZeRO-3", &two_dir)] {
            let dst = root.join(name.replace(' ', "-"));
            stopped_at(&world, env.rank, src, &dst, precision, 3);
            let (resumed, resumed_norms, _) = go(&dst, true, ZeroStage::Parameters);
            // The resumed run's records hold the checkpoint's history too; its norms are its own
            // steps' only (compared below).
            report_difference(
                &format!("{what}: {name}"),
                ("resumed", &resumed.records, &[]),
                ("straight", &straight.records, &[]),
            );
            assert_eq!(bits(&resumed.records), bits(&straight.records), "{what}: {name}");
            assert_eq!(resumed_norms[..], norms[3..], "{what}: {name}: the norms of steps 4 to 6");
            world.barrier().unwrap();
            if env.rank == 0 {
                let last = |d: &Path| d.join(precision.name()).join("step-0000006");
                assert!(same_checkpoint(&last(&dst), &last(&three_dir)), "{what}: {name}: the step-6 checkpoint");
            }
            world.barrier().unwrap();
        }
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}

/// The refusals, on one GPU: `--zero 3` without full recompute and for the GPT presets
/// (`TrainError::Unsupported`, naming what to change); `DecoderLm::set_zero3` without full
/// recompute and twice, `to_weights` of a sharded model; a plain step of a ZeRO-3 optimizer and `step_sharded` of a ZeRO-2 one
/// (`Error::Config`); `DataParallel::begin_step` of a sharded model (its layers share the ring's
/// storage) and `begin_step_reversed` of another parameter count.
#[test]
fn zero_3_refusals_are_typed() {
    let Some(dev) = device() else { return };
    let group = Arc::new(ProcessGroup::single(&dev).unwrap());
    let w = DecoderLm::new(&dev, config(3, 64), DType::BF16).unwrap().to_weights().unwrap();
    // The trainer: no full recompute; the GPT presets.
    let cfg = train_config(2, 2, 1.0);
    let mut trainer =
        Trainer::new(cfg.clone(), Backend::Gpu(dev.clone())).unwrap().with_zero(ZeroStage::Parameters).unwrap();
    let mut m = DecoderLm::from_weights(&dev, &w, DType::BF16).unwrap();
    let e = trainer.finetune(&mut m, &data(), (SEQ, Pack::Blocks), Precision::Bf16, |_| {}).unwrap_err();
    assert!(matches!(e, TrainError::Unsupported { .. }) && e.to_string().contains("add --recompute full"), "{e}");
    let e = trainer.train(&crate::train::corpus(), Precision::Bf16, |_| {}).unwrap_err();
    assert!(matches!(e, TrainError::Unsupported { .. }) && e.to_string().contains("decoder family"), "{e}");
    // The library: set_zero3 without full recompute, then twice.
    let opt = AdamW::new_zero_stage(&dev, &m, cfg.adamw_config(), group.clone(), ZeroStage::Parameters).unwrap();
    let shards = opt.grad_shards().unwrap().clone();
    let e = m.set_zero3(group.clone(), shards.clone()).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("--recompute full"), "{e}");
    m.set_recompute(Recompute::Full).unwrap();
    m.set_zero3(group.clone(), shards.clone()).unwrap();
    let e = m.set_zero3(group.clone(), shards.clone()).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("sharded already"), "{e}");
    let e = m.set_recompute(Recompute::None).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("zero3_unshard"), "{e}");
    let e = m.to_weights().unwrap_err();
    assert!(e.to_string().contains("zero3_unshard"), "{e}");
    // A step: the plain one refused; step_sharded of a ZeRO-2 optimizer refused.
    let ids: Vec<i32> = (0..SEQ as i32 * 2).map(|i| i * 7 % VOCAB as i32).collect();
    let x = te_nn::modules::TokenIds::from_host(&dev, &[SEQ, 2], &ids).unwrap();
    let (_, ctx) = m.forward_loss(&x, &x).unwrap();
    m.backward(ctx).unwrap();
    let mut opt = opt;
    let e = opt.step(&mut m).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let reduced = vec![true; shards.len()];
    let e = opt.step_reduced(&mut m, &reduced).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("step_sharded"), "{e}");
    let pieces = m.zero3_pieces().unwrap();
    let mut two = AdamW::new_zero_stage(&dev, &m, cfg.adamw_config(), group.clone(), ZeroStage::Gradients).unwrap();
    let e = two.step_sharded(&mut m, &reduced, &pieces).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("step_reduced"), "{e}");
    let e = opt.step_sharded(&mut m, &reduced, &pieces[1..]).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    // On one rank every piece is whole: the sharded step runs, and the model still gives the
    // same loss as a whole copy of it with the same update.
    opt.step_sharded(&mut m, &reduced, &pieces).unwrap();
    // DataParallel: the sharded layers share the ring's storage.
    let mut dp = te_nn::parallel::DataParallel::new(group.clone()).unwrap();
    dp.set_grad_shards(Some(shards.clone())).unwrap();
    let e = dp.begin_step(&m).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("shares its storage"), "{e}");
    let e = dp.begin_step_reversed(shards.len() + 1).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    dp.begin_step_reversed(shards.len()).unwrap();
    m.zero3_unshard().unwrap();
    assert!(!m.is_zero3());
}

/// ZeRO-3's optimizer built after the model was sharded (`AdamW::zero_shards`, `set_zero3`,
/// `AdamW::new_zero3` from the pieces) holds the masters of one built from the whole model
/// before, bit for bit, and its split is that optimizer's; the pieces are the optimizer's pieces
/// (one rank: whole), `None` outside the layers; a list of other length is refused.
#[test]
fn zero_3_optimizer_built_from_the_pieces_equals_one_built_whole() {
    let Some(dev) = device() else { return };
    let group = Arc::new(ProcessGroup::single(&dev).unwrap());
    let adamw = train_config(1, 2, 1.0).adamw_config();
    let mut m = DecoderLm::new(&dev, config(3, 128), DType::BF16).unwrap();
    let whole = AdamW::new_zero_stage(&dev, &m, adamw, group.clone(), ZeroStage::Parameters).unwrap();
    let shards = AdamW::zero_shards(&m, 1).unwrap();
    assert_eq!(&shards, whole.grad_shards().unwrap(), "the split is known before the optimizer");
    m.set_recompute(Recompute::Full).unwrap();
    m.set_zero3(group.clone(), shards).unwrap();
    let pieces = m.zero3_pieces().unwrap();
    let e = AdamW::new_zero3(&dev, &m, adamw, group.clone(), &pieces[1..]).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("local pieces"), "{e}");
    let sharded = AdamW::new_zero3(&dev, &m, adamw, group, &pieces).unwrap();
    assert_eq!(sharded.zero_stage(), ZeroStage::Parameters);
    let stream = dev.stream();
    for ((a, b), p) in sharded.states().iter().zip(whole.states()).zip(&pieces) {
        assert_eq!(a.piece, b.piece, "{}", a.path);
        let (ma, mb) = (stream.clone_dtoh(&a.master).unwrap(), stream.clone_dtoh(&b.master).unwrap());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&ma), bits(&mb), "{}: the masters", a.path);
        match p {
            Some(p) => assert_eq!(p.numel(), a.piece.len(), "{}", a.path),
            None => assert!(!a.path.starts_with("layers."), "{} is a layer parameter", a.path),
        }
    }
    assert!(pieces.iter().any(Option::is_some) && pieces.iter().any(Option::is_none));
}
