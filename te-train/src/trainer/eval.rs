//! The evaluations of a GPU run: TE's FP8 calibration of a pretrained model before its first
//! FP8 step, and the mean validation loss (of a run's evaluations, and of a model before
//! training).

use super::batches::{check_context_seq, Pack, Tokens};
use super::lm::TrainLm;
use crate::config::{Precision, TrainConfig};
use crate::data::{TokenId, TokenSplit};
use crate::error::TrainError;
use std::sync::Arc;
use te_models::gpt::MicroBatch;
use te_nn::fp8::Fp8Autocast;
use te_nn::parallel::Parallel;
use te_runtime::Device;

/// Training batches a fine-tuning run in FP8 with delayed scaling first runs under TE's
/// calibration mode.
pub const FP8_CALIBRATION_BATCHES: usize = 4;

/// TE's FP8 calibration of a pretrained model (`fp8_autocast(enabled=False, calibrating=True)`):
/// [`FP8_CALIBRATION_BATCHES`] forwards in high precision over training windows (drawn apart from
/// the run's order) record every amax into the delayed-scaling histories, so the first FP8 step
/// computes its scales from the checkpoint's activations instead of the initial scale 1.
pub(super) fn calibrate<M: TrainLm, T: TokenId>(
    dev: &Arc<Device>,
    model: &mut M,
    data: &Tokens<'_, T>,
    cfg: &TrainConfig,
    parallel: &Parallel,
) -> Result<(), TrainError> {
    let mut batches = data.train(cfg.data_seed ^ 0xca1, cfg.batch, parallel.data_rank(), parallel.context_rank())?;
    let scope = Fp8Autocast::calibrating(cfg.recipe).with_group(parallel.world().cloned());
    model.set_training(false);
    for _ in 0..FP8_CALIBRATION_BATCHES {
        let batch = batches.next(dev, data.seq(), cfg.batch)?;
        scope.clone().run(|| batch.forward(model, MicroBatch::default()))?;
    }
    model.set_training(true);
    Ok(())
}

/// The mean loss of `model` over `cfg`'s validation batches of `val` (what a run's evaluations
/// report), in `precision` (FP8 under the recipe, its amaxes reduced over `parallel`'s ranks).
pub(super) fn validation_loss<M: TrainLm>(
    dev: &Arc<Device>,
    model: &mut M,
    (data, seq, pack): (&TokenSplit, usize, Pack),
    cfg: &TrainConfig,
    precision: Precision,
    parallel: &Parallel,
) -> Result<f32, TrainError> {
    let autocast = Fp8Autocast::new(cfg.recipe).with_group(parallel.world().cloned());
    if let Some(cp) = parallel.context() {
        if pack == Pack::Thd {
            return Err(TrainError::Unsupported {
                message: format!(
                    "--pack thd with --context-parallel {} is not built: use --pack blocks or drop --context-parallel",
                    cp.size()
                ),
            });
        }
        check_context_seq(seq, cp.size())?;
    }
    model.set_context_parallel(parallel.context().cloned())?;
    let tokens: Tokens<'_, u32> = match pack {
        Pack::Blocks => Tokens::Windows { train: data.train.tokens(), val: data.val.tokens(), seq },
        Pack::Thd => Tokens::Thd { train: &data.train, val: &data.val, seq },
    };
    evaluate(dev, model, &tokens, cfg, (precision, &autocast), parallel)
}

/// Mean validation loss over `cfg.eval_batches` fixed batches (the same for every evaluation),
/// in evaluation mode (no dropout; the training run's dropout stream does not move). FP8 runs
/// evaluate under `autocast` (the run's recipe and amax reduction group: every rank of a
/// data-parallel run evaluates the same batches, and their scales stay equal). With context
/// parallelism each rank evaluates its chunks of those batches and the loss is the mean over
/// the context-parallel group.
pub(super) fn evaluate<M: TrainLm, T: TokenId>(
    dev: &Arc<Device>,
    model: &mut M,
    data: &Tokens<'_, T>,
    cfg: &TrainConfig,
    (precision, autocast): (Precision, &Fp8Autocast),
    parallel: &Parallel,
) -> Result<f32, TrainError> {
    let mut batches = data.val(cfg, parallel.context_rank())?;
    model.set_training(false);
    let mut run = || -> Result<f32, TrainError> {
        let mut sum = 0.0f32;
        for _ in 0..cfg.eval_batches {
            let batch = batches.next(dev, data.seq(), cfg.batch)?;
            // The language-model loss alone: a MoE model's aux losses are left out of validation.
            let mb = MicroBatch::default();
            let (loss, _ctx) = match precision {
                Precision::Fp8 => autocast.clone().run(|| batch.forward(model, mb))?,
                Precision::Bf16 => batch.forward(model, mb)?,
            };
            sum += loss.lm_value()?;
        }
        Ok(sum / cfg.eval_batches as f32)
    };
    let mean = run();
    model.set_training(true);
    Ok(parallel.context_mean(mean?)?)
}
