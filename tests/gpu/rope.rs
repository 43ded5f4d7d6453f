//! Family 9 on the GPU: RoPE forward and backward against the CPU reference for f32, bf16 and
//! f16, both formats, full (d2 = d) and partial (d2 < d) rotation at d = 64 and 128, an odd half
//! (d2 = 30: scalar accesses), odd s and b, more rows per position than one block work item,
//! more positions than the grid (grid-stride), TE's angles (equal halves) and random ones
//! (unequal halves: the backward must be the transpose); and typed errors.
//!
//! Tolerance: the kernel's `sincosf` and the host's `sin_cos` differ by up to 2 f32 ulps, the
//! rest of the math is mirrored operation for operation. With |t| ≲ 10 that is ≲ 5e-6 absolute
//! before the final rounding, so outputs agree within atol 1e-5 plus one ulp of the output dtype
//! (rtol 2^-7 bf16, 2^-10 f16, 1e-6 f32). Channels past d2 are copies: compared bit for bit.

use crate::common::{assert_close, device, randn};
use te_reference::rope as reference;
use te_runtime::numerics;
use te_runtime::ops::rope::{backward, forward, RopeFormat};
use te_runtime::{DType, Device, Error, Tensor};

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
const FORMATS: [RopeFormat; 2] = [RopeFormat::Sbhd, RopeFormat::Bshd];

fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::BF16 => (2f32.powi(-7), 1e-5),
        DType::F16 => (2f32.powi(-10), 1e-5),
        _ => (1e-6, 1e-5),
    }
}

/// TE's angles for `s_f` positions: `p · 10000^(-2j/d2)`, `j < d2/2`, repeated for both halves.
fn te_freqs(s_f: usize, d2: usize) -> Vec<f32> {
    let half = d2 / 2;
    (0..s_f)
        .flat_map(|p| (0..d2).map(move |c| p as f32 * 10000f32.powf(-2.0 * (c % half) as f32 / d2 as f32)))
        .collect()
}

/// One rotation problem: `[s, b, h, d]` sizes, `d2`, the angles and the shape `freqs` is given in.
struct Case {
    s: usize,
    b: usize,
    h: usize,
    d: usize,
    d2: usize,
    freqs: Vec<f32>,
    freqs_shape: Vec<usize>,
}

impl Case {
    fn te(s: usize, b: usize, h: usize, d: usize, d2: usize) -> Case {
        Case { s, b, h, d, d2, freqs: te_freqs(s, d2), freqs_shape: vec![s, d2] }
    }

    /// Random angles in about ±12 rad (the halves differ), for `s + 3` positions, in TE's
    /// `[s_f, 1, 1, d2]` shape.
    fn random(seed: u64, s: usize, b: usize, h: usize, d: usize, d2: usize) -> Case {
        let freqs = randn(seed, (s + 3) * d2, 4.0);
        Case { s, b, h, d, d2, freqs, freqs_shape: vec![s + 3, 1, 1, d2] }
    }

    fn shape(&self, format: RopeFormat) -> [usize; 4] {
        match format {
            RopeFormat::Sbhd => [self.s, self.b, self.h, self.d],
            RopeFormat::Bshd => [self.b, self.s, self.h, self.d],
        }
    }

    /// Runs forward and backward on the GPU and checks both against the reference.
    fn check(&self, dev: &Device, format: RopeFormat, dtype: DType, seed: u64) {
        let shape = self.shape(format);
        let n = shape.iter().product();
        let freqs = Tensor::from_f32(dev, DType::F32, &self.freqs_shape, &self.freqs).unwrap();
        let what = format!("{format} {dtype} {shape:?} d2 = {}", self.d2);
        for (dir, seed) in [("forward", seed), ("backward", seed + 1)] {
            let x: Vec<f32> = randn(seed, n, 2.0).into_iter().map(|v| numerics::round_to(dtype, v)).collect();
            let xt = Tensor::from_f32(dev, dtype, &shape, &x).unwrap();
            let mut yt = Tensor::zeros(dev, dtype, &shape).unwrap();
            let want = if dir == "forward" {
                forward(dev, format, &xt, &freqs, &mut yt).unwrap();
                reference::forward(&x, &self.freqs, format, shape, self.d2, dtype)
            } else {
                backward(dev, format, &xt, &freqs, &mut yt).unwrap();
                reference::backward(&x, &self.freqs, format, shape, self.d2, dtype)
            };
            let got = yt.to_f32(dev).unwrap();
            let (rtol, atol) = tolerance(dtype);
            assert_close(&format!("rope {dir} {what}"), &got, &want, rtol, atol);
            for (i, (g, w)) in got.iter().zip(&x).enumerate().filter(|(i, _)| i % self.d >= self.d2) {
                assert_eq!(
                    g.to_bits(),
                    w.to_bits(),
                    "rope {dir} {what}: channel {} of row {} is not copied",
                    i % self.d,
                    i / self.d
                );
            }
        }
    }
}

#[test]
fn full_and_partial_rotation_match_the_reference() {
    let Some(dev) = device() else { return };
    let mut seed = 1;
    for dtype in DTYPES {
        for format in FORMATS {
            for (d, d2) in [(64, 64), (64, 32), (128, 128), (128, 64)] {
                Case::te(7, 3, 5, d, d2).check(&dev, format, dtype, seed);
                Case::random(seed + 100, 5, 3, 2, d, d2).check(&dev, format, dtype, seed + 2);
                seed += 4;
            }
            // An odd half (scalar accesses, 65 jobs per row).
            Case::random(seed + 100, 3, 5, 3, 80, 30).check(&dev, format, dtype, seed);
            seed += 4;
        }
    }
}

#[test]
fn many_rows_per_position_and_many_positions() {
    let Some(dev) = device() else { return };
    for format in FORMATS {
        // b·h = 155 rows per position: two work items each (128 rows per item for bf16 d = 128).
        Case::te(9, 5, 31, 128, 128).check(&dev, format, DType::BF16, 500);
        // 5001 positions of one row: more work items than the grid has blocks.
        Case::random(501, 5001, 1, 1, 64, 64).check(&dev, format, DType::F32, 502);
        // A training-sized slice: s = 257, b = 3, h = 16, d = 128.
        Case::te(257, 3, 16, 128, 128).check(&dev, format, DType::BF16, 503);
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let (s, b, h, d) = (6, 2, 3, 128);
    let t = Tensor::zeros(&dev, DType::BF16, &[s, b, h, d]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[s, b, h, d]).unwrap();
    let freqs = |shape: &[usize]| Tensor::zeros(&dev, DType::F32, shape).unwrap();
    let sbhd = RopeFormat::Sbhd;
    let shape_err = |r: te_runtime::Result<()>, needle: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(needle), "{needle}: {e}");
    };

    shape_err(forward(&dev, sbhd, &t, &freqs(&[s, 63]), &mut out), "d2 = 63");
    shape_err(forward(&dev, sbhd, &t, &freqs(&[s, 256]), &mut out), "d2 = 256");
    shape_err(backward(&dev, sbhd, &t, &freqs(&[s, 0]), &mut out), "d2 = 0");
    shape_err(forward(&dev, sbhd, &t, &freqs(&[s - 1, 128]), &mut out), "at least 6");
    shape_err(forward(&dev, sbhd, &t, &freqs(&[s, 2, 1, 128]), &mut out), "[s, 1, 1, d2]");
    shape_err(forward(&dev, sbhd, &t, &freqs(&[s * 128]), &mut out), "[s, d2]");
    // In bshd the sequence is dim 1: 2 positions need only 2 rows of angles.
    forward(&dev, RopeFormat::Bshd, &t, &freqs(&[2, 1, 1, 128]), &mut out).unwrap();
    shape_err(forward(&dev, RopeFormat::Bshd, &t, &freqs(&[1, 128]), &mut out), "s = 2");

    let flat = Tensor::zeros(&dev, DType::BF16, &[s * b, h, d]).unwrap();
    shape_err(forward(&dev, sbhd, &flat, &freqs(&[s, 128]), &mut out), "4-D [s, b, h, d]");
    let mut other = Tensor::zeros(&dev, DType::BF16, &[s, b, h + 1, d]).unwrap();
    shape_err(forward(&dev, sbhd, &t, &freqs(&[s, 128]), &mut other), "`out`");
    let huge = Tensor::zeros(&dev, DType::BF16, &[1, 1, 1, 2048]).unwrap();
    let mut huge_out = Tensor::zeros(&dev, DType::BF16, &[1, 1, 1, 2048]).unwrap();
    shape_err(forward(&dev, sbhd, &huge, &freqs(&[1, 128]), &mut huge_out), "d = 2048");
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, b, h, d]).unwrap();
    let mut empty_out = Tensor::zeros(&dev, DType::BF16, &[0, b, h, d]).unwrap();
    shape_err(forward(&dev, sbhd, &empty, &freqs(&[s, 128]), &mut empty_out), "no elements");

    let bf16_freqs = Tensor::zeros(&dev, DType::BF16, &[s, 128]).unwrap();
    let e = forward(&dev, sbhd, &t, &bf16_freqs, &mut out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "freqs", .. }), "{e}");
    let mut f32_out = Tensor::zeros(&dev, DType::F32, &[s, b, h, d]).unwrap();
    let e = backward(&dev, sbhd, &t, &freqs(&[s, 128]), &mut f32_out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "dt", .. }), "{e}");
    let q = Tensor::zeros(&dev, DType::E4M3, &[s, b, h, d]).unwrap();
    let e = forward(&dev, sbhd, &q, &freqs(&[s, 128]), &mut out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "t", .. }), "{e}");
}
