//! Family 9 reference: RoPE forward and backward, mirroring `te-codegen/templates/rope.cu.tera` operation
//! for operation: `fma(a, cos, round(rot · sin))` in f32, rounded once to the output dtype;
//! channels past `d2` copied. The sines and cosines come from the host's `sin_cos` where the
//! kernel uses CUDA's `sincosf` (within 2 ulps), so outputs agree within a few f32 ulps of the
//! terms before the final rounding (see `tests/gpu/rope.rs` for the tolerance).

use te_codegen::spec::{Direction, RopeFormat};
use te_codegen::DType;
use te_runtime::numerics::round_to;

/// `out` of `ops::rope::forward`: `x` holds `shape` (`[s, b, h, d]` for [`RopeFormat::Sbhd`],
/// `[b, s, h, d]` for [`RopeFormat::Bshd`]) values of its dtype, `freqs` is `[s_f, d2]` row-major
/// with `s_f >= s`; the result is rounded to `out` (returned widened to f32).
///
/// # Panics
/// If the lengths do not match the shapes or `d2` is odd or above `d` (caller bugs).
pub fn forward(x: &[f32], freqs: &[f32], format: RopeFormat, shape: [usize; 4], d2: usize, out: DType) -> Vec<f32> {
    rotate(Direction::Fwd, x, freqs, format, shape, (d2, out))
}

/// `dt` of `ops::rope::backward`, the transpose of [`forward`]: arguments as there, `dout` for
/// `x`, rounded to `dt`.
///
/// # Panics
/// As [`forward`].
pub fn backward(dout: &[f32], freqs: &[f32], format: RopeFormat, shape: [usize; 4], d2: usize, dt: DType) -> Vec<f32> {
    rotate(Direction::Bwd, dout, freqs, format, shape, (d2, dt))
}

fn rotate(
    direction: Direction,
    x: &[f32],
    freqs: &[f32],
    format: RopeFormat,
    [d0, d1, h, d]: [usize; 4],
    (d2, dtype): (usize, DType),
) -> Vec<f32> {
    let (s, b) = match format {
        RopeFormat::Sbhd => (d0, d1),
        RopeFormat::Bshd => (d1, d0),
    };
    assert_eq!(x.len(), s * b * h * d, "x is not {:?}", [d0, d1, h, d]);
    assert!(d2 % 2 == 0 && d2 <= d && freqs.len() >= s * d2, "freqs is not [>= {s}, {d2}] with an even d2 <= {d}");
    let half = d2 / 2;
    let sin_cos: Vec<(f32, f32)> = freqs[..s * d2].iter().map(|f| f.sin_cos()).collect();
    let mut y = x.to_vec(); // channels d2..d pass through
    for (row, (xr, yr)) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).enumerate() {
        let p = match format {
            RopeFormat::Sbhd => row / (b * h),
            RopeFormat::Bshd => (row / h) % s,
        };
        let sc = &sin_cos[p * d2..(p + 1) * d2];
        for c in 0..half {
            let ((sa, ca), (sb, cb)) = (sc[c], sc[c + half]);
            let (xa, xb) = (xr[c], xr[c + half]);
            let (ya, yb) = match direction {
                Direction::Fwd => (xa.mul_add(ca, -xb * sa), xb.mul_add(cb, xa * sb)),
                Direction::Bwd => (xa.mul_add(ca, xb * sb), xb.mul_add(cb, xa * -sa)),
            };
            yr[c] = round_to(dtype, ya);
            yr[c + half] = round_to(dtype, yb);
        }
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::f32::consts::FRAC_PI_2;

    /// TE's angles: `p · 10000^(-2j/d2)` for `j < d2/2`, the same for both halves.
    fn te_freqs(s: usize, d2: usize) -> Vec<f32> {
        let half = d2 / 2;
        (0..s)
            .flat_map(|p| (0..d2).map(move |c| p as f32 * 10000f32.powf(-2.0 * (c % half) as f32 / d2 as f32)))
            .collect()
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 211) as f32 - 105.0) / 37.0).collect()
    }

    #[test]
    fn a_quarter_turn_rotates_each_pair_and_copies_the_tail() {
        // d = 6, d2 = 4: pairs (0, 2) and (1, 3) rotate, channels 4 and 5 are copied.
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let freqs = [FRAC_PI_2; 4];
        let y = forward(&x, &freqs, RopeFormat::Sbhd, [1, 1, 1, 6], 4, DType::F32);
        // (a, b) -> (a cos - b sin, b cos + a sin) = (-b, a).
        let want = [-3.0, -4.0, 1.0, 2.0, 5.0, 6.0];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{y:?}");
        }
        // The backward rotates by -θ: (a, b) -> (b, -a).
        let g = backward(&x, &freqs, RopeFormat::Sbhd, [1, 1, 1, 6], 4, DType::F32);
        for (g, w) in g.iter().zip([3.0, 4.0, -1.0, -2.0, 5.0, 6.0]) {
            assert!((g - w).abs() < 1e-6, "{g:?}");
        }
    }

    #[test]
    fn backward_undoes_forward_for_te_angles() {
        let (s, b, h, d, d2) = (5, 3, 2, 16, 12);
        let x = values(s * b * h * d);
        let freqs = te_freqs(s, d2);
        let y = forward(&x, &freqs, RopeFormat::Sbhd, [s, b, h, d], d2, DType::F32);
        let back = backward(&y, &freqs, RopeFormat::Sbhd, [s, b, h, d], d2, DType::F32);
        for (i, (&a, &w)) in back.iter().zip(&x).enumerate() {
            assert!((a - w).abs() <= 1e-5 * (1.0 + w.abs()), "element {i}: {a} vs {w}");
        }
        assert_ne!(y, x);
    }

    #[test]
    fn backward_is_the_transpose_for_any_angles() {
        // <forward(x), g> = <x, backward(g)> also when the two halves' angles differ.
        let (s, b, h, d, d2) = (3, 2, 2, 8, 8);
        let n = s * b * h * d;
        let (x, g) = (values(n), values(n + 5)[5..].to_vec());
        let freqs: Vec<f32> = values(s * d2 + 3)[3..].to_vec();
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(&p, &q)| p as f64 * q as f64).sum::<f64>();
        let fx = forward(&x, &freqs, RopeFormat::Bshd, [b, s, h, d], d2, DType::F32);
        let bg = backward(&g, &freqs, RopeFormat::Bshd, [b, s, h, d], d2, DType::F32);
        let (l, r) = (dot(&fx, &g), dot(&x, &bg));
        assert!((l - r).abs() < 1e-4 * l.abs().max(1.0), "{l} vs {r}");
    }

    #[test]
    fn bshd_matches_sbhd_after_the_transpose_and_rounds_to_the_dtype() {
        let (s, b, h, d) = (4, 3, 2, 8);
        let x_sbhd = values(s * b * h * d).into_iter().map(|v| round_to(DType::BF16, v)).collect::<Vec<_>>();
        let freqs = te_freqs(s + 2, d); // more positions than s: the first s rows are used
                                        // [s, b, h, d] -> [b, s, h, d]
        let row = h * d;
        let to_bshd = |v: &[f32]| {
            let mut o = vec![0.0; v.len()];
            for (si, bi) in (0..s).flat_map(|si| (0..b).map(move |bi| (si, bi))) {
                o[(bi * s + si) * row..][..row].copy_from_slice(&v[(si * b + bi) * row..][..row]);
            }
            o
        };
        let y_sbhd = forward(&x_sbhd, &freqs, RopeFormat::Sbhd, [s, b, h, d], d, DType::BF16);
        let y_bshd = forward(&to_bshd(&x_sbhd), &freqs, RopeFormat::Bshd, [b, s, h, d], d, DType::BF16);
        assert_eq!(to_bshd(&y_sbhd), y_bshd);
        assert!(y_sbhd.iter().all(|&v| v == round_to(DType::BF16, v)));
    }
}
