//! Family 4 on the GPU: bias + activation forward (high-precision and FP8 outputs) and the
//! activation backward for GELU, ReLU, SwiGLU and GeGLU against the CPU reference, and typed
//! errors.
//!
//! The kernels and the reference run the same f32 formulas, but `tanhf`/`expf` on the GPU and
//! Rust's `tanh`/`exp` may differ by an ulp or two, and NVRTC fuses multiply-adds. So
//! high-precision outputs are compared with TE's tolerances for the output dtype (bf16 rtol
//! 1.6e-2 atol 1e-5, f16 rtol 1e-3 atol 1e-5; f32 rtol 1e-5 atol 1e-5, looser than TE's 1.3e-6
//! because a 2-ulp `tanhf` difference is amplified by the `1 + tanh` cancellation of GELU for
//! negative inputs). FP8 outputs: the f32 value before the cast can differ by a few ulps, which
//! flips the FP8 code only when it lies within those ulps of a rounding midpoint. So FP8 codes
//! are compared after dequantizing with E4M3's tolerance (rtol 0.125 atol 0.0675 = one code),
//! and all but 2 + 0.1% of the codes must be bit-identical (a flip needs the f32 value within
//! ~2 ulps of a midpoint: odds ~1e-5 per element); amax within rtol 1e-5, scale_inv bit-exact.

use crate::common::{assert_close, device, randn};
use te_codegen::spec::Activation;
use te_reference::{activation as ref_act, cast as ref_cast};
use te_runtime::numerics;
use te_runtime::ops::{activation, Fp8Meta};
use te_runtime::{DType, Error, Tensor};

const ROWS: [usize; 3] = [1, 33, 1000];
const SCALE: f32 = 24.0;

fn in_cols(act: Activation, cols: usize) -> usize {
    if act.is_gated() {
        2 * cols
    } else {
        cols
    }
}

/// `n` values `~ N(0, std)` rounded to `dtype`, so the reference sees what the kernel reads.
fn input(dtype: DType, seed: u64, n: usize, std: f32) -> Vec<f32> {
    randn(seed, n, std).into_iter().map(|v| numerics::round_to(dtype, v)).collect()
}

/// TE's tolerances for a high-precision output dtype (f32 loosened, see the module doc).
fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::BF16 => (1.6e-2, 1e-5),
        DType::F16 => (1e-3, 1e-5),
        _ => (1e-5, 1e-5),
    }
}

/// Checks an output tensor against the reference's f32 values `want`: rounded to a
/// high-precision dtype, or quantized with `SCALE` (with amax and scale_inv) for FP8.
fn check_output(dev: &te_runtime::Device, what: &str, out: &Tensor, want: &[f32], meta: Option<&Fp8Meta>) {
    let dtype = out.dtype();
    if let Some(meta) = meta {
        let (want_q, want_amax, want_scale_inv) = ref_cast::quantize(want, dtype, SCALE);
        let got_q = out.to_bytes(dev).unwrap();
        let got: Vec<f32> = got_q.iter().map(|&q| numerics::dequantize(dtype, q)).collect();
        let exp: Vec<f32> = want_q.iter().map(|&q| numerics::dequantize(dtype, q)).collect();
        assert_close(&format!("{what}: fp8 values"), &got, &exp, 0.125, 0.0675);
        let differ = got_q.iter().zip(&want_q).filter(|(a, b)| a != b).count();
        assert!(
            differ <= 2 + got_q.len() / 1000,
            "{what}: {differ}/{} FP8 codes differ from the reference (allowed: 2 + 0.1%)",
            got_q.len()
        );
        let (_, amax, scale_inv) = meta.read(dev).unwrap();
        assert_close(&format!("{what}: amax"), &[amax], &[want_amax], 1e-5, 0.0);
        assert_eq!(scale_inv.to_bits(), want_scale_inv.to_bits(), "{what}: scale_inv");
    } else {
        let exp: Vec<f32> = want.iter().map(|&v| numerics::round_to(dtype, v)).collect();
        let (rtol, atol) = tolerance(dtype);
        assert_close(what, &out.to_f32(dev).unwrap(), &exp, rtol, atol);
    }
}

/// Runs the forward on the GPU and checks it against the reference.
fn check_forward(act: Activation, input_t: DType, out_t: DType, rows: usize, cols: usize, bias: bool, seed: u64) {
    let Some(dev) = device() else { return };
    let w = in_cols(act, cols);
    let xv = input(input_t, seed, rows * w, 2.0);
    let bv = input(input_t, seed + 1, w, 0.5);
    let x = Tensor::from_f32(&dev, input_t, &[rows, w], &xv).unwrap();
    let b = Tensor::from_f32(&dev, input_t, &[w], &bv).unwrap();
    let mut y = Tensor::zeros(&dev, out_t, &[rows, cols]).unwrap();
    let mut meta = out_t.is_fp8().then(|| Fp8Meta::new(&dev, SCALE).unwrap());
    let mut scaling = meta.as_mut().map(Fp8Meta::scaling);
    activation::forward(&dev, act, &x, bias.then_some(&b), &mut y, scaling.as_mut()).unwrap();
    let want = ref_act::forward(act, &xv, bias.then_some(&bv[..]), cols);
    let what = format!("{act} fwd {input_t}->{out_t} [{rows}, {cols}] bias={bias}");
    check_output(&dev, &what, &y, &want, meta.as_ref());
}

/// Runs the backward on the GPU and checks it against the reference.
fn check_backward(act: Activation, input_t: DType, out_t: DType, rows: usize, cols: usize, seed: u64) {
    let Some(dev) = device() else { return };
    let w = in_cols(act, cols);
    let xv = input(input_t, seed, rows * w, 2.0);
    let gv = input(input_t, seed + 1, rows * cols, 1.0);
    let x = Tensor::from_f32(&dev, input_t, &[rows, w], &xv).unwrap();
    let dy = Tensor::from_f32(&dev, input_t, &[rows, cols], &gv).unwrap();
    let mut dx = Tensor::zeros(&dev, out_t, &[rows, w]).unwrap();
    let mut meta = out_t.is_fp8().then(|| Fp8Meta::new(&dev, SCALE).unwrap());
    let mut scaling = meta.as_mut().map(Fp8Meta::scaling);
    activation::backward(&dev, act, &dy, &x, &mut dx, scaling.as_mut()).unwrap();
    let want = ref_act::backward(act, &gv, &xv, cols);
    let what = format!("{act} bwd {input_t}->{out_t} [{rows}, {cols}]");
    check_output(&dev, &what, &dx, &want, meta.as_ref());
}

#[test]
fn forward_bf16_and_e4m3_outputs_match_reference() {
    let Some(_dev) = device() else { return };
    let mut seed = 1000;
    for act in Activation::ALL {
        for cols in [784, 4096] {
            for rows in ROWS {
                for bias in [false, true] {
                    for out in [DType::BF16, DType::E4M3] {
                        seed += 2;
                        check_forward(act, DType::BF16, out, rows, cols, bias, seed);
                    }
                }
            }
        }
    }
}

#[test]
fn backward_bf16_and_e4m3_outputs_match_reference() {
    let Some(_dev) = device() else { return };
    let mut seed = 2000;
    for act in Activation::ALL {
        for cols in [784, 4096] {
            for rows in ROWS {
                for out in [DType::BF16, DType::E4M3] {
                    seed += 2;
                    check_backward(act, DType::BF16, out, rows, cols, seed);
                }
            }
        }
    }
}

#[test]
fn narrow_rows_of_8_columns_match_reference() {
    let Some(_dev) = device() else { return };
    for act in Activation::ALL {
        for rows in ROWS {
            check_forward(act, DType::BF16, DType::BF16, rows, 8, true, 3000 + rows as u64);
            check_backward(act, DType::BF16, DType::BF16, rows, 8, 3100 + rows as u64);
        }
    }
}

#[test]
fn f32_and_f16_inputs_and_e5m2_output_match_reference() {
    let Some(_dev) = device() else { return };
    for act in Activation::ALL {
        for dtype in [DType::F32, DType::F16] {
            check_forward(act, dtype, dtype, 33, 784, true, 4000);
            check_backward(act, dtype, dtype, 33, 784, 4010);
            // 100 columns: vectors of 4 elements, not 16 bytes.
            check_forward(act, dtype, dtype, 7, 100, false, 4020);
        }
        check_forward(act, DType::F32, DType::E4M3, 33, 784, false, 4030);
        check_forward(act, DType::BF16, DType::E5M2, 33, 784, true, 4040);
        check_backward(act, DType::F16, DType::E5M2, 33, 784, 4050);
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let t = |dtype, shape: &[usize]| Tensor::zeros(&dev, dtype, shape).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();

    // A gated activation reads [a | b]: x must be twice as wide as y.
    let e = activation::forward(
        &dev,
        Activation::Swiglu,
        &t(DType::BF16, &[4, 100]),
        None,
        &mut t(DType::BF16, &[4, 64]),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("2 * cols = 128"), "{e}");
    let e = activation::backward(
        &dev,
        Activation::Geglu,
        &t(DType::BF16, &[4, 64]),
        &t(DType::BF16, &[4, 64]),
        &mut t(DType::BF16, &[4, 64]),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("2 * cols = 128"), "{e}");

    // FP8 needs cols % 16 == 0; the message says what to pad to.
    let e = activation::forward(
        &dev,
        Activation::Gelu,
        &t(DType::BF16, &[4, 24]),
        None,
        &mut t(DType::E4M3, &[4, 24]),
        Some(&mut meta.scaling()),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("pad it to 32"), "{e}");
    let e = activation::backward(
        &dev,
        Activation::Swiglu,
        &t(DType::BF16, &[4, 8]),
        &t(DType::BF16, &[4, 16]),
        &mut t(DType::E4M3, &[4, 16]),
        Some(&mut meta.scaling()),
    )
    .unwrap_err();
    assert!(e.to_string().contains("pad it to 16"), "{e}");

    // FP8 output without scaling, scaling with a bf16 output.
    let x = t(DType::BF16, &[4, 32]);
    let e = activation::forward(&dev, Activation::Relu, &x, None, &mut t(DType::E4M3, &[4, 32]), None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "y", .. }), "{e}");
    let e =
        activation::forward(&dev, Activation::Relu, &x, None, &mut t(DType::BF16, &[4, 32]), Some(&mut meta.scaling()))
            .unwrap_err();
    assert!(matches!(e, Error::DType { arg: "y", .. }), "{e}");

    // Bias of the wrong dtype or length; mismatched leading dims; FP8 input; empty input.
    let e = activation::forward(
        &dev,
        Activation::Gelu,
        &x,
        Some(&t(DType::F32, &[32])),
        &mut t(DType::BF16, &[4, 32]),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { arg: "bias", .. }), "{e}");
    let e = activation::forward(
        &dev,
        Activation::Geglu,
        &t(DType::BF16, &[4, 64]),
        Some(&t(DType::BF16, &[32])),
        &mut t(DType::BF16, &[4, 32]),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[64]"), "{e}");
    let e = activation::forward(&dev, Activation::Gelu, &x, None, &mut t(DType::BF16, &[5, 32]), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("leading"), "{e}");
    let e = activation::forward(
        &dev,
        Activation::Gelu,
        &t(DType::E4M3, &[4, 32]),
        None,
        &mut t(DType::BF16, &[4, 32]),
        None,
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { arg: "x", .. }), "{e}");
    let e = activation::forward(
        &dev,
        Activation::Gelu,
        &t(DType::BF16, &[0, 32]),
        None,
        &mut t(DType::BF16, &[0, 32]),
        None,
    )
    .unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
    let e =
        activation::backward(&dev, Activation::Gelu, &x, &t(DType::F16, &[4, 32]), &mut t(DType::BF16, &[4, 32]), None)
            .unwrap_err();
    assert!(matches!(e, Error::DType { arg: "x", .. }), "{e}");
}
