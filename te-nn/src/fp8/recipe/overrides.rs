//! [`RecipeOverrides`]: the recipe fields flags and config files set on top of a recipe's TE
//! defaults, and the check that the recipe has each field set.

use super::{Format, Recipe};
use te_codegen::spec::AmaxComputeAlgo;
use te_runtime::{Error, Result};

/// Fields several recipes share, as `te prewarm`/`te train` flags and config keys set them on
/// top of a recipe parsed by name (`"current".parse::<Recipe>()`): `None` keeps the recipe's
/// value. [`Recipe::with_overrides`] applies them and refuses a field the recipe does not have
/// (an amax history under current scaling, `fp8_dpa` under blockwise scaling, ...).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecipeOverrides {
    /// FP8 formats (TE `fp8_format`; every recipe has it).
    pub fp8_format: Option<Format>,
    /// Entries of each slot's amax history (TE `amax_history_len`; delayed scaling).
    pub amax_history_len: Option<usize>,
    /// How the history becomes an amax (TE `amax_compute_algo`; delayed scaling).
    pub amax_compute_algo: Option<AmaxComputeAlgo>,
    /// Attention in FP8 (TE `fp8_dpa`; delayed and current scaling).
    pub fp8_dpa: Option<bool>,
    /// FP8 between attention and its output projection (TE `fp8_mha`; delayed and current
    /// scaling).
    pub fp8_mha: Option<bool>,
}

impl RecipeOverrides {
    /// Every field's name, as [`RecipeOverrides::names`] and
    /// [`super::ScalingRecipe::override_fields`] list them.
    pub const FIELDS: [&'static str; 5] = ["fp8_format", "amax_history_len", "amax_compute_algo", "fp8_dpa", "fp8_mha"];

    /// The names of the fields that are set, in [`RecipeOverrides::FIELDS`] order.
    pub fn names(&self) -> Vec<&'static str> {
        let set = [
            self.fp8_format.is_some(),
            self.amax_history_len.is_some(),
            self.amax_compute_algo.is_some(),
            self.fp8_dpa.is_some(),
            self.fp8_mha.is_some(),
        ];
        Self::FIELDS.into_iter().zip(set).filter_map(|(name, set)| set.then_some(name)).collect()
    }

    /// Whether no field is set.
    pub fn is_empty(&self) -> bool {
        self.names().is_empty()
    }

    /// These overrides, with `base`'s where these leave a field unset (flags over a config
    /// file's keys).
    pub fn or(self, base: RecipeOverrides) -> RecipeOverrides {
        RecipeOverrides {
            fp8_format: self.fp8_format.or(base.fp8_format),
            amax_history_len: self.amax_history_len.or(base.amax_history_len),
            amax_compute_algo: self.amax_compute_algo.or(base.amax_compute_algo),
            fp8_dpa: self.fp8_dpa.or(base.fp8_dpa),
            fp8_mha: self.fp8_mha.or(base.fp8_mha),
        }
    }

    /// `Ok` when `recipe` has every field that is set; else the typed error naming the first
    /// one it lacks and the recipes that have it.
    pub(super) fn check(&self, recipe: &Recipe) -> Result<()> {
        let have = recipe.scaling().override_fields();
        let Some(field) = self.names().into_iter().find(|f| !have.contains(f)) else { return Ok(()) };
        let with: Vec<&str> = Recipe::all()
            .iter()
            .filter(|r| r.scaling().override_fields().contains(&field))
            .map(|r| r.short_name())
            .collect();
        Err(Error::Recipe {
            message: format!(
                "{} ({}) has no {field} (its fields: {}): leave {field} out, or use a recipe that has it ({})",
                recipe.name(),
                recipe.short_name(),
                have.join(", "),
                with.join(", ")
            ),
        })
    }
}

/// The amax algorithm flags and config files name: `max` or `most_recent` (TE's
/// `amax_compute_algo` strings), in any case.
///
/// # Errors
/// [`Error::Recipe`] naming the accepted values.
pub fn parse_amax_compute_algo(s: &str) -> Result<AmaxComputeAlgo> {
    match s.trim().to_ascii_lowercase().as_str() {
        "max" => Ok(AmaxComputeAlgo::Max),
        "most_recent" => Ok(AmaxComputeAlgo::MostRecent),
        _ => Err(Error::Recipe {
            message: format!(
                "unknown amax_compute_algo `{s}`: expected max (the largest amax of the history) or most_recent \
                 (the newest)"
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_set_fields_and_or_prefers_self() {
        assert!(RecipeOverrides::default().is_empty());
        let a = RecipeOverrides { fp8_dpa: Some(true), amax_history_len: Some(16), ..Default::default() };
        assert_eq!(a.names(), ["amax_history_len", "fp8_dpa"]);
        let b = RecipeOverrides { fp8_dpa: Some(false), fp8_format: Some(Format::E4M3), ..Default::default() };
        let both = a.or(b);
        assert_eq!(both.fp8_dpa, Some(true));
        assert_eq!(both.fp8_format, Some(Format::E4M3));
        assert_eq!(both.amax_history_len, Some(16));
    }

    #[test]
    fn amax_algorithms_parse_by_te_name() {
        assert_eq!(parse_amax_compute_algo("max").unwrap(), AmaxComputeAlgo::Max);
        assert_eq!(parse_amax_compute_algo("MOST_RECENT").unwrap(), AmaxComputeAlgo::MostRecent);
        let e = parse_amax_compute_algo("mean").unwrap_err();
        assert!(matches!(e, Error::Recipe { .. }) && e.to_string().contains("expected max"), "{e}");
    }
}
