//! Family 16's launcher: blockwise FP8 quantization (TE 2.x `Float8BlockScaling`,
//! DeepSeek-V3's recipe): one f32 scale per 1×128 tile (with a 128×1-tiled transposed copy) or
//! per 128×128 block, the scales in the layouts cuBLASLt's block-scaled FP8 GEMMs read (TE's
//! `GEMM_READY`). The numerics are `te_reference::block_scaling`'s, bit for bit.
//! [`quantize_dbias`] also gives the bias gradient from the same read, in two deterministic
//! passes.

use super::cast_transpose::DbiasOut;
use super::launch::Launch;
use super::{check_dtype, check_shape, launch_1d};
use crate::gemm::BlockScale;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::BlockQuantizeSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "block_quantize";
const BLOCK: usize = BlockQuantizeSpec::BLOCK;

/// How [`quantize`] scales (TE's `QParams` of `Float8BlockScaling`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQuantizeParams {
    /// The codes: E4M3 (TE's default, both directions) or E5M2.
    pub dtype: DType,
    /// 1: 1×128 tiles (activations, gradients); 2: 128×128 blocks (weights).
    pub block_dim: usize,
    /// Floor of a block's amax (TE `amax_epsilon`).
    pub epsilon: f32,
    /// Scales rounded down to powers of 2 (TE `power_2_scale`).
    pub power_2: bool,
}

/// One orientation of a blockwise-quantized tensor: FP8 codes and their `scale_inv` (f32, TE's
/// `GEMM_READY` layout, `[scale_rows, ld]` row-major with unused padding set to 0).
#[derive(Debug)]
pub struct BlockCodes {
    /// Codes: `[rows, cols]` row-wise, `[cols, rows]` column-wise.
    pub data: Tensor,
    /// The scales' inverses.
    pub scale_inv: CudaSlice<f32>,
    /// Rows of `scale_inv`.
    pub scale_rows: usize,
    /// Leading dimension of `scale_inv` (a multiple of 4: 16-byte rows).
    pub ld: usize,
}

/// A `[rows, cols]` tensor quantized blockwise by [`quantize`]:
/// - `rowwise`: the codes as they are, scaled per 1×128 tile of a row (`block_dim` 1, scales
///   `[⌈cols/128⌉, ld ≥ rows]`: the transpose of the tile grid, rows contiguous, as cuBLASLt's
///   `VEC128_32F` mode reads them) or per 128×128 block (2, `[⌈rows/128⌉, ld ≥ ⌈cols/128⌉]`,
///   `BLK128x128_32F`);
/// - `columnwise`: the transpose `[cols, rows]`, scaled per 128×1 tile of the original's columns
///   (1: `[⌈rows/128⌉, ld ≥ cols]`, quantized from the high-precision values) or with the
///   row-wise blocks' scales transposed (2: `[⌈cols/128⌉, ld ≥ ⌈rows/128⌉]`).
#[derive(Debug)]
pub struct BlockFp8 {
    /// Rows of the original.
    pub rows: usize,
    /// Columns of the original.
    pub cols: usize,
    /// 1 or 2.
    pub block_dim: usize,
    /// Row-wise codes, when asked for.
    pub rowwise: Option<BlockCodes>,
    /// Column-wise (transposed) codes, when asked for.
    pub columnwise: Option<BlockCodes>,
}

/// `(scale rows, leading dimension)` of one orientation's `scale_inv` for a `[rows, cols]`
/// original (TE's `Float8BlockQuantizer::get_scale_shape`, `GEMM_READY`).
pub fn scale_shape(rows: usize, cols: usize, block_dim: usize, columnwise: bool) -> (usize, usize) {
    let block = if block_dim == 1 { BlockScale::Vec128 } else { BlockScale::Blk128x128 };
    // As a GEMM operand the column-wise copy is the transpose: `[cols, rows]`.
    if columnwise {
        block.shape(cols, rows)
    } else {
        block.shape(rows, cols)
    }
}

/// The largest finite value of `dtype`, the scale of a block whose `fp8_max / amax` overflows
/// (TE's `value_for_inf`, the input type's `max_finite_value`).
fn value_for_inf(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => half::f16::MAX.to_f32(),
        _ => half::bf16::MAX.to_f32(),
    }
}

impl BlockQuantizeParams {
    /// Fails unless the codes are E4M3/E5M2, `block_dim` is 1 or 2 and `epsilon` finite and ≥ 0.
    ///
    /// # Errors
    /// [`Error::DType`], [`Error::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        if !self.dtype.is_fp8() {
            return Err(Error::DType { op: OP, arg: "codes", got: self.dtype, expected: "e4m3 or e5m2".into() });
        }
        if !(matches!(self.block_dim, 1 | 2) && self.epsilon.is_finite() && self.epsilon >= 0.0) {
            return Err(Error::Config {
                module: OP,
                message: format!(
                    "block_dim must be 1 or 2 (got {}) and epsilon finite and >= 0 (got {})",
                    self.block_dim, self.epsilon
                ),
            });
        }
        Ok(())
    }
}

impl BlockFp8 {
    /// Uninitialized codes and zeroed scales for [`quantize`] of a `[rows, cols]` tensor with
    /// `params`: the row-wise orientation when `rowwise`, the column-wise one when
    /// `columnwise` (at least one).
    ///
    /// # Errors
    /// As [`BlockQuantizeParams::validate`]; [`Error::Shape`] when neither orientation is
    /// asked for; allocation failures.
    pub fn new(
        dev: &Device,
        [rows, cols]: [usize; 2],
        params: &BlockQuantizeParams,
        rowwise: bool,
        columnwise: bool,
    ) -> Result<Self> {
        params.validate()?;
        if !(rowwise || columnwise) {
            return Err(Error::Shape {
                op: OP,
                message: "ask for the row-wise codes, the column-wise codes or both".into(),
            });
        }
        let make = |columnwise: bool| -> Result<BlockCodes> {
            let shape = if columnwise { [cols, rows] } else { [rows, cols] };
            let (scale_rows, ld) = scale_shape(rows, cols, params.block_dim, columnwise);
            Ok(BlockCodes {
                data: Tensor::empty(dev, params.dtype, &shape)?,
                scale_inv: dev.stream().alloc_zeros::<f32>((scale_rows * ld).max(1))?,
                scale_rows,
                ld,
            })
        };
        Ok(Self {
            rows,
            cols,
            block_dim: params.block_dim,
            rowwise: rowwise.then(|| make(false)).transpose()?,
            columnwise: columnwise.then(|| make(true)).transpose()?,
        })
    }
}

/// Quantizes `x` (bf16/f16, viewed as `[rows, cols]` over its last dim) blockwise with
/// `params` into `out` ([`BlockFp8::new`] for the same sizes and params): each orientation
/// `out` holds, in one pass over 128×128 tiles. Shapes need not be multiples of 128.
///
/// # Errors
/// [`Error::DType`] for an input other than bf16/f16; [`BlockQuantizeParams::validate`]'s
/// errors; [`Error::Shape`] when `out` was made for other sizes, another `block_dim` or other
/// codes; compile and launch failures.
pub fn quantize(dev: &Device, x: &Tensor, params: &BlockQuantizeParams, out: &mut BlockFp8) -> Result<()> {
    launch(dev, x, params, out, None)
}

/// f32 elements of the [`DbiasOut::workspace`] [`quantize_dbias`] of a `[rows, cols]` tensor
/// needs: `⌈rows/128⌉ · cols` (one row of column sums per 128-row tile). A workspace sized for
/// a cast_transpose ([`super::cast_transpose::dbias_workspace_len`], 64-row tiles) is large enough.
pub fn block_dbias_workspace_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(BLOCK) * cols
}

/// [`quantize`] with the bias gradient of `x` fused: `dbias.dbias[c] = Σ_r x[r, c]` (`[cols]`,
/// `x`'s dtype; f32 sums rounded once). Deterministic: the quantize kernel writes each 128-row
/// tile's f32 column sums into `dbias.workspace` (at least [`block_dbias_workspace_len`]`(rows,
/// cols)` f32, no initialization needed, scratch afterwards), a second kernel adds them in a
/// fixed order. The codes and scales are [`quantize`]'s, bit for bit. An `x` without rows gives
/// a zero `dbias`.
///
/// The column sums come from the column-wise pass: `params.block_dim` must be 1 and `out` must
/// hold the column-wise codes (the 2D quantizer has no fused dbias: use
/// [`super::cast_transpose::dbias`] after [`quantize`]).
///
/// # Errors
/// As [`quantize`]; [`Error::Argument`] for `block_dim` 2 or an `out` without column-wise codes;
/// [`Error::DType`] for a `dbias` of another dtype than `x`; [`Error::Shape`] for a `dbias` that
/// is not `[cols]` or a workspace that is too small.
pub fn quantize_dbias(
    dev: &Device,
    x: &Tensor,
    params: &BlockQuantizeParams,
    out: &mut BlockFp8,
    dbias: DbiasOut<'_>,
) -> Result<()> {
    launch(dev, x, params, out, Some(dbias))
}

/// [`quantize`] and [`quantize_dbias`]: checks, the quantize kernel and, with `dbias`, its
/// second pass.
fn launch(
    dev: &Device,
    x: &Tensor,
    params: &BlockQuantizeParams,
    out: &mut BlockFp8,
    dbias: Option<DbiasOut<'_>>,
) -> Result<()> {
    check_dtype(OP, "x", x, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    params.validate()?;
    let (rows, cols) = x.as_2d(OP)?;
    let codes_ok = [&out.rowwise, &out.columnwise].into_iter().flatten().all(|c| c.data.dtype() == params.dtype);
    if (out.rows, out.cols, out.block_dim) != (rows, cols, params.block_dim) || !codes_ok {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "the output was made for [{}, {}] in {}D blocks; x is [{rows}, {cols}] and the params ask for {}D {} codes: \
                 make it with BlockFp8::new for these",
                out.rows, out.cols, out.block_dim, params.block_dim, params.dtype
            ),
        });
    }
    let mut dbias = dbias;
    if let Some(d) = &dbias {
        check_dbias(x, params, out, d, rows, cols)?;
    }
    let (tiles_x, tiles_y) = (cols.div_ceil(BLOCK), rows.div_ceil(BLOCK));
    let dbias_blocks = if dbias.is_some() { cols.div_ceil(BlockQuantizeSpec::DBIAS_COLS) } else { 0 };
    if tiles_y > 65_535 || tiles_x.max(dbias_blocks) > i32::MAX as usize {
        return Err(Error::Shape {
            op: OP,
            message: format!("[{rows}, {cols}] has more 128x128 tiles than a launch grid holds: quantize it in parts"),
        });
    }
    let spec = BlockQuantizeSpec::new(x.dtype(), params.dtype, params.block_dim, dev.arch());
    if rows > 0 && cols > 0 {
        let f = dev.function(&KernelSpec::BlockQuantize(spec), 0)?;
        let sizes = [rows as u64, cols as u64];
        let lds = [out.rowwise.as_ref().map_or(0, |c| c.ld as u64), out.columnwise.as_ref().map_or(0, |c| c.ld as u64)];
        let (power_2, inf) = (i32::from(params.power_2), value_for_inf(x.dtype()));
        let null = 0u64;
        let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
        l.ptr("x", x.data());
        let ((q, s), (q_t, s_t)) = (split(out.rowwise.as_mut()), split(out.columnwise.as_mut()));
        for (name, t) in [("q", q), ("q_t", q_t)] {
            match t {
                Some(t) => l.ptr(name, t.data_mut()?),
                None => l.ptr(name, &null),
            };
        }
        for (name, si) in [("s", s), ("s_t", s_t)] {
            match si {
                Some(si) => l.ptr(name, si),
                None => l.ptr(name, &null),
            };
        }
        l.scalar("rows", &sizes[0]).scalar("cols", &sizes[1]).scalar("ld_s", &lds[0]).scalar("ld_s_t", &lds[1]);
        l.scalar("epsilon", &params.epsilon).scalar("power_2", &power_2).scalar("value_for_inf", &inf);
        if params.block_dim == 1 {
            match &mut dbias {
                Some(d) => l.ptr("dbias_partial", &mut d.workspace),
                None => l.ptr("dbias_partial", &null),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (tiles_x as u32, tiles_y as u32, 1),
            block_dim: (BlockQuantizeSpec::THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: x holds rows · cols elements of the spec's input type; each code tensor holds
        // rows · cols bytes in its orientation and each scale_inv scale_rows · ld f32, the
        // kernel's indices staying below (ld ≥ the scales of a row); a dbias workspace holds
        // ⌈rows/128⌉ · cols f32 (checked); the outputs are distinct allocations (`&mut`), absent
        // ones null.
        unsafe { l.launch(cfg) }?;
    }
    if let Some(mut d) = dbias {
        if cols == 0 {
            return Ok(());
        }
        let g = dev.function(&KernelSpec::BlockQuantize(spec), 1)?;
        let (cols_u64, row_tiles) = (cols as u64, tiles_y as u64);
        let mut l = Launch::new(OP, dev.stream(), &g, &spec, 1);
        l.ptr("dbias_partial", &mut d.workspace).ptr("dbias", d.dbias.data_mut()?);
        l.scalar("cols", &cols_u64).scalar("row_tiles", &row_tiles);
        let cfg = launch_1d(dbias_blocks, BlockQuantizeSpec::DBIAS_THREADS, 0);
        // SAFETY: the workspace rows 0 .. row_tiles were written by the launch above on the same
        // stream (none are read without rows); `dbias` holds cols elements of x's dtype
        // (checked); one block per DBIAS_COLS columns (a grid checked above).
        unsafe { l.launch(cfg) }?;
    }
    Ok(())
}

/// The checks of [`quantize_dbias`]'s `dbias` against `x`, `params` and `out`.
fn check_dbias(
    x: &Tensor,
    params: &BlockQuantizeParams,
    out: &BlockFp8,
    d: &DbiasOut<'_>,
    rows: usize,
    cols: usize,
) -> Result<()> {
    if params.block_dim != 1 {
        return Err(Error::Argument {
            op: OP,
            message: "the fused dbias needs 1D blocks (block_dim 1, the gradients' 128x1 column tiles): for \
                      128x128 blocks run quantize, then ops::cast_transpose::dbias"
                .into(),
        });
    }
    if out.columnwise.is_none() {
        return Err(Error::Argument {
            op: OP,
            message: "the fused dbias sums the columns in the column-wise pass: make the output with \
                      BlockFp8::new(.., columnwise = true)"
                .into(),
        });
    }
    let dt = x.dtype();
    check_dtype(OP, "dbias", d.dbias, |t| t == dt, &format!("{dt} (the dtype of `x`)"))?;
    check_shape(OP, "dbias", d.dbias, &[cols])?;
    let need = block_dbias_workspace_len(rows, cols);
    if d.workspace.len() < need {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "the dbias workspace holds {} f32, needs {need}: allocate block_dbias_workspace_len({rows}, {cols})",
                d.workspace.len()
            ),
        });
    }
    Ok(())
}

/// The codes and the scales of one orientation, borrowed apart.
fn split(c: Option<&mut BlockCodes>) -> (Option<&mut Tensor>, Option<&mut CudaSlice<f32>>) {
    match c {
        Some(c) => (Some(&mut c.data), Some(&mut c.scale_inv)),
        None => (None, None),
    }
}
