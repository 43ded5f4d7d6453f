//! [`GgufWriter`]: builds a GGUF file (version 3 or 2) of metadata and F32 / F16 / BF16 / Q8_0
//! tensors (or raw bytes of any ggml type), laid out as ggml's `gguf_write_to_file` lays it
//! out: header, metadata, tensor infos, padding to the alignment, then each tensor's data padded
//! to the alignment, offsets in insertion order.

use super::dequant::legacy;
use super::file::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, SUPPORTED_VERSIONS};
use super::value::{write_string, write_value, MetadataValue};
use super::GgmlType;
use half::{bf16, f16};
use std::collections::HashSet;
use std::path::Path;
use te_runtime::{Error, Result};

/// One tensor to write: name, dims in ggml order, type, bytes.
#[derive(Clone, Debug)]
struct Pending {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory: metadata pairs and tensors, in the order added.
///
/// ```
/// # fn main() -> te_runtime::Result<()> {
/// use te_models::gguf::{GgmlType, GgufFile, GgufWriter};
/// let mut w = GgufWriter::new();
/// w.add_metadata("general.architecture", "gemma3")?;
/// w.add_tensor("w", &[2, 32], GgmlType::Q8_0, &[0.5; 64])?; // 2 rows of 32
/// let file = GgufFile::from_bytes(w.to_bytes()?, "w.gguf")?;
/// assert_eq!(file.tensor("w")?.shape(), [2, 32]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetadataValue)>,
    keys: HashSet<String>,
    tensors: Vec<Pending>,
    names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn refuse(message: String) -> Error {
    Error::Checkpoint { message: format!("GGUF writer: {message}") }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        Self {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Writes GGUF version `version` (2 or 3; they differ only in what readers accept).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for another version.
    pub fn set_version(&mut self, version: u32) -> Result<()> {
        if !SUPPORTED_VERSIONS.contains(&version) {
            return Err(refuse(format!("version {version}; versions {SUPPORTED_VERSIONS:?} are written")));
        }
        self.version = version;
        Ok(())
    }

    /// Aligns the data section and every tensor to `alignment` bytes, recorded as
    /// `general.alignment` (a `u32`) when it is not the default 32.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when `alignment` is not a power of two.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<()> {
        if !alignment.is_power_of_two() {
            return Err(refuse(format!("alignment {alignment} is not a power of two")));
        }
        self.alignment = alignment.into();
        Ok(())
    }

    /// Adds a metadata pair (any [`MetadataValue`]: `18u32`, `1e6f32`, `"gemma3"`,
    /// `vec!["<pad>".to_string()]`, `vec![0.0f32]`, `vec![1i32]`, ...).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for a key added before, or `general.alignment` (set it with
    /// [`GgufWriter::set_alignment`]).
    pub fn add_metadata(&mut self, key: impl Into<String>, value: impl Into<MetadataValue>) -> Result<()> {
        let key = key.into();
        if key == ALIGNMENT_KEY {
            return Err(refuse(format!("`{ALIGNMENT_KEY}` is written from set_alignment")));
        }
        if !self.keys.insert(key.clone()) {
            return Err(refuse(format!("metadata key `{key}` added twice")));
        }
        self.metadata.push((key, value.into()));
        Ok(())
    }

    /// Adds a tensor of row-major `shape` (written as ggml dims, reversed: `[rows, cols]`
    /// becomes `[cols, rows]`) from f32 `values`, stored as `ty`: F32, F16 or BF16 (rounded to
    /// nearest-even), or Q8_0 (quantized as ggml's `quantize_row_q8_0_ref`: per 32 values,
    /// `d = amax / 127`, `q = round(x / d)`).
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for another `ty`, `values` not of `shape`'s element count, a last
    /// dimension that is not a whole number of blocks (32 for Q8_0), more than 4 dims, or a
    /// name added before.
    pub fn add_tensor(&mut self, name: impl Into<String>, shape: &[usize], ty: GgmlType, values: &[f32]) -> Result<()> {
        let name = name.into();
        let n: usize = shape.iter().product();
        if values.len() != n {
            return Err(refuse(format!(
                "tensor `{name}`: shape {shape:?} has {n} elements, {} values given",
                values.len()
            )));
        }
        let data = match ty {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => values.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect(),
            GgmlType::BF16 => values.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect(),
            GgmlType::Q8_0 => {
                let cols = shape.last().copied().unwrap_or(1);
                if cols % legacy::QK != 0 {
                    return Err(refuse(format!(
                        "tensor `{name}`: Q8_0 rows of {cols} are not whole 32-element blocks"
                    )));
                }
                let mut data = vec![0u8; n / legacy::QK * 34];
                for (x, b) in values.chunks_exact(legacy::QK).zip(data.chunks_exact_mut(34)) {
                    legacy::quantize_q8_0(x, b);
                }
                data
            }
            other => {
                return Err(refuse(format!(
                    "tensor `{name}`: type {other} is not written from f32 (F32, F16, BF16, Q8_0 are)"
                )))
            }
        };
        self.add_raw_tensor(name, shape, ty, data)
    }

    /// Adds a tensor of row-major `shape` whose `data` is already in ggml's layout for `ty`
    /// (whole blocks, little-endian): any ggml type, e.g. hand-built Q4_K blocks.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] for `data` that is not the bytes of `shape` in `ty`, a last dimension
    /// that is not a whole number of blocks, more than 4 dims, or a name added before.
    pub fn add_raw_tensor(
        &mut self,
        name: impl Into<String>,
        shape: &[usize],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<()> {
        let name = name.into();
        if shape.len() > MAX_DIMS as usize {
            return Err(refuse(format!("tensor `{name}` has {} dims; GGUF allows {MAX_DIMS}", shape.len())));
        }
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        let ne0 = dims.first().copied().unwrap_or(1);
        let n = dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d));
        let want = n.and_then(|n| ty.bytes_of(n)).filter(|_| ne0 % ty.block_size() == 0);
        if want != Some(data.len() as u64) {
            return Err(refuse(format!(
                "tensor `{name}`: shape {shape:?} of {ty} (rows of whole {}-element blocks) does not match {} bytes",
                ty.block_size(),
                data.len()
            )));
        }
        if !self.names.insert(name.clone()) {
            return Err(refuse(format!("tensor `{name}` added twice")));
        }
        self.tensors.push(Pending { name, dims, ty, data });
        Ok(())
    }

    /// The file's bytes.
    ///
    /// # Errors
    /// None today (the `Result` keeps room for checks of the whole file).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let align = self.alignment as usize;
        let pad = |out: &mut Vec<u8>| out.resize(out.len().next_multiple_of(align), 0);
        let mut out = Vec::new();
        out.extend(MAGIC);
        out.extend(self.version.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        let explicit = self.alignment != DEFAULT_ALIGNMENT;
        out.extend((self.metadata.len() as u64 + u64::from(explicit)).to_le_bytes());
        if explicit {
            write_string(&mut out, ALIGNMENT_KEY);
            write_value(&mut out, &MetadataValue::U32(self.alignment as u32));
        }
        for (k, v) in &self.metadata {
            write_string(&mut out, k);
            write_value(&mut out, v);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            write_string(&mut out, &t.name);
            out.extend((t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(t.ty.id().to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset = (offset + t.data.len()).next_multiple_of(align);
        }
        pad(&mut out);
        for t in &self.tensors {
            out.extend(&t.data);
            pad(&mut out);
        }
        Ok(out)
    }

    /// Writes the file to `path`.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming `path` when it cannot be written.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_bytes()?)
            .map_err(|e| Error::Checkpoint { message: format!("{}: cannot write the GGUF file: {e}", path.display()) })
    }
}
