//! `Linear` on the GPU against the CPU reference (`te_reference::linear`): FP8 with
//! delayed and current scaling, the high-precision path, scale updates through autocast scopes,
//! wgrad fusion into `main_grad`, the micro-batch weight cache, FP8-only inference weights and
//! the typed errors.

use crate::common::{amax, assert_close, bf16, device, randn, upload};
use te_nn::fp8::{
    fp8_autocast, fp8_model_init, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Float8Tensor, Format,
    Fp8Autocast, Recipe,
};
use te_nn::modules::{BackwardOptions, ForwardOptions, Linear, LinearConfig, Output};
use te_reference::block_scaling::{dequantize_blockwise, quantize_blockwise, BlockParams, BlockTiling};
use te_reference::linear::{self as reference, rel_frobenius, Fp8Step};
use te_reference::scaling::current_scale;
use te_runtime::{DType, Device, Error, Tensor};

/// tokens, in_features, out_features: multiples of 16, not of the GEMM tiles.
const T: usize = 112;
const IN: usize = 80;
const OUT: usize = 144;

struct Data {
    x: Vec<f32>,
    dy: Vec<f32>,
    w: Vec<f32>,
    b: Vec<f32>,
}

/// A layer with a random bias and bf16-rounded host copies of its parameters and data.
fn layer(dev: &std::sync::Arc<Device>, cfg: LinearConfig, seed: u64) -> (Linear, Data) {
    let mut lin = Linear::new(dev, cfg.clone()).unwrap();
    let w = lin.params().weight().unwrap().to_f32(dev).unwrap();
    let b = bf16(&randn(seed + 3, cfg.out_features, 0.5));
    if cfg.bias {
        lin.params_mut().set_bias(Tensor::from_f32(dev, DType::BF16, &[cfg.out_features], &b).unwrap()).unwrap();
    }
    let x = bf16(&randn(seed + 1, T * cfg.in_features, 1.0));
    let dy = bf16(&randn(seed + 2, T * cfg.out_features, 1e-2));
    (lin, Data { x, dy, w, b })
}

/// One fwd+bwd step; returns (y, dx) on the host.
fn step(dev: &Device, lin: &mut Linear, d: &Data) -> (Vec<f32>, Vec<f32>) {
    let x = upload(dev, &d.x, &[T, lin.config().in_features]);
    let (y, ctx) = lin.forward(&x).unwrap();
    let dy = upload(dev, &d.dy, &[T, lin.config().out_features]);
    let dx = lin.backward(ctx, &dy).unwrap();
    (y.to_f32(dev).unwrap(), dx.to_f32(dev).unwrap())
}

/// GPU result vs the reference computed on the same quantized operands: TE's bound on the
/// relative Frobenius error and the E4M3 elementwise tolerances (scaled by the magnitude for the
/// tiny gradients).
fn check(what: &str, got: &[f32], want: &[f32]) {
    let e = rel_frobenius(got, want);
    assert!(e < 1e-2, "{what}: relative Frobenius error {e}");
    assert_close(what, got, want, 0.125, 0.0675 * amax(want).min(1.0));
}

#[test]
fn fp8_delayed_scaling_matches_reference_and_updates_scales() {
    let Some(dev) = device() else { return };
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 10);
    let recipe = DelayedScaling { amax_history_len: 16, ..Default::default() };
    // Step 1 runs with the initial scales (1) and records the amaxes.
    fp8_autocast(true, recipe, || Ok(step(&dev, &mut lin, &d))).unwrap();
    let fwd = lin.fp8_forward_state().unwrap().snapshot().unwrap();
    let bwd = lin.fp8_backward_state().unwrap().snapshot().unwrap();
    // The scope exit and the backward each updated their state (TE: scale = fp8_max / amax).
    assert_eq!(fwd.scale[0], 448.0 / amax(&d.x), "input scale");
    assert_eq!(fwd.scale[1], 448.0 / amax(&d.w), "weight scale");
    assert_eq!(fwd.scale[2], 1.0, "output slot unused: scale kept");
    assert_eq!(bwd.scale[0], 57344.0 / amax(&d.dy), "grad_output scale (E5M2 under HYBRID)");
    assert_eq!(fwd.amax_history[15], amax(&d.x), "history rolled: the amax moved to the back");
    lin.params_mut().zero_grad();
    // Step 2 casts with those scales: compare with the reference at the same scales.
    let (y, dx) = fp8_autocast(true, recipe, || Ok(step(&dev, &mut lin, &d))).unwrap();
    let s = Fp8Step { input: fwd.scale[0], weight: fwd.scale[1], grad_output: bwd.scale[0], grad_dtype: DType::E5M2 };
    check("y", &y, &reference::forward(&d.x, &d.w, Some(&d.b), T, Some(&s)));
    let g = reference::backward(&d.dy, &d.x, &d.w, T, Some(&s));
    check("dx", &dx, &g.dx);
    check("dw", &lin.params().weight_grad().unwrap().to_f32(&dev).unwrap(), &g.dw);
    assert_close("dbias", &lin.params().bias_grad().unwrap().to_f32(&dev).unwrap(), &g.dbias, 1.6e-2, 1e-5);
}

#[test]
fn fp8_current_scaling_matches_reference() {
    let Some(dev) = device() else { return };
    for format in [Format::Hybrid, Format::E4M3] {
        let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 20);
        let recipe = Float8CurrentScaling { fp8_format: format, ..Default::default() };
        let (y, dx) = fp8_autocast(true, recipe, || Ok(step(&dev, &mut lin, &d))).unwrap();
        let gd = format.backward_dtype();
        let sc = |v: &[f32], dt: DType| current_scale(amax(v), dt.fp8_max().unwrap(), 0.0, false).0;
        let s = Fp8Step {
            input: sc(&d.x, DType::E4M3),
            weight: sc(&d.w, DType::E4M3),
            grad_output: sc(&d.dy, gd),
            grad_dtype: gd,
        };
        check("y", &y, &reference::forward(&d.x, &d.w, Some(&d.b), T, Some(&s)));
        let g = reference::backward(&d.dy, &d.x, &d.w, T, Some(&s));
        check("dx", &dx, &g.dx);
        check("dw", &lin.params().weight_grad().unwrap().to_f32(&dev).unwrap(), &g.dw);
        assert!(lin.fp8_forward_state().is_none(), "current scaling keeps no state");
    }
}

/// Float8BlockScaling (TE's defaults: 1×128 tiles of x and dy, 128×128 blocks of W, E4M3 both
/// ways) against the reference on the same blockwise-quantized operands: fprop `x(1×128) ·
/// W(128×128)ᵀ`, dgrad `dy(1×128) · W`, wgrad `dy(128×1)ᵀ · x(128×1)` (the transposed
/// operands quantized again from the high-precision values), dbias from the unquantized `dy`.
/// Sizes not multiples of 128; a second step with a cached weight (micro-batches) too.
#[test]
fn fp8_block_scaling_matches_reference() {
    let Some(dev) = device() else { return };
    const IN_B: usize = 272;
    const OUT_B: usize = 400;
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN_B, OUT_B), 25);
    let recipe = Float8BlockScaling::default();
    let run = |lin: &mut Linear, first: Option<bool>| {
        fp8_autocast(true, recipe, || {
            lin.params_mut().zero_grad();
            let x = upload(&dev, &d.x, &[T, IN_B]);
            let opts = ForwardOptions { is_first_microbatch: first, ..Default::default() };
            let (y, ctx) = lin.forward_with(&x, opts)?;
            let dx = lin.backward(ctx, &upload(&dev, &d.dy, &[T, OUT_B]))?;
            Ok((y.into_high(&dev, DType::BF16)?.to_f32(&dev)?, dx.to_f32(&dev)?))
        })
        .unwrap()
    };
    let p = BlockParams::te_default(DType::BF16);
    let dq = |v: &[f32], r, c, t| dequantize_blockwise(&quantize_blockwise(v, r, c, t, &p), r, c, t, DType::E4M3);
    let (xr, xc) = (dq(&d.x, T, IN_B, BlockTiling::Rows), dq(&d.x, T, IN_B, BlockTiling::Columns));
    let (dyr, dyc) = (dq(&d.dy, T, OUT_B, BlockTiling::Rows), dq(&d.dy, T, OUT_B, BlockTiling::Columns));
    let w = dq(&d.w, OUT_B, IN_B, BlockTiling::Square);
    for first in [None, Some(true), Some(false)] {
        let (y, dx) = run(&mut lin, first);
        check("block y", &y, &reference::forward(&xr, &w, Some(&d.b), T, None));
        check("block dx", &dx, &reference::backward(&dyr, &xr, &w, T, None).dx);
        let dw = lin.params().weight_grad().unwrap().to_f32(&dev).unwrap();
        check("block dw", &dw, &reference::backward(&dyc, &xc, &w, T, None).dw);
        let db = lin.params().bias_grad().unwrap().to_f32(&dev).unwrap();
        let want = reference::backward(&d.dy, &d.x, &d.w, T, None).dbias;
        assert_close("block dbias", &db, &want, 1.6e-2, 1e-2 * amax(&want));
    }
    assert!(lin.fp8_forward_state().is_none() && lin.fp8_backward_state().is_none(), "no amax history");

    // f32 activations are not cast blockwise: a typed error that says what to use.
    let cfg = LinearConfig { params_dtype: DType::F32, ..LinearConfig::new(IN_B, OUT_B) };
    let mut lin32 = Linear::new(&dev, cfg).unwrap();
    let x32 = Tensor::from_f32(&dev, DType::F32, &[T, IN_B], &d.x).unwrap();
    let e = fp8_autocast(true, recipe, || lin32.forward(&x32).map(|_| ())).unwrap_err();
    assert!(matches!(e, Error::DType { .. }) && e.to_string().contains("params_dtype bf16"), "{e}");
    // A 2D × 2D recipe is refused before any GEMM.
    let bad = Float8BlockScaling { x_block_scaling_dim: 2, ..recipe };
    let e = fp8_autocast(true, bad, || lin.forward(&upload(&dev, &d.x, &[T, IN_B])).map(|_| ())).unwrap_err();
    assert!(matches!(e, Error::Recipe { .. }), "{e}");
}

#[test]
fn high_precision_path_matches_reference() {
    let Some(dev) = device() else { return };
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 30);
    let (y, dx) = step(&dev, &mut lin, &d);
    let want = reference::forward(&d.x, &d.w, Some(&d.b), T, None);
    assert_close("y", &y, &want, 1.6e-2, 1e-2 * amax(&want));
    let g = reference::backward(&d.dy, &d.x, &d.w, T, None);
    assert_close("dx", &dx, &g.dx, 1.6e-2, 1e-2 * amax(&g.dx));
    let dw = lin.params().weight_grad().unwrap().to_f32(&dev).unwrap();
    assert_close("dw", &dw, &g.dw, 1.6e-2, 1e-2 * amax(&g.dw));
    let db = lin.params().bias_grad().unwrap().to_f32(&dev).unwrap();
    assert_close("dbias", &db, &g.dbias, 1.6e-2, 1e-2 * amax(&g.dbias));
    // A second backward accumulates.
    step(&dev, &mut lin, &d);
    let dw2 = lin.params().weight_grad().unwrap().to_f32(&dev).unwrap();
    let twice: Vec<f32> = g.dw.iter().map(|v| 2.0 * v).collect();
    assert_close("dw accumulated", &dw2, &twice, 3.2e-2, 2e-2 * amax(&twice));
}

#[test]
fn fused_wgrad_accumulates_into_main_grad() {
    let Some(dev) = device() else { return };
    let cfg = LinearConfig { fuse_wgrad_accumulation: true, ..LinearConfig::new(IN, OUT) };
    let (mut lin, d) = layer(&dev, cfg, 40);
    let (x, dy) = (upload(&dev, &d.x, &[T, IN]), upload(&dev, &d.dy, &[T, OUT]));
    let (_, ctx) = lin.forward(&x).unwrap();
    assert!(matches!(lin.backward(ctx, &dy), Err(Error::Config { .. })), "no main_grad handed in");
    let init = randn(41, OUT * IN, 1e-3);
    lin.params_mut().set_main_grad(Tensor::from_f32(&dev, DType::F32, &[OUT, IN], &init).unwrap()).unwrap();
    let recipe = Float8CurrentScaling::default();
    for _ in 0..2 {
        fp8_autocast(true, recipe, || Ok(step(&dev, &mut lin, &d))).unwrap();
    }
    assert!(lin.params().weight_grad().is_none(), "wgrad went to main_grad");
    let s = |v: &[f32], dt: DType| current_scale(amax(v), dt.fp8_max().unwrap(), 0.0, false).0;
    let st = Fp8Step {
        input: s(&d.x, DType::E4M3),
        weight: s(&d.w, DType::E4M3),
        grad_output: s(&d.dy, DType::E5M2),
        grad_dtype: DType::E5M2,
    };
    let dw = reference::backward(&d.dy, &d.x, &d.w, T, Some(&st)).dw;
    let want: Vec<f32> = init.iter().zip(&dw).map(|(i, g)| i + 2.0 * g).collect();
    let got = lin.params_mut().take_main_grad().unwrap().to_f32(&dev).unwrap();
    assert!(rel_frobenius(&got, &want) < 1e-2, "main_grad error {}", rel_frobenius(&got, &want));
}

#[test]
fn microbatch_cache_reuses_the_fp8_weight() {
    let Some(dev) = device() else { return };
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 50);
    let x = upload(&dev, &d.x, &[T, IN]);
    let recipe = Recipe::from(Float8CurrentScaling::default());
    let run = |lin: &mut Linear, first: Option<bool>| {
        fp8_autocast(true, recipe, || {
            let opts = ForwardOptions { is_first_microbatch: first, ..Default::default() };
            let (y, _ctx) = lin.forward_with(&x, opts)?;
            y.into_high(&dev, DType::BF16)?.to_f32(&dev)
        })
        .unwrap()
    };
    let bf16_bytes = lin.params().parameter_bytes();
    let y1 = run(&mut lin, Some(true));
    assert!(lin.params().parameter_bytes() > bf16_bytes, "the FP8 weight is cached");
    // Changing the weight in place of the cache is ignored until the next first micro-batch.
    let w2 = Tensor::from_f32(&dev, DType::BF16, &[OUT, IN], &randn(51, OUT * IN, 0.05)).unwrap();
    let cached = run(&mut lin, Some(false));
    assert_eq!(y1, cached, "Some(false) reuses the cached cast");
    lin.params_mut().set_weight(w2).unwrap();
    assert_eq!(lin.params().parameter_bytes(), bf16_bytes, "set_weight drops the cache");
    let y3 = run(&mut lin, Some(false));
    assert_ne!(y1, y3, "a stale cache is never used");
}

#[test]
fn fp8_output_and_return_bias() {
    let Some(dev) = device() else { return };
    let cfg = LinearConfig { return_bias: true, ..LinearConfig::new(IN, OUT) };
    let (mut lin, d) = layer(&dev, cfg, 60);
    let x = upload(&dev, &d.x, &[T, IN]);
    let recipe = DelayedScaling::default();
    // Two steps so that the output slot has a scale from its amax.
    let mut last = None;
    for _ in 0..2 {
        last = Some(
            fp8_autocast(true, recipe, || {
                let (y, _) = lin.forward_with(&x, ForwardOptions { fp8_output: true, ..Default::default() })?;
                Ok(y)
            })
            .unwrap(),
        );
    }
    let Some(Output::Fp8(y8)) = last else { panic!("fp8_output gives an FP8 output") };
    assert_eq!(y8.dtype(), DType::E4M3);
    let fwd = lin.fp8_forward_state().unwrap().snapshot().unwrap();
    let s = Fp8Step { input: fwd.scale[0], weight: fwd.scale[1], grad_output: 1.0, grad_dtype: DType::E5M2 };
    // return_bias: the bias is not added.
    let want = reference::forward(&d.x, &d.w, None, T, Some(&s));
    let got = y8.to_f32(&dev).unwrap();
    let e = rel_frobenius(&got, &want);
    assert!(e < 0.05, "FP8 output error {e} (E4M3 rounding of the output included)");
    assert_close("y fp8", &got, &want, 0.125, 0.0675);
}

#[test]
fn fp8_model_init_weights_take_one_byte_per_parameter() {
    let Some(dev) = device() else { return };
    let (n_in, n_out) = (1024, 2048);
    let cfg = LinearConfig::new(n_in, n_out);
    let bf16_layer = Linear::new(&dev, cfg.clone()).unwrap();
    let mut fp8_layer = fp8_model_init(true, || Linear::new(&dev, cfg.clone())).unwrap();
    assert!(fp8_layer.params().weight().is_none() && fp8_layer.params().fp8_weight().is_some());
    let x = Tensor::from_f32(&dev, DType::BF16, &[100, n_in], &bf16(&randn(70, 100 * n_in, 1.0))).unwrap();
    let y = fp8_autocast(true, DelayedScaling::default(), || fp8_layer.infer(&x)).unwrap();
    assert_eq!(y.shape(), &[100, n_out], "inference takes any token count");
    assert!(fp8_layer.params().fp8_weight().unwrap().transpose().is_none(), "inference builds no transpose");
    let ratio = fp8_layer.params().parameter_bytes() as f64 / bf16_layer.params().parameter_bytes() as f64;
    assert!(ratio <= 0.52, "FP8 inference weights take {ratio:.3} of BF16");
    // Same init seed: the FP8 weight is the BF16 weight cast with its own amax.
    let w = bf16_layer.params().weight().unwrap().to_f32(&dev).unwrap();
    let w8 = fp8_layer.params().fp8_weight().unwrap().to_f32(&dev).unwrap();
    assert_close("fp8 weight", &w8, &w, 0.125, 0.0675 * amax(&w));
}

#[test]
fn bulk_update_covers_every_module_of_the_scope() {
    let Some(dev) = device() else { return };
    let (mut a, d) = layer(&dev, LinearConfig::new(IN, OUT), 80);
    let (mut b, _) = layer(&dev, LinearConfig::new(OUT, IN), 81);
    let x = upload(&dev, &d.x, &[T, IN]);
    let guard = Fp8Autocast::new(DelayedScaling::default()).enter().unwrap();
    let (h, ctx_a) = a.forward(&x).unwrap();
    let (_, ctx_b) = b.forward(&h).unwrap();
    let inner = fp8_autocast(true, DelayedScaling::default(), || a.fp8_forward_state().unwrap().snapshot());
    assert_eq!(inner.unwrap().scale[0], 1.0, "an inner scope's exit updates nothing");
    guard.exit().unwrap();
    for (name, l) in [("a", &a), ("b", &b)] {
        let s = l.fp8_forward_state().unwrap().snapshot().unwrap();
        assert!(s.scale[0] != 1.0 && s.scale[1] != 1.0, "{name}: forward scales updated at the outermost exit");
    }
    // Backward scales update when the last context of the scope is used.
    let g = upload(&dev, &vec![1e-3; T * IN], &[T, IN]);
    let dh = b.backward(ctx_b, &g).unwrap();
    assert_eq!(a.fp8_backward_state().unwrap().snapshot().unwrap().scale[0], 1.0, "a's context is pending");
    a.backward_with(ctx_a, &dh, BackwardOptions { input_grad: false, ..Default::default() }).unwrap();
    for (name, l) in [("a", &a), ("b", &b)] {
        let s = l.fp8_backward_state().unwrap().snapshot().unwrap();
        assert_ne!(s.scale[0], 1.0, "{name}: backward scale updated after the group's last backward");
    }
}

#[test]
fn amax_edge_cases_give_te_scales() {
    let Some(dev) = device() else { return };
    // (input fill, expected input scale after one step): 0 keeps 1; a tiny amax overflows the
    // scale to FLT_MAX; inf keeps 1; NaN is skipped by the amax (the other values decide).
    let cases: [(&[f32], f32); 4] =
        [(&[0.0], 1.0), (&[1e-37], f32::MAX), (&[f32::INFINITY, 1.0], 1.0), (&[f32::NAN, 2.0], 224.0)];
    for (fill, want) in cases {
        let (mut lin, _) = layer(&dev, LinearConfig::new(IN, OUT), 90);
        let xs: Vec<f32> = (0..T * IN).map(|i| fill[i % fill.len()]).collect();
        let x = upload(&dev, &xs, &[T, IN]);
        fp8_autocast(true, DelayedScaling::default(), || lin.infer(&x).map(|_| ())).unwrap();
        let s = lin.fp8_forward_state().unwrap().snapshot().unwrap();
        assert_eq!(s.scale[0], want, "input {fill:?}");
        assert!(s.scale.iter().chain(&s.scale_inv).all(|v| !v.is_nan()), "no NaN scale for {fill:?}");
    }
}

#[test]
fn errors_are_typed_and_say_what_to_do() {
    let Some(dev) = device() else { return };
    let recipe = DelayedScaling::default();
    // A dim that FP8 GEMMs cannot take names itself and what to pad to.
    let mut odd = Linear::new(&dev, LinearConfig::new(100, 64)).unwrap();
    let x = Tensor::zeros(&dev, DType::BF16, &[32, 100]).unwrap();
    let e = fp8_autocast(true, recipe, || odd.forward(&x).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("in_features = 100") && e.to_string().contains("pad it to 112"), "{e}");
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 100);
    let x = Tensor::zeros(&dev, DType::BF16, &[50, IN]).unwrap();
    let e = fp8_autocast(true, recipe, || lin.forward(&x).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("tokens") && e.to_string().contains("pad it to 64"), "{e}");
    // Wrong input width, wrong grad_output shape, wrong dtype.
    let bad = Tensor::zeros(&dev, DType::BF16, &[T, IN + 16]).unwrap();
    assert!(matches!(lin.forward(&bad), Err(Error::Shape { .. })));
    let x = upload(&dev, &d.x, &[T, IN]);
    let (_, ctx) = lin.forward(&x).unwrap();
    assert!(matches!(lin.backward(ctx, &x), Err(Error::Shape { .. })));
    let int8 = Tensor::zeros(&dev, DType::E4M3, &[T, IN]).unwrap();
    assert!(matches!(lin.forward(&int8), Err(Error::DType { .. })));
    // A context of another module, and a stale one.
    let (mut other, _) = layer(&dev, LinearConfig::new(IN, OUT), 101);
    let dy = Tensor::zeros(&dev, DType::BF16, &[T, OUT]).unwrap();
    let (_, ctx) = lin.forward(&x).unwrap();
    assert!(matches!(other.backward(ctx, &dy), Err(Error::Context { .. })));
    let (_, ctx) = lin.forward(&x).unwrap();
    let w = lin.params().weight().unwrap().clone();
    lin.params_mut().set_weight(w).unwrap();
    let e = lin.backward(ctx, &dy).unwrap_err();
    assert!(matches!(e, Error::Context { .. }) && e.to_string().contains("stale"), "{e}");
    // Bad configurations.
    assert!(matches!(Linear::new(&dev, LinearConfig::new(0, 8)), Err(Error::Config { .. })));
    let f8 = LinearConfig { params_dtype: DType::E4M3, ..LinearConfig::new(16, 16) };
    assert!(matches!(Linear::new(&dev, f8), Err(Error::Config { .. })));
    let e = fp8_model_init(true, || Linear::new(&dev, LinearConfig::new(24, 16))).unwrap_err();
    assert!(e.to_string().contains("pad it to 32"), "{e}");
}

#[test]
fn calibration_runs_high_precision_and_records_amax() {
    let Some(dev) = device() else { return };
    let (mut lin, d) = layer(&dev, LinearConfig::new(IN, OUT), 110);
    let x = upload(&dev, &d.x, &[T, IN]);
    let high = lin.infer(&x).unwrap().to_f32(&dev).unwrap();
    let calib = Fp8Autocast::calibrating(DelayedScaling::default());
    let y = calib.run(|| lin.infer(&x)).unwrap().to_f32(&dev).unwrap();
    assert_eq!(y, high, "calibration computes in high precision");
    let s = lin.fp8_forward_state().unwrap().snapshot().unwrap();
    assert_eq!((s.scale[0], s.scale[1]), (448.0 / amax(&d.x), 448.0 / amax(&d.w)), "scales from the recorded amaxes");
    // The calibrated scales serve the FP8 inference that follows.
    let y8 = fp8_autocast(true, DelayedScaling::default(), || lin.infer(&x)).unwrap().to_f32(&dev).unwrap();
    let st = Fp8Step { input: s.scale[0], weight: s.scale[1], grad_output: 1.0, grad_dtype: DType::E5M2 };
    check("y after calibration", &y8, &reference::forward(&d.x, &d.w, Some(&d.b), T, Some(&st)));
}

/// `backward_fp8` from an output gradient cast outside the layer (E5M2 codes with their
/// transpose and scale) gives exactly what `backward` gives when its own cast uses the same
/// scale (the first delayed-scaling step's: 1): dgrad and wgrad bit for bit; and it refuses a
/// high-precision forward, a layer with a bias and a gradient without its transpose.
#[test]
fn backward_fp8_takes_a_gradient_cast_outside_the_layer() {
    let Some(dev) = device() else { return };
    let cfg = LinearConfig { bias: false, ..LinearConfig::new(IN, OUT) };
    let (mut a, d) = layer(&dev, cfg.clone(), 40);
    let (mut b, _) = layer(&dev, cfg, 40);
    let x = upload(&dev, &d.x, &[T, IN]);
    let dy = upload(&dev, &d.dy, &[T, OUT]);
    let (dx_a, dx_b) = fp8_autocast(true, DelayedScaling::default(), || {
        let (_, ca) = a.forward(&x)?;
        let (_, cb) = b.forward(&x)?;
        assert!(ca.takes_fp8_grad() && cb.takes_fp8_grad());
        let dx_a = a.backward(ca, &dy)?;
        let dy8 = Float8Tensor::quantize(&dev, &dy, DType::E5M2, 1.0, true)?;
        let dx_b = b.backward_fp8(cb, &dy8, DType::BF16)?;
        Ok((dx_a.to_f32(&dev)?, dx_b.to_f32(&dev)?))
    })
    .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&dx_a), bits(&dx_b), "dgrad");
    let wgrad = |l: &Linear| l.params().weight_grad().unwrap().to_f32(&dev).unwrap();
    assert_eq!(bits(&wgrad(&a)), bits(&wgrad(&b)), "wgrad");
    assert!(dx_b.iter().any(|&v| v != 0.0), "a gradient flowed");

    let dy8 = Float8Tensor::quantize(&dev, &dy, DType::E5M2, 1.0, true).unwrap();
    let (_, high) = b.forward(&x).unwrap();
    assert!(!high.takes_fp8_grad());
    let e = b.backward_fp8(high, &dy8, DType::BF16).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("high-precision grad_output"), "{e}");
    let no_t = Float8Tensor::quantize(&dev, &dy, DType::E5M2, 1.0, false).unwrap();
    let e = fp8_autocast(true, DelayedScaling::default(), || {
        let (_, c) = b.forward(&x)?;
        b.backward_fp8(c, &no_t, DType::BF16)
    })
    .unwrap_err();
    assert!(e.to_string().contains("transpose"), "{e}");
    let (mut biased, _) = layer(&dev, LinearConfig::new(IN, OUT), 41);
    let e = fp8_autocast(true, DelayedScaling::default(), || {
        let (_, c) = biased.forward(&x)?;
        biased.backward_fp8(c, &dy8, DType::BF16)
    })
    .unwrap_err();
    assert!(e.to_string().contains("bias"), "{e}");
}
