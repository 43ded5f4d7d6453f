//! `#[derive(Module)]` over TE's layers: TE's state-dict names and shapes, gradients seen and
//! dropped through the traversal, weights written through `visit_mut`, the FP8 scaling states
//! under their paths (snapshot and restore), and FP8-only weights.

use crate::common::{device, randn, Fp8States};
use std::sync::Arc;
use te_nn::fp8::{fp8_autocast, fp8_model_init, DelayedScaling, ScalingSnapshot};
use te_nn::modules::{
    Activation, LayerNormLinear, LayerNormLinearConfig, LayerNormMLP, LayerNormMLPConfig, Linear, LinearConfig, Norm,
    NormConfig, Param, ParamKind, ParamMut,
};
use te_nn::Module;
use te_runtime::{DType, Device, Result, Tensor};

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
    final_norm: Option<Norm>,
    rms: Norm,
    head: Linear,
    #[module(skip)]
    hidden: usize,
}

fn model(dev: &Arc<Device>) -> Model {
    let block = |seed| Block {
        qkv: LayerNormLinear::new(dev, LayerNormLinearConfig { bias: false, ..LayerNormLinearConfig::new(H, 3 * H) })
            .unwrap(),
        mlp: LayerNormMLP::new(
            dev,
            LayerNormMLPConfig { activation: Activation::Swiglu, seed, ..LayerNormMLPConfig::new(H, F) },
        )
        .unwrap(),
    };
    Model {
        layers: (0..2).map(block).collect(),
        final_norm: Some(Norm::layer_norm(dev, NormConfig::new(H)).unwrap()),
        rms: Norm::rms_norm(dev, NormConfig::new(H)).unwrap(),
        head: Linear::new(dev, LinearConfig::new(H, F)).unwrap(),
        hidden: H,
    }
}

/// One bf16 (or FP8, inside an autocast) forward and backward of every layer on its own input.
fn step(dev: &Device, m: &mut Model) -> Result<()> {
    let x = Tensor::from_f32(dev, DType::BF16, &[T, H], &randn(1, T * H, 1.0))?;
    for b in &mut m.layers {
        let (y, ctx) = b.qkv.forward(&x)?;
        b.qkv.backward(ctx, &Tensor::from_f32(dev, DType::BF16, y.shape(), &randn(2, y.numel(), 1e-2))?)?;
        let (y, ctx) = b.mlp.forward(&x)?;
        b.mlp.backward(ctx, &Tensor::from_f32(dev, DType::BF16, y.shape(), &randn(3, y.numel(), 1e-2))?)?;
    }
    for n in m.final_norm.iter_mut().chain([&mut m.rms]) {
        let (y, ctx) = n.forward(&x)?;
        n.backward(ctx, &y)?;
    }
    let (y, ctx) = m.head.forward(&x)?;
    m.head.backward(ctx, &y)?;
    Ok(())
}

#[test]
fn te_state_dict_names_shapes_and_kinds() {
    let Some(dev) = device() else { return };
    let m = model(&dev);
    assert_eq!(m.hidden, H);
    let named: Vec<_> = m.named_parameters().into_iter().map(|p| (p.path, p.shape, p.kind)).collect();
    let p = |path: &str, shape: &[usize], kind| (path.to_string(), shape.to_vec(), kind);
    use ParamKind::*;
    let mut want = Vec::new();
    for i in 0..2 {
        let l = |name: &str| format!("layers.{i}.{name}");
        want.extend([
            p(&l("qkv.layer_norm_weight"), &[H], NormWeight),
            p(&l("qkv.layer_norm_bias"), &[H], NormBias),
            p(&l("qkv.weight"), &[3 * H, H], Weight),
            p(&l("mlp.layer_norm_weight"), &[H], NormWeight),
            p(&l("mlp.layer_norm_bias"), &[H], NormBias),
            p(&l("mlp.fc1_weight"), &[2 * F, H], Weight),
            p(&l("mlp.fc1_bias"), &[2 * F], Bias),
            p(&l("mlp.fc2_weight"), &[H, F], Weight),
            p(&l("mlp.fc2_bias"), &[H], Bias),
        ]);
    }
    want.extend([
        p("final_norm.weight", &[H], NormWeight),
        p("final_norm.bias", &[H], NormBias),
        p("rms.weight", &[H], NormWeight),
        p("head.weight", &[F, H], Weight),
        p("head.bias", &[F], Bias),
    ]);
    assert_eq!(named, want);
    let total: usize = want.iter().map(|(_, s, _)| s.iter().product::<usize>()).sum();
    assert_eq!(m.num_parameters(), total);
    assert!(m.named_parameters().iter().all(|p| p.dtype == DType::BF16));
}

#[test]
fn gradients_are_seen_and_dropped_through_the_traversal() {
    let Some(dev) = device() else { return };
    let mut m = model(&dev);
    step(&dev, &mut m).unwrap();
    let mut with_grad = Vec::new();
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        if let Some(g) = p.grad() {
            assert_eq!(g.shape(), p.shape(), "{path}");
            with_grad.push(path.to_owned());
        }
        Ok(())
    })
    .unwrap();
    assert_eq!(with_grad.len(), m.named_parameters().len(), "{with_grad:?}");

    m.zero_grad();
    assert!(m.head.params().weight_grad().is_none() && m.head.params().bias_grad().is_none());
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        assert!(p.grad().is_none(), "{path} still has a gradient");
        Ok(())
    })
    .unwrap();
}

#[test]
fn visit_mut_writes_every_parameter() {
    let Some(dev) = device() else { return };
    let mut m = model(&dev);
    let v0 = m.layers[1].mlp.fc2().version();
    m.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
        let shape = p.shape().to_vec();
        let n = shape.iter().product();
        p.set(Tensor::from_f32(&dev, p.dtype(), &shape, &vec![0.5; n])?)
    })
    .unwrap();
    assert_eq!(m.layers[1].mlp.fc2().version(), v0 + 2, "weight and bias each bump the version");
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        let host = p.tensor().unwrap().to_f32(&dev)?;
        assert!(host.iter().all(|&x| x == 0.5), "{path}");
        Ok(())
    })
    .unwrap();

    let wrong = Tensor::zeros(&dev, DType::BF16, &[1]).unwrap();
    let r = m.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> { p.set(wrong.clone()) });
    assert!(matches!(r, Err(te_runtime::Error::Shape { .. })), "{r:?}");
}

#[test]
fn fp8_scaling_states_are_visited_by_path_and_restore() {
    let Some(dev) = device() else { return };
    let mut m = model(&dev);
    let mut before = Fp8States::default();
    m.visit("", &mut before).unwrap();
    assert!(before.0.is_empty(), "no state before an FP8 forward");

    let recipe = DelayedScaling { amax_history_len: 4, ..Default::default() };
    fp8_autocast(true, recipe, || step(&dev, &mut m)).unwrap();
    let mut states = Fp8States::default();
    m.visit("", &mut states).unwrap();
    let paths: Vec<&str> = states.0.iter().map(|(p, _)| p.as_str()).collect();
    let mut want = Vec::new();
    for l in 0..2 {
        for name in
            ["qkv.fp8_fwd", "qkv.fp8_bwd", "mlp.fc1_fp8_fwd", "mlp.fc1_fp8_bwd", "mlp.fc2_fp8_fwd", "mlp.fc2_fp8_bwd"]
        {
            want.push(format!("layers.{l}.{name}"));
        }
    }
    want.extend(["head.fp8_fwd".to_string(), "head.fp8_bwd".to_string()]);
    assert_eq!(paths, want);

    let snaps: Vec<ScalingSnapshot> = states.0.iter().map(|(_, s)| s.snapshot().unwrap()).collect();
    assert!(snaps[want.len() - 2].amax_history.iter().any(|&a| a > 0.0), "the forward recorded amaxes");
    fp8_autocast(true, recipe, || step(&dev, &mut m)).unwrap();
    for ((path, s), snap) in states.0.iter().zip(&snaps) {
        s.restore(snap).unwrap();
        assert_eq!(&s.snapshot().unwrap(), snap, "{path}");
    }
}

#[test]
fn fp8_only_weights_report_e4m3_and_count_elements() {
    let Some(dev) = device() else { return };
    let head = fp8_model_init(true, || Linear::new(&dev, LinearConfig::new(H, F))).unwrap();
    let named = head.named_parameters();
    assert_eq!(
        (named[0].path.as_str(), named[0].dtype, named[0].shape.as_slice()),
        ("weight", DType::E4M3, &[F, H][..])
    );
    assert_eq!(named[1].dtype, DType::BF16);
    assert_eq!(head.num_parameters(), F * H + F);
    head.visit("head", &mut |path: &str, kind: ParamKind, p: &dyn Param| -> Result<()> {
        if kind == ParamKind::Weight {
            assert_eq!(path, "head.weight");
            assert!(p.tensor().is_none() && p.fp8_tensor().is_some());
        }
        Ok(())
    })
    .unwrap();
}
