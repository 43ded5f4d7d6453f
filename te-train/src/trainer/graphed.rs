//! `te train --cuda-graph` ([`crate::TrainConfig::cuda_graph`]): the whole training step (every
//! micro-batch's forward and backward, the FP8 scale updates, the AdamW update) captured once in
//! a CUDA graph and replayed for every later step, TE's `make_graphed_callables` applied to the
//! step (PyTorch's `torch.cuda.graph` with static inputs). A small model's step is bound by the
//! host issuing its hundreds of kernels one by one; a replay issues them in one launch.
//!
//! What changes from step to step lives in device memory the graph reads, refilled before each
//! replay, so a replay computes what the eager step would, bit for bit:
//! - the batch: static id and target buffers ([`StepBatch::refill`], with the ids' grouping
//!   for the embedding's backward);
//! - the dropout stream: the device's Philox base ([`Device::set_philox_offset_base`]) is the
//!   offsets the steps since the capture advanced;
//! - AdamW's learning rate and bias corrections: its chunk table
//!   ([`AdamW::prepare_replay`]).
//!
//! The positions, the FP8 scaling tables and the weights stay where they are (the optimizer
//! writes the weights in place). The first step of a process runs eagerly (it loads every
//! kernel and picks every GEMM algorithm), the second is captured, then replayed.

use super::batches::{Source, StepBatch};
use super::lm::TrainLm;
use crate::config::Precision;
use crate::data::{Batch, TokenId};
use crate::error::TrainError;
use crate::optim::{AdamW, PendingStep, StepStats};
use std::sync::Arc;
use te_models::gpt::{GptLoss, MicroBatch};
use te_nn::fp8::Fp8Autocast;
use te_nn::modules::{ParamKind, ParamMut};
use te_nn::parallel::Parallel;
use te_runtime::graph::Graph;
use te_runtime::{Device, Error};

/// Why a run cannot step from a graph (the eager steps run instead), or `None` when it can.
/// `moe`: the model routes tokens to experts, whose row counts the host reads each step;
/// `windows`: its batches are windows of one shape (packed `thd` rows carry tables that vary);
/// `finetune`: a pretrained decoder of the family (its graphed step is not verified yet: the
/// loss's token count, read from the host at the capture, must not vary between batches);
/// `recompute`: activation recompute, full or selective (the recomputed forward swaps FP8
/// scaling buffers on the host around its kernels; its capture is not verified yet).
pub(super) fn unsupported(
    parallel: &Parallel,
    moe: bool,
    windows: bool,
    finetune: bool,
    recompute: bool,
) -> Option<&'static str> {
    if recompute {
        Some("activation recompute (full or selective) steps eagerly (its captured backward is not verified yet)")
    } else if finetune {
        Some("fine-tuning a decoder of the family steps eagerly (its graphed step is not verified yet)")
    } else if parallel.world_size() > 1 {
        Some("a data- or tensor-parallel run steps eagerly (its collectives are not captured yet)")
    } else if moe {
        Some("a MoE model steps eagerly (the host reads each expert's row count every step)")
    } else if !windows {
        Some("packed (thd) batches step eagerly (their cu_seqlens differ from batch to batch)")
    } else {
        None
    }
}

/// Every micro-batch's forward and backward of one step: the losses, each still on the device.
/// The eager loop's step and what a capture records.
pub(super) fn forward_backward<M: TrainLm>(
    model: &mut M,
    batches: &[StepBatch],
    precision: Precision,
    autocast: &Fp8Autocast,
    parallel: &mut Parallel,
) -> te_runtime::Result<Vec<GptLoss>> {
    let n = batches.len();
    let mut losses = Vec::with_capacity(n);
    for (micro, batch) in batches.iter().enumerate() {
        let mb = MicroBatch { is_first_microbatch: (n > 1).then_some(micro == 0), grad_scale: 1.0 / n as f32 };
        let (loss, ctx) = match precision {
            Precision::Fp8 => autocast.clone().run(|| batch.forward(model, mb))?,
            Precision::Bf16 => batch.forward(model, mb)?,
        };
        match parallel.data() {
            // The last micro-batch's backward reduces each part's gradients as they complete
            // (ZeRO-2: each piece to its owner, the others' gradients released as it goes).
            Some(dp) if micro + 1 == n => {
                // ZeRO-3: the layers' weights are transient buffers, not told apart by their
                // storage; the backward hands its parts over in reverse traversal order.
                if model.is_zero3() {
                    dp.begin_step_reversed(model.named_parameters().len())?;
                } else {
                    dp.begin_step(&*model)?;
                }
                model.backward_with(ctx, &mut |part| dp.reduce_grads(part))?;
                dp.finish()?;
            }
            _ => model.backward_with(ctx, &mut |_| Ok(()))?,
        }
        losses.push(loss);
    }
    Ok(losses)
}

/// A captured training step and the static inputs it reads.
pub(super) struct GraphedStep {
    graph: Graph,
    /// One static batch per micro-batch.
    batches: Vec<StepBatch>,
    /// The micro-batches' losses, as the latest replay wrote them.
    losses: Vec<GptLoss>,
    /// The optimizer step the capture recorded (which parameters it updates).
    captured: PendingStep,
    /// The model's dropout offset when the step was captured (the offsets frozen in the graph).
    offset_at_capture: u64,
    /// How far one step moves the dropout offset.
    offset_per_step: u64,
}

impl GraphedStep {
    /// Captures one step of `model` and `opt` on `hosts` (one batch a micro-batch) without
    /// running it; [`GraphedStep::replay`] runs it. On a failed capture the model is left as
    /// it was before (its dropout offset, no gradients, every weight marked changed so no
    /// cache of the discarded capture is read), and the error says what broke the capture.
    ///
    /// # Errors
    /// [`TrainError::Runtime`] with [`Error::Capture`] when the step breaks a capture rule;
    /// the model's and the optimizer's errors.
    pub(super) fn capture<M: TrainLm>(
        dev: &Arc<Device>,
        (model, opt): (&mut M, &mut AdamW),
        (seq, batch, hosts): (usize, usize, &[Batch]),
        precision: Precision,
        autocast: &Fp8Autocast,
    ) -> Result<GraphedStep, TrainError> {
        let batches =
            hosts.iter().map(|h| StepBatch::windows(dev, seq, batch, h)).collect::<te_runtime::Result<Vec<_>>>()?;
        // The graph's memory comes from the driver's graph pool: the eager step's cached
        // activations go back first.
        dev.release_cached_memory()?;
        dev.set_philox_offset_base(0)?;
        let offset_at_capture = model.dropout_offset();
        let mut single = Parallel::default();
        let captured = Graph::capture(dev, || {
            let losses = forward_backward(&mut *model, &batches, precision, autocast, &mut single)?;
            let pending = opt.issue(&mut *model)?;
            Ok((losses, pending))
        });
        // The capture ran no step: the dropout stream is where it was, the gradients it
        // recorded belong to the graph, and the weights' caches must be cast anew.
        let offset_per_step = model.dropout_offset() - offset_at_capture;
        model.set_dropout_offset(offset_at_capture);
        model.zero_grad();
        let (graph, (losses, captured)) = match captured {
            Ok(c) => c,
            Err(e) => {
                mark_weights_changed(model)?;
                return Err(e.into());
            }
        };
        Ok(GraphedStep { graph, batches, losses, captured, offset_at_capture, offset_per_step })
    }

    /// One step from the graph on `hosts` (one batch a micro-batch): refills the static inputs,
    /// sets the dropout base and the optimizer's scalars, replays, and completes the step on
    /// the host (the model's dropout offset moves on, its weights marked changed for eager
    /// forwards such as an evaluation). Returns the micro-batches' mean loss and the
    /// optimizer's statistics.
    ///
    /// # Errors
    /// Copy and launch failures; the optimizer's.
    pub(super) fn replay<M: TrainLm>(
        &mut self,
        dev: &Arc<Device>,
        (model, opt): (&mut M, &mut AdamW),
        hosts: &[Batch],
    ) -> Result<(f32, StepStats), TrainError> {
        for (b, h) in self.batches.iter_mut().zip(hosts) {
            b.refill(dev, h)?;
        }
        let offset = model.dropout_offset();
        dev.set_philox_offset_base(offset - self.offset_at_capture)?;
        let pending = opt.prepare_replay(&self.captured)?;
        self.graph.replay()?;
        let stats = opt.finish(&pending)?;
        model.set_dropout_offset(offset + self.offset_per_step);
        mark_weights_changed(model)?;
        let sum = self.losses.iter().map(GptLoss::value).sum::<Result<f32, _>>()?;
        Ok((sum / self.losses.len() as f32, stats))
    }

    /// The next step's batches of `source`, one a micro-batch, on the host.
    ///
    /// # Errors
    /// Data errors; [`TrainError::Runtime`] when the source packs rows (never captured).
    pub(super) fn next_hosts<T: TokenId>(source: &mut Source<'_, T>, n: usize) -> Result<Vec<Batch>, TrainError> {
        (0..n)
            .map(|_| {
                source.next_windows()?.ok_or_else(|| {
                    TrainError::Runtime(Error::internal("GraphedStep", "packed batches reached a captured step"))
                })
            })
            .collect()
    }
}

impl Drop for GraphedStep {
    fn drop(&mut self) {
        // Eager dropout after the run draws from its own offsets again.
        if let Err(e) = self.graph.device().set_philox_offset_base(0) {
            tracing::warn!("resetting the dropout base after a graphed run: {e}");
        }
    }
}

/// Hands every weight back to its layer (the same storage), bumping the layers' versions: the
/// graph changed the weights behind the layers' backs, so a cached FP8 cast of them is stale.
fn mark_weights_changed<M: TrainLm>(model: &mut M) -> Result<(), TrainError> {
    model.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> te_runtime::Result<()> {
        match p.tensor().cloned() {
            Some(t) => p.set(t),
            None => Ok(()),
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_a_graph_cannot_hold_say_why() {
        let one = Parallel::default();
        assert_eq!(unsupported(&one, false, true, false, false), None);
        for (moe, windows, finetune, word) in
            [(true, true, false, "MoE"), (false, false, false, "thd"), (false, true, true, "fine-tuning")]
        {
            let why = unsupported(&one, moe, windows, finetune, false).unwrap_or_default();
            assert!(why.contains(word), "{why}");
        }
        let why = unsupported(&one, false, true, false, true).unwrap_or_default();
        assert!(why.contains("recompute") && why.contains("eagerly"), "{why}");
    }
}
