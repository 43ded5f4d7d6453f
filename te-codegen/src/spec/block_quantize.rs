//! Family 16: blockwise FP8 quantization (TE 2.x `Float8BlockScaling`, the recipe DeepSeek-V3
//! was trained with; TE `common/transpose/quantize_transpose_vector_blockwise.cu` and
//! `quantize_transpose_square_blockwise.cu`).

use super::{ArgCond, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Quantizes a row-major `[rows, cols]` bf16/f16 tensor to FP8 with one f32 scale per block of
/// 128 values, in one pass over 128×128 tiles (`rows`, `cols` run time; partial edge tiles):
/// - `block_dim` 1 (activations and gradients): row-wise codes `q [rows, cols]` with one scale
///   per 1×128 tile of a row, and column-wise codes `q_t [cols, rows]` (the transpose, for the
///   GEMM that reads the tensor the other way) with one scale per 128×1 tile of a column, each
///   from its own tile's amax (TE quantizes the column-wise copy from the high-precision
///   values, not from the row-wise codes);
/// - `block_dim` 2 (weights): one scale per 128×128 block, the codes written row-wise and, when
///   asked, transposed (the same codes, the same scales).
///
/// Scales by TE's `compute_scale_from_amax`: `fp8_max / max(amax, epsilon)` (1 for an amax of
/// 0, inf or NaN; `value_for_inf` when the division overflows), rounded down to a power of 2
/// with `power_2`; codes `x · scale` rounded to nearest even and saturated; `scale_inv = 1 /
/// scale` stored in TE's `GEMM_READY` layouts, the ones cuBLASLt's `VEC128_32F` and
/// `BLK128x128_32F` scale modes read:
/// - 1D row-wise `[⌈cols/128⌉, ld_s]` (transposed: the rows contiguous, `ld_s ≥ rows`, a
///   multiple of 4), column-wise `[⌈rows/128⌉, ld_s_t]` (`ld_s_t ≥ cols`);
/// - 2D row-wise `[⌈rows/128⌉, ld_s]` (`ld_s ≥ ⌈cols/128⌉`), column-wise `[⌈cols/128⌉, ld_s_t]`.
///
/// With `block_dim` 1 the column-wise pass also gives the bias gradient `dbias[c] = Σ_r x[r, c]`,
/// deterministically in two passes (as [`super::CastTransposeSpec`]'s dbias): when
/// `dbias_partial` is not null, the main kernel writes each 128-row tile's f32 column sums (the
/// lanes' 4 rows in order, then the warp's butterfly) to row `blockIdx.y` of the
/// `[⌈rows/128⌉, cols]` workspace; `<name>_dbias` sums those rows in a fixed order (slice `s` of
/// [`BlockQuantizeSpec::DBIAS_SLICES`] the tiles `s, s + DBIAS_SLICES, ...`, then the slices in
/// order) and rounds once to the input type. The same bits every run. A null `dbias_partial`
/// costs one uniform branch per column.
///
/// Entry points: `<name>` ([`BlockQuantizeSpec::ARGS`]; `dbias_partial` with `block_dim` 1 only),
/// one block of [`BlockQuantizeSpec::THREADS`] per 128×128 tile (`grid (⌈cols/128⌉,
/// ⌈rows/128⌉)`); with `block_dim` 1 also `<name>_dbias` ([`BlockQuantizeSpec::DBIAS_ARGS`]),
/// [`BlockQuantizeSpec::DBIAS_THREADS`] threads and `⌈cols / DBIAS_COLS⌉` blocks, after `<name>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockQuantizeSpec {
    /// Input element type: bf16 or f16.
    pub input: DType,
    /// Output codes: E4M3 or E5M2.
    pub output: DType,
    /// 1: 1×128 (and 128×1) tiles; 2: 128×128 blocks.
    pub block_dim: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl BlockQuantizeSpec {
    /// Values per block side.
    pub const BLOCK: usize = 128;
    /// Threads per block (8 warps; 16 rows or columns of a tile each).
    pub const THREADS: usize = 256;
    /// Columns per block of the `<name>_dbias` kernel (one 128-byte row segment of partials).
    pub const DBIAS_COLS: usize = 32;
    /// Row-tile slices of the `<name>_dbias` kernel: slice `s` sums the partials of row tiles
    /// `s, s + DBIAS_SLICES, ...` in order, then the slices are summed in order.
    pub const DBIAS_SLICES: usize = 8;
    /// Threads per block of the `<name>_dbias` kernel.
    pub const DBIAS_THREADS: usize = Self::DBIAS_COLS * Self::DBIAS_SLICES;

    /// The entry point's arguments.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` input, bf16/f16, row-major"),
        KernelArg::write("q", "void* __restrict__", "`[rows, cols]` row-wise FP8 codes, or null"),
        KernelArg::write("q_t", "void* __restrict__", "`[cols, rows]` column-wise (transposed) codes, or null"),
        KernelArg::write("s", "float* __restrict__", "row-wise scale_inv (GEMM_READY layout), written with q"),
        KernelArg::write("s_t", "float* __restrict__", "column-wise scale_inv (GEMM_READY layout), written with q_t"),
        KernelArg::scalar("rows", "u64", "rows of x"),
        KernelArg::scalar("cols", "u64", "columns of x"),
        KernelArg::scalar("ld_s", "u64", "leading dimension of s (elements)"),
        KernelArg::scalar("ld_s_t", "u64", "leading dimension of s_t (elements)"),
        KernelArg::scalar("epsilon", "float", "floor of a block's amax (TE amax_epsilon)"),
        KernelArg::scalar("power_2", "int", "1: scales rounded down to powers of 2"),
        KernelArg::scalar("value_for_inf", "float", "the scale when fp8_max / amax overflows"),
        KernelArg::write(
            "dbias_partial",
            "float* __restrict__",
            "`[⌈rows/128⌉, cols]` f32 column sums per 128-row tile (written with q_t), or null",
        )
        .when(ArgCond::Dbias),
    ];

    /// The arguments of the `<name>_dbias` entry point (`block_dim` 1).
    pub const DBIAS_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "dbias_partial",
            "const float* __restrict__",
            "`[row_tiles, cols]` f32 column sums per 128-row tile",
        ),
        KernelArg::write("dbias", "void* __restrict__", "`[cols]` bias gradient, the input dtype"),
        KernelArg::scalar("cols", "u64", "columns of x"),
        KernelArg::scalar("row_tiles", "u64", "⌈rows/128⌉: rows of dbias_partial"),
    ];

    /// The quantizer of `input` into `output` blocks of `block_dim` (1 or 2).
    pub fn new(input: DType, output: DType, block_dim: usize, arch: Arch) -> Self {
        Self { input, output, block_dim, arch }
    }
}

impl Family for BlockQuantizeSpec {
    fn family(&self) -> &'static str {
        "block_quantize"
    }
    fn template(&self) -> &'static str {
        "block_quantize.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!("{}_{}_{}d", self.input, self.output, self.block_dim)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        if entry == 0 {
            Self::ARGS
        } else {
            Self::DBIAS_ARGS
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        cond == ArgCond::Dbias && self.block_dim == 1
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        if self.block_dim == 1 {
            &["", "_dbias"]
        } else {
            &[""]
        }
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("fp8_max", &self.output.fp8_max().unwrap_or(0.0));
        ctx.insert("block_dim", &self.block_dim);
        ctx.insert("threads", &Self::THREADS);
        ctx.insert("dbias_cols", &Self::DBIAS_COLS);
        ctx.insert("dbias_slices", &Self::DBIAS_SLICES);
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.input, DType::BF16 | DType::F16) {
            return Err(format!("blockwise quantization takes bf16 or f16 input, not {}", self.input));
        }
        if !self.output.is_fp8() {
            return Err(format!("blockwise quantization writes e4m3 or e5m2 codes, not {}", self.output));
        }
        if !matches!(self.block_dim, 1 | 2) {
            return Err(format!(
                "block_dim = {} must be 1 (1x128 tiles) or 2 (128x128 blocks), as TE's block_scaling_dim",
                self.block_dim
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_field() {
        let ok = BlockQuantizeSpec::new(DType::BF16, DType::E4M3, 1, Arch::Sm90a);
        assert!(ok.validate().is_ok());
        let e = BlockQuantizeSpec { block_dim: 3, ..ok }.validate().unwrap_err();
        assert!(e.contains("block_dim"), "{e}");
        assert!(BlockQuantizeSpec { input: DType::F32, ..ok }.validate().unwrap_err().contains("bf16 or f16"));
        assert!(BlockQuantizeSpec { output: DType::BF16, ..ok }.validate().unwrap_err().contains("e4m3"));
    }

    #[test]
    fn dbias_is_an_entry_point_of_the_1d_quantizer_only() {
        use super::super::KernelSpec;
        let one = BlockQuantizeSpec::new(DType::BF16, DType::E5M2, 1, Arch::Sm90a);
        let two = BlockQuantizeSpec { block_dim: 2, ..one };
        let names = |s: BlockQuantizeSpec, e| s.params(e).iter().map(|a| a.name).collect::<Vec<_>>();
        assert_eq!(names(one, 0).last(), Some(&"dbias_partial"));
        assert_eq!(names(one, 1), ["dbias_partial", "dbias", "cols", "row_tiles"]);
        assert_eq!(names(two, 0).last(), Some(&"value_for_inf"));
        let n = KernelSpec::from(one).name();
        assert_eq!(KernelSpec::from(one).entry_points(), [n.clone(), format!("{n}_dbias")]);
        assert_eq!(KernelSpec::from(two).entry_points().len(), 1);
    }
}
