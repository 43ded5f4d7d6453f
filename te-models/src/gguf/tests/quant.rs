//! Each block format against a decoder written here from the layouts of ggml-common.h, one
//! element at a time (element `e` of a block: where its bits are, which scale it takes), sharing
//! no code with the dequantizers. Blocks are seeded random bytes with finite scales; the values
//! must match bit for bit (same formulas, same float operation order).

use super::{Bytes, Raw};
use crate::gguf::{dequantize_bf16, dequantize_f32, GgmlType, GgufFile, GgufWriter};
use half::{bf16, f16};

fn h(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from(b[i]) | u16::from(b[i + 1]) << 8).to_f32()
}

/// The 4-bit quant of element `e` (0..32) of a 32-element block whose nibbles start at `qs`:
/// elements 0–15 are the low nibbles of bytes 0–15, elements 16–31 their high nibbles.
fn nibble32(b: &[u8], qs: usize, e: usize) -> u32 {
    let byte = u32::from(b[qs + e % 16]);
    if e < 16 {
        byte & 15
    } else {
        byte >> 4
    }
}

/// Bit `e` of the little-endian `u32` at `b[at..at + 4]`.
fn bit32(b: &[u8], at: usize, e: usize) -> u32 {
    u32::from(b[at + e / 8] >> (e % 8)) & 1
}

fn q4_0(b: &[u8], e: usize) -> f32 {
    (nibble32(b, 2, e) as i32 - 8) as f32 * h(b, 0)
}

fn q4_1(b: &[u8], e: usize) -> f32 {
    nibble32(b, 4, e) as f32 * h(b, 0) + h(b, 2)
}

fn q5_0(b: &[u8], e: usize) -> f32 {
    let q = nibble32(b, 6, e) + 16 * bit32(b, 2, e);
    (q as i32 - 16) as f32 * h(b, 0)
}

fn q5_1(b: &[u8], e: usize) -> f32 {
    let q = nibble32(b, 8, e) + 16 * bit32(b, 4, e);
    q as f32 * h(b, 0) + h(b, 2)
}

fn q8_0(b: &[u8], e: usize) -> f32 {
    f32::from(b[2 + e] as i8) * h(b, 0)
}

/// The 6-bit scale and min of sub-block `s` (0..8) from the 12 bytes at `b[4..16]`: bytes 0–3
/// hold scales 0–3 in bits 0–5, bytes 4–7 mins 0–3 in bits 0–5; byte 8 + k holds scale 4 + k
/// (bits 0–3) and min 4 + k (bits 4–7), whose bits 4–5 are the top two bits of bytes k and 4 + k.
fn k_scale_min(b: &[u8], s: usize) -> (u32, u32) {
    let byte = |i: usize| u32::from(b[4 + i]);
    if s < 4 {
        (byte(s) & 0x3f, byte(4 + s) & 0x3f)
    } else {
        let k = s - 4;
        ((byte(8 + k) & 15) | (byte(k) >> 6) << 4, (byte(8 + k) >> 4) | (byte(4 + k) >> 6) << 4)
    }
}

/// The low 4 bits of element `e` (0..256) of a Q4_K / Q5_K super-block whose quants start at
/// `qs`: sub-block `s = e / 32` lies in bytes `32 * (s / 2)..`, low nibbles for even `s`.
fn k_nibble(b: &[u8], qs: usize, e: usize) -> u32 {
    let s = e / 32;
    let byte = u32::from(b[qs + 32 * (s / 2) + e % 32]);
    if s % 2 == 0 {
        byte & 15
    } else {
        byte >> 4
    }
}

fn q4_k(b: &[u8], e: usize) -> f32 {
    let (sc, m) = k_scale_min(b, e / 32);
    h(b, 0) * sc as f32 * k_nibble(b, 16, e) as f32 - h(b, 2) * m as f32
}

fn q5_k(b: &[u8], e: usize) -> f32 {
    let s = e / 32;
    let (sc, m) = k_scale_min(b, s);
    let high = u32::from(b[16 + e % 32] >> s) & 1;
    h(b, 0) * sc as f32 * (k_nibble(b, 48, e) + 16 * high) as f32 - h(b, 2) * m as f32
}

/// Element `e` of a Q6_K super-block: half `e / 128`; within it, quarter `k` (0..4) and lane
/// `l` (0..32); low 4 bits from `ql[64·half + l + 32·(k % 2)]` (low nibble for k < 2), high 2
/// bits from bits `2k..2k + 2` of `qh[32·half + l]`; scale `scales[e / 16]`, signed; `d` at 208.
fn q6_k(b: &[u8], e: usize) -> f32 {
    let (half, k, l) = (e / 128, (e % 128) / 32, e % 32);
    let ql = b[64 * half + l + 32 * (k % 2)];
    let lo = if k < 2 { ql & 15 } else { ql >> 4 };
    let hi = (b[128 + 32 * half + l] >> (2 * k)) & 3;
    let q = i32::from(lo | hi << 4) - 32;
    h(b, 208) * f32::from(b[192 + e / 16] as i8) * q as f32
}

fn q8_k(b: &[u8], e: usize) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * f32::from(b[4 + e] as i8)
}

type Element = fn(&[u8], usize) -> f32;

/// Each quantized type, its per-element decoder, and the byte offsets of its f16 scales.
const FORMATS: [(GgmlType, Element, &[usize]); 9] = [
    (GgmlType::Q4_0, q4_0, &[0]),
    (GgmlType::Q4_1, q4_1, &[0, 2]),
    (GgmlType::Q5_0, q5_0, &[0]),
    (GgmlType::Q5_1, q5_1, &[0, 2]),
    (GgmlType::Q8_0, q8_0, &[0]),
    (GgmlType::Q4_K, q4_k, &[0, 2]),
    (GgmlType::Q5_K, q5_k, &[0, 2]),
    (GgmlType::Q6_K, q6_k, &[208]),
    (GgmlType::Q8_K, q8_k, &[]),
];

/// `n_blocks` seeded random blocks of `ty` with finite scales (f16 scales in ±[1e-3, 0.1], Q8_K's
/// f32 `d` likewise).
fn random_blocks(ty: GgmlType, scales: &[usize], n_blocks: usize, seed: u64) -> Vec<u8> {
    let mut r = Bytes::new(seed);
    let ts = ty.type_size() as usize;
    let mut data = r.fill(n_blocks * ts);
    for block in data.chunks_mut(ts) {
        let sign = if r.next_u64() % 2 == 0 { 1.0 } else { -1.0 };
        for &at in scales {
            let d = f16::from_f32(sign * r.uniform(1e-3, 0.1));
            block[at..at + 2].copy_from_slice(&d.to_le_bytes());
        }
        if ty == GgmlType::Q8_K {
            block[..4].copy_from_slice(&(sign * r.uniform(1e-3, 0.1)).to_le_bytes());
        }
    }
    data
}

fn expected(ty: GgmlType, element: Element, data: &[u8]) -> Vec<f32> {
    let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
    data.chunks(ts).flat_map(|b| (0..bs).map(move |e| element(b, e))).collect()
}

fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {i}: {g} vs {w}");
    }
}

#[test]
fn every_block_format_matches_its_per_element_decoder() {
    for (ty, element, scales) in FORMATS {
        for (n_blocks, seed) in [(1, 1), (7, 2), (3, 3)] {
            let data = random_blocks(ty, scales, n_blocks, seed);
            let want = expected(ty, element, &data);
            let mut got = vec![f32::NAN; want.len()];
            dequantize_f32(ty, &data, &mut got).unwrap();
            same_bits(&got, &want, &format!("{ty} × {n_blocks}"));
            let mut got16 = vec![bf16::NAN; want.len()];
            dequantize_bf16(ty, &data, &mut got16).unwrap();
            assert_eq!(got16, want.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), "{ty} bf16");
        }
    }
}

#[test]
fn large_tensors_decode_in_parallel_to_the_same_values() {
    // 96 rows of 1024: many parallel chunks; through a file, as a model's weights are read.
    let (rows, cols) = (96, 1024);
    let mut w = GgufWriter::new();
    let mut want = Vec::new();
    for (i, (ty, element, scales)) in FORMATS.into_iter().enumerate() {
        let n_blocks = rows * cols / ty.block_size() as usize;
        let data = random_blocks(ty, scales, n_blocks, 100 + i as u64);
        want.push(expected(ty, element, &data));
        w.add_raw_tensor(ty.name(), &[rows, cols], ty, data).unwrap();
    }
    let file = GgufFile::from_bytes(w.to_bytes().unwrap(), "big.gguf").unwrap();
    for ((ty, ..), want) in FORMATS.into_iter().zip(want) {
        let t = file.tensor(ty.name()).unwrap();
        assert_eq!((t.shape(), t.ggml_type()), (vec![rows, cols], ty));
        same_bits(&t.to_f32().unwrap(), &want, ty.name());
        assert_eq!(t.to_bf16().unwrap(), want.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), "{ty}");
    }
}

#[test]
fn plain_types_decode_exactly() {
    let mut r = Bytes::new(7);
    let x: Vec<f32> = (0..40_000).map(|_| r.uniform(-100.0, 100.0)).collect();
    let f32s: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let f16s: Vec<u8> = x.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
    let bf16s: Vec<u8> = x.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
    let mut out = vec![0.0; x.len()];
    dequantize_f32(GgmlType::F32, &f32s, &mut out).unwrap();
    same_bits(&out, &x, "f32");
    dequantize_f32(GgmlType::F16, &f16s, &mut out).unwrap();
    same_bits(&out, &x.iter().map(|&v| f16::from_f32(v).to_f32()).collect::<Vec<_>>(), "f16");
    dequantize_f32(GgmlType::BF16, &bf16s, &mut out).unwrap();
    same_bits(&out, &x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect::<Vec<_>>(), "bf16");
    let mut out16 = vec![bf16::ZERO; x.len()];
    dequantize_bf16(GgmlType::BF16, &bf16s, &mut out16).unwrap();
    assert_eq!(out16.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>(), bf16s);
    // A NaN payload survives a BF16 → bf16 copy bit for bit.
    let nan = [0x81u8, 0xff];
    dequantize_bf16(GgmlType::BF16, &nan, &mut out16[..1]).unwrap();
    assert_eq!(out16[0].to_bits(), 0xff81);
}

#[test]
fn wrong_lengths_and_types_are_argument_errors() {
    let mut out = vec![0.0f32; 256];
    for (ty, bytes) in
        [(GgmlType::Q4_K, 143), (GgmlType::Q4_K, 145), (GgmlType::F32, 1023), (GgmlType::Q8_0, 8 * 34 + 1)]
    {
        let e = dequantize_f32(ty, &vec![0; bytes], &mut out).unwrap_err();
        assert!(matches!(&e, te_runtime::Error::Argument { message, .. } if message.contains(ty.name())), "{e}");
    }
    let e = dequantize_f32(GgmlType::Q4_K, &[0; 144], &mut out[..100]).unwrap_err();
    assert!(e.to_string().contains("multiple of 256"), "{e}");
    let e = dequantize_bf16(GgmlType::IQ4_XS, &[0; 136], &mut [bf16::ZERO; 256]).unwrap_err();
    assert!(e.to_string().contains("iq4_xs") && e.to_string().contains("supported"), "{e}");
    let e = dequantize_bf16(GgmlType::BF16, &[0; 3], &mut [bf16::ZERO; 2]).unwrap_err();
    assert!(e.to_string().contains("bf16"), "{e}");
}

#[test]
fn q6_k_and_q4_k_known_blocks() {
    // Q6_K with every quant 63 (ql 0xff, qh 0xff: 15 | 3 << 4), scales 1..=16, d = 0.5: element
    // e is 0.5 * (e / 16 + 1) * 31.
    let mut b = vec![0xffu8; 192];
    b.extend((1..=16u8).collect::<Vec<_>>());
    b.extend(f16::from_f32(0.5).to_le_bytes());
    let mut y = vec![0.0; 256];
    dequantize_f32(GgmlType::Q6_K, &b, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        assert_eq!(*v, 0.5 * (e / 16 + 1) as f32 * 31.0, "{e}");
    }
    // Q4_K with d = 1, dmin = 0.25, sub-block s scale 8s + 7 and min 63 - 8s (six bits, packed;
    // sub-blocks 4-7 use the top bits), quants = lane % 16: element e is
    // (8s + 7) * ((e % 32) % 16) - 0.25 * (63 - 8s).
    let (sc, mn): (Vec<u8>, Vec<u8>) = (0..8u8).map(|s| (8 * s + 7, 63 - 8 * s)).unzip();
    let mut s12 = [0u8; 12];
    for k in 0..4 {
        s12[k] = sc[k] | (sc[4 + k] >> 4) << 6;
        s12[4 + k] = mn[k] | (mn[4 + k] >> 4) << 6;
        s12[8 + k] = (sc[4 + k] & 15) | (mn[4 + k] & 15) << 4;
    }
    let mut b: Vec<u8> = [f16::from_f32(1.0).to_le_bytes(), f16::from_f32(0.25).to_le_bytes()].concat();
    b.extend(s12);
    for _chunk in 0..4 {
        b.extend((0..32u8).map(|l| (l % 16) | (l % 16) << 4));
    }
    dequantize_f32(GgmlType::Q4_K, &b, &mut y).unwrap();
    for (e, v) in y.iter().enumerate() {
        let s = e / 32;
        assert_eq!(*v, (8 * s + 7) as f32 * ((e % 32) % 16) as f32 - 0.25 * (63 - 8 * s) as f32, "{e}");
    }
}

#[test]
fn raw_builder_q5_0_tensor_of_two_rows() {
    // Through a hand-built file: Q5_0 dims [32, 2] is 2 rows of one block.
    let data = random_blocks(GgmlType::Q5_0, &[0], 2, 11);
    let mut r = Raw::header(3, 1, 0);
    r.tensor("q", &[32, 2], GgmlType::Q5_0.id(), 0).pad(32).raw(&data);
    let file = r.parse().unwrap();
    let t = file.tensor("q").unwrap();
    assert_eq!(t.shape(), [2, 32]);
    same_bits(&t.to_f32().unwrap(), &expected(GgmlType::Q5_0, q5_0, &data), "q5_0 file");
}
