//! CPU reference of `te_nn::modules::DotProductAttention` and of the fused attention kernels:
//! `O = softmax(scale · Q · Kᵀ, masked) · V` per (batch, head) and the gradients of q, k and v, in
//! f64 on the host, for both dense layouts, GQA/MQA, every mask type, sliding windows and
//! attention dropout. The problem is the runtime's [`AttentionShape`], the mask its
//! [`AttentionShape::attends`] rule; a query whose keys are all masked gets zeros (as the kernels
//! give); query head `j` reads key/value head `j / (heads / groups)`. Attention dropout drops
//! element `i` of the dense `[batch, heads, sq, sk]` probabilities by the dropout kernel's rule
//! ([`crate::dropout::random_word`]) and scales the kept ones by `1 / (1 − p)`, as the fused
//! kernels and the unfused backend do.

use crate::dropout::random_word;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::dropout::{keep_scale, keep_threshold};

/// The forward's results.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// `[batch, sq, heads · head_dim_v]` (bshd) or `[sq, batch, heads · head_dim_v]` (sbhd).
    pub out: Vec<f32>,
    /// `[batch, heads, sq, sk]`: the attention probabilities (before dropout).
    pub probs: Vec<f32>,
}

/// The gradients of one backward, each in the layout of its input.
#[derive(Debug, Clone, PartialEq)]
pub struct Grads {
    /// Of q.
    pub dq: Vec<f32>,
    /// Of k.
    pub dk: Vec<f32>,
    /// Of v.
    pub dv: Vec<f32>,
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn narrow(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

/// Checks the call: a valid shape, dense layout, `seq_lens` as the mask needs them, the
/// inputs' lengths.
///
/// # Panics
/// On any of these (caller bugs: the oracle runs inside tests, where the panic reports them).
fn check(s: &AttentionShape, seq_lens: Option<&[usize]>, [q, k, v]: [usize; 3]) {
    if let Err(e) = s.validate("attention reference").and_then(|()| s.check_seq_lens("attention reference", seq_lens)) {
        panic!("{e}");
    }
    assert!(s.layout != QkvLayout::Thd, "the attention reference takes bshd or sbhd: run thd sequences one by one");
    assert_eq!(q, s.q_len(), "q must hold batch · sq · heads · head_dim values");
    assert_eq!(k, s.kv_len(), "k must hold batch · sk · groups · head_dim values");
    assert_eq!(v, s.v_len(), "v must hold batch · sk · groups · head_dim_v values");
}

/// The factor of probability `i` of the dense `[batch, heads, sq, sk]` ones after dropout: 0 when
/// dropped, `1 / (1 − p)` when kept, 1 without dropout.
fn dropout_factor(s: &AttentionShape, i: usize) -> f64 {
    match s.dropout {
        None => 1.0,
        Some(d) if u64::from(random_word(d.seed, d.offset, i as u64)) < keep_threshold(d.p) => keep_scale(d.p) as f64,
        Some(_) => 0.0,
    }
}

/// `(out, probs)` in f64.
fn forward_f64(
    c: &AttentionShape,
    seq_lens: Option<&[usize]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    forward_f64_capped(c, seq_lens, q, k, v, None)
}

/// `(out, probs)` in f64, the scores `cap · tanh(score / cap)` when `softcap` is given.
fn forward_f64_capped(
    c: &AttentionShape,
    seq_lens: Option<&[usize]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    softcap: Option<f64>,
) -> (Vec<f64>, Vec<f64>) {
    let (d, dv, hpg, scale) = (c.head_dim, c.head_dim_v, c.heads_per_group(), c.scale as f64);
    let (qs, ks, vs, os) = (c.q_strides(), c.k_strides(), c.v_strides(), c.o_strides());
    let mut out = vec![0.0; c.out_len()];
    let mut probs = vec![0.0; c.batch * c.heads * c.sq * c.sk];
    for b in 0..c.batch {
        let lengths = c.valid_lengths(seq_lens.map(|l| l[b]));
        for h in 0..c.heads {
            let g = h / hpg;
            for i in 0..c.sq {
                let scores: Vec<Option<f64>> = (0..c.sk)
                    .map(|j| {
                        c.attends(lengths, i, j).then(|| {
                            let dot: f64 = (0..d).map(|x| q[qs.index(b, i, h, x)] * k[ks.index(b, j, g, x)]).sum();
                            let score = scale * dot;
                            softcap.map_or(score, |cap| cap * (score / cap).tanh())
                        })
                    })
                    .collect();
                let Some(max) = scores.iter().flatten().copied().reduce(f64::max) else {
                    continue; // every key masked: zeros
                };
                let e: Vec<f64> = scores.iter().map(|s| s.map_or(0.0, |s| (s - max).exp())).collect();
                let sum: f64 = e.iter().sum();
                let row = ((b * c.heads + h) * c.sq + i) * c.sk;
                for (j, &ej) in e.iter().enumerate() {
                    let p = ej / sum;
                    probs[row + j] = p;
                    let kept = p * dropout_factor(c, row + j);
                    for x in 0..dv {
                        out[os.index(b, i, h, x)] += kept * v[vs.index(b, j, g, x)];
                    }
                }
            }
        }
    }
    (out, probs)
}

/// `(dq, dk, dv)` in f64.
fn backward_f64(
    c: &AttentionShape,
    seq_lens: Option<&[usize]>,
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_out: &[f64],
) -> [Vec<f64>; 3] {
    let (_, probs) = forward_f64(c, seq_lens, q, k, v);
    let (d, w, hpg, scale) = (c.head_dim, c.head_dim_v, c.heads_per_group(), c.scale as f64);
    let (qs, ks, vs, os) = (c.q_strides(), c.k_strides(), c.v_strides(), c.o_strides());
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..c.batch {
        for h in 0..c.heads {
            let g = h / hpg;
            for i in 0..c.sq {
                let row = ((b * c.heads + h) * c.sq + i) * c.sk;
                let p = &probs[row..][..c.sk];
                let factor: Vec<f64> = (0..c.sk).map(|j| dropout_factor(c, row + j)).collect();
                // dP of the probabilities before dropout: the dropped ones' gradient is 0.
                let dp: Vec<f64> = (0..c.sk)
                    .map(|j| {
                        factor[j] * (0..w).map(|x| d_out[os.index(b, i, h, x)] * v[vs.index(b, j, g, x)]).sum::<f64>()
                    })
                    .collect();
                let dot: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for j in 0..c.sk {
                    let ds = scale * p[j] * (dp[j] - dot);
                    for x in 0..d {
                        let (qi, kj) = (qs.index(b, i, h, x), ks.index(b, j, g, x));
                        dq[qi] += ds * k[kj];
                        dk[kj] += ds * q[qi];
                    }
                    for x in 0..w {
                        dv[vs.index(b, j, g, x)] += p[j] * factor[j] * d_out[os.index(b, i, h, x)];
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

/// The output and probabilities of attention of `q` over `k`, `v` for the problem `shape`
/// (layouts of `shape.layout`: q `[batch, sq, heads, head_dim]`, k `[batch, sk, groups,
/// head_dim]`, v `[batch, sk, groups, head_dim_v]` in bshd); `seq_lens`: the valid length of each
/// sequence for padding masks ([`AttentionShape::check_seq_lens`]), else `None`.
///
/// # Panics
/// If the shape is not valid ([`AttentionShape::validate`]) or `thd`, `seq_lens` do not fit the
/// mask, or the lengths do not match the shape (caller bugs).
pub fn forward(shape: &AttentionShape, seq_lens: Option<&[usize]>, q: &[f32], k: &[f32], v: &[f32]) -> Forward {
    check(shape, seq_lens, [q.len(), k.len(), v.len()]);
    let (out, probs) = forward_f64(shape, seq_lens, &widen(q), &widen(k), &widen(v));
    Forward { out: narrow(&out), probs: narrow(&probs) }
}

/// The fused forward's `softmax_lse` of the problem `shape`: f32 `[batch, heads, sq]`, `ln Σ_j
/// exp(scale · q_i · k_j)` over the keys query `i` sees (in f64), `+inf` for a query that sees
/// none (the kernels' convention).
///
/// # Panics
/// As [`forward`].
pub fn lse(shape: &AttentionShape, seq_lens: Option<&[usize]>, q: &[f32], k: &[f32]) -> Vec<f32> {
    let c = shape;
    check(c, seq_lens, [q.len(), k.len(), c.v_len()]);
    let (d, hpg, scale) = (c.head_dim, c.heads_per_group(), f64::from(c.scale));
    let (qs, ks) = (c.q_strides(), c.k_strides());
    let mut out = vec![f32::INFINITY; c.lse_len()];
    for b in 0..c.batch {
        let lengths = c.valid_lengths(seq_lens.map(|l| l[b]));
        for h in 0..c.heads {
            for i in 0..c.sq {
                let scores: Vec<f64> = (0..c.sk)
                    .filter(|&j| c.attends(lengths, i, j))
                    .map(|j| {
                        scale
                            * (0..d)
                                .map(|x| f64::from(q[qs.index(b, i, h, x)]) * f64::from(k[ks.index(b, j, h / hpg, x)]))
                                .sum::<f64>()
                    })
                    .collect();
                if let Some(max) = scores.iter().copied().reduce(f64::max) {
                    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    out[(b * c.heads + h) * c.sq + i] = (max + sum.ln()) as f32;
                }
            }
        }
    }
    out
}

/// [`forward`] with the scores soft-capped before the mask and the softmax: `cap · tanh(scale ·
/// q·k / cap)` (Gemma 2's `attn_logit_softcapping`, transformers' `eager_attention_forward`
/// with `softcap`; the fused kernels have no softcap). Forward only.
///
/// # Panics
/// As [`forward`], or if `cap` is not finite and > 0 (caller bugs).
pub fn forward_softcapped(
    shape: &AttentionShape,
    seq_lens: Option<&[usize]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cap: f32,
) -> Forward {
    check(shape, seq_lens, [q.len(), k.len(), v.len()]);
    assert!(cap.is_finite() && cap > 0.0, "the softcap must be finite and > 0, got {cap}");
    let (out, probs) = forward_f64_capped(shape, seq_lens, &widen(q), &widen(k), &widen(v), Some(f64::from(cap)));
    Forward { out: narrow(&out), probs: narrow(&probs) }
}

/// The gradients of q, k and v for `d_out`, the gradient of the output (its layout); key and
/// value gradients sum over the query heads of their group.
///
/// # Panics
/// As [`forward`], or if `d_out` is not the output's length.
pub fn backward(
    shape: &AttentionShape,
    seq_lens: Option<&[usize]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    d_out: &[f32],
) -> Grads {
    check(shape, seq_lens, [q.len(), k.len(), v.len()]);
    assert_eq!(d_out.len(), shape.out_len(), "d_out must have the output's length");
    let [dq, dk, dv] = backward_f64(shape, seq_lens, &widen(q), &widen(k), &widen(v), &widen(d_out));
    Grads { dq: narrow(&dq), dk: narrow(&dk), dv: narrow(&dv) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_codegen::spec::{AttnMaskType, QkvFormat};
    use te_runtime::ops::attention_shape::HeadStrides;
    use te_runtime::ops::dropout::DropoutParams;

    fn values(seed: usize, n: usize) -> Vec<f64> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 97) as f64 - 48.0) / 30.0).collect()
    }

    const LENS: [usize; 2] = [3, 2];

    /// Two sequences of 3 queries and 4 keys, 4 heads over 2 groups of 3 channels, scale 0.7.
    fn case(format: QkvFormat, mask: AttnMaskType) -> AttentionShape {
        AttentionShape::new(format.into(), 2, (3, 4), (4, 2), 3).with_scale(0.7).with_mask(mask, None)
    }

    /// The padding lengths of `case`'s padding masks.
    fn lens(mask: AttnMaskType) -> Option<&'static [usize]> {
        mask.is_padding().then_some(&LENS[..])
    }

    /// Index of channel `x` of head `h` at position `s` of sequence `b` in a dense tensor of `n`
    /// heads of `w` channels over `seq` positions.
    fn index(c: &AttentionShape, seq: usize, n: usize, w: usize, (b, s, h, x): (usize, usize, usize, usize)) -> usize {
        let format = c.layout.format().unwrap();
        HeadStrides::dense(format, c.batch, seq, n, w).index(b, s, h, x)
    }

    const MASKS: [AttnMaskType; 6] = AttnMaskType::ALL;
    const FORMATS: [QkvFormat; 2] = [QkvFormat::Bshd, QkvFormat::Sbhd];

    /// Every gradient of `Σ d_out · out` against central differences within `tol · (1 +
    /// |grad|)`.
    fn check_finite_differences(c: &AttentionShape, seq_lens: Option<&[usize]>, tol: f64) {
        let (q, k, v, d_out) =
            (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.v_len()), values(4, c.out_len()));
        let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
            forward_f64(c, seq_lens, q, k, v).0.iter().zip(&d_out).map(|(o, g)| o * g).sum()
        };
        assert_eq!(forward_f64(c, seq_lens, &q, &k, &v).0.len(), c.out_len());
        let grads = backward_f64(c, seq_lens, &q, &k, &v, &d_out);
        let inputs = [&q, &k, &v];
        for (which, grad) in grads.iter().enumerate() {
            assert_eq!(grad.len(), inputs[which].len());
            for i in 0..inputs[which].len() {
                let h = 1e-5;
                let shifted = |delta: f64| {
                    let mut x = [q.clone(), k.clone(), v.clone()];
                    x[which][i] += delta;
                    loss(&x[0], &x[1], &x[2])
                };
                let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
                assert!(
                    (fd - grad[i]).abs() <= tol * (1.0 + grad[i].abs()),
                    "{:?} {} {:?} dropout {:?} input {which} [{i}]: fd {fd} vs {}",
                    c.layout,
                    c.mask.name(),
                    c.window,
                    c.dropout,
                    grad[i]
                );
            }
        }
    }

    /// With `head_dim_v` other than `head_dim` (TE's `kv_channels = (qk, v)`): the output and
    /// dV have v's width, and every gradient matches central differences.
    #[test]
    fn head_dim_v_other_than_head_dim_matches_finite_differences() {
        for head_dim_v in [2, 5] {
            for mask in [AttnMaskType::Causal, AttnMaskType::PaddingCausalBottomRight] {
                let c = case(QkvFormat::Sbhd, mask).with_head_dim_v(head_dim_v);
                check_finite_differences(&c, lens(mask), 1e-6);
            }
        }
    }

    /// The gradients of `Σ d_out · out` against central differences.
    #[test]
    fn gradients_match_finite_differences() {
        let windowed = [
            (AttnMaskType::NoMask, Some((1, 1))),
            (AttnMaskType::Causal, Some((1, 0))),
            (AttnMaskType::Padding, Some((0, 2))),
        ];
        let cases = MASKS.iter().map(|&m| (m, None)).chain(windowed);
        for format in FORMATS {
            for (mask, window) in cases.clone() {
                let c = case(format, mask).with_mask(mask, window);
                check_finite_differences(&c, lens(mask), 1e-7);
            }
        }
    }

    /// With attention dropout the mask is fixed by the stream: the gradients still match central
    /// differences, and another stream drops other probabilities.
    #[test]
    fn dropout_gradients_match_finite_differences() {
        for (mask, p) in [(AttnMaskType::NoMask, 0.5), (AttnMaskType::PaddingCausal, 0.3)] {
            let c = case(QkvFormat::Bshd, mask).with_dropout(Some(DropoutParams { p, seed: 7, offset: 3 }));
            check_finite_differences(&c, lens(mask), 1e-7);
        }
    }

    /// The dropout is the dropout kernel's mask over the dense probabilities (`reference::dropout`
    /// draws the same bits): the output is `dropout(P) · V`, P itself undropped; p = 1 drops
    /// everything.
    #[test]
    fn dropout_drops_the_probabilities_by_the_dropout_rule() {
        let params = DropoutParams { p: 0.4, seed: 11, offset: 5 };
        let c = case(QkvFormat::Sbhd, AttnMaskType::Causal).with_dropout(Some(params));
        let plain = AttentionShape { dropout: None, ..c };
        let (q, k, v) = (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.v_len()));
        let (out, probs) = forward_f64(&c, None, &q, &k, &v);
        assert_eq!(probs, forward_f64(&plain, None, &q, &k, &v).1, "P is kept before dropout");
        let mask = crate::dropout::keep_mask(probs.len(), params);
        let dropped: Vec<f64> = probs
            .iter()
            .enumerate()
            .map(|(i, &p)| if crate::dropout::kept(&mask, i) { p * keep_scale(params.p) as f64 } else { 0.0 })
            .collect();
        assert!(dropped.iter().zip(&probs).any(|(d, p)| *d == 0.0 && *p > 0.0), "something is dropped");
        for (b, i, h, x) in
            (0..2).flat_map(|b| (0..3).flat_map(move |i| (0..4).flat_map(move |h| (0..3).map(move |x| (b, i, h, x)))))
        {
            let row = ((b * 4 + h) * 3 + i) * 4;
            let want: f64 = (0..4).map(|j| dropped[row + j] * v[index(&c, 4, 2, 3, (b, j, h / 2, x))]).sum();
            let got = out[index(&c, 3, 4, 3, (b, i, h, x))];
            assert!((got - want).abs() < 1e-12, "({b}, {i}, {h}, {x}): {got} vs {want}");
        }
        let all = c.with_dropout(Some(DropoutParams { p: 1.0, ..params }));
        let d_out = values(4, c.out_len());
        assert!(forward_f64(&all, None, &q, &k, &v).0.iter().all(|&o| o == 0.0), "p = 1: zeros");
        for g in backward_f64(&all, None, &q, &k, &v, &d_out) {
            assert!(g.iter().all(|&x| x == 0.0), "p = 1: zero gradients");
        }
    }

    /// With q = 0 every attended key scores the same: the output is the mean of their values.
    /// Soft-capping squashes the scores through `cap · tanh(s / cap)` before the softmax: with
    /// one key per query the output is v whatever the cap, with two the probabilities are the
    /// softmax of the capped scores, and a huge cap changes nothing.
    #[test]
    fn softcapped_scores_go_through_tanh() {
        let c = AttentionShape::new(QkvFormat::Bshd.into(), 1, (2, 2), (1, 1), 2)
            .with_scale(1.0)
            .with_mask(AttnMaskType::Causal, None);
        let (q, k, v) = ([3.0f32, 1.0, 2.0, 0.0], [1.0f32, 2.0, 4.0, -1.0], [1.0f32, 10.0, -2.0, 6.0]);
        let capped = forward_softcapped(&c, None, &q, &k, &v, 2.0);
        assert_eq!(&capped.out[..2], &v[..2], "the first query sees one key");
        let (s0, s1) = (2.0f64 * (2.0f64 / 2.0).tanh(), 2.0f64 * (8.0f64 / 2.0).tanh());
        let p1 = 1.0 / (1.0 + (s0 - s1).exp());
        assert!((f64::from(capped.probs[3]) - p1).abs() < 1e-6, "{:?}", capped.probs);
        let plain = forward(&c, None, &q, &k, &v);
        assert_ne!(plain.probs[3], capped.probs[3]);
        let loose = forward_softcapped(&c, None, &q, &k, &v, 1e9);
        for (a, b) in loose.out.iter().zip(&plain.out) {
            assert!((a - b).abs() < 1e-5, "{a} vs {b}");
        }
    }

    #[test]
    fn equal_scores_give_uniform_attention() {
        for format in FORMATS {
            for mask in MASKS {
                let c = case(format, mask);
                let v = values(5, c.kv_len());
                let (out, probs) = forward_f64(&c, lens(mask), &vec![0.0; c.q_len()], &values(6, c.kv_len()), &v);
                for (b, h, i, x) in (0..2)
                    .flat_map(|b| (0..4).flat_map(move |h| (0..3).flat_map(move |i| (0..3).map(move |x| (b, h, i, x)))))
                {
                    let lengths = c.valid_lengths(lens(mask).map(|l| l[b]));
                    let keys: Vec<usize> = (0..c.sk).filter(|&j| c.attends(lengths, i, j)).collect();
                    let mean = if keys.is_empty() {
                        0.0
                    } else {
                        keys.iter().map(|&j| v[index(&c, c.sk, c.groups, c.head_dim, (b, j, h / 2, x))]).sum::<f64>()
                            / keys.len() as f64
                    };
                    let got = out[index(&c, c.sq, c.heads, c.head_dim, (b, i, h, x))];
                    assert!((got - mean).abs() < 1e-12, "{format:?} {mask:?} ({b}, {i}, {h}, {x}): {got} vs {mean}");
                    let row = &probs[((b * 4 + h) * 3 + i) * 4..][..4];
                    for (j, &p) in row.iter().enumerate() {
                        let want = if keys.contains(&j) { 1.0 / keys.len() as f64 } else { 0.0 };
                        assert!((p - want).abs() < 1e-12);
                    }
                }
            }
        }
    }

    /// Padding: queries past the length give zeros and get no gradient; keys past it carry no
    /// value and get no gradient.
    #[test]
    fn padded_positions_carry_nothing() {
        for mask in [AttnMaskType::Padding, AttnMaskType::PaddingCausal, AttnMaskType::PaddingCausalBottomRight] {
            let c = case(QkvFormat::Bshd, mask);
            let (q, k, v, d_out) =
                (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
            let (out, _) = forward_f64(&c, lens(mask), &q, &k, &v);
            let [dq, dk, dv] = backward_f64(&c, lens(mask), &q, &k, &v, &d_out);
            let mut v2 = v.clone();
            for (b, len) in [(0, 3), (1, 2)] {
                for s in 0..4 {
                    for (h, x) in (0..4).flat_map(|h| (0..3).map(move |x| (h, x))) {
                        if s >= len && s < 3 {
                            let i = index(&c, 3, 4, 3, (b, s, h, x));
                            assert_eq!((out[i], dq[i]), (0.0, 0.0), "{mask:?} query {s} of sequence {b}");
                        }
                        if s >= len && h < 2 {
                            let j = index(&c, 4, 2, 3, (b, s, h, x));
                            assert_eq!((dk[j], dv[j]), (0.0, 0.0), "{mask:?} key {s} of sequence {b}");
                            v2[j] = 1e6;
                        }
                    }
                }
            }
            assert_eq!(forward_f64(&c, lens(mask), &q, &k, &v2).0, out, "values of masked keys leak into the output");
        }
    }

    /// sbhd is bshd with the first two dims swapped, for inputs, output and gradients.
    #[test]
    fn formats_agree() {
        let mask = AttnMaskType::PaddingCausal;
        let c = case(QkvFormat::Bshd, mask);
        let s = AttentionShape { layout: QkvLayout::Sbhd, ..c };
        let to_sbhd = |x: &[f64], seq: usize, n: usize| -> Vec<f64> {
            let mut y = vec![0.0; x.len()];
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..seq).flat_map(move |t| (0..n).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                y[index(&s, seq, n, 3, (b, t, h, e))] = x[index(&c, seq, n, 3, (b, t, h, e))];
            }
            y
        };
        let (q, k, v, d_out) =
            (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
        let (qs, ks, vs, ds) = (to_sbhd(&q, 3, 4), to_sbhd(&k, 4, 2), to_sbhd(&v, 4, 2), to_sbhd(&d_out, 3, 4));
        let (out, probs) = forward_f64(&c, lens(mask), &q, &k, &v);
        let (out_s, probs_s) = forward_f64(&s, lens(mask), &qs, &ks, &vs);
        assert_eq!((to_sbhd(&out, 3, 4), probs), (out_s, probs_s));
        let [dq, dk, dv] = backward_f64(&c, lens(mask), &q, &k, &v, &d_out);
        let [dqs, dks, dvs] = backward_f64(&s, lens(mask), &qs, &ks, &vs, &ds);
        assert_eq!([to_sbhd(&dq, 3, 4), to_sbhd(&dk, 4, 2), to_sbhd(&dv, 4, 2)], [dqs, dks, dvs]);
    }

    /// GQA is MHA with each key/value head repeated for its query heads; the key/value gradients
    /// are the sums of the repeated heads' gradients.
    #[test]
    fn gqa_is_mha_with_repeated_heads() {
        let g = case(QkvFormat::Bshd, AttnMaskType::Causal);
        let m = AttentionShape { groups: 4, ..g };
        let (q, k, v, d_out) =
            (values(1, g.q_len()), values(2, g.kv_len()), values(3, g.kv_len()), values(4, g.q_len()));
        let repeat = |x: &[f64]| -> Vec<f64> {
            let mut y = vec![0.0; m.kv_len()];
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..4).flat_map(move |t| (0..4).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                y[index(&m, 4, 4, 3, (b, t, h, e))] = x[index(&g, 4, 2, 3, (b, t, h / 2, e))];
            }
            y
        };
        let (km, vm) = (repeat(&k), repeat(&v));
        assert_eq!(forward_f64(&g, None, &q, &k, &v), forward_f64(&m, None, &q, &km, &vm));
        let [dq, dk, dv] = backward_f64(&g, None, &q, &k, &v, &d_out);
        let [dqm, dkm, dvm] = backward_f64(&m, None, &q, &km, &vm, &d_out);
        assert_eq!(dq, dqm);
        for (sum, full) in [(&dk, &dkm), (&dv, &dvm)] {
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..4).flat_map(move |t| (0..2).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                let want = full[index(&m, 4, 4, 3, (b, t, 2 * h, e))] + full[index(&m, 4, 4, 3, (b, t, 2 * h + 1, e))];
                assert!((sum[index(&g, 4, 2, 3, (b, t, h, e))] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn f32_entry_points_round_the_f64_results() {
        let c = case(QkvFormat::Sbhd, AttnMaskType::NoMask);
        let (q, k, v, d_out) =
            (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
        let (q32, k32, v32, d32) = (narrow(&q), narrow(&k), narrow(&v), narrow(&d_out));
        let f = forward(&c, None, &q32, &k32, &v32);
        let (out, probs) = forward_f64(&c, None, &widen(&q32), &widen(&k32), &widen(&v32));
        assert_eq!((f.out, f.probs), (narrow(&out), narrow(&probs)));
        let g = backward(&c, None, &q32, &k32, &v32, &d32);
        let [dq, dk, dv] = backward_f64(&c, None, &widen(&q32), &widen(&k32), &widen(&v32), &widen(&d32));
        assert_eq!((g.dq, g.dk, g.dv), (narrow(&dq), narrow(&dk), narrow(&dv)));
    }

    /// The entry points refuse what the oracle cannot run: an invalid shape, `thd`, padding
    /// masks without lengths, inputs of the wrong length.
    #[test]
    fn caller_bugs_panic_with_what_is_wrong() {
        let c = case(QkvFormat::Bshd, AttnMaskType::Padding);
        let (q, k) = (vec![0.0; c.q_len()], vec![0.0; c.kv_len()]);
        let panics = |f: &dyn Fn()| {
            let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_err();
            e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap()
        };
        assert!(panics(&|| {
            let _ = forward(&c, None, &q, &k, &k);
        })
        .contains("needs seq_lens"));
        let thd = AttentionShape { layout: QkvLayout::Thd, ..c };
        assert!(panics(&|| {
            let _ = forward(&thd, None, &q, &k, &k);
        })
        .contains("one by one"));
        let bad = AttentionShape { groups: 3, ..c };
        assert!(panics(&|| {
            let _ = forward(&bad, Some(&LENS), &q, &k, &k);
        })
        .contains("groups dividing heads"));
        assert!(panics(&|| {
            let _ = forward(&c, Some(&LENS), &q[1..], &k, &k);
        })
        .contains("q must hold"));
    }
}
