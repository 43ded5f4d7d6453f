//! Family 19: grouped GEMM with the group sizes on the device (the expert GEMMs of a
//! mixture-of-experts layer in one launch, graph-capturable: TE's `GroupedLinear` with
//! `m_splits` on the device, PyTorch's `torch._grouped_mm(x, w, offs)`; cuBLASLt's grouped
//! matmul needs CUDA 13.2 update 1 (FP8) or 13.3 (BF16) on Hopper).
//!
//! Hopper only (`wgmma.mma_async` through inline PTX, sm_90a).

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Which dimension the groups split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GroupedSplit {
    /// The rows of A and D (forward and dgrad): group `g` owns rows `[o_g, o_g + m_g)` of `A
    /// [rows, k]` and of `D [rows, n]`, and multiplies them by its own B (`b_ptrs[g]`).
    Rows,
    /// The reduction (wgrad): group `g` sums over `[o_g, o_g + m_g)` of the shared operands and
    /// writes its own `D_g [m, n]` (`d_ptrs[g]`); a group of 0 rows writes zeros (or leaves an
    /// accumulated `D_g` as it is).
    Reduction,
}

impl GroupedSplit {
    /// `rows` or `red` in kernel names.
    pub const fn name(self) -> &'static str {
        match self {
            GroupedSplit::Rows => "rows",
            GroupedSplit::Reduction => "red",
        }
    }
}

/// One grouped GEMM `D = alpha · A · Bᵀ` (f32 accumulation) per group, the groups' sizes
/// `m_splits` (i32 `[groups]`) read on the device: no host synchronization, so a CUDA graph can
/// capture it and replay it with other sizes. `o_g = Σ_{h<g} m_h`.
///
/// Operand layouts (row-major storage, `k` the reduction):
/// - A: K-major `[m-side, k]` (ld = its row length), or with [`GroupedSplit::Reduction`] and
///   16-bit types also MN-major `[k, m]` (`a_k_major` false: the un-transposed `dy` of wgrad).
/// - B: K-major `[n, k]` (a weight `[out, in]` in forward), or (16-bit only) MN-major `[k, n]`
///   (the weight read as `[out, in]` in dgrad; `x` in wgrad).
/// - 8-bit operands (E4M3/E5M2, not both E5M2) must be K-major, as wgmma reads them; their
///   `scale_inv` multiply the product (A: one value; B: `b_scale_inv[g]`, or `[0]` with
///   [`GroupedSplit::Reduction`]).
/// - D: bf16, f16 or f32, row-major `[rows, n]` ([`GroupedSplit::Rows`]; rows past `Σ m_g` are
///   written with zeros; each group's bias `[n]`, of D's type, added when `bias_ptrs` is not
///   null) or `[m, n]` per group; `accumulate` adds to D (in f32, rounded once).
/// - 16-bit specs have a second entry point, `<name>_dbias` ([`GroupedGemmSpec::DBIAS_ARGS`]):
///   each group's column sums of `a [total, m]` into its `dbias [m]` (the bias gradient),
///   written or accumulated, deterministic.
///
/// Limits the launcher checks on the host: `k` and `n` multiples of 16 (16-byte rows), `m` of 16
/// with MN-major A. On the device, per launch: a negative size, sizes summing past the rows, or
/// (8-bit [`GroupedSplit::Reduction`]) a size not a multiple of 16 sets `status` to 1 and is
/// clamped (nothing outside the tensors is touched).
///
/// Tiles: 128 × 256 outputs per block of [`GroupedGemmSpec::THREADS`] (two warpgroups of 64
/// rows, `wgmma` m64n256), 128-byte k slices in [`GroupedGemmSpec::STAGES`] cp.async stages
/// (128B swizzle), the output staged through shared memory for 16-byte stores; one
/// flat grid of the tiles of every group, `m`-tiles fastest within chunks of
/// [`GroupedGemmSpec::GROUP_M`] so the blocks in flight share their B tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupedGemmSpec {
    /// Which dimension the groups split.
    pub split: GroupedSplit,
    /// A's element type: bf16, f16, e4m3 or e5m2.
    pub a: DType,
    /// B's element type (bf16/f16 as A; with an 8-bit A, e4m3 or e5m2).
    pub b: DType,
    /// A is stored K-major (`[m-side, k]`).
    pub a_k_major: bool,
    /// B is stored K-major (`[n, k]`).
    pub b_k_major: bool,
    /// D's element type: bf16, f16 or f32.
    pub out: DType,
    /// D += the product instead of D = (wgrad accumulation: into an f32 `main_grad`, or a
    /// 16-bit gradient, summed in f32 and rounded once).
    pub accumulate: bool,
    /// Target architecture (sm_90a only).
    pub arch: Arch,
}

impl GroupedGemmSpec {
    /// Threads per block: two consumer warpgroups.
    pub const THREADS: usize = 256;
    /// Output rows of a block's tile.
    pub const TILE_M: usize = 128;
    /// Output columns of a block's tile.
    pub const TILE_N: usize = 256;
    /// cp.async stages of 48 KiB (a 16 KiB A tile and a 32 KiB B tile: 128 bytes of k a row).
    pub const STAGES: usize = 4;
    /// Dynamic shared memory per block: the stages plus 1 KiB for the 1024-byte alignment.
    pub const SHARED_BYTES: usize = Self::STAGES * (Self::TILE_M + Self::TILE_N) * 128 + 1024;
    /// M-tiles per chunk of the tile order.
    pub const GROUP_M: usize = 16;

    /// The arguments of the one entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("a", "const void* __restrict__", "A (see the layouts)"),
        KernelArg::read("b", "const void* __restrict__", "B shared by the groups (Reduction), else null"),
        KernelArg::read("b_ptrs", "const u64* __restrict__", "`[groups]` B of each group (Rows), else null"),
        KernelArg::write("d", "void* __restrict__", "D `[rows, n]` (Rows), else null"),
        KernelArg::read("d_ptrs", "const u64* __restrict__", "`[groups]` D_g `[m, n]` (Reduction), else null"),
        KernelArg::read("m_splits", "const int* __restrict__", "i32 `[groups]` rows (or reduction length) per group"),
        KernelArg::read("a_scale_inv", "const float* __restrict__", "f32 `[1]` A's scale_inv (8-bit), else null"),
        KernelArg::read("b_scale_inv", "const u64* __restrict__", "`[groups]` pointers to B's f32 scale_inv (8-bit)"),
        KernelArg::read(
            "bias_ptrs",
            "const u64* __restrict__",
            "`[groups]` bias `[n]` of D's type per group (Rows), or null",
        ),
        KernelArg::write("status", "int* __restrict__", "i32 `[1]`: set to 1 on sizes the kernel had to clamp"),
        KernelArg::scalar("total", "u64", "rows of A and D (Rows) or the reduction length (Reduction)"),
        KernelArg::scalar("m", "u64", "rows of each D_g (Reduction; unused with Rows)"),
        KernelArg::scalar("n", "u64", "columns of D"),
        KernelArg::scalar("k", "u64", "reduction length (Rows; unused with Reduction)"),
        KernelArg::scalar("groups", "u64", "groups"),
        KernelArg::scalar("alpha", "float", "scale of the product"),
    ];

    /// The arguments of `<name>_dbias` (16-bit A only).
    pub const DBIAS_ARGS: &'static [KernelArg] = &[
        KernelArg::read("a", "const void* __restrict__", "`[total, m]` rows whose column sums are taken (dy)"),
        KernelArg::read("m_splits", "const int* __restrict__", "i32 `[groups]` rows per group"),
        KernelArg::read("dbias_ptrs", "const u64* __restrict__", "`[groups]` dbias `[m]` of D's type per group"),
        KernelArg::scalar("total", "u64", "rows of a"),
        KernelArg::scalar("m", "u64", "columns of a"),
        KernelArg::scalar("groups", "u64", "groups"),
    ];

    /// Columns per block of `<name>_dbias` (grid `(⌈m/64⌉, groups)`, 256 threads).
    pub const DBIAS_COLS: usize = 64;

    /// The kernel for a bf16/f16 forward-style product (both operands K-major).
    pub const fn new(split: GroupedSplit, a: DType, b: DType, out: DType, arch: Arch) -> Self {
        Self { split, a, b, a_k_major: true, b_k_major: true, out, accumulate: false, arch }
    }

    /// The same spec with the operands' storage orders.
    pub const fn with_major(mut self, a_k_major: bool, b_k_major: bool) -> Self {
        self.a_k_major = a_k_major;
        self.b_k_major = b_k_major;
        self
    }

    /// The same spec accumulating into D.
    pub const fn accumulating(mut self, accumulate: bool) -> Self {
        self.accumulate = accumulate;
        self
    }

    /// Blocks of a launch: an upper bound of the tiles of every group (Rows: `⌈total/128⌉ +
    /// groups` row tiles, the tail of zeros included; Reduction: `groups · ⌈m/128⌉`) times
    /// `⌈n/256⌉`. Blocks past the tiles the sizes give return at once.
    pub fn blocks(&self, total: usize, m: usize, n: usize, groups: usize) -> usize {
        let t = Self::TILE_M;
        let m_tiles = match self.split {
            GroupedSplit::Rows => total.div_ceil(t) + groups,
            GroupedSplit::Reduction => groups * m.div_ceil(t),
        };
        m_tiles * n.div_ceil(Self::TILE_N)
    }
}

fn major(k_major: bool) -> &'static str {
    if k_major {
        "k"
    } else {
        "mn"
    }
}

impl Family for GroupedGemmSpec {
    fn family(&self) -> &'static str {
        "grouped_gemm"
    }
    fn template(&self) -> &'static str {
        "grouped_gemm.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}{}_{}{}_{}{}",
            self.split.name(),
            self.a,
            major(self.a_k_major),
            self.b,
            major(self.b_k_major),
            self.out,
            if self.accumulate { "_acc" } else { "" }
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        if self.a.is_fp8() {
            &[""]
        } else {
            &["", "_dbias"]
        }
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            0 => Self::ARGS,
            _ => Self::DBIAS_ARGS,
        }
    }
    fn context(&self, ctx: &mut tera::Context) {
        let fp8 = self.a.is_fp8();
        ctx.insert("ta", self.a.type_tag());
        ctx.insert("tb", self.b.type_tag());
        ctx.insert("tout", self.out.type_tag());
        ctx.insert("fp8", &fp8);
        ctx.insert("elem_bytes", &self.a.size_bytes());
        ctx.insert("a_k_major", &self.a_k_major);
        ctx.insert("b_k_major", &self.b_k_major);
        ctx.insert("rows_split", &(self.split == GroupedSplit::Rows));
        ctx.insert("accumulate", &self.accumulate);
        ctx.insert("out_f32", &(self.out == DType::F32));
        ctx.insert("a_name", self.a.name());
        ctx.insert("b_name", self.b.name());
        ctx.insert("threads", &Self::THREADS);
        ctx.insert("stages", &Self::STAGES);
        ctx.insert("group_m", &Self::GROUP_M);
        ctx.insert("tile_n", &Self::TILE_N);
        // Accumulator registers of a thread (64 × TILE_N f32 over 128 threads), in 8-column tiles.
        ctx.insert("acc_regs", &(Self::TILE_N / 2));
        ctx.insert("acc_tiles", &(Self::TILE_N / 8));
    }
    fn validate(&self) -> Result<(), String> {
        if self.arch != Arch::Sm90a {
            return Err("the grouped GEMM runs on Hopper's wgmma: target sm_90a".into());
        }
        match (self.a, self.b) {
            (DType::BF16, DType::BF16) | (DType::F16, DType::F16) => {}
            (DType::E4M3 | DType::E5M2, DType::E4M3 | DType::E5M2)
                if !(self.a == DType::E5M2 && self.b == DType::E5M2) =>
            {
                if !self.a_k_major || !self.b_k_major {
                    return Err("8-bit operands must be K-major (wgmma reads them so): pass transposed codes".into());
                }
            }
            (a, b) => {
                return Err(format!(
                    "operands {a} x {b}: expected bf16 x bf16, f16 x f16 or two FP8 formats (not both e5m2)"
                ))
            }
        }
        if self.split == GroupedSplit::Rows && !self.a_k_major {
            return Err("with the rows split A is the [rows, k] activation: K-major".into());
        }
        if !matches!(self.out, DType::BF16 | DType::F16 | DType::F32) {
            return Err(format!("output {}: expected bf16, f16 or f32", self.out));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every split's tiles fit the launch: `Σ_g ⌈m_g/128⌉ + ⌈tail/128⌉` row tiles never exceed
    /// `⌈total/128⌉ + groups`, whatever the splits.
    #[test]
    fn the_grid_bounds_the_tiles_of_any_splits() {
        let spec = GroupedGemmSpec::new(GroupedSplit::Rows, DType::BF16, DType::BF16, DType::BF16, Arch::Sm90a);
        let t = GroupedGemmSpec::TILE_M;
        for (total, splits) in [
            (1000usize, vec![1usize, 1, 1, 1]),
            (1000, vec![129, 0, 255, 1, 257]),
            (512, vec![128, 128, 128, 128]),
            (300, vec![0, 0, 0]),
            (4097, vec![4097]),
        ] {
            let used: usize = splits.iter().sum();
            let tiles: usize = splits.iter().map(|m| m.div_ceil(t)).sum::<usize>() + (total - used).div_ceil(t);
            let n_tiles = 3;
            assert!(tiles * n_tiles <= spec.blocks(total, 0, 3 * GroupedGemmSpec::TILE_N, splits.len()), "{splits:?}");
        }
        let red = GroupedGemmSpec { split: GroupedSplit::Reduction, ..spec };
        assert_eq!(red.blocks(5000, 300, 300, 4), 4 * 3 * 2);
    }

    #[test]
    fn names_say_split_orders_and_accumulation() {
        let s = GroupedGemmSpec::new(GroupedSplit::Reduction, DType::BF16, DType::BF16, DType::F32, Arch::Sm90a)
            .with_major(false, false)
            .accumulating(true);
        assert_eq!(crate::spec::KernelSpec::from(s).name(), "te_grouped_gemm_red_bf16mn_bf16mn_f32_acc_sm_90a");
    }
}
