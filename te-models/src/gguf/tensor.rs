//! [`TensorInfo`] (one entry of a GGUF file's tensor table) and [`GgufTensor`] (a tensor's bytes
//! in the file, decoded on demand).
//!
//! Shapes: GGUF lists a tensor's dimensions in ggml order, fastest-varying first (`ne0`, `ne1`,
//! ...; [`TensorInfo::dims`]). A 2-D tensor with dims `[ne0, ne1]` is, in Rust's row-major
//! terms, `ne1` rows of `ne0` contiguous columns: [`TensorInfo::shape`] is the dims reversed,
//! `[ne1, ne0]`. A linear layer's weight `blk.0.ffn_up.weight` with dims `[640, 2048]` is the
//! `[2048, 640]` (out × in) matrix PyTorch's `nn.Linear` holds; quantized blocks run along a row.

use super::{dequant, GgmlType};
use half::bf16;
use te_runtime::{Error, Result};

/// One entry of the tensor table: name, dims, ggml type and where its data lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub(crate) name: String,
    pub(crate) dims: Vec<u64>,
    pub(crate) ggml_type: GgmlType,
    pub(crate) offset: u64,
    pub(crate) n_bytes: u64,
}

impl TensorInfo {
    /// The tensor's name (`token_embd.weight`, `blk.0.attn_q.weight`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Dimensions in ggml order, fastest-varying first (`[ne0, ne1, ...]`, 1 to 4 of them).
    pub fn dims(&self) -> &[u64] {
        &self.dims
    }

    /// The row-major shape: [`TensorInfo::dims`] reversed (`[ne1, ne0]` for a matrix of `ne1`
    /// rows of `ne0` elements).
    pub fn shape(&self) -> Vec<usize> {
        // Every dim is at most the element count, which the parser checked fits in usize.
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    /// Elements (the product of the dims).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.ggml_type
    }

    /// Byte offset of the data from the start of the file's data section (a multiple of the
    /// file's alignment).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes of data: `n_elements / block_size * type_size`.
    pub fn n_bytes(&self) -> u64 {
        self.n_bytes
    }
}

/// A tensor of an open [`super::GgufFile`]: its table entry and its bytes in the file (borrowed,
/// not copied; decoded by [`GgufTensor::to_f32`] / [`GgufTensor::to_bf16`]).
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    pub(crate) info: &'a TensorInfo,
    pub(crate) data: &'a [u8],
    pub(crate) source: &'a str,
}

impl<'a> GgufTensor<'a> {
    /// The table entry.
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }

    /// The name.
    pub fn name(&self) -> &'a str {
        &self.info.name
    }

    /// The row-major shape (see [`TensorInfo::shape`]).
    pub fn shape(&self) -> Vec<usize> {
        self.info.shape()
    }

    /// The element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.info.ggml_type
    }

    /// The raw bytes as the file stores them (whole blocks of [`GgufTensor::ggml_type`],
    /// little-endian), e.g. to upload quantized weights as they are.
    pub fn data(&self) -> &'a [u8] {
        self.data
    }

    fn elements(&self) -> usize {
        // The parser checked that the element count fits in usize.
        self.info.n_elements() as usize
    }

    fn unsupported(&self, e: Error) -> Error {
        Error::Checkpoint { message: format!("{}: tensor `{}`: {e}", self.source, self.info.name) }
    }

    /// The values as f32, row-major in [`GgufTensor::shape`]. Decoding follows ggml's
    /// `dequantize_row_*` (see [`super::dequantize_f32`]); large tensors decode in parallel.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] naming the file, the tensor and its type when the type does not
    /// dequantize here ([`GgmlType::can_dequantize`]: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
    /// Q8_0, Q4_K, Q5_K, Q6_K, Q8_K).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.supported()?;
        let mut out = vec![0.0f32; self.elements()];
        dequant::dequantize_f32(self.info.ggml_type, self.data, &mut out).map_err(|e| self.unsupported(e))?;
        Ok(out)
    }

    /// The values as bf16 (each f32 value of [`GgufTensor::to_f32`] rounded to nearest-even,
    /// decoded block by block without an f32 copy of the tensor; BF16 data copied exactly).
    ///
    /// # Errors
    /// As [`GgufTensor::to_f32`].
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        self.supported()?;
        let mut out = vec![bf16::ZERO; self.elements()];
        dequant::dequantize_bf16(self.info.ggml_type, self.data, &mut out).map_err(|e| self.unsupported(e))?;
        Ok(out)
    }

    /// Refuses a type that does not decode before allocating its output.
    fn supported(&self) -> Result<()> {
        let ty = self.info.ggml_type;
        if ty.can_dequantize() {
            return Ok(());
        }
        Err(Error::Checkpoint {
            message: format!(
                "{}: tensor `{}` is ggml type {ty} (id {}), which this library does not dequantize yet; \
                 supported: {} (re-quantize the model with one of them, e.g. Q4_K_M)",
                self.source,
                self.info.name,
                ty.id(),
                super::ggml_type::DEQUANTIZABLE.map(GgmlType::name).join(", ")
            ),
        })
    }
}
