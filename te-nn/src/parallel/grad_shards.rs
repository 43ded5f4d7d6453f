//! Which rank owns which elements of each parameter's gradient in a ZeRO-2 run ([`GradShards`]),
//! and what one gradient bucket of a backward does with it ([`GradShards::calls`],
//! [`GradShards::released`]): each piece of a gradient is reduced to the rank that owns it
//! (DeepSpeed ZeRO stage 2, Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
//! Trillion Parameter Models"; Megatron-LM's distributed optimizer reduce-scatters its gradient
//! buffer to the same owners, `megatron/core/distributed/param_and_grad_buffer.py`), and a rank
//! releases the gradients of the parameters it owns no piece of. The split itself is the
//! optimizer's (`te_train::optim::Partition`, contiguous pieces of the flattened parameters);
//! this is the part [`super::DataParallel`] needs of it.

use std::ops::Range;
use te_runtime::{Error, Result};

const MODULE: &str = "GradShards";

/// One rank's piece of one parameter's gradient.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// The rank that owns it (the root its reduction goes to).
    pub root: usize,
    /// Its elements (flattened, row-major), non-empty.
    pub range: Range<usize>,
}

/// One `ncclReduce` of a bucket: the elements `range` of parameter `param`'s gradient reduced
/// to rank `root`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReduceCall {
    /// The parameter's index in the whole model's traversal order.
    pub param: usize,
    /// The elements reduced, a piece of the gradient.
    pub range: Range<usize>,
    /// The rank that owns the piece.
    pub root: usize,
}

/// The owners of every parameter's gradient pieces over a data-parallel group of `world` ranks,
/// parameters in the whole model's traversal order (see the module docs). Every rank holds the
/// same one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GradShards {
    world: usize,
    /// Each parameter's pieces, in increasing element (and rank) order, covering it.
    owners: Vec<Vec<Shard>>,
}

impl GradShards {
    /// The owners `owners[i]` of parameter `i`'s pieces over `world` ranks: each parameter's
    /// pieces, in order, must be non-empty ranges from element 0 on, each starting where the
    /// previous ended, owned by increasing ranks below `world` (a contiguous split of the
    /// flattened parameters, as `te_train::optim::Partition` makes). A parameter of no elements
    /// has no pieces.
    ///
    /// # Errors
    /// [`Error::Argument`] for `world` 0 or pieces not as above (naming the parameter).
    pub fn new(world: usize, owners: Vec<Vec<Shard>>) -> Result<Self> {
        if world == 0 {
            return Err(Error::Argument { op: MODULE, message: "a group of 0 ranks: pass the group's size".into() });
        }
        for (param, shards) in owners.iter().enumerate() {
            let mut next = 0;
            let mut last_root = None;
            for s in shards {
                let ordered = last_root.is_none_or(|r| s.root > r);
                if s.range.start != next || s.range.is_empty() || s.root >= world || !ordered {
                    return Err(Error::Argument {
                        op: MODULE,
                        message: format!(
                            "parameter {param}: pieces {shards:?} over {world} ranks; each must be non-empty, start \
                             where the one before ended (the first at 0) and belong to a later rank below {world}"
                        ),
                    });
                }
                next = s.range.end;
                last_root = Some(s.root);
            }
        }
        Ok(Self { world, owners })
    }

    /// Ranks of the group.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Parameters described.
    pub fn len(&self) -> usize {
        self.owners.len()
    }

    /// Whether no parameter is described.
    pub fn is_empty(&self) -> bool {
        self.owners.is_empty()
    }

    /// Parameter `param`'s pieces (none past the last parameter).
    pub fn shards(&self, param: usize) -> &[Shard] {
        self.owners.get(param).map_or(&[], Vec::as_slice)
    }

    /// Elements of parameter `param` (the end of its last piece; 0 past the last parameter).
    pub fn numel(&self, param: usize) -> usize {
        self.shards(param).last().map_or(0, |s| s.range.end)
    }

    /// Whether rank `rank` owns a piece of parameter `param`.
    pub fn owns(&self, rank: usize, param: usize) -> bool {
        self.shards(param).iter().any(|s| s.root == rank)
    }

    /// The reductions a bucket of the parameters `params` (traversal indices, in the order the
    /// bucket hands them out) issues, in that order: one per piece, to its owner. Every rank
    /// computes the same list, so their NCCL calls match.
    pub fn calls(&self, params: &[usize]) -> Vec<ReduceCall> {
        params
            .iter()
            .flat_map(|&param| {
                self.shards(param).iter().map(move |s| ReduceCall { param, range: s.range.clone(), root: s.root })
            })
            .collect()
    }

    /// The parameters of `params` whose gradients rank `rank` releases once the bucket's
    /// reductions are done: those it owns no piece of (a parameter split over several ranks
    /// keeps its gradient whole on each of them; only the owned elements are read).
    pub fn released(&self, rank: usize, params: &[usize]) -> Vec<usize> {
        params.iter().copied().filter(|&p| !self.owns(rank, p)).collect()
    }

    /// Gradient bytes rank `rank` keeps (those of the parameters it owns a piece of) and
    /// releases, for gradients of `elem` bytes an element.
    pub fn kept_and_released_bytes(&self, rank: usize, elem: u64) -> (u64, u64) {
        (0..self.len()).fold((0, 0), |(kept, released), p| {
            let bytes = self.numel(p) as u64 * elem;
            if self.owns(rank, p) {
                (kept + bytes, released)
            } else {
                (kept, released + bytes)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shard(root: usize, range: Range<usize>) -> Shard {
        Shard { root, range }
    }

    /// Three parameters over 2 ranks: the first rank 0's, the second split at 512, the third
    /// rank 1's; an empty one between.
    fn example() -> GradShards {
        let owners =
            vec![vec![shard(0, 0..300)], vec![shard(0, 0..512), shard(1, 512..1000)], vec![], vec![shard(1, 0..40)]];
        GradShards::new(2, owners).unwrap()
    }

    #[test]
    fn a_bucket_reduces_each_piece_to_its_owner_in_the_buckets_order() {
        let g = example();
        assert_eq!((g.world(), g.len(), g.numel(1), g.numel(2), g.numel(9)), (2, 4, 1000, 0, 0));
        // A bucket hands out the head first, as a backward does.
        let calls = g.calls(&[3, 2, 1]);
        let want = [
            ReduceCall { param: 3, range: 0..40, root: 1 },
            ReduceCall { param: 1, range: 0..512, root: 0 },
            ReduceCall { param: 1, range: 512..1000, root: 1 },
        ];
        assert_eq!(calls, want);
        assert_eq!(g.calls(&[0]), [ReduceCall { param: 0, range: 0..300, root: 0 }]);
        assert!(g.calls(&[]).is_empty() && g.calls(&[2]).is_empty(), "an empty parameter reduces nothing");
    }

    #[test]
    fn a_rank_releases_the_gradients_it_owns_nothing_of() {
        let g = example();
        assert_eq!(g.released(0, &[3, 2, 1, 0]), [3, 2], "rank 0 keeps the split parameter whole");
        assert_eq!(g.released(1, &[3, 2, 1, 0]), [2, 0]);
        assert!(g.owns(0, 1) && g.owns(1, 1) && !g.owns(1, 0) && !g.owns(0, 7));
        // bf16: rank 0 keeps 300 + 1000 elements, releases 40; rank 1 keeps 1040, releases 300.
        assert_eq!(g.kept_and_released_bytes(0, 2), (2600, 80));
        assert_eq!(g.kept_and_released_bytes(1, 2), (2080, 600));
        // One rank owns everything and releases nothing.
        let one = GradShards::new(1, vec![vec![shard(0, 0..5)], vec![shard(0, 0..3)]]).unwrap();
        assert!(one.released(0, &[1, 0]).is_empty());
        assert_eq!(one.calls(&[1, 0]).iter().map(|c| c.root).collect::<Vec<_>>(), [0, 0]);
    }

    #[test]
    fn pieces_that_are_not_a_contiguous_split_are_refused() {
        let bad = [
            (2, vec![vec![shard(0, 1..4)]]),                 // not from 0
            (2, vec![vec![shard(0, 0..4), shard(1, 5..8)]]), // a gap
            (2, vec![vec![shard(0, 0..4), shard(1, 2..8)]]), // an overlap
            (2, vec![vec![shard(1, 0..4), shard(0, 4..8)]]), // ranks out of order
            (2, vec![vec![shard(2, 0..4)]]),                 // a root past the group
            (2, vec![vec![shard(0, 0..0)]]),                 // an empty piece
            (0, vec![]),                                     // no ranks
        ];
        for (world, owners) in bad {
            let e = GradShards::new(world, owners.clone()).unwrap_err();
            assert!(matches!(e, Error::Argument { .. }), "{owners:?}: {e}");
        }
        assert!(GradShards::new(3, vec![]).unwrap().is_empty());
    }
}
