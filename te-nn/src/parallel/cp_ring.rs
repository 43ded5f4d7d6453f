//! The ring (p2p) exchange of context parallelism (TE's `cp_comm_type="p2p"`,
//! `AttnFuncWithCPAndKVP2P` in `pytorch/attention/dot_product_attention/context_parallel.py`):
//! which communication a [`super::ContextParallel`] uses ([`CpCommType`]) and the ring's
//! schedule ([`ring_schedule`]).
//!
//! **The ring.** Each of the `cp` ranks holds its two chunks of queries, keys and values
//! (chunks `r` and `2·cp − 1 − r` of `c` tokens). In `cp` steps the keys and values travel
//! around the ring (rank `r` sends to `r + 1` and receives from `r − 1`, on a side stream,
//! beside the attention of the ones in hand): at step `i` rank `r` holds those of rank `(r −
//! i) mod cp`. With a causal mask (TE's load-balanced schedule) each step computes one of:
//!
//! - step 0, the rank's own keys: both query chunks over both key chunks, causal (the local
//!   `[2c, 2c]` problem with the causal diagonal: chunk `r` sees chunk `r` causally and not
//!   chunk `2·cp − 1 − r`, chunk `2·cp − 1 − r` sees chunk `r` whole and itself causally);
//! - `1 ≤ i ≤ r` (keys of a lower rank `j < r`): both query chunks over the first key chunk `j`,
//!   no mask (both query chunks come after it; chunk `2·cp − 1 − j` comes after both);
//! - `i > r` (keys of a higher rank `j > r`): the second query chunk `2·cp − 1 − r` over both key
//!   chunks, no mask (chunk `r` comes before both of them, chunk `2·cp − 1 − r` after both).
//!
//! Every step after the first is a `2c × c` (or `c × 2c`) block of unmasked pairs, so every
//! rank does the same work at every step. Without a mask, every step is both query chunks over
//! both key chunks. Each step's output and `softmax_lse` are merged into the result by the LSE
//! merge (`te_runtime::ops::attn_merge`, in f32). The backward runs the same ring: the query
//! gradient accumulates locally, the key and value gradients travel with their keys and values
//! (one step behind them) and reach their rank after the last step.

use std::fmt;
use std::str::FromStr;
use te_runtime::{Error, Result};

/// How the attention of context parallelism gets the other ranks' keys and values (TE's
/// `cp_comm_type`; `"p2p"` is TE's default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum CpCommType {
    /// `"p2p"`: keys and values passed around the ring, one rank's a step, beside the attention
    /// of the ones in hand; outputs merged by their LSE (TE's `AttnFuncWithCPAndKVP2P`).
    #[default]
    P2p,
    /// `"all_gather"`: every rank's keys and values all-gathered before the attention, their
    /// gradients reduce-scattered after it (TE's `AttnFuncWithCPAndKVAllGather`).
    AllGather,
}

impl CpCommType {
    /// TE's name: `p2p` or `all_gather`.
    pub fn name(self) -> &'static str {
        match self {
            CpCommType::P2p => "p2p",
            CpCommType::AllGather => "all_gather",
        }
    }
}

impl fmt::Display for CpCommType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for CpCommType {
    type Err = Error;

    /// `p2p` or `all_gather` (TE's names; `allgather` too).
    ///
    /// # Errors
    /// [`Error::Config`] for another name (TE's `a2a` and `a2a+p2p` are not built).
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "p2p" => Ok(CpCommType::P2p),
            "all_gather" | "allgather" => Ok(CpCommType::AllGather),
            other => Err(Error::Config {
                module: "ContextParallel",
                message: format!("cp_comm_type {other:?}: use p2p or all_gather (a2a and a2a+p2p are not built)"),
            }),
        }
    }
}

/// Which of a rank's two chunks (of queries, or of the keys in hand) a ring step uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Halves {
    /// Both chunks, `[2c, ...]`.
    Both,
    /// The first chunk (`r` of the rank `r` that holds them), rows `0..c`.
    First,
    /// The second chunk (`2·cp − 1 − r`), rows `c..2c`.
    Second,
}

impl Halves {
    /// The local rows `0..2c` it covers, for chunks of `c` tokens.
    pub fn rows(self, c: usize) -> std::ops::Range<usize> {
        match self {
            Halves::Both => 0..2 * c,
            Halves::First => 0..c,
            Halves::Second => c..2 * c,
        }
    }
}

/// One step of the ring on one rank (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RingStep {
    /// The step, `0..cp`.
    pub step: usize,
    /// The rank whose keys and values are in hand: `(rank − step) mod cp`.
    pub kv_rank: usize,
    /// The query chunks that attend.
    pub queries: Halves,
    /// The key chunks they attend over.
    pub keys: Halves,
    /// Whether the step is causal (top-left diagonal over the local rows: step 0 only);
    /// otherwise unmasked.
    pub causal: bool,
}

/// The ring's steps on `rank` of `cp` ranks (TE's load-balanced schedule for a causal mask;
/// every step both chunks over both without one).
pub fn ring_schedule(cp: usize, rank: usize, causal: bool) -> Vec<RingStep> {
    (0..cp)
        .map(|step| {
            let kv_rank = (rank + cp - step) % cp;
            let (queries, keys, causal) = match (causal, step) {
                (false, _) => (Halves::Both, Halves::Both, false),
                (true, 0) => (Halves::Both, Halves::Both, true),
                (true, i) if i <= rank => (Halves::Both, Halves::First, false),
                (true, _) => (Halves::Second, Halves::Both, false),
            };
            RingStep { step, kv_rank, queries, keys, causal }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The global chunks of rank `r`: `r` and `2·cp − 1 − r`.
    fn chunk_ids(cp: usize, r: usize) -> [usize; 2] {
        [r, 2 * cp - 1 - r]
    }

    /// The global token of local row `row` of rank `r` (chunks of `c`).
    fn global(cp: usize, r: usize, c: usize, row: usize) -> usize {
        chunk_ids(cp, r)[row / c] * c + row % c
    }

    /// The (query, key) pairs of global positions each rank's steps compute: with a causal mask
    /// exactly the causal pairs of its queries over the whole sequence, each once; without one,
    /// every pair once.
    #[test]
    fn the_steps_cover_each_visible_pair_once() {
        let c = 3;
        for cp in 1..=6 {
            for causal in [true, false] {
                for r in 0..cp {
                    let mut seen = BTreeSet::new();
                    for s in ring_schedule(cp, r, causal) {
                        assert_eq!(s.kv_rank, (r + cp - s.step) % cp);
                        for qi in s.queries.rows(c) {
                            for kj in s.keys.rows(c) {
                                if s.causal && kj > qi {
                                    continue;
                                }
                                let pair = (global(cp, r, c, qi), global(cp, s.kv_rank, c, kj));
                                assert!(seen.insert(pair), "cp {cp} rank {r}: {pair:?} twice");
                            }
                        }
                    }
                    let want: BTreeSet<_> = (0..2 * c)
                        .flat_map(|qi| {
                            let q = global(cp, r, c, qi);
                            (0..2 * cp * c).filter(move |&k| !causal || k <= q).map(move |k| (q, k))
                        })
                        .collect();
                    assert_eq!(seen, want, "cp {cp} rank {r} causal {causal}");
                }
            }
        }
    }

    /// TE's schedule: the diagonal first, then the lower ranks' first chunks, then the higher
    /// ranks' keys for the second query chunk; every step after the first of equal size.
    #[test]
    fn the_causal_schedule_is_load_balanced() {
        let steps = ring_schedule(4, 1, true);
        let kinds: Vec<_> = steps.iter().map(|s| (s.kv_rank, s.queries, s.keys, s.causal)).collect();
        assert_eq!(
            kinds,
            [
                (1, Halves::Both, Halves::Both, true),
                (0, Halves::Both, Halves::First, false),
                (3, Halves::Second, Halves::Both, false),
                (2, Halves::Second, Halves::Both, false),
            ]
        );
        for cp in 2..=8 {
            for r in 0..cp {
                for s in &ring_schedule(cp, r, true)[1..] {
                    assert_eq!(s.queries.rows(5).len() * s.keys.rows(5).len(), 2 * 5 * 5, "cp {cp} rank {r}");
                }
            }
        }
    }

    /// The ring's forward on the CPU oracle: each rank's steps (the keys and values of the rank
    /// in hand, the schedule's query rows and key prefix, its mask) merged by the LSE merge give
    /// that rank's rows of the whole sequence's attention, causal or not, with GQA.
    #[test]
    fn merged_steps_on_the_oracle_are_the_whole_attention() {
        use te_codegen::spec::AttnMaskType;
        use te_reference::{attention, attn_merge};
        use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
        let (c, b, h, g, d) = (3, 2, 4, 2, 8);
        let values = |seed: usize, n: usize| -> Vec<f32> {
            (0..n).map(|i| (((i * 7919 + seed * 104_729) % 97) as f32 - 48.0) / 40.0).collect()
        };
        // Rows `range` of a sequence-first buffer of `per` values a row.
        let rows = |x: &[f32], per: usize, r: std::ops::Range<usize>| x[r.start * per..r.end * per].to_vec();
        for cp in 1..=3 {
            let s = 2 * cp * c;
            let whole = AttentionShape::new(QkvLayout::Sbhd, b, (s, s), (h, g), d);
            let (q, k, v) = (values(1, whole.q_len()), values(2, whole.kv_len()), values(3, whole.v_len()));
            let (qp, kp, op) = (b * h * d, b * g * d, b * h * d);
            // A rank's local rows: its chunks r and 2·cp − 1 − r stacked.
            let local = |x: &[f32], per: usize, r: usize| {
                [chunk_ids(cp, r)[0], chunk_ids(cp, r)[1]]
                    .iter()
                    .flat_map(|&i| rows(x, per, i * c..(i + 1) * c))
                    .collect::<Vec<_>>()
            };
            for causal in [true, false] {
                let mask = if causal { AttnMaskType::Causal } else { AttnMaskType::NoMask };
                let want = attention::forward(&whole.with_mask(mask, None), None, &q, &k, &v).out;
                for r in 0..cp {
                    let acc = AttentionShape { sq: 2 * c, sk: 2 * c, ..whole };
                    let (mut out, mut lse) = (vec![0.0; acc.out_len()], vec![0.0; acc.lse_len()]);
                    let ql = local(&q, qp, r);
                    for st in ring_schedule(cp, r, causal) {
                        let (kl, vl) = (local(&k, kp, st.kv_rank), local(&v, kp, st.kv_rank));
                        let (qr, kr) = (st.queries.rows(c), st.keys.rows(c));
                        let mask = if st.causal { AttnMaskType::Causal } else { AttnMaskType::NoMask };
                        let shape = AttentionShape { sq: qr.len(), sk: kr.len(), ..whole }.with_mask(mask, None);
                        let (qs, ks, vs) = (rows(&ql, qp, qr.clone()), rows(&kl, kp, kr.clone()), rows(&vl, kp, kr));
                        let o = attention::forward(&shape, None, &qs, &ks, &vs).out;
                        let l = attention::lse(&shape, None, &qs, &ks);
                        attn_merge::merge_step(&acc, &mut out, &mut lse, &shape, &o, &l, qr.start, st.step == 0);
                    }
                    for (i, (got, want)) in out.iter().zip(local(&want, op, r)).enumerate() {
                        assert!((got - want).abs() < 1e-5, "cp {cp} rank {r} causal {causal}: [{i}] {got} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn comm_types_parse_by_te_names() {
        assert_eq!("p2p".parse::<CpCommType>().unwrap(), CpCommType::P2p);
        assert_eq!("all_gather".parse::<CpCommType>().unwrap(), CpCommType::AllGather);
        assert_eq!(CpCommType::default(), CpCommType::P2p);
        assert_eq!(CpCommType::AllGather.to_string(), "all_gather");
        let e = "a2a".parse::<CpCommType>().unwrap_err().to_string();
        assert!(e.contains("p2p or all_gather"), "{e}");
    }
}
