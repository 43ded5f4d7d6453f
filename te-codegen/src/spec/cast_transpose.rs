//! Families 2, 3 and the fused dact backward of 4: one read of a `[rows, cols]` input gives a
//! row-wise FP8 copy `[rows, cols]`, a column-wise (transposed) FP8 copy `[cols, rows]` and the
//! amax, optionally the bias gradient (column sums) and a fused activation backward first.

use super::cast::{check_pow2, check_threads};
use super::{Activation, Family};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Cast + transpose (+ dbias) (+ dact) of `[rows, cols]` (`rows` is a run-time argument).
///
/// Math (TE `common/transpose/cast_transpose_fusion.cu`): `g = dact ? dy * act'(act_in) : x`;
/// `q = fp8(g * scale)`, `q_t = q^T`, `amax = max(amax, max|g|)`, `scale_inv = 1/scale`;
/// `dbias[c] = Σ_r g[r, c]` accumulated in f32 per row tile, then reduced in a fixed order by a
/// second kernel (same bits run to run), written in the input type.
///
/// Entry points: `<name>` with arguments `(x, [act_in], q, q_t, scale, amax, scale_inv,
/// [dbias_partial], rows)` and, with `dbias`, `<name>_dbias` with `(dbias_partial, dbias,
/// row_tiles)`. `dbias_partial` is an f32 workspace `[ceil(rows / tile_rows), cols]`.
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
    /// A spec with the default tuning.
    pub fn new(input: DType, output: DType, cols: usize, dbias: bool, dact: Option<Activation>, arch: Arch) -> Self {
        Self { input, output, cols, dbias, dact, tile_rows: 64, tile_cols: 128, threads: 256, arch }
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
        check_threads(self.threads)
    }
}
