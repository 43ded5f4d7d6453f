//! [`GgufFile`]: a GGUF file opened read-only (memory-mapped, or bytes in memory), its header,
//! metadata and tensor table parsed and checked against the file's length up front.
//!
//! Layout (GGUF spec, `docs/gguf.md` in ggml; `gguf_init_from_file_impl` in
//! `ggml/src/gguf.cpp`), little-endian:
//!
//! ```text
//! "GGUF" | u32 version (2 or 3) | u64 tensor count | u64 metadata count
//! metadata: (string key, u32 value type, value) × count          (see `value`)
//! tensor infos: (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset) × count
//! padding to `general.alignment` (default 32) | data section
//! ```
//!
//! A string is a `u64` byte length and the bytes. Version 1 (32-bit counts) is refused, as ggml
//! refuses it; versions 2 and 3 are read alike (3 allowed big-endian files, which are refused
//! here). Tensor offsets are relative to the data section and multiples of the alignment.

use super::cursor::{Cursor, Short};
use super::metadata::Metadata;
use super::tensor::{GgufTensor, TensorInfo};
use super::value::{read_value, ValueAt};
use super::GgmlType;
use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use te_runtime::{Error, Result};

/// The four bytes a GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// The GGUF versions read (and [`super::GgufWriter`] writes).
pub const SUPPORTED_VERSIONS: [u32; 2] = [2, 3];
/// The metadata key of the data alignment (a `u32`, a power of two).
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// The alignment when [`ALIGNMENT_KEY`] is absent (ggml's `GGUF_DEFAULT_ALIGNMENT`).
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a tensor has (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;

/// The fewest bytes one metadata entry takes: key length, value type, a 1-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// The fewest bytes one tensor info takes: name length, n_dims, type, offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;

/// Where the bytes live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A GGUF file (versions 2 and 3, little-endian): header, [`Metadata`], tensor table, and the
/// tensors' bytes, read on demand ([`GgufFile::tensor`]).
///
/// ```no_run
/// # fn main() -> te_runtime::Result<()> {
/// use te_models::gguf::GgufFile;
/// let file = GgufFile::open("gemma-3-270m-it-Q4_K_M.gguf")?;
/// assert_eq!(file.metadata().architecture()?, "gemma3");
/// let emb = file.tensor("token_embd.weight")?; // dims [640, 262144]: shape [262144, 640]
/// let rows: Vec<half::bf16> = emb.to_bf16()?;
/// # let _ = rows; Ok(()) }
/// ```
pub struct GgufFile {
    source: String,
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("source", &self.source)
            .field("version", &self.version)
            .field("bytes", &self.storage.bytes().len())
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and parses the file at `path`, memory-mapped read-only: the tensors' bytes are not
    /// read until used, and never copied by [`GgufTensor::data`]. The file must not be changed
    /// by another process while it is open (as with any mapped file; llama.cpp maps its models
    /// the same way).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file: it cannot be opened or mapped, or it is not a valid
    /// GGUF file (see [`GgufFile::from_bytes`]).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let source = path.display().to_string();
        let io = |what: &str, e: std::io::Error| Error::Checkpoint { message: format!("{source}: cannot {what}: {e}") };
        let file = std::fs::File::open(path).map_err(|e| io("open the file", e))?;
        // SAFETY: the map is read-only and private to this value; its bytes are only read
        // through bounds-checked slices. Mapping is unsound only if the file is changed or
        // truncated while mapped, which `open` documents as the caller's to avoid.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| io("memory-map the file", e))?;
        Self::parse(Storage::Mapped(map), source)
    }

    /// Parses the bytes of a whole GGUF file held in memory; `source` names it in errors.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming `source` and what is wrong: a bad magic, a version other than
    /// 2 or 3 (big-endian files too), a truncated header, metadata or tensor table, a metadata
    /// value of an unknown type, duplicate keys or tensor names, a `general.alignment` that is
    /// not a power of two, a tensor of more than 4 dims or an element count past `i64`, a ggml
    /// type id ggml does not define, a row that is not a whole number of blocks, a tensor offset
    /// that is not a multiple of the alignment, or tensor data past the end of the file.
    pub fn from_bytes(bytes: Vec<u8>, source: impl Into<String>) -> Result<Self> {
        Self::parse(Storage::Owned(bytes), source.into())
    }

    fn parse(storage: Storage, source: String) -> Result<Self> {
        let parsed = Parser { c: Cursor::new(storage.bytes()), source: &source }.parse()?;
        let (version, alignment, data_offset, metadata, tensors) = parsed;
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(Self { source, storage, version, alignment, data_offset, metadata, tensors, index })
    }

    /// The path (or the name given to [`GgufFile::from_bytes`]) errors name.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data alignment in bytes ([`ALIGNMENT_KEY`], else [`DEFAULT_ALIGNMENT`]).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Byte offset of the data section in the file.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The file's length in bytes.
    pub fn len_bytes(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// The metadata.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// Every tensor with its bytes, in file order.
    pub fn iter_tensors(&self) -> impl Iterator<Item = GgufTensor<'_>> {
        self.tensors.iter().map(|info| self.view(info))
    }

    /// The tensor `name`, if present.
    pub fn get_tensor(&self, name: &str) -> Option<GgufTensor<'_>> {
        self.index.get(name).and_then(|&i| self.tensors.get(i)).map(|info| self.view(info))
    }

    /// The tensor `name`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file and the tensor when it is not in the file.
    pub fn tensor(&self, name: &str) -> Result<GgufTensor<'_>> {
        self.get_tensor(name).ok_or_else(|| Error::Checkpoint {
            message: format!(
                "{}: no tensor `{name}` (the file has {} tensors; is it a model of this architecture?)",
                self.source,
                self.tensors.len()
            ),
        })
    }

    fn view<'a>(&'a self, info: &'a TensorInfo) -> GgufTensor<'a> {
        // The parser checked every tensor's range against the file's length.
        let start = self.data_offset.saturating_add(info.offset) as usize;
        let data = self.storage.bytes().get(start..start.saturating_add(info.n_bytes as usize)).unwrap_or_default();
        GgufTensor { info, data, source: &self.source }
    }
}

/// The parse of a file: version, alignment, data offset, metadata, tensors.
type Parsed = (u32, u64, u64, Metadata, Vec<TensorInfo>);

struct Parser<'a> {
    c: Cursor<'a>,
    source: &'a str,
}

impl Parser<'_> {
    fn error(&self, message: String) -> Error {
        Error::Checkpoint { message: format!("{}: {message}", self.source) }
    }

    fn short(&self, what: &str) -> impl Fn(Short) -> Error + '_ {
        let what = what.to_string();
        move |s| s.error(self.source, &what)
    }

    fn parse(mut self) -> Result<Parsed> {
        let magic = self.c.take_array::<4>().map_err(self.short("the magic"))?;
        if magic != MAGIC {
            return Err(self.error(format!(
                "not a GGUF file: it starts with {:?} ({}), expected \"GGUF\"",
                String::from_utf8_lossy(&magic),
                magic.map(|b| format!("{b:02x}")).join(" ")
            )));
        }
        let version = self.c.u32().map_err(self.short("the version"))?;
        self.check_version(version)?;
        let n_tensors = self.c.u64().map_err(self.short("the tensor count"))?;
        let n_kv = self.c.u64().map_err(self.short("the metadata count"))?;
        // Bound both counts by the bytes left before allocating anything for them.
        let fits = |n: u64, min: usize| usize::try_from(n).ok().and_then(|n| n.checked_mul(min));
        let need =
            fits(n_kv, MIN_KV_BYTES).zip(fits(n_tensors, MIN_TENSOR_INFO_BYTES)).and_then(|(a, b)| a.checked_add(b));
        if need.is_none_or(|need| need > self.c.remaining()) {
            return Err(self.error(format!(
                "the header claims {n_kv} metadata entries and {n_tensors} tensors, more than the {} bytes after it \
                 can hold: the file is truncated or corrupt",
                self.c.remaining()
            )));
        }
        let metadata = self.metadata(n_kv as usize)?;
        let alignment = self.alignment(&metadata)?;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = HashMap::with_capacity(n_tensors as usize);
        for i in 0..n_tensors as usize {
            let t = self.tensor_info(i)?;
            if let Some(j) = names.insert(t.name.clone(), i) {
                return Err(self.error(format!("tensors {j} and {i} are both named `{}`", t.name)));
            }
            tensors.push(t);
        }
        let data_offset = (self.c.pos() as u64).checked_next_multiple_of(alignment).unwrap_or(u64::MAX);
        let len = self.c.pos() as u64 + self.c.remaining() as u64;
        for t in &tensors {
            self.check_range(t, alignment, data_offset, len)?;
        }
        Ok((version, alignment, data_offset, metadata, tensors))
    }

    fn check_version(&self, version: u32) -> Result<()> {
        if SUPPORTED_VERSIONS.contains(&version) {
            return Ok(());
        }
        let why = if version == 1 {
            "GGUF version 1 (32-bit counts) is no longer read by ggml either; convert the model again with a current \
             llama.cpp"
                .to_string()
        } else if SUPPORTED_VERSIONS.contains(&version.swap_bytes()) {
            "it is a big-endian GGUF file; only little-endian files are read (convert it on a little-endian machine)"
                .to_string()
        } else {
            format!("GGUF version {version} is not supported; versions {SUPPORTED_VERSIONS:?} are")
        };
        Err(self.error(why))
    }

    fn metadata(&mut self, n_kv: usize) -> Result<Metadata> {
        let mut meta = Metadata::new(self.source);
        for i in 0..n_kv {
            let what = format!("the key of metadata entry {i}");
            let key = self.c.string_bytes().map_err(self.short(&what))?;
            let key = String::from_utf8(key.to_vec())
                .map_err(|e| self.error(format!("the key of metadata entry {i} is not UTF-8 ({e})")))?;
            let ty = self.c.u32().map_err(self.short(&format!("the value type of metadata key `{key}`")))?;
            let value = read_value(&mut self.c, ty, &ValueAt { source: self.source, key: &key })?;
            if meta.contains(&key) {
                return Err(self.error(format!("metadata key `{key}` appears twice")));
            }
            meta.insert(key, value);
        }
        Ok(meta)
    }

    fn alignment(&self, meta: &Metadata) -> Result<u64> {
        let Some(a) = meta.optional(ALIGNMENT_KEY, Metadata::get_u32)? else { return Ok(DEFAULT_ALIGNMENT) };
        if !a.is_power_of_two() {
            return Err(self.error(format!("`{ALIGNMENT_KEY}` is {a}, not a power of two")));
        }
        Ok(a.into())
    }

    fn tensor_info(&mut self, i: usize) -> Result<TensorInfo> {
        let name = self.c.string_bytes().map_err(self.short(&format!("the name of tensor {i}")))?;
        let name = String::from_utf8(name.to_vec())
            .map_err(|e| self.error(format!("the name of tensor {i} is not UTF-8 ({e})")))?;
        let at = |what: &str| format!("the {what} of tensor `{name}`");
        let n_dims = self.c.u32().map_err(self.short(&at("dimension count")))?;
        if n_dims > MAX_DIMS {
            return Err(self.error(format!("tensor `{name}` has {n_dims} dimensions; GGUF allows at most {MAX_DIMS}")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.c.u64().map_err(self.short(&at("dimensions")))?);
        }
        let id = self.c.u32().map_err(self.short(&at("ggml type")))?;
        let offset = self.c.u64().map_err(self.short(&at("data offset")))?;
        let Some(ggml_type) = GgmlType::from_id(id) else {
            return Err(self.error(format!(
                "tensor `{name}` has ggml type id {id}, which ggml does not define (known: {}); the file may come \
                 from a newer llama.cpp",
                GgmlType::all().map(|t| format!("{t}={}", t.id())).collect::<Vec<_>>().join(", ")
            )));
        };
        let n = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).filter(|&n| n <= i64::MAX as u64);
        let Some(n) = n.filter(|&n| usize::try_from(n).is_ok()) else {
            return Err(self.error(format!("tensor `{name}` has dims {dims:?}, more elements than i64 holds")));
        };
        let ne0 = dims.first().copied().unwrap_or(1);
        if ne0 % ggml_type.block_size() != 0 {
            return Err(self.error(format!(
                "tensor `{name}` of type {ggml_type} has rows of {ne0} elements (dims {dims:?}), not a whole number of \
                 its {}-element blocks",
                ggml_type.block_size()
            )));
        }
        let Some(n_bytes) = ggml_type.bytes_of(n) else {
            return Err(
                self.error(format!("tensor `{name}` of type {ggml_type} has dims {dims:?}, more bytes than u64 holds"))
            );
        };
        Ok(TensorInfo { name, dims, ggml_type, offset, n_bytes })
    }

    fn check_range(&self, t: &TensorInfo, alignment: u64, data_offset: u64, len: u64) -> Result<()> {
        if t.offset % alignment != 0 {
            return Err(self.error(format!(
                "tensor `{}` has data offset {}, not a multiple of the file's alignment {alignment}: the file is corrupt",
                t.name, t.offset
            )));
        }
        let end = data_offset.checked_add(t.offset).and_then(|s| s.checked_add(t.n_bytes));
        if end.is_none_or(|end| end > len) {
            return Err(self.error(format!(
                "tensor `{}` ({} {:?}, {} bytes at data offset {}) ends past the end of the file ({len} bytes, data \
                 section at {data_offset}): the file is truncated; download it again",
                t.name, t.ggml_type, t.dims, t.n_bytes, t.offset
            )));
        }
        Ok(())
    }
}
