//! `Float8Tensor`: FP8 codes with the `scale_inv` they were cast with and, when a TN GEMM needs
//! it, the transposed copy (TE `pytorch/tensor/float8_tensor.py`).

use crate::graph::HostCopies;
use crate::numerics;
use crate::ops::{self, Fp8Meta};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;

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
/// Cloning shares the device buffers (as [`Tensor`] does).
#[derive(Debug, Clone)]
pub struct Float8Tensor {
    data: Tensor,
    transpose: Option<Tensor>,
    scale_inv: Arc<CudaSlice<f32>>,
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
        Ok(Self { data, transpose, scale_inv })
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
        Ok(Self { data, transpose, scale_inv: Arc::new(meta.scale_inv) })
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

    /// `[1]` f32: `1 / scale` of the cast that made the codes.
    pub fn scale_inv(&self) -> &CudaSlice<f32> {
        &self.scale_inv
    }

    /// The shared `scale_inv` buffer (for a tensor made of other codes with the same scale).
    pub fn scale_inv_shared(&self) -> Arc<CudaSlice<f32>> {
        self.scale_inv.clone()
    }

    /// Device bytes held: codes, transpose and `scale_inv`.
    pub fn num_bytes(&self) -> usize {
        self.data.num_bytes() + self.transpose.as_ref().map_or(0, Tensor::num_bytes) + 4
    }

    /// Builds the transposed copy if it is missing (a byte transpose of the codes: exact).
    ///
    /// # Errors
    /// The last dim is not a multiple of 16; launch failures.
    pub fn ensure_transpose(&mut self, dev: &Device) -> Result<&Tensor> {
        let t = match self.transpose.take() {
            Some(t) => t,
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
    }

    /// The transposed copy as a tensor of its own: `[cols, rows]` codes with the same
    /// `scale_inv` (what a module saves for its wgrad GEMM; the row-wise codes are dropped).
    /// `None` when there is no transposed copy.
    pub fn into_transposed(self) -> Option<Float8Tensor> {
        let scale_inv = self.scale_inv;
        self.transpose.map(|data| Float8Tensor { data, transpose: None, scale_inv })
    }

    /// `x = q * scale_inv` as a new tensor of `dtype` (f32/bf16/f16).
    ///
    /// # Errors
    /// A non-high-precision `dtype`; launch failures.
    pub fn dequantize(&self, dev: &Device, dtype: DType) -> Result<Tensor> {
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
    /// Driver failures.
    pub fn scale_inv_host(&self, dev: &Device) -> Result<f32> {
        Ok(dev.stream().dtoh(self.scale_inv.as_ref())?[0])
    }

    /// The dequantized values `q * scale_inv` on the host (exact: f32 holds every FP8 value
    /// times a float).
    ///
    /// # Errors
    /// Driver failures.
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        let si = self.scale_inv_host(dev)?;
        Ok(self.to_bytes(dev)?.into_iter().map(|q| numerics::dequantize(self.dtype(), q) * si).collect())
    }
}
