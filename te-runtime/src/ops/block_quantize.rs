//! Family 16's launcher: blockwise FP8 quantization (TE 2.x `Float8BlockScaling`,
//! DeepSeek-V3's recipe): one f32 scale per 1×128 tile (with a 128×1-tiled transposed copy) or
//! per 128×128 block, the scales in the layouts cuBLASLt's block-scaled FP8 GEMMs read (TE's
//! `GEMM_READY`). The numerics are [`crate::reference::block_scaling`]'s, bit for bit.

use super::check_dtype;
use super::launch::Launch;
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
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let spec = BlockQuantizeSpec::new(x.dtype(), params.dtype, params.block_dim, dev.arch());
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
    let (tiles_x, tiles_y) = (cols.div_ceil(BLOCK), rows.div_ceil(BLOCK));
    if tiles_y > 65_535 || tiles_x > i32::MAX as usize {
        return Err(Error::Shape {
            op: OP,
            message: format!("[{rows}, {cols}] has more 128x128 tiles than a launch grid holds: quantize it in parts"),
        });
    }
    let cfg = LaunchConfig {
        grid_dim: (tiles_x as u32, tiles_y as u32, 1),
        block_dim: (BlockQuantizeSpec::THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: x holds rows · cols elements of the spec's input type; each code tensor holds
    // rows · cols bytes in its orientation and each scale_inv scale_rows · ld f32, the
    // kernel's indices staying below (ld ≥ the scales of a row); the outputs are distinct
    // allocations (`&mut`), absent ones null.
    unsafe { l.launch(cfg) }?;
    Ok(())
}

/// The codes and the scales of one orientation, borrowed apart.
fn split(c: Option<&mut BlockCodes>) -> (Option<&mut Tensor>, Option<&mut CudaSlice<f32>>) {
    match c {
        Some(c) => (Some(&mut c.data), Some(&mut c.scale_inv)),
        None => (None, None),
    }
}
