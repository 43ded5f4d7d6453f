//! The FP8 attention forward (`ops::flash_attention_fp8`, TE's `fp8_dpa` forward) on Hopper: the
//! E4M3 operands bit-exact against the host quantizer (Vᵀ with its key order and zero padding),
//! amax exact, and the output and `softmax_lse` against an f64 forward of the dequantized
//! operands at TE's E4M3 tolerances; shapes that are not tile multiples, GQA, sbhd, causal,
//! bottom-right and head_dim 256; typed errors for what the FP8 kernels do not take.

use crate::attention::check;
use crate::common::{device, randn};
use crate::fused_attention::{check_lse, host_window_forward};
use te_nn::modules::{AttnMaskType, QkvFormat};
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::flash_attention::{FlashAttnParams, HeadStrides};
use te_runtime::ops::flash_attention_fp8::{self as fp8, Fp8Operand, Fp8Operands};
use te_runtime::ops::Fp8Meta;
use te_runtime::{Arch, DType, Error, Tensor};

/// Host data in bshd order → the layout of `format`.
pub(crate) fn to_format(x: &[f32], format: QkvFormat, b: usize, s: usize, h: usize, d: usize) -> Vec<f32> {
    match format {
        QkvFormat::Bshd => x.to_vec(),
        QkvFormat::Sbhd => {
            let mut y = vec![0f32; x.len()];
            for bi in 0..b {
                for si in 0..s {
                    let row = (bi * s + si) * h * d;
                    y[(si * b + bi) * h * d..][..h * d].copy_from_slice(&x[row..][..h * d]);
                }
            }
            y
        }
    }
}

/// The key of hardware k index `kh` (within a chunk of 32) of the kernel's P fragments.
pub(crate) fn key_of_k(kh: usize) -> usize {
    (kh & 16) + 2 * ((kh & 15) >> 2) + (kh & 1) + 8 * ((kh >> 1) & 1)
}

/// The device when it is a Hopper GPU (the FP8 attention kernels run on sm_90a only).
pub(crate) fn hopper() -> Option<std::sync::Arc<te_runtime::Device>> {
    let dev = device()?;
    if dev.arch() != Arch::Sm90a {
        eprintln!("FP8 attention runs on sm_90a only; {} skips it", dev.arch());
        return None;
    }
    Some(dev)
}

/// The call of `batch` sequences of `sq` queries (`heads` of `d`) and `sk` keys (`groups`) with
/// `mask` (no window), q, k, v in `format`, the output dense bshd.
pub(crate) fn params(
    (batch, sq, sk): (usize, usize, usize),
    (heads, groups, d): (usize, usize, usize),
    mask: AttnMaskType,
    format: QkvFormat,
) -> FlashAttnParams {
    let shape = AttentionShape::new(format.into(), batch, (sq, sk), (heads, groups), d).with_mask(mask, None);
    FlashAttnParams { o: HeadStrides::dense(QkvFormat::Bshd, batch, sq, heads, d), ..FlashAttnParams::dense(shape) }
}

#[test]
fn fp8_forward_matches_the_reference_of_its_quantized_inputs() {
    let Some(dev) = hopper() else { return };
    let (batch, heads, groups) = (2, 4, 2);
    for (sq, sk, mask, d, format, seed) in [
        (200, 333, AttnMaskType::NoMask, 128, QkvFormat::Bshd, 300),
        (333, 333, AttnMaskType::Causal, 128, QkvFormat::Sbhd, 301),
        (77, 300, AttnMaskType::CausalBottomRight, 256, QkvFormat::Bshd, 302),
        (129, 64, AttnMaskType::NoMask, 128, QkvFormat::Bshd, 303),
    ] {
        let p = params((batch, sq, sk), (heads, groups, d), mask, format);
        let what = format!("sq {sq} sk {sk} {} d {d} {format:?}", mask.name());
        let vals = |s, n, sd| -> Vec<f32> { randn(s, n, sd).into_iter().map(|x| round_to(DType::BF16, x)).collect() };
        let (hq, hk, hv) = (
            vals(seed, batch * sq * heads * d, 1.0),
            vals(seed + 1, batch * sk * groups * d, 2.0),
            vals(seed + 2, batch * sk * groups * d, 0.5),
        );
        let up = |x: &[f32], s: usize, h: usize| {
            let shape = format.shape(batch, s, h, d);
            Tensor::from_f32(&dev, DType::BF16, &shape, &to_format(x, format, batch, s, h, d)).unwrap()
        };
        let (q, k, v) = (up(&hq, sq, heads), up(&hk, sk, groups), up(&hv, sk, groups));
        let amax_of = |x: &[f32]| x.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let want_amax = [amax_of(&hq), amax_of(&hk), amax_of(&hv)];
        let scales = want_amax.map(|a| 448.0 / a);
        let mut ops = Fp8Operands::new(&dev, &p).unwrap();
        let mut metas = scales.map(|s| Fp8Meta::new(&dev, s).unwrap());
        for ((which, x), meta) in
            [(Fp8Operand::Q, &q), (Fp8Operand::K, &k), (Fp8Operand::V, &v)].into_iter().zip(&mut metas)
        {
            fp8::quantize(&dev, &p, which, (x, 0), &mut meta.scaling(), &mut ops).unwrap();
        }
        for (i, meta) in metas.iter().enumerate() {
            let (_, amax, scale_inv) = meta.read(&dev).unwrap();
            assert_eq!(amax, want_amax[i], "{what}: amax of operand {i}");
            assert_eq!(scale_inv, 1.0 / scales[i], "{what}: scale_inv of operand {i}");
        }
        let scales = (scales[0], scales[1], scales[2]);

        // The operands, bit-exact (as values) against the host quantizer.
        let e4m3 = |x: &[f32], s: f32| -> Vec<f32> { x.iter().map(|&v| round_to(DType::E4M3, v * s)).collect() };
        let (q8, k8, v8) = (e4m3(&hq, scales.0), e4m3(&hk, scales.1), e4m3(&hv, scales.2));
        assert!(ops.q.to_f32(&dev).unwrap() == q8, "{what}: e4m3 q");
        assert!(ops.k.to_f32(&dev).unwrap() == k8, "{what}: e4m3 k");
        let vt_row = sk.div_ceil(128) * 128;
        let mut vt = vec![0f32; batch * groups * d * vt_row];
        for b in 0..batch {
            for g in 0..groups {
                for c in 0..d {
                    for kh in 0..vt_row {
                        let j = (kh & !31) + key_of_k(kh & 31);
                        if j < sk {
                            vt[((b * groups + g) * d + c) * vt_row + kh] = v8[((b * sk + j) * groups + g) * d + c];
                        }
                    }
                }
            }
        }
        assert!(ops.vt.to_f32(&dev).unwrap() == vt, "{what}: e4m3 vᵀ (key order, zero padding)");

        let mut out = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        let scale_inv = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        fp8::forward(&dev, &p, &ops, scale_inv, None, &mut out, &mut lse).unwrap();
        let deq = |x: &[f32], s: f32| -> Vec<f32> { x.iter().map(|&v| v / s).collect() };
        let pd = FlashAttnParams {
            q: HeadStrides::dense(QkvFormat::Bshd, batch, sq, heads, d),
            kv: HeadStrides::dense(QkvFormat::Bshd, batch, sk, groups, d),
            v: HeadStrides::dense(QkvFormat::Bshd, batch, sk, groups, d),
            ..p
        };
        let (want_out, want_lse) =
            host_window_forward(&pd, &deq(&q8, scales.0), &deq(&k8, scales.1), &deq(&v8, scales.2));
        check(&format!("{what}: fp8 out"), DType::E4M3, &out.to_f32(&dev).unwrap(), &want_out);
        check_lse(&what, &dev.stream().clone_dtoh(&lse).unwrap(), &want_lse);
    }
}

#[test]
fn fp8_errors_are_typed() {
    let Some(dev) = device() else { return };
    let (batch, sq, heads, d) = (1, 64, 2, 64);
    let p = params((batch, sq, sq), (heads, heads, d), AttnMaskType::NoMask, QkvFormat::Bshd);
    let x = Tensor::zeros(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
    let mut ops = Fp8Operands::new(&dev, &p).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    // head_dim 64 (or any arch but sm_90a) is not one the FP8 kernels take.
    let e = fp8::quantize(&dev, &p, Fp8Operand::Q, (&x, 0), &mut meta.scaling(), &mut ops).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("head_dim 128 or 256") || msg.contains("sm_90a"), "{msg}");
    // Operands of other sizes, an empty scale_inv, a short lse, x smaller than its strides.
    let p128 = params((batch, sq, sq), (heads, heads, 128), AttnMaskType::NoMask, QkvFormat::Bshd);
    let mut out = Tensor::zeros(&dev, DType::BF16, &[batch, sq, heads, 128]).unwrap();
    let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
    if dev.arch() == Arch::Sm90a {
        let si = [&meta.scale_inv, &meta.scale_inv, &meta.scale_inv];
        let e = fp8::forward(&dev, &p128, &ops, si, None, &mut out, &mut lse).unwrap_err();
        assert!(e.to_string().contains("Fp8Operands::new"), "{e}");
        let mut ops128 = Fp8Operands::new(&dev, &p128).unwrap();
        let empty = dev.stream().alloc_zeros::<f32>(0).unwrap();
        let e = fp8::forward(&dev, &p128, &ops128, [si[0], si[1], &empty], None, &mut out, &mut lse).unwrap_err();
        assert!(e.to_string().contains("scale_inv of v"), "{e}");
        let mut short = dev.stream().alloc_zeros::<f32>(3).unwrap();
        let e = fp8::forward(&dev, &p128, &ops128, si, None, &mut out, &mut short).unwrap_err();
        assert!(e.to_string().contains("lse"), "{e}");
        let small = Tensor::zeros(&dev, DType::BF16, &[batch, sq - 1, heads, 128]).unwrap();
        let e = fp8::quantize(&dev, &p128, Fp8Operand::K, (&small, 0), &mut meta.scaling(), &mut ops128).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`x`"), "{e}");
    }
}
