//! Family 7: FP8 scaling-factor updates (TE `common/recipe/delayed_scaling.cu`,
//! `common/recipe/current_scaling.cu`).

use super::{Family, KernelArg};
use crate::Arch;
use serde::{Deserialize, Serialize};

/// How delayed scaling turns an amax history into the amax it scales by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxComputeAlgo {
    /// The maximum over the whole history (TE's default).
    Max,
    /// The newest entry, `history[0]`.
    MostRecent,
}

/// Which scale computation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ScalingKind {
    /// Bulk delayed-scaling update of `n` tensor slots in one launch (one block per slot); the
    /// slots may live in any number of buffers (one group per module and direction in TE).
    ///
    /// Per slot with `history: [len]` (`history[0]` newest): `amax = max(history)` or
    /// `history[0]`; `scale = scaled_max / amax` only if amax is finite and > 0, otherwise the
    /// old scale; an infinite scale becomes `FLT_MAX`; `scale_inv = 1 / scale`; then the history
    /// rolls by one (`new[i] = old[i+1]`, `new[len-1] = old[0]`, `new[0] = 0`), except when
    /// `history[0]` is 0, where it is left as it is. `scaled_max = fp8_max / 2^margin`.
    ///
    /// Arguments: [`ScalingSpec::DELAYED_ARGS`], `slots` a device array of `n` 40-byte entries, one per slot, C layout
    /// `{ float* history; float* scale; float* scale_inv; u64 len; float scaled_max; u32 pad; }`
    /// (`history` points at `len` floats, `scale`/`scale_inv` at one float each, no two slots
    /// share any of them); grid = `n` blocks, block `b` updates `slots[b]`.
    DelayedUpdate {
        /// Max over the history or most recent.
        algo: AmaxComputeAlgo,
    },
    /// Current scaling for `n` tensors: `a = max(amax, amax_epsilon)`; `scale = 1` if `a` is 0,
    /// inf or NaN, else `fp8_max / a` (inf → `FLT_MAX`), rounded down to a power of two when
    /// `power_2_scale`; `scale_inv = 1 / scale`.
    /// Arguments: [`ScalingSpec::CURRENT_ARGS`].
    CurrentScale {
        /// Keep only the exponent of the scale.
        power_2_scale: bool,
    },
}

/// A scaling-factor update kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ScalingSpec {
    /// Which update.
    pub kind: ScalingKind,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl ScalingSpec {
    /// The bulk delayed-scaling update.
    pub fn delayed(algo: AmaxComputeAlgo, arch: Arch) -> Self {
        Self { kind: ScalingKind::DelayedUpdate { algo }, threads: 256, arch }
    }

    /// The current-scaling scale computation.
    pub fn current(power_2_scale: bool, arch: Arch) -> Self {
        Self { kind: ScalingKind::CurrentScale { power_2_scale }, threads: 128, arch }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl ScalingSpec {
    /// Arguments of the `delayed` entry point.
    pub const DELAYED_ARGS: &'static [KernelArg] = &[KernelArg::read(
        "slots",
        "const ScalingSlot* __restrict__",
        "`[slots]` table of (history, scale, scale_inv pointers, length, fp8 max, margin), built on the host",
    )];

    /// Arguments of the `current` entry point.
    pub const CURRENT_ARGS: &'static [KernelArg] = &[
        KernelArg::read("amax", "const float* __restrict__", "`[n]` f32 amaxes"),
        KernelArg::write("scale", "float* __restrict__", "`[n]` f32 scales"),
        KernelArg::write("scale_inv", "float* __restrict__", "`[n]` f32 `1 / scale`"),
        KernelArg::scalar("n", "u64", "tensors"),
        KernelArg::scalar("fp8_max", "float", "largest FP8 value of the format"),
        KernelArg::scalar("amax_epsilon", "float", "floor of the amax"),
    ];
}

impl Family for ScalingSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        let _ = entry;
        match self.kind {
            ScalingKind::DelayedUpdate { .. } => Self::DELAYED_ARGS,
            ScalingKind::CurrentScale { .. } => Self::CURRENT_ARGS,
        }
    }
    fn family(&self) -> &'static str {
        "scaling"
    }
    fn template(&self) -> &'static str {
        "scaling.cu.tera"
    }
    fn name_parts(&self) -> String {
        let kind = match self.kind {
            ScalingKind::DelayedUpdate { algo: AmaxComputeAlgo::Max } => "delayed_max",
            ScalingKind::DelayedUpdate { algo: AmaxComputeAlgo::MostRecent } => "delayed_most_recent",
            ScalingKind::CurrentScale { power_2_scale: false } => "current",
            ScalingKind::CurrentScale { power_2_scale: true } => "current_pow2",
        };
        format!("{kind}_t{}", self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        match self.kind {
            ScalingKind::DelayedUpdate { algo } => {
                ctx.insert("kind", "delayed");
                ctx.insert("most_recent", &(algo == AmaxComputeAlgo::MostRecent));
                ctx.insert("power_2_scale", &false);
            }
            ScalingKind::CurrentScale { power_2_scale } => {
                ctx.insert("kind", "current");
                ctx.insert("most_recent", &false);
                ctx.insert("power_2_scale", &power_2_scale);
            }
        }
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        super::cast::check_threads(self.threads)
    }
}
