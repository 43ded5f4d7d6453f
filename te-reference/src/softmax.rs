//! Family 6 reference: scaled softmax (no mask, causal, padding) and its backward, with the
//! kernels' f32 element operations. Row sums accumulate in f64 and are rounded to f32 once: the
//! kernels' tree-ordered f32 sums are within a few ulps of that, so the reference's own
//! summation error (up to `sk` ulps sequentially) does not eat the test tolerance.

use te_codegen::spec::MaskKind;

/// Whether key `key` of row `row` is attended.
///
/// `rows` of `sk` keys are laid out `[batch, heads, sq]`: row `r` is query `r % sq` of batch
/// `r / (heads * sq)`. Causal: keys `j <= query`. Padding: `mask[batch][query][key] == 0`.
fn attends(kind: MaskKind, mask: &[u8], (heads, sq, sk): (usize, usize, usize), row: usize, key: usize) -> bool {
    let query = row % sq;
    match kind {
        MaskKind::None => true,
        MaskKind::Causal => key <= query,
        MaskKind::Padding => mask[((row / (heads * sq)) * sq + query) * sk + key] == 0,
    }
}

/// `y = softmax(scale * x)` over each row of `sk` keys of `x: [batch, heads, sq, sk]`
/// (`heads`, `sq` locate each row's batch and query). Masked keys give exactly 0; a fully masked
/// row gives zeros. `mask` is `[batch, sq, sk]` (nonzero = masked out) for
/// [`MaskKind::Padding`] and ignored otherwise.
///
/// # Panics
/// If the lengths do not match the shapes (caller bugs).
pub fn forward(x: &[f32], kind: MaskKind, mask: &[u8], heads: usize, sq: usize, sk: usize, scale: f32) -> Vec<f32> {
    assert!(sk > 0 && x.len() % (heads * sq * sk) == 0, "x is not [batch, {heads}, {sq}, {sk}]");
    if kind == MaskKind::Padding {
        assert_eq!(mask.len(), x.len() / heads, "mask is not [batch, sq, sk]");
    }
    let mut y = vec![0.0f32; x.len()];
    for (row, (xr, yr)) in x.chunks_exact(sk).zip(y.chunks_exact_mut(sk)).enumerate() {
        let v: Vec<f32> = xr
            .iter()
            .enumerate()
            .map(|(j, &xv)| if attends(kind, mask, (heads, sq, sk), row, j) { xv * scale } else { f32::NEG_INFINITY })
            .collect();
        let max = v.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
        if max == f32::NEG_INFINITY {
            continue; // every key masked: zeros
        }
        let e: Vec<f32> = v.iter().map(|&a| (a - max).exp()).collect();
        let sum = e.iter().map(|&v| v as f64).sum::<f64>() as f32;
        for (o, &ej) in yr.iter_mut().zip(&e) {
            *o = ej / sum;
        }
    }
    y
}

/// `dx = scale * (dy*y - y * Σ_j dy_j y_j)` per row of `sk` keys, each operation rounded in f32
/// as the kernel does (the sum of the f32 products `dy_j y_j` in f64).
///
/// # Panics
/// If `dy` and `y` differ in length or are not whole rows (caller bugs).
pub fn backward(dy: &[f32], y: &[f32], sk: usize, scale: f32) -> Vec<f32> {
    assert!(sk > 0 && dy.len() == y.len() && dy.len() % sk == 0, "dy/y are not rows of {sk}");
    let mut dx = vec![0.0f32; dy.len()];
    for ((g, p), out) in dy.chunks_exact(sk).zip(y.chunks_exact(sk)).zip(dx.chunks_exact_mut(sk)) {
        let gy: Vec<f32> = g.iter().zip(p).map(|(&a, &b)| a * b).collect();
        let sum = gy.iter().map(|&v| v as f64).sum::<f64>() as f32;
        for ((o, &gyj), &pj) in out.iter_mut().zip(&gy).zip(p) {
            *o = scale * (gyj - pj * sum);
        }
    }
    dx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scores(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 101) as f32 - 50.0) * 0.09).collect()
    }

    #[test]
    fn rows_sum_to_one_and_masked_keys_are_zero() {
        let (batch, heads, sq, sk) = (2, 3, 5, 7);
        let x = scores(batch * heads * sq * sk);
        let mut mask = vec![0u8; batch * sq * sk];
        for (i, m) in mask.iter_mut().enumerate() {
            *m = u8::from(i % 3 == 0);
        }
        mask[sq * sk..sq * sk + sk].fill(1); // batch 1, query 0: fully masked
        for kind in [MaskKind::None, MaskKind::Causal, MaskKind::Padding] {
            let y = forward(&x, kind, &mask, heads, sq, sk, 0.7);
            for (row, yr) in y.chunks_exact(sk).enumerate() {
                let b = row / (heads * sq);
                let q = row % sq;
                let fully_masked = kind == MaskKind::Padding && b == 1 && q == 0;
                let s: f32 = yr.iter().sum();
                if fully_masked {
                    assert!(yr.iter().all(|&v| v == 0.0), "{kind:?} row {row}: {yr:?}");
                } else {
                    assert!((s - 1.0).abs() < 1e-6, "{kind:?} row {row} sums to {s}");
                }
                for (j, &v) in yr.iter().enumerate() {
                    let masked = match kind {
                        MaskKind::None => false,
                        MaskKind::Causal => j > q,
                        MaskKind::Padding => mask[(b * sq + q) * sk + j] != 0,
                    };
                    if masked {
                        assert_eq!(v, 0.0, "{kind:?} row {row} key {j}");
                    } else if !fully_masked {
                        assert!(v > 0.0, "{kind:?} row {row} key {j}");
                    }
                }
            }
        }
    }

    #[test]
    fn forward_is_shift_invariant_and_matches_f64() {
        let sk = 33;
        let x = scores(sk);
        let shifted: Vec<f32> = x.iter().map(|v| v + 3.0).collect();
        let a = forward(&x, MaskKind::None, &[], 1, 1, sk, 1.0);
        let b = forward(&shifted, MaskKind::None, &[], 1, 1, sk, 1.0);
        let z: f64 = x.iter().map(|&v| (v as f64).exp()).sum();
        for ((&p, &q), &v) in a.iter().zip(&b).zip(&x) {
            assert!((p - q).abs() < 1e-6);
            assert!((p as f64 - (v as f64).exp() / z).abs() < 1e-6);
        }
    }

    /// `dx` is the gradient of `Σ dy · softmax(scale * x)`, by central differences in f64.
    #[test]
    fn backward_matches_finite_differences() {
        let (sq, sk, scale) = (4, 9, 0.8);
        let x = scores(sq * sk);
        let dy: Vec<f32> = (0..sq * sk).map(|i| ((i * 31 % 13) as f32 - 6.0) * 0.3).collect();
        for kind in [MaskKind::None, MaskKind::Causal] {
            let y = forward(&x, kind, &[], 1, sq, sk, scale);
            let dx = backward(&dy, &y, sk, scale);
            let loss = |x: &[f32]| -> f64 {
                forward(x, kind, &[], 1, sq, sk, scale).iter().zip(&dy).map(|(&p, &g)| p as f64 * g as f64).sum()
            };
            for i in 0..x.len() {
                let h = 1e-2f32;
                let (mut xp, mut xm) = (x.clone(), x.clone());
                xp[i] += h;
                xm[i] -= h;
                let fd = (loss(&xp) - loss(&xm)) / (2.0 * h as f64);
                assert!((fd - dx[i] as f64).abs() < 1e-3, "{kind:?} x[{i}]: fd {fd} vs {}", dx[i]);
                if kind == MaskKind::Causal && i % sk > i / sk {
                    assert_eq!(dx[i], 0.0, "masked key has a gradient");
                }
            }
        }
    }
}
