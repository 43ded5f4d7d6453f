//! Checkpoints: a model's parameters and FP8 scaling states in one safetensors file, every
//! tensor under its traversal path (`te_nn::Module`), FP8 state as named f32 tensors
//! (`<path>.amax_history`, `.scale`, `.scale_inv`) next to the weights, never an opaque blob
//! (TE's extra-state lesson). Save → load → continue trains as if never stopped.
//!
//! ```no_run
//! use te_nn::checkpoint::{load, save, LoadOptions, SaveOptions};
//! use te_nn::modules::{Linear, LinearConfig};
//! use te_runtime::Device;
//!
//! # fn main() -> te_runtime::Result<()> {
//! let dev = Device::new(0)?;
//! let model = Linear::new(&dev, LinearConfig::new(1024, 1024))?;
//! save(&model, "model.safetensors", &SaveOptions::default())?;
//! let mut fresh = Linear::new(&dev, LinearConfig { seed: 7, ..LinearConfig::new(1024, 1024) })?;
//! let report = load(&mut fresh, "model.safetensors", &LoadOptions::default())?;
//! assert!(report.is_clean());
//! # Ok(()) }
//! ```

mod atomic;
pub mod format;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod host;
mod load;
pub mod optimizer_state;
mod save;
pub mod tp;

pub use atomic::write_atomic;
pub use load::load;
pub use save::save;

use crate::fp8::Recipe;
use std::collections::BTreeMap;
use std::fmt;

/// Options of [`save`].
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Entries added to the file's `__metadata__` (a training step, a run name); the keys of
    /// [`mod@format`] are reserved.
    pub metadata: BTreeMap<String, String>,
    /// The FP8 recipe the model trains with, recorded as [`format::RECIPE_KEY`] (its
    /// [`Recipe::name`]); `None` (the default): not recorded (a model trained in high
    /// precision).
    pub recipe: Option<Recipe>,
}

/// Options of [`load`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadOptions {
    /// Fail on any missing, unexpected or mismatched tensor, before changing the model (the
    /// default); `false` loads what matches and reports the rest.
    pub strict: bool,
    /// The FP8 recipe the model will run: a file that records another one is refused (its FP8
    /// scaling states belong to that recipe), unless `convert_recipe`. `None` (the default):
    /// not checked.
    pub recipe: Option<Recipe>,
    /// Load a file of another recipe than `recipe` as an explicit conversion: the weights
    /// load, the file's FP8 scaling states do not (the model's start fresh, as when TE's
    /// recipe changes between runs). Default false.
    pub convert_recipe: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { strict: true, recipe: None, convert_recipe: false }
    }
}

/// What [`load`] could not match. FP8 scaling states the file does not hold at all are optional
/// and not reported.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Tensors the model has and the file lacks.
    pub missing: Vec<String>,
    /// Tensors the file has and the model lacks.
    pub unexpected: Vec<String>,
    /// Tensors of another dtype or shape: `"name (file BF16 [64, 32], model BF16 [32, 64])"`.
    pub mismatched: Vec<String>,
}

impl LoadReport {
    /// Whether everything matched.
    pub fn is_clean(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let lists = [("missing", &self.missing), ("unexpected", &self.unexpected), ("mismatched", &self.mismatched)];
        let parts: Vec<String> =
            lists.iter().filter(|(_, l)| !l.is_empty()).map(|(what, l)| format!("{what}: {}", l.join(", "))).collect();
        if parts.is_empty() {
            f.write_str("everything matched")
        } else {
            f.write_str(&parts.join("; "))
        }
    }
}
