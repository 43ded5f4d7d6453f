//! Context parallelism of a [`DecoderLm`] ([`DecoderLm::set_context_parallel`]; TE's context
//! parallelism with `cp_comm_type="p2p"` (the ring, the default) or `"all_gather"`, as the
//! [`ContextParallel`] says; Megatron-LM's `--context-parallel-size`):
//! every sequence of a batch split over the ranks of a context-parallel group in load-balanced
//! chunks ([`ContextParallel`]: rank `r` of `cp` holds chunks `r` and `2·cp − 1 − r` of `2·cp`),
//! each rank running the embedding, the layers, the final norm, the LM head and the loss on its
//! `2c` tokens of every sequence, RoPE at the tokens' global positions, and the attention over
//! every rank's keys and values. Only the attention communicates; the parameters are
//! replicated over the group, so their gradients are averaged over context × data by the
//! caller (`te_nn::parallel::Parallel::data`).

use super::DecoderLm;
use te_nn::parallel::ContextParallel;
use te_runtime::{Error, Result};

const MODEL: &str = "DecoderLm";

impl DecoderLm {
    /// Splits every sequence of the next forwards over `cp`'s ranks (`None`: whole sequences,
    /// the default). The ids and targets of [`DecoderLm::forward_loss_with`] are then this
    /// rank's part `[2c, b]` of `b` sequences of `S = 2·cp·c` tokens (its chunks `r` and `2·cp −
    /// 1 − r` stacked: [`ContextParallel::shard`] of the `[S, b]` batch), the loss the mean over
    /// this rank's targets (every rank holds equally many tokens, so averaging the gradients
    /// over the group gives those of the whole sequences' mean), and every rank of `cp` runs the
    /// same forwards and backwards. Full recompute ([`DecoderLm::set_recompute`]) works with
    /// it (the recomputed forward exchanges the keys and values again).
    ///
    /// # Errors
    /// The attention's refusals ([`Error::Config`]: tensor parallelism). Packed documents
    /// (`thd`) are refused at the forward.
    pub fn set_context_parallel(&mut self, cp: Option<ContextParallel>) -> Result<()> {
        for layer in &mut self.layers {
            layer.set_context_parallel(cp.clone())?;
        }
        self.cp = cp;
        Ok(())
    }

    /// The context-parallel group of [`DecoderLm::set_context_parallel`].
    pub fn context_parallel(&self) -> Option<&ContextParallel> {
        self.cp.as_ref()
    }

    /// Ranks every sequence is split over (1 without context parallelism).
    pub(super) fn context_parallel_size(&self) -> usize {
        self.cp.as_ref().map_or(1, ContextParallel::size)
    }

    /// With context parallelism, the global positions of this rank's `local` tokens of every
    /// sequence (what RoPE rotates by); `None` without it.
    ///
    /// # Errors
    /// [`Error::Config`] for packed documents (`thd`) with context parallelism; [`Error::Shape`]
    /// for a part that is not two chunks of equal length.
    pub(super) fn cp_positions(&self, local: usize, thd: bool) -> Result<Option<Vec<usize>>> {
        let Some(cp) = &self.cp else { return Ok(None) };
        if thd {
            return Err(Error::Config {
                module: MODEL,
                message: "packed documents (thd) with context parallelism are not built: train on windows \
                          (--pack blocks) or without --context-parallel"
                    .into(),
            });
        }
        if local == 0 || local % 2 != 0 {
            return Err(Error::Shape {
                op: MODEL,
                message: format!(
                    "{local} tokens a sequence on this context-parallel rank: a rank holds two chunks of equal length \
                     (ContextParallel::shard of the whole sequences)"
                ),
            });
        }
        cp.positions(local * cp.size()).map(Some)
    }
}

/// Rank `rank` of `cp`'s part of a `[seq, batch]` row-major host batch (sequence-major, as the
/// model's layout): its chunks `rank` and `2·cp − 1 − rank` of every column, `[2c, batch]`
/// (what [`ContextParallel::shard`] does on the device, for the data loader).
///
/// # Errors
/// [`Error::Shape`] for `seq` not a positive multiple of `2·cp`, or `values` not `seq · batch`
/// long.
pub fn shard_rows<T: Copy>(values: &[T], (seq, batch): (usize, usize), (rank, cp): (usize, usize)) -> Result<Vec<T>> {
    if seq == 0 || cp == 0 || seq % (2 * cp) != 0 || values.len() != seq * batch || rank >= cp {
        return Err(Error::Shape {
            op: MODEL,
            message: format!(
                "a batch of {} values as [{seq}, {batch}] for context-parallel rank {rank} of {cp}: the sequence \
                 length must be a positive multiple of 2 · cp = {} (each rank holds two chunks)",
                values.len(),
                2 * cp
            ),
        });
    }
    let c = seq / (2 * cp);
    let second = 2 * cp - 1 - rank;
    let rows = (rank * c..(rank + 1) * c).chain(second * c..(second + 1) * c);
    Ok(rows.flat_map(|t| values[t * batch..(t + 1) * batch].iter().copied()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cp = 2 over 8 tokens of 2 columns: rank 0 holds rows 0, 1, 6, 7, rank 1 rows 2..6; the
    /// ranks' parts together are every row once, as `ContextParallel::chunks` lays them out.
    #[test]
    fn each_rank_takes_its_two_chunks_of_every_column() {
        let values: Vec<usize> = (0..16).collect(); // row t, column b: 2t + b
        assert_eq!(shard_rows(&values, (8, 2), (0, 2)).unwrap(), [0, 1, 2, 3, 12, 13, 14, 15]);
        assert_eq!(shard_rows(&values, (8, 2), (1, 2)).unwrap(), [4, 5, 6, 7, 8, 9, 10, 11]);
        for cp in 1..=4 {
            let seq = 2 * cp * 3;
            let values: Vec<usize> = (0..seq * 3).collect();
            let mut all: Vec<usize> = (0..cp).flat_map(|r| shard_rows(&values, (seq, 3), (r, cp)).unwrap()).collect();
            all.sort_unstable();
            assert_eq!(all, values, "cp {cp}: every token on one rank");
        }
        assert_eq!(shard_rows(&values, (8, 2), (0, 1)).unwrap(), values);
    }

    #[test]
    fn lengths_that_do_not_split_are_refused() {
        let e = shard_rows(&[0; 12], (6, 2), (0, 2)).unwrap_err().to_string();
        assert!(e.contains("multiple of 2 · cp = 4"), "{e}");
        assert!(shard_rows(&[0; 16], (8, 2), (2, 2)).is_err());
        assert!(shard_rows(&[0; 15], (8, 2), (0, 2)).is_err());
    }
}
