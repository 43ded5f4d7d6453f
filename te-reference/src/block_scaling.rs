//! CPU reference of blockwise FP8 quantization (TE 2.x `Float8BlockScaling`, the recipe
//! DeepSeek-V3 was trained with; TE `common/transpose/quantize_transpose_vector_blockwise.cu`
//! and `..._square_blockwise.cu`): one f32 scale per block of 128 values, the scale from the
//! block's amax by TE's `compute_scale_from_amax` ([`scale_from_amax`]), each value cast as
//! `x · scale` rounded once to FP8 (nearest even, saturating, NaN kept: [`quantize`]), and the
//! block's `scale_inv = 1 / scale` stored for the GEMM.
//!
//! Tilings of a row-major `[rows, cols]` tensor:
//! - [`BlockTiling::Rows`]: 1×128 tiles along each row (activations and gradients as the GEMM
//!   reads them row by row); `scale_inv` `[rows, ⌈cols/128⌉]`;
//! - [`BlockTiling::Columns`]: 128×1 tiles down each column, the 1×128 tiles of the transpose
//!   (the operand a wgrad GEMM reads the other way: TE quantizes it again, from the high-precision
//!   values, rather than transposing codes); codes stored transposed, `[cols, rows]`,
//!   `scale_inv` `[cols, ⌈rows/128⌉]`;
//! - [`BlockTiling::Square`]: 128×128 blocks (weights: one quantization serves both GEMM
//!   orientations); `scale_inv` `[⌈rows/128⌉, ⌈cols/128⌉]`.
//!
//! Edge blocks are partial (shapes need not be multiples of 128). The amax of a block ignores
//! NaN (`fmaxf`); an infinite amax gives scale 1, so its infinities saturate to ±max.

use super::scaling::scale_from_amax;
use te_codegen::DType;
use te_runtime::numerics::{dequantize, quantize};

/// Values per block side.
pub const BLOCK: usize = 128;

/// How a 2-D tensor is tiled into scaling blocks (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockTiling {
    /// 1×128 tiles along each row.
    Rows,
    /// 128×1 tiles down each column; codes stored transposed.
    Columns,
    /// 128×128 blocks.
    Square,
}

/// How block scales are computed (TE's `QParams` of `Float8BlockScaling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockParams {
    /// The FP8 format (E4M3 in TE's recipe, both directions).
    pub dtype: DType,
    /// Floor of a block's amax (TE `amax_epsilon`, default 0).
    pub epsilon: f32,
    /// Scales rounded down to powers of 2 (TE `power_2_scale`, default true).
    pub power_2: bool,
    /// The scale of a block whose `fp8_max / amax` overflows: the largest finite value of the
    /// input's type (TE `TypeInfo<IType>::max_finite_value`).
    pub value_for_inf: f32,
}

impl BlockParams {
    /// TE's defaults for inputs of `input`: E4M3, epsilon 0, power-of-2 scales.
    pub fn te_default(input: DType) -> Self {
        let value_for_inf = match input {
            DType::BF16 => half::bf16::MAX.to_f32(),
            DType::F16 => half::f16::MAX.to_f32(),
            _ => f32::MAX,
        };
        Self { dtype: DType::E4M3, epsilon: 0.0, power_2: true, value_for_inf }
    }
}

/// A tensor quantized blockwise: codes and one `scale_inv` per block (layouts in the module
/// docs).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockQuantized {
    /// FP8 codes, `[rows, cols]` (`Rows`, `Square`) or `[cols, rows]` (`Columns`).
    pub codes: Vec<u8>,
    /// `1 / scale` of each block.
    pub scale_inv: Vec<f32>,
}

/// `(block rows, block cols, row tile, col tile)` of a tiling of `[rows, cols]`.
fn grid(tiling: BlockTiling, rows: usize, cols: usize) -> (usize, usize, usize, usize) {
    match tiling {
        BlockTiling::Rows => (rows, cols.div_ceil(BLOCK), 1, BLOCK),
        BlockTiling::Columns => (rows.div_ceil(BLOCK), cols, BLOCK, 1),
        BlockTiling::Square => (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK), BLOCK, BLOCK),
    }
}

/// The index of block `(br, bc)` in `scale_inv`.
fn scale_index(tiling: BlockTiling, (br, bc): (usize, usize), (nbr, nbc): (usize, usize)) -> usize {
    match tiling {
        // [cols, ⌈rows/128⌉]: the transpose's rows.
        BlockTiling::Columns => bc * nbr + br,
        _ => br * nbc + bc,
    }
}

/// Quantizes `x` (row-major `[rows, cols]`) blockwise.
///
/// # Panics
/// If `x` is not `rows · cols` long or `params.dtype` is not an FP8 type (caller bugs).
pub fn quantize_blockwise(
    x: &[f32],
    rows: usize,
    cols: usize,
    tiling: BlockTiling,
    params: &BlockParams,
) -> BlockQuantized {
    assert_eq!(x.len(), rows * cols, "x must be [rows, cols]");
    let fp8_max = params.dtype.fp8_max().unwrap_or(f32::NAN);
    assert!(fp8_max.is_finite(), "blockwise quantization casts to an FP8 type, not {}", params.dtype);
    let (nbr, nbc, th, tw) = grid(tiling, rows, cols);
    let mut codes = vec![0u8; rows * cols];
    let mut scale_inv = vec![0.0f32; nbr * nbc];
    for br in 0..nbr {
        for bc in 0..nbc {
            let (r0, r1) = (br * th, ((br + 1) * th).min(rows));
            let (c0, c1) = (bc * tw, ((bc + 1) * tw).min(cols));
            let mut amax = 0.0f32;
            for r in r0..r1 {
                for &v in &x[r * cols + c0..r * cols + c1] {
                    amax = amax.max(v.abs());
                }
            }
            let scale = scale_from_amax(amax, fp8_max, params.epsilon, params.power_2, params.value_for_inf);
            scale_inv[scale_index(tiling, (br, bc), (nbr, nbc))] = 1.0 / scale;
            for r in r0..r1 {
                for c in c0..c1 {
                    let q = quantize(params.dtype, x[r * cols + c] * scale);
                    let at = if tiling == BlockTiling::Columns { c * rows + r } else { r * cols + c };
                    codes[at] = q;
                }
            }
        }
    }
    BlockQuantized { codes, scale_inv }
}

/// The values `q` stands for, row-major `[rows, cols]` (each code times its block's
/// `scale_inv`, in f32).
///
/// # Panics
/// If `q` does not hold a `[rows, cols]` tensor of `tiling` (a caller bug).
pub fn dequantize_blockwise(
    q: &BlockQuantized,
    rows: usize,
    cols: usize,
    tiling: BlockTiling,
    dtype: DType,
) -> Vec<f32> {
    let (nbr, nbc, th, tw) = grid(tiling, rows, cols);
    assert_eq!((q.codes.len(), q.scale_inv.len()), (rows * cols, nbr * nbc), "a [rows, cols] tensor of the tiling");
    let mut out = vec![0.0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let at = if tiling == BlockTiling::Columns { c * rows + r } else { r * cols + c };
            let s = q.scale_inv[scale_index(tiling, (r / th, c / tw), (nbr, nbc))];
            out[r * cols + c] = dequantize(dtype, q.codes[at]) * s;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn params() -> BlockParams {
        BlockParams::te_default(DType::BF16)
    }

    /// A row of 1..=128: amax 128, scale 448/128 = 3.5 rounded down to 2; the codes are x · 2
    /// cast, the scale_inv 0.5; without power-of-2 scales, 3.5.
    #[test]
    fn one_block_follows_tes_scale_rule() {
        let x: Vec<f32> = (1..=128).map(|v| v as f32).collect();
        let q = quantize_blockwise(&x, 1, 128, BlockTiling::Rows, &params());
        assert_eq!(q.scale_inv, [0.5]);
        for (i, &c) in q.codes.iter().enumerate() {
            assert_eq!(c, quantize(DType::E4M3, x[i] * 2.0), "{i}");
        }
        let plain = BlockParams { power_2: false, ..params() };
        let q = quantize_blockwise(&x, 1, 128, BlockTiling::Rows, &plain);
        assert_eq!(q.scale_inv, [1.0 / 3.5]);
        assert_eq!(dequantize(DType::E4M3, q.codes[127]) / 3.5, 128.0, "the amax maps to 448");
    }

    /// Zeros give scale 1; an infinity gives scale 1 and saturates; NaN stays NaN and does not
    /// count in the amax; a tiny amax overflows the scale to the input type's max (2^127 once
    /// rounded down); epsilon floors the amax.
    #[test]
    fn special_values_follow_te() {
        let mut x = vec![0.0f32; 256];
        x[130] = f32::INFINITY;
        x[131] = -3.0;
        x[200] = f32::NAN;
        let q = quantize_blockwise(&x, 1, 256, BlockTiling::Rows, &params());
        assert_eq!(q.scale_inv, [1.0, 1.0]);
        assert_eq!(q.codes[130], quantize(DType::E4M3, 448.0));
        assert_eq!(q.codes[131], quantize(DType::E4M3, -3.0));
        assert_eq!(q.codes[200], 0x7f);
        let mut y = vec![0.0f32; 128];
        y[5] = f32::NAN;
        y[6] = 2.0;
        assert_eq!(
            quantize_blockwise(&y, 1, 128, BlockTiling::Rows, &params()).scale_inv,
            [1.0 / 128.0],
            "NaN ignored: amax 2"
        );
        let tiny = quantize_blockwise(&[1e-40; 128], 1, 128, BlockTiling::Rows, &params());
        assert_eq!(tiny.scale_inv, [1.0 / 2f32.powi(127)]);
        let floored = BlockParams { epsilon: 1.0, power_2: false, ..params() };
        assert_eq!(quantize_blockwise(&[0.25; 128], 1, 128, BlockTiling::Rows, &floored).scale_inv, [1.0 / 448.0]);
    }

    /// Shapes that are not multiples of 128: the tilings agree with the definition block by
    /// block; Columns is Rows of the transpose; every value comes back within one FP8 step.
    #[test]
    fn tilings_partial_blocks_and_round_trips() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(16);
        let (rows, cols) = (131, 200);
        let x: Vec<f32> =
            (0..rows * cols).map(|i| rng.random::<f32>() * 8.0 - 4.0 + if i % 97 == 0 { 40.0 } else { 0.0 }).collect();
        let p = params();
        let rowwise = quantize_blockwise(&x, rows, cols, BlockTiling::Rows, &p);
        assert_eq!(rowwise.scale_inv.len(), rows * 2);
        let t: Vec<f32> = (0..cols * rows).map(|i| x[(i % rows) * cols + i / rows]).collect();
        let columns = quantize_blockwise(&x, rows, cols, BlockTiling::Columns, &p);
        assert_eq!(
            columns,
            quantize_blockwise(&t, cols, rows, BlockTiling::Rows, &p),
            "Columns = Rows of the transpose"
        );
        let square = quantize_blockwise(&x, rows, cols, BlockTiling::Square, &p);
        assert_eq!(square.scale_inv.len(), 2 * 2);
        // The last square block (rows 128..131, cols 128..200): its own amax.
        let amax = (128..rows)
            .flat_map(|r| (128..cols).map(move |c| (r, c)))
            .map(|(r, c)| x[r * cols + c].abs())
            .fold(0.0f32, f32::max);
        let want = scale_from_amax(amax, 448.0, 0.0, true, p.value_for_inf);
        assert_eq!(square.scale_inv[3], 1.0 / want);
        for (tiling, q) in
            [(BlockTiling::Rows, &rowwise), (BlockTiling::Columns, &columns), (BlockTiling::Square, &square)]
        {
            let back = dequantize_blockwise(q, rows, cols, tiling, DType::E4M3);
            // E4M3 keeps 3 mantissa bits: within 2^-4 relative, or half a subnormal step (2^-10)
            // of the block's scale_inv.
            let step = q.scale_inv.iter().fold(0.0f32, |m, &v| m.max(v)) * 2f32.powi(-10);
            for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
                assert!((a - b).abs() <= a.abs() / 16.0 + step, "{tiling:?} {i}: {a} -> {b}");
            }
        }
    }
}
