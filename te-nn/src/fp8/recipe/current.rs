//! Current scaling (TE `Float8CurrentScaling`, `common/recipe/__init__.py`; the scale
//! `common/recipe/current_scaling.cu`): the recipe, its quantizer (each tensor's own amax) and
//! its [`ScalingRecipe`] impl.

use super::{Format, Recipe, RecipeOverrides, ScalingRecipe};
use crate::fp8::quantizer::{cast, check_fp8, not_fusable, FusedCastKernel};
use crate::fp8::{Float8Tensor, GemmScaling, GemmTensor, HostCast, HostScalingState, Quantizer};
use cudarc::driver::CudaSlice;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use te_codegen::spec::{CastSpec, ScalingSpec};
use te_codegen::{Arch, DType, KernelSpec};
use te_runtime::ops::cast_transpose::DbiasOut;
use te_runtime::ops::{self, Fp8Meta};
use te_runtime::{Device, Error, Result, Tensor};

/// Current (just-in-time) scaling (TE `Float8CurrentScaling`): each tensor's amax is computed
/// right before its cast, `scale = fp8_max / max(amax, amax_epsilon)` (1 when the amax is 0, inf
/// or NaN). Costs one extra read of every tensor; keeps no state.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Float8CurrentScaling {
    /// FP8 formats. TE default [`Format::Hybrid`].
    pub fp8_format: Format,
    /// Round every scale down to a power of two (exact rescaling). TE default false.
    pub power_2_scale: bool,
    /// Lower bound of the amax, guarding tiny tensors. TE default 0.
    pub amax_epsilon: f32,
    /// Run `DotProductAttention` in FP8 too, with one current scale for q, k and v (TE
    /// `fp8_dpa`; see [`super::DelayedScaling::fp8_dpa`]).
    pub fp8_dpa: bool,
    /// TE `fp8_mha` (implies `fp8_dpa`). Under current scaling the output's scale needs its
    /// amax before any code is written, so the attention output stays 16-bit and the output
    /// projection casts it, as without the flag; see [`super::DelayedScaling::fp8_mha`].
    pub fp8_mha: bool,
}

impl ScalingRecipe for Float8CurrentScaling {
    fn name(&self) -> &'static str {
        "Float8CurrentScaling"
    }

    fn short_name(&self) -> &'static str {
        "current"
    }

    fn description(&self) -> &'static str {
        "current scaling"
    }

    fn format(&self) -> Format {
        self.fp8_format
    }

    /// # Errors
    /// [`Error::Recipe`] for a negative or non-finite amax epsilon.
    fn validate(&self) -> Result<()> {
        if !(self.amax_epsilon.is_finite() && self.amax_epsilon >= 0.0) {
            return Err(Error::Recipe {
                message: format!(
                    "Float8CurrentScaling::amax_epsilon must be finite and ≥ 0, got {}",
                    self.amax_epsilon
                ),
            });
        }
        Ok(())
    }

    fn fp8_dpa(&self) -> bool {
        self.fp8_dpa || self.fp8_mha
    }

    fn fp8_mha(&self) -> bool {
        self.fp8_mha
    }

    fn override_fields(&self) -> &'static [&'static str] {
        &["fp8_format", "fp8_dpa", "fp8_mha"]
    }

    fn apply_overrides(&self, o: &RecipeOverrides) -> Recipe {
        Float8CurrentScaling {
            fp8_format: o.fp8_format.unwrap_or(self.fp8_format),
            fp8_dpa: o.fp8_dpa.unwrap_or(self.fp8_dpa),
            fp8_mha: o.fp8_mha.unwrap_or(self.fp8_mha),
            ..*self
        }
        .into()
    }

    /// The amax of each tensor and the scale from it.
    fn kernel_specs(&self, dt: DType, arch: Arch, specs: &mut Vec<KernelSpec>) {
        specs.push(CastSpec::amax(dt, arch).into());
        specs.push(ScalingSpec::current(self.power_2_scale, arch).into());
    }

    fn forward_quantizer(&self, gemm: &mut GemmScaling, _: GemmTensor) -> Result<Box<dyn Quantizer>> {
        Ok(Box::new(Float8CurrentScalingQuantizer::new(&gemm.dev, self.fp8_format.forward_dtype(), *self)?))
    }

    /// The weight's own quantizer: its scale is the whole weight's amax's.
    fn sharded_weight_quantizer(&self, dev: &Arc<Device>) -> Result<Option<Box<dyn Quantizer>>> {
        Ok(Some(Box::new(Float8CurrentScalingQuantizer::new(dev, self.fp8_format.forward_dtype(), *self)?)))
    }

    fn grad_output_quantizer(&self, gemm: &mut GemmScaling) -> Result<Box<dyn Quantizer>> {
        Ok(Box::new(Float8CurrentScalingQuantizer::new(&gemm.dev, self.fp8_format.backward_dtype(), *self)?))
    }

    /// Per-tensor casts, each with the scale of its operand's own amax; the wgrad GEMM reads the
    /// same codes (their byte transpose).
    fn host_forward_casts(&self, _: Option<&HostScalingState>, _: [usize; 3]) -> ([HostCast; 2], Option<HostCast>) {
        ([self.host_cast(self.fp8_format.forward_dtype()); 2], None)
    }

    /// The output gradient's own amax scale (E5M2 under HYBRID), one cast for both GEMMs.
    fn host_grad_casts(&self, _: Option<&HostScalingState>, _: [usize; 2]) -> (HostCast, Option<HostCast>) {
        (self.host_cast(self.fp8_format.backward_dtype()), None)
    }
}

impl Float8CurrentScaling {
    /// The host cast of one operand to `dtype` under this recipe.
    fn host_cast(&self, dtype: DType) -> HostCast {
        HostCast::Current { dtype, amax_epsilon: self.amax_epsilon, power_2_scale: self.power_2_scale }
    }
}

/// Current scaling (TE `Float8CurrentScalingQuantizer`): each tensor's own amax, then its scale
/// `fp8_max / max(amax, amax_epsilon)`, then the cast: three launches, no state.
#[derive(Debug, Clone)]
pub struct Float8CurrentScalingQuantizer {
    dev: Arc<Device>,
    dtype: DType,
    recipe: Float8CurrentScaling,
}

impl Float8CurrentScalingQuantizer {
    /// Casts to `dtype` (E4M3 or E5M2) with `recipe`'s epsilon and power-of-2 rule.
    ///
    /// # Errors
    /// [`Error::Argument`] for a `dtype` that is not FP8.
    pub fn new(dev: &Arc<Device>, dtype: DType, recipe: Float8CurrentScaling) -> Result<Self> {
        check_fp8("Float8CurrentScalingQuantizer::new", dtype)?;
        Ok(Self { dev: dev.clone(), dtype, recipe })
    }

    /// The amax of all of `xs` and the scale (and `scale_inv`) it gives.
    fn scaled(&self, xs: &[&Tensor]) -> Result<Fp8Meta> {
        self.scaled_reduced(xs, &mut |_| Ok(()))
    }

    /// [`Float8CurrentScalingQuantizer::scaled`] with `reduce_amax` run on the amax first.
    fn scaled_reduced(
        &self,
        xs: &[&Tensor],
        reduce_amax: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<Fp8Meta> {
        let dev = &self.dev;
        // `current_scaling` writes the scale below: no upload, so a decode step stays capturable.
        let mut meta = Fp8Meta::zeroed(dev)?;
        for x in xs {
            ops::cast::amax(dev, x, &mut meta.amax.as_view_mut())?;
        }
        reduce_amax(&mut meta.amax)?;
        let fp8_max = self.dtype.fp8_max().unwrap_or(1.0);
        let r = &self.recipe;
        ops::scaling::current_scaling(
            dev,
            &meta.amax,
            &mut meta.scale,
            &mut meta.scale_inv,
            fp8_max,
            r.amax_epsilon,
            r.power_2_scale,
        )?;
        Ok(meta)
    }
}

impl Quantizer for Float8CurrentScalingQuantizer {
    fn dtype(&self) -> DType {
        self.dtype
    }

    fn fuses_cast(&self) -> bool {
        false
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        let mut meta = self.scaled(&[x])?;
        let (data, transpose) = cast(&self.dev, x, self.dtype, &mut meta.scaling(), columnwise, dbias)?;
        Float8Tensor::from_parts(data, transpose, Arc::new(meta.scale_inv))
    }

    fn fused_cast(&self, _: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        Err(not_fusable("Float8CurrentScalingQuantizer::fused_cast"))
    }

    fn cast_inputs(&self, inputs: &[&Tensor], kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        let mut meta = self.scaled(inputs)?;
        kernel(&mut meta.scaling())?;
        Ok(Arc::new(meta.scale_inv))
    }

    fn calibrate(&self, _: &Tensor) -> Result<()> {
        Ok(())
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        // Deterministic: the same tensor gives the same amax, so the same scale and codes.
        Ok(Box::new(self.clone()))
    }

    fn quantize_with_amax(
        &self,
        x: &Tensor,
        columnwise: bool,
        reduce_amax: &mut dyn FnMut(&mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<Option<Float8Tensor>> {
        let mut meta = self.scaled_reduced(&[x], reduce_amax)?;
        let (data, transpose) = cast(&self.dev, x, self.dtype, &mut meta.scaling(), columnwise, None)?;
        Ok(Some(Float8Tensor::from_parts(data, transpose, Arc::new(meta.scale_inv))?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_and_host_casts_follow_the_fields() {
        let r = Float8CurrentScaling { power_2_scale: true, amax_epsilon: 1e-3, ..Default::default() };
        let mut specs = Vec::new();
        r.kernel_specs(DType::F16, Arch::Sm89, &mut specs);
        let want: [KernelSpec; 2] =
            [CastSpec::amax(DType::F16, Arch::Sm89).into(), ScalingSpec::current(true, Arch::Sm89).into()];
        assert_eq!(specs, want);
        assert!(r.host_state().is_none() && !r.calibrates() && !r.reduces_amax());
        let ([x, w], wgrad) = r.host_forward_casts(None, [4, 8, 16]);
        let fwd = HostCast::Current { dtype: DType::E4M3, amax_epsilon: 1e-3, power_2_scale: true };
        assert_eq!((x, w, wgrad), (fwd, fwd, None));
        let (dy, dy_w) = r.host_grad_casts(None, [4, 8]);
        let bwd = HostCast::Current { dtype: DType::E5M2, amax_epsilon: 1e-3, power_2_scale: true };
        assert_eq!((dy, dy_w), (bwd, None));
    }
}
