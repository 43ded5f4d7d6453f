//! Element types the kernels read and write.

use serde::{Deserialize, Serialize};

/// Element type of a kernel input or output.
///
/// FP8 formats follow the OCP 8-bit floating point spec as used by TE: `E4M3` is
/// `float8_e4m3fn` (no infinities, one NaN pattern, max 448) and `E5M2` is IEEE-like (max 57344).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16 (8 exponent bits, 7 mantissa bits).
    BF16,
    /// IEEE binary16.
    F16,
    /// FP8 with 4 exponent and 3 mantissa bits (`float8_e4m3fn`), max finite 448.
    E4M3,
    /// FP8 with 5 exponent and 2 mantissa bits, max finite 57344.
    E5M2,
}

impl DType {
    /// Every element type, in a fixed order.
    pub const ALL: [DType; 5] = [DType::F32, DType::BF16, DType::F16, DType::E4M3, DType::E5M2];

    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::E4M3 | DType::E5M2 => 1,
        }
    }

    /// True for the two FP8 formats.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DType::E4M3 | DType::E5M2)
    }

    /// Largest finite value of an FP8 format (448 for E4M3, 57344 for E5M2); `None` otherwise.
    pub const fn fp8_max(self) -> Option<f32> {
        match self {
            DType::E4M3 => Some(448.0),
            DType::E5M2 => Some(57344.0),
            _ => None,
        }
    }

    /// Short lowercase name used in kernel names and templates (`bf16`, `e4m3`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::E4M3 => "e4m3",
            DType::E5M2 => "e5m2",
        }
    }

    /// Name of the C++ type tag in `te-codegen/templates/common.cuh.tera` (`F32`, `BF16`, `E4M3`, ...).
    pub const fn type_tag(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::E4M3 => "E4M3",
            DType::E5M2 => "E5M2",
        }
    }

    /// True for the high-precision types a kernel can take as a non-FP8 input (f32, bf16, f16).
    pub const fn is_high_precision(self) -> bool {
        !self.is_fp8()
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown dtype `{s}`: expected one of f32, bf16, f16, e4m3, e5m2"))
    }
}
