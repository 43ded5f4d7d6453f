//! FP8 training machinery: recipes (one file each, `recipe/`), FP8 tensors, quantizers,
//! per-module scaling state, the host emulation of the recipes' casts, and the `fp8_autocast` /
//! `fp8_model_init` scopes (TE `pytorch/fp8.py`, `common/recipe`).

pub mod autocast;
mod float8_tensor;
mod gemm_scaling;
mod host_cast;
mod host_state;
pub mod quantizer;
mod recipe;
mod state;
mod state_slot;

pub use autocast::{fp8_autocast, fp8_mode, fp8_model_init, is_fp8_model_init, Fp8Autocast, Fp8AutocastGuard, Fp8Mode};
pub use float8_tensor::Float8Tensor;
pub(crate) use gemm_scaling::{ForwardQuantizers, GradScaling};
pub use gemm_scaling::{GemmScaling, GemmTensor};
pub use host_cast::{host_amax, HostCast};
pub use host_state::HostScalingState;
pub use quantizer::{Float8Quantizer, Quantizer};
pub use recipe::{
    parse_amax_compute_algo, DelayedScaling, DelayedScalingQuantizer, Float8BlockQuantizer, Float8BlockScaling,
    Float8CurrentScaling, Float8CurrentScalingQuantizer, Format, Recipe, RecipeOverrides, ScalingRecipe,
};
pub use state::{ScalingSnapshot, ScalingState};
pub use state_slot::{Fp8Direction, Fp8StateSlot};
pub use te_codegen::spec::AmaxComputeAlgo;
