//! The 256-element super-blocks of ggml's K-quants (`block_q4_K`, `block_q5_K`, `block_q6_K`,
//! `block_q8_K` in `ggml/src/ggml-common.h`, `QK_K` = 256; decoded as `dequantize_row_q4_K`,
//! `_q5_K`, `_q6_K`, `_q8_K` in `ggml/src/ggml-quants.c` do, same operation order). Each
//! function decodes one super-block: `b` is its bytes, `y` its 256 outputs.

use super::f16_at;

/// Elements per super-block (ggml's `QK_K`).
pub(crate) const QK_K: usize = 256;

/// Scale and min of sub-block `j` (0..8) of the 12 packed bytes `s` of a Q4_K / Q5_K block
/// (ggml's `get_scale_min_k4`): six bits each. Sub-blocks 0–3 keep theirs in the low six bits
/// of `s[j]` (scale) and `s[j + 4]` (min); sub-blocks 4–7 in a nibble of `s[j + 4]` (scale:
/// low, min: high) plus, as bits 4–5, the top two bits of `s[j - 4]` (scale) and `s[j]` (min).
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// `block_q4_K` (144 bytes): f16 `d`, f16 `dmin`, `scales[12]`, `qs[128]`. Eight sub-blocks of
/// 32; in each 64-element chunk `c` (0..4), `qs[32c..32c + 32]` holds sub-block `2c` in its low
/// nibbles and `2c + 1` in its high nibbles. `x = d·sc·q − dmin·m`.
pub(crate) fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * c..32 * c + 32];
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            out[l] = d1 * (q[l] & 0x0f) as f32 - m1;
            out[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

/// `block_q5_K` (176 bytes): f16 `d`, f16 `dmin`, `scales[12]`, `qh[32]`, `qs[128]`. As Q4_K,
/// plus a fifth bit: element `l` (0..32) of sub-block `s` (0..8) takes bit `s` of `qh[l]` as 16.
pub(crate) fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for c in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
        let q = &qs[32 * c..32 * c + 32];
        let out = &mut y[64 * c..64 * c + 64];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            out[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
            out[l + 32] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

/// `block_q6_K` (210 bytes): `ql[128]` (low 4 bits), `qh[64]` (high 2 bits), `scales[16]`
/// (signed), f16 `d`. Two halves of 128; in half `n`, for `l` in 0..32, the elements `l`, `l +
/// 32`, `l + 64`, `l + 96` take the low nibble of `ql[64n + l]`, the low nibble of `ql[64n + l
/// + 32]`, the high nibbles of the same two, and bits 0–1, 2–3, 4–5, 6–7 of `qh[32n + l]`;
/// element `e` of the block has scale `scales[e / 16]`. `x = d·sc·(q − 32)`.
pub(crate) fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for n in 0..2 {
        let ql = &b[64 * n..64 * n + 64];
        let qh = &b[128 + 32 * n..128 + 32 * n + 32];
        let sc = &b[192 + 8 * n..192 + 8 * n + 8];
        let out = &mut y[128 * n..128 * n + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            let s = |k: usize| d * (sc[is + k] as i8) as f32;
            out[l] = s(0) * q1 as f32;
            out[l + 32] = s(2) * q2 as f32;
            out[l + 64] = s(4) * q3 as f32;
            out[l + 96] = s(6) * q4 as f32;
        }
    }
}

/// `block_q8_K` (292 bytes): f32 `d`, `qs[256]` signed, `bsums[16]` (i16 sums of groups of
/// 16, unused here); `x = d * q`.
pub(crate) fn q8_k(b: &[u8], y: &mut [f32]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (out, &q) in y.iter_mut().zip(&b[4..4 + QK_K]) {
        *out = d * (q as i8) as f32;
    }
}
