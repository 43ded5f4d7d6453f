//! Family 14: fused attention (FlashAttention-2), forward with the log-sum-exp and a
//! deterministic backward, on tensor cores through `mma.sync` / `ldmatrix` / `cp.async`; on
//! Hopper the forward at head dims 64/128/256 runs on warpgroup MMA (`wgmma.mma_async`, the GEMMs,
//! the softmax/P·V overlap and, at 128 query rows, the producer/consumer warp specialization of
//! Shah et al., "FlashAttention-3" (2024)), and so does the backward at 64/128/256 (above 128
//! with FlashAttention-3's split of each gradient's channels over two warpgroups); FP8 forward at
//! 128/256 and backward at 128. The backward of GQA/MQA splits the query heads of a group over
//! blocks and sums their partial dK/dV in a fixed order.
//!
//! One kernel serves every mask, sliding window, GQA ratio, layout (`bshd`, `sbhd`, q/k/v read
//! in place from a fused QKV tensor) and padding: those are run-time arguments (strides,
//! `cu_seqlens`, the window's bounds), so that the specialization is per head dim, dtype, tile
//! and arch only. Sources followed: Dao, "FlashAttention-2" (2023), Algorithms 1 and 2;
//! the `flash_fwd_kernel.h` / `flash_bwd_kernel.h` structure of `Dao-AILab/flash-attention`
//! (tiling, the P-fragment reuse from the score accumulators); TE
//! `pytorch/attention/dot_product_attention/utils.py` for the mask and window semantics.

use super::{ArgCond, Direction, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// A FlashAttention-2 kernel module for one head dim, dtype and tile.
///
/// **Forward** (entry point 0, [`FlashAttnSpec::FWD_ARGS`]): per (query block, head, sequence),
/// `O = softmax(scale · Q · Kᵀ, masked) · V` with the online softmax over key tiles of
/// `block_n` keys, no `[sq, sk]` buffer, and `softmax_lse = ln Σ_j exp(scale · s_ij)` over the
/// attended keys, f32 `[batch, heads, sq]`. A query whose keys are all masked (or a padded query
/// past its sequence's length) gets a zero output and `softmax_lse = +inf`, as in
/// FlashAttention-2 (so that the backward's `exp(s - lse)` is 0 there).
///
/// **Backward** (entry points `_dot_do_o`, `_dkdv`, `_dq`, [`FlashAttnSpec::BWD_DOT_ARGS`],
/// [`FlashAttnSpec::BWD_DKDV_ARGS`], [`FlashAttnSpec::BWD_DQ_ARGS`]): `delta_i = Σ_x dO_ix ·
/// O_ix`; then per key block (dK, dV, looping over the query blocks and, for GQA, over the
/// query heads of the group) and per query block (dQ, looping over the key blocks) the
/// probabilities are recomputed from Q, K and the LSE: `P = exp(scale · S − lse)`, `dP = dO ·
/// Vᵀ`, `dS = P ⊙ (dP − delta)`, `dV = Pᵀ dO`, `dK = scale · dSᵀ Q`, `dQ = scale · dS K`. No
/// atomics: each output element is summed by one thread in a fixed order, so the gradients are
/// the same bits run to run (the dQ kernel recomputes `S` and `dP`, about 1.4× the FLOPs of
/// FlashAttention-2's atomic dQ).
///
/// Masks (run time): query `i` of a sequence with `lq` queries and `lk` keys sees key `j` iff
/// `i < lq`, `j < lk`, `(left < 0 || j >= i + off − left)` and `(right < 0 || j <= i + off +
/// right)`, with `off = lk − lq` when bottom-right aligned, else 0. Causal is `(left, right) =
/// (−1, 0)`. Tiles that no query of a block can see are skipped.
///
/// Layout (run time): element `x` of head `h` at position `s` of sequence `b` sits at `b ·
/// batch_stride + s · row_stride + h · head_stride + x` elements (bshd, sbhd, or heads inside a
/// fused QKV row). Every pointer and stride must be 16-byte aligned (strides multiples of 8
/// elements). With `cu_seqlens_q` / `cu_seqlens_kv` (i32 `[batch + 1]`, may be null) sequence
/// `b` has `cu[b + 1] − cu[b]` valid positions of the padded `sq` / `sk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FlashAttnSpec {
    /// Forward, or the backward's three kernels.
    pub direction: Direction,
    /// bf16 or f16 (q, k, v, o and their gradients); f32 accumulation and softmax.
    pub dtype: DType,
    /// Channels per head of q and k: 32, 64, 96, 128 or 256 (the backward at 256: Hopper only).
    pub head_dim: usize,
    /// Channels per head of v and o (TE's `kv_channels = (head_dim_qk, head_dim_v)`): `head_dim`,
    /// or on the 16-bit Hopper kernels ([`FlashAttnSpec::with_head_dim_v`]) another of 64, 128
    /// and 256.
    pub head_dim_v: usize,
    /// Query rows per block: 16 per warp (forward and dQ kernels).
    pub block_m: usize,
    /// Keys per block: a tile of the forward and dQ loop; the rows of one dK/dV block (16 per
    /// warp).
    pub block_n: usize,
    /// Target architecture.
    pub arch: Arch,
    /// Hopper (`sm_90a`, head dims 64/128/256): warpgroup MMA
    /// (`wgmma.mma_async`, the FlashAttention-3 GEMMs: S-like products from shared memory, P·V-like
    /// ones with P or dS in registers) over 128-byte-swizzled shared tiles, one warpgroup per 64
    /// rows. Otherwise `mma.sync`.
    pub wgmma: bool,
    /// FP8 (TE's `fp8_dpa`, sm_90a). Forward ([`FlashAttnSpec::fp8_forward`], head dims 128 and
    /// 256): q, k and v in E4M3 (v transposed, see [`FlashAttnSpec::FWD_FP8_ARGS`]), the output in
    /// `dtype`; a second entry point `_quantize` ([`FlashAttnSpec::QUANTIZE_ARGS`]) makes the FP8
    /// operands of the forward and the backward. Backward ([`FlashAttnSpec::fp8_backward`], head
    /// dims 128 and 256): every product on 8-bit wgmma, the gradients in `dtype`
    /// ([`FlashAttnSpec::BWD_FP8_DKDV_ARGS`], [`FlashAttnSpec::BWD_FP8_DQ_ARGS`]).
    pub fp8: bool,
    /// FP8 backward: dO and dS in E5M2 (TE's HYBRID format), else E4M3.
    #[serde(default)]
    pub grad_e5m2: bool,
    /// wgmma kernels, warp-specialized (FlashAttention-3): one more warpgroup loads the tiles
    /// (the forward: TMA, `cp.async.bulk.tensor` from tensor maps, for dense inputs without
    /// `cu_seqlens`, else cp.async; the backward: cp.async; completing mbarriers) while the
    /// others multiply, each at its own pace, with the producer's registers (setmaxnreg). TMA
    /// measured on an H100 (2026-11-25, d128 causal, against cp.async): bf16 forward b4 s2048
    /// 304 → 298 µs, b2 s8192 1 811 → 1 733 µs, b1 s16384 3 386 → 3 241 µs; FP8 263 → 251,
    /// 1 511 → 1 437, 2 784 → 2 635 µs. On by default with 128-row blocks (two consumer
    /// warpgroups: d128 forward, FP8 forward and 16-bit backward). Measured on an H100
    /// (2026-11-25, d128 causal, bf16): forward b4 s2048 381 → 312 µs, b1 s16384 4 630 →
    /// 3 443 µs; forward + backward b4 s2048 1 525 → 1 327 µs, b2 s8192 10 384 → 8 771 µs; FP8
    /// forward 276 → 264 µs at s2048. At d64 (one consumer warpgroup, 64 rows) slower (forward
    /// 64 → 91 µs at b8 s1024 h12), so off there; on with two consumer warpgroups at each 64 rows
    /// of the backward above head dim 128; the FP8 backward (255 registers) keeps its
    /// block barriers. The 16-bit forward's two consumer warpgroups also take turns issuing
    /// their products (ping-pong, FlashAttention-3 §3.1; numbers in `context`).
    #[serde(default)]
    pub warp_specialized: bool,
    /// Attention dropout on the probabilities (`with_dropout`): the keep mask drawn in the
    /// kernels from the Philox stream of `ops::dropout` at the element's index in a dense `[batch,
    /// heads, sq, sk]` tensor, so that the unfused backend and the CPU reference draw the same.
    pub dropout: bool,
}

/// Head dims the kernels take.
pub const FLASH_HEAD_DIMS: [usize; 5] = [32, 64, 96, 128, 256];

/// A family-14 argument list: the entry point's pointers, then what the forward, `_dkdv` and `_dq`
/// share in this order: the sequence tables, the q / kv / o strides, the sizes, the mask and the
/// dropout stream.
macro_rules! flash_args {
    ($($pointer:expr),* $(,)?) => {
        &[
            $($pointer,)*
            KernelArg::read("cu_seqlens_q", "const int* __restrict__", "i32 `[batch + 1]` or null"),
            KernelArg::read("cu_seqlens_kv", "const int* __restrict__", "i32 `[batch + 1]` or null"),
            KernelArg::read(
                "seq_offsets_q",
                "const int* __restrict__",
                "thd: i32 `[batch + 1]` token offsets of q and o, or null",
            ),
            KernelArg::read(
                "seq_offsets_kv",
                "const int* __restrict__",
                "thd: i32 `[batch + 1]` token offsets of k and v, or null",
            ),
            KernelArg::scalar("q_batch", "u64", "batch stride of q (and dq) (elements)"),
            KernelArg::scalar("q_row", "u64", "position stride of q (and dq) (elements)"),
            KernelArg::scalar("q_head", "u64", "head stride of q (and dq) (elements)"),
            KernelArg::scalar("kv_batch", "u64", "batch stride of k (and dk) (elements)"),
            KernelArg::scalar("kv_row", "u64", "position stride of k (and dk) (elements)"),
            KernelArg::scalar("kv_head", "u64", "head stride of k (and dk) (elements)"),
            KernelArg::scalar("v_batch", "u64", "batch stride of v (and dv) (elements)"),
            KernelArg::scalar("v_row", "u64", "position stride of v (and dv) (elements)"),
            KernelArg::scalar("v_head", "u64", "head stride of v (and dv) (elements)"),
            KernelArg::scalar("o_batch", "u64", "batch stride of o or d_o (elements)"),
            KernelArg::scalar("o_row", "u64", "position stride of o or d_o (elements)"),
            KernelArg::scalar("o_head", "u64", "head stride of o or d_o (elements)"),
            KernelArg::scalar("sq", "u64", "queries per sequence (padded length)"),
            KernelArg::scalar("sk", "u64", "keys per sequence (padded length)"),
            KernelArg::scalar("total_q", "u64", "thd: tokens of q and o (bounds seq_offsets_q)"),
            KernelArg::scalar("total_kv", "u64", "thd: tokens of k and v (bounds seq_offsets_kv)"),
            KernelArg::scalar("heads", "u64", "query heads"),
            KernelArg::scalar("heads_per_group", "u64", "query heads per key/value head"),
            KernelArg::scalar("scale", "float", "softmax_scale"),
            KernelArg::scalar("window_left", "long long", "keys before the diagonal a query sees, -1 = all"),
            KernelArg::scalar("window_right", "long long", "keys after the diagonal a query sees, -1 = all"),
            KernelArg::scalar("bottom_right", "int", "1: the diagonal is aligned bottom-right (off = lk - lq)"),
            KernelArg::scalar("dropout_seed", "u64", "dropout: Philox key"),
            KernelArg::scalar("dropout_offset", "u64", "dropout: Philox counter words 2 and 3"),
            KernelArg::scalar("keep_threshold", "u64", "dropout: an element is kept iff its 32-bit word is below this"),
            KernelArg::scalar("keep_scale", "float", "dropout: 1 / (1 - p), the factor of kept probabilities"),
        ]
    };
}

mod args;
mod family;

impl FlashAttnSpec {
    /// A spec with the default tiles for `head_dim`.
    ///
    /// Hopper forward at head dims 64, 128 and 256: wgmma, 128 query rows (two warpgroups)
    /// against 128-key tiles at 128, 64 × 128 at 64, 128 × 64 at 256 (warp-specialized where
    /// 128 rows). Measured on an H100 (2026-11-25, b4 s2048 h32 d128 causal): 128 × 128 509 µs
    /// against 719 µs for 64 × 128 (one block per SM either way, by shared memory); at d64 64 ×
    /// 128 89 µs against 95 µs. 2026-11-27 (H100): d256 b4 s4096 h8/kv1 causal 128 × 64 489 µs
    /// against 907 µs for 64 × 64; d64 64 × 128 against 128 × 128 and 192 × 128 (three consumer
    /// warpgroups, FlashAttention-3's d64 tile): b8 s1024 65 / 67 / 94 µs, b4 s4096 h32 793 / 787 /
    /// 918 µs, b16 s1000 no mask 224 / 233 / 265 µs.
    ///
    /// Hopper backward: wgmma, dK/dV blocks of `block_n` keys (a warpgroup per 64) against query
    /// tiles of 64, dQ blocks of `block_m` queries against `block_n`-key tiles: 128 / 128 at
    /// d64 and d128, warp-specialized; above 128, 64 / 64 with two warpgroups on each 64 rows
    /// ([`FlashAttnSpec::channel_split`]). Measured on an H100 (2026-11-25, fwd+bwd causal): d128
    /// b4 s2048 128/128 1.61 ms, 64/64 1.59, 128/64 1.67, 64/128 1.75, 32-query tiles 1.84; at
    /// s8192 128/128 10.3 ms against 10.5–11.3. 2026-11-27 (H100, fwd+bwd): d64 128/128
    /// warp-specialized against 64/64 with block barriers: b4 s4096 h32 causal 3.18 against 3.76
    /// ms, b16 s1000 no mask 913 against 1 068 µs, b8 s1024 causal 264 against 277 µs.
    ///
    /// Otherwise (Ada, other head dims), forward: 64 query rows (4 warps of 16), against 64-key tiles up to head dim 64, 128-key
    /// tiles at 96 and 128, 32-key tiles at 256 (registers). Measured on an H100 (2026-11-24,
    /// b4 s2048 h32 d128 causal): 64×128 669 µs, 64×64 715 µs, 128×64 774 µs, 128×32 969 µs;
    /// at d64 64×64 104 µs against 140 µs for 128×64: two blocks per SM hide each other's
    /// barriers. Backward: dK/dV blocks of 64 keys (4 warps) with query tiles of 64 rows up to
    /// head dim 64, 32 above; dQ blocks of 64 rows against 64-key tiles (128-row or 128-key
    /// blocks measured no faster).
    pub fn new(direction: Direction, dtype: DType, head_dim: usize, arch: Arch) -> Self {
        let wgmma = arch == Arch::Sm90a && head_dim % 64 == 0;
        let (block_m, block_n) = match (direction, head_dim) {
            (Direction::Bwd, d) if wgmma && d > 128 => (64, 64),
            (Direction::Bwd, _) if wgmma => (128, 128),
            (Direction::Fwd, 64) if wgmma => (64, 128),
            (Direction::Fwd, 128) if wgmma => (128, 128),
            (Direction::Fwd, _) if wgmma => (128, 64),
            (Direction::Fwd, d) if d <= 64 => (64, 64),
            (Direction::Fwd, d) if d <= 128 => (64, 128),
            (Direction::Fwd, _) => (64, 32),
            (Direction::Bwd, _) => (64, 64),
        };
        // Warp-specialized where two consumer warpgroups share the producer (128 query rows, or
        // the backward's channel halves above head dim 128).
        let warp_specialized = wgmma && (block_m == 128 || (direction == Direction::Bwd && head_dim > 128));
        Self {
            direction,
            dtype,
            head_dim,
            head_dim_v: head_dim,
            block_m,
            block_n,
            arch,
            wgmma,
            fp8: false,
            grad_e5m2: false,
            warp_specialized,
            dropout: false,
        }
    }

    /// Keys per tile of the FP8 forward: also the positions per block of its `_quantize` and the
    /// multiple Vᵀ rows are padded to (a tile of Vᵀ is one 128-byte row per channel).
    pub const FP8_KEY_TILE: usize = 128;

    /// The FP8 forward for the same head dim and output dtype: 128 query rows (two consumer
    /// warpgroups and the producer) against [`FlashAttnSpec::FP8_KEY_TILE`]-key tiles. Measured on
    /// an H100 (2026-11-27, b4 s4096 h8/kv1 d256 causal): 344 µs against 543 µs with 64 rows (one
    /// warpgroup, block barriers), where the bf16 forward takes 490 µs.
    pub fn fp8_forward(dtype: DType, head_dim: usize, arch: Arch) -> Self {
        let block_m = 128;
        let wgmma = arch == Arch::Sm90a;
        Self {
            direction: Direction::Fwd,
            dtype,
            head_dim,
            head_dim_v: head_dim,
            block_m,
            block_n: Self::FP8_KEY_TILE,
            arch,
            wgmma,
            fp8: true,
            grad_e5m2: false,
            warp_specialized: wgmma && block_m == 128,
            dropout: false,
        }
    }

    /// The FP8 backward for the same head dim and gradient dtype (head_dim 128 or 256 on sm_90a;
    /// dO and dS in E5M2 with `grad_e5m2`, else E4M3): dK/dV blocks of 128 keys against 64-query
    /// tiles (three stages), each block on [`FlashAttnSpec::fp8_dkdv_channels`] channels of the
    /// gradients; dQ blocks of 128 queries against [`FlashAttnSpec::dq_key_tile`]-key tiles.
    pub fn fp8_backward(dtype: DType, head_dim: usize, arch: Arch, grad_e5m2: bool) -> Self {
        Self {
            direction: Direction::Bwd,
            dtype,
            head_dim,
            head_dim_v: head_dim,
            block_m: 128,
            block_n: 128,
            arch,
            wgmma: arch == Arch::Sm90a,
            fp8: true,
            grad_e5m2,
            warp_specialized: false,
            dropout: false,
        }
    }

    /// The 16-bit kernels of head dim `head_dim` for q and k and `head_dim_v` for v and o (TE's
    /// `kv_channels = (head_dim_qk, head_dim_v)`, as FlashAttention-3 and cuDNN take it on
    /// Hopper): sm_90a wgmma, both of 64, 128 and 256 (the backward above 128: both 128 or 256), with the tiles
    /// [`FlashAttnSpec::new`] picks for the larger of the two. Elsewhere (Ada, FP8, other head
    /// dims) [`KernelSpec::validate`](crate::spec::KernelSpec) refuses a `head_dim_v` other than
    /// `head_dim`: the unfused backend runs those calls, as in TE.
    pub fn with_head_dim_v(self, head_dim_v: usize) -> Self {
        if head_dim_v == self.head_dim || self.fp8 {
            return Self { head_dim_v, ..self };
        }
        let tiles = Self::new(self.direction, self.dtype, self.head_dim.max(head_dim_v), self.arch);
        let wgmma = self.wgmma && tiles.wgmma;
        Self {
            head_dim_v,
            wgmma,
            block_m: tiles.block_m,
            block_n: tiles.block_n,
            warp_specialized: wgmma && tiles.warp_specialized,
            ..self
        }
    }

    /// The same kernels with attention dropout on or off.
    pub const fn with_dropout(self, dropout: bool) -> Self {
        Self { dropout, ..self }
    }

    /// Threads of a forward or dQ block: 32 per 16 query rows times the
    /// [`FlashAttnSpec::channel_split`] (and a producer warpgroup when warp-specialized).
    pub const fn threads_m(&self) -> usize {
        self.block_m / 16 * 32 * self.channel_split() + if self.warp_specialized { 128 } else { 0 }
    }

    /// Threads of a dK/dV block: 32 per 16 keys times the [`FlashAttnSpec::channel_split`] (and a
    /// producer warpgroup when warp-specialized).
    pub const fn threads_n(&self) -> usize {
        self.block_n / 16 * 32 * self.channel_split() + if self.warp_specialized { 128 } else { 0 }
    }

    /// Consumer warpgroups that share each 64 rows of a backward block: 2 for the Hopper backward
    /// above head dim 128 (FlashAttention-3's d256 tiling), else 1. With 2, each owns half the
    /// channels of the gradient accumulators (dK and dV, or dQ: 64 f32 registers a thread each
    /// instead of 128) and half the columns of the S-like products; the probabilities and dS pass
    /// between them through shared memory.
    pub const fn channel_split(&self) -> usize {
        let d = if self.head_dim > self.head_dim_v { self.head_dim } else { self.head_dim_v };
        if matches!(self.direction, Direction::Bwd) && self.wgmma && !self.fp8 && d > 128 {
            2
        } else {
            1
        }
    }

    /// Channels of dK and dV one FP8 `_dkdv` block accumulates: at most 128, so that its dK and
    /// dV accumulators stay 128 f32 registers a thread at head_dim 256. Above that the launch has
    /// `head_dim / 128` blocks per key block and kv head, each recomputing Sᵀ and dPᵀ over every
    /// channel (the contraction) and accumulating its own channel slab of the gradients: 1.5× the
    /// dK/dV products of one pass, for the 8-bit wgmma's K-major operands leave no room for
    /// FlashAttention-3's exchange of P and dS through shared memory without a transposed copy.
    pub const fn fp8_dkdv_channels(&self) -> usize {
        if self.head_dim > 128 {
            128
        } else {
            self.head_dim
        }
    }

    /// Keys per tile of the `_dq` loop: `block_n`, but 64 for the FP8 backward above head dim
    /// 128 (its dQ accumulator is 128 f32 registers a thread there; S and dP of 64 keys keep the
    /// rest under 255).
    pub const fn dq_key_tile(&self) -> usize {
        if self.fp8 && self.head_dim > 128 {
            64
        } else {
            self.block_n
        }
    }

    /// Query rows per tile of the dK/dV kernel's loop.
    pub const fn dkdv_tile_m(&self) -> usize {
        if self.head_dim <= 64 || self.wgmma {
            64
        } else {
            32
        }
    }

    /// Stages of the dK/dV kernel's query-side tiles (Q, dO, LSE, delta): three with wgmma at
    /// head_dim 128 (one block per SM either way; the loads run two items ahead), else two
    /// (a third would cost the smaller tiles a block per SM).
    pub const fn dkdv_stages(&self) -> usize {
        if self.wgmma && self.head_dim > 64 && self.channel_split() == 1 {
            3
        } else {
            2
        }
    }

    /// Padded shared-memory row of a `[rows, head_dim]` tile, in elements (`head_dim + 8`:
    /// the 8 rows an `ldmatrix` reads fall in distinct banks).
    pub const fn smem_ld(&self) -> usize {
        self.head_dim + 8
    }

    /// The mbarriers of the warp-specialized kernels (at most 9 of 8 bytes), in bytes.
    const fn barrier_bytes(&self) -> usize {
        if self.warp_specialized {
            128
        } else {
            0
        }
    }

    /// Dynamic shared memory of entry point `entry`, in bytes.
    pub fn shared_bytes(&self, entry: usize) -> usize {
        let row = self.smem_ld() * 2;
        match (self.direction, entry) {
            // `_quantize`: a [block_n][head_dim + 8] 16-bit staging tile (transposing v).
            (Direction::Fwd, 1) => self.block_n * self.smem_ld() * 2,
            // wgmma: Q and two K and V tiles, unpadded, 1024-byte aligned (1 KiB spare).
            // (+ 9 mbarriers when warp-specialized.)
            (Direction::Fwd, _) if self.wgmma => {
                let elem = if self.fp8 { 1 } else { 2 };
                let (d, dv) = (self.head_dim, self.head_dim_v);
                ((self.block_m + 2 * self.block_n) * d + 2 * self.block_n * dv) * elem + 1024 + self.barrier_bytes()
            }
            (Direction::Fwd, _) => (self.block_m + 2 * self.block_n) * row,
            (Direction::Bwd, 0) | (Direction::Bwd, 3) => 0,
            // FP8: K, V and the stages of Q, dO, the block's channels of Qᵀ, dOᵀ (bytes), LSE and
            // delta.
            (Direction::Bwd, 1) if self.fp8 => {
                let q_side = self.dkdv_stages() * self.dkdv_tile_m();
                (2 * self.block_n + 2 * q_side) * self.head_dim
                    + 2 * q_side * self.fp8_dkdv_channels()
                    + 2 * q_side * 4
                    + 1024
            }
            // FP8: Q, dO and two stages of K, V, Kᵀ (bytes).
            (Direction::Bwd, _) if self.fp8 => (2 * self.block_m + 6 * self.dq_key_tile()) * self.head_dim + 1024,
            // K, V and the stages of Q, dO, LSE and delta (+ Pᵀ and dSᵀ tiles with a channel split).
            (Direction::Bwd, 1) if self.wgmma => {
                let rows = self.block_n + self.dkdv_stages() * self.dkdv_tile_m();
                let lse_delta = 2 * self.dkdv_stages() * self.dkdv_tile_m() * 4;
                // Two Pᵀ and two dSᵀ tiles (by item parity).
                let exchange = if self.channel_split() > 1 { 4 * self.block_n * self.dkdv_tile_m() * 2 } else { 0 };
                rows * (self.head_dim + self.head_dim_v) * 2 + lse_delta + exchange + 1024 + self.barrier_bytes()
            }
            // Q, dO and two stages of K and V (+ two dS tiles with a channel split).
            (Direction::Bwd, _) if self.wgmma => {
                let exchange = if self.channel_split() > 1 { 2 * self.block_m * self.block_n * 2 } else { 0 };
                (self.block_m + 2 * self.block_n) * (self.head_dim + self.head_dim_v) * 2
                    + exchange
                    + 1024
                    + self.barrier_bytes()
            }
            // K and V tiles, two stages of the Q and dO tiles and of their LSE and delta.
            (Direction::Bwd, 1) => (2 * self.block_n + 4 * self.dkdv_tile_m()) * row + 4 * self.dkdv_tile_m() * 4,
            // Q and dO tiles, two stages of the K and V tiles.
            (Direction::Bwd, _) => (2 * self.block_m + 4 * self.block_n) * row,
        }
    }
}

#[cfg(test)]
mod tests;
