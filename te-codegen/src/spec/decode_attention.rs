//! Family 15: decode attention over a KV cache (FlashDecoding: split-K over the cached keys),
//! the attention of a generation step (TE's `InferenceParams` path of `DotProductAttention`; the
//! algorithm of FlashAttention's `flash_attn_with_kvcache` with `num_splits`, Dao et al. 2023,
//! "Flash-Decoding for long-context inference").
//!
//! One query per sequence and head attends over the `len[b]` cached keys of its sequence
//! (causal by construction: the cache holds the tokens up to the query's own). The cache is
//! `[batch, capacity, groups, head_dim]` for k and for v (bshd; query head `j` reads group `j /
//! (heads / groups)`), the lengths an i32 `[batch]` device array, so that one launch
//! configuration (from the capacity) serves every step and a CUDA graph can replay it while the
//! lengths change.

use super::{ArgCond, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Head dimensions the decode kernels take: multiples of 8 (one 16-byte access holds 8
/// channels) up to 256.
pub const DECODE_MAX_HEAD_DIM: usize = 256;

/// The decode kernels of one head dim and dtype, three entry points:
///
/// - `<name>` ([`DecodeAttnSpec::SPLIT_ARGS`]): block `(split, b·heads / q_per_block)` runs the
///   online softmax of `q_per_block` queries sharing a KV head over keys `[split · chunk, min(len, (split + 1) · chunk))` and writes the
///   unnormalized partial output (f32 `[b·heads, splits, head_dim]`) with its running max (in
///   log2 units) and sum (f32 `[b·heads, splits, 2]`). [`DecodeAttnSpec::THREADS`] threads:
///   `lanes` threads per key (8 channels each, 16 of an E4M3 cache: 16-byte loads), `32 / lanes`
///   keys per warp at a time, the online softmax rescaled once per 4 keys of a thread.
/// - `<name>_combine` ([`DecodeAttnSpec::COMBINE_ARGS`]): block `b·heads` merges the splits
///   (`o = Σ o_s · 2^(m_s − M) / Σ l_s · 2^(m_s − M)`) and writes `o` in the dtype; a sequence of
///   length 0 gets zeros.
/// - `<name>_append` ([`DecodeAttnSpec::APPEND_ARGS`]): writes `s` new tokens' k and v (rows of
///   the fused QKV projection, or any strided `[s, b, groups, head_dim]`) into the cache at
///   positions `len[b] − s ..len[b]` (the lengths after the append); positions outside `[0,
///   capacity)` are skipped.
///
/// Math in f32: the scores `q·k · softmax_scale · log2(e)` and `exp2`, as FlashAttention.
///
/// With an E4M3 cache ([`DecodeAttnSpec::with_fp8_cache`], vLLM's `kv_cache_dtype="fp8"` with
/// per-tensor scales): the append writes `E4M3(k · k_scale)` and `E4M3(v · v_scale)` (round to
/// nearest even, saturating), and the split kernel reads each key and value as its code in f32,
/// `k_scale_inv` folded into the query and `v_scale_inv` into the output; half the cache's
/// bytes, at E4M3's precision (3 mantissa bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DecodeAttnSpec {
    /// q, k, v, the cache and o: bf16 or f16.
    pub dtype: DType,
    /// Channels per head: a multiple of 8, at most [`DECODE_MAX_HEAD_DIM`].
    pub head_dim: usize,
    /// The cache's dtype: `dtype`, or E4M3 codes with per-tensor scales.
    pub kv_cache: DType,
    /// Query heads of one KV head a split block serves, 1 to [`DecodeAttnSpec::MAX_Q_PER_BLOCK`]
    /// (GQA: each key and value is loaded and converted once for all of them); the heads per KV
    /// head must be a multiple ([`DecodeAttnSpec::q_per_block_for`]).
    pub q_per_block: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl DecodeAttnSpec {
    /// Threads per block of every entry point.
    pub const THREADS: usize = 128;
    /// The most key chunks a query is split into (the combine keeps a weight per split in
    /// shared memory).
    pub const MAX_SPLITS: usize = 1024;

    /// The most query heads a split block serves.
    pub const MAX_Q_PER_BLOCK: usize = 4;

    /// The kernels of `head_dim` and `dtype` for `arch`, one query head a block.
    pub const fn new(dtype: DType, head_dim: usize, arch: Arch) -> Self {
        Self { dtype, head_dim, kv_cache: dtype, q_per_block: 1, arch }
    }

    /// These kernels serving `n` query heads of one KV head a block.
    pub const fn with_q_per_block(self, n: usize) -> Self {
        Self { q_per_block: n, ..self }
    }

    /// The query heads a block serves for `heads` query heads over `groups` KV heads: the
    /// largest of 4, 3, 2, 1 that divides `heads / groups` (Gemma 3 and Llama 3: 4; MHA: 1).
    pub const fn q_per_block_for(heads: usize, groups: usize) -> usize {
        let r = match heads.checked_div(groups) {
            Some(r) => r,
            None => 1,
        };
        let mut n = Self::MAX_Q_PER_BLOCK;
        while n > 1 && (r == 0 || r % n != 0) {
            n -= 1;
        }
        n
    }

    /// These kernels over an E4M3 cache with per-tensor scales (see the type's docs).
    pub const fn with_fp8_cache(self) -> Self {
        Self { kv_cache: DType::E4M3, ..self }
    }

    /// Whether the cache holds E4M3 codes.
    pub fn fp8_cache(&self) -> bool {
        self.kv_cache == DType::E4M3
    }

    /// Channels a thread reads of a key or value with one load: 8 of a 16-bit cache (16 bytes),
    /// 16 E4M3 codes (16 bytes; 8 codes when the head dim is not a multiple of 16 or a block
    /// serves several query heads, whose registers that leaves room for).
    pub const fn channels_per_thread(&self) -> usize {
        if matches!(self.kv_cache, DType::E4M3) && self.head_dim % 16 == 0 && self.q_per_block == 1 {
            16
        } else {
            8
        }
    }

    /// Threads that load one key, a power of two: `head_dim / channels_per_thread` rounded up.
    pub const fn lanes(&self) -> usize {
        (self.head_dim / self.channels_per_thread()).next_power_of_two()
    }

    /// Keys a block reads at a time (`THREADS / lanes`).
    pub const fn keys_per_step(&self) -> usize {
        Self::THREADS / self.lanes()
    }

    /// Arguments of the split kernel (entry point 0).
    pub const SPLIT_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "q",
            "const void* __restrict__",
            "queries: head `h` of sequence `b` at `b · q_batch + h · head_dim`",
        ),
        KernelArg::read("k_cache", "const void* __restrict__", "cached keys `[batch, capacity, groups, head_dim]`"),
        KernelArg::read("v_cache", "const void* __restrict__", "cached values, as `k_cache`"),
        KernelArg::read("seqlens", "const int* __restrict__", "i32 `[batch]`: cached tokens per sequence"),
        KernelArg::write("o_partial", "float* __restrict__", "f32 `[batch · heads, splits, head_dim]` partial outputs"),
        KernelArg::write(
            "ml_partial",
            "float* __restrict__",
            "f32 `[batch · heads, splits, 2]`: max (log2 units), sum",
        ),
        KernelArg::scalar("q_batch", "u64", "elements between the queries of two sequences"),
        KernelArg::scalar("heads", "u32", "query heads"),
        KernelArg::scalar("groups", "u32", "key/value heads (divides heads)"),
        KernelArg::scalar("capacity", "u32", "positions per sequence in the cache"),
        KernelArg::scalar("splits", "u32", "key chunks per query"),
        KernelArg::scalar("chunk", "u32", "keys per chunk"),
        KernelArg::scalar("scale_log2", "float", "softmax_scale · log2(e)"),
        KernelArg::scalar(
            "window_left",
            "int",
            "sliding window: the query at position `len − 1` sees keys from `len − 1 − window_left`; −1: all",
        ),
        KernelArg::read("kv_scales", "const float* __restrict__", KV_SCALES_DOC).when(ArgCond::Fp8KvCache),
    ];

    /// Arguments of the combine kernel (entry point 1).
    pub const COMBINE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("o_partial", "const float* __restrict__", "the split kernel's partial outputs"),
        KernelArg::read("ml_partial", "const float* __restrict__", "the split kernel's maxima and sums"),
        KernelArg::write("o", "void* __restrict__", "output: head `h` of sequence `b` at `b · o_batch + h · head_dim`"),
        KernelArg::scalar("o_batch", "u64", "elements between the outputs of two sequences"),
        KernelArg::scalar("heads", "u32", "query heads"),
        KernelArg::scalar("splits", "u32", "key chunks per query"),
    ];

    /// Arguments of the append kernel (entry point 2).
    pub const APPEND_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "k_new",
            "const void* __restrict__",
            "new keys: group `g` of token `i` of sequence `b` at `(i · batch + b) · new_row + g · head_dim`",
        ),
        KernelArg::read("v_new", "const void* __restrict__", "new values, at the strides of `k_new`"),
        KernelArg::read(
            "seqlens",
            "const int* __restrict__",
            "i32 `[batch]`: cached tokens per sequence after the append",
        ),
        KernelArg::write("k_cache", "void* __restrict__", "cached keys `[batch, capacity, groups, head_dim]`"),
        KernelArg::write("v_cache", "void* __restrict__", "cached values, as `k_cache`"),
        KernelArg::scalar("new_row", "u64", "elements between two tokens' rows of `k_new` / `v_new`"),
        KernelArg::scalar("batch", "u32", "sequences"),
        KernelArg::scalar("groups", "u32", "key/value heads"),
        KernelArg::scalar("capacity", "u32", "positions per sequence in the cache"),
        KernelArg::scalar("s", "u32", "new tokens per sequence"),
        KernelArg::read("kv_scales", "const float* __restrict__", KV_SCALES_DOC).when(ArgCond::Fp8KvCache),
    ];
}

/// The E4M3 cache's scales, one buffer for every kernel that uses them (these and
/// [`super::QkvRopeSpec`]'s append).
pub(super) const KV_SCALES_DOC: &str =
    "f32 `[4]`: `k_scale, v_scale` (the append multiplies by them before the cast), \
                             `k_scale_inv, v_scale_inv` (the split kernel's dequantization)";

impl Family for DecodeAttnSpec {
    fn family(&self) -> &'static str {
        "decode_attn"
    }
    fn template(&self) -> &'static str {
        "decode_attn.cu.tera"
    }
    fn name_parts(&self) -> String {
        let kv = if self.fp8_cache() { "_kv_e4m3" } else { "" };
        let qg = if self.q_per_block > 1 { format!("_qg{}", self.q_per_block) } else { String::new() };
        format!("{}_d{}{kv}{qg}", self.dtype, self.head_dim)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("d", &self.head_dim);
        ctx.insert("lanes", &self.lanes());
        ctx.insert("ch", &self.channels_per_thread());
        ctx.insert("q_per_block", &self.q_per_block);
        ctx.insert("threads", &Self::THREADS);
        ctx.insert("max_splits", &Self::MAX_SPLITS);
        ctx.insert("kv_t", self.kv_cache.type_tag());
        ctx.insert("fp8_kv", &self.fp8_cache());
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &["", "_combine", "_append"]
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.dtype, DType::BF16 | DType::F16) {
            return Err(format!("decode attention takes bf16 or f16, not {}", self.dtype));
        }
        if self.head_dim == 0 || self.head_dim % 8 != 0 || self.head_dim > DECODE_MAX_HEAD_DIM {
            return Err(format!("head_dim = {} must be a multiple of 8 in [8, {DECODE_MAX_HEAD_DIM}]", self.head_dim));
        }
        if self.q_per_block == 0 || self.q_per_block > Self::MAX_Q_PER_BLOCK {
            return Err(format!("q_per_block = {} must be in [1, {}]", self.q_per_block, Self::MAX_Q_PER_BLOCK));
        }
        if self.kv_cache != self.dtype && self.kv_cache != DType::E4M3 {
            return Err(format!(
                "the KV cache holds {} (the queries' dtype) or e4m3 codes, not {}",
                self.dtype, self.kv_cache
            ));
        }
        Ok(())
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Fp8KvCache => self.fp8_cache(),
            _ => false,
        }
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            0 => Self::SPLIT_ARGS,
            1 => Self::COMBINE_ARGS,
            _ => Self::APPEND_ARGS,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::KernelSpec;

    #[test]
    fn lanes_cover_the_head_with_16_byte_loads() {
        let lanes = |d| DecodeAttnSpec::new(DType::BF16, d, Arch::Sm90a).lanes();
        assert_eq!([lanes(32), lanes(64), lanes(96), lanes(128), lanes(256), lanes(8)], [4, 8, 16, 16, 32, 1]);
        assert_eq!(
            [(8, 8), (4, 1), (32, 8), (28, 4), (14, 2), (12, 4), (6, 1), (8, 0)]
                .map(|(h, g)| DecodeAttnSpec::q_per_block_for(h, g)),
            [1, 4, 4, 1, 1, 3, 3, 1]
        );
        let grouped = DecodeAttnSpec::new(DType::BF16, 256, Arch::Sm90a).with_q_per_block(4);
        grouped.validate().unwrap();
        assert_eq!(KernelSpec::from(grouped).name(), "te_decode_attn_bf16_d256_qg4_sm_90a");
        assert_eq!(grouped.with_fp8_cache().channels_per_thread(), 8);
        assert!(grouped.with_q_per_block(5).validate().unwrap_err().contains("q_per_block"));
        let fp8 = |d| DecodeAttnSpec::new(DType::BF16, d, Arch::Sm90a).with_fp8_cache();
        assert_eq!([fp8(64).lanes(), fp8(256).lanes(), fp8(40).lanes()], [4, 16, 8]);
        assert_eq!([fp8(64).channels_per_thread(), fp8(40).channels_per_thread()], [16, 8]);
        let s = DecodeAttnSpec::new(DType::F16, 128, Arch::Sm89);
        assert_eq!(s.keys_per_step(), 8);
        assert_eq!(KernelSpec::from(s).name(), "te_decode_attn_f16_d128_sm_89");
        assert_eq!(
            KernelSpec::from(s).entry_points(),
            [
                "te_decode_attn_f16_d128_sm_89",
                "te_decode_attn_f16_d128_sm_89_combine",
                "te_decode_attn_f16_d128_sm_89_append"
            ]
        );
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let spec = |dtype, d| DecodeAttnSpec::new(dtype, d, Arch::Sm90a).validate();
        assert!(spec(DType::F32, 64).unwrap_err().contains("bf16 or f16"));
        assert!(spec(DType::BF16, 60).unwrap_err().contains("multiple of 8"));
        assert!(spec(DType::BF16, 512).unwrap_err().contains("256"));
        spec(DType::BF16, 64).unwrap();
    }
}
