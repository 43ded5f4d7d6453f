//! Which ZeRO stage a data-parallel run's optimizer uses ([`ZeroStage`], `te train --zero`) and
//! what its state costs each rank ([`OptimizerMemory`]).

use crate::error::TrainError;

/// How a data-parallel run holds its optimizer state and gradients (ZeRO, Rajbhandari et al.
/// 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"; Megatron-LM's
/// `--use-distributed-optimizer` is stage 1 with stage 2's reduce-scatter of the gradients,
/// DeepSpeed's `zero_optimization.stage`). Only the stages built here exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ZeroStage {
    /// Stage 0: every rank holds all of the f32 masters and moments ([`super::AdamW::new`]).
    #[default]
    Replicated,
    /// Stage 1: the masters and moments are sharded over the data-parallel group, each rank
    /// updating its piece of the parameters ([`super::AdamW::new_zero`]); gradients and
    /// parameters stay whole on every rank.
    OptimizerStates,
    /// Stage 2: the masters and moments sharded as in stage 1, and the gradients too: each
    /// piece of a gradient is reduced only to the rank that owns it (`ncclReduce`, instead of
    /// an all-reduce; [`te_nn::parallel::DataParallel::set_grad_shards`]), and a rank releases
    /// the gradients of the parameters it owns no piece of once their reduction is done, during
    /// the backward ([`super::AdamW::new_zero_stage`], [`super::AdamW::step_reduced`]). With
    /// gradient accumulation the gradients are whole until the last micro-batch's backward, so
    /// the memory is saved from there to the step only. Parameters stay whole on every rank.
    Gradients,
    /// Stage 3: stage 2, and the 16-bit weights of the model's layers sharded too (PyTorch
    /// FSDP, DeepSpeed's `zero_optimization.stage = 3`): each rank keeps its pieces of them
    /// (the pieces it holds the masters of, [`te_nn::parallel::ParamShards`]), a layer's whole
    /// weights are gathered into transient buffers just before its forward and again before
    /// its backward, and a step updates the pieces in place with no broadcast after it
    /// ([`super::AdamW::step_sharded`]). Built for the decoder family under full activation
    /// recompute (`te_models::decoder::train::DecoderLm::set_zero3`); the embedding, final
    /// norm and LM head stay whole on every rank, as at stage 2.
    Parameters,
}

impl ZeroStage {
    /// The stage's number: 0, 1, 2 or 3.
    pub fn number(self) -> u8 {
        match self {
            ZeroStage::Replicated => 0,
            ZeroStage::OptimizerStates => 1,
            ZeroStage::Gradients => 2,
            ZeroStage::Parameters => 3,
        }
    }

    /// The stage numbered `stage`.
    ///
    /// # Errors
    /// [`TrainError::Config`] (field `zero`) for a number above 3.
    pub fn from_number(stage: u8) -> Result<Self, TrainError> {
        match stage {
            0 => Ok(ZeroStage::Replicated),
            1 => Ok(ZeroStage::OptimizerStates),
            2 => Ok(ZeroStage::Gradients),
            3 => Ok(ZeroStage::Parameters),
            s => Err(TrainError::Config {
                field: "zero",
                message: format!(
                    "ZeRO stage {s} does not exist: 0 (replicated optimizer state), 1 (optimizer state sharded over \
                     the data-parallel ranks), 2 (optimizer state and gradients sharded) or 3 (the layers' weights \
                     sharded too)"
                ),
            }),
        }
    }

    /// Whether the optimizer state is sharded (stages 1 to 3).
    pub fn shards_optimizer(self) -> bool {
        self != ZeroStage::Replicated
    }

    /// Whether the gradients are sharded (stages 2 and 3).
    pub fn shards_gradients(self) -> bool {
        matches!(self, ZeroStage::Gradients | ZeroStage::Parameters)
    }

    /// Whether the layers' weights are sharded (stage 3).
    pub fn shards_parameters(self) -> bool {
        self == ZeroStage::Parameters
    }
}

/// The optimizer state of one rank of a run: what ZeRO saves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptimizerMemory {
    /// The stage the run used (stages 1 and 2 over one rank hold everything, as stage 0).
    pub stage: ZeroStage,
    /// Ranks the state is split over (1 when replicated).
    pub ranks: usize,
    /// Bytes of f32 masters and moments this rank holds ([`super::AdamW::state_bytes`]).
    pub bytes_per_rank: u64,
    /// Bytes a replicated optimizer holds on each rank ([`super::AdamW::replicated_state_bytes`]).
    pub replicated_bytes: u64,
    /// Bytes of all of the model's gradients (each parameter's elements in its gradient's
    /// dtype): what a rank holds at the end of a backward unless ZeRO-2 releases some.
    pub gradient_bytes: u64,
    /// ZeRO-2 and ZeRO-3: bytes of the gradients this rank releases during the last
    /// micro-batch's backward (those of the parameters it owns no piece of,
    /// [`te_nn::parallel::GradShards::kept_and_released_bytes`]); 0 at the other stages.
    pub released_gradient_bytes: u64,
    /// ZeRO-3: bytes of the sharded weights this rank keeps (its pieces) and of those weights
    /// whole ([`te_nn::parallel::ParamShards::bytes`]); `(0, 0)` at the other stages.
    pub sharded_weight_bytes: (u64, u64),
}

impl OptimizerMemory {
    /// `bytes_per_rank / replicated_bytes` (1 for a replicated optimizer; about `1 / ranks`
    /// for ZeRO-1 and ZeRO-2); NaN for a model without parameters.
    pub fn fraction(&self) -> f64 {
        self.bytes_per_rank as f64 / self.replicated_bytes as f64
    }

    /// One line for a run's report, e.g. `optimizer state 142.3 MiB per rank (ZeRO-1 over 4
    /// ranks: 0.250 × the replicated 569.4 MiB)`; ZeRO-2 adds the gradients it releases
    /// (`; gradients: 180.1 of 237.2 MiB released per rank after the backward`).
    pub fn describe(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let state = self.describe_state();
        match (self.stage, self.ranks) {
            (ZeroStage::Gradients, n) if n > 1 => format!(
                "{state}; gradients: {:.1} of {:.1} MiB released per rank after the backward",
                mib(self.released_gradient_bytes),
                mib(self.gradient_bytes)
            ),
            (ZeroStage::Parameters, n) if n > 1 => format!(
                "{state}; gradients: {:.1} of {:.1} MiB released per rank after the backward; layer weights: {:.1} of \
                 {:.1} MiB kept per rank",
                mib(self.released_gradient_bytes),
                mib(self.gradient_bytes),
                mib(self.sharded_weight_bytes.0),
                mib(self.sharded_weight_bytes.1)
            ),
            _ => state,
        }
    }

    /// The optimizer state's part of [`OptimizerMemory::describe`].
    fn describe_state(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        match (self.stage, self.ranks) {
            (stage, n) if n > 1 && stage.shards_optimizer() => format!(
                "optimizer state {:.1} MiB per rank (ZeRO-{} over {n} ranks: {:.3} × the replicated {:.1} MiB)",
                mib(self.bytes_per_rank),
                stage.number(),
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
        let stages = [ZeroStage::Replicated, ZeroStage::OptimizerStates, ZeroStage::Gradients, ZeroStage::Parameters];
        for (n, s) in stages.into_iter().enumerate() {
            assert_eq!(ZeroStage::from_number(s.number()).unwrap(), s);
            assert_eq!(usize::from(s.number()), n);
            let shards = (s.shards_optimizer(), s.shards_gradients(), s.shards_parameters());
            assert_eq!(shards, (n >= 1, n >= 2, n == 3), "{s:?}");
        }
        assert_eq!(ZeroStage::default(), ZeroStage::Replicated);
        for bad in [4, 255] {
            let e = ZeroStage::from_number(bad).unwrap_err();
            assert!(matches!(e, TrainError::Config { field: "zero", .. }), "{e}");
            assert!(e.to_string().contains(&format!("ZeRO stage {bad} does not exist")), "{e}");
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
            gradient_bytes: 2 * 124_475_904,
            released_gradient_bytes: 0,
            sharded_weight_bytes: (0, 0),
        };
        assert!((zero.fraction() - 0.25).abs() < 1e-4, "{}", zero.fraction());
        assert_eq!(
            zero.describe(),
            "optimizer state 356.1 MiB per rank (ZeRO-1 over 4 ranks: 0.250 × the replicated 1424.5 MiB)"
        );
        let two = OptimizerMemory { stage: ZeroStage::Gradients, released_gradient_bytes: 186_713_856, ..zero };
        assert_eq!(
            two.describe(),
            "optimizer state 356.1 MiB per rank (ZeRO-2 over 4 ranks: 0.250 × the replicated 1424.5 MiB); gradients: \
             178.1 of 237.4 MiB released per rank after the backward"
        );
        let three =
            OptimizerMemory { stage: ZeroStage::Parameters, sharded_weight_bytes: (50 << 20, 200 << 20), ..two };
        assert_eq!(
            three.describe(),
            "optimizer state 356.1 MiB per rank (ZeRO-3 over 4 ranks: 0.250 × the replicated 1424.5 MiB); gradients: \
             178.1 of 237.4 MiB released per rank after the backward; layer weights: 50.0 of 200.0 MiB kept per rank"
        );
        let one_rank = OptimizerMemory { ranks: 1, bytes_per_rank: replicated, ..two };
        assert_eq!(one_rank.describe(), "optimizer state 1424.5 MiB per rank (replicated)");
        let full = OptimizerMemory { stage: ZeroStage::Replicated, ranks: 1, bytes_per_rank: replicated, ..zero };
        assert_eq!(full.fraction(), 1.0);
        assert_eq!(full.describe(), "optimizer state 1424.5 MiB per rank (replicated)");
    }
}
