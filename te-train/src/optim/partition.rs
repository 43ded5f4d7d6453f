//! The partition of a model's optimizer state over the ranks of a data-parallel group (ZeRO
//! stage 1; Megatron-LM's distributed optimizer, `megatron/core/optimizer/distrib_optimizer.py`
//! `_build_model_gbuf_range`): the parameters' elements, flattened in traversal order into one
//! space of `total` elements, split into one contiguous range a rank. Rank `r` owns the
//! intersection of its range with each parameter (its *piece* of the parameter): a parameter
//! may be split over several ranks, and a rank may own no part of a parameter.
//!
//! Each boundary between two ranks is the multiple of `align` elements within the parameter it
//! falls in (or a parameter's end) nearest to `r · total / N`, so every piece starts at a
//! multiple of `align` of its parameter, and each rank owns `total / N` elements within `align`
//! (Megatron-LM pads its buffer to a multiple of the group's size instead; here nothing is
//! padded). [`AdamW`](super::AdamW) aligns its pieces to the fused kernel's chunk
//! ([`te_runtime::ops::optimizer::CHUNK`]), which is what makes a sharded step's gradient norm
//! bit for bit the replicated step's.

use std::ops::Range;
use te_nn::parallel::{GradShards, Shard};
use te_runtime::{Error, Result};

const MODULE: &str = "ZeRO partition";

/// One rank's piece of one parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The parameter's index in traversal order.
    pub param: usize,
    /// Its elements (flattened, row-major) the rank owns, non-empty.
    pub range: Range<usize>,
}

/// The contiguous split of a model's parameter elements over `N` ranks (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    /// Element count of each parameter, in traversal order.
    numels: Vec<usize>,
    /// Where each parameter starts in the flat space (`numels.len() + 1` entries, the last the
    /// total).
    starts: Vec<usize>,
    /// Rank `r` owns `bounds[r] .. bounds[r + 1]` of the flat space (`N + 1` entries).
    bounds: Vec<usize>,
    /// The pieces of each rank, in traversal order.
    pieces: Vec<Vec<Piece>>,
}

impl Partition {
    /// The partition of parameters of `numels` elements each (in traversal order) over `world`
    /// ranks, with every piece starting at a multiple of `align` elements of its parameter.
    ///
    /// # Errors
    /// [`Error::Argument`] for `world` 0 or `align` 0.
    pub fn new(numels: &[usize], world: usize, align: usize) -> Result<Self> {
        if world == 0 || align == 0 {
            return Err(Error::Argument {
                op: MODULE,
                message: format!(
                    "{world} ranks with pieces aligned to {align} elements: both must be at least 1 (the \
                     data-parallel group's size, the optimizer kernel's alignment)"
                ),
            });
        }
        let mut starts = Vec::with_capacity(numels.len() + 1);
        let mut total = 0usize;
        for &n in numels {
            starts.push(total);
            total += n;
        }
        starts.push(total);
        let mut bounds = Vec::with_capacity(world + 1);
        bounds.push(0);
        for r in 1..world {
            // r · total / N rounded to the nearest element, without overflow.
            let ideal = ((r as u128 * total as u128 + world as u128 / 2) / world as u128) as usize;
            bounds.push(snap(numels, &starts, ideal, align));
        }
        bounds.push(total);
        let pieces = (0..world)
            .map(|r| {
                let (lo, hi) = (bounds[r], bounds[r + 1]);
                numels
                    .iter()
                    .enumerate()
                    .filter_map(|(param, &n)| {
                        let start = starts[param];
                        let (a, b) = (lo.max(start), hi.min(start + n));
                        (a < b).then(|| Piece { param, range: a - start..b - start })
                    })
                    .collect()
            })
            .collect();
        Ok(Self { numels: numels.to_vec(), starts, bounds, pieces })
    }

    /// Ranks it splits over.
    pub fn world(&self) -> usize {
        self.bounds.len() - 1
    }

    /// Elements of all parameters together.
    pub fn total(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The flat elements rank `rank` owns (empty for a rank past the world).
    pub fn rank_range(&self, rank: usize) -> Range<usize> {
        match (self.bounds.get(rank), self.bounds.get(rank + 1)) {
            (Some(&a), Some(&b)) => a..b,
            _ => 0..0,
        }
    }

    /// Rank `rank`'s pieces, in traversal order (none for a rank past the world).
    pub fn pieces(&self, rank: usize) -> &[Piece] {
        self.pieces.get(rank).map_or(&[], Vec::as_slice)
    }

    /// The elements of parameter `param` rank `rank` owns (an empty range at 0 when none).
    pub fn piece(&self, rank: usize, param: usize) -> Range<usize> {
        self.pieces(rank).iter().find(|p| p.param == param).map_or(0..0, |p| p.range.clone())
    }

    /// The elements rank `rank` owns.
    pub fn owned(&self, rank: usize) -> usize {
        self.rank_range(rank).len()
    }

    /// Chunks of `chunk` elements (counted from each piece's start) of each rank's pieces of the
    /// parameters `updated` marks (by index; a parameter past its end counts as not updated),
    /// in rank order: the partial norms each rank's fused AdamW step writes.
    pub fn chunk_counts(&self, updated: &[bool], chunk: usize) -> Vec<usize> {
        let chunk = chunk.max(1);
        self.pieces
            .iter()
            .map(|pieces| {
                let updated = pieces.iter().filter(|p| updated.get(p.param) == Some(&true));
                updated.map(|p| p.range.len().div_ceil(chunk)).sum()
            })
            .collect()
    }

    /// Element count of each parameter, in traversal order.
    pub fn numels(&self) -> &[usize] {
        &self.numels
    }

    /// The owners of each parameter's pieces, as a ZeRO-2 backward reduces the gradients to
    /// them ([`te_nn::parallel::DataParallel::set_grad_shards`]): for each parameter in
    /// traversal order, the ranks holding a piece of it, in rank order, with their pieces.
    ///
    /// # Errors
    /// [`Error::Internal`](te_runtime::Error) if the pieces were not a contiguous split (they
    /// always are).
    pub fn grad_shards(&self) -> Result<GradShards> {
        let mut owners = vec![Vec::new(); self.numels.len()];
        for (root, pieces) in self.pieces.iter().enumerate() {
            for p in pieces {
                if let Some(o) = owners.get_mut(p.param) {
                    o.push(Shard { root, range: p.range.clone() });
                }
            }
        }
        GradShards::new(self.world(), owners)
            .map_err(|e| Error::internal(MODULE, format!("the partition's pieces are not a split: {e}")))
    }
}

/// The flat position nearest to `ideal` that is a parameter's start or end or a multiple of
/// `align` within the parameter holding `ideal` (ties: the lower).
fn snap(numels: &[usize], starts: &[usize], ideal: usize, align: usize) -> usize {
    // The parameter holding `ideal` (the last non-empty one starting at or before it).
    let p = starts.partition_point(|&s| s <= ideal).saturating_sub(1);
    let Some(&n) = numels.get(p) else { return ideal };
    let local = ideal - starts[p];
    if local >= n {
        return starts[p] + n;
    }
    let down = local / align * align;
    let up = (down + align).min(n);
    starts[p] + if local - down <= up - local { down } else { up }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element is owned by exactly one rank, in rank order, and the pieces are the
    /// ranks' ranges cut at the parameters' edges.
    fn check_cover(p: &Partition) {
        let mut next = vec![0usize; p.numels().len()];
        let mut flat = 0;
        for r in 0..p.world() {
            let range = p.rank_range(r);
            assert_eq!(range.start, flat, "rank {r} starts where rank {} ended", r.wrapping_sub(1));
            flat = range.end;
            let mut owned = 0;
            for piece in p.pieces(r) {
                assert!(!piece.range.is_empty());
                assert_eq!(piece.range.start, next[piece.param], "param {} continues where it stopped", piece.param);
                next[piece.param] = piece.range.end;
                owned += piece.range.len();
                assert_eq!(p.piece(r, piece.param), piece.range);
            }
            assert_eq!(owned, p.owned(r));
        }
        assert_eq!(flat, p.total());
        assert_eq!(next, p.numels(), "every parameter is covered to its end");
    }

    #[test]
    fn pieces_cover_the_model_without_overlap_aligned_and_balanced() {
        // Sizes that are multiples of nothing in particular, some below the alignment.
        let numels = [50_257 * 7, 3, 1_000_003, 129, 0, 77_777, 1, 262_145];
        let total: usize = numels.iter().sum();
        for world in [1, 2, 3, 4, 7, 8] {
            for align in [1, 4, 128, 32_768] {
                let p = Partition::new(&numels, world, align).unwrap();
                check_cover(&p);
                for r in 0..world {
                    for piece in p.pieces(r) {
                        assert_eq!(piece.range.start % align, 0, "world {world} align {align}: {piece:?}");
                    }
                    // Each boundary moves at most align / 2 from r · total / N (+1 rounding).
                    let ideal = total as f64 / world as f64;
                    let dev = (p.owned(r) as f64 - ideal).abs();
                    assert!(
                        dev <= align as f64 + 1.0,
                        "world {world} align {align} rank {r}: {} vs {ideal}",
                        p.owned(r)
                    );
                }
            }
        }
    }

    #[test]
    fn one_rank_owns_the_whole_model() {
        let numels = [10, 33, 7];
        let p = Partition::new(&numels, 1, 128).unwrap();
        check_cover(&p);
        let whole: Vec<Piece> = numels.iter().enumerate().map(|(param, &n)| Piece { param, range: 0..n }).collect();
        assert_eq!(p.pieces(0), whole.as_slice());
        assert_eq!((p.owned(0), p.total(), p.rank_range(0)), (50, 50, 0..50));
    }

    /// A parameter split over two ranks, a rank with nothing, a model smaller than the ranks.
    #[test]
    fn tiny_and_empty_cases() {
        // 2 ranks over one parameter of 1000 with align 128: the middle 500 snaps to 512.
        let p = Partition::new(&[1000], 2, 128).unwrap();
        check_cover(&p);
        assert_eq!(p.pieces(0), [Piece { param: 0, range: 0..512 }]);
        assert_eq!(p.pieces(1), [Piece { param: 0, range: 512..1000 }]);
        // Parameters smaller than the alignment are never split: boundaries land on their edges.
        let p = Partition::new(&[5, 6, 7], 4, 128).unwrap();
        check_cover(&p);
        let owners: Vec<usize> = (0..3).map(|i| (0..4).find(|&r| !p.piece(r, i).is_empty()).unwrap()).collect();
        for (i, &r) in owners.iter().enumerate() {
            assert_eq!(p.piece(r, i), 0..[5, 6, 7][i], "param {i} whole on rank {r}");
        }
        assert!((0..4).any(|r| p.owned(r) == 0), "4 ranks, 3 unsplittable params: a rank owns nothing");
        // A model of fewer elements than ranks; an empty model.
        let p = Partition::new(&[3], 8, 1).unwrap();
        check_cover(&p);
        assert_eq!((0..8).map(|r| p.owned(r)).sum::<usize>(), 3);
        let p = Partition::new(&[], 3, 4).unwrap();
        check_cover(&p);
        assert!((0..3).all(|r| p.pieces(r).is_empty()));
        // Past the world: nothing.
        assert!(p.pieces(9).is_empty() && p.rank_range(9).is_empty() && p.piece(9, 0).is_empty());
    }

    /// With pieces aligned to the chunk, the ranks' chunks add up to the whole parameters'
    /// (the replicated step's): a piece of `chunk + 1` elements is 2 chunks, a parameter without
    /// a gradient none.
    #[test]
    fn chunk_counts_are_the_replicated_chunks_when_aligned() {
        let chunk: usize = 64;
        let numels = [chunk + 1, 5, 3 * chunk + 17, 7, 10 * chunk];
        let replicated = |updated: &[bool]| -> usize {
            numels.iter().zip(updated).filter(|(_, &u)| u).map(|(&n, _)| n.div_ceil(chunk)).sum()
        };
        for world in [1, 2, 3, 5, 16] {
            let p = Partition::new(&numels, world, chunk).unwrap();
            for updated in [[true; 5], [false, true, false, true, true], [true, false, true, false, false]] {
                let counts = p.chunk_counts(&updated, chunk);
                assert_eq!(counts.len(), world);
                assert_eq!(counts.iter().sum::<usize>(), replicated(&updated), "world {world} {updated:?}");
            }
        }
        // Unaligned pieces cut chunks: more of them than the replicated step's.
        let p = Partition::new(&[2 * chunk], 2, 1).unwrap();
        assert_eq!(p.chunk_counts(&[true], chunk), [1, 1]);
        let p = Partition::new(&[2 * chunk], 3, 1).unwrap();
        assert_eq!(p.chunk_counts(&[true], chunk), [1, 1, 1], "43, 42 and 43 elements: 3 chunks, not 2");
        assert_eq!(p.chunk_counts(&[], chunk), [0, 0, 0], "no parameter updated");
    }

    /// The gradient shards are the partition's pieces by parameter: a bucket reduces each piece
    /// to its owner, and a rank releases the gradients of the parameters it has no piece of.
    #[test]
    fn gradient_shards_follow_the_pieces() {
        let numels = [1000, 3, 0, 2000, 7];
        for world in [1, 2, 3, 4] {
            let p = Partition::new(&numels, world, 128).unwrap();
            let g = p.grad_shards().unwrap();
            assert_eq!((g.world(), g.len()), (world, numels.len()));
            for (param, &n) in numels.iter().enumerate() {
                assert_eq!(g.numel(param), n, "world {world} param {param}");
                for r in 0..world {
                    let piece = p.piece(r, param);
                    assert_eq!(g.owns(r, param), !piece.is_empty());
                    let calls = g.calls(&[param]);
                    assert_eq!(calls.iter().find(|c| c.root == r).map(|c| c.range.clone()).unwrap_or(0..0), piece);
                }
            }
            // Each rank's released gradients are the parameters it holds no optimizer state of.
            let all: Vec<usize> = (0..numels.len()).rev().collect();
            for r in 0..world {
                let released = g.released(r, &all);
                let none: Vec<usize> = all.iter().copied().filter(|&i| p.piece(r, i).is_empty()).collect();
                assert_eq!(released, none, "world {world} rank {r}");
            }
        }
        // 2 ranks over [1000, 3, 0, 2000, 7] aligned to 128: rank 0 owns 0..1000, 0..3 and the
        // first 512 of the third; rank 1 the rest.
        let g = Partition::new(&numels, 2, 128).unwrap().grad_shards().unwrap();
        assert_eq!(g.released(0, &[4, 3, 2, 1, 0]), [4, 2]);
        assert_eq!(g.released(1, &[4, 3, 2, 1, 0]), [2, 1, 0]);
        let roots: Vec<(usize, usize)> = g.calls(&[3]).iter().map(|c| (c.root, c.range.start)).collect();
        assert_eq!(roots, [(0, 0), (1, 512)]);
    }

    /// ZeRO-3 keeps each rank's pieces of the weights, the optimizer's pieces: over sizes that
    /// are not multiples of the ranks, each rank's local pieces add up to what it owns, and a
    /// layer's gather (one broadcast a piece, from its owner) rebuilds every element once.
    #[test]
    fn zero_3_pieces_are_the_partition_and_a_gather_covers_each_layer() {
        // An embedding, three "layers" of four parameters of odd sizes, a norm and a head.
        let numels = [1001, 37, 4099, 333, 65_537, 37, 4099, 333, 65_537, 37, 4099, 333, 65_537, 37, 999];
        let layers = [1..5, 5..9, 9..13];
        for world in [2, 3, 4, 7] {
            for align in [4, 128, 32_768] {
                let p = Partition::new(&numels, world, align).unwrap();
                let g = p.grad_shards().unwrap();
                for r in 0..world {
                    let local: usize = (0..numels.len()).map(|i| te_nn::parallel::local_piece(&g, r, i).len()).sum();
                    assert_eq!(local, p.owned(r), "world {world} align {align} rank {r}");
                }
                for layer in &layers {
                    let params: Vec<usize> = layer.clone().collect();
                    let mut covered: Vec<Vec<u8>> = params.iter().map(|&i| vec![0; numels[i]]).collect();
                    for c in g.calls(&params) {
                        let at = params.iter().position(|&i| i == c.param).unwrap();
                        assert_eq!(te_nn::parallel::local_piece(&g, c.root, c.param), c.range, "the owner sends");
                        c.range.clone().for_each(|e| covered[at][e] += 1);
                    }
                    assert!(covered.iter().flatten().all(|&n| n == 1), "world {world} align {align} {layer:?}");
                }
            }
        }
    }

    #[test]
    fn bad_sizes_are_refused() {
        for (world, align) in [(0, 4), (2, 0)] {
            let e = Partition::new(&[10], world, align).unwrap_err();
            assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("at least 1"), "{e}");
        }
    }
}
