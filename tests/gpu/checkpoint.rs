//! Checkpoints of a `#[derive(Module)]` model on the GPU: save → load → continue is bit for bit
//! never stopping (weights and FP8 scaling states restored, into a fresh model without state);
//! a BF16 checkpoint without FP8 state loads and trains in FP8; strict errors and the
//! non-strict report name the tensors; FP8-only weights round-trip; truncated files fail.

use crate::common::{assert_bits_eq, device, randn, Fp8States};
use std::sync::Arc;
use te_nn::checkpoint::{load, save, LoadOptions, LoadReport, SaveOptions};
use te_nn::fp8::{fp8_autocast, fp8_model_init, DelayedScaling};
use te_nn::modules::{
    LayerNormLinear, LayerNormLinearConfig, LayerNormMLP, LayerNormMLPConfig, Linear, LinearConfig, Norm, NormConfig,
    Param, ParamKind, ParamMut,
};
use te_nn::Module;
use te_runtime::{DType, Device, Error, Result, Tensor};

const T: usize = 32;
const H: usize = 64;
const F: usize = 128;

#[derive(Module)]
struct Block {
    qkv: LayerNormLinear,
    mlp: LayerNormMLP,
}

#[derive(Module)]
struct Model {
    layers: Vec<Block>,
    final_norm: Norm,
    head: Linear,
}

/// A model of `layers` blocks and a head of `vocab` outputs, initialized from `seed`.
fn model(dev: &Arc<Device>, layers: usize, vocab: usize, seed: u64) -> Model {
    let block = |i: usize| Block {
        qkv: LayerNormLinear::new(
            dev,
            LayerNormLinearConfig { bias: false, seed: seed + 10 * i as u64, ..LayerNormLinearConfig::new(H, 3 * H) },
        )
        .unwrap(),
        mlp: LayerNormMLP::new(
            dev,
            LayerNormMLPConfig { seed: seed + 10 * i as u64 + 1, ..LayerNormMLPConfig::new(H, F) },
        )
        .unwrap(),
    };
    Model {
        layers: (0..layers).map(block).collect(),
        final_norm: Norm::layer_norm(dev, NormConfig::new(H)).unwrap(),
        head: Linear::new(dev, LinearConfig { seed: seed + 99, ..LinearConfig::new(H, vocab) }).unwrap(),
    }
}

fn recipe() -> DelayedScaling {
    DelayedScaling { amax_history_len: 4, ..Default::default() }
}

/// One training step on input `seed`: forward and backward of every layer (each output and
/// every gradient appended to `trace` as bytes), then SGD `w -= 0.5 · g` and `zero_grad`.
fn step(dev: &Device, m: &mut Model, seed: u64, trace: &mut Vec<(String, Vec<u8>)>) -> Result<()> {
    let x = Tensor::from_f32(dev, DType::BF16, &[T, H], &randn(seed, T * H, 1.0))?;
    let dy = |n: usize, s: u64| Tensor::from_f32(dev, DType::BF16, &[T, n], &randn(seed * 7 + s, T * n, 1e-1));
    for (i, b) in m.layers.iter_mut().enumerate() {
        let (y, ctx) = b.qkv.forward(&x)?;
        trace.push((format!("layers.{i}.qkv out"), y.to_bytes(dev)?));
        b.qkv.backward(ctx, &dy(3 * H, 1)?)?;
        let (y, ctx) = b.mlp.forward(&x)?;
        trace.push((format!("layers.{i}.mlp out"), y.to_bytes(dev)?));
        b.mlp.backward(ctx, &dy(H, 2)?)?;
    }
    let (y, ctx) = m.final_norm.forward(&x)?;
    m.final_norm.backward(ctx, &dy(H, 3)?)?;
    let (logits, ctx) = m.head.forward(&y)?;
    trace.push(("head out".into(), logits.to_bytes(dev)?));
    m.head.backward(ctx, &dy(logits.shape()[1], 4)?)?;
    m.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
        let (Some(w), Some(g)) = (p.tensor(), p.grad()) else { return Ok(()) };
        trace.push((format!("{path} grad"), g.to_bytes(dev)?));
        let (w32, g32) = (w.to_f32(dev)?, g.to_f32(dev)?);
        let new: Vec<f32> = w32.iter().zip(&g32).map(|(w, g)| w - 0.5 * g).collect();
        let (dtype, shape) = (p.dtype(), p.shape().to_vec());
        p.set(Tensor::from_f32(dev, dtype, &shape, &new)?)
    })?;
    m.zero_grad();
    Ok(())
}

/// `steps` FP8 steps (delayed scaling) on inputs `first..`, returning the trace.
fn train_fp8(dev: &Device, m: &mut Model, first: u64, steps: u64) -> Vec<(String, Vec<u8>)> {
    let mut trace = Vec::new();
    for s in first..first + steps {
        fp8_autocast(true, recipe(), || step(dev, m, s, &mut trace)).unwrap();
    }
    trace
}

/// Every parameter's bytes by path.
fn weights(dev: &Device, m: &Model) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        out.push((path.to_owned(), p.tensor().unwrap().to_bytes(dev)?));
        Ok(())
    })
    .unwrap();
    out
}

fn states(m: &Model) -> Vec<(String, te_nn::fp8::ScalingSnapshot)> {
    let mut s = Fp8States::default();
    m.visit("", &mut s).unwrap();
    s.0.into_iter().map(|(p, st)| (p, st.snapshot().unwrap())).collect()
}

fn assert_traces_eq(got: &[(String, Vec<u8>)], want: &[(String, Vec<u8>)]) {
    assert_eq!(got.len(), want.len());
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn);
        assert_bits_eq(gn, g, w);
    }
}

#[test]
fn save_load_continue_is_bit_identical_to_never_stopping() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let mut a = model(&dev, 2, F, 0);
    train_fp8(&dev, &mut a, 1, 2);
    save(&a, &path, &SaveOptions::default()).unwrap();

    let mut b = model(&dev, 2, F, 1000);
    assert_ne!(weights(&dev, &a), weights(&dev, &b), "another seed, other weights");
    assert!(states(&b).is_empty(), "a fresh model has no FP8 state");
    let report = load(&mut b, &path, &LoadOptions::default()).unwrap();
    assert_eq!(report, LoadReport::default());
    assert_eq!(weights(&dev, &b), weights(&dev, &a));
    let (sa, sb) = (states(&a), states(&b));
    assert_eq!(sa.len(), 14, "qkv, fc1, fc2 of 2 layers and the head, forward and backward");
    assert_eq!(sb, sa, "FP8 states restored exactly, also where the model had none");

    let ta = train_fp8(&dev, &mut a, 3, 2);
    let tb = train_fp8(&dev, &mut b, 3, 2);
    assert_traces_eq(&tb, &ta);
    assert_eq!(weights(&dev, &b), weights(&dev, &a));
    assert_eq!(states(&b), states(&a));
}

#[test]
fn file_holds_weights_and_fp8_state_as_named_tensors() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let mut a = model(&dev, 1, F, 0);
    train_fp8(&dev, &mut a, 1, 1);
    let opts = SaveOptions { metadata: [("step".to_string(), "1".to_string())].into(), ..SaveOptions::default() };
    save(&a, &path, &opts).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("layers.0.mlp.fc1_weight").unwrap();
    assert_eq!((t.dtype(), t.shape()), (safetensors::Dtype::BF16, &[F, H][..]));
    let t = st.tensor("head.fp8_fwd.amax_history").unwrap();
    assert_eq!((t.dtype(), t.shape()), (safetensors::Dtype::F32, &[3, 4][..]));
    assert_eq!(st.tensor("head.fp8_bwd.scale").unwrap().shape(), [1]);
    assert_eq!(st.tensor("layers.0.qkv.fp8_fwd.scale_inv").unwrap().shape(), [3]);
    let snap = &states(&a).into_iter().find(|(p, _)| p == "head.fp8_fwd").unwrap().1;
    let scale: Vec<f32> = st
        .tensor("head.fp8_fwd.scale")
        .unwrap()
        .data()
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(scale, snap.scale);
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    assert_eq!(meta["te_format_version"], "2");
    assert_eq!(meta["step"], "1");
}

/// A file of format version 1, whose backward states held a second, never-written `grad_input`
/// slot, loads: the states are the file's first slots, and training continues as from the
/// version-2 file of the same model.
#[test]
fn a_format_1_checkpoint_loads_without_its_unused_grad_input_slot() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (v2, v1) = (dir.path().join("v2.safetensors"), dir.path().join("v1.safetensors"));
    let mut a = model(&dev, 1, F, 0);
    train_fp8(&dev, &mut a, 1, 2);
    save(&a, &v2, &SaveOptions::default()).unwrap();

    // The same checkpoint as format 1 wrote it: each `*fp8_bwd.*` gains the second slot (a zero
    // history row, scale and scale_inv 1).
    let bytes = std::fs::read(&v2).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        let (mut shape, mut data) = (t.shape().to_vec(), t.data().to_vec());
        if name.contains("fp8_bwd.") {
            let pad: f32 = if name.ends_with(".amax_history") { 0.0 } else { 1.0 };
            let row = shape.get(1).copied().unwrap_or(1);
            data.extend(std::iter::repeat_n(pad.to_le_bytes(), row).flatten());
            shape[0] = 2;
        }
        tensors.push((name, t.dtype(), shape, data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = std::collections::HashMap::from([("te_format_version".to_string(), "1".to_string())]);
    std::fs::write(&v1, safetensors::serialize(views, Some(meta)).unwrap()).unwrap();

    let mut b = model(&dev, 1, F, 1000);
    assert_eq!(load(&mut b, &v1, &LoadOptions::default()).unwrap(), LoadReport::default());
    assert_eq!(states(&b), states(&a));
    assert_traces_eq(&train_fp8(&dev, &mut b, 3, 2), &train_fp8(&dev, &mut a, 3, 2));
}

#[test]
fn a_bf16_checkpoint_loads_with_fresh_fp8_state_and_trains_in_fp8() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bf16.safetensors");
    let mut a = model(&dev, 1, F, 0);
    step(&dev, &mut a, 1, &mut Vec::new()).unwrap();
    save(&a, &path, &SaveOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let names = safetensors::SafeTensors::deserialize(&bytes).unwrap().names().len();
    assert_eq!(names, a.named_parameters().len(), "no FP8 state in a BF16 checkpoint");

    // Into a fresh model (strict: FP8 state is optional), and into one with trained FP8 state,
    // which is reset to fresh.
    let mut b = model(&dev, 1, F, 1000);
    assert!(load(&mut b, &path, &LoadOptions::default()).unwrap() == LoadReport::default());
    let mut c = model(&dev, 1, F, 2000);
    train_fp8(&dev, &mut c, 5, 2);
    load(&mut c, &path, &LoadOptions::default()).unwrap();
    for (p, s) in states(&c) {
        assert!(s.amax_history.iter().all(|&x| x == 0.0) && s.scale.iter().all(|&x| x == 1.0), "{p} not fresh");
    }
    let ta = train_fp8(&dev, &mut a, 2, 2);
    let tb = train_fp8(&dev, &mut b, 2, 2);
    let tc = train_fp8(&dev, &mut c, 2, 2);
    assert_traces_eq(&tb, &ta);
    assert_traces_eq(&tc, &ta);
}

/// A checkpoint records the recipe it was trained with; loading it for another recipe is a
/// typed error naming both, or an explicit conversion: the weights load, the FP8 states start
/// fresh (a model with trained states has them reset).
#[test]
fn another_recipe_is_refused_or_converted_explicitly() {
    use te_nn::fp8::{Float8BlockScaling, Recipe};
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("delayed.safetensors");
    let mut a = model(&dev, 1, F, 0);
    train_fp8(&dev, &mut a, 1, 2);
    let delayed = Recipe::from(recipe());
    save(&a, &path, &SaveOptions { recipe: Some(delayed), ..SaveOptions::default() }).unwrap();
    let mut b = model(&dev, 1, F, 3000);
    train_fp8(&dev, &mut b, 7, 1);
    let block = LoadOptions { recipe: Some(Float8BlockScaling::default().into()), ..LoadOptions::default() };
    let e = load(&mut b, &path, &block).unwrap_err().to_string();
    assert!(e.contains("DelayedScaling") && e.contains("Float8BlockScaling"), "{e}");
    assert_ne!(weights(&dev, &b), weights(&dev, &a), "a refused load changes nothing");
    load(&mut b, &path, &LoadOptions { convert_recipe: true, ..block }).unwrap();
    assert_eq!(weights(&dev, &b), weights(&dev, &a));
    for (p, s) in states(&b) {
        assert!(s.amax_history.iter().all(|&x| x == 0.0) && s.scale.iter().all(|&x| x == 1.0), "{p} not fresh");
    }
    // The same recipe loads the states too.
    let mut c = model(&dev, 1, F, 4000);
    load(&mut c, &path, &LoadOptions { recipe: Some(delayed), ..LoadOptions::default() }).unwrap();
    assert_eq!(states(&c).len(), states(&a).len());
}

#[test]
fn strict_errors_and_the_non_strict_report_name_the_tensors() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("two.safetensors");
    let mut a = model(&dev, 2, F, 0);
    train_fp8(&dev, &mut a, 1, 1);
    save(&a, &path, &SaveOptions::default()).unwrap();

    // One layer and a wider head: layers.1.* unexpected, head mismatched.
    let mut b = model(&dev, 1, 2 * F, 1000);
    let before = weights(&dev, &b);
    let Err(Error::Checkpoint { message }) = load(&mut b, &path, &LoadOptions::default()) else {
        panic!("strict load of a mismatching file must fail")
    };
    for name in ["layers.1.qkv.weight", "layers.1.mlp.fc2_fp8_bwd.amax_history", "head.weight (file BF16 [128, 64]"] {
        assert!(message.contains(name), "{name} not in: {message}");
    }
    assert_eq!(weights(&dev, &b), before, "a failed strict load changes nothing");

    let report = load(&mut b, &path, &LoadOptions { strict: false, ..LoadOptions::default() }).unwrap();
    assert!(report.missing.is_empty(), "{report}");
    assert!(report.unexpected.iter().any(|n| n == "layers.1.mlp.fc1_weight"), "{report}");
    assert!(report.mismatched.iter().any(|n| n.starts_with("head.bias ")), "{report}");
    let (wa, wb) = (weights(&dev, &a), weights(&dev, &b));
    for (p, w) in wb.iter().filter(|(p, _)| p.starts_with("layers.0.")) {
        assert_eq!(Some(w), wa.iter().find(|(q, _)| q == p).map(|(_, w)| w), "{p} loaded");
    }

    // Two layers from a one-layer file: layers.1.* missing.
    let one = dir.path().join("one.safetensors");
    save(&model(&dev, 1, F, 0), &one, &SaveOptions::default()).unwrap();
    let report =
        load(&mut model(&dev, 2, F, 0), &one, &LoadOptions { strict: false, ..LoadOptions::default() }).unwrap();
    assert!(report.missing.iter().any(|n| n == "layers.1.mlp.fc2_bias") && report.unexpected.is_empty(), "{report}");
}

#[test]
fn fp8_only_weights_round_trip_as_codes_and_scale_inv() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fp8.safetensors");
    let a = fp8_model_init(true, || Linear::new(&dev, LinearConfig::new(H, F))).unwrap();
    save(&a, &path, &SaveOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(st.tensor("weight").unwrap().dtype(), safetensors::Dtype::F8_E4M3);
    assert_eq!(st.tensor("weight.scale_inv").unwrap().shape(), [1]);

    let mut b =
        fp8_model_init(true, || Linear::new(&dev, LinearConfig { seed: 5, ..LinearConfig::new(H, F) })).unwrap();
    let v0 = b.params().version();
    load(&mut b, &path, &LoadOptions::default()).unwrap();
    let (wa, wb) = (a.params().fp8_weight().unwrap(), b.params().fp8_weight().unwrap());
    assert_bits_eq("codes", &wb.to_bytes(&dev).unwrap(), &wa.to_bytes(&dev).unwrap());
    assert_eq!(wb.scale_inv_host(&dev).unwrap(), wa.scale_inv_host(&dev).unwrap());
    assert!(b.params().version() > v0, "a loaded weight bumps the version");

    // A high-precision model cannot take FP8 codes: a mismatch, named.
    let mut c = Linear::new(&dev, LinearConfig::new(H, F)).unwrap();
    let report = load(&mut c, &path, &LoadOptions { strict: false, ..LoadOptions::default() }).unwrap();
    assert_eq!(report.unexpected, ["weight.scale_inv"], "{report}");
    assert!(report.mismatched[0].starts_with("weight (file F8_E4M3 [128, 64], model BF16"), "{report}");
}

#[test]
fn a_truncated_checkpoint_is_an_error() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let a = model(&dev, 1, F, 0);
    save(&a, &path, &SaveOptions::default()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    let r = load(&mut model(&dev, 1, F, 1), &path, &LoadOptions::default());
    assert!(matches!(r, Err(Error::Checkpoint { ref message }) if message.contains("truncated")), "{r:?}");
}
