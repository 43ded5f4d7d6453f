//! Checkpoint loading on host mock modules (no GPU): strict errors listing every missing,
//! unexpected and mismatched tensor, the non-strict report, truncated and corrupt files, newer
//! format versions, and a failed save leaving the previous file intact.

// Test code: a panic (unwrap, expect) is how a test reports a failure.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::Path;
use te_nn::checkpoint::format::{FORMAT_VERSION, FORMAT_VERSION_KEY};
use te_nn::checkpoint::{load, save, LoadOptions, LoadReport, SaveOptions};
use te_nn::modules::{join_path, ModuleVisitor, ModuleVisitorMut, Param, ParamKind, ParamMut};
use te_nn::Module;
use te_runtime::{DType, Error, Result, Tensor};

/// A bf16 parameter of a shape, without device storage; counts writes.
#[derive(Debug)]
struct HostParam {
    shape: Vec<usize>,
    writes: usize,
}

impl Param for HostParam {
    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn dtype(&self) -> DType {
        DType::BF16
    }

    fn tensor(&self) -> Option<&Tensor> {
        None
    }

    fn grad(&self) -> Option<&Tensor> {
        None
    }
}

impl ParamMut for HostParam {
    fn set(&mut self, _: Tensor) -> Result<()> {
        self.writes += 1;
        Ok(())
    }

    fn zero_grad(&mut self) {}
}

/// `weight [32, 16]` and `bias [32]`.
struct Mock {
    weight: HostParam,
    bias: HostParam,
}

fn mock() -> Mock {
    Mock { weight: HostParam { shape: vec![32, 16], writes: 0 }, bias: HostParam { shape: vec![32], writes: 0 } }
}

impl Module for Mock {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visitor.param(&join_path(prefix, "weight"), ParamKind::Weight, &self.weight)?;
        visitor.param(&join_path(prefix, "bias"), ParamKind::Bias, &self.bias)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visitor.param(&join_path(prefix, "weight"), ParamKind::Weight, &mut self.weight)?;
        visitor.param(&join_path(prefix, "bias"), ParamKind::Bias, &mut self.bias)
    }
}

/// Writes a safetensors file of zero-filled tensors `(name, dtype, shape)` with `meta`.
fn write(path: &Path, tensors: &[(&str, Dtype, &[usize])], meta: Option<HashMap<String, String>>) {
    let bytes: Vec<Vec<u8>> =
        tensors.iter().map(|(_, d, s)| vec![0u8; s.iter().product::<usize>() * d.bitsize() / 8]).collect();
    let views: Vec<(&str, TensorView<'_>)> =
        tensors.iter().zip(&bytes).map(|((n, d, s), b)| (*n, TensorView::new(*d, s.to_vec(), b).unwrap())).collect();
    std::fs::write(path, safetensors::serialize(views, meta).unwrap()).unwrap();
}

fn message(e: Error) -> String {
    match e {
        Error::Checkpoint { message } => message,
        other => panic!("expected Error::Checkpoint, got {other:?}"),
    }
}

#[test]
fn strict_load_lists_everything_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    write(
        &path,
        &[("m.weight", Dtype::BF16, &[16, 32]), ("m.extra", Dtype::F32, &[2]), ("m.fp8_fwd.scale", Dtype::F32, &[3])],
        None,
    );
    let mut m = mock();
    let msg = message(load(&mut Prefixed(&mut m), &path, &LoadOptions::default()).unwrap_err());
    for name in ["missing: m.bias", "m.extra", "m.fp8_fwd.scale", "m.weight (file BF16 [16, 32], model BF16 [32, 16])"]
    {
        assert!(msg.contains(name), "{name} not in: {msg}");
    }
    assert_eq!((m.weight.writes, m.bias.writes), (0, 0));
}

#[test]
fn non_strict_load_reports() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    write(&path, &[("m.weight", Dtype::BF16, &[32, 16]), ("m.head.weight", Dtype::BF16, &[8])], None);
    let mut m = mock();
    let report = load(&mut Prefixed(&mut m), &path, &LoadOptions { strict: false, ..LoadOptions::default() }).unwrap();
    let want =
        LoadReport { missing: vec!["m.bias".into()], unexpected: vec!["m.head.weight".into()], mismatched: vec![] };
    assert_eq!(report, want);
}

#[test]
fn truncated_corrupt_and_absent_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    write(&path, &[("m.weight", Dtype::BF16, &[32, 16]), ("m.bias", Dtype::BF16, &[32])], None);
    let full = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.safetensors");
    for n in [0, 4, 8, 20, full.len() / 2, full.len() - 1] {
        std::fs::write(&cut, &full[..n]).unwrap();
        let msg = message(load(&mut Prefixed(&mut mock()), &cut, &LoadOptions::default()).unwrap_err());
        assert!(msg.contains("cut.safetensors") && msg.contains("truncated or corrupt"), "{n}: {msg}");
    }
    let mut corrupt = full.clone();
    corrupt[10..20].fill(0xff);
    std::fs::write(&cut, &corrupt).unwrap();
    assert!(matches!(load(&mut Prefixed(&mut mock()), &cut, &LoadOptions::default()), Err(Error::Checkpoint { .. })));
    let absent = dir.path().join("absent.safetensors");
    assert!(matches!(
        load(&mut Prefixed(&mut mock()), &absent, &LoadOptions::default()),
        Err(Error::Checkpoint { .. })
    ));
}

#[test]
fn a_newer_format_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    let meta = HashMap::from([(FORMAT_VERSION_KEY.to_string(), (FORMAT_VERSION + 1).to_string())]);
    write(&path, &[("m.weight", Dtype::BF16, &[32, 16]), ("m.bias", Dtype::BF16, &[32])], Some(meta));
    let msg = message(load(&mut Prefixed(&mut mock()), &path, &LoadOptions::default()).unwrap_err());
    assert!(msg.contains("format version"), "{msg}");
}

#[test]
fn a_failed_save_keeps_the_previous_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.safetensors");
    std::fs::write(&path, b"previous checkpoint").unwrap();
    // The mock's parameters have no device tensor: saving fails before anything is written.
    let msg = message(save(&Prefixed(&mut mock()), &path, &SaveOptions::default()).unwrap_err());
    assert!(msg.contains("m.weight"), "{msg}");
    assert_eq!(std::fs::read(&path).unwrap(), b"previous checkpoint");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

/// The mock under the path `m` (a model's field).
struct Prefixed<'a>(&'a mut Mock);

impl Module for Prefixed<'_> {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        self.0.visit(&join_path(prefix, "m"), visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        self.0.visit_mut(&join_path(prefix, "m"), visitor)
    }
}
