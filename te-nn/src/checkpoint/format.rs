//! The file format: tensor names, dtypes, the `__metadata__` header, and parsing a file's bytes
//! into typed errors.

use super::{LoadOptions, SaveOptions};
use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use te_codegen::DType;
use te_runtime::{Error, Result};

/// `__metadata__` key naming this library's checkpoint format (value [`FORMAT_NAME`]).
pub const FORMAT_KEY: &str = "te_format";
/// The value of [`FORMAT_KEY`].
pub const FORMAT_NAME: &str = "te-rs-checkpoint";
/// `__metadata__` key of the format version (value [`FORMAT_VERSION`]).
pub const FORMAT_VERSION_KEY: &str = "te_format_version";
/// Version of the format written; a file of a newer version is refused.
///
/// - 2: backward scaling states (`*.fp8_bwd`) hold one slot, the output gradient's.
/// - 1: backward scaling states held a second slot (TE's `grad_input`) that nothing wrote; a
///   version-1 file loads into version 2 by dropping it.
pub const FORMAT_VERSION: u32 = 2;
/// Slots of a backward scaling state in a format-1 file (grad_output and an unused grad_input).
pub(crate) const V1_BWD_SLOTS: usize = 2;
/// `__metadata__` key of the version of the library that wrote the file.
pub const LIBRARY_VERSION_KEY: &str = "te_version";
/// `__metadata__` key of the FP8 recipe the model was trained with (`te_nn::fp8::Recipe::name`;
/// absent for a file saved without one).
pub const RECIPE_KEY: &str = "te_fp8_recipe";

/// Suffixes of the three f32 tensors of a scaling state at `path`: `path.amax_history`
/// `[n, history_len]`, `path.scale` `[n]`, `path.scale_inv` `[n]`.
pub const STATE_SUFFIXES: [&str; 3] = ["amax_history", "scale", "scale_inv"];

/// The names of the three tensors of the scaling state at `path` (see [`STATE_SUFFIXES`]).
pub fn state_tensor_names(path: &str) -> [String; 3] {
    STATE_SUFFIXES.map(|s| format!("{path}.{s}"))
}

/// The name of the f32 `[1]` `scale_inv` stored next to the E4M3 codes of an FP8-only weight
/// at `path`.
pub fn fp8_scale_inv_name(path: &str) -> String {
    format!("{path}.scale_inv")
}

/// The safetensors dtype of `dtype` (FP8 as `F8_E4M3` / `F8_E5M2`).
pub fn to_safetensors(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::BF16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::E4M3 => Dtype::F8_E4M3,
        DType::E5M2 => Dtype::F8_E5M2,
    }
}

/// The dtype of a safetensors `dtype`; `None` for one this library has no tensors of.
pub fn from_safetensors(dtype: Dtype) -> Option<DType> {
    match dtype {
        Dtype::F32 => Some(DType::F32),
        Dtype::BF16 => Some(DType::BF16),
        Dtype::F16 => Some(DType::F16),
        Dtype::F8_E4M3 => Some(DType::E4M3),
        Dtype::F8_E5M2 => Some(DType::E5M2),
        _ => None,
    }
}

/// The `__metadata__` of a file written with `user` entries: the format name and version and
/// the library version, then the user's.
///
/// # Errors
/// [`Error::Checkpoint`] when a user key is one of the reserved keys.
pub fn build_metadata(options: &SaveOptions) -> Result<HashMap<String, String>> {
    let user = &options.metadata;
    let reserved = [FORMAT_KEY, FORMAT_VERSION_KEY, LIBRARY_VERSION_KEY, RECIPE_KEY];
    if let Some(k) = user.keys().find(|k| reserved.contains(&k.as_str())) {
        return Err(Error::Checkpoint { message: format!("metadata key `{k}` is reserved ({reserved:?})") });
    }
    let mut meta: HashMap<String, String> = user.clone().into_iter().collect();
    if let Some(r) = &options.recipe {
        meta.insert(RECIPE_KEY.into(), r.name().into());
    }
    meta.insert(FORMAT_KEY.into(), FORMAT_NAME.into());
    meta.insert(FORMAT_VERSION_KEY.into(), FORMAT_VERSION.to_string());
    meta.insert(LIBRARY_VERSION_KEY.into(), env!("CARGO_PKG_VERSION").into());
    Ok(meta)
}

/// Accepts a file's `__metadata__`: absent or foreign (a checkpoint from elsewhere: `None`) or
/// of a format version up to [`FORMAT_VERSION`] (returned).
///
/// # Errors
/// [`Error::Checkpoint`] for a newer or unreadable format version.
pub fn check_metadata(meta: Option<&HashMap<String, String>>, path: &Path) -> Result<Option<u32>> {
    let Some(v) = meta.and_then(|m| m.get(FORMAT_VERSION_KEY)) else { return Ok(None) };
    match v.parse::<u32>() {
        Ok(v) if v <= FORMAT_VERSION => Ok(Some(v)),
        _ => Err(Error::Checkpoint {
            message: format!(
                "{}: checkpoint format version `{v}`; this library reads versions up to {FORMAT_VERSION}",
                path.display()
            ),
        }),
    }
}

/// Whether a file of `meta` loads as an explicit recipe conversion: `Ok(false)` when the file's
/// recorded recipe ([`RECIPE_KEY`]) and the one `options` expects agree, or either is unknown;
/// `Ok(true)` when they differ and `options.convert_recipe` asks for the conversion (the file's
/// FP8 scaling states are then not loaded).
///
/// # Errors
/// [`Error::Checkpoint`] naming both recipes when they differ without `convert_recipe`.
pub fn check_recipe(meta: Option<&HashMap<String, String>>, options: &LoadOptions, path: &Path) -> Result<bool> {
    let (Some(file), Some(want)) = (meta.and_then(|m| m.get(RECIPE_KEY)), options.recipe) else { return Ok(false) };
    if file == want.name() {
        return Ok(false);
    }
    if options.convert_recipe {
        return Ok(true);
    }
    Err(Error::Checkpoint {
        message: format!(
            "{}: trained with the FP8 recipe {file}, and the model will run {}: its FP8 scaling states belong to \
             {file}. Load with LoadOptions {{ recipe: Some({file}), .. }}, or convert explicitly with \
             convert_recipe: true (the weights load, the FP8 states start fresh)",
            path.display(),
            want.name()
        ),
    })
}

/// Leaves the tensors of the model's scaling states (`states`: their paths) out of a file's
/// tensor list (an explicit recipe conversion loads the weights only).
pub(crate) fn drop_state_tensors<'a>(
    states: impl IntoIterator<Item = &'a str>,
    infos: &mut BTreeMap<String, (Dtype, Vec<usize>)>,
) {
    for path in states {
        for name in state_tensor_names(path) {
            infos.remove(&name);
        }
    }
}

/// Parses the whole bytes of a safetensors file (header size, header JSON, tensor offsets and
/// the file length are all checked).
///
/// # Errors
/// [`Error::Checkpoint`] naming `path` for a truncated or corrupt file.
pub fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| Error::Checkpoint {
        message: format!("{}: not a complete safetensors file (truncated or corrupt): {e}", path.display()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

        /// A checkpoint file mutated on disk (bytes flipped, cut short, grown, or random bytes)
        /// parses, or is refused with a typed checkpoint error naming the file; its metadata check
        /// likewise. Never a panic (reliability issue's fuzzing of the checkpoint loader).
        #[test]
        fn mutated_files_are_parsed_or_refused(m in crate::checkpoint::fuzz::mutation()) {
            let data = m.apply(file_bytes());
            let path = Path::new("fuzzed.safetensors");
            match parse(&data, path) {
                Ok(_) => {
                    if let Ok((_, meta)) = SafeTensors::read_metadata(&data) {
                        if let Err(e) = check_metadata(meta.metadata().as_ref(), path) {
                            prop_assert!(matches!(e, Error::Checkpoint { .. }), "{e}");
                        }
                    }
                }
                Err(e) => prop_assert!(matches!(&e, Error::Checkpoint { message } if message.contains("fuzzed")), "{e}"),
            }
        }
    }

    fn file_bytes() -> Vec<u8> {
        let data = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let view = safetensors::tensor::TensorView::new(Dtype::F32, vec![2], &data).unwrap();
        let meta = build_metadata(&SaveOptions::default()).unwrap();
        safetensors::serialize([("w", &view)], Some(meta)).unwrap()
    }

    #[test]
    fn names_of_state_tensors_and_fp8_scale_inv() {
        assert_eq!(
            state_tensor_names("layers.0.mlp.fc1_fp8_fwd"),
            [
                "layers.0.mlp.fc1_fp8_fwd.amax_history",
                "layers.0.mlp.fc1_fp8_fwd.scale",
                "layers.0.mlp.fc1_fp8_fwd.scale_inv"
            ]
        );
        assert_eq!(fp8_scale_inv_name("head.weight"), "head.weight.scale_inv");
    }

    #[test]
    fn dtypes_round_trip() {
        for d in DType::ALL {
            assert_eq!(from_safetensors(to_safetensors(d)), Some(d));
        }
        assert_eq!(to_safetensors(DType::E4M3), Dtype::F8_E4M3);
        assert_eq!(from_safetensors(Dtype::I64), None);
    }

    #[test]
    fn metadata_has_format_and_versions_and_refuses_reserved_keys() {
        let user = BTreeMap::from([("step".to_string(), "12".to_string())]);
        let meta = build_metadata(&SaveOptions { metadata: user, recipe: None }).unwrap();
        assert_eq!(meta[FORMAT_KEY], FORMAT_NAME);
        assert_eq!(meta[FORMAT_VERSION_KEY], FORMAT_VERSION.to_string());
        assert_eq!(meta[LIBRARY_VERSION_KEY], env!("CARGO_PKG_VERSION"));
        assert_eq!(meta["step"], "12");
        let bad = BTreeMap::from([(FORMAT_VERSION_KEY.to_string(), "0".to_string())]);
        assert!(matches!(build_metadata(&SaveOptions { metadata: bad, recipe: None }), Err(Error::Checkpoint { .. })));
    }

    #[test]
    fn metadata_versions_accepted_and_refused() {
        let p = Path::new("x.safetensors");
        assert_eq!(check_metadata(None, p).unwrap(), None);
        let foreign = HashMap::from([("format".to_string(), "pt".to_string())]);
        assert_eq!(check_metadata(Some(&foreign), p).unwrap(), None);
        let v = |s: &str| HashMap::from([(FORMAT_VERSION_KEY.to_string(), s.to_string())]);
        assert_eq!(check_metadata(Some(&v("1")), p).unwrap(), Some(1));
        assert_eq!(check_metadata(Some(&v("2")), p).unwrap(), Some(2));
        for bad in ["3", "x", ""] {
            let e = check_metadata(Some(&v(bad)), p).unwrap_err();
            assert!(matches!(&e, Error::Checkpoint { message } if message.contains("x.safetensors")), "{e}");
        }
    }

    #[test]
    fn a_complete_file_parses() {
        let bytes = file_bytes();
        let st = parse(&bytes, Path::new("ok")).unwrap();
        assert_eq!(st.names(), ["w"]);
        let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()[FORMAT_KEY], FORMAT_NAME);
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = file_bytes();
        for n in 0..bytes.len() {
            let e = parse(&bytes[..n], Path::new("cut.safetensors")).unwrap_err();
            assert!(matches!(&e, Error::Checkpoint { message } if message.contains("cut.safetensors")), "{n}: {e}");
        }
    }

    #[test]
    fn corrupt_headers_are_errors() {
        let good = file_bytes();
        // A header size past the end, a huge one, and garbage in the JSON.
        let mut past = good.clone();
        past[..8].copy_from_slice(&(good.len() as u64).to_le_bytes());
        let mut huge = good.clone();
        huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let mut garbage = good.clone();
        garbage[9] = b'#';
        let mut extra = good.clone();
        extra.push(0);
        for (what, bytes) in [("past", past), ("huge", huge), ("garbage", garbage), ("extra byte", extra)] {
            assert!(matches!(parse(&bytes, Path::new("c")), Err(Error::Checkpoint { .. })), "{what}");
        }
    }
}
