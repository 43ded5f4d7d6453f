//! Two ranks on two GPUs (the multi-GPU issue): collectives with rank-dependent data, the FP8
//! amax reduction of an autocast scope with `fp8_group`, and data-parallel gradients of a GPT
//! against the same model on the whole batch in one process.
//!
//! Each test re-runs this test binary as one process per rank (`--exact <test>`) with
//! `torchrun`'s variables and waits for them (bounded: a hang fails the test). Two layouts: one
//! node of two GPUs (`LOCAL_RANK` 0 and 1), and two "nodes" of one GPU each (each process sees
//! one GPU through `CUDA_VISIBLE_DEVICES`, `LOCAL_RANK` 0 on both): multi-node runs are the same
//! code with other variables.
//!
//! Skip with fewer than two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use crate::common::{amax, bf16, randn};
use std::sync::Arc;
use std::time::{Duration, Instant};
use te_models::gpt::{Gpt, GptConfig, MicroBatch};
use te_nn::fp8::{DelayedScaling, Fp8Autocast};
use te_nn::modules::{Linear, LinearConfig, ModuleVisitor, Param, ParamKind, TokenIds};
use te_nn::parallel::{DataParallel, Parallel};
use te_nn::Module;
use te_runtime::dist::{DistEnv, ProcessGroup, ReduceOp};
use te_runtime::{DType, Device, Tensor};

/// The variable that marks a child process: the test it runs as a rank.
const CHILD: &str = "TE_MULTI_GPU_TEST";

/// How the ranks are laid out over "nodes".
#[derive(Clone, Copy)]
pub(crate) enum Layout {
    /// One node with both GPUs.
    OneNode,
    /// One node per GPU, each process seeing its GPU only.
    NodePerGpu,
}

/// Runs `body` as each of `world` ranks: in the parent, spawns the ranks and checks they pass;
/// in a rank, calls `body` with its group. Returns without running in a parent that lacks the
/// GPUs or NCCL (unless `TE_REQUIRE_MULTI_GPU=1`).
pub(crate) fn on_ranks(
    test: &str,
    world: usize,
    layout: Layout,
    body: impl FnOnce(&DistEnv, &Arc<Device>, ProcessGroup),
) {
    if std::env::var(CHILD).is_ok_and(|t| t == test) {
        let env = DistEnv::from_env().unwrap().expect("a rank has WORLD_SIZE");
        let dev = Device::new(env.local_rank).unwrap();
        let group = ProcessGroup::init(&dev, &env).unwrap();
        body(&env, &dev, group);
        return;
    }
    if !crate::common::multi_gpu(test, world) {
        return;
    }
    // A port of our own for the rendezvous.
    let port = crate::common::free_port();
    let mut children = Vec::new();
    for rank in 0..world {
        let env = match layout {
            Layout::OneNode => crate::common::local_rank_env(rank, world, port),
            Layout::NodePerGpu => DistEnv {
                rank,
                world_size: world,
                local_rank: 0,
                local_world_size: 1,
                master_addr: "127.0.0.1".into(),
                master_port: port,
            },
        };
        let mut cmd = crate::common::rank_command(test, &env, 60);
        cmd.env(CHILD, test);
        if let Layout::NodePerGpu = layout {
            cmd.env("CUDA_VISIBLE_DEVICES", rank.to_string());
        }
        children.push((rank, cmd.spawn().unwrap()));
    }
    let start = Instant::now();
    let mut failed = Vec::new();
    for (rank, mut child) in children {
        // Bounded: a rank stuck in a collective fails the test instead of hanging it.
        while child.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(300) {
            std::thread::sleep(Duration::from_millis(50));
        }
        if child.try_wait().unwrap().is_none() {
            let _ = child.kill();
        }
        let out = child.wait_with_output().unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        if !out.status.success() || !text.contains("1 passed") {
            failed.push(format!("rank {rank} ({}):\n{text}", out.status));
        }
    }
    assert!(failed.is_empty(), "{test}:\n{}", failed.join("\n"));
}

fn values(t: &Tensor, dev: &Device) -> Vec<f32> {
    t.to_f32(dev).unwrap()
}

fn collectives(env: &DistEnv, dev: &Arc<Device>, pg: ProcessGroup) {
    let (r, n) = (env.rank, env.world_size);
    assert_eq!((pg.rank(), pg.size()), (r, n));
    // Rank r holds randn(seed r): every rank can compute every rank's data.
    let data = |rank: usize| randn(40 + rank as u64, 1000, 2.0);
    let all: Vec<Vec<f32>> = (0..n).map(data).collect();
    let mut t = Tensor::from_f32(dev, DType::F32, &[10, 100], &data(r)).unwrap();
    pg.all_reduce(&mut t, ReduceOp::Sum).unwrap();
    let sum: Vec<f32> = (0..1000).map(|i| all.iter().map(|d| d[i]).sum()).collect();
    assert_eq!(values(&t, dev), sum, "f32 sum of {n} ranks");
    for (op, want) in [
        (ReduceOp::Max, (0..1000).map(|i| all.iter().map(|d| d[i]).fold(f32::MIN, f32::max)).collect::<Vec<_>>()),
        (ReduceOp::Min, (0..1000).map(|i| all.iter().map(|d| d[i]).fold(f32::MAX, f32::min)).collect()),
    ] {
        let mut t = Tensor::from_f32(dev, DType::F32, &[1000], &data(r)).unwrap();
        pg.all_reduce(&mut t, op).unwrap();
        assert_eq!(values(&t, dev), want, "{op:?}");
    }
    let mut avg = Tensor::from_f32(dev, DType::BF16, &[1000], &data(r)).unwrap();
    pg.all_reduce(&mut avg, ReduceOp::Avg).unwrap();
    let mean: Vec<f32> = sum.iter().map(|s| s / n as f32).collect();
    crate::common::assert_close("bf16 avg", &values(&avg, dev), &mean, 2e-2, 2e-2);
    // Gather FP8 codes and bf16 rows; reduce-scatter; broadcast.
    for dtype in [DType::BF16, DType::E4M3] {
        let part = Tensor::from_f32(dev, dtype, &[4, 25], &data(r)[..100]).unwrap();
        let mut whole = Tensor::zeros(dev, dtype, &[4 * n, 25]).unwrap();
        pg.all_gather(&part, &mut whole).unwrap();
        let want: Vec<u8> = (0..n)
            .flat_map(|k| Tensor::from_f32(dev, dtype, &[4, 25], &data(k)[..100]).unwrap().to_bytes(dev).unwrap())
            .collect();
        assert_eq!(whole.to_bytes(dev).unwrap(), want, "all_gather {dtype}");
    }
    let input = Tensor::from_f32(dev, DType::F32, &[2 * n, 50], &data(r)[..100 * n]).unwrap();
    let mut part = Tensor::zeros(dev, DType::F32, &[2, 50]).unwrap();
    pg.reduce_scatter(&input, &mut part, ReduceOp::Sum).unwrap();
    let want: Vec<f32> = (r * 100..(r + 1) * 100).map(|i| all.iter().map(|d| d[i]).sum()).collect();
    assert_eq!(values(&part, dev), want, "reduce_scatter: rank {r}'s rows of the sum");
    let mut b = Tensor::from_f32(dev, DType::BF16, &[1000], &data(r)).unwrap();
    pg.broadcast(&mut b, n - 1).unwrap();
    assert_eq!(
        b.to_bytes(dev).unwrap(),
        Tensor::from_f32(dev, DType::BF16, &[1000], &all[n - 1]).unwrap().to_bytes(dev).unwrap()
    );
    // A bucket of several buffers in one NCCL group, on a side stream, waited for.
    let side = pg.with_side_stream().unwrap();
    assert!(side.is_side_stream() && !pg.is_side_stream());
    let mut bufs: Vec<Tensor> =
        (0..3).map(|k| Tensor::from_f32(dev, DType::F32, &[100 + k], &data(r)[..100 + k]).unwrap()).collect();
    let mut refs: Vec<&mut Tensor> = bufs.iter_mut().collect();
    side.all_reduce_many(&mut refs, ReduceOp::Sum).unwrap();
    side.wait().unwrap();
    for (k, b) in bufs.iter().enumerate() {
        assert_eq!(values(b, dev), sum[..100 + k].to_vec(), "grouped buffer {k} on the side stream");
    }
    // Sub-groups: each rank alone.
    let alone = pg.split(Some).unwrap().unwrap();
    assert_eq!((alone.rank(), alone.size(), alone.ranks()), (0, 1, &[r][..]));
    pg.barrier().unwrap();
}

#[test]
fn collectives_on_two_ranks() {
    on_ranks("multi_gpu::collectives_on_two_ranks", 2, Layout::OneNode, collectives);
}

#[test]
fn collectives_on_two_nodes_of_one_gpu() {
    on_ranks("multi_gpu::collectives_on_two_nodes_of_one_gpu", 2, Layout::NodePerGpu, |env, dev, pg| {
        assert_eq!((env.local_rank, env.local_world_size), (0, 1));
        collectives(env, dev, pg)
    });
}

/// Whether every rank of `group` holds the same `values`: their maximum and minimum over the
/// group agree.
fn same_on_every_rank(group: &ProcessGroup, dev: &Device, values: &[f32]) -> bool {
    let mut hi = dev.stream().clone_htod(values).unwrap();
    let mut lo = dev.stream().clone_htod(values).unwrap();
    group.all_reduce(&mut hi, ReduceOp::Max).unwrap();
    group.all_reduce(&mut lo, ReduceOp::Min).unwrap();
    dev.stream().clone_dtoh(&hi).unwrap() == dev.stream().clone_dtoh(&lo).unwrap()
}

/// The largest `|x|` of bf16-rounded `values`.
fn bf16_amax(values: &[f32]) -> f32 {
    amax(&bf16(values))
}

#[test]
fn amax_reduction_gives_every_rank_the_global_amax() {
    on_ranks("multi_gpu::amax_reduction_gives_every_rank_the_global_amax", 2, Layout::OneNode, |env, dev, pg| {
        let (r, n) = (env.rank, env.world_size);
        let group = Arc::new(pg);
        let (tokens, inf, outf) = (48, 64, 96);
        // Rank r's input and output gradient are scaled by r + 1: their amaxes differ by rank.
        let x_of = |rank: usize| -> Vec<f32> {
            randn(7 + rank as u64, tokens * inf, 1.0).iter().map(|v| v * (rank + 1) as f32).collect()
        };
        let dy_of = |rank: usize| -> Vec<f32> {
            randn(9 + rank as u64, tokens * outf, 0.1).iter().map(|v| v * (rank + 1) as f32).collect()
        };
        for reduce in [true, false] {
            let mut lin = Linear::new(dev, LinearConfig { seed: 5, ..LinearConfig::new(inf, outf) }).unwrap();
            let recipe = DelayedScaling { amax_history_len: 8, ..Default::default() };
            let scope = Fp8Autocast::new(recipe).with_group(reduce.then(|| group.clone()));
            let x = Tensor::from_f32(dev, DType::BF16, &[tokens, inf], &x_of(r)).unwrap();
            let dy = Tensor::from_f32(dev, DType::BF16, &[tokens, outf], &dy_of(r)).unwrap();
            let (_, ctx) = scope.run(|| lin.forward(&x)).unwrap();
            lin.backward(ctx, &dy).unwrap();
            let fwd = lin.fp8_forward_state().unwrap().snapshot().unwrap();
            let bwd = lin.fp8_backward_state().unwrap().snapshot().unwrap();
            // One step: the step's amax is the only entry of the (rolled) history of a slot;
            // slot 0 is the input (forward) and the output gradient (backward).
            let slot0 = |h: &[f32]| h[..8].iter().copied().fold(0.0, f32::max);
            let (x_amax, dy_amax) = (slot0(&fwd.amax_history), slot0(&bwd.amax_history));
            let (want_x, want_dy) = if reduce {
                (
                    (0..n).map(|k| bf16_amax(&x_of(k))).fold(0.0, f32::max),
                    (0..n).map(|k| bf16_amax(&dy_of(k))).fold(0.0, f32::max),
                )
            } else {
                (bf16_amax(&x_of(r)), bf16_amax(&dy_of(r)))
            };
            assert_eq!((x_amax, dy_amax), (want_x, want_dy), "reduce {reduce}: input and grad_output amaxes");
            // With the reduction every rank holds the same scales.
            let scales: Vec<f32> = fwd.scale.iter().chain(&bwd.scale).copied().collect();
            let same = same_on_every_rank(&group, dev, &scales);
            assert_eq!(same, reduce, "reduce {reduce}: scales equal on every rank");
        }
    });
}

/// Collects every gradient (main_grad first) of a model as f32, by path.
struct Grads(Vec<(String, Vec<f32>)>, Arc<Device>);

impl ModuleVisitor for Grads {
    fn param(&mut self, path: &str, _: ParamKind, p: &dyn Param) -> te_runtime::Result<()> {
        if let Some(g) = p.main_grad().or(p.grad()) {
            self.0.push((path.to_owned(), g.to_f32(&self.1)?));
        }
        Ok(())
    }
}

fn grads(model: &Gpt, dev: &Arc<Device>) -> Vec<(String, Vec<f32>)> {
    let mut g = Grads(Vec::new(), dev.clone());
    model.visit("", &mut g).unwrap();
    g.0
}

#[test]
fn data_parallel_gradients_equal_the_whole_batch() {
    on_ranks("multi_gpu::data_parallel_gradients_equal_the_whole_batch", 2, Layout::OneNode, |env, dev, pg| {
        let (r, n) = (env.rank, env.world_size);
        let cfg = GptConfig { num_layers: 2, seq_length: 64, hidden_dropout: 0.0, seed: 3, ..GptConfig::tiny() };
        let (s, b) = (64, 4);
        // The whole batch [s, n·b]; rank r's shard is sequences r·b..(r+1)·b.
        let ids: Vec<i32> = (0..s * b * n).map(|i| ((i * 7 + i / 5) % 256) as i32).collect();
        let targets: Vec<i32> = (0..s * b * n).map(|i| ((i * 11 + 3) % 256) as i32).collect();
        let shard = |v: &[i32]| -> Vec<i32> {
            (0..s).flat_map(|t| v[t * b * n + r * b..t * b * n + (r + 1) * b].to_vec()).collect()
        };
        let dp_group = Arc::new(pg);
        for fp8 in [false, true] {
            let mut dp = DataParallel::new(dp_group.clone()).unwrap();
            let mut model = Gpt::new(dev, cfg.clone()).unwrap();
            dp.broadcast_parameters(&mut model).unwrap();
            let mut whole = Gpt::new(dev, cfg.clone()).unwrap();
            let recipe = DelayedScaling { amax_history_len: 4, ..Default::default() };
            let scope =
                |g: Option<Arc<ProcessGroup>>| Fp8Autocast { enabled: fp8, ..Fp8Autocast::new(recipe) }.with_group(g);
            let (x, y) = (
                TokenIds::from_host(dev, &[s, b], &shard(&ids)).unwrap(),
                TokenIds::from_host(dev, &[s, b], &shard(&targets)).unwrap(),
            );
            let (xw, yw) = (
                TokenIds::from_host(dev, &[s, b * n], &ids).unwrap(),
                TokenIds::from_host(dev, &[s, b * n], &targets).unwrap(),
            );
            if fp8 {
                // A first step sets the delayed scales from its amaxes (reduced over the ranks);
                // the compared step casts with them (the initial scale 1 underflows small
                // gradients, differently at the shard's and at the whole batch's loss scale).
                let mb = MicroBatch::default();
                let (_, ctx) = scope(Some(dp_group.clone())).run(|| model.forward_loss_with(&x, &y, mb)).unwrap();
                model.backward(ctx).unwrap();
                let (_, ctx) = scope(None).run(|| whole.forward_loss_with(&xw, &yw, mb)).unwrap();
                whole.backward(ctx).unwrap();
                model.zero_grad();
                whole.zero_grad();
            }
            // Data parallel: this rank's shard, gradients reduced while the backward runs.
            let (_, ctx) =
                scope(Some(dp_group.clone())).run(|| model.forward_loss_with(&x, &y, MicroBatch::default())).unwrap();
            let mut buckets = 0;
            model
                .backward_with(ctx, &mut |part| {
                    buckets += 1;
                    dp.reduce_grads(part)
                })
                .unwrap();
            assert_eq!(dp.finish().unwrap(), buckets);
            assert_eq!(buckets, 2 + cfg.num_layers + 2, "LM head, final norm, each layer, two embeddings");
            // The whole batch in one process.
            let (_, ctx) = scope(None).run(|| whole.forward_loss_with(&xw, &yw, MicroBatch::default())).unwrap();
            whole.backward(ctx).unwrap();
            let (got, want) = (grads(&model, dev), grads(&whole, dev));
            assert_eq!(got.len(), want.len());
            let (mut err2, mut norm2) = (0.0f64, 0.0f64);
            for ((path, g), (_, w)) in got.iter().zip(&want) {
                let e: f64 = g.iter().zip(w).map(|(a, b)| f64::from(a - b).powi(2)).sum();
                let n: f64 = w.iter().map(|v| f64::from(*v).powi(2)).sum();
                (err2, norm2) = (err2 + e, norm2 + n);
                // BF16: each gradient within 2e-2 (bf16 values summed in another order).
                if !fp8 {
                    let rel = (e / n).sqrt();
                    assert!(rel <= 2e-2, "bf16: {path}: relative error {rel} (norm {})", n.sqrt());
                }
            }
            // FP8: a value one bf16 ulp away (another GEMM algorithm at the shard's row count)
            // can round to the neighbouring E5M2 code, a quarter of the value away, so single
            // small gradients (a bias's, a sum over tokens that cancels) can differ by more; the
            // whole gradient is held to the FP8 gradient bound of the module tests (0.15, as
            // tests/gpu/moe_mlp.rs).
            let rel = (err2 / norm2).sqrt();
            let bound = if fp8 { 0.15 } else { 2e-2 };
            assert!(rel <= bound, "fp8 {fp8}: the whole gradient's relative error {rel} (bound {bound})");
            eprintln!("fp8 {fp8}: the whole gradient's relative error {rel}");
            // Every rank holds the same averaged gradients (their sums).
            let sums: Vec<f32> = got.iter().map(|(_, g)| g.iter().map(|v| f64::from(*v)).sum::<f64>() as f32).collect();
            assert!(same_on_every_rank(&dp_group, dev, &sums), "fp8 {fp8}: same gradients on every rank");
            // The mean of the ranks' values.
            assert_eq!(dp.mean(r as f32).unwrap(), (0..n).sum::<usize>() as f32 / n as f32);
        }
    });
}

#[test]
fn data_parallel_training_follows_one_gpu_at_twice_the_batch() {
    let test = "multi_gpu::data_parallel_training_follows_one_gpu_at_twice_the_batch";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        use crate::train::{train, CheckpointOptions, Precision, TrainConfig};
        let corpus = crate::train::corpus();
        let group = Arc::new(pg);
        let base = crate::train::config(60);
        // No dropout: the ranks' masks differ from one GPU's; the data and the weights do not.
        let base = TrainConfig {
            grad_accum: 1,
            eval_interval: 20,
            model: GptConfig { hidden_dropout: 0.0, ..base.model.clone() },
            ..base
        };
        for precision in [Precision::Bf16, Precision::Fp8] {
            let mut dp = Parallel::data_parallel(group.clone()).unwrap();
            let none = CheckpointOptions::default();
            let per_rank = TrainConfig { batch: 4, ..base.clone() };
            let ranks = train(dev, &corpus, &per_rank, precision, &none, &mut dp, |_, _| {}).unwrap();
            let whole = TrainConfig { batch: 4 * env.world_size, ..base.clone() };
            let one = train(dev, &corpus, &whole, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
            assert_eq!((ranks.ranks, one.ranks), (env.world_size, 1));
            let what = format!("{precision:?} rank {}", env.rank);
            let (a, b) = (&ranks.records, &one.records);
            assert_eq!(a.len(), b.len());
            // The first step sees the same data and weights: only the summation order differs.
            let first = (a[0].train_loss - b[0].train_loss).abs() / b[0].train_loss;
            assert!(first < 2e-3, "{what}: step 1 loss {} vs {}", a[0].train_loss, b[0].train_loss);
            for (x, y) in a.iter().zip(b) {
                let d = (x.train_loss - y.train_loss).abs() / y.train_loss;
                assert!(d < 5e-2, "{what}: step {} loss {} vs {}", x.step, x.train_loss, y.train_loss);
                if let (Some(u), Some(v)) = (x.val_loss, y.val_loss) {
                    assert!((u - v).abs() / v < 2e-2, "{what}: step {} validation loss {u} vs {v}", x.step);
                }
            }
            let tail = |r: &[crate::train::Record]| r[r.len() - 10..].iter().map(|r| r.train_loss).sum::<f32>() / 10.0;
            let (ta, tb) = (tail(a), tail(b));
            assert!((ta - tb).abs() / tb < 2e-2, "{what}: mean loss of the last 10 steps {ta} vs {tb}");
            assert!(ta < a[0].train_loss * 0.8, "{what}: it learns ({} -> {ta})", a[0].train_loss);
        }
    });
}

/// Columns `[c0, c0 + w)` of a row-major `[rows, cols]` matrix.
fn columns(m: &[f32], cols: usize, c0: usize, w: usize) -> Vec<f32> {
    m.chunks(cols).flat_map(|row| row[c0..c0 + w].to_vec()).collect()
}

/// Relative Frobenius error of `got` against `want`.
pub(crate) fn rel_err(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let e: f64 = got.iter().zip(want).map(|(a, b)| f64::from(a - b).powi(2)).sum();
    let n: f64 = want.iter().map(|v| f64::from(*v).powi(2)).sum();
    (e / n.max(1e-30)).sqrt()
}

#[test]
fn tensor_parallel_linear_equals_the_whole_layer() {
    on_ranks("multi_gpu::tensor_parallel_linear_equals_the_whole_layer", 2, Layout::OneNode, |env, dev, pg| {
        use te_nn::fp8::{fp8_autocast, Float8CurrentScaling, Recipe};
        use te_nn::parallel::{ParallelMode, TpConfig};
        let (r, n) = (env.rank, env.world_size);
        let group = Arc::new(pg);
        let (tokens, n_in, n_out) = (96, 64, 160);
        let up = |v: &[f32], shape: &[usize]| Tensor::from_f32(dev, DType::BF16, shape, v).unwrap();
        let host = |t: &Tensor| t.to_f32(dev).unwrap();
        let rows = |m: &[f32], cols: usize, r0: usize, h: usize| m[r0 * cols..(r0 + h) * cols].to_vec();
        let recipes: [Option<Recipe>; 3] =
            [None, Some(DelayedScaling::default().into()), Some(Float8CurrentScaling::default().into())];
        for sp in [false, true] {
            for recipe in recipes {
                for mode in [ParallelMode::Column, ParallelMode::Row] {
                    let what = format!("{mode:?} sp={sp} {recipe:?} rank {r}");
                    let cfg = LinearConfig { seed: 11, ..LinearConfig::new(n_in, n_out) };
                    let mut whole = Linear::new(dev, cfg.clone()).unwrap();
                    let tp = TpConfig::new(group.clone()).with_sequence_parallel(sp);
                    let mut part = Linear::new(dev, LinearConfig { tp: Some(tp), parallel_mode: mode, ..cfg }).unwrap();
                    let bias = randn(12, n_out, 0.5);
                    whole.params_mut().set_bias(up(&bias, &[n_out])).unwrap();
                    let (o, i) = (n_out / n, n_in / n);
                    let part_bias =
                        if mode == ParallelMode::Column { bias[r * o..(r + 1) * o].to_vec() } else { bias.clone() };
                    part.params_mut().set_bias(up(&part_bias, &[part_bias.len()])).unwrap();
                    // The slice of the whole layer's weight (the same init, sliced).
                    let w = host(whole.params().weight().unwrap());
                    let w_part = host(part.params().weight().unwrap());
                    let want_w = if mode == ParallelMode::Column {
                        rows(&w, n_in, r * o, o)
                    } else {
                        columns(&w, n_in, r * i, i)
                    };
                    assert_eq!(w_part, want_w, "{what}: the weight slice");
                    let x = bf16(&randn(13, tokens * n_in, 1.0));
                    let dy = bf16(&randn(14, tokens * n_out, 1.0));
                    let t = tokens / n;
                    // This rank's input and output gradient.
                    let (x_part, x_shape, dy_part, dy_shape) = match (mode, sp) {
                        (ParallelMode::Column, false) => {
                            (x.clone(), [tokens, n_in], columns(&dy, n_out, r * o, o), [tokens, o])
                        }
                        (ParallelMode::Column, true) => {
                            (rows(&x, n_in, r * t, t), [t, n_in], columns(&dy, n_out, r * o, o), [tokens, o])
                        }
                        (ParallelMode::Row, false) => {
                            (columns(&x, n_in, r * i, i), [tokens, i], dy.clone(), [tokens, n_out])
                        }
                        (ParallelMode::Row, true) => {
                            (columns(&x, n_in, r * i, i), [tokens, i], rows(&dy, n_out, r * t, t), [t, n_out])
                        }
                    };
                    let run = |m: &mut Linear, xv: &[f32], xs: &[usize], dyv: &[f32], ds: &[usize]| {
                        let mut step = || -> te_runtime::Result<(Vec<f32>, Vec<f32>)> {
                            let (y, ctx) = m.forward(&up(xv, xs))?;
                            let dx = m.backward(ctx, &up(dyv, ds))?;
                            Ok((host(&y), host(&dx)))
                        };
                        match recipe {
                            Some(rc) => fp8_autocast(true, rc, step).unwrap(),
                            None => step().unwrap(),
                        }
                    };
                    let (y_w, dx_w) = run(&mut whole, &x, &[tokens, n_in], &dy, &[tokens, n_out]);
                    let (y_p, dx_p) = run(&mut part, &x_part, &x_shape, &dy_part, &dy_shape);
                    let want_y = match (mode, sp) {
                        (ParallelMode::Column, _) => columns(&y_w, n_out, r * o, o),
                        (ParallelMode::Row, false) => y_w.clone(),
                        (ParallelMode::Row, true) => rows(&y_w, n_out, r * t, t),
                    };
                    let want_dx = match (mode, sp) {
                        (ParallelMode::Column, false) => dx_w.clone(),
                        (ParallelMode::Column, true) => rows(&dx_w, n_in, r * t, t),
                        (ParallelMode::Row, _) => columns(&dx_w, n_in, r * i, i),
                    };
                    let dw_w = host(whole.params().weight_grad().unwrap());
                    let db_w = host(whole.params().bias_grad().unwrap());
                    let want_dw = if mode == ParallelMode::Column {
                        rows(&dw_w, n_in, r * o, o)
                    } else {
                        columns(&dw_w, n_in, r * i, i)
                    };
                    let want_db =
                        if mode == ParallelMode::Column { db_w[r * o..(r + 1) * o].to_vec() } else { db_w.clone() };
                    let (fwd_bound, bwd_bound) = if recipe.is_some() { (0.06, 0.15) } else { (1e-2, 2e-2) };
                    for (name, got, want, bound) in [
                        ("y", y_p, want_y, fwd_bound),
                        ("dx", dx_p, want_dx, bwd_bound),
                        ("dW", host(part.params().weight_grad().unwrap()), want_dw, bwd_bound),
                        ("db", host(part.params().bias_grad().unwrap()), want_db, bwd_bound),
                    ] {
                        let e = rel_err(&got, &want);
                        assert!(e < bound, "{what}: {name} relative error {e} (bound {bound})");
                    }
                }
            }
        }
        // A split that does not divide is a typed error naming the dimension.
        let odd = LinearConfig { tp: Some(TpConfig::new(group.clone())), ..LinearConfig::new(64, 33) };
        let e = Linear::new(dev, odd).unwrap_err().to_string();
        assert!(e.contains("out_features = 33") && e.contains("2 tensor-parallel ranks"), "{e}");
    });
}
