//! Tensor parallelism of the blocks on two ranks (the multi-GPU issue): `LayerNormLinear`
//! (column), `LayerNormMLP` (GELU and SwiGLU), `MultiheadAttention` (GQA, with and without the
//! input norm) and `TransformerLayer` at TP=2, with and without sequence parallelism, in BF16 and
//! under delayed and current FP8 scaling, against the whole block in one process: the output,
//! the input gradient and every parameter (the rank's slice of the whole block's weight) and
//! gradient. Plus the typed errors of splits that do not divide.
//!
//! The ranks run as in [`crate::multi_gpu`]; skip with fewer than two GPUs or without NCCL.

use crate::common::{bf16, randn};
use crate::multi_gpu::{on_ranks, rel_err, Layout};
use std::sync::Arc;
use te_nn::fp8::{DelayedScaling, Float8CurrentScaling, Fp8Autocast, Recipe};
use te_nn::modules::{
    Activation, LayerNormLinear, LayerNormLinearConfig, LayerNormMLP, LayerNormMLPConfig, ModuleVisitor,
    MultiheadAttention, MultiheadAttentionConfig, Param, ParamKind, TransformerLayer, TransformerLayerConfig,
};
use te_nn::parallel::TpConfig;
use te_nn::Module;
use te_runtime::dist::ProcessGroup;
use te_runtime::{DType, Device, Tensor};

/// Sizes of the blocks: `[s, b, hidden]` hidden states, 4 query heads in 2 groups of 16
/// channels, an ffn of 96 (48 a rank).
const S: usize = 32;
const B: usize = 2;
const HIDDEN: usize = 64;
const HEADS: usize = 4;
const GROUPS: usize = 2;
const FFN: usize = 96;

/// One parameter: its path, shape, values and gradient.
type Named = (String, Vec<usize>, Vec<f32>, Option<Vec<f32>>);

/// A forward and backward of a block: `(y, dx)` for `x` and `dy`.
type Step<M> = dyn Fn(&mut M, &Tensor, &Tensor) -> te_runtime::Result<(Tensor, Tensor)>;

/// Every parameter and gradient of a module as f32, by path.
struct Params(Vec<Named>, Arc<Device>);

impl ModuleVisitor for Params {
    fn param(&mut self, path: &str, _: ParamKind, p: &dyn Param) -> te_runtime::Result<()> {
        let Some(value) = p.tensor() else { return Ok(()) };
        let grad = p.main_grad().or(p.grad()).map(|g| g.to_f32(&self.1)).transpose()?;
        self.0.push((path.to_owned(), p.shape().to_vec(), value.to_f32(&self.1)?, grad));
        Ok(())
    }
}

fn params(m: &dyn Module, dev: &Arc<Device>) -> Vec<Named> {
    let mut p = Params(Vec::new(), dev.clone());
    m.visit("", &mut p).unwrap();
    p.0
}

/// Rank `r` of `n`'s part of a row-major `[rows, cols]` matrix split along `dim` (0: rows, 1:
/// columns), each of `segments` (parts of that dim summing to it) split separately.
fn slice(m: &[f32], [rows, cols]: [usize; 2], dim: usize, segments: &[usize], r: usize, n: usize) -> Vec<f32> {
    let mut ranges = Vec::new();
    let mut start = 0;
    for &seg in segments {
        ranges.push(start + r * seg / n..start + (r + 1) * seg / n);
        start += seg;
    }
    (0..rows)
        .filter(|row| dim == 1 || ranges.iter().any(|g| g.contains(row)))
        .flat_map(|row| {
            let line = &m[row * cols..(row + 1) * cols];
            if dim == 0 {
                line.to_vec()
            } else {
                ranges.iter().flat_map(|g| line[g.clone()].to_vec()).collect()
            }
        })
        .collect()
}

/// The rows `r · len / n ..` of a tensor's values split along its first dim.
fn chunk(v: &[f32], r: usize, n: usize) -> Vec<f32> {
    v[r * v.len() / n..(r + 1) * v.len() / n].to_vec()
}

/// The output features' parts of a parameter that split separately, by path.
fn segments(path: &str, rows: usize, gated: bool) -> Vec<usize> {
    let d = HIDDEN / HEADS;
    if path.contains("qkv") {
        vec![HEADS * d, GROUPS * d, GROUPS * d]
    } else if path.contains("fc1") && gated {
        vec![rows / 2, rows / 2]
    } else {
        vec![rows]
    }
}

/// One block at TP=2 against the whole block: `make(tp)` builds it (`None`: whole), `step` runs a
/// forward and backward and returns `(y, dx)`, `out_cols` is the width of a column-split output
/// (`LayerNormLinear`) or `None` for a whole-hidden output.
struct Case<'a, M> {
    name: &'a str,
    make: &'a dyn Fn(Option<TpConfig>) -> M,
    step: &'a Step<M>,
    x_shape: &'a [usize],
    out_cols: Option<usize>,
    gated: bool,
}

fn compare<M: Module>(case: &Case<'_, M>, dev: &Arc<Device>, group: &Arc<ProcessGroup>) {
    let (r, n) = (group.rank(), group.size());
    let host = |t: &Tensor| t.to_f32(dev).unwrap();
    let up = |v: &[f32], shape: &[usize]| Tensor::from_f32(dev, DType::BF16, shape, v).unwrap();
    // The recipe, and whether the amaxes are reduced over the group (delayed scaling then
    // shares its scales, and sequence parallelism all-gathers FP8 codes).
    let delayed: Recipe = DelayedScaling::default().into();
    let recipes: [Option<(Recipe, bool)>; 4] =
        [None, Some((delayed, false)), Some((delayed, true)), Some((Float8CurrentScaling::default().into(), false))];
    for sp in [false, true] {
        for recipe in recipes {
            let what = format!("{} sp={sp} {recipe:?} rank {r}", case.name);
            let mut whole = (case.make)(None);
            let mut part = (case.make)(Some(TpConfig::new(group.clone()).with_sequence_parallel(sp)));
            let x_len: usize = case.x_shape.iter().product();
            let x = bf16(&randn(21, x_len, 1.0));
            let tokens = x_len / HIDDEN;
            let out_cols = case.out_cols.unwrap_or(HIDDEN);
            let dy = bf16(&randn(22, tokens * out_cols, 1.0));
            let shard = |v: &[f32]| if sp { chunk(v, r, n) } else { v.to_vec() };
            let mut x_part_shape = case.x_shape.to_vec();
            if sp {
                x_part_shape[0] /= n;
            }
            // The rank's output: its columns (column-split) or its token shard (sequence parallel).
            let out_part = |v: &[f32]| match case.out_cols {
                Some(c) => slice(v, [tokens, c], 1, &[c], r, n),
                None => shard(v),
            };
            let mut y_shape = x_part_shape.clone();
            *y_shape.last_mut().unwrap() = out_cols;
            let y_part_shape: Vec<usize> = match case.out_cols {
                Some(c) => vec![tokens, c / n],
                None => y_shape,
            };
            let mut y_whole_shape = case.x_shape.to_vec();
            *y_whole_shape.last_mut().unwrap() = out_cols;
            let run = |m: &mut M, xv: &[f32], xs: &[usize], dyv: &[f32], ds: &[usize]| {
                let mut step = || (case.step)(m, &up(xv, xs), &up(dyv, ds));
                let (y, dx) = match recipe {
                    Some((rc, reduce)) => Fp8Autocast::new(rc).with_group(reduce.then(|| group.clone())).run(step),
                    None => step(),
                }
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                (host(&y), host(&dx))
            };
            let (y_w, dx_w) = run(&mut whole, &x, case.x_shape, &dy, &y_whole_shape);
            let (y_p, dx_p) = run(&mut part, &shard(&x), &x_part_shape, &out_part(&dy), &y_part_shape);
            let (fwd_bound, bwd_bound) = if recipe.is_some() { (0.06, 0.15) } else { (1e-2, 2e-2) };
            let check = |name: &str, got: &[f32], want: &[f32], bound: f64| {
                let e = rel_err(got, want);
                assert!(e < bound, "{what}: {name} relative error {e} (bound {bound})");
            };
            check("y", &y_p, &out_part(&y_w), fwd_bound);
            check("dx", &dx_p, &shard(&dx_w), bwd_bound);
            let whole_params = params(&whole, dev);
            let part_params = params(&part, dev);
            assert_eq!(whole_params.len(), part_params.len(), "{what}: parameter count");
            for ((path, ws, wv, wg), (ppath, ps, pv, pg)) in whole_params.iter().zip(&part_params) {
                assert_eq!(path, ppath, "{what}: parameter order");
                let cut = |v: &[f32]| -> Vec<f32> {
                    if ps == ws {
                        return v.to_vec(); // replicated: norms, a row-parallel bias
                    }
                    let (rows, cols) = (ws[0], ws.get(1).copied().unwrap_or(1));
                    if ps[0] * n == rows {
                        slice(v, [rows, cols], 0, &segments(path, rows, case.gated), r, n)
                    } else {
                        assert_eq!(ps[1] * n, cols, "{what}: {path} {ps:?} is no slice of {ws:?}");
                        slice(v, [rows, cols], 1, &[cols], r, n)
                    }
                };
                assert_eq!(pv, &cut(wv), "{what}: {path} is the whole block's slice");
                match (pg, wg) {
                    (Some(g), Some(w)) => check(&format!("{path} grad"), g, &cut(w), bwd_bound),
                    _ => panic!("{what}: {path} has no gradient"),
                }
            }
        }
    }
}

/// The `step` of a [`Case`] for a block with `forward(x) -> (y, ctx)` and `backward(ctx, dy) ->
/// dx`.
macro_rules! fwd_bwd {
    () => {
        &|m, x, dy| {
            let (y, ctx) = m.forward(x)?;
            Ok((y, m.backward(ctx, dy)?))
        }
    };
}

fn attention_config(input_layernorm: bool, tp: Option<TpConfig>) -> MultiheadAttentionConfig {
    MultiheadAttentionConfig {
        num_gqa_groups: Some(GROUPS),
        input_layernorm,
        seed: 31,
        tp,
        ..MultiheadAttentionConfig::new(HIDDEN, HEADS)
    }
}

#[test]
fn tensor_parallel_blocks_equal_the_whole_blocks() {
    on_ranks("multi_gpu_tp::tensor_parallel_blocks_equal_the_whole_blocks", 2, Layout::OneNode, |_, dev, pg| {
        let group = Arc::new(pg);
        let hidden_shape = [S, B, HIDDEN];
        let ln_linear = |tp: Option<TpConfig>| {
            let cfg = LayerNormLinearConfig { seed: 5, tp, ..LayerNormLinearConfig::new(HIDDEN, FFN) };
            LayerNormLinear::new(dev, cfg).unwrap()
        };
        compare(
            &Case {
                name: "LayerNormLinear",
                make: &ln_linear,
                step: fwd_bwd!(),
                x_shape: &[S * B, HIDDEN],
                out_cols: Some(FFN),
                gated: false,
            },
            dev,
            &group,
        );
        for activation in [Activation::Gelu, Activation::Swiglu] {
            let mlp = |tp| {
                let cfg = LayerNormMLPConfig { activation, seed: 7, tp, ..LayerNormMLPConfig::new(HIDDEN, FFN) };
                LayerNormMLP::new(dev, cfg).unwrap()
            };
            compare(
                &Case {
                    name: &format!("LayerNormMLP {activation:?}"),
                    make: &mlp,
                    step: fwd_bwd!(),
                    x_shape: &hidden_shape,
                    out_cols: None,
                    gated: activation.is_gated(),
                },
                dev,
                &group,
            );
        }
        for input_layernorm in [true, false] {
            let mha = |tp| MultiheadAttention::new(dev, attention_config(input_layernorm, tp)).unwrap();
            compare(
                &Case {
                    name: &format!("MultiheadAttention input_layernorm={input_layernorm}"),
                    make: &mha,
                    step: fwd_bwd!(),
                    x_shape: &hidden_shape,
                    out_cols: None,
                    gated: false,
                },
                dev,
                &group,
            );
        }
        let layer = |tp| {
            let cfg = TransformerLayerConfig {
                num_gqa_groups: Some(GROUPS),
                hidden_dropout: 0.0,
                seed: 41,
                tp,
                ..TransformerLayerConfig::new(HIDDEN, FFN, HEADS)
            };
            TransformerLayer::new(dev, cfg).unwrap()
        };
        compare(
            &Case {
                name: "TransformerLayer",
                make: &layer,
                step: fwd_bwd!(),
                x_shape: &hidden_shape,
                out_cols: None,
                gated: false,
            },
            dev,
            &group,
        );

        // Splits that do not divide are typed errors.
        let tp = || Some(TpConfig::new(group.clone()));
        let e =
            MultiheadAttention::new(dev, MultiheadAttentionConfig { tp: tp(), ..MultiheadAttentionConfig::new(48, 3) })
                .unwrap_err()
                .to_string();
        assert!(e.contains("num_attention_heads = 3") && e.contains("2 tensor-parallel ranks"), "{e}");
        let gqa =
            MultiheadAttentionConfig { num_gqa_groups: Some(1), tp: tp(), ..MultiheadAttentionConfig::new(64, 4) };
        let e = MultiheadAttention::new(dev, gqa).unwrap_err().to_string();
        assert!(e.contains("num_gqa_groups = 1"), "{e}");
        let e = LayerNormMLP::new(dev, LayerNormMLPConfig { tp: tp(), ..LayerNormMLPConfig::new(64, 99) })
            .unwrap_err()
            .to_string();
        assert!(e.contains("ffn_hidden_size = 99"), "{e}");
        let e = LayerNormLinear::new(dev, LayerNormLinearConfig { tp: tp(), ..LayerNormLinearConfig::new(64, 33) })
            .unwrap_err()
            .to_string();
        assert!(e.contains("out_features = 33") && e.contains("2 tensor-parallel ranks"), "{e}");
    });
}

/// A GPT trained at TP=2 (BF16 without, FP8 with sequence parallelism) follows the same model
/// trained on one GPU with the same batches; its checkpoint (one file a rank) merges into the
/// file one GPU loads (`te checkpoint merge`), and that model gives the TP=2 model's loss.
#[test]
fn tensor_parallel_training_follows_one_gpu_and_its_checkpoint_merges() {
    let test = "multi_gpu_tp::tensor_parallel_training_follows_one_gpu_and_its_checkpoint_merges";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        use crate::train::{train, CheckpointOptions, Precision, TrainConfig};
        use te_models::gpt::{Gpt, GptConfig};
        use te_nn::checkpoint::{
            self,
            tp::{merge_files, shard_path},
            LoadOptions,
        };
        use te_nn::modules::TokenIds;
        use te_nn::parallel::{Parallel, TpLayout};
        let corpus = crate::train::corpus();
        let world = Arc::new(pg);
        let base = crate::train::config(40);
        let base = TrainConfig {
            grad_accum: 1,
            eval_interval: 20,
            model: GptConfig { hidden_dropout: 0.0, ..base.model.clone() },
            ..base
        };
        let root = std::env::temp_dir().join(format!("te-tp-train-{}", env.master_port));
        for (sp, precision) in [(false, Precision::Bf16), (true, Precision::Fp8)] {
            let what = format!("sp={sp} {precision:?} rank {}", env.rank);
            let mut parallel = Parallel::new(world.clone(), 2, sp).unwrap();
            assert_eq!((parallel.tensor_rank(), parallel.data_rank()), ((env.rank, 2), (0, 1)));
            let dir = root.join(format!("sp-{sp}"));
            let ckpt = CheckpointOptions { dir: Some(dir.clone()), interval: 20, ..CheckpointOptions::default() };
            let tp = train(dev, &corpus, &base, precision, &ckpt, &mut parallel, |_, _| {}).unwrap();
            let none = CheckpointOptions::default();
            let one = train(dev, &corpus, &base, precision, &none, &mut Parallel::default(), |_, _| {}).unwrap();
            assert_eq!((tp.ranks, one.ranks), (2, 1));
            let (a, b) = (&tp.records, &one.records);
            assert_eq!(a.len(), b.len());
            let first = (a[0].train_loss - b[0].train_loss).abs() / b[0].train_loss;
            assert!(first < 5e-3, "{what}: step 1 loss {} vs {}", a[0].train_loss, b[0].train_loss);
            for (x, y) in a.iter().zip(b) {
                let d = (x.train_loss - y.train_loss).abs() / y.train_loss;
                assert!(d < 5e-2, "{what}: step {} loss {} vs {}", x.step, x.train_loss, y.train_loss);
            }
            let last = a[a.len() - 1].train_loss;
            assert!(last < a[0].train_loss * 0.8, "{what}: it learns ({} -> {last})", a[0].train_loss);

            // The checkpoint: one file a rank, merged into one GPU's.
            let step_dir = dir.join(precision.name()).join(format!("step-{:07}", base.steps));
            let model_file = step_dir.join("model.safetensors");
            let shards: Vec<_> = (0..2).map(|r| shard_path(&model_file, r, 2)).collect();
            assert!(shards.iter().all(|p| p.exists()), "{what}: the ranks' files {shards:?}");
            let m = &base.model;
            let ids: Vec<i32> = (0..m.seq_length * 4).map(|i| (i * 7 % 251) as i32).collect();
            let targets: Vec<i32> = ids.iter().map(|&t| (t + 1) % 256).collect();
            let shape = [m.seq_length, 4];
            let (ids, targets) =
                (TokenIds::from_host(dev, &shape, &ids).unwrap(), TokenIds::from_host(dev, &shape, &targets).unwrap());
            let tp_cfg = parallel.tensor().unwrap().clone();
            let mut tp_model = Gpt::with_tensor_parallel(dev, m.clone(), tp_cfg).unwrap();
            let untrained = tp_model.forward_loss(&ids, &targets).unwrap().0;
            checkpoint::load(&mut tp_model, &shards[env.rank], &LoadOptions::default()).unwrap();
            let tp_loss = tp_model.forward_loss(&ids, &targets).unwrap().0;
            assert!((untrained - tp_loss).abs() > 0.1, "{what}: the trained weights were loaded");
            world.barrier().unwrap();
            if env.rank == 0 {
                let d = m.hidden_size / m.num_attention_heads;
                let layout =
                    TpLayout::new(m.num_attention_heads, m.num_attention_heads, d, m.ffn_hidden_size, 2).unwrap();
                merge_files(&shards, &layout, &model_file).unwrap();
                let mut whole = Gpt::new(dev, m.clone()).unwrap();
                checkpoint::load(&mut whole, &model_file, &LoadOptions::default()).unwrap();
                let loss = whole.forward_loss(&ids, &targets).unwrap().0;
                assert!((loss - tp_loss).abs() / tp_loss < 5e-3, "{what}: merged model loss {loss} vs TP=2 {tp_loss}");
                // Resume from step 20 (its trainer.toml over latest.toml) below.
                let run_dir = dir.join(precision.name());
                std::fs::copy(run_dir.join("step-0000020/trainer.toml"), run_dir.join("latest.toml")).unwrap();
            }
            world.barrier().unwrap();
            // Each rank resumes from its own files; the last 20 steps are the straight run's, bit
            // for bit.
            let resume = CheckpointOptions { resume: true, ..ckpt.clone() };
            let resumed = train(dev, &corpus, &base, precision, &resume, &mut parallel, |_, _| {}).unwrap();
            let bits =
                |r: &[crate::train::Record]| r.iter().map(|r| (r.step, r.train_loss.to_bits())).collect::<Vec<_>>();
            assert_eq!(bits(&resumed.records), bits(&tp.records), "{what}: resumed at step 20");
            world.barrier().unwrap();
        }
        if env.rank == 0 {
            let _ = std::fs::remove_dir_all(&root);
        }
    });
}

/// Four ranks as TP=2 × DP=2 (Megatron-LM's layout: tensor-parallel pairs (0, 1) and (2, 3),
/// data-parallel groups (0, 2) and (1, 3)): each pair reads its shard of the batch, and the run
/// follows one GPU on the whole batch. Needs four GPUs (skipped with fewer, even when multi-GPU
/// tests are required: the 2-GPU machines run the tests above).
#[test]
fn tensor_and_data_parallel_training_follows_one_gpu() {
    if te_runtime::device::device_count() < 4 && std::env::var("TE_MULTI_GPU_TEST").is_err() {
        eprintln!("skipping: four GPUs needed");
        return;
    }
    let test = "multi_gpu_tp::tensor_and_data_parallel_training_follows_one_gpu";
    on_ranks(test, 4, Layout::OneNode, |env, dev, pg| {
        use crate::train::{train, CheckpointOptions, Precision, TrainConfig};
        use te_models::gpt::GptConfig;
        use te_nn::parallel::Parallel;
        let corpus = crate::train::corpus();
        let base = crate::train::config(30);
        let base = TrainConfig {
            grad_accum: 1,
            eval_interval: 10,
            model: GptConfig { hidden_dropout: 0.0, ..base.model.clone() },
            ..base
        };
        let mut parallel = Parallel::new(Arc::new(pg), 2, false).unwrap();
        let r = env.rank;
        assert_eq!((parallel.tensor_rank(), parallel.data_rank()), ((r % 2, 2), (r / 2, 2)));
        let none = CheckpointOptions::default();
        let per_rank = TrainConfig { batch: 4, ..base.clone() };
        let ranks = train(dev, &corpus, &per_rank, Precision::Bf16, &none, &mut parallel, |_, _| {}).unwrap();
        let whole = TrainConfig { batch: 8, ..base };
        let one = train(dev, &corpus, &whole, Precision::Bf16, &none, &mut Parallel::default(), |_, _| {}).unwrap();
        assert_eq!(ranks.ranks, 4);
        for (x, y) in ranks.records.iter().zip(&one.records) {
            let d = (x.train_loss - y.train_loss).abs() / y.train_loss;
            assert!(d < 5e-2, "rank {r}: step {} loss {} vs {}", x.step, x.train_loss, y.train_loss);
        }
        let first = &ranks.records[0];
        assert!((first.train_loss - one.records[0].train_loss).abs() / one.records[0].train_loss < 5e-3);
    });
}
