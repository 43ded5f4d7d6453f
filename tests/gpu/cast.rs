//! Family 1 on the GPU: quantize bit-exact (special values included), dequantize, amax.

use crate::common::{assert_bits_eq, assert_close, device, randn};
use te_reference::cast as ref_cast;
use te_runtime::numerics;
use te_runtime::ops::{cast, Fp8Meta};
use te_runtime::{DType, Error, Tensor};

/// Values that probe rounding, saturation, subnormals and NaN/inf.
fn specials() -> Vec<f32> {
    let mut v =
        vec![0.0, -0.0, 1.0, -1.0, 1.0625, 1.1875, 448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 57344.0, 61440.0, 1e9];
    v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MIN_POSITIVE, 1e-40]);
    for e in -20..-5 {
        v.push(2f32.powi(e));
        v.push(-1.5 * 2f32.powi(e));
        v.push(1.25 * 2f32.powi(e));
    }
    v
}

#[test]
fn quantize_is_bit_exact_with_amax_and_scale_inv() {
    let Some(dev) = device() else { return };
    // Sizes: vector multiples and odd tails.
    for (i, &n) in [4096usize, 1, 13, 1000, 65_537, 1 << 20].iter().enumerate() {
        for input in [DType::F32, DType::BF16, DType::F16] {
            for out in [DType::E4M3, DType::E5M2] {
                let mut vals = randn(100 + i as u64, n, 3.0);
                if n >= 64 {
                    let sp = specials();
                    vals[..sp.len()].copy_from_slice(&sp);
                }
                // The reference sees the input exactly as the GPU does (rounded to `input`).
                let vals: Vec<f32> = vals.iter().map(|&v| numerics::round_to(input, v)).collect();
                let scale = 7.5f32;
                let x = Tensor::from_f32(&dev, input, &[n], &vals).unwrap();
                let mut q = Tensor::zeros(&dev, out, &[n]).unwrap();
                let mut meta = Fp8Meta::new(&dev, scale).unwrap();
                cast::quantize(&dev, &x, &mut q, &mut meta.scaling()).unwrap();
                let (want_q, want_amax, want_scale_inv) = ref_cast::quantize(&vals, out, scale);
                let what = format!("quantize {input}->{out} n={n}");
                assert_bits_eq(&what, &q.to_bytes(&dev).unwrap(), &want_q);
                let (_, amax, scale_inv) = meta.read(&dev).unwrap();
                assert_eq!(amax.to_bits(), want_amax.to_bits(), "{what}: amax");
                assert_eq!(scale_inv.to_bits(), want_scale_inv.to_bits(), "{what}: scale_inv");
            }
        }
    }
}

#[test]
fn amax_accumulates_across_calls_and_is_deterministic() {
    let Some(dev) = device() else { return };
    let a = randn(7, 300_001, 1.0);
    let b: Vec<f32> = randn(8, 300_001, 5.0);
    let xa = Tensor::from_f32(&dev, DType::F32, &[a.len()], &a).unwrap();
    let xb = Tensor::from_f32(&dev, DType::F32, &[b.len()], &b).unwrap();
    let mut amax = dev.stream().alloc_zeros::<f32>(1).unwrap();
    cast::amax(&dev, &xa, &mut amax.as_view_mut()).unwrap();
    assert_eq!(dev.stream().clone_dtoh(&amax).unwrap()[0], ref_cast::amax(&a));
    cast::amax(&dev, &xb, &mut amax.as_view_mut()).unwrap();
    assert_eq!(dev.stream().clone_dtoh(&amax).unwrap()[0], ref_cast::amax(&a).max(ref_cast::amax(&b)));
}

#[test]
fn dequantize_matches_reference() {
    let Some(dev) = device() else { return };
    for input in [DType::E4M3, DType::E5M2] {
        let codes: Vec<u8> = (0..=255u8).cycle().take(10_007).collect();
        let q = Tensor::from_bytes(&dev, input, &[codes.len()], &codes).unwrap();
        let scale_inv = dev.stream().clone_htod(&[0.37f32]).unwrap();
        for out in [DType::F32, DType::BF16, DType::F16] {
            let mut y = Tensor::zeros(&dev, out, &[codes.len()]).unwrap();
            cast::dequantize(&dev, &q, &scale_inv.as_view(), &mut y).unwrap();
            let want: Vec<f32> =
                ref_cast::dequantize(&codes, input, 0.37).into_iter().map(|v| numerics::round_to(out, v)).collect();
            assert_close(&format!("dequantize {input}->{out}"), &y.to_f32(&dev).unwrap(), &want, 0.0, 0.0);
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let x = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let mut wrong_shape = Tensor::zeros(&dev, DType::E4M3, &[4, 16]).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let e = cast::quantize(&dev, &x, &mut wrong_shape, &mut meta.scaling()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let mut not_fp8 = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let e = cast::quantize(&dev, &x, &mut not_fp8, &mut meta.scaling()).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out", .. }), "{e}");
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let mut q = Tensor::zeros(&dev, DType::E4M3, &[0, 8]).unwrap();
    let e = cast::quantize(&dev, &empty, &mut q, &mut meta.scaling()).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
}
