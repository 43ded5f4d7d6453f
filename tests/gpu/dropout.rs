//! Family 10 on the GPU: bias_dropout_add, dropout and the backward against the CPU reference,
//! which draws the same Philox words: masks bit for bit and outputs bit for bit (the math is
//! mirrored operation for operation; inputs have no NaN) for every mix of f32/bf16/f16, with and
//! without bias, at sizes with a tail past the 8-element chunks and rows whose width is not a
//! multiple of 8 (the scalar bias path); the keep fraction within 4σ of 1 - p on 1M elements;
//! p = 0 is the identity and p = 1 keeps only the residual; masks reproduce per (seed, offset);
//! and typed errors.

use crate::common::{assert_bits_eq, device, randn};
use cudarc::driver::CudaSlice;
use te_reference::dropout as reference;
use te_runtime::numerics;
use te_runtime::ops::dropout::{bias_dropout_add, dropout, dropout_backward, mask_bytes, DropoutParams};
use te_runtime::{DType, Device, Error, Tensor};

const HIGH_PRECISION: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
/// `[rows, cols]`: tail only, a partial chunk, cols not a multiple of 8, vector bias, and ~1M
/// elements with a tail.
const SHAPES: [[usize; 2]; 5] = [[1, 1], [1, 7], [3, 5], [37, 64], [1027, 1021]];

fn input(dtype: DType, seed: u64, n: usize) -> Vec<f32> {
    randn(seed, n, 2.0).into_iter().map(|v| numerics::round_to(dtype, v)).collect()
}

fn params(p: f32, seed: u64) -> DropoutParams {
    DropoutParams { p, seed: seed.wrapping_mul(0x9E37_79B9_7F4A_7C15), offset: seed ^ 0x5555 }
}

fn mask_buffer(dev: &Device, n: usize) -> CudaSlice<u8> {
    // Garbage in the buffer: every byte must be written.
    dev.stream().clone_htod(&vec![0xa5u8; mask_bytes(n)]).unwrap()
}

#[test]
fn bias_dropout_add_is_bit_exact_for_every_dtype_mix() {
    let Some(dev) = device() else { return };
    let mut seed = 1;
    for [rows, cols] in SHAPES {
        let n = rows * cols;
        for x_t in HIGH_PRECISION {
            for out_t in HIGH_PRECISION {
                for with_bias in [false, true] {
                    seed += 1;
                    let p = params(0.3, seed);
                    let (x, bias, res) =
                        (input(x_t, seed, n), input(x_t, seed + 1000, cols), input(out_t, seed + 2000, n));
                    let xt = Tensor::from_f32(&dev, x_t, &[rows, cols], &x).unwrap();
                    let bt = Tensor::from_f32(&dev, x_t, &[cols], &bias).unwrap();
                    let rt = Tensor::from_f32(&dev, out_t, &[rows, cols], &res).unwrap();
                    let mut out = Tensor::zeros(&dev, out_t, &[rows, cols]).unwrap();
                    let mut mask = mask_buffer(&dev, n);
                    let b = with_bias.then_some(&bt);
                    bias_dropout_add(&dev, &xt, b, &rt, p, &mut out, &mut mask).unwrap();
                    let (want, want_mask) =
                        reference::bias_dropout_add(&x, with_bias.then_some(&bias[..]), Some(&res), p, out_t);
                    let what = format!("bias_dropout_add {x_t} -> {out_t}, bias {with_bias}, [{rows}, {cols}]");
                    assert_bits_eq(&format!("{what}: mask"), &dev.stream().clone_dtoh(&mask).unwrap(), &want_mask);
                    assert_bits_eq(&what, &out.to_bytes(&dev).unwrap(), &numerics::encode(out_t, &want));
                }
            }
        }
    }
}

#[test]
fn dropout_and_backward_are_bit_exact() {
    let Some(dev) = device() else { return };
    let mut seed = 100;
    for [rows, cols] in SHAPES {
        let n = rows * cols;
        for in_t in HIGH_PRECISION {
            for out_t in HIGH_PRECISION {
                seed += 1;
                let p = params(0.1, seed);
                let x = input(in_t, seed, n);
                let xt = Tensor::from_f32(&dev, in_t, &[rows, cols], &x).unwrap();
                let mut out = Tensor::zeros(&dev, out_t, &[rows, cols]).unwrap();
                let mut mask = mask_buffer(&dev, n);
                dropout(&dev, &xt, p, &mut out, &mut mask).unwrap();
                let (want, want_mask) = reference::bias_dropout_add(&x, None, None, p, out_t);
                let what = format!("dropout {in_t} -> {out_t}, [{rows}, {cols}]");
                assert_bits_eq(&format!("{what}: mask"), &dev.stream().clone_dtoh(&mask).unwrap(), &want_mask);
                assert_bits_eq(&what, &out.to_bytes(&dev).unwrap(), &numerics::encode(out_t, &want));

                // Backward of a dout (dtype in_t) into dx (out_t) with the forward's mask.
                let g = input(in_t, seed + 5000, n);
                let gt = Tensor::from_f32(&dev, in_t, &[rows, cols], &g).unwrap();
                let mut dx = Tensor::zeros(&dev, out_t, &[rows, cols]).unwrap();
                dropout_backward(&dev, &gt, &mask, p.p, &mut dx).unwrap();
                let want = reference::dropout_backward(&g, &want_mask, p.p, out_t);
                assert_bits_eq(
                    &format!("{what}: backward"),
                    &dx.to_bytes(&dev).unwrap(),
                    &numerics::encode(out_t, &want),
                );
            }
        }
    }
}

#[test]
fn keep_fraction_is_within_4_sigma_and_masks_reproduce() {
    let Some(dev) = device() else { return };
    let n = 1 << 20;
    let x = Tensor::from_f32(&dev, DType::BF16, &[n], &input(DType::BF16, 7, n)).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[n]).unwrap();
    for p in [0.1f32, 0.5, 0.9] {
        let mut mask = mask_buffer(&dev, n);
        dropout(&dev, &x, params(p, 9), &mut out, &mut mask).unwrap();
        let bits = dev.stream().clone_dtoh(&mask).unwrap();
        let kept: u64 = bits.iter().map(|b| b.count_ones() as u64).sum();
        let (mean, sigma) = (n as f64 * (1.0 - p as f64), (n as f64 * p as f64 * (1.0 - p as f64)).sqrt());
        assert!((kept as f64 - mean).abs() < 4.0 * sigma, "p = {p}: {kept} of {n} kept, expected {mean} ± 4·{sigma}");
        // Dropped elements are exactly 0 in the output.
        let y = out.to_f32(&dev).unwrap();
        assert!(y.iter().enumerate().all(|(i, &v)| reference::kept(&bits, i) || v == 0.0), "p = {p}");

        // The same (seed, offset) reproduces the mask; another offset or seed does not.
        let mut again = mask_buffer(&dev, n);
        dropout(&dev, &x, params(p, 9), &mut out, &mut again).unwrap();
        assert_eq!(dev.stream().clone_dtoh(&again).unwrap(), bits, "p = {p}: same stream");
        for other in [DropoutParams { offset: 1, ..params(p, 9) }, DropoutParams { seed: 1, ..params(p, 9) }] {
            dropout(&dev, &x, other, &mut out, &mut again).unwrap();
            assert_ne!(dev.stream().clone_dtoh(&again).unwrap(), bits, "p = {p}: {other:?}");
        }
    }
}

#[test]
fn p_0_is_the_identity_and_p_1_keeps_only_the_residual() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (33, 77);
    let n = rows * cols;
    for dt in HIGH_PRECISION {
        let x = input(dt, 11, n);
        let xt = Tensor::from_f32(&dev, dt, &[rows, cols], &x).unwrap();
        let mut out = Tensor::zeros(&dev, dt, &[rows, cols]).unwrap();
        let mut mask = mask_buffer(&dev, n);
        dropout(&dev, &xt, params(0.0, 3), &mut out, &mut mask).unwrap();
        assert_bits_eq(&format!("p = 0 {dt}"), &out.to_bytes(&dev).unwrap(), &xt.to_bytes(&dev).unwrap());
        let mut all = vec![0xffu8; mask_bytes(n)];
        *all.last_mut().unwrap() = (1u8 << (n % 8)) - 1; // n % 8 = 5: the bits past n stay 0
        assert_eq!(dev.stream().clone_dtoh(&mask).unwrap(), all, "p = 0 {dt}: mask");
        // The backward with that mask is the identity too.
        let mut dx = Tensor::zeros(&dev, dt, &[rows, cols]).unwrap();
        dropout_backward(&dev, &xt, &mask, 0.0, &mut dx).unwrap();
        assert_bits_eq(&format!("p = 0 {dt}: backward"), &dx.to_bytes(&dev).unwrap(), &xt.to_bytes(&dev).unwrap());

        let bias = Tensor::from_f32(&dev, dt, &[cols], &input(dt, 12, cols)).unwrap();
        let residual = Tensor::from_f32(&dev, dt, &[rows, cols], &input(dt, 13, n)).unwrap();
        bias_dropout_add(&dev, &xt, Some(&bias), &residual, params(1.0, 3), &mut out, &mut mask).unwrap();
        assert_bits_eq(&format!("p = 1 {dt}"), &out.to_bytes(&dev).unwrap(), &residual.to_bytes(&dev).unwrap());
        assert!(dev.stream().clone_dtoh(&mask).unwrap().iter().all(|&b| b == 0), "p = 1 {dt}: mask");
        dropout_backward(&dev, &xt, &mask, 1.0, &mut dx).unwrap();
        assert!(dx.to_f32(&dev).unwrap().iter().all(|&v| v.to_bits() == 0), "p = 1 {dt}: backward is +0");
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (4, 10);
    let x = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let bias = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
    let res = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let mut mask = mask_buffer(&dev, rows * cols);
    let ok = params(0.1, 1);

    for p in [-0.5, 1.01, f32::NAN] {
        let e = dropout(&dev, &x, params(p, 1), &mut out, &mut mask).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("[0, 1]"), "{e}");
        let e = dropout_backward(&dev, &x, &mask, p, &mut out).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }), "{e}");
    }
    let shape_err = |r: te_runtime::Result<()>, needle: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(needle), "{needle}: {e}");
    };
    let mut short = dev.stream().alloc_zeros::<u8>(4).unwrap();
    shape_err(dropout(&dev, &x, ok, &mut out, &mut short), "= 5 bytes");
    shape_err(dropout_backward(&dev, &x, &short, 0.1, &mut out), "= 5 bytes");
    let wide_bias = Tensor::zeros(&dev, DType::BF16, &[rows * cols]).unwrap();
    shape_err(bias_dropout_add(&dev, &x, Some(&wide_bias), &res, ok, &mut out, &mut mask), "`bias`");
    let flat = Tensor::zeros(&dev, DType::BF16, &[rows * cols]).unwrap();
    shape_err(bias_dropout_add(&dev, &x, Some(&bias), &flat, ok, &mut out, &mut mask), "`residual`");
    let mut flat_out = Tensor::zeros(&dev, DType::BF16, &[rows * cols]).unwrap();
    shape_err(dropout(&dev, &x, ok, &mut flat_out, &mut mask), "`out`");
    shape_err(dropout_backward(&dev, &x, &mask, 0.1, &mut flat_out), "`dx`");
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, cols]).unwrap();
    let mut empty_out = Tensor::zeros(&dev, DType::BF16, &[0, cols]).unwrap();
    let mut no_mask = dev.stream().alloc_zeros::<u8>(1).unwrap();
    shape_err(dropout(&dev, &empty, ok, &mut empty_out, &mut no_mask), "no elements");

    let dtype_err = |r: te_runtime::Result<()>, arg: &str| {
        let e = r.unwrap_err();
        assert!(matches!(&e, Error::DType { arg: a, .. } if *a == arg), "{arg}: {e}");
    };
    let f32_bias = Tensor::zeros(&dev, DType::F32, &[cols]).unwrap();
    dtype_err(bias_dropout_add(&dev, &x, Some(&f32_bias), &res, ok, &mut out, &mut mask), "bias");
    let f32_res = Tensor::zeros(&dev, DType::F32, &[rows, cols]).unwrap();
    dtype_err(bias_dropout_add(&dev, &x, None, &f32_res, ok, &mut out, &mut mask), "residual");
    let q = Tensor::zeros(&dev, DType::E4M3, &[rows, cols]).unwrap();
    dtype_err(dropout(&dev, &q, ok, &mut out, &mut mask), "x");
    let mut q_out = Tensor::zeros(&dev, DType::E5M2, &[rows, cols]).unwrap();
    dtype_err(dropout(&dev, &x, ok, &mut q_out, &mut mask), "out");
    dtype_err(dropout_backward(&dev, &q, &mask, 0.1, &mut out), "dout");
}
