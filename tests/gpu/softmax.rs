//! Family 6 on the GPU: scaled softmax forward (no mask, causal, padding) and backward against
//! the CPU reference, for bf16, f16 and f32 at sk = 77 (odd: scalar accesses), 1024 (one warp
//! per row) and 4096 (a 128-thread group per row), and typed errors.
//!
//! Tolerances: TE's for bf16 (rtol 1.6e-2 atol 1e-5) and f16 (rtol 1e-3 atol 1e-5). f32 uses
//! rtol 1e-5 atol 1e-6 instead of TE's 1.3e-6 / 1e-5: the kernel's `expf` may differ from Rust's
//! `exp` by 2 ulps and its tree-ordered f32 row sum by a few ulps from the reference's f64 sum
//! (relative error a few 1e-6), while an atol of 1e-5 would hide errors in probabilities of
//! ~1/4096. Masked keys must be exactly 0 and fully masked rows all zeros (checked exactly).

use crate::common::{assert_close, device, randn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_codegen::spec::MaskKind;
use te_reference::softmax as ref_softmax;
use te_runtime::numerics;
use te_runtime::ops::softmax::{self, Mask};
use te_runtime::{DType, Device, Error, Tensor};

const SCALE: f32 = 0.35;

fn tolerance(dtype: DType) -> (f32, f32) {
    match dtype {
        DType::BF16 => (1.6e-2, 1e-5),
        DType::F16 => (1e-3, 1e-5),
        _ => (1e-5, 1e-6),
    }
}

fn rounded(dtype: DType, v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| numerics::round_to(dtype, x)).collect()
}

/// A `[batch, sq, sk]` mask with ~30% of the keys masked (by bytes 1 and 255: any nonzero
/// masks) and batch `batch - 1`, query `sq / 2` fully masked.
fn padding_mask(seed: u64, batch: usize, sq: usize, sk: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut m: Vec<u8> = (0..batch * sq * sk)
        .map(|_| match rng.random_range(0..10) {
            0..=1 => 1,
            2 => 255,
            _ => 0,
        })
        .collect();
    let full = ((batch - 1) * sq + sq / 2) * sk;
    m[full..full + sk].fill(1);
    m
}

/// Whether key `j` of row `row` is masked out.
fn masked(kind: MaskKind, mask: &[u8], (heads, sq, sk): (usize, usize, usize), row: usize, j: usize) -> bool {
    let q = row % sq;
    match kind {
        MaskKind::None => false,
        MaskKind::Causal => j > q,
        MaskKind::Padding => mask[((row / (heads * sq)) * sq + q) * sk + j] != 0,
    }
}

/// Runs the forward on `[batch, heads, sq, sk]` scores and checks it against the reference;
/// masked keys must be exactly 0. Returns the GPU output (as f32) for further checks.
fn check_forward(
    dev: &Device,
    dtype: DType,
    kind: MaskKind,
    (batch, heads, sq, sk): (usize, usize, usize, usize),
    seed: u64,
) -> Vec<f32> {
    let n = batch * heads * sq * sk;
    let xv = rounded(dtype, randn(seed, n, 3.0));
    let maskv = padding_mask(seed + 1, batch, sq, sk);
    let mask_dev = dev.stream().clone_htod(&maskv).unwrap();
    let mask = match kind {
        MaskKind::None => Mask::None,
        MaskKind::Causal => Mask::Causal,
        MaskKind::Padding => Mask::Padding(&mask_dev),
    };
    let shape = [batch, heads, sq, sk];
    let x = Tensor::from_f32(dev, dtype, &shape, &xv).unwrap();
    let mut y = Tensor::zeros(dev, dtype, &shape).unwrap();
    softmax::forward(dev, &x, mask, SCALE, &mut y).unwrap();
    let got = y.to_f32(dev).unwrap();
    let want = rounded(dtype, ref_softmax::forward(&xv, kind, &maskv, heads, sq, sk, SCALE));
    let what = format!("softmax fwd {kind:?} {dtype} {shape:?}");
    let (rtol, atol) = tolerance(dtype);
    assert_close(&what, &got, &want, rtol, atol);
    for (i, &g) in got.iter().enumerate() {
        if masked(kind, &maskv, (heads, sq, sk), i / sk, i % sk) {
            assert!(g == 0.0, "{what}: masked element {i} is {g}, not 0");
        }
    }
    got
}

#[test]
fn forward_matches_reference_for_every_mask_dtype_and_width() {
    let Some(dev) = device() else { return };
    let mut seed = 10;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for sk in [77, 1024, 4096] {
            for kind in [MaskKind::None, MaskKind::Causal, MaskKind::Padding] {
                seed += 2;
                // sq = 19 with 3 heads and 2 batches: 114 rows, not a multiple of rows per block.
                check_forward(&dev, dtype, kind, (2, 3, 19, sk), seed);
            }
        }
    }
}

#[test]
fn causal_rows_see_exactly_their_prefix() {
    let Some(dev) = device() else { return };
    // sq = sk: every prefix length 1..=sk appears once; sq > sk: later rows see every key.
    for (sq, sk) in [(77, 77), (1024, 1024), (4096, 4096), (100, 64)] {
        let y = check_forward(&dev, DType::BF16, MaskKind::Causal, (1, 1, sq, sk), 99 + sk as u64);
        for (q, row) in y.chunks_exact(sk).enumerate() {
            let visible = (q + 1).min(sk);
            assert!(row[..visible].iter().all(|&p| p > 0.0), "causal row {q}: a visible key has probability 0");
            let s: f32 = row.iter().sum();
            assert!((s - 1.0).abs() < 0.02, "causal row {q} sums to {s}");
        }
    }
}

#[test]
fn fully_masked_padding_row_gives_zeros_not_nan() {
    let Some(dev) = device() else { return };
    for dtype in [DType::BF16, DType::F32] {
        for sk in [77, 1024, 4096] {
            let (batch, heads, sq) = (2, 2, 5);
            let y = check_forward(&dev, dtype, MaskKind::Padding, (batch, heads, sq, sk), 500 + sk as u64);
            // padding_mask fully masks query sq / 2 of the last batch, for every head.
            for h in 0..heads {
                let row = ((batch - 1) * heads + h) * sq + sq / 2;
                let r = &y[row * sk..(row + 1) * sk];
                assert!(r.iter().all(|&p| p == 0.0), "{dtype} sk={sk}: fully masked row {row} is not all zeros");
            }
            assert!(y.iter().all(|p| p.is_finite()), "{dtype} sk={sk}: non-finite output");
        }
    }
}

#[test]
fn backward_matches_reference() {
    let Some(dev) = device() else { return };
    let mut seed = 700;
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for sk in [77, 1024, 4096] {
            seed += 2;
            let (batch, heads, sq) = (2, 3, 19);
            let n = batch * heads * sq * sk;
            // y: a causal softmax output (so some probabilities are exactly 0), in the dtype.
            let xv = randn(seed, n, 3.0);
            let yv = rounded(dtype, ref_softmax::forward(&xv, MaskKind::Causal, &[], heads, sq, sk, SCALE));
            let gv = rounded(dtype, randn(seed + 1, n, 1.0));
            let shape = [batch, heads, sq, sk];
            let y = Tensor::from_f32(&dev, dtype, &shape, &yv).unwrap();
            let dy = Tensor::from_f32(&dev, dtype, &shape, &gv).unwrap();
            let mut dx = Tensor::zeros(&dev, dtype, &shape).unwrap();
            softmax::backward(&dev, &dy, &y, SCALE, &mut dx).unwrap();
            let got = dx.to_f32(&dev).unwrap();
            let want = rounded(dtype, ref_softmax::backward(&gv, &yv, sk, SCALE));
            let what = format!("softmax bwd {dtype} {shape:?}");
            let (rtol, atol) = tolerance(dtype);
            assert_close(&what, &got, &want, rtol, atol);
            for (i, (&g, &p)) in got.iter().zip(&yv).enumerate() {
                if p == 0.0 {
                    assert!(g == 0.0, "{what}: element {i} has y = 0 but dx = {g}");
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let x = Tensor::zeros(&dev, DType::BF16, &[2, 3, 4, 8]).unwrap();
    let mut y = Tensor::zeros(&dev, DType::BF16, &[2, 3, 4, 8]).unwrap();

    // The padding mask must be [batch, sq, sk] = 2 * 4 * 8 bytes.
    let short = dev.stream().alloc_zeros::<u8>(2 * 3 * 4 * 8).unwrap();
    let e = softmax::forward(&dev, &x, Mask::Padding(&short), 1.0, &mut y).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("= 64 bytes, got 192"), "{e}");

    let x3 = Tensor::zeros(&dev, DType::BF16, &[6, 4, 8]).unwrap();
    let mut y3 = Tensor::zeros(&dev, DType::BF16, &[6, 4, 8]).unwrap();
    let e = softmax::forward(&dev, &x3, Mask::None, 1.0, &mut y3).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("4-D"), "{e}");

    let wide = Tensor::zeros(&dev, DType::BF16, &[1, 1, 1, 16385]).unwrap();
    let mut wide_y = Tensor::zeros(&dev, DType::BF16, &[1, 1, 1, 16385]).unwrap();
    let e = softmax::forward(&dev, &wide, Mask::Causal, 1.0, &mut wide_y).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("16384"), "{e}");

    let mut y_f32 = Tensor::zeros(&dev, DType::F32, &[2, 3, 4, 8]).unwrap();
    let e = softmax::forward(&dev, &x, Mask::None, 1.0, &mut y_f32).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "y", .. }), "{e}");
    let mut y_shape = Tensor::zeros(&dev, DType::BF16, &[2, 3, 4, 16]).unwrap();
    let e = softmax::forward(&dev, &x, Mask::None, 1.0, &mut y_shape).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let fp8 = Tensor::zeros(&dev, DType::E4M3, &[2, 3, 4, 8]).unwrap();
    let e = softmax::forward(&dev, &fp8, Mask::None, 1.0, &mut y).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "x", .. }), "{e}");

    let e = softmax::backward(&dev, &x, &y_f32, 1.0, &mut y).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "y", .. }), "{e}");
    let e = softmax::backward(&dev, &x, &y, 1.0, &mut y_shape).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let mut empty_dx = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let e = softmax::backward(&dev, &empty, &empty, 1.0, &mut empty_dx).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
}
