//! GGUF files (llama.cpp's model format): the container reader ([`GgufFile`]: header, typed
//! [`Metadata`], the tensor table), dequantization of ggml's tensor types to f32 and bf16
//! ([`GgufTensor::to_f32`], [`GgufTensor::to_bf16`], [`dequantize_f32`]), and a small
//! [`GgufWriter`] (F32, F16, BF16, Q8_0 or raw tensors and metadata) for tests and export.
//!
//! Sources of the format rules: the GGUF spec (`docs/gguf.md` in ggml) and ggml's own reader
//! (`ggml/src/gguf.cpp`) for the container; `ggml/src/ggml-common.h` (the `block_*` structs) and
//! `ggml/src/ggml-quants.c` (`dequantize_row_*`) for the block layouts. Each module cites what it
//! follows.
//!
//! - **Files.** Versions 2 and 3, little-endian. [`GgufFile::open`] memory-maps the file: only
//!   the header, metadata and tensor table are parsed up front (and checked against the file's
//!   length), tensor bytes are read when decoded. Bad input is a typed
//!   [`te_runtime::Error::Checkpoint`] naming the file and what is wrong, never a panic, and no
//!   allocation is sized by an unchecked count.
//! - **Shapes.** GGUF dims are ggml's, fastest-varying first: dims `[ne0, ne1]` are `ne1` rows of
//!   `ne0` columns, row-major shape `[ne1, ne0]` ([`TensorInfo::shape`]).
//! - **Types.** Every ggml type is known ([`GgmlType`]) so any file lists and bounds-checks;
//!   F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K and Q8_K decode (the types of
//!   the common `Q4_K_M`, `Q5_K_M`, `Q6_K`, `Q8_0` files); the others (Q2_K, Q3_K, the IQ and
//!   TQ families, the FP4 formats, Q1_0) are refused with an error naming the tensor and its type.
//!
//! ```no_run
//! # fn main() -> te_runtime::Result<()> {
//! use te_models::gguf::GgufFile;
//! let file = GgufFile::open("gemma-3-270m-it-Q4_K_M.gguf")?;
//! let meta = file.metadata();
//! let heads = meta.get_u32(&meta.arch_key("attention.head_count")?)?;
//! for t in file.tensors() {
//!     println!("{} {:?} {}", t.name(), t.shape(), t.ggml_type());
//! }
//! let q: Vec<f32> = file.tensor("blk.0.attn_q.weight")?.to_f32()?; // [heads * 256, 640]
//! # let _ = (heads, q); Ok(()) }
//! ```

mod cursor;
mod dequant;
mod file;
mod ggml_type;
mod metadata;
mod tensor;
mod value;
mod writer;

#[cfg(test)]
mod tests;

pub use dequant::{dequantize_bf16, dequantize_f32};
pub use file::{GgufFile, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS, SUPPORTED_VERSIONS};
pub use ggml_type::{GgmlType, ALL as ALL_TYPES, DEQUANTIZABLE};
pub use metadata::Metadata;
pub use tensor::{GgufTensor, TensorInfo};
pub use value::{MetadataArray, MetadataValue};
pub use writer::GgufWriter;
