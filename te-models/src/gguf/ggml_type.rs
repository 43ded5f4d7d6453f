//! [`GgmlType`]: the element types of ggml tensors, with the block geometry that sizes their data.
//!
//! Ids, block sizes and block byte sizes are ggml's (`enum ggml_type` in `ggml/include/ggml.h`,
//! `type_traits` in `ggml/src/ggml.c`, the `block_*` structs of `ggml/src/ggml-common.h`). A
//! tensor's data is `n_elements / block_size` blocks of `type_size` bytes, and a row (the first
//! GGUF dimension, `ne0`) holds a whole number of blocks.

use std::fmt;

/// The element type of a ggml tensor (GGUF's tensor info `type`, a `u32` on disk).
///
/// Every type ggml defines is known here, so any file's tensors can be listed and sized; which
/// of them dequantize is [`GgmlType::can_dequantize`]. The names are ggml's (`Q4_K` is ggml's
/// `GGML_TYPE_Q4_K`, [`GgmlType::name`] prints its `ggml_type_name`, `q4_K`).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    /// IEEE binary32, one element per block (id 0).
    F32,
    /// IEEE binary16 (id 1).
    F16,
    /// 32 elements: f16 scale `d`, 16 bytes of 4-bit quants; `x = d * (q - 8)` (id 2).
    Q4_0,
    /// 32 elements: f16 `d`, f16 min `m`, 16 bytes of 4-bit quants; `x = d * q + m` (id 3).
    Q4_1,
    /// 32 elements: f16 `d`, 4 bytes of fifth bits, 16 bytes of low nibbles; `x = d * (q - 16)` (id 6).
    Q5_0,
    /// 32 elements: f16 `d`, f16 `m`, fifth bits, low nibbles; `x = d * q + m` (id 7).
    Q5_1,
    /// 32 elements: f16 `d`, 32 signed bytes; `x = d * q` (id 8).
    Q8_0,
    /// 32 elements: f16 `d`, f16 sum, 32 signed bytes (an intermediate of ggml's dot products, id 9).
    Q8_1,
    /// 256-element super-block of 2-bit quants (id 10).
    Q2_K,
    /// 256-element super-block of 3-bit quants (id 11).
    Q3_K,
    /// 256 elements in 8 sub-blocks of 32 with 6-bit scales and mins; `x = d·sc·q − dmin·m` (id 12).
    Q4_K,
    /// As [`GgmlType::Q4_K`] with a fifth bit per quant (id 13).
    Q5_K,
    /// 256 elements in 16 sub-blocks of 16, 6-bit quants, 8-bit scales; `x = d·sc·(q − 32)` (id 14).
    Q6_K,
    /// 256 elements: f32 `d`, 256 signed bytes, 16 i16 group sums; `x = d * q` (id 15).
    Q8_K,
    /// Importance-matrix 2-bit quants (id 16).
    IQ2_XXS,
    /// Importance-matrix 2-bit quants (id 17).
    IQ2_XS,
    /// Importance-matrix 3-bit quants (id 18).
    IQ3_XXS,
    /// Importance-matrix 1-bit quants (id 19).
    IQ1_S,
    /// Non-linear 4-bit quants, 32 per block (id 20).
    IQ4_NL,
    /// Importance-matrix 3-bit quants (id 21).
    IQ3_S,
    /// Importance-matrix 2-bit quants (id 22).
    IQ2_S,
    /// Non-linear 4-bit quants, 256 per block (id 23).
    IQ4_XS,
    /// Signed 8-bit integer (id 24).
    I8,
    /// Signed 16-bit integer (id 25).
    I16,
    /// Signed 32-bit integer (id 26).
    I32,
    /// Signed 64-bit integer (id 27).
    I64,
    /// IEEE binary64 (id 28).
    F64,
    /// Importance-matrix 1-bit quants (id 29).
    IQ1_M,
    /// bfloat16 (id 30).
    BF16,
    /// Ternary quants, 1.69 bits per weight (id 34).
    TQ1_0,
    /// Ternary quants, 2.06 bits per weight (id 35).
    TQ2_0,
    /// Microscaling FP4: 32 E2M1 elements under one E8M0 scale (id 39).
    MXFP4,
    /// NVIDIA FP4: 64 E2M1 elements with FP8 sub-block scales (id 40; sizes from gguf-py's
    /// `GGML_QUANT_SIZES`, newer than the ggml sources cited above).
    NVFP4,
    /// 1-bit quants, 128 per block (id 41; sizes from gguf-py's `GGML_QUANT_SIZES`).
    Q1_0,
}

/// Every type ggml defines, in id order.
pub const ALL: [GgmlType; 34] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ3_XXS,
    GgmlType::IQ1_S,
    GgmlType::IQ4_NL,
    GgmlType::IQ3_S,
    GgmlType::IQ2_S,
    GgmlType::IQ4_XS,
    GgmlType::I8,
    GgmlType::I16,
    GgmlType::I32,
    GgmlType::I64,
    GgmlType::F64,
    GgmlType::IQ1_M,
    GgmlType::BF16,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::MXFP4,
    GgmlType::NVFP4,
    GgmlType::Q1_0,
];

/// The types [`GgmlType::can_dequantize`] accepts, in id order.
pub const DEQUANTIZABLE: [GgmlType; 12] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q8_K,
    GgmlType::BF16,
];

impl GgmlType {
    /// Every type ggml defines, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        ALL.into_iter()
    }

    /// The type of ggml id `id` (the `u32` of a GGUF tensor info); `None` for an id ggml does
    /// not define (4 and 5 were removed Q4_2/Q4_3, 31–33 and 36–38 repacked layouts that GGUF
    /// files never hold).
    pub fn from_id(id: u32) -> Option<GgmlType> {
        ALL.into_iter().find(|t| t.id() == id)
    }

    /// ggml's (id, `ggml_type_name`, elements per block, bytes per block). Block byte sizes are
    /// the `sizeof` of ggml-common.h's structs (`block_q4_K`: 2 + 2 + 12 + 128 = 144, ...).
    fn props(self) -> (u32, &'static str, u64, u64) {
        match self {
            GgmlType::F32 => (0, "f32", 1, 4),
            GgmlType::F16 => (1, "f16", 1, 2),
            GgmlType::Q4_0 => (2, "q4_0", 32, 18),
            GgmlType::Q4_1 => (3, "q4_1", 32, 20),
            GgmlType::Q5_0 => (6, "q5_0", 32, 22),
            GgmlType::Q5_1 => (7, "q5_1", 32, 24),
            GgmlType::Q8_0 => (8, "q8_0", 32, 34),
            GgmlType::Q8_1 => (9, "q8_1", 32, 36),
            GgmlType::Q2_K => (10, "q2_K", 256, 84),
            GgmlType::Q3_K => (11, "q3_K", 256, 110),
            GgmlType::Q4_K => (12, "q4_K", 256, 144),
            GgmlType::Q5_K => (13, "q5_K", 256, 176),
            GgmlType::Q6_K => (14, "q6_K", 256, 210),
            GgmlType::Q8_K => (15, "q8_K", 256, 292),
            GgmlType::IQ2_XXS => (16, "iq2_xxs", 256, 66),
            GgmlType::IQ2_XS => (17, "iq2_xs", 256, 74),
            GgmlType::IQ3_XXS => (18, "iq3_xxs", 256, 98),
            GgmlType::IQ1_S => (19, "iq1_s", 256, 50),
            GgmlType::IQ4_NL => (20, "iq4_nl", 32, 18),
            GgmlType::IQ3_S => (21, "iq3_s", 256, 110),
            GgmlType::IQ2_S => (22, "iq2_s", 256, 82),
            GgmlType::IQ4_XS => (23, "iq4_xs", 256, 136),
            GgmlType::I8 => (24, "i8", 1, 1),
            GgmlType::I16 => (25, "i16", 1, 2),
            GgmlType::I32 => (26, "i32", 1, 4),
            GgmlType::I64 => (27, "i64", 1, 8),
            GgmlType::F64 => (28, "f64", 1, 8),
            GgmlType::IQ1_M => (29, "iq1_m", 256, 56),
            GgmlType::BF16 => (30, "bf16", 1, 2),
            GgmlType::TQ1_0 => (34, "tq1_0", 256, 54),
            GgmlType::TQ2_0 => (35, "tq2_0", 256, 66),
            GgmlType::MXFP4 => (39, "mxfp4", 32, 17),
            GgmlType::NVFP4 => (40, "nvfp4", 64, 36),
            GgmlType::Q1_0 => (41, "q1_0", 128, 18),
        }
    }

    /// ggml's id of this type.
    pub fn id(self) -> u32 {
        self.props().0
    }

    /// ggml's name (`ggml_type_name`): `f32`, `q4_K`, `iq2_xxs`, ...
    pub fn name(self) -> &'static str {
        self.props().1
    }

    /// Elements per block: 1 for the plain types, 32 for the legacy quants, 256 (`QK_K`) for the
    /// K-quants.
    pub fn block_size(self) -> u64 {
        self.props().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.props().3
    }

    /// Bytes of `n_elements` elements; `None` when `n_elements` is not a whole number of
    /// blocks or the size overflows `u64`.
    pub fn bytes_of(self, n_elements: u64) -> Option<u64> {
        if n_elements % self.block_size() != 0 {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.type_size())
    }

    /// Whether [`crate::gguf::dequantize_f32`] (and the tensors' `to_f32` / `to_bf16`) decode
    /// this type: the members of [`DEQUANTIZABLE`].
    pub fn can_dequantize(self) -> bool {
        DEQUANTIZABLE.contains(&self)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_round_trip() {
        let mut ids: Vec<u32> = GgmlType::all().map(GgmlType::id).collect();
        assert_eq!(ids.len(), ALL.len());
        for t in GgmlType::all() {
            assert_eq!(GgmlType::from_id(t.id()), Some(t));
        }
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), ALL.len());
        for gone in [4, 5, 31, 32, 33, 36, 37, 38, 42, u32::MAX] {
            assert_eq!(GgmlType::from_id(gone), None);
        }
    }

    #[test]
    fn block_geometry_is_ggmls() {
        assert_eq!((GgmlType::Q4_K.block_size(), GgmlType::Q4_K.type_size()), (256, 144));
        assert_eq!((GgmlType::Q6_K.block_size(), GgmlType::Q6_K.type_size()), (256, 210));
        assert_eq!((GgmlType::Q5_0.block_size(), GgmlType::Q5_0.type_size()), (32, 22));
        assert_eq!((GgmlType::Q8_0.block_size(), GgmlType::Q8_0.type_size()), (32, 34));
        assert_eq!(GgmlType::Q4_K.bytes_of(512), Some(288));
        assert_eq!(GgmlType::Q4_K.bytes_of(100), None);
        assert_eq!(GgmlType::F32.bytes_of(u64::MAX), None);
        assert_eq!(GgmlType::Q4_K.to_string(), "q4_K");
        assert!(GgmlType::Q6_K.can_dequantize() && !GgmlType::IQ2_XXS.can_dequantize());
    }
}
