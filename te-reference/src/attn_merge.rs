//! Family 23 reference: the LSE merge of partial attention outputs of `ops::attn_merge` (the ring
//! of context parallelism), in f32 in the kernel's order: for each query row, `lse' = hi +
//! ln(1 + exp(lo − hi))` of the running and the part's LSE (`hi`/`lo` their larger/smaller; `+inf`,
//! a row that saw no key, weighs nothing), then `out' = exp(lse − lse') · out + exp(lse_i − lse')
//! · out_i`. The accumulators are f32 `out` in the accumulator shape's dense output layout and
//! `lse` `[batch, heads, sq]`.

use te_runtime::ops::attention_shape::AttentionShape;

/// A part's LSE as a weight's exponent (`+inf` and NaN weigh nothing).
fn part_lse(v: f32) -> f32 {
    if v == f32::INFINITY || v.is_nan() {
        f32::NEG_INFINITY
    } else {
        v
    }
}

/// Folds the part `out_step` (`step`'s dense output layout, values widened to f32) with
/// `lse_step` (`[batch, heads, step.sq]`) into the accumulators `out` / `lse` of the queries of
/// `acc`, from query `q_offset` on; `init` sets them instead (the part covers every query).
///
/// # Panics
/// If the part does not fit the accumulators (caller bugs).
#[allow(clippy::too_many_arguments)] // the kernel's arguments, named as there
pub fn merge_step(
    acc: &AttentionShape,
    out: &mut [f32],
    lse: &mut [f32],
    step: &AttentionShape,
    out_step: &[f32],
    lse_step: &[f32],
    q_offset: usize,
    init: bool,
) {
    assert!(q_offset + step.sq <= acc.sq && (step.batch, step.heads) == (acc.batch, acc.heads), "part does not fit");
    assert_eq!((out.len(), lse.len()), (acc.out_len(), acc.lse_len()), "accumulators of the shape");
    assert_eq!((out_step.len(), lse_step.len()), (step.out_len(), step.lse_len()), "part of its shape");
    let (ss, sa) = (step.o_strides(), acc.o_strides());
    for b in 0..acc.batch {
        for h in 0..acc.heads {
            for s in 0..step.sq {
                let r = (b * acc.heads + h) * step.sq + s;
                let ra = (b * acc.heads + h) * acc.sq + q_offset + s;
                let ls = part_lse(lse_step[r]);
                let src = |x| out_step[ss.index(b, s, h, x)];
                let dst = |x| sa.index(b, q_offset + s, h, x);
                if init {
                    for x in 0..acc.head_dim_v {
                        out[dst(x)] = src(x);
                    }
                    lse[ra] = ls;
                    continue;
                }
                let la = lse[ra];
                let (hi, lo) = (la.max(ls), la.min(ls));
                let (merged, wa, ws) = if hi == f32::NEG_INFINITY {
                    (f32::NEG_INFINITY, 0.0, 0.0)
                } else {
                    let m = hi + (lo - hi).exp().ln_1p();
                    (m, (la - m).exp(), (ls - m).exp())
                };
                for x in 0..acc.head_dim_v {
                    let part = if ws == 0.0 { 0.0 } else { src(x) };
                    out[dst(x)] = wa * out[dst(x)] + ws * part;
                }
                lse[ra] = merged;
            }
        }
    }
}

/// The finishing pass: an LSE of `-inf` (a row that saw no key) back to `+inf`, and the second
/// half of each `(sequence, head)`'s rows: `[batch, heads, sq / 2]` (the output is `out` rounded
/// to the output dtype by the caller).
///
/// # Panics
/// If `lse` is not `[batch, heads, sq]` of `acc` or `sq` is odd (caller bugs).
pub fn merge_finish(acc: &AttentionShape, lse: &mut [f32]) -> Vec<f32> {
    assert!(lse.len() == acc.lse_len() && acc.sq % 2 == 0, "lse of the shape, an even number of queries");
    for v in lse.iter_mut() {
        if *v == f32::NEG_INFINITY {
            *v = f32::INFINITY;
        }
    }
    lse.chunks_exact(acc.sq).flat_map(|row| row[acc.sq / 2..].to_vec()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention;
    use te_codegen::spec::AttnMaskType;
    use te_runtime::ops::attention_shape::QkvLayout;

    fn values(seed: usize, n: usize) -> Vec<f32> {
        (0..n).map(|i| (((i * 7919 + seed * 104_729) % 97) as f32 - 48.0) / 30.0).collect()
    }

    /// Rows `range` of a sequence-first `[s, rest]` buffer.
    fn rows(x: &[f32], per_row: usize, range: std::ops::Range<usize>) -> Vec<f32> {
        x[range.start * per_row..range.end * per_row].to_vec()
    }

    /// Attention over all the keys equals the merge of the attentions over two spans of them,
    /// one of which covers only the later half of the queries (the ring's second-half steps),
    /// and the LSE is the whole one's.
    #[test]
    fn merged_parts_equal_the_attention_over_all_keys() {
        // sbhd: 6 queries, 10 keys, batch 2, 4 heads over 2 groups of 3 channels.
        let whole = AttentionShape::new(QkvLayout::Sbhd, 2, (6, 10), (4, 2), 3).with_scale(0.6);
        let (q, k, v) = (values(1, whole.q_len()), values(2, whole.kv_len()), values(3, whole.v_len()));
        let expect = attention::forward(&whole, None, &q, &k, &v).out;
        let expect_lse = attention::lse(&whole, None, &q, &k);
        let (kv_row, q_row, o_row) = (2 * 2 * 3, 2 * 4 * 3, 2 * 4 * 3);
        // Part 1: every query over keys 0..4; part 2: queries 3..6 over keys 4..10; part 3:
        // queries 0..3 over keys 4..10.
        let mut acc_out = vec![0.0; whole.out_len()];
        let mut acc_lse = vec![0.0; whole.lse_len()];
        let first = AttentionShape { sk: 4, ..whole };
        let (k1, v1) = (rows(&k, kv_row, 0..4), rows(&v, kv_row, 0..4));
        let out1 = attention::forward(&first, None, &q, &k1, &v1).out;
        merge_step(&whole, &mut acc_out, &mut acc_lse, &first, &out1, &attention::lse(&first, None, &q, &k1), 0, true);
        let (k2, v2) = (rows(&k, kv_row, 4..10), rows(&v, kv_row, 4..10));
        for span in [3..6, 0..3] {
            let part = AttentionShape { sq: 3, sk: 6, ..whole };
            let qp = rows(&q, q_row, span.clone());
            let out = attention::forward(&part, None, &qp, &k2, &v2).out;
            let lse = attention::lse(&part, None, &qp, &k2);
            merge_step(&whole, &mut acc_out, &mut acc_lse, &part, &out, &lse, span.start, false);
        }
        let half = merge_finish(&whole, &mut acc_lse);
        for (i, (a, e)) in acc_out.iter().zip(&expect).enumerate() {
            assert!((a - e).abs() < 1e-5, "out[{i}] (row {}): {a} vs {e}", i / o_row);
        }
        for (a, e) in acc_lse.iter().zip(&expect_lse) {
            assert!((a - e).abs() < 1e-5, "lse {a} vs {e}");
        }
        let second: Vec<f32> = acc_lse.chunks_exact(6).flat_map(|r| r[3..].to_vec()).collect();
        assert_eq!(half, second, "the second halves of the merged LSE rows");
    }

    /// A part whose rows saw no key (`+inf`, zeros) leaves the accumulators as they were; rows
    /// empty throughout finish as `+inf`.
    #[test]
    fn empty_parts_weigh_nothing() {
        let whole = AttentionShape::new(QkvLayout::Bshd, 1, (2, 4), (1, 1), 2).with_mask(AttnMaskType::NoMask, None);
        let mut out = vec![1.0, 2.0, 3.0, 4.0];
        let mut lse = vec![0.5, f32::NEG_INFINITY];
        let step = whole;
        merge_step(&whole, &mut out, &mut lse, &step, &[0.0; 4], &[f32::INFINITY; 2], 0, false);
        assert_eq!(out[..2], [1.0, 2.0]);
        assert_eq!(lse[0], 0.5);
        assert_eq!(lse[1], f32::NEG_INFINITY);
        assert_eq!(merge_finish(&whole, &mut lse), [f32::INFINITY]);
        assert_eq!(lse, [0.5, f32::INFINITY]);
    }
}
