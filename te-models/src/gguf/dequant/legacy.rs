//! The 32-element blocks of ggml's first quantization formats (`block_q4_0`, `block_q4_1`,
//! `block_q5_0`, `block_q5_1`, `block_q8_0` in `ggml/src/ggml-common.h`; decoded as
//! `dequantize_row_q*_0/1` in `ggml/src/ggml-quants.c` do). Each function decodes one block: `b`
//! is its bytes (the type's `type_size`), `y` its 32 outputs.
//!
//! The 4- and 5-bit formats pack two elements per byte: byte `j` (0..16) holds element `j` in
//! its low nibble and element `j + 16` in its high nibble. The 5-bit formats keep the fifth
//! bits in a little-endian `u32` `qh`: bit `j` is element `j`'s.

use super::f16_at;

/// Elements per block of these formats (ggml's `QK4_0` = `QK4_1` = `QK5_0` = `QK5_1` = `QK8_0`).
pub(crate) const QK: usize = 32;

/// `block_q4_0` (18 bytes): f16 `d`, `qs[16]`; `x = d * (q - 8)` with `q` the 4-bit quant.
pub(crate) fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..2 + QK / 2];
    for (j, &q) in qs.iter().enumerate() {
        y[j] = ((q & 0x0f) as i32 - 8) as f32 * d;
        y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

/// `block_q4_1` (20 bytes): f16 `d`, f16 `m`, `qs[16]`; `x = d * q + m`.
pub(crate) fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..4 + QK / 2];
    for (j, &q) in qs.iter().enumerate() {
        y[j] = (q & 0x0f) as f32 * d + m;
        y[j + QK / 2] = (q >> 4) as f32 * d + m;
    }
}

/// The 32 fifth bits of a 5-bit block: `qh` at `b[at..at + 4]`, little-endian.
fn high_bits(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// The 5-bit quants of byte `j` of `qs` and fifth bits `qh`: elements `j` and `j + 16`.
fn five_bit(q: u8, qh: u32, j: usize) -> (u8, u8) {
    let lo = (q & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
    let hi = (q >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
    (lo, hi)
}

/// `block_q5_0` (22 bytes): f16 `d`, `qh[4]`, `qs[16]`; `x = d * (q - 16)` with `q` 5-bit.
pub(crate) fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = high_bits(b, 2);
    let qs = &b[6..6 + QK / 2];
    for (j, &q) in qs.iter().enumerate() {
        let (lo, hi) = five_bit(q, qh, j);
        y[j] = (lo as i32 - 16) as f32 * d;
        y[j + QK / 2] = (hi as i32 - 16) as f32 * d;
    }
}

/// `block_q5_1` (24 bytes): f16 `d`, f16 `m`, `qh[4]`, `qs[16]`; `x = d * q + m`.
pub(crate) fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = high_bits(b, 4);
    let qs = &b[8..8 + QK / 2];
    for (j, &q) in qs.iter().enumerate() {
        let (lo, hi) = five_bit(q, qh, j);
        y[j] = lo as f32 * d + m;
        y[j + QK / 2] = hi as f32 * d + m;
    }
}

/// `block_q8_0` (34 bytes): f16 `d`, `qs[32]` signed; `x = d * q`.
pub(crate) fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (out, &q) in y.iter_mut().zip(&b[2..2 + QK]) {
        *out = (q as i8) as f32 * d;
    }
}

/// Quantizes 32 values into a `block_q8_0` as ggml's reference quantizer does
/// (`quantize_row_q8_0_ref`): `d = amax / 127` stored as f16, `q = round(x / d)` (half away
/// from zero), all zeros when `amax` is 0. `x` has 32 values, `b` 34 bytes.
pub(crate) fn quantize_q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    b[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    for (q, v) in b[2..2 + QK].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}
