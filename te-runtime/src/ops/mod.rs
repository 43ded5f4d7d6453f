//! Launchers of the fused kernels. Each op validates shapes and dtypes (typed errors that say
//! what to change), picks the spec for the device's arch, loads the kernel on first use and
//! launches it on the device's stream. Outputs are caller-allocated, as in TE's `nvte_*` API.

pub mod activation;
pub mod argmax;
pub mod attention_shape;
pub mod attn_merge;
pub mod block_quantize;
pub mod cast;
pub mod cast_transpose;
pub mod copy;
pub mod cross_entropy;
pub mod decode_attention;
pub mod dropout;
pub mod elementwise;
pub mod embedding;
pub mod flash_attention;
pub mod flash_attention_fp8;
mod flash_attention_gqa;
pub mod gemv;
pub mod grouped_gemm;
mod launch;
pub mod moe;
pub mod moe_router;
pub mod norm;
pub mod optimizer;
pub mod qkv_rope;
pub mod rope;
pub mod scaling;
pub mod softmax;
mod tma;

use crate::graph::HostCopies;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig};
use te_codegen::DType;

/// Device-side scaling state of one FP8 cast (each a single f32): the `scale` the kernel
/// multiplies by, the `amax` it max-accumulates `|x|` into, and the `scale_inv` it writes.
#[derive(Debug)]
pub struct Fp8Scaling<'a> {
    /// Read: the quantization scale.
    pub scale: CudaView<'a, f32>,
    /// Updated: running amax (e.g. `amax_history[0]` of a delayed-scaling slot).
    pub amax: CudaViewMut<'a, f32>,
    /// Written: `1 / scale`, stored next to the FP8 data for the GEMM.
    pub scale_inv: CudaViewMut<'a, f32>,
}

/// Owned single-tensor scaling state: handy for tests, benchmarks and one-off casts.
#[derive(Debug)]
pub struct Fp8Meta {
    /// `[1]` f32 scale.
    pub scale: CudaSlice<f32>,
    /// `[1]` f32 amax.
    pub amax: CudaSlice<f32>,
    /// `[1]` f32 scale_inv.
    pub scale_inv: CudaSlice<f32>,
}

impl Fp8Meta {
    /// State with the given scale, amax 0 and scale_inv 0 (the cast writes it).
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device, scale: f32) -> Result<Self> {
        let s = dev.stream();
        Ok(Self { scale: s.htod(&[scale])?, amax: s.alloc_zeros(1)?, scale_inv: s.alloc_zeros(1)? })
    }

    /// State with scale, amax and scale_inv all 0, for a kernel that writes the scale before any
    /// cast reads it (current scaling: amax, then `ops::scaling::current_scaling`). Memsets only,
    /// no host upload, so it may be called inside a CUDA graph capture.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn zeroed(dev: &Device) -> Result<Self> {
        let s = dev.stream();
        Ok(Self { scale: s.alloc_zeros(1)?, amax: s.alloc_zeros(1)?, scale_inv: s.alloc_zeros(1)? })
    }

    /// Views for an op.
    pub fn scaling(&mut self) -> Fp8Scaling<'_> {
        Fp8Scaling {
            scale: self.scale.as_view(),
            amax: self.amax.as_view_mut(),
            scale_inv: self.scale_inv.as_view_mut(),
        }
    }

    /// `(scale, amax, scale_inv)` copied to the host.
    ///
    /// # Errors
    /// Driver failures.
    pub fn read(&self, dev: &Device) -> Result<(f32, f32, f32)> {
        let s = dev.stream();
        Ok((s.dtoh(&self.scale)?[0], s.dtoh(&self.amax)?[0], s.dtoh(&self.scale_inv)?[0]))
    }
}

/// Fails unless `t` has a dtype accepted by `ok`.
pub fn check_dtype(
    op: &'static str,
    arg: &'static str,
    t: &Tensor,
    ok: impl Fn(DType) -> bool,
    expected: &str,
) -> Result<()> {
    if ok(t.dtype()) {
        Ok(())
    } else {
        Err(Error::DType { op, arg, expected: expected.to_string(), got: t.dtype() })
    }
}

/// Fails unless `t` has exactly `shape`.
pub fn check_shape(op: &'static str, arg: &str, t: &Tensor, shape: &[usize]) -> Result<()> {
    if t.shape() == shape {
        Ok(())
    } else {
        Err(Error::Shape { op, message: format!("`{arg}` must have shape {shape:?}, got {:?}", t.shape()) })
    }
}

/// Fails for a tensor with no elements.
pub fn check_nonempty(op: &'static str, arg: &str, t: &Tensor) -> Result<()> {
    if t.numel() > 0 {
        Ok(())
    } else {
        Err(Error::Shape { op, message: format!("`{arg}` has shape {:?}, which holds no elements", t.shape()) })
    }
}

/// Fails unless the feature dimension `cols` is a multiple of 16 (FP8 GEMM layouts need it;
/// [`te_codegen::check_fp8_dim`]).
pub(crate) fn check_fp8_cols(op: &'static str, dim: &str, cols: usize) -> Result<()> {
    te_codegen::check_fp8_dim(dim, cols).map_err(|message| Error::Shape { op, message })
}

/// A 1-D launch of `blocks` blocks of `threads` threads.
pub(crate) fn launch_1d(blocks: usize, threads: usize, shared_mem_bytes: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (blocks.max(1) as u32, 1, 1), block_dim: (threads as u32, 1, 1), shared_mem_bytes }
}

/// Blocks for a grid-stride loop over `work_items` items: enough to fill the GPU several
/// times over, never more than the work needs.
pub(crate) fn grid_stride_blocks(dev: &Device, work_items: usize, threads: usize) -> usize {
    let needed = work_items.div_ceil(threads).max(1);
    let resident = dev.sm_count() * (2048 / threads).max(1);
    needed.min(resident * 4)
}
