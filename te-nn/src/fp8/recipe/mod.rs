//! FP8 recipes: how tensors are scaled before their FP8 cast (TE `common/recipe/__init__.py`).
//!
//! One file per recipe: [`DelayedScaling`] (`delayed.rs`), [`Float8CurrentScaling`]
//! (`current.rs`), [`Float8BlockScaling`] (`block.rs`). Each file holds the recipe's struct
//! (TE's fields and defaults), its quantizer, and its [`ScalingRecipe`] impl: everything the
//! rest of the library asks a recipe (names, parsing and validation, the quantizers of a GEMM,
//! the scaling state it keeps, the kernels it adds, attention's FP8 capabilities, its emulation
//! on the host). [`Recipe`] is the set the modules run, and dispatches to the trait
//! ([`Recipe::scaling`]); nothing outside these files matches on its variants.
//!
//! Adding a recipe: a new file with the struct (`Default` = TE's defaults), its quantizer and
//! its [`ScalingRecipe`] impl, then one line in the `recipes!` list below (its variant).
//! [`Recipe::all`], the parser ([`Recipe`]'s `FromStr`), the overrides, the modules, prewarm,
//! checkpoints and the CPU twins pick it up from there.

mod block;
mod current;
mod delayed;
mod format;
mod overrides;

pub use block::{Float8BlockQuantizer, Float8BlockScaling};
pub use current::{Float8CurrentScaling, Float8CurrentScalingQuantizer};
pub use delayed::{DelayedScaling, DelayedScalingQuantizer};
pub use format::Format;
pub use overrides::{parse_amax_compute_algo, RecipeOverrides};

use super::{GemmScaling, GemmTensor, HostCast, HostScalingState, Quantizer, ScalingState};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use te_codegen::spec::AmaxComputeAlgo;
use te_codegen::{Arch, DType, KernelSpec};
use te_runtime::{Device, Error, Result};

/// What an FP8 recipe is to the rest of the library. Implemented by each recipe struct in its
/// own file (sealed: the set is [`Recipe`]'s); [`Recipe::scaling`] returns the one of a recipe.
pub trait ScalingRecipe: sealed::Sealed + fmt::Debug + Send + Sync {
    /// TE's class name (`DelayedScaling`, `Float8CurrentScaling`, `Float8BlockScaling`): what
    /// checkpoints record ([`Recipe::name`]) and what the parser accepts besides the short name.
    fn name(&self) -> &'static str;

    /// The short name of flags and config files (`delayed`, `current`, `block`).
    fn short_name(&self) -> &'static str;

    /// The recipe in words, as reports name it (`delayed scaling`, `current scaling`,
    /// `blockwise scaling`).
    fn description(&self) -> &'static str;

    /// The recipe's FP8 formats.
    fn format(&self) -> Format;

    /// Checks the fields a user can get wrong.
    ///
    /// # Errors
    /// [`Error::Recipe`] naming the field, its value and what is accepted.
    fn validate(&self) -> Result<()>;

    /// Whether `DotProductAttention` runs in FP8 (TE `fp8_dpa`, or `fp8_mha`, which implies it).
    fn fp8_dpa(&self) -> bool {
        false
    }

    /// Whether `MultiheadAttention` hands the attention output to its projection in FP8 (TE
    /// `fp8_mha`; see [`DelayedScaling::fp8_mha`]).
    fn fp8_mha(&self) -> bool {
        false
    }

    /// The [`RecipeOverrides`] fields this recipe has (names of [`RecipeOverrides::FIELDS`]).
    fn override_fields(&self) -> &'static [&'static str];

    /// This recipe with the fields of `o` it has set; fields it does not have are ignored
    /// ([`Recipe::with_overrides`] refuses them before). Not validated.
    fn apply_overrides(&self, o: &RecipeOverrides) -> Recipe;

    /// Whether calibration (`fp8_autocast(calibrating=True)`) can record amaxes for it: only a
    /// recipe that keeps amax histories.
    fn calibrates(&self) -> bool {
        false
    }

    /// Whether an autocast scope's amaxes are all-reduced over its `fp8_group` before the scale
    /// updates (TE `reduce_amax`, delayed scaling).
    fn reduces_amax(&self) -> bool {
        false
    }

    /// The delayed recipe of attention's dS under `fp8_dpa` (TE `dot_product_attention.py`:
    /// a recipe without histories "creates a new FP8DS recipe for S, dP": history 1, the most
    /// recent amax, the run's format).
    fn attention_ds_recipe(&self) -> DelayedScaling {
        DelayedScaling {
            fp8_format: self.format(),
            amax_history_len: 1,
            amax_compute_algo: AmaxComputeAlgo::MostRecent,
            ..DelayedScaling::default()
        }
    }

    /// The kernels the recipe adds to every FP8 module whose activations are `dt`, on `arch`,
    /// besides the plain casts to its formats and their dequantize (its amax, scale update or
    /// blockwise casts).
    fn kernel_specs(&self, dt: DType, arch: Arch, specs: &mut Vec<KernelSpec>);

    /// The quantizer of `tensor` in a forward of the GEMM whose scaling is `gemm`: the
    /// recipe's state in `gemm` made or conformed first, when it keeps one (registered with the
    /// autocast scope, whose exit updates it).
    ///
    /// # Errors
    /// Allocation failures; [`Error::Recipe`] where the recipe cannot run on this GPU.
    fn forward_quantizer(&self, gemm: &mut GemmScaling, tensor: GemmTensor) -> Result<Box<dyn Quantizer>>;

    /// The quantizer of the output gradient in a backward of the GEMM (the backward format:
    /// E5M2 under HYBRID).
    ///
    /// # Errors
    /// As [`ScalingRecipe::forward_quantizer`].
    fn grad_output_quantizer(&self, gemm: &mut GemmScaling) -> Result<Box<dyn Quantizer>>;

    /// The backward state of the GEMM whose scales the scope's backward group updates after
    /// the last backward (made first when missing); `None` for a recipe without state.
    ///
    /// # Errors
    /// Allocation failures.
    fn backward_state(&self, gemm: &mut GemmScaling) -> Result<Option<Arc<ScalingState>>> {
        let _ = gemm;
        Ok(None)
    }

    /// The quantizer a sharded weight's pieces are cast with for an FP8 all-gather (ZeRO-3,
    /// torchao's float8 all-gather with FSDP): one whose scale comes from the whole weight's
    /// amax alone, so that a cast of each piece with the pieces' amaxes all-reduced (max)
    /// ([`Quantizer::quantize_with_amax`]) makes the codes [`ScalingRecipe::forward_quantizer`]
    /// makes of the whole weight. Current scaling's; `None` (the weight is gathered in high
    /// precision and cast whole) for delayed scaling, whose weight scale comes from the
    /// layer's amax history, and for blockwise scaling, whose blocks straddle pieces.
    ///
    /// # Errors
    /// Allocation failures.
    fn sharded_weight_quantizer(&self, dev: &Arc<Device>) -> Result<Option<Box<dyn Quantizer>>> {
        let _ = dev;
        Ok(None)
    }

    /// CPU emulation: the state a host model keeps per FP8 GEMM (`None`: the recipe keeps none).
    fn host_state(&self) -> Option<HostScalingState> {
        None
    }

    /// CPU emulation: how a GEMM reads its forward operands, input `[t, n_in]` and weight
    /// `[n_out, n_in]` (`dims = [t, n_out, n_in]`), and the input as its wgrad GEMM reads it when
    /// that differs; `state`: the GEMM's [`ScalingRecipe::host_state`].
    fn host_forward_casts(
        &self,
        state: Option<&HostScalingState>,
        dims: [usize; 3],
    ) -> ([HostCast; 2], Option<HostCast>);

    /// CPU emulation: how a GEMM's backward reads the output gradient `[t, n_out]` (`dims = [t,
    /// n_out]`) for its dgrad GEMM and, when it differs, for its wgrad GEMM.
    fn host_grad_casts(&self, state: Option<&HostScalingState>, dims: [usize; 2]) -> (HostCast, Option<HostCast>);
}

/// Keeps [`ScalingRecipe`] to the recipes of this module.
mod sealed {
    /// Implemented by the recipe structs only.
    pub trait Sealed {}
}

/// The recipe registry: the [`Recipe`] enum, one variant per recipe struct, its `From`
/// impls, its dispatch to [`ScalingRecipe`] and [`Recipe::all`].
macro_rules! recipes {
    ($($(#[$doc:meta])* $variant:ident($ty:ident),)+) => {
        /// An FP8 recipe: one of the recipe structs, dispatching to its [`ScalingRecipe`].
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum Recipe {
            $($(#[$doc])* $variant($ty),)+
        }

        $(
            impl From<$ty> for Recipe {
                fn from(r: $ty) -> Self {
                    Recipe::$variant(r)
                }
            }

            impl sealed::Sealed for $ty {}
        )+

        impl Recipe {
            /// The recipe as its [`ScalingRecipe`].
            pub fn scaling(&self) -> &dyn ScalingRecipe {
                match self {
                    $(Recipe::$variant(r) => r,)+
                }
            }

            /// Every recipe, with TE's defaults, in registration order.
            pub fn all() -> Vec<Recipe> {
                vec![$($ty::default().into(),)+]
            }
        }
    };
}

recipes! {
    /// Scales from amax histories ([`DelayedScaling`]).
    Delayed(DelayedScaling),
    /// Scales from each tensor's own amax ([`Float8CurrentScaling`]).
    Current(Float8CurrentScaling),
    /// One scale per block of 128 values (1×128 or 128×128), from the block's own amax
    /// ([`Float8BlockScaling`]).
    Block(Float8BlockScaling),
}

impl Default for Recipe {
    /// TE's default recipe: `DelayedScaling()`.
    fn default() -> Self {
        Recipe::Delayed(DelayedScaling::default())
    }
}

impl Recipe {
    /// TE's class name of the recipe: `DelayedScaling`, `Float8CurrentScaling` or
    /// `Float8BlockScaling` (what a checkpoint records it as).
    pub fn name(&self) -> &'static str {
        self.scaling().name()
    }

    /// The short name of flags and config files: `delayed`, `current` or `block`.
    pub fn short_name(&self) -> &'static str {
        self.scaling().short_name()
    }

    /// The recipe in words, as reports name it: `delayed scaling`, `current scaling` or
    /// `blockwise scaling`.
    pub fn description(&self) -> &'static str {
        self.scaling().description()
    }

    /// The recipe's formats.
    pub fn format(&self) -> Format {
        self.scaling().format()
    }

    /// Whether `DotProductAttention` runs in FP8 under this recipe (TE `fp8_dpa`, or `fp8_mha`,
    /// which implies it). Never under [`Recipe::Block`].
    pub fn fp8_dpa(&self) -> bool {
        self.scaling().fp8_dpa()
    }

    /// Whether `MultiheadAttention` hands the attention output to its projection in FP8 (TE
    /// `fp8_mha`; see [`DelayedScaling::fp8_mha`]). Never under [`Recipe::Block`].
    pub fn fp8_mha(&self) -> bool {
        self.scaling().fp8_mha()
    }

    /// This recipe with `o` applied, then validated: the common knobs flags and config files
    /// set on top of a recipe parsed by name.
    ///
    /// # Errors
    /// [`Error::Recipe`] for a field the recipe does not have (an amax history under current
    /// scaling, `fp8_dpa` under blockwise scaling: the message names the recipes that have it),
    /// or a value [`Recipe::validate`] refuses.
    pub fn with_overrides(self, o: &RecipeOverrides) -> Result<Recipe> {
        o.check(&self)?;
        let r = self.scaling().apply_overrides(o);
        r.validate()?;
        Ok(r)
    }

    /// The same recipe with `fields` applied when it has them all, else unchanged.
    fn with_if_present(self, fields: RecipeOverrides) -> Recipe {
        match fields.check(&self) {
            Ok(()) => self.scaling().apply_overrides(&fields),
            Err(_) => self,
        }
    }

    /// The same recipe with `fp8_mha` set to `fp8_mha` (unchanged under [`Recipe::Block`],
    /// whose attention stays in 16 bits).
    pub fn with_fp8_mha(self, fp8_mha: bool) -> Self {
        self.with_if_present(RecipeOverrides { fp8_mha: Some(fp8_mha), ..Default::default() })
    }

    /// The same recipe with `fp8_dpa` set to `fp8_dpa` (unchanged under [`Recipe::Block`]).
    pub fn with_fp8_dpa(self, fp8_dpa: bool) -> Self {
        self.with_if_present(RecipeOverrides { fp8_dpa: Some(fp8_dpa), ..Default::default() })
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
    /// [`Error::Recipe`] for a zero history length, a negative or non-finite margin, a
    /// negative or non-finite amax epsilon, or the block dimensions
    /// [`Float8BlockScaling::validate`] rejects.
    pub fn validate(&self) -> Result<()> {
        self.scaling().validate()
    }

    /// Whether calibration can record amaxes for this recipe ([`ScalingRecipe::calibrates`]).
    pub fn calibrates(&self) -> bool {
        self.scaling().calibrates()
    }

    /// Whether autocast scopes all-reduce the amaxes of this recipe over their `fp8_group`
    /// ([`ScalingRecipe::reduces_amax`]).
    pub fn reduces_amax(&self) -> bool {
        self.scaling().reduces_amax()
    }

    /// The delayed recipe of attention's dS under `fp8_dpa` ([`ScalingRecipe::attention_ds_recipe`]).
    pub fn attention_ds_recipe(&self) -> DelayedScaling {
        self.scaling().attention_ds_recipe()
    }

    /// The kernels the recipe adds to an FP8 module of `dt` activations on `arch`
    /// ([`ScalingRecipe::kernel_specs`]).
    pub fn kernel_specs(&self, dt: DType, arch: Arch, specs: &mut Vec<KernelSpec>) {
        self.scaling().kernel_specs(dt, arch, specs);
    }
}

/// `a, b or c`.
fn one_of(names: &[&str]) -> String {
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => (*last).to_owned(),
        None => String::new(),
    }
}

impl FromStr for Recipe {
    type Err = Error;

    /// A recipe with TE's default fields from its short name (`delayed`, `current`, `block`) or
    /// TE's class name (`DelayedScaling`, `Float8CurrentScaling`, `Float8BlockScaling`), in any
    /// case: what `te prewarm --recipe`, `te train --recipe` and config files' `recipe` take.
    /// [`Recipe::with_overrides`] then sets the knobs.
    ///
    /// # Errors
    /// [`Error::Recipe`] listing the accepted names.
    fn from_str(s: &str) -> Result<Recipe> {
        let all = Recipe::all();
        let name = s.trim();
        all.iter()
            .find(|r| r.short_name().eq_ignore_ascii_case(name) || r.name().eq_ignore_ascii_case(name))
            .copied()
            .ok_or_else(|| {
                let short: Vec<&str> = all.iter().map(Recipe::short_name).collect();
                let te: Vec<&str> = all.iter().map(Recipe::name).collect();
                Error::Recipe {
                    message: format!(
                        "unknown recipe `{s}`: expected {} (or TE's class names {})",
                        one_of(&short),
                        one_of(&te)
                    ),
                }
            })
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

    /// Short names and TE's class names, in any case, give the recipe with TE's defaults;
    /// anything else is a typed error listing what is accepted.
    #[test]
    fn recipes_parse_by_short_and_class_name() {
        let want: [(&str, &str, Recipe); 3] = [
            ("delayed", "DelayedScaling", DelayedScaling::default().into()),
            ("current", "Float8CurrentScaling", Float8CurrentScaling::default().into()),
            ("block", "Float8BlockScaling", Float8BlockScaling::default().into()),
        ];
        assert_eq!(Recipe::all(), want.map(|(.., r)| r));
        for (short, class, recipe) in want {
            assert_eq!(short.parse::<Recipe>().unwrap(), recipe);
            assert_eq!(class.parse::<Recipe>().unwrap(), recipe);
            assert_eq!(short.to_ascii_uppercase().parse::<Recipe>().unwrap(), recipe);
            assert_eq!((recipe.short_name(), recipe.name()), (short, class));
        }
        let e = "mxfp8".parse::<Recipe>().unwrap_err();
        assert!(matches!(e, Error::Recipe { .. }), "{e:?}");
        let e = e.to_string();
        assert!(
            e.contains("unknown recipe `mxfp8`")
                && e.contains("expected delayed, current or block")
                && e.contains("DelayedScaling, Float8CurrentScaling or Float8BlockScaling"),
            "{e}"
        );
    }

    /// The common knobs apply where the recipe has them; a field it lacks is refused naming
    /// the recipes that have it; the result is validated.
    #[test]
    fn overrides_apply_or_name_the_missing_field() {
        let all = RecipeOverrides {
            fp8_format: Some(Format::E4M3),
            amax_history_len: Some(16),
            amax_compute_algo: Some(AmaxComputeAlgo::MostRecent),
            fp8_dpa: Some(true),
            fp8_mha: Some(true),
        };
        let d = Recipe::default().with_overrides(&all).unwrap();
        let want = DelayedScaling {
            fp8_format: Format::E4M3,
            amax_history_len: 16,
            amax_compute_algo: AmaxComputeAlgo::MostRecent,
            fp8_dpa: true,
            fp8_mha: true,
            ..Default::default()
        };
        assert_eq!(d, want.into());
        let attention = RecipeOverrides { fp8_format: Some(Format::E4M3), fp8_dpa: Some(true), ..Default::default() };
        let c = "current".parse::<Recipe>().unwrap().with_overrides(&attention).unwrap();
        let want = Float8CurrentScaling { fp8_format: Format::E4M3, fp8_dpa: true, ..Default::default() };
        assert_eq!(c, want.into());
        let e = c.with_overrides(&all).unwrap_err();
        assert!(matches!(e, Error::Recipe { .. }));
        let e = e.to_string();
        assert!(e.contains("Float8CurrentScaling (current) has no amax_history_len") && e.contains("(delayed)"), "{e}");
        let b = "block".parse::<Recipe>().unwrap();
        let hybrid = RecipeOverrides { fp8_format: Some(Format::Hybrid), ..Default::default() };
        assert_eq!(
            b.with_overrides(&hybrid).unwrap(),
            Float8BlockScaling { fp8_format: Format::Hybrid, ..Default::default() }.into()
        );
        let e = b.with_overrides(&RecipeOverrides { fp8_dpa: Some(false), ..Default::default() }).unwrap_err();
        assert!(e.to_string().contains("has no fp8_dpa") && e.to_string().contains("(delayed, current)"), "{e}");
        // Validated after applying.
        let zero = RecipeOverrides { amax_history_len: Some(0), ..Default::default() };
        assert!(Recipe::default().with_overrides(&zero).unwrap_err().to_string().contains("amax_history_len"));
        assert_eq!(Recipe::default().with_overrides(&RecipeOverrides::default()).unwrap(), Recipe::default());
        // fp8_mha implies fp8_dpa.
        let mha = Recipe::from(Float8CurrentScaling::default()).with_fp8_mha(true);
        assert!(mha.fp8_mha() && mha.fp8_dpa());
    }

    #[test]
    fn capabilities_follow_the_recipe() {
        let [d, c, b]: [Recipe; 3] = Recipe::all().try_into().unwrap();
        assert!(d.calibrates() && !c.calibrates() && !b.calibrates());
        assert!(d.reduces_amax() && !c.reduces_amax() && !b.reduces_amax());
        let no_reduce = Recipe::from(DelayedScaling { reduce_amax: false, ..Default::default() });
        assert!(!no_reduce.reduces_amax());
        let e4m3 = Recipe::from(DelayedScaling { fp8_format: Format::E4M3, ..Default::default() });
        assert_eq!(e4m3.attention_ds_recipe(), DelayedScaling { fp8_format: Format::E4M3, ..Default::default() });
        let ds = c.attention_ds_recipe();
        assert_eq!(
            (ds.amax_history_len, ds.amax_compute_algo, ds.fp8_format),
            (1, AmaxComputeAlgo::MostRecent, Format::Hybrid)
        );
    }
}
