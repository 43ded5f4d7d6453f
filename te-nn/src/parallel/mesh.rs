//! The shape of a device mesh: the run's ranks as a grid with named axes, in Megatron-LM's rank
//! layout (`megatron/core/parallel_state.py`, `RankGenerator` with its default order
//! `tp-cp-ep-dp`): the tensor-parallel axis varies fastest (the `tp` ranks of a tensor-parallel
//! group are consecutive, so on one node they share its NVLink), then context, expert, ZeRO and
//! data. Rank `r`'s coordinate on an axis is `(r / stride) % size`, the stride being the product
//! of the sizes of the faster axes.
//!
//! A group of a set of axes holds the ranks that differ only along those axes: its *color* (the
//! value [`te_runtime::dist::ProcessGroup::split`] takes) is the rank's position on the other
//! axes, and its rank inside the group its position on the set's axes, both mixed-radix with the
//! faster axis first, so a group ranks its members in their world order, as
//! `ProcessGroup::split` does. With TP × DP the tensor-parallel group of rank `r` is `r / tp`
//! and its data-parallel group `r % tp`.
//!
//! Pure arithmetic, no GPU: [`super::DeviceMesh`] makes the process groups from it.

use std::fmt;
use te_runtime::{Error, Result};

const MODULE: &str = "DeviceMesh";

/// A named axis of the mesh, listed fastest first ([`MeshAxis::ALL`]). A run uses the axes of
/// its kinds of parallelism; the others have size 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MeshAxis {
    /// Tensor parallelism: the layers' GEMMs split over the axis (`TpConfig`), and with sequence
    /// parallelism the tokens between them.
    Tensor,
    /// Context parallelism: the sequence split for attention (Megatron's `cp`;
    /// [`super::Parallel::with_context`]); the parameters are replicated along it, so their
    /// gradients average over context × data.
    Context,
    /// Expert parallelism: the experts of MoE layers spread over the axis (Megatron's `ep`,
    /// folded into the data-parallel ranks: dense parameters are replicated along it; not built
    /// by [`super::Parallel`] yet).
    Expert,
    /// ZeRO: the data-parallel ranks that share one copy of the optimizer state, each holding
    /// its shard (Megatron's distributed-optimizer instance); the replicas of that copy are the
    /// [`MeshAxis::Data`] axis, and the gradients are averaged over both (not built by
    /// [`super::Parallel`] yet).
    Zero,
    /// Data parallelism: every rank of the axis runs its shard of the batch on the same weights.
    Data,
}

impl MeshAxis {
    /// Every axis, fastest first: the rank layout's order.
    pub const ALL: [MeshAxis; 5] =
        [MeshAxis::Tensor, MeshAxis::Context, MeshAxis::Expert, MeshAxis::Zero, MeshAxis::Data];

    /// The axis's short name (`tp`, `cp`, `ep`, `zero`, `dp`).
    pub fn name(self) -> &'static str {
        match self {
            MeshAxis::Tensor => "tp",
            MeshAxis::Context => "cp",
            MeshAxis::Expert => "ep",
            MeshAxis::Zero => "zero",
            MeshAxis::Data => "dp",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for MeshAxis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The sizes of the mesh's axes (1 for an axis a run does not use); their product is the
/// number of ranks. See the module docs for the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MeshShape {
    sizes: [usize; 5],
}

impl Default for MeshShape {
    /// One rank.
    fn default() -> Self {
        Self::single()
    }
}

impl fmt::Display for MeshShape {
    /// `tp=2 × dp=4` (the axes above 1; `1 rank` for a single one).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let used: Vec<String> =
            MeshAxis::ALL.iter().filter(|&&a| self.size(a) > 1).map(|&a| format!("{a}={}", self.size(a))).collect();
        if used.is_empty() {
            f.write_str("1 rank")
        } else {
            f.write_str(&used.join(" × "))
        }
    }
}

impl MeshShape {
    /// A mesh of one rank.
    pub fn single() -> Self {
        Self { sizes: [1; 5] }
    }

    /// The mesh of `world` ranks with the given axis sizes (the others 1), in any order.
    ///
    /// # Errors
    /// [`Error::Config`] for an axis of size 0, an axis given twice, or sizes whose product is
    /// not `world`, naming them.
    pub fn new(world: usize, axes: &[(MeshAxis, usize)]) -> Result<Self> {
        let config = |message: String| Err(Error::Config { module: MODULE, message });
        let mut sizes = [1; 5];
        let mut given = [false; 5];
        for &(axis, size) in axes {
            if size == 0 {
                return config(format!("the {axis} axis has size 0: every axis has at least one rank"));
            }
            if std::mem::replace(&mut given[axis.index()], true) {
                return config(format!("the {axis} axis is given twice: give each axis once"));
            }
            sizes[axis.index()] = size;
        }
        let shape = Self { sizes };
        if shape.world_size() != world {
            return config(format!(
                "the axes {shape} make {} ranks, the run has {world}: choose sizes whose product is the world size",
                shape.world_size()
            ));
        }
        Ok(shape)
    }

    /// Megatron-LM's tensor × data-parallel layout of `world` ranks: tensor-parallel groups of
    /// `tensor_parallel` consecutive ranks, data parallelism over the `world / tensor_parallel`
    /// groups.
    ///
    /// # Errors
    /// [`Error::Config`] for a tensor-parallel size of 0 or one that does not divide `world`.
    pub fn tensor_data(world: usize, tensor_parallel: usize) -> Result<Self> {
        let tp = tensor_parallel;
        if tp == 0 || world % tp != 0 {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "a tensor-parallel size of {tp} does not divide the {world} ranks: choose a divisor of the world \
                     size"
                ),
            });
        }
        Self::new(world, &[(MeshAxis::Tensor, tp), (MeshAxis::Data, world / tp)])
    }

    /// Megatron-LM's tensor × context × data-parallel layout of `world` ranks (`tp-cp-dp`):
    /// tensor-parallel groups of `tensor_parallel` consecutive ranks, context-parallel groups of
    /// `context_parallel` ranks `tensor_parallel` apart (rank `r`'s context coordinate is `(r /
    /// tp) % cp`), data parallelism over the `world / (tp · cp)` rest.
    ///
    /// # Errors
    /// [`Error::Config`] for a size of 0 or sizes whose product does not divide `world`, naming
    /// them.
    pub fn tensor_context_data(world: usize, tensor_parallel: usize, context_parallel: usize) -> Result<Self> {
        let (tp, cp) = (tensor_parallel, context_parallel);
        if tp == 0 || cp == 0 || world % (tp * cp) != 0 {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "a tensor-parallel size of {tp} × a context-parallel size of {cp} does not divide the {world} \
                     ranks: choose sizes whose product divides the world size"
                ),
            });
        }
        Self::new(world, &[(MeshAxis::Tensor, tp), (MeshAxis::Context, cp), (MeshAxis::Data, world / (tp * cp))])
    }

    /// Ranks in the mesh.
    pub fn world_size(&self) -> usize {
        self.sizes.iter().product()
    }

    /// Ranks along `axis` (1 for an axis the run does not use).
    pub fn size(&self, axis: MeshAxis) -> usize {
        self.sizes[axis.index()]
    }

    /// Ranks in a group of `axes`: the product of their sizes (an axis listed twice counts
    /// once).
    pub fn group_size(&self, axes: &[MeshAxis]) -> usize {
        MeshAxis::ALL.iter().filter(|a| axes.contains(a)).map(|&a| self.size(a)).product()
    }

    /// Ranks between two neighbours along `axis`: the product of the faster axes' sizes.
    fn stride(&self, axis: MeshAxis) -> usize {
        self.sizes[..axis.index()].iter().product()
    }

    /// Rank `rank`'s coordinate along `axis`, `0..size(axis)` (`rank` in `0..world_size()`).
    pub fn coord(&self, rank: usize, axis: MeshAxis) -> usize {
        (rank / self.stride(axis)) % self.size(axis)
    }

    /// Mixed-radix position of `rank` on the axes `keep` selects, the faster axis first.
    fn position(&self, rank: usize, keep: impl Fn(MeshAxis) -> bool) -> usize {
        let (mut value, mut radix) = (0, 1);
        for axis in MeshAxis::ALL.into_iter().filter(|&a| keep(a)) {
            value += self.coord(rank, axis) * radix;
            radix *= self.size(axis);
        }
        value
    }

    /// The color of rank `rank`'s group of `axes` (`0..world_size() / group_size(axes)`): the
    /// ranks that differ only along `axes` share it. The color function of
    /// `ProcessGroup::split` for these groups.
    pub fn color(&self, rank: usize, axes: &[MeshAxis]) -> usize {
        self.position(rank, |a| !axes.contains(&a))
    }

    /// Rank `rank`'s rank inside its group of `axes` (`0..group_size(axes)`), in the order
    /// `ProcessGroup::split` ranks the group's members (their world order).
    pub fn rank_in_group(&self, rank: usize, axes: &[MeshAxis]) -> usize {
        self.position(rank, |a| axes.contains(&a))
    }

    /// Every group of `axes`, by color, each listing its world ranks in group-rank order.
    pub fn groups(&self, axes: &[MeshAxis]) -> Vec<Vec<usize>> {
        let mut groups = vec![Vec::new(); self.world_size() / self.group_size(axes)];
        for rank in 0..self.world_size() {
            groups[self.color(rank, axes)].push(rank);
        }
        groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MeshAxis::{Context, Data, Expert, Tensor, Zero};

    /// 8 ranks at TP=2: tensor-parallel pairs of consecutive ranks, data-parallel groups of the
    /// ranks with the same place in their pair (Megatron-LM's layout), and the colors are the
    /// `r / tp` and `r % tp` of `ProcessGroup::split`.
    #[test]
    fn tp2_over_8_ranks_follows_megatrons_layout() {
        let m = MeshShape::tensor_data(8, 2).unwrap();
        assert_eq!((m.size(Tensor), m.size(Data), m.world_size()), (2, 4, 8));
        assert_eq!(m.groups(&[Tensor]), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(m.groups(&[Data]), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        for r in 0..8 {
            assert_eq!((m.color(r, &[Tensor]), m.color(r, &[Data])), (r / 2, r % 2));
            assert_eq!((m.rank_in_group(r, &[Tensor]), m.rank_in_group(r, &[Data])), (r % 2, r / 2));
        }
        assert_eq!(m.to_string(), "tp=2 × dp=4");
    }

    /// 16 ranks as TP=2 × DP=8 (two nodes of 8): each node holds four tensor-parallel pairs,
    /// and a data-parallel group spans both nodes.
    #[test]
    fn tp2_dp8_over_16_ranks() {
        let m = MeshShape::new(16, &[(Data, 8), (Tensor, 2)]).unwrap();
        assert_eq!(m, MeshShape::tensor_data(16, 2).unwrap());
        let tp = m.groups(&[Tensor]);
        assert_eq!(tp.len(), 8);
        assert!(tp.iter().enumerate().all(|(c, g)| *g == [2 * c, 2 * c + 1]));
        assert_eq!(m.groups(&[Data]), [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]]);
        assert_eq!((m.coord(13, Tensor), m.coord(13, Data)), (1, 6));
        assert_eq!(m.groups(&[Tensor, Data]), [(0..16).collect::<Vec<_>>()]);
        assert_eq!(m.group_size(&[Tensor, Data, Tensor]), 16);
    }

    /// Every axis in use: TP=2 × CP=2 × EP=2 × ZeRO=2 × DP=2 over 32 ranks. The axes vary in
    /// layout order (tp fastest); groups of several axes (the data-parallel gradient average over
    /// ZeRO × DP, the dense parameters' over EP too) hold the ranks that differ only on them;
    /// every group partitions the world and ranks its members in world order.
    #[test]
    fn every_axis_follows_the_layout_order() {
        let m = MeshShape::new(32, &[(Tensor, 2), (Context, 2), (Expert, 2), (Zero, 2), (Data, 2)]).unwrap();
        assert_eq!(m.groups(&[Context])[0], [0, 2]);
        assert_eq!(m.groups(&[Expert])[0], [0, 4]);
        assert_eq!(m.groups(&[Zero])[0], [0, 8]);
        assert_eq!(m.groups(&[Data])[0], [0, 16]);
        assert_eq!(m.groups(&[Zero, Data])[1], [1, 9, 17, 25]);
        assert_eq!(m.groups(&[Expert, Zero, Data])[0], [0, 4, 8, 12, 16, 20, 24, 28]);
        assert_eq!(m.groups(&[Tensor, Context])[3], [12, 13, 14, 15]);
        for axes in [&[Tensor][..], &[Context], &[Expert, Data], &[Tensor, Zero, Data], &[]] {
            let groups = m.groups(axes);
            let mut all: Vec<usize> = groups.concat();
            all.sort_unstable();
            assert_eq!(all, (0..32).collect::<Vec<_>>(), "{axes:?} partitions the world");
            for g in &groups {
                assert!(g.windows(2).all(|w| w[0] < w[1]), "{axes:?}: {g:?} in world order");
                for (i, &r) in g.iter().enumerate() {
                    assert_eq!(m.rank_in_group(r, axes), i, "{axes:?}: rank {r}");
                }
            }
        }
        assert_eq!(m.to_string(), "tp=2 × cp=2 × ep=2 × zero=2 × dp=2");
    }

    /// TP × CP × DP (Megatron's `tp-cp-dp`): the context-parallel groups hold ranks `tp` apart,
    /// the gradient-averaging group of the replicated parameters is context × data, and the
    /// data index (which sequences a rank reads) is the data coordinate alone, so the CP ranks
    /// of one data rank read the same sequences.
    #[test]
    fn context_axis_groups_over_tp_cp_dp() {
        let m = MeshShape::tensor_context_data(8, 1, 2).unwrap();
        assert_eq!(m.to_string(), "cp=2 × dp=4");
        assert_eq!(m.groups(&[Context]), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(m.groups(&[Data]), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        assert_eq!(m.groups(&[Context, Data]), [(0..8).collect::<Vec<_>>()]);
        for r in 0..8 {
            assert_eq!((m.coord(r, Context), m.coord(r, Data)), (r % 2, r / 2));
        }
        let m = MeshShape::tensor_context_data(8, 2, 2).unwrap();
        assert_eq!(m.to_string(), "tp=2 × cp=2 × dp=2");
        assert_eq!(m.groups(&[Tensor]), [[0, 1], [2, 3], [4, 5], [6, 7]]);
        assert_eq!(m.groups(&[Context]), [[0, 2], [1, 3], [4, 6], [5, 7]]);
        assert_eq!(m.groups(&[Context, Data]), [[0, 2, 4, 6], [1, 3, 5, 7]]);
        assert_eq!((m.coord(6, Data), m.coord(6, Context), m.coord(6, Tensor)), (1, 1, 0));
        let m = MeshShape::tensor_context_data(4, 1, 4).unwrap();
        assert_eq!(m.groups(&[Context]), [[0, 1, 2, 3]]);
        assert_eq!(m.groups(&[Data]), [[0], [1], [2], [3]]);
        assert_eq!(MeshShape::tensor_context_data(4, 1, 1).unwrap(), MeshShape::tensor_data(4, 1).unwrap());
        let e = MeshShape::tensor_context_data(6, 2, 2).unwrap_err().to_string();
        assert!(e.contains("context-parallel size of 2 does not divide the 6 ranks"), "{e}");
        assert!(MeshShape::tensor_context_data(4, 1, 0).is_err());
    }

    /// A single rank, and axes of size 1, leave every group a single rank.
    #[test]
    fn one_rank_and_unused_axes() {
        let one = MeshShape::default();
        assert_eq!((one.world_size(), one.color(0, &[Tensor]), one.rank_in_group(0, &[Data])), (1, 0, 0));
        assert_eq!(one.to_string(), "1 rank");
        let dp = MeshShape::tensor_data(4, 1).unwrap();
        assert_eq!(dp.groups(&[Tensor]), [[0], [1], [2], [3]]);
        assert_eq!(dp.groups(&[Data]), [[0, 1, 2, 3]]);
        assert_eq!(MeshShape::tensor_data(4, 4).unwrap().groups(&[Tensor]), [[0, 1, 2, 3]]);
    }

    /// Sizes that do not make the world, zero sizes and repeated axes are typed errors saying
    /// what to change.
    #[test]
    fn bad_shapes_are_typed_errors() {
        let e = MeshShape::tensor_data(8, 3).unwrap_err().to_string();
        assert!(e.contains("tensor-parallel size of 3 does not divide the 8 ranks"), "{e}");
        assert!(MeshShape::tensor_data(8, 0).is_err());
        let e = MeshShape::new(8, &[(Tensor, 2), (Data, 3)]).unwrap_err().to_string();
        assert!(e.contains("tp=2 × dp=3 make 6 ranks, the run has 8"), "{e}");
        let e = MeshShape::new(8, &[(Context, 0)]).unwrap_err().to_string();
        assert!(e.contains("cp axis has size 0"), "{e}");
        let e = MeshShape::new(4, &[(Data, 2), (Data, 2)]).unwrap_err().to_string();
        assert!(e.contains("dp axis is given twice"), "{e}");
    }
}
