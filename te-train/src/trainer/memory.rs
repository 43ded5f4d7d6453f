//! The memory check before a GPU run allocates: the model's estimate (`Gpt::training_bytes_with`,
//! `DecoderLm::training_bytes_with`) less what ZeRO-1 shards away, and, when it does not fit,
//! the estimates of the memory flags the run has not set (`--zero 1` over its data-parallel
//! ranks, `--recompute full`, both), each saying whether it would fit in the free memory.

use crate::error::TrainError;
use crate::optim::ZeroStage;
use te_nn::modules::Recompute;
use te_runtime::Device;

/// A run's memory settings and how its estimate depends on them.
pub(super) struct MemoryPlan<'a> {
    /// The parameters a rank holds AdamW state for when replicated.
    pub parameters: u64,
    /// Data-parallel ranks.
    pub data_parallel: usize,
    /// The run's ZeRO stage.
    pub zero: ZeroStage,
    /// The run's recompute mode.
    pub recompute: Recompute,
    /// Whether `--recompute full` can run for this model (not a MoE GPT).
    pub recompute_possible: bool,
    /// The model's estimate in bytes for a recompute mode, optimizer state replicated.
    pub estimate: &'a dyn Fn(Recompute) -> u64,
}

impl MemoryPlan<'_> {
    /// The estimate (bytes) with `zero` and `recompute`: the model's, less the AdamW state
    /// (f32 master weights and two moments, 12 bytes a parameter) the other ranks hold under
    /// ZeRO-1 (`12 · P · (1 − 1/N)`; Megatron-LM's distributed optimizer).
    pub fn bytes(&self, zero: ZeroStage, recompute: Recompute) -> u64 {
        let base = (self.estimate)(recompute);
        match zero {
            ZeroStage::OptimizerStates if self.data_parallel > 1 => {
                let n = self.data_parallel as u64;
                base.saturating_sub(12 * self.parameters / n * (n - 1))
            }
            _ => base,
        }
    }

    /// The flags the run has not set that lower the estimate, with their estimates: `--zero 1`
    /// (data parallel only), `--recompute full` (where the model takes it), and both.
    pub fn alternatives(&self) -> Vec<(&'static str, u64)> {
        let zero = self.data_parallel > 1 && self.zero == ZeroStage::Replicated;
        let recompute = self.recompute_possible && !self.recompute.is_full();
        let mut out = Vec::new();
        if zero {
            out.push(("--zero 1", self.bytes(ZeroStage::OptimizerStates, self.recompute)));
        }
        if recompute {
            out.push(("--recompute full", self.bytes(self.zero, Recompute::Full)));
        }
        if zero && recompute {
            out.push(("--zero 1 --recompute full", self.bytes(ZeroStage::OptimizerStates, Recompute::Full)));
        }
        out
    }

    /// Fails with the device's out-of-memory error when the run's estimate, less `resident`
    /// bytes already on the device, exceeds the free memory. The message is `what(advice)`:
    /// `advice` names each alternative with its estimate and whether it would fit (`; --zero 1:
    /// about N MiB, fits`), for `what` to place inside its description.
    ///
    /// # Errors
    /// `te_runtime::Error::OutOfMemory`; driver errors reading the free memory.
    pub fn check(&self, dev: &Device, resident: u64, what: impl FnOnce(&str) -> String) -> Result<(), TrainError> {
        let needed = self.bytes(self.zero, self.recompute).saturating_sub(resident);
        let (free, _) = dev.memory_info()?;
        if needed <= free {
            return Ok(());
        }
        let advice = advice(&self.alternatives(), resident, free);
        dev.check_free_memory(needed, || what(&advice))?;
        Ok(())
    }
}

/// `; --zero 1: about N MiB, fits; ...` for `alternatives` (their bytes before `resident` is
/// taken off), or nothing.
fn advice(alternatives: &[(&str, u64)], resident: u64, free: u64) -> String {
    alternatives
        .iter()
        .map(|&(flag, bytes)| {
            let need = bytes.saturating_sub(resident);
            let verdict = if need <= free { "fits" } else { "does not fit" };
            format!("; {flag}: about {} MiB, {verdict}", need >> 20)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan<'a>(
        estimate: &'a dyn Fn(Recompute) -> u64,
        dp: usize,
        zero: ZeroStage,
        recompute: Recompute,
    ) -> MemoryPlan<'a> {
        MemoryPlan { parameters: 1 << 30, data_parallel: dp, zero, recompute, recompute_possible: true, estimate }
    }

    #[test]
    fn zero_1_takes_the_other_ranks_optimizer_state_off_and_alternatives_name_what_fits() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| if r.is_full() { 30 * gib } else { 40 * gib };
        // 1 Gi parameters: 12 GiB of AdamW state; over 4 ranks each keeps 3.
        let p = plan(&estimate, 4, ZeroStage::Replicated, Recompute::None);
        assert_eq!(p.bytes(ZeroStage::Replicated, Recompute::None), 40 * gib);
        assert_eq!(p.bytes(ZeroStage::OptimizerStates, Recompute::None), 31 * gib);
        assert_eq!(p.bytes(ZeroStage::OptimizerStates, Recompute::Full), 21 * gib);
        let alt = p.alternatives();
        let flags: Vec<&str> = alt.iter().map(|a| a.0).collect();
        assert_eq!(flags, ["--zero 1", "--recompute full", "--zero 1 --recompute full"]);
        assert_eq!(
            advice(&alt, 0, 25 * gib),
            "; --zero 1: about 31744 MiB, does not fit; --recompute full: about 30720 MiB, does not fit; --zero 1 \
             --recompute full: about 21504 MiB, fits"
        );
        // One rank: ZeRO changes nothing and is not offered; a run that set both has nothing left.
        let one = plan(&estimate, 1, ZeroStage::OptimizerStates, Recompute::None);
        assert_eq!(one.bytes(ZeroStage::OptimizerStates, Recompute::None), 40 * gib);
        assert_eq!(one.alternatives().iter().map(|a| a.0).collect::<Vec<_>>(), ["--recompute full"]);
        let both = plan(&estimate, 2, ZeroStage::OptimizerStates, Recompute::Full);
        assert!(both.alternatives().is_empty());
        assert_eq!(advice(&both.alternatives(), 0, gib), "");
        // A model that cannot recompute (MoE) is offered ZeRO only.
        let moe =
            MemoryPlan { recompute_possible: false, ..plan(&estimate, 2, ZeroStage::Replicated, Recompute::None) };
        assert_eq!(moe.alternatives().iter().map(|a| a.0).collect::<Vec<_>>(), ["--zero 1"]);
        // Resident bytes come off every figure.
        assert_eq!(advice(&[("--zero 1", 10 * gib)], 4 * gib, 5 * gib), "; --zero 1: about 6144 MiB, does not fit");
    }
}
