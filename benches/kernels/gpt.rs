//! One training step of the GPT presets (`te_models::gpt`), as `te train` does it:
//! `forward_loss_with` (the loss stays on the device), `backward`, `AdamW::step` (FP32 masters, global-norm clipping at 1.0) and
//! `zero_grad`, in BF16 and in FP8 (DelayedScaling, TE's defaults; with `fp8_dpa`, attention in
//! FP8 where the kernels take it: head_dim 128 on Hopper; with `fp8_mha`, its output handed to the
//! projection in E4M3 too; and Float8BlockScaling, TE's defaults), timed per phase with CUDA
//! events; tokens/s from the whole step. `small`: batch 8 × seq 1024 (and batch 1: `small b1`);
//! `large` (1.2 B parameters): batch 2 × seq 2048. For `small`, the BF16 and FP8 delayed steps
//! are also captured in a CUDA graph and replayed (`te train --cuda-graph`: variants `… graph`). One model per preset serves both precisions (its weights
//! keep training from one timed step to the next; the host-side init of `large` takes seconds).
//! `benches/anchors/gpt.py` times the same step of a GPT-2-style `nn.Module` in PyTorch.
//!
//! FLOPs: forward `2·tokens·(layers·(4h² + 2h·ffn) + h·vocab)` for the GEMMs (FP8 under FP8)
//! plus `2·b·s²·h` per layer for causal attention (BF16); backward twice that. The optimizer
//! moves at least 30 bytes per parameter (bf16 gradient read for the norm and for the update,
//! fp32 master and both moments read and written, the bf16 parameter written).

use crate::harness::{Bench, PhaseStats, Work};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_models::gpt::{Gpt, GptConfig, MicroBatch};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Recipe};
use te_nn::modules::TokenIds;
use te_nn::Module;
use te_runtime::graph::Graph;
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

/// Optimizer bytes per parameter (see the module doc).
pub const OPTIMIZER_BYTES_PER_PARAM: u64 = 30;

pub fn run(b: &mut Bench) {
    // (preset name, config, batch, warm-up steps, timed steps)
    // `small b1`: one sequence a step, where launches bound the step (the graph's case).
    let presets = [
        ("small", GptConfig::small(), 8, 3, 10),
        ("small b1", GptConfig::small(), 1, 3, 20),
        ("large", GptConfig::large(), 2, 2, 8),
    ];
    for (preset, cfg, batch, warmup, iters) in presets {
        let work = format!("gpt {preset}");
        if b.enabled(&work) {
            step(b, &work, cfg, batch, warmup, iters);
        }
    }
}

fn step(b: &mut Bench, work: &str, cfg: GptConfig, batch: usize, warmup: usize, iters: usize) {
    let dev = b.dev().clone();
    let (s, h, f, v, layers) = (cfg.seq_length, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_layers);
    let tokens = s * batch;
    let gemm = (2 * tokens * (layers * (4 * h * h + 2 * h * f) + h * v)) as u64;
    let attention = (2 * layers * batch * s * s * h) as u64;
    println!("{work}: building {} parameters", cfg.num_parameters());
    let mut model = Gpt::new(&dev, cfg).unwrap();
    let params = model.num_parameters() as u64;
    let opt_cfg = AdamWConfig {
        max_grad_norm: Some(1.0),
        weight_decay: 0.1,
        betas: (0.9, 0.95),
        decay_biases_and_norms: false,
        ..AdamWConfig::new(LrSchedule::Constant(1e-4))
    };
    let mut opt = AdamW::new(&dev, &model, opt_cfg).unwrap();
    // Random tokens; the targets are the ids shifted by one position, as in training.
    let mut rng = StdRng::seed_from_u64(7);
    let ids: Vec<i32> = (0..tokens + batch).map(|_| rng.random_range(0..v as i32)).collect();
    // With their grouping for the embedding's backward built once (a captured step uploads nothing).
    let ids_t = TokenIds::from_host(&dev, &[s, batch], &ids[..tokens]).unwrap().with_grad_index(&dev).unwrap();
    let targets = TokenIds::from_host(&dev, &[s, batch], &ids[batch..]).unwrap();
    let shape = format!("b{batch} s{s}");
    let fp8_dpa = DelayedScaling { fp8_dpa: true, ..DelayedScaling::default() };
    let fp8_mha = DelayedScaling { fp8_mha: true, ..DelayedScaling::default() };
    let variants: [(&str, Option<Recipe>); 5] = [
        ("ours bf16", None),
        ("ours fp8 delayed", Some(DelayedScaling::default().into())),
        ("ours fp8 + fp8_dpa", Some(fp8_dpa.into())),
        ("ours fp8 + fp8_mha", Some(fp8_mha.into())),
        ("ours fp8 block", Some(Float8BlockScaling::default().into())),
    ];
    for (variant, recipe) in variants {
        let fp8 = recipe.is_some();
        let st = b.time_phases(warmup, iters, 3, |m| {
            let (_, ctx) = match recipe {
                Some(r) => fp8_autocast(true, r, || model.forward_loss_with(&ids_t, &targets, MicroBatch::default())),
                None => model.forward_loss_with(&ids_t, &targets, MicroBatch::default()),
            }
            .unwrap();
            m.mark();
            model.backward(ctx).unwrap();
            m.mark();
            opt.step(&mut model).unwrap();
            model.zero_grad();
            m.mark();
        });
        let fp8_flops = if fp8 { gemm } else { 0 };
        let step = StepRows { work, shape: &shape, variant, fp8, tokens, params };
        step.record(b, &st, gemm + attention, fp8_flops);
        // The same step replayed from a CUDA graph (`te train --cuda-graph`), after the eager
        // steps above loaded its kernels: BF16 and FP8 delayed, for `small`.
        if work.starts_with("gpt small") && matches!(variant, "ours bf16" | "ours fp8 delayed") {
            let g = graphed_step(b, (&mut model, &mut opt), (&ids_t, &targets), recipe, (warmup, iters));
            println!(
                "{work} {variant}: graph {:.0} µs against eager {:.0} µs = {:.2}×",
                g.median_us,
                st.total.median_us,
                st.total.median_us / g.median_us
            );
            let w = Work {
                section: "gpt",
                work: work.into(),
                pass: "step",
                variant: format!("{variant} graph"),
                precision: if fp8 { "fp8" } else { "bf16" },
                flops_fp8: 3 * fp8_flops,
                tokens: Some(tokens as u64),
            };
            b.record_work(&shape, g, 3 * (gemm + attention), Some(OPTIMIZER_BYTES_PER_PARAM * params), w);
        }
    }
}

/// One training step captured in a CUDA graph and replayed as the trainer does
/// (`te_train::TrainConfig::cuda_graph`): the dropout base and AdamW's scalars set before each
/// replay, the step completed on the host after it (which waits for the device, as the eager
/// step's norm read does).
fn graphed_step(
    b: &mut Bench,
    (model, opt): (&mut Gpt, &mut AdamW),
    (ids, targets): (&TokenIds, &TokenIds),
    recipe: Option<Recipe>,
    (warmup, iters): (usize, usize),
) -> crate::harness::Stats {
    let dev = b.dev().clone();
    let offset0 = model.dropout_offset();
    dev.set_philox_offset_base(0).unwrap();
    let (graph, pending) = Graph::capture(&dev, || {
        let (_, ctx) = match recipe {
            Some(r) => fp8_autocast(true, r, || model.forward_loss_with(ids, targets, MicroBatch::default()))?,
            None => model.forward_loss_with(ids, targets, MicroBatch::default())?,
        };
        model.backward(ctx)?;
        opt.issue(&mut *model)
    })
    .unwrap();
    let per_step = model.dropout_offset() - offset0;
    model.set_dropout_offset(offset0);
    model.zero_grad();
    let st = b.time(warmup, iters, |_| {
        let offset = model.dropout_offset();
        dev.set_philox_offset_base(offset - offset0).unwrap();
        let p = opt.prepare_replay(&pending).unwrap();
        graph.replay().unwrap();
        opt.finish(&p).unwrap();
        model.set_dropout_offset(offset + per_step);
    });
    dev.set_philox_offset_base(0).unwrap();
    st
}

/// The rows of one timed training step (phases forward, backward, optimizer; `section` gpt).
pub struct StepRows<'a> {
    pub work: &'a str,
    pub shape: &'a str,
    pub variant: &'a str,
    /// The GEMMs run in FP8.
    pub fp8: bool,
    pub tokens: usize,
    /// Parameters the optimizer updates.
    pub params: u64,
}

impl StepRows<'_> {
    /// Records `fwd`, `bwd` (twice the forward's FLOPs), `optimizer` and `step` rows of `st`
    /// (`fwd` FLOPs a forward, `fp8_flops` of them at the FP8 rate) and prints the tokens/s.
    pub fn record(&self, b: &mut Bench, st: &PhaseStats, fwd: u64, fp8_flops: u64) {
        let opt_bytes = OPTIMIZER_BYTES_PER_PARAM * self.params;
        let rows = [
            ("fwd", st.phases[0], fwd, fp8_flops, None),
            ("bwd", st.phases[1], 2 * fwd, 2 * fp8_flops, None),
            ("optimizer", st.phases[2], 0, 0, Some(opt_bytes)),
            ("step", st.total, 3 * fwd, 3 * fp8_flops, Some(opt_bytes)),
        ];
        for (pass, stats, flops, flops_fp8, bytes) in rows {
            let w = Work {
                section: "gpt",
                work: self.work.into(),
                pass,
                variant: self.variant.into(),
                precision: if self.fp8 { "fp8" } else { "bf16" },
                flops_fp8,
                tokens: Some(self.tokens as u64),
            };
            b.record_work(self.shape, stats, flops, bytes, w);
        }
        let (work, variant) = (self.work, self.variant);
        println!("{work} {variant}: {:.0} tokens/s", self.tokens as f64 / (st.total.median_us * 1e-6));
    }
}
