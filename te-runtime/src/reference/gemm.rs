//! GEMM reference: the row-major `D[m, n] = A[m, k] · B[n, k]ᵀ` of [`crate::gemm::gemm`],
//! accumulated in f64, and its epilogues on the f32 product. FP8 operands enter dequantized
//! (codes × scale_inv, [`super::cast::dequantize`]); FP8 outputs are the quantized result
//! ([`super::cast::quantize`], whose amax is the GEMM's amax before scaling).

use super::activation::{dgelu, gelu};

/// `D[i, j] = Σ_k a[i, k] · b[j, k]` for row-major `a: [m, k]`, `b: [n, k]`, summed in f64 and
/// rounded once to f32.
///
/// # Panics
/// If `a` does not hold `m · k` values or `b` does not hold `n · k` (caller bugs).
pub fn gemm_tn(a: &[f32], b: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    assert_eq!(a.len(), m * k, "a must be [m, k]");
    assert_eq!(b.len(), n * k, "b must be [n, k]");
    let dot = |i: usize, j: usize| {
        let (x, y) = (&a[i * k..(i + 1) * k], &b[j * k..(j + 1) * k]);
        x.iter().zip(y).map(|(&x, &y)| x as f64 * y as f64).sum::<f64>() as f32
    };
    (0..m).flat_map(|i| (0..n).map(move |j| dot(i, j))).collect()
}

/// `x[i, j] + bias[j]` for `x: [rows, n]` and `bias: [n]` (the `Bias` epilogue).
///
/// # Panics
/// If `x` is not a whole number of rows of `bias.len()` (caller bug).
pub fn add_bias(x: &[f32], bias: &[f32]) -> Vec<f32> {
    assert!(!bias.is_empty() && x.len() % bias.len() == 0, "x must be [rows, bias.len()]");
    x.chunks_exact(bias.len()).flat_map(|row| row.iter().zip(bias).map(|(&v, &b)| v + b)).collect()
}

/// The `GeluAuxBias` epilogue: `(d, pre_gelu)` with `pre_gelu = x + bias` and
/// `d = gelu(pre_gelu)` (TE's tanh approximation), for `x: [rows, n]`, `bias: [n]`.
///
/// # Panics
/// As [`add_bias`].
pub fn gelu_aux_bias(x: &[f32], bias: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let pre_gelu = add_bias(x, bias);
    (pre_gelu.iter().map(|&v| gelu(v)).collect(), pre_gelu)
}

/// The `DGeluBgrad` epilogue: `(d, bgrad)` with `d = x * gelu'(pre_gelu)` and
/// `bgrad[j] = Σ_i d[i, j]` (f64 sum) for `x, pre_gelu: [rows, n]`.
///
/// # Panics
/// If `x` and `pre_gelu` differ in length or are not whole rows of `n` (caller bugs).
pub fn dgelu_bgrad(x: &[f32], pre_gelu: &[f32], n: usize) -> (Vec<f32>, Vec<f32>) {
    assert!(n > 0 && x.len() == pre_gelu.len() && x.len() % n == 0, "x and pre_gelu must be [rows, n]");
    let d: Vec<f32> = x.iter().zip(pre_gelu).map(|(&g, &p)| g * dgelu(p)).collect();
    let mut bgrad = vec![0.0f64; n];
    for row in d.chunks_exact(n) {
        for (acc, &v) in bgrad.iter_mut().zip(row) {
            *acc += v as f64;
        }
    }
    (d, bgrad.into_iter().map(|v| v as f32).collect())
}

/// The `BgradB` epilogue's vector: `bgrad[i] = Σ_k a[i, k]` (f64 sum) for `a: [m, k]`.
///
/// # Panics
/// If `a` is not a whole number of rows of `k` (caller bug).
pub fn row_sums(a: &[f32], k: usize) -> Vec<f32> {
    assert!(k > 0 && a.len() % k == 0, "a must be [m, k]");
    a.chunks_exact(k).map(|row| row.iter().map(|&v| v as f64).sum::<f64>() as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::cast;
    use te_codegen::DType;

    #[test]
    fn gemm_tn_contracts_the_last_dims() {
        // a = [[1, 2, 3], [4, 5, 6]], b = [[1, 0, -1], [2, 1, 0], [0, 0, 1]]: D = a · bᵀ.
        let a = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [1.0, 0.0, -1.0, 2.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        assert_eq!(gemm_tn(&a, &b, 2, 3, 3), vec![-2.0, 4.0, 3.0, -2.0, 13.0, 6.0]);
    }

    #[test]
    fn gemm_tn_accumulates_in_f64() {
        // In f32, 1e8 + 1 - 1e8 loses the 1; the reference keeps it.
        assert_eq!(gemm_tn(&[1e8, 1.0, -1e8], &[1.0, 1.0, 1.0], 1, 1, 3), vec![1.0]);
    }

    #[test]
    fn epilogues() {
        let x = [1.0, -2.0, 0.5, 3.0];
        assert_eq!(add_bias(&x, &[10.0, 20.0]), vec![11.0, 18.0, 10.5, 23.0]);
        let (d, pre) = gelu_aux_bias(&x, &[0.0, 1.0]);
        assert_eq!(pre, vec![1.0, -1.0, 0.5, 4.0]);
        assert_eq!(d, pre.iter().map(|&v| gelu(v)).collect::<Vec<_>>());
        let (dx, bgrad) = dgelu_bgrad(&x, &pre, 2);
        assert_eq!(dx, vec![dgelu(1.0), -2.0 * dgelu(-1.0), 0.5 * dgelu(0.5), 3.0 * dgelu(4.0)]);
        assert_eq!(bgrad, vec![dx[0] + dx[2], dx[1] + dx[3]]);
        assert_eq!(row_sums(&x, 2), vec![-1.0, 3.5]);
    }

    #[test]
    fn fp8_operands_enter_dequantized() {
        // Values on the E4M3 grid survive the round trip, so the product is exact.
        let a = [1.5f32, -0.25, 2.0, 0.125];
        let (codes, _, scale_inv) = cast::quantize(&a, DType::E4M3, 4.0);
        let back = cast::dequantize(&codes, DType::E4M3, scale_inv);
        assert_eq!(back, a);
        assert_eq!(gemm_tn(&back, &back, 1, 1, 4), vec![1.5 * 1.5 + 0.0625 + 4.0 + 0.015625]);
    }
}
