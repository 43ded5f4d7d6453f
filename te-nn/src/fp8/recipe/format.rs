//! [`Format`]: which FP8 formats a recipe casts to (TE `common/recipe/__init__.py` `Format`).

use serde::{Deserialize, Serialize};
use std::str::FromStr;
use te_codegen::DType;
use te_runtime::Error;

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

    /// The name flags and config files use: `hybrid` or `e4m3`.
    pub fn name(self) -> &'static str {
        match self {
            Format::E4M3 => "e4m3",
            Format::Hybrid => "hybrid",
        }
    }
}

impl FromStr for Format {
    type Err = Error;

    /// `hybrid` or `e4m3`, in any case (TE's `Format.HYBRID`, `Format.E4M3`).
    ///
    /// # Errors
    /// [`Error::Recipe`]: "unknown FP8 format \`NAME\`: expected hybrid or e4m3" (E5M2 is no
    /// recipe format: HYBRID already casts gradients to it).
    fn from_str(s: &str) -> Result<Self, Error> {
        [Format::Hybrid, Format::E4M3].into_iter().find(|f| f.name().eq_ignore_ascii_case(s.trim())).ok_or_else(|| {
            Error::Recipe {
                message: format!(
                    "unknown FP8 format `{s}`: expected hybrid or e4m3 (hybrid casts gradients to E5M2, e4m3 casts \
                     everything to E4M3)"
                ),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse_by_name_in_any_case() {
        for f in [Format::Hybrid, Format::E4M3] {
            assert_eq!(f.name().parse::<Format>().unwrap(), f);
            assert_eq!(f.name().to_ascii_uppercase().parse::<Format>().unwrap(), f);
        }
        let e = "e5m2".parse::<Format>().unwrap_err();
        assert!(matches!(e, Error::Recipe { .. }) && e.to_string().contains("expected hybrid or e4m3"), "{e}");
        assert_eq!(Format::Hybrid.backward_dtype(), DType::E5M2);
        assert_eq!(Format::E4M3.backward_dtype(), DType::E4M3);
        assert_eq!(Format::E4M3.forward_dtype(), DType::E4M3);
    }
}
