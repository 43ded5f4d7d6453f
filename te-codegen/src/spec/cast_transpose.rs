//! Families 2, 3 and the fused dact backward of 4: one read of a `[rows, cols]` input gives a
//! row-wise FP8 copy `[rows, cols]`, a column-wise (transposed) FP8 copy `[cols, rows]` and the
//! amax, optionally the bias gradient (column sums) and a fused activation backward first.

use super::cast::{check_pow2, check_threads};
use super::{Activation, Family};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Cast + transpose (+ dbias) (+ dact) of `[rows, cols]` (`rows` is a run-time argument).
///
/// Math (TE `common/transpose/cast_transpose.cu`, `cast_transpose_fusion.cu`):
/// `g = dact ? dy * act'(act_in) : x` (f32, one rounded multiply); `q = fp8(g * scale)`,
/// `q_t = q^T` (the same codes), `amax = max(amax, max|g|)` (NaN skipped), `scale_inv = 1/scale`;
/// `dbias[c] = Σ_r g[r, c]` accumulated in f32 per row tile, then reduced in a fixed order by a
/// second kernel (same bits run to run), written in the input type.
///
/// Entry points: `<name>` with arguments `(x, [act_in], q, q_t, scale, amax, scale_inv,
/// [dbias_partial], rows)` and, with `dbias`, `<name>_dbias` with `(dbias_partial, dbias,
/// row_tiles)`. `x`/`act_in` are `[rows, cols]` in `input`, `q` `[rows, cols]` and `q_t`
/// `[cols, rows]` in `output`, `scale`/`amax`/`scale_inv` one f32 each, `dbias_partial` an f32
/// workspace `[ceil(rows / tile_rows), cols]`, `dbias` `[cols]` in `input`; `rows` and
/// `row_tiles` are `u64`. Launch: `<name>` with one block of `threads` per tile, i.e.
/// `ceil(rows / tile_rows) * ceil(cols / tile_cols)` blocks (row-tile major); `<name>_dbias`
/// with [`CastTransposeSpec::DBIAS_THREADS`] threads and `ceil(cols / DBIAS_COLS)` blocks.
///
/// Tiling: a thread owns micro-tiles of 4 rows × 8 columns (16-byte loads, one 8-byte row-wise
/// store per row); the FP8 codes are staged transposed in `tile_rows * tile_cols` bytes of shared
/// memory and written to `q_t` 16 bytes per thread and step.
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

    /// Row tiles of a `[rows, cols]` input: rows of the dbias workspace.
    pub fn row_tiles(&self, rows: usize) -> usize {
        rows.div_ceil(self.tile_rows)
    }

    /// Blocks of the main kernel for `rows` rows.
    pub fn blocks(&self, rows: usize) -> usize {
        self.row_tiles(rows) * self.cols.div_ceil(self.tile_cols)
    }
}

impl Family for CastTransposeSpec {
    fn family(&self) -> &'static str {
        "cast_transpose"
    }
    fn template(&self) -> &'static str {
        "cast_transpose.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_c{}{}{}_r{}x{}_t{}",
            self.input,
            self.output,
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
        if !self.input.is_high_precision() || !self.output.is_fp8() {
            return Err(format!(
                "cast_transpose goes from f32/bf16/f16 to e4m3/e5m2, not {} → {}",
                self.input, self.output
            ));
        }
        if self.cols == 0 || self.cols % 16 != 0 {
            return Err(format!(
                "FP8 cast_transpose needs cols % 16 == 0; cols = {} (pad to {})",
                self.cols,
                self.cols.div_ceil(16).max(1) * 16
            ));
        }
        if let Some(a) = self.dact {
            if a.is_gated() {
                return Err(format!(
                    "fused dact supports gelu and relu; {a} is gated: run the activation backward, then cast_transpose"
                ));
            }
        }
        check_pow2("tile_rows", self.tile_rows, 16, 128)?;
        check_pow2("tile_cols", self.tile_cols, 16, 256)?;
        check_threads(self.threads)?;
        let micro_tiles = (self.tile_rows / 4) * (self.tile_cols / 8);
        if self.threads > micro_tiles {
            return Err(format!(
                "threads = {} exceeds the {micro_tiles} micro-tiles (4 rows × 8 columns) of a {}×{} tile: \
                 lower threads or enlarge the tile",
                self.threads, self.tile_rows, self.tile_cols
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_tunings_say_what_to_change() {
        let s = CastTransposeSpec::new(DType::BF16, DType::E4M3, 784, true, Some(Activation::Gelu), Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.row_tiles(1000), s.blocks(1000)), (16, 16 * 7));
        let e = CastTransposeSpec::new(DType::BF16, DType::E4M3, 1000, false, None, Arch::Sm90a).validate();
        assert!(e.unwrap_err().contains("pad to 1008"));
        let e = CastTransposeSpec { tile_rows: 16, tile_cols: 64, ..s }.validate().unwrap_err();
        assert!(e.contains("micro-tiles"), "{e}");
        let e = CastTransposeSpec { dact: Some(Activation::Swiglu), ..s }.validate().unwrap_err();
        assert!(e.contains("gated"), "{e}");
    }
}
