//! [`Metadata`]: a GGUF file's key/value pairs in file order, with typed accessors whose errors
//! name the file, the key and what it holds.
//!
//! Keys are the GGUF spec's dotted names: `general.architecture`, `general.alignment`,
//! `{arch}.block_count`, `{arch}.attention.head_count_kv`, `tokenizer.ggml.tokens`, ... (see
//! `docs/gguf.md` in ggml for the standard ones; [`Metadata::arch_key`] prefixes the
//! architecture).

use super::value::{MetadataArray, MetadataValue};
use std::collections::HashMap;
use te_runtime::{Error, Result};

/// The metadata of a GGUF file: its key/value pairs in file order, looked up by key.
///
/// Accessors return typed errors ([`Error::Checkpoint`]) naming the file and the key: one that
/// is missing, or that holds another type than asked. [`Metadata::optional`] turns a missing key
/// into `None` and keeps the type check:
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// let file = te_models::gguf::GgufFile::open("gemma-3-270m-it-Q4_K_M.gguf")?;
/// let meta = file.metadata();
/// let tokens: &[String] = meta.get_str_array("tokenizer.ggml.tokens")?;
/// let scores: &[f32] = meta.get_f32_array("tokenizer.ggml.scores")?;
/// let bos = meta.get_u32("tokenizer.ggml.bos_token_id")?;
/// let add_bos = meta.optional("tokenizer.ggml.add_bos_token", |m, k| m.get_bool(k))?.unwrap_or(false);
/// let layers = meta.get_u32(&meta.arch_key("block_count")?)?; // `gemma3.block_count`
/// # let _ = (tokens, scores, bos, add_bos, layers); Ok(()) }
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    source: String,
    entries: Vec<(String, MetadataValue)>,
    index: HashMap<String, usize>,
}

/// Integer variants widened to `i128`, for the lossless integer accessors.
fn as_integer(v: &MetadataValue) -> Option<i128> {
    Some(match *v {
        MetadataValue::U8(x) => x.into(),
        MetadataValue::I8(x) => x.into(),
        MetadataValue::U16(x) => x.into(),
        MetadataValue::I16(x) => x.into(),
        MetadataValue::U32(x) => x.into(),
        MetadataValue::I32(x) => x.into(),
        MetadataValue::U64(x) => x.into(),
        MetadataValue::I64(x) => x.into(),
        _ => return None,
    })
}

/// A short rendering of a value for errors (arrays by type and length only).
fn preview(v: &MetadataValue) -> String {
    match v {
        MetadataValue::Array(_) => v.type_name(),
        MetadataValue::String(s) if s.chars().count() > 40 => {
            format!("string {:?}…", s.chars().take(40).collect::<String>())
        }
        MetadataValue::String(s) => format!("string {s:?}"),
        other => format!("{} {}", other.type_name(), scalar_text(other)),
    }
}

fn scalar_text(v: &MetadataValue) -> String {
    match v {
        MetadataValue::F32(x) => x.to_string(),
        MetadataValue::F64(x) => x.to_string(),
        MetadataValue::Bool(x) => x.to_string(),
        other => as_integer(other).map(|x| x.to_string()).unwrap_or_default(),
    }
}

impl Metadata {
    /// Empty metadata of `source` (the file, for errors).
    pub(crate) fn new(source: &str) -> Self {
        Self { source: source.to_string(), ..Self::default() }
    }

    /// Adds a pair; `false` (and nothing added) when the key is already there.
    pub(crate) fn insert(&mut self, key: String, value: MetadataValue) -> bool {
        if self.index.contains_key(&key) {
            return false;
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        true
    }

    /// Pairs.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The pairs in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetadataValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&MetadataValue> {
        self.index.get(key).and_then(|&i| self.entries.get(i)).map(|(_, v)| v)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn error(&self, key: &str, message: String) -> Error {
        Error::Checkpoint { message: format!("{}: metadata key `{key}` {message}", self.source) }
    }

    /// The value of `key`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key when it is missing.
    pub fn require(&self, key: &str) -> Result<&MetadataValue> {
        self.get(key).ok_or_else(|| {
            self.error(key, format!("is missing (the file has {} keys; is it a model of this kind?)", self.len()))
        })
    }

    fn mistyped(&self, key: &str, v: &MetadataValue, expected: &str) -> Error {
        self.error(key, format!("holds {}, expected {expected}", preview(v)))
    }

    /// `Ok(None)` when `key` is missing, else `get(self, key)`: a missing key is fine, a
    /// mistyped one is still an error (`meta.optional("tokenizer.ggml.add_bos_token", |m, k|
    /// m.get_bool(k))`).
    ///
    /// # Errors
    /// What `get` returns for a present key.
    pub fn optional<T>(&self, key: &str, get: impl FnOnce(&Self, &str) -> Result<T>) -> Result<Option<T>> {
        if self.contains(key) {
            get(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    fn integer<T: TryFrom<i128>>(&self, key: &str, expected: &str) -> Result<T> {
        let v = self.require(key)?;
        as_integer(v).and_then(|x| T::try_from(x).ok()).ok_or_else(|| self.mistyped(key, v, expected))
    }

    /// An integer key as `u32`. Any GGUF integer type is accepted when its value fits (writers
    /// differ: `tokenizer.ggml.bos_token_id` is `u32` in llama.cpp's converter, some files
    /// store `i32`).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key: missing, not an integer, or out of range.
    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.integer(key, "an integer in u32's range")
    }

    /// An integer key as `u64` (any integer type whose value fits).
    ///
    /// # Errors
    /// As [`Metadata::get_u32`].
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.integer(key, "an integer in u64's range")
    }

    /// An integer key as `i32` (any integer type whose value fits).
    ///
    /// # Errors
    /// As [`Metadata::get_u32`].
    pub fn get_i32(&self, key: &str) -> Result<i32> {
        self.integer(key, "an integer in i32's range")
    }

    /// A float key as `f32`: an `f32`, or an `f64` rounded to `f32` (e.g.
    /// `gemma3.rope.freq_base` = 1e6, `gemma3.attention.layer_norm_rms_epsilon` = 1e-6).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key: missing or not a float.
    pub fn get_f32(&self, key: &str) -> Result<f32> {
        match self.require(key)? {
            MetadataValue::F32(x) => Ok(*x),
            MetadataValue::F64(x) => Ok(*x as f32),
            v => Err(self.mistyped(key, v, "f32")),
        }
    }

    /// A bool key.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key: missing or not a bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        match self.require(key)? {
            MetadataValue::Bool(x) => Ok(*x),
            v => Err(self.mistyped(key, v, "bool")),
        }
    }

    /// A string key.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key: missing or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        match self.require(key)? {
            MetadataValue::String(x) => Ok(x),
            v => Err(self.mistyped(key, v, "string")),
        }
    }

    fn array(&self, key: &str) -> Result<&MetadataArray> {
        match self.require(key)? {
            MetadataValue::Array(a) => Ok(a),
            v => Err(self.mistyped(key, v, "an array")),
        }
    }

    /// An array of strings (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the key: missing, not an array, or an array of
    /// another element type.
    pub fn get_str_array(&self, key: &str) -> Result<&[String]> {
        match self.array(key)? {
            MetadataArray::String(v) => Ok(v),
            _ => Err(self.array_mistyped(key, "string")),
        }
    }

    /// An array of `f32` (`tokenizer.ggml.scores`).
    ///
    /// # Errors
    /// As [`Metadata::get_str_array`].
    pub fn get_f32_array(&self, key: &str) -> Result<&[f32]> {
        match self.array(key)? {
            MetadataArray::F32(v) => Ok(v),
            _ => Err(self.array_mistyped(key, "f32")),
        }
    }

    /// An array of `i32` (`tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4
    /// user-defined, 5 unused, 6 byte, as llama.cpp's `llama_token_type`).
    ///
    /// # Errors
    /// As [`Metadata::get_str_array`].
    pub fn get_i32_array(&self, key: &str) -> Result<&[i32]> {
        match self.array(key)? {
            MetadataArray::I32(v) => Ok(v),
            _ => Err(self.array_mistyped(key, "i32")),
        }
    }

    /// An array of `u32`.
    ///
    /// # Errors
    /// As [`Metadata::get_str_array`].
    pub fn get_u32_array(&self, key: &str) -> Result<&[u32]> {
        match self.array(key)? {
            MetadataArray::U32(v) => Ok(v),
            _ => Err(self.array_mistyped(key, "u32")),
        }
    }

    fn array_mistyped(&self, key: &str, expected: &str) -> Error {
        let got = self.get(key).map(MetadataValue::type_name).unwrap_or_default();
        self.error(key, format!("holds an {got}, expected an array of {expected}"))
    }

    /// `general.architecture` (`gemma3`, `llama`, `qwen2`, ...).
    ///
    /// # Errors
    /// As [`Metadata::get_str`].
    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    /// `{general.architecture}.{suffix}`: the key of an architecture's hyper-parameter
    /// (`arch_key("block_count")` is `gemma3.block_count` in a Gemma 3 file).
    ///
    /// # Errors
    /// As [`Metadata::architecture`].
    pub fn arch_key(&self, suffix: &str) -> Result<String> {
        Ok(format!("{}.{suffix}", self.architecture()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Metadata {
        let mut m = Metadata::new("m.gguf");
        for (k, v) in [
            ("general.architecture", MetadataValue::from("gemma3")),
            ("gemma3.block_count", 18u32.into()),
            ("gemma3.rope.freq_base", 1e6f32.into()),
            ("eps64", 1e-6f64.into()),
            ("neg", (-3i32).into()),
            ("big", (1u64 << 40).into()),
            ("tokenizer.ggml.add_bos_token", true.into()),
            ("tokenizer.ggml.tokens", vec!["<pad>".to_string(), "<eos>".into()].into()),
            ("tokenizer.ggml.scores", vec![0.0f32, -1.5].into()),
            ("tokenizer.ggml.token_type", vec![3i32, 3].into()),
            ("ids", vec![1u32, 2].into()),
        ] {
            assert!(m.insert(k.into(), v));
        }
        assert!(!m.insert("neg".into(), 0u8.into()));
        m
    }

    #[test]
    fn typed_accessors_read_what_is_there() {
        let m = meta();
        assert_eq!(m.len(), 11);
        assert_eq!(m.iter().next().map(|(k, _)| k), Some("general.architecture"));
        assert_eq!(m.architecture().unwrap(), "gemma3");
        assert_eq!(m.get_u32(&m.arch_key("block_count").unwrap()).unwrap(), 18);
        assert_eq!(m.get_u64("gemma3.block_count").unwrap(), 18);
        assert_eq!(m.get_i32("neg").unwrap(), -3);
        assert_eq!(m.get_u64("big").unwrap(), 1 << 40);
        assert_eq!(m.get_f32("gemma3.rope.freq_base").unwrap(), 1e6);
        assert_eq!(m.get_f32("eps64").unwrap(), 1e-6);
        assert!(m.get_bool("tokenizer.ggml.add_bos_token").unwrap());
        assert_eq!(m.get_str_array("tokenizer.ggml.tokens").unwrap(), ["<pad>", "<eos>"]);
        assert_eq!(m.get_f32_array("tokenizer.ggml.scores").unwrap(), [0.0, -1.5]);
        assert_eq!(m.get_i32_array("tokenizer.ggml.token_type").unwrap(), [3, 3]);
        assert_eq!(m.get_u32_array("ids").unwrap(), [1, 2]);
        assert_eq!(m.optional("absent", |m, k| m.get_bool(k)).unwrap(), None);
        assert_eq!(m.optional("tokenizer.ggml.add_bos_token", |m, k| m.get_bool(k)).unwrap(), Some(true));
    }

    #[test]
    fn missing_and_mistyped_keys_are_named() {
        let m = meta();
        let check = |r: Result<()>, want: &[&str]| {
            let e = r.unwrap_err().to_string();
            for w in want {
                assert!(e.contains(w), "{e} lacks {w}");
            }
        };
        check(m.get_u32("absent").map(drop), &["m.gguf", "`absent`", "missing"]);
        check(m.get_u32("neg").map(drop), &["`neg`", "i32 -3", "u32"]);
        check(m.get_i32("big").map(drop), &["`big`", "u64 1099511627776"]);
        check(m.get_f32("general.architecture").map(drop), &["string \"gemma3\"", "expected f32"]);
        check(m.get_bool("gemma3.block_count").map(drop), &["u32 18", "bool"]);
        check(m.get_str("gemma3.rope.freq_base").map(drop), &["f32 1000000", "string"]);
        check(m.get_str_array("tokenizer.ggml.scores").map(drop), &["array of f32 (2)", "array of string"]);
        check(m.get_f32_array("neg").map(drop), &["`neg`", "an array"]);
        check(m.get_i32_array("ids").map(drop), &["array of u32"]);
        check(m.get_u32_array("tokenizer.ggml.token_type").map(drop), &["array of i32"]);
        check(m.optional("neg", |m, k| m.get_bool(k)).map(drop), &["`neg`"]);
        check(Metadata::new("e.gguf").arch_key("x").map(drop), &["general.architecture", "missing"]);
    }
}
