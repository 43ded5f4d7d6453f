//! `LayerNormMLP` forward + backward (hidden 4096, ffn 16384, 8192 tokens: the shape of TE's
//! benchmarks) in BF16 and FP8 and the bytes it saves for backward, and `TransformerLayer`
//! forward + backward (TE's quickstart layer: hidden 4096, 32 heads, ffn 16384, seq 2048, batch
//! 4, hidden dropout 0.1). `benches/anchors/modules.py` times the same blocks in PyTorch (eager,
//! torch.compile, torchao float8) for the ratios.

use crate::harness::{random_bytes, Bench};
use te_runtime::fp8::{fp8_autocast, DelayedScaling, Float8CurrentScaling, Recipe};
use te_runtime::modules::{LayerNormMLP, LayerNormMLPConfig, TransformerLayer, TransformerLayerConfig};
use te_runtime::{DType, Tensor};

const TOKENS: usize = 8192;
const HIDDEN: usize = 4096;
const FFN: usize = 16384;

pub fn run(b: &mut Bench) {
    if b.enabled("layernorm_mlp") {
        layernorm_mlp(b);
    }
    if b.enabled("transformer_layer") {
        transformer_layer(b);
    }
}

/// Times `step(None)` (BF16) and `step(Some(recipe))` for both recipes; returns the BF16 and
/// delayed-scaling stats.
fn time_recipes(
    b: &mut Bench,
    name: &str,
    shape: &str,
    flops: u64,
    mut step: impl FnMut(Option<Recipe>),
) -> (crate::harness::Stats, crate::harness::Stats) {
    let bf16 = b.time(3, 20, |_| step(None));
    b.record_flops(&format!("{name} fwd+bwd bf16"), shape, bf16, flops);
    let delayed = b.time(3, 20, |_| step(Some(DelayedScaling::default().into())));
    b.record_flops(&format!("{name} fwd+bwd fp8 delayed scaling"), shape, delayed, flops);
    let current = b.time(3, 20, |_| step(Some(Float8CurrentScaling::default().into())));
    b.record_flops(&format!("{name} fwd+bwd fp8 current scaling"), shape, current, flops);
    b.record_ratio(
        &format!("{name} fwd+bwd: fp8 delayed speedup over our bf16"),
        bf16.median_us / delayed.median_us,
        None,
    );
    (bf16, delayed)
}

fn transformer_layer(b: &mut Bench) {
    const SEQ: usize = 2048;
    const BATCH: usize = 4;
    const HEADS: usize = 32;
    let dev = b.dev().clone();
    let shape = format!("s{SEQ} b{BATCH} h{HIDDEN} heads{HEADS} ffn{FFN}");
    // GEMM FLOPs: QKV, proj, fc1, fc2 (×3 for fwd+bwd) and attention's two matmuls (×3, causal
    // counted as full).
    let t = SEQ * BATCH;
    let gemms = 2 * t * HIDDEN * (3 * HIDDEN + HIDDEN + 2 * FFN);
    let attn = 2 * 2 * BATCH * HEADS * SEQ * SEQ * (HIDDEN / HEADS);
    let flops = (3 * (gemms + attn)) as u64;
    let tensor = |seed| {
        let n = SEQ * BATCH * HIDDEN;
        Tensor::from_bytes(&dev, DType::BF16, &[SEQ, BATCH, HIDDEN], &random_bytes(DType::BF16, n, seed)).unwrap()
    };
    let (x, dy) = (tensor(3), tensor(4));
    let mut layer = TransformerLayer::new(&dev, TransformerLayerConfig::new(HIDDEN, FFN, HEADS)).unwrap();
    time_recipes(b, "transformer_layer", &shape, flops, |recipe| {
        let run = |l: &mut TransformerLayer| {
            let (_, ctx) = l.forward(&x)?;
            l.backward(ctx, &dy)
        };
        match recipe {
            Some(r) => fp8_autocast(true, r, || run(&mut layer)).unwrap(),
            None => run(&mut layer).unwrap(),
        };
    });
}

fn layernorm_mlp(b: &mut Bench) {
    let dev = b.dev().clone();
    let shape = format!("{TOKENS}x{HIDDEN}, ffn {FFN}");
    let flops = (3 * 2 * 2 * TOKENS * HIDDEN * FFN) as u64;
    let tensor = |rows, cols, seed| {
        Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, rows * cols, seed)).unwrap()
    };
    let x = tensor(TOKENS, HIDDEN, 1);
    let dy = tensor(TOKENS, HIDDEN, 2);
    let mut mlp = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(HIDDEN, FFN)).unwrap();
    let mut step = |recipe: Option<Recipe>| {
        let run = |m: &mut LayerNormMLP| {
            let (_, ctx) = m.forward(&x)?;
            m.backward(ctx, &dy)
        };
        match recipe {
            Some(r) => fp8_autocast(true, r, || run(&mut mlp)).unwrap(),
            None => run(&mut mlp).unwrap(),
        };
    };
    let bf16 = b.time(3, 20, |_| step(None));
    b.record_flops("layernorm_mlp fwd+bwd bf16", &shape, bf16, flops);
    let delayed = b.time(3, 20, |_| step(Some(DelayedScaling::default().into())));
    b.record_flops("layernorm_mlp fwd+bwd fp8 delayed scaling", &shape, delayed, flops);
    let current = b.time(3, 20, |_| step(Some(Float8CurrentScaling::default().into())));
    b.record_flops("layernorm_mlp fwd+bwd fp8 current scaling", &shape, current, flops);
    b.record_ratio(
        "layernorm_mlp fwd+bwd: fp8 delayed speedup over our bf16",
        bf16.median_us / delayed.median_us,
        None,
    );
    let mut recompute = LayerNormMLP::new(
        &dev,
        LayerNormMLPConfig { recompute_activation: true, ..LayerNormMLPConfig::new(HIDDEN, FFN) },
    )
    .unwrap();
    let st = b.time(3, 20, |_| {
        fp8_autocast(true, DelayedScaling::default(), || {
            let (_, ctx) = recompute.forward(&x)?;
            recompute.backward(ctx, &dy)
        })
        .unwrap();
    });
    b.record_flops("layernorm_mlp fwd+bwd fp8 delayed, recompute_activation", &shape, st, flops);
    let (_, rc_ctx) = fp8_autocast(true, DelayedScaling::default(), || recompute.forward(&x)).unwrap();
    let (_, bf16_ctx) = mlp.forward(&x).unwrap();
    let (_, fp8_ctx) = fp8_autocast(true, DelayedScaling::default(), || mlp.forward(&x)).unwrap();
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
