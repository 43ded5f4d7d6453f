//! `LayerNormMLP` forward + backward (hidden 4096, ffn 16384, 8192 tokens: the shape of TE's
//! benchmarks) in BF16 and FP8, and the bytes it saves for backward. `benches/anchors/modules.py`
//! times the same block in PyTorch (eager, torch.compile, torchao float8) for the ratios.

use crate::harness::{random_bytes, Bench};
use te_runtime::fp8::{fp8_autocast, DelayedScaling, Float8CurrentScaling, Recipe};
use te_runtime::modules::{LayerNormMLP, LayerNormMLPConfig};
use te_runtime::{DType, Tensor};

const TOKENS: usize = 8192;
const HIDDEN: usize = 4096;
const FFN: usize = 16384;

pub fn run(b: &mut Bench) {
    if !b.enabled("layernorm_mlp") {
        return;
    }
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
}
