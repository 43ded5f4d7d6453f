//! Family 9: rotary position embedding (RoPE), forward and backward, non-interleaved ("rotate
//! half"), as TE's fused `apply_rotary_pos_emb` (`common/fused_rope/fused_rope.cu`).

use super::{vector_width, Direction, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Memory layout of the `[.., h, d]` tensor RoPE rotates (TE's `tensor_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RopeFormat {
    /// `[s, b, h, d]`: sequence-major (Megatron's layout); the `b * h` rows of one position are
    /// contiguous.
    Sbhd,
    /// `[b, s, h, d]`: batch-major.
    Bshd,
}

impl RopeFormat {
    /// `sbhd` or `bshd`.
    pub const fn name(self) -> &'static str {
        match self {
            RopeFormat::Sbhd => "sbhd",
            RopeFormat::Bshd => "bshd",
        }
    }
}

impl std::fmt::Display for RopeFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// RoPE over `t: [s, b, h, d]` or `[b, s, h, d]` with angles `freqs: [s_f, d2]` f32 (`s_f >= s`;
/// position `p` uses row `p`). `d` and `d2` are specialized; `s`, `b`, `h` are run-time.
///
/// With `half = d2 / 2`, `θ = freqs[p][c]` and every channel `c < d2` of a row at position `p`
/// (math in f32, `cos`/`sin` from `sincosf`, as TE):
/// - forward: `out[c] = t[c]·cos θ_c − t[c+half]·sin θ_c` for `c < half` and
///   `out[c] = t[c]·cos θ_c + t[c−half]·sin θ_c` for `c ≥ half` (`t·cos + rotate_half(t)·sin`);
/// - backward (the transpose, TE's `fused_rope_block_backward`): `dt[c] = g[c]·cos θ_c +
///   g[c+half]·sin θ_{c+half}` for `c < half` and `dt[c] = g[c]·cos θ_c − g[c−half]·sin θ_{c−half}`
///   for `c ≥ half`;
/// - channels `c ≥ d2` are copied unchanged (bit for bit).
///
/// Each output is `fmaf(a, cos, b·sin)` with the product `b·sin` rounded first (no other
/// contraction), then rounded once to the dtype: the CPU reference mirrors it exactly, so the
/// two differ only by the `sincosf` vs host `sin_cos` rounding (≤ a few f32 ulps of the terms).
///
/// Entry point `<name>` ([`RopeSpec::ARGS`]): `src` and `dst` hold `s·b·h·d` elements of `dtype`
/// (distinct), `freqs` `s_f·d2` f32. Launch: `jobs · rows_per_step` threads per block ([`RopeSpec::threads`]); a job is
/// `vec` channels of a row (a pair job owns `[c, c+vec)` and its partner `[c+half, c+half+vec)`,
/// a copy job `vec` channels past `d2`). A block work item is one position and
/// `rows_per_step · unroll` of its `b·h` rows ([`RopeSpec::rows_per_item`]); blocks stride over
/// the `s · ceil(b·h / rows_per_item)` items, any block count. Per item each thread issues its
/// loads, the block computes the position's `d2` sines and cosines once into shared memory, then
/// each thread rotates its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RopeSpec {
    /// Forward or backward.
    pub direction: Direction,
    /// Layout of `src` and `dst`.
    pub format: RopeFormat,
    /// Element type of `src` and `dst`: f32, bf16 or f16.
    pub dtype: DType,
    /// Head dimension.
    pub d: usize,
    /// Rotated channels: even, `2 <= d2 <= d`.
    pub d2: usize,
    /// Channels per vector access: a power of two dividing `d2 / 2` and `d`, at most 16 bytes.
    pub vec: usize,
    /// Rows a block rotates side by side (threads per block = jobs per row × this).
    pub rows_per_step: usize,
    /// Rows each thread loads before computing (loads in flight per thread).
    pub unroll: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl RopeSpec {
    /// Largest head dimension the template takes.
    pub const MAX_D: usize = 1024;

    /// A spec with the default tuning: 16-byte vectors where `d2 / 2` and `d` allow, about 256
    /// threads per block, 4 rows per thread.
    pub fn new(direction: Direction, format: RopeFormat, dtype: DType, d: usize, d2: usize, arch: Arch) -> Self {
        let vec = vector_width(gcd(d2 / 2, d), dtype.size_bytes(), 16);
        let jobs = (d2 / 2 + d.saturating_sub(d2)) / vec;
        let rows_per_step = (256 / jobs.max(1)).max(1);
        Self { direction, format, dtype, d, d2, vec, rows_per_step, unroll: 4, arch }
    }

    /// Pair jobs per row: `(d2 / 2) / vec`.
    pub const fn pair_jobs(&self) -> usize {
        self.d2 / 2 / self.vec
    }

    /// Jobs per row: the pair jobs and `(d - d2) / vec` copy jobs.
    pub const fn jobs(&self) -> usize {
        self.pair_jobs() + (self.d - self.d2) / self.vec
    }

    /// Threads per block: `jobs · rows_per_step`.
    pub const fn threads(&self) -> usize {
        self.jobs() * self.rows_per_step
    }

    /// Rows of one position a block work item covers: `rows_per_step · unroll`.
    pub const fn rows_per_item(&self) -> usize {
        self.rows_per_step * self.unroll
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl RopeSpec {
    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("src", "const void* __restrict__", "`[s, b, h, d]` (sbhd) or `[b, s, h, d]` (bshd) input"),
        KernelArg::read("freqs", "const float* __restrict__", "`[s, rot]` f32 angles"),
        KernelArg::write("dst", "void* __restrict__", "output, the shape of `src`"),
        KernelArg::scalar("s", "u64", "sequence length"),
        KernelArg::scalar("b", "u64", "batch"),
        KernelArg::scalar("h", "u64", "heads"),
    ];
}

impl Family for RopeSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        let _ = entry;
        Self::ARGS
    }
    fn family(&self) -> &'static str {
        "rope"
    }
    fn template(&self) -> &'static str {
        "rope.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_{}_d{}_r{}_v{}_g{}_u{}",
            self.direction.name(),
            self.format,
            self.dtype,
            self.d,
            self.d2,
            self.vec,
            self.rows_per_step,
            self.unroll
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("direction", self.direction.name());
        ctx.insert("format", self.format.name());
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("d", &self.d);
        ctx.insert("d2", &self.d2);
        ctx.insert("vec", &self.vec);
        ctx.insert("rows_per_step", &self.rows_per_step);
        ctx.insert("unroll", &self.unroll);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("rope works on f32, bf16 or f16, not {}", self.dtype));
        }
        if self.d == 0 || self.d > Self::MAX_D {
            return Err(format!("d = {} must be in [1, {}]", self.d, Self::MAX_D));
        }
        if self.d2 == 0 || self.d2 % 2 != 0 || self.d2 > self.d {
            return Err(format!("d2 = {} must be even and in [2, d = {}]", self.d2, self.d));
        }
        let half = self.d2 / 2;
        if !self.vec.is_power_of_two() || half % self.vec != 0 || self.d % self.vec != 0 {
            return Err(format!(
                "vec = {} must be a power of two dividing d2 / 2 = {half} and d = {}",
                self.vec, self.d
            ));
        }
        if self.vec * self.dtype.size_bytes() > 16 {
            return Err(format!("vec = {} {} elements exceed one 16-byte access", self.vec, self.dtype));
        }
        if !(1..=8).contains(&self.unroll) {
            return Err(format!("unroll = {} must be in [1, 8]", self.unroll));
        }
        if self.rows_per_step == 0 || self.threads() > 1024 {
            return Err(format!(
                "{} jobs per row × rows_per_step = {} must give 1 to 1024 threads",
                self.jobs(),
                self.rows_per_step
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_use_16_byte_pairs_and_about_256_threads() {
        let s = RopeSpec::new(Direction::Fwd, RopeFormat::Sbhd, DType::BF16, 128, 128, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.vec, s.pair_jobs(), s.jobs(), s.threads(), s.rows_per_item()), (8, 8, 8, 256, 128));
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_rope_fwd_sbhd_bf16_d128_r128_v8_g32_u4_sm_90a");
        // Partial rotation: 4 pair jobs and 8 copy jobs per row.
        let s = RopeSpec::new(Direction::Bwd, RopeFormat::Bshd, DType::BF16, 128, 64, Arch::Sm89);
        s.validate().unwrap();
        assert_eq!((s.vec, s.jobs(), s.threads()), (8, 12, 252));
        // An odd half falls back to scalar accesses.
        let s = RopeSpec::new(Direction::Fwd, RopeFormat::Sbhd, DType::F32, 80, 30, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.vec, s.jobs()), (1, 65));
        let s = RopeSpec::new(Direction::Fwd, RopeFormat::Sbhd, DType::F32, 1024, 2, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.vec, s.jobs(), s.threads()), (1, 1023, 1023));
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let new = |d, d2| RopeSpec::new(Direction::Fwd, RopeFormat::Sbhd, DType::BF16, d, d2, Arch::Sm90a);
        assert!(new(128, 63).validate().unwrap_err().contains("even"));
        assert!(new(64, 128).validate().unwrap_err().contains("d2 = 128"));
        assert!(new(2048, 2048).validate().unwrap_err().contains("d = 2048"));
        let s = RopeSpec { dtype: DType::E4M3, ..new(64, 64) };
        assert!(s.validate().unwrap_err().contains("e4m3"));
        let s = RopeSpec { vec: 16, ..new(64, 64) };
        assert!(s.validate().unwrap_err().contains("16-byte"));
        let s = RopeSpec { rows_per_step: 300, ..new(64, 64) };
        assert!(s.validate().unwrap_err().contains("1024 threads"));
    }
}
