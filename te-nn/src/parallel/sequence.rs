//! The token-shard side of sequence parallelism (Megatron-LM's sequence parallelism, TE's
//! `sequence_parallel`): between the tensor-parallel GEMMs, the norms, dropout and residuals run
//! on each rank's `1 / tp` of the tokens (the first dim: `[s / tp, b, hidden]` in sbhd). This
//! hook is what a module asks about those shards: how many ranks share the tokens, which part is
//! this rank's, how to cut a whole tensor into it and gather it back, and the sum of the
//! parameter gradients each shard gives a part of (the norms'). Its single-GPU form
//! ([`SequenceParallel::none`]) is the identity: whole tokens, no collectives.
//!
//! Context parallelism (the sequence split over a group of its own for attention, coming next)
//! will be a hook beside this one, on the mesh's context axis ([`super::MeshAxis::Context`]).

use super::collectives::all_gather_rows;
use super::TpConfig;
use std::ops::Range;
use std::sync::Arc;
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::{Device, Error, Result, Tensor};

/// Whether (and over which group) a module's activations are token shards; see the module docs.
/// `Default` is [`SequenceParallel::none`].
#[derive(Debug, Clone, Default)]
pub struct SequenceParallel {
    group: Option<Arc<ProcessGroup>>,
}

impl SequenceParallel {
    /// Whole tokens on every rank: every method is the identity.
    pub fn none() -> Self {
        Self { group: None }
    }

    /// Tokens split over `group`'s ranks, rank `r` holding the `r`-th of `size` equal parts of
    /// the first dim.
    pub fn over(group: Arc<ProcessGroup>) -> Self {
        Self { group: Some(group) }
    }

    /// The token shards of a tensor-parallel config: over its group with `sequence_parallel`,
    /// else (or without `tp`) none.
    pub fn of(tp: Option<&TpConfig>) -> Self {
        Self { group: tp.filter(|tp| tp.sequence_parallel).map(|tp| tp.group.clone()) }
    }

    /// Whether the tokens are split.
    pub fn is_sharded(&self) -> bool {
        self.group.is_some()
    }

    /// The group the tokens are split over, `None` when they are whole.
    pub fn group(&self) -> Option<&Arc<ProcessGroup>> {
        self.group.as_ref()
    }

    /// Ranks sharing the tokens (1 when they are whole).
    pub fn size(&self) -> usize {
        self.group.as_ref().map_or(1, |g| g.size())
    }

    /// This rank's shard index (0 when the tokens are whole): what makes its dropout masks its
    /// own.
    pub fn rank(&self) -> usize {
        self.group.as_ref().map_or(0, |g| g.rank())
    }

    /// The whole first dim of a tensor whose shard has `local` rows.
    pub fn whole_len(&self, local: usize) -> usize {
        local * self.size()
    }

    /// This rank's rows `[whole·r/n, whole·(r+1)/n)` of a first dim of `whole` rows.
    ///
    /// # Errors
    /// [`Error::Shape`] naming `module` when `whole` is not a multiple of the group's size.
    pub fn shard_range(&self, module: &'static str, whole: usize) -> Result<Range<usize>> {
        shard_rows(module, whole, self.rank(), self.size())
    }

    /// This rank's shard of the whole `x` along the first dim (`x` itself when the tokens are
    /// whole).
    ///
    /// # Errors
    /// As [`SequenceParallel::shard_range`]; copy errors.
    pub fn scatter(&self, module: &'static str, dev: &Device, x: &Tensor) -> Result<Tensor> {
        if self.group.is_none() {
            return Ok(x.clone());
        }
        let whole = x.shape().first().copied().unwrap_or(0);
        x.narrow(dev, self.shard_range(module, whole)?)
    }

    /// The whole tensor from every rank's shard `x`, concatenated in rank order along the first
    /// dim (NCCL all-gather, in `x`'s dtype); `x` itself when the tokens are whole.
    ///
    /// # Errors
    /// NCCL and allocation errors.
    pub fn gather(&self, x: &Tensor) -> Result<Tensor> {
        match &self.group {
            Some(group) => all_gather_rows(group, x),
            None => Ok(x.clone()),
        }
    }

    /// Sums `grads` over the group in place, as one NCCL group launch (Megatron-LM's all-reduce
    /// of the norms' gradients: each rank's shard gives part of them, so every rank ends up with
    /// the whole batch's). Nothing when the tokens are whole.
    ///
    /// # Errors
    /// NCCL errors.
    pub fn sum_grads(&self, grads: &mut [&mut Tensor]) -> Result<()> {
        let Some(group) = &self.group else { return Ok(()) };
        group.grouped(|| grads.iter_mut().try_for_each(|g| group.all_reduce(&mut **g, ReduceOp::Sum)))?;
        group.wait()
    }
}

/// Rank `rank` of `size`'s rows of a first dim of `whole` rows, split into equal parts.
///
/// # Errors
/// [`Error::Shape`] naming `module` when `whole` is not a multiple of `size` (or `size` is 0).
pub(crate) fn shard_rows(module: &'static str, whole: usize, rank: usize, size: usize) -> Result<Range<usize>> {
    if size == 0 || whole % size != 0 {
        return Err(Error::Shape {
            op: module,
            message: format!(
                "sequence parallelism splits the sequence length {whole} over {size} ranks: make it a multiple of \
                 {size}"
            ),
        });
    }
    let part = whole / size;
    Ok(rank * part..(rank + 1) * part)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each rank holds its equal, consecutive part of the sequence; the parts tile it.
    #[test]
    fn ranks_hold_consecutive_equal_parts() {
        let parts: Vec<_> = (0..4).map(|r| shard_rows("Gpt", 32, r, 4).unwrap()).collect();
        assert_eq!(parts, [0..8, 8..16, 16..24, 24..32]);
        assert_eq!(shard_rows("Gpt", 32, 0, 1).unwrap(), 0..32);
        let none = SequenceParallel::none();
        assert_eq!((none.size(), none.rank(), none.whole_len(12), none.is_sharded()), (1, 0, 12, false));
        assert_eq!(none.shard_range("Gpt", 7).unwrap(), 0..7);
    }

    /// A sequence that does not split evenly is a typed error naming the module and what to do.
    #[test]
    fn uneven_sequences_are_typed_errors() {
        let e = shard_rows("Gpt", 30, 1, 4).unwrap_err().to_string();
        assert!(
            e.contains("Gpt") && e.contains("sequence length 30 over 4 ranks") && e.contains("multiple of 4"),
            "{e}"
        );
        assert!(shard_rows("Gpt", 30, 0, 0).is_err());
    }
}
