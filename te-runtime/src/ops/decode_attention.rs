//! Family 15 launchers: attention of a generation step over a KV cache
//! ([`te_codegen::spec::DecodeAttnSpec`]): [`append_kv`] writes the new tokens' keys and values
//! into the cache, [`decode`] attends one query per sequence and head over the cached tokens
//! (split-K over the cache, FlashDecoding, so a long context uses every SM); [`append_kv_fp8`]
//! and [`decode_fp8`] do the same over an E4M3 cache with per-tensor scales ([`KvScales`]:
//! half the cache's bytes, vLLM's `kv_cache_dtype="fp8"`). The cached lengths
//! are an i32 device array the caller fills, so the launches of one cache (their grids follow
//! its capacity) can be captured in a CUDA graph and replayed as the lengths grow.
//!
//! The cache of one layer is `k`, `v`: `[batch, capacity, groups, head_dim]` each (TE's
//! `InferenceParams` keeps `[max_seq, batch, groups, head_dim]`; batch-major keeps each
//! sequence's keys contiguous for the split reads).

use super::attention_shape::AttentionShape;
use super::flash_attention::addresses;
use super::launch::Launch;
use super::{check_dtype, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::{DecodeAttnSpec, DECODE_MAX_HEAD_DIM};
use te_codegen::{DType, KernelSpec};

const OP: &str = "decode attention";

/// A tensor read or written from an element offset with a stride: element `x` of head `h` of
/// row `r` is at `offset + r · row + h · head_dim + x` (rows are sequences for queries and
/// outputs, `token · batch + sequence` for new keys and values: the `[s, b, ..]` rows of the
/// fused QKV projection's output).
#[derive(Debug, Clone, Copy)]
pub struct Strided<'a> {
    /// The tensor.
    pub tensor: &'a Tensor,
    /// Element offset of row 0, head 0 (a multiple of 8).
    pub offset: usize,
    /// Elements between rows (a multiple of 8).
    pub row: usize,
}

/// The per-tensor scales of an E4M3 KV cache (vLLM's `kv_cache_dtype="fp8"` with `k_scale` /
/// `v_scale`): f32 `[4]` on the device, `k_scale, v_scale, k_scale_inv, v_scale_inv`. The
/// append stores `E4M3(x · scale)` (round to nearest even, saturating at ±448), the decode reads
/// `code · scale_inv`; a scale of 1 keeps values up to 448 (what an uncalibrated vLLM cache
/// does). In device memory, so a captured step replays with scales set later.
#[derive(Debug, Clone, Copy)]
pub struct KvScales<'a>(pub &'a CudaSlice<f32>);

impl KvScales<'_> {
    /// The 4 floats of the buffer for `k_scale` and `v_scale`: `[k_scale, v_scale, 1 /
    /// k_scale, 1 / v_scale]`. `448 / scale` is the largest magnitude kept.
    ///
    /// # Errors
    /// [`Error::Argument`] for scales that are not finite and positive.
    pub fn values(k_scale: f32, v_scale: f32) -> Result<[f32; 4]> {
        if !(k_scale.is_finite() && k_scale > 0.0 && v_scale.is_finite() && v_scale > 0.0) {
            return Err(Error::Argument {
                op: OP,
                message: format!("kv scales must be finite and > 0, got {k_scale} and {v_scale}"),
            });
        }
        Ok([k_scale, v_scale, 1.0 / k_scale, 1.0 / v_scale])
    }
}

/// Checks a decode call's shape: valid ([`AttentionShape::validate`]) and the decode problem
/// ([`AttentionShape::decode`]: one query per sequence over its cached keys), within the
/// kernels' grid and head dims.
fn check(p: &AttentionShape) -> Result<()> {
    p.validate(OP)?;
    let shape = |message: String| Err(Error::Shape { op: OP, message });
    // A sliding window (left, 0) of the causal mask is taken: the split kernel starts there.
    let window = if p.window.0 >= 0 && p.window.1 == 0 { Some(p.window) } else { None };
    let decode =
        AttentionShape::decode(p.batch, p.heads, p.groups, p.head_dim, p.sk, p.scale).with_sliding_window(window);
    if *p != decode {
        return shape(format!(
            "the decode kernels attend one query per sequence over its cached keys: sq = 1, the bshd cache's capacity \
             as sk, one head dim, padding_causal_bottom_right with no window or a sliding one (left, 0), no dropout (AttentionShape::decode); \
             got sq = {}, head_dim_v = {} (head_dim {}), {} {} window {:?}, dropout {:?}",
            p.sq,
            p.head_dim_v,
            p.head_dim,
            p.layout.name(),
            p.mask.name(),
            p.window,
            p.dropout
        ));
    }
    if p.batch * p.heads > 65_535 || p.sk > i32::MAX as usize {
        return shape(format!(
            "batch · heads = {} must be at most 65 535 and the capacity at most 2³¹ − 1",
            p.batch * p.heads
        ));
    }
    if p.head_dim % 8 != 0 || p.head_dim > DECODE_MAX_HEAD_DIM {
        return shape(format!("head_dim = {} must be a multiple of 8 up to {DECODE_MAX_HEAD_DIM}", p.head_dim));
    }
    Ok(())
}

/// The cache of one layer for a decode shape: `k` and `v` each `[batch, capacity, groups,
/// head_dim]` (`capacity` = the shape's `sk`).
pub fn cache_shape(p: &AttentionShape) -> [usize; 4] {
    [p.batch, p.sk, p.groups, p.head_dim]
}

/// `(splits, chunk)` of a decode shape: key chunks per query and keys per chunk, so that `batch ·
/// heads / q_per_block · splits` blocks give each of the `sm_count` SMs about [`BLOCKS_PER_SM`] (enough loads in
/// flight to stream the cache), with chunks of at least 32 keys (of the `capacity = sk` cached
/// positions).
pub fn splits(p: &AttentionShape, sm_count: usize) -> (usize, usize) {
    let blocks = p.batch * p.heads / DecodeAttnSpec::q_per_block_for(p.heads, p.groups);
    let want = (BLOCKS_PER_SM * sm_count).div_ceil(blocks.max(1)).max(1);
    let splits = want.min((p.sk / 32).max(1)).min(DecodeAttnSpec::MAX_SPLITS);
    (splits, p.sk.div_ceil(splits))
}

/// Split-kernel blocks of 128 threads per SM that [`splits`] aims at (16 warps: at 2, GPT
/// `small`'s 384 queries of batch 32 ran one chunk each at 12 warps an SM).
pub const BLOCKS_PER_SM: usize = 4;

/// Checks that `t` holds `rows` rows of `width` elements from its offset at its row stride, at
/// 16-byte alignment.
fn check_strided(arg: &str, t: &Strided<'_>, rows: usize, width: usize) -> Result<()> {
    if t.offset % 8 != 0 || t.row % 8 != 0 {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "`{arg}`: offset {} and row stride {} must be multiples of 8 elements (16-byte loads)",
                t.offset, t.row
            ),
        });
    }
    let needed = t.offset + (rows - 1) * t.row + width;
    if needed > t.tensor.numel() {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "`{arg}` holds {} elements; {rows} rows of {width} at offset {} and stride {} reach {needed}",
                t.tensor.numel(),
                t.offset,
                t.row
            ),
        });
    }
    Ok(())
}

/// Checks the caches: `[batch, capacity, groups, head_dim]` of `dtype` (the queries'), or E4M3
/// codes when `scales` are given (which must hold 4 floats).
fn check_cache(p: &AttentionShape, dtype: DType, k: &Tensor, v: &Tensor, scales: Option<&KvScales>) -> Result<()> {
    let (want, same) = match scales {
        Some(sc) => {
            if sc.0.len() < 4 {
                return Err(Error::Shape {
                    op: OP,
                    message: format!(
                        "`kv_scales` holds {} floats: an E4M3 cache takes 4 (k_scale, v_scale, k_scale_inv, v_scale_inv)",
                        sc.0.len()
                    ),
                });
            }
            (DType::E4M3, "e4m3 (a cache with kv_scales)".to_string())
        }
        None => (dtype, format!("{dtype} (the dtype of the queries and keys)")),
    };
    for (arg, t) in [("k_cache", k), ("v_cache", v)] {
        check_dtype(OP, arg, t, |d| d == want, &same)?;
        if t.shape() != cache_shape(p) {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "`{arg}` must be [batch, capacity, groups, head_dim] = {:?}, got {:?}",
                    cache_shape(p),
                    t.shape()
                ),
            });
        }
    }
    Ok(())
}

fn check_seqlens(p: &AttentionShape, seqlens: &CudaSlice<i32>) -> Result<()> {
    if seqlens.len() < p.batch {
        return Err(Error::Shape {
            op: OP,
            message: format!("`seqlens` holds {} lengths for a batch of {}", seqlens.len(), p.batch),
        });
    }
    Ok(())
}

/// Writes `s` new tokens per sequence into the cache `[k_cache, v_cache]` of the decode shape `p`
/// ([`AttentionShape::decode`], `capacity = p.sk`): the keys of token `i` of sequence `b` (`k_new`
/// row `i · batch + b`, `groups · head_dim` elements) and likewise the values go to position
/// `seqlens[b] − s + i` (`seqlens`: the lengths *after* the append; positions outside `[0,
/// capacity)` are skipped).
///
/// # Errors
/// [`Error::DType`] for dtypes other than bf16/f16 or that differ; [`Error::Shape`] for a shape
/// that is not valid or not the decode problem (one query per sequence, one head dim, the cache's
/// mask, no dropout; `groups` dividing `heads`, a head dim a multiple of 8 up to 256), caches not
/// `[batch, capacity, groups, head_dim]`, strides or offsets not multiples of 8, tensors smaller
/// than their strides reach, too few lengths, `s = 0`; [`Error::Argument`] for a `scale` that is
/// not finite and positive; compile and launch failures.
pub fn append_kv(
    dev: &Device,
    p: &AttentionShape,
    s: usize,
    new: [Strided<'_>; 2],
    seqlens: &CudaSlice<i32>,
    cache: [&mut Tensor; 2],
) -> Result<()> {
    append(dev, p, s, new, seqlens, cache, None)
}

/// [`append_kv`] into an E4M3 cache: each new key is stored as `E4M3(k · k_scale)`, each value
/// as `E4M3(v · v_scale)` ([`KvScales`]).
///
/// # Errors
/// As [`append_kv`], for E4M3 caches; [`Error::Shape`] for `scales` of fewer than 4 floats.
pub fn append_kv_fp8(
    dev: &Device,
    p: &AttentionShape,
    s: usize,
    new: [Strided<'_>; 2],
    seqlens: &CudaSlice<i32>,
    cache: [&mut Tensor; 2],
    scales: KvScales<'_>,
) -> Result<()> {
    append(dev, p, s, new, seqlens, cache, Some(&scales))
}

#[allow(clippy::too_many_arguments)] // append_kv's arguments and the optional scales
fn append(
    dev: &Device,
    p: &AttentionShape,
    s: usize,
    [k_new, v_new]: [Strided<'_>; 2],
    seqlens: &CudaSlice<i32>,
    [k_cache, v_cache]: [&mut Tensor; 2],
    scales: Option<&KvScales<'_>>,
) -> Result<()> {
    let dtype = k_new.tensor.dtype();
    check_dtype(OP, "k_new", k_new.tensor, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    check_dtype(OP, "v_new", v_new.tensor, |d| d == dtype, &dtype.to_string())?;
    check(p)?;
    if s == 0 || k_new.row != v_new.row {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "s = {s} must be ≥ 1 and k_new, v_new share a row stride ({} vs {})",
                k_new.row, v_new.row
            ),
        });
    }
    check_cache(p, dtype, k_cache, v_cache, scales)?;
    check_seqlens(p, seqlens)?;
    let width = p.groups * p.head_dim;
    check_strided("k_new", &k_new, s * p.batch, width)?;
    check_strided("v_new", &v_new, s * p.batch, width)?;
    let spec = kernels(p, dtype, dev, scales);
    let f = dev.function(&KernelSpec::DecodeAttn(spec), 2)?;
    let threads = DecodeAttnSpec::THREADS;
    let chunks = s * p.batch * p.groups * (p.head_dim / 8);
    let cfg = launch_1d(chunks.div_ceil(threads).min(dev.sm_count() * 16), threads, 0);
    let stream = dev.stream();
    let ([k_addr, v_addr], _guards) = addresses(stream, [(k_new.tensor, k_new.offset), (v_new.tensor, v_new.offset)]);
    let (row, batch, groups, capacity, s_arg) =
        (k_new.row as u64, p.batch as u32, p.groups as u32, p.sk as u32, s as u32);
    let mut l = Launch::new(OP, stream, &f, &spec, 2);
    l.ptr("k_new", &k_addr).ptr("v_new", &v_addr).ptr("seqlens", seqlens);
    l.ptr("k_cache", k_cache.data_mut()?).ptr("v_cache", v_cache.data_mut()?);
    l.scalar("new_row", &row).scalar("batch", &batch).scalar("groups", &groups);
    l.scalar("capacity", &capacity).scalar("s", &s_arg);
    if let Some(sc) = scales {
        l.ptr("kv_scales", sc.0);
    }
    // SAFETY: k_new and v_new hold `s · batch` rows of `groups · head_dim` elements from their
    // offsets at their stride, the caches `batch · capacity · groups · head_dim` elements, all of
    // the spec's dtype (the caches E4M3 with 4 scales when the spec says so), aligned (checked
    // above); `seqlens` holds `batch` i32; the kernel
    // writes only cache positions inside `[0, capacity)`; the caches are distinct allocations
    // (`&mut`), apart from the new tokens (`&`).
    unsafe { l.launch(cfg) }
}

/// `o = softmax(scale · q · Kᵀ) · V` (the decode shape `p`, [`AttentionShape::decode`]) of one
/// query per sequence and head over the sequence's
/// `seqlens[b]` cached tokens (positions `0..seqlens[b]` of the cache, capped by its capacity;
/// a sequence of length 0 gets zeros). `q` and `out` (with its row stride): rows are sequences,
/// `heads · head_dim` elements each (head `h` at `h · head_dim`). Math in f32; the splits'
/// partial results go to a workspace allocated here (f32 `batch · heads · splits · (head_dim +
/// 2)`).
///
/// # Errors
/// As [`append_kv`], for `q` and `out` (`out` of q's dtype).
pub fn decode(
    dev: &Device,
    p: &AttentionShape,
    q: Strided<'_>,
    cache: [&Tensor; 2],
    seqlens: &CudaSlice<i32>,
    out: (&mut Tensor, usize),
) -> Result<()> {
    attend(dev, p, q, cache, seqlens, out, None)
}

/// [`decode`] over an E4M3 cache ([`append_kv_fp8`]): keys and values read as `code ·
/// scale_inv` in f32.
///
/// # Errors
/// As [`decode`], for E4M3 caches; [`Error::Shape`] for `scales` of fewer than 4 floats.
pub fn decode_fp8(
    dev: &Device,
    p: &AttentionShape,
    q: Strided<'_>,
    cache: [&Tensor; 2],
    scales: KvScales<'_>,
    seqlens: &CudaSlice<i32>,
    out: (&mut Tensor, usize),
) -> Result<()> {
    attend(dev, p, q, cache, seqlens, out, Some(&scales))
}

/// The kernels of a call: the queries' dtype, over an E4M3 cache with `scales`.
fn kernels(p: &AttentionShape, dtype: DType, dev: &Device, scales: Option<&KvScales<'_>>) -> DecodeAttnSpec {
    let spec = p.decode_spec(dtype, dev.arch());
    if scales.is_some() {
        spec.with_fp8_cache()
    } else {
        spec
    }
}

#[allow(clippy::too_many_arguments)] // decode's arguments and the optional scales
fn attend(
    dev: &Device,
    p: &AttentionShape,
    q: Strided<'_>,
    [k_cache, v_cache]: [&Tensor; 2],
    seqlens: &CudaSlice<i32>,
    (out, out_row): (&mut Tensor, usize),
    scales: Option<&KvScales<'_>>,
) -> Result<()> {
    let dtype = q.tensor.dtype();
    check_dtype(OP, "q", q.tensor, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    check_dtype(OP, "out", out, |d| d == dtype, &dtype.to_string())?;
    check(p)?;
    check_cache(p, dtype, k_cache, v_cache, scales)?;
    check_seqlens(p, seqlens)?;
    let width = p.heads * p.head_dim;
    check_strided("q", &q, p.batch, width)?;
    check_strided("out", &Strided { tensor: out, offset: 0, row: out_row }, p.batch, width)?;
    let spec = kernels(p, dtype, dev, scales);
    let kernel = KernelSpec::DecodeAttn(spec);
    let (split_f, combine_f) = (dev.function(&kernel, 0)?, dev.function(&kernel, 1)?);
    let (splits, chunk) = splits(p, dev.sm_count());
    let queries = p.batch * p.heads;
    let stream = dev.stream();
    // SAFETY: f32 has no invalid bit patterns; the split kernel writes every element (each block
    // its split's head_dim outputs and two scalars) before the combine kernel reads them.
    let mut o_partial = unsafe { stream.alloc::<f32>(queries * splits * p.head_dim) }?;
    let mut ml_partial = unsafe { stream.alloc::<f32>(queries * splits * 2) }?;
    let (q_row, heads, groups, capacity) = (q.row as u64, p.heads as u32, p.groups as u32, p.sk as u32);
    let (splits_arg, chunk_arg, scale_log2) = (splits as u32, chunk as u32, p.scale * std::f32::consts::LOG2_E);
    let threads = DecodeAttnSpec::THREADS as u32;
    {
        let ([q_addr], _guards) = addresses(stream, [(q.tensor, q.offset)]);
        let mut l = Launch::new(OP, stream, &split_f, &spec, 0);
        l.ptr("q", &q_addr).ptr("k_cache", k_cache.data()).ptr("v_cache", v_cache.data()).ptr("seqlens", seqlens);
        l.ptr("o_partial", &mut o_partial).ptr("ml_partial", &mut ml_partial);
        l.scalar("q_batch", &q_row).scalar("heads", &heads).scalar("groups", &groups);
        l.scalar("capacity", &capacity).scalar("splits", &splits_arg).scalar("chunk", &chunk_arg);
        let window_left = if p.window.0 >= 0 { p.window.0.min(i64::from(i32::MAX)) as i32 } else { -1 };
        l.scalar("scale_log2", &scale_log2).scalar("window_left", &window_left);
        if let Some(sc) = scales {
            l.ptr("kv_scales", sc.0);
        }
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, (queries / spec.q_per_block) as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: q holds `batch` rows of `heads · head_dim` elements from its offset at its
        // stride, the caches `[batch, capacity, groups, head_dim]`, seqlens `batch` i32 (checked
        // above); the partial buffers hold `queries · splits` entries, one per block and head
        // (q_per_block divides heads / groups, so a block's heads are queries of one sequence).
        unsafe { l.launch(cfg) }?;
    }
    let o_row = out_row as u64;
    let mut l = Launch::new(OP, stream, &combine_f, &spec, 1);
    l.ptr("o_partial", &o_partial).ptr("ml_partial", &ml_partial).ptr("o", out.data_mut()?);
    l.scalar("o_batch", &o_row).scalar("heads", &heads).scalar("splits", &splits_arg);
    // SAFETY: the partial buffers were written in full by the split kernel before (same
    // stream); out holds `batch` rows of `heads · head_dim` elements at its stride (checked).
    unsafe { l.launch(launch_1d(queries, DecodeAttnSpec::THREADS, 0)) }
}

#[cfg(test)]
mod tests {
    use super::super::attention_shape::QkvLayout;
    use super::*;
    use te_codegen::spec::AttnMaskType;

    #[test]
    fn splits_fill_the_gpu_with_chunks_of_32_keys_or_more() {
        let p = AttentionShape::decode(1, 12, 12, 64, 1024, 0.125);
        assert_eq!(splits(&p, 132), (32, 32));
        let p = AttentionShape { batch: 32, ..p };
        assert_eq!(splits(&p, 132), (2, 512));
        let p = AttentionShape { sk: 40, ..p };
        assert_eq!(splits(&p, 132), (1, 40));
        let p = AttentionShape { batch: 1, sk: 100, ..p };
        assert_eq!(splits(&p, 132), (3, 34));
        // Gemma 3: 4 query heads over one KV head, one block serves the 4.
        let gemma = AttentionShape::decode(32, 4, 1, 256, 1100, 0.0625);
        assert_eq!(splits(&gemma, 132), (17, 65));
        assert_eq!(cache_shape(&p), [1, 100, 12, 64]);
    }

    #[test]
    fn only_the_decode_problem_is_taken() {
        let p = AttentionShape::decode(2, 8, 2, 64, 300, 0.125);
        check(&p).unwrap();
        let e = |p: AttentionShape| check(&p).unwrap_err().to_string();
        assert!(e(AttentionShape { sq: 2, ..p }).contains("sq = 2"));
        assert!(e(p.with_head_dim_v(32)).contains("head_dim_v = 32"));
        assert!(e(p.with_mask(AttnMaskType::Padding, None)).contains("padding window"));
        assert!(e(AttentionShape { layout: QkvLayout::Sbhd, ..p }).contains("sbhd"));
        assert!(e(AttentionShape { groups: 3, ..p }).contains("groups dividing heads"));
        assert!(e(AttentionShape { head_dim: 60, head_dim_v: 60, ..p }).contains("multiple of 8"));
        assert!(e(AttentionShape { batch: 10_000, ..p }).contains("65 535"));
        assert!(e(p.with_scale(f32::INFINITY)).contains("softmax_scale"));
    }
}
