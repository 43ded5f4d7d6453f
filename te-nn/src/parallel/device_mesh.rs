//! The process groups of a device mesh: one NCCL communicator per axis in use, split from the
//! run's world group by the mesh's color arithmetic ([`MeshShape::color`]).

use super::mesh::{MeshAxis, MeshShape};
use std::sync::Arc;
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result};

const MODULE: &str = "DeviceMesh";

/// The run's ranks as a grid of named axes ([`MeshShape`]) with the process group of this
/// rank along each axis in use. `Default` is a single GPU: no groups.
#[derive(Debug, Default)]
pub struct DeviceMesh {
    shape: MeshShape,
    world: Option<Arc<ProcessGroup>>,
    /// This rank's group along each axis of size above 1, in [`MeshAxis::ALL`] order.
    groups: Vec<(MeshAxis, Arc<ProcessGroup>)>,
}

impl DeviceMesh {
    /// A single GPU: one rank, no groups.
    pub fn single() -> Self {
        Self::default()
    }

    /// The mesh of `world`'s ranks shaped as `shape`: for each axis above size 1, in layout
    /// order (tensor first, data last), this rank's group along it; an axis spanning the whole
    /// world uses `world` itself, the others are split from it (`ncclCommSplit`, one collective
    /// of all ranks per axis). Every rank of `world` must call it with the same shape.
    ///
    /// # Errors
    /// [`Error::Config`] when `shape` does not have `world`'s number of ranks; NCCL errors of
    /// the splits.
    pub fn new(world: Arc<ProcessGroup>, shape: MeshShape) -> Result<Self> {
        if shape.world_size() != world.size() {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "the mesh {shape} has {} ranks, the world group {}: shape the mesh over every rank",
                    shape.world_size(),
                    world.size()
                ),
            });
        }
        let mut groups = Vec::new();
        for axis in MeshAxis::ALL.into_iter().filter(|&a| shape.size(a) > 1) {
            let group = if shape.size(axis) == world.size() {
                world.clone()
            } else {
                let group = world.split(|r| Some(shape.color(r, &[axis])))?;
                Arc::new(group.ok_or_else(|| Error::internal(MODULE, "a rank got no group of its color"))?)
            };
            groups.push((axis, group));
        }
        Ok(Self { shape, world: Some(world), groups })
    }

    /// The mesh's shape.
    pub fn shape(&self) -> &MeshShape {
        &self.shape
    }

    /// All ranks of the run (`None` on a single GPU).
    pub fn world(&self) -> Option<&Arc<ProcessGroup>> {
        self.world.as_ref()
    }

    /// This rank's group along `axis`; `None` for an axis of size 1 (no collectives along it).
    pub fn group(&self, axis: MeshAxis) -> Option<&Arc<ProcessGroup>> {
        self.groups.iter().find(|(a, _)| *a == axis).map(|(_, g)| g)
    }

    /// This rank's group of several `axes` (the ranks that differ only along them, e.g. the
    /// gradient averaging of replicated parameters over context × data): `None` where it is
    /// one rank; the world group or an axis's own group where it is that; else split from the
    /// world (`ncclCommSplit`, a collective of every rank: all ranks call it with the same
    /// `axes`).
    ///
    /// # Errors
    /// NCCL errors of the split.
    pub fn group_of(&self, axes: &[MeshAxis]) -> Result<Option<Arc<ProcessGroup>>> {
        let Some(world) = &self.world else { return Ok(None) };
        let size = self.shape.group_size(axes);
        if size == 1 {
            return Ok(None);
        }
        if size == world.size() {
            return Ok(Some(world.clone()));
        }
        let used: Vec<MeshAxis> = axes.iter().copied().filter(|&a| self.shape.size(a) > 1).collect();
        if let [axis] = used[..] {
            return Ok(self.group(axis).cloned());
        }
        let shape = self.shape;
        let group = world.split(|r| Some(shape.color(r, axes)))?;
        Ok(Some(Arc::new(group.ok_or_else(|| Error::internal(MODULE, "a rank got no group of its color"))?)))
    }

    /// This rank in the run (0 on a single GPU).
    pub fn rank(&self) -> usize {
        self.world.as_ref().map_or(0, |w| w.rank())
    }

    /// Ranks in the run (1 on a single GPU).
    pub fn world_size(&self) -> usize {
        self.world.as_ref().map_or(1, |w| w.size())
    }

    /// This rank's coordinate along `axis` (its rank in its group along it).
    pub fn coord(&self, axis: MeshAxis) -> usize {
        self.shape.coord(self.rank(), axis)
    }
}
