//! The memory check before a GPU run allocates: the model's estimate (`Gpt::training_bytes_with`,
//! `DecoderLm::training_bytes_with`) less what ZeRO shards away (stage 1 the other ranks' AdamW
//! state, stage 2 also their gradients, stage 3 also their pieces of a decoder's layer weights),
//! and, when it does not fit, the estimates of the memory flags the run has not set (`--zero 1`,
//! `--zero 2` and `--zero 3` over its data-parallel ranks,
//! `--recompute selective` where the model takes it, `--recompute full`, both;
//! `--offload-activations N` where the model offloads), each saying
//! whether it would fit in the free memory.

use crate::error::TrainError;
use crate::optim::ZeroStage;
use te_nn::modules::Recompute;
use te_runtime::Device;

/// A run's memory settings and how its estimate depends on them.
pub(super) struct MemoryPlan<'a> {
    /// The parameters a rank holds AdamW state for when replicated.
    pub parameters: u64,
    /// Bytes of the gradients of all of them as the estimate counts them (`P` times the
    /// gradient's element size: 2 in BF16).
    pub gradient_bytes: u64,
    /// Micro-batches a step (`grad_accum`): with more than one, the gradients are whole until
    /// the last micro-batch's backward, so ZeRO-2 does not lower the peak.
    pub micro_batches: usize,
    /// Data-parallel ranks.
    pub data_parallel: usize,
    /// The run's ZeRO stage.
    pub zero: ZeroStage,
    /// The run's recompute mode.
    pub recompute: Recompute,
    /// Whether `--recompute full` can run for this model (not a MoE GPT).
    pub recompute_possible: bool,
    /// Whether `--recompute selective` can run for this model (the decoder family, `--model`;
    /// not the GPT presets).
    pub selective_possible: bool,
    /// ZeRO-3 (with full recompute): the bytes of the layers' weights it takes off each rank
    /// beyond ZeRO-2 (`DecoderLm::zero3_weight_saving`); `None` for a model that does not
    /// shard its weights.
    pub zero3_saving: Option<u64>,
    /// The model's estimate in bytes for a recompute mode, optimizer state replicated (with the
    /// run's own activation offload, if any).
    pub estimate: &'a dyn Fn(Recompute) -> u64,
    /// Where the run does not offload but the model can (`--offload-activations`, full
    /// recompute only): the layer count to suggest (all but the last) and the estimate under
    /// full recompute with them offloaded. `None`: not offered.
    pub offload: Option<(usize, &'a dyn Fn() -> u64)>,
}

impl MemoryPlan<'_> {
    /// The estimate (bytes) with `zero` and `recompute`: the model's, less the AdamW state
    /// (f32 master weights and two moments, 12 bytes a parameter) the other ranks hold under
    /// ZeRO-1 and ZeRO-2 (`12 · P · (1 − 1/N)`; Megatron-LM's distributed optimizer), and under
    /// ZeRO-2 with one micro-batch a step also the gradients the other ranks own
    /// (`gradient_bytes · (1 − 1/N)`; released during the backward, so the estimate's
    /// all-gradients term shrinks by about that; DeepSpeed's stage 2).
    pub fn bytes(&self, zero: ZeroStage, recompute: Recompute) -> u64 {
        self.sharded((self.estimate)(recompute), zero)
    }

    /// `base` less what `zero` shards away ([`MemoryPlan::bytes`]).
    fn sharded(&self, base: u64, zero: ZeroStage) -> u64 {
        let n = self.data_parallel as u64;
        if n <= 1 || !zero.shards_optimizer() {
            return base;
        }
        let mut sharded = 12 * self.parameters / n * (n - 1);
        if zero.shards_gradients() && self.micro_batches <= 1 {
            sharded += self.gradient_bytes / n * (n - 1);
        }
        if zero.shards_parameters() {
            sharded += self.zero3_saving.unwrap_or(0);
        }
        base.saturating_sub(sharded)
    }

    /// The ZeRO stages above the run's that lower its estimate: stage 1 over more than one
    /// data-parallel rank, stage 2 too with one micro-batch a step, stage 3 where the model
    /// shards its weights.
    fn higher_stages(&self) -> Vec<ZeroStage> {
        if self.data_parallel <= 1 {
            return Vec::new();
        }
        [ZeroStage::OptimizerStates, ZeroStage::Gradients, ZeroStage::Parameters]
            .into_iter()
            .filter(|s| s.number() > self.zero.number())
            .filter(|s| *s != ZeroStage::Gradients || self.micro_batches <= 1)
            .filter(|s| !s.shards_parameters() || self.zero3_saving.is_some_and(|b| b > 0))
            .collect()
    }

    /// The flags the run has not set that lower the estimate, with their estimates: `--zero 1`,
    /// `--zero 2` and `--zero 3` (data parallel only; stage 2 with one micro-batch a step;
    /// stage 3 where the model shards its weights, with full recompute only), `--recompute
    /// selective` (where the model takes it and the run recomputes nothing), `--recompute
    /// full` (where the model takes it), and each stage with it; `--offload-activations N`
    /// (with `--recompute full` unless set) at the run's ZeRO stage where the model offloads.
    pub fn alternatives(&self) -> Vec<(String, u64)> {
        let flags = |s: ZeroStage| match s {
            ZeroStage::Parameters => ("--zero 3", "--zero 3 --recompute full"),
            ZeroStage::Gradients => ("--zero 2", "--zero 2 --recompute full"),
            _ => ("--zero 1", "--zero 1 --recompute full"),
        };
        let stages = self.higher_stages();
        let recompute = self.recompute_possible && !self.recompute.is_full();
        let mut out = Vec::new();
        // Stage 3 runs with full recompute only: without it, it is offered with the flag.
        for &s in stages.iter().filter(|s| !s.shards_parameters() || self.recompute.is_full()) {
            out.push((flags(s).0.to_string(), self.bytes(s, self.recompute)));
        }
        if self.selective_possible && self.recompute == Recompute::None {
            out.push(("--recompute selective".to_string(), self.bytes(self.zero, Recompute::Selective)));
        }
        if recompute {
            out.push(("--recompute full".to_string(), self.bytes(self.zero, Recompute::Full)));
            for &s in &stages {
                out.push((flags(s).1.to_string(), self.bytes(s, Recompute::Full)));
            }
        }
        if let Some((n, estimate)) = self.offload.filter(|_| self.recompute_possible) {
            let flag = if self.recompute.is_full() { "" } else { "--recompute full " };
            out.push((format!("{flag}--offload-activations {n}"), self.sharded(estimate(), self.zero)));
        }
        out
    }

    /// Fails with the device's out-of-memory error when the run's estimate, less `resident`
    /// bytes already on the device, exceeds the free memory. The message is `what(advice)`:
    /// `advice` names each alternative with its estimate and whether it would fit (`; --zero 2:
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
fn advice<S: AsRef<str>>(alternatives: &[(S, u64)], resident: u64, free: u64) -> String {
    alternatives
        .iter()
        .map(|(flag, bytes)| {
            let (flag, bytes) = (flag.as_ref(), *bytes);
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
        MemoryPlan {
            parameters: 1 << 30,
            gradient_bytes: 2 << 30,
            micro_batches: 1,
            data_parallel: dp,
            zero,
            recompute,
            recompute_possible: true,
            selective_possible: false,
            zero3_saving: None,
            estimate,
            offload: None,
        }
    }

    fn flags(p: &MemoryPlan<'_>) -> Vec<String> {
        p.alternatives().into_iter().map(|a| a.0).collect()
    }

    /// A model that offloads is offered `--offload-activations N` (with `--recompute full`
    /// unless the run has it) at the run's ZeRO stage, last.
    #[test]
    fn offload_is_offered_with_its_estimate() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| if r.is_full() { 30 * gib } else { 40 * gib };
        let offloaded = || 25 * gib;
        let p =
            MemoryPlan { offload: Some((7, &offloaded)), ..plan(&estimate, 1, ZeroStage::Replicated, Recompute::None) };
        assert_eq!(flags(&p), ["--recompute full", "--recompute full --offload-activations 7"]);
        assert_eq!(p.alternatives()[1].1, 25 * gib);
        let full =
            MemoryPlan { offload: Some((7, &offloaded)), ..plan(&estimate, 2, ZeroStage::Gradients, Recompute::Full) };
        assert_eq!(flags(&full), ["--offload-activations 7"]);
        assert_eq!(full.alternatives()[0].1, 25 * gib - 6 * gib - gib);
        assert_eq!(advice(&full.alternatives(), 0, 20 * gib), "; --offload-activations 7: about 18432 MiB, fits");
    }

    #[test]
    fn zero_takes_the_other_ranks_share_off_and_alternatives_name_what_fits() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| if r.is_full() { 30 * gib } else { 40 * gib };
        // 1 Gi parameters: 12 GiB of AdamW state and 2 GiB of BF16 gradients; over 4 ranks each
        // keeps 3 GiB of state (ZeRO-1) and 0.5 GiB of gradients (ZeRO-2).
        let p = plan(&estimate, 4, ZeroStage::Replicated, Recompute::None);
        assert_eq!(p.bytes(ZeroStage::Replicated, Recompute::None), 40 * gib);
        assert_eq!(p.bytes(ZeroStage::OptimizerStates, Recompute::None), 31 * gib);
        assert_eq!(p.bytes(ZeroStage::Gradients, Recompute::None), 31 * gib - 3 * gib / 2);
        assert_eq!(p.bytes(ZeroStage::OptimizerStates, Recompute::Full), 21 * gib);
        assert_eq!(p.bytes(ZeroStage::Gradients, Recompute::Full), 21 * gib - 3 * gib / 2);
        let alt = p.alternatives();
        assert_eq!(
            flags(&p),
            ["--zero 1", "--zero 2", "--recompute full", "--zero 1 --recompute full", "--zero 2 --recompute full"]
        );
        assert_eq!(
            advice(&alt, 0, 30 * gib),
            "; --zero 1: about 31744 MiB, does not fit; --zero 2: about 30208 MiB, fits; --recompute full: about \
             30720 MiB, fits; --zero 1 --recompute full: about 21504 MiB, fits; --zero 2 --recompute full: about \
             19968 MiB, fits"
        );
        // A ZeRO-1 run is offered stage 2; a ZeRO-2 run with full recompute has nothing left.
        let one = plan(&estimate, 4, ZeroStage::OptimizerStates, Recompute::None);
        assert_eq!(flags(&one), ["--zero 2", "--recompute full", "--zero 2 --recompute full"]);
        let two = plan(&estimate, 2, ZeroStage::Gradients, Recompute::None);
        assert_eq!(flags(&two), ["--recompute full"]);
        assert_eq!(two.bytes(ZeroStage::Gradients, Recompute::None), 40 * gib - 6 * gib - gib);
        let both = plan(&estimate, 2, ZeroStage::Gradients, Recompute::Full);
        assert!(both.alternatives().is_empty());
        assert_eq!(advice(&both.alternatives(), 0, gib), "");
        // One rank: ZeRO changes nothing and is not offered.
        let single = plan(&estimate, 1, ZeroStage::Gradients, Recompute::None);
        assert_eq!(single.bytes(ZeroStage::Gradients, Recompute::None), 40 * gib);
        assert_eq!(flags(&single), ["--recompute full"]);
        // A model that cannot recompute (MoE) is offered ZeRO only.
        let moe =
            MemoryPlan { recompute_possible: false, ..plan(&estimate, 2, ZeroStage::Replicated, Recompute::None) };
        assert_eq!(flags(&moe), ["--zero 1", "--zero 2"]);
        // Resident bytes come off every figure.
        assert_eq!(advice(&[("--zero 1", 10 * gib)], 4 * gib, 5 * gib), "; --zero 1: about 6144 MiB, does not fit");
    }

    /// ZeRO-3 is offered where the model shards its weights, with full recompute only, and
    /// takes the weights' share off beyond ZeRO-2 (also with gradient accumulation).
    #[test]
    fn zero_3_is_offered_with_full_recompute_where_the_model_shards_its_weights() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| if r.is_full() { 30 * gib } else { 40 * gib };
        let p =
            MemoryPlan { zero3_saving: Some(4 * gib), ..plan(&estimate, 4, ZeroStage::Replicated, Recompute::None) };
        assert_eq!(p.bytes(ZeroStage::Parameters, Recompute::Full), 21 * gib - 3 * gib / 2 - 4 * gib);
        assert_eq!(
            flags(&p),
            [
                "--zero 1",
                "--zero 2",
                "--recompute full",
                "--zero 1 --recompute full",
                "--zero 2 --recompute full",
                "--zero 3 --recompute full"
            ]
        );
        let full =
            MemoryPlan { zero3_saving: Some(4 * gib), ..plan(&estimate, 4, ZeroStage::Gradients, Recompute::Full) };
        assert_eq!(flags(&full), ["--zero 3"]);
        assert_eq!(full.alternatives()[0].1, 21 * gib - 3 * gib / 2 - 4 * gib);
        let accum = MemoryPlan {
            micro_batches: 4,
            zero3_saving: Some(4 * gib),
            ..plan(&estimate, 4, ZeroStage::OptimizerStates, Recompute::Full)
        };
        assert_eq!(flags(&accum), ["--zero 3"]);
        assert_eq!(accum.bytes(ZeroStage::Parameters, Recompute::Full), 21 * gib - 4 * gib);
        // One rank, or a model that keeps its weights whole (the GPT): not offered.
        let one = MemoryPlan { zero3_saving: Some(0), ..plan(&estimate, 1, ZeroStage::Replicated, Recompute::Full) };
        assert!(flags(&one).is_empty());
        let gpt = plan(&estimate, 4, ZeroStage::Gradients, Recompute::Full);
        assert!(flags(&gpt).is_empty());
    }

    /// A decoder (`--model`) that recomputes nothing is offered `--recompute selective` (with its
    /// estimate, between none's and full's) before `--recompute full`; a run with selective
    /// recompute is offered full recompute, and ZeRO-3 only with it.
    #[test]
    fn selective_recompute_is_offered_where_the_model_takes_it() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| match r {
            Recompute::None => 40 * gib,
            Recompute::Selective => 34 * gib,
            Recompute::Full => 30 * gib,
        };
        let decoder = |zero, r| MemoryPlan { selective_possible: true, ..plan(&estimate, 1, zero, r) };
        let p = decoder(ZeroStage::Replicated, Recompute::None);
        assert_eq!(flags(&p), ["--recompute selective", "--recompute full"]);
        assert_eq!(p.alternatives()[0].1, 34 * gib);
        let selective = decoder(ZeroStage::Replicated, Recompute::Selective);
        assert_eq!(selective.bytes(ZeroStage::Replicated, Recompute::Selective), 34 * gib);
        assert_eq!(flags(&selective), ["--recompute full"]);
        let sharded = MemoryPlan {
            data_parallel: 4,
            zero3_saving: Some(4 * gib),
            ..decoder(ZeroStage::Gradients, Recompute::Selective)
        };
        assert_eq!(flags(&sharded), ["--recompute full", "--zero 3 --recompute full"]);
        // The GPT presets are not offered it.
        assert_eq!(flags(&plan(&estimate, 1, ZeroStage::Replicated, Recompute::None)), ["--recompute full"]);
    }

    /// With gradient accumulation the gradients are whole until the last micro-batch's
    /// backward: ZeRO-2 saves what ZeRO-1 does at the peak, and is not offered for memory.
    #[test]
    fn zero_2_saves_nothing_more_with_several_micro_batches() {
        let gib = 1u64 << 30;
        let estimate = |r: Recompute| if r.is_full() { 30 * gib } else { 40 * gib };
        let p = MemoryPlan { micro_batches: 4, ..plan(&estimate, 4, ZeroStage::Replicated, Recompute::None) };
        assert_eq!(
            p.bytes(ZeroStage::Gradients, Recompute::None),
            p.bytes(ZeroStage::OptimizerStates, Recompute::None)
        );
        assert_eq!(flags(&p), ["--zero 1", "--recompute full", "--zero 1 --recompute full"]);
        let one = MemoryPlan { micro_batches: 2, ..plan(&estimate, 4, ZeroStage::OptimizerStates, Recompute::None) };
        assert_eq!(flags(&one), ["--recompute full"]);
    }
}
