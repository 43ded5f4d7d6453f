//! Family 21 on the GPU: the row-wise argmax against the CPU reference, bit for bit: f32, bf16
//! and f16, Gemma's vocabulary of 262 144 and odd widths, many ties (few distinct values), a row
//! of −inf, a NaN row (−1), more rows than the grid; typed errors.

use crate::common::{device, randn};
use te_reference::argmax::argmax as reference;
use te_runtime::graph::HostCopies;
use te_runtime::numerics::round_to;
use te_runtime::ops::argmax::argmax;
use te_runtime::{DType, Error, Tensor};

#[test]
fn argmax_matches_the_reference() {
    let Some(dev) = device() else { return };
    for (dtype, rows, cols, seed) in [
        (DType::BF16, 3, 262_144, 1),
        (DType::F32, 5, 1000, 2),
        (DType::F16, 70_000, 33, 3),
        (DType::BF16, 32, 151_936, 4),
    ] {
        // Coarse values (BF16 of N(0, 4) rounded to 0.5): many ties.
        let mut x: Vec<f32> =
            randn(seed, rows * cols, 4.0).into_iter().map(|v| round_to(dtype, (v * 2.0).round() / 2.0)).collect();
        x[..cols].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        if rows > 2 {
            x[2 * cols + 7] = f32::NAN;
        }
        let t = Tensor::from_f32(&dev, dtype, &[rows, cols], &x).unwrap();
        let mut out = dev.stream().htod(&vec![0i32; rows]).unwrap();
        argmax(&dev, &t, &mut out).unwrap();
        let got = dev.stream().dtoh(&out).unwrap();
        assert_eq!(got, reference(&x, cols), "{dtype} [{rows}, {cols}]");
        assert_eq!(got[0], 0, "a row of -inf: the first index");
    }
}

#[test]
fn argmax_refuses_bad_calls() {
    let Some(dev) = device() else { return };
    let t = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let mut short = dev.stream().htod(&[0i32; 3]).unwrap();
    assert!(matches!(argmax(&dev, &t, &mut short).unwrap_err(), Error::Shape { .. }));
    let e4 = Tensor::zeros(&dev, DType::E4M3, &[4, 16]).unwrap();
    let mut out = dev.stream().htod(&[0i32; 4]).unwrap();
    assert!(matches!(argmax(&dev, &e4, &mut out).unwrap_err(), Error::DType { .. }));
}
