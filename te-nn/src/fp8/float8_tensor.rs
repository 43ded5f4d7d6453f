//! `Float8Tensor`: FP8 codes with the `scale_inv` they were cast with and, when a TN GEMM needs
//! it, the transposed copy (TE `pytorch/tensor/float8_tensor.py`).

use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::gemm::{BlockScale, Operand};
use te_runtime::graph::HostCopies;
use te_runtime::numerics;
use te_runtime::ops::block_quantize::{BlockCodes, BlockFp8};
use te_runtime::ops::{self, Fp8Meta};
use te_runtime::{Device, Error, Result, Tensor};

/// An FP8 tensor: E4M3 or E5M2 codes `q` of a high-precision tensor `x`, `q = fp8(x * scale)`,
/// with `scale_inv = 1 / scale` (one f32 on the device) so that `x ≈ q * scale_inv`.
///
/// `data` is row-major `[..., cols]`. Hopper's FP8 GEMMs take only the TN layout, so a tensor
/// that is the "wrong" operand of a GEMM also carries `transpose`, the same codes as
/// `[cols, rows]` (leading dims folded into `rows`). The transpose is made by the cast when
/// backward will need it, built lazily with [`Float8Tensor::ensure_transpose`] otherwise, and
/// dropped with [`Float8Tensor::drop_transpose`] when nothing needs it (an inference weight
/// keeps none: 1 byte per element).
///
/// **Blockwise scaling** (TE's `Float8BlockwiseQTensor`, [`crate::fp8::Float8BlockScaling`]):
/// `scale_inv` holds one f32 per block in the layout [`Float8Tensor::block_scale`] names, and
/// the transpose has scales of its own: with 1×128 tiles it is quantized again from the
/// high-precision values (its 128×1 tiles are other blocks), so it exists only when the cast
/// made it; with 128×128 blocks it holds the same blocks transposed.
///
/// Cloning shares the device buffers (as [`Tensor`] does).
#[derive(Debug, Clone)]
pub struct Float8Tensor {
    data: Tensor,
    transpose: Option<Tensor>,
    scale_inv: Arc<CudaSlice<f32>>,
    block: Option<BlockScales>,
}

/// The block scales of a blockwise [`Float8Tensor`] beyond the row-wise ones in `scale_inv`.
#[derive(Debug, Clone)]
struct BlockScales {
    /// The layout of both orientations' scales.
    kind: BlockScale,
    /// The transpose's scales, with the transpose.
    transpose_scale_inv: Option<Arc<CudaSlice<f32>>>,
}

impl Float8Tensor {
    /// Wraps FP8 `data` (and optionally its `transpose`, `[cols, rows]`) with its `scale_inv`
    /// (`[1]` f32).
    ///
    /// # Errors
    /// [`Error::DType`] when `data` is not E4M3/E5M2 or `transpose` has another dtype;
    /// [`Error::Shape`] when `transpose` is not `[cols, rows]` of `data` or `scale_inv` is not
    /// one float.
    pub fn from_parts(data: Tensor, transpose: Option<Tensor>, scale_inv: Arc<CudaSlice<f32>>) -> Result<Self> {
        const OP: &str = "Float8Tensor::from_parts";
        ops::check_dtype(OP, "data", &data, DType::is_fp8, "e4m3 or e5m2")?;
        if let Some(t) = &transpose {
            ops::check_dtype(OP, "transpose", t, |d| d == data.dtype(), data.dtype().name())?;
            let (rows, cols) = data.as_2d(OP)?;
            ops::check_shape(OP, "transpose", t, &[cols, rows])?;
        }
        if scale_inv.len() != 1 {
            return Err(Error::Shape {
                op: OP,
                message: format!("scale_inv must hold 1 f32, got {}", scale_inv.len()),
            });
        }
        Ok(Self { data, transpose, scale_inv, block: None })
    }

    /// Wraps the output of [`ops::block_quantize::quantize`]: the row-wise codes (required),
    /// viewed as `shape` (the input's, `[..., cols]`), and, when it made them, the column-wise
    /// ones as the transpose.
    ///
    /// # Errors
    /// [`Error::Shape`] when `q` has no row-wise codes or `shape` holds another count.
    pub fn from_block(q: BlockFp8, shape: &[usize]) -> Result<Self> {
        let kind = if q.block_dim == 1 { BlockScale::Vec128 } else { BlockScale::Blk128x128 };
        let row: BlockCodes = q.rowwise.ok_or_else(|| Error::Shape {
            op: "Float8Tensor::from_block",
            message: "the blockwise cast made no row-wise codes: quantize with rowwise = true".into(),
        })?;
        let (transpose, transpose_scale_inv) = match q.columnwise {
            Some(c) => (Some(c.data), Some(Arc::new(c.scale_inv))),
            None => (None, None),
        };
        Ok(Self {
            data: row.data.reshape(shape)?,
            transpose,
            scale_inv: Arc::new(row.scale_inv),
            block: Some(BlockScales { kind, transpose_scale_inv }),
        })
    }

    /// The layout of the block scales of a blockwise tensor (both orientations); `None` for
    /// one scale per tensor.
    pub fn block_scale(&self) -> Option<BlockScale> {
        self.block.as_ref().map(|b| b.kind)
    }

    /// The codes as a GEMM operand `[rows, cols]` (k = cols), with their scales.
    pub fn operand(&self) -> Operand<'_> {
        self.operand_of(&self.data, &self.scale_inv)
    }

    /// The transposed codes as a GEMM operand `[cols, rows]` (k = rows), with their scales;
    /// `None` when there is no transposed copy.
    pub fn transpose_operand(&self) -> Option<Operand<'_>> {
        let t = self.transpose.as_ref()?;
        match &self.block {
            None => Some(self.operand_of(t, &self.scale_inv)),
            Some(b) => Some(self.operand_of(t, b.transpose_scale_inv.as_ref()?)),
        }
    }

    fn operand_of<'a>(&'a self, codes: &'a Tensor, scale_inv: &'a CudaSlice<f32>) -> Operand<'a> {
        match &self.block {
            None => Operand::fp8(codes, scale_inv.as_view()),
            Some(b) => Operand::fp8_block(codes, scale_inv.as_view(), b.kind),
        }
    }

    /// Casts `x` (f32/bf16/f16) to `dtype` with a fixed `scale`: `q = fp8(x * scale)`. With
    /// `with_transpose` the transposed copy is written by the same kernel (`x` then needs a last
    /// dim that is a multiple of 16). For module casts the scale comes from the recipe instead.
    ///
    /// # Errors
    /// Dtype/shape errors of [`ops::cast::quantize`] / [`ops::cast_transpose::cast_transpose`];
    /// driver failures.
    pub fn quantize(dev: &Device, x: &Tensor, dtype: DType, scale: f32, with_transpose: bool) -> Result<Self> {
        let mut meta = Fp8Meta::new(dev, scale)?;
        let mut data = Tensor::empty(dev, dtype, x.shape())?;
        let transpose = if with_transpose {
            let (rows, cols) = x.as_2d("Float8Tensor::quantize")?;
            let mut t = Tensor::empty(dev, dtype, &[cols, rows])?;
            ops::cast_transpose::cast_transpose(dev, x, &mut data, &mut t, &mut meta.scaling(), None)?;
            Some(t)
        } else {
            ops::cast::quantize(dev, x, &mut data, &mut meta.scaling())?;
            None
        };
        Ok(Self { data, transpose, scale_inv: Arc::new(meta.scale_inv), block: None })
    }

    /// Shape of the (row-major) data.
    pub fn shape(&self) -> &[usize] {
        self.data.shape()
    }

    /// E4M3 or E5M2.
    pub fn dtype(&self) -> DType {
        self.data.dtype()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.data.numel()
    }

    /// The FP8 codes, row-major.
    pub fn data(&self) -> &Tensor {
        &self.data
    }

    /// The transposed codes `[cols, rows]`, when present.
    pub fn transpose(&self) -> Option<&Tensor> {
        self.transpose.as_ref()
    }

    /// `[1]` f32: `1 / scale` of the cast that made the codes; for a blockwise tensor the
    /// row-wise codes' block scales (see [`Float8Tensor::block_scale`]).
    pub fn scale_inv(&self) -> &CudaSlice<f32> {
        &self.scale_inv
    }

    /// The shared `scale_inv` buffer (for a tensor made of other codes with the same scale).
    pub fn scale_inv_shared(&self) -> Arc<CudaSlice<f32>> {
        self.scale_inv.clone()
    }

    /// Device bytes held: codes, transpose and scales.
    pub fn num_bytes(&self) -> usize {
        let t_scales = self.block.as_ref().and_then(|b| b.transpose_scale_inv.as_ref()).map_or(0, |s| s.len() * 4);
        self.data.num_bytes()
            + self.transpose.as_ref().map_or(0, Tensor::num_bytes)
            + self.scale_inv.len() * 4
            + t_scales
    }

    /// Builds the transposed copy if it is missing (a byte transpose of the codes: exact).
    ///
    /// # Errors
    /// The last dim is not a multiple of 16; [`Error::Argument`] for a blockwise tensor
    /// without its transpose (it comes from the high-precision values: cast again with
    /// `columnwise`); launch failures.
    pub fn ensure_transpose(&mut self, dev: &Device) -> Result<&Tensor> {
        let t = match self.transpose.take() {
            Some(t) => t,
            None if self.block.is_some() => {
                return Err(Error::Argument {
                    op: "Float8Tensor::ensure_transpose",
                    message: "a blockwise FP8 tensor gets its transposed codes from the high-precision values at \
                              the cast (quantize with columnwise), not from its codes"
                        .into(),
                })
            }
            None => {
                let (rows, cols) = self.data.as_2d("Float8Tensor::ensure_transpose")?;
                let mut t = Tensor::empty(dev, self.dtype(), &[cols, rows])?;
                ops::cast_transpose::transpose_fp8(dev, &self.data, &mut t)?;
                t
            }
        };
        Ok(self.transpose.insert(t))
    }

    /// Drops the transposed copy, freeing its memory.
    pub fn drop_transpose(&mut self) {
        self.transpose = None;
        if let Some(b) = &mut self.block {
            b.transpose_scale_inv = None;
        }
    }

    /// The transposed copy as a tensor of its own: `[cols, rows]` codes with their scales
    /// (the same `scale_inv`, or the transpose's block scales; what a module saves for its
    /// wgrad GEMM; the row-wise codes are dropped). `None` when there is no transposed copy.
    pub fn into_transposed(self) -> Option<Float8Tensor> {
        let data = self.transpose?;
        match self.block {
            None => Some(Float8Tensor { data, transpose: None, scale_inv: self.scale_inv, block: None }),
            Some(b) => Some(Float8Tensor {
                data,
                transpose: None,
                scale_inv: b.transpose_scale_inv?,
                block: Some(BlockScales { kind: b.kind, transpose_scale_inv: None }),
            }),
        }
    }

    /// `x = q * scale_inv` as a new tensor of `dtype` (f32/bf16/f16). A blockwise tensor is
    /// dequantized through the host ([`Float8Tensor::to_f32`]): for checks and conversions,
    /// not for a training step.
    ///
    /// # Errors
    /// A non-high-precision `dtype`; launch failures.
    pub fn dequantize(&self, dev: &Device, dtype: DType) -> Result<Tensor> {
        if self.block.is_some() {
            return Tensor::from_f32(dev, dtype, self.shape(), &self.to_f32(dev)?);
        }
        let mut y = Tensor::empty(dev, dtype, self.shape())?;
        ops::cast::dequantize(dev, &self.data, &self.scale_inv.as_view(), &mut y)?;
        Ok(y)
    }

    /// The codes copied to the host.
    ///
    /// # Errors
    /// Driver failures.
    pub fn to_bytes(&self, dev: &Device) -> Result<Vec<u8>> {
        self.data.to_bytes(dev)
    }

    /// `scale_inv` copied to the host.
    ///
    /// # Errors
    /// [`Error::Argument`] for a blockwise tensor (many scales: see
    /// [`Float8Tensor::block_scale_inv_host`]); driver failures.
    pub fn scale_inv_host(&self, dev: &Device) -> Result<f32> {
        if self.block.is_some() {
            return Err(Error::Argument {
                op: "Float8Tensor::scale_inv_host",
                message: "a blockwise FP8 tensor has one scale per block: read them with block_scale_inv_host".into(),
            });
        }
        Ok(dev.stream().dtoh(self.scale_inv.as_ref())?[0])
    }

    /// The row-wise codes' block scales copied to the host, in the layout of
    /// [`Float8Tensor::block_scale`] (empty for a per-tensor scale).
    ///
    /// # Errors
    /// Driver failures.
    pub fn block_scale_inv_host(&self, dev: &Device) -> Result<Vec<f32>> {
        match self.block {
            Some(_) => Ok(dev.stream().dtoh(self.scale_inv.as_ref())?),
            None => Ok(Vec::new()),
        }
    }

    /// The dequantized values `q * scale_inv` on the host (exact: f32 holds every FP8 value
    /// times a float), each code with its block's scale for a blockwise tensor.
    ///
    /// # Errors
    /// Driver failures.
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        let codes = self.to_bytes(dev)?;
        let dtype = self.dtype();
        let Some(b) = &self.block else {
            let si = self.scale_inv_host(dev)?;
            return Ok(codes.into_iter().map(|q| numerics::dequantize(dtype, q) * si).collect());
        };
        let (rows, cols) = self.data.as_2d("Float8Tensor::to_f32")?;
        let scales = dev.stream().dtoh(self.scale_inv.as_ref())?;
        let scale = |i: usize| scales.get(b.kind.index(rows, cols, (i / cols, i % cols))).copied().unwrap_or(f32::NAN);
        Ok(codes.into_iter().enumerate().map(|(i, q)| numerics::dequantize(dtype, q) * scale(i)).collect())
    }
}
