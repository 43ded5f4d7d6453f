//! FP8 recipes: how tensors are scaled before their FP8 cast (TE `common/recipe/__init__.py`).

use serde::{Deserialize, Serialize};
use te_codegen::spec::AmaxComputeAlgo;
use te_codegen::DType;

/// Which FP8 formats a recipe uses (TE `Format`); `e4m3` or `hybrid` in config files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// E4M3 for every tensor.
    E4M3,
    /// E4M3 in the forward pass (inputs, weights, outputs), E5M2 for gradients. TE's default.
    #[default]
    Hybrid,
}

impl Format {
    /// The FP8 dtype of forward tensors (inputs, weights, outputs): always E4M3.
    pub fn forward_dtype(self) -> DType {
        DType::E4M3
    }

    /// The FP8 dtype of gradients: E4M3, or E5M2 under [`Format::Hybrid`].
    pub fn backward_dtype(self) -> DType {
        match self {
            Format::E4M3 => DType::E4M3,
            Format::Hybrid => DType::E5M2,
        }
    }
}

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

/// Current (just-in-time) scaling (TE `Float8CurrentScaling`): each tensor's amax is computed
/// right before its cast, `scale = fp8_max / max(amax, amax_epsilon)` (1 when the amax is 0, inf
/// or NaN). Costs one extra read of every tensor; keeps no state. In config files (a training
/// checkpoint's `trainer.toml`) a table of these fields.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Float8CurrentScaling {
    /// FP8 formats. TE default [`Format::Hybrid`].
    pub fp8_format: Format,
    /// Round every scale down to a power of two (exact rescaling). TE default false.
    pub power_2_scale: bool,
    /// Lower bound of the amax, guarding tiny tensors. TE default 0.
    pub amax_epsilon: f32,
    /// Run `DotProductAttention` in FP8 too, with one current scale for q, k and v (TE
    /// `fp8_dpa`; see [`DelayedScaling::fp8_dpa`]).
    pub fp8_dpa: bool,
    /// TE `fp8_mha` (implies `fp8_dpa`). Under current scaling the output's scale needs its
    /// amax before any code is written, so the attention output stays 16-bit and the output
    /// projection casts it, as without the flag; see [`DelayedScaling::fp8_mha`].
    pub fp8_mha: bool,
}

/// Blockwise scaling (TE 2.x `Float8BlockScaling`, the recipe DeepSeek-V3 was trained with): one
/// f32 scale per 1×128 tile of activations and gradients and per 128×128 block of weights, each
/// from its block's own amax (no history), E4M3 in both directions by default. The block scale
/// rule and layouts: `te_reference::block_scaling`.
///
/// Every GEMM module runs it ([`Recipe::Block`] in `fp8_autocast`): its quantizer
/// ([`super::Float8BlockQuantizer`]) casts with the blockwise kernels
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
    pub fn validate(&self) -> te_runtime::Result<()> {
        let dims =
            [("x", self.x_block_scaling_dim), ("w", self.w_block_scaling_dim), ("grad", self.grad_block_scaling_dim)];
        if let Some((what, d)) = dims.iter().find(|(_, d)| !matches!(d, 1 | 2)) {
            return Err(te_runtime::Error::Recipe {
                message: format!(
                    "Float8BlockScaling::{what}_block_scaling_dim must be 1 (1x128 tiles) or 2 (128x128), got {d}"
                ),
            });
        }
        if !(self.amax_epsilon.is_finite() && self.amax_epsilon >= 0.0) {
            return Err(te_runtime::Error::Recipe {
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
            return Err(te_runtime::Error::Recipe {
                message: format!(
                    "Float8BlockScaling: {a}_block_scaling_dim and {b}_block_scaling_dim are both 2, but a GEMM of two \
                     128x128-scaled operands does not exist; set one of them to 1"
                ),
            });
        }
        Ok(())
    }
}

/// An FP8 recipe.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Recipe {
    /// Scales from amax histories.
    Delayed(DelayedScaling),
    /// Scales from each tensor's own amax.
    Current(Float8CurrentScaling),
    /// One scale per block of 128 values (1×128 or 128×128), from the block's own amax.
    Block(Float8BlockScaling),
}

impl Default for Recipe {
    /// TE's default recipe: `DelayedScaling()`.
    fn default() -> Self {
        Recipe::Delayed(DelayedScaling::default())
    }
}

impl From<DelayedScaling> for Recipe {
    fn from(r: DelayedScaling) -> Self {
        Recipe::Delayed(r)
    }
}

impl From<Float8CurrentScaling> for Recipe {
    fn from(r: Float8CurrentScaling) -> Self {
        Recipe::Current(r)
    }
}

impl From<Float8BlockScaling> for Recipe {
    fn from(r: Float8BlockScaling) -> Self {
        Recipe::Block(r)
    }
}

impl Recipe {
    /// TE's class name of the recipe: `DelayedScaling`, `Float8CurrentScaling` or
    /// `Float8BlockScaling` (what a checkpoint records it as).
    pub fn name(&self) -> &'static str {
        match self {
            Recipe::Delayed(_) => "DelayedScaling",
            Recipe::Current(_) => "Float8CurrentScaling",
            Recipe::Block(_) => "Float8BlockScaling",
        }
    }

    /// The recipe's formats.
    pub fn format(&self) -> Format {
        match self {
            Recipe::Delayed(r) => r.fp8_format,
            Recipe::Current(r) => r.fp8_format,
            Recipe::Block(r) => r.fp8_format,
        }
    }

    /// Whether `DotProductAttention` runs in FP8 under this recipe (TE `fp8_dpa`, or `fp8_mha`,
    /// which implies it). Never under [`Recipe::Block`].
    pub fn fp8_dpa(&self) -> bool {
        match self {
            Recipe::Delayed(r) => r.fp8_dpa || r.fp8_mha,
            Recipe::Current(r) => r.fp8_dpa || r.fp8_mha,
            Recipe::Block(_) => false,
        }
    }

    /// Whether `MultiheadAttention` hands the attention output to its projection in FP8 (TE
    /// `fp8_mha`; see [`DelayedScaling::fp8_mha`]). Never under [`Recipe::Block`].
    pub fn fp8_mha(&self) -> bool {
        match self {
            Recipe::Delayed(r) => r.fp8_mha,
            Recipe::Current(r) => r.fp8_mha,
            Recipe::Block(_) => false,
        }
    }

    /// The same recipe with `fp8_mha` set to `fp8_mha` (unchanged under [`Recipe::Block`],
    /// whose attention stays in 16 bits).
    pub fn with_fp8_mha(self, fp8_mha: bool) -> Self {
        match self {
            Recipe::Delayed(r) => DelayedScaling { fp8_mha, ..r }.into(),
            Recipe::Current(r) => Float8CurrentScaling { fp8_mha, ..r }.into(),
            r @ Recipe::Block(_) => r,
        }
    }

    /// The same recipe with `fp8_dpa` set to `fp8_dpa` (unchanged under [`Recipe::Block`]).
    pub fn with_fp8_dpa(self, fp8_dpa: bool) -> Self {
        match self {
            Recipe::Delayed(r) => DelayedScaling { fp8_dpa, ..r }.into(),
            Recipe::Current(r) => Float8CurrentScaling { fp8_dpa, ..r }.into(),
            r @ Recipe::Block(_) => r,
        }
    }

    /// The blockwise recipe, when this is one.
    pub fn block(&self) -> Option<&Float8BlockScaling> {
        match self {
            Recipe::Block(r) => Some(r),
            _ => None,
        }
    }

    /// Checks the fields a user can get wrong.
    ///
    /// # Errors
    /// [`te_runtime::Error::Recipe`] for a zero history length, a negative or non-finite margin, a
    /// negative or non-finite amax epsilon, or the block dimensions
    /// [`Float8BlockScaling::validate`] rejects.
    pub fn validate(&self) -> te_runtime::Result<()> {
        let bad = |message: String| Err(te_runtime::Error::Recipe { message });
        match self {
            Recipe::Delayed(r) if r.amax_history_len == 0 => {
                bad("DelayedScaling::amax_history_len must be at least 1 (TE default 1024)".into())
            }
            Recipe::Delayed(r) if !(r.margin.is_finite() && r.margin >= 0.0) => {
                bad(format!("DelayedScaling::margin must be a finite value ≥ 0, got {}", r.margin))
            }
            Recipe::Current(r) if !(r.amax_epsilon.is_finite() && r.amax_epsilon >= 0.0) => {
                bad(format!("Float8CurrentScaling::amax_epsilon must be finite and ≥ 0, got {}", r.amax_epsilon))
            }
            Recipe::Block(r) => r.validate(),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_te() {
        let d = DelayedScaling::default();
        assert_eq!((d.margin, d.amax_history_len, d.fp8_format), (0.0, 1024, Format::Hybrid));
        assert_eq!(d.amax_compute_algo, AmaxComputeAlgo::Max);
        let c = Float8CurrentScaling::default();
        assert_eq!((c.fp8_format, c.power_2_scale, c.amax_epsilon), (Format::Hybrid, false, 0.0));
        assert!(!Recipe::from(c).fp8_dpa() && !Recipe::from(d).fp8_dpa());
        assert_eq!(Recipe::default(), Recipe::Delayed(d));
        assert_eq!(Format::Hybrid.backward_dtype(), DType::E5M2);
        assert_eq!(Format::E4M3.backward_dtype(), DType::E4M3);
    }

    #[test]
    fn validation_names_the_field() {
        let r = Recipe::from(DelayedScaling { amax_history_len: 0, ..Default::default() });
        assert!(r.validate().unwrap_err().to_string().contains("amax_history_len"));
        let r = Recipe::from(DelayedScaling { margin: f32::NAN, ..Default::default() });
        assert!(r.validate().unwrap_err().to_string().contains("margin"));
        let r = Recipe::from(Float8CurrentScaling { amax_epsilon: -1.0, ..Default::default() });
        assert!(r.validate().unwrap_err().to_string().contains("amax_epsilon"));
        assert!(Recipe::default().validate().is_ok());
        let b = Float8BlockScaling { w_block_scaling_dim: 3, ..Default::default() };
        assert!(b.validate().unwrap_err().to_string().contains("w_block_scaling_dim"));
        let b = Float8BlockScaling { amax_epsilon: f32::INFINITY, ..Default::default() };
        assert!(b.validate().unwrap_err().to_string().contains("amax_epsilon"));
        let b = Float8BlockScaling { x_block_scaling_dim: 2, ..Default::default() };
        assert!(Recipe::from(b).validate().unwrap_err().to_string().contains("x_block_scaling_dim and w_block"));
        let b = Float8BlockScaling { w_block_scaling_dim: 1, grad_block_scaling_dim: 2, ..Default::default() };
        b.validate().unwrap();
        let b = Float8BlockScaling::default();
        b.validate().unwrap();
        assert!(!Recipe::from(b).fp8_dpa() && Recipe::from(b).with_fp8_dpa(true) == Recipe::from(b));
        assert_eq!(
            (b.fp8_format, b.power_2_scale, b.x_block_scaling_dim, b.w_block_scaling_dim),
            (Format::E4M3, true, 1, 2)
        );
    }
}
