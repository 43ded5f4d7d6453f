//! TMA tensor maps (Hopper's Tensor Memory Accelerator, `cuTensorMapEncodeTiled`): the 128-byte
//! descriptors kernels take by value (`TmaDesc` in the templates, [`te_codegen::spec::TMA_DESC`])
//! to load boxes of a strided tensor into shared memory with `cp.async.bulk.tensor`.

use crate::Result;
use cudarc::driver::sys::{
    self, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave, CUtensorMapL2promotion,
    CUtensorMapSwizzle,
};
use cudarc::driver::DeviceRepr;
use te_codegen::DType;

/// One tensor map, passed to a kernel by value.
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub(crate) struct TensorMap(sys::CUtensorMap);

// SAFETY: a plain 128-byte, 128-byte-aligned value the kernel reads as its `TmaDesc` parameter.
unsafe impl DeviceRepr for TensorMap {}

impl TensorMap {
    /// A map no kernel reads (the argument of a launch that loads without TMA).
    pub(crate) fn unused() -> Self {
        // SAFETY: the descriptor is plain data; all zeros is a valid (unused) value.
        Self(unsafe { std::mem::zeroed() })
    }

    /// The 4-D tensor of `dtype` at device address `base` with `dims` (innermost first, in
    /// elements) and the byte strides of dims 1 to 3, read in `boxes` of `box_dims` with the
    /// 128-byte swizzle (the layout of the wgmma tiles: a box's innermost extent is one 128-byte
    /// row), out-of-range elements zero-filled.
    ///
    /// # Errors
    /// The driver's, when the address, strides or box break the TMA rules (16-byte alignment,
    /// strides multiples of 16 below 2^40, boxes of at most 256 per dim and 128 bytes inner);
    /// callers then load without TMA.
    pub(crate) fn tiled(
        base: u64,
        dtype: DType,
        dims: [u64; 4],
        strides: [u64; 3],
        box_dims: [u32; 4],
    ) -> Result<Self> {
        let data_type = match dtype {
            DType::BF16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            DType::F16 => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            _ => CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        };
        let mut map = Self::unused();
        let element_strides = [1u32; 4];
        // SAFETY: every array holds the rank's 4 (strides: 3) entries and outlives the call; the
        // map is 128-byte aligned (`CUtensorMap`); the driver only encodes, it reads no memory.
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map.0,
                data_type,
                4,
                base as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                box_dims.as_ptr(),
                element_strides.as_ptr(),
                CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
                CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        }
        .result()?;
        Ok(map)
    }
}
