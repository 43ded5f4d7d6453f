//! `DotProductAttention` forward and forward + backward, bf16.
//!
//! Fused backend (section `attention`, beside `benches/anchors/attention.py`'s
//! `scaled_dot_product_attention` rows): [`FUSED_SHAPES`] in bshd, FLOPs `4 · b · h · sq · sk · d`
//! forward and 3.5× that forward + backward (FlashAttention's convention), the causal half
//! only.
//!
//! Unfused backend, batch 4, seq 2048, 32 heads of 128, causal, in sbhd and bshd (kernel rows):
//! the forward's two GEMMs are `4 · b · h · s² · d`, the backward's four twice that, so `3×` in
//! all; the causal mask is counted as full (the unfused path computes every score, masked or
//! not), so these are TFLOP/s of dense attention work.

use crate::harness::{random_bytes, Bench, Work};
use te_nn::modules::{AttentionBackend, AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use te_runtime::{DType, Tensor};

/// `(batch, seq, heads, kv heads, head_dim, causal)`: the shapes it was tuned on, then the shape
/// classes of modern models (issue 34): head_dim 64 at a long sequence, GQA 8:1 and MQA training
/// shapes, Gemma 3's head_dim 256 with one KV head, and a no-mask encoder shape whose length is
/// no tile multiple. `benches/anchors/attention.py` has the same list.
const FUSED_SHAPES: [(usize, usize, usize, usize, usize, bool); 11] = [
    (4, 2048, 32, 32, 128, true),
    (2, 8192, 32, 32, 128, true),
    (4, 4096, 32, 8, 128, true),
    (1, 16384, 32, 32, 128, true),
    (256, 128, 12, 12, 32, false),
    (8, 1024, 12, 12, 64, true),
    (4, 4096, 32, 32, 64, true),
    (2, 8192, 32, 4, 128, true),
    (4, 4096, 32, 1, 128, true),
    (4, 4096, 8, 1, 256, true),
    (16, 1000, 16, 16, 64, false),
];

/// The filters `attention_fused`, `attention_fp8` and `attention_unfused` pick one part;
/// `attention` runs all three.
pub fn run(b: &mut Bench) {
    if b.enabled("attention_fused") {
        for (batch, seq, heads, groups, d, causal) in FUSED_SHAPES {
            let shape = FusedShape { batch, seq, heads, groups, d, causal };
            fused(b, shape, QkvFormat::Bshd, 0.0, "ours fused");
        }
        // The first shape again in the layer's `sbhd` layout, and with attention dropout 0.1
        // (the keep mask drawn in the kernels): fwd+bwd rows.
        let first = FusedShape { batch: 4, seq: 2048, heads: 32, groups: 32, d: 128, causal: true };
        fused(b, first, QkvFormat::Sbhd, 0.0, "ours fused sbhd");
        fused(b, first, QkvFormat::Bshd, 0.1, "ours fused dropout 0.1");
    }
    // FP8 forward and backward (fp8_dpa) on the first (tuned) shapes of head_dim 128 and at Gemma
    // 3's head_dim 256, Hopper only.
    if b.enabled("attention_fp8") && b.dev().arch() == te_runtime::Arch::Sm90a {
        let d256 = FUSED_SHAPES.into_iter().filter(|s| s.4 == 256);
        for (batch, seq, heads, groups, d, causal) in
            FUSED_SHAPES.into_iter().take(6).filter(|s| s.4 == 128).chain(d256)
        {
            fp8_forward(b, FusedShape { batch, seq, heads, groups, d, causal });
        }
    }
    if b.enabled("attention_unfused") {
        unfused(b);
    }
}

/// One row of [`FUSED_SHAPES`].
#[derive(Clone, Copy)]
struct FusedShape {
    batch: usize,
    seq: usize,
    heads: usize,
    groups: usize,
    d: usize,
    causal: bool,
}

/// The fused backend on `s` in `format` with attention dropout `p`: forward (only for the plain
/// bshd rows) and forward + backward, as `variant`.
fn fused(b: &mut Bench, s: FusedShape, format: QkvFormat, p: f32, variant: &str) {
    let dev = b.dev().clone();
    let FusedShape { batch, seq, heads, groups, d, causal } = s;
    let cfg = DotProductAttentionConfig {
        qkv_format: format,
        attn_mask_type: if causal { AttnMaskType::Causal } else { AttnMaskType::NoMask },
        num_gqa_groups: Some(groups),
        attention_dropout: p,
        backend: AttentionBackend::Fused,
        ..DotProductAttentionConfig::new(heads, d)
    };
    let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
    let bf16 = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, n, seed)).unwrap()
    };
    let q = bf16(&format.shape(batch, seq, heads, d), 1);
    let kv_shape = format.shape(batch, seq, groups, d);
    let (k, v) = (bf16(&kv_shape, 2), bf16(&kv_shape, 3));
    let [x0, x1, _, _] = kv_shape;
    let d_out = bf16(&[x0, x1, heads * d], 4);
    let kv = if groups != heads { format!("/kv{groups}") } else { String::new() };
    let shape = format!("b{batch} s{seq} h{heads}{kv} d{d} {}", if causal { "causal" } else { "no_mask" });
    let full = (4 * batch * heads * seq * seq * d) as u64;
    let fwd_flops = if causal { full / 2 } else { full };
    let work = |pass| Work {
        section: "attention",
        work: "attention".into(),
        pass,
        variant: variant.into(),
        precision: "bf16",
        flops_fp8: 0,
        tokens: None,
    };
    if format == QkvFormat::Bshd && p == 0.0 {
        let st = b.time(3, 10, |_| {
            attn.forward(&q, &k, &v, None).unwrap();
        });
        b.record_work(&shape, st, fwd_flops, None, work("fwd"));
    }
    // A shape the fused backward does not take yet (head_dim 256: issue 34) is said, not timed.
    let trial = attn.forward(&q, &k, &v, None).and_then(|(_, ctx)| attn.backward(ctx, &d_out));
    if let Err(e) = trial {
        println!("attention {shape} fwd+bwd ({variant}): not run: {e}");
        return;
    }
    let st = b.time(2, 10, |_| {
        let (_, ctx) = attn.forward(&q, &k, &v, None).unwrap();
        attn.backward(ctx, &d_out).unwrap();
    });
    b.record_work(&shape, st, fwd_flops * 7 / 2, None, work("fwd+bwd"));
}

/// The FP8 forward (`ops::flash_attention_fp8`) on `s` in bshd: the attention kernel alone (E4M3
/// operands made once) and with the quantization of q, k, v (what a step pays when the QKV GEMM
/// emits 16-bit), as `ours fp8` and `ours fp8 + quantize`. FLOPs as the 16-bit forward's. Then,
/// the FP8 backward (E5M2 dO and dS): its kernels alone (`bwd`, 2.5× the
/// forward's FLOPs) and the whole training step with every cast (`fwd+bwd`, `ours fp8 +
/// quantize`).
fn fp8_forward(b: &mut Bench, s: FusedShape) {
    use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
    use te_runtime::ops::flash_attention::{FlashAttnParams, Qkv};
    use te_runtime::ops::flash_attention_fp8::{self as fp8, Fp8BwdScaleInv, Fp8Grad, Fp8Operand, Fp8Operands};
    use te_runtime::ops::Fp8Meta;
    let dev = b.dev().clone();
    let FusedShape { batch, seq, heads, groups, d, causal } = s;
    let mask = if causal { AttnMaskType::Causal } else { AttnMaskType::NoMask };
    let shape = AttentionShape::new(QkvLayout::Bshd, batch, (seq, seq), (heads, groups), d).with_mask(mask, None);
    let p = FlashAttnParams::dense(shape);
    let bf16 = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, n, seed)).unwrap()
    };
    let q = bf16(&[batch, seq, heads, d], 1);
    let (k, v) = (bf16(&[batch, seq, groups, d], 2), bf16(&[batch, seq, groups, d], 3));
    let mut ops = Fp8Operands::new(&dev, &p).unwrap();
    let mut metas = [(); 3].map(|_| Fp8Meta::new(&dev, 64.0).unwrap());
    let mut out = Tensor::empty(&dev, DType::BF16, &[batch, seq, heads, d]).unwrap();
    let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * seq).unwrap();
    let quantize = |ops: &mut Fp8Operands, metas: &mut [Fp8Meta; 3]| {
        for ((which, x), m) in [(Fp8Operand::Q, &q), (Fp8Operand::K, &k), (Fp8Operand::V, &v)].into_iter().zip(metas) {
            fp8::quantize(&dev, &p, which, (x, 0), &mut m.scaling(), ops).unwrap();
        }
    };
    quantize(&mut ops, &mut metas);
    let kv = if groups != heads { format!("/kv{groups}") } else { String::new() };
    let shape = format!("b{batch} s{seq} h{heads}{kv} d{d} {}", if causal { "causal" } else { "no_mask" });
    let full = (4 * batch * heads * seq * seq * d) as u64;
    let flops = if causal { full / 2 } else { full };
    let work = |variant: &str, pass: &'static str, flops: u64| Work {
        section: "attention",
        work: "attention".into(),
        pass,
        variant: variant.into(),
        precision: "fp8",
        flops_fp8: flops,
        tokens: None,
    };
    let st = b.time(3, 10, |_| {
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap()
    });
    b.record_work(&shape, st, flops, None, work("ours fp8", "fwd", flops));
    // The output as E4M3 codes for an FP8 consumer (TE's fp8_mha): half the output bytes.
    let mut o8 = Tensor::empty(&dev, DType::E4M3, &[batch, seq, heads, d]).unwrap();
    let mut ometa = Fp8Meta::new(&dev, 64.0).unwrap();
    let st = b.time(3, 10, |_| {
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        let o = (&mut o8, DType::BF16);
        fp8::forward_fp8_out(&dev, &p, &ops, si, None, o, &mut ometa.scaling(), &mut lse).unwrap()
    });
    b.record_work(&shape, st, flops, None, work("ours fp8, e4m3 out", "fwd", flops));
    let st = b.time(3, 10, |_| {
        quantize(&mut ops, &mut metas);
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();
    });
    b.record_work(&shape, st, flops, None, work("ours fp8 + quantize", "fwd", flops));

    // Training: the operands with the backward's codes, dO in E5M2.
    let mut ops = Fp8Operands::with_backward(&dev, &p).unwrap();
    let mut g8 = Fp8Grad::new(&dev, &p, DType::E5M2).unwrap();
    let (mut gmeta, mut ds) = (Fp8Meta::new(&dev, 1024.0).unwrap(), Fp8Meta::new(&dev, 1.0).unwrap());
    let d_out = bf16(&[batch, seq, heads, d], 4);
    let grads = |shape: &[usize]| Tensor::empty(&dev, DType::BF16, shape).unwrap();
    let (mut dq, mut dk, mut dv) =
        (grads(&[batch, seq, heads, d]), grads(&[batch, seq, groups, d]), grads(&[batch, seq, groups, d]));
    quantize(&mut ops, &mut metas);
    let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
    fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();
    fp8::quantize_grad(&dev, &p, &d_out, &mut gmeta.scaling(), &mut g8).unwrap();
    let st = b.time(2, 10, |_| {
        let scale_inv = Fp8BwdScaleInv { qkv: si, d_o: &gmeta.scale_inv, o: None };
        let g = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
        fp8::backward(&dev, &p, (&ops, &g8), scale_inv, &mut ds.scaling(), (&out, &d_out), &lse, None, g).unwrap();
    });
    b.record_work(&shape, st, flops * 5 / 2, None, work("ours fp8", "bwd", flops * 5 / 2));
    let st = b.time(2, 10, |_| {
        quantize(&mut ops, &mut metas);
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();
        fp8::quantize_grad(&dev, &p, &d_out, &mut gmeta.scaling(), &mut g8).unwrap();
        let scale_inv = Fp8BwdScaleInv { qkv: si, d_o: &gmeta.scale_inv, o: None };
        let g = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
        fp8::backward(&dev, &p, (&ops, &g8), scale_inv, &mut ds.scaling(), (&out, &d_out), &lse, None, g).unwrap();
    });
    b.record_work(&shape, st, flops * 7 / 2, None, work("ours fp8 + quantize", "fwd+bwd", flops * 7 / 2));
}

/// The bytes each backend's context keeps for the backward on the same call (the fused one keeps
/// `softmax_lse`, the unfused one the probabilities), printed and recorded as a ratio.
fn saved_for_backward(b: &mut Bench, unfused: &DotProductAttentionConfig, [q, k, v]: [&Tensor; 3], label: &str) {
    let dev = b.dev().clone();
    let bytes = |backend| {
        let cfg = DotProductAttentionConfig { backend, ..unfused.clone() };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        attn.forward(q, k, v, None).unwrap().1.saved_bytes()
    };
    let (fused, unfused) = (bytes(AttentionBackend::Fused), bytes(AttentionBackend::Unfused));
    println!("attention saved for backward {label} bf16: fused {} KiB, unfused {} MiB", fused >> 10, unfused >> 20);
    b.record_ratio(
        &format!("attention bytes saved for backward {label}: fused ÷ unfused"),
        fused as f64 / unfused as f64,
        None,
    );
}

fn unfused(b: &mut Bench) {
    let dev = b.dev().clone();
    let (batch, seq, heads, head_dim) = (4usize, 2048usize, 32usize, 128usize);
    let flops = (3 * 4 * batch * heads * seq * seq * head_dim) as u64;
    let label = format!("b{batch} s{seq} h{heads} d{head_dim}");
    for (format, name, p) in
        [(QkvFormat::Sbhd, "sbhd", 0.0), (QkvFormat::Bshd, "bshd", 0.0), (QkvFormat::Sbhd, "sbhd dropout 0.1", 0.1)]
    {
        let cfg = DotProductAttentionConfig {
            qkv_format: format,
            attn_mask_type: AttnMaskType::Causal,
            attention_dropout: p,
            backend: AttentionBackend::Unfused,
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
        if p == 0.0 && format == QkvFormat::Sbhd {
            saved_for_backward(b, attn.config(), [&q, &k, &v], &label);
        }
    }
}
