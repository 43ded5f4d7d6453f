//! Owners of the cuBLASLt objects one GEMM needs (library handle, matmul descriptor, matrix
//! layouts, heuristic preference) over cudarc's `cublaslt::result` layer: each frees its object
//! when dropped, and attribute setters take a value whose size they pass along, so a size can
//! never disagree with the buffer.

use cudarc::cublaslt::result::{self, CublasError};
use cudarc::cublaslt::sys;
use std::ffi::c_void;
use std::mem::size_of;

/// Points cuBLASLt at `value` for an attribute setter: a pointer to `size_of::<T>()` readable
/// bytes. cuBLASLt copies them and rejects a size that does not fit the attribute
/// (`CUBLAS_STATUS_INVALID_VALUE`), so any plain `Copy` value is memory-safe to pass.
fn attr_buf<T: Copy>(value: &T) -> (*const c_void, usize) {
    (value as *const T as *const c_void, size_of::<T>())
}

/// A cuBLASLt library context (`cublasLtHandle_t`).
#[derive(Debug)]
pub(crate) struct Handle(sys::cublasLtHandle_t);

// SAFETY: the handle holds no per-call state (all configuration lives in the descriptors of
// each call), and cuBLAS documents its functions as callable from several host threads with the
// same handle ("Thread Safety" in the cuBLAS docs).
unsafe impl Send for Handle {}
// SAFETY: as for `Send`: every use takes `&self` and cuBLASLt synchronizes internally.
unsafe impl Sync for Handle {}

impl Handle {
    /// Creates a handle. The caller must have checked that libcublasLt loads
    /// (`sys::is_culib_present`): cudarc panics otherwise.
    pub(crate) fn new() -> Result<Self, CublasError> {
        Ok(Self(result::create_handle()?))
    }

    /// The raw handle, valid while `self` lives.
    pub(crate) fn raw(&self) -> sys::cublasLtHandle_t {
        self.0
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `Handle::new` and is destroyed exactly once, here. A
        // failure cannot be reported from `drop`; it only leaks host memory.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

/// A matmul descriptor (`cublasLtMatmulDesc_t`): compute type, transposes, scale pointers,
/// epilogue.
#[derive(Debug)]
pub(crate) struct MatmulDesc(sys::cublasLtMatmulDesc_t);

impl MatmulDesc {
    /// A descriptor computing in `compute` with `alpha`/`beta` of type `scale`.
    pub(crate) fn new(compute: sys::cublasComputeType_t, scale: sys::cudaDataType) -> Result<Self, CublasError> {
        Ok(Self(result::create_matmul_desc(compute, scale)?))
    }

    /// Sets `attr` to `value`, whose type must be the one cuBLASLt documents for `attr`
    /// (e.g. `i32` for `TRANSA`, `u64` device pointers for `*_POINTER`).
    pub(crate) fn set<T: Copy>(
        &mut self,
        attr: sys::cublasLtMatmulDescAttributes_t,
        value: T,
    ) -> Result<(), CublasError> {
        let (buf, size) = attr_buf(&value);
        // SAFETY: the descriptor is live (owned by `self`); `buf` points to `size` readable bytes
        // that cuBLASLt copies before returning.
        unsafe { result::set_matmul_desc_attribute(self.0, attr, buf, size) }
    }

    /// The raw descriptor, valid while `self` lives.
    pub(crate) fn raw(&self) -> sys::cublasLtMatmulDesc_t {
        self.0
    }
}

impl Drop for MatmulDesc {
    fn drop(&mut self) {
        // SAFETY: created by `MatmulDesc::new`, destroyed exactly once, here.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}

/// A column-major matrix layout (`cublasLtMatrixLayout_t`): element type, rows, columns and
/// leading dimension (elements between the starts of two columns), and for batched GEMMs the
/// matrix count and the stride between matrices.
#[derive(Debug)]
pub(crate) struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// A `rows × cols` column-major layout of `dtype` elements with leading dimension `ld`.
    pub(crate) fn new(dtype: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Self, CublasError> {
        Ok(Self(result::create_matrix_layout(dtype, rows as u64, cols as u64, ld as i64)?))
    }

    /// Makes the layout describe `count` matrices, each `stride` elements after the previous
    /// (`CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT`, an `i32`, and `_STRIDED_BATCH_OFFSET`, an `i64`).
    /// The caller has checked that both fit their types.
    pub(crate) fn set_batch(&mut self, count: usize, stride: usize) -> Result<(), CublasError> {
        use sys::cublasLtMatrixLayoutAttribute_t as Attr;
        let (count, stride) = (count as i32, stride as i64);
        for (attr, (buf, size)) in [
            (Attr::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, attr_buf(&count)),
            (Attr::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, attr_buf(&stride)),
        ] {
            // SAFETY: the layout is live (owned by `self`); `buf` points to `size` readable bytes
            // (`count` or `stride`, alive for the loop) that cuBLASLt copies before returning.
            unsafe { result::set_matrix_layout_attribute(self.0, attr, buf, size) }?;
        }
        Ok(())
    }

    /// The raw layout, valid while `self` lives.
    pub(crate) fn raw(&self) -> sys::cublasLtMatrixLayout_t {
        self.0
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `Layout::new`, destroyed exactly once, here.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}

/// Constraints for the algorithm heuristic (`cublasLtMatmulPreference_t`): workspace size and
/// pointer alignments.
#[derive(Debug)]
pub(crate) struct Preference(sys::cublasLtMatmulPreference_t);

impl Preference {
    /// A preference with cuBLASLt's defaults.
    pub(crate) fn new() -> Result<Self, CublasError> {
        Ok(Self(result::create_matmul_pref()?))
    }

    /// Sets `attr` to `value`, whose type must be the one cuBLASLt documents for `attr`
    /// (`u64` for `MAX_WORKSPACE_BYTES`, `u32` for the `MIN_ALIGNMENT_*_BYTES`).
    pub(crate) fn set<T: Copy>(
        &mut self,
        attr: sys::cublasLtMatmulPreferenceAttributes_t,
        value: T,
    ) -> Result<(), CublasError> {
        let (buf, size) = attr_buf(&value);
        // SAFETY: the preference is live (owned by `self`); `buf` points to `size` readable bytes
        // that cuBLASLt copies before returning.
        unsafe { result::set_matmul_pref_attribute(self.0, attr, buf, size) }
    }

    /// The raw preference, valid while `self` lives.
    pub(crate) fn raw(&self) -> sys::cublasLtMatmulPreference_t {
        self.0
    }
}

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by `Preference::new`, destroyed exactly once, here.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}
