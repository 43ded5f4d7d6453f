//! Loading a checkpoint into a model: the model's parameters and scaling-state slots are listed,
//! checked against the file's tensors (names, dtypes, shapes), and only then written — strict
//! loads change nothing when anything does not match.

use super::atomic::io_error;
use super::format::{check_metadata, check_recipe, drop_state_tensors, fp8_scale_inv_name, parse, state_tensor_names};
use super::format::{to_safetensors, V1_BWD_SLOTS};
use super::{LoadOptions, LoadReport};
use crate::fp8::{DelayedScaling, Float8Tensor, ScalingSnapshot, ScalingState};
use crate::modules::{Fp8Direction, Fp8StateSlot, ModuleVisitorMut, ParamKind, ParamMut};
use crate::Module;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::{Error, Result, Tensor};

/// Loads the safetensors file `path` into `model` (written by [`super::save`], or weights from
/// elsewhere under the same names):
///
/// - each parameter through [`ParamMut::set`] (the file's dtype and shape must be the stored
///   ones); an FP8-only weight from its E4M3 codes and `<path>.scale_inv` through
///   [`ParamMut::set_fp8`];
/// - each scaling state the file holds (`<path>.amax_history` `[n, len]`, `.scale` and
///   `.scale_inv` `[n]`, f32) through [`ScalingState::restore`], made first in a model that has
///   not run FP8 yet; the next FP8 pass uses it (a recipe with another history length adapts
///   it). A state the file does not hold at all is optional: the model's state is reset to
///   fresh (scale 1, zero history), or made on the first FP8 pass.
///
/// With [`LoadOptions::strict`] (the default) anything missing, unexpected or mismatched fails
/// the load before the model is touched; otherwise what matches is loaded and the rest
/// reported.
///
/// # Errors
/// [`Error::Checkpoint`] for an unreadable, truncated or corrupt file, a newer format version,
/// or (strict) the list of missing, unexpected and mismatched tensors; driver failures.
pub fn load<M: Module + ?Sized>(model: &mut M, path: impl AsRef<Path>, options: &LoadOptions) -> Result<LoadReport> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| io_error(path, "cannot read", e))?;
    let file = parse(&bytes, path)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::Checkpoint { message: format!("{}: {e}", path.display()) })?;
    let version = check_metadata(header.metadata().as_ref(), path)?;
    let convert = check_recipe(header.metadata().as_ref(), options, path)?;

    let mut entries = Entries::default();
    model.visit_mut("", &mut entries)?;
    let mut infos: BTreeMap<String, (Dtype, Vec<usize>)> =
        file.iter().map(|(name, t)| (name.to_owned(), (t.dtype(), t.shape().to_vec()))).collect();
    if convert {
        drop_state_tensors(state_paths(&entries.0), &mut infos);
    }
    let plan = check(&entries.0, &infos, version);
    if options.strict && !plan.report.is_clean() {
        return Err(Error::Checkpoint {
            message: format!("{}: does not match the model: {}", path.display(), plan.report),
        });
    }
    let tensors: BTreeMap<&str, TensorView<'_>> = file.iter().collect();
    model.visit_mut("", &mut Apply { plan: &plan, tensors: &tensors })?;
    Ok(plan.report)
}

/// The paths of the scaling-state slots among `entries`.
pub(crate) fn state_paths(entries: &[Entry]) -> impl Iterator<Item = &str> {
    entries.iter().filter_map(|e| match e {
        Entry::State { path, .. } => Some(path.as_str()),
        Entry::Param { .. } => None,
    })
}

/// What the model holds at one path.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// A parameter: stored dtype and shape; `fp8` for an FP8-only weight.
    Param {
        /// Its path in the model (`layers.0.fc1_weight`).
        path: String,
        /// The dtype it is stored in.
        dtype: DType,
        /// Its shape.
        shape: Vec<usize>,
        /// An FP8-only weight (`fp8_model_init`).
        fp8: bool,
    },
    /// A scaling-state slot of `slots` FP8 tensor slots.
    State {
        /// Its path in the model (`layers.0.fp8_fwd`).
        path: String,
        /// FP8 tensors it holds scales for.
        slots: usize,
        /// Forward (inputs, weights) or backward (gradients).
        direction: Fp8Direction,
    },
}

/// The visitor that lists the model's entries (it writes nothing).
#[derive(Default)]
struct Entries(Vec<Entry>);

impl ModuleVisitorMut for Entries {
    fn param(&mut self, path: &str, _: ParamKind, p: &mut dyn ParamMut) -> Result<()> {
        let fp8 = p.tensor().is_none() && p.fp8_tensor().is_some();
        self.0.push(Entry::Param { path: path.to_owned(), dtype: p.dtype(), shape: p.shape().to_vec(), fp8 });
        Ok(())
    }

    fn fp8_state_slot(&mut self, path: &str, slot: &mut Fp8StateSlot<'_>) -> Result<()> {
        self.0.push(Entry::State { path: path.to_owned(), slots: slot.slots(), direction: slot.direction() });
        Ok(())
    }
}

/// What to write, and the report.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    /// Parameters and states to load from the file.
    pub load: BTreeSet<String>,
    /// States the file does not hold at all: reset to fresh.
    pub fresh: BTreeSet<String>,
    /// Missing, unexpected and mismatched names.
    pub report: LoadReport,
}

/// Checks the model's `entries` against the file's tensors (`name → (dtype, shape)`) of a file
/// of format `version` (`None`: written elsewhere).
pub(crate) fn check(entries: &[Entry], file: &BTreeMap<String, (Dtype, Vec<usize>)>, version: Option<u32>) -> Plan {
    let mut plan = Plan::default();
    let mut used = BTreeSet::new();
    let describe = |(d, s): &(Dtype, Vec<usize>)| format!("{d} {s:?}");
    for e in entries {
        match e {
            Entry::Param { path, dtype, shape, fp8 } => {
                let mut want = vec![(path.clone(), (to_safetensors(*dtype), shape.clone()))];
                if *fp8 {
                    want.push((fp8_scale_inv_name(path), (Dtype::F32, vec![1])));
                }
                if expect(&want, file, &mut used, &mut plan.report, describe) {
                    plan.load.insert(path.clone());
                }
            }
            Entry::State { path, slots, direction } => {
                let names = state_tensor_names(path);
                if names.iter().all(|n| !file.contains_key(n)) {
                    plan.fresh.insert(path.clone());
                    continue;
                }
                let history = file.get(&names[0]).map(|(_, s)| s.as_slice());
                let len = match history {
                    Some([_, len]) if *len > 0 => Some(*len),
                    _ => None,
                };
                // Format 1 kept an unused second slot in backward states: it loads, and
                // `Apply` keeps the model's slots (the first ones).
                let v1_bwd = version == Some(1)
                    && *direction == Fp8Direction::Backward
                    && matches!(history, Some([n, _]) if *n == V1_BWD_SLOTS);
                let stored = if v1_bwd { V1_BWD_SLOTS } else { *slots };
                let [a, s, si] = names;
                let want = [
                    (a, (Dtype::F32, vec![stored, len.unwrap_or(1)])),
                    (s, (Dtype::F32, vec![stored])),
                    (si, (Dtype::F32, vec![stored])),
                ];
                if expect(&want, file, &mut used, &mut plan.report, describe) {
                    plan.load.insert(path.clone());
                }
            }
        }
    }
    plan.report.unexpected = file.keys().filter(|n| !used.contains(*n)).cloned().collect();
    plan
}

/// Checks that each wanted `(name, (dtype, shape))` is in `file` as wanted, recording the names
/// seen in `used` and the others in `report`; whether all matched.
fn expect(
    want: &[(String, (Dtype, Vec<usize>))],
    file: &BTreeMap<String, (Dtype, Vec<usize>)>,
    used: &mut BTreeSet<String>,
    report: &mut LoadReport,
    describe: impl Fn(&(Dtype, Vec<usize>)) -> String,
) -> bool {
    let mut ok = true;
    for (name, w) in want {
        match file.get(name) {
            None => {
                report.missing.push(name.clone());
                ok = false;
            }
            Some(got) => {
                used.insert(name.clone());
                if got != w {
                    report.mismatched.push(format!("{name} (file {}, model {})", describe(got), describe(w)));
                    ok = false;
                }
            }
        }
    }
    ok
}

/// The visitor that writes what the plan loads.
struct Apply<'p, 'f> {
    plan: &'p Plan,
    tensors: &'p BTreeMap<&'f str, TensorView<'f>>,
}

impl Apply<'_, '_> {
    fn tensor(&self, name: &str) -> Result<&TensorView<'_>> {
        self.tensors.get(name).ok_or_else(|| Error::internal("checkpoint::load", format!("`{name}` vanished")))
    }

    fn f32s(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

impl ModuleVisitorMut for Apply<'_, '_> {
    fn param(&mut self, path: &str, _: ParamKind, p: &mut dyn ParamMut) -> Result<()> {
        if !self.plan.load.contains(path) {
            return Ok(());
        }
        let t = self.tensor(path)?;
        let dtype = p.dtype();
        if let Some(old) = p.tensor() {
            let value = Tensor::from_bytes_on(old.data().stream(), dtype, t.shape(), t.data())?;
            return p.set(value);
        }
        let Some(old) = p.fp8_tensor() else { return Ok(()) };
        let stream = old.data().data().stream().clone();
        let codes = Tensor::from_bytes_on(&stream, dtype, t.shape(), t.data())?;
        let scale_inv = stream.htod(&self.f32s(&fp8_scale_inv_name(path))?)?;
        p.set_fp8(Float8Tensor::from_parts(codes, None, Arc::new(scale_inv))?)
    }

    fn fp8_state_slot(&mut self, path: &str, slot: &mut Fp8StateSlot<'_>) -> Result<()> {
        if self.plan.fresh.contains(path) {
            return match slot.state() {
                Some(state) => reset(state),
                None => Ok(()),
            };
        }
        if !self.plan.load.contains(path) {
            return Ok(());
        }
        let [a, s, si] = state_tensor_names(path);
        let history_len = self.tensor(&a)?.shape().get(1).copied().unwrap_or(0);
        // The model's slots are the file's first ones (all of them but in a format-1 backward
        // state; see `check`).
        let n = slot.slots();
        let first = |mut v: Vec<f32>, len: usize| {
            v.truncate(n * len);
            v
        };
        let snap = ScalingSnapshot {
            amax_history: first(self.f32s(&a)?, history_len),
            scale: first(self.f32s(&s)?, 1),
            scale_inv: first(self.f32s(&si)?, 1),
            history_len,
        };
        let state = slot.get_or_create(&DelayedScaling { amax_history_len: history_len, ..Default::default() })?;
        state.restore(&snap)
    }
}

/// Resets `state` to a fresh one's values: scale and scale_inv 1, zero history.
fn reset(state: &ScalingState) -> Result<()> {
    let (n, len) = (state.slots(), state.history_len());
    state.restore(&ScalingSnapshot {
        amax_history: vec![0.0; n * len],
        scale: vec![1.0; n],
        scale_inv: vec![1.0; n],
        history_len: len,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(path: &str, dtype: DType, shape: &[usize], fp8: bool) -> Entry {
        Entry::Param { path: path.into(), dtype, shape: shape.to_vec(), fp8 }
    }

    fn state(path: &str, slots: usize) -> Entry {
        let direction = if path.ends_with("bwd") { Fp8Direction::Backward } else { Fp8Direction::Forward };
        Entry::State { path: path.into(), slots, direction }
    }

    fn file(tensors: &[(&str, Dtype, &[usize])]) -> BTreeMap<String, (Dtype, Vec<usize>)> {
        tensors.iter().map(|(n, d, s)| (n.to_string(), (*d, s.to_vec()))).collect()
    }

    fn model() -> Vec<Entry> {
        vec![
            param("fc.weight", DType::BF16, &[32, 16], false),
            param("fc.bias", DType::BF16, &[32], false),
            state("fc.fp8_fwd", 3),
            state("fc.fp8_bwd", 1),
        ]
    }

    fn full_file() -> BTreeMap<String, (Dtype, Vec<usize>)> {
        file(&[
            ("fc.weight", Dtype::BF16, &[32, 16]),
            ("fc.bias", Dtype::BF16, &[32]),
            ("fc.fp8_fwd.amax_history", Dtype::F32, &[3, 16]),
            ("fc.fp8_fwd.scale", Dtype::F32, &[3]),
            ("fc.fp8_fwd.scale_inv", Dtype::F32, &[3]),
            ("fc.fp8_bwd.amax_history", Dtype::F32, &[1, 16]),
            ("fc.fp8_bwd.scale", Dtype::F32, &[1]),
            ("fc.fp8_bwd.scale_inv", Dtype::F32, &[1]),
        ])
    }

    #[test]
    fn a_matching_file_loads_everything() {
        let plan = check(&model(), &full_file(), Some(2));
        assert!(plan.report.is_clean(), "{}", plan.report);
        assert_eq!(plan.load.len(), 4);
        assert!(plan.fresh.is_empty());
    }

    #[test]
    fn fp8_state_is_optional() {
        let f = file(&[("fc.weight", Dtype::BF16, &[32, 16]), ("fc.bias", Dtype::BF16, &[32])]);
        let plan = check(&model(), &f, Some(2));
        assert!(plan.report.is_clean(), "{}", plan.report);
        assert_eq!(plan.fresh, BTreeSet::from(["fc.fp8_fwd".to_string(), "fc.fp8_bwd".to_string()]));
        assert_eq!(plan.load, BTreeSet::from(["fc.weight".to_string(), "fc.bias".to_string()]));
    }

    #[test]
    fn missing_unexpected_and_mismatched_are_all_listed() {
        let mut f = full_file();
        f.remove("fc.bias");
        f.remove("fc.fp8_bwd.scale");
        f.insert("fc.weight".into(), (Dtype::BF16, vec![16, 32]));
        f.insert("fc.fp8_fwd.scale".into(), (Dtype::F16, vec![3]));
        f.insert("other.weight".into(), (Dtype::F32, vec![4]));
        let plan = check(&model(), &f, Some(2));
        let r = &plan.report;
        assert_eq!(r.missing, ["fc.bias", "fc.fp8_bwd.scale"]);
        assert_eq!(r.unexpected, ["other.weight"]);
        assert_eq!(
            r.mismatched,
            ["fc.weight (file BF16 [16, 32], model BF16 [32, 16])", "fc.fp8_fwd.scale (file F16 [3], model F32 [3])"]
        );
        assert!(plan.load.is_empty(), "{:?}", plan.load);
        let text = r.to_string();
        assert!(
            text.starts_with("missing: fc.bias, fc.fp8_bwd.scale; unexpected: other.weight; mismatched: "),
            "{text}"
        );
    }

    #[test]
    fn a_state_of_another_slot_count_or_rank_mismatches() {
        let mut f = full_file();
        f.insert("fc.fp8_fwd.amax_history".into(), (Dtype::F32, vec![2, 16]));
        f.insert("fc.fp8_bwd.amax_history".into(), (Dtype::F32, vec![32]));
        let plan = check(&model(), &f, Some(2));
        assert_eq!(plan.report.mismatched.len(), 2, "{}", plan.report);
        assert!(plan.report.missing.is_empty() && plan.report.unexpected.is_empty());
        assert_eq!(plan.load, BTreeSet::from(["fc.weight".to_string(), "fc.bias".to_string()]));
    }

    #[test]
    fn an_fp8_only_weight_needs_its_codes_and_scale_inv() {
        let m = [param("w", DType::E4M3, &[16, 16], true)];
        let ok = file(&[("w", Dtype::F8_E4M3, &[16, 16]), ("w.scale_inv", Dtype::F32, &[1])]);
        assert!(check(&m, &ok, Some(2)).report.is_clean());
        let plan = check(&m, &file(&[("w", Dtype::F8_E4M3, &[16, 16])]), Some(2));
        assert_eq!(plan.report.missing, ["w.scale_inv"]);
        let plan = check(&m, &file(&[("w", Dtype::BF16, &[16, 16]), ("w.scale_inv", Dtype::F32, &[1])]), Some(2));
        assert_eq!(plan.report.mismatched, ["w (file BF16 [16, 16], model F8_E4M3 [16, 16])"]);
    }

    /// Format 1 kept an unused `grad_input` slot in each backward state: such a file loads (the
    /// model's slot is the first), a format-2 or foreign file of that shape mismatches.
    #[test]
    fn a_format_1_backward_state_with_its_unused_slot_loads() {
        let mut f = full_file();
        f.insert("fc.fp8_bwd.amax_history".into(), (Dtype::F32, vec![2, 16]));
        f.insert("fc.fp8_bwd.scale".into(), (Dtype::F32, vec![2]));
        f.insert("fc.fp8_bwd.scale_inv".into(), (Dtype::F32, vec![2]));
        let plan = check(&model(), &f, Some(1));
        assert!(plan.report.is_clean(), "{}", plan.report);
        assert_eq!(plan.load.len(), 4);
        for version in [Some(2), None] {
            let plan = check(&model(), &f, version);
            assert_eq!(plan.report.mismatched.len(), 3, "{}", plan.report);
        }
        // A forward state keeps its slot count in every version.
        f.insert("fc.fp8_fwd.amax_history".into(), (Dtype::F32, vec![2, 16]));
        assert_eq!(check(&model(), &f, Some(1)).report.mismatched.len(), 1);
    }

    #[test]
    fn a_state_file_entry_without_a_model_slot_is_unexpected() {
        let f = full_file();
        let plan = check(&model()[..2], &f, Some(2));
        assert_eq!(plan.report.unexpected.len(), 6, "{}", plan.report);
    }
}
