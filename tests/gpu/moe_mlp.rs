//! `MoeMLP` (the mixture-of-experts MLP block) on the GPU against the CPU reference
//! `reference::moe_mlp` (composed from `reference::moe` and `reference::modules`; its gradients
//! are checked against finite differences by a CPU test): the output, the aux loss and every
//! gradient in BF16 at TE's bf16 tolerances with a token count that is not a multiple of 16, the
//! aux loss's own gradient, FP8 (delayed scaling, second step) within FP8 bounds with the expert
//! rows padded to multiples of 16, experts that receive no tokens, typed errors; a tiny
//! `moe-small`-like GPT whose SGD steps lower the loss (BF16 and FP8) and whose gradients match
//! finite differences of the loss (aux losses included).

use crate::common::{amax, assert_close, bf16, device, host, randn, upload};
use crate::gpt::{batch, config, param_and_grad, poke, sgd_losses};
use te_models::{Gpt, GptConfig};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Recipe};
use te_nn::modules::{Activation, ForwardOptions, MoeConfig, MoeMLP, MoeMLPConfig, MoeMLPCtx, NormKind};
use te_nn::Module;
use te_reference::linear::rel_frobenius;
use te_reference::modules::{DenseRef, NormRef};
use te_reference::moe_mlp::{MoeMlpGrads, MoeMlpRef};
use te_runtime::{DType, Device, Error, Tensor};

/// Tokens: not a multiple of 16.
const T: usize = 37;
const H: usize = 64;
const F: usize = 96;
const E: usize = 4;

/// BF16: TE's bf16 tolerances and a relative Frobenius bound; FP8: the Frobenius bounds of
/// E4M3 operands forward and E5M2 gradients backward.
fn check(fp8: bool, what: &str, got: &[f32], want: &[f32], grad: bool) {
    let bound = match (fp8, grad) {
        (false, false) => 1e-2,
        (false, true) => 2e-2,
        (true, false) => 0.06,
        (true, true) => 0.15,
    };
    let e = rel_frobenius(got, want);
    assert!(e < bound, "fp8={fp8} {what}: relative Frobenius error {e} (bound {bound})");
    if !fp8 {
        assert_close(what, got, want, 1.6e-2, 2e-2 * amax(want));
    }
}

/// The host values of a block's parameters.
struct Params {
    gamma: Vec<f32>,
    beta: Option<Vec<f32>>,
    router: Vec<f32>,
    w1: Vec<Vec<f32>>,
    b1: Vec<Vec<f32>>,
    w2: Vec<Vec<f32>>,
    b2: Vec<Vec<f32>>,
}

impl Params {
    fn reference(&self, cfg: &MoeMLPConfig) -> MoeMlpRef<'_> {
        MoeMlpRef {
            norm: NormRef {
                kind: cfg.normalization,
                gamma: &self.gamma,
                beta: self.beta.as_deref(),
                eps: cfg.eps,
                zero_centered_gamma: cfg.zero_centered_gamma,
            },
            router: &self.router,
            fc1: (0..cfg.num_experts).map(|i| DenseRef { w: &self.w1[i], b: Some(&self.b1[i]) }).collect(),
            fc2: (0..cfg.num_experts).map(|i| DenseRef { w: &self.w2[i], b: Some(&self.b2[i]) }).collect(),
            act: cfg.activation,
            topk: cfg.topk,
            pre_softmax: cfg.pre_softmax,
            aux_loss_coeff: cfg.aux_loss_coeff,
        }
    }
}

/// Random norm parameters (gamma around 1), router weights `router(e)` (a row per expert) and
/// random expert biases; returns every parameter's host value.
fn randomize(dev: &Device, m: &mut MoeMLP, seed: u64, router: impl Fn(usize) -> Vec<f32>) -> Params {
    let cfg = m.config().clone();
    let (h, e) = (cfg.hidden_size, cfg.num_experts);
    let gamma = bf16(&randn(seed, h, 0.1).iter().map(|v| v + 1.0).collect::<Vec<_>>());
    m.norm_params_mut().set_weight(upload(dev, &gamma, &[h])).unwrap();
    let beta = m.norm_params().bias().is_some().then(|| bf16(&randn(seed + 1, h, 0.1)));
    if let Some(b) = &beta {
        m.norm_params_mut().set_bias(upload(dev, b, &[h])).unwrap();
    }
    let r: Vec<f32> = bf16(&(0..e).flat_map(&router).collect::<Vec<_>>());
    m.router_mut().params_mut().set_weight(upload(dev, &r, &[e, h])).unwrap();
    let mut p = Params { gamma, beta, router: r, w1: vec![], b1: vec![], w2: vec![], b2: vec![] };
    for i in 0..e {
        let fc1 = m.fc1_mut().params_mut(i).unwrap();
        let b1 = bf16(&randn(seed + 10 + i as u64, fc1.out_features(), 0.1));
        fc1.set_bias(upload(dev, &b1, &[fc1.out_features()])).unwrap();
        p.w1.push(host(dev, fc1.weight()));
        p.b1.push(b1);
        let fc2 = m.fc2_mut().params_mut(i).unwrap();
        let b2 = bf16(&randn(seed + 20 + i as u64, h, 0.1));
        fc2.set_bias(upload(dev, &b2, &[h])).unwrap();
        p.w2.push(host(dev, fc2.weight()));
        p.b2.push(b2);
    }
    p
}

/// Each token's experts as the GPU chose them; checked against the reference's top-k of its
/// logits except where the k-th and the next logit are within rounding of each other.
fn gpu_route(dev: &Device, ctx: &MoeMLPCtx, logits: &[f32], k: usize) -> Vec<usize> {
    let got: Vec<usize> =
        dev.stream().clone_dtoh(&ctx.router_output().indices).unwrap().iter().map(|&i| i as usize).collect();
    let e = logits.len() / T;
    for t in 0..T {
        let row = &logits[t * e..][..e];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let gap = if k < e { row[order[k - 1]] - row[order[k]] } else { f32::INFINITY };
        let tol = 2e-2 * amax(row).max(1.0);
        let (mut want, mut have) = (order[..k].to_vec(), got[t * k..][..k].to_vec());
        want.sort_unstable();
        have.sort_unstable();
        assert!(want == have || gap < tol, "token {t}: GPU experts {have:?}, reference {want:?} (gap {gap})");
    }
    got
}

/// Compares every gradient of `m` (after a backward) with `want`.
fn check_grads(dev: &Device, fp8: bool, what: &str, m: &MoeMLP, dx: &[f32], want: &MoeMlpGrads, splits: &[usize]) {
    check(fp8, &format!("{what} dx"), dx, &want.dx, true);
    check(fp8, &format!("{what} dgamma"), &host(dev, m.norm_params().weight_grad()), &want.dgamma, true);
    if m.norm_params().bias().is_some() {
        check(fp8, &format!("{what} dbeta"), &host(dev, m.norm_params().bias_grad()), &want.dbeta, true);
    }
    check(fp8, &format!("{what} drouter"), &host(dev, m.router().params().weight_grad()), &want.drouter, true);
    for (i, &rows) in splits.iter().enumerate() {
        let (fc1, fc2) = (m.fc1().params(i).unwrap(), m.fc2().params(i).unwrap());
        if rows == 0 {
            // No rows: a zero gradient (every expert has one after a backward: ranks of a
            // data-parallel run reduce the same tensors).
            assert!(fc1.weight_grad().is_some() && fc2.weight_grad().is_some(), "{what}: expert {i} has a gradient");
            for g in [fc1.weight_grad(), fc1.bias_grad(), fc2.weight_grad(), fc2.bias_grad()].into_iter().flatten() {
                assert!(g.to_f32(dev).unwrap().iter().all(|&v| v == 0.0), "{what}: expert {i} got no rows");
            }
            continue;
        }
        check(fp8, &format!("{what} dw1[{i}]"), &host(dev, fc1.weight_grad()), &want.dw1[i], true);
        check(fp8, &format!("{what} db1[{i}]"), &host(dev, fc1.bias_grad()), &want.db1[i], true);
        check(fp8, &format!("{what} dw2[{i}]"), &host(dev, fc2.weight_grad()), &want.dw2[i], true);
        check(fp8, &format!("{what} db2[{i}]"), &host(dev, fc2.bias_grad()), &want.db2[i], true);
    }
}

/// What one step of [`step_and_check`] read back from the GPU.
struct Step {
    y: Vec<f32>,
    dx: Vec<f32>,
    route: Vec<usize>,
    aux: f32,
    splits: Vec<usize>,
    gemm: Vec<usize>,
}

/// One forward and backward of `m` against the reference (with the GPU's routing): output, aux
/// loss and every gradient; returns the rows per expert.
fn step_and_check(dev: &Device, m: &mut MoeMLP, p: &Params, fp8: Option<Recipe>, what: &str) -> Vec<usize> {
    let cfg = m.config().clone();
    let x = bf16(&randn(100, T * H, 1.0));
    let dy = bf16(&randn(101, T * H, 1.0));
    let run = |m: &mut MoeMLP| -> te_runtime::Result<Step> {
        let (y, ctx) = m.forward(&upload(dev, &x, &[T, H]))?;
        let logits = p.reference(&cfg).forward(&x, T, None).logits;
        let route = gpu_route(dev, &ctx, &logits, cfg.topk);
        let (splits, gemm) = (ctx.tokens_per_expert().to_vec(), ctx.gemm_splits().to_vec());
        let aux = ctx.aux_loss_value()?;
        let dx = m.backward(ctx, &upload(dev, &dy, &[T, H]))?;
        Ok(Step { y: y.to_f32(dev)?, dx: dx.to_f32(dev)?, route, aux, splits, gemm })
    };
    let Step { y, dx, route, aux, splits, gemm } = match fp8 {
        Some(r) => fp8_autocast(true, r, || run(m)).unwrap(),
        None => run(m).unwrap(),
    };
    let r = p.reference(&cfg);
    let fwd = r.forward(&x, T, Some(&route));
    assert_eq!(splits, fwd.routing.tokens_per_expert, "{what}: tokens per expert");
    assert_eq!(splits.iter().sum::<usize>(), T * cfg.topk);
    if fp8.is_some() {
        assert!(gemm.iter().zip(&splits).all(|(&g, &s)| g % 16 == 0 && g >= s && g < s + 16), "{gemm:?} {splits:?}");
    } else {
        assert_eq!(gemm, splits, "no padding in BF16");
    }
    let fp8 = fp8.is_some();
    check(fp8, &format!("{what} y"), &y, &fwd.y, false);
    assert!(
        (aux - fwd.aux_loss).abs() <= 2e-2 * fwd.aux_loss.abs() + 1e-6,
        "{what}: aux loss {aux} vs {}",
        fwd.aux_loss
    );
    let want = r.backward(&dy, &x, T, Some(&route), 1.0);
    check_grads(dev, fp8, what, m, &dx, &want, &splits);
    splits
}

/// One unchecked FP8 step on the checked step's input and output gradient (delayed scaling: the
/// next step's scales come from its amaxes, so the checked step's casts neither saturate nor
/// underflow), then the gradients zeroed.
fn fp8_warmup(dev: &Device, m: &mut MoeMLP, recipe: Recipe) {
    let x = upload(dev, &bf16(&randn(100, T * H, 1.0)), &[T, H]);
    let dy = upload(dev, &bf16(&randn(101, T * H, 1.0)), &[T, H]);
    fp8_autocast(true, recipe, || {
        let (_, ctx) = m.forward(&x)?;
        m.backward(ctx, &dy)
    })
    .unwrap();
    m.zero_grad();
}

fn random_router(seed: u64) -> impl Fn(usize) -> Vec<f32> {
    move |e| randn(seed + e as u64, H, 0.3)
}

#[test]
fn moe_mlp_matches_reference_in_bf16() {
    let Some(dev) = device() else { return };
    let cases = [
        (2, false, Activation::Gelu, NormKind::LayerNorm),
        (2, true, Activation::Swiglu, NormKind::RmsNorm),
        (1, false, Activation::Relu, NormKind::LayerNorm),
        (E, false, Activation::Gelu, NormKind::LayerNorm),
    ];
    for (k, pre_softmax, activation, normalization) in cases {
        let cfg = MoeMLPConfig {
            pre_softmax,
            activation,
            normalization,
            aux_loss_coeff: 0.1,
            seed: 5,
            ..MoeMLPConfig::new(H, F, E, k)
        };
        let mut m = MoeMLP::new(&dev, cfg).unwrap();
        let p = randomize(&dev, &mut m, 1, random_router(50));
        step_and_check(&dev, &mut m, &p, None, &format!("k={k} pre_softmax={pre_softmax} {activation:?}"));
    }
}

#[test]
fn the_aux_loss_gradient_reaches_the_router() {
    let Some(dev) = device() else { return };
    // A zero output gradient: what reaches the router (and through the norm, x) is the aux
    // loss's gradient alone, times the set weight.
    let cfg = MoeMLPConfig { aux_loss_coeff: 0.5, ..MoeMLPConfig::new(H, F, E, 2) };
    let mut m = MoeMLP::new(&dev, cfg.clone()).unwrap();
    let p = randomize(&dev, &mut m, 2, random_router(60));
    let x = bf16(&randn(102, T * H, 1.0));
    let (_, mut ctx) = m.forward(&upload(&dev, &x, &[T, H])).unwrap();
    let logits = p.reference(&cfg).forward(&x, T, None).logits;
    let route = gpu_route(&dev, &ctx, &logits, 2);
    ctx.set_aux_loss_grad(3.0);
    let dx = m.backward(ctx, &Tensor::zeros(&dev, DType::BF16, &[T, H]).unwrap()).unwrap();
    let want = p.reference(&cfg).backward(&vec![0.0; T * H], &x, T, Some(&route), 3.0);
    assert!(amax(&want.drouter) > 0.0);
    let drouter = host(&dev, m.router().params().weight_grad());
    check(false, "aux-only drouter", &drouter, &want.drouter, true);
    check(false, "aux-only dx", &dx.to_f32(&dev).unwrap(), &want.dx, true);
}

#[test]
fn fp8_moe_mlp_is_within_fp8_bounds() {
    let Some(dev) = device() else { return };
    let recipe: Recipe = DelayedScaling { amax_history_len: 4, ..Default::default() }.into();
    for (k, activation) in [(2, Activation::Gelu), (2, Activation::Swiglu)] {
        let cfg = MoeMLPConfig { activation, ..MoeMLPConfig::new(H, F, E, k) };
        let mut m = MoeMLP::new(&dev, cfg).unwrap();
        let p = randomize(&dev, &mut m, 3, random_router(70));
        // The checked step runs on scales from the first's amaxes.
        fp8_warmup(&dev, &mut m, recipe);
        step_and_check(&dev, &mut m, &p, Some(recipe), &format!("fp8 {activation:?}"));
    }
}

#[test]
fn experts_without_tokens_get_no_rows_and_a_zero_gradient() {
    let Some(dev) = device() else { return };
    // With LayerNorm (gamma 1, beta 1) the normalized rows sum to 0, so a router row c · 1 gives
    // every token the logit c · H: experts 2 and 3 (c = -0.05) lose to experts 0 and 1
    // (c = 0.02 plus noise), which share the tokens under top-1.
    let router = |e: usize| -> Vec<f32> {
        match e {
            0 | 1 => randn(80 + e as u64, H, 0.05).iter().map(|v| v + 0.02).collect(),
            _ => vec![-0.05; H],
        }
    };
    let recipe: Recipe = DelayedScaling::default().into();
    for fp8 in [None, Some(recipe)] {
        let cfg = MoeMLPConfig::new(H, F, E, 1);
        let mut m = MoeMLP::new(&dev, cfg).unwrap();
        let mut p = randomize(&dev, &mut m, 4, router);
        p.gamma = vec![1.0; H];
        p.beta = Some(vec![1.0; H]);
        m.norm_params_mut().set_weight(upload(&dev, &p.gamma, &[H])).unwrap();
        m.norm_params_mut().set_bias(upload(&dev, &[1.0; H], &[H])).unwrap();
        if let Some(r) = fp8 {
            fp8_warmup(&dev, &mut m, r);
        }
        let splits = step_and_check(&dev, &mut m, &p, fp8, &format!("empty experts fp8={}", fp8.is_some()));
        assert_eq!(&splits[2..], &[0, 0], "{splits:?}");
        assert!(splits[0] > 0 && splits[1] > 0, "{splits:?}");
    }
}

#[test]
fn moe_mlp_errors_are_typed() {
    let Some(dev) = device() else { return };
    for cfg in [
        MoeMLPConfig::new(H, F, E, E + 1),
        MoeMLPConfig::new(H, F, 0, 1),
        MoeMLPConfig::new(H, F, 513, 2),
        MoeMLPConfig { aux_loss_coeff: -1.0, ..MoeMLPConfig::new(H, F, E, 2) },
    ] {
        let e = MoeMLP::new(&dev, cfg.clone()).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{cfg:?}: {e}");
    }
    let mut m = MoeMLP::new(&dev, MoeMLPConfig::new(H, F, E, 2)).unwrap();
    let mut other = MoeMLP::new(&dev, MoeMLPConfig::new(H, F, E, 2)).unwrap();
    let e = m.forward(&Tensor::zeros(&dev, DType::BF16, &[T, H + 1]).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let x = upload(&dev, &bf16(&randn(7, T * H, 1.0)), &[T, H]);
    let e = m.forward_with(&x, ForwardOptions { fp8_output: true, ..Default::default() }).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let (y, ctx) = m.forward(&x).unwrap();
    let e = other.backward(ctx, &y).unwrap_err();
    assert!(matches!(e, Error::Context { .. }), "{e}");
    let (_, ctx) = m.forward(&x).unwrap();
    let e = m.backward(ctx, &Tensor::zeros(&dev, DType::BF16, &[T, H + 1]).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    // Under FP8 the feature sizes must be multiples of 16 (the rows are padded).
    let mut odd = MoeMLP::new(&dev, MoeMLPConfig::new(H, 40, E, 2)).unwrap();
    let e = fp8_autocast(true, DelayedScaling::default(), || odd.forward(&x)).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}

/// A tiny `moe-small`: 4 experts of half the ffn, top-2.
fn moe_config(dtype: DType) -> GptConfig {
    let dense = config(dtype);
    GptConfig { ffn_hidden_size: dense.ffn_hidden_size / 2, moe: Some(MoeConfig::new(4, 2)), ..dense }
}

#[test]
fn moe_gpt_names_counts_and_learns() {
    let Some(dev) = device() else { return };
    let cfg = moe_config(DType::BF16);
    let gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    assert_eq!(gpt.num_parameters(), cfg.num_parameters());
    let named = gpt.named_parameters();
    let paths: Vec<&str> = named.iter().map(|p| p.path.as_str()).collect();
    for p in [
        "layers.0.mlp.layer_norm_weight",
        "layers.0.mlp.layer_norm_bias",
        "layers.0.mlp.router.weight",
        "layers.1.mlp.experts.fc1.weight3",
        "layers.1.mlp.experts.fc2.bias0",
    ] {
        assert!(paths.contains(&p), "{p} missing from {paths:?}");
    }
    assert!(!paths.iter().any(|p| p.contains("layernorm_mlp")), "{paths:?}");
    let delayed: Recipe = DelayedScaling { amax_history_len: 4, ..Default::default() }.into();
    for fp8 in [None, Some(delayed)] {
        let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
        let losses = sgd_losses(&dev, &mut gpt, fp8, 10, 0.2);
        assert!(losses.iter().all(|l| l.is_finite()), "fp8 = {fp8:?}: {losses:?}");
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(last < first - 0.3, "fp8 = {fp8:?}: the loss did not fall: {losses:?}");
    }
    // The returned loss is the LM loss plus the layers' aux losses (about the coefficient each).
    let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    let (ids, targets) = batch(&dev, 32, 2);
    let (loss, _) = gpt.forward_loss_with(&ids, &targets, Default::default()).unwrap();
    let aux = loss.aux_value().unwrap();
    assert!(aux > 0.5 * 2.0 * 0.01 && aux < 4.0 * 2.0 * 0.01, "aux {aux}");
    assert!((loss.value().unwrap() - loss.lm_value().unwrap() - aux).abs() < 1e-5);
}

#[test]
fn moe_gpt_gradients_match_finite_differences_of_the_loss() {
    let Some(dev) = device() else { return };
    // F32, aux losses weighted up so their gradient shows in the router's.
    let cfg =
        GptConfig { moe: Some(MoeConfig { aux_loss_coeff: 1.0, ..MoeConfig::new(4, 2) }), ..moe_config(DType::F32) };
    let mut gpt = Gpt::new(&dev, cfg).unwrap();
    let (ids, targets) = batch(&dev, 16, 2);
    let (_, ctx) = gpt.forward_loss(&ids, &targets).unwrap();
    gpt.backward(ctx).unwrap();
    let eps = 1e-3f32;
    for path in ["layers.0.mlp.router.weight", "layers.1.mlp.router.weight", "layers.1.mlp.experts.fc2.weight0"] {
        let (value, grad) = param_and_grad(&gpt, &dev, path);
        // The elements with the largest gradients; one whose step flips a token's routing (the
        // loss jumps: the one-sided differences disagree) is skipped for the next.
        let mut order: Vec<usize> = (0..grad.len()).collect();
        order.sort_by(|&a, &b| grad[b].abs().total_cmp(&grad[a].abs()));
        let mut checked = 0;
        for &i in order.iter().take(6) {
            let mut loss_at = |x: f32| {
                poke(&mut gpt, &dev, path, i, x);
                gpt.forward_loss(&ids, &targets).unwrap().0
            };
            let (up, mid, down) = (loss_at(value[i] + eps), loss_at(value[i]), loss_at(value[i] - eps));
            poke(&mut gpt, &dev, path, i, value[i]);
            let (right, left) = ((up - mid) / eps, (mid - down) / eps);
            if (right - left).abs() > 0.2 * right.abs().max(left.abs()) + 2e-3 {
                continue;
            }
            let (fd, g) = ((up - down) / (2.0 * eps), grad[i]);
            assert!((fd - g).abs() <= 0.05 * g.abs() + 5e-4, "{path}[{i}]: backward {g}, finite difference {fd}");
            checked += 1;
            if checked == 2 {
                break;
            }
        }
        assert!(checked > 0, "{path}: every probed step changed the routing");
    }
}

/// `device_m_splits`: the rows per expert stay on the device and the experts run one grouped
/// launch per pass. Against the same block on the host's splits (same seeds; with and without
/// biases): the
/// output, dx and every gradient at bf16 tolerance, over two steps (the second accumulating);
/// the device's rows per expert are the host's; FP8 takes the host's splits; a config the
/// grouped GEMM cannot run is a typed error. (Experts without rows: `grouped_linear`'s test.)
#[test]
fn device_m_splits_follow_the_host_splits() {
    let Some(dev) = device() else { return };
    let (h, f) = (64, 96);
    for (activation, bias) in [(Activation::Gelu, true), (Activation::Swiglu, false)] {
        let cfg = MoeMLPConfig { bias, activation, seed: 9, ..MoeMLPConfig::new(h, f, E, 2) };
        let mut on_host = MoeMLP::new(&dev, cfg.clone()).unwrap();
        let mut on_device = MoeMLP::new(&dev, MoeMLPConfig { device_m_splits: true, ..cfg }).unwrap();
        let router: Vec<f32> = bf16(&(0..E).flat_map(|e| randn(60 + e as u64, h, 0.3)).collect::<Vec<_>>());
        for m in [&mut on_host, &mut on_device] {
            m.router_mut().params_mut().set_weight(upload(&dev, &router, &[E, h])).unwrap();
            for i in (0..E).filter(|_| bias) {
                let fc1 = m.fc1_mut().params_mut(i).unwrap();
                let n = fc1.out_features();
                fc1.set_bias(upload(&dev, &bf16(&randn(70 + i as u64, n, 0.1)), &[n])).unwrap();
                let fc2 = m.fc2_mut().params_mut(i).unwrap();
                fc2.set_bias(upload(&dev, &bf16(&randn(80 + i as u64, h, 0.1)), &[h])).unwrap();
            }
        }
        let x = upload(&dev, &bf16(&randn(7, T * h, 1.0)), &[T, h]);
        let dy = upload(&dev, &bf16(&randn(8, T * h, 1.0)), &[T, h]);
        for step in 0..2 {
            let what = format!("{activation:?} step {step}");
            let (yh, ch) = on_host.forward(&x).unwrap();
            let (yd, cd) = on_device.forward(&x).unwrap();
            assert!(cd.tokens_per_expert().is_empty(), "{what}: the splits stay on the device");
            let splits = ch.tokens_per_expert().to_vec();
            let on_gpu = dev.stream().clone_dtoh(cd.device_tokens_per_expert()).unwrap();
            assert_eq!(on_gpu.iter().map(|&m| m as usize).collect::<Vec<_>>(), splits, "{what}: rows per expert");
            check(false, &format!("{what} y"), &host(&dev, Some(&yd)), &host(&dev, Some(&yh)), false);
            let (dxh, dxd) = (on_host.backward(ch, &dy).unwrap(), on_device.backward(cd, &dy).unwrap());
            check(false, &format!("{what} dx"), &host(&dev, Some(&dxd)), &host(&dev, Some(&dxh)), true);
            let (r_h, r_d) = (on_host.router().params().weight_grad(), on_device.router().params().weight_grad());
            check(false, &format!("{what} drouter"), &host(&dev, r_d), &host(&dev, r_h), true);
            for (i, &rows) in splits.iter().enumerate() {
                let (h1, d1) = (on_host.fc1().params(i).unwrap(), on_device.fc1().params(i).unwrap());
                let (h2, d2) = (on_host.fc2().params(i).unwrap(), on_device.fc2().params(i).unwrap());
                let pairs = [
                    ("dw1", h1.weight_grad(), d1.weight_grad()),
                    ("dw2", h2.weight_grad(), d2.weight_grad()),
                    ("db1", h1.bias_grad(), d1.bias_grad()),
                    ("db2", h2.bias_grad(), d2.bias_grad()),
                ];
                for (name, gh, gd) in pairs.into_iter().filter(|(_, gh, _)| gh.is_some()) {
                    let (gh, gd) = (host(&dev, gh), host(&dev, gd));
                    if rows == 0 {
                        assert!(gd.iter().all(|&v| v == 0.0), "{what}: {name}[{i}] of an expert without rows");
                    } else {
                        check(false, &format!("{what} {name}[{i}]"), &gd, &gh, true);
                    }
                }
            }
        }
        on_device.fc1_mut().check_device_splits().unwrap();
        // Under FP8 the block takes the host's splits (padded to 16).
        let (_, ctx) = fp8_autocast(true, DelayedScaling::default(), || on_device.forward(&x)).unwrap();
        assert!(!ctx.tokens_per_expert().is_empty());
    }
    let e = MoeMLP::new(&dev, MoeMLPConfig { device_m_splits: true, ..MoeMLPConfig::new(h, 40, E, 2) }).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("multiples of 16"), "{e}");
}

/// On device splits a `MoeMLP` step has no host transfer (the aux loss's gradient is a memset):
/// a CUDA graph captures forward + backward and its replays on new inputs compute what the eager
/// calls of a twin block compute, gradients accumulating alike.
#[test]
fn a_moe_mlp_step_on_device_splits_replays_in_a_graph() {
    use te_runtime::graph::Graph;
    let Some(dev) = device() else { return };
    let (h, f) = (64, 96);
    let cfg = MoeMLPConfig { device_m_splits: true, seed: 4, ..MoeMLPConfig::new(h, f, E, 2) };
    let mut graphed = MoeMLP::new(&dev, cfg.clone()).unwrap();
    let mut eager = MoeMLP::new(&dev, cfg).unwrap();
    let router = bf16(&(0..E).flat_map(|e| randn(90 + e as u64, h, 0.3)).collect::<Vec<_>>());
    for m in [&mut graphed, &mut eager] {
        m.router_mut().params_mut().set_weight(upload(&dev, &router, &[E, h])).unwrap();
    }
    let up = |seed, std| upload(&dev, &bf16(&randn(seed, T * h, std)), &[T, h]);
    let (x, dy) = (up(1, 1.0), up(2, 1.0));
    let step = |m: &mut MoeMLP, x: &Tensor, dy: &Tensor| -> te_runtime::Result<(Tensor, Tensor)> {
        let (y, ctx) = m.forward(x)?;
        let dx = m.backward(ctx, dy)?;
        Ok((y, dx))
    };
    // Two warm-ups: every kernel loaded and GEMM algorithm chosen, the gradients allocated.
    for _ in 0..2 {
        step(&mut graphed, &x, &dy).unwrap();
        step(&mut eager, &x, &dy).unwrap();
    }
    let (graph, (y, dx)) = Graph::capture(&dev, || step(&mut graphed, &x, &dy)).unwrap();
    for seed in [10, 20] {
        let (xs, dys) = (up(seed, 1.0), up(seed + 1, 1.0));
        x.copy_from(&xs).unwrap();
        dy.copy_from(&dys).unwrap();
        graph.replay().unwrap();
        let (want_y, want_dx) = step(&mut eager, &xs, &dys).unwrap();
        check(false, &format!("replay {seed}: y"), &host(&dev, Some(&y)), &host(&dev, Some(&want_y)), false);
        check(false, &format!("replay {seed}: dx"), &host(&dev, Some(&dx)), &host(&dev, Some(&want_dx)), true);
    }
    let (g, e) = (graphed.router().params().weight_grad(), eager.router().params().weight_grad());
    check(false, "router gradient after 4 steps", &host(&dev, g), &host(&dev, e), true);
    for i in 0..E {
        let (g, e) = (graphed.fc1().params(i).unwrap().weight_grad(), eager.fc1().params(i).unwrap().weight_grad());
        check(false, &format!("fc1 dW[{i}] after 4 steps"), &host(&dev, g), &host(&dev, e), true);
    }
}
