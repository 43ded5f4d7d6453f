//! GEMM reference: the row-major `D[m, n] = A[m, k] · B[n, k]ᵀ` of [`te_runtime::gemm::gemm`],
//! accumulated in f64, its epilogues on the f32 product, and the strided batched GEMM of
//! [`te_runtime::gemm::gemm_strided_batched`]. FP8 operands enter dequantized
//! (codes × scale_inv, [`super::cast::dequantize`]); FP8 outputs are the quantized result
//! ([`super::cast::quantize`], whose amax is the GEMM's amax before scaling).

use super::activation::{dgelu, gelu};
use te_runtime::gemm::{MatrixView, StridedBatch};

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

/// [`te_runtime::gemm::gemm_strided_batched`] on host slices: `d_i = alpha · a_i · b_iᵀ (+ d_i when
/// accumulating)` for every `i < batch.count`, each matrix addressed through its view (operands
/// marked transposed read as stored transposed), sums in f64 rounded once to f32. Elements of `d`
/// outside the views are kept.
///
/// # Panics
/// If a view reaches past its slice (a caller bug; the GPU function checks it).
pub fn gemm_strided_batched(a: &[f32], b: &[f32], d: &mut [f32], batch: &StridedBatch, alpha: f32, accumulate: bool) {
    let at = |v: &MatrixView, i: usize, r: usize, c: usize| v.offset + i * v.batch_stride + r * v.row_stride + c;
    let (m, n) = (batch.d.rows, batch.d.cols);
    let k = if batch.a_transposed { batch.a.rows } else { batch.a.cols };
    for i in 0..batch.count {
        for r in 0..m {
            for c in 0..n {
                let dot: f64 = (0..k)
                    .map(|x| {
                        let av = if batch.a_transposed { a[at(&batch.a, i, x, r)] } else { a[at(&batch.a, i, r, x)] };
                        let bv = if batch.b_transposed { b[at(&batch.b, i, x, c)] } else { b[at(&batch.b, i, c, x)] };
                        av as f64 * bv as f64
                    })
                    .sum();
                let out = &mut d[at(&batch.d, i, r, c)];
                let prev = if accumulate { *out as f64 } else { 0.0 };
                *out = (alpha as f64 * dot + prev) as f32;
            }
        }
    }
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
    use crate::cast;
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
    fn strided_batched_addresses_matrices_through_views() {
        // Two 2 × 3 matrices side by side in the rows of a [2, 8] tensor (offset 1, 4 apart),
        // times the transposes of two 2 × 3 matrices stacked in a [2, 2, 3] tensor.
        let a: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let b: Vec<f32> = (0..12).map(|v| (v % 5) as f32 - 2.0).collect();
        let batch = StridedBatch {
            count: 2,
            a: MatrixView { offset: 1, rows: 2, cols: 3, row_stride: 8, batch_stride: 4 },
            a_transposed: false,
            b: MatrixView::contiguous(2, 3),
            b_transposed: false,
            d: MatrixView { offset: 0, rows: 2, cols: 2, row_stride: 5, batch_stride: 2 },
        };
        let mut d = vec![7.0f32; 10];
        gemm_strided_batched(&a, &b, &mut d, &batch, 1.0, false);
        for i in 0..2 {
            let ai: Vec<f32> = (0..2).flat_map(|r| (0..3).map(move |c| (1 + 4 * i + 8 * r + c) as f32)).collect();
            let want = gemm_tn(&ai, &b[6 * i..6 * i + 6], 2, 2, 3);
            for r in 0..2 {
                assert_eq!(&d[2 * i + 5 * r..2 * i + 5 * r + 2], &want[2 * r..2 * r + 2], "matrix {i} row {r}");
            }
        }
        assert_eq!((d[4], d[9]), (7.0, 7.0), "elements outside the views are kept");
        // Transposed operands and accumulation: d += aᵀ-stored · bᵀ-stored.
        let at = StridedBatch {
            count: 1,
            a: MatrixView::contiguous(3, 2),
            a_transposed: true,
            b: MatrixView::contiguous(3, 2),
            b_transposed: true,
            d: MatrixView::contiguous(2, 2),
        };
        let (x, y) = ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        let mut d = vec![1.0f32; 4];
        gemm_strided_batched(&x, &y, &mut d, &at, 2.0, true);
        // aᵀ = [[1, 3, 5], [2, 4, 6]], bᵀ = [[1, 0, 1], [0, 1, 1]]: a · b = [[6, 8], [8, 10]].
        assert_eq!(d, vec![13.0, 17.0, 17.0, 21.0]);
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
