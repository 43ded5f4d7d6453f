//! Families 2, 3 and the fused dact backward of 4: one read of a `[rows, cols]` input gives a
//! row-wise FP8 copy `[rows, cols]`, a column-wise (transposed) FP8 copy `[cols, rows]` and the
//! amax, optionally the bias gradient (column sums) and a fused activation backward first. In
//! transpose mode (FP8 input of the output's format) it only transposes the FP8 codes.

use super::cast::{check_pow2, check_threads};
use super::{Activation, ArgCond, Family, KernelArg};
use crate::{check_fp8_dim, Arch, DType};
use serde::{Deserialize, Serialize};

/// Cast + transpose (+ dbias) (+ dact) of `[rows, cols]` (`rows` is a run-time argument).
///
/// Math (TE `common/transpose/cast_transpose.cu`, `cast_transpose_fusion.cu`):
/// `g = dact ? dy * act'(act_in) : x` (f32, one rounded multiply); `q = fp8(g * scale)`,
/// `q_t = q^T` (the same codes), `amax = max(amax, max|g|)` (NaN skipped), `scale_inv = 1/scale`;
/// `dbias[c] = Σ_r g[r, c]` accumulated in f32 per row tile, then reduced in a fixed order by a
/// second kernel (same bits run to run), written in the input type.
///
/// Entry points: `<name>` ([`CastTransposeSpec::ARGS`]) and, with `dbias`, `<name>_dbias`
/// ([`CastTransposeSpec::DBIAS_ARGS`]); `dbias_partial` has `ceil(rows / tile_rows)` rows. Launch: `<name>` with one block of `threads` per tile, i.e.
/// `ceil(rows / tile_rows) * ceil(cols / tile_cols)` blocks (row-tile major); `<name>_dbias`
/// with [`CastTransposeSpec::DBIAS_THREADS`] threads and `ceil(cols / DBIAS_COLS)` blocks.
///
/// Tiling: a thread owns micro-tiles of 4 rows × 8 columns (16-byte loads, one 8-byte row-wise
/// store per row); the FP8 codes are staged transposed in `tile_rows * tile_cols` bytes of shared
/// memory and written to `q_t` 16 bytes per thread and step.
///
/// Transpose mode ([`CastTransposeSpec::is_transpose`]: `input` is FP8 and equal to `output`, no
/// dbias, no dact; template `transpose.cu.tera`): `q_t = xᵀ`, the codes copied byte for byte with
/// no scale, amax or scale_inv (TE `Float8Tensor.transpose_2d`). Entry point `<name>`
/// ([`CastTransposeSpec::TRANSPOSE_ARGS`]); launch as above, one block of `threads` per tile. A thread owns micro-tiles of 4 rows ×
/// 16 columns (one 16-byte load per row), staged in shared memory the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CastTransposeSpec {
    /// Type of `x` (or `dy`): f32, bf16 or f16.
    pub input: DType,
    /// FP8 type of both copies.
    pub output: DType,
    /// Feature size (`cols`), specialized.
    pub cols: usize,
    /// Also compute the bias gradient.
    pub dbias: bool,
    /// Fused activation backward (non-gated activations only).
    pub dact: Option<Activation>,
    /// Rows per block tile.
    pub tile_rows: usize,
    /// Columns per block tile.
    pub tile_cols: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl CastTransposeSpec {
    /// Default rows per tile: `q_t` rows are written in 64-byte segments (two full sectors).
    pub const DEFAULT_TILE_ROWS: usize = 64;
    /// Default columns per tile: 256-byte bf16 input rows per block.
    pub const DEFAULT_TILE_COLS: usize = 128;
    /// Default threads per block: one 4 × 8 micro-tile per thread with the default tile.
    pub const DEFAULT_THREADS: usize = 256;
    /// Columns per block of the `<name>_dbias` kernel.
    pub const DBIAS_COLS: usize = 32;
    /// Row-tile slices of the `<name>_dbias` kernel: slice `s` sums the partials of row tiles
    /// `s, s + DBIAS_SLICES, ...` in order, then the slices are summed in order.
    pub const DBIAS_SLICES: usize = 8;
    /// Threads per block of the `<name>_dbias` kernel.
    pub const DBIAS_THREADS: usize = Self::DBIAS_COLS * Self::DBIAS_SLICES;
    /// Default rows per tile in transpose mode: `q_t` rows are written in 128-byte segments.
    pub const TRANSPOSE_TILE_ROWS: usize = 128;
    /// Default columns per tile in transpose mode: `x` rows are read in 128-byte segments.
    pub const TRANSPOSE_TILE_COLS: usize = 128;
    /// Default threads per block in transpose mode: one 4 × 16 micro-tile per thread.
    pub const TRANSPOSE_THREADS: usize = 256;

    /// A spec with the default tuning.
    pub fn new(input: DType, output: DType, cols: usize, dbias: bool, dact: Option<Activation>, arch: Arch) -> Self {
        Self {
            input,
            output,
            cols,
            dbias,
            dact,
            tile_rows: Self::DEFAULT_TILE_ROWS,
            tile_cols: Self::DEFAULT_TILE_COLS,
            threads: Self::DEFAULT_THREADS,
            arch,
        }
    }

    /// Transpose mode for FP8 codes of `dtype` (E4M3 or E5M2) with the default tuning.
    pub fn transpose(dtype: DType, cols: usize, arch: Arch) -> Self {
        Self {
            input: dtype,
            output: dtype,
            cols,
            dbias: false,
            dact: None,
            tile_rows: Self::TRANSPOSE_TILE_ROWS,
            tile_cols: Self::TRANSPOSE_TILE_COLS,
            threads: Self::TRANSPOSE_THREADS,
            arch,
        }
    }

    /// True in transpose mode: the input holds FP8 codes (only valid with `output == input`).
    pub const fn is_transpose(&self) -> bool {
        self.input.is_fp8()
    }

    /// Columns of a thread's micro-tile: 8 when casting (one 8-byte row-wise FP8 store), 16 in
    /// transpose mode (one 16-byte load of codes).
    const fn micro_tile_cols(&self) -> usize {
        if self.is_transpose() {
            16
        } else {
            8
        }
    }

    /// Row tiles of a `[rows, cols]` input: rows of the dbias workspace.
    pub fn row_tiles(&self, rows: usize) -> usize {
        rows.div_ceil(self.tile_rows)
    }

    /// Blocks of the main kernel for `rows` rows.
    pub fn blocks(&self, rows: usize) -> usize {
        self.row_tiles(rows) * self.cols.div_ceil(self.tile_cols)
    }

    /// Transpose mode copies codes: the same FP8 format out, nothing computed from values.
    fn validate_transpose_mode(&self) -> Result<(), String> {
        let fp8 = self.input;
        if self.output != fp8 {
            return Err(format!(
                "transposing {fp8} codes copies them as they are, so the output must be {fp8}, not {}: \
                 to change the format, dequantize and cast_transpose the high-precision tensor",
                self.output
            ));
        }
        if self.dbias {
            return Err(format!(
                "dbias sums high-precision values, not {fp8} codes: run cast_transpose with dbias on the \
                 f32/bf16/f16 gradient instead of transposing its FP8 copy"
            ));
        }
        if let Some(a) = self.dact {
            return Err(format!(
                "a fused d{a} needs the high-precision dy and activation input, not {fp8} codes: run \
                 cast_transpose_dact on them instead of transposing an FP8 copy"
            ));
        }
        Ok(())
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl CastTransposeSpec {
    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` input (the output gradient with dact)"),
        KernelArg::read("act_in", "const void* __restrict__", "`[rows, cols]` forward input of the activation")
            .when(ArgCond::Dact),
        KernelArg::write("q", "void* __restrict__", "`[rows, cols]` FP8 codes"),
        KernelArg::write("q_t", "void* __restrict__", "`[cols, rows]` FP8 codes, transposed"),
        KernelArg::read("scale_ptr", "const float* __restrict__", "`[1]` scale"),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax, maxed"),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "`[1]` `1 / scale`"),
        KernelArg::write("dbias_partial", "float* __restrict__", "`[row_tiles, cols]` f32 column sums per row tile")
            .when(ArgCond::Dbias),
        KernelArg::scalar("rows", "u64", "rows"),
    ];

    /// Arguments of the `dbias` entry point.
    pub const DBIAS_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "dbias_partial",
            "const float* __restrict__",
            "`[row_tiles, cols]` f32 column sums per row tile",
        ),
        KernelArg::write("dbias", "void* __restrict__", "`[cols]` bias gradient, the input dtype"),
        KernelArg::scalar("row_tiles", "u64", "row tiles of the cast + transpose"),
    ];

    /// Arguments of the `transpose` entry point.
    pub const TRANSPOSE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` FP8 codes"),
        KernelArg::write("out_t", "void* __restrict__", "`[cols, rows]` FP8 codes, transposed"),
        KernelArg::scalar("rows", "u64", "rows"),
    ];
}

impl Family for CastTransposeSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match (self.is_transpose(), entry) {
            (true, _) => Self::TRANSPOSE_ARGS,
            (false, 0) => Self::ARGS,
            (false, _) => Self::DBIAS_ARGS,
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Dact => self.dact.is_some(),
            ArgCond::Dbias => self.dbias,
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        if self.is_transpose() {
            "transpose"
        } else {
            "cast_transpose"
        }
    }
    fn template(&self) -> &'static str {
        if self.is_transpose() {
            "transpose.cu.tera"
        } else {
            "cast_transpose.cu.tera"
        }
    }
    fn name_parts(&self) -> String {
        let types = if self.is_transpose() && self.output == self.input {
            self.input.to_string()
        } else {
            format!("{}_{}", self.input, self.output)
        };
        format!(
            "{types}_c{}{}{}_r{}x{}_t{}",
            self.cols,
            if self.dbias { "_dbias" } else { "" },
            self.dact.map(|a| format!("_d{a}")).unwrap_or_default(),
            self.tile_rows,
            self.tile_cols,
            self.threads
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("cols", &self.cols);
        ctx.insert("dbias", &self.dbias);
        ctx.insert("dact", self.dact.map(|a| a.name()).unwrap_or(""));
        ctx.insert("tile_rows", &self.tile_rows);
        ctx.insert("tile_cols", &self.tile_cols);
        ctx.insert("threads", &self.threads);
        ctx.insert("dbias_cols", &Self::DBIAS_COLS);
        ctx.insert("dbias_slices", &Self::DBIAS_SLICES);
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        if self.dbias {
            &["", "_dbias"]
        } else {
            &[""]
        }
    }
    fn validate(&self) -> Result<(), String> {
        if self.is_transpose() {
            self.validate_transpose_mode()?;
        } else if !self.output.is_fp8() {
            return Err(format!(
                "cast_transpose goes from f32/bf16/f16 to e4m3/e5m2 (or transposes e4m3/e5m2 codes as they are), \
                 not {} → {}",
                self.input, self.output
            ));
        }
        check_fp8_dim("cols", self.cols).map_err(|e| format!("FP8 {}: {e}", self.family()))?;
        if let Some(a) = self.dact {
            if a.is_gated() {
                return Err(format!(
                    "fused dact supports gelu, gelu_erf and relu; {a} is gated: run the activation backward, then cast_transpose"
                ));
            }
        }
        check_pow2("tile_rows", self.tile_rows, 16, 128)?;
        check_pow2("tile_cols", self.tile_cols, 16, 256)?;
        check_threads(self.threads)?;
        let nc = self.micro_tile_cols();
        let micro_tiles = (self.tile_rows / 4) * (self.tile_cols / nc);
        if self.threads > micro_tiles {
            return Err(format!(
                "threads = {} exceeds the {micro_tiles} micro-tiles (4 rows × {nc} columns) of a {}×{} tile: \
                 lower threads or enlarge the tile",
                self.threads, self.tile_rows, self.tile_cols
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::KernelSpec;
    use super::*;

    #[test]
    fn defaults_validate_and_bad_tunings_say_what_to_change() {
        let s = CastTransposeSpec::new(DType::BF16, DType::E4M3, 784, true, Some(Activation::Gelu), Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.row_tiles(1000), s.blocks(1000)), (16, 16 * 7));
        let e = CastTransposeSpec::new(DType::BF16, DType::E4M3, 1000, false, None, Arch::Sm90a).validate();
        assert!(e.unwrap_err().contains("pad it to 1008"));
        let e = CastTransposeSpec { tile_rows: 16, tile_cols: 64, ..s }.validate().unwrap_err();
        assert!(e.contains("micro-tiles"), "{e}");
        let e = CastTransposeSpec { dact: Some(Activation::Swiglu), ..s }.validate().unwrap_err();
        assert!(e.contains("gated"), "{e}");
        let e = CastTransposeSpec::new(DType::BF16, DType::F16, 784, false, None, Arch::Sm90a).validate();
        assert!(e.unwrap_err().contains("f32/bf16/f16 to e4m3/e5m2"));
    }

    #[test]
    fn transpose_mode_copies_codes_and_rejects_value_fusions() {
        let t = CastTransposeSpec::transpose(DType::E5M2, 4112, Arch::Sm90a);
        t.validate().unwrap();
        assert!(t.is_transpose());
        assert_eq!(KernelSpec::from(t).name(), "te_transpose_e5m2_c4112_r128x128_t256_sm_90a");
        assert_eq!(KernelSpec::from(t).entry_points().len(), 1);
        assert_eq!(t.blocks(48), 33);
        let e = CastTransposeSpec { output: DType::E4M3, ..t }.validate().unwrap_err();
        assert!(e.contains("output must be e5m2") && e.contains("dequantize"), "{e}");
        let e = CastTransposeSpec { output: DType::BF16, ..t }.validate().unwrap_err();
        assert!(e.contains("output must be e5m2"), "{e}");
        let e = CastTransposeSpec { dbias: true, ..t }.validate().unwrap_err();
        assert!(e.contains("run cast_transpose with dbias"), "{e}");
        let e = CastTransposeSpec { dact: Some(Activation::Gelu), ..t }.validate().unwrap_err();
        assert!(e.contains("cast_transpose_dact"), "{e}");
        let e = CastTransposeSpec::transpose(DType::E4M3, 1000, Arch::Sm90a).validate().unwrap_err();
        assert!(
            e.contains("FP8 transpose: cols = 1000 must be a multiple of 16") && e.contains("pad it to 1008"),
            "{e}"
        );
        // 4 × 16 micro-tiles: a 64 × 128 tile has 128 of them.
        let e = CastTransposeSpec { tile_rows: 64, ..t }.validate().unwrap_err();
        assert!(e.contains("128 micro-tiles (4 rows × 16 columns)"), "{e}");
        CastTransposeSpec { tile_rows: 64, threads: 128, ..t }.validate().unwrap();
    }
}
