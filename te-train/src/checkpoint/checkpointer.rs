//! The checkpointing of one run: resuming at its start, saving after its steps (atomically,
//! keeping the one before), the newest good checkpoint for error messages.

use super::history::{read_history, write_history, write_text};
use super::latest::{read_latest, DecoderSection, Latest, ModelSection};
use super::CheckpointOptions;
use crate::config::{Precision, TrainConfig};
use crate::error::TrainError;
use crate::summary::Record;
use std::path::{Path, PathBuf};

/// The model and its optimizer as a checkpoint saves and restores them: the GPU's `Gpt` and
/// `AdamW`, or the CPU path's `GptRef` and `GptAdamW`.
pub(crate) trait RunState {
    /// Writes `model.safetensors` (with `step` in its metadata) and `optimizer.safetensors`
    /// into `dir`.
    fn save_files(&self, dir: &Path, step: u64) -> Result<(), TrainError>;
    /// Restores model and optimizer from `dir`; returns the optimizer's step count.
    fn load_files(&mut self, dir: &Path) -> Result<u64, TrainError>;
    /// The dropout stream position.
    fn dropout_offset(&self) -> u64;
    /// Moves the dropout stream to `offset`.
    fn set_dropout_offset(&mut self, offset: u64) -> Result<(), TrainError>;
    /// The paths of FP8 scaling states holding a NaN or infinite value.
    fn nonfinite_states(&self) -> Result<Vec<String>, TrainError>;
    /// On a rank that writes no files (a data-parallel rank other than 0), the part of the save
    /// of the checkpoint in `dir` every rank takes part in: a sharded optimizer's gather of its
    /// pieces to the writer (ZeRO-1, `AdamW::save_state`). Nothing by default.
    fn join_save(&self, dir: &Path) -> Result<(), TrainError> {
        let _ = dir;
        Ok(())
    }
    /// Waits until every rank that writes a part of the checkpoint (the ranks of a
    /// tensor-parallel group) has written its files; nothing for a single writer.
    fn files_written(&self) -> Result<(), TrainError> {
        Ok(())
    }
}

/// The checkpointing of one run.
#[derive(Debug)]
pub(crate) struct Checkpointer<'a> {
    opts: &'a CheckpointOptions,
    cfg: &'a TrainConfig,
    precision: Precision,
    /// `<dir>/<precision>`, with a checkpoint directory.
    run_dir: Option<PathBuf>,
    last: Option<PathBuf>,
    /// Ranks of the data-parallel run (1: a single GPU).
    data_parallel: usize,
    /// Ranks of the tensor-parallel group (1: none): each writes its files of every checkpoint.
    tensor_parallel: usize,
    /// Whether this process writes checkpoint files (rank 0 of a data-parallel run, each
    /// tensor-parallel rank of it; every rank resumes from them).
    writes: bool,
    /// Whether it also writes `latest.toml` and the loss history (the writer of tensor-parallel
    /// rank 0, once every writer's files are written).
    writes_latest: bool,
    /// The decoder of a fine-tuning run (`[model.decoder]`), `None` for a GPT run.
    decoder: Option<DecoderSection>,
}

impl<'a> Checkpointer<'a> {
    /// The checkpointing `opts` asks for, of a run of `cfg` in `precision`.
    pub(crate) fn new(opts: &'a CheckpointOptions, cfg: &'a TrainConfig, precision: Precision) -> Self {
        let run_dir = opts.dir.as_ref().map(|d| d.join(precision.name()));
        Self {
            opts,
            cfg,
            precision,
            run_dir,
            last: None,
            data_parallel: 1,
            tensor_parallel: 1,
            writes: true,
            writes_latest: true,
            decoder: None,
        }
    }

    /// The checkpointing of a fine-tuning run of `decoder` (`None`: a GPT run): its checkpoints
    /// record it, and one of another architecture or packing is refused on resume.
    pub(crate) fn decoder(self, decoder: Option<DecoderSection>) -> Self {
        Self { decoder, ..self }
    }

    /// The `[model]` section of this run's checkpoints.
    fn model_section(&self) -> ModelSection {
        ModelSection { decoder: self.decoder.clone(), ..ModelSection::new(self.cfg, self.precision) }
    }

    /// The checkpointing of rank `rank` of a data-parallel run of `size` ranks: rank 0 writes
    /// the checkpoints (recording `size`), every rank resumes from them, and a checkpoint of
    /// another data-parallel size is refused (its data order differs).
    pub(crate) fn data_parallel(self, rank: usize, size: usize) -> Self {
        Self { data_parallel: size.max(1), writes: self.writes && rank == 0, ..self }
    }

    /// The checkpointing of rank `rank` of a tensor-parallel group of `size` ranks: each rank
    /// writes its own files (`model.tp-<rank>-of-<size>.safetensors`, its optimizer state
    /// likewise; [`RunState::save_files`]), rank 0 the step's `latest.toml` once all are
    /// written (recording `size`), and a checkpoint of another tensor-parallel size is refused
    /// (`te checkpoint merge|split` reshards it).
    pub(crate) fn tensor_parallel(self, rank: usize, size: usize) -> Self {
        Self { tensor_parallel: size.max(1), writes_latest: self.writes_latest && rank == 0, ..self }
    }

    /// The newest good checkpoint: the one resumed from, then each one saved.
    pub(crate) fn last(&self) -> Option<&Path> {
        self.last.as_deref()
    }

    /// With `resume` and a checkpoint in the run's directory: restores `state` and the loss
    /// curve (`records`) from it and returns the steps it had done; else 0.
    ///
    /// # Errors
    /// [`TrainError::Resume`] for a checkpoint made with other settings or inconsistent files;
    /// runtime errors loading them.
    pub(crate) fn resume(&mut self, state: &mut dyn RunState, records: &mut Vec<Record>) -> Result<u64, TrainError> {
        let Some(run_dir) = self.run_dir.as_ref().filter(|_| self.opts.resume) else { return Ok(0) };
        let path = run_dir.join("latest.toml");
        let Some(latest) = read_latest(&path)? else { return Ok(0) };
        let cfg = self.cfg;
        let err = |message: String| TrainError::Resume { path: path.clone(), message };
        let want = [
            ("batch", latest.batch.to_string(), cfg.batch.to_string()),
            ("grad_accum", latest.grad_accum.to_string(), cfg.grad_accum.to_string()),
            ("seq_length", latest.seq_length.to_string(), cfg.model.seq_length.to_string()),
            ("lr", latest.lr.to_string(), cfg.lr.to_string()),
            ("seed", latest.data_seed.to_string(), cfg.data_seed.to_string()),
            ("model seed", latest.model_seed.to_string(), cfg.model.seed.to_string()),
            ("data-parallel size", latest.data_parallel.unwrap_or(1).to_string(), self.data_parallel.to_string()),
        ];
        let mut differ: Vec<String> =
            want.iter().filter(|(_, a, b)| a != b).map(|(n, a, b)| format!("{n} {a} (checkpoint) vs {b}")).collect();
        if let Some(m) = &latest.model {
            let now = self.model_section();
            match (&m.decoder, &now.decoder) {
                (Some(a), Some(b)) => {
                    if a.architecture != b.architecture {
                        differ.push(format!("the model {} (checkpoint) vs {}", a.architecture, b.architecture));
                    }
                    if a.pack != b.pack {
                        differ.push(format!("the packing {} (checkpoint) vs {} (--pack)", a.pack, b.pack));
                    }
                }
                (Some(a), None) => {
                    differ.push(format!("a fine-tuning run of {} (checkpoint) vs a GPT run", a.architecture))
                }
                (None, _) => {}
            }
            let (was, is) = (ModelSection { decoder: None, ..m.clone() }, ModelSection { decoder: None, ..now });
            if !was.same_run(&is) {
                differ.push(format!("the model or its recipe: {was:?} (checkpoint) vs {is:?}"));
            }
        }
        if !differ.is_empty() {
            return Err(err(format!(
                "the run was made with other settings: {}; resume with the checkpoint's, or use another --out \
                 (CheckpointOptions::dir)",
                differ.join(", ")
            )));
        }
        if latest.step > cfg.steps {
            return Err(err(format!("it is at step {}, beyond --steps {}", latest.step, cfg.steps)));
        }
        let n = latest.tensor_parallel.unwrap_or(1);
        if n != self.tensor_parallel {
            return Err(err(format!(
                "it holds the files of {n} tensor-parallel rank(s) and this run has {}: reshard it (te checkpoint \
                 merge, then split) or resume with --tensor-parallel {n}",
                self.tensor_parallel
            )));
        }
        let dir = run_dir.join(&latest.dir);
        let steps = state.load_files(&dir)?;
        if steps != latest.step {
            return Err(err(format!("optimizer.safetensors is at step {steps}, latest.toml at {}", latest.step)));
        }
        state.set_dropout_offset(latest.dropout_offset)?;
        *records = read_history(&dir.join("history.csv"))?;
        self.last = Some(dir);
        Ok(latest.step)
    }

    /// After step `step`: saves a checkpoint when one is due (every `interval` steps, at the
    /// last step, and when `stop` was requested: [`CheckpointOptions::stop_requested`], agreed
    /// by every rank of a data-parallel run), then ends the run with
    /// [`TrainError::Interrupted`] when a stop was requested before the last step. A rank that
    /// does not write ([`Checkpointer::data_parallel`]) points at rank 0's checkpoint of the step.
    ///
    /// # Errors
    /// That stop; [`TrainError::NonFinite`] for an FP8 scaling state that is not finite (the
    /// checkpoint is not written); I/O and runtime errors of the save.
    pub(crate) fn after_step(
        &mut self,
        step: u64,
        state: &dyn RunState,
        records: &[Record],
        stop: bool,
    ) -> Result<(), TrainError> {
        let stop = stop && step < self.cfg.steps;
        let interval = self.opts.interval;
        if let Some(run_dir) = &self.run_dir {
            if (interval > 0 && step % interval == 0) || step == self.cfg.steps || stop {
                self.last = Some(match self.writes {
                    true => self.save(run_dir, step, state, records)?,
                    false => {
                        let dir = run_dir.join(format!("step-{step:07}"));
                        // The writer's checks, so every rank saves or stops together.
                        check_finite(step, state)?;
                        state.join_save(&dir)?;
                        dir
                    }
                });
            }
        }
        if stop {
            return Err(TrainError::Interrupted { step, checkpoint: self.last.clone() });
        }
        Ok(())
    }

    /// Saves step `step` of a run into `run_dir`, then (the writer of `latest.toml`, once every
    /// writer's files are written) points `latest.toml` at it and removes the checkpoints older
    /// than the previous one.
    fn save(&self, run_dir: &Path, step: u64, state: &dyn RunState, records: &[Record]) -> Result<PathBuf, TrainError> {
        let cfg = self.cfg;
        check_finite(step, state)?;
        let name = format!("step-{step:07}");
        let dir = run_dir.join(&name);
        std::fs::create_dir_all(&dir).map_err(|source| TrainError::Output { path: dir.clone(), source })?;
        state.save_files(&dir, step)?;
        state.files_written()?;
        if !self.writes_latest {
            return Ok(dir);
        }
        write_history(&dir.join("history.csv"), records)?;
        let latest = Latest {
            dir: name.clone(),
            step,
            dropout_offset: state.dropout_offset(),
            batch: cfg.batch,
            grad_accum: cfg.grad_accum,
            seq_length: cfg.model.seq_length,
            lr: cfg.lr,
            data_seed: cfg.data_seed,
            model_seed: cfg.model.seed,
            tensor_parallel: (self.tensor_parallel > 1).then_some(self.tensor_parallel),
            data_parallel: (self.data_parallel > 1).then_some(self.data_parallel),
            model: Some(self.model_section()),
        };
        let path = run_dir.join("latest.toml");
        let previous = read_latest(&path)?.map(|l| l.dir);
        let text =
            toml::to_string(&latest).map_err(|e| TrainError::Resume { path: path.clone(), message: e.to_string() })?;
        // The step's own copy (to resume from it by copying it over latest.toml), then the pointer.
        for file in [dir.join("trainer.toml"), path] {
            write_text(&file, &text)?;
        }
        // Keep the newest and the one before it; older ones are no longer needed.
        let entries =
            std::fs::read_dir(run_dir).map_err(|source| TrainError::Output { path: run_dir.into(), source })?;
        for entry in entries.flatten() {
            let n = entry.file_name().to_string_lossy().into_owned();
            if n.starts_with("step-") && n != name && Some(&n) != previous.as_ref() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
        Ok(dir)
    }
}

/// Refuses to save a checkpoint of `state` at `step` while an FP8 scaling state holds a NaN or
/// infinite value.
fn check_finite(step: u64, state: &dyn RunState) -> Result<(), TrainError> {
    let bad = state.nonfinite_states()?;
    match bad.first() {
        Some(path) => Err(TrainError::NonFinite {
            step,
            message: format!(
                "the FP8 scaling state {path} holds a NaN or infinite value ({} states in all); the checkpoint was \
                 not written. The previous checkpoint is kept: continue from it with --resume, with a lower --lr",
                bad.len()
            ),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trainer::Pack;
    use te_models::decoder::DecoderConfig;
    use te_models::gpt::GptConfig;

    /// A run state without files: what the checkpointer writes and checks around them.
    struct NoFiles(u64);

    impl RunState for NoFiles {
        fn save_files(&self, _: &Path, _: u64) -> Result<(), TrainError> {
            Ok(())
        }
        fn load_files(&mut self, _: &Path) -> Result<u64, TrainError> {
            Ok(self.0)
        }
        fn dropout_offset(&self) -> u64 {
            0
        }
        fn set_dropout_offset(&mut self, _: u64) -> Result<(), TrainError> {
            Ok(())
        }
        fn nonfinite_states(&self) -> Result<Vec<String>, TrainError> {
            Ok(Vec::new())
        }
    }

    /// A fine-tuning run's checkpoints record its decoder (architecture, packing, source) in
    /// `latest.toml` and the step's `trainer.toml`; resuming with the other packing, or as a GPT
    /// run, is refused with the difference named; the same decoder from a moved file resumes.
    #[test]
    fn a_fine_tuning_checkpoint_records_its_decoder_and_refuses_another_packing() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = TrainConfig::new(GptConfig::tiny(), 2);
        let opts = CheckpointOptions { dir: Some(dir.path().into()), resume: true, ..Default::default() };
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
            "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}"#;
        let model = DecoderConfig::from_hf_json(text).unwrap();
        let section = |pack, source: &str| Some(DecoderSection::new(&model, pack, Some(source.into())));
        let records = vec![Record { step: 2, train_loss: 1.25, val_loss: Some(1.5), step_ms: 3.0 }];
        let mut writer = Checkpointer::new(&opts, &cfg, Precision::Bf16).decoder(section(Pack::Thd, "/models/llama"));
        writer.after_step(2, &NoFiles(2), &records, false).unwrap();
        let run_dir = dir.path().join("bf16");
        for file in [run_dir.join("latest.toml"), run_dir.join("step-0000002").join("trainer.toml")] {
            let latest = read_latest(&file).unwrap().unwrap();
            assert_eq!(latest.model.unwrap().decoder, section(Pack::Thd, "/models/llama"), "{}", file.display());
        }
        let text = std::fs::read_to_string(run_dir.join("latest.toml")).unwrap();
        assert!(text.contains("[model.decoder]") && text.contains("architecture = \"LlamaForCausalLM\""), "{text}");

        let mut blocks =
            Checkpointer::new(&opts, &cfg, Precision::Bf16).decoder(section(Pack::Blocks, "/models/llama"));
        let e = blocks.resume(&mut NoFiles(2), &mut Vec::new()).unwrap_err();
        assert!(matches!(e, TrainError::Resume { .. }), "{e}");
        assert!(e.to_string().contains("the packing thd (checkpoint) vs blocks (--pack)"), "{e}");
        assert!(!e.to_string().contains("the model or its recipe"), "only the packing differs: {e}");
        let mut gpt = Checkpointer::new(&opts, &cfg, Precision::Bf16);
        let e = gpt.resume(&mut NoFiles(2), &mut Vec::new()).unwrap_err().to_string();
        assert!(e.contains("a fine-tuning run of LlamaForCausalLM (checkpoint) vs a GPT run"), "{e}");

        let mut moved = Checkpointer::new(&opts, &cfg, Precision::Bf16).decoder(section(Pack::Thd, "/elsewhere/llama"));
        let mut resumed = Vec::new();
        assert_eq!(moved.resume(&mut NoFiles(2), &mut resumed).unwrap(), 2);
        assert_eq!(resumed, records);
        assert_eq!(moved.last(), Some(run_dir.join("step-0000002").as_path()));
    }
}
