//! The FP8 attention backward (`ops::flash_attention_fp8::backward`, TE's `fp8_dpa` backward) on
//! Hopper: the backward's codes (Qᵀ, Kᵀ, dense V, dO and dOᵀ in E5M2 or E4M3) bit-exact against
//! the host quantizer, the recorded amax of dS against an f64 host computation, and the
//! gradients against the 16-bit fused backward of the same (dequantized) inputs: they differ by
//! the quantization of P (E4M3) and dS (E5M2 / E4M3) only. Power-of-two scales make the
//! dequantized inputs exact in bf16. Head dims 128 and 256, shapes that are not tile multiples,
//! GQA and MQA, sbhd, causal and bottom-right; bitwise determinism; typed errors.

use crate::common::randn;
use crate::fp8_attention::{hopper, key_of_k, params, to_format};
use te_nn::modules::{AttnMaskType, QkvFormat};
use te_runtime::numerics::round_to;
use te_runtime::ops::flash_attention::{self as fa, FlashAttnParams, HeadStrides, Qkv};
use te_runtime::ops::flash_attention_fp8::{self as fp8, Fp8BwdScaleInv, Fp8Grad, Fp8Operand, Fp8Operands};
use te_runtime::ops::Fp8Meta;
use te_runtime::{DType, Error, Tensor};

/// Relative RMS error bound of the FP8 gradients against the 16-bit ones of the same inputs: dS
/// in E5M2 keeps 2 mantissa bits (elements within ±12.5%), averaged over the sums of dK and dQ.
const RMS_TOL: f64 = 0.08;

fn rel_rms(got: &[f32], want: &[f32]) -> f64 {
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    (err / norm.max(1e-30)).sqrt()
}

/// `x` bshd `[b, s, h, d]` → `[b, h, d, trow]` with each chunk of 32 positions permuted and
/// zeros past `s` (what `_quantize` writes for Qᵀ, Kᵀ, Vᵀ, dOᵀ).
fn transposed(x: &[f32], b: usize, s: usize, h: usize, d: usize) -> Vec<f32> {
    let trow = s.div_ceil(128) * 128;
    let mut y = vec![0f32; b * h * d * trow];
    for bi in 0..b {
        for hi in 0..h {
            for c in 0..d {
                for kh in 0..trow {
                    let j = (kh & !31) + key_of_k(kh & 31);
                    if j < s {
                        y[((bi * h + hi) * d + c) * trow + kh] = x[((bi * s + j) * h + hi) * d + c];
                    }
                }
            }
        }
    }
    y
}

/// The largest power of two `p` with `amax · p ≤ max` (a delayed scale with margin 0, exact in
/// dequantization).
fn pow2_scale(max: f32, amax: f32) -> f32 {
    2f32.powi((max / amax).log2().floor() as i32)
}

/// Max |dS| in f64 over the visible scores, `dS = P ⊙ (dP − delta)`, all bshd.
#[allow(clippy::too_many_arguments)]
fn host_ds_amax(p: &FlashAttnParams, q: &[f32], k: &[f32], v: &[f32], d_o: &[f32], o: &[f32]) -> f64 {
    let p = &p.shape;
    let (b, sq, sk, h, g, d) = (p.batch, p.sq, p.sk, p.heads, p.groups, p.head_dim);
    let off = if p.bottom_right() { sk as i64 - sq as i64 } else { 0 };
    let seen = |i: usize, j: usize| {
        let (i, j) = (i as i64, j as i64);
        (p.window.0 < 0 || j >= i + off - p.window.0) && (p.window.1 < 0 || j <= i + off + p.window.1)
    };
    let dot = |a: &[f32], c: &[f32]| a.iter().zip(c).map(|(&x, &y)| f64::from(x) * f64::from(y)).sum::<f64>();
    let mut amax = 0f64;
    for bi in 0..b {
        for hi in 0..h {
            let kv = hi / (h / g);
            for i in 0..sq {
                let qi = &q[((bi * sq + i) * h + hi) * d..][..d];
                let oi = &o[((bi * sq + i) * h + hi) * d..][..d];
                let doi = &d_o[((bi * sq + i) * h + hi) * d..][..d];
                let keys: Vec<usize> = (0..sk).filter(|&j| seen(i, j)).collect();
                if keys.is_empty() {
                    continue;
                }
                let s: Vec<f64> = keys
                    .iter()
                    .map(|&j| dot(qi, &k[((bi * sk + j) * g + kv) * d..][..d]) * f64::from(p.scale))
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let delta = dot(doi, oi);
                for (x, &j) in s.iter().zip(&keys) {
                    let dp = dot(doi, &v[((bi * sk + j) * g + kv) * d..][..d]);
                    amax = amax.max(((x - m).exp() / z * (dp - delta)).abs());
                }
            }
        }
    }
    amax
}

#[test]
fn fp8_backward_matches_the_16_bit_backward_of_its_quantized_inputs() {
    let Some(dev) = hopper() else { return };
    let batch = 2;
    // head_dim 256 (Gemma 3's): two 128-channel slabs of dK/dV per key block, 64-key dQ tiles;
    // MQA there as in Gemma 3.
    for (d, heads, groups, sq, sk, mask, format, grad, seed) in [
        (128, 4, 2, 200, 333, AttnMaskType::NoMask, QkvFormat::Bshd, DType::E5M2, 400),
        (128, 4, 2, 333, 333, AttnMaskType::Causal, QkvFormat::Sbhd, DType::E5M2, 401),
        (128, 4, 2, 77, 300, AttnMaskType::CausalBottomRight, QkvFormat::Bshd, DType::E4M3, 402),
        (128, 4, 2, 129, 64, AttnMaskType::NoMask, QkvFormat::Bshd, DType::E5M2, 403),
        (256, 4, 1, 300, 300, AttnMaskType::Causal, QkvFormat::Bshd, DType::E5M2, 404),
        (256, 4, 2, 77, 200, AttnMaskType::NoMask, QkvFormat::Sbhd, DType::E4M3, 405),
        (256, 2, 2, 150, 333, AttnMaskType::CausalBottomRight, QkvFormat::Bshd, DType::E5M2, 406),
    ] {
        let what = format!("d {d} h {heads}/{groups} sq {sq} sk {sk} {} {format:?} {grad}", mask.name());
        let dense = |s, h| HeadStrides::dense(QkvFormat::Bshd, batch, s, h, d);
        let p = params((batch, sq, sk), (heads, groups, d), mask, format);
        let pd = FlashAttnParams { q: dense(sq, heads), kv: dense(sk, groups), v: dense(sk, groups), ..p };
        // Inputs already on the FP8 grids of power-of-two scales: quantization is exact, and the
        // dequantized values are the 16-bit reference's inputs (bshd on the host).
        let fmt_max = |t: DType| if t == DType::E5M2 { 57344.0 } else { 448.0 };
        let on_grid = |seed, n, sd: f32, t: DType| -> (Vec<f32>, f32) {
            let x: Vec<f32> = randn(seed, n, sd).into_iter().map(|x| round_to(DType::BF16, x)).collect();
            let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
            let s = pow2_scale(fmt_max(t), amax);
            (x.iter().map(|&v| round_to(t, v * s) / s).collect(), s)
        };
        let (hq, sq_) = on_grid(seed, batch * sq * heads * d, 1.0, DType::E4M3);
        let (hk, sk_) = on_grid(seed + 1, batch * sk * groups * d, 2.0, DType::E4M3);
        let (hv, sv_) = on_grid(seed + 2, batch * sk * groups * d, 0.5, DType::E4M3);
        let (hdo, sdo) = on_grid(seed + 3, batch * sq * heads * d, 1e-3, grad);
        let up = |x: &[f32], s: usize, h: usize, f: QkvFormat| {
            Tensor::from_f32(&dev, DType::BF16, &f.shape(batch, s, h, d), &to_format(x, f, batch, s, h, d)).unwrap()
        };
        let (q, k, v) = (up(&hq, sq, heads, format), up(&hk, sk, groups, format), up(&hv, sk, groups, format));
        let d_out = up(&hdo, sq, heads, QkvFormat::Bshd);

        // The 16-bit reference: forward and backward of the same values.
        let (qd, kd, vd) = (
            up(&hq, sq, heads, QkvFormat::Bshd),
            up(&hk, sk, groups, QkvFormat::Bshd),
            up(&hv, sk, groups, QkvFormat::Bshd),
        );
        let mut out16 = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse16 = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        fa::forward(&dev, &pd, Qkv::Apart([&qd, &kd, &vd]), None, &mut out16, &mut lse16).unwrap();
        let grads16 = |t: &Tensor| Tensor::empty(&dev, DType::BF16, t.shape()).unwrap();
        let (mut wq, mut wk, mut wv) = (grads16(&qd), grads16(&kd), grads16(&vd));
        let g = Qkv::Apart([&mut wq, &mut wk, &mut wv]);
        fa::backward(&dev, &pd, Qkv::Apart([&qd, &kd, &vd]), &out16, &d_out, &lse16, None, g).unwrap();

        // The FP8 forward, keeping the backward's codes.
        let mut ops = Fp8Operands::with_backward(&dev, &p).unwrap();
        let mut metas = [sq_, sk_, sv_].map(|s| Fp8Meta::new(&dev, s).unwrap());
        for ((which, x), meta) in
            [(Fp8Operand::Q, &q), (Fp8Operand::K, &k), (Fp8Operand::V, &v)].into_iter().zip(&mut metas)
        {
            fp8::quantize(&dev, &p, which, (x, 0), &mut meta.scaling(), &mut ops).unwrap();
        }
        let codes = |x: &[f32], s: f32, t: DType| -> Vec<f32> { x.iter().map(|&v| round_to(t, v * s)).collect() };
        let bwd = ops.backward.as_ref().unwrap();
        let (q8, k8) = (codes(&hq, sq_, DType::E4M3), codes(&hk, sk_, DType::E4M3));
        assert!(bwd.qt.to_f32(&dev).unwrap() == transposed(&q8, batch, sq, heads, d), "{what}: qᵀ codes");
        assert!(bwd.kt.to_f32(&dev).unwrap() == transposed(&k8, batch, sk, groups, d), "{what}: kᵀ codes");
        assert!(bwd.v.to_f32(&dev).unwrap() == codes(&hv, sv_, DType::E4M3), "{what}: dense v codes");
        let mut out = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();

        // dO's codes.
        let mut gmeta = Fp8Meta::new(&dev, sdo).unwrap();
        let mut g8 = Fp8Grad::new(&dev, &p, grad).unwrap();
        fp8::quantize_grad(&dev, &p, &d_out, &mut gmeta.scaling(), &mut g8).unwrap();
        let do8 = codes(&hdo, sdo, grad);
        assert!(g8.d_o.to_f32(&dev).unwrap() == do8, "{what}: dO codes");
        assert!(g8.d_ot.to_f32(&dev).unwrap() == transposed(&do8, batch, sq, heads, d), "{what}: dOᵀ codes");

        // dS's delayed scale: the power of two under the format's max for the true amax.
        let o_host = out.to_f32(&dev).unwrap();
        let ds_amax = host_ds_amax(&pd, &hq, &hk, &hv, &hdo, &o_host) as f32;
        let mut ds = Fp8Meta::new(&dev, pow2_scale(fmt_max(grad), ds_amax)).unwrap();
        let run = |ds: &mut Fp8Meta| -> [Vec<f32>; 3] {
            let new = |s: usize, h: usize| Tensor::empty(&dev, DType::BF16, &format.shape(batch, s, h, d)).unwrap();
            let (mut dq, mut dk, mut dv) = (new(sq, heads), new(sk, groups), new(sk, groups));
            let scale_inv = Fp8BwdScaleInv { qkv: si, d_o: &gmeta.scale_inv, o: None };
            let grads = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
            fp8::backward(&dev, &p, (&ops, &g8), scale_inv, &mut ds.scaling(), (&out, &d_out), &lse, None, grads)
                .unwrap();
            [&dq, &dk, &dv].map(|t| t.to_f32(&dev).unwrap())
        };
        let got = run(&mut ds);
        let (_, recorded, _) = ds.read(&dev).unwrap();
        let rel = (recorded - ds_amax).abs() / ds_amax;
        eprintln!("{what}: dS amax {recorded:.4e} (host {ds_amax:.4e}, {rel:.3})");
        assert!(rel < 0.1, "{what}: dS amax {recorded} against the host's {ds_amax}");
        // The 16-bit reference in the call's layout (the gradients follow q's, k's and v's).
        let to_layout =
            |t: &Tensor, s: usize, h: usize| up(&t.to_f32(&dev).unwrap(), s, h, format).to_f32(&dev).unwrap();
        let want = [to_layout(&wq, sq, heads), to_layout(&wk, sk, groups), to_layout(&wv, sk, groups)];
        for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let e = rel_rms(g, w);
            eprintln!("{what}: {name} relative RMS error {e:.4}");
            assert!(g.iter().all(|x| x.is_finite()) && e <= RMS_TOL, "{what}: {name} relative RMS error {e:.4}");
        }
        assert_eq!(run(&mut ds), got, "{what}: the backward is deterministic");
    }
}

#[test]
fn fp8_backward_errors_are_typed() {
    let Some(dev) = hopper() else { return };
    let (batch, sq, heads, d) = (1, 64, 2, 128);
    let p = params((batch, sq, sq), (heads, heads, d), AttnMaskType::NoMask, QkvFormat::Bshd);
    let x = Tensor::zeros(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
    let meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let mut ds = Fp8Meta::new(&dev, 1.0).unwrap();
    let ops = Fp8Operands::new(&dev, &p).unwrap();
    let g8 = Fp8Grad::new(&dev, &p, DType::E5M2).unwrap();
    let si = Fp8BwdScaleInv { qkv: [&meta.scale_inv; 3], d_o: &meta.scale_inv, o: None };
    let lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
    let mut t = [0; 3].map(|_| Tensor::zeros(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap());
    let [a, b, c] = &mut t;
    // Operands made for the forward only.
    let e = fp8::backward(&dev, &p, (&ops, &g8), si, &mut ds.scaling(), (&x, &x), &lse, None, Qkv::Apart([a, b, c]))
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("with_backward"), "{e}");
    // Attention dropout, and gradient codes that are not FP8.
    let ops = Fp8Operands::with_backward(&dev, &p).unwrap();
    let dropout = te_runtime::ops::dropout::DropoutParams { p: 0.1, seed: 1, offset: 1 };
    let drop = FlashAttnParams { shape: p.shape.with_dropout(Some(dropout)), ..p };
    let [a, b, c] = &mut t;
    let e = fp8::backward(&dev, &drop, (&ops, &g8), si, &mut ds.scaling(), (&x, &x), &lse, None, Qkv::Apart([a, b, c]))
        .unwrap_err();
    assert!(e.to_string().contains("dropout"), "{e}");
    let e = Fp8Grad::new(&dev, &p, DType::BF16).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    // A short lse.
    let short = dev.stream().alloc_zeros::<f32>(3).unwrap();
    let [a, b, c] = &mut t;
    let e = fp8::backward(&dev, &p, (&ops, &g8), si, &mut ds.scaling(), (&x, &x), &short, None, Qkv::Apart([a, b, c]))
        .unwrap_err();
    assert!(e.to_string().contains("lse"), "{e}");
}
