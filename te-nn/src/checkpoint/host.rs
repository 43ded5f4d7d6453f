//! Checkpoints of host models (the CPU twins of `te_models::cpu`) in the format [`super::save`]
//! writes for device models: the same tensor names, dtypes, scaling-state tensors and
//! `__metadata__`, so that a checkpoint written on one side loads on the other (a `te train
//! --preset tiny` run on the CPU continues or samples on a GPU, and a GPU run samples on the
//! CPU). Models describe what they hold as [`Entry`]s (the list the device loader builds with a
//! visitor) and the file is checked against them by the device loader's own rules.

use super::atomic::{io_error, write_atomic};
use super::format::to_safetensors;
use super::format::{build_metadata, check_metadata, check_recipe, drop_state_tensors, parse, state_tensor_names};
pub use super::load::Entry;
use super::load::{check, state_paths};
use super::{LoadOptions, LoadReport, SaveOptions};
use crate::fp8::ScalingSnapshot;
use safetensors::tensor::TensorView;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use te_codegen::DType;
use te_runtime::numerics::{decode, encode};
use te_runtime::{Error, Result};

/// A parameter of a host model as [`save_host`] writes it: its path, the dtype it is stored in
/// (the values are rounded to it, nearest even), its shape and f32 values (row-major).
#[derive(Debug, Clone, Copy)]
pub struct HostParam<'a> {
    /// Its path in the model.
    pub path: &'a str,
    /// The dtype it is stored in.
    pub dtype: DType,
    /// Its shape.
    pub shape: &'a [usize],
    /// Its values, row-major.
    pub values: &'a [f32],
}

/// What [`load_host`] read: every parameter the plan loaded (decoded to f32), every scaling
/// state (the model's first `slots` slots of the file's), the states the file does not hold
/// (fresh), and what did not match.
#[derive(Debug, Default)]
pub struct HostCheckpoint {
    /// Every parameter loaded, by path, decoded to f32.
    pub params: BTreeMap<String, Vec<f32>>,
    /// Every scaling state loaded, by path.
    pub states: BTreeMap<String, ScalingSnapshot>,
    /// The states the file does not hold (they start fresh).
    pub fresh: BTreeSet<String>,
    /// What did not match.
    pub report: LoadReport,
}

/// Writes `params` and the scaling `states` (`(path, snapshot)`: `<path>.amax_history` `[n,
/// len]`, `.scale`, `.scale_inv` `[n]`) to the safetensors file `path`, atomically, with the
/// metadata of [`super::save`].
///
/// # Errors
/// [`Error::Checkpoint`] for two tensors under one name, values that do not fill their shape, a
/// reserved metadata key, or an I/O failure.
pub fn save_host(
    params: &[HostParam<'_>],
    states: &[(String, ScalingSnapshot)],
    path: &Path,
    options: &SaveOptions,
) -> Result<()> {
    let meta = build_metadata(options)?;
    let mut tensors: Vec<(String, DType, Vec<usize>, Vec<u8>)> = Vec::new();
    for p in params {
        if p.values.len() != p.shape.iter().product::<usize>() {
            return Err(Error::Checkpoint {
                message: format!("{}: {} values do not fill the shape {:?}", p.path, p.values.len(), p.shape),
            });
        }
        tensors.push((p.path.to_owned(), p.dtype, p.shape.to_vec(), encode(p.dtype, p.values)));
    }
    for (state, snap) in states {
        let n = snap.scale.len();
        let [a, s, si] = state_tensor_names(state);
        tensors.push((a, DType::F32, vec![n, snap.history_len], encode(DType::F32, &snap.amax_history)));
        tensors.push((s, DType::F32, vec![n], encode(DType::F32, &snap.scale)));
        tensors.push((si, DType::F32, vec![n], encode(DType::F32, &snap.scale_inv)));
    }
    let mut names = BTreeSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for (name, dtype, shape, bytes) in &tensors {
        if !names.insert(name.as_str()) {
            return Err(Error::Checkpoint { message: format!("two tensors are named `{name}`: paths must be unique") });
        }
        let view = TensorView::new(to_safetensors(*dtype), shape.clone(), bytes)
            .map_err(|e| Error::Checkpoint { message: format!("{name}: {e}") })?;
        views.push((name.as_str(), view));
    }
    write_atomic(path, |tmp| {
        safetensors::serialize_to_file(views, Some(meta), tmp).map_err(|e| io_error(tmp, "cannot write", e))
    })
}

/// Reads the safetensors file `path` for a host model holding `entries` (parameters: path,
/// stored dtype, shape; FP8-only weights are not supported on the host), with the device
/// loader's rules: the same names, dtypes and shapes, scaling states optional (listed in
/// [`HostCheckpoint::fresh`] when the file has none of their tensors), a format-1 backward
/// state's unused slot dropped. Strict loads fail on any mismatch.
///
/// # Errors
/// [`Error::Checkpoint`] for an unreadable, truncated or corrupt file, a newer format version,
/// or (strict) the list of missing, unexpected and mismatched tensors.
pub fn load_host(path: &Path, entries: &[Entry], options: &LoadOptions) -> Result<HostCheckpoint> {
    let bytes = std::fs::read(path).map_err(|e| io_error(path, "cannot read", e))?;
    let file = parse(&bytes, path)?;
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes)
        .map_err(|e| Error::Checkpoint { message: format!("{}: {e}", path.display()) })?;
    let version = check_metadata(header.metadata().as_ref(), path)?;
    let mut infos = file.iter().map(|(name, t)| (name.to_owned(), (t.dtype(), t.shape().to_vec()))).collect();
    if check_recipe(header.metadata().as_ref(), options, path)? {
        drop_state_tensors(state_paths(entries), &mut infos);
    }
    let plan = check(entries, &infos, version);
    if options.strict && !plan.report.is_clean() {
        return Err(Error::Checkpoint {
            message: format!("{}: does not match the model: {}", path.display(), plan.report),
        });
    }
    let tensor = |name: &str| {
        file.tensor(name).map_err(|e| Error::internal("checkpoint::load_host", format!("`{name}` vanished: {e}")))
    };
    let mut out = HostCheckpoint { fresh: plan.fresh.clone(), report: plan.report.clone(), ..Default::default() };
    for e in entries {
        match e {
            Entry::Param { path: p, dtype, .. } if plan.load.contains(p) => {
                out.params.insert(p.clone(), decode(*dtype, tensor(p)?.data()));
            }
            Entry::State { path: p, slots, .. } if plan.load.contains(p) => {
                let [a, s, si] = state_tensor_names(p);
                let history = tensor(&a)?;
                let history_len = history.shape().get(1).copied().unwrap_or(0);
                // The model's slots are the file's first ones (see `check`).
                let first = |v: Vec<f32>, len: usize| v.into_iter().take(slots * len).collect::<Vec<f32>>();
                let snap = ScalingSnapshot {
                    amax_history: first(decode(DType::F32, history.data()), history_len),
                    scale: first(decode(DType::F32, tensor(&s)?.data()), 1),
                    scale_inv: first(decode(DType::F32, tensor(&si)?.data()), 1),
                    history_len,
                };
                out.states.insert(p.clone(), snap);
            }
            _ => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modules::Fp8Direction;

    fn entries() -> Vec<Entry> {
        vec![
            Entry::Param { path: "w".into(), dtype: DType::BF16, shape: vec![2, 3], fp8: false },
            Entry::Param { path: "b".into(), dtype: DType::F32, shape: vec![3], fp8: false },
            Entry::State { path: "fp8_fwd".into(), slots: 3, direction: Fp8Direction::Forward },
            Entry::State { path: "fp8_bwd".into(), slots: 1, direction: Fp8Direction::Backward },
        ]
    }

    /// Parameters come back rounded to their stored dtype, scaling states exactly; a state the
    /// file lacks is fresh.
    #[test]
    fn host_checkpoints_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let w = [0.1f32, -2.0, 3.25, 1e-3, 7.0, -0.5];
        let b = [1.0f32 / 3.0, 2.0, -1.0];
        let snap = ScalingSnapshot {
            amax_history: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            scale: vec![2.0, 4.0, 1.0],
            scale_inv: vec![0.5, 0.25, 1.0],
            history_len: 2,
        };
        let saved = snap.clone();
        let params = [
            HostParam { path: "w", dtype: DType::BF16, shape: &[2, 3], values: &w },
            HostParam { path: "b", dtype: DType::F32, shape: &[3], values: &b },
        ];
        save_host(&params, &[("fp8_fwd".into(), snap)], &path, &SaveOptions::default()).unwrap();
        let ck = load_host(&path, &entries(), &LoadOptions::default()).unwrap();
        let want_w: Vec<f32> = w.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
        assert_eq!(ck.params["w"], want_w);
        assert_eq!(ck.params["b"], b);
        let s = &ck.states["fp8_fwd"];
        assert_eq!(
            (&s.amax_history, &s.scale, &s.scale_inv, s.history_len),
            (&saved.amax_history, &saved.scale, &saved.scale_inv, 2)
        );
        assert_eq!(ck.fresh.iter().collect::<Vec<_>>(), ["fp8_bwd"]);
        assert!(ck.report.is_clean());
    }

    /// A file records the recipe it was saved with; a load expecting another recipe is refused
    /// naming both, or, as an explicit conversion, loads the weights and leaves the scaling
    /// states fresh; without a recorded or an expected recipe nothing is checked.
    #[test]
    fn another_recipe_is_refused_or_converted() {
        use crate::fp8::{DelayedScaling, Float8BlockScaling, Recipe};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let (w, b) = ([0.5f32; 6], [1.0f32; 3]);
        let params = [
            HostParam { path: "w", dtype: DType::BF16, shape: &[2, 3], values: &w },
            HostParam { path: "b", dtype: DType::F32, shape: &[3], values: &b },
        ];
        let snap = ScalingSnapshot {
            amax_history: vec![1.0; 6],
            scale: vec![2.0; 3],
            scale_inv: vec![0.5; 3],
            history_len: 2,
        };
        let delayed = Recipe::from(DelayedScaling::default());
        let saved = SaveOptions { recipe: Some(delayed), ..SaveOptions::default() };
        save_host(&params, &[("fp8_fwd".into(), snap)], &path, &saved).unwrap();
        let block = LoadOptions { recipe: Some(Float8BlockScaling::default().into()), ..LoadOptions::default() };
        let e = load_host(&path, &entries(), &block).unwrap_err().to_string();
        assert!(
            e.contains("DelayedScaling") && e.contains("Float8BlockScaling") && e.contains("convert_recipe"),
            "{e}"
        );
        let ck = load_host(&path, &entries(), &LoadOptions { convert_recipe: true, ..block }).unwrap();
        assert_eq!(ck.params["b"], b);
        assert!(ck.states.is_empty(), "a conversion loads no scaling state");
        assert_eq!(ck.fresh.len(), 2, "both states start fresh: {:?}", ck.fresh);
        // The same recipe, or none expected: the states load.
        for options in [LoadOptions { recipe: Some(delayed), ..LoadOptions::default() }, LoadOptions::default()] {
            assert_eq!(load_host(&path, &entries(), &options).unwrap().states.len(), 1);
        }
    }

    /// Every recipe is recorded under TE's class name (`te_fp8_recipe`, the names existing
    /// checkpoints hold), which the recipe parser reads back; a file loads under its own recipe
    /// and is refused under each other one, naming both.
    #[test]
    fn recipes_are_recorded_under_te_class_names() {
        use super::super::format::RECIPE_KEY;
        use crate::fp8::Recipe;
        let dir = tempfile::tempdir().unwrap();
        let params = [HostParam { path: "b", dtype: DType::F32, shape: &[3], values: &[1.0; 3] }];
        let entries = [Entry::Param { path: "b".into(), dtype: DType::F32, shape: vec![3], fp8: false }];
        let names = ["DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"];
        for (recipe, name) in Recipe::all().into_iter().zip(names) {
            let path = dir.path().join(format!("{name}.safetensors"));
            save_host(&params, &[], &path, &SaveOptions { recipe: Some(recipe), ..SaveOptions::default() }).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
            let recorded = header.metadata().as_ref().unwrap()[RECIPE_KEY].clone();
            assert_eq!(recorded, name);
            assert_eq!(recorded.parse::<Recipe>().unwrap(), recipe);
            for other in Recipe::all() {
                let got = load_host(&path, &entries, &LoadOptions { recipe: Some(other), ..LoadOptions::default() });
                if other == recipe {
                    got.unwrap();
                } else {
                    let e = got.unwrap_err().to_string();
                    let want = format!("trained with the FP8 recipe {name}, and the model will run {}", other.name());
                    assert!(e.contains(&want) && e.contains("convert_recipe: true"), "{e}");
                }
            }
        }
    }

    /// A file of another model is refused with what does not match; values that do not fill
    /// their shape and duplicate names are refused when saving.
    #[test]
    fn mismatches_and_bad_tensors_are_typed_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let params = [HostParam { path: "w", dtype: DType::F32, shape: &[3, 2], values: &[0.0; 6] }];
        save_host(&params, &[], &path, &SaveOptions::default()).unwrap();
        let e = load_host(&path, &entries(), &LoadOptions::default()).unwrap_err().to_string();
        assert!(
            e.contains("does not match the model") && e.contains("missing: b") && e.contains("mismatched: w"),
            "{e}"
        );
        let lenient = load_host(&path, &entries(), &LoadOptions { strict: false, ..LoadOptions::default() }).unwrap();
        assert!(lenient.params.is_empty() && !lenient.report.is_clean());
        let short = [HostParam { path: "w", dtype: DType::F32, shape: &[3, 2], values: &[0.0; 5] }];
        assert!(save_host(&short, &[], &path, &SaveOptions::default()).unwrap_err().to_string().contains("fill"));
        let twice = [params[0], params[0]];
        assert!(save_host(&twice, &[], &path, &SaveOptions::default()).unwrap_err().to_string().contains("unique"));
        let missing = dir.path().join("none.safetensors");
        assert!(matches!(load_host(&missing, &entries(), &LoadOptions::default()), Err(Error::Checkpoint { .. })));
    }
}
