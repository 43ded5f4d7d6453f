//! `head_dim_v` other than `head_dim` (TE's `kv_channels = (head_dim_qk, head_dim_v)`, as
//! FlashAttention-3 and cuDNN run it on Hopper) through `ops::flash_attention`: forward and every
//! gradient against the f64 CPU reference at the tolerances of `attention`, each way round (v
//! narrower and wider than q, k), GQA, both dense formats, lengths that are not tile multiples,
//! past 128 (the backward's channel split across two warpgroups); and the typed errors of what the
//! kernels refuse.

use crate::attention::check;
use crate::common::randn;
use crate::fp8_attention::hopper;
use te_nn::modules::{AttnMaskType, QkvFormat};
use te_reference::attention as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::flash_attention::{self, FlashAttnParams, Qkv};
use te_runtime::{DType, Error, Tensor};

/// A call of `(batch, sq, sk)`, `heads` over `groups`, head dims `(d, dv)`, every tensor dense in
/// `format`, causal (top-left) or no mask.
fn params(
    (batch, sq, sk): (usize, usize, usize),
    (heads, groups): (usize, usize),
    (d, dv): (usize, usize),
    format: QkvFormat,
    causal: bool,
) -> FlashAttnParams {
    let mask = if causal { AttnMaskType::Causal } else { AttnMaskType::NoMask };
    let shape = AttentionShape::new(format.into(), batch, (sq, sk), (heads, groups), d)
        .with_head_dim_v(dv)
        .with_mask(mask, None);
    FlashAttnParams::dense(shape)
}

#[test]
fn forward_and_gradients_match_the_reference_with_a_head_dim_v_of_its_own() {
    let Some(dev) = hopper() else { return };
    let (batch, heads, groups) = (2, 4, 2);
    for (seed, (d, dv), (sq, sk), format, causal, training) in [
        (700, (128, 64), (77, 129), QkvFormat::Bshd, true, true),
        (710, (64, 128), (129, 77), QkvFormat::Sbhd, false, true),
        (720, (64, 128), (200, 200), QkvFormat::Bshd, true, true),
        (730, (128, 256), (100, 130), QkvFormat::Bshd, true, true),
        (740, (256, 128), (130, 100), QkvFormat::Sbhd, false, true),
    ] {
        let p = params((batch, sq, sk), (heads, groups), (d, dv), format, causal);
        let vals = |s, n| -> Vec<f32> { randn(s, n, 1.0).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
        let (hq, hk, hv, hdo) = (
            vals(seed, batch * sq * heads * d),
            vals(seed + 1, batch * sk * groups * d),
            vals(seed + 2, batch * sk * groups * dv),
            vals(seed + 3, batch * sq * heads * dv),
        );
        let up = |v: &[f32], heads: usize, seq: usize, w: usize| {
            Tensor::from_f32(&dev, DType::BF16, &format.shape(batch, seq, heads, w), v).unwrap()
        };
        let (q, k, v) = (up(&hq, heads, sq, d), up(&hk, groups, sk, d), up(&hv, groups, sk, dv));
        let mut out = Tensor::empty(&dev, DType::BF16, &format.shape(batch, sq, heads, dv)).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        flash_attention::forward(&dev, &p, Qkv::Apart([&q, &k, &v]), None, &mut out, &mut lse).unwrap();
        // The reference runs the same problem.
        let case = p.shape;
        let what = format!("d {d} dv {dv} {sq} × {sk} {format:?} causal {causal}");
        let want = reference::forward(&case, None, &hq, &hk, &hv);
        check(&format!("{what}: out"), DType::BF16, &out.to_f32(&dev).unwrap(), &want.out);
        if !training {
            continue;
        }
        let d_out = up(&hdo, heads, sq, dv);
        let mut dq = Tensor::empty(&dev, DType::BF16, q.shape()).unwrap();
        let mut dk = Tensor::empty(&dev, DType::BF16, k.shape()).unwrap();
        let mut dv_t = Tensor::empty(&dev, DType::BF16, v.shape()).unwrap();
        let grads = Qkv::Apart([&mut dq, &mut dk, &mut dv_t]);
        flash_attention::backward(&dev, &p, Qkv::Apart([&q, &k, &v]), &out, &d_out, &lse, None, grads).unwrap();
        let g = reference::backward(&case, None, &hq, &hk, &hv, &hdo);
        check(&format!("{what}: dq"), DType::BF16, &dq.to_f32(&dev).unwrap(), &g.dq);
        check(&format!("{what}: dk"), DType::BF16, &dk.to_f32(&dev).unwrap(), &g.dk);
        check(&format!("{what}: dv"), DType::BF16, &dv_t.to_f32(&dev).unwrap(), &g.dv);
    }
}

#[test]
fn head_dims_the_kernels_refuse_are_typed_errors() {
    let Some(dev) = hopper() else { return };
    let run = |d: usize, dv: usize, training: bool| -> Error {
        let p = params((1, 64, 64), (2, 2), (d, dv), QkvFormat::Bshd, true);
        let t = |w: usize| Tensor::zeros(&dev, DType::BF16, &[1, 64, 2, w]).unwrap();
        let (q, k, v) = (t(d), t(d), t(dv));
        let mut out = t(dv);
        let mut lse = dev.stream().alloc_zeros::<f32>(2 * 64).unwrap();
        if !training {
            return flash_attention::forward(&dev, &p, Qkv::Apart([&q, &k, &v]), None, &mut out, &mut lse).unwrap_err();
        }
        let (mut dq, mut dk, mut dvt) = (t(d), t(d), t(dv));
        let grads = Qkv::Apart([&mut dq, &mut dk, &mut dvt]);
        flash_attention::backward(&dev, &p, Qkv::Apart([&q, &k, &v]), &out, &out, &lse, None, grads).unwrap_err()
    };
    // v's head dim not a multiple of 64; the backward past 128 with a head dim whose half is no
    // whole 64-channel block; q, k at a head dim of no wgmma kernel.
    for (d, dv, training, says) in
        [(128, 96, false, "head_dim_v = 96"), (64, 256, true, "halves"), (96, 128, false, "head_dim_v = 128")]
    {
        let e = run(d, dv, training);
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(says), "d {d} dv {dv}: {e}");
    }
    // A v or an output narrower than head_dim_v says which.
    let p = params((1, 64, 64), (2, 2), (128, 64), QkvFormat::Bshd, true);
    let t = |w: usize| Tensor::zeros(&dev, DType::BF16, &[1, 64, 2, w]).unwrap();
    let mut lse = dev.stream().alloc_zeros::<f32>(2 * 64).unwrap();
    let e = flash_attention::forward(&dev, &p, Qkv::Apart([&t(128), &t(128), &t(32)]), None, &mut t(64), &mut lse)
        .unwrap_err();
    assert!(e.to_string().contains("`v`"), "{e}");
    let e = flash_attention::forward(&dev, &p, Qkv::Apart([&t(128), &t(128), &t(64)]), None, &mut t(32), &mut lse)
        .unwrap_err();
    assert!(e.to_string().contains("`out`"), "{e}");
}

/// `DotProductAttention` with `head_dim_v` (TE's `kv_channels = (192, 128)`-style config): both
/// backends give the reference's output and gradients, the fused one where it runs the call;
/// the fused QKV tensor, which holds one head dim, is refused with a typed error.
#[test]
fn dot_product_attention_runs_a_head_dim_v_of_its_own_on_both_backends() {
    use te_nn::modules::{AttentionBackend, DotProductAttention, DotProductAttentionConfig};
    let Some(dev) = hopper() else { return };
    let (batch, sq, sk, heads, groups, d, dv) = (2, 77, 130, 8, 2, 128, 64);
    let vals = |s, n| -> Vec<f32> { randn(s, n, 1.0).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
    let (hq, hk, hv, hdo) = (
        vals(800, batch * sq * heads * d),
        vals(801, batch * sk * groups * d),
        vals(802, batch * sk * groups * dv),
        vals(803, batch * sq * heads * dv),
    );
    let case = AttentionShape::new(QkvFormat::Bshd.into(), batch, (sq, sk), (heads, groups), d)
        .with_head_dim_v(dv)
        .with_mask(AttnMaskType::CausalBottomRight, None);
    let want = reference::forward(&case, None, &hq, &hk, &hv);
    let grads = reference::backward(&case, None, &hq, &hk, &hv, &hdo);
    let up = |v: &[f32], s: &[usize]| Tensor::from_f32(&dev, DType::BF16, s, v).unwrap();
    let q = up(&hq, &[batch, sq, heads, d]);
    let (k, v) = (up(&hk, &[batch, sk, groups, d]), up(&hv, &[batch, sk, groups, dv]));
    for backend in [AttentionBackend::Fused, AttentionBackend::Unfused] {
        let cfg = DotProductAttentionConfig {
            head_dim_v: Some(dv),
            num_gqa_groups: Some(groups),
            qkv_format: QkvFormat::Bshd,
            attn_mask_type: AttnMaskType::CausalBottomRight,
            backend,
            ..DotProductAttentionConfig::new(heads, d)
        };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        let (out, ctx) = attn.forward(&q, &k, &v, None).unwrap();
        assert_eq!((out.shape(), ctx.backend()), (&[batch, sq, heads * dv][..], backend));
        // Kept for the backward: the f32 softmax_lse (fused) or the bf16 probabilities (unfused).
        let saved = match backend {
            AttentionBackend::Fused => batch * heads * sq * 4,
            _ => batch * heads * sq * sk * 2,
        };
        assert_eq!(ctx.saved_bytes(), saved, "{backend:?}");
        let (dq, dk, dvt) = attn.backward(ctx, &up(&hdo, &[batch, sq, heads * dv])).unwrap();
        assert_eq!((dq.shape(), dk.shape(), dvt.shape()), (q.shape(), k.shape(), v.shape()));
        let what = format!("{backend:?}");
        check(&format!("{what}: out"), DType::BF16, &out.to_f32(&dev).unwrap(), &want.out);
        check(&format!("{what}: dq"), DType::BF16, &dq.to_f32(&dev).unwrap(), &grads.dq);
        check(&format!("{what}: dk"), DType::BF16, &dk.to_f32(&dev).unwrap(), &grads.dk);
        check(&format!("{what}: dv"), DType::BF16, &dvt.to_f32(&dev).unwrap(), &grads.dv);
        // A v of k's head dim is refused with the shape wanted.
        let e = attn.forward(&q, &k, &k, None).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("head_dim_v = 64"), "{e}");
        let qkv = Tensor::zeros(&dev, DType::BF16, &[batch, sq, (heads + 2 * groups) * d]).unwrap();
        let e = attn.forward_packed(&qkv, None).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("one head dim"), "{e}");
    }
}
