//! Where attention's per-head matrices sit in `bshd`/`sbhd` tensors, and the strided batched
//! GEMMs that run the three per-head products over them without copies.
//!
//! A tensor of `n` heads of `w` channels (`head_dim` for q and k, `head_dim_v` for v and the
//! output) over `seq` positions holds head `j` of batch `b` as a `[seq, w]` matrix with rows `n ·
//! w` (bshd) or `batch · n · w` (sbhd) elements apart; the heads of one batch start `w` apart, and in sbhd batch `b + 1` continues where batch `b`
//! ends. So with `hpg = heads / groups` query heads per key/value group, and query head
//! `j = group · hpg + r`, the (batch, group) pairs of one `r` sit at constant strides: all
//! `batch · groups` pairs in sbhd, the `groups` pairs of each batch in bshd. One GEMM call covers
//! such a run of pairs, for each `r` (and each batch in bshd). Scores `[batch, heads, sq, sk]` are
//! dense, pairs `hpg · sq · sk` apart.

use super::{QkvFormat, MODULE};
use te_runtime::gemm::{MatrixView, StridedBatch};
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::{Error, Result};

/// The per-head products, each `D = A · Bᵀ` on head matrices of `w` channels ([`calls`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Product {
    /// `[sq, sk] = [sq, w] · [sk, w]ᵀ` per query head: `S = Q · Kᵀ` (`w = head_dim`), `dP = dO ·
    /// Vᵀ` (`head_dim_v`).
    QueryKeyT,
    /// `[sq, w] = [sq, sk] · [sk, w]` per query head: `O = P · V` (`head_dim_v`), `dQ = dS · K`
    /// (`head_dim`).
    ScoresKey,
    /// `[sk, w] = Σ_r [sq, sk]ᵀ · [sq, w]` per key head, summed over the `hpg` query heads of its
    /// group: `dV = Pᵀ · dO` (`head_dim_v`), `dK = dSᵀ · Q` (`head_dim`).
    ScoresTQuery,
}

/// One strided batched GEMM of a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Call {
    pub batch: StridedBatch,
    /// Adds to the output (the second and later query heads of a group in
    /// [`Product::ScoresTQuery`]).
    pub accumulate: bool,
}

/// The dense format of the unfused backend's call.
///
/// # Errors
/// [`Error::Internal`] for `thd`, which only the fused backend runs (the module refuses it before).
pub(super) fn format(s: &AttentionShape) -> Result<QkvFormat> {
    s.layout.format().ok_or_else(|| Error::internal(MODULE, "a thd call reached the unfused backend"))
}

/// `[batch, sq, heads · head_dim_v]` (bshd) or `[sq, batch, heads · head_dim_v]` (sbhd): the
/// output, laid out as q.
///
/// # Errors
/// As [`format`].
pub(super) fn out_shape(s: &AttentionShape) -> Result<Vec<usize>> {
    let [a, b, h, d] = format(s)?.shape(s.batch, s.sq, s.heads, s.head_dim_v);
    Ok(vec![a, b, h * d])
}

/// The shape of k (`w = head_dim`) or v (`head_dim_v`).
///
/// # Errors
/// As [`format`].
pub(super) fn kv_shape(s: &AttentionShape, w: usize) -> Result<[usize; 4]> {
    Ok(format(s)?.shape(s.batch, s.sk, s.groups, w))
}

/// The `[seq, w]` matrices of a tensor of `n` heads of `w` channels over `seq` positions, from
/// head `head` of batch `batch` on, consecutive matrices `step` heads apart.
fn heads(
    s: &AttentionShape,
    format: QkvFormat,
    (seq, n, w): (usize, usize, usize),
    (batch, head, step): (usize, usize, usize),
) -> MatrixView {
    let (batch_offset, row_stride) = match format {
        QkvFormat::Bshd => (batch * seq * n * w, n * w),
        QkvFormat::Sbhd => (batch * n * w, s.batch * n * w),
    };
    MatrixView { offset: batch_offset + head * w, rows: seq, cols: w, row_stride, batch_stride: step * w }
}

/// Scores of query heads `r` of each group, from batch `batch` on.
fn scores(s: &AttentionShape, batch: usize, r: usize) -> MatrixView {
    let plane = s.sq * s.sk;
    MatrixView {
        offset: (batch * s.heads + r) * plane,
        rows: s.sq,
        cols: s.sk,
        row_stride: s.sk,
        batch_stride: s.heads_per_group() * plane,
    }
}

/// Runs of (batch, group) pairs at constant strides: `(first batch, pairs)`.
fn runs(s: &AttentionShape, format: QkvFormat) -> Vec<(usize, usize)> {
    match format {
        QkvFormat::Sbhd => vec![(0, s.batch * s.groups)],
        QkvFormat::Bshd => (0..s.batch).map(|b| (b, s.groups)).collect(),
    }
}

/// The GEMMs of `product` on head matrices of `w` channels: operands `a`, `b` and output as the
/// product's doc says, query heads `r` of each group (q, the output, their gradients) against the
/// key/value heads (k, v, their gradients).
///
/// # Errors
/// As [`format`].
pub(super) fn calls(s: &AttentionShape, product: Product, w: usize) -> Result<Vec<Call>> {
    let format = format(s)?;
    let mut calls = Vec::new();
    for (batch, count) in runs(s, format) {
        for r in 0..s.heads_per_group() {
            let q = heads(s, format, (s.sq, s.heads, w), (batch, r, s.heads_per_group()));
            let k = heads(s, format, (s.sk, s.groups, w), (batch, 0, 1));
            let d_scores = scores(s, batch, r);
            let (a, a_transposed, b, b_transposed, d) = match product {
                Product::QueryKeyT => (q, false, k, false, d_scores),
                // B = the key matrix `[sk, d]` read as `[d, sk]`: stored transposed.
                Product::ScoresKey => (d_scores, false, k, true, q),
                Product::ScoresTQuery => (d_scores, true, q, true, k),
            };
            let batch = StridedBatch { count, a, a_transposed, b, b_transposed, d };
            calls.push(Call { batch, accumulate: product == Product::ScoresTQuery && r > 0 });
        }
    }
    Ok(calls)
}

#[cfg(test)]
mod tests {
    use super::super::mask::{byte_mask, kernel_mask};
    use super::super::AttnMaskType;
    use super::*;
    use crate::modules::init::normal;
    use te_codegen::spec::MaskKind;
    use te_codegen::DType;
    use te_reference::attention as reference;
    use te_reference::gemm::gemm_strided_batched;
    use te_reference::softmax;
    use te_runtime::numerics;
    use te_runtime::ops::attention_shape::QkvLayout;

    fn values(seed: u64, n: usize) -> Vec<f32> {
        normal(n, 1.0, seed)
    }

    /// Runs the calls of `product` on host slices.
    fn run(dims: &AttentionShape, product: Product, w: usize, a: &[f32], b: &[f32], d: &mut [f32]) {
        for call in calls(dims, product, w).unwrap() {
            gemm_strided_batched(a, b, d, &call.batch, 1.0, call.accumulate);
        }
    }

    /// The unfused forward and backward with the plan's GEMMs on the host (every intermediate
    /// rounded to `dtype`, as the GPU stores it; key gradients of groups in f32), against the
    /// f64 reference: relative Frobenius error below `rtol`, and elementwise `|got - want| <=
    /// rtol · |want| + atol · max |want|`.
    fn check((case, seq_lens): &(AttentionShape, Option<&[usize]>), dtype: DType, rtol: f32, atol: f32) {
        let (dims, seq_lens) = (case, *seq_lens);
        let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| numerics::round_to(dtype, x)).collect() };
        let (d, dv_w) = (dims.head_dim, dims.head_dim_v);
        let (q_len, out_len) = (case.q_len(), case.out_len());
        let (kv_len, v_len) = (case.kv_len(), case.v_len());
        let s_len = dims.scores_shape().iter().product();
        let (q, k, v, d_out) =
            (round(values(1, q_len)), round(values(2, kv_len)), round(values(3, v_len)), round(values(4, out_len)));
        let kind = kernel_mask(case.mask, case.window);
        let mask = match kind {
            MaskKind::Padding => byte_mask(case, seq_lens),
            MaskKind::None | MaskKind::Causal => Vec::new(),
        };
        let mut s = vec![f32::NAN; s_len];
        run(dims, Product::QueryKeyT, d, &q, &k, &mut s);
        let p = round(softmax::forward(&round(s), kind, &mask, dims.heads, dims.sq, dims.sk, case.scale));
        let mut out = vec![f32::NAN; out_len];
        run(dims, Product::ScoresKey, dv_w, &p, &v, &mut out);
        let mut dv = vec![f32::NAN; v_len];
        run(dims, Product::ScoresTQuery, dv_w, &p, &d_out, &mut dv);
        let mut dp = vec![f32::NAN; s_len];
        run(dims, Product::QueryKeyT, dv_w, &d_out, &v, &mut dp);
        let ds = round(softmax::backward(&round(dp), &p, dims.sk, case.scale));
        let mut dq = vec![f32::NAN; q_len];
        run(dims, Product::ScoresKey, d, &ds, &k, &mut dq);
        let mut dk = vec![f32::NAN; kv_len];
        run(dims, Product::ScoresTQuery, d, &ds, &q, &mut dk);

        let want = reference::forward(case, seq_lens, &q, &k, &v);
        let grads = reference::backward(case, seq_lens, &q, &k, &v, &d_out);
        let what = format!("{:?} {} groups {}", case.layout, case.mask.name(), case.groups);
        for (name, got, want) in [
            ("out", round(out), &want.out),
            ("dq", round(dq), &grads.dq),
            ("dk", round(dk), &grads.dk),
            ("dv", round(dv), &grads.dv),
        ] {
            let amax = want.iter().fold(0f32, |a, &w| a.max(w.abs()));
            let diff: f64 = got.iter().zip(want).map(|(&g, &w)| ((g - w) as f64).powi(2)).sum();
            let norm: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
            let frobenius = (diff / norm).sqrt() as f32;
            assert!(frobenius < rtol, "{what} {name}: relative Frobenius error {frobenius}");
            for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                assert!((g - w).abs() <= rtol * w.abs() + atol * amax, "{what} {name}[{i}]: {g} vs {w} (amax {amax})");
            }
        }
    }

    /// Every format and mask with `sq != sk` where the mask allows, and a sliding window, with
    /// `groups` key/value heads for 4 query heads; `seq_lens` for the padding masks (`sq = sk =
    /// seq_lens[0]` there).
    fn cases<'a>(
        seq_lens: &'a [usize],
        (sq, sk): (usize, usize),
        groups: &[usize],
        (head_dim, head_dim_v): (usize, usize),
    ) -> Vec<(AttentionShape, Option<&'a [usize]>)> {
        let mut cases = Vec::new();
        for format in [QkvFormat::Bshd, QkvFormat::Sbhd] {
            let padded = seq_lens[0];
            for (mask, sq, sk, window) in [
                (AttnMaskType::NoMask, sq, sk, None),
                (AttnMaskType::Causal, sk, sq, None),
                (AttnMaskType::CausalBottomRight, sq, sk, None),
                (AttnMaskType::CausalBottomRight, sk, sq, Some((2, 0))),
                (AttnMaskType::NoMask, sq, sk, Some((1, 2))),
                (AttnMaskType::Padding, padded, padded, None),
                (AttnMaskType::PaddingCausal, padded, padded, None),
                (AttnMaskType::PaddingCausalBottomRight, padded, padded, Some((3, 0))),
            ] {
                for &groups in groups {
                    let shape = AttentionShape::new(format.into(), seq_lens.len(), (sq, sk), (4, groups), head_dim)
                        .with_head_dim_v(head_dim_v)
                        .with_mask(mask, window);
                    cases.push((shape, mask.is_padding().then_some(seq_lens)));
                }
            }
        }
        cases
    }

    #[test]
    fn plan_reproduces_the_reference_in_f32() {
        for case in cases(&[6, 3, 0], (5, 7), &[1, 2, 4], (8, 8)) {
            check(&case, DType::F32, 1e-5, 1e-6);
        }
        // head_dim_v other than head_dim, narrower and wider.
        for dims in [(8, 4), (4, 12)] {
            for case in cases(&[6, 3, 0], (5, 7), &[2], dims) {
                check(&case, DType::F32, 1e-5, 1e-6);
            }
        }
    }

    /// With every intermediate stored in bf16, as on the GPU, the results stay within the
    /// tolerance the GPU tests use: TE's bf16 rtol and an atol of 1% of the largest magnitude
    /// (the rounding of the probabilities and of `dP` is absolute error in outputs near zero).
    /// Measured at the GPU tests' sizes (head_dim 64 and 128, sq and sk 77 to 128), this
    /// emulation needs at most 0.6% and stays below 0.45% relative Frobenius error; here at
    /// smaller sizes that run fast on the host.
    #[test]
    fn bf16_storage_stays_within_the_gpu_tolerance() {
        for case in cases(&[40, 23], (40, 48), &[2], (64, 64)) {
            check(&case, DType::BF16, 1.6e-2, 1e-2);
        }
    }

    #[test]
    fn calls_cover_every_head_once() {
        for format in [QkvFormat::Bshd, QkvFormat::Sbhd] {
            let dims = AttentionShape::new(QkvLayout::from(format), 3, (5, 7), (6, 2), 4);
            let q_len = 3 * 5 * 6 * 4;
            let mut written = vec![0u32; q_len];
            for call in calls(&dims, Product::ScoresKey, 4).unwrap() {
                assert!(!call.accumulate);
                let v = call.batch.d;
                for i in 0..call.batch.count {
                    for r in 0..v.rows {
                        for c in 0..v.cols {
                            written[v.offset + i * v.batch_stride + r * v.row_stride + c] += 1;
                        }
                    }
                }
            }
            assert!(written.iter().all(|&n| n == 1), "{format:?}: {written:?}");
            let calls = calls(&dims, Product::ScoresTQuery, 4).unwrap();
            let counts: Vec<(usize, bool)> = calls.iter().map(|c| (c.batch.count, c.accumulate)).collect();
            // Three query heads per group: the first writes, the others add.
            let per_run = [false, true, true];
            let want: Vec<(usize, bool)> = match format {
                QkvFormat::Sbhd => per_run.map(|acc| (6, acc)).to_vec(),
                QkvFormat::Bshd => (0..3).flat_map(|_| per_run.map(|acc| (2, acc))).collect(),
            };
            assert_eq!(counts, want, "{format:?}");
        }
    }
}
