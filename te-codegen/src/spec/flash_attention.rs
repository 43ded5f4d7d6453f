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

use super::{ArgCond, Direction, Family, KernelArg, TMA_DESC};
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

    /// Arguments of the forward entry point.
    pub const FWD_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "queries, `[.., sq, heads, head_dim]` at the q strides"),
        KernelArg::read("k", "const void* __restrict__", "keys, `[.., sk, groups, head_dim]` at the kv strides"),
        KernelArg::read("v", "const void* __restrict__", "values, `[.., sk, groups, head_dim_v]` at the v strides"),
        KernelArg::write("o", "void* __restrict__", "output, `[.., sq, heads, head_dim_v]` at the o strides"),
        KernelArg::write("lse", "float* __restrict__", "`[batch, heads, sq]` f32 softmax_lse"),
        KernelArg::scalar(
            "tma_q",
            TMA_DESC,
            "q's tensor map: dims (head_dim, heads, sq, batch), boxes of 64 × 1 × block_m"
        )
        .when(ArgCond::Tma),
        KernelArg::scalar("tma_k", TMA_DESC, "k's tensor map: (head_dim, groups, sk, batch), 64 × 1 × block_n")
            .when(ArgCond::Tma),
        KernelArg::scalar("tma_v", TMA_DESC, "v's tensor map: (head_dim_v, groups, sk, batch), 64 × 1 × block_n")
            .when(ArgCond::Tma),
        KernelArg::scalar("use_tma", "int", "1: load with the tensor maps (dense unpadded inputs), 0: with cp.async")
            .when(ArgCond::Tma),
    );

    /// Arguments of the FP8 forward (entry point 0 of an [`FlashAttnSpec::fp8`] spec): q and k
    /// E4M3 at their strides (in elements = bytes); v as Vᵀ E4M3 `[batch, groups, head_dim,
    /// vt_row]`, the keys of each chunk of 32 permuted as `_quantize` writes them, zero past `sk`;
    /// S is descaled by q's and k's `scale_inv`, O by v's (device f32, as the casts wrote them).
    /// With `o_scale` set the output is written as E4M3 codes (TE's `fp8_mha`): each element
    /// rounded to the 16-bit type first, then cast with TE's contract (`o · o_scale` rounded to
    /// nearest and saturated, `o_amax` raised to max |o|, `o_scale_inv` written `1 / o_scale`),
    /// so the codes equal a cast of the 16-bit output bit for bit.
    pub const FWD_FP8_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "E4M3 queries, `[.., sq, heads, head_dim]` at the q strides"),
        KernelArg::read("k", "const void* __restrict__", "E4M3 keys, `[.., sk, groups, head_dim]` at the kv strides"),
        KernelArg::read("v", "const void* __restrict__", "E4M3 Vᵀ, `[batch, groups, head_dim, vt_row]`"),
        KernelArg::write(
            "o",
            "void* __restrict__",
            "output, `[.., sq, heads, head_dim]` at the o strides: 16-bit, or E4M3 with o_scale"
        ),
        KernelArg::write("lse", "float* __restrict__", "`[batch, heads, sq]` f32 softmax_lse"),
        KernelArg::read("scale_inv_q", "const float* __restrict__", "q's scale_inv (one f32)"),
        KernelArg::read("scale_inv_k", "const float* __restrict__", "k's scale_inv (one f32)"),
        KernelArg::read("scale_inv_v", "const float* __restrict__", "v's scale_inv (one f32)"),
        KernelArg::read("o_scale", "const float* __restrict__", "null: 16-bit o; else o's E4M3 scale (one f32)"),
        KernelArg::write("o_amax", "float* __restrict__", "E4M3 o: one f32 raised to max |o|, or null"),
        KernelArg::write("o_scale_inv", "float* __restrict__", "E4M3 o: one f32 written 1 / o_scale, or null"),
        KernelArg::scalar("vt_row", "u64", "keys per Vᵀ row (sk rounded up to a multiple of 128)"),
        KernelArg::scalar(
            "tma_q",
            TMA_DESC,
            "q's tensor map: dims (head_dim, heads, sq, batch), boxes of 128 × 1 × block_m"
        )
        .when(ArgCond::Tma),
        KernelArg::scalar("tma_k", TMA_DESC, "k's tensor map: (head_dim, groups, sk, batch), 128 × 1 × block_n")
            .when(ArgCond::Tma),
        KernelArg::scalar("tma_v", TMA_DESC, "Vᵀ's tensor map: (vt_row, head_dim, groups, batch), block_n × head_dim")
            .when(ArgCond::Tma),
        KernelArg::scalar("use_tma", "int", "1: load with the tensor maps (unpadded, not thd), 0: with cp.async")
            .when(ArgCond::Tma),
    );

    /// Arguments of the FP8 forward spec's `_quantize` entry point: one of q, k, v (or, for the
    /// backward, dO) → its FP8 codes, dense and / or transposed, in one pass.
    pub const QUANTIZE_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "x",
            "const void* __restrict__",
            "16-bit input, `[batch, seq, heads, head_dim]` at its strides",
        ),
        KernelArg::write("y", "void* __restrict__", "dense FP8 `[batch, seq, heads, head_dim]`, or null"),
        KernelArg::write(
            "yt",
            "void* __restrict__",
            "transposed FP8 `[batch, heads, head_dim, y_row]`, positions permuted, or null",
        ),
        KernelArg::read("scale_ptr", "const float* __restrict__", "the quantization scale (y = x · scale)"),
        KernelArg::write("amax_ptr", "float* __restrict__", "one f32, raised to max |x|, or null"),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "one f32, written 1 / scale, or null"),
        KernelArg::scalar("x_batch", "u64", "batch stride of x (elements)"),
        KernelArg::scalar("x_row", "u64", "position stride of x (elements)"),
        KernelArg::scalar("x_head", "u64", "head stride of x (elements)"),
        KernelArg::scalar("seq", "u64", "positions per sequence"),
        KernelArg::scalar("heads", "u64", "heads of x"),
        KernelArg::scalar("y_row", "u64", "positions per transposed row (seq rounded up to a multiple of 128)"),
        KernelArg::scalar("e5m2", "int", "1: E5M2 codes, 0: E4M3"),
    ];

    /// Arguments of the backward's `_dot_do_o` entry point.
    pub const BWD_DOT_ARGS: &'static [KernelArg] = &[
        KernelArg::read("o", "const void* __restrict__", "the forward output, at the o strides"),
        KernelArg::read("d_o", "const void* __restrict__", "its gradient, at the o strides"),
        KernelArg::write("delta", "float* __restrict__", "`[batch, heads, sq]` f32 Σ_x dO · O"),
        KernelArg::read(
            "o_scale_inv",
            "const float* __restrict__",
            "null: o is 16-bit; else o is E4M3 codes descaled by this one f32 (TE's fp8_mha)",
        ),
        KernelArg::read("cu_seqlens_q", "const int* __restrict__", "i32 `[batch + 1]` or null"),
        KernelArg::read(
            "seq_offsets_q",
            "const int* __restrict__",
            "thd: i32 `[batch + 1]` token offsets of o, or null",
        ),
        KernelArg::scalar("o_batch", "u64", "batch stride of o and d_o (elements)"),
        KernelArg::scalar("o_row", "u64", "position stride of o and d_o (elements)"),
        KernelArg::scalar("o_head", "u64", "head stride of o and d_o (elements)"),
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
    ];

    /// Arguments of the backward's `_dkdv` entry point.
    pub const BWD_DKDV_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "queries, at the q strides"),
        KernelArg::read("k", "const void* __restrict__", "keys, at the kv strides"),
        KernelArg::read("v", "const void* __restrict__", "values, at the v strides"),
        KernelArg::read("d_o", "const void* __restrict__", "output gradient, at the o strides"),
        KernelArg::read("lse", "const float* __restrict__", "`[batch, heads, sq]` forward softmax_lse"),
        KernelArg::read("delta", "const float* __restrict__", "`[batch, heads, sq]` from `_dot_do_o`"),
        KernelArg::write("dk", "void* __restrict__", "key gradient, at the kv strides (kv_splits = 1)"),
        KernelArg::write("dv", "void* __restrict__", "value gradient, at the v strides (kv_splits = 1)"),
        KernelArg::write(
            "dkdv_acc",
            "float* __restrict__",
            "kv_splits > 1: f32 partial sums `[kv_splits, batch, groups, sk, head_dim + head_dim_v]` (dK unscaled, then dV)",
        ),
        KernelArg::scalar("kv_splits", "u64", "blocks per key block that split the query heads of a group (≥ 1)"),
    );

    /// Arguments of the backward's `_dkdv_sum` entry point: dK = scale · Σ_split and dV = Σ_split
    /// of `_dkdv`'s partial sums, in split order (deterministic), rows `[0, rows of the
    /// sequence)` of each key/value head.
    pub const BWD_DKDV_SUM_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("dkdv_acc", "const float* __restrict__", "`_dkdv`'s partial sums"),
        KernelArg::write("dk", "void* __restrict__", "key gradient, at the kv strides"),
        KernelArg::write("dv", "void* __restrict__", "value gradient, at the v strides"),
        KernelArg::scalar("kv_splits", "u64", "partial sums per key (≥ 2)"),
    );

    /// Arguments of the backward's `_dq` entry point.
    pub const BWD_DQ_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "queries, at the q strides"),
        KernelArg::read("k", "const void* __restrict__", "keys, at the kv strides"),
        KernelArg::read("v", "const void* __restrict__", "values, at the v strides"),
        KernelArg::read("d_o", "const void* __restrict__", "output gradient, at the o strides"),
        KernelArg::read("lse", "const float* __restrict__", "`[batch, heads, sq]` forward softmax_lse"),
        KernelArg::read("delta", "const float* __restrict__", "`[batch, heads, sq]` from `_dot_do_o`"),
        KernelArg::write("dq", "void* __restrict__", "query gradient, at the q strides"),
    );

    /// Arguments of the FP8 backward's `_dkdv` entry point (the q / kv / v strides are those of
    /// dq, dk, dv; the FP8 codes are dense and unpadded, `thd` is not taken).
    pub const BWD_FP8_DKDV_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "E4M3 queries, dense `[batch, sq, heads, head_dim]`"),
        KernelArg::read("k", "const void* __restrict__", "E4M3 keys, dense `[batch, sk, groups, head_dim]`"),
        KernelArg::read("v", "const void* __restrict__", "E4M3 values, dense as the keys"),
        KernelArg::read("d_o", "const void* __restrict__", "FP8 output gradient, dense as the queries"),
        KernelArg::read("qt", "const void* __restrict__", "E4M3 Qᵀ `[batch, heads, head_dim, q_trow]` (`_quantize`)"),
        KernelArg::read("d_ot", "const void* __restrict__", "FP8 dOᵀ, as Qᵀ"),
        KernelArg::read("lse", "const float* __restrict__", "`[batch, heads, sq]` forward softmax_lse"),
        KernelArg::read("delta", "const float* __restrict__", "`[batch, heads, sq]` from `_dot_do_o`"),
        KernelArg::write("dk", "void* __restrict__", "key gradient, at the kv strides"),
        KernelArg::write("dv", "void* __restrict__", "value gradient, at the v strides"),
        KernelArg::read("scale_inv_q", "const float* __restrict__", "q's scale_inv (one f32)"),
        KernelArg::read("scale_inv_k", "const float* __restrict__", "k's scale_inv (one f32)"),
        KernelArg::read("scale_inv_v", "const float* __restrict__", "v's scale_inv (one f32)"),
        KernelArg::read("scale_inv_do", "const float* __restrict__", "dO's scale_inv (one f32)"),
        KernelArg::read("ds_scale", "const float* __restrict__", "dS's quantization scale (one f32)"),
        KernelArg::write("ds_amax", "float* __restrict__", "one f32, raised to max |dS| (true units)"),
        KernelArg::scalar("q_trow", "u64", "positions per Qᵀ / dOᵀ row (sq rounded up to a multiple of 128)"),
    );

    /// Arguments of the FP8 backward's `_dq` entry point.
    pub const BWD_FP8_DQ_ARGS: &'static [KernelArg] = flash_args!(
        KernelArg::read("q", "const void* __restrict__", "E4M3 queries, dense `[batch, sq, heads, head_dim]`"),
        KernelArg::read("k", "const void* __restrict__", "E4M3 keys, dense `[batch, sk, groups, head_dim]`"),
        KernelArg::read("v", "const void* __restrict__", "E4M3 values, dense as the keys"),
        KernelArg::read("d_o", "const void* __restrict__", "FP8 output gradient, dense as the queries"),
        KernelArg::read("kt", "const void* __restrict__", "E4M3 Kᵀ `[batch, groups, head_dim, k_trow]` (`_quantize`)"),
        KernelArg::read("lse", "const float* __restrict__", "`[batch, heads, sq]` forward softmax_lse"),
        KernelArg::read("delta", "const float* __restrict__", "`[batch, heads, sq]` from `_dot_do_o`"),
        KernelArg::write("dq", "void* __restrict__", "query gradient, at the q strides"),
        KernelArg::read("scale_inv_q", "const float* __restrict__", "q's scale_inv (one f32)"),
        KernelArg::read("scale_inv_k", "const float* __restrict__", "k's scale_inv (one f32)"),
        KernelArg::read("scale_inv_v", "const float* __restrict__", "v's scale_inv (one f32)"),
        KernelArg::read("scale_inv_do", "const float* __restrict__", "dO's scale_inv (one f32)"),
        KernelArg::read("ds_scale", "const float* __restrict__", "dS's quantization scale (one f32)"),
        KernelArg::scalar("k_trow", "u64", "positions per Kᵀ row (sk rounded up to a multiple of 128)"),
    );
}

impl Family for FlashAttnSpec {
    fn has(&self, cond: ArgCond) -> bool {
        cond == ArgCond::Tma && self.direction == Direction::Fwd && self.warp_specialized
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match (self.direction, entry) {
            (Direction::Fwd, 0) if self.fp8 => Self::FWD_FP8_ARGS,
            (Direction::Fwd, _) if self.fp8 => Self::QUANTIZE_ARGS,
            (Direction::Fwd, _) => Self::FWD_ARGS,
            (Direction::Bwd, 0) => Self::BWD_DOT_ARGS,
            (Direction::Bwd, 1) if self.fp8 => Self::BWD_FP8_DKDV_ARGS,
            (Direction::Bwd, _) if self.fp8 => Self::BWD_FP8_DQ_ARGS,
            (Direction::Bwd, 1) => Self::BWD_DKDV_ARGS,
            (Direction::Bwd, 2) => Self::BWD_DQ_ARGS,
            (Direction::Bwd, _) => Self::BWD_DKDV_SUM_ARGS,
        }
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        match self.direction {
            Direction::Fwd if self.fp8 => &["", "_quantize"],
            Direction::Fwd => &[""],
            Direction::Bwd if self.fp8 => &["_dot_do_o", "_dkdv", "_dq"],
            Direction::Bwd => &["_dot_do_o", "_dkdv", "_dq", "_dkdv_sum"],
        }
    }
    fn family(&self) -> &'static str {
        "flash_attn"
    }
    fn template(&self) -> &'static str {
        match self.direction {
            Direction::Fwd => "flash_attn_fwd.cu.tera",
            Direction::Bwd if self.fp8 => "flash_attn_bwd_fp8.cu.tera",
            Direction::Bwd => "flash_attn_bwd.cu.tera",
        }
    }
    fn name_parts(&self) -> String {
        let drop = if self.dropout { "_drop" } else { "" };
        let wg = match (self.wgmma, self.fp8) {
            (_, true) if self.grad_e5m2 => "_fp8_e5m2",
            (_, true) if self.warp_specialized => "_fp8_ws",
            (_, true) => "_fp8",
            (true, false) if self.warp_specialized => "_ws",
            (true, false) => "_wg",
            (false, false) => "",
        };
        let (dir, dt, d, m, n) = (self.direction.name(), self.dtype, self.head_dim, self.block_m, self.block_n);
        let dv = if self.head_dim_v == d { String::new() } else { format!("_v{}", self.head_dim_v) };
        format!("{dir}_{dt}_d{d}{dv}_m{m}_n{n}{wg}{drop}")
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("mma_type", if self.dtype == DType::F16 { "f16" } else { "bf16" });
        ctx.insert("head_dim", &self.head_dim);
        ctx.insert("head_dim_v", &self.head_dim_v);
        ctx.insert("block_m", &self.block_m);
        ctx.insert("block_n", &self.block_n);
        ctx.insert("dkdv_tile_m", &self.dkdv_tile_m());
        ctx.insert("dkdv_stages", &self.dkdv_stages());
        ctx.insert("dkdv_channels", &self.fp8_dkdv_channels());
        ctx.insert("dq_key_tile", &self.dq_key_tile());
        ctx.insert("smem_ld", &self.smem_ld());
        ctx.insert("dropout", &self.dropout);
        ctx.insert("wgmma", &self.wgmma);
        ctx.insert("fp8", &self.fp8);
        ctx.insert("grad_e5m2", &self.grad_e5m2);
        ctx.insert("ws", &self.warp_specialized);
        // FlashAttention-3's ping-pong between the two consumer warpgroups of the 16-bit
        // warp-specialized forward. Measured on an H100 (2026-11-25, d128 causal): b4 s2048 312 →
        // 304 µs (440 → 453 TFLOP/s), b4 s4096 h32/kv8 1 005 → 985 µs, b1 s16384 3 447 → 3 420
        // µs; the FP8 forward is slower with it (s2048 263 → 265 µs, s16384 2 784 → 2 869 µs),
        // so it keeps the warpgroups free-running (with TMA loads too: s8192 1 432 → 1 477 µs).
        // The forward's producer keeps 40 registers: 24 measured no faster with TMA (s8192 bf16
        // 1 747 → 1 754 µs, FP8 1 432 → 1 461 µs). The FP8 forward at d256 (2026-11-27, b4 s4096
        // h8/kv1): 342 µs free-running, 345 µs with ping-pong.
        let ping_pong = self.warp_specialized && self.direction == Direction::Fwd && self.block_m == 128 && !self.fp8;
        ctx.insert("ping_pong", &ping_pong);
        // setmaxnreg budget of each consumer thread (a multiple of 8, at most 240).
        let consumers = self.block_m / 16 * 32 * self.channel_split();
        // The block starts with the registers its launch got (64 K / threads, a multiple of 8, per
        // thread); setmaxnreg only moves them: an increase beyond that pool never returns. The
        // backward's producer keeps 24, the forward's 40 (fewer spill its loads).
        let producer_regs = if self.direction == Direction::Bwd { 24 } else { 40 };
        let threads = consumers + 128;
        let pool = 65536 / threads / 8 * 8 * threads;
        ctx.insert("ws_producer_regs", &producer_regs);
        ctx.insert("ws_consumer_regs", &((pool - 128 * producer_regs) / consumers.max(1) / 8 * 8).min(240));
        ctx.insert("grad_type", if self.grad_e5m2 { "E5M2" } else { "E4M3" });
        // The 8-bit wgmma operand types: F8_QK, F8_XG, F8_GX (x = e4m3, g = the gradients' type).
        let g = if self.grad_e5m2 { "e5m2" } else { "e4m3" };
        let pairs = match self.direction {
            Direction::Fwd => vec![(0, "e4m3", "e4m3")],
            Direction::Bwd => vec![(0, "e4m3", "e4m3"), (1, "e4m3", g), (2, g, "e4m3")],
        };
        ctx.insert("fp8_pairs", &pairs);
        // The wgmma shapes the kernels use, as (n, n / 8): S-like products (both operands in shared
        // memory) and P·V-like ones (A in registers).
        // With a channel split: each warpgroup's half of the S-like columns, and the P·V-like
        // products from shared memory (B MN-major) on its half of the channels.
        let cs = self.channel_split();
        ctx.insert("csplit", &cs);
        let mut ss = match self.direction {
            Direction::Fwd => vec![self.block_n],
            Direction::Bwd => vec![self.dkdv_tile_m() / cs, self.dq_key_tile() / cs],
        };
        ss.dedup();
        let shapes = |ns: Vec<usize>| ns.into_iter().map(|n| (n, n / 8)).collect::<Vec<_>>();
        ctx.insert("wgmma_ss_n", &shapes(ss));
        let mut rs = vec![self.head_dim, self.head_dim_v];
        if self.fp8 && self.direction == Direction::Bwd {
            rs.push(self.fp8_dkdv_channels());
        }
        rs.sort_unstable();
        rs.dedup();
        let mut ss_t = if cs > 1 { vec![self.head_dim / cs, self.head_dim_v / cs] } else { vec![] };
        ss_t.dedup();
        ctx.insert("wgmma_rs_n", &shapes(if cs > 1 { vec![] } else { rs }));
        ctx.insert("wgmma_ss_t_n", &shapes(ss_t));
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.dtype, DType::BF16 | DType::F16) {
            return Err(format!("fused attention runs on bf16 or f16, not {}", self.dtype));
        }
        if !FLASH_HEAD_DIMS.contains(&self.head_dim) {
            return Err(format!("head_dim = {} is not one of {FLASH_HEAD_DIMS:?}", self.head_dim));
        }
        if self.direction == Direction::Bwd && self.head_dim.max(self.head_dim_v) > 128 && !self.wgmma {
            return Err(format!(
                "the fused backward takes head dims above 128 only on sm_90a (wgmma), got {} (q, k) and {} (v) on {} \
                 (use the unfused backend)",
                self.head_dim, self.head_dim_v, self.arch
            ));
        }
        if self.head_dim_v != self.head_dim
            && !(self.wgmma && !self.fp8 && self.head_dim_v % 64 == 0 && self.head_dim_v <= 256)
        {
            return Err(format!(
                "head_dim_v = {} other than head_dim = {} is a setting of the 16-bit sm_90a (wgmma) kernels, with \
                 head_dim_v a multiple of 64 up to 256 (use the unfused backend)",
                self.head_dim_v, self.head_dim
            ));
        }
        if self.channel_split() > 1 {
            // Each warpgroup's channel half starts at a 64-channel column block of the tiles.
            let (d, dv) = (self.head_dim, self.head_dim_v);
            if d % 128 != 0 || dv % 128 != 0 || !self.warp_specialized || self.block_n != 64 || self.block_m != 64 {
                return Err(format!(
                    "the backward above head dim 128 splits the channels of both gradients in halves of whole \
                     64-channel blocks: head_dim and head_dim_v 128 or 256 (got {d} and {dv}), warp-specialized, 64 × 64 \
                     blocks (use the unfused backend)"
                ));
            }
        }
        for (what, n) in [("block_m", self.block_m), ("block_n", self.block_n)] {
            if n == 0 || n % 16 != 0 || n > 128 {
                return Err(format!("{what} = {n} must be a multiple of 16 in [16, 128]"));
            }
        }
        if self.wgmma {
            if self.arch != Arch::Sm90a {
                return Err("wgmma kernels are sm_90a only".into());
            }
            if self.head_dim % 64 != 0 || self.block_m % 64 != 0 {
                return Err(format!(
                    "wgmma tiles need head_dim and block_m multiples of 64 (got {} and {})",
                    self.head_dim, self.block_m
                ));
            }
        }
        if self.fp8
            && self.direction == Direction::Bwd
            && !(self.wgmma
                && self.head_dim % 128 == 0
                && self.head_dim <= 256
                && self.block_m == 128
                && self.block_n == 128
                && !self.dropout)
        {
            return Err(format!(
                "the FP8 backward is the sm_90a wgmma kernel at head_dim 128 or 256 with 128 × 128 blocks and no dropout, got \
                 {} head_dim {} blocks {} × {}{} (use the bf16/f16 backward)",
                self.arch,
                self.head_dim,
                self.block_m,
                self.block_n,
                if self.dropout { " with dropout" } else { "" }
            ));
        }
        if self.warp_specialized
            && !(self.wgmma
                && (self.block_m == 128 || self.channel_split() > 1)
                && !(self.fp8 && self.direction == Direction::Bwd))
        {
            return Err(
                "warp specialization is a setting of the 16-bit wgmma kernels and the FP8 forward with 128-row \
                        blocks (or the backward's channel split above head dim 128)"
                    .into(),
            );
        }
        if self.grad_e5m2 && !(self.fp8 && self.direction == Direction::Bwd) {
            return Err("grad_e5m2 (E5M2 dO and dS) is a setting of the FP8 backward only".into());
        }
        if self.fp8
            && self.direction == Direction::Fwd
            && !(self.wgmma && self.head_dim % 128 == 0 && self.block_n == Self::FP8_KEY_TILE)
        {
            return Err(format!(
                "FP8 attention is the sm_90a wgmma forward at head_dim 128 or 256 with 128-key tiles, got {} head_dim {} \
                 block_n {} (use the bf16/f16 kernels)",
                self.arch, self.head_dim, self.block_n
            ));
        }
        if self.direction == Direction::Bwd && self.block_n % self.dkdv_tile_m() != 0 && self.dkdv_tile_m() % 16 != 0 {
            return Err("the dK/dV query tile must be a multiple of 16".into());
        }
        let smem = (0..self.entry_suffixes().len()).map(|e| self.shared_bytes(e)).max().unwrap_or(0);
        if smem > 227 * 1024 {
            return Err(format!("the tiles need {smem} bytes of shared memory, above the 227 KiB of an SM"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_refuse_what_the_kernels_do_not_take() {
        for d in FLASH_HEAD_DIMS {
            for dtype in [DType::BF16, DType::F16] {
                FlashAttnSpec::new(Direction::Fwd, dtype, d, Arch::Sm90a).validate().unwrap();
                if d <= 128 {
                    FlashAttnSpec::new(Direction::Bwd, dtype, d, Arch::Sm89).validate().unwrap();
                }
                FlashAttnSpec::new(Direction::Bwd, dtype, d, Arch::Sm90a).validate().unwrap();
            }
        }
        let e = FlashAttnSpec::new(Direction::Fwd, DType::F32, 64, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("bf16 or f16"), "{e}");
        let e = FlashAttnSpec::new(Direction::Fwd, DType::BF16, 80, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("head_dim = 80"), "{e}");
        let e = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm89).validate().unwrap_err();
        assert!(e.contains("above 128 only on sm_90a"), "{e}");
    }

    #[test]
    fn backward_above_head_dim_128_splits_the_channels_over_two_warpgroups() {
        let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm90a);
        assert!(bwd.wgmma && bwd.warp_specialized && bwd.channel_split() == 2);
        assert_eq!((bwd.block_m, bwd.block_n, bwd.dkdv_tile_m(), bwd.dkdv_stages()), (64, 64, 64, 2));
        // Two consumer warpgroups on the same 64 rows, and the producer.
        assert_eq!((bwd.threads_m(), bwd.threads_n()), (384, 384));
        // K, V, two stages of Q and dO, Pᵀ and dSᵀ, LSE and delta: within an SM's 227 KiB.
        assert_eq!(bwd.shared_bytes(1), (64 + 2 * 64) * 512 * 2 + 4 * 64 * 64 * 2 + 2 * 2 * 64 * 4 + 1024 + 128);
        assert_eq!(bwd.shared_bytes(2), (64 + 2 * 64) * 512 * 2 + 2 * 64 * 64 * 2 + 1024 + 128);
        assert!(bwd.shared_bytes(1) <= 227 * 1024);
        // 128 (q, k) with 256 (v) takes the split too; below, none does.
        assert_eq!(bwd.with_head_dim_v(128).channel_split(), 2);
        let mixed = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a).with_head_dim_v(256);
        assert_eq!(mixed.channel_split(), 2);
        crate::spec::KernelSpec::from(mixed).validate().unwrap();
        assert_eq!(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a).channel_split(), 1);
        assert_eq!(FlashAttnSpec::new(Direction::Fwd, DType::BF16, 256, Arch::Sm90a).channel_split(), 1);
        // Halves of whole 64-channel blocks only: 64 with 256 is refused.
        let e = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 64, Arch::Sm90a).with_head_dim_v(256).validate();
        assert!(e.unwrap_err().contains("halves"));
        // The 16-bit backward has the split sum of dK and dV; the FP8 one does not.
        assert_eq!(crate::spec::Family::entry_suffixes(&bwd).len(), 4);
        let fp8 = FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true);
        assert_eq!(crate::spec::Family::entry_suffixes(&fp8).len(), 3);
    }

    #[test]
    fn fp8_backward_at_head_dim_256_keeps_head_dim_128_registers() {
        let d128 = FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true);
        assert_eq!((d128.fp8_dkdv_channels(), d128.dq_key_tile()), (128, 128));
        let d256 = FlashAttnSpec::fp8_backward(DType::BF16, 256, Arch::Sm90a, false);
        crate::spec::KernelSpec::from(d256).validate().unwrap();
        // Two 128-channel slabs of dK/dV per key block; 64-key tiles in `_dq`.
        assert_eq!((d256.fp8_dkdv_channels(), d256.dq_key_tile()), (128, 64));
        // K, V, three stages of Q, dO and of the slab's Qᵀ, dOᵀ, LSE and delta.
        assert_eq!(d256.shared_bytes(1), 2 * 128 * 256 + 2 * 3 * 64 * 256 + 2 * 3 * 64 * 128 + 2 * 3 * 64 * 4 + 1024);
        // Q, dO, two stages of 64-key K, V, Kᵀ.
        assert_eq!(d256.shared_bytes(2), (2 * 128 + 6 * 64) * 256 + 1024);
        assert!(d256.shared_bytes(1).max(d256.shared_bytes(2)) <= 227 * 1024);
        // The 16-bit tiles are not the FP8 slabs': their dQ loop keeps block_n.
        let bf16 = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm90a);
        assert_eq!(bf16.dq_key_tile(), bf16.block_n);
        // Dropout and Ada stay refused.
        let e = crate::spec::KernelSpec::from(d256.with_dropout(true)).validate().unwrap_err().to_string();
        assert!(e.contains("no dropout"), "{e}");
        let ada = FlashAttnSpec::fp8_backward(DType::BF16, 256, Arch::Sm89, true);
        assert!(crate::spec::KernelSpec::from(ada).validate().is_err());
    }

    #[test]
    fn hopper_forward_picks_wgmma_where_its_tiles_fit() {
        for (d, wgmma) in [(32, false), (64, true), (96, false), (128, true), (256, true)] {
            let fwd = FlashAttnSpec::new(Direction::Fwd, DType::BF16, d, Arch::Sm90a);
            assert_eq!(fwd.wgmma, wgmma, "head_dim {d}");
            let producer = if fwd.warp_specialized { 128 } else { 0 };
            assert_eq!(fwd.threads_m(), fwd.block_m * 2 + producer, "a warpgroup (128 threads) per 64 rows");
            assert!(!FlashAttnSpec::new(Direction::Fwd, DType::BF16, d, Arch::Sm89).wgmma);
            let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, d.min(128), Arch::Sm90a);
            assert_eq!(bwd.wgmma, d % 64 == 0, "head_dim {d}");
        }
        let fwd = FlashAttnSpec::new(Direction::Fwd, DType::BF16, 128, Arch::Sm90a);
        assert!(crate::spec::KernelSpec::from(fwd).name().contains("_ws"));
        // The warp-specialized forward takes the tensor maps of its TMA loads; the others do not.
        let names = |s: FlashAttnSpec| s.params(0).iter().map(|a| a.name).collect::<Vec<_>>();
        let n = names(fwd);
        let at = n.iter().position(|&x| x == "lse").unwrap();
        assert_eq!(n[at + 1..at + 5], ["tma_q", "tma_k", "tma_v", "use_tma"]);
        assert!(!names(FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a)).contains(&"tma_q"));
        assert!(!names(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a)).contains(&"tma_q"));
        assert_eq!(fwd.params(0).iter().find(|a| a.name == "tma_k").and_then(|a| a.scalar_size()), Some(128));
        // Two K and two V tiles beside Q, 1 KiB for the 1024-byte alignment of the swizzle, the
        // mbarriers of the warp-specialized pipeline.
        assert!(fwd.warp_specialized);
        // Warp-specialized where two consumer warpgroups share the producer: 128-row blocks.
        let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a);
        assert!(bwd.warp_specialized && bwd.threads_n() == 384 && bwd.threads_m() == 384);
        assert!(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 64, Arch::Sm90a).warp_specialized);
        assert!(!FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a).warp_specialized);
        assert!(!FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true).warp_specialized);
        let e = FlashAttnSpec {
            warp_specialized: true,
            ..FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a)
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("warp specialization"), "{e}");
        assert_eq!(fwd.shared_bytes(0), (128 + 4 * 128) * 128 * 2 + 1024 + 128);
        let e = FlashAttnSpec { arch: Arch::Sm89, ..fwd }.validate().unwrap_err();
        assert!(e.contains("sm_90a only"), "{e}");
        let e = FlashAttnSpec { block_m: 32, ..fwd }.validate().unwrap_err();
        assert!(e.contains("multiples of 64"), "{e}");
    }
}
