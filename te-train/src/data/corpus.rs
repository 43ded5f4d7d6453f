//! The bytes a run trains on and their train / validation split.

use super::DataError;
use std::path::Path;

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

/// The bytes of a text file, or of every file under a directory (in path order, each followed
/// by a newline), concatenated.
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

/// Train and validation bytes (byte-level tokens): the last `val_fraction` of the text is held
/// out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corpus {
    /// Training bytes.
    pub train: Vec<u8>,
    /// Held-out bytes.
    pub val: Vec<u8>,
}

impl Corpus {
    /// Splits `text`: its last `val_fraction` (clamped to `[0, 1]`) is the validation split,
    /// keeping at least one byte on each side (a text of one byte is in both).
    pub fn split(mut text: Vec<u8>, val_fraction: f64) -> Corpus {
        let n = text.len();
        let val_len = ((n as f64 * val_fraction.clamp(0.0, 1.0)) as usize).clamp(n.min(1), n.saturating_sub(1).max(1));
        let val = text.split_off(n.saturating_sub(val_len));
        Corpus { train: text, val }
    }

    /// The split ([`Corpus::split`]) of a string's UTF-8 bytes.
    pub fn from_text(text: impl Into<String>, val_fraction: f64) -> Corpus {
        Self::split(text.into().into_bytes(), val_fraction)
    }

    /// The split ([`Corpus::split`]) of a text file, or of every file under a directory
    /// ([`read_text`]).
    ///
    /// # Errors
    /// [`DataError::Io`] for unreadable paths.
    pub fn from_path(path: &Path, val_fraction: f64) -> Result<Corpus, DataError> {
        Ok(Self::split(read_text(path)?, val_fraction))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_holds_out_the_tail() {
        let c = Corpus::split((0..100u8).collect(), 0.1);
        assert_eq!((c.train.len(), c.val.len()), (90, 10));
        assert_eq!(c.val[0], 90);
        let tiny = Corpus::split(vec![1, 2], 0.0);
        assert_eq!((tiny.train.len(), tiny.val.len()), (1, 1));
        let text = Corpus::from_text("abcdefghij", 0.2);
        assert_eq!((text.train.as_slice(), text.val.as_slice()), (&b"abcdefgh"[..], &b"ij"[..]));
    }

    #[test]
    fn reads_text_from_files_and_directories() {
        let dir = tempfile::tempdir().unwrap();
        let texts = dir.path().join("texts");
        std::fs::create_dir_all(texts.join("sub")).unwrap();
        std::fs::write(texts.join("sub/2.txt"), b"two").unwrap();
        std::fs::write(texts.join("1.txt"), b"one").unwrap();
        assert_eq!(read_text(&texts).unwrap(), b"one\ntwo\n");
        assert_eq!(read_text(&texts.join("1.txt")).unwrap(), b"one");
        let c = Corpus::from_path(&texts, 0.5).unwrap();
        assert_eq!((c.train.as_slice(), c.val.as_slice()), (&b"one\n"[..], &b"two\n"[..]));
        let e = Corpus::from_path(&dir.path().join("missing"), 0.1).unwrap_err();
        assert!(matches!(&e, DataError::Io { path, .. } if path.ends_with("missing")), "{e}");
    }
}
