//! The fused attention backend (FlashAttention-2 kernels, `ops::flash_attention`) on its own,
//! against the f64 CPU reference at the tolerances of `attention`: head dims 32 to 256 (256 in
//! training on Hopper), lengths that are not tile multiples (1, 3, 77, 129, 1000) with `sq != sk`,
//! GQA 32/8 (its query heads split over blocks, their partial dK/dV summed), zero-length sequences, `sk` beyond the unfused backend's limit, a bitwise-deterministic
//! backward, sliding windows and bottom-right diagonals through the ops layer (against a host
//! f64 forward written here, `softmax_lse` included), and typed errors.

use crate::attention::{check, check_case, check_padded_zeros, Case, Inputs};
use crate::common::{device, randn};
use te_nn::modules::{
    AttentionBackend, AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat, ThdSeqlens,
};
use te_reference::attention as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::flash_attention::{self, FlashAttnParams, HeadStrides, Qkv};
use te_runtime::{DType, Error, Tensor};

fn fused(c: Case) -> Case {
    Case { backend: AttentionBackend::Fused, ..c }
}

#[test]
fn head_dims_and_odd_lengths_match_reference() {
    let Some(dev) = device() else { return };
    use AttnMaskType::{Causal, NoMask};
    use QkvFormat::{Bshd, Sbhd};
    for (d, lens, mask, format, dtype, seed) in [
        // One query (with one key every gradient but dv is exactly zero: a degenerate case).
        (32, (1, 3), NoMask, Bshd, DType::BF16, 200),
        (32, (129, 77), NoMask, Sbhd, DType::BF16, 201),
        (64, (77, 129), Causal, Bshd, DType::F16, 202),
        (96, (129, 129), Causal, Sbhd, DType::BF16, 203),
        (96, (65, 200), NoMask, Bshd, DType::F16, 204),
        (128, (200, 65), Causal, Bshd, DType::BF16, 205),
    ] {
        let c = Case { dtype, ..fused(Case::new(format, mask, lens, 2, d)) };
        check_case(&dev, &c, seed);
    }
    // A long causal sequence, many key tiles: one sequence, two heads.
    let c = Case { batch: 1, heads: 2, groups: 1, ..fused(Case::new(Bshd, Causal, (1000, 1000), 1, 128)) };
    check_case(&dev, &c, 206);
}

#[test]
fn gqa_32_of_8_and_zero_length_sequences() {
    let Some(dev) = device() else { return };
    let c = Case { batch: 1, heads: 32, ..fused(Case::new(QkvFormat::Sbhd, AttnMaskType::Causal, (129, 129), 8, 64)) };
    check_case(&dev, &c, 210);
    for (lens, seed) in [(vec![0, 77], 211), (vec![77, 0], 212), (vec![1, 33], 213)] {
        let c = Case {
            seq_lens: Some(lens),
            ..fused(Case::new(QkvFormat::Bshd, AttnMaskType::PaddingCausal, (77, 77), 2, 64))
        };
        let (got, _) = check_case(&dev, &c, seed);
        check_padded_zeros(&c, &got);
        let c = Case { mask: AttnMaskType::Padding, ..c };
        let (got, _) = check_case(&dev, &c, seed + 10);
        check_padded_zeros(&c, &got);
    }
}

#[test]
fn keys_beyond_the_unfused_limit_run_fused() {
    let Some(dev) = device() else { return };
    let c = Case { batch: 1, heads: 2, ..fused(Case::new(QkvFormat::Bshd, AttnMaskType::NoMask, (16, 20000), 1, 64)) };
    check_case(&dev, &c, 220);
    let unfused = Case { backend: AttentionBackend::Unfused, ..c.clone() };
    let mut attn = DotProductAttention::new(&dev, unfused.config()).unwrap();
    let q = Tensor::zeros(&dev, DType::BF16, &[1, 16, 2, 64]).unwrap();
    let kv = Tensor::zeros(&dev, DType::BF16, &[1, 20000, 1, 64]).unwrap();
    let e = attn.forward(&q, &kv, &kv, None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("fused backend"), "{e}");
}

/// Head dim 256 (Gemma's) trains on the fused kernels (Hopper: two warpgroups split the channels of
/// each gradient): MQA, GQA and MHA, odd lengths, both dtypes and dense formats, a padding mask and
/// a sliding window, against the reference; attention dropout against the unfused backend's mask;
/// `Auto` picks the fused backend in training.
#[test]
fn head_dim_256_trains_fused() {
    let Some(dev) = crate::fp8_attention::hopper() else { return };
    use AttnMaskType::{Causal, NoMask, PaddingCausal};
    use QkvFormat::{Bshd, Sbhd};
    for (lens, mask, format, groups, dtype, window, seed) in [
        ((130, 130), Causal, Bshd, 1, DType::BF16, None, 230),
        ((77, 200), NoMask, Sbhd, 8, DType::F16, None, 231),
        ((129, 129), PaddingCausal, Bshd, 2, DType::BF16, None, 232),
        ((150, 150), Causal, Bshd, 1, DType::BF16, Some((40, 0)), 233),
    ] {
        let c = Case { dtype, window, ..fused(Case::new(format, mask, lens, groups, 256)) };
        check_case(&dev, &c, seed);
    }
    // Attention dropout: the fused kernels (the keep mask drawn per split column) replay the
    // unfused backend's mask in the output and every gradient.
    let c = Case::new(Bshd, Causal, (80, 80), 2, 256);
    let x = Inputs::new(&c, 235);
    let mut results = Vec::new();
    for backend in [AttentionBackend::Fused, AttentionBackend::Unfused] {
        let c = Case { backend, ..c.clone() };
        let cfg = DotProductAttentionConfig { attention_dropout: 0.2, ..c.config() };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        attn.set_dropout_rng(1234, 43);
        results.push(crate::attention::run(&dev, &mut attn, &c, &x));
    }
    for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
        check(&format!("d256 dropout 0.2, fused vs unfused: {name}"), DType::BF16, &results[0][i], &results[1][i]);
    }
    let c = Case { batch: 1, heads: 2, ..Case::new(QkvFormat::Bshd, AttnMaskType::Causal, (130, 130), 1, 256) };
    let x = Inputs::new(&c, 234);
    let shape = c.format.shape(c.batch, c.sq, c.heads, c.head_dim);
    let kv_shape = c.format.shape(c.batch, c.sk, c.groups, c.head_dim);
    let up = |v: &[f32], s: &[usize]| Tensor::from_f32(&dev, c.dtype, s, v).unwrap();
    let (q, k, v) = (up(&x.q, &shape), up(&x.k, &kv_shape), up(&x.v, &kv_shape));
    let mut attn = DotProductAttention::new(&dev, c.config()).unwrap();
    let (_, ctx) = attn.forward(&q, &k, &v, None).unwrap();
    assert_eq!(ctx.backend(), AttentionBackend::Fused);
}

#[test]
fn backward_is_bitwise_deterministic() {
    let Some(dev) = device() else { return };
    let c = fused(Case::new(QkvFormat::Bshd, AttnMaskType::Causal, (300, 300), 2, 128));
    let x = Inputs::new(&c, 240);
    let shape = c.format.shape(c.batch, c.sq, c.heads, c.head_dim);
    let kv_shape = c.format.shape(c.batch, c.sk, c.groups, c.head_dim);
    let up = |v: &[f32], s: &[usize]| Tensor::from_f32(&dev, c.dtype, s, v).unwrap();
    let (q, k, v) = (up(&x.q, &shape), up(&x.k, &kv_shape), up(&x.v, &kv_shape));
    let d_out = up(&x.d_out, &[c.batch, c.sq, c.heads * c.head_dim]);
    let mut attn = DotProductAttention::new(&dev, c.config()).unwrap();
    let mut once = || {
        let (out, ctx) = attn.forward(&q, &k, &v, None).unwrap();
        let (dq, dk, dv) = attn.backward(ctx, &d_out).unwrap();
        [out, dq, dk, dv].map(|t| t.to_bytes(&dev).unwrap())
    };
    let (a, b) = (once(), once());
    for (i, (a, b)) in a.iter().zip(&b).enumerate() {
        assert!(a == b, "tensor {i} (out, dq, dk, dv) differs between two identical runs");
    }
}

/// `softmax_lse` against the host's: `+inf` exactly where a row sees no key, else within 2e-3
/// (relative, absolute below 1).
pub(crate) fn check_lse(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lse length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= 2e-3 * w.abs().max(1.0) };
        assert!(ok, "{what}: lse[{i}] = {g}, want {w}");
    }
}

/// Host f64 forward of one dense bshd call with a window: `(out [b, sq, h, d], lse [b, h, sq])`.
pub(crate) fn host_window_forward(p: &FlashAttnParams, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let p = &p.shape;
    let (d, hpg) = (p.head_dim, p.heads / p.groups);
    let (lq, lk) = (p.sq as i64, p.sk as i64);
    let off = if p.bottom_right() { lk - lq } else { 0 };
    let (left, right) = p.window;
    let mut out = vec![0f32; p.batch * p.sq * p.heads * d];
    let mut lse = vec![f32::INFINITY; p.batch * p.heads * p.sq];
    for b in 0..p.batch {
        for h in 0..p.heads {
            for i in 0..p.sq {
                let qi = &q[((b * p.sq + i) * p.heads + h) * d..][..d];
                let keys: Vec<usize> = (0..p.sk)
                    .filter(|&j| {
                        let (i, j) = (i as i64, j as i64);
                        (left < 0 || j >= i + off - left) && (right < 0 || j <= i + off + right)
                    })
                    .collect();
                if keys.is_empty() {
                    continue;
                }
                let kv_at = |j: usize| ((b * p.sk + j) * p.groups + h / hpg) * d;
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| p.scale as f64 * (0..d).map(|x| qi[x] as f64 * k[kv_at(j) + x] as f64).sum::<f64>())
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = s.iter().map(|&x| (x - m).exp()).sum();
                lse[(b * p.heads + h) * p.sq + i] = (m + sum.ln()) as f32;
                for x in 0..d {
                    let o: f64 =
                        keys.iter().zip(&s).map(|(&j, &sj)| (sj - m).exp() / sum * v[kv_at(j) + x] as f64).sum();
                    out[((b * p.sq + i) * p.heads + h) * d + x] = o as f32;
                }
            }
        }
    }
    (out, lse)
}

#[test]
fn sliding_windows_and_bottom_right_diagonals_match_a_host_forward() {
    let Some(dev) = device() else { return };
    let (batch, heads, groups, d) = (2, 4, 2, 64);
    // TE's masks and windows: bottom-right causal with and without a window (sq < sk, sq > sk),
    // and two-sided windows without a causal mask (bottom-right aligned, TE's default), one
    // reaching past the last key.
    for ((sq, sk), mask, window, seed) in [
        ((100, 150), AttnMaskType::CausalBottomRight, Some((16, 0)), 250),
        ((150, 100), AttnMaskType::CausalBottomRight, None, 251),
        ((130, 130), AttnMaskType::NoMask, Some((8, 8)), 252),
        ((77, 200), AttnMaskType::NoMask, Some((150, 40)), 253),
    ] {
        let shape = AttentionShape::new(QkvLayout::Bshd, batch, (sq, sk), (heads, groups), d)
            .with_mask(mask, window)
            .with_scale(0.125);
        let p = FlashAttnParams::dense(shape);
        let vals = |s, n| -> Vec<f32> { randn(s, n, 1.0).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
        let (hq, hk, hv) = (
            vals(seed, batch * sq * heads * d),
            vals(seed + 1, batch * sk * groups * d),
            vals(seed + 2, batch * sk * groups * d),
        );
        let up = |v: &[f32], s: &[usize]| Tensor::from_f32(&dev, DType::BF16, s, v).unwrap();
        let q = up(&hq, &[batch, sq, heads, d]);
        let (k, v) = (up(&hk, &[batch, sk, groups, d]), up(&hv, &[batch, sk, groups, d]));
        let mut out = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        flash_attention::forward(&dev, &p, Qkv::Apart([&q, &k, &v]), None, &mut out, &mut lse).unwrap();
        let (want_out, want_lse) = host_window_forward(&p, &hq, &hk, &hv);
        let what = format!("sq {sq} sk {sk} {} window {:?}", mask.name(), shape.window);
        check(&format!("{what}: out"), DType::BF16, &out.to_f32(&dev).unwrap(), &want_out);
        check_lse(&what, &dev.stream().clone_dtoh(&lse).unwrap(), &want_lse);
    }
}

#[test]
fn ops_errors_are_typed() {
    let Some(dev) = device() else { return };
    let (b, s, h, d) = (1, 32, 2, 64);
    let shape = AttentionShape::new(QkvLayout::Bshd, b, (s, s), (h, h), d)
        .with_mask(AttnMaskType::Causal, None)
        .with_scale(0.125);
    let base = FlashAttnParams::dense(shape);
    let dense = base.q;
    let t = |dtype| Tensor::zeros(&dev, dtype, &[b, s, h, d]).unwrap();
    let (q, f32t) = (t(DType::BF16), t(DType::F32));
    let mut out = t(DType::BF16);
    let mut lse = dev.stream().alloc_zeros::<f32>(b * h * s).unwrap();
    let mut run = |p: FlashAttnParams, q: &Tensor| {
        flash_attention::forward(&dev, &p, Qkv::Apart([q, q, q]), None, &mut out, &mut lse)
    };
    assert!(matches!(run(base, &f32t).unwrap_err(), Error::DType { arg: "q", .. }));
    let e = run(FlashAttnParams { shape: AttentionShape { head_dim: 80, head_dim_v: 80, ..shape }, ..base }, &q)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("head_dim = 80"), "{e}");
    let e = run(FlashAttnParams { q: HeadStrides { row: 132, ..dense }, ..base }, &q).unwrap_err();
    assert!(e.to_string().contains("multiples of 8"), "{e}");
    let e = run(FlashAttnParams { shape: AttentionShape { sq: 64, ..shape }, ..base }, &q).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("reach"), "{e}");
    let e = run(FlashAttnParams { shape: AttentionShape { window: (-2, 0), ..shape }, ..base }, &q).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }), "{e}");
    // A causal mask whose window sees past the diagonal: the shape's TE rule refuses it.
    let e = run(FlashAttnParams { shape: AttentionShape { window: (-1, -1), ..shape }, ..base }, &q).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("resolves window"), "{e}");
    let e = run(FlashAttnParams { shape: AttentionShape { groups: 3, ..shape }, ..base }, &q).unwrap_err();
    assert!(e.to_string().contains("groups dividing heads"), "{e}");
    // A padding mask without cu_seqlens.
    let padded = shape.with_mask(AttnMaskType::PaddingCausal, None);
    let e = run(FlashAttnParams { shape: padded, ..base }, &q).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("needs cu_seqlens"), "{e}");
    run(base, &q).unwrap();
    let mut short = dev.stream().alloc_zeros::<f32>(3).unwrap();
    let e = flash_attention::forward(&dev, &base, Qkv::Apart([&q, &q, &q]), None, &mut out, &mut short).unwrap_err();
    assert!(e.to_string().contains("`lse`"), "{e}");
    // Packed: offsets must be 16-byte aligned and the strides must stay inside from them.
    let mut lse = dev.stream().alloc_zeros::<f32>(b * h * s).unwrap();
    let e = flash_attention::forward(&dev, &base, Qkv::Packed(&q, [0, 4, 8]), None, &mut out, &mut lse).unwrap_err();
    assert!(e.to_string().contains("`k` starts at element 4"), "{e}");
    let e = flash_attention::forward(&dev, &base, Qkv::Packed(&q, [0, 0, 64]), None, &mut out, &mut lse).unwrap_err();
    assert!(e.to_string().contains("from offset 64"), "{e}");
    let forced =
        DotProductAttentionConfig { backend: AttentionBackend::Fused, ..DotProductAttentionConfig::new(2, 80) };
    let mut attn = DotProductAttention::new(&dev, forced).unwrap();
    let q80 = Tensor::zeros(&dev, DType::BF16, &[s, b, h, 80]).unwrap();
    let e = attn.forward(&q80, &q80, &q80, None).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("head_dim = 80"), "{e}");
}

/// `forward_packed` / `backward_packed` on the fused QKV tensor give the same bits as `forward`
/// / `backward` on q, k, v copied apart (fused: the kernels read and write the heads in place;
/// unfused: it splits and concatenates), for both formats, GQA and a padding mask.
#[test]
fn packed_qkv_matches_qkv_apart_bitwise() {
    let Some(dev) = device() else { return };
    let (s, b, h, g, d) = (77, 3, 8, 2, 64);
    let w = (h + 2 * g) * d;
    for (format, mask) in [(QkvFormat::Sbhd, AttnMaskType::Causal), (QkvFormat::Bshd, AttnMaskType::PaddingCausal)] {
        for backend in [AttentionBackend::Fused, AttentionBackend::Unfused] {
            let cfg = DotProductAttentionConfig {
                backend,
                num_gqa_groups: Some(g),
                qkv_format: format,
                attn_mask_type: mask,
                ..DotProductAttentionConfig::new(h, d)
            };
            let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
            let lens = [77, 40, 1];
            let seq_lens = mask.is_padding().then_some(&lens[..]);
            let [x0, x1, _, _] = format.shape(b, s, 1, 1);
            let vals =
                |seed, n| -> Vec<f32> { randn(seed, n, 1.0).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
            let (hqkv, hdo) = (vals(300, x0 * x1 * w), vals(301, x0 * x1 * h * d));
            let qkv = Tensor::from_f32(&dev, DType::BF16, &[x0, x1, w], &hqkv).unwrap();
            let d_out = Tensor::from_f32(&dev, DType::BF16, &[x0, x1, h * d], &hdo).unwrap();
            // Apart on the host: columns [0, h·d), [h·d, (h+g)·d), [(h+g)·d, w) of each row.
            let cols = |from: usize, n: usize| -> Vec<f32> {
                hqkv.chunks(w).flat_map(|row| row[from * d..(from + n) * d].to_vec()).collect()
            };
            let up = |v: &[f32], heads: usize| Tensor::from_f32(&dev, DType::BF16, &[x0, x1, heads, d], v).unwrap();
            let (q, k, v) = (up(&cols(0, h), h), up(&cols(h, g), g), up(&cols(h + g, g), g));
            let (out_a, ctx) = attn.forward(&q, &k, &v, seq_lens).unwrap();
            assert_eq!(ctx.backend(), backend);
            let (dq, dk, dv) = attn.backward(ctx, &d_out).unwrap();
            let (out_p, ctx) = attn.forward_packed(&qkv, seq_lens).unwrap();
            let what = format!("{format:?} {} {}", mask.name(), backend.name());
            assert_eq!(out_p.to_bytes(&dev).unwrap(), out_a.to_bytes(&dev).unwrap(), "{what}: out");
            let d_qkv = attn.backward_packed(ctx, &d_out).unwrap();
            assert_eq!(d_qkv.shape(), &[x0, x1, w], "{what}");
            let got = d_qkv.to_f32(&dev).unwrap();
            let (dq, dk, dv) = (dq.to_f32(&dev).unwrap(), dk.to_f32(&dev).unwrap(), dv.to_f32(&dev).unwrap());
            for (r, row) in got.chunks(w).enumerate() {
                assert_eq!(&row[..h * d], &dq[r * h * d..][..h * d], "{what}: dq row {r}");
                assert_eq!(&row[h * d..(h + g) * d], &dk[r * g * d..][..g * d], "{what}: dk row {r}");
                assert_eq!(&row[(h + g) * d..], &dv[r * g * d..][..g * d], "{what}: dv row {r}");
            }
            // The gradients of a packed forward also come apart, and the wrong pairing is refused.
            let (_, ctx) = attn.forward_packed(&qkv, seq_lens).unwrap();
            let (dq2, _, _) = attn.backward(ctx, &d_out).unwrap();
            assert_eq!(dq2.to_f32(&dev).unwrap(), dq, "{what}: dq of a packed context through backward");
            let (_, ctx) = attn.forward(&q, &k, &v, seq_lens).unwrap();
            let e = attn.backward_packed(ctx, &d_out).unwrap_err();
            assert!(matches!(e, Error::Context { .. }) && e.to_string().contains("backward"), "{e}");
            let bad = Tensor::zeros(&dev, DType::BF16, &[x0, x1, w - d]).unwrap();
            let e = attn.forward_packed(&bad, seq_lens).unwrap_err();
            assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("(8 + 2 · 2) · 64 = 768"), "{e}");
        }
    }
}

/// `thd`: sequences of different lengths (0, 1, not tile multiples, sq ≠ sk) packed one after
/// another, without and with padding between them, against the reference run per sequence;
/// tokens no sequence owns get zero outputs and gradients.
#[test]
fn thd_matches_the_reference_per_sequence() {
    let Some(dev) = device() else { return };
    let (h, g, d) = (4, 2, 64);
    let lens_q = [77usize, 0, 1, 130, 33];
    let lens_kv = [77usize, 5, 1, 130, 60];
    let prefix = |lens: &[usize], pad: usize| -> Vec<usize> {
        let mut v = vec![0];
        for &l in lens {
            v.push(v.last().unwrap() + l + pad);
        }
        v
    };
    for (mask, window, pad) in [
        (AttnMaskType::Causal, None, 0),
        (AttnMaskType::PaddingCausalBottomRight, Some((40, 0)), 5),
        (AttnMaskType::NoMask, None, 3),
    ] {
        let (cu_q, cu_kv) = (prefix(&lens_q, 0), prefix(&lens_kv, 0));
        let (off_q, off_kv) = (prefix(&lens_q, pad), prefix(&lens_kv, pad));
        let seqs = ThdSeqlens {
            cu_seqlens_q_padded: (pad > 0).then_some(&off_q[..]),
            cu_seqlens_kv_padded: (pad > 0).then_some(&off_kv[..]),
            ..ThdSeqlens::new(&cu_q, &cu_kv)
        };
        let (tq, tk) = (*off_q.last().unwrap(), *off_kv.last().unwrap());
        let vals =
            |seed, n| -> Vec<f32> { randn(seed, n, 1.0).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
        let (hq, hk, hv, hdo) =
            (vals(400, tq * h * d), vals(401, tk * g * d), vals(402, tk * g * d), vals(403, tq * h * d));
        let up = |v: &[f32], s: &[usize]| Tensor::from_f32(&dev, DType::BF16, s, v).unwrap();
        let cfg = DotProductAttentionConfig {
            num_gqa_groups: Some(g),
            attn_mask_type: mask,
            window_size: window,
            ..DotProductAttentionConfig::new(h, d)
        };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        let (q, k, v) = (up(&hq, &[tq, h, d]), up(&hk, &[tk, g, d]), up(&hv, &[tk, g, d]));
        let (out, ctx) = attn.forward_thd(&q, &k, &v, seqs).unwrap();
        assert_eq!((out.shape(), ctx.backend()), (&[tq, h * d][..], AttentionBackend::Fused));
        let (dq, dk, dv) = attn.backward(ctx, &up(&hdo, &[tq, h * d])).unwrap();
        assert_eq!((dq.shape(), dk.shape(), dv.shape()), (&[tq, h, d][..], &[tk, g, d][..], &[tk, g, d][..]));
        let [out, dq, dk, dv] = [out, dq, dk, dv].map(|t| t.to_f32(&dev).unwrap());
        let (rq, rk) = (h * d, g * d);
        let mut owned_q = vec![false; tq];
        let mut owned_kv = vec![false; tk];
        for b in 0..lens_q.len() {
            let (lq, lk, sq0, sk0) = (lens_q[b], lens_kv[b], off_q[b], off_kv[b]);
            owned_q[sq0..sq0 + lq].fill(true);
            owned_kv[sk0..sk0 + lk].fill(true);
            if lq == 0 {
                continue;
            }
            // One sequence of the batch: no padding left, the diagonal placed by its own lengths.
            let one = if mask.is_padding() { AttnMaskType::CausalBottomRight } else { mask };
            let case = AttentionShape::new(QkvLayout::Bshd, 1, (lq, lk.max(1)), (h, g), d).with_mask(one, window);
            let what = format!("{} {window:?} pad {pad} sequence {b} ({lq} × {lk})", mask.name());
            let sl = |x: &[f32], start: usize, n: usize, row: usize| x[start * row..(start + n) * row].to_vec();
            if lk == 0 {
                assert!(sl(&out, sq0, lq, rq).iter().all(|&x| x == 0.0), "{what}: out without keys");
                continue;
            }
            let (q_b, k_b, v_b, do_b) =
                (sl(&hq, sq0, lq, rq), sl(&hk, sk0, lk, rk), sl(&hv, sk0, lk, rk), sl(&hdo, sq0, lq, rq));
            let f = reference::forward(&case, None, &q_b, &k_b, &v_b);
            let gr = reference::backward(&case, None, &q_b, &k_b, &v_b, &do_b);
            // With one visible key per query, dq and dk are 0 in exact arithmetic (dS = P · (dP −
            // rowsum(dP ⊙ P)) = 0): only rounding is left, so bound it absolutely there.
            let compare = |name: &str, got: &[f32], want: &[f32]| {
                if want.iter().all(|w| w.abs() < 1e-6) {
                    let amax = got.iter().fold(0f32, |a, g| a.max(g.abs()));
                    assert!(amax < 0.1, "{what}: {name} should be rounding noise around 0, max |got| {amax}");
                } else {
                    check(&format!("{what}: {name}"), DType::BF16, got, want);
                }
            };
            compare("out", &sl(&out, sq0, lq, rq), &f.out);
            compare("dq", &sl(&dq, sq0, lq, rq), &gr.dq);
            compare("dk", &sl(&dk, sk0, lk, rk), &gr.dk);
            compare("dv", &sl(&dv, sk0, lk, rk), &gr.dv);
        }
        for (t, _) in owned_q.iter().enumerate().filter(|(_, &o)| !o) {
            assert!(out[t * rq..][..rq].iter().chain(&dq[t * rq..][..rq]).all(|&x| x == 0.0), "padding token {t} of q");
        }
        for (t, _) in owned_kv.iter().enumerate().filter(|(_, &o)| !o) {
            assert!(dk[t * rk..][..rk].iter().chain(&dv[t * rk..][..rk]).all(|&x| x == 0.0), "padding token {t} of kv");
        }
    }
    // Errors: no unfused thd, bad tables, wrong shapes.
    let cfg = DotProductAttentionConfig::new(h, d);
    let mut attn = DotProductAttention::new(&dev, cfg.clone()).unwrap();
    let t32 = Tensor::zeros(&dev, DType::F32, &[10, h, d]).unwrap();
    let e = attn.forward_thd(&t32, &t32, &t32, ThdSeqlens::new(&[0, 10], &[0, 10])).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("fused backend only"), "{e}");
    let t = Tensor::zeros(&dev, DType::BF16, &[10, h, d]).unwrap();
    let e = attn.forward_thd(&t, &t, &t, ThdSeqlens::new(&[0, 6, 4], &[0, 5, 10])).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("must not decrease"), "{e}");
    let e = attn.forward_thd(&t, &t, &t, ThdSeqlens::new(&[0, 6, 11], &[0, 5, 10])).unwrap_err();
    assert!(e.to_string().contains("ends at 11 tokens"), "{e}");
    let bad = Tensor::zeros(&dev, DType::BF16, &[10, h * d]).unwrap();
    let e = attn.forward_thd(&bad, &t, &t, ThdSeqlens::new(&[0, 10], &[0, 10])).unwrap_err();
    assert!(e.to_string().contains("thd `q` must be [tokens, 4, 64]"), "{e}");
}
