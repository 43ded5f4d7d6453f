//! A minimal device tensor: contiguous bytes of one dtype and a shape, on the device's stream.

use crate::reference::numerics;
use crate::{Device, Error, Result};
use cudarc::driver::CudaSlice;
use te_codegen::DType;

/// A contiguous row-major device tensor. FP8 tensors hold their codes; their scales travel
/// separately (see [`crate::ops::Fp8Scaling`]).
#[derive(Debug)]
pub struct Tensor {
    data: CudaSlice<u8>,
    dtype: DType,
    shape: Vec<usize>,
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

impl Tensor {
    /// A zero-filled tensor.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn zeros(dev: &Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        let bytes = numel(shape) * dtype.size_bytes();
        let data = dev.stream().alloc_zeros::<u8>(bytes.max(1))?;
        Ok(Self { data, dtype, shape: shape.to_vec() })
    }

    /// A tensor holding `bytes` (the dtype's little-endian encoding, e.g. bf16 bits).
    ///
    /// # Errors
    /// [`Error::Shape`] when the byte count does not match `shape`; allocation failures.
    pub fn from_bytes(dev: &Device, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let want = numel(shape) * dtype.size_bytes();
        if bytes.len() != want {
            return Err(Error::Shape {
                op: "Tensor::from_bytes",
                message: format!("{shape:?} {dtype} needs {want} bytes, got {}", bytes.len()),
            });
        }
        let data =
            if bytes.is_empty() { dev.stream().alloc_zeros::<u8>(1)? } else { dev.stream().clone_htod(bytes)? };
        Ok(Self { data, dtype, shape: shape.to_vec() })
    }

    /// A tensor of `values` rounded to `dtype` (FP8 values are cast with scale 1).
    ///
    /// # Errors
    /// As [`Tensor::from_bytes`].
    pub fn from_f32(dev: &Device, dtype: DType, shape: &[usize], values: &[f32]) -> Result<Self> {
        Self::from_bytes(dev, dtype, shape, &numerics::encode(dtype, values))
    }

    /// Copies the raw bytes to the host (waits for the stream).
    ///
    /// # Errors
    /// Driver failures, including a failed earlier kernel.
    pub fn to_bytes(&self, dev: &Device) -> Result<Vec<u8>> {
        let mut v = dev.stream().clone_dtoh(&self.data)?;
        v.truncate(self.num_bytes());
        Ok(v)
    }

    /// Copies to the host and widens every element to f32.
    ///
    /// # Errors
    /// As [`Tensor::to_bytes`].
    pub fn to_f32(&self, dev: &Device) -> Result<Vec<f32>> {
        Ok(numerics::decode(self.dtype, &self.to_bytes(dev)?))
    }

    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }

    /// Size in bytes.
    pub fn num_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }

    /// The device buffer.
    pub fn data(&self) -> &CudaSlice<u8> {
        &self.data
    }

    /// The device buffer, mutably.
    pub fn data_mut(&mut self) -> &mut CudaSlice<u8> {
        &mut self.data
    }

    /// The shape as `[rows, cols]`: all leading dims folded into rows.
    ///
    /// # Errors
    /// [`Error::Shape`] for a 0-d tensor.
    pub fn as_2d(&self, op: &'static str) -> Result<(usize, usize)> {
        match self.shape.split_last() {
            Some((&cols, lead)) => Ok((lead.iter().product(), cols)),
            None => {
                Err(Error::Shape { op, message: "expected a tensor with at least one dimension, got a scalar".into() })
            }
        }
    }
}
