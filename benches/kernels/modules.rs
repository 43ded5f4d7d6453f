//! The TE modules forward, backward and both (one CUDA event between the passes), in BF16 and in
//! FP8 with each recipe (DelayedScaling, Float8CurrentScaling and Float8BlockScaling, TE's defaults), at the shapes
//! of `benches/anchors/modules.py`, which times the same blocks in PyTorch (eager,
//! torch.compile, torchao float8 tensorwise and rowwise):
//! - `linear`: 8192 tokens, 4096 → 16384 and 16384 → 4096;
//! - `layernorm_linear`: 8192 tokens, 4096 → 12288 (a QKV projection);
//! - `layernorm_mlp`: 8192 tokens, hidden 4096, ffn 16384, GELU (TE's benchmark shape);
//! - `transformer_layer`: TE's quickstart layer, hidden 4096, 32 heads, ffn 16384, seq 2048,
//!   batch 4, hidden dropout 0.1, causal.
//!
//! FLOPs are the GEMMs' `2·m·n·k` (backward: twice the forward) plus, for the layer,
//! attention's two batched matmuls over the causal half (`2·b·s²·h` forward): the work any
//! implementation must do, so our unfused attention, which computes the masked half too, is
//! counted at half its work. Under FP8 the GEMMs count at the FP8 rate, attention at BF16.
//!
//! Also: `LayerNormMLPConfig::recompute_activation`, and the bytes `LayerNormMLP` saves for
//! backward in FP8 against BF16.

use crate::harness::{random_bytes, Bench, Marks, PhaseStats, Work};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe};
use te_nn::modules::{
    ForwardOptions, GroupedLinear, GroupedLinearConfig, LayerNormLinear, LayerNormLinearConfig, LayerNormMLP,
    LayerNormMLPConfig, Linear, LinearConfig, TransformerLayer, TransformerLayerConfig,
};
use te_runtime::{DType, Tensor};

const TOKENS: usize = 8192;
const HIDDEN: usize = 4096;
const FFN: usize = 16384;
/// `grouped_linear`: the rows of each of 8 experts (8192 in all) and their FFN width (Mixtral's).
const GROUPED_SPLITS: [usize; 8] = [1536, 512, 2048, 768, 1024, 256, 1280, 768];
const GROUPED_FFN: usize = 14336;
const WARMUP: usize = 3;
const ITERS: usize = 20;

pub fn run(b: &mut Bench) {
    let dev = b.dev().clone();
    let tensor = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, n, seed)).unwrap()
    };
    if b.enabled("linear") {
        for (n_in, n_out) in [(4096, 16384), (16384, 4096)] {
            let (x, dy) = (tensor(&[TOKENS, n_in], 1), tensor(&[TOKENS, n_out], 2));
            let mut lin = Linear::new(&dev, LinearConfig::new(n_in, n_out)).unwrap();
            let gemm = (2 * TOKENS * n_in * n_out) as u64;
            let shape = format!("{TOKENS}x{n_in}->{n_out}");
            time_passes(b, "linear", &shape, gemm, gemm, Some(1.6), |recipe, m| {
                let (_, ctx) = autocast(recipe, || lin.forward(&x));
                m.mark();
                lin.backward(ctx, &dy).unwrap();
                m.mark();
            });
        }
    }
    if b.enabled("layernorm_linear") {
        let n_out = 3 * HIDDEN;
        let (x, dy) = (tensor(&[TOKENS, HIDDEN], 1), tensor(&[TOKENS, n_out], 2));
        let mut lnl = LayerNormLinear::new(&dev, LayerNormLinearConfig::new(HIDDEN, n_out)).unwrap();
        let gemm = (2 * TOKENS * HIDDEN * n_out) as u64;
        let shape = format!("{TOKENS}x{HIDDEN}->{n_out}");
        time_passes(b, "layernorm_linear", &shape, gemm, gemm, None, |recipe, m| {
            let (_, ctx) = autocast(recipe, || lnl.forward(&x));
            m.mark();
            lnl.backward(ctx, &dy).unwrap();
            m.mark();
        });
    }
    if b.enabled("layernorm_mlp") {
        layernorm_mlp(b, &tensor(&[TOKENS, HIDDEN], 1), &tensor(&[TOKENS, HIDDEN], 2));
    }
    if b.enabled("grouped_linear") {
        // TE's expert layer: 8 experts, 8192 tokens spread unevenly (multiples of 16), no bias
        // (as torch._grouped_mm in benches/anchors/modules.py).
        let (n_in, n_out) = (HIDDEN, GROUPED_FFN);
        let (x, dy) = (tensor(&[TOKENS, n_in], 5), tensor(&[TOKENS, n_out], 6));
        let cfg = GroupedLinearConfig { bias: false, ..GroupedLinearConfig::new(GROUPED_SPLITS.len(), n_in, n_out) };
        let mut experts = GroupedLinear::new(&dev, cfg).unwrap();
        let gemm = (2 * TOKENS * n_in * n_out) as u64;
        let shape = format!("{TOKENS}x{n_in}->{n_out} e{}", GROUPED_SPLITS.len());
        time_passes(b, "grouped_linear", &shape, gemm, gemm, None, |recipe, m| {
            let (_, ctx) = autocast(recipe, || experts.forward(&x, &GROUPED_SPLITS));
            m.mark();
            experts.backward(ctx, &dy).unwrap();
            m.mark();
        });
        // Gradient accumulation's later micro-batches: the FP8 weights (and their transposes)
        // cast by the first one are reused (is_first_microbatch = Some(false)).
        let delayed = Some(Recipe::from(DelayedScaling::default()));
        let first = ForwardOptions { is_first_microbatch: Some(true), ..Default::default() };
        autocast(delayed, || experts.forward_with(&x, &GROUPED_SPLITS, first));
        let later = ForwardOptions { is_first_microbatch: Some(false), ..Default::default() };
        let st = b.time_phases(WARMUP, ITERS, 2, |m| {
            let (_, ctx) = autocast(delayed, || experts.forward_with(&x, &GROUPED_SPLITS, later));
            m.mark();
            experts.backward(ctx, &dy).unwrap();
            m.mark();
        });
        record_passes(b, "grouped_linear", &shape, gemm, gemm, "ours fp8 delayed, weights cached", &st);
        // The same splits on the device: one grouped launch per pass (family 19), no host sync.
        let splits: Vec<i32> = GROUPED_SPLITS.iter().map(|&m| m as i32).collect();
        let splits = dev.stream().clone_htod(&splits).unwrap();
        let st = b.time_phases(WARMUP, ITERS, 2, |m| {
            let (_, ctx) = experts.forward_device(&x, &splits).unwrap();
            m.mark();
            experts.backward(ctx, &dy).unwrap();
            m.mark();
        });
        record_passes(b, "grouped_linear", &shape, gemm, 0, "ours bf16, device m_splits (grouped kernel)", &st);
    }
    if b.enabled("transformer_layer") {
        const SEQ: usize = 2048;
        const BATCH: usize = 4;
        const HEADS: usize = 32;
        let (x, dy) = (tensor(&[SEQ, BATCH, HIDDEN], 3), tensor(&[SEQ, BATCH, HIDDEN], 4));
        let mut layer = TransformerLayer::new(&dev, TransformerLayerConfig::new(HIDDEN, FFN, HEADS)).unwrap();
        let gemm = (2 * SEQ * BATCH * HIDDEN * (4 * HIDDEN + 2 * FFN)) as u64;
        let attention = (2 * BATCH * SEQ * SEQ * HIDDEN) as u64;
        let shape = format!("s{SEQ} b{BATCH} h{HIDDEN} heads{HEADS} ffn{FFN}");
        time_passes(b, "transformer_layer", &shape, gemm + attention, gemm, None, |recipe, m| {
            let (_, ctx) = autocast(recipe, || layer.forward(&x));
            m.mark();
            layer.backward(ctx, &dy).unwrap();
            m.mark();
        });
    }
}

/// `f()` under `fp8_autocast` with `recipe`, or as is for `None` (BF16).
fn autocast<T>(recipe: Option<Recipe>, f: impl FnOnce() -> te_runtime::Result<T>) -> T {
    match recipe {
        Some(r) => fp8_autocast(true, r, f),
        None => f(),
    }
    .unwrap()
}

/// Times `step(recipe, marks)` (forward, mark, backward, mark) in BF16 and under the three
/// FP8 recipes and records the fwd, bwd and fwd+bwd rows; `flops` and `gemm_flops` (the part that
/// runs in FP8) are the forward's. Records the FP8 speedups over our BF16 fwd+bwd, the delayed
/// one with the target `speedup_target` (at least).
fn time_passes(
    b: &mut Bench,
    work: &str,
    shape: &str,
    flops: u64,
    gemm_flops: u64,
    speedup_target: Option<f64>,
    mut step: impl FnMut(Option<Recipe>, &mut Marks),
) {
    let variants: [(&str, Option<Recipe>); 4] = [
        ("ours bf16", None),
        ("ours fp8 delayed", Some(DelayedScaling::default().into())),
        ("ours fp8 current", Some(Float8CurrentScaling::default().into())),
        ("ours fp8 block", Some(Float8BlockScaling::default().into())),
    ];
    let mut fwd_bwd_us = Vec::new();
    for (variant, recipe) in variants {
        let st = b.time_phases(WARMUP, ITERS, 2, |m| step(recipe, m));
        record_passes(b, work, shape, flops, if recipe.is_some() { gemm_flops } else { 0 }, variant, &st);
        fwd_bwd_us.push(st.total.median_us);
    }
    let target = speedup_target.map(|t| (true, t));
    b.record_ratio(
        &format!("{work} {shape} fwd+bwd: fp8 delayed speedup over our bf16"),
        fwd_bwd_us[0] / fwd_bwd_us[1],
        target,
    );
    b.record_ratio(
        &format!("{work} {shape} fwd+bwd: fp8 current speedup over our bf16"),
        fwd_bwd_us[0] / fwd_bwd_us[2],
        None,
    );
    b.record_ratio(
        &format!("{work} {shape} fwd+bwd: fp8 block speedup over our bf16"),
        fwd_bwd_us[0] / fwd_bwd_us[3],
        None,
    );
}

/// The fwd, bwd and fwd+bwd rows of one variant's timings (`gemm_flops` of the forward in FP8,
/// 0 for BF16).
fn record_passes(b: &mut Bench, work: &str, shape: &str, flops: u64, gemm_flops: u64, variant: &str, st: &PhaseStats) {
    for (pass, stats, times) in [("fwd", st.phases[0], 1), ("bwd", st.phases[1], 2), ("fwd+bwd", st.total, 3)] {
        let w = Work {
            section: "modules",
            work: work.into(),
            pass,
            variant: variant.into(),
            precision: if gemm_flops > 0 { "fp8" } else { "bf16" },
            flops_fp8: times * gemm_flops,
            tokens: None,
        };
        b.record_work(shape, stats, times * flops, None, w);
    }
}

fn layernorm_mlp(b: &mut Bench, x: &Tensor, dy: &Tensor) {
    let dev = b.dev().clone();
    let shape = format!("{TOKENS}x{HIDDEN} ffn{FFN}");
    let gemm = (2 * 2 * TOKENS * HIDDEN * FFN) as u64;
    let mut mlp = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(HIDDEN, FFN)).unwrap();
    time_passes(b, "layernorm_mlp", &shape, gemm, gemm, None, |recipe, m| {
        let (_, ctx) = autocast(recipe, || mlp.forward(x));
        m.mark();
        mlp.backward(ctx, dy).unwrap();
        m.mark();
    });
    let mut recompute = LayerNormMLP::new(
        &dev,
        LayerNormMLPConfig { recompute_activation: true, ..LayerNormMLPConfig::new(HIDDEN, FFN) },
    )
    .unwrap();
    let st = b.time(WARMUP, ITERS, |_| {
        let (_, ctx) = autocast(Some(DelayedScaling::default().into()), || recompute.forward(x));
        recompute.backward(ctx, dy).unwrap();
    });
    let w = Work {
        section: "modules",
        work: "layernorm_mlp".into(),
        pass: "fwd+bwd",
        variant: "ours fp8 delayed recompute_activation".into(),
        precision: "fp8",
        flops_fp8: 3 * gemm,
        tokens: None,
    };
    b.record_work(&shape, st, 3 * gemm, None, w);
    let (_, rc_ctx) = fp8_autocast(true, DelayedScaling::default(), || recompute.forward(x)).unwrap();
    let (_, bf16_ctx) = mlp.forward(x).unwrap();
    let (_, fp8_ctx) = fp8_autocast(true, DelayedScaling::default(), || mlp.forward(x)).unwrap();
    println!(
        "layernorm_mlp saved for backward: bf16 {} MiB, fp8 {} MiB",
        bf16_ctx.saved_bytes() >> 20,
        fp8_ctx.saved_bytes() >> 20
    );
    b.record_ratio(
        "layernorm_mlp bytes saved for backward: fp8 ÷ bf16",
        fp8_ctx.saved_bytes() as f64 / bf16_ctx.saved_bytes() as f64,
        Some((false, 0.6)),
    );
    b.record_ratio(
        "layernorm_mlp bytes saved for backward: fp8 recompute_activation ÷ bf16",
        rc_ctx.saved_bytes() as f64 / bf16_ctx.saved_bytes() as f64,
        Some((false, 0.6)),
    );
}
