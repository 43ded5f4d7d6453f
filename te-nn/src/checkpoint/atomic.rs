//! Writing a file so that it is either the old one or the complete new one: a temporary file in
//! the same directory, fsync, rename over the target.

use std::fs::File;
use std::path::Path;
use te_runtime::{Error, Result};

/// `Error::Checkpoint` for an I/O failure on `path`.
pub(crate) fn io_error(path: &Path, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Checkpoint { message: format!("{}: {what}: {e}", path.display()) }
}

/// Writes `path` through `write`, which gets the path of a fresh temporary file in the same
/// directory to fill; the temporary file is then flushed to disk and renamed over `path`. An
/// existing `path` stays as it was until the rename: when `write` or the fsync fails, the
/// temporary file is removed and the error returned.
///
/// # Errors
/// `write`'s error; [`Error::Checkpoint`] when the temporary file cannot be made, synced or
/// renamed (an unwritable directory, a full disk).
pub fn write_atomic(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path.file_name().map_or_else(|| "checkpoint".into(), |n| n.to_string_lossy());
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{name}."))
        .suffix(".tmp")
        .tempfile_in(dir)
        .map_err(|e| io_error(dir, "cannot make a temporary file", e))?;
    write(tmp.path())?;
    tmp.as_file().sync_all().map_err(|e| io_error(tmp.path(), "fsync failed", e))?;
    tmp.persist(path).map_err(|e| io_error(path, "cannot rename the temporary file over it", e.error))?;
    // The rename itself reaches the disk with the directory; a directory that cannot be opened
    // or synced (some file systems) leaves the rename to the OS, the file is complete either way.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn leftovers(dir: &Path) -> Vec<String> {
        let mut names: Vec<_> =
            fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        names.sort();
        names
    }

    #[test]
    fn writes_and_replaces() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        write_atomic(&path, |tmp| fs::write(tmp, b"one").map_err(|e| io_error(tmp, "write", e))).unwrap();
        write_atomic(&path, |tmp| fs::write(tmp, b"two").map_err(|e| io_error(tmp, "write", e))).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        assert_eq!(leftovers(dir.path()), ["ckpt.safetensors"]);
    }

    #[test]
    fn a_failed_write_keeps_the_old_file_and_leaves_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckpt.safetensors");
        fs::write(&path, b"old").unwrap();
        let r = write_atomic(&path, |tmp| {
            fs::write(tmp, b"half of the new").unwrap();
            Err(Error::Checkpoint { message: "disk full".into() })
        });
        assert!(matches!(r, Err(Error::Checkpoint { message }) if message == "disk full"));
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(leftovers(dir.path()), ["ckpt.safetensors"]);
    }

    #[test]
    fn an_unwritable_target_is_an_error_and_keeps_what_was_there() {
        let dir = tempfile::tempdir().unwrap();
        let missing_dir = dir.path().join("no_such_dir").join("ckpt.safetensors");
        let e = write_atomic(&missing_dir, |_| Ok(())).unwrap_err();
        assert!(matches!(&e, Error::Checkpoint { message } if message.contains("temporary file")), "{e}");

        // A directory where the file should go: the rename fails, the directory stays.
        let occupied = dir.path().join("occupied");
        fs::create_dir(&occupied).unwrap();
        fs::write(occupied.join("inside"), b"kept").unwrap();
        let e = write_atomic(&occupied, |tmp| fs::write(tmp, b"new").map_err(|e| io_error(tmp, "write", e)));
        assert!(matches!(e, Err(Error::Checkpoint { .. })));
        assert_eq!(fs::read(occupied.join("inside")).unwrap(), b"kept");
        assert_eq!(leftovers(dir.path()), ["occupied"]);
    }
}
