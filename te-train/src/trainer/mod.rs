//! [`Trainer`]: trains a GPT ([`TrainConfig::model`]) on a [`Corpus`] in FP8 or BF16, on a GPU
//! ([`Backend::Gpu`], optionally one rank of a data- and/or tensor-parallel run) or on the CPU
//! ([`Backend::Cpu`], the CPU twin of the model with the GPU's GEMM numerics emulated), with
//! checkpoints that a stopped run resumes from bit for bit.
//!
//! ```no_run
//! use te_models::gpt::GptConfig;
//! use te_train::data::Corpus;
//! use te_train::{Backend, Precision, TrainConfig, Trainer};
//!
//! let corpus = Corpus::from_path(std::path::Path::new("input.txt"), 0.05)?;
//! let config = TrainConfig { batch: 4, ..TrainConfig::new(GptConfig::tiny(), 200) };
//! let mut trainer = Trainer::new(config, Backend::detect()?)?;
//! let run = trainer.train(&corpus, Precision::Fp8, |p| println!("step {} loss {:.4}", p.step, p.train_loss))?;
//! println!("validation loss {:?}", run.final_val_loss());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod batches;
mod cpu;
mod eval;
mod gpu;
mod graphed;
mod lm;
mod memory;

pub use batches::{check_context_seq, Pack};
pub use cpu::cpu_gemm_precision;
pub use eval::FP8_CALIBRATION_BATCHES;
pub use lm::TrainLm;

use crate::checkpoint::CheckpointOptions;
use crate::config::{Precision, TrainConfig};
use crate::data::{Corpus, TokenSplit};
use crate::error::TrainError;
use crate::optim::{OptimizerMemory, ZeroStage};
use crate::summary::{Progress, RunSummary};
use std::sync::Arc;
use te_nn::modules::Recompute;
use te_nn::parallel::Parallel;
use te_runtime::Device;

/// Where a [`Trainer`] runs.
#[derive(Debug, Clone)]
pub enum Backend {
    /// The GPU model (`te_models::Gpt`) and the fused AdamW on this device.
    Gpu(Arc<Device>),
    /// The CPU twin of the model (`te_models::cpu::gpt::GptRef`, f32 with the GEMM inputs
    /// rounded as the GPU's FP8 or BF16 GEMMs read them) and its AdamW: slow, for the `tiny`
    /// preset and tests; one process, no parallelism.
    Cpu,
}

impl Backend {
    /// GPU 0 when a CUDA GPU is present, else the CPU.
    ///
    /// # Errors
    /// [`TrainError::Runtime`] when a GPU is present but its context cannot be created.
    pub fn detect() -> Result<Backend, TrainError> {
        if te_runtime::device::gpu_available() {
            Ok(Backend::Gpu(Device::new(0)?))
        } else {
            Ok(Backend::Cpu)
        }
    }

    /// Whether this is the GPU backend.
    pub fn is_gpu(&self) -> bool {
        matches!(self, Backend::Gpu(_))
    }
}

/// A training job: a validated [`TrainConfig`] on a [`Backend`], with its checkpointing and
/// (on the GPU) its data / tensor parallel layout. [`Trainer::train`] runs it once per
/// precision (the FP8 and BF16 runs of `te train` share the seed, initial weights, data order
/// and dropout masks).
#[derive(Debug)]
pub struct Trainer {
    config: TrainConfig,
    backend: Backend,
    checkpoints: CheckpointOptions,
    parallel: Parallel,
    /// How a data-parallel run holds its optimizer state ([`Trainer::with_zero`]).
    zero: ZeroStage,
    /// What the training forward keeps for the backward ([`Trainer::with_recompute`]).
    recompute: Recompute,
    /// The first layers whose saved inputs go to pinned host memory
    /// ([`Trainer::with_offload_activations`]).
    offload_activations: usize,
    /// The optimizer state of the last GPU run on this rank.
    optimizer_memory: Option<OptimizerMemory>,
}

impl Trainer {
    /// A trainer of `config` on `backend`, without checkpoints, on a single GPU or the CPU.
    ///
    /// # Errors
    /// [`TrainError::Config`] / [`TrainError::Runtime`] for a setting out of its range
    /// ([`TrainConfig::validate`]).
    pub fn new(config: TrainConfig, backend: Backend) -> Result<Self, TrainError> {
        config.validate()?;
        Ok(Self {
            config,
            backend,
            checkpoints: CheckpointOptions::default(),
            parallel: Parallel::default(),
            zero: ZeroStage::Replicated,
            recompute: Recompute::None,
            offload_activations: 0,
            optimizer_memory: None,
        })
    }

    /// The same trainer with its optimizer state held as `stage` says on the ranks of a
    /// data-parallel run (`te train --zero`): [`ZeroStage::OptimizerStates`] shards AdamW's
    /// f32 masters and moments over the data-parallel group (with context parallelism, the
    /// context × data ranks that average the gradients: [`Parallel::data`]) ([`crate::optim::AdamW::new_zero`]:
    /// about `1 / N` of the bytes per rank, the same steps bit for bit, the same checkpoint
    /// files); [`ZeroStage::Gradients`] shards the gradients too
    /// ([`crate::optim::AdamW::new_zero_stage`]: the last micro-batch's backward reduces each
    /// gradient piece to its owner and releases the gradients of the parameters a rank owns no
    /// piece of, about `1 − 1/N` of the gradient bytes; the same steps as stage 1 bit for bit on
    /// two ranks, the same checkpoint files); [`ZeroStage::Parameters`] (ZeRO-3, for
    /// [`Trainer::finetune`] of the decoder family under full recompute) shards the layers'
    /// 16-bit weights too (`te_models::decoder::train::DecoderLm::set_zero3`: each rank keeps
    /// the pieces it holds the masters of, a layer is gathered before its forward and again
    /// before its backward; [`crate::optim::AdamW::step_sharded`]; the same steps as stage 2,
    /// the same checkpoint files, the model whole again after the run). A run of one rank
    /// holds everything either way.
    ///
    /// # Errors
    /// [`TrainError::Unsupported`] for ZeRO on the CPU backend (one process, nothing to shard
    /// over); with tensor parallelism, [`Trainer::train`] and [`Trainer::finetune`] refuse it;
    /// ZeRO-3 is refused by [`Trainer::train`] (the GPT presets) and, without full recompute,
    /// by [`Trainer::finetune`].
    pub fn with_zero(self, stage: ZeroStage) -> Result<Self, TrainError> {
        if stage != ZeroStage::Replicated && !self.backend.is_gpu() {
            return Err(TrainError::Unsupported {
                message: format!(
                    "ZeRO stage {} shards the optimizer state over the data-parallel GPUs, and the CPU backend \
                     trains in one process: drop --zero (or pass --zero 0)",
                    stage.number()
                ),
            });
        }
        Ok(Self { zero: stage, ..self })
    }

    /// How a data-parallel run holds its optimizer state ([`Trainer::with_zero`]).
    pub fn zero(&self) -> ZeroStage {
        self.zero
    }

    /// The same trainer keeping activations as `mode` says (`te train --recompute`):
    /// [`Recompute::Full`] keeps each layer's input only and runs the layer's forward again in
    /// the backward (`te_models::gpt::Gpt::set_recompute`, TE's `checkpoint`, Megatron-LM's full
    /// recompute): the same steps bit for bit, peak activation memory of about one layer's
    /// context plus the layer inputs, one more forward of the layers a step.
    /// [`Recompute::Selective`] (the decoder family only: `Trainer::finetune`) keeps each
    /// layer's attention context and MLP input and runs the MLP's forward again
    /// (`te_models::decoder::train::DecoderLm::set_recompute`, Megatron-LM's selective
    /// recompute of the `mlp` module): the same steps bit for bit, less memory than none, more
    /// than full. The memory estimate checked before allocating accounts for both;
    /// `cuda_graph` runs step eagerly with either (its capture is not verified yet).
    ///
    /// # Errors
    /// [`TrainError::Unsupported`] for a mode other than [`Recompute::None`] on the CPU backend
    /// (its reference model keeps every activation); a MoE model, FP8 attention (`fp8_dpa`) or
    /// [`Recompute::Selective`] on the GPT presets is refused by [`Trainer::train`]
    /// ([`TrainError::Runtime`] with a configuration error).
    pub fn with_recompute(self, mode: Recompute) -> Result<Self, TrainError> {
        if mode.recomputes() && !self.backend.is_gpu() {
            return Err(TrainError::Unsupported {
                message: format!(
                    "--recompute {mode} recomputes the GPU model's layers; the CPU reference path keeps every \
                     activation: drop --recompute (or pass --recompute none)"
                ),
            });
        }
        Ok(Self { recompute: mode, ..self })
    }

    /// What the training forward keeps for the backward ([`Trainer::with_recompute`]).
    pub fn recompute(&self) -> Recompute {
        self.recompute
    }

    /// The same trainer offloading the saved inputs of the first `n` layers to pinned host
    /// memory (`te train --offload-activations N`; TE's `get_cpu_offload_context` with
    /// `num_layers = n`; 0: off): copied out on a side stream in the forward, back a layer ahead
    /// in the backward (`te_models::decoder::train::DecoderLm::set_offload_activations`,
    /// `te_models::gpt::Gpt::set_offload_activations`). The same steps bit for bit; the memory
    /// estimate checked before allocating leaves the offloaded inputs out (two in flight stay).
    /// Built under full recompute ([`Trainer::with_recompute`]); `cuda_graph` steps eagerly
    /// with it, as with full recompute.
    ///
    /// # Errors
    /// [`TrainError::Unsupported`] on the CPU backend (nothing to offload to); without full
    /// recompute or for `n` above the layer count, [`Trainer::finetune`] and [`Trainer::train`]
    /// refuse it.
    pub fn with_offload_activations(self, n: usize) -> Result<Self, TrainError> {
        if n > 0 && !self.backend.is_gpu() {
            return Err(TrainError::Unsupported {
                message: "--offload-activations copies the GPU model's saved activations to pinned host memory; the \
                          CPU reference path has nothing to offload: drop --offload-activations"
                    .into(),
            });
        }
        Ok(Self { offload_activations: n, ..self })
    }

    /// The layers whose saved inputs are offloaded ([`Trainer::with_offload_activations`]).
    pub fn offload_activations(&self) -> usize {
        self.offload_activations
    }

    /// The offload setting checked against the run: full recompute, at most `layers`.
    fn check_offload(&self, layers: usize) -> Result<(), TrainError> {
        let n = self.offload_activations;
        if n > 0 && !self.recompute.is_full() {
            return Err(TrainError::Unsupported {
                message: format!(
                    "--offload-activations {n} offloads the layer inputs full recompute keeps (the offload of whole \
                     layer contexts is not built): add --recompute full"
                ),
            });
        }
        if n > layers {
            return Err(TrainError::Config {
                field: "offload_activations",
                message: format!(
                    "{n} layers to offload, the model has {layers}: pass at most {layers} (usually {}, all but the last)",
                    layers.saturating_sub(1)
                ),
            });
        }
        Ok(())
    }

    /// The optimizer state this rank held in the last GPU run ([`Trainer::train`] or
    /// [`Trainer::finetune`]; `None` before one, and on the CPU backend): the bytes ZeRO
    /// saves per rank.
    pub fn optimizer_memory(&self) -> Option<OptimizerMemory> {
        self.optimizer_memory
    }

    /// Refuses a ZeRO stage the layout cannot run: ZeRO-1 or ZeRO-2 with tensor parallelism.
    fn check_zero(&self) -> Result<(), TrainError> {
        let (_, tp) = self.parallel.tensor_rank();
        if self.zero != ZeroStage::Replicated && tp > 1 {
            return Err(TrainError::Unsupported {
                message: format!(
                    "ZeRO stage {} with tensor parallelism ({tp} ranks a layer) is not built yet: drop --zero or \
                     --tensor-parallel",
                    self.zero.number()
                ),
            });
        }
        Ok(())
    }

    /// The same trainer saving (and, with `resume`, resuming from) checkpoints as `checkpoints`
    /// says, honouring its stop flag.
    pub fn with_checkpoints(self, checkpoints: CheckpointOptions) -> Self {
        Self { checkpoints, ..self }
    }

    /// The same trainer as one rank of the data-, tensor- and/or context-parallel run `parallel`
    /// lays out (every rank builds its trainer with the same config and calls [`Trainer::train`]
    /// with the same arguments). With context parallelism ([`Parallel::with_context`];
    /// [`Trainer::finetune`] only) each rank reads its chunks of its data rank's windows, the
    /// gradients are averaged over context × data, the recorded losses are the group's means and
    /// the tokens/s counts each token once.
    ///
    /// # Errors
    /// [`TrainError::Unsupported`] on the CPU backend for a layout of more than one rank.
    pub fn with_parallel(self, parallel: Parallel) -> Result<Self, TrainError> {
        if !self.backend.is_gpu() && parallel.world_size() > 1 {
            return Err(TrainError::Unsupported {
                message: format!(
                    "the CPU backend trains in one process, and this layout has {} ranks: train data or tensor \
                     parallel on GPUs (Backend::Gpu)",
                    parallel.world_size()
                ),
            });
        }
        Ok(Self { parallel, ..self })
    }

    /// The settings.
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }

    /// Where it runs.
    pub fn backend(&self) -> &Backend {
        &self.backend
    }

    /// The checkpointing.
    pub fn checkpoints(&self) -> &CheckpointOptions {
        &self.checkpoints
    }

    /// The parallel layout of this rank ([`Parallel::default`]: one GPU, or the CPU).
    pub fn parallel(&self) -> &Parallel {
        &self.parallel
    }

    /// Gives the parallel layout back (to build another trainer on the same groups).
    pub fn into_parallel(self) -> Parallel {
        self.parallel
    }

    /// Trains the model from its seed (or from the newest checkpoint, resuming) on `corpus` in
    /// `precision`, calling `progress` after each step (on every rank of a parallel run, with
    /// the ranks' mean loss). Returns the loss curve and throughput of the run.
    ///
    /// # Errors
    /// [`TrainError::Data`] for a split shorter than one window; [`TrainError::Runtime`] for
    /// device, kernel, model and checkpoint-file errors (out of GPU memory, estimated before
    /// allocating, and recipes that do not validate); [`TrainError::HostMemory`] for a CPU configuration the host
    /// cannot hold; [`TrainError::Resume`] for a checkpoint made with other settings;
    /// [`TrainError::NonFinite`] past [`TrainConfig::skip_nonfinite_steps`] non-finite steps, or
    /// for a non-finite FP8 scaling state at a checkpoint; [`TrainError::Interrupted`] after the
    /// step during which the stop flag ([`CheckpointOptions::stop`]) was set, its checkpoint
    /// written; [`TrainError::Output`] for checkpoint directories that cannot be written;
    /// [`TrainError::Unsupported`] for ZeRO-1 or ZeRO-2 ([`Trainer::with_zero`]) with tensor
    /// parallelism, and for a context-parallel layout (the GPT is not split along the sequence:
    /// context parallelism is [`Trainer::finetune`]'s).
    pub fn train(
        &mut self,
        corpus: &Corpus,
        precision: Precision,
        mut progress: impl FnMut(&Progress),
    ) -> Result<RunSummary, TrainError> {
        self.check_zero()?;
        self.check_offload(self.config.model.num_layers)?;
        let (cfg, ckpt) = (&self.config, &self.checkpoints);
        match &self.backend {
            Backend::Gpu(dev) => {
                let layout = (&mut self.parallel, self.zero, self.recompute);
                let offload = self.offload_activations;
                let (run, memory) = gpu::train(dev, corpus, cfg, precision, ckpt, layout, offload, &mut progress)?;
                self.optimizer_memory = Some(memory);
                Ok(run)
            }
            Backend::Cpu => cpu::train(corpus, cfg, precision, ckpt, &mut progress),
        }
    }

    /// Fine-tunes `model` (a pretrained decoder of the family, loaded with
    /// `DecoderLm::from_weights`) on `data`'s token ids (made with the model's tokenizer:
    /// [`crate::data::TokenDataset`]) in rows of `seq_length` tokens packed as `pack` says, in
    /// `precision` (FP8 with delayed scaling starts from [`FP8_CALIBRATION_BATCHES`] batches of
    /// TE's calibration). The settings are this trainer's [`TrainConfig`] but its `model` (the
    /// GPT geometry; its checkpoints record `seq_length` and the vocabulary there); the run is
    /// data parallel over its layout, and writes and resumes checkpoints as the trainer's
    /// [`CheckpointOptions`] say (the model's parameters, FP8 states and AdamW state; their
    /// `[model.decoder]` records the architecture, `pack` and
    /// [`CheckpointOptions::model_source`], what `te generate --checkpoint` samples from:
    /// resuming needs the same model, data and `pack`, and a checkpoint of another architecture
    /// or packing is refused). `progress` and the returned summary as for [`Trainer::train`];
    /// `model` is left trained (export it with `DecoderLm::to_weights` and
    /// `DecoderWeights::save_hf_dir`).
    ///
    /// # Errors
    /// As [`Trainer::train`]; [`TrainError::Unsupported`] on the CPU backend, with a
    /// tensor-parallel layout, or with [`Pack::Thd`] on a context-parallel one;
    /// [`TrainError::Config`] for `seq_length` 0 or above the model's
    /// `max_position_embeddings`, or not a multiple of `2 · cp` with context parallelism
    /// ([`check_context_seq`]).
    pub fn finetune(
        &mut self,
        model: &mut te_models::decoder::train::DecoderLm,
        data: &TokenSplit,
        (seq_length, pack): (usize, Pack),
        precision: Precision,
        mut progress: impl FnMut(&Progress),
    ) -> Result<RunSummary, TrainError> {
        let max = model.config().max_position_embeddings;
        if seq_length == 0 || seq_length > max {
            return Err(TrainError::Config {
                field: "seq_length",
                message: format!("{seq_length} must be in [1, {max}] (the model's max_position_embeddings)"),
            });
        }
        // The run's window and vocabulary where its checkpoints record and check the model's.
        let mut cfg = self.config.clone();
        cfg.model.seq_length = seq_length;
        cfg.model.vocab_size = model.config().vocab_size;
        self.check_zero()?;
        self.check_offload(model.config().num_layers)?;
        let ckpt = &self.checkpoints;
        match &self.backend {
            Backend::Gpu(dev) => {
                model.set_offload_activations(self.offload_activations)?;
                let (shape, layout) = ((seq_length, pack), (&mut self.parallel, self.zero, self.recompute));
                let (run, memory) =
                    gpu::finetune(dev, model, data, shape, &cfg, precision, ckpt, layout, &mut progress)?;
                if model.offload_activations() > 0 {
                    tracing::info!(
                        "activation offload: {:.1} MiB of pinned host memory, allocated once and reused every step",
                        model.offload_pinned_bytes() as f64 / (1u64 << 20) as f64
                    );
                }
                self.optimizer_memory = Some(memory);
                Ok(run)
            }
            Backend::Cpu => Err(TrainError::Unsupported {
                message: "fine-tuning a decoder of the family runs on a GPU (Backend::Gpu)".into(),
            }),
        }
    }

    /// The mean loss of `model` over the validation windows a run of this trainer evaluates on
    /// (`eval_batches` batches of `batch` windows of `seq_length` tokens of `val`, the same every
    /// time), in `precision`: the pretrained model's loss before [`Trainer::finetune`], to set its
    /// curve against. The model is left in training mode.
    ///
    /// # Errors
    /// [`TrainError::Data`] for `val` shorter than one window; [`TrainError::Unsupported`] on
    /// the CPU backend; the model's errors.
    pub fn validation_loss<M: TrainLm>(
        &self,
        model: &mut M,
        data: &TokenSplit,
        (seq_length, pack): (usize, Pack),
        precision: Precision,
    ) -> Result<f32, TrainError> {
        match &self.backend {
            Backend::Gpu(dev) => {
                let shape = (data, seq_length, pack);
                eval::validation_loss(dev, model, shape, &self.config, precision, &self.parallel)
            }
            Backend::Cpu => Err(TrainError::Unsupported {
                message: "the validation loss of a TrainLm runs on a GPU (Backend::Gpu)".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_models::gpt::GptConfig;

    /// Full and selective recompute are the GPU model's: the CPU backend refuses them, naming
    /// the flag to drop; `none` is fine anywhere.
    #[test]
    fn the_cpu_backend_refuses_full_recompute() {
        let trainer = || Trainer::new(TrainConfig::new(GptConfig::tiny(), 2), Backend::Cpu).unwrap();
        assert_eq!(trainer().recompute(), Recompute::None);
        let t = trainer().with_recompute(Recompute::None).unwrap();
        assert_eq!(t.recompute(), Recompute::None);
        for mode in [Recompute::Full, Recompute::Selective] {
            let e = trainer().with_recompute(mode).unwrap_err();
            let want = format!("--recompute {mode}");
            assert!(matches!(e, TrainError::Unsupported { .. }) && e.to_string().contains(&want), "{e}");
        }
    }

    /// Activation offload: the CPU backend refuses it; a run refuses it without full recompute
    /// (naming the flag to add) and above the layer count (naming the most it takes).
    #[test]
    fn offload_refusals_name_what_to_change() {
        let trainer = || Trainer::new(TrainConfig::new(GptConfig::tiny(), 2), Backend::Cpu).unwrap();
        assert_eq!(trainer().with_offload_activations(0).unwrap().offload_activations(), 0);
        let e = trainer().with_offload_activations(3).unwrap_err();
        assert!(matches!(e, TrainError::Unsupported { .. }) && e.to_string().contains("--offload-activations"), "{e}");
        // The run's checks (what the GPU backend's finetune applies before its first step).
        let plain = Trainer { offload_activations: 3, ..trainer() };
        let e = plain.check_offload(4).unwrap_err().to_string();
        assert!(e.contains("add --recompute full"), "{e}");
        let full = Trainer { offload_activations: 3, recompute: Recompute::Full, ..trainer() };
        full.check_offload(4).unwrap();
        let e = full.check_offload(2).unwrap_err().to_string();
        assert!(e.contains("at most 2") && e.contains("all but the last"), "{e}");
        assert!(Trainer { recompute: Recompute::Full, ..trainer() }.check_offload(0).is_ok());
    }
}
