//! Blockwise scaling (TE 2.x `Float8BlockScaling`, `common/recipe/__init__.py`; the casts
//! `common/transpose/quantize_transpose_{vector,square}_blockwise.cu`): the recipe, its
//! quantizer (each block's own amax) and its [`ScalingRecipe`] impl.

use super::{Format, Recipe, RecipeOverrides, ScalingRecipe};
use crate::fp8::quantizer::{not_fusable, FusedCastKernel};
use crate::fp8::{Float8Tensor, GemmScaling, GemmTensor, HostCast, HostScalingState, Quantizer};
use cudarc::driver::CudaSlice;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use te_codegen::spec::BlockQuantizeSpec;
use te_codegen::{Arch, DType, KernelSpec};
use te_reference::block_scaling::{BlockParams, BlockTiling};
use te_runtime::gemm::BlockScale;
use te_runtime::ops;
use te_runtime::ops::block_quantize::{self, BlockFp8, BlockQuantizeParams};
use te_runtime::ops::cast_transpose::DbiasOut;
use te_runtime::{Device, Error, Result, Tensor};

/// Blockwise scaling (TE 2.x `Float8BlockScaling`, the recipe DeepSeek-V3 was trained with): one
/// f32 scale per 1×128 tile of activations and gradients and per 128×128 block of weights, each
/// from its block's own amax (no history), E4M3 in both directions by default. The block scale
/// rule and layouts: `te_reference::block_scaling`.
///
/// Every GEMM module runs it ([`Recipe::Block`] in `fp8_autocast`): its quantizer
/// ([`Float8BlockQuantizer`]) casts with the blockwise kernels
/// ([`te_runtime::ops::block_quantize`], bit-exact against the reference) and the GEMMs take block
/// scales ([`te_runtime::gemm::BlockScale`]). As in TE, the casts are not fused into the norm and
/// activation kernels (those write 16 bits, then the block cast runs), attention stays in 16
/// bits (no `fp8_dpa`), the activations and gradients it casts are bf16 or f16, and the GPU
/// must be a Hopper (cuBLASLt's block scale modes are sm_90 only).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Float8BlockScaling {
    /// FP8 formats. TE default [`Format::E4M3`] (E4M3 gradients too).
    pub fp8_format: Format,
    /// Scales rounded down to powers of 2 (TE default true; `NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1`
    /// turns it off).
    pub power_2_scale: bool,
    /// Floor of each block's amax (TE default 0).
    pub amax_epsilon: f32,
    /// Blocks of activations: 1 (1×128 tiles) or 2 (128×128). TE default 1.
    pub x_block_scaling_dim: usize,
    /// Blocks of weights: 1 or 2. TE default 2.
    pub w_block_scaling_dim: usize,
    /// Blocks of output gradients: 1 or 2. TE default 1.
    pub grad_block_scaling_dim: usize,
}

impl Default for Float8BlockScaling {
    fn default() -> Self {
        Self {
            fp8_format: Format::E4M3,
            power_2_scale: true,
            amax_epsilon: 0.0,
            x_block_scaling_dim: 1,
            w_block_scaling_dim: 2,
            grad_block_scaling_dim: 1,
        }
    }
}

impl Float8BlockScaling {
    /// Checks the fields a user can get wrong.
    ///
    /// # Errors
    /// [`te_runtime::Error::Recipe`] for a block dimension other than 1 or 2, or a negative or
    /// non-finite amax epsilon.
    pub fn validate(&self) -> Result<()> {
        let dims =
            [("x", self.x_block_scaling_dim), ("w", self.w_block_scaling_dim), ("grad", self.grad_block_scaling_dim)];
        if let Some((what, d)) = dims.iter().find(|(_, d)| !matches!(d, 1 | 2)) {
            return Err(Error::Recipe {
                message: format!(
                    "Float8BlockScaling::{what}_block_scaling_dim must be 1 (1x128 tiles) or 2 (128x128), got {d}"
                ),
            });
        }
        if !(self.amax_epsilon.is_finite() && self.amax_epsilon >= 0.0) {
            return Err(Error::Recipe {
                message: format!("Float8BlockScaling::amax_epsilon must be finite and ≥ 0, got {}", self.amax_epsilon),
            });
        }
        // Each GEMM pairs two of x, w and grad (fprop x·w, dgrad grad·w, wgrad grad·x);
        // cuBLASLt has no 128×128 × 128×128 mode (TE's recipe asserts the same).
        let pairs = [
            ("x", "w", self.x_block_scaling_dim, self.w_block_scaling_dim),
            ("grad", "w", self.grad_block_scaling_dim, self.w_block_scaling_dim),
            ("x", "grad", self.x_block_scaling_dim, self.grad_block_scaling_dim),
        ];
        if let Some((a, b, ..)) = pairs.iter().find(|(_, _, da, db)| *da == 2 && *db == 2) {
            return Err(Error::Recipe {
                message: format!(
                    "Float8BlockScaling: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2, but a GEMM of two \
                     128x128-scaled operands does not exist; set one of them to 1"
                ),
            });
        }
        Ok(())
    }

    /// The blockwise casts for `dt` activations: inputs and weights forward, gradients backward,
    /// in their block dims, sorted and deduplicated (none for an f32 `dt`, which the recipe does
    /// not cast).
    pub fn quantize_specs(&self, dt: DType, arch: Arch) -> Vec<KernelSpec> {
        if !matches!(dt, DType::BF16 | DType::F16) {
            return Vec::new();
        }
        let (fwd, bwd) = (self.fp8_format.forward_dtype(), self.fp8_format.backward_dtype());
        let mut v: Vec<KernelSpec> =
            [(fwd, self.x_block_scaling_dim), (fwd, self.w_block_scaling_dim), (bwd, self.grad_block_scaling_dim)]
                .into_iter()
                .map(|(q, dim)| BlockQuantizeSpec::new(dt, q, dim, arch).into())
                .collect();
        v.sort();
        v.dedup();
        v
    }

    /// The host cast of a `[rows, cols]` operand to `dtype` with block dimension `dim` (1:
    /// 1×128 tiles along its rows, or `across` the rows when the GEMM contracts over them; 2:
    /// 128×128 blocks).
    fn host_cast(&self, dim: usize, across: bool, [rows, cols]: [usize; 2], dtype: DType) -> HostCast {
        let params = BlockParams {
            dtype,
            epsilon: self.amax_epsilon,
            power_2: self.power_2_scale,
            // The GPU model's activations, weights and gradients are bf16.
            value_for_inf: half::bf16::MAX.to_f32(),
        };
        let tiling = match (dim, across) {
            (2, _) => BlockTiling::Square,
            (_, false) => BlockTiling::Rows,
            (_, true) => BlockTiling::Columns,
        };
        HostCast::Block { tiling, rows, cols, params }
    }
}

impl ScalingRecipe for Float8BlockScaling {
    fn name(&self) -> &'static str {
        "Float8BlockScaling"
    }

    fn short_name(&self) -> &'static str {
        "block"
    }

    fn description(&self) -> &'static str {
        "blockwise scaling"
    }

    fn format(&self) -> Format {
        self.fp8_format
    }

    fn validate(&self) -> Result<()> {
        Float8BlockScaling::validate(self)
    }

    fn override_fields(&self) -> &'static [&'static str] {
        &["fp8_format"]
    }

    fn apply_overrides(&self, o: &RecipeOverrides) -> Recipe {
        Float8BlockScaling { fp8_format: o.fp8_format.unwrap_or(self.fp8_format), ..*self }.into()
    }

    /// The blockwise casts ([`Float8BlockScaling::quantize_specs`]).
    fn kernel_specs(&self, dt: DType, arch: Arch, specs: &mut Vec<KernelSpec>) {
        specs.extend(self.quantize_specs(dt, arch));
    }

    /// The output is the next layer's input: tiled as inputs are.
    fn forward_quantizer(&self, gemm: &mut GemmScaling, tensor: GemmTensor) -> Result<Box<dyn Quantizer>> {
        let dim = if tensor == GemmTensor::Weight { self.w_block_scaling_dim } else { self.x_block_scaling_dim };
        Ok(Box::new(Float8BlockQuantizer::new(&gemm.dev, self.fp8_format.forward_dtype(), dim, self)?))
    }

    fn grad_output_quantizer(&self, gemm: &mut GemmScaling) -> Result<Box<dyn Quantizer>> {
        let dtype = self.fp8_format.backward_dtype();
        Ok(Box::new(Float8BlockQuantizer::new(&gemm.dev, dtype, self.grad_block_scaling_dim, self)?))
    }

    /// The input in 1×128 tiles along its features and the weight in 128×128 blocks (the
    /// recipe's block dims); the wgrad GEMM reads the input quantized along the tokens (TE
    /// re-quantizes the transposed operands rather than transposing codes).
    fn host_forward_casts(
        &self,
        _: Option<&HostScalingState>,
        [t, n_out, n_in]: [usize; 3],
    ) -> ([HostCast; 2], Option<HostCast>) {
        let dt = self.fp8_format.forward_dtype();
        let x = self.host_cast(self.x_block_scaling_dim, false, [t, n_in], dt);
        let w = self.host_cast(self.w_block_scaling_dim, false, [n_out, n_in], dt);
        let x_wgrad = self.host_cast(self.x_block_scaling_dim, true, [t, n_in], dt);
        ([x, w], Some(x_wgrad))
    }

    /// The output gradient in 1×128 tiles along its features for the dgrad GEMM and along the
    /// tokens for the wgrad GEMM.
    fn host_grad_casts(&self, _: Option<&HostScalingState>, dims: [usize; 2]) -> (HostCast, Option<HostCast>) {
        let (dt, d) = (self.fp8_format.backward_dtype(), self.grad_block_scaling_dim);
        (self.host_cast(d, false, dims, dt), Some(self.host_cast(d, true, dims, dt)))
    }
}

/// Blockwise scaling (TE `Float8BlockQuantizer`, [`Float8BlockScaling`]): each 1×128 tile
/// (activations, gradients) or 128×128 block (weights) cast with the scale of its own amax, in
/// one pass ([`block_quantize::quantize`]); with `columnwise` the transpose is quantized in the
/// same pass from the high-precision values in 128×1 tiles (or the same 128×128 blocks). No
/// state; the cast cannot be fused into a producer, whose output is cast after it.
#[derive(Debug, Clone)]
pub struct Float8BlockQuantizer {
    dev: Arc<Device>,
    params: BlockQuantizeParams,
}

impl Float8BlockQuantizer {
    /// Casts to `dtype` in blocks of `block_dim` (1: 1×128, 2: 128×128) with `recipe`'s epsilon
    /// and power-of-2 rule.
    ///
    /// # Errors
    /// [`Error::Recipe`] on a GPU other than Hopper (cuBLASLt's block-scaled GEMMs are sm_90
    /// only); [`Error::DType`] / [`Error::Config`] for a `dtype` that is not FP8 or a
    /// `block_dim` other than 1 or 2 ([`BlockQuantizeParams::validate`]).
    pub fn new(dev: &Arc<Device>, dtype: DType, block_dim: usize, recipe: &Float8BlockScaling) -> Result<Self> {
        if dev.arch() != Arch::Sm90a {
            return Err(Error::Recipe {
                message: format!(
                    "Float8BlockScaling needs a Hopper GPU (sm_90): cuBLASLt has no block-scaled FP8 GEMMs on {}; \
                     use DelayedScaling or Float8CurrentScaling here",
                    dev.arch()
                ),
            });
        }
        let params =
            BlockQuantizeParams { dtype, block_dim, epsilon: recipe.amax_epsilon, power_2: recipe.power_2_scale };
        params.validate()?;
        Ok(Self { dev: dev.clone(), params })
    }
}

impl Quantizer for Float8BlockQuantizer {
    fn dtype(&self) -> DType {
        self.params.dtype
    }

    fn fuses_cast(&self) -> bool {
        false
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        const OP: &str = "Float8BlockQuantizer::quantize";
        ops::check_dtype(
            OP,
            "x",
            x,
            |d| matches!(d, DType::BF16 | DType::F16),
            "bf16 or f16 (Float8BlockScaling \
             casts 16-bit activations and gradients: run the module with params_dtype bf16)",
        )?;
        let (rows, cols) = x.as_2d(OP)?;
        let columnwise = columnwise || dbias.is_some();
        let mut q = BlockFp8::new(&self.dev, [rows, cols], &self.params, true, columnwise)?;
        match dbias {
            // 1×128 tiles: the column sums come from the column-wise pass of the same read (the
            // workspace a module sizes for cast_transpose, 64-row tiles, holds the 128-row one).
            Some(d) if self.params.block_dim == 1 => {
                block_quantize::quantize_dbias(&self.dev, x, &self.params, &mut q, d)?
            }
            // 128×128 blocks (`grad_block_scaling_dim` 2) have no per-column pass: a ones GEMM.
            Some(d) => {
                block_quantize::quantize(&self.dev, x, &self.params, &mut q)?;
                ops::cast_transpose::dbias(&self.dev, x, d.dbias)?;
            }
            None => block_quantize::quantize(&self.dev, x, &self.params, &mut q)?,
        }
        Float8Tensor::from_block(q, x.shape())
    }

    fn fused_cast(&self, _: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        Err(not_fusable("Float8BlockQuantizer::fused_cast"))
    }

    fn calibrate(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        // Deterministic: the same tensor gives the same block amaxes, scales and codes.
        Ok(Box::new(self.clone()))
    }

    fn block_scale(&self) -> Option<BlockScale> {
        Some(if self.params.block_dim == 1 { BlockScale::Vec128 } else { BlockScale::Blk128x128 })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_follow_the_block_dims_and_dtype() {
        let r = Float8BlockScaling::default();
        let mut specs = Vec::new();
        r.kernel_specs(DType::BF16, Arch::Sm90a, &mut specs);
        let want = |dim| KernelSpec::from(BlockQuantizeSpec::new(DType::BF16, DType::E4M3, dim, Arch::Sm90a));
        assert_eq!(specs.len(), 2, "1x128 for x and grad, 128x128 for w: {specs:?}");
        assert!(specs.contains(&want(1)) && specs.contains(&want(2)));
        assert!(r.quantize_specs(DType::F32, Arch::Sm90a).is_empty(), "f32 is not cast blockwise");
    }

    #[test]
    fn host_casts_tile_as_the_gemms_read() {
        let r = Float8BlockScaling::default();
        let ([x, w], x_wgrad) = r.host_forward_casts(None, [256, 64, 384]);
        let tiling = |c: HostCast| match c {
            HostCast::Block { tiling, rows, cols, params } => (tiling, rows, cols, params.dtype),
            other => panic!("not blockwise: {other:?}"),
        };
        assert_eq!(tiling(x), (BlockTiling::Rows, 256, 384, DType::E4M3));
        assert_eq!(tiling(w), (BlockTiling::Square, 64, 384, DType::E4M3));
        assert_eq!(tiling(x_wgrad.unwrap()), (BlockTiling::Columns, 256, 384, DType::E4M3));
        let hybrid = Float8BlockScaling { fp8_format: Format::Hybrid, ..r };
        let (dy, dy_w) = hybrid.host_grad_casts(None, [256, 64]);
        assert_eq!(tiling(dy), (BlockTiling::Rows, 256, 64, DType::E5M2));
        assert_eq!(tiling(dy_w.unwrap()), (BlockTiling::Columns, 256, 64, DType::E5M2));
    }
}
