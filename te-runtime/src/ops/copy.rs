//! Column-block copies between row-major tensors: the split of a fused QKV projection into q, k
//! and v, and the concatenation of their gradients (TE does these with `torch.split` views and
//! `torch.cat`). One `cuMemcpy2DAsync` per call, on the device's stream.

use super::check_dtype;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{sys, DevicePtr, DevicePtrMut};

const OP: &str = "copy_columns";

/// `dst[r, dst_col + c] = src[r, src_col + c]` for every row `r` and `c < width`, with `src`
/// viewed as `[rows, src_cols]` and `dst` as `[rows, dst_cols]` (leading dims folded), same dtype.
///
/// # Errors
/// [`Error::DType`] for different dtypes; [`Error::Shape`] when the row counts differ, `width` is
/// 0, or a column range leaves its tensor; driver failures.
pub fn copy_columns(
    dev: &Device,
    src: &Tensor,
    src_col: usize,
    dst: &mut Tensor,
    dst_col: usize,
    width: usize,
) -> Result<()> {
    check_dtype(OP, "dst", dst, |d| d == src.dtype(), src.dtype().name())?;
    let (rows, src_cols) = src.as_2d(OP)?;
    let (dst_rows, dst_cols) = dst.as_2d(OP)?;
    let shape_err = |message: String| Err(Error::Shape { op: OP, message });
    if rows != dst_rows {
        return shape_err(format!("`src` has {rows} rows and `dst` {dst_rows}; they must match"));
    }
    if width == 0 || src_col + width > src_cols || dst_col + width > dst_cols {
        return shape_err(format!(
            "columns [{src_col}, {}) of `src` ({src_cols} wide) → [{dst_col}, {}) of `dst` ({dst_cols} wide) must be \
             non-empty and inside both",
            src_col + width,
            dst_col + width
        ));
    }
    if rows == 0 {
        return Ok(());
    }
    let e = src.dtype().size_bytes();
    let s = dev.stream();
    let (src_ptr, _s) = src.data().device_ptr(s);
    let (dst_ptr, _d) = dst.data_mut()?.device_ptr_mut(s);
    let copy = sys::CUDA_MEMCPY2D {
        srcXInBytes: src_col * e,
        srcY: 0,
        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        srcHost: std::ptr::null(),
        srcDevice: src_ptr,
        srcArray: std::ptr::null_mut(),
        srcPitch: src_cols * e,
        dstXInBytes: dst_col * e,
        dstY: 0,
        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
        dstHost: std::ptr::null_mut(),
        dstDevice: dst_ptr,
        dstArray: std::ptr::null_mut(),
        dstPitch: dst_cols * e,
        WidthInBytes: width * e,
        Height: rows,
    };
    // SAFETY: both pointers are live device allocations of this context; the copied region
    // (rows × width elements at the checked column offsets and pitches) lies inside each tensor;
    // `dst` is borrowed mutably and the copy is ordered on the stream all work uses.
    unsafe { sys::cuMemcpy2DAsync_v2(&copy, s.cu_stream()) }.result()?;
    Ok(())
}
