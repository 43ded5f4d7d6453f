//! Dequantization of ggml tensor data to f32 or bf16: the plain types (F32, F16, BF16), the
//! legacy 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: [`legacy`]) and the 256-element
//! K-quants (Q4_K, Q5_K, Q6_K, Q8_K: [`kquants`]), following ggml's block layouts and
//! operation order (`ggml/src/ggml-quants.c`). Large tensors decode in parallel (rayon, chunks of
//! whole blocks); the values do not depend on the split.
//!
//! bf16 outputs are the f32 values rounded to nearest-even (`half::bf16::from_f32`), block by
//! block, with no f32 copy of the whole tensor; a BF16 tensor's bits are copied as they are.

pub(crate) mod kquants;
pub(crate) mod legacy;

use super::GgmlType;
use half::{bf16, f16};
use rayon::prelude::*;
use te_runtime::{Error, Result};

/// The f32 of the little-endian f16 at `b[i..i + 2]` (ggml's `GGML_FP16_TO_FP32`).
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Elements one parallel task decodes (a multiple of every block size).
const CHUNK: usize = 1 << 14;

/// Decodes one block of a quantized type: its bytes, its `block_size` outputs.
type BlockFn = fn(&[u8], &mut [f32]);

/// The block decoder of a quantized type ([`GgmlType::can_dequantize`] minus the plain types).
fn block_fn(ty: GgmlType) -> Option<BlockFn> {
    Some(match ty {
        GgmlType::Q4_0 => legacy::q4_0,
        GgmlType::Q4_1 => legacy::q4_1,
        GgmlType::Q5_0 => legacy::q5_0,
        GgmlType::Q5_1 => legacy::q5_1,
        GgmlType::Q8_0 => legacy::q8_0,
        GgmlType::Q4_K => kquants::q4_k,
        GgmlType::Q5_K => kquants::q5_k,
        GgmlType::Q6_K => kquants::q6_k,
        GgmlType::Q8_K => kquants::q8_k,
        _ => return None,
    })
}

/// The one-element decoder of a plain type.
fn element_fn(ty: GgmlType) -> Option<fn(&[u8]) -> f32> {
    Some(match ty {
        GgmlType::F32 => |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b| f16_at(b, 0),
        GgmlType::BF16 => |b| bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => return None,
    })
}

/// Checks that `data` holds exactly `n` elements of `ty`, and that `ty` decodes.
fn check(ty: GgmlType, data: &[u8], n: usize) -> Result<()> {
    if !ty.can_dequantize() {
        return Err(Error::Argument {
            op: "gguf::dequantize",
            message: format!(
                "ggml type {ty} does not dequantize here; supported: {}",
                super::ggml_type::DEQUANTIZABLE.map(GgmlType::name).join(", ")
            ),
        });
    }
    let want = ty.bytes_of(n as u64);
    if want != Some(data.len() as u64) {
        let want = want.map_or_else(|| format!("a multiple of {} elements", ty.block_size()), |b| format!("{b} bytes"));
        return Err(Error::Argument {
            op: "gguf::dequantize",
            message: format!("{n} elements of {ty} need {want}, the data has {} bytes", data.len()),
        });
    }
    Ok(())
}

/// Decodes `data` (whole blocks of `ty`) into `out`, each value through `conv`.
fn run<T: Send + Copy>(ty: GgmlType, data: &[u8], out: &mut [T], conv: impl Fn(f32) -> T + Sync) -> Result<()> {
    check(ty, data, out.len())?;
    let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
    let chunk_bytes = CHUNK / bs * ts;
    if let Some(f) = element_fn(ty) {
        out.par_chunks_mut(CHUNK).zip(data.par_chunks(chunk_bytes)).for_each(|(out, data)| {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(ts)) {
                *o = conv(f(b));
            }
        });
    } else if let Some(f) = block_fn(ty) {
        out.par_chunks_mut(CHUNK).zip(data.par_chunks(chunk_bytes)).for_each(|(out, data)| {
            let mut tmp = [0.0f32; kquants::QK_K];
            for (o, b) in out.chunks_exact_mut(bs).zip(data.chunks_exact(ts)) {
                f(b, &mut tmp[..bs]);
                for (o, &v) in o.iter_mut().zip(&tmp[..bs]) {
                    *o = conv(v);
                }
            }
        });
    }
    Ok(())
}

/// Decodes `data`, `out.len()` elements of ggml type `ty` stored as ggml stores them (whole
/// blocks, little-endian), into f32 `out`. Values are bit-identical to ggml's
/// `dequantize_row_*` (same formulas, same operation order).
///
/// # Errors
/// [`Error::Argument`] when `ty` does not dequantize here (see [`GgmlType::can_dequantize`]), or
/// when `data` is not exactly the bytes of `out.len()` elements (`out.len()` must be a whole
/// number of blocks: 32 elements for Q4_0..Q8_0, 256 for the K-quants).
pub fn dequantize_f32(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    run(ty, data, out, |v| v)
}

/// As [`dequantize_f32`], into bf16: each f32 value rounded to nearest-even; a BF16 tensor's
/// bits are copied exactly.
///
/// # Errors
/// As [`dequantize_f32`].
pub fn dequantize_bf16(ty: GgmlType, data: &[u8], out: &mut [bf16]) -> Result<()> {
    if ty == GgmlType::BF16 {
        check(ty, data, out.len())?;
        for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
            *o = bf16::from_le_bytes([b[0], b[1]]);
        }
        return Ok(());
    }
    run(ty, data, out, bf16::from_f32)
}
