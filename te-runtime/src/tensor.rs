//! A device tensor: contiguous bytes of one dtype and a shape, on the device's stream.

use crate::graph::HostCopies;
use crate::graph_memory::DeviceBuffer;
use crate::numerics;
use crate::{Device, Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;
use te_codegen::DType;

/// A contiguous row-major device tensor. FP8 tensors hold their codes; their scales travel
/// separately (see [`crate::ops::Fp8Scaling`] and `te_nn::fp8::Float8Tensor`).
///
/// Cloning is cheap and shares the storage, as a `torch.Tensor` reference does (a module keeps
/// its input for backward this way without a copy). Writing through [`Tensor::data_mut`] copies
/// the storage first when it is shared (copy-on-write), so a clone never sees later writes.
#[derive(Debug, Clone)]
pub struct Tensor {
    data: Arc<DeviceBuffer>,
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
    /// [`crate::Error::OutOfMemory`] when the device cannot hold it; other allocation failures.
    pub fn zeros(dev: &Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        let bytes = numel(shape) * dtype.size_bytes();
        let data = dev.stream().alloc_zeros::<u8>(bytes.max(1)).map_err(|e| dev.alloc_error(e, bytes, dtype, shape))?;
        Ok(Self { data: Arc::new(DeviceBuffer::new(data)), dtype, shape: shape.to_vec() })
    }

    /// A tensor whose contents are unspecified until written (`torch.empty`): for outputs an op
    /// overwrites in full, without the memset of [`Tensor::zeros`].
    ///
    /// # Errors
    /// [`crate::Error::OutOfMemory`] when the device cannot hold it; other allocation failures.
    pub fn empty(dev: &Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        let bytes = numel(shape) * dtype.size_bytes();
        // SAFETY: `u8` has no invalid bit patterns, and device bytes are only read by kernels
        // and by copies into host `u8`s: unspecified contents are never undefined behaviour.
        let data =
            unsafe { dev.stream().alloc::<u8>(bytes.max(1)) }.map_err(|e| dev.alloc_error(e, bytes, dtype, shape))?;
        Ok(Self { data: Arc::new(DeviceBuffer::new(data)), dtype, shape: shape.to_vec() })
    }

    /// A tensor of ones (`torch.ones`), filled on the device by a memset of the dtype's
    /// encoding of 1.0 (no host copy, so it can be captured in a CUDA graph).
    ///
    /// # Errors
    /// Allocation and driver failures.
    pub fn ones(dev: &Device, dtype: DType, shape: &[usize]) -> Result<Self> {
        let mut t = Self::empty(dev, dtype, shape)?;
        let n = t.numel();
        if n == 0 {
            return Ok(t);
        }
        use cudarc::driver::sys::{cuMemsetD16Async, cuMemsetD32Async, cuMemsetD8Async};
        let stream = dev.stream().clone();
        let cu = stream.cu_stream();
        {
            let (ptr, _guard) = t.data_mut()?.device_ptr_mut(&stream);
            // SAFETY: `ptr` is a live allocation of `n` elements of `dtype` (`n · size` bytes),
            // the memset writes exactly that many, ordered on the stream every op of this crate
            // uses.
            unsafe {
                match dtype {
                    DType::F32 => cuMemsetD32Async(ptr, 1.0f32.to_bits(), n, cu),
                    DType::BF16 => cuMemsetD16Async(ptr, half::bf16::ONE.to_bits(), n, cu),
                    DType::F16 => cuMemsetD16Async(ptr, half::f16::ONE.to_bits(), n, cu),
                    DType::E4M3 | DType::E5M2 => cuMemsetD8Async(ptr, numerics::quantize(dtype, 1.0), n, cu),
                }
            }
            .result()?;
        }
        Ok(t)
    }

    /// A tensor holding `bytes` (the dtype's little-endian encoding, e.g. bf16 bits).
    ///
    /// # Errors
    /// [`Error::Shape`] when the byte count does not match `shape`; allocation failures.
    pub fn from_bytes(dev: &Device, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        Self::from_bytes_on(dev.stream(), dtype, shape, bytes)
    }

    /// As [`Tensor::from_bytes`], on `stream` (the stream of a tensor this one replaces).
    pub fn from_bytes_on(stream: &Arc<CudaStream>, dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let want = numel(shape) * dtype.size_bytes();
        if bytes.len() != want {
            return Err(Error::Shape {
                op: "Tensor::from_bytes",
                message: format!("{shape:?} {dtype} needs {want} bytes, got {}", bytes.len()),
            });
        }
        let data = if bytes.is_empty() { stream.alloc_zeros::<u8>(1)? } else { stream.htod(bytes)? };
        Ok(Self { data: Arc::new(DeviceBuffer::new(data)), dtype, shape: shape.to_vec() })
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
        let mut v = dev.stream().dtoh(&**self.data)?;
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

    /// The device buffer, mutably: copied first when a clone shares it.
    ///
    /// # Errors
    /// Allocation or copy failures of that copy.
    pub fn data_mut(&mut self) -> Result<&mut CudaSlice<u8>> {
        if Arc::get_mut(&mut self.data).is_none() {
            let stream = self.data.stream().clone();
            let mut copy = stream.alloc_zeros::<u8>(self.data.len())?;
            stream.memcpy_dtod(&**self.data, &mut copy)?;
            self.data = Arc::new(DeviceBuffer::new(copy));
        }
        Arc::get_mut(&mut self.data)
            .map(|s| &mut **s)
            .ok_or_else(|| Error::internal("Tensor::data_mut", "storage is shared after the copy"))
    }

    /// Copies `src` into this tensor's storage, in place, on the device (`torch.Tensor.copy_`):
    /// how a CUDA graph's static inputs get the next batch before a replay
    /// ([`crate::graph::Graph::replay`]), which reads them by address. Unlike a write through
    /// [`Tensor::data_mut`] (copy-on-write), every clone sharing the storage sees the new values,
    /// as every reference to a `torch.Tensor` sees `copy_`: a context a module saved from this
    /// tensor reads them too.
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] when `src` differs in shape or dtype; copy failures.
    pub fn copy_from(&self, src: &Tensor) -> Result<()> {
        if src.shape != self.shape {
            return Err(Error::Shape {
                op: "Tensor::copy_from",
                message: format!("the source {:?} must have the destination's shape {:?}", src.shape, self.shape),
            });
        }
        if src.dtype != self.dtype {
            return Err(Error::DType {
                op: "Tensor::copy_from",
                arg: "src",
                expected: self.dtype.to_string(),
                got: src.dtype,
            });
        }
        let stream = self.data.stream();
        let (dst, _dst_guard) = self.data.device_ptr(stream);
        let (from, _src_guard) = src.data.device_ptr(stream);
        // SAFETY: both buffers are live device allocations of `num_bytes` bytes (same shape and
        // dtype); the copy is ordered on the stream every op of this crate uses, so it runs after
        // the work that wrote `src` and before any later reader of `self`. Writing storage that
        // clones share is this method's documented purpose; no Rust reference to device memory
        // is created.
        unsafe { cudarc::driver::sys::cuMemcpyDtoDAsync_v2(dst, from, self.num_bytes(), stream.cu_stream()) }
            .result()?;
        Ok(())
    }

    /// Copies the `len` elements of `src` from its element `src_at` (flattened, row-major) into
    /// this tensor's storage from element `at`, in place, on the device: every clone sharing
    /// the storage sees them, as with [`Tensor::copy_from`] (how a ZeRO-3 rank puts its piece of
    /// a weight into the layer's transient whole buffer, and takes its piece of a loaded one).
    /// `len` 0 is nothing to do.
    ///
    /// # Errors
    /// [`Error::DType`] when `src` has another dtype; [`Error::Shape`] for a range past either
    /// tensor's elements; copy failures.
    pub fn copy_elements_from(&self, at: usize, src: &Tensor, src_at: usize, len: usize) -> Result<()> {
        const OP: &str = "Tensor::copy_elements_from";
        if src.dtype != self.dtype {
            return Err(Error::DType { op: OP, arg: "src", expected: self.dtype.to_string(), got: src.dtype });
        }
        let inside = |start: usize, n: usize| start.checked_add(len).is_some_and(|end| end <= n);
        if !inside(at, self.numel()) || !inside(src_at, src.numel()) {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "{len} elements from {src_at} of a tensor of {} into {at} of one of {}: both ranges must lie inside \
                     their tensors",
                    src.numel(),
                    self.numel()
                ),
            });
        }
        if len == 0 {
            return Ok(());
        }
        let elem = self.dtype.size_bytes();
        let stream = self.data.stream();
        let (dst, _dst_guard) = self.data.device_ptr(stream);
        let (from, _src_guard) = src.data.device_ptr(stream);
        // SAFETY: both ranges lie inside live device allocations (checked above, in elements of
        // one dtype); the copy is ordered on the stream every op of this crate uses, as in
        // `copy_from`. Writing storage that clones share is this method's documented purpose; no
        // Rust reference to device memory is created.
        unsafe {
            cudarc::driver::sys::cuMemcpyDtoDAsync_v2(
                dst + (at * elem) as u64,
                from + (src_at * elem) as u64,
                len * elem,
                stream.cu_stream(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Whether another clone shares this tensor's storage.
    pub fn is_shared(&self) -> bool {
        Arc::strong_count(&self.data) > 1
    }

    /// The same storage under another shape with as many elements (a view, as `torch.reshape`
    /// of a contiguous tensor).
    ///
    /// # Errors
    /// [`Error::Shape`] when the element counts differ.
    pub fn reshape(&self, shape: &[usize]) -> Result<Tensor> {
        if numel(shape) != self.numel() {
            return Err(Error::Shape {
                op: "Tensor::reshape",
                message: format!("cannot view {:?} ({} elements) as {shape:?}", self.shape, self.numel()),
            });
        }
        Ok(Tensor { data: self.data.clone(), dtype: self.dtype, shape: shape.to_vec() })
    }

    /// The rows of this tensor (`[rows, cols]`, leading dims folded) split into consecutive
    /// groups of `sizes[i]` rows, each copied into a `[sizes[i], cols]` tensor of its own
    /// (`torch.split` along dim 0, but copies: a [`Tensor`] is always a whole allocation).
    /// A group of 0 rows is an empty `[0, cols]` tensor.
    ///
    /// # Errors
    /// [`Error::Shape`] when `sizes` do not add up to the rows; allocation and copy failures.
    pub fn split_rows(&self, dev: &Device, sizes: &[usize]) -> Result<Vec<Tensor>> {
        const OP: &str = "Tensor::split_rows";
        let (rows, cols) = self.as_2d(OP)?;
        let total: usize = sizes.iter().sum();
        if total != rows {
            return Err(Error::Shape {
                op: OP,
                message: format!("the split sizes {sizes:?} add up to {total} rows, but the tensor has {rows}"),
            });
        }
        let mut start = 0;
        let mut parts = Vec::with_capacity(sizes.len());
        for &n in sizes {
            parts.push(self.copy_rows(dev, start, n, cols)?);
            start += n;
        }
        Ok(parts)
    }

    /// The slices `range` of the first dim, copied (`x[a..b]` in torch, `[b - a, ...]`).
    ///
    /// # Errors
    /// [`Error::Shape`] for a range past the first dim; allocation and copy failures.
    pub fn narrow(&self, dev: &Device, range: std::ops::Range<usize>) -> Result<Tensor> {
        const OP: &str = "Tensor::narrow";
        let d0 = self.shape.first().copied().unwrap_or(0);
        if range.start > range.end || range.end > d0 {
            return Err(Error::Shape {
                op: OP,
                message: format!("rows {range:?} of the first dim of {:?}", self.shape),
            });
        }
        let per = self.shape[1..].iter().product::<usize>();
        let mut out = self.copy_rows(dev, range.start * per, range.len() * per, 1)?;
        let mut shape = self.shape.clone();
        shape[0] = range.len();
        out.shape = shape;
        Ok(out)
    }

    /// `n` rows of `cols` elements from row `start` into a new `[n, cols]` tensor.
    fn copy_rows(&self, dev: &Device, start: usize, n: usize, cols: usize) -> Result<Tensor> {
        let row_bytes = cols * self.dtype.size_bytes();
        let mut part = Tensor::empty(dev, self.dtype, &[n, cols])?;
        if n > 0 {
            let src = self.data.slice(start * row_bytes..(start + n) * row_bytes);
            dev.stream().memcpy_dtod(&src, part.data_mut()?)?;
        }
        Ok(part)
    }

    /// `parts` (each `[rows_i, cols]`, leading dims folded, one dtype) stacked along the rows
    /// into one `[Σ rows_i, cols]` tensor (`torch.cat` along dim 0).
    ///
    /// # Errors
    /// [`Error::Shape`] for no parts or parts of different widths; [`Error::DType`] for mixed
    /// dtypes; allocation and copy failures.
    pub fn cat_rows(dev: &Device, parts: &[Tensor]) -> Result<Tensor> {
        const OP: &str = "Tensor::cat_rows";
        let first = parts.first().ok_or_else(|| Error::Shape { op: OP, message: "no tensors to stack".into() })?;
        let (_, cols) = first.as_2d(OP)?;
        let mut rows = 0;
        for p in parts {
            let (r, c) = p.as_2d(OP)?;
            if c != cols {
                return Err(Error::Shape {
                    op: OP,
                    message: format!("every part must have {cols} columns, got {:?}", p.shape()),
                });
            }
            if p.dtype != first.dtype {
                return Err(Error::DType { op: OP, arg: "parts", expected: first.dtype.to_string(), got: p.dtype });
            }
            rows += r;
        }
        let mut out = Tensor::empty(dev, first.dtype, &[rows, cols])?;
        let row_bytes = cols * first.dtype.size_bytes();
        let mut start = 0;
        let dst = out.data_mut()?;
        for p in parts {
            let n = p.numel() / cols.max(1);
            if n > 0 {
                let mut view = dst.slice_mut(start * row_bytes..(start + n) * row_bytes);
                dev.stream().memcpy_dtod(&p.data.slice(0..n * row_bytes), &mut view)?;
            }
            start += n;
        }
        Ok(out)
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
