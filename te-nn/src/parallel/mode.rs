//! How one GEMM splits over a tensor-parallel group (TE's `parallel_mode`, Megatron-LM's
//! `ColumnParallelLinear` / `RowParallelLinear`) and the arithmetic that follows from it: this
//! rank's feature counts, which parameters are slices, who adds the bias, and which collective
//! runs where. Pure functions of the mode, the group's size and this rank's place in it; the
//! collectives themselves are [`super::GemmParallel`]'s.

use super::shard::Split;
use te_runtime::{Error, Result};

/// How a GEMM layer splits over its tensor-parallel group (TE's `parallel_mode`). The GEMM
/// modules take it where the split is chosen: `LinearConfig::parallel_mode`, or fixed by a block
/// (`LayerNormLinear` and the first GEMM of `LayerNormMLP` and of the attention are column, the
/// second ones row).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParallelMode {
    /// Output features split; the input is whole on every rank (all-gathered under sequence
    /// parallelism); the output stays split.
    Column,
    /// Input features split (the previous column-parallel output as is); the partial outputs are
    /// all-reduced (reduce-scattered under sequence parallelism).
    Row,
}

impl ParallelMode {
    /// The `(in, out)` features of this rank's slice of a `[n_in → n_out]` layer split over
    /// `size` ranks: `(n_in, n_out / size)` (column) or `(n_in / size, n_out)` (row).
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` and the dimension when it does not divide by `size`
    /// (or `size` is 0).
    pub fn local_features(
        self,
        module: &'static str,
        n_in: usize,
        n_out: usize,
        size: usize,
    ) -> Result<(usize, usize)> {
        let (name, dim) = match self {
            ParallelMode::Column => ("out_features", n_out),
            ParallelMode::Row => ("in_features", n_in),
        };
        if size == 0 || dim % size != 0 {
            return Err(Error::Config {
                module,
                message: format!(
                    "{name} = {dim} does not split over {size} tensor-parallel ranks ({self:?}-parallel): choose a \
                     tensor-parallel size that divides it"
                ),
            });
        }
        Ok(match self {
            ParallelMode::Column => (n_in, n_out / size),
            ParallelMode::Row => (n_in / size, n_out),
        })
    }

    /// How a `[out, in]` weight splits: along dim 0 (column) or 1 (row).
    pub fn weight_split(self) -> Split {
        match self {
            ParallelMode::Column => Split::Dim(0),
            ParallelMode::Row => Split::Dim(1),
        }
    }

    /// Whether `[weight, bias]` are slices on each rank: the weight always, the bias of a
    /// column-parallel layer (a row-parallel bias is whole on every rank).
    pub fn param_split(self) -> [bool; 2] {
        [true, self == ParallelMode::Column]
    }

    /// Whether rank `rank`'s GEMM adds the bias in forward: every column-parallel rank adds its
    /// slice; of the row-parallel ranks only rank 0 adds the whole bias to its partial output,
    /// so the sum holds it once.
    pub fn adds_bias(self, rank: usize) -> bool {
        self == ParallelMode::Column || rank == 0
    }

    /// Whether the forward's input is a token shard to all-gather before the GEMM (column under
    /// sequence parallelism).
    pub fn gathers_input(self, sequence_parallel: bool) -> bool {
        self == ParallelMode::Column && sequence_parallel
    }

    /// Whether the backward's output gradient is a token shard to all-gather before the GEMMs
    /// (row under sequence parallelism).
    pub fn gathers_grad_output(self, sequence_parallel: bool) -> bool {
        self == ParallelMode::Row && sequence_parallel
    }

    /// Whether the ranks' outputs are partial sums to reduce (row).
    pub fn reduces_output(self) -> bool {
        self == ParallelMode::Row
    }

    /// Whether the ranks' input gradients are partial sums to reduce (column: each rank's dgrad
    /// is its output slice's part).
    pub fn reduces_dgrad(self) -> bool {
        self == ParallelMode::Column
    }

    /// Refuses an FP8 output the ranks would have to sum (row: the partial outputs are summed in
    /// 16 bits).
    ///
    /// # Errors
    /// [`Error::Config`] naming `module` for `fp8_output` with row parallelism.
    pub fn check_fp8_output(self, module: &'static str, fp8_output: bool) -> Result<()> {
        if fp8_output && self.reduces_output() {
            return Err(Error::Config {
                module,
                message: "fp8_output with row parallelism: the ranks' partial outputs are summed in 16 bits, then \
                          cast; ask for a 16-bit output"
                    .into(),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Column splits the output features, row the input features; the weight and the bias
    /// follow (a row-parallel bias stays whole and only rank 0 adds it).
    #[test]
    fn modes_split_their_features_and_parameters() {
        let (c, r) = (ParallelMode::Column, ParallelMode::Row);
        assert_eq!(c.local_features("m", 64, 160, 2).unwrap(), (64, 80));
        assert_eq!(r.local_features("m", 64, 160, 4).unwrap(), (16, 160));
        assert_eq!(c.local_features("m", 64, 160, 1).unwrap(), (64, 160));
        assert_eq!((c.weight_split(), r.weight_split()), (Split::Dim(0), Split::Dim(1)));
        assert_eq!((c.param_split(), r.param_split()), ([true, true], [true, false]));
        assert!((0..4).all(|rank| c.adds_bias(rank)));
        assert_eq!((0..4).map(|rank| r.adds_bias(rank)).collect::<Vec<_>>(), [true, false, false, false]);
    }

    /// Which collective runs where: column gathers its input and reduces its dgrad, row reduces
    /// its output and gathers its output gradient; the gathers only under sequence parallelism.
    #[test]
    fn modes_name_their_collectives() {
        let (c, r) = (ParallelMode::Column, ParallelMode::Row);
        assert!(c.gathers_input(true) && !c.gathers_input(false) && !r.gathers_input(true));
        assert!(r.gathers_grad_output(true) && !r.gathers_grad_output(false) && !c.gathers_grad_output(true));
        assert!(r.reduces_output() && !c.reduces_output());
        assert!(c.reduces_dgrad() && !r.reduces_dgrad());
    }

    /// Splits that do not divide, a zero-size group and an FP8 output to sum are typed errors
    /// saying what to change.
    #[test]
    fn bad_splits_are_typed_errors() {
        let e = ParallelMode::Column.local_features("Linear", 64, 33, 2).unwrap_err().to_string();
        assert!(
            e.contains("out_features = 33") && e.contains("2 tensor-parallel ranks") && e.contains("Column"),
            "{e}"
        );
        let e = ParallelMode::Row.local_features("Linear", 30, 64, 4).unwrap_err().to_string();
        assert!(e.contains("in_features = 30") && e.contains("Row-parallel"), "{e}");
        assert!(ParallelMode::Row.local_features("Linear", 30, 64, 0).is_err());
        let e = ParallelMode::Row.check_fp8_output("Linear", true).unwrap_err().to_string();
        assert!(e.contains("fp8_output with row parallelism") && e.contains("16-bit output"), "{e}");
        assert!(ParallelMode::Row.check_fp8_output("Linear", false).is_ok());
        assert!(ParallelMode::Column.check_fp8_output("Linear", true).is_ok());
    }
}
