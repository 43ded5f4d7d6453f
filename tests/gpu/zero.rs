//! ZeRO stage 1 (Megatron-LM's distributed optimizer: the f32 masters and AdamW moments sharded
//! over the data-parallel group; `te_train::optim::AdamW::new_zero`, `Trainer::with_zero`) on two
//! ranks against the replicated optimizer:
//!
//! - an AdamW step of pieces equals the replicated step bit for bit, with and without clipping
//!   (the pieces start at multiples of the fused kernel's chunk, so the norm's partial sums are
//!   the replicated step's, summed in the same order), and each rank holds its pieces' state only
//!   (about half of it); the typed refusals (a side-stream group, tensor parallelism);
//! - data-parallel training runs of a small GPT with ZeRO-1 equal the replicated runs bit for bit
//!   (losses, gradient norms, final weights and optimizer state), in BF16 and FP8, with and
//!   without clipping;
//! - a ZeRO-1 checkpoint (rank 0 writes the replicated run's format) resumes bit for bit, and
//!   the replicated and ZeRO-1 checkpoints load into each other's runs.
//!
//! Each test re-runs this binary as its ranks (`multi_gpu::on_ranks`); skipped with fewer than
//! two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use crate::multi_gpu::{on_ranks, Layout};
use crate::train::{CheckpointOptions, Precision, Record, TrainConfig};
use std::path::Path;
use std::sync::Arc;
use te_models::gpt::{Gpt, GptConfig};
use te_nn::modules::{ModuleVisitor, Param, ParamKind, TokenIds};
use te_nn::parallel::Parallel;
use te_nn::Module;
use te_runtime::dist::ProcessGroup;
use te_runtime::ops::optimizer::CHUNK;
use te_runtime::{Device, Error};
use te_train::data::Corpus;
use te_train::optim::{AdamW, AdamWConfig, LrSchedule, OptimizerMemory, Partition, ZeroStage};
use te_train::{Backend, RunSummary, Trainer};

/// Every parameter's raw bytes, by path.
struct Values(Vec<(String, Vec<u8>)>, Arc<Device>);

impl ModuleVisitor for Values {
    fn param(&mut self, path: &str, _: ParamKind, p: &dyn Param) -> te_runtime::Result<()> {
        let t = p.tensor().expect("a high-precision parameter");
        self.0.push((path.to_owned(), t.to_bytes(&self.1)?));
        Ok(())
    }
}

pub(crate) fn values(model: &Gpt, dev: &Arc<Device>) -> Vec<(String, Vec<u8>)> {
    let mut v = Values(Vec::new(), dev.clone());
    model.visit("", &mut v).unwrap();
    v.0
}

/// Every parameter's state of `opt` as bits: `(path, step, master, exp_avg, exp_avg_sq)`.
pub(crate) type StateBits = Vec<(String, u64, Vec<u32>, Vec<u32>, Vec<u32>)>;

pub(crate) fn state_bits(opt: &AdamW, dev: &Device) -> StateBits {
    let bits = |s: &cudarc::driver::CudaSlice<f32>| -> Vec<u32> {
        dev.stream().clone_dtoh(s).unwrap().iter().map(|v| v.to_bits()).collect()
    };
    opt.states()
        .iter()
        .map(|s| (s.path.clone(), s.step, bits(&s.master), bits(&s.exp_avg), bits(&s.exp_avg_sq)))
        .collect()
}

/// The optimizer state file at `path` as bits, read into a replicated AdamW of `cfg`'s model.
pub(crate) fn state_file_bits(dev: &Arc<Device>, cfg: &TrainConfig, path: &Path) -> (u64, StateBits) {
    let model = Gpt::new(dev, cfg.model.clone()).unwrap();
    let mut opt = AdamW::new(dev, &model, cfg.adamw_config()).unwrap();
    opt.load_state(path).unwrap();
    (opt.step_count(), state_bits(&opt, dev))
}

pub(crate) fn zero_config(clip: Option<f32>) -> AdamWConfig {
    AdamWConfig {
        max_grad_norm: clip,
        weight_decay: 0.1,
        betas: (0.9, 0.95),
        decay_biases_and_norms: false,
        skip_nonfinite: true,
        ..AdamWConfig::new(LrSchedule::Constant(2e-3))
    }
}

/// Three AdamW steps of a 2-layer GPT on the same batch on both ranks (so the gradients are
/// equal without a reduction): the sharded optimizer's parameters, norms and (gathered) state
/// equal the replicated optimizer's bit for bit; each rank holds exactly its partition's pieces.
#[test]
fn a_zero_1_step_equals_the_replicated_step_and_holds_half_the_state() {
    let test = "zero::a_zero_1_step_equals_the_replicated_step_and_holds_half_the_state";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        // Hidden 160 (not a power of two): the fc weights are 160 × 640 = 102 400 elements,
        // 3.125 chunks, so a boundary falls inside one.
        let cfg = GptConfig {
            num_layers: 2,
            hidden_size: 160,
            num_attention_heads: 5,
            ffn_hidden_size: 640,
            seq_length: 48,
            hidden_dropout: 0.0,
            seed: 11,
            ..GptConfig::tiny()
        };
        let (s, b) = (48, 3);
        let ids: Vec<i32> = (0..s * b).map(|i| ((i * 7 + i / 5) % 256) as i32).collect();
        let targets: Vec<i32> = (0..s * b).map(|i| ((i * 11 + 3) % 256) as i32).collect();
        let x = TokenIds::from_host(dev, &[s, b], &ids).unwrap();
        let y = TokenIds::from_host(dev, &[s, b], &targets).unwrap();
        for clip in [None, Some(0.05)] {
            let what = format!("clip {clip:?} rank {}", env.rank);
            let mut full = Gpt::new(dev, cfg.clone()).unwrap();
            let mut sharded = Gpt::new(dev, cfg.clone()).unwrap();
            let mut a = AdamW::new(dev, &full, zero_config(clip)).unwrap();
            let mut z = AdamW::new_zero(dev, &sharded, zero_config(clip), group.clone()).unwrap();
            assert_eq!((a.zero_ranks(), z.zero_ranks()), (None, Some(2)));

            // The state each rank holds: its partition's pieces, about half of the model's.
            let numels: Vec<usize> = a.states().iter().map(|s| s.numel()).collect();
            let total: usize = numels.iter().sum();
            let partition = Partition::new(&numels, 2, CHUNK).unwrap();
            assert_eq!(z.state_bytes(), 12 * partition.owned(env.rank) as u64, "{what}");
            assert_eq!((a.state_bytes(), a.replicated_state_bytes()), (12 * total as u64, 12 * total as u64));
            assert_eq!(z.replicated_state_bytes(), a.state_bytes());
            let fraction = z.state_bytes() as f64 / a.state_bytes() as f64;
            let slack = CHUNK as f64 / total as f64;
            assert!((fraction - 0.5).abs() <= slack, "{what}: {fraction} of the replicated state ({total} elements)");
            for (i, st) in z.states().iter().enumerate() {
                assert_eq!(st.piece, partition.piece(env.rank, i), "{what}: {}", st.path);
                assert_eq!(st.piece.start % CHUNK, 0, "{what}: {} piece {:?}", st.path, st.piece);
            }

            for step in 1..=3 {
                let (_, ctx) = full.forward_loss(&x, &y).unwrap();
                full.backward(ctx).unwrap();
                let (_, ctx) = sharded.forward_loss(&x, &y).unwrap();
                sharded.backward(ctx).unwrap();
                let (sa, sz) = (a.step(&mut full).unwrap(), z.step(&mut sharded).unwrap());
                assert_eq!(sa.grad_norm.to_bits(), sz.grad_norm.to_bits(), "{what} step {step}: the norm");
                assert_eq!(sa.clip_coef.to_bits(), sz.clip_coef.to_bits(), "{what} step {step}");
                if clip.is_some() {
                    assert!(sa.clip_coef < 1.0, "{what}: the gradients are clipped ({})", sa.grad_norm);
                }
                let (va, vz) = (values(&full, dev), values(&sharded, dev));
                assert_eq!(va.len(), vz.len());
                for ((path, p), (_, q)) in va.iter().zip(&vz) {
                    assert!(p == q, "{what} step {step}: {path} differs from the replicated step's");
                }
                full.zero_grad();
                sharded.zero_grad();
            }

            // The sharded state, gathered into rank 0's file, is the replicated state.
            let dir = std::env::temp_dir().join(format!("te-zero-step-{}", env.master_port));
            if env.rank == 0 {
                std::fs::create_dir_all(&dir).unwrap();
            }
            group.barrier().unwrap();
            let file = dir.join(format!("{}.safetensors", clip.is_some()));
            z.save_state(&file).unwrap();
            group.barrier().unwrap();
            assert!(file.exists(), "{what}: rank 0 wrote the state");
            let mut loaded = AdamW::new(dev, &full, zero_config(clip)).unwrap();
            loaded.load_state(&file).unwrap();
            assert_eq!(loaded.step_count(), 3);
            assert!(state_bits(&loaded, dev) == state_bits(&a, dev), "{what}: the gathered state differs");
            // And the replicated file loads into a sharded optimizer, each rank keeping its pieces.
            let replicated = dir.join(format!("replicated-{}-{}.safetensors", clip.is_some(), env.rank));
            a.save_state(&replicated).unwrap();
            let mut resharded = AdamW::new_zero(dev, &sharded, zero_config(clip), group.clone()).unwrap();
            resharded.load_state(&replicated).unwrap();
            assert!(state_bits(&resharded, dev) == state_bits(&z, dev), "{what}: the replicated state's pieces");
            group.barrier().unwrap();
            if env.rank == 0 {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }

        // Typed refusals: a side-stream group; tensor parallelism with ZeRO.
        let side = Arc::new(group.with_side_stream().unwrap());
        let model = Gpt::new(dev, cfg.clone()).unwrap();
        let e = AdamW::new_zero(dev, &model, zero_config(None), side).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("side stream"), "{e}");
        let mut model = Gpt::new(dev, cfg.clone()).unwrap();
        let mut tp =
            AdamW::new_zero(dev, &model, zero_config(None), group.clone()).unwrap().with_tensor_parallel(group.clone());
        let (_, ctx) = model.forward_loss(&x, &y).unwrap();
        model.backward(ctx).unwrap();
        let e = tp.step(&mut model).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("tensor parallelism"), "{e}");
    });
}

/// A run of `cfg` through the [`Trainer`] as a rank of `parallel` with the optimizer state held
/// as `zero` says: the summary, each step's gradient norm bits, and the optimizer's memory.
pub(crate) fn run(
    dev: &Arc<Device>,
    corpus: &Corpus,
    cfg: &TrainConfig,
    precision: Precision,
    ckpt: &CheckpointOptions,
    parallel: &mut Parallel,
    zero: ZeroStage,
) -> (RunSummary, Vec<u32>, OptimizerMemory) {
    let trainer = Trainer::new(cfg.clone(), Backend::Gpu(dev.clone())).unwrap().with_checkpoints(ckpt.clone());
    let mut trainer = trainer.with_parallel(std::mem::take(parallel)).unwrap().with_zero(zero).unwrap();
    let mut norms = Vec::new();
    let summary = trainer.train(corpus, precision, |p| norms.push(p.grad_norm.to_bits())).unwrap();
    let memory = trainer.optimizer_memory().unwrap();
    *parallel = trainer.into_parallel();
    (summary, norms, memory)
}

pub(crate) fn bits(records: &[Record]) -> Vec<(u64, u32, Option<u32>)> {
    crate::train::losses(records)
}

pub(crate) fn base_config(steps: u64) -> TrainConfig {
    let base = crate::train::config(steps);
    TrainConfig { grad_accum: 1, eval_interval: 3, ..base }
}

/// Six data-parallel steps of the small GPT with ZeRO-1 equal the replicated run bit for bit:
/// losses, gradient norms, the final model and optimizer state (BF16 without clipping and with
/// a threshold every step crosses, FP8 with the default 1.0), at about half the optimizer bytes
/// per rank.
#[test]
fn zero_1_training_equals_the_replicated_run_bit_for_bit() {
    let test = "zero::zero_1_training_equals_the_replicated_run_bit_for_bit";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        let root = std::env::temp_dir().join(format!("te-zero-train-{}", env.master_port));
        let cases = [(Precision::Bf16, f32::INFINITY), (Precision::Bf16, 0.05), (Precision::Fp8, 1.0)];
        for (precision, clip) in cases {
            let cfg = TrainConfig { max_grad_norm: clip, ..base_config(6) };
            let what = format!("{precision:?} clip {clip} rank {}", env.rank);
            let mut outs = Vec::new();
            for zero in [ZeroStage::Replicated, ZeroStage::OptimizerStates] {
                let dir = root.join(format!("{}-{clip}-{}", precision.name(), zero.number()));
                let ckpt = CheckpointOptions { dir: Some(dir.clone()), interval: 6, ..CheckpointOptions::default() };
                let mut parallel = Parallel::data_parallel(world.clone()).unwrap();
                let (summary, norms, memory) = run(dev, &corpus, &cfg, precision, &ckpt, &mut parallel, zero);
                assert_eq!(summary.records.len(), 6, "{what}");
                outs.push((summary, norms, memory, dir.join(precision.name()).join("step-0000006")));
            }
            let [(rep, rep_norms, rep_mem, rep_dir), (zero, zero_norms, zero_mem, zero_dir)] = &outs[..] else {
                unreachable!("two runs")
            };
            assert_eq!(bits(&zero.records), bits(&rep.records), "{what}: the losses");
            assert_eq!(zero_norms, rep_norms, "{what}: the gradient norms");
            if clip < 1.0 {
                let clipped = rep_norms.iter().all(|&n| f32::from_bits(n) > clip);
                assert!(clipped, "{what}: every step is clipped ({rep_norms:?})");
            }
            // About half the optimizer state per rank.
            assert_eq!((rep_mem.ranks, rep_mem.fraction()), (1, 1.0), "{what}");
            assert_eq!((zero_mem.stage, zero_mem.ranks), (ZeroStage::OptimizerStates, 2), "{what}");
            assert_eq!(zero_mem.replicated_bytes, rep_mem.bytes_per_rank, "{what}");
            let slack = 12.0 * CHUNK as f64 / zero_mem.replicated_bytes as f64;
            assert!((zero_mem.fraction() - 0.5).abs() <= slack, "{what}: {}", zero_mem.describe());
            eprintln!("{what}: {}", zero_mem.describe());
            world.barrier().unwrap();
            if env.rank == 0 {
                // The same final weights and (gathered) optimizer state.
                let model = |d: &Path| std::fs::read(d.join("model.safetensors")).unwrap();
                let (m_rep, m_zero) = (model(rep_dir), model(zero_dir));
                let tensors = |b: &[u8]| {
                    let st = safetensors::SafeTensors::deserialize(b).unwrap();
                    let mut v: Vec<(String, Vec<u8>)> =
                        st.tensors().into_iter().map(|(n, t)| (n, t.data().to_vec())).collect();
                    v.sort();
                    v
                };
                assert!(tensors(&m_zero) == tensors(&m_rep), "{what}: the final model differs");
                let opt = |d: &Path| state_file_bits(dev, &cfg, &d.join("optimizer.safetensors"));
                assert!(opt(zero_dir) == opt(rep_dir), "{what}: the final optimizer state differs");
            }
            world.barrier().unwrap();
        }
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}

/// Rank 0 makes `dst` a run directory holding `src`'s checkpoint of `step` only, as the newest
/// (its `trainer.toml` over `latest.toml`): a run stopped after `step`. Every rank waits for it.
pub(crate) fn stopped_at(world: &ProcessGroup, rank: usize, src: &Path, dst: &Path, precision: Precision, step: u64) {
    if rank == 0 {
        let name = format!("step-{step:07}");
        let (from, to) = (src.join(precision.name()).join(&name), dst.join(precision.name()).join(&name));
        std::fs::create_dir_all(&to).unwrap();
        for f in ["model.safetensors", "optimizer.safetensors", "history.csv", "trainer.toml"] {
            std::fs::copy(from.join(f), to.join(f)).unwrap();
        }
        std::fs::copy(to.join("trainer.toml"), dst.join(precision.name()).join("latest.toml")).unwrap();
    }
    world.barrier().unwrap();
}

/// A ZeRO-1 run checkpointed at step 3 and resumed finishes bit for bit as the straight run; a
/// replicated run's checkpoint resumes as ZeRO-1 and a ZeRO-1 checkpoint as a replicated run,
/// both bit for bit (the state file is the same format; the runs are the same steps).
#[test]
fn zero_1_checkpoints_resume_bit_exactly_and_load_across_stages() {
    let test = "zero::zero_1_checkpoints_resume_bit_exactly_and_load_across_stages";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        let root = std::env::temp_dir().join(format!("te-zero-resume-{}", env.master_port));
        let cfg = base_config(6);
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
        let (zero_dir, rep_dir) = (root.join("zero"), root.join("replicated"));
        let (straight, norms, _) = go(&zero_dir, false, ZeroStage::OptimizerStates);
        let (replicated, rep_norms, _) = go(&rep_dir, false, ZeroStage::Replicated);
        let what = format!("rank {}", env.rank);
        assert_eq!(bits(&straight.records), bits(&replicated.records), "{what}: ZeRO-1 vs replicated");
        assert_eq!(norms, rep_norms, "{what}");
        for (name, src, zero) in [
            ("ZeRO-1 resumed as ZeRO-1", &zero_dir, ZeroStage::OptimizerStates),
            ("replicated resumed as ZeRO-1", &rep_dir, ZeroStage::OptimizerStates),
            ("ZeRO-1 resumed as replicated", &zero_dir, ZeroStage::Replicated),
        ] {
            let dst = root.join(name.replace(' ', "-"));
            stopped_at(&world, env.rank, src, &dst, precision, 3);
            let (resumed, resumed_norms, _) = go(&dst, true, zero);
            assert_eq!(bits(&resumed.records), bits(&straight.records), "{what}: {name}");
            assert_eq!(resumed_norms[..], norms[3..], "{what}: {name}: the norms of steps 4 to 6");
            world.barrier().unwrap();
            if env.rank == 0 {
                let last = |d: &Path| d.join(precision.name()).join("step-0000006").join("optimizer.safetensors");
                let (a, b) = (state_file_bits(dev, &cfg, &last(&dst)), state_file_bits(dev, &cfg, &last(&zero_dir)));
                assert_eq!(a.0, 6, "{name}");
                assert!(a == b, "{what}: {name}: the step-6 optimizer state differs from the straight run's");
            }
            world.barrier().unwrap();
        }
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}
