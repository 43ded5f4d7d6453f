//! The mask rule of an [`AttentionShape`] (TE's `get_full_mask`): which keys a query attends
//! for the valid lengths of its sequence.

use super::AttentionShape;
use std::ops::Range;

impl AttentionShape {
    /// The valid `(queries, keys)` of one sequence: `(sq, sk)`, or for a sequence of `seq_len`
    /// valid positions (a padding mask's length, TE's one length for queries and keys) `(min(len,
    /// sq), min(len, sk))`. `thd` sequences take their lengths from `cu_seqlens` instead.
    pub fn valid_lengths(&self, seq_len: Option<usize>) -> (usize, usize) {
        match seq_len {
            Some(len) => (len.min(self.sq), len.min(self.sk)),
            None => (self.sq, self.sk),
        }
    }

    /// The keys query `i` of a sequence with `(lq, lk)` valid queries and keys attends: one
    /// contiguous range within `0..lk` (`0..0` when empty, e.g. for `i >= lq`). With `t = i + off` its diagonal (`off = lk − lq`
    /// bottom-right, else 0) and `(left, right)` the window: `j < lk`, `j <= t` for causal masks,
    /// `j >= t − left` and `j <= t + right` for the window's bounded sides (TE's
    /// `get_full_mask`; the kernels skip and mask the same keys).
    pub fn keys(&self, (lq, lk): (usize, usize), i: usize) -> Range<usize> {
        if i >= lq {
            return 0..0;
        }
        let off = if self.bottom_right() { lk as i64 - lq as i64 } else { 0 };
        let t = i as i64 + off;
        let (left, right) = self.window;
        let mut hi = lk as i64; // exclusive
        if self.mask.is_causal() {
            hi = hi.min(t + 1);
        }
        if right >= 0 {
            hi = hi.min(t + right + 1);
        }
        let lo = if left >= 0 { (t - left).max(0) } else { 0 };
        if lo < hi {
            lo as usize..hi as usize
        } else {
            0..0
        }
    }

    /// Whether query `i` of a sequence with `(lq, lk)` valid queries and keys
    /// ([`AttentionShape::valid_lengths`]) attends key `j` ([`AttentionShape::keys`]); `false` is
    /// TE's `true` = masked out. A query that attends no key gets a zero output.
    pub fn attends(&self, lengths: (usize, usize), i: usize, j: usize) -> bool {
        self.keys(lengths, i).contains(&j)
    }
}

#[cfg(test)]
mod tests {
    use super::super::QkvLayout;
    use super::*;
    use te_codegen::spec::AttnMaskType::{self, *};

    const OP: &str = "test";

    /// TE's diagonals and windows on a 3 × 5 sequence (sq < sk, as in decoding), and the padding
    /// lengths capped by sq and sk.
    #[test]
    fn attends_follows_te() {
        let visible = |mask, window, lengths: (usize, usize), i| -> Vec<usize> {
            let s = AttentionShape::new(QkvLayout::Bshd, 1, (3, 5), (1, 1), 1).with_mask(mask, window);
            s.validate(OP).unwrap();
            (0..5).filter(|&j| s.attends(lengths, i, j)).collect()
        };
        assert_eq!(visible(Causal, None, (3, 5), 0), [0]);
        assert_eq!(visible(CausalBottomRight, None, (3, 5), 0), [0, 1, 2]);
        assert_eq!(visible(CausalBottomRight, None, (3, 5), 2), [0, 1, 2, 3, 4]);
        assert_eq!(visible(CausalBottomRight, Some((1, 0)), (3, 5), 2), [3, 4]);
        assert_eq!(visible(Causal, Some((1, 0)), (3, 5), 2), [1, 2]);
        assert_eq!(visible(NoMask, Some((0, 1)), (3, 5), 0), [2, 3], "no_mask windows are bottom-right aligned");
        assert_eq!(visible(NoMask, None, (3, 5), 1), [0, 1, 2, 3, 4]);
        // Padding lengths 2: the diagonal ends at the last valid key; queries past 2 see nothing.
        let s = AttentionShape::new(QkvLayout::Bshd, 1, (3, 5), (1, 1), 1);
        assert_eq!(s.valid_lengths(Some(2)), (2, 2));
        assert_eq!(s.valid_lengths(Some(4)), (3, 4));
        assert_eq!(s.valid_lengths(None), (3, 5));
        assert_eq!(visible(PaddingCausalBottomRight, None, (2, 2), 1), [0, 1]);
        assert_eq!(visible(PaddingCausalBottomRight, None, (2, 2), 2), Vec::<usize>::new());
        assert_eq!(visible(PaddingCausal, None, (3, 3), 0), [0]);
        assert_eq!(visible(Padding, None, (0, 0), 0), Vec::<usize>::new(), "a sequence of length 0");
        // sq > sk bottom-right: the first queries see no key.
        let s = AttentionShape::new(QkvLayout::Bshd, 1, (5, 3), (1, 1), 1).with_mask(CausalBottomRight, None);
        assert_eq!((s.keys((5, 3), 1), s.keys((5, 3), 2), s.keys((5, 3), 4)), (0..0, 0..1, 0..3));
    }

    /// `keys` is TE's elementwise rule (`get_full_mask`) for every mask, window and length pair.
    #[test]
    fn keys_is_the_elementwise_rule() {
        for (sq, sk) in [(3, 6), (6, 3), (4, 4), (1, 7)] {
            for mask in AttnMaskType::ALL {
                for window in [None, Some((1, 0)), Some((0, 0)), Some((2, 1)), Some((-1, -1)), Some((0, 3))] {
                    let s = AttentionShape::new(QkvLayout::Sbhd, 1, (sq, sk), (1, 1), 1).with_mask(mask, window);
                    if s.validate(OP).is_err() {
                        continue;
                    }
                    for lengths in [(sq, sk), (sq.min(2), sk.min(2)), (0, 0), (sq, 1)] {
                        let (lq, lk) = lengths;
                        for i in 0..sq {
                            let t = i as i64 + if mask.is_bottom_right() { lk as i64 - lq as i64 } else { 0 };
                            let (left, right) = s.window;
                            for j in 0..sk {
                                let jj = j as i64;
                                let want = i < lq
                                    && j < lk
                                    && !(mask.is_causal() && jj > t
                                        || left >= 0 && jj < t - left
                                        || right >= 0 && jj > t + right);
                                assert_eq!(
                                    s.attends(lengths, i, j),
                                    want,
                                    "{} {window:?} {lengths:?} ({i}, {j})",
                                    mask.name()
                                );
                            }
                            let keys = s.keys(lengths, i);
                            assert!(keys.end <= lk && (keys.start < keys.end || keys == (0..0)), "{keys:?}");
                        }
                    }
                }
            }
        }
    }
}
