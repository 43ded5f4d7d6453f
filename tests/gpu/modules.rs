//! `LayerNorm`/`RMSNorm`, `LayerNormLinear` and `LayerNormMLP` on the GPU against the exact CPU
//! reference (`te_reference::modules`): BF16 at TE's bf16 tolerances; FP8 with delayed
//! (second step, scales from the first), current and blockwise scaling within bounds of the FP8
//! rounding.

use crate::common::{amax, assert_close, bf16, device, host, randn, upload};
use std::sync::Arc;
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe};
use te_nn::modules::{
    Activation, LayerNormLinear, LayerNormLinearConfig, LayerNormMLP, LayerNormMLPConfig, LinearParams, Norm,
    NormConfig, NormKind, NormParams,
};
use te_reference::linear::rel_frobenius;
use te_reference::modules::{self as reference, DenseRef, NormRef};
use te_runtime::{Device, Error};

const T: usize = 112;
const H: usize = 80;
const F: usize = 144;

/// How a step runs: high precision or FP8 with a recipe.
#[derive(Debug, Clone, Copy)]
enum Mode {
    Bf16,
    Fp8(Recipe),
}

impl Mode {
    fn all() -> [Mode; 4] {
        [
            Mode::Bf16,
            Mode::Fp8(DelayedScaling { amax_history_len: 4, ..Default::default() }.into()),
            Mode::Fp8(Float8CurrentScaling::default().into()),
            Mode::Fp8(Float8BlockScaling::default().into()),
        ]
    }

    fn run<T>(self, f: impl FnOnce() -> te_runtime::Result<T>) -> T {
        match self {
            Mode::Bf16 => f().unwrap(),
            Mode::Fp8(r) => fp8_autocast(true, r, f).unwrap(),
        }
    }

    /// `(forward bound, gradient bound)` on the relative Frobenius error vs exact math: bf16
    /// rounding, or E4M3 operands forward and E5M2 gradients (2 and 3 mantissa bits) backward.
    fn bounds(self) -> (f64, f64) {
        match self {
            Mode::Bf16 => (1e-2, 2e-2),
            Mode::Fp8(_) => (0.06, 0.15),
        }
    }
}

fn check(mode: Mode, what: &str, got: &[f32], want: &[f32], grad: bool) {
    check_frobenius(mode, what, got, want, grad);
    match mode {
        Mode::Bf16 => assert_close(what, got, want, 1.6e-2, 2e-2 * amax(want)),
        Mode::Fp8(_) => assert_close(what, got, want, 0.25, 0.125 * amax(want)),
    }
}

/// The relative Frobenius bound alone: for gradients through ReLU, whose derivative jumps at 0,
/// where a pre-activation that rounds across 0 flips single elements.
fn check_frobenius(mode: Mode, what: &str, got: &[f32], want: &[f32], grad: bool) {
    let (fwd, bwd) = mode.bounds();
    let bound = if grad { bwd } else { fwd };
    let e = rel_frobenius(got, want);
    assert!(e < bound, "{mode:?} {what}: relative Frobenius error {e} (bound {bound})");
}

/// Random gamma (around 1) and beta on a norm; returns their host values.
fn randomize_norm(dev: &Device, p: &mut NormParams, seed: u64) -> (Vec<f32>, Option<Vec<f32>>) {
    let h = p.config().hidden_size;
    let g = bf16(&randn(seed, h, 0.1).iter().map(|v| v + 1.0).collect::<Vec<_>>());
    p.set_weight(upload(dev, &g, &[h])).unwrap();
    let b = p.bias().is_some().then(|| bf16(&randn(seed + 1, h, 0.1)));
    if let Some(b) = &b {
        p.set_bias(upload(dev, b, &[h])).unwrap();
    }
    (g, b)
}

/// Random bias on a GEMM layer; returns host weight and bias.
fn randomize_dense(dev: &Device, p: &mut LinearParams, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let b = bf16(&randn(seed, p.out_features(), 0.1));
    p.set_bias(upload(dev, &b, &[p.out_features()])).unwrap();
    (host(dev, p.weight()), b)
}

#[test]
fn norms_match_reference() {
    let Some(dev) = device() else { return };
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for zcg in [false, true] {
            let cfg = NormConfig { zero_centered_gamma: zcg, ..NormConfig::new(H) };
            let mut norm = Norm::new(&dev, kind, cfg).unwrap();
            let (g, b) = randomize_norm(&dev, norm.params_mut(), 1);
            let x = bf16(&randn(2, T * H, 2.0));
            let dy = bf16(&randn(3, T * H, 1.0));
            let (y, ctx) = norm.forward(&upload(&dev, &x, &[T, H])).unwrap();
            let dx = norm.backward(ctx, &upload(&dev, &dy, &[T, H])).unwrap();
            let r = NormRef { kind, gamma: &g, beta: b.as_deref(), eps: 1e-5, zero_centered_gamma: zcg };
            let what = format!("{kind:?} zero_centered_gamma={zcg}");
            check(Mode::Bf16, &format!("{what} y"), &y.to_f32(&dev).unwrap(), &r.forward(&x), false);
            let (rdx, rdg, rdb) = r.backward(&dy, &x);
            check(Mode::Bf16, &format!("{what} dx"), &dx.to_f32(&dev).unwrap(), &rdx, true);
            check(Mode::Bf16, &format!("{what} dgamma"), &host(&dev, norm.params().weight_grad()), &rdg, true);
            if kind == NormKind::LayerNorm {
                check(Mode::Bf16, &format!("{what} dbeta"), &host(&dev, norm.params().bias_grad()), &rdb, true);
            }
        }
    }
}

#[test]
fn layernorm_linear_matches_reference() {
    let Some(dev) = device() else { return };
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for mode in Mode::all() {
            let cfg = LayerNormLinearConfig { normalization: kind, ..LayerNormLinearConfig::new(H, F) };
            let mut m = LayerNormLinear::new(&dev, cfg).unwrap();
            let (g, b) = randomize_norm(&dev, m.norm_params_mut(), 10);
            let (w, bias) = randomize_dense(&dev, m.params_mut(), 12);
            let x = bf16(&randn(13, T * H, 1.0));
            let dy = bf16(&randn(14, T * F, 1e-2));
            let (xt, dyt) = (upload(&dev, &x, &[T, H]), upload(&dev, &dy, &[T, F]));
            let step = |m: &mut LayerNormLinear| {
                m.norm_params_mut().zero_grad();
                m.params_mut().zero_grad();
                mode.run(|| {
                    let (y, ctx) = m.forward(&xt)?;
                    Ok((y.to_f32(&dev)?, m.backward(ctx, &dyt)?.to_f32(&dev)?))
                })
            };
            step(&mut m); // delayed scaling: the second step runs with scales from the first
            let (y, dx) = step(&mut m);
            let norm = NormRef { kind, gamma: &g, beta: b.as_deref(), eps: 1e-5, zero_centered_gamma: false };
            let fc = DenseRef { w: &w, b: Some(&bias) };
            let what = format!("LayerNormLinear {kind:?}");
            check(mode, &format!("{what} y"), &y, &reference::layernorm_linear_forward(&norm, &fc, &x, T).0, false);
            let r = reference::layernorm_linear_backward(&norm, &fc, &dy, &x, T);
            check(mode, &format!("{what} dx"), &dx, &r.dx, true);
            check(mode, &format!("{what} dgamma"), &host(&dev, m.norm_params().weight_grad()), &r.dgamma, true);
            if kind == NormKind::LayerNorm {
                check(mode, &format!("{what} dbeta"), &host(&dev, m.norm_params().bias_grad()), &r.dbeta, true);
            }
            check(mode, &format!("{what} dw"), &host(&dev, m.params().weight_grad()), &r.dw1, true);
            check(mode, &format!("{what} dbias"), &host(&dev, m.params().bias_grad()), &r.db1, true);
        }
    }
}

#[test]
fn layernorm_linear_returns_the_norm_output() {
    let Some(dev) = device() else { return };
    let cfg = LayerNormLinearConfig { return_layernorm_output: true, ..LayerNormLinearConfig::new(H, F) };
    let mut m = LayerNormLinear::new(&dev, cfg).unwrap();
    let (g, b) = randomize_norm(&dev, m.norm_params_mut(), 20);
    let x = bf16(&randn(21, T * H, 1.0));
    let out = fp8_autocast(true, DelayedScaling::default(), || {
        let (out, _ctx) = m.forward_with(&upload(&dev, &x, &[T, H]), Default::default())?;
        Ok(out)
    })
    .unwrap();
    let norm =
        NormRef { kind: NormKind::LayerNorm, gamma: &g, beta: b.as_deref(), eps: 1e-5, zero_centered_gamma: false };
    check(Mode::Bf16, "ln_out", &out.ln_out.unwrap().to_f32(&dev).unwrap(), &norm.forward(&x), false);
}

#[test]
fn layernorm_mlp_matches_reference() {
    let Some(dev) = device() else { return };
    for act in [Activation::Gelu, Activation::Relu, Activation::Swiglu, Activation::Geglu] {
        for mode in Mode::all() {
            let cfg = LayerNormMLPConfig { activation: act, ..LayerNormMLPConfig::new(H, F) };
            let mut m = LayerNormMLP::new(&dev, cfg).unwrap();
            let (g, b) = randomize_norm(&dev, m.norm_params_mut(), 30);
            let (w1, b1) = randomize_dense(&dev, m.fc1_mut(), 32);
            let (w2, b2) = randomize_dense(&dev, m.fc2_mut(), 33);
            let x = bf16(&randn(34, T * H, 1.0));
            let dy = bf16(&randn(35, T * H, 1e-2));
            let (xt, dyt) = (upload(&dev, &x, &[T, H]), upload(&dev, &dy, &[T, H]));
            let step = |m: &mut LayerNormMLP| {
                m.norm_params_mut().zero_grad();
                m.fc1_mut().zero_grad();
                m.fc2_mut().zero_grad();
                mode.run(|| {
                    let (y, ctx) = m.forward(&xt)?;
                    Ok((y.to_f32(&dev)?, m.backward(ctx, &dyt)?.to_f32(&dev)?))
                })
            };
            step(&mut m);
            let (y, dx) = step(&mut m);
            let norm = NormRef {
                kind: NormKind::LayerNorm,
                gamma: &g,
                beta: b.as_deref(),
                eps: 1e-5,
                zero_centered_gamma: false,
            };
            let (fc1, fc2) = (DenseRef { w: &w1, b: Some(&b1) }, DenseRef { w: &w2, b: Some(&b2) });
            let what = format!("LayerNormMLP {act:?}");
            let want = reference::layernorm_mlp_forward(&norm, &fc1, act, &fc2, &x, T);
            check(mode, &format!("{what} y"), &y, &want, false);
            let r = reference::layernorm_mlp_backward(&norm, &fc1, act, &fc2, &dy, &x, T);
            // ReLU's derivative jumps at 0: pre-activations that round across 0 flip single
            // elements, so ReLU gradients get the Frobenius bound only, widened under FP8.
            let check = |mode: Mode, what: &str, got: &[f32], want: &[f32], grad| match (act, mode) {
                (Activation::Relu, Mode::Fp8(_)) if grad => {
                    let e = rel_frobenius(got, want);
                    assert!(e < 0.25, "{mode:?} {what}: relative Frobenius error {e} (bound 0.25 for ReLU)");
                }
                (Activation::Relu, _) => check_frobenius(mode, what, got, want, grad),
                _ => check(mode, what, got, want, grad),
            };
            check(mode, &format!("{what} dx"), &dx, &r.dx, true);
            check(mode, &format!("{what} dgamma"), &host(&dev, m.norm_params().weight_grad()), &r.dgamma, true);
            check(mode, &format!("{what} dbeta"), &host(&dev, m.norm_params().bias_grad()), &r.dbeta, true);
            check(mode, &format!("{what} dw1"), &host(&dev, m.fc1().weight_grad()), &r.dw1, true);
            check(mode, &format!("{what} db1"), &host(&dev, m.fc1().bias_grad()), &r.db1, true);
            check(mode, &format!("{what} dw2"), &host(&dev, m.fc2().weight_grad()), &r.dw2, true);
            check(mode, &format!("{what} db2"), &host(&dev, m.fc2().bias_grad()), &r.db2, true);
        }
    }
}

#[test]
fn fp8_layernorm_mlp_saves_less_for_backward() {
    let Some(dev) = device() else { return };
    let mut m = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(256, 1024)).unwrap();
    let x = upload(&dev, &bf16(&randn(40, 512 * 256, 1.0)), &[512, 256]);
    let (_, bf16_ctx) = m.forward(&x).unwrap();
    let (_, fp8_ctx) = fp8_autocast(true, DelayedScaling::default(), || m.forward(&x)).unwrap();
    let ratio = fp8_ctx.saved_bytes() as f64 / bf16_ctx.saved_bytes() as f64;
    eprintln!(
        "LayerNormMLP saved for backward: fp8 {} B, bf16 {} B, ratio {ratio:.3}",
        fp8_ctx.saved_bytes(),
        bf16_ctx.saved_bytes()
    );
    assert!(ratio < 0.8, "FP8 saves its GEMM inputs in 1 byte per element (ratio {ratio:.3})");
}

/// Recomputing fc2's FP8 input in backward gives the same gradients bit for bit as keeping it,
/// and keeps fewer bytes.
#[test]
fn recomputed_activation_matches_the_saved_one() {
    let Some(dev) = device() else { return };
    let x = upload(&dev, &bf16(&randn(70, T * H, 1.0)), &[T, H]);
    let dy = upload(&dev, &bf16(&randn(71, T * H, 1e-2)), &[T, H]);
    for recipe in [Recipe::from(DelayedScaling::default()), Float8CurrentScaling::default().into()] {
        let mut results = Vec::new();
        for recompute in [false, true] {
            let cfg = LayerNormMLPConfig { recompute_activation: recompute, ..LayerNormMLPConfig::new(H, F) };
            let mut m = LayerNormMLP::new(&dev, cfg).unwrap();
            let mut last = None;
            for _ in 0..2 {
                m.fc2_mut().zero_grad();
                last = Some(
                    fp8_autocast(true, recipe, || {
                        let (_, ctx) = m.forward(&x)?;
                        let bytes = ctx.saved_bytes();
                        Ok((m.backward(ctx, &dy)?.to_f32(&dev)?, bytes))
                    })
                    .unwrap(),
                );
            }
            let (dx, bytes) = last.unwrap();
            results.push((dx, host(&dev, m.fc2().weight_grad()), bytes));
        }
        assert_eq!(results[0].0, results[1].0, "{recipe:?}: dx");
        assert_eq!(results[0].1, results[1].1, "{recipe:?}: fc2 wgrad");
        assert!(results[1].2 + T * F <= results[0].2, "{recipe:?}: one byte per ffn activation fewer");
    }
}

#[test]
fn module_errors_are_typed() {
    let Some(dev) = device() else { return };
    let dev: Arc<Device> = dev;
    let recipe = DelayedScaling::default();
    let mut m = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, 100)).unwrap();
    let x = upload(&dev, &vec![0.5; T * H], &[T, H]);
    let e = fp8_autocast(true, recipe, || m.forward(&x).map(|_| ())).unwrap_err();
    assert!(e.to_string().contains("100") && e.to_string().contains("pad it to 112"), "{e}");
    let wrong = upload(&dev, &vec![0.5; T * 96], &[T, 96]);
    assert!(matches!(m.forward(&wrong), Err(Error::Shape { .. })));
    let mut a = LayerNormLinear::new(&dev, LayerNormLinearConfig::new(H, F)).unwrap();
    let mut b = LayerNormLinear::new(&dev, LayerNormLinearConfig::new(H, F)).unwrap();
    let (y, ctx) = a.forward(&x).unwrap();
    assert!(matches!(b.backward(ctx, &y), Err(Error::Context { .. })));
    let (_, ctx) = a.forward(&x).unwrap();
    a.norm_params_mut().set_weight(upload(&dev, &vec![1.0; H], &[H])).unwrap();
    assert!(matches!(a.backward(ctx, &y), Err(Error::Context { .. })), "stale after a norm update");
    let mut rms = Norm::rms_norm(&dev, NormConfig::new(H)).unwrap();
    assert!(matches!(rms.params_mut().set_bias(upload(&dev, &vec![0.0; H], &[H])), Err(Error::Config { .. })));
}

mod transformer {
    use super::*;
    use te_nn::modules::{AttnMaskType, TransformerLayer, TransformerLayerConfig};
    use te_reference::transformer::{LayerRef, MhaRef};
    use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};

    const S: usize = 48;
    const B: usize = 2;
    const HID: usize = 64;
    const HEADS: usize = 4;
    const FFN: usize = 128;

    fn ln_ref<'a>(gamma: &'a [f32], beta: &'a Option<Vec<f32>>) -> NormRef<'a> {
        NormRef { kind: NormKind::LayerNorm, gamma, beta: beta.as_deref(), eps: 1e-5, zero_centered_gamma: false }
    }

    fn config(groups: usize) -> TransformerLayerConfig {
        TransformerLayerConfig {
            num_gqa_groups: Some(groups),
            hidden_dropout: 0.0,
            ..TransformerLayerConfig::new(HID, FFN, HEADS)
        }
    }

    /// The same layer (same seed, so the same weights) on the fused and on the unfused
    /// attention backend: a whole forward + backward step agrees in the output, the input
    /// gradient and the weight gradients, in BF16 and under each FP8 recipe, with MQA.
    #[test]
    fn fused_and_unfused_attention_agree_on_a_layer_step() {
        use te_nn::modules::AttentionBackend;
        let Some(dev) = device() else { return };
        let x = bf16(&randn(60, S * B * HID, 1.0));
        let dy = bf16(&randn(61, S * B * HID, 1e-2));
        let (xt, dyt) = (upload(&dev, &x, &[S, B, HID]), upload(&dev, &dy, &[S, B, HID]));
        for mode in Mode::all() {
            let mut results = Vec::new();
            for backend in [AttentionBackend::Fused, AttentionBackend::Unfused] {
                // Two heads of 32 (the fused kernels' smallest head dim) sharing one key/value head.
                let cfg = TransformerLayerConfig {
                    attention_backend: backend,
                    num_gqa_groups: Some(1),
                    hidden_dropout: 0.0,
                    ..TransformerLayerConfig::new(HID, FFN, 2)
                };
                let mut layer = TransformerLayer::new(&dev, cfg).unwrap();
                let mut step = || {
                    mode.run(|| {
                        let (y, ctx) = layer.forward(&xt)?;
                        Ok((y.to_f32(&dev)?, layer.backward(ctx, &dyt)?.to_f32(&dev)?))
                    })
                };
                step();
                let (y, dx) = step();
                let attn = layer.self_attention();
                let dw = [attn.qkv_params().weight_grad(), attn.proj_params().weight_grad()].map(|t| host(&dev, t));
                results.push((y, dx, dw));
            }
            let (fused, unfused) = (&results[0], &results[1]);
            check(mode, "layer step fused vs unfused: y", &fused.0, &unfused.0, false);
            check(mode, "layer step fused vs unfused: dx", &fused.1, &unfused.1, true);
            check(mode, "layer step fused vs unfused: d qkv", &fused.2[0], &unfused.2[0], true);
            check(mode, "layer step fused vs unfused: d proj", &fused.2[1], &unfused.2[1], true);
        }
    }

    #[test]
    fn transformer_layer_matches_reference() {
        let Some(dev) = device() else { return };
        for groups in [HEADS, 2] {
            for mode in Mode::all() {
                let mut layer = TransformerLayer::new(&dev, config(groups)).unwrap();
                let attn = layer.self_attention_mut();
                let (g1, b1) = randomize_norm(&dev, attn.norm_params_mut().unwrap(), 50);
                let (wqkv, bqkv) = randomize_dense(&dev, attn.qkv_params_mut(), 52);
                let (wp, bp) = randomize_dense(&dev, attn.proj_params_mut(), 53);
                let mlp = layer.layernorm_mlp_mut().unwrap();
                let (g2, b2) = randomize_norm(&dev, mlp.norm_params_mut(), 54);
                let (w1, bb1) = randomize_dense(&dev, mlp.fc1_mut(), 56);
                let (w2, bb2) = randomize_dense(&dev, mlp.fc2_mut(), 57);
                let x = bf16(&randn(58, S * B * HID, 1.0));
                let dy = bf16(&randn(59, S * B * HID, 1e-2));
                let (xt, dyt) = (upload(&dev, &x, &[S, B, HID]), upload(&dev, &dy, &[S, B, HID]));
                let step = |l: &mut TransformerLayer| {
                    l.self_attention_mut().qkv_params_mut().zero_grad();
                    l.self_attention_mut().proj_params_mut().zero_grad();
                    l.layernorm_mlp_mut().unwrap().fc1_mut().zero_grad();
                    mode.run(|| {
                        let (y, ctx) = l.forward(&xt)?;
                        Ok((y.to_f32(&dev)?, l.backward(ctx, &dyt)?.to_f32(&dev)?))
                    })
                };
                step(&mut layer);
                let (y, dx) = step(&mut layer);
                let shape = AttentionShape::new(QkvLayout::Sbhd, B, (S, S), (HEADS, groups), HID / HEADS)
                    .with_mask(AttnMaskType::Causal, None);
                let r = LayerRef {
                    mha: MhaRef {
                        norm: ln_ref(&g1, &b1),
                        qkv: DenseRef { w: &wqkv, b: Some(&bqkv) },
                        proj: DenseRef { w: &wp, b: Some(&bp) },
                        shape,
                    },
                    norm2: ln_ref(&g2, &b2),
                    fc1: DenseRef { w: &w1, b: Some(&bb1) },
                    fc2: DenseRef { w: &w2, b: Some(&bb2) },
                    activation: Activation::Gelu,
                };
                let what = format!("TransformerLayer groups={groups}");
                check(mode, &format!("{what} y"), &y, &r.forward(&x), false);
                let g = r.backward(&dy, &x);
                check(mode, &format!("{what} dx"), &dx, &g.dx, true);
                let attn = layer.self_attention();
                check(
                    mode,
                    &format!("{what} d qkv"),
                    &host(&dev, attn.qkv_params().weight_grad()),
                    &g.mha.qkv.dw1,
                    true,
                );
                check(
                    mode,
                    &format!("{what} d proj"),
                    &host(&dev, attn.proj_params().weight_grad()),
                    &g.mha.dw_proj,
                    true,
                );
                check(
                    mode,
                    &format!("{what} d fc1"),
                    &host(&dev, layer.layernorm_mlp().unwrap().fc1().weight_grad()),
                    &g.mlp.dw1,
                    true,
                );
            }
        }
    }

    /// With every hidden activation dropped (p = 1) the layer is the identity: the dropout masks
    /// and residual paths are wired right, forward and backward.
    #[test]
    fn full_hidden_dropout_leaves_the_residual_stream() {
        let Some(dev) = device() else { return };
        let cfg = TransformerLayerConfig { hidden_dropout: 1.0, ..config(HEADS) };
        let mut layer = TransformerLayer::new(&dev, cfg).unwrap();
        let x = bf16(&randn(60, S * B * HID, 1.0));
        let dy = bf16(&randn(61, S * B * HID, 1.0));
        let (y, ctx) = layer.forward(&upload(&dev, &x, &[S, B, HID])).unwrap();
        assert_eq!(y.to_f32(&dev).unwrap(), x);
        let dx = layer.backward(ctx, &upload(&dev, &dy, &[S, B, HID])).unwrap();
        assert_eq!(dx.to_f32(&dev).unwrap(), dy);
    }

    /// TE's state-dict names through the derive's traversal, pre-LN and post-LN.
    #[test]
    fn layer_parameters_have_te_names() {
        use te_nn::Module;
        let Some(dev) = device() else { return };
        let layer = TransformerLayer::new(&dev, config(2)).unwrap();
        let names: Vec<String> = layer.named_parameters().into_iter().map(|p| p.path).collect();
        for want in [
            "self_attention.layernorm_qkv.layer_norm_weight",
            "self_attention.layernorm_qkv.weight",
            "self_attention.proj.bias",
            "layernorm_mlp.layer_norm_bias",
            "layernorm_mlp.fc1_weight",
            "layernorm_mlp.fc2_bias",
        ] {
            assert!(names.iter().any(|n| n == want), "{want} missing from {names:?}");
        }
        let (h, g, d) = (HID, 2, HID / HEADS);
        let want =
            4 * h + ((HEADS + 2 * g) * d * h + (HEADS + 2 * g) * d) + (h * h + h) + (FFN * h + FFN + h * FFN + h);
        assert_eq!(layer.num_parameters(), want);
        let post = TransformerLayerConfig {
            output_layernorm: true,
            apply_residual_connection_post_layernorm: true,
            ..config(HEADS)
        };
        let bert = TransformerLayer::new(&dev, post).unwrap();
        let names: Vec<String> = bert.named_parameters().into_iter().map(|p| p.path).collect();
        assert!(
            names.iter().any(|n| n == "self_attention.qkv.weight") && names.iter().any(|n| n == "layernorm.weight")
        );
    }

    #[test]
    fn layer_errors_are_typed() {
        let Some(dev) = device() else { return };
        let e = TransformerLayer::new(&dev, TransformerLayerConfig::new(100, 256, 3)).unwrap_err();
        assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("num_attention_heads"), "{e}");
        let e = TransformerLayer::new(&dev, TransformerLayerConfig { num_gqa_groups: Some(3), ..config(HEADS) });
        assert!(matches!(e, Err(Error::Config { .. })));
        let mut layer = TransformerLayer::new(&dev, config(HEADS)).unwrap();
        let flat = upload(&dev, &vec![0.0; S * HID], &[S, HID]);
        assert!(matches!(layer.forward(&flat), Err(Error::Shape { .. })));
    }
}
