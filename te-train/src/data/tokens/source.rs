//! Where documents come from: text files (one document each), `.jsonl` files (one document a
//! line, its `"text"` field) and directories (their [`DOCUMENT_EXTENSIONS`] files, recursively,
//! in path order).

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::Value;

use crate::data::DataError;

/// The extensions (case-insensitive) of the files a directory contributes: `txt` and `md` as one
/// document each, `jsonl` as JSON Lines (a dataset's shards); other files under it are left out.
/// A file named directly is read whatever its extension (JSON Lines when it is `.jsonl`).
pub const DOCUMENT_EXTENSIONS: [&str; 3] = ["txt", "md", "jsonl"];

/// How a file's bytes become documents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SourceFormat {
    /// The whole file is one document: UTF-8 text (a leading byte-order mark is dropped).
    Text,
    /// JSON Lines (a `.jsonl` file): every non-blank line a JSON object whose string field
    /// `"text"` is a document; other fields are ignored.
    Jsonl,
}

/// One file of the data and how it is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceFile {
    /// The file: a source as given, or a file found under a directory given (that directory
    /// joined with the path below it).
    pub path: PathBuf,
    /// How its bytes become documents.
    pub format: SourceFormat,
}

/// A document's text and where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The text.
    pub text: String,
    /// The file, or `file:line` for a line of a `.jsonl` file (line numbers from 1): what errors
    /// about the document name.
    pub origin: String,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DataError + '_ {
    move |source| DataError::Io { path: path.to_path_buf(), source }
}

fn has_extension(path: &Path, exts: &[&str]) -> bool {
    path.extension().and_then(|e| e.to_str()).is_some_and(|e| exts.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// The files of `sources`, in order: a `.jsonl` file (case-insensitive) as
/// [`SourceFormat::Jsonl`], any other file as [`SourceFormat::Text`], a directory as its
/// [`DOCUMENT_EXTENSIONS`] files (recursively, sorted by path), each read as its extension says.
///
/// # Errors
/// [`DataError::NoSources`] for an empty list; [`DataError::Io`] for a path that does not exist
/// or a directory that cannot be listed.
pub fn source_files<P: AsRef<Path>>(sources: &[P]) -> Result<Vec<SourceFile>, DataError> {
    if sources.is_empty() {
        return Err(DataError::NoSources);
    }
    let mut files = Vec::new();
    for source in sources {
        let source = source.as_ref();
        let format = |p: &Path| if has_extension(p, &["jsonl"]) { SourceFormat::Jsonl } else { SourceFormat::Text };
        if !std::fs::metadata(source).map_err(io(source))?.is_dir() {
            files.push(SourceFile { path: source.to_path_buf(), format: format(source) });
            continue;
        }
        let mut found = Vec::new();
        let mut stack = vec![source.to_path_buf()];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir).map_err(io(&dir))? {
                let p = entry.map_err(io(&dir))?.path();
                if p.is_dir() {
                    stack.push(p);
                } else if has_extension(&p, &DOCUMENT_EXTENSIONS) {
                    found.push(p);
                }
            }
        }
        found.sort();
        files.extend(found.into_iter().map(|path| SourceFile { format: format(&path), path }));
    }
    Ok(files)
}

/// The documents of `sources` ([`source_files`], then each file read as its format says), in
/// order.
///
/// # Errors
/// As [`source_files`]; [`DataError::Io`] for an unreadable file; [`DataError::NotUtf8`] for a
/// text file that is not UTF-8; [`DataError::Jsonl`] (naming `file:line`) for a line of a
/// `.jsonl` file that is not a JSON object with a string `"text"`; [`DataError::NoDocuments`]
/// when there is none.
pub fn read_documents<P: AsRef<Path>>(sources: &[P]) -> Result<Vec<Document>, DataError> {
    let mut docs = Vec::new();
    for file in source_files(sources)? {
        let bytes = std::fs::read(&file.path).map_err(io(&file.path))?;
        docs.extend(file_documents(&file, bytes)?);
    }
    if docs.is_empty() {
        return Err(DataError::NoDocuments { sources: describe(sources) });
    }
    Ok(docs)
}

/// The sources as a list for messages.
pub(super) fn describe<P: AsRef<Path>>(sources: &[P]) -> String {
    sources.iter().map(|p| p.as_ref().display().to_string()).collect::<Vec<_>>().join(", ")
}

/// The documents of one file's bytes: the whole text, or one per non-blank line of JSON Lines.
///
/// # Errors
/// [`DataError::NotUtf8`] for a text file that is not UTF-8; [`DataError::Jsonl`] (naming
/// `file:line`) for a line that is not a JSON object with a string `"text"`.
pub(super) fn file_documents(file: &SourceFile, bytes: Vec<u8>) -> Result<Vec<Document>, DataError> {
    match file.format {
        SourceFormat::Text => {
            let mut text = String::from_utf8(bytes)
                .map_err(|e| DataError::NotUtf8 { path: file.path.clone(), at: e.utf8_error().valid_up_to() })?;
            if text.starts_with('\u{feff}') {
                text.drain(..'\u{feff}'.len_utf8());
            }
            Ok(vec![Document { text, origin: file.path.display().to_string() }])
        }
        SourceFormat::Jsonl => {
            let body = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(&bytes);
            let lines: Vec<&[u8]> = body.split(|&b| b == b'\n').collect();
            let parsed: Vec<Result<Option<Document>, DataError>> =
                lines.par_iter().enumerate().map(|(i, line)| jsonl_line(&file.path, i + 1, line)).collect();
            parsed.into_iter().filter_map(Result::transpose).collect()
        }
    }
}

/// The document of line `line` (from 1) of a JSON Lines file; `None` for a blank line.
fn jsonl_line(path: &Path, line: usize, bytes: &[u8]) -> Result<Option<Document>, DataError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let err = |message: String| DataError::Jsonl { path: path.to_path_buf(), line, message };
    let value: Value = serde_json::from_slice(bytes).map_err(|e| {
        // serde's own position is within the line: keep the column only.
        let full = e.to_string();
        let message = full.strip_suffix(&format!(" at line {} column {}", e.line(), e.column())).unwrap_or(&full);
        err(format!("not JSON: {message} (column {})", e.column()))
    })?;
    let kind = |v: &Value| match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let Value::Object(mut fields) = value else {
        return Err(err(format!("a JSON {}, not an object", kind(&value))));
    };
    match fields.remove("text") {
        Some(Value::String(text)) => Ok(Some(Document { text, origin: format!("{}:{line}", path.display()) })),
        Some(other) => Err(err(format!("\"text\" is a {}, not a string", kind(&other)))),
        None => {
            let names: Vec<&str> = fields.keys().map(String::as_str).collect();
            Err(err(format!("no \"text\" field (the object has: {})", names.join(", "))))
        }
    }
}
