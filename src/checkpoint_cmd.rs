//! `te checkpoint split|merge`: a `te train` checkpoint (a `step-NNNNNNN` directory) split into
//! the files of the ranks of a tensor-parallel group, and merged back
//! ([`te_nn::checkpoint::tp`]): `model.safetensors` and `optimizer.safetensors` become
//! `model.tp-<rank>-of-<size>.safetensors` and `optimizer.tp-…`, `trainer.toml` records
//! `tensor_parallel = <size>`, `history.csv` is copied. A merge gives back the files of the
//! single-GPU checkpoint bit for bit, so a tensor-parallel run's checkpoint resumes or samples on
//! one GPU (or the CPU) once merged.

use std::path::{Path, PathBuf};
use te_nn::checkpoint::tp::{merge_files, shard_path, split_file};
use te_nn::parallel::TpLayout;
use te_train::checkpoint::{read_latest, Latest};

/// The files of a checkpoint that split; `history.csv` is copied as it is.
const FILES: [&str; 2] = ["model.safetensors", "optimizer.safetensors"];

/// `te checkpoint`'s subcommands.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum CheckpointCommand {
    /// Split a checkpoint into the files of the ranks of a tensor-parallel group.
    Split {
        /// A checkpoint's `step-NNNNNNN` directory.
        dir: PathBuf,
        /// Ranks of the group: divides the heads and the MLP width.
        #[arg(long)]
        tensor_parallel: usize,
        /// Where the split checkpoint goes (a new directory).
        #[arg(long)]
        out: PathBuf,
    },
    /// Merge a tensor-parallel checkpoint back into a single-GPU one.
    Merge {
        /// The split checkpoint's directory.
        dir: PathBuf,
        /// Where the merged checkpoint goes (a new directory).
        #[arg(long)]
        out: PathBuf,
    },
}

fn io(path: &Path, what: &str, e: std::io::Error) -> String {
    format!("{}: {what}: {e}", path.display())
}

/// The checkpoint's `trainer.toml` and the tensor-parallel layout of its model for `size` ranks.
fn read(dir: &Path, size: usize) -> Result<(Latest, TpLayout), String> {
    let path = dir.join("trainer.toml");
    let latest = read_latest(&path)
        .map_err(|e| e.to_string())?
        .ok_or_else(|| format!("{}: not found: give a checkpoint's step-NNNNNNN directory", path.display()))?;
    let Some(model) = &latest.model else {
        return Err(format!(
            "{}: no [model] section (written before this version): resume the run for a step to rewrite it",
            path.display()
        ));
    };
    let c = &model.config;
    let heads = c.num_attention_heads.max(1);
    let layout =
        TpLayout::new(heads, heads, c.hidden_size / heads, c.ffn_hidden_size, size).map_err(|e| e.to_string())?;
    Ok((latest, layout))
}

/// Writes `latest` as `trainer.toml` and copies `history.csv` into `out`.
fn finish(dir: &Path, out: &Path, latest: &Latest) -> Result<(), String> {
    let text = toml::to_string(latest).map_err(|e| e.to_string())?;
    std::fs::write(out.join("trainer.toml"), text).map_err(|e| io(out, "cannot write trainer.toml", e))?;
    let history = dir.join("history.csv");
    if history.exists() {
        std::fs::copy(&history, out.join("history.csv")).map_err(|e| io(&history, "cannot copy", e))?;
    }
    Ok(())
}

fn make_out(out: &Path) -> Result<(), String> {
    if out.join("trainer.toml").exists() {
        return Err(format!("{}: already holds a checkpoint: give a new --out", out.display()));
    }
    std::fs::create_dir_all(out).map_err(|e| io(out, "cannot create", e))
}

/// Runs a `te checkpoint` subcommand; returns what it wrote, as a line.
///
/// # Errors
/// A message naming the file or tensor: a missing or older `trainer.toml`, a size that does not
/// divide the heads or the MLP width, a checkpoint already split (split) or not split (merge),
/// an `--out` that already holds a checkpoint, I/O and format errors.
pub fn run(cmd: &CheckpointCommand) -> Result<String, String> {
    match cmd {
        CheckpointCommand::Split { dir, tensor_parallel, out } => {
            let (mut latest, layout) = read(dir, *tensor_parallel)?;
            if latest.tensor_parallel.is_some_and(|n| n > 1) {
                return Err(format!("{}: already split: merge it first", dir.display()));
            }
            make_out(out)?;
            for name in FILES.iter().filter(|n| dir.join(n).exists()) {
                split_file(&dir.join(name), &layout, &out.join(name)).map_err(|e| e.to_string())?;
            }
            latest.tensor_parallel = Some(*tensor_parallel);
            finish(dir, out, &latest)?;
            Ok(format!("split {} into {tensor_parallel} ranks' files in {}", dir.display(), out.display()))
        }
        CheckpointCommand::Merge { dir, out } => {
            let path = dir.join("trainer.toml");
            let size = read_latest(&path)
                .map_err(|e| e.to_string())?
                .and_then(|l| l.tensor_parallel)
                .filter(|&n| n > 1)
                .ok_or_else(|| {
                    format!("{}: not a tensor-parallel checkpoint (no tensor_parallel > 1)", path.display())
                })?;
            let (mut latest, layout) = read(dir, size)?;
            make_out(out)?;
            for name in FILES {
                let parts: Vec<PathBuf> = (0..size).map(|r| shard_path(&dir.join(name), r, size)).collect();
                if name == FILES[1] && !parts[0].exists() {
                    continue;
                }
                merge_files(&parts, &layout, &out.join(name)).map_err(|e| e.to_string())?;
            }
            latest.tensor_parallel = None;
            finish(dir, out, &latest)?;
            Ok(format!("merged the {size} ranks' files of {} into {}", dir.display(), out.display()))
        }
    }
}
