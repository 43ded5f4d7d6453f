//! Context-parallel training of the decoder family (the CP issue: `DecoderLm::set_context_parallel`,
//! `Parallel::with_context`, `te train --model … --context-parallel N`): a tiny random Llama
//! (GQA, 3 layers; and a Gemma 3: sliding windows, a global layer, sandwich and q/k norms, a
//! tied head) trained a few SGD steps with every sequence split over 2 ranks (each rank its
//! two load-balanced chunks, RoPE at the global positions, attention over every rank's keys and
//! values, passed around the ring (`CpCommType::P2p`, the default; Gemma's sliding-window
//! layers run the all-gather) or all-gathered, the gradients averaged over context × data by
//! `Parallel::data`) against the same model on the whole sequences in one process, on the same
//! batches:
//!
//! - BF16, under the ring and under the all-gather: per-step losses within 1e-2 relative, every averaged gradient within 3e-2 (relative
//!   Frobenius; the key and value gradients are summed over the ranks in another order and the
//!   loss means are taken per rank, so only rounding differs), the weights after the steps
//!   within 1e-2;
//! - the same with full recompute on the context-parallel ranks;
//! - FP8 GEMMs under delayed scaling (amaxes reduced over the world, so the ranks' scales are
//!   those of the whole batch): losses within 3e-2, gradients within 1e-1;
//! - CP=2 × DP=2 on 4 GPUs against one GPU on the whole global batch (skipped with fewer);
//! - the trainer's path (`Trainer::finetune` at CP=2 under the ring against one GPU on the same
//!   windows): the recorded train and validation losses within 2e-2.
//!
//! The ranks run as in [`crate::multi_gpu`]; skip with fewer GPUs or without NCCL.

use crate::common::device;
use crate::multi_gpu::{on_ranks, rel_err, Layout};
use std::sync::Arc;
use te_models::decoder::train::{shard_rows, DecoderLm};
use te_models::decoder::{DecoderConfig, DecoderWeights};
use te_models::gpt::MicroBatch;
use te_nn::fp8::{DelayedScaling, Fp8Autocast, Recipe};
use te_nn::modules::{Param, ParamKind, ParamMut, Recompute, TokenIds};
use te_nn::parallel::{CpCommType, Parallel};
use te_nn::Module;
use te_runtime::dist::ProcessGroup;
use te_runtime::{DType, Device, Result, Tensor};

/// Tokens a sequence (a multiple of 2·cp for cp 2 and 4), sequences a data rank, vocabulary.
const S: usize = 64;
const B: usize = 2;
const VOCAB: usize = 512;
const STEPS: usize = 3;
/// The SGD learning rate: small enough that three steps of rounding differences do not grow
/// into a different trajectory (the test compares each step's gradients).
const LR: f32 = 0.02;

/// A Llama (GQA, 3 layers).
fn config() -> DecoderConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {VOCAB},
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": false}}"#
    );
    DecoderConfig::from_hf_json(&json).unwrap()
}

/// A Gemma 3 (6 layers: sliding windows of 16 tokens on the first five, the sixth global with
/// its own RoPE; sandwich and q/k norms, a tied head).
fn gemma3() -> DecoderConfig {
    let json = format!(
        r#"{{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": {VOCAB},
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 16, "query_pre_attn_scalar": 32,
        "max_position_embeddings": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}}"#
    );
    DecoderConfig::from_hf_json(&json).unwrap()
}

/// Step `step`'s `[S, columns]` ids and targets (row-major, sequence first), the same on every
/// rank.
fn batch(step: usize, columns: usize) -> (Vec<i32>, Vec<i32>) {
    let n = S * columns;
    let ids = (0..n).map(|i| ((i * 7919 + 13 + step * 101) % VOCAB) as i32).collect();
    let targets = (0..n).map(|i| ((i * 104_729 + 5 + step * 37) % VOCAB) as i32).collect();
    (ids, targets)
}

/// Columns `from..from + b` of a `[S, columns]` row-major batch.
fn columns(v: &[i32], columns: usize, from: usize, b: usize) -> Vec<i32> {
    (0..S).flat_map(|t| v[t * columns + from..t * columns + from + b].iter().copied()).collect()
}

fn upload(dev: &Arc<Device>, shape: [usize; 2], v: &[i32]) -> TokenIds {
    TokenIds::from_host(dev, &shape, v).unwrap()
}

/// Every parameter's gradient (f32), by path.
fn grads(dev: &Device, m: &dyn Module) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        if let Some(g) = p.grad() {
            out.push((path.to_owned(), g.to_f32(dev)?));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// Every parameter (f32), by path.
fn weights(dev: &Device, m: &dyn Module) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        out.push((path.to_owned(), p.tensor().unwrap().to_f32(dev)?));
        Ok(())
    })
    .unwrap();
    out
}

/// `p -= lr · grad` on every parameter (f32 on the host, rounded to the parameter's dtype).
fn sgd(dev: &Device, m: &mut dyn Module, lr: f32) {
    m.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
        let (Some(t), Some(g)) = (p.tensor(), p.grad()) else { return Ok(()) };
        let (w, g) = (t.to_f32(dev)?, g.to_f32(dev)?);
        let new: Vec<f32> = w.iter().zip(&g).map(|(w, g)| w - lr * g).collect();
        p.set(Tensor::from_f32(dev, t.dtype(), t.shape(), &new)?)
    })
    .unwrap();
    m.zero_grad();
}

/// What a run shows: each step's loss and averaged gradients, and the final weights.
struct Run {
    losses: Vec<f32>,
    grads: Vec<Vec<(String, Vec<f32>)>>,
    weights: Vec<(String, Vec<f32>)>,
}

/// How a check runs: the FP8 recipe (`None`: BF16) and the context-parallel model's recompute.
#[derive(Debug, Clone, Copy)]
struct Case {
    fp8: Option<Recipe>,
    recompute: Recompute,
    /// Bounds: loss (relative), gradients and weights (relative Frobenius; FP8 gradients at TE's
    /// E4M3 rtol, 0.125: `tests/pytorch/utils.py`).
    bounds: (f32, f64, f64),
}

/// The one-GPU reference: `STEPS` steps on the whole global batch `[S, B · dp]`.
fn whole(dev: &Arc<Device>, w: &DecoderWeights, case: Case, dp: usize) -> Run {
    let mut m = DecoderLm::from_weights(dev, w, DType::BF16).unwrap();
    let mut run = Run { losses: Vec::new(), grads: Vec::new(), weights: Vec::new() };
    for step in 0..STEPS {
        let (ids, targets) = batch(step, B * dp);
        let (ids, targets) = (upload(dev, [S, B * dp], &ids), upload(dev, [S, B * dp], &targets));
        let (loss, ctx) = match case.fp8 {
            Some(r) => Fp8Autocast::new(r).run(|| m.forward_loss_with(&ids, &targets, MicroBatch::default())),
            None => m.forward_loss_with(&ids, &targets, MicroBatch::default()),
        }
        .unwrap();
        m.backward(ctx).unwrap();
        run.losses.push(loss.value().unwrap());
        run.grads.push(grads(dev, &m));
        sgd(dev, &mut m, LR);
    }
    run.weights = weights(dev, &m);
    run
}

/// The same steps on this rank of `parallel` (context × data): its data rank's columns, its
/// chunks of them, the gradients averaged over context × data while the backward runs.
fn split(dev: &Arc<Device>, w: &DecoderWeights, case: Case, parallel: &mut Parallel) -> Run {
    let mut m = DecoderLm::from_weights(dev, w, DType::BF16).unwrap();
    m.set_context_parallel(parallel.context().cloned()).unwrap();
    m.set_recompute(case.recompute).unwrap();
    let (d, dp) = parallel.data_rank();
    let cp = parallel.context_rank();
    let local = S / cp.1;
    let autocast = case.fp8.map(|r| Fp8Autocast::new(r).with_group(parallel.world().cloned()));
    let mut run = Run { losses: Vec::new(), grads: Vec::new(), weights: Vec::new() };
    for step in 0..STEPS {
        let (ids, targets) = batch(step, B * dp);
        let part = |v: &[i32]| shard_rows(&columns(v, B * dp, d * B, B), (S, B), cp).unwrap();
        let (ids, targets) = (upload(dev, [local, B], &part(&ids)), upload(dev, [local, B], &part(&targets)));
        let (loss, ctx) = match &autocast {
            Some(a) => a.clone().run(|| m.forward_loss_with(&ids, &targets, MicroBatch::default())),
            None => m.forward_loss_with(&ids, &targets, MicroBatch::default()),
        }
        .unwrap();
        let dpar = parallel.data().expect("a context- or data-parallel run averages its gradients");
        dpar.begin_step(&m).unwrap();
        m.backward_with(ctx, &mut |part| dpar.reduce_grads(part)).unwrap();
        dpar.finish().unwrap();
        // Every rank's loss is the mean over its tokens, all ranks hold equally many: the
        // world's mean is the whole batch's.
        run.losses.push(parallel.mean(loss.value().unwrap()).unwrap());
        run.grads.push(grads(dev, &m));
        sgd(dev, &mut m, LR);
    }
    run.weights = weights(dev, &m);
    run
}

fn compare(what: &str, got: &Run, want: &Run, case: Case) {
    let (loss_bound, grad_bound, weight_bound) = case.bounds;
    for (step, (g, w)) in got.losses.iter().zip(&want.losses).enumerate() {
        let e = (g - w).abs() / w.abs();
        eprintln!("{what}: step {step} loss {g:.5} against {w:.5} (relative {e:.2e})");
        assert!(e <= loss_bound, "{what}: step {step} loss {g} against {w}");
    }
    // Step 0 (the same weights on both sides): every gradient tensor within the bound. Later
    // steps start from weights that already differ by the previous steps' rounding, and the
    // gradients of norm weights are sums over tokens with heavy cancellation (the key-norm's
    // Σ_j dK_j is exactly 0 through the softmax), so their per-tensor error grows with any
    // perturbation: there the whole model's gradient (every tensor concatenated) is held to the
    // bound, the worst tensor printed.
    for (step, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: step {step} gradient count");
        let none = String::new();
        let worst = g.iter().zip(w).map(|((path, gv), (_, wv))| (rel_err(gv, wv), path)).fold((0.0, &none), |a, b| {
            if b.0 > a.0 {
                b
            } else {
                a
            }
        });
        let flat = |r: &[(String, Vec<f32>)]| r.iter().flat_map(|(_, v)| v.iter().copied()).collect::<Vec<f32>>();
        let whole = rel_err(&flat(g), &flat(w));
        eprintln!(
            "{what}: step {step} whole-model gradient relative error {whole:.2e}; worst tensor {} {:.2e}",
            worst.1, worst.0
        );
        assert!(whole <= grad_bound, "{what}: step {step}: the whole gradient differs by {whole}");
        if step == 0 {
            assert!(worst.0 <= grad_bound, "{what}: step 0: the gradient of {} differs by {}", worst.1, worst.0);
        }
    }
    // The final weights, the whole model (Gemma stores its norm weights as γ − 1, near 0: those
    // tensors are only their updates, whose relative error is the gradients'); the worst tensor
    // printed.
    let flat = |r: &[(String, Vec<f32>)]| r.iter().flat_map(|(_, v)| v.iter().copied()).collect::<Vec<f32>>();
    let whole = rel_err(&flat(&got.weights), &flat(&want.weights));
    let none = String::new();
    let worst = got
        .weights
        .iter()
        .zip(&want.weights)
        .map(|((p, g), (_, w))| (rel_err(g, w), p))
        .fold((0.0, &none), |a, b| if b.0 > a.0 { b } else { a });
    eprintln!(
        "{what}: weights after {STEPS} steps: relative error {whole:.2e}; worst tensor {} {:.2e}",
        worst.1, worst.0
    );
    assert!(whole <= weight_bound, "{what}: the weights after {STEPS} steps differ by {whole}");
}

const BF16: Case = Case { fp8: None, recompute: Recompute::None, bounds: (1e-2, 3e-2, 1e-2) };

fn delayed() -> Recipe {
    DelayedScaling { amax_history_len: 4, ..Default::default() }.into()
}

/// One rank's checks of `cases` on the Llama (and with `gemma`, the Gemma 3) at context
/// parallel `cp` over `pg`'s ranks (data parallel over the rest), under each of `comms`.
fn check(dev: &Arc<Device>, pg: ProcessGroup, cp: usize, cases: &[(&str, Case)], gemma: bool, comms: &[CpCommType]) {
    let world = pg.size();
    let pg = Arc::new(pg);
    for &comm in comms {
        let mut parallel =
            Parallel::with_context(pg.clone(), 1, cp, false).and_then(|p| p.with_cp_comm_type(comm)).unwrap();
        assert_eq!(parallel.context_rank().1, cp);
        assert_eq!(parallel.context().unwrap().comm_type(), comm);
        assert_eq!(parallel.data_rank().1 * cp, world);
        assert_eq!(parallel.replica_rank().1, world, "the gradients average over context × data");
        let mut models = vec![("llama", config())];
        if gemma {
            models.push(("gemma3", gemma3()));
        }
        let dp = parallel.data_rank().1;
        for (model, cfg) in models {
            let w = DecoderLm::new(dev, cfg, DType::BF16).unwrap().to_weights().unwrap();
            for &(name, case) in cases {
                let want = whole(dev, &w, case, dp);
                let got = split(dev, &w, case, &mut parallel);
                let what = format!("rank {} cp {cp} ({comm}) × dp {dp} {model} {name}", parallel.rank());
                compare(&what, &got, &want, case);
            }
        }
    }
}

/// The ring, TE's default exchange.
const P2P: &[CpCommType] = &[CpCommType::P2p];

#[test]
fn cp2_decoder_steps_equal_one_gpu_in_bf16() {
    on_ranks("context_parallel_train::cp2_decoder_steps_equal_one_gpu_in_bf16", 2, Layout::OneNode, |_, dev, pg| {
        check(dev, pg, 2, &[("bf16", BF16)], true, &[CpCommType::P2p, CpCommType::AllGather]);
    });
}

#[test]
fn cp2_decoder_steps_with_full_recompute_equal_one_gpu() {
    let test = "context_parallel_train::cp2_decoder_steps_with_full_recompute_equal_one_gpu";
    on_ranks(test, 2, Layout::OneNode, |_, dev, pg| {
        check(dev, pg, 2, &[("bf16 full recompute", Case { recompute: Recompute::Full, ..BF16 })], true, P2P);
    });
}

#[test]
fn cp2_decoder_steps_in_fp8_delayed_scaling_equal_one_gpu() {
    let test = "context_parallel_train::cp2_decoder_steps_in_fp8_delayed_scaling_equal_one_gpu";
    on_ranks(test, 2, Layout::OneNode, |_, dev, pg| {
        let fp8 = Case { fp8: Some(delayed()), recompute: Recompute::None, bounds: (3e-2, 0.125, 3e-2) };
        check(dev, pg, 2, &[("fp8 delayed", fp8)], false, P2P);
    });
}

/// CP=2 × DP=2 (skipped with fewer than 4 GPUs, even under `TE_REQUIRE_MULTI_GPU=1`: the
/// suite's multi-GPU runs take 2).
#[test]
fn cp2_dp2_decoder_steps_equal_one_gpu_on_the_global_batch() {
    if std::env::var("TE_MULTI_GPU_TEST").is_err() && te_runtime::device::device_count() < 4 {
        eprintln!("skipping: 4 GPUs needed, {} here", te_runtime::device::device_count());
        return;
    }
    let test = "context_parallel_train::cp2_dp2_decoder_steps_equal_one_gpu_on_the_global_batch";
    on_ranks(test, 4, Layout::OneNode, |_, dev, pg| {
        check(dev, pg, 2, &[("bf16", BF16)], false, P2P);
    });
}

/// The trainer's path: `Trainer::finetune` of a random decoder at CP=2 under the ring (every
/// rank its chunks of the same windows, the keys and values passed around the ranks, the loss
/// means over the group) records the losses of the one-GPU run on the same windows, and counts
/// each token once.
#[test]
fn cp2_trainer_finetune_records_the_losses_of_one_gpu() {
    use te_train::data::TokenDocs;
    use te_train::{Backend, Pack, Precision, TrainConfig, Trainer};
    let test = "context_parallel_train::cp2_trainer_finetune_records_the_losses_of_one_gpu";
    on_ranks(test, 2, Layout::OneNode, |_, dev, pg| {
        let w = DecoderLm::new(dev, config(), DType::BF16).unwrap().to_weights().unwrap();
        let cycle: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % VOCAB as u32).collect();
        let docs: Vec<Vec<u32>> =
            (0..40).map(|d| (0..300).map(|t| cycle[(t + d * 7) % cycle.len()]).collect()).collect();
        let data = TokenDocs::from_documents(&docs).split(0.1, 1).unwrap();
        let cfg = TrainConfig {
            batch: B,
            lr: 3e-3,
            weight_decay: 0.0,
            eval_interval: 4,
            eval_batches: 2,
            ..TrainConfig::new(te_models::gpt::GptConfig::tiny(), 8)
        };
        let run = |parallel: Parallel| {
            let mut trainer =
                Trainer::new(cfg.clone(), Backend::Gpu(dev.clone())).unwrap().with_parallel(parallel).unwrap();
            let mut m = DecoderLm::from_weights(dev, &w, DType::BF16).unwrap();
            trainer.finetune(&mut m, &data, (S, Pack::Blocks), Precision::Bf16, |_| {}).unwrap()
        };
        let one = run(Parallel::default());
        let parallel = Parallel::with_context(Arc::new(pg), 1, 2, false)
            .and_then(|p| p.with_cp_comm_type(CpCommType::P2p))
            .unwrap();
        let cp = run(parallel);
        for (g, w) in cp.records.iter().zip(&one.records) {
            let e = (g.train_loss - w.train_loss).abs() / w.train_loss;
            eprintln!("step {}: train loss {:.5} against {:.5}", g.step, g.train_loss, w.train_loss);
            assert!(e <= 2e-2, "step {}: train loss {} against {}", g.step, g.train_loss, w.train_loss);
            if let (Some(gv), Some(wv)) = (g.val_loss, w.val_loss) {
                assert!((gv - wv).abs() / wv <= 2e-2, "step {}: validation loss {gv} against {wv}", g.step);
            }
        }
        assert_eq!((cp.ranks, cp.records.len()), (2, one.records.len()));
        eprintln!("tokens/s: one GPU {:.0}, CP=2 {:.0} (each token counted once)", one.tokens_per_s, cp.tokens_per_s);
    });
}

/// What context parallelism does not split is refused with typed errors, on one GPU: packed
/// documents (`thd`) at the forward; a part of odd length.
#[test]
fn context_parallel_decoder_refuses_what_it_does_not_split() {
    use te_models::decoder::train::Packing;
    use te_nn::parallel::ContextParallel;
    let Some(dev) = device() else { return };
    let cp = ContextParallel::new(Arc::new(ProcessGroup::single(&dev).unwrap())).unwrap();
    let mut m = DecoderLm::new(&dev, config(), DType::BF16).unwrap();
    m.set_context_parallel(Some(cp)).unwrap();
    let ids = upload(&dev, [8, 1], &[3; 8]);
    let packing = Packing { position_ids: &[0, 1, 2, 3, 0, 1, 2, 3], cu_seqlens: &[0, 4, 8], cu_seqlens_padded: None };
    let e = m.forward_loss_thd(&ids, &ids, packing, MicroBatch::default()).unwrap_err().to_string();
    assert!(e.contains("thd") && e.contains("context parallelism"), "{e}");
    let odd = upload(&dev, [7, 1], &[3; 7]);
    let e = m.forward_loss_with(&odd, &odd, MicroBatch::default()).unwrap_err().to_string();
    assert!(e.contains("two chunks"), "{e}");
    // One rank: the context-parallel forward is the plain one.
    let (ids, targets) = batch(0, B);
    let (ids, targets) = (upload(&dev, [S, B], &ids), upload(&dev, [S, B], &targets));
    let (got, _) = m.forward_loss(&ids, &targets).unwrap();
    m.set_context_parallel(None).unwrap();
    let (want, _) = m.forward_loss(&ids, &targets).unwrap();
    assert!((got - want).abs() <= 1e-3 * want.abs(), "one rank: {got} against {want}");
}
