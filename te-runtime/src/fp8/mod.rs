//! FP8 training machinery: recipes, FP8 tensors, per-module scaling state, and the
//! `fp8_autocast` / `fp8_model_init` scopes (TE `pytorch/fp8.py`, `common/recipe`).

pub mod autocast;
mod float8_tensor;
mod recipe;
mod state;

pub use autocast::{fp8_autocast, fp8_mode, fp8_model_init, is_fp8_model_init, Fp8Autocast, Fp8AutocastGuard, Fp8Mode};
pub use float8_tensor::Float8Tensor;
pub use recipe::{DelayedScaling, Float8CurrentScaling, Format, Recipe};
pub(crate) use state::quantize_current;
pub use state::{ScalingSnapshot, ScalingState};
pub use te_codegen::spec::AmaxComputeAlgo;
