//! CPU reference of mixture-of-experts routing (TE 2.x `pytorch/router.py` and
//! `pytorch/permutation.py`; Megatron-LM's `moe_utils.py`), the numerics the GPU kernels of the
//! blockwise-FP8 and MoE issue will be checked against:
//! - [`topk_router`]: the top-k softmax router (TE's `fused_topk_with_score_function` with the
//!   softmax score function), before or after the softmax;
//! - [`aux_loss`]: the auxiliary load-balancing loss (Switch Transformer; TE's
//!   `fused_moe_aux_loss`, Megatron's `switch_load_balancing_loss_func`) and its gradient;
//! - [`permute`] / [`unpermute`]: TE's `moe_permute` / `moe_unpermute` with an index routing map:
//!   the rows of each token copied next to the other rows of their expert, and back, weighted
//!   by the routing probabilities;
//! - [`grouped_forward`]: `GroupedLinear`'s forward, one GEMM per expert over its rows.
//!
//! Layouts: `[tokens, experts]` logits, `[tokens, k]` expert indices and probabilities (slot `j`
//! of a token is its `j`-th choice), row-major `[rows, hidden]` activations. The functions
//! assume consistent sizes (they are references for tests; the modules check their inputs) and
//! panic otherwise.

use super::linear;

/// The routing of `tokens` tokens to `k` experts each.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// `[tokens, k]` expert indices, best first.
    pub experts: Vec<usize>,
    /// `[tokens, k]` routing probabilities of those experts.
    pub probs: Vec<f32>,
    /// `[tokens, experts]` softmax over all experts (the scores of the auxiliary loss).
    pub scores: Vec<f32>,
    /// Tokens routed to each expert (`m_splits` of the expert GEMMs), `[experts]`.
    pub tokens_per_expert: Vec<usize>,
}

/// Softmax of each row of `x` (`[rows, n]`), in f64.
fn softmax_rows(x: &[f32], n: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(n) {
        let m = row.iter().fold(f64::NEG_INFINITY, |a, &v| a.max(f64::from(v)));
        let e: Vec<f64> = row.iter().map(|&v| (f64::from(v) - m).exp()).collect();
        let s: f64 = e.iter().sum();
        out.extend(e.iter().map(|&v| (v / s) as f32));
    }
    out
}

/// The indices of the `k` largest values of `row`, largest first; of equal values the lower
/// index first (a deterministic rule for ties, which `torch.topk` leaves unspecified; the GPU
/// router must follow it).
fn topk(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// The top-`k` router over `logits` `[tokens, experts]`:
/// - `pre_softmax` (TE's `use_pre_softmax`): softmax over all experts, then the `k` best
///   probabilities as they are;
/// - otherwise (TE's default): the `k` best logits, then a softmax over those `k`, so each
///   token's probabilities sum to 1.
///
/// The probabilities are multiplied by `scaling_factor` (TE's `scaling_factor`, 1 by default).
///
/// # Panics
/// If `logits` is not `tokens · experts` long or `k` is 0 or above `experts`.
pub fn topk_router(
    logits: &[f32],
    tokens: usize,
    experts: usize,
    k: usize,
    pre_softmax: bool,
    scaling_factor: f32,
) -> Routing {
    assert!(logits.len() == tokens * experts && (1..=experts).contains(&k), "router sizes");
    let scores = softmax_rows(logits, experts);
    let (mut chosen, mut probs) = (Vec::with_capacity(tokens * k), Vec::with_capacity(tokens * k));
    let mut tokens_per_expert = vec![0usize; experts];
    for t in 0..tokens {
        let (row, full) = (&logits[t * experts..][..experts], &scores[t * experts..][..experts]);
        let pick = if pre_softmax { topk(full, k) } else { topk(row, k) };
        let p: Vec<f32> = if pre_softmax {
            pick.iter().map(|&e| full[e]).collect()
        } else {
            softmax_rows(&pick.iter().map(|&e| row[e]).collect::<Vec<_>>(), k)
        };
        for &e in &pick {
            tokens_per_expert[e] += 1;
        }
        chosen.extend_from_slice(&pick);
        probs.extend(p.iter().map(|&v| v * scaling_factor));
    }
    Routing { experts: chosen, probs, scores, tokens_per_expert }
}

/// The auxiliary load-balancing loss of a routing and its gradient with respect to
/// `routing.scores`: `coeff · E / (k · T²) · Σ_e tokens_per_expert[e] · Σ_t scores[t, e]` for `T`
/// tokens and `E` experts (Switch Transformer's `E · Σ_e f_e · P_e` in Megatron-LM's form); a
/// perfectly balanced routing with uniform scores gives exactly `coeff`. The gradient is
/// `coeff · E / (k · T²) · tokens_per_expert[e]` at every `[t, e]`.
pub fn aux_loss(routing: &Routing, k: usize, coeff: f32) -> (f32, Vec<f32>) {
    let experts = routing.tokens_per_expert.len();
    let tokens = routing.scores.len() / experts.max(1);
    let c = f64::from(coeff) * experts as f64 / (k as f64 * (tokens as f64).powi(2));
    let mut per_expert = vec![0f64; experts];
    for row in routing.scores.chunks_exact(experts) {
        per_expert.iter_mut().zip(row).for_each(|(a, &s)| *a += f64::from(s));
    }
    let loss: f64 = per_expert.iter().zip(&routing.tokens_per_expert).map(|(&p, &n)| p * n as f64).sum();
    let grad_row: Vec<f32> = routing.tokens_per_expert.iter().map(|&n| (c * n as f64) as f32).collect();
    ((c * loss) as f32, grad_row.repeat(tokens))
}

/// The rows of `x` `[tokens, hidden]` permuted by expert (TE `moe_permute`): each token's row
/// once per slot of `experts` (`[tokens, k]`), grouped by expert in ascending order and, within
/// an expert, in token order. Returns `[tokens · k, hidden]`, the `row_id_map` (`[k, tokens]`:
/// where slot `j` of token `t` went, TE's layout) and the rows per expert (`m_splits`).
pub fn permute(
    x: &[f32],
    hidden: usize,
    experts: &[usize],
    k: usize,
    num_experts: usize,
) -> (Vec<f32>, Vec<usize>, Vec<usize>) {
    let tokens = x.len() / hidden.max(1);
    assert!(experts.len() == tokens * k && experts.iter().all(|&e| e < num_experts), "routing sizes");
    let mut m_splits = vec![0usize; num_experts];
    experts.iter().for_each(|&e| m_splits[e] += 1);
    let mut starts: Vec<usize> = m_splits.iter().scan(0, |acc, &m| Some(std::mem::replace(acc, *acc + m))).collect();
    let mut row_id_map = vec![0usize; tokens * k];
    let mut out = vec![0f32; tokens * k * hidden];
    for (e, next) in starts.iter_mut().enumerate() {
        for t in 0..tokens {
            for j in 0..k {
                if experts[t * k + j] == e {
                    let row = *next;
                    *next += 1;
                    row_id_map[j * tokens + t] = row;
                    out[row * hidden..][..hidden].copy_from_slice(&x[t * hidden..][..hidden]);
                }
            }
        }
    }
    (out, row_id_map, m_splits)
}

/// The inverse of [`permute`] (TE `moe_unpermute`): `out[t] = Σ_j probs[t, j] · y[row_id_map[j,
/// t]]` (`probs` `[tokens, k]`; `None` weighs every slot 1), summed in f64. `y` is `[tokens · k,
/// hidden]`.
pub fn unpermute(y: &[f32], hidden: usize, row_id_map: &[usize], k: usize, probs: Option<&[f32]>) -> Vec<f32> {
    let tokens = row_id_map.len() / k.max(1);
    let mut out = vec![0f32; tokens * hidden];
    for t in 0..tokens {
        let mut acc = vec![0f64; hidden];
        for j in 0..k {
            let p = probs.map_or(1.0, |p| f64::from(p[t * k + j]));
            let row = &y[row_id_map[j * tokens + t] * hidden..][..hidden];
            acc.iter_mut().zip(row).for_each(|(a, &v)| *a += p * f64::from(v));
        }
        out[t * hidden..][..hidden].iter_mut().zip(&acc).for_each(|(o, &a)| *o = a as f32);
    }
    out
}

/// `GroupedLinear`'s forward: the rows of `x` (`[Σ m_splits, in]`) split by `m_splits`, expert
/// `i`'s rows times its weight `weights[i]` `[out, in]` transposed, plus its bias; `[Σ m_splits,
/// out]` (an expert with no rows contributes nothing). Each split is
/// [`linear::forward`] in high precision.
pub fn grouped_forward(x: &[f32], m_splits: &[usize], weights: &[&[f32]], biases: Option<&[&[f32]]>) -> Vec<f32> {
    let rows: usize = m_splits.iter().sum();
    let n_in = x.len() / rows.max(1);
    assert!(weights.len() == m_splits.len() && x.len() == rows * n_in, "grouped sizes");
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &m) in m_splits.iter().enumerate().filter(|&(_, &m)| m > 0) {
        let xi = &x[start * n_in..(start + m) * n_in];
        out.extend(linear::forward(xi, weights[i], biases.map(|b| b[i]), m, None));
        start += m;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn router_picks_the_top_k_with_ties_to_the_lower_index() {
        // Token 0: experts 1 and 3 tie for first; token 1: a clear order.
        let logits = [0.0, 2.0, 1.0, 2.0, 3.0, -1.0, 0.5, 1.0];
        let r = topk_router(&logits, 2, 4, 2, false, 1.0);
        assert_eq!(r.experts, vec![1, 3, 0, 3]);
        // Post-softmax: equal logits share 1/2; token 1 gets softmax(3, 1).
        assert_eq!(&r.probs[..2], &[0.5, 0.5]);
        let want = 1.0 / (1.0 + (-2.0f64).exp());
        assert!((f64::from(r.probs[2]) - want).abs() < 1e-6 && (r.probs[2] + r.probs[3] - 1.0).abs() < 1e-6);
        assert_eq!(r.tokens_per_expert, vec![1, 1, 0, 2]);
        // Pre-softmax: the full softmax's values, unnormalized over the k, then scaled.
        let pre = topk_router(&logits, 2, 4, 2, true, 2.0);
        assert_eq!(pre.experts, r.experts);
        assert_eq!(pre.probs[0], 2.0 * pre.scores[1]);
        assert!(pre.probs[0] + pre.probs[1] < 2.0);
    }

    #[test]
    fn aux_loss_is_the_coefficient_when_balanced() {
        // 8 tokens, 4 experts, top-2, every expert chosen 4 times, uniform scores.
        let (tokens, experts, k) = (8, 4, 2);
        let routing = Routing {
            experts: (0..tokens * k).map(|i| (i / 2 + i % 2 * 2) % experts).collect(),
            probs: vec![0.5; tokens * k],
            scores: vec![0.25; tokens * experts],
            tokens_per_expert: vec![4; experts],
        };
        let (loss, grad) = aux_loss(&routing, k, 0.01);
        assert!((loss - 0.01).abs() < 1e-8, "{loss}");
        // d loss / d scores[t, e] = coeff · E / (k · T²) · n_e.
        assert!(grad.iter().all(|&g| (g - 0.01 * 4.0 / (2.0 * 64.0) * 4.0).abs() < 1e-9));
        // All tokens on one expert raise the loss.
        let skewed = topk_router(&[5.0, 0.0, 0.0, 0.0].repeat(tokens), tokens, experts, 1, false, 1.0);
        assert!(aux_loss(&skewed, 1, 0.01).0 > 0.01);
    }

    #[test]
    fn permute_groups_by_expert_and_unpermute_inverts_it() {
        let (tokens, hidden, experts, k) = (37, 5, 6, 2);
        let x = lcg(1, tokens * hidden);
        let r = topk_router(&lcg(2, tokens * experts), tokens, experts, k, false, 1.0);
        let (p, map, m_splits) = permute(&x, hidden, &r.experts, k, experts);
        assert_eq!(m_splits, r.tokens_per_expert);
        assert_eq!(m_splits.iter().sum::<usize>(), tokens * k);
        // Rows are grouped by expert, in token order within one.
        let mut start = 0;
        for (e, &m) in m_splits.iter().enumerate() {
            let mut last = None;
            for row in start..start + m {
                let (t, j) = (0..tokens * k)
                    .map(|i| (i % tokens, i / tokens))
                    .find(|&(t, j)| map[j * tokens + t] == row)
                    .unwrap();
                assert_eq!(r.experts[t * k + j], e);
                assert!(last < Some(t), "token order within expert {e}");
                last = Some(t);
                assert_eq!(&p[row * hidden..][..hidden], &x[t * hidden..][..hidden]);
            }
            start += m;
        }
        // Weighted by probabilities that sum to 1 per token: x back; unweighted: k · x.
        let back = unpermute(&p, hidden, &map, k, Some(&r.probs));
        assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-6));
        let sum = unpermute(&p, hidden, &map, k, None);
        assert!(sum.iter().zip(&x).all(|(a, b)| *a == 2.0 * b));
    }

    #[test]
    fn grouped_forward_runs_each_expert_on_its_rows() {
        // Expert 1 gets no rows.
        let (n_in, n_out, m_splits) = (3, 2, [2usize, 0, 3]);
        let x = lcg(3, 5 * n_in);
        let w: Vec<Vec<f32>> = (0..3).map(|i| lcg(10 + i, n_out * n_in)).collect();
        let b: Vec<Vec<f32>> = (0..3).map(|i| lcg(20 + i, n_out)).collect();
        let (wr, br): (Vec<&[f32]>, Vec<&[f32]>) =
            (w.iter().map(Vec::as_slice).collect(), b.iter().map(Vec::as_slice).collect());
        let y = grouped_forward(&x, &m_splits, &wr, Some(&br));
        assert_eq!(y.len(), 5 * n_out);
        let dot = |r: usize, e: usize, o: usize| -> f32 {
            (0..n_in).map(|i| x[r * n_in + i] * w[e][o * n_in + i]).sum::<f32>() + b[e][o]
        };
        for (r, e) in [(0, 0), (1, 0), (2, 2), (3, 2), (4, 2)] {
            for o in 0..n_out {
                assert!((y[r * n_out + o] - dot(r, e, o)).abs() < 1e-5, "row {r} output {o}");
            }
        }
    }
}
