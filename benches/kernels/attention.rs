//! `DotProductAttention` forward + backward, unfused (cuBLASLt strided batched GEMMs around the
//! softmax kernels), bf16, batch 4, seq 2048, 32 heads of 128, causal, in sbhd and bshd. FLOPs:
//! the forward's two GEMMs are `4 · b · h · s² · d`, the backward's four twice that, so `3×` in
//! all; the causal mask is counted as full (the unfused path computes every score, masked or
//! not), so these are TFLOP/s of dense attention work.

use crate::harness::{random_bytes, Bench};
use te_runtime::modules::{AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("attention") {
        return;
    }
    let dev = b.dev().clone();
    let (batch, seq, heads, head_dim) = (4usize, 2048usize, 32usize, 128usize);
    let flops = (3 * 4 * batch * heads * seq * seq * head_dim) as u64;
    let label = format!("b{batch} s{seq} h{heads} d{head_dim}");
    for (format, name) in [(QkvFormat::Sbhd, "sbhd"), (QkvFormat::Bshd, "bshd")] {
        let cfg = DotProductAttentionConfig {
            qkv_format: format,
            attn_mask_type: AttnMaskType::Causal,
            ..DotProductAttentionConfig::new(heads, head_dim)
        };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        let shape = format.shape(batch, seq, heads, head_dim);
        let n = shape.iter().product();
        let bf16 = |shape: &[usize], seed| {
            Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, n, seed)).unwrap()
        };
        let (q, k, v) = (bf16(&shape, 1), bf16(&shape, 2), bf16(&shape, 3));
        let d_out = bf16(&[shape[0], shape[1], heads * head_dim], 4);
        let st = b.time(2, 10, |_| {
            let (_, ctx) = attn.forward(&q, &k, &v, None).unwrap();
            attn.backward(ctx, &d_out).unwrap();
        });
        b.record_flops(&format!("attention fwd+bwd causal bf16 {name} (unfused)"), &label, st, flops);
    }
}
