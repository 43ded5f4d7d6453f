//! Checkpoints of a `te train` run, on the GPU and on the CPU path alike.
//!
//! A checkpoint of a run is a directory `<checkpoint_dir>/<precision>/step-NNNNNNN/` holding
//! `model.safetensors` (weights and FP8 state, [`te_nn::checkpoint`]),
//! `optimizer.safetensors` ([`te_train::optim::AdamW::save_state`]), `history.csv` (the loss
//! curve so far) and `trainer.toml` (the step, the dropout stream position, the settings the
//! run must be resumed with, and the model: its architecture, precision and FP8 recipe, what
//! `te generate` rebuilds it from); `<checkpoint_dir>/<precision>/latest.toml`, a copy of the
//! newest complete one's `trainer.toml`, is what `resume` starts from. It is rewritten
//! (atomically) only after the new directory is complete, and the checkpoint before stays on
//! disk, so a crash while saving never loses the last good checkpoint; copying an older
//! `trainer.toml` over it resumes from that one.
//!
//! The files are the same on both paths (the CPU model writes the device model's format), so a
//! run started on the CPU can be sampled from anywhere.

use crate::train::{CheckpointOptions, Precision, Record, TrainConfig, TrainError};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use te_models::gpt::GptConfig;
use te_nn::checkpoint::write_atomic;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling};

/// The model and its optimizer as a checkpoint saves and restores them: the GPU's `Gpt` and
/// `AdamW`, or the CPU path's `GptRef` and `GptAdamW`.
pub trait RunState {
    /// Writes `model.safetensors` (with `step` in its metadata) and `optimizer.safetensors`
    /// into `dir`.
    ///
    /// # Errors
    /// Runtime (I/O, device) errors.
    fn save_files(&self, dir: &Path, step: u64) -> Result<(), TrainError>;
    /// Restores model and optimizer from `dir`; returns the optimizer's step count.
    ///
    /// # Errors
    /// Runtime errors: missing, corrupt or foreign files.
    fn load_files(&mut self, dir: &Path) -> Result<u64, TrainError>;
    /// The dropout stream position.
    fn dropout_offset(&self) -> u64;
    /// Moves the dropout stream to `offset`.
    ///
    /// # Errors
    /// An offset the model cannot take.
    fn set_dropout_offset(&mut self, offset: u64) -> Result<(), TrainError>;
    /// The paths of FP8 scaling states holding a NaN or infinite value.
    ///
    /// # Errors
    /// Device errors reading them.
    fn nonfinite_states(&self) -> Result<Vec<String>, TrainError>;
    /// Waits until every rank that writes a part of the checkpoint (the ranks of a
    /// tensor-parallel group) has written its files; nothing for a single writer.
    ///
    /// # Errors
    /// Communication errors.
    fn files_written(&self) -> Result<(), TrainError> {
        Ok(())
    }
}

/// The model a checkpoint holds, as `trainer.toml` records it (its `[model]` table): what
/// `te generate` rebuilds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSection {
    /// The run's precision.
    pub precision: Precision,
    /// The architecture (`[model.config]`).
    pub config: GptConfig,
    /// The FP8 recipe of FP8 runs (`[model.recipe]`).
    pub recipe: DelayedScaling,
    /// Blockwise FP8 in place of `recipe` (`[model.block_scaling]`; `te train --recipe block`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_scaling: Option<Float8BlockScaling>,
}

impl ModelSection {
    /// The section of a run of `cfg` in `precision`.
    pub fn new(cfg: &TrainConfig, precision: Precision) -> Self {
        Self { precision, config: cfg.model.clone(), recipe: cfg.recipe, block_scaling: cfg.block_scaling }
    }
}

/// What `latest.toml` (and each checkpoint's `trainer.toml`) records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Latest {
    /// The checkpoint directory's name (`step-NNNNNNN`), relative to the run's directory.
    pub dir: String,
    /// Optimizer steps done.
    pub step: u64,
    /// The model's dropout stream position.
    pub dropout_offset: u64,
    /// Settings a resumed run must share (data order and schedule).
    pub batch: usize,
    /// Micro-batches per step.
    pub grad_accum: usize,
    /// Tokens per sequence.
    pub seq_length: usize,
    /// Peak learning rate.
    pub lr: f32,
    /// Data order seed.
    pub data_seed: u64,
    /// Model (init and dropout) seed.
    pub model_seed: u64,
    /// Ranks of the tensor-parallel group whose files the checkpoint holds (`te checkpoint
    /// split`); absent for a single-GPU checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tensor_parallel: Option<usize>,
    /// Ranks of the data-parallel run that wrote it (each read its own shard of every global
    /// batch of `data_parallel × batch` sequences); absent for a single-GPU run. Every rank
    /// holds the same weights and FP8 state, so the files are a single GPU's: a resumed run
    /// must have the same data-parallel size to keep the data order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_parallel: Option<usize>,
    /// The model (absent in checkpoints written before `te generate`).
    #[serde(default)]
    pub model: Option<ModelSection>,
}

/// `latest.toml` of a run, or `None` when there is none.
///
/// # Errors
/// [`TrainError::Resume`] for an unreadable file; [`TrainError::Output`] for an I/O error.
pub fn read_latest(path: &Path) -> Result<Option<Latest>, TrainError> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str(&text)
            .map(Some)
            .map_err(|e| TrainError::Resume { path: path.to_path_buf(), message: format!("unreadable: {e}") }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TrainError::Output { path: path.to_path_buf(), source }),
    }
}

/// The checkpointing of one run: resuming at its start, saving after its steps, the newest good
/// checkpoint for error messages.
#[derive(Debug)]
pub struct Checkpointer<'a> {
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
}

impl<'a> Checkpointer<'a> {
    /// The checkpointing `opts` asks for, of a run of `cfg` in `precision`.
    pub fn new(opts: &'a CheckpointOptions, cfg: &'a TrainConfig, precision: Precision) -> Self {
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
        }
    }

    /// The checkpointing of rank `rank` of a data-parallel run of `size` ranks: rank 0 writes
    /// the checkpoints (recording `size`), every rank resumes from them, and a checkpoint of
    /// another data-parallel size is refused (its data order differs).
    pub fn data_parallel(self, rank: usize, size: usize) -> Self {
        Self { data_parallel: size.max(1), writes: self.writes && rank == 0, ..self }
    }

    /// The checkpointing of rank `rank` of a tensor-parallel group of `size` ranks: each rank
    /// writes its own files (`model.tp-<rank>-of-<size>.safetensors`, its optimizer state
    /// likewise; [`RunState::save_files`]), rank 0 the step's `latest.toml` once all are
    /// written (recording `size`), and a checkpoint of another tensor-parallel size is refused
    /// (`te checkpoint merge|split` reshards it).
    pub fn tensor_parallel(self, rank: usize, size: usize) -> Self {
        Self { tensor_parallel: size.max(1), writes_latest: self.writes_latest && rank == 0, ..self }
    }

    /// The newest good checkpoint: the one resumed from, then each one saved.
    pub fn last(&self) -> Option<&Path> {
        self.last.as_deref()
    }

    /// With `--resume` and a checkpoint in the run's directory: restores `state` and the loss
    /// curve (`records`) from it and returns the steps it had done; else 0.
    ///
    /// # Errors
    /// [`TrainError::Resume`] for a checkpoint made with other settings or inconsistent files;
    /// runtime errors loading them.
    pub fn resume(&mut self, state: &mut dyn RunState, records: &mut Vec<Record>) -> Result<u64, TrainError> {
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
            let now = ModelSection::new(cfg, self.precision);
            if *m != now {
                differ.push(format!("the model or its recipe: {m:?} (checkpoint) vs {now:?}"));
            }
        }
        if !differ.is_empty() {
            return Err(err(format!(
                "the run was made with other settings: {}; resume with the checkpoint's, or use another --out",
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
    pub fn after_step(
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
                    false => run_dir.join(format!("step-{step:07}")),
                });
            }
        }
        if stop {
            return Err(TrainError::Interrupted { step, checkpoint: self.last.clone() });
        }
        Ok(())
    }
}

impl Checkpointer<'_> {
    /// Saves step `step` of a run into `run_dir`, then (the writer of `latest.toml`, once every
    /// writer's files are written) points `latest.toml` at it and removes the checkpoints older
    /// than the previous one.
    fn save(&self, run_dir: &Path, step: u64, state: &dyn RunState, records: &[Record]) -> Result<PathBuf, TrainError> {
        let (cfg, precision) = (self.cfg, self.precision);
        let bad = state.nonfinite_states()?;
        if let Some(path) = bad.first() {
            return Err(TrainError::NonFinite {
                step,
                message: format!(
                "the FP8 scaling state {path} holds a NaN or infinite value ({} states in all); the checkpoint was \
                 not written. The previous checkpoint is kept: continue from it with --resume, with a lower --lr",
                bad.len()
            ),
            });
        }
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
            model: Some(ModelSection::new(cfg, precision)),
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

/// Writes a loss curve as `step,train_loss,val_loss,step_ms` (atomically).
fn write_history(path: &Path, records: &[Record]) -> Result<(), TrainError> {
    let mut text = String::from("step,train_loss,val_loss,step_ms\n");
    for r in records {
        let val = r.val_loss.map(|v| v.to_string()).unwrap_or_default();
        text.push_str(&format!("{},{},{val},{}\n", r.step, r.train_loss, r.step_ms));
    }
    write_text(path, &text)
}

/// Writes `text` to `path` atomically (a crash leaves the old file or the new one).
fn write_text(path: &Path, text: &str) -> Result<(), TrainError> {
    write_atomic(path, |tmp| {
        std::fs::write(tmp, text)
            .map_err(|e| te_runtime::Error::Checkpoint { message: format!("{}: {e}", tmp.display()) })
    })?;
    Ok(())
}

/// Reads what [`write_history`] wrote (floats round-trip exactly through their shortest form).
fn read_history(path: &Path) -> Result<Vec<Record>, TrainError> {
    let bad =
        |line: usize| TrainError::Resume { path: path.to_path_buf(), message: format!("line {line} is malformed") };
    let text = std::fs::read_to_string(path).map_err(|source| TrainError::Output { path: path.into(), source })?;
    text.lines()
        .enumerate()
        .skip(1)
        .map(|(i, line)| {
            let f: Vec<&str> = line.split(',').collect();
            let [step, train, val, ms] = f[..] else { return Err(bad(i + 1)) };
            Ok(Record {
                step: step.parse().map_err(|_| bad(i + 1))?,
                train_loss: train.parse().map_err(|_| bad(i + 1))?,
                val_loss: if val.is_empty() { None } else { Some(val.parse().map_err(|_| bad(i + 1))?) },
                step_ms: ms.parse().map_err(|_| bad(i + 1))?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_round_trips_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("history.csv");
        let records = vec![
            Record { step: 1, train_loss: 5.545_177_5, val_loss: None, step_ms: 12.345_678 },
            Record { step: 2, train_loss: 0.1 + 0.2, val_loss: Some(1.0 / 3.0), step_ms: 0.001 },
        ];
        write_history(&path, &records).unwrap();
        assert_eq!(read_history(&path).unwrap(), records);
        std::fs::write(&path, "step,train_loss,val_loss,step_ms\n1,2\n").unwrap();
        let e = read_history(&path).unwrap_err();
        assert!(e.to_string().contains("line 2 is malformed"), "{e}");
    }

    fn train_config() -> TrainConfig {
        TrainConfig {
            model: GptConfig { seed: 9, ..GptConfig::tiny() },
            steps: 10,
            batch: 8,
            grad_accum: 2,
            lr: 6e-4,
            warmup_steps: 1,
            max_grad_norm: 1.0,
            eval_interval: 5,
            eval_batches: 1,
            data_seed: 1,
            recipe: DelayedScaling { amax_history_len: 16, ..DelayedScaling::default() },
            block_scaling: None,
            skip_nonfinite_steps: 0,
        }
    }

    /// `latest.toml` round-trips with its model section, and one written before the section
    /// existed still reads (without it); a missing file is `None`, a broken one an error.
    #[test]
    fn latest_toml_round_trips_and_missing_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest.toml");
        assert!(read_latest(&path).unwrap().is_none());
        let cfg = train_config();
        let l = Latest {
            dir: "step-0000010".into(),
            step: 10,
            dropout_offset: 20,
            batch: 8,
            grad_accum: 2,
            seq_length: 128,
            lr: 6e-4,
            data_seed: 1,
            model_seed: 1,
            tensor_parallel: None,
            data_parallel: None,
            model: Some(ModelSection::new(&cfg, Precision::Fp8)),
        };
        std::fs::write(&path, toml::to_string(&l).unwrap()).unwrap();
        assert_eq!(read_latest(&path).unwrap(), Some(l.clone()));
        let old = "dir = \"step-0000010\"\nstep = 10\ndropout_offset = 20\nbatch = 8\ngrad_accum = 2\n\
                   seq_length = 128\nlr = 6e-4\ndata_seed = 1\nmodel_seed = 1\n";
        std::fs::write(&path, old).unwrap();
        assert_eq!(read_latest(&path).unwrap(), Some(Latest { model: None, ..l }));
        std::fs::write(&path, "dir = 3").unwrap();
        assert!(matches!(read_latest(&path), Err(TrainError::Resume { .. })));
    }

    /// A model section unknown to this version (a field it cannot read) is an error naming it.
    #[test]
    fn a_model_section_this_version_cannot_read_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("latest.toml");
        let l = Latest {
            dir: "step-0000001".into(),
            step: 1,
            dropout_offset: 2,
            batch: 8,
            grad_accum: 2,
            seq_length: 128,
            lr: 6e-4,
            data_seed: 1,
            model_seed: 9,
            tensor_parallel: None,
            data_parallel: None,
            model: Some(ModelSection::new(&train_config(), Precision::Bf16)),
        };
        let text = toml::to_string(&l).unwrap().replace("params_dtype = \"bf16\"", "params_dtype = \"f8\"");
        std::fs::write(&path, text).unwrap();
        let e = read_latest(&path).unwrap_err().to_string();
        assert!(e.contains("unreadable") && e.contains("f8"), "{e}");
    }
}
