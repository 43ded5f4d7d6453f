//! Family 8 on the GPU: `add` and `add_assign` for every mix of f32/bf16/f16, bit-exact against
//! the CPU reference on random data with fixed seeds, at sizes that leave a scalar tail after the
//! vectors, with values that probe rounding ties, overflow, subnormals and signed zeros (no NaN:
//! the GPU writes the canonical NaN, see `reference::elementwise`); and typed errors.

use crate::common::{assert_bits_eq, device, randn};
use te_reference::elementwise as reference;
use te_runtime::numerics;
use te_runtime::ops::elementwise::{add, add_assign, scale_assign};
use te_runtime::{DType, Error, Tensor};

/// Sizes: one element (tail only), less than one vector, and vector multiples plus 3.
const SIZES: [usize; 4] = [1, 7, 4099, (1 << 20) + 3];
const HIGH_PRECISION: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// `n` values `~ N(0, std)` rounded to `dtype`, the first ones replaced by `specials` (rounded
/// too) when they fit: what the kernel reads.
fn input(dtype: DType, seed: u64, n: usize, specials: &[f32]) -> Vec<f32> {
    let mut v = randn(seed, n, 2.0);
    if n >= 64 {
        v[..specials.len()].copy_from_slice(specials);
    }
    v.into_iter().map(|x| numerics::round_to(dtype, x)).collect()
}

/// Operand pairs whose sums tie in bf16, overflow f16 (and f32), stay subnormal, cancel to +0
/// or keep -0, or are infinite.
fn specials() -> (Vec<f32>, Vec<f32>) {
    let p = |e: i32| 2f32.powi(e);
    let a = vec![1.0, 1.0, 1.0, 60000.0, -60000.0, -0.0, 1.0, f32::INFINITY, 65504.0, 3e38, 1e-40, p(-24), 0.5];
    let b = vec![p(-8), 3.0 * p(-8), p(-11), 10000.0, -10000.0, -0.0, -1.0, 1.0, 16.0, 3e38, 1e-40, p(-25), p(-12)];
    (a, b)
}

#[test]
fn add_is_bit_exact_for_every_dtype_mix() {
    let Some(dev) = device() else { return };
    let (sa, sb) = specials();
    for (i, &n) in SIZES.iter().enumerate() {
        for a_t in HIGH_PRECISION {
            for b_t in HIGH_PRECISION {
                for out_t in HIGH_PRECISION {
                    let a = input(a_t, 100 + i as u64, n, &sa);
                    let b = input(b_t, 200 + i as u64, n, &sb);
                    let at = Tensor::from_f32(&dev, a_t, &[n], &a).unwrap();
                    let bt = Tensor::from_f32(&dev, b_t, &[n], &b).unwrap();
                    let mut out = Tensor::zeros(&dev, out_t, &[n]).unwrap();
                    add(&dev, &at, &bt, &mut out).unwrap();
                    let want = numerics::encode(out_t, &reference::add(&a, &b, out_t));
                    assert_bits_eq(
                        &format!("add {a_t} + {b_t} -> {out_t}, n = {n}"),
                        &out.to_bytes(&dev).unwrap(),
                        &want,
                    );
                }
            }
        }
    }
}

#[test]
fn add_assign_is_bit_exact_for_every_dst_src_pair() {
    let Some(dev) = device() else { return };
    let (sa, sb) = specials();
    for (i, &n) in SIZES.iter().enumerate() {
        for dst_t in HIGH_PRECISION {
            for src_t in HIGH_PRECISION {
                let mut want = input(dst_t, 300 + i as u64, n, &sa);
                let mut dst = Tensor::from_f32(&dev, dst_t, &[n], &want).unwrap();
                // Two accumulations into the same dst (gradient accumulation over micro-batches).
                for step in 0..2u64 {
                    let s = input(src_t, 400 + 10 * i as u64 + step, n, &sb);
                    let src = Tensor::from_f32(&dev, src_t, &[n], &s).unwrap();
                    add_assign(&dev, &mut dst, &src).unwrap();
                    reference::add_assign(&mut want, dst_t, &s);
                }
                let what = format!("add_assign {dst_t} += {src_t}, n = {n}");
                assert_bits_eq(&what, &dst.to_bytes(&dev).unwrap(), &numerics::encode(dst_t, &want));
            }
        }
    }
}

/// `scale_assign` (Gemma's embedding multiplier, 25.25 in BF16) bit for bit, every dtype and
/// size, with the specials (overflow to inf, subnormals, signed zeros); a non-finite alpha is
/// refused.
#[test]
fn scale_assign_is_bit_exact() {
    let Some(dev) = device() else { return };
    let (a, _) = specials();
    for dtype in HIGH_PRECISION {
        for (i, &n) in SIZES.iter().enumerate() {
            for alpha in [25.25f32, -0.5, 3e-3] {
                let mut want = input(dtype, 50 + i as u64, n, &a);
                let mut t = Tensor::from_f32(&dev, dtype, &[n], &want).unwrap();
                scale_assign(&dev, &mut t, alpha).unwrap();
                reference::scale_assign(&mut want, dtype, alpha);
                let want_t = Tensor::from_f32(&dev, dtype, &[n], &want).unwrap();
                assert_bits_eq(
                    &format!("scale_assign {dtype} n={n} alpha={alpha}"),
                    &t.to_bytes(&dev).unwrap(),
                    &want_t.to_bytes(&dev).unwrap(),
                );
            }
        }
    }
    let mut t = Tensor::zeros(&dev, DType::BF16, &[4]).unwrap();
    assert!(matches!(scale_assign(&dev, &mut t, f32::NAN).unwrap_err(), Error::Argument { .. }));
}

#[test]
fn add_takes_any_rank_and_the_same_tensor_twice() {
    let Some(dev) = device() else { return };
    let shape = [3, 5, 7];
    let x = input(DType::BF16, 500, 105, &[]);
    let xt = Tensor::from_f32(&dev, DType::BF16, &shape, &x).unwrap();
    let mut out = Tensor::zeros(&dev, DType::F32, &shape).unwrap();
    add(&dev, &xt, &xt, &mut out).unwrap();
    let want = numerics::encode(DType::F32, &reference::add(&x, &x, DType::F32));
    assert_bits_eq("add x + x", &out.to_bytes(&dev).unwrap(), &want);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let a = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let b = Tensor::zeros(&dev, DType::F32, &[4, 8]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();

    let flat = Tensor::zeros(&dev, DType::F32, &[32]).unwrap();
    let e = add(&dev, &a, &flat, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`b` must have shape [4, 8]"), "{e}");
    let mut wide = Tensor::zeros(&dev, DType::BF16, &[4, 16]).unwrap();
    let e = add(&dev, &a, &b, &mut wide).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`out`"), "{e}");

    let q = Tensor::zeros(&dev, DType::E4M3, &[4, 8]).unwrap();
    let e = add(&dev, &q, &b, &mut out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "a", .. }) && e.to_string().contains("dequantize"), "{e}");
    let mut q_out = Tensor::zeros(&dev, DType::E5M2, &[4, 8]).unwrap();
    let e = add(&dev, &a, &b, &mut q_out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out", .. }), "{e}");

    let mut dst = Tensor::zeros(&dev, DType::F32, &[4, 8]).unwrap();
    let e = add_assign(&dev, &mut dst, &q).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "src", .. }), "{e}");
    let e = add_assign(&dev, &mut q_out, &a).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "dst", .. }), "{e}");
    let e = add_assign(&dev, &mut dst, &flat).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`src`"), "{e}");

    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let mut empty_out = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let e = add(&dev, &empty, &empty, &mut empty_out).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
    let e = add_assign(&dev, &mut empty_out, &empty).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
}

/// `add_assign_rows` (the ring's sums of a span's gradients): rows `row..row + n` of `dst` get
/// `src` added, bit for bit as `add_assign` on them, the other rows untouched; a span that does
/// not fit or is misaligned is refused.
#[test]
fn add_assign_rows_adds_into_a_span_of_rows() {
    use te_runtime::ops::elementwise::add_assign_rows;
    let Some(dev) = device() else { return };
    for (dst_t, src_t) in [(DType::BF16, DType::BF16), (DType::F32, DType::BF16)] {
        let (rows, width) = (10, 2 * 3 * 8);
        let d = input(dst_t, 31, rows * width, &[]);
        let s = input(src_t, 32, 4 * width, &[]);
        let mut dst = Tensor::from_f32(&dev, dst_t, &[rows, 2, 3, 8], &d).unwrap();
        let src = Tensor::from_f32(&dev, src_t, &[4, 2, 3, 8], &s).unwrap();
        add_assign_rows(&dev, &mut dst, 5, &src).unwrap();
        let mut want = d.clone();
        let mut span = want[5 * width..9 * width].to_vec();
        reference::add_assign(&mut span, dst_t, &s);
        want[5 * width..9 * width].copy_from_slice(&span);
        let what = format!("{dst_t} += {src_t} at row 5");
        assert_bits_eq(&what, &dst.to_bytes(&dev).unwrap(), &numerics::encode(dst_t, &want));
        let err = add_assign_rows(&dev, &mut dst, 7, &src).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }), "{err}");
    }
    let mut odd = Tensor::zeros(&dev, DType::BF16, &[4, 3]).unwrap();
    let src = Tensor::zeros(&dev, DType::BF16, &[1, 3]).unwrap();
    let err = add_assign_rows(&dev, &mut odd, 1, &src).unwrap_err();
    assert!(err.to_string().contains("16-byte"), "{err}");
}
