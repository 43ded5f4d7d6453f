//! Tests of the GGUF reader, dequantizers and writer: round trips through [`super::GgufWriter`]
//! and files written byte by byte ([`Raw`], independent of the writer) in `container`; the error
//! paths in `errors`; each block format against a per-element decoder written from the spec in
//! `quant`; a file written by llama.cpp's own Python package (gguf-py) in `fixture`; the parser
//! under mutated files in `fuzz`.

mod container;
mod errors;
mod fixture;
mod fuzz;
mod quant;

use super::GgufFile;
use te_runtime::Error;

/// A GGUF file written field by field, as the spec lays it out (no use of the writer).
#[derive(Clone, Debug, Default)]
pub(super) struct Raw {
    pub bytes: Vec<u8>,
}

impl Raw {
    /// Magic, `version`, tensor and metadata counts.
    pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Self {
        let mut r = Raw { bytes: b"GGUF".to_vec() };
        r.u32(version).u64(n_tensors).u64(n_kv);
        r
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.bytes.extend(v.to_le_bytes());
        self
    }

    pub fn string(&mut self, s: &str) -> &mut Self {
        self.u64(s.len() as u64);
        self.bytes.extend(s.as_bytes());
        self
    }

    /// A metadata entry holding a `u32` (value type 4).
    pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.string(key).u32(4).u32(v)
    }

    /// A metadata entry holding a string (value type 8).
    pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.string(key).u32(8).string(v)
    }

    /// A tensor info: name, dims (ggml order), ggml type id, data offset.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
        self.string(name).u32(dims.len() as u32);
        for &d in dims {
            self.u64(d);
        }
        self.u32(ty).u64(offset)
    }

    /// Zero bytes up to a multiple of `align`.
    pub fn pad(&mut self, align: usize) -> &mut Self {
        self.bytes.resize(self.bytes.len().next_multiple_of(align), 0);
        self
    }

    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.bytes.extend(b);
        self
    }

    pub fn parse(&self) -> te_runtime::Result<GgufFile> {
        GgufFile::from_bytes(self.bytes.clone(), "raw.gguf")
    }
}

/// The message of a checkpoint error, which must name `source`.
pub(super) fn checkpoint_message(e: Error, source: &str) -> String {
    match e {
        Error::Checkpoint { message } => {
            assert!(message.contains(source), "`{message}` does not name {source}");
            message
        }
        other => panic!("expected a checkpoint error, got {other}"),
    }
}

/// A seeded stream of bytes (SplitMix64), so the tests need no RNG crate.
pub(super) struct Bytes(u64);

impl Bytes {
    pub fn new(seed: u64) -> Self {
        Bytes(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn fill(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }

    /// A uniform value in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
    }
}
