//! TE's quickstart in Rust: one `TransformerLayer` (pre-LN GPT block: LayerNorm + fused QKV,
//! causal attention, projection, LayerNorm + GELU MLP) run forward and backward.
//!
//! On a GPU the layer runs under `fp8_autocast` with TE quickstart's recipe
//! (`DelayedScaling(fp8_format=HYBRID, amax_history_len=16, amax_compute_algo="max")`): its GEMMs
//! in FP8, everything else in BF16. Without a GPU the same layer (same sizes, TE's
//! initialization) runs as the CPU reference the GPU tests check it against
//! (`te_reference::transformer::LayerRef`, f32 values, f64 sums). Either way it prints the shapes
//! and checksums of the output and the gradients.
//!
//! `cargo run --release --example quickstart`

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::error::Error;
use te_codegen::spec::{Activation, AmaxComputeAlgo, NormKind};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Format};
use te_nn::modules::{AttnMaskType, TransformerLayer, TransformerLayerConfig};
use te_reference::modules::{DenseRef, NormRef};
use te_reference::transformer::{LayerRef, MhaRef};
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::{DType, Device, Tensor};

/// Sequence length, batch, hidden size, MLP width, heads (every GEMM dimension a multiple of 16,
/// as FP8 GEMMs need).
const S: usize = 64;
const B: usize = 4;
const HIDDEN: usize = 256;
const FFN: usize = 1024;
const HEADS: usize = 4;

/// `n` values of N(0, std²) drawn with `seed` (Box-Muller).
fn randn(seed: u64, n: usize, std: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect()
}

/// `name: shape, sum, L2 norm` of a tensor's values.
fn report(name: &str, shape: &[usize], v: &[f32]) {
    let (sum, sq) = v.iter().fold((0.0f64, 0.0f64), |(s, q), &x| (s + f64::from(x), q + f64::from(x) * f64::from(x)));
    println!("{name:<12} {shape:?}  sum {sum:+.6e}  norm {:.6e}", sq.sqrt());
}

fn main() -> Result<(), Box<dyn Error>> {
    let x = randn(1, S * B * HIDDEN, 1.0);
    let dy = randn(2, S * B * HIDDEN, 1e-2);
    println!("TransformerLayer(hidden {HIDDEN}, ffn {FFN}, heads {HEADS}) on x of [s, b, h] = [{S}, {B}, {HIDDEN}]");
    if te_runtime::device::gpu_available() {
        gpu(&x, &dy)
    } else {
        cpu(&x, &dy);
        Ok(())
    }
}

/// The layer on GPU 0, its GEMMs in FP8.
fn gpu(x: &[f32], dy: &[f32]) -> Result<(), Box<dyn Error>> {
    let dev = Device::new(0)?;
    let config = TransformerLayerConfig { hidden_dropout: 0.0, ..TransformerLayerConfig::new(HIDDEN, FFN, HEADS) };
    let mut layer = TransformerLayer::new(&dev, config)?;
    let shape = [S, B, HIDDEN];
    let (x, dy) = (Tensor::from_f32(&dev, DType::BF16, &shape, x)?, Tensor::from_f32(&dev, DType::BF16, &shape, dy)?);
    let recipe = DelayedScaling {
        fp8_format: Format::Hybrid,
        amax_history_len: 16,
        amax_compute_algo: AmaxComputeAlgo::Max,
        ..DelayedScaling::default()
    };
    let (y, ctx) = fp8_autocast(true, recipe, || layer.forward(&x))?;
    let dx = layer.backward(ctx, &dy)?;
    println!("on {} (FP8 GEMMs, delayed scaling)", dev.name());
    report("y", y.shape(), &y.to_f32(&dev)?);
    report("dx", dx.shape(), &dx.to_f32(&dev)?);
    let grads = [
        ("d qkv.weight", layer.self_attention().qkv_params().weight_grad()),
        ("d fc1.weight", layer.layernorm_mlp().and_then(|m| m.fc1().weight_grad())),
    ];
    for (name, grad) in grads {
        if let Some(g) = grad {
            report(name, g.shape(), &g.to_f32(&dev)?);
        }
    }
    Ok(())
}

/// The same layer on the CPU reference, initialized as TE (and `TransformerLayer::new`) does:
/// weights N(0, 0.023²), biases 0, LayerNorm γ = 1 and β = 0.
fn cpu(x: &[f32], dy: &[f32]) {
    let (h, f, d) = (HIDDEN, FFN, HIDDEN / HEADS);
    let std = 0.023;
    let (ones, zeros) = (vec![1.0; h], Some(vec![0.0; h]));
    let (w_qkv, w_proj) = (randn(10, 3 * h * h, std), randn(11, h * h, std));
    let (w_fc1, w_fc2) = (randn(12, f * h, std), randn(13, h * f, std));
    let (b_qkv, b_fc1, b_h) = (vec![0.0; 3 * h], vec![0.0; f], vec![0.0; h]);
    let norm = || NormRef {
        kind: NormKind::LayerNorm,
        gamma: &ones,
        beta: zeros.as_deref(),
        eps: 1e-5,
        zero_centered_gamma: false,
    };
    let shape =
        AttentionShape::new(QkvLayout::Sbhd, B, (S, S), (HEADS, HEADS), d).with_mask(AttnMaskType::Causal, None);
    let layer = LayerRef {
        mha: MhaRef {
            norm: norm(),
            qkv: DenseRef { w: &w_qkv, b: Some(&b_qkv) },
            proj: DenseRef { w: &w_proj, b: Some(&b_h) },
            shape,
        },
        norm2: norm(),
        fc1: DenseRef { w: &w_fc1, b: Some(&b_fc1) },
        fc2: DenseRef { w: &w_fc2, b: Some(&b_h) },
        activation: Activation::Gelu,
    };
    let y = layer.forward(x);
    let grads = layer.backward(dy, x);
    println!("on the CPU reference (no GPU: f32 values, f64 sums)");
    report("y", &[S, B, h], &y);
    report("dx", &[S, B, h], &grads.dx);
    report("d qkv.weight", &[3 * h, h], &grads.mha.qkv.dw1);
    report("d fc1.weight", &[f, h], &grads.mlp.dw1);
}
