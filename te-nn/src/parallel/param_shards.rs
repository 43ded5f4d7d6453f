//! Sharded parameters (ZeRO stage 3; DeepSpeed's `zero_optimization.stage = 3`, PyTorch FSDP's
//! per-unit all-gather): each rank of a data-parallel group keeps only its pieces of the
//! parameters of each *group* (a unit gathered together: a transformer layer), and the group's
//! whole tensors exist only while it runs. [`ParamShards`] holds the pieces, gathers a group's
//! whole tensors into a ring of transient buffers (every piece broadcast from the rank that owns
//! it, in one NCCL group on a side stream, so the gather of the next group overlaps the current
//! one's compute: [`ParamShards::prefetch`]), makes the device's stream wait for a gather only
//! where its tensors are read ([`ParamShards::gather`], an event), and frees the slot for the
//! next gather ([`ParamShards::release`]).
//!
//! Who owns which piece is a [`GradShards`]: the optimizer's split of the flattened parameters
//! (`te_train::optim::Partition`), so a rank's pieces of the weights are the pieces it keeps the
//! f32 masters and moments of and the gradient pieces reduced to it (ZeRO-2), and its update
//! writes its pieces in place ([`ParamShards::local_pieces`]); nothing is broadcast after a step,
//! the next gathers carry the new values. A group's gather is one broadcast per piece, the bytes
//! an all-gather of the group moves.
//!
//! The ring has `slots` sets of whole buffers (2: the group running and the one prefetched);
//! group `g` is gathered into slot `g % slots`, whose buffers are reused from group to group
//! when the shapes agree (the layers of a decoder). The caller points its modules' parameters
//! at the buffers [`ParamShards::gather`] returns; a released group's parameters keep pointing
//! at a slot that later gathers overwrite, so they are read only between `gather` and
//! `release`. The ordering rules: a gather's broadcasts start after the device's stream work
//! issued before it (so after the kernels that read the slot's previous group), and the
//! device's stream waits for them before the first kernel issued after [`ParamShards::gather`].
//! A gather into a slot whose previous gather the device's stream never waited for (a prefetch
//! no [`ParamShards::gather`] took: the last layer's after a forward no backward followed, an
//! evaluation's) first makes the device's stream wait for that one: its broadcasts may still be
//! writing the buffers (on a rank that owns none of that group, all of them), and this rank's
//! pieces of the new group, copied on the device's stream, must land after them. The
//! bookkeeping (`shard_ring.rs`) is apart from the device work so the host tests run it.
//!
//! FP8 all-gather (torchao's `enable_fsdp_float8_all_gather`): the GEMM weights of a group
//! ([`ParamShards::add_group_fp8`]) can be gathered as FP8 codes, half the bytes of bf16.
//! [`ParamShards::set_fp8_gather`] takes the recipe's weight quantizer for a step, the amax of
//! each piece and one all-reduce (max) of them all, so every rank knows each whole weight's
//! amax; each gather then casts this rank's pieces with the scale of the whole weight's amax
//! (the codes the layer's own cast of the whole weight would make, bit for bit) and
//! broadcasts the codes. The transpose a backward needs is made from the gathered codes.

use super::shard_ring::Ring;
use super::GradShards;
use crate::fp8::{Float8Tensor, Quantizer};
use cudarc::driver::CudaSlice;
use std::ops::Range;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::dist::{ProcessGroup, ReduceOp, SideMark};
use te_runtime::{ops, Device, Error, Result, Tensor};

const MODULE: &str = "ParamShards";

/// One parameter of a group: where it sits in the model and this rank's piece of it.
#[derive(Debug)]
struct Member {
    /// Its index in the whole model's traversal order (the [`GradShards`]' index).
    param: usize,
    shape: Vec<usize>,
    dtype: DType,
    /// The elements (flattened, row-major) this rank owns; empty when it owns none.
    piece: Range<usize>,
    /// Those elements, `[piece.len()]` of `dtype` (a `[0]` tensor when it owns none).
    local: Tensor,
    /// For a GEMM weight that may be gathered as FP8 codes: its index in the whole weights'
    /// amaxes ([`Fp8Gather::amax`]).
    fp8: Option<usize>,
}

/// A gathered whole parameter: high precision, or a GEMM weight's FP8 codes with their
/// `scale_inv` (an FP8 gather, [`ParamShards::set_fp8_gather`]).
#[derive(Debug, Clone)]
pub enum Gathered {
    /// The whole tensor in the parameter's dtype.
    High(Tensor),
    /// The whole weight's codes (no transpose yet) and their one `scale_inv`.
    Fp8(Float8Tensor),
}

impl Gathered {
    /// The whole tensor gathered into: the values, or the codes.
    pub fn data(&self) -> &Tensor {
        match self {
            Gathered::High(t) => t,
            Gathered::Fp8(f) => f.data(),
        }
    }
}

/// The FP8 gather of one step: the weights' quantizer and each whole weight's amax.
#[derive(Debug)]
struct Fp8Gather {
    quantizer: Box<dyn Quantizer>,
    /// `[FP8 weights]` f32: each weight's pieces' amaxes all-reduced (max) over the group.
    amax: CudaSlice<f32>,
}

/// Elements of the stand-in a rank that owns none of a weight casts to get its `scale_inv`.
const STAND_IN: usize = 64;

impl Fp8Gather {
    /// `local` (this rank's piece of FP8 weight `i`) cast with the scale of the whole weight's
    /// amax; a rank owning none casts a stand-in of zeros for the `scale_inv` alone.
    fn cast(&self, dev: &Device, local: &Tensor, i: usize) -> Result<Float8Tensor> {
        let stand_in;
        let x = if local.numel() == 0 {
            stand_in = Tensor::zeros(dev, local.dtype(), &[STAND_IN])?;
            &stand_in
        } else {
            local
        };
        let whole = self.amax.slice(i..i + 1);
        let mut take_whole = |amax: &mut CudaSlice<f32>| -> Result<()> {
            dev.stream().memcpy_dtod(&whole, amax)?;
            Ok(())
        };
        self.quantizer
            .quantize_with_amax(x, false, &mut take_whole)?
            .ok_or_else(|| Error::internal(MODULE, "the FP8 gather's quantizer does not scale by the tensor's amax"))
    }
}

/// The pieces of the sharded parameters of one rank and the ring of buffers their groups are
/// gathered into (see the module docs). Every rank of the group builds it with the same groups
/// and calls the same gathers in the same order.
#[derive(Debug)]
pub struct ParamShards {
    dev: Arc<Device>,
    /// The data-parallel group on the device's stream (whole gathers of checkpoints).
    group: Arc<ProcessGroup>,
    /// The same ranks on a side stream (the gathers of the ring, overlapped with compute).
    side: ProcessGroup,
    shards: GradShards,
    groups: Vec<Vec<Member>>,
    /// Which group each slot of the ring holds, and the gathers not waited for.
    ring: Ring<SideMark>,
    /// Each slot's whole tensors, in its group's order.
    buffers: Vec<Vec<Gathered>>,
    /// GEMM weights added with [`ParamShards::add_group_fp8`].
    fp8_weights: usize,
    /// This step's FP8 gather ([`ParamShards::set_fp8_gather`]); `None`: all in high precision.
    fp8: Option<Fp8Gather>,
}

impl ParamShards {
    /// An empty store over the data-parallel `group` (on the device's stream; every rank calls
    /// this: it creates the side-stream communicator), the pieces `shards` says (the whole
    /// model's parameters in traversal order, the optimizer's split), with a ring of `slots`
    /// buffer sets (2: one group running, the next prefetched). Add the groups with
    /// [`ParamShards::add_group`].
    ///
    /// # Errors
    /// [`Error::Argument`] for a group on a side stream, `shards` over another number of ranks
    /// than the group, or `slots` 0; NCCL and driver errors.
    pub fn new(group: Arc<ProcessGroup>, shards: GradShards, slots: usize) -> Result<Self> {
        let argument = |message: String| Error::Argument { op: MODULE, message };
        if group.is_side_stream() {
            return Err(argument(
                "the group runs its collectives on a side stream: pass the data-parallel group on the device's \
                 stream (DataParallel::group)"
                    .into(),
            ));
        }
        if shards.world() != group.size() {
            return Err(argument(format!(
                "pieces split over {} ranks for a group of {}: split over this group",
                shards.world(),
                group.size()
            )));
        }
        if slots == 0 {
            return Err(argument("a ring of 0 buffer sets: pass at least 1 (2 overlaps a gather with compute)".into()));
        }
        let side = group.with_side_stream()?;
        let dev = group.device().clone();
        let (ring, buffers) = (Ring::new(slots), vec![Vec::new(); slots]);
        Ok(Self { dev, group, side, shards, groups: Vec::new(), ring, buffers, fp8_weights: 0, fp8: None })
    }

    /// Adds a group of parameters gathered together: `(index, value)` pairs, the index in the
    /// whole model's traversal order and the whole value (any shape, `numel` the shards'),
    /// from which this rank keeps its pieces (copied). Returns the group's number (0, 1, ... in
    /// the order added). The caller then drops or replaces its whole values.
    ///
    /// # Errors
    /// [`Error::Argument`] for an index past the shards, a value of another element count than
    /// its shards, or a parameter already in a group; allocation and copy errors.
    pub fn add_group(&mut self, params: &[(usize, Tensor)]) -> Result<usize> {
        self.add_group_fp8(params, &vec![false; params.len()])
    }

    /// [`ParamShards::add_group`] with `fp8[i]` marking `params[i]` a GEMM weight (`[out, in]`)
    /// that is gathered as FP8 codes while an FP8 gather is on ([`ParamShards::set_fp8_gather`]).
    ///
    /// # Errors
    /// As [`ParamShards::add_group`]; [`Error::Argument`] for `fp8` of another length than
    /// `params` or a marked parameter that is not a 2-D high-precision tensor.
    pub fn add_group_fp8(&mut self, params: &[(usize, Tensor)], fp8: &[bool]) -> Result<usize> {
        let rank = self.group.rank();
        let marked_ok = fp8.len() == params.len()
            && params.iter().zip(fp8).all(|((_, v), &f)| !f || (v.shape().len() == 2 && v.dtype().is_high_precision()));
        if !marked_ok {
            return Err(Error::Argument {
                op: MODULE,
                message: format!(
                    "{} FP8 marks for {} parameters, each marked one a 2-D high-precision GEMM weight: mark the \
                     [out, in] weights only",
                    fp8.len(),
                    params.len()
                ),
            });
        }
        let mut fp8_weights = self.fp8_weights;
        let mut marks = fp8.iter();
        let mut members = Vec::with_capacity(params.len());
        for (param, value) in params {
            let param = *param;
            let taken = self.groups.iter().flatten().chain(&members).any(|m: &Member| m.param == param);
            if param >= self.shards.len() || value.numel() != self.shards.numel(param) || taken {
                return Err(Error::Argument {
                    op: MODULE,
                    message: format!(
                        "parameter {param} of {} elements: the shards describe {} parameters (this one of {} \
                         elements), each in one group at most{}",
                        value.numel(),
                        self.shards.len(),
                        self.shards.numel(param),
                        if taken { "; it is in a group already" } else { "" }
                    ),
                });
            }
            let piece = local_piece(&self.shards, rank, param);
            let local = Tensor::empty(&self.dev, value.dtype(), &[piece.len()])?;
            local.copy_elements_from(0, value, piece.start, piece.len())?;
            let fp8 = marks.next().copied().unwrap_or(false).then(|| {
                fp8_weights += 1;
                fp8_weights - 1
            });
            members.push(Member { param, shape: value.shape().to_vec(), dtype: value.dtype(), piece, local, fp8 });
        }
        self.groups.push(members);
        self.fp8_weights = fp8_weights;
        Ok(self.groups.len() - 1)
    }

    /// The device the pieces live on.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }

    /// Groups added.
    pub fn groups(&self) -> usize {
        self.groups.len()
    }

    /// The parameters (whole model's traversal indices) of group `g`, in its order; none past
    /// the last group.
    pub fn params(&self, g: usize) -> Vec<usize> {
        self.groups.get(g).map_or_else(Vec::new, |m| m.iter().map(|m| m.param).collect())
    }

    /// Whether parameter `param` (traversal index) is in a group.
    pub fn is_sharded(&self, param: usize) -> bool {
        self.groups.iter().flatten().any(|m| m.param == param)
    }

    /// This rank's pieces, by the whole model's traversal index: `Some` for every sharded
    /// parameter (a `[piece_len]` tensor sharing the store's storage, `[0]` where this rank owns
    /// none; an optimizer writes its update into it in place), `None` for the others. The same
    /// `Some`/`None` pattern on every rank.
    pub fn local_pieces(&self) -> Vec<Option<Tensor>> {
        let mut out = vec![None; self.shards.len()];
        for m in self.groups.iter().flatten() {
            out[m.param] = Some(m.local.clone());
        }
        out
    }

    /// Bytes of the pieces this rank keeps, and of the whole parameters of all groups.
    pub fn bytes(&self) -> (u64, u64) {
        self.groups.iter().flatten().fold((0, 0), |(local, whole), m| {
            let elem = m.dtype.size_bytes() as u64;
            (local + m.piece.len() as u64 * elem, whole + self.shards.numel(m.param) as u64 * elem)
        })
    }

    /// Bytes of the whole parameters of the largest group (what one slot of the ring holds).
    pub fn max_group_bytes(&self) -> u64 {
        let group_bytes =
            |g: &Vec<Member>| g.iter().map(|m| (self.shards.numel(m.param) * m.dtype.size_bytes()) as u64).sum();
        self.groups.iter().map(group_bytes).max().unwrap_or(0)
    }

    /// Starts gathering group `g` into its slot on the side stream, after the work issued so
    /// far on the device's stream (nothing when it is there or on its way already). Every
    /// rank issues the same prefetches in the same order.
    ///
    /// # Errors
    /// [`Error::Argument`] for a group past the last, or when its slot holds another group not
    /// released yet; allocation, copy and NCCL errors.
    pub fn prefetch(&mut self, g: usize) -> Result<()> {
        let members = self.groups.get(g).ok_or_else(|| self.no_group(g))?;
        let (side, dev, shards, buffers) = (&self.side, &self.dev, &self.shards, &mut self.buffers);
        let fp8 = self.fp8.as_ref();
        let mut issue = |at: usize| fill(side, dev, shards, members, &mut buffers[at], fp8);
        self.ring.prefetch(g, &mut |mark| side.wait_mark(&mark), &mut issue)
    }

    /// Group `g`'s whole tensors (in its order, clones sharing the slot's buffers; a marked
    /// GEMM weight as FP8 codes while an FP8 gather is on): gathered now unless
    /// [`ParamShards::prefetch`] started it, and the device's stream made to wait for the
    /// gather (an event; the host does not wait). Valid until [`ParamShards::release`] of `g`;
    /// point the modules' parameters at them.
    ///
    /// # Errors
    /// As [`ParamShards::prefetch`]; driver errors.
    pub fn gather(&mut self, g: usize) -> Result<Vec<Gathered>> {
        let members = self.groups.get(g).ok_or_else(|| self.no_group(g))?;
        let (side, dev, shards, buffers) = (&self.side, &self.dev, &self.shards, &mut self.buffers);
        let fp8 = self.fp8.as_ref();
        let mut issue = |at: usize| fill(side, dev, shards, members, &mut buffers[at], fp8);
        let at = self.ring.gather(g, &mut |mark| side.wait_mark(&mark), &mut issue)?;
        Ok(self.buffers[at].clone())
    }

    /// Group `g`'s values as [`ParamShards::gather`] returned them, while its slot holds it
    /// (fresh clones: an FP8 weight without the transpose a layer made of it); `None` once
    /// released.
    pub fn held(&self, g: usize) -> Option<Vec<Gathered>> {
        self.ring.holds(g).then(|| self.buffers[self.ring.slot_of(g)].clone())
    }

    /// Turns the FP8 gather on for the gathers from now on, with `quantizer` (the recipe's
    /// weight quantizer, [`crate::fp8::ScalingRecipe::sharded_weight_quantizer`]), or off
    /// (`None`: every parameter gathered in high precision). On, it takes the amax of each
    /// piece of the marked weights ([`ParamShards::add_group_fp8`]) and all-reduces (max) them
    /// over the group on the device's stream, so every rank casts its pieces with the scale of
    /// the whole weight: call it after the pieces last changed (an optimizer step, a load) and
    /// before the step's first gather, on every rank (a collective when on). Slots that hold a
    /// group keep its values (release them first to gather anew).
    ///
    /// # Errors
    /// [`Error::Argument`] for a quantizer that is not a per-tensor FP8 one; NCCL, launch and
    /// allocation errors (the gather is off then).
    pub fn set_fp8_gather(&mut self, quantizer: Option<Box<dyn Quantizer>>) -> Result<()> {
        self.fp8 = None;
        let Some(quantizer) = quantizer.filter(|_| self.fp8_weights > 0) else { return Ok(()) };
        if quantizer.block_scale().is_some() || !quantizer.dtype().is_fp8() {
            return Err(Error::Argument {
                op: MODULE,
                message: format!(
                    "an FP8 gather with a {} quantizer{}: pass a per-tensor FP8 weight quantizer \
                     (ScalingRecipe::sharded_weight_quantizer)",
                    quantizer.dtype(),
                    if quantizer.block_scale().is_some() { " of block scales" } else { "" }
                ),
            });
        }
        let mut amax = self.dev.stream().alloc_zeros::<f32>(self.fp8_weights)?;
        // A quantizer whose scale does not come from the amax it is handed (delayed scaling's,
        // a given scale) would cast the pieces with scales of their own.
        let probe = Fp8Gather { quantizer, amax: self.dev.stream().alloc_zeros::<f32>(1)? };
        let stand_in = Tensor::empty(&self.dev, DType::BF16, &[0])?;
        if let Err(e) = probe.cast(&self.dev, &stand_in, 0) {
            return Err(Error::Argument {
                op: MODULE,
                message: format!(
                    "an FP8 gather needs a quantizer whose scale is the whole weight's amax ({e}): pass \
                     ScalingRecipe::sharded_weight_quantizer's (current scaling)"
                ),
            });
        }
        let quantizer = probe.quantizer;
        for m in self.groups.iter().flatten() {
            if let (Some(i), true) = (m.fp8, m.local.numel() > 0) {
                ops::cast::amax(&self.dev, &m.local, &mut amax.slice_mut(i..i + 1))?;
            }
        }
        self.group.all_reduce(&mut amax, ReduceOp::Max)?;
        self.fp8 = Some(Fp8Gather { quantizer, amax });
        Ok(())
    }

    /// Whether the gathers cast the marked weights to FP8 ([`ParamShards::set_fp8_gather`]).
    pub fn fp8_gather(&self) -> bool {
        self.fp8.is_some()
    }

    /// Ends group `g`'s use of its slot: the next gather there overwrites the buffers (after
    /// the kernels issued before it, which may still read them). The next [`ParamShards::gather`]
    /// of `g` gathers again. Nothing to do for a group not in its slot.
    pub fn release(&mut self, g: usize) {
        self.ring.release(g);
    }

    /// Releases every group (after an optimizer step or a load changed the pieces: no slot
    /// holds values to reuse).
    pub fn release_all(&mut self) {
        self.ring.release_all();
    }

    /// Group `g`'s whole tensors in buffers of their own (not the ring's), gathered on the
    /// device's stream: what a checkpoint save or the end of a run takes. Every rank calls it.
    ///
    /// # Errors
    /// As [`ParamShards::prefetch`].
    pub fn gather_whole(&self, g: usize) -> Result<Vec<Tensor>> {
        let members = self.groups.get(g).ok_or_else(|| self.no_group(g))?;
        // The ring's gathers in flight go first (another communicator, another stream).
        self.side.wait()?;
        let mut tensors = Vec::with_capacity(members.len());
        for m in members {
            let t = Tensor::empty(&self.dev, m.dtype, &m.shape)?;
            t.copy_elements_from(m.piece.start, &m.local, 0, m.piece.len())?;
            tensors.push(t);
        }
        broadcast_pieces(&self.group, &self.shards, members, &tensors.iter().collect::<Vec<_>>())?;
        Ok(tensors)
    }

    /// Replaces this rank's pieces of group `g` by theirs in `values` (the group's whole
    /// tensors in its order: a checkpoint's, loaded on every rank), and releases the group.
    ///
    /// # Errors
    /// [`Error::Argument`] for a group past the last; [`Error::Shape`] / [`Error::DType`] for
    /// values of other shapes or dtypes than the group's; copy errors.
    pub fn scatter(&mut self, g: usize, values: &[Tensor]) -> Result<()> {
        let members = self.groups.get(g).ok_or_else(|| self.no_group(g))?;
        let fits = values.len() == members.len()
            && values.iter().zip(members).all(|(v, m)| v.shape() == m.shape.as_slice() && v.dtype() == m.dtype);
        if !fits {
            let got: Vec<_> = values.iter().map(|v| (v.shape().to_vec(), v.dtype())).collect();
            let want: Vec<_> = members.iter().map(|m| (m.shape.clone(), m.dtype)).collect();
            return Err(Error::Shape {
                op: MODULE,
                message: format!("group {g}: values {got:?} for parameters {want:?}: pass the group's whole tensors"),
            });
        }
        for (v, m) in values.iter().zip(members) {
            m.local.copy_elements_from(0, v, m.piece.start, m.piece.len())?;
        }
        self.release(g);
        Ok(())
    }

    fn no_group(&self, g: usize) -> Error {
        Error::Argument { op: MODULE, message: format!("group {g} of {}: add it first", self.groups.len()) }
    }
}

/// Gathers the group of `members` into a slot's `buffers` (made anew unless they have the
/// group's shapes and dtypes): this rank's pieces copied into place on the device's stream
/// (the marked weights cast to FP8 first under `fp8`), then every piece broadcast in place
/// from its owner, in one NCCL group on the `side` stream (which first waits for the device's
/// stream). Returns the side stream's point after the broadcasts.
fn fill(
    side: &ProcessGroup,
    dev: &Arc<Device>,
    shards: &GradShards,
    members: &[Member],
    buffers: &mut Vec<Gathered>,
    fp8: Option<&Fp8Gather>,
) -> Result<SideMark> {
    let cast = |m: &Member| m.fp8.zip(fp8);
    let dtype = |m: &Member| cast(m).map_or(m.dtype, |(_, g)| g.quantizer.dtype());
    // The buffers are reused when the group has the slot's shapes (a decoder's layers).
    let fits = buffers.len() == members.len()
        && buffers
            .iter()
            .zip(members)
            .all(|(b, m)| b.data().shape() == m.shape.as_slice() && b.data().dtype() == dtype(m));
    if !fits {
        *buffers = members
            .iter()
            .map(|m| Tensor::empty(dev, dtype(m), &m.shape).map(Gathered::High))
            .collect::<Result<_>>()?;
    }
    // This rank's pieces into place (on the device's stream, after the slot's last readers and
    // after the slot's previous gather, which the ring waited for), then every piece from its
    // owner: in place, so the owner's copy is what it sends.
    for (b, m) in buffers.iter_mut().zip(members) {
        let data = b.data().clone();
        *b = match cast(m) {
            Some((i, g)) => {
                let piece = g.cast(dev, &m.local, i)?;
                data.copy_elements_from(m.piece.start, piece.data(), 0, m.piece.len())?;
                Gathered::Fp8(Float8Tensor::from_parts(data, None, piece.scale_inv_shared())?)
            }
            None => {
                data.copy_elements_from(m.piece.start, &m.local, 0, m.piece.len())?;
                Gathered::High(data)
            }
        };
    }
    broadcast_pieces(side, shards, members, &buffers.iter().map(Gathered::data).collect::<Vec<_>>())?;
    side.mark()
}

/// Every piece of the group of `members` broadcast in place into `tensors` (the members' whole
/// tensors, in their order) from the rank that owns it, in one NCCL group on `group`'s stream:
/// the bytes of an all-gather of the group.
fn broadcast_pieces(group: &ProcessGroup, shards: &GradShards, members: &[Member], tensors: &[&Tensor]) -> Result<()> {
    let params: Vec<usize> = members.iter().map(|m| m.param).collect();
    let calls = shards.calls(&params);
    group.grouped(|| {
        calls.iter().try_for_each(|c| {
            let at = params.iter().position(|&p| p == c.param);
            let t = at.and_then(|i| tensors.get(i)).ok_or_else(|| {
                Error::internal(MODULE, format!("a gather of parameter {} outside its group", c.param))
            })?;
            group.broadcast_range_shared(t, c.range.clone(), c.root)
        })
    })
}

/// The elements of parameter `param` rank `rank` owns under `shards` (an empty range when none).
pub fn local_piece(shards: &GradShards, rank: usize, param: usize) -> Range<usize> {
    shards.shards(param).iter().find(|s| s.root == rank).map_or(0..0, |s| s.range.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::Shard;

    /// Sizes that are not multiples of the ranks, split unevenly: a parameter over three ranks,
    /// one over two, one whole on a rank, an empty one.
    fn uneven() -> GradShards {
        let s = |root, range| Shard { root, range };
        GradShards::new(
            3,
            vec![vec![s(0, 0..7), s(1, 7..13), s(2, 13..17)], vec![s(2, 0..5)], vec![], vec![s(0, 0..2), s(1, 2..11)]],
        )
        .unwrap()
    }

    #[test]
    fn each_rank_keeps_its_pieces_and_they_cover_every_parameter_once() {
        let g = uneven();
        for param in 0..g.len() {
            let mut covered = vec![0u8; g.numel(param)];
            for rank in 0..g.world() {
                for i in local_piece(&g, rank, param) {
                    covered[i] += 1;
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "param {param}: {covered:?}");
        }
        assert_eq!(local_piece(&g, 1, 0), 7..13);
        assert_eq!(local_piece(&g, 0, 1), 0..0, "rank 0 owns nothing of parameter 1");
        assert_eq!(local_piece(&g, 2, 2), 0..0, "an empty parameter has no piece");
        assert_eq!(local_piece(&g, 9, 0), 0..0, "a rank past the group owns nothing");
        // The gather of a group is one broadcast per piece, from its owner, in the group's order.
        let calls = g.calls(&[3, 1]);
        let roots: Vec<(usize, usize, Range<usize>)> = calls.into_iter().map(|c| (c.param, c.root, c.range)).collect();
        assert_eq!(roots, [(3, 0, 0..2), (3, 1, 2..11), (1, 2, 0..5)]);
        // What each rank keeps adds up to the parameters' elements.
        let kept: usize =
            (0..3).flat_map(|r| (0..g.len()).map(move |p| (r, p))).map(|(r, p)| local_piece(&g, r, p).len()).sum();
        assert_eq!(kept, 17 + 5 + 11);
    }
}
