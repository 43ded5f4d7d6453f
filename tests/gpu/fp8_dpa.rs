//! `DotProductAttention` in FP8 (TE's `fp8_dpa`): under `fp8_autocast` with a recipe that sets
//! `fp8_dpa`, the fused backend casts q, k and v to E4M3 with one scale from the module's scaling
//! state (delayed) or from their amax (current), runs the FP8 forward and, in training at head_dim
//! 128 without dropout, the FP8 backward (dO in E5M2, dS on a delayed scale); outputs and
//! gradients stay within FP8 error of the 16-bit module's. The delayed states record the amax of
//! q, k and v, of dO and of dS, are updated at the scope's exit (forward) and after the last
//! backward, and are visited (checkpointed) as `….fp8_fwd`, `….fp8_bwd`, `….fp8_dp`; calls the FP8
//! kernels do not take run in 16 bits, bit for bit as without the flag.

use crate::common::{randn, Fp8States};
use crate::fp8_attention::hopper;
use std::sync::Arc;
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8CurrentScaling, Fp8Autocast, Recipe};
use te_nn::modules::QkvFormat;
use te_nn::modules::{AttentionCtx, DotProductAttention, DotProductAttentionConfig, Module};
use te_runtime::numerics::round_to;
use te_runtime::{DType, Device, Result, Tensor};

/// Relative RMS error bound of FP8 attention against the 16-bit module: E4M3 keeps 3 mantissa
/// bits (elements within ±6.25%), and the errors of q, k and v average over `head_dim` and the
/// keys, so outputs land within a few percent; 10% leaves room for the tails.
const RMS_TOL: f64 = 0.10;
/// The same for the gradients of the FP8 backward: dO and dS in E5M2 keep 2 mantissa bits (±12.5%),
/// on top of q, k, v in E4M3, and the first step quantizes dS at the fresh state's scale 1 (as TE
/// starts), where small dS are subnormal; measured 11–12% on an H100 (5.4% for dS alone, the
/// ops-level test).
const GRAD_RMS_TOL: f64 = 0.15;

fn assert_rms_close(what: &str, got: &[f32], want: &[f32]) {
    assert_rms_within(what, got, want, RMS_TOL);
}

fn assert_rms_within(what: &str, got: &[f32], want: &[f32], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    assert!(got.iter().all(|g| g.is_finite()), "{what}: non-finite values");
    let rel = (err / norm.max(1e-30)).sqrt();
    eprintln!("{what}: relative RMS error {rel:.4}");
    assert!(rel <= tol, "{what}: relative RMS error {rel:.4} > {tol}");
}

fn bf16(dev: &Arc<Device>, shape: &[usize], seed: u64, std: f32) -> (Tensor, Vec<f32>) {
    let n = shape.iter().product();
    let host: Vec<f32> = randn(seed, n, std).into_iter().map(|x| round_to(DType::BF16, x)).collect();
    (Tensor::from_f32(dev, DType::BF16, shape, &host).unwrap(), host)
}

type Grads = [Vec<f32>; 3];

/// Forward (apart or through the fused QKV tensor) and backward; the output, the gradients
/// and the context's FP8 flags (forward, backward).
fn step(
    dev: &Device,
    attn: &mut DotProductAttention,
    x: &Inputs,
    recipe: Option<Recipe>,
) -> (Vec<f32>, Grads, (bool, bool)) {
    let forward = |attn: &mut DotProductAttention| -> Result<(Tensor, AttentionCtx)> {
        match &x.packed {
            Some(qkv) => attn.forward_packed(qkv, None),
            None => attn.forward(&x.q, &x.k, &x.v, None),
        }
    };
    let (out, ctx) = match recipe {
        Some(r) => fp8_autocast(true, r, || forward(attn)),
        None => forward(attn),
    }
    .unwrap();
    let fp8 = (ctx.fp8(), ctx.fp8_backward());
    let grads = match &x.packed {
        Some(_) => {
            let d = attn.backward_packed(ctx, &x.d_out).unwrap().to_f32(dev).unwrap();
            [d, Vec::new(), Vec::new()]
        }
        None => {
            let (dq, dk, dv) = attn.backward(ctx, &x.d_out).unwrap();
            [dq.to_f32(dev).unwrap(), dk.to_f32(dev).unwrap(), dv.to_f32(dev).unwrap()]
        }
    };
    (out.to_f32(dev).unwrap(), grads, fp8)
}

struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    /// The fused `[s, b, (h + 2g) · d]` tensor when the call goes through `forward_packed`.
    packed: Option<Tensor>,
    d_out: Tensor,
    amax: f32,
}

fn inputs(dev: &Arc<Device>, cfg: &DotProductAttentionConfig, batch: usize, s: usize, packed: bool) -> Inputs {
    let (h, g, d) = (cfg.num_attention_heads, cfg.num_gqa_groups.unwrap_or(cfg.num_attention_heads), cfg.kv_channels);
    let (q, hq) = bf16(dev, &[s, batch, h, d], 11, 1.0);
    let (k, hk) = bf16(dev, &[s, batch, g, d], 12, 2.0);
    let (v, hv) = bf16(dev, &[s, batch, g, d], 13, 0.5);
    let (d_out, _) = bf16(dev, &[s, batch, h * d], 14, 1.0);
    let amax = hq.iter().chain(&hk).chain(&hv).fold(0f32, |a, &x| a.max(x.abs()));
    let packed = packed.then(|| {
        let (t, _) = bf16(dev, &[s, batch, (h + 2 * g) * d], 15, 1.0);
        t
    });
    let amax = match &packed {
        Some(t) => t.to_f32(dev).unwrap().iter().fold(0f32, |a, &x| a.max(x.abs())),
        None => amax,
    };
    Inputs { q, k, v, packed, d_out, amax }
}

#[test]
fn fp8_dpa_runs_attention_in_fp8_under_autocast() {
    let Some(dev) = hopper() else { return };
    let cfg = DotProductAttentionConfig { num_gqa_groups: Some(2), ..DotProductAttentionConfig::new(4, 128) };
    let delayed = DelayedScaling { fp8_dpa: true, amax_history_len: 4, ..Default::default() };
    let current = Float8CurrentScaling { fp8_dpa: true, ..Default::default() };
    for (recipe, packed) in [(Recipe::from(delayed), false), (Recipe::from(current), true)] {
        let what = if packed { "current scaling, fused QKV" } else { "delayed scaling, q k v apart" };
        let x = inputs(&dev, &cfg, 2, 300, packed);
        let mut attn = DotProductAttention::new(&dev, cfg.clone()).unwrap();
        let (want, want_grads, fp8) = step(&dev, &mut attn, &x, None);
        assert_eq!(fp8, (false, false), "{what}: no autocast, no FP8");
        for round in 0..2 {
            let (got, grads, fp8) = step(&dev, &mut attn, &x, Some(recipe));
            assert_eq!(fp8, (true, true), "{what}: forward and backward ran in FP8");
            assert_rms_close(&format!("{what} round {round}: out"), &got, &want);
            let pairs = ["dq (or d_qkv)", "dk", "dv"].iter().zip(grads.iter().zip(&want_grads));
            for (name, (g, w)) in pairs.filter(|(_, (g, _))| !g.is_empty()) {
                assert_rms_within(&format!("{what} round {round}: {name}"), g, w, GRAD_RMS_TOL);
            }
        }
        let mut states = Fp8States::default();
        attn.visit("core_attention", &mut states).unwrap();
        // dS's state (delayed under both recipes) recorded an amax and took a scale from it (the
        // update rolls the history, so its newest entry is zero again).
        let (name, dp) = states.0.last().unwrap();
        assert_eq!(name, "core_attention.fp8_dp");
        let dp = dp.snapshot().unwrap();
        assert!(dp.scale[0].is_finite() && dp.scale[0] > 1.0, "{what}: dS state {dp:?}");
        match recipe {
            Recipe::Delayed(_) => {
                let names: Vec<_> = states.0.iter().map(|(n, _)| n.as_str()).collect();
                assert_eq!(names, ["core_attention.fp8_fwd", "core_attention.fp8_bwd", "core_attention.fp8_dp"]);
                let snap = states.0[0].1.snapshot().unwrap();
                // Both rounds recorded the amax of q, k and v in the QKV slot (0); the scope
                // exits rolled the history and set the scale from it.
                let history = &snap.amax_history[..snap.history_len];
                assert_eq!(history.iter().filter(|&&a| a == x.amax).count(), 2, "{what}: history {history:?}");
                assert_eq!(snap.scale[0], 448.0 / x.amax, "{what}: scale");
            }
            Recipe::Current(_) => assert_eq!(states.0.len(), 1, "{what}: current scaling keeps dS's state only"),
            Recipe::Block(_) => unreachable!("Float8BlockScaling has no fp8_dpa"),
        }
    }
}

#[test]
fn fp8_dpa_leaves_calls_the_fp8_kernels_do_not_take_in_16_bits() {
    let Some(dev) = hopper() else { return };
    let fp8_dpa = Recipe::from(DelayedScaling { fp8_dpa: true, ..Default::default() });
    // head_dim 64: the FP8 kernels take 128 and 256 only.
    let cfg = DotProductAttentionConfig { qkv_format: QkvFormat::Bshd, ..DotProductAttentionConfig::new(4, 64) };
    let x = inputs(&dev, &DotProductAttentionConfig { qkv_format: QkvFormat::Sbhd, ..cfg.clone() }, 2, 77, false);
    let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
    let (want, want_grads, _) = step(&dev, &mut attn, &x, None);
    let (got, grads, fp8) = step(&dev, &mut attn, &x, Some(fp8_dpa));
    assert_eq!(fp8, (false, false), "head_dim 64 stays 16-bit");
    assert_eq!(got, want, "the same kernels as without the flag");
    assert_eq!(grads, want_grads);
    assert!(attn.fp8_forward_state().is_none(), "no state for a call that did not run in FP8");
    // Without the flag, FP8 autocast leaves attention in 16 bits.
    let cfg = DotProductAttentionConfig::new(4, 128);
    let x = inputs(&dev, &cfg, 2, 130, false);
    let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
    let (want, _, _) = step(&dev, &mut attn, &x, None);
    let (got, _, fp8) = step(&dev, &mut attn, &x, Some(DelayedScaling::default().into()));
    assert!(fp8 == (false, false) && got == want, "fp8_dpa off: 16-bit attention");
    // Attention dropout: the FP8 forward, then the 16-bit backward (the FP8 backward takes none).
    let drop = DotProductAttentionConfig { attention_dropout: 0.1, ..DotProductAttentionConfig::new(4, 128) };
    let mut dropped = DotProductAttention::new(&dev, drop).unwrap();
    let (_, grads, fp8) = step(&dev, &mut dropped, &x, Some(fp8_dpa));
    assert_eq!(fp8, (true, false), "dropout: FP8 forward, 16-bit backward");
    assert!(grads.iter().flatten().all(|g| g.is_finite()));
    // Calibration records the amax of q, k, v and runs in 16 bits.
    let calibrate = Fp8Autocast::calibrating(DelayedScaling { fp8_dpa: true, ..Default::default() });
    let (out, ctx) = calibrate.run(|| attn.forward(&x.q, &x.k, &x.v, None)).unwrap();
    assert!(!ctx.fp8());
    assert_eq!(out.to_f32(&dev).unwrap(), want);
    let snap = attn.fp8_forward_state().expect("calibration made the state").snapshot().unwrap();
    assert!(snap.amax_history.contains(&x.amax), "calibrated amax {:?}", &snap.amax_history[..4]);
}
