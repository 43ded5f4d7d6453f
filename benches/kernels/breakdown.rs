//! Where the time of `TransformerLayer` goes: the layer of `modules.rs` (hidden 4096, 32 heads,
//! ffn 16384, seq 2048, batch 4, hidden dropout 0.1, causal) composed from the public parts it
//! is made of — `LayerNormLinear` (QKV), `DotProductAttention` on the fused QKV output (as the
//! layer runs it: in place on the fused backend), `Linear`
//! (projection), `bias_dropout_add`, `LayerNormMLP` — with a CUDA event after each part, forward
//! and backward, in BF16 and in FP8 (delayed scaling). The parts' sum is the composed layer's
//! step; beside `transformer_layer fwd+bwd` it shows what the layer adds around them.

use crate::harness::{random_bytes, Bench, Marks};
use cudarc::driver::CudaSlice;
use te_nn::fp8::{fp8_autocast, DelayedScaling, Recipe};
use te_nn::modules::{
    AttnMaskType, DotProductAttention, DotProductAttentionConfig, LayerNormLinear, LayerNormLinearConfig, LayerNormMLP,
    LayerNormMLPConfig, Linear, LinearConfig,
};
use te_runtime::ops::dropout::{bias_dropout_add, dropout_backward, mask_bytes, DropoutParams};
use te_runtime::ops::elementwise::add_assign;
use te_runtime::{DType, Device, Tensor};

const SEQ: usize = 2048;
const BATCH: usize = 4;
const HIDDEN: usize = 4096;
const HEADS: usize = 32;
const FFN: usize = 16384;
const DROPOUT: f32 = 0.1;

/// The phases, in the order they are marked.
const PHASES: [&str; 13] = [
    "fwd layernorm + QKV GEMM",
    "fwd attention",
    "fwd projection GEMM",
    "fwd dropout + residual",
    "fwd LayerNormMLP",
    "fwd dropout + residual",
    "fwd FP8 scale update (scope exit)",
    "bwd dropout",
    "bwd LayerNormMLP + residual",
    "bwd dropout",
    "bwd projection GEMMs",
    "bwd attention",
    "bwd layernorm + QKV GEMMs + residual",
];

struct Parts {
    qkv: LayerNormLinear,
    attn: DotProductAttention,
    proj: Linear,
    mlp: LayerNormMLP,
    calls: u64,
}

pub fn run(b: &mut Bench) {
    if !b.enabled("transformer_layer breakdown") {
        return;
    }
    let dev = b.dev().clone();
    let tensor = |seed| {
        let n = SEQ * BATCH * HIDDEN;
        Tensor::from_bytes(&dev, DType::BF16, &[SEQ, BATCH, HIDDEN], &random_bytes(DType::BF16, n, seed)).unwrap()
    };
    let (x, dy) = (tensor(3), tensor(4));
    let attn_cfg = DotProductAttentionConfig {
        attn_mask_type: AttnMaskType::Causal,
        ..DotProductAttentionConfig::new(HEADS, HIDDEN / HEADS)
    };
    let mut p = Parts {
        qkv: LayerNormLinear::new(&dev, LayerNormLinearConfig::new(HIDDEN, 3 * HIDDEN)).unwrap(),
        attn: DotProductAttention::new(&dev, attn_cfg).unwrap(),
        proj: Linear::new(&dev, LinearConfig::new(HIDDEN, HIDDEN)).unwrap(),
        mlp: LayerNormMLP::new(&dev, LayerNormMLPConfig::new(HIDDEN, FFN)).unwrap(),
        calls: 0,
    };
    let shape = format!("s{SEQ} b{BATCH} h{HIDDEN} heads{HEADS} ffn{FFN}");
    let variants: [(&str, Option<Recipe>); 2] =
        [("bf16", None), ("fp8 delayed", Some(DelayedScaling::default().into()))];
    for (variant, recipe) in variants {
        let st = b.time_phases(3, 20, PHASES.len(), |m| step(&dev, &mut p, &x, &dy, recipe, m));
        for (name, stats) in PHASES.iter().zip(st.phases) {
            b.record(&format!("transformer_layer breakdown {variant}: {name}"), &shape, stats, None, None);
        }
        b.record(&format!("transformer_layer breakdown {variant}: sum of the parts"), &shape, st.total, None, None);
    }
}

/// `out = residual + dropout(x)` with a fresh mask.
fn dropout_add(
    dev: &Device,
    p: &mut Parts,
    x: &Tensor,
    residual: &Tensor,
) -> te_runtime::Result<(Tensor, CudaSlice<u8>)> {
    p.calls += 1;
    let params = DropoutParams { p: DROPOUT, seed: 0, offset: p.calls };
    let mut out = Tensor::empty(dev, residual.dtype(), residual.shape())?;
    // SAFETY: u8 has no invalid bit patterns; the kernel writes every mask byte.
    let mut mask = unsafe { dev.stream().alloc::<u8>(mask_bytes(x.numel())) }?;
    bias_dropout_add(dev, x, None, residual, params, &mut out, &mut mask)?;
    Ok((out, mask))
}

fn step(dev: &Device, p: &mut Parts, x: &Tensor, dy: &Tensor, recipe: Option<Recipe>, m: &mut Marks) {
    let forward = |p: &mut Parts, m: &mut Marks| -> te_runtime::Result<_> {
        let (qkv, qkv_ctx) = p.qkv.forward(x)?;
        m.mark();
        let (a, attn_ctx) = p.attn.forward_packed(&qkv.reshape(&[SEQ, BATCH, 3 * HIDDEN])?, None)?;
        m.mark();
        let (a, proj_ctx) = p.proj.forward(&a)?;
        m.mark();
        let (h1, mask1) = dropout_add(dev, p, &a, x)?;
        m.mark();
        let (y, mlp_ctx) = p.mlp.forward(&h1)?;
        m.mark();
        let (_, mask2) = dropout_add(dev, p, &y, &h1)?;
        m.mark();
        Ok((qkv_ctx, attn_ctx, proj_ctx, mask1, mlp_ctx, mask2))
    };
    let (qkv_ctx, attn_ctx, proj_ctx, mask1, mlp_ctx, mask2) = match recipe {
        Some(r) => fp8_autocast(true, r, || forward(p, m)),
        None => forward(p, m),
    }
    .unwrap();
    m.mark();
    let backward = |p: &mut Parts, m: &mut Marks| -> te_runtime::Result<()> {
        let mut d_m = Tensor::empty(dev, dy.dtype(), dy.shape())?;
        dropout_backward(dev, dy, &mask2, DROPOUT, &mut d_m)?;
        m.mark();
        let mut d_h1 = p.mlp.backward(mlp_ctx, &d_m)?;
        add_assign(dev, &mut d_h1, dy)?;
        m.mark();
        let mut d_a = Tensor::empty(dev, d_h1.dtype(), d_h1.shape())?;
        dropout_backward(dev, &d_h1, &mask1, DROPOUT, &mut d_a)?;
        m.mark();
        let d_ctx = p.proj.backward(proj_ctx, &d_a)?;
        m.mark();
        let d_qkv = p.attn.backward_packed(attn_ctx, &d_ctx)?;
        m.mark();
        let d_x = p.qkv.backward(qkv_ctx, &d_qkv)?;
        add_assign(dev, &mut d_h1, &d_x)?;
        m.mark();
        Ok(())
    };
    backward(p, m).unwrap();
}
