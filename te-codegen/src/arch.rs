//! GPU targets kernels are compiled for.

use serde::{Deserialize, Serialize};

/// A GPU architecture NVRTC compiles for.
///
/// FP8 conversions (`cvt.*.e4m3x2`) need compute capability 8.9 or newer, so only Ada and
/// Hopper are targets. Hopper uses the arch-specific `sm_90a` so that later kernels may use
/// `wgmma` and `setmaxnreg`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Arch {
    /// Ada Lovelace (L4, L40, RTX 4090): compute capability 8.9.
    #[serde(rename = "sm_89")]
    Sm89,
    /// Hopper (H100, H200): compute capability 9.0, arch-specific features enabled.
    #[serde(rename = "sm_90a")]
    Sm90a,
}

impl Arch {
    /// Every supported target.
    pub const ALL: [Arch; 2] = [Arch::Sm89, Arch::Sm90a];

    /// The target for a device of compute capability `major.minor`, or `None` when the device
    /// has no FP8 support (anything before 8.9). Newer GPUs than Hopper run the `sm_90a` code
    /// only if built for them, so they are `None` too until a target is added.
    pub fn from_compute_capability(major: i32, minor: i32) -> Option<Arch> {
        match (major, minor) {
            (8, 9) => Some(Arch::Sm89),
            (9, 0) => Some(Arch::Sm90a),
            _ => None,
        }
    }

    /// Name as NVRTC spells it in `--gpu-architecture` (`sm_89`, `sm_90a`).
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Sm89 => "sm_89",
            Arch::Sm90a => "sm_90a",
        }
    }

    /// The virtual architecture for a PTX fallback (`compute_89`, `compute_90a`).
    pub const fn virtual_name(self) -> &'static str {
        match self {
            Arch::Sm89 => "compute_89",
            Arch::Sm90a => "compute_90a",
        }
    }

    /// The number NVRTC lists in `nvrtcGetSupportedArchs` for this target (89, 90).
    pub const fn sm_number(self) -> i32 {
        match self {
            Arch::Sm89 => 89,
            Arch::Sm90a => 90,
        }
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Arch {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sm_89" | "sm89" | "89" => Ok(Arch::Sm89),
            "sm_90a" | "sm_90" | "sm90a" | "sm90" | "90" | "90a" => Ok(Arch::Sm90a),
            _ => Err(format!("unknown arch `{s}`: expected sm_89 (Ada) or sm_90a (Hopper)")),
        }
    }
}
