//! Delayed scaling (TE `DelayedScaling`, `common/recipe/__init__.py`; the update
//! `common/recipe/delayed_scaling.cu`): the recipe, its quantizer (a slot of a module's amax
//! history) and its [`ScalingRecipe`] impl.

use super::{Format, Recipe, RecipeOverrides, ScalingRecipe};
use crate::fp8::autocast::register_forward;
use crate::fp8::gemm_scaling::{BWD_GRAD_OUTPUT, BWD_SLOTS, FWD_SLOTS};
use crate::fp8::quantizer::{cast, copy_of, FusedCastKernel};
use crate::fp8::ScalingState;
use crate::fp8::{Float8Quantizer, Float8Tensor, GemmScaling, GemmTensor, HostCast, HostScalingState, Quantizer};
use cudarc::driver::CudaSlice;
use serde::{Deserialize, Serialize};
use std::sync::Arc;
use te_codegen::spec::{AmaxComputeAlgo, ScalingSpec};
use te_codegen::{Arch, DType, KernelSpec};
use te_runtime::ops;
use te_runtime::ops::cast_transpose::DbiasOut;
use te_runtime::{Device, Error, Result, Tensor};

/// Delayed scaling (TE `DelayedScaling`): each tensor slot is cast with a scale derived from the
/// amax history of earlier iterations, so the cast needs no extra pass over the data.
///
/// After each forward scope and each backward: `amax = max(history)` (or the newest entry),
/// `scale = (fp8_max / amax) / 2^margin` when amax is finite and positive (else the old scale),
/// then the history rolls. Initial scale 1. One departure from TE: a non-finite newest amax (a
/// step that overflowed, e.g. one `te train --skip-nonfinite-steps` skips) keeps that update's
/// scale, as in TE, but rolls into the history as 0; TE keeps the inf there, which freezes the
/// scale for `amax_history_len` steps and leaves a state no checkpoint should hold. In config
/// files (a training checkpoint's `trainer.toml`) a table of these fields.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DelayedScaling {
    /// Headroom: the scale is divided by `2^margin`. TE default 0.
    pub margin: f32,
    /// FP8 formats. TE default [`Format::Hybrid`].
    pub fp8_format: Format,
    /// Entries of each slot's amax history. TE default 1024.
    pub amax_history_len: usize,
    /// How the history becomes an amax. TE default [`AmaxComputeAlgo::Max`].
    pub amax_compute_algo: AmaxComputeAlgo,
    /// All-reduce (max) the amaxes over the autocast scope's amax reduction group
    /// ([`crate::fp8::Fp8Autocast::fp8_group`], TE's `fp8_group`) before each scale update,
    /// forward and backward, so every rank casts with the same scales (TE default true). Without
    /// a group, or with a group of one rank, there is nothing to reduce.
    pub reduce_amax: bool,
    /// Run `DotProductAttention` in FP8 too (TE `fp8_dpa`, default false): q, k, v cast to E4M3
    /// with the module's scaling state, `Q · Kᵀ` and `P · V` on E4M3 tensor cores, the output
    /// in 16 bits; in training the backward runs in FP8 too where its kernels take the call
    /// (head_dim 128, no attention dropout; TE's `NVTE_FP8_DPA_BWD=0` keeps it 16-bit). Where the
    /// FP8 kernels do not take a call (not Hopper, head_dim other than 128 or 256, `thd`),
    /// attention runs in 16 bits as without the flag.
    pub fp8_dpa: bool,
    /// FP8 between the attention and the output projection too (TE `fp8_mha`, default false;
    /// implies `fp8_dpa`): in `MultiheadAttention`, an FP8 attention forward writes its output
    /// as E4M3 codes with the projection's input scale and the projection's GEMM reads them, so
    /// the 16-bit output is never written and never cast. Only where the output cast can be
    /// fused (delayed scaling) and the FP8 backward follows (or no backward: inference); the
    /// backward reads the E4M3 output for `rowsum(dO ⊙ O)`, as TE's does.
    #[serde(default)]
    pub fp8_mha: bool,
}

impl Default for DelayedScaling {
    fn default() -> Self {
        Self {
            margin: 0.0,
            fp8_format: Format::Hybrid,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
            reduce_amax: true,
            fp8_dpa: false,
            fp8_mha: false,
        }
    }
}

impl ScalingRecipe for DelayedScaling {
    fn name(&self) -> &'static str {
        "DelayedScaling"
    }

    fn short_name(&self) -> &'static str {
        "delayed"
    }

    fn description(&self) -> &'static str {
        "delayed scaling"
    }

    fn format(&self) -> Format {
        self.fp8_format
    }

    /// # Errors
    /// [`Error::Recipe`] for a zero history length or a negative or non-finite margin.
    fn validate(&self) -> Result<()> {
        if self.amax_history_len == 0 {
            return Err(Error::Recipe {
                message: "DelayedScaling::amax_history_len must be at least 1 (TE default 1024)".into(),
            });
        }
        if !(self.margin.is_finite() && self.margin >= 0.0) {
            return Err(Error::Recipe {
                message: format!("DelayedScaling::margin must be a finite value ≥ 0, got {}", self.margin),
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
        &RecipeOverrides::FIELDS
    }

    fn apply_overrides(&self, o: &RecipeOverrides) -> Recipe {
        DelayedScaling {
            fp8_format: o.fp8_format.unwrap_or(self.fp8_format),
            amax_history_len: o.amax_history_len.unwrap_or(self.amax_history_len),
            amax_compute_algo: o.amax_compute_algo.unwrap_or(self.amax_compute_algo),
            fp8_dpa: o.fp8_dpa.unwrap_or(self.fp8_dpa),
            fp8_mha: o.fp8_mha.unwrap_or(self.fp8_mha),
            ..*self
        }
        .into()
    }

    fn calibrates(&self) -> bool {
        true
    }

    fn reduces_amax(&self) -> bool {
        self.reduce_amax
    }

    /// The run's own recipe: dS keeps a history like every other slot.
    fn attention_ds_recipe(&self) -> DelayedScaling {
        *self
    }

    /// The bulk scale update of the histories' reduction.
    fn kernel_specs(&self, _dt: DType, arch: Arch, specs: &mut Vec<KernelSpec>) {
        specs.push(ScalingSpec::delayed(self.amax_compute_algo, arch).into());
    }

    fn forward_quantizer(&self, gemm: &mut GemmScaling, tensor: GemmTensor) -> Result<Box<dyn Quantizer>> {
        let dtype = self.fp8_format.forward_dtype();
        let s = conform(&mut gemm.fwd, &gemm.dev, FWD_SLOTS, dtype, self)?;
        register_forward(&s);
        Ok(Box::new(DelayedScalingQuantizer::new(s, tensor.slot())?))
    }

    fn grad_output_quantizer(&self, gemm: &mut GemmScaling) -> Result<Box<dyn Quantizer>> {
        Ok(Box::new(DelayedScalingQuantizer::new(bwd_state(gemm, self)?, BWD_GRAD_OUTPUT)?))
    }

    fn backward_state(&self, gemm: &mut GemmScaling) -> Result<Option<Arc<ScalingState>>> {
        Ok(Some(bwd_state(gemm, self)?))
    }

    fn host_state(&self) -> Option<HostScalingState> {
        Some(HostScalingState::new(self))
    }

    /// Per-tensor casts with the state's forward scales (input, weight; scale 1 without one).
    fn host_forward_casts(&self, state: Option<&HostScalingState>, _: [usize; 3]) -> ([HostCast; 2], Option<HostCast>) {
        let dtype = self.fp8_format.forward_dtype();
        let scale = |slot| state.map_or(1.0, |s| s.forward_scales()[slot]);
        ([HostCast::Fp8 { dtype, scale: scale(0) }, HostCast::Fp8 { dtype, scale: scale(1) }], None)
    }

    /// The per-tensor cast with the state's backward scale (one for both GEMMs).
    fn host_grad_casts(&self, state: Option<&HostScalingState>, _: [usize; 2]) -> (HostCast, Option<HostCast>) {
        let dtype = self.fp8_format.backward_dtype();
        (HostCast::Fp8 { dtype, scale: state.map_or(1.0, |s| s.backward_scale()) }, None)
    }
}

/// The backward state of `gemm` for `r` (made or conformed).
fn bwd_state(gemm: &mut GemmScaling, r: &DelayedScaling) -> Result<Arc<ScalingState>> {
    conform(&mut gemm.bwd, &gemm.dev, BWD_SLOTS, r.fp8_format.backward_dtype(), r)
}

/// The state of `slot` for this recipe and format: created on first use, conformed after.
fn conform(
    slot: &mut Option<Arc<ScalingState>>,
    dev: &Arc<Device>,
    n: usize,
    dtype: DType,
    r: &DelayedScaling,
) -> Result<Arc<ScalingState>> {
    match slot {
        Some(s) => {
            s.conform(r, dtype)?;
            Ok(s.clone())
        }
        None => Ok(slot.insert(ScalingState::new(dev, n, dtype, r)?).clone()),
    }
}

/// Delayed scaling (TE `Float8Quantizer` over `fp8_meta`): one slot of a module's
/// [`ScalingState`]. Casts with the slot's scale (from the amax history of earlier steps) and
/// maxes each tensor's `|x|` into the slot's newest amax; the autocast scope updates the scale.
#[derive(Debug, Clone)]
pub struct DelayedScalingQuantizer {
    state: Arc<ScalingState>,
    slot: usize,
}

impl DelayedScalingQuantizer {
    /// Slot `slot` of `state`.
    ///
    /// # Errors
    /// [`Error::Internal`] for a slot the state does not have.
    pub(crate) fn new(state: Arc<ScalingState>, slot: usize) -> Result<Self> {
        if slot >= state.slots() {
            return Err(Error::internal(
                "DelayedScalingQuantizer",
                format!("slot {slot} of a state with {} slots", state.slots()),
            ));
        }
        Ok(Self { state, slot })
    }
}

impl Quantizer for DelayedScalingQuantizer {
    fn dtype(&self) -> DType {
        self.state.dtype()
    }

    fn fuses_cast(&self) -> bool {
        true
    }

    fn quantize(&self, x: &Tensor, columnwise: bool, dbias: Option<DbiasOut<'_>>) -> Result<Float8Tensor> {
        let dev = self.state.device();
        let mut b = self.state.lock();
        let dtype = b.dtype;
        let mut scale_inv = dev.stream().alloc_zeros::<f32>(1)?;
        let mut scaling = b.scaling(self.slot, &mut scale_inv);
        let (data, transpose) = cast(dev, x, dtype, &mut scaling, columnwise, dbias)?;
        Float8Tensor::from_parts(data, transpose, Arc::new(scale_inv))
    }

    fn fused_cast(&self, kernel: &mut FusedCastKernel<'_>) -> Result<Arc<CudaSlice<f32>>> {
        let dev = self.state.device();
        let mut b = self.state.lock();
        let mut scale_inv = copy_of(dev, &b.scale_inv.slice(self.slot..self.slot + 1))?;
        kernel(&mut b.scaling(self.slot, &mut scale_inv))?;
        Ok(Arc::new(scale_inv))
    }

    fn calibrate(&self, x: &Tensor) -> Result<()> {
        let mut b = self.state.lock();
        let h = self.slot * b.history_len;
        ops::cast::amax(self.state.device(), x, &mut b.amax_history.slice_mut(h..h + 1))
    }

    fn frozen(&self) -> Result<Box<dyn Quantizer>> {
        let dev = self.state.device();
        let b = self.state.lock();
        let (i, j) = (self.slot, self.slot + 1);
        let (scale, scale_inv) = (copy_of(dev, &b.scale.slice(i..j))?, copy_of(dev, &b.scale_inv.slice(i..j))?);
        Ok(Box::new(Float8Quantizer::from_device(dev, b.dtype, scale, scale_inv)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_and_host_casts_follow_the_fields() {
        let r = DelayedScaling { amax_compute_algo: AmaxComputeAlgo::MostRecent, ..Default::default() };
        let mut specs = Vec::new();
        r.kernel_specs(DType::BF16, Arch::Sm90a, &mut specs);
        assert_eq!(specs, [ScalingSpec::delayed(AmaxComputeAlgo::MostRecent, Arch::Sm90a).into()]);
        // A fresh state casts with scale 1; gradients in E5M2 under HYBRID.
        let state = r.host_state().unwrap();
        let ([x, w], wgrad) = r.host_forward_casts(Some(&state), [4, 8, 16]);
        assert!(wgrad.is_none());
        for c in [x, w] {
            assert!(matches!(c, HostCast::Fp8 { dtype: DType::E4M3, scale } if scale == 1.0), "{c:?}");
        }
        let (dy, dy_w) = r.host_grad_casts(Some(&state), [4, 8]);
        assert!(matches!(dy, HostCast::Fp8 { dtype: DType::E5M2, scale } if scale == 1.0) && dy_w.is_none());
    }
}
