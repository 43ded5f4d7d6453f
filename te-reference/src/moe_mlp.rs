//! CPU reference of the mixture-of-experts MLP block (`modules::MoeMLP`), forward and backward,
//! composed from [`super::moe`] (router, permutation, aux loss) and [`super::modules`] (norm,
//! dense layers) in f32 (Megatron-LM's `MoELayer` with `TopKRouter` and `TEGroupedMLP`):
//!
//! `ln = norm(x)`, `logits = ln · Rᵀ`, top-k routing, each token's row through each of its
//! experts (`fc2_e(act(fc1_e(ln)))`), summed weighted by the routing probabilities; the
//! load-balancing loss of the routing. The backward returns every gradient of `Σ y · dy +
//! aux_grad · aux_loss`.

use super::activation;
use super::modules::{DenseRef, NormRef};
use super::moe::{aux_loss, permute, topk_router, unpermute, Routing};
use te_codegen::spec::Activation;

/// The block's parameters and options.
#[derive(Debug, Clone)]
pub struct MoeMlpRef<'a> {
    /// The norm in front.
    pub norm: NormRef<'a>,
    /// Router weight `[experts, hidden]` (no bias).
    pub router: &'a [f32],
    /// Each expert's fc1 (`[fc1_out, hidden]`).
    pub fc1: Vec<DenseRef<'a>>,
    /// Each expert's fc2 (`[hidden, ffn]`).
    pub fc2: Vec<DenseRef<'a>>,
    /// The experts' activation.
    pub act: Activation,
    /// Experts per token.
    pub topk: usize,
    /// Softmax before the top-k.
    pub pre_softmax: bool,
    /// The aux loss's coefficient.
    pub aux_loss_coeff: f32,
}

/// What [`MoeMlpRef::forward`] computes.
#[derive(Debug, Clone)]
pub struct MoeMlpForward {
    /// `[tokens, hidden]`.
    pub y: Vec<f32>,
    /// The router's logits `[tokens, experts]`.
    pub logits: Vec<f32>,
    /// The routing (indices, probabilities, scores, tokens per expert).
    pub routing: Routing,
    /// The load-balancing loss (coefficient included).
    pub aux_loss: f32,
}

/// The gradients of [`MoeMlpRef::backward`].
#[derive(Debug, Clone)]
pub struct MoeMlpGrads {
    /// `[tokens, hidden]`.
    pub dx: Vec<f32>,
    /// The norm's gamma gradient.
    pub dgamma: Vec<f32>,
    /// The norm's beta gradient (empty for RMSNorm).
    pub dbeta: Vec<f32>,
    /// The router weight's gradient `[experts, hidden]`.
    pub drouter: Vec<f32>,
    /// Each expert's fc1 weight and bias gradients (zeros for an expert with no rows).
    pub dw1: Vec<Vec<f32>>,
    /// See `dw1`.
    pub db1: Vec<Vec<f32>>,
    /// Each expert's fc2 weight and bias gradients.
    pub dw2: Vec<Vec<f32>>,
    /// See `dw2`.
    pub db2: Vec<Vec<f32>>,
}

/// Everything the forward computes that the backward reads.
struct Trace {
    ln: Vec<f32>,
    fwd: MoeMlpForward,
    row_id_map: Vec<usize>,
    /// Per expert: its input rows, pre-activation, activation.
    experts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    /// The experts' outputs, permuted `[tokens · k, hidden]`.
    yp: Vec<f32>,
}

impl MoeMlpRef<'_> {
    fn experts(&self) -> usize {
        self.fc1.len()
    }

    /// The forward over `x` (`[tokens, hidden]`). `route`: each token's `k` experts (`[tokens,
    /// k]`, e.g. the GPU's choice) instead of the top-k of the logits, whose near-ties rounding
    /// may break differently; the probabilities are then those of these experts.
    ///
    /// # Panics
    /// On inconsistent sizes.
    pub fn forward(&self, x: &[f32], tokens: usize, route: Option<&[usize]>) -> MoeMlpForward {
        self.trace(x, tokens, route).fwd
    }

    fn trace(&self, x: &[f32], tokens: usize, route: Option<&[usize]>) -> Trace {
        let (e, k) = (self.experts(), self.topk);
        let h = x.len() / tokens;
        let ln = self.norm.forward(x);
        let logits = DenseRef { w: self.router, b: None }.forward(&ln, tokens);
        let mut routing = topk_router(&logits, tokens, e, k, self.pre_softmax, 1.0);
        if let Some(r) = route {
            routing = forced_routing(&logits, &routing.scores, r, tokens, e, k, self.pre_softmax);
        }
        let (xp, row_id_map, m_splits) = permute(&ln, h, &routing.experts, k, e);
        let mut experts = Vec::with_capacity(e);
        let mut yp = Vec::with_capacity(xp.len());
        let mut start = 0;
        for (i, &m) in m_splits.iter().enumerate() {
            let xe = xp[start * h..(start + m) * h].to_vec();
            start += m;
            if m == 0 {
                experts.push((xe, Vec::new(), Vec::new()));
                continue;
            }
            let pre = self.fc1[i].forward(&xe, m);
            let ffn = self.fc2[i].w.len() / h;
            let a = activation::forward(self.act, &pre, None, ffn);
            yp.extend(self.fc2[i].forward(&a, m));
            experts.push((xe, pre, a));
        }
        let y = unpermute(&yp, h, &row_id_map, k, Some(&routing.probs));
        let aux = aux_loss(&routing, k, self.aux_loss_coeff).0;
        Trace { ln, fwd: MoeMlpForward { y, logits, routing, aux_loss: aux }, row_id_map, experts, yp }
    }

    /// The gradients of `Σ y · dy + aux_grad · aux_loss` at `x` (`route` as in
    /// [`MoeMlpRef::forward`]).
    ///
    /// # Panics
    /// On inconsistent sizes.
    pub fn backward(
        &self,
        dy: &[f32],
        x: &[f32],
        tokens: usize,
        route: Option<&[usize]>,
        aux_grad: f32,
    ) -> MoeMlpGrads {
        let (e, k) = (self.experts(), self.topk);
        let h = x.len() / tokens;
        let t = self.trace(x, tokens, route);
        let (r, map) = (&t.fwd.routing, &t.row_id_map);
        // unpermute: y[t] = Σ_j p[t, j] · yp[row(t, j)].
        let mut d_probs = vec![0f32; tokens * k];
        let mut d_yp = vec![0f32; t.yp.len()];
        for tok in 0..tokens {
            let dyt = &dy[tok * h..][..h];
            for j in 0..k {
                let row = map[j * tokens + tok];
                let yr = &t.yp[row * h..][..h];
                d_probs[tok * k + j] =
                    dyt.iter().zip(yr).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>() as f32;
                let p = r.probs[tok * k + j];
                d_yp[row * h..][..h].iter_mut().zip(dyt).for_each(|(d, &g)| *d = p * g);
            }
        }
        let mut d_xp = Vec::with_capacity(t.yp.len());
        let (mut dw1, mut db1, mut dw2, mut db2) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut start = 0;
        for (i, (xe, pre, a)) in t.experts.iter().enumerate() {
            let m = r.tokens_per_expert[i];
            let (f1, f2) = (&self.fc1[i], &self.fc2[i]);
            if m == 0 {
                dw1.push(vec![0.0; f1.w.len()]);
                db1.push(vec![0.0; f1.w.len() / h]);
                dw2.push(vec![0.0; f2.w.len()]);
                db2.push(vec![0.0; h]);
                continue;
            }
            let ffn = f2.w.len() / h;
            let (d_a, w2, b2) = f2.backward(&d_yp[start * h..(start + m) * h], a, m);
            start += m;
            let d_pre = activation::backward(self.act, &d_a, pre, ffn);
            let (d_x, w1, b1) = f1.backward(&d_pre, xe, m);
            d_xp.extend(d_x);
            dw1.push(w1);
            db1.push(b1);
            dw2.push(w2);
            db2.push(b2);
        }
        let mut d_ln = unpermute(&d_xp, h, map, k, None);
        // Router: the probabilities' gradient and the aux loss's, through the softmaxes.
        let (_, d_scores) = aux_loss(r, k, self.aux_loss_coeff);
        let mut d_logits = vec![0f32; tokens * e];
        for tok in 0..tokens {
            let s = &r.scores[tok * e..][..e];
            let idx = &r.experts[tok * k..][..k];
            let dp = &d_probs[tok * k..][..k];
            let dl = &mut d_logits[tok * e..][..e];
            if self.pre_softmax {
                let dot: f64 = (0..k).map(|j| f64::from(dp[j]) * f64::from(s[idx[j]])).sum();
                for (i, d) in dl.iter_mut().enumerate() {
                    let g: f64 = (0..k).filter(|&j| idx[j] == i).map(|j| f64::from(dp[j])).sum();
                    *d = (f64::from(s[i]) * (g - dot)) as f32;
                }
            } else {
                let q = &r.probs[tok * k..][..k];
                let dot: f64 = (0..k).map(|j| f64::from(q[j]) * f64::from(dp[j])).sum();
                for j in 0..k {
                    dl[idx[j]] += (f64::from(q[j]) * (f64::from(dp[j]) - dot)) as f32;
                }
            }
            let g = &d_scores[tok * e..][..e];
            let dot: f64 = (0..e).map(|i| f64::from(s[i]) * f64::from(aux_grad * g[i])).sum();
            for i in 0..e {
                dl[i] += (f64::from(s[i]) * (f64::from(aux_grad * g[i]) - dot)) as f32;
            }
        }
        let (d_ln_router, drouter, _) = DenseRef { w: self.router, b: None }.backward(&d_logits, &t.ln, tokens);
        d_ln.iter_mut().zip(&d_ln_router).for_each(|(a, b)| *a += b);
        let (dx, dgamma, dbeta) = self.norm.backward(&d_ln, x);
        MoeMlpGrads { dx, dgamma, dbeta, drouter, dw1, db1, dw2, db2 }
    }
}

/// The routing of the given experts `route` (`[tokens, k]`): their probabilities (softmax of
/// their logits, or their scores with `pre_softmax`) and the tokens per expert.
fn forced_routing(
    logits: &[f32],
    scores: &[f32],
    route: &[usize],
    tokens: usize,
    experts: usize,
    k: usize,
    pre_softmax: bool,
) -> Routing {
    assert!(route.len() == tokens * k && route.iter().all(|&e| e < experts), "route sizes");
    let mut probs = Vec::with_capacity(tokens * k);
    let mut tokens_per_expert = vec![0usize; experts];
    for t in 0..tokens {
        let pick = &route[t * k..][..k];
        pick.iter().for_each(|&e| tokens_per_expert[e] += 1);
        if pre_softmax {
            probs.extend(pick.iter().map(|&e| scores[t * experts + e]));
        } else {
            let l: Vec<f64> = pick.iter().map(|&e| f64::from(logits[t * experts + e])).collect();
            let m = l.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(v));
            let s: f64 = l.iter().map(|v| (v - m).exp()).sum();
            probs.extend(l.iter().map(|v| ((v - m).exp() / s) as f32));
        }
    }
    Routing { experts: route.to_vec(), probs, scores: scores.to_vec(), tokens_per_expert }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_codegen::spec::NormKind;

    fn vals(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                (((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0) * scale
            })
            .collect()
    }

    /// `Σ y · dy + aux_grad · aux` at `x` with the routing held.
    fn objective(m: &MoeMlpRef<'_>, x: &[f32], dy: &[f32], tokens: usize, route: &[usize], aux_grad: f32) -> f64 {
        let f = m.forward(x, tokens, Some(route));
        f.y.iter().zip(dy).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>()
            + f64::from(aux_grad) * f64::from(f.aux_loss)
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (tokens, h, ffn, e, k) = (6, 8, 6, 4, 2);
        for (pre_softmax, act) in [(false, Activation::Gelu), (true, Activation::Swiglu)] {
            let fc1_out = if act.is_gated() { 2 * ffn } else { ffn };
            let gamma: Vec<f32> = vals(1, h, 0.2).iter().map(|v| v + 1.0).collect();
            let beta = vals(2, h, 0.2);
            let router = vals(3, e * h, 1.0);
            let w1: Vec<Vec<f32>> = (0..e).map(|i| vals(10 + i as u64, fc1_out * h, 0.5)).collect();
            let b1: Vec<Vec<f32>> = (0..e).map(|i| vals(20 + i as u64, fc1_out, 0.1)).collect();
            let w2: Vec<Vec<f32>> = (0..e).map(|i| vals(30 + i as u64, h * ffn, 0.5)).collect();
            let b2: Vec<Vec<f32>> = (0..e).map(|i| vals(40 + i as u64, h, 0.1)).collect();
            let m = MoeMlpRef {
                norm: NormRef {
                    kind: NormKind::LayerNorm,
                    gamma: &gamma,
                    beta: Some(&beta),
                    eps: 1e-5,
                    zero_centered_gamma: false,
                },
                router: &router,
                fc1: (0..e).map(|i| DenseRef { w: &w1[i], b: Some(&b1[i]) }).collect(),
                fc2: (0..e).map(|i| DenseRef { w: &w2[i], b: Some(&b2[i]) }).collect(),
                act,
                topk: k,
                pre_softmax,
                aux_loss_coeff: 0.5,
            };
            let x = vals(4, tokens * h, 1.5);
            let dy = vals(5, tokens * h, 1.0);
            let route = m.forward(&x, tokens, None).routing.experts;
            // Unforced and forced with its own choice agree.
            assert_eq!(m.forward(&x, tokens, Some(&route)).y, m.forward(&x, tokens, None).y);
            let aux_grad = 2.0;
            let g = m.backward(&dy, &x, tokens, Some(&route), aux_grad);
            let eps = 1e-2f32;
            let fd = |bump: &dyn Fn(f32) -> f64| (bump(eps) - bump(-eps)) / (2.0 * f64::from(eps));
            let close = |what: &str, got: f32, want: f64| {
                assert!(
                    (f64::from(got) - want).abs() <= 2e-2 * want.abs().max(0.05),
                    "{what} pre_softmax={pre_softmax}: analytic {got}, finite difference {want}"
                );
            };
            for i in [0, 5, 17, 40] {
                let want = fd(&|d| {
                    let mut xp = x.clone();
                    xp[i] += d;
                    objective(&m, &xp, &dy, tokens, &route, aux_grad)
                });
                close(&format!("dx[{i}]"), g.dx[i], want);
            }
            for i in [0, 9, 30] {
                let want = fd(&|d| {
                    let mut rp = router.clone();
                    rp[i] += d;
                    objective(&MoeMlpRef { router: &rp, ..m.clone() }, &x, &dy, tokens, &route, aux_grad)
                });
                close(&format!("drouter[{i}]"), g.drouter[i], want);
            }
            let ex = route[0];
            for i in [0, 7] {
                let want = fd(&|d| {
                    let mut wp = w1[ex].clone();
                    wp[i] += d;
                    let mut fc1 = m.fc1.clone();
                    fc1[ex] = DenseRef { w: &wp, b: Some(&b1[ex]) };
                    objective(&MoeMlpRef { fc1, ..m.clone() }, &x, &dy, tokens, &route, aux_grad)
                });
                close(&format!("dw1[{ex}][{i}]"), g.dw1[ex][i], want);
            }
            let want = fd(&|d| {
                let mut gp = gamma.clone();
                gp[3] += d;
                let norm = NormRef { gamma: &gp, ..m.norm };
                objective(&MoeMlpRef { norm, ..m.clone() }, &x, &dy, tokens, &route, aux_grad)
            });
            close("dgamma[3]", g.dgamma[3], want);
        }
    }
}
