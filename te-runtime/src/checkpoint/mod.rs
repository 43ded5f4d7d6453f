//! Checkpoints: a model's parameters and FP8 scaling states in one safetensors file, every
//! tensor under its traversal path ([`crate::Module`]), FP8 state as named f32 tensors
//! (`<path>.amax_history`, `.scale`, `.scale_inv`) next to the weights, never an opaque blob
//! (TE's extra-state lesson). Save → load → continue trains as if never stopped.
//!
//! ```no_run
//! use te_runtime::checkpoint::{load, save, LoadOptions, SaveOptions};
//! use te_runtime::modules::{Linear, LinearConfig};
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
pub(crate) mod host;
mod load;
mod save;
pub mod tp;

pub use atomic::write_atomic;
pub use load::load;
pub use save::save;

use std::collections::BTreeMap;
use std::fmt;

/// Options of [`save`].
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Entries added to the file's `__metadata__` (a training step, a run name); the keys of
    /// [`mod@format`] are reserved.
    pub metadata: BTreeMap<String, String>,
}

/// Options of [`load`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadOptions {
    /// Fail on any missing, unexpected or mismatched tensor, before changing the model (the
    /// default); `false` loads what matches and reports the rest.
    pub strict: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { strict: true }
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
