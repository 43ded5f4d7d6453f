//! The weight memory of an FP8 inference `Linear` (`fp8_model_init`) against BF16. Its timing,
//! forward and backward, is in `modules.rs`.

use crate::harness::{random_bytes, Bench};
use te_nn::fp8::{fp8_autocast, fp8_model_init, DelayedScaling};
use te_nn::modules::{Linear, LinearConfig};
use te_runtime::{DType, Tensor};

const TOKENS: usize = 8192;

pub fn run(b: &mut Bench) {
    if !b.enabled("linear") {
        return;
    }
    let dev = b.dev().clone();
    // Inference weights: fp8_model_init keeps only E4M3 codes (no transpose, no BF16 copy).
    let (n_in, n_out) = (4096, 16384);
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
