//! Which ZeRO stage a data-parallel run's optimizer uses ([`ZeroStage`], `te train --zero`) and
//! what its state costs each rank ([`OptimizerMemory`]).

use crate::error::TrainError;

/// How a data-parallel run holds its optimizer state (ZeRO, Rajbhandari et al. 2020; Megatron-LM's
/// `--use-distributed-optimizer` is stage 1). Only the stages built here exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ZeroStage {
    /// Stage 0: every rank holds all of the f32 masters and moments ([`super::AdamW::new`]).
    #[default]
    Replicated,
    /// Stage 1: the masters and moments are sharded over the data-parallel group, each rank
    /// updating its piece of the parameters ([`super::AdamW::new_zero`]); gradients and
    /// parameters stay whole on every rank.
    OptimizerStates,
}

impl ZeroStage {
    /// The stage's number: 0 or 1.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Replicated => 0,
            ZeroStage::OptimizerStates => 1,
        }
    }

    /// The stage numbered `stage`.
    ///
    /// # Errors
    /// [`TrainError::Config`] (field `zero`) for a stage not built here (2 and 3 shard the
    /// gradients and parameters too).
    pub fn from_number(stage: u8) -> Result<Self, TrainError> {
        match stage {
            0 => Ok(ZeroStage::Replicated),
            1 => Ok(ZeroStage::OptimizerStates),
            s => Err(TrainError::Config {
                field: "zero",
                message: format!(
                    "ZeRO stage {s} is not built: 0 (replicated optimizer state) or 1 (optimizer state sharded over \
                     the data-parallel ranks)"
                ),
            }),
        }
    }
}

/// The optimizer state of one rank of a run: what ZeRO saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerMemory {
    /// The stage the run used (stage 1 over one rank holds everything, as stage 0).
    pub stage: ZeroStage,
    /// Ranks the state is split over (1 when replicated).
    pub ranks: usize,
    /// Bytes of f32 masters and moments this rank holds ([`super::AdamW::state_bytes`]).
    pub bytes_per_rank: u64,
    /// Bytes a replicated optimizer holds on each rank ([`super::AdamW::replicated_state_bytes`]).
    pub replicated_bytes: u64,
}

impl OptimizerMemory {
    /// `bytes_per_rank / replicated_bytes` (1 for a replicated optimizer; about `1 / ranks`
    /// for ZeRO-1); NaN for a model without parameters.
    pub fn fraction(&self) -> f64 {
        self.bytes_per_rank as f64 / self.replicated_bytes as f64
    }

    /// One line for a run's report, e.g. `optimizer state 142.3 MiB per rank (ZeRO-1 over 4
    /// ranks: 0.250 × the replicated 569.4 MiB)`.
    pub fn describe(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        match (self.stage, self.ranks) {
            (ZeroStage::OptimizerStates, n) if n > 1 => format!(
                "optimizer state {:.1} MiB per rank (ZeRO-1 over {n} ranks: {:.3} × the replicated {:.1} MiB)",
                mib(self.bytes_per_rank),
                self.fraction(),
                mib(self.replicated_bytes)
            ),
            _ => format!("optimizer state {:.1} MiB per rank (replicated)", mib(self.bytes_per_rank)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_round_trip_and_unbuilt_ones_are_refused() {
        for s in [ZeroStage::Replicated, ZeroStage::OptimizerStates] {
            assert_eq!(ZeroStage::from_number(s.number()).unwrap(), s);
        }
        assert_eq!(ZeroStage::default(), ZeroStage::Replicated);
        for bad in [2, 3, 255] {
            let e = ZeroStage::from_number(bad).unwrap_err();
            assert!(matches!(e, TrainError::Config { field: "zero", .. }), "{e}");
            assert!(e.to_string().contains(&format!("ZeRO stage {bad} is not built")), "{e}");
        }
    }

    #[test]
    fn the_memory_line_gives_the_cut() {
        let replicated = 12 * 124_475_904u64;
        let zero = OptimizerMemory {
            stage: ZeroStage::OptimizerStates,
            ranks: 4,
            bytes_per_rank: replicated / 4 + 12 * 1000,
            replicated_bytes: replicated,
        };
        assert!((zero.fraction() - 0.25).abs() < 1e-4, "{}", zero.fraction());
        assert_eq!(
            zero.describe(),
            "optimizer state 356.1 MiB per rank (ZeRO-1 over 4 ranks: 0.250 × the replicated 1424.5 MiB)"
        );
        let full = OptimizerMemory { stage: ZeroStage::Replicated, ranks: 1, bytes_per_rank: replicated, ..zero };
        assert_eq!(full.fraction(), 1.0);
        assert_eq!(full.describe(), "optimizer state 1424.5 MiB per rank (replicated)");
    }
}
