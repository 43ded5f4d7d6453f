//! The MoE top-k softmax router and auxiliary loss on the GPU (`ops::moe_router`, TE's
//! `fused_topk_with_score_function` with softmax and `fused_moe_aux_loss`) against the CPU
//! reference (`reference::moe::{topk_router, aux_loss}`): expert indices exactly (ties, heavy in
//! bf16, to the lower expert), probabilities and scores to an f32 ulp or two, the loss to f32
//! rounding and bit for bit from run to run, the gradients against their formulas (which a CPU
//! test here checks against finite differences of the reference), token counts that are not
//! multiples of the 8 tokens of a block, 8 to 512 experts, k 1, 2 and 8, typed errors.

use crate::common::{assert_close, device, randn};
use te_reference::moe::{self, Routing};
use te_runtime::numerics::round_to;
use te_runtime::ops::moe::{routing_map, MoeRouting};
use te_runtime::ops::moe_router::{aux_loss, aux_loss_backward, topk_router, topk_router_backward};
use te_runtime::ops::moe_router::{RouterConfig, RouterOutput};
use te_runtime::{DType, Device, Error, Tensor};

fn cfg(k: usize, pre_softmax: bool, scaling_factor: f32) -> RouterConfig {
    RouterConfig { k, pre_softmax, scaling_factor }
}

/// The gradient of `Σ_{t,j} d_probs[t, j] · probs[t, j]` with respect to the logits, in f64,
/// for the routing `r` of `logits` (the experts held fixed): the formulas of the router's
/// backward, from the reference's outputs.
fn router_grad(logits: &[f32], r: &Routing, experts: usize, c: RouterConfig, d_probs: &[f32]) -> Vec<f64> {
    let (k, sf) = (c.k, f64::from(c.scaling_factor));
    let mut out = vec![0f64; logits.len()];
    for (t, row) in out.chunks_exact_mut(experts).enumerate() {
        let s: Vec<f64> = r.scores[t * experts..][..experts].iter().map(|&v| f64::from(v)).collect();
        let pick = &r.experts[t * k..][..k];
        let dp: Vec<f64> = d_probs[t * k..][..k].iter().map(|&v| f64::from(v)).collect();
        if c.pre_softmax {
            let a: f64 = pick.iter().zip(&dp).map(|(&e, d)| d * s[e]).sum();
            row.iter_mut().zip(&s).for_each(|(o, si)| *o = -si * sf * a);
            pick.iter().zip(&dp).for_each(|(&e, d)| row[e] += s[e] * sf * d);
        } else {
            let l: Vec<f64> = pick.iter().map(|&e| f64::from(logits[t * experts + e])).collect();
            let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let ex: Vec<f64> = l.iter().map(|v| (v - m).exp()).collect();
            let q: Vec<f64> = ex.iter().map(|v| v / ex.iter().sum::<f64>()).collect();
            let b: f64 = q.iter().zip(&dp).map(|(q, d)| q * d).sum();
            pick.iter().enumerate().for_each(|(j, &e)| row[e] = sf * q[j] * (dp[j] - b));
        }
    }
    out
}

/// The auxiliary loss's gradient with respect to the logits, in f64: the reference's gradient
/// with respect to the scores times `d_loss`, through each token's softmax.
fn aux_grad(r: &Routing, experts: usize, k: usize, coeff: f32, d_loss: f32) -> Vec<f64> {
    let (_, g_scores) = moe::aux_loss(r, k, coeff);
    let mut out = vec![0f64; r.scores.len()];
    for ((row, s), g) in
        out.chunks_exact_mut(experts).zip(r.scores.chunks_exact(experts)).zip(g_scores.chunks_exact(experts))
    {
        let g: Vec<f64> = g.iter().map(|&v| f64::from(v) * f64::from(d_loss)).collect();
        let dot: f64 = s.iter().zip(&g).map(|(&s, g)| f64::from(s) * g).sum();
        row.iter_mut().zip(s.iter().zip(&g)).for_each(|(o, (&s, g))| *o = f64::from(s) * (g - dot));
    }
    out
}

/// No GPU needed: the two gradient formulas above against central differences of the CPU
/// reference (logits spaced so that the perturbation keeps every token's experts).
#[test]
fn router_gradient_formulas_match_finite_differences() {
    let (tokens, experts) = (3, 8);
    let logits: Vec<f32> =
        (0..tokens * experts).map(|i| ((i * 5 + i / experts) % experts) as f32 * 0.37 - 1.2).collect();
    let d_probs: Vec<f32> = randn(7, tokens * 3, 1.0);
    let h = 1e-3f32;
    for (k, pre, sf) in [(2, false, 1.0), (3, false, 2.5), (2, true, 1.0), (3, true, 0.5)] {
        let c = cfg(k, pre, sf);
        let r = moe::topk_router(&logits, tokens, experts, k, pre, sf);
        let dp = &d_probs[..tokens * k];
        let want = router_grad(&logits, &r, experts, c, dp);
        let objective = |x: &[f32]| -> f64 {
            let p = moe::topk_router(x, tokens, experts, k, pre, sf);
            assert_eq!(p.experts, r.experts, "the perturbation changed a routing");
            p.probs.iter().zip(dp).map(|(&p, &d)| f64::from(p) * f64::from(d)).sum()
        };
        let aux = aux_grad(&r, experts, k, 1.0, 1.0);
        let aux_objective = |x: &[f32]| -> f64 {
            let p = moe::topk_router(x, tokens, experts, k, pre, sf);
            f64::from(moe::aux_loss(&Routing { tokens_per_expert: r.tokens_per_expert.clone(), ..p }, k, 1.0).0)
        };
        for i in 0..logits.len() {
            let (mut hi, mut lo) = (logits.clone(), logits.clone());
            hi[i] += h;
            lo[i] -= h;
            let dx = f64::from(hi[i] - lo[i]);
            let fd = (objective(&hi) - objective(&lo)) / dx;
            assert!(
                (fd - want[i]).abs() < 2e-3,
                "k {k} pre {pre}: d logits[{i}] {} vs finite difference {fd}",
                want[i]
            );
            let fd = (aux_objective(&hi) - aux_objective(&lo)) / dx;
            assert!((fd - aux[i]).abs() < 2e-3, "aux: d logits[{i}] {} vs finite difference {fd}", aux[i]);
        }
    }
}

/// `logits` (already representable in `dtype`) routed on the GPU; the output and its host copies
/// (indices, probs, scores).
fn gpu_route(
    dev: &Device,
    dtype: DType,
    logits: &[f32],
    experts: usize,
    c: RouterConfig,
) -> (RouterOutput, Vec<i32>, Vec<f32>, Vec<f32>) {
    let tokens = logits.len() / experts;
    let x = Tensor::from_f32(dev, dtype, &[tokens, experts], logits).unwrap();
    let mut out = RouterOutput::new(dev, tokens, experts, c).unwrap();
    topk_router(dev, &x, &mut out).unwrap();
    let s = dev.stream();
    let (i, p, sc) =
        (s.clone_dtoh(&out.indices).unwrap(), s.clone_dtoh(&out.probs).unwrap(), s.clone_dtoh(&out.scores).unwrap());
    (out, i, p, sc)
}

/// The GPU's routing against the reference's: indices exactly, probabilities and scores within
/// 2 f32 ulps (the f64 sums run in another order).
fn check_routing(what: &str, r: &Routing, got: &(RouterOutput, Vec<i32>, Vec<f32>, Vec<f32>)) {
    let want: Vec<i32> = r.experts.iter().map(|&e| e as i32).collect();
    if let Some(i) = (0..want.len()).find(|&i| got.1[i] != want[i]) {
        let k = got.0.config.k;
        panic!("{what}: token {} slot {}: expert {} vs {}", i / k, i % k, got.1[i], want[i]);
    }
    assert_close(&format!("{what}: probs"), &got.2, &r.probs, 2.5e-7, 0.0);
    assert_close(&format!("{what}: scores"), &got.3, &r.scores, 2.5e-7, 1e-38);
}

#[test]
fn router_forward_matches_the_reference() {
    let Some(dev) = device() else { return };
    let cases = [(1001, 8, 1), (1001, 8, 2), (333, 64, 8), (517, 100, 2), (77, 128, 8), (45, 256, 8), (19, 512, 8)];
    for (n, &(tokens, experts, k)) in cases.iter().enumerate() {
        for dtype in [DType::F32, DType::BF16] {
            let logits: Vec<f32> =
                randn(10 + n as u64, tokens * experts, 1.5).into_iter().map(|v| round_to(dtype, v)).collect();
            for (pre, sf) in [(false, 1.0), (true, 1.0), (false, 2.5), (true, 0.75)] {
                let c = cfg(k, pre, sf);
                let r = moe::topk_router(&logits, tokens, experts, k, pre, sf);
                let got = gpu_route(&dev, dtype, &logits, experts, c);
                check_routing(&format!("{dtype} {tokens}x{experts} top{k} pre {pre} sf {sf}"), &r, &got);
                // The indices feed family 17's routing map: its m_splits are the tokens per expert.
                let mut map = MoeRouting::new(&dev, tokens, k, experts).unwrap();
                routing_map(&dev, &got.0.indices, &mut map).unwrap();
                let splits: Vec<usize> =
                    dev.stream().clone_dtoh(&map.m_splits).unwrap().iter().map(|&v| v as usize).collect();
                assert_eq!(splits, r.tokens_per_expert, "{dtype} {tokens}x{experts}: m_splits");
            }
        }
    }
}

#[test]
fn ties_go_to_the_lower_expert() {
    let Some(dev) = device() else { return };
    let (experts, k) = (64, 8);
    // Rows of few distinct values, an all-equal row, ±0 and -inf.
    let mut logits: Vec<f32> = (0..37 * experts).map(|i| ((i * 7919) % 5) as f32 - 2.0).collect();
    logits[..experts].fill(0.5);
    for (e, v) in logits[experts..2 * experts].iter_mut().enumerate() {
        *v = if e % 2 == 0 { -0.0 } else { 0.0 };
    }
    for v in logits[2 * experts..3 * experts].iter_mut().step_by(3) {
        *v = f32::NEG_INFINITY;
    }
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for pre in [false, true] {
            let r = moe::topk_router(&logits, 37, experts, k, pre, 1.0);
            assert_eq!(&r.experts[..k], &(0..k).collect::<Vec<_>>(), "an all-equal row takes the first k");
            let got = gpu_route(&dev, dtype, &logits, experts, cfg(k, pre, 1.0));
            check_routing(&format!("ties {dtype} pre {pre}"), &r, &got);
        }
    }
}

#[test]
fn router_backward_matches_the_formula() {
    let Some(dev) = device() else { return };
    for (n, &(tokens, experts, k)) in [(1001, 8, 2), (333, 64, 8), (77, 128, 1), (19, 512, 8)].iter().enumerate() {
        let logits: Vec<f32> =
            randn(30 + n as u64, tokens * experts, 1.0).into_iter().map(|v| round_to(DType::BF16, v)).collect();
        let d_probs: Vec<f32> = randn(40 + n as u64, tokens * k, 1.0);
        let dp = dev.stream().clone_htod(&d_probs).unwrap();
        for (pre, sf) in [(false, 1.0), (true, 1.0), (false, 2.5), (true, 0.75)] {
            let c = cfg(k, pre, sf);
            let r = moe::topk_router(&logits, tokens, experts, k, pre, sf);
            let want: Vec<f32> = router_grad(&logits, &r, experts, c, &d_probs).iter().map(|&v| v as f32).collect();
            let (out, ..) = gpu_route(&dev, DType::BF16, &logits, experts, c);
            for dtype in [DType::F32, DType::BF16] {
                let mut dl =
                    Tensor::from_f32(&dev, dtype, &[tokens, experts], &vec![f32::NAN; tokens * experts]).unwrap();
                topk_router_backward(&dev, &out, &dp, &mut dl).unwrap();
                let got = dl.to_f32(&dev).unwrap();
                let (rtol, atol) = if dtype == DType::BF16 { (1.0 / 128.0, 1e-6) } else { (1e-5, 1e-6) };
                assert_close(
                    &format!("{dtype} {tokens}x{experts} top{k} pre {pre} sf {sf}: d_logits"),
                    &got,
                    &want,
                    rtol,
                    atol,
                );
            }
        }
    }
}

#[test]
fn aux_loss_matches_the_reference() {
    let Some(dev) = device() else { return };
    let s = dev.stream();
    for (n, &(tokens, experts, k)) in [(1001, 8, 2), (4099, 64, 8), (77, 128, 1), (19, 512, 8)].iter().enumerate() {
        let logits: Vec<f32> = randn(50 + n as u64, tokens * experts, 1.0);
        let (coeff, d_loss) = (0.01f32, 3.0f32);
        let c = cfg(k, false, 1.0);
        let r = moe::topk_router(&logits, tokens, experts, k, false, 1.0);
        let (out, ..) = gpu_route(&dev, DType::F32, &logits, experts, c);
        let tpe = s.clone_htod(&r.tokens_per_expert.iter().map(|&v| v as i32).collect::<Vec<_>>()).unwrap();
        let (want, _) = moe::aux_loss(&r, k, coeff);
        let mut loss = s.alloc_zeros::<f32>(1).unwrap();
        aux_loss(&dev, &out, &tpe, coeff, &mut loss).unwrap();
        let got = s.clone_dtoh(&loss).unwrap()[0];
        assert!((got - want).abs() <= 2.5e-7 * want.abs(), "{tokens}x{experts} top{k}: loss {got} vs {want}");
        aux_loss(&dev, &out, &tpe, coeff, &mut loss).unwrap();
        assert_eq!(s.clone_dtoh(&loss).unwrap()[0].to_bits(), got.to_bits(), "the loss is deterministic");

        // Backward: alone, and added to the router's gradient.
        let dl_dev = s.clone_htod(&[d_loss]).unwrap();
        let aux: Vec<f32> = aux_grad(&r, experts, k, coeff, d_loss).iter().map(|&v| v as f32).collect();
        let d_probs: Vec<f32> = randn(60 + n as u64, tokens * k, 1.0);
        let dp = s.clone_htod(&d_probs).unwrap();
        let router: Vec<f64> = router_grad(&logits, &r, experts, c, &d_probs);
        let both: Vec<f32> = router.iter().zip(&aux).map(|(&a, &b)| (a + f64::from(b)) as f32).collect();
        for dtype in [DType::F32, DType::BF16] {
            let mut dl = Tensor::from_f32(&dev, dtype, &[tokens, experts], &vec![f32::NAN; tokens * experts]).unwrap();
            aux_loss_backward(&dev, &out, &tpe, coeff, &dl_dev, &mut dl, false).unwrap();
            let (rtol, atol) = if dtype == DType::BF16 { (1.0 / 128.0, 1e-9) } else { (1e-5, 1e-9) };
            assert_close(
                &format!("{dtype} {tokens}x{experts}: aux d_logits"),
                &dl.to_f32(&dev).unwrap(),
                &aux,
                rtol,
                atol,
            );
            topk_router_backward(&dev, &out, &dp, &mut dl).unwrap();
            aux_loss_backward(&dev, &out, &tpe, coeff, &dl_dev, &mut dl, true).unwrap();
            let (rtol, atol) = if dtype == DType::BF16 { (2.0 / 128.0, 1e-6) } else { (1e-5, 1e-6) };
            assert_close(
                &format!("{dtype} {tokens}x{experts}: router + aux d_logits"),
                &dl.to_f32(&dev).unwrap(),
                &both,
                rtol,
                atol,
            );
        }
    }
    // A balanced routing with uniform scores (equal logits) gives exactly coeff.
    let (tokens, experts, k) = (64, 8, 2);
    let (out, ..) = gpu_route(&dev, DType::F32, &vec![0.25; tokens * experts], experts, cfg(k, false, 1.0));
    let tpe = s.clone_htod(&[16i32; 8]).unwrap();
    let mut loss = s.alloc_zeros::<f32>(1).unwrap();
    aux_loss(&dev, &out, &tpe, 0.01, &mut loss).unwrap();
    assert!((s.clone_dtoh(&loss).unwrap()[0] - 0.01).abs() < 1e-9);
}

#[test]
fn router_errors_are_typed() {
    let Some(dev) = device() else { return };
    let s = dev.stream();
    let shape = |r: Result<RouterOutput, Error>| matches!(r, Err(Error::Shape { .. }));
    assert!(shape(RouterOutput::new(&dev, 10, 8, cfg(0, false, 1.0))), "k = 0");
    assert!(shape(RouterOutput::new(&dev, 10, 8, cfg(9, false, 1.0))), "k > experts");
    assert!(shape(RouterOutput::new(&dev, 10, 0, cfg(1, false, 1.0))), "no experts");
    let e = RouterOutput::new(&dev, 10, 513, cfg(2, false, 1.0)).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("512"), "{e}");
    assert!(shape(RouterOutput::new(&dev, usize::MAX / 2, 8, cfg(2, false, 1.0))), "too many tokens");
    let e = RouterOutput::new(&dev, 10, 8, cfg(2, false, f32::NAN)).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }), "{e}");

    let (tokens, experts, k) = (10, 8, 2);
    let mut out = RouterOutput::new(&dev, tokens, experts, cfg(k, false, 1.0)).unwrap();
    let fp8 = Tensor::zeros(&dev, DType::E4M3, &[tokens, experts]).unwrap();
    assert!(matches!(topk_router(&dev, &fp8, &mut out), Err(Error::DType { .. })));
    let wrong = Tensor::zeros(&dev, DType::BF16, &[tokens, experts + 1]).unwrap();
    let e = topk_router(&dev, &wrong, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("logits"), "{e}");
    // Leading dims fold into tokens.
    let folded = Tensor::zeros(&dev, DType::BF16, &[2, 5, experts]).unwrap();
    topk_router(&dev, &folded, &mut out).unwrap();

    let mut dl = Tensor::zeros(&dev, DType::F32, &[tokens, experts]).unwrap();
    let short = s.alloc_zeros::<f32>(tokens * k - 1).unwrap();
    let e = topk_router_backward(&dev, &out, &short, &mut dl).unwrap_err();
    assert!(e.to_string().contains("d_probs"), "{e}");
    let dp = s.alloc_zeros::<f32>(tokens * k).unwrap();
    let mut fp8_dl = Tensor::zeros(&dev, DType::E5M2, &[tokens, experts]).unwrap();
    assert!(matches!(topk_router_backward(&dev, &out, &dp, &mut fp8_dl), Err(Error::DType { .. })));

    let tpe = s.clone_htod(&[2i32; 8]).unwrap();
    let bad_tpe = s.clone_htod(&[2i32; 7]).unwrap();
    let mut loss = s.alloc_zeros::<f32>(1).unwrap();
    let e = aux_loss(&dev, &out, &bad_tpe, 0.01, &mut loss).unwrap_err();
    assert!(e.to_string().contains("tokens_per_expert"), "{e}");
    let mut two = s.alloc_zeros::<f32>(2).unwrap();
    assert!(matches!(aux_loss(&dev, &out, &tpe, 0.01, &mut two), Err(Error::Shape { .. })));
    assert!(matches!(aux_loss(&dev, &out, &tpe, f32::INFINITY, &mut loss), Err(Error::Argument { .. })));
    let d_loss = s.clone_htod(&[1f32]).unwrap();
    let mut wrong_dl = Tensor::zeros(&dev, DType::F32, &[tokens + 1, experts]).unwrap();
    assert!(matches!(
        aux_loss_backward(&dev, &out, &tpe, 0.01, &d_loss, &mut wrong_dl, true),
        Err(Error::Shape { .. })
    ));

    // No tokens: nothing to route, a loss of 0.
    let mut none = RouterOutput::new(&dev, 0, experts, cfg(k, true, 1.0)).unwrap();
    topk_router(&dev, &Tensor::zeros(&dev, DType::BF16, &[0, experts]).unwrap(), &mut none).unwrap();
    let mut loss = s.clone_htod(&[7f32]).unwrap();
    aux_loss(&dev, &none, &tpe, 0.01, &mut loss).unwrap();
    assert_eq!(s.clone_dtoh(&loss).unwrap(), [0.0]);
}
