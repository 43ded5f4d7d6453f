//! The kernel arguments of each flash-attention entry point ([`KernelArg`] lists, declared
//! once): the templates' signatures are rendered from them and the launchers push against them.

use super::FlashAttnSpec;
use crate::spec::{ArgCond, KernelArg, TMA_DESC};

impl FlashAttnSpec {
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
