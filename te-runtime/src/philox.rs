//! Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
//! SC'11), the counter-based generator of curand's `Philox4_32_10` and of the dropout kernels
//! (`te-codegen/templates/philox.cuh.tera`), bit for bit, on the host: what the CPU reference's
//! dropout masks and the generation sampler (`te_models::generate`) draw from.

/// Round multipliers and Weyl key increments of Philox4x32.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

/// The four 32-bit words Philox4x32-10 makes of `counter` under `key`.
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let p0 = M0 as u64 * c0 as u64;
        let p1 = M1 as u64 * c2 as u64;
        (c0, c1, c2, c3) = ((p1 >> 32) as u32 ^ c1 ^ k0, p1 as u32, (p0 >> 32) as u32 ^ c3 ^ k1, p0 as u32);
    }
    [c0, c1, c2, c3]
}

/// Block `q` of the stream `(seed, offset)`: key `(seed_lo, seed_hi)`, counter
/// `(q_lo, q_hi, offset_lo, offset_hi)`.
pub fn block(seed: u64, offset: u64, q: u64) -> [u32; 4] {
    let lo_hi = |v: u64| [v as u32, (v >> 32) as u32];
    let ([q0, q1], [o0, o1]) = (lo_hi(q), lo_hi(offset));
    philox4x32_10([q0, q1, o0, o1], lo_hi(seed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random123_known_answers() {
        // Random123's tests/kat_vectors for philox4x32 with 10 rounds (also curand's output).
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn blocks_split_the_u64s_into_low_and_high_words() {
        let (seed, offset, q) = (0x299f_31d0_a409_3822, 0x0370_7344_1319_8a2e, 0x85a3_08d3_243f_6a88);
        assert_eq!(block(seed, offset, q), [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]);
        assert_ne!(block(1, 0, 0), block(0, 1, 0));
        assert_ne!(block(0, 1, 0), block(0, 0, 1));
    }
}
