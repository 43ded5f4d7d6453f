//! FP8 training machinery: recipes, FP8 tensors, per-module scaling state, and the
//! `fp8_autocast` / `fp8_model_init` scopes (TE `pytorch/fp8.py`, `common/recipe`).

pub mod autocast;
mod float8_tensor;
mod gemm_scaling;
pub mod quantizer;
mod recipe;
mod state;
mod state_slot;

pub use autocast::{fp8_autocast, fp8_mode, fp8_model_init, is_fp8_model_init, Fp8Autocast, Fp8AutocastGuard, Fp8Mode};
pub use float8_tensor::Float8Tensor;
pub(crate) use gemm_scaling::{ForwardQuantizers, GemmScaling, GradScaling, FWD_INPUT};
pub use quantizer::{
    DelayedScalingQuantizer, Float8BlockQuantizer, Float8CurrentScalingQuantizer, Float8Quantizer, Quantizer,
};
pub use recipe::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Format, Recipe};
pub use state::{ScalingSnapshot, ScalingState};
pub use state_slot::{Fp8Direction, Fp8StateSlot};
pub use te_codegen::spec::AmaxComputeAlgo;
