//! CPU reference of `te_nn::modules::DotProductAttention`: `O = softmax(scale · Q · Kᵀ,
//! masked) · V` per (batch, head) and the gradients of q, k and v, in f64 on the host, for both
//! formats, GQA/MQA, every mask type and sliding windows. A query whose keys are all masked gets
//! zeros (as the softmax kernel gives); query head `j` reads key/value head `j / (heads /
//! groups)`.

use te_codegen::spec::{AttnMaskType, QkvFormat};

/// The sizes, mask and scale of one attention call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionCase<'a> {
    /// Layout of q, k, v, the output and the gradients.
    pub format: QkvFormat,
    /// Sequences.
    pub batch: usize,
    /// Queries per sequence.
    pub sq: usize,
    /// Keys per sequence.
    pub sk: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (divides `heads`).
    pub groups: usize,
    /// Channels per head of q and k.
    pub head_dim: usize,
    /// Channels per head of v and the output (TE's `kv_channels = (head_dim_qk, head_dim_v)`).
    pub head_dim_v: usize,
    /// The mask.
    pub mask: AttnMaskType,
    /// Valid length of each sequence, for padding masks.
    pub seq_lens: Option<&'a [usize]>,
    /// Multiplies `Q · Kᵀ` before the softmax.
    pub scale: f32,
    /// The sliding window `(left, right)` around the mask's diagonal (TE `window_size`, −1 =
    /// unbounded; `(-1, -1)`: none).
    pub window: (i64, i64),
}

impl AttentionCase<'_> {
    /// Whether query `i` of sequence `b` attends key `j`, TE's rule (`get_full_mask`): with `lq`
    /// valid queries and `lk` valid keys (`sq`, `sk`, or for padding masks `seq_lens[b]` capped
    /// by each), `i < lq`, `j < lk`, and around the diagonal `t = i + (lk − lq)` (bottom-right
    /// masks) or `t = i` (top-left): `j <= t` for causal masks, `j >= t − left` and `j <= t +
    /// right` for the window's bounded sides.
    ///
    /// # Panics
    /// For a padding mask without a length for `b` (a caller bug).
    // The oracle runs inside tests: a case built wrong is a test bug, reported by the panic.
    #[allow(clippy::expect_used)]
    pub fn attends(&self, b: usize, i: usize, j: usize) -> bool {
        let (lq, lk) = if self.mask.is_padding() {
            let len = self.seq_lens.expect("padding masks need seq_lens")[b];
            (len.min(self.sq), len.min(self.sk))
        } else {
            (self.sq, self.sk)
        };
        if i >= lq || j >= lk {
            return false;
        }
        let (j, offset) = (j as i64, if self.mask.is_bottom_right() { lk as i64 - lq as i64 } else { 0 });
        let t = i as i64 + offset;
        let (left, right) = self.window;
        !(self.mask.is_causal() && j > t || left >= 0 && j < t - left || right >= 0 && j > t + right)
    }

    /// Elements of q.
    pub fn q_len(&self) -> usize {
        self.batch * self.sq * self.heads * self.head_dim
    }

    /// Elements of k.
    pub fn kv_len(&self) -> usize {
        self.batch * self.sk * self.groups * self.head_dim
    }

    /// Elements of v.
    pub fn v_len(&self) -> usize {
        self.batch * self.sk * self.groups * self.head_dim_v
    }

    /// Elements of the output (and of its gradient).
    pub fn out_len(&self) -> usize {
        self.batch * self.sq * self.heads * self.head_dim_v
    }

    /// Index of channel `x` of head `h` at position `s` of sequence `b` in a tensor of `n` heads
    /// of `width` channels over `seq` positions.
    fn index(&self, seq: usize, n: usize, width: usize, (b, s, h, x): (usize, usize, usize, usize)) -> usize {
        let outer = match self.format {
            QkvFormat::Bshd => b * seq + s,
            QkvFormat::Sbhd => s * self.batch + b,
        };
        (outer * n + h) * width + x
    }

    fn check(&self, q: usize, k: usize, v: usize) {
        assert!(self.groups > 0 && self.heads % self.groups == 0, "groups must divide heads");
        assert_eq!(q, self.q_len(), "q must hold batch · sq · heads · head_dim values");
        assert_eq!(k, self.kv_len(), "k must hold batch · sk · groups · head_dim values");
        assert_eq!(v, self.v_len(), "v must hold batch · sk · groups · head_dim_v values");
    }
}

/// The forward's results.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// `[batch, sq, heads · head_dim_v]` (bshd) or `[sq, batch, heads · head_dim_v]` (sbhd).
    pub out: Vec<f32>,
    /// `[batch, heads, sq, sk]`: the attention probabilities.
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

/// `(out, probs)` in f64.
fn forward_f64(c: &AttentionCase<'_>, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (d, dv, hpg, scale) = (c.head_dim, c.head_dim_v, c.heads / c.groups, c.scale as f64);
    let mut out = vec![0.0; c.out_len()];
    let mut probs = vec![0.0; c.batch * c.heads * c.sq * c.sk];
    for b in 0..c.batch {
        for h in 0..c.heads {
            let g = h / hpg;
            for i in 0..c.sq {
                let scores: Vec<Option<f64>> = (0..c.sk)
                    .map(|j| {
                        c.attends(b, i, j).then(|| {
                            let dot: f64 = (0..d)
                                .map(|x| {
                                    q[c.index(c.sq, c.heads, d, (b, i, h, x))]
                                        * k[c.index(c.sk, c.groups, d, (b, j, g, x))]
                                })
                                .sum();
                            scale * dot
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
                    for x in 0..dv {
                        out[c.index(c.sq, c.heads, dv, (b, i, h, x))] +=
                            p * v[c.index(c.sk, c.groups, dv, (b, j, g, x))];
                    }
                }
            }
        }
    }
    (out, probs)
}

/// `(dq, dk, dv)` in f64.
fn backward_f64(c: &AttentionCase<'_>, q: &[f64], k: &[f64], v: &[f64], d_out: &[f64]) -> [Vec<f64>; 3] {
    let (_, probs) = forward_f64(c, q, k, v);
    let (d, w, hpg, scale) = (c.head_dim, c.head_dim_v, c.heads / c.groups, c.scale as f64);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for b in 0..c.batch {
        for h in 0..c.heads {
            let g = h / hpg;
            for i in 0..c.sq {
                let qi = |x| c.index(c.sq, c.heads, d, (b, i, h, x));
                let kj = |j, x| c.index(c.sk, c.groups, d, (b, j, g, x));
                let oi = |x| c.index(c.sq, c.heads, w, (b, i, h, x));
                let vj = |j, x| c.index(c.sk, c.groups, w, (b, j, g, x));
                let p = &probs[((b * c.heads + h) * c.sq + i) * c.sk..][..c.sk];
                let dp: Vec<f64> = (0..c.sk).map(|j| (0..w).map(|x| d_out[oi(x)] * v[vj(j, x)]).sum()).collect();
                let dot: f64 = p.iter().zip(&dp).map(|(p, dp)| p * dp).sum();
                for j in 0..c.sk {
                    let ds = scale * p[j] * (dp[j] - dot);
                    for x in 0..d {
                        dq[qi(x)] += ds * k[kj(j, x)];
                        dk[kj(j, x)] += ds * q[qi(x)];
                    }
                    for x in 0..w {
                        dv[vj(j, x)] += p[j] * d_out[oi(x)];
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

/// The output and probabilities of attention of `q` over `k`, `v` (layouts of `case.format`:
/// q `[batch, sq, heads, head_dim]`, k `[batch, sk, groups, head_dim]`, v `[batch, sk, groups,
/// head_dim_v]` in bshd).
///
/// # Panics
/// If the lengths do not match the case, or groups do not divide heads (caller bugs).
pub fn forward(case: &AttentionCase<'_>, q: &[f32], k: &[f32], v: &[f32]) -> Forward {
    case.check(q.len(), k.len(), v.len());
    let (out, probs) = forward_f64(case, &widen(q), &widen(k), &widen(v));
    Forward { out: narrow(&out), probs: narrow(&probs) }
}

/// The gradients of q, k and v for `d_out`, the gradient of the output (its layout); key and
/// value gradients sum over the query heads of their group.
///
/// # Panics
/// As [`forward`], or if `d_out` is not the output's length.
pub fn backward(case: &AttentionCase<'_>, q: &[f32], k: &[f32], v: &[f32], d_out: &[f32]) -> Grads {
    case.check(q.len(), k.len(), v.len());
    assert_eq!(d_out.len(), case.out_len(), "d_out must have the output's length");
    let [dq, dk, dv] = backward_f64(case, &widen(q), &widen(k), &widen(v), &widen(d_out));
    Grads { dq: narrow(&dq), dk: narrow(&dk), dv: narrow(&dv) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(seed: usize, n: usize) -> Vec<f64> {
        (0..n).map(|i| (((i * 7919 + seed * 104729) % 97) as f64 - 48.0) / 30.0).collect()
    }

    fn case(format: QkvFormat, mask: AttnMaskType, seq_lens: &[usize]) -> AttentionCase<'_> {
        AttentionCase {
            format,
            batch: 2,
            sq: 3,
            sk: 4,
            heads: 4,
            groups: 2,
            head_dim: 3,
            head_dim_v: 3,
            mask,
            seq_lens: mask.is_padding().then_some(seq_lens),
            scale: 0.7,
            window: (-1, -1),
        }
    }

    const MASKS: [AttnMaskType; 6] = AttnMaskType::ALL;
    const FORMATS: [QkvFormat; 2] = [QkvFormat::Bshd, QkvFormat::Sbhd];

    /// With `head_dim_v` other than `head_dim` (TE's `kv_channels = (qk, v)`): the output and
    /// dV have v's width, and every gradient matches central differences.
    #[test]
    fn head_dim_v_other_than_head_dim_matches_finite_differences() {
        for head_dim_v in [2, 5] {
            for mask in [AttnMaskType::Causal, AttnMaskType::PaddingCausalBottomRight] {
                let c = AttentionCase { head_dim_v, ..case(QkvFormat::Sbhd, mask, &[3, 2]) };
                let (q, k, v, d_out) =
                    (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.v_len()), values(4, c.out_len()));
                let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                    forward_f64(&c, q, k, v).0.iter().zip(&d_out).map(|(o, g)| o * g).sum()
                };
                assert_eq!(forward_f64(&c, &q, &k, &v).0.len(), c.out_len());
                let grads = backward_f64(&c, &q, &k, &v, &d_out);
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
                        let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
                        assert!(
                            (grad[i] - numeric).abs() < 1e-6,
                            "head_dim_v {head_dim_v} {mask:?} input {which} element {i}: {} vs {numeric}",
                            grad[i]
                        );
                    }
                }
            }
        }
    }

    /// The gradients of `Σ d_out · out` against central differences.
    #[test]
    fn gradients_match_finite_differences() {
        let windowed =
            [(AttnMaskType::NoMask, (1, 1)), (AttnMaskType::Causal, (1, 0)), (AttnMaskType::Padding, (0, 2))];
        let cases = MASKS.iter().map(|&m| (m, (-1, -1))).chain(windowed);
        for format in FORMATS {
            for (mask, window) in cases.clone() {
                let c = AttentionCase { window, ..case(format, mask, &[3, 2]) };
                let (q, k, v, d_out) =
                    (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
                let loss = |q: &[f64], k: &[f64], v: &[f64]| -> f64 {
                    forward_f64(&c, q, k, v).0.iter().zip(&d_out).map(|(o, g)| o * g).sum()
                };
                let grads = backward_f64(&c, &q, &k, &v, &d_out);
                for (which, grad) in grads.iter().enumerate() {
                    let inputs = [&q, &k, &v];
                    for i in 0..inputs[which].len() {
                        let h = 1e-5;
                        let shifted = |delta: f64| {
                            let mut x = [q.clone(), k.clone(), v.clone()];
                            x[which][i] += delta;
                            loss(&x[0], &x[1], &x[2])
                        };
                        let fd = (shifted(h) - shifted(-h)) / (2.0 * h);
                        assert!(
                            (fd - grad[i]).abs() <= 1e-7 * (1.0 + grad[i].abs()),
                            "{format:?} {mask:?} {window:?} input {which} [{i}]: fd {fd} vs {}",
                            grad[i]
                        );
                    }
                }
            }
        }
    }

    /// With q = 0 every attended key scores the same: the output is the mean of their values.
    #[test]
    fn equal_scores_give_uniform_attention() {
        for format in FORMATS {
            for mask in MASKS {
                let c = case(format, mask, &[3, 2]);
                let v = values(5, c.kv_len());
                let (out, probs) = forward_f64(&c, &vec![0.0; c.q_len()], &values(6, c.kv_len()), &v);
                for (b, h, i, x) in (0..2)
                    .flat_map(|b| (0..4).flat_map(move |h| (0..3).flat_map(move |i| (0..3).map(move |x| (b, h, i, x)))))
                {
                    let keys: Vec<usize> = (0..c.sk).filter(|&j| c.attends(b, i, j)).collect();
                    let mean = if keys.is_empty() {
                        0.0
                    } else {
                        keys.iter().map(|&j| v[c.index(c.sk, c.groups, c.head_dim, (b, j, h / 2, x))]).sum::<f64>()
                            / keys.len() as f64
                    };
                    let got = out[c.index(c.sq, c.heads, c.head_dim, (b, i, h, x))];
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

    /// The diagonals and windows of TE's formula, on a 3 × 5 case (sq < sk, as in decoding).
    #[test]
    fn diagonals_and_windows_follow_te() {
        let visible = |mask, window, lens: &[usize], b, i| -> Vec<usize> {
            let c = AttentionCase { window, ..case(QkvFormat::Bshd, mask, lens) };
            let c = AttentionCase { sq: 3, sk: 5, ..c };
            (0..5).filter(|&j| c.attends(b, i, j)).collect()
        };
        use AttnMaskType::*;
        assert_eq!(visible(Causal, (-1, 0), &[], 0, 0), [0]);
        assert_eq!(visible(CausalBottomRight, (-1, 0), &[], 0, 0), [0, 1, 2]);
        assert_eq!(visible(CausalBottomRight, (-1, 0), &[], 0, 2), [0, 1, 2, 3, 4]);
        assert_eq!(visible(CausalBottomRight, (1, 0), &[], 0, 2), [3, 4]);
        assert_eq!(visible(Causal, (1, 0), &[], 0, 2), [1, 2]);
        assert_eq!(visible(NoMask, (0, 1), &[], 0, 0), [2, 3], "no_mask windows are bottom-right aligned");
        // Padding lengths 2 (queries 0..2, keys 0..2 of 5): the diagonal ends at the last valid key.
        assert_eq!(visible(PaddingCausalBottomRight, (-1, 0), &[2, 2], 1, 1), [0, 1]);
        assert_eq!(visible(PaddingCausalBottomRight, (-1, 0), &[2, 2], 1, 2), Vec::<usize>::new());
        assert_eq!(visible(PaddingCausal, (-1, 0), &[3, 3], 0, 0), [0]);
    }

    /// Padding: queries past the length give zeros and get no gradient; keys past it carry no
    /// value and get no gradient.
    #[test]
    fn padded_positions_carry_nothing() {
        for mask in [AttnMaskType::Padding, AttnMaskType::PaddingCausal, AttnMaskType::PaddingCausalBottomRight] {
            let c = case(QkvFormat::Bshd, mask, &[3, 2]);
            let (q, k, v, d_out) =
                (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
            let (out, _) = forward_f64(&c, &q, &k, &v);
            let [dq, dk, dv] = backward_f64(&c, &q, &k, &v, &d_out);
            let mut v2 = v.clone();
            for (b, len) in [(0, 3), (1, 2)] {
                for s in 0..4 {
                    for (h, x) in (0..4).flat_map(|h| (0..3).map(move |x| (h, x))) {
                        if s >= len && s < 3 {
                            let i = c.index(3, 4, 3, (b, s, h, x));
                            assert_eq!((out[i], dq[i]), (0.0, 0.0), "{mask:?} query {s} of sequence {b}");
                        }
                        if s >= len && h < 2 {
                            let j = c.index(4, 2, 3, (b, s, h, x));
                            assert_eq!((dk[j], dv[j]), (0.0, 0.0), "{mask:?} key {s} of sequence {b}");
                            v2[j] = 1e6;
                        }
                    }
                }
            }
            assert_eq!(forward_f64(&c, &q, &k, &v2).0, out, "values of masked keys leak into the output");
        }
    }

    /// sbhd is bshd with the first two dims swapped, for inputs, output and gradients.
    #[test]
    fn formats_agree() {
        let c = case(QkvFormat::Bshd, AttnMaskType::PaddingCausal, &[3, 2]);
        let s = AttentionCase { format: QkvFormat::Sbhd, ..c };
        let to_sbhd = |x: &[f64], seq: usize, n: usize| -> Vec<f64> {
            let mut y = vec![0.0; x.len()];
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..seq).flat_map(move |t| (0..n).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                y[s.index(seq, n, 3, (b, t, h, e))] = x[c.index(seq, n, 3, (b, t, h, e))];
            }
            y
        };
        let (q, k, v, d_out) =
            (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
        let (qs, ks, vs, ds) = (to_sbhd(&q, 3, 4), to_sbhd(&k, 4, 2), to_sbhd(&v, 4, 2), to_sbhd(&d_out, 3, 4));
        let (out, probs) = forward_f64(&c, &q, &k, &v);
        let (out_s, probs_s) = forward_f64(&s, &qs, &ks, &vs);
        assert_eq!((to_sbhd(&out, 3, 4), probs), (out_s, probs_s));
        let [dq, dk, dv] = backward_f64(&c, &q, &k, &v, &d_out);
        let [dqs, dks, dvs] = backward_f64(&s, &qs, &ks, &vs, &ds);
        assert_eq!([to_sbhd(&dq, 3, 4), to_sbhd(&dk, 4, 2), to_sbhd(&dv, 4, 2)], [dqs, dks, dvs]);
    }

    /// GQA is MHA with each key/value head repeated for its query heads; the key/value gradients
    /// are the sums of the repeated heads' gradients.
    #[test]
    fn gqa_is_mha_with_repeated_heads() {
        let g = case(QkvFormat::Bshd, AttnMaskType::Causal, &[]);
        let m = AttentionCase { groups: 4, ..g };
        let (q, k, v, d_out) =
            (values(1, g.q_len()), values(2, g.kv_len()), values(3, g.kv_len()), values(4, g.q_len()));
        let repeat = |x: &[f64]| -> Vec<f64> {
            let mut y = vec![0.0; m.kv_len()];
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..4).flat_map(move |t| (0..4).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                y[m.index(4, 4, 3, (b, t, h, e))] = x[g.index(4, 2, 3, (b, t, h / 2, e))];
            }
            y
        };
        let (km, vm) = (repeat(&k), repeat(&v));
        assert_eq!(forward_f64(&g, &q, &k, &v), forward_f64(&m, &q, &km, &vm));
        let [dq, dk, dv] = backward_f64(&g, &q, &k, &v, &d_out);
        let [dqm, dkm, dvm] = backward_f64(&m, &q, &km, &vm, &d_out);
        assert_eq!(dq, dqm);
        for (sum, full) in [(&dk, &dkm), (&dv, &dvm)] {
            for (b, t, h, e) in (0..2)
                .flat_map(|b| (0..4).flat_map(move |t| (0..2).flat_map(move |h| (0..3).map(move |e| (b, t, h, e)))))
            {
                let want = full[m.index(4, 4, 3, (b, t, 2 * h, e))] + full[m.index(4, 4, 3, (b, t, 2 * h + 1, e))];
                assert!((sum[g.index(4, 2, 3, (b, t, h, e))] - want).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn f32_entry_points_round_the_f64_results() {
        let c = case(QkvFormat::Sbhd, AttnMaskType::NoMask, &[]);
        let (q, k, v, d_out) =
            (values(1, c.q_len()), values(2, c.kv_len()), values(3, c.kv_len()), values(4, c.q_len()));
        let (q32, k32, v32, d32) = (narrow(&q), narrow(&k), narrow(&v), narrow(&d_out));
        let f = forward(&c, &q32, &k32, &v32);
        let (out, probs) = forward_f64(&c, &widen(&q32), &widen(&k32), &widen(&v32));
        assert_eq!((f.out, f.probs), (narrow(&out), narrow(&probs)));
        let g = backward(&c, &q32, &k32, &v32, &d32);
        let [dq, dk, dv] = backward_f64(&c, &widen(&q32), &widen(&k32), &widen(&v32), &widen(&d32));
        assert_eq!((g.dq, g.dk, g.dv), (narrow(&dq), narrow(&dk), narrow(&dv)));
    }
}
