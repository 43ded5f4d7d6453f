//! Families 2, 3 and the fused dact of 4: cast + transpose (+ dbias) (+ dact).
//!
//! Mirrors `te-codegen/templates/cast_transpose.cu.tera`: `g = dy * act'(act_in)` is one rounded f32
//! multiply, codes are `fp8(g * scale)`, and the dbias sums run in the kernel's order (see
//! [`cast_transpose`]), so without a fused GELU every output matches bit for bit. With GELU the
//! GPU's `tanhf` (and FMA contraction inside `act'`) can differ from the CPU's by an ulp, which
//! moves the odd code by one step and the sums by float rounding. [`transpose`] is the oracle of
//! the FP8 byte transpose (`ops::cast_transpose::transpose_fp8`).

use super::activation::elementwise;
use super::cast::amax as amax_of;
use te_codegen::spec::CastTransposeSpec;
use te_runtime::numerics::{quantize, round_to};

/// Outputs of [`cast_transpose`].
#[derive(Debug, Clone, PartialEq)]
pub struct CastTransposeRef {
    /// Row-wise FP8 codes, `[rows, cols]`.
    pub q: Vec<u8>,
    /// Column-wise FP8 codes, `[cols, rows]` (`q` transposed).
    pub q_t: Vec<u8>,
    /// `max |g|` with NaN skipped (0 for an all-zero input).
    pub amax: f32,
    /// `1 / scale`.
    pub scale_inv: f32,
    /// With `spec.dbias`: `[cols]` column sums of `g`, rounded to `spec.input` (as f32).
    pub dbias: Option<Vec<f32>>,
}

/// The cast_transpose of `x` (`[rows, spec.cols]`, already rounded to `spec.input`) with
/// `scale`, as the kernel of `spec` computes it; `act_in` is the activation input of the fused
/// dact (`spec.dact`), same shape as `x` (which then holds `dy`).
///
/// dbias order: per row tile of `spec.tile_rows` rows, each group of 4 rows is summed in row
/// order (rows past the end count as `+0`), then the groups in order; then slice `s` of
/// [`CastTransposeSpec::DBIAS_SLICES`] sums the tiles `s, s + SLICES, ...` from `+0`, and the
/// slices are summed in order.
///
/// # Panics
/// When `x` (or `act_in`) does not hold `rows * spec.cols` values, or `act_in` is missing or
/// present against `spec.dact` (caller bugs).
pub fn cast_transpose(
    spec: &CastTransposeSpec,
    x: &[f32],
    act_in: Option<&[f32]>,
    rows: usize,
    scale: f32,
) -> CastTransposeRef {
    let cols = spec.cols;
    assert_eq!(x.len(), rows * cols, "x must hold rows * cols values");
    let g: Vec<f32> = match (spec.dact, act_in) {
        (None, None) => x.to_vec(),
        (Some(act), Some(a)) => {
            assert_eq!(a.len(), x.len(), "act_in must have the shape of dy");
            let (_, dact) = elementwise(act);
            x.iter().zip(a).map(|(&dy, &a)| dy * dact(a)).collect()
        }
        _ => panic!("act_in must be given exactly when spec.dact is set"),
    };
    let q: Vec<u8> = g.iter().map(|&v| quantize(spec.output, v * scale)).collect();
    let q_t = transpose(&q, rows, cols);
    let dbias = spec.dbias.then(|| {
        dbias_partials(spec, &g, rows).iter().map(|p| round_to(spec.input, reduce_partials(p))).collect::<Vec<f32>>()
    });
    CastTransposeRef { q, q_t, amax: amax_of(&g), scale_inv: 1.0 / scale, dbias }
}

/// The `[cols, rows]` transpose of a row-major `[rows, cols]` matrix.
///
/// # Panics
/// When `x` does not hold `rows * cols` elements (a caller bug).
pub fn transpose<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    assert_eq!(x.len(), rows * cols, "x must hold rows * cols elements");
    (0..cols).flat_map(|c| (0..rows).map(move |r| x[r * cols + c])).collect()
}

/// Per column, the f32 partial sum of each row tile, in the kernel's order.
fn dbias_partials(spec: &CastTransposeSpec, g: &[f32], rows: usize) -> Vec<Vec<f32>> {
    let cols = spec.cols;
    let at = |r: usize, c: usize| if r < rows { g[r * cols + c] } else { 0.0 };
    (0..cols)
        .map(|c| {
            (0..spec.row_tiles(rows))
                .map(|t| {
                    let r0 = t * spec.tile_rows;
                    let group = |m: usize| (1..4).fold(at(r0 + 4 * m, c), |s, k| s + at(r0 + 4 * m + k, c));
                    (1..spec.tile_rows / 4).fold(group(0), |s, m| s + group(m))
                })
                .collect()
        })
        .collect()
}

/// The `<name>_dbias` kernel's sum of one column's row-tile partials.
fn reduce_partials(partials: &[f32]) -> f32 {
    let slices = CastTransposeSpec::DBIAS_SLICES;
    let slice = |s: usize| partials.iter().skip(s).step_by(slices).fold(0.0f32, |acc, &p| acc + p);
    (1..slices).fold(slice(0), |total, s| total + slice(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{dgelu, drelu};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use te_codegen::spec::Activation;
    use te_codegen::{Arch, DType};
    use te_runtime::numerics::dequantize;

    fn values(seed: u64, n: usize, input: DType) -> Vec<f32> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| round_to(input, rng.random::<f32>() * 6.0 - 3.0)).collect()
    }

    fn spec(input: DType, output: DType, cols: usize, dbias: bool, dact: Option<Activation>) -> CastTransposeSpec {
        CastTransposeSpec::new(input, output, cols, dbias, dact, Arch::Sm90a)
    }

    /// Column sums in f64.
    fn col_sums(g: &[f32], rows: usize, cols: usize) -> Vec<f64> {
        (0..cols).map(|c| (0..rows).map(|r| g[r * cols + c] as f64).sum()).collect()
    }

    #[test]
    fn both_copies_hold_the_quantized_codes() {
        for (rows, cols) in [(1, 48), (17, 16), (130, 272)] {
            let s = spec(DType::BF16, DType::E4M3, cols, false, None);
            let x = values(1, rows * cols, DType::BF16);
            let r = cast_transpose(&s, &x, None, rows, 500.0);
            for i in 0..rows {
                for c in 0..cols {
                    let code = r.q[i * cols + c];
                    assert_eq!(code, quantize(DType::E4M3, x[i * cols + c] * 500.0));
                    assert_eq!(r.q_t[c * rows + i], code, "q_t[{c}, {i}]");
                }
            }
            assert_eq!(r.amax, x.iter().fold(0.0f32, |a, v| a.max(v.abs())));
            assert_eq!(r.scale_inv, 1.0 / 500.0);
            assert!(r.dbias.is_none());
            // |x| * 500 > 448 saturates.
            let saturated = x.iter().any(|v| v.abs() * 500.0 > 448.0);
            assert_eq!(r.q.iter().any(|&q| dequantize(DType::E4M3, q).abs() == 448.0), saturated);
        }
    }

    #[test]
    fn transpose_moves_element_r_c_to_c_r() {
        let x: Vec<u8> = (0..6).collect(); // [[0, 1, 2], [3, 4, 5]]
        assert_eq!(transpose(&x, 2, 3), [0, 3, 1, 4, 2, 5]);
        assert_eq!(transpose(&transpose(&x, 2, 3), 3, 2), x);
        assert_eq!(transpose(&[7u8], 1, 1), [7]);
    }

    #[test]
    fn dbias_is_the_column_sum_rounded_to_the_input_type() {
        // Rows that are and are not tile multiples, more row tiles than dbias slices.
        for (rows, cols, input) in [(1, 32, DType::F32), (1000, 784, DType::BF16), (64 * 19 + 5, 64, DType::F16)] {
            let s = spec(input, DType::E5M2, cols, true, None);
            let x = values(2, rows * cols, input);
            let r = cast_transpose(&s, &x, None, rows, 1.0);
            let db = r.dbias.unwrap();
            for (c, want) in col_sums(&x, rows, cols).into_iter().enumerate() {
                let tol = 1.6e-2 * want.abs() + 1e-5 * rows as f64;
                assert!((db[c] as f64 - want).abs() <= tol, "{input} {rows}x{cols} col {c}: {} vs {want}", db[c]);
                assert_eq!(db[c], round_to(input, db[c]), "dbias is representable in {input}");
            }
        }
    }

    #[test]
    fn dbias_order_follows_the_kernel() {
        // 1e8 + 1 - 1e8 in f32 depends on the order: 4-row groups first, then groups, then tiles.
        let (rows, cols) = (8, 16);
        let mut x = vec![0.0f32; rows * cols];
        x[0] = 1e8; // group 0, row 0
        x[cols] = 1.0; // group 0, row 1
        x[4 * cols] = -1e8; // group 1, row 4
        let r = cast_transpose(&spec(DType::F32, DType::E4M3, cols, true, None), &x, None, rows, 1.0);
        assert_eq!(r.dbias.unwrap()[0], (1e8f32 + 1.0) + -1e8);
        // Across row tiles: slice 0 sums tiles 0, 8, 16 from +0; slice 1 sums tile 1.
        let partials = [1e8f32, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1e8];
        assert_eq!(reduce_partials(&partials), ((0.0 + 1e8f32) + 1.0 + -1e8) + 3.0);
    }

    #[test]
    fn dact_multiplies_by_the_activation_derivative() {
        let (rows, cols) = (70, 32);
        let dy = values(3, rows * cols, DType::BF16);
        let a = values(4, rows * cols, DType::BF16);
        for (act, d) in [(Activation::Gelu, dgelu as fn(f32) -> f32), (Activation::Relu, drelu)] {
            let s = spec(DType::BF16, DType::E5M2, cols, true, Some(act));
            let r = cast_transpose(&s, &dy, Some(&a), rows, 4.0);
            let g: Vec<f32> = dy.iter().zip(&a).map(|(&y, &x)| y * d(x)).collect();
            let plain = cast_transpose(&spec(DType::F32, DType::E5M2, cols, true, None), &g, None, rows, 4.0);
            assert_eq!((&r.q, &r.q_t, r.amax), (&plain.q, &plain.q_t, plain.amax), "{act}");
            let (db, want) = (r.dbias.unwrap(), col_sums(&g, rows, cols));
            for c in 0..cols {
                assert!((db[c] as f64 - want[c]).abs() <= 1.6e-2 * want[c].abs() + 1e-4, "{act} col {c}");
            }
        }
        // ReLU' is 0 for x <= 0: those gradients vanish (keeping dy's sign on the zero).
        let r = cast_transpose(
            &spec(DType::F32, DType::E4M3, 16, false, Some(Activation::Relu)),
            &[-2.0; 16],
            Some(&[-1.0; 16]),
            1,
            1.0,
        );
        assert!(r.q.iter().all(|&q| q == 0x80), "{:?}", r.q);
        assert_eq!(r.amax, 0.0);
    }
}
