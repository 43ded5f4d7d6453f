//! Tensor-parallel communication overlap (`TpConfig::tp_comm_overlap`, TE's `ub_overlap_ag` /
//! `ub_overlap_rs` / `ub_bulk_dgrad`) on two ranks at TP=2 with sequence parallelism: the same
//! block with the overlap on and off, in BF16 and under delayed FP8 scaling (with the amaxes
//! reduced over the group: the norm's FP8 codes are gathered; and without: the 16-bit norm
//! output is gathered), two steps each (the second with the first's scales): outputs, input
//! gradients and every parameter gradient. Plus a few steps of GPT training with the overlap
//! on and off (`TE_TP_COMM_OVERLAP=1`, what the trainer reads through `Parallel`). The
//! reduce-scatter is chunked (`TE_TP_OVERLAP_RS_CHUNKS`) so that these small GEMMs take the
//! overlapped path too.
//!
//! What is bit for bit the same: the dgrad reduce-scatter beside the wgrad GEMM is the same
//! collective on the same data; the gathered and reduce-scattered GEMMs run on half the rows
//! (one rank's tokens) instead of all, so they match bit for bit where cuBLASLt picks an
//! algorithm of the same reduction order for that `M` (it usually does: the reduction is along
//! `k`, which does not change), else within the GEMM's rounding. The tests hold both to
//! tolerances below TE's (bf16 1e-2, FP8 2e-2 relative) and print whether each is bit-exact.
//!
//! The ranks run as in [`crate::multi_gpu`]; skip with fewer than two GPUs or without NCCL.

use crate::common::{bf16, randn};
use crate::multi_gpu::{on_ranks, rel_err, Layout};
use std::sync::Arc;
use te_nn::fp8::{DelayedScaling, Fp8Autocast, Recipe};
use te_nn::modules::{
    LayerNormLinear, LayerNormLinearConfig, LayerNormMLP, LayerNormMLPConfig, Linear, LinearConfig, ModuleVisitor,
    Param, ParamKind, TransformerLayer, TransformerLayerConfig,
};
use te_nn::parallel::{ParallelMode, TpConfig};
use te_nn::Module;
use te_runtime::{DType, Device, Tensor};

const S: usize = 64;
const B: usize = 2;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const FFN: usize = 128;

/// A forward and backward: `(y, dx)` for `x` and `dy`.
type Step<M> = dyn Fn(&mut M, &Tensor, &Tensor) -> te_runtime::Result<(Tensor, Tensor)>;

/// Every parameter gradient of a module as f32, by path.
struct Grads(Vec<(String, Vec<f32>)>, Arc<Device>);

impl ModuleVisitor for Grads {
    fn param(&mut self, path: &str, _: ParamKind, p: &dyn Param) -> te_runtime::Result<()> {
        if let Some(g) = p.main_grad().or(p.grad()) {
            self.0.push((path.to_owned(), g.to_f32(&self.1)?));
        }
        Ok(())
    }
}

fn grads(m: &dyn Module, dev: &Arc<Device>) -> Vec<(String, Vec<f32>)> {
    let mut g = Grads(Vec::new(), dev.clone());
    m.visit("", &mut g).unwrap();
    g.0
}

/// One block with the overlap on against off: `make(tp)` builds it on this rank, `x_shape` is
/// this rank's input, `y_shape` its output.
struct Case<'a, M> {
    name: &'a str,
    make: &'a dyn Fn(TpConfig) -> M,
    step: &'a Step<M>,
    x_shape: &'a [usize],
    y_shape: &'a [usize],
}

/// Compares; returns how many of the compared tensors were bit for bit equal, of how many.
fn compare<M: Module>(case: &Case<'_, M>, dev: &Arc<Device>, on: &TpConfig, off: &TpConfig) -> (usize, usize) {
    let r = on.rank();
    let host = |t: &Tensor| t.to_f32(dev).unwrap();
    let up = |v: &[f32], shape: &[usize]| Tensor::from_f32(dev, DType::BF16, shape, v).unwrap();
    let delayed: Recipe = DelayedScaling::default().into();
    let group = on.group.clone();
    let (mut same, mut total) = (0, 0);
    for recipe in [None, Some((delayed, true)), Some((delayed, false))] {
        let what = format!("{} {recipe:?} rank {r}", case.name);
        let mut a = (case.make)(on.clone());
        let mut b = (case.make)(off.clone());
        for step in 0..2u64 {
            let x_len: usize = case.x_shape.iter().product();
            let y_len: usize = case.y_shape.iter().product();
            // Each rank its own tokens.
            let x = bf16(&randn(100 + 10 * step + r as u64, x_len, 1.0));
            let dy = bf16(&randn(200 + 10 * step + r as u64, y_len, 1.0));
            let run = |m: &mut M| {
                let mut f = || (case.step)(m, &up(&x, case.x_shape), &up(&dy, case.y_shape));
                let (y, dx) = match recipe {
                    Some((rc, reduce)) => Fp8Autocast::new(rc).with_group(reduce.then(|| group.clone())).run(f),
                    None => f(),
                }
                .unwrap_or_else(|e| panic!("{what} step {step}: {e}"));
                (host(&y), host(&dx))
            };
            let (ya, dxa) = run(&mut a);
            let (yb, dxb) = run(&mut b);
            let (fwd, bwd) = if recipe.is_some() { (2e-2, 4e-2) } else { (1e-2, 1e-2) };
            let mut check = |name: &str, got: &[f32], want: &[f32], bound: f64| {
                assert_eq!(got.len(), want.len(), "{what} step {step}: {name} length");
                let e = rel_err(got, want);
                assert!(e < bound, "{what} step {step}: {name} overlap on vs off relative error {e} (bound {bound})");
                let bits = got.iter().zip(want).all(|(p, q)| p.to_bits() == q.to_bits());
                if !bits {
                    eprintln!("{what} step {step}: {name} not bit-exact (relative error {e})");
                }
                same += bits as usize;
                total += 1;
            };
            check("y", &ya, &yb, fwd);
            check("dx", &dxa, &dxb, bwd);
            for ((pa, ga), (pb, gb)) in grads(&a, dev).iter().zip(&grads(&b, dev)) {
                assert_eq!(pa, pb, "{what}: parameter order");
                check(&format!("{pa} grad"), ga, gb, bwd);
            }
        }
    }
    (same, total)
}

macro_rules! fwd_bwd {
    () => {
        &|m, x, dy| {
            let (y, ctx) = m.forward(x)?;
            Ok((y, m.backward(ctx, dy)?))
        }
    };
}

/// LayerNormLinear and Linear (column: the overlapped all-gather and dgrad reduce-scatter; row:
/// the overlapped reduce-scatter), LayerNormMLP and TransformerLayer at TP=2 with sequence
/// parallelism: the overlap on gives what it gives off.
#[test]
fn overlapped_tensor_parallel_blocks_equal_the_synchronous_ones() {
    on_ranks(
        "tp_overlap::overlapped_tensor_parallel_blocks_equal_the_synchronous_ones",
        2,
        Layout::OneNode,
        |_, dev, pg| {
            // These blocks are far below the rows the reduce-scatter is chunked at by default:
            // four chunks per owner, to run the chunked path.
            std::env::set_var(te_nn::parallel::overlap::REDUCE_CHUNKS_ENV, "4");
            let group = Arc::new(pg);
            let off = TpConfig::new(group.clone()).with_sequence_parallel(true).with_comm_overlap(false);
            let on = off.clone().with_comm_overlap(true);
            assert!(on.overlaps_comm() && !off.overlaps_comm());
            let n = group.size();
            let shard = [S / n, B, HIDDEN];
            let mut report = Vec::new();

            let ln_linear = |tp| {
                let cfg = LayerNormLinearConfig { seed: 5, tp: Some(tp), ..LayerNormLinearConfig::new(HIDDEN, FFN) };
                LayerNormLinear::new(dev, cfg).unwrap()
            };
            let case = Case {
                name: "LayerNormLinear",
                make: &ln_linear,
                step: fwd_bwd!(),
                x_shape: &shard,
                y_shape: &[S, B, FFN / n],
            };
            report.push((case.name, compare(&case, dev, &on, &off)));

            let column = |tp| {
                let cfg = LinearConfig {
                    seed: 6,
                    tp: Some(tp),
                    parallel_mode: ParallelMode::Column,
                    ..LinearConfig::new(HIDDEN, FFN)
                };
                Linear::new(dev, cfg).unwrap()
            };
            let case = Case {
                name: "Linear column",
                make: &column,
                step: fwd_bwd!(),
                x_shape: &shard,
                y_shape: &[S, B, FFN / n],
            };
            report.push((case.name, compare(&case, dev, &on, &off)));

            let row = |tp| {
                let cfg = LinearConfig {
                    seed: 8,
                    tp: Some(tp),
                    parallel_mode: ParallelMode::Row,
                    ..LinearConfig::new(FFN, HIDDEN)
                };
                Linear::new(dev, cfg).unwrap()
            };
            let case =
                Case { name: "Linear row", make: &row, step: fwd_bwd!(), x_shape: &[S, B, FFN / n], y_shape: &shard };
            report.push((case.name, compare(&case, dev, &on, &off)));

            let mlp = |tp| {
                let cfg = LayerNormMLPConfig { seed: 7, tp: Some(tp), ..LayerNormMLPConfig::new(HIDDEN, FFN) };
                LayerNormMLP::new(dev, cfg).unwrap()
            };
            let case = Case { name: "LayerNormMLP", make: &mlp, step: fwd_bwd!(), x_shape: &shard, y_shape: &shard };
            report.push((case.name, compare(&case, dev, &on, &off)));

            let layer = |tp| {
                let cfg = TransformerLayerConfig {
                    hidden_dropout: 0.0,
                    seed: 41,
                    tp: Some(tp),
                    ..TransformerLayerConfig::new(HIDDEN, FFN, HEADS)
                };
                TransformerLayer::new(dev, cfg).unwrap()
            };
            let case =
                Case { name: "TransformerLayer", make: &layer, step: fwd_bwd!(), x_shape: &shard, y_shape: &shard };
            report.push((case.name, compare(&case, dev, &on, &off)));

            for (name, (same, total)) in report {
                eprintln!("tp_overlap rank {}: {name}: {same} of {total} tensors bit-exact", group.rank());
            }
        },
    );
}

/// A GPT trained at TP=2 with sequence parallelism (BF16 and FP8) with the overlap on
/// (`TE_TP_COMM_OVERLAP=1` when `Parallel` builds its `TpConfig`) follows the run with it off.
#[test]
fn overlapped_tensor_parallel_training_follows_the_synchronous_one() {
    let test = "tp_overlap::overlapped_tensor_parallel_training_follows_the_synchronous_one";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        use crate::train::{train, CheckpointOptions, Precision, TrainConfig};
        use te_models::gpt::GptConfig;
        use te_nn::parallel::tensor_parallel::TP_COMM_OVERLAP_ENV;
        use te_nn::parallel::Parallel;
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        // The tiny model's row-parallel GEMMs are far below the default chunk rows.
        std::env::set_var(te_nn::parallel::overlap::REDUCE_CHUNKS_ENV, "2");
        let base = crate::train::config(12);
        let base = TrainConfig {
            grad_accum: 1,
            eval_interval: 6,
            model: GptConfig { hidden_dropout: 0.0, ..base.model.clone() },
            ..base
        };
        let none = CheckpointOptions::default();
        for precision in [Precision::Bf16, Precision::Fp8] {
            let what = format!("{precision:?} rank {}", env.rank);
            let mut runs = Vec::new();
            for overlap in [false, true] {
                // Read by `TpConfig::new` inside `Parallel::new` (each rank is a process of its own).
                std::env::set_var(TP_COMM_OVERLAP_ENV, if overlap { "1" } else { "0" });
                let mut parallel = Parallel::new(world.clone(), 2, true).unwrap();
                std::env::remove_var(TP_COMM_OVERLAP_ENV);
                assert_eq!(parallel.tensor().unwrap().tp_comm_overlap, overlap, "{what}");
                runs.push(train(dev, &corpus, &base, precision, &none, &mut parallel, |_, _| {}).unwrap());
                world.barrier().unwrap();
            }
            let (off, on) = (&runs[0].records, &runs[1].records);
            assert_eq!(off.len(), on.len(), "{what}");
            let mut exact = 0;
            for (x, y) in on.iter().zip(off) {
                let d = (x.train_loss - y.train_loss).abs() / y.train_loss;
                assert!(d < 1e-2, "{what}: step {} loss {} (overlap) vs {}", x.step, x.train_loss, y.train_loss);
                exact += (x.train_loss.to_bits() == y.train_loss.to_bits()) as usize;
            }
            eprintln!("tp_overlap training {what}: {exact} of {} losses bit-exact", on.len());
            let last = on[on.len() - 1].train_loss;
            assert!(last < on[0].train_loss, "{what}: it learns ({} -> {last})", on[0].train_loss);
        }
    });
}
