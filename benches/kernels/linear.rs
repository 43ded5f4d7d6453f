//! `Linear` forward + backward (fprop, dgrad, wgrad, bias, casts, scale updates) in FP8 against
//! the same module's BF16 path, at 8192 tokens; and the weight memory of an FP8 inference Linear
//! (`fp8_model_init`) against BF16.

use crate::harness::{random_bytes, Bench};
use te_runtime::fp8::{fp8_autocast, fp8_model_init, DelayedScaling, Float8CurrentScaling, Recipe};
use te_runtime::modules::{Linear, LinearConfig};
use te_runtime::{DType, Tensor};

const TOKENS: usize = 8192;
const SHAPES: [(usize, usize); 2] = [(4096, 16384), (16384, 4096)];

pub fn run(b: &mut Bench) {
    if !b.enabled("linear") {
        return;
    }
    let dev = b.dev().clone();
    for (n_in, n_out) in SHAPES {
        let shape = format!("{TOKENS}x{n_in}→{n_out}");
        let flops = (3 * 2 * TOKENS * n_in * n_out) as u64;
        let x = Tensor::from_bytes(&dev, DType::BF16, &[TOKENS, n_in], &random_bytes(DType::BF16, TOKENS * n_in, 1))
            .unwrap();
        let dy = Tensor::from_bytes(&dev, DType::BF16, &[TOKENS, n_out], &random_bytes(DType::BF16, TOKENS * n_out, 2))
            .unwrap();
        let mut lin = Linear::new(&dev, LinearConfig::new(n_in, n_out)).unwrap();
        let mut step = |recipe: Option<Recipe>| {
            let run = |lin: &mut Linear| {
                let (_, ctx) = lin.forward(&x)?;
                lin.backward(ctx, &dy)
            };
            match recipe {
                Some(r) => fp8_autocast(true, r, || run(&mut lin)).unwrap(),
                None => run(&mut lin).unwrap(),
            };
        };
        let bf16 = b.time(3, 20, |_| step(None));
        b.record_flops("linear fwd+bwd bf16", &shape, bf16, flops);
        let delayed = b.time(3, 20, |_| step(Some(DelayedScaling::default().into())));
        b.record_flops("linear fwd+bwd fp8 delayed scaling", &shape, delayed, flops);
        let current = b.time(3, 20, |_| step(Some(Float8CurrentScaling::default().into())));
        b.record_flops("linear fwd+bwd fp8 current scaling", &shape, current, flops);
        b.record_ratio(
            &format!("linear fwd+bwd {shape}: fp8 delayed speedup over bf16"),
            bf16.median_us / delayed.median_us,
            Some((true, 1.6)),
        );
        b.record_ratio(
            &format!("linear fwd+bwd {shape}: fp8 current speedup over bf16"),
            bf16.median_us / current.median_us,
            None,
        );
    }
    // Inference weights: fp8_model_init keeps only E4M3 codes (no transpose, no BF16 copy).
    let (n_in, n_out) = SHAPES[0];
    let free = || dev.context().mem_get_info().map(|(f, _)| f).unwrap_or(0);
    let before = free();
    let bf16_layer = Linear::new(&dev, LinearConfig::new(n_in, n_out)).unwrap();
    let mid = free();
    let mut fp8_layer = fp8_model_init(true, || Linear::new(&dev, LinearConfig::new(n_in, n_out))).unwrap();
    let x =
        Tensor::from_bytes(&dev, DType::BF16, &[TOKENS, n_in], &random_bytes(DType::BF16, TOKENS * n_in, 3)).unwrap();
    fp8_autocast(true, DelayedScaling::default(), || fp8_layer.infer(&x)).unwrap();
    let ratio = fp8_layer.params().parameter_bytes() as f64 / bf16_layer.params().parameter_bytes() as f64;
    b.record_ratio(&format!("linear {n_in}→{n_out} fp8 inference weight bytes ÷ bf16"), ratio, Some((false, 0.52)));
    println!(
        "device memory: bf16 layer {} MiB, fp8 layer params {} MiB (driver free-memory delta for bf16: {} MiB)",
        bf16_layer.params().parameter_bytes() >> 20,
        fp8_layer.params().parameter_bytes() >> 20,
        before.saturating_sub(mid) >> 20
    );
}
