//! The KV cache of [`super::Decoder`] and the tables of one step over it.
//!
//! The cache of each layer is `k`, `v`: `[batch, capacity, groups, head_dim]` (the layout of
//! `ops::decode_attention`), sequence `j`'s token at position `p` in row `j · capacity + p`.
//! The host keeps each sequence's length. A step feeds any number of new tokens per sequence
//! (packed, sequence after sequence, TE's `thd`): the fused QKV + RoPE kernel writes their keys
//! and values at their rows; the attention of a step where every sequence takes one token runs
//! the split-K decode kernels over the cache, any other step (a prompt, a chunk of one, a window
//! of perplexity) the fused attention over the cache with `cu_seqlens` (queries packed, keys at
//! the sequences' cache offsets, bottom-right causal so a chunk after cached tokens sees them).
//!
//! Sliding-window layers keep only their window: when the cache holds more tokens per sequence
//! than `window + chunk` (`chunk`: the most tokens a step feeds a sequence,
//! [`DEFAULT_PREFILL_CHUNK`] unless set), those layers get buffers of `window + chunk` rows a
//! sequence instead of `capacity`, sequence `j`'s position `p` in row `j · (window + chunk) + p −
//! base_j`. Before a step that would overflow them, [`DecoderCache::make_room`] moves the last
//! `window` positions of the sequence to the front (`base_j` grows; positions older than the window
//! are never read again). Keys are cached after RoPE at their absolute positions and every mask is
//! aligned at the bottom right, so the attention over the shifted rows is the same. Longer prompts
//! run in chunks ([`super::Decoder::forward_step`]). Gemma 3 270M at 32k tokens: 124 MB a sequence
//! instead of 604 MB.
//!
//! An E4M3 cache ([`DecoderCache::with_chunk_dtype`], vLLM's `kv_cache_dtype="fp8"`) holds the
//! codes of `k · k_scale` and `v · v_scale` (per-tensor scales in device memory, 1 until
//! [`DecoderCache::set_kv_scales`]): half the bytes, which the decode step reads. The fused QKV +
//! RoPE kernel writes the codes, the decode kernels read them back; a prefill step dequantizes
//! the layer's rows into a BF16 scratch of one layer (its own view's rows) for the fused
//! attention.

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::AttnMaskType;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::cast::dequantize;
use te_runtime::ops::decode_attention::KvScales;
use te_runtime::ops::qkv_rope::TokenRows;
use te_runtime::{Device, Tensor};

/// The most tokens a step feeds one sequence when the sliding-window layers keep only their
/// window (longer prompts run in chunks of this many).
pub const DEFAULT_PREFILL_CHUNK: usize = 1024;

/// The KV cache of every layer for `batch` sequences of up to `capacity` tokens each.
#[derive(Debug)]
pub struct DecoderCache {
    batch: usize,
    capacity: usize,
    heads: usize,
    layers: Vec<[Tensor; 2]>,
    lens: Vec<usize>,
    /// The sliding-window layers' smaller buffers, when they are smaller.
    sliding: Option<SlidingRows>,
    /// An E4M3 cache's scales, f32 `[4]` (`KvScales`); `None`: BF16.
    kv_scales: Option<CudaSlice<f32>>,
    /// An E4M3 cache's BF16 scratch for a prefill's fused attention: one `[k, v]` per layer
    /// shape (the global layers' and the sliding layers'), made at the first prefill.
    scratch: Vec<[Tensor; 2]>,
}

/// Where the sliding-window layers keep their rows (see the module docs).
#[derive(Debug)]
struct SlidingRows {
    /// Rows a sequence: `keep + chunk`.
    capacity: usize,
    /// Positions kept when the rows are full: the widest window.
    keep: usize,
    /// Each sequence's first position still cached.
    bases: Vec<usize>,
    /// Whether layer `l` uses these rows.
    layers: Vec<bool>,
}

/// One way of addressing the cache: the rows a sequence, each sequence's first cached position.
#[derive(Debug, Clone, Copy)]
struct View<'a> {
    capacity: usize,
    bases: Option<&'a [usize]>,
}

impl View<'_> {
    fn base(&self, j: usize) -> usize {
        self.bases.map_or(0, |b| b[j])
    }
}

impl DecoderCache {
    /// An empty cache (BF16) for `cfg`'s layers.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for a zero batch or capacity, or a capacity beyond the model's
    /// `max_position_embeddings`; out of memory.
    pub fn new(dev: &Arc<Device>, cfg: &DecoderConfig, batch: usize, capacity: usize) -> DecoderResult<Self> {
        Self::with_chunk(dev, cfg, batch, capacity, DEFAULT_PREFILL_CHUNK)
    }

    /// An empty cache whose sliding-window layers keep `window + chunk` rows a sequence when that
    /// is less than `capacity` (a step then feeds a sequence at most `chunk` tokens; see the
    /// module docs).
    ///
    /// # Errors
    /// As [`DecoderCache::new`], and [`DecoderError::Input`] for `chunk` 0.
    pub fn with_chunk(
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        batch: usize,
        capacity: usize,
        chunk: usize,
    ) -> DecoderResult<Self> {
        Self::with_chunk_dtype(dev, cfg, batch, capacity, chunk, DType::BF16)
    }

    /// [`DecoderCache::with_chunk`] holding `dtype`: BF16, or E4M3 codes with per-tensor scales
    /// (see the module docs; zeroed, scales 1).
    ///
    /// # Errors
    /// As [`DecoderCache::with_chunk`], and [`DecoderError::Input`] for another dtype.
    pub fn with_chunk_dtype(
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        batch: usize,
        capacity: usize,
        chunk: usize,
        dtype: DType,
    ) -> DecoderResult<Self> {
        check_kv_dtype(dtype)?;
        if batch == 0 || capacity == 0 || chunk == 0 {
            return Err(DecoderError::input(format!(
                "a KV cache needs batch ≥ 1, capacity ≥ 1 and a prefill chunk ≥ 1, got {batch}, {capacity}, {chunk}"
            )));
        }
        if capacity > cfg.max_position_embeddings {
            return Err(DecoderError::input(format!(
                "{capacity} tokens per sequence exceed the model's max_position_embeddings = {}: shorten the prompt or \
                 the number of new tokens",
                cfg.max_position_embeddings
            )));
        }
        let windows: Vec<Option<usize>> =
            (0..cfg.num_layers).map(|l| cfg.layer_window(l).map(|(left, _)| left as usize + 1)).collect();
        let keep = windows.iter().flatten().copied().max();
        let sliding = keep.filter(|&k| k + chunk < capacity).map(|keep| SlidingRows {
            capacity: keep + chunk,
            keep,
            bases: vec![0; batch],
            layers: windows.iter().map(Option::is_some).collect(),
        });
        let layers = (0..cfg.num_layers)
            .map(|l| {
                let rows = match &sliding {
                    Some(s) if s.layers[l] => s.capacity,
                    _ => capacity,
                };
                let shape = [batch, rows, cfg.num_gqa_groups, cfg.head_dim];
                // E4M3 zeroed: a prefill dequantizes every row of a layer, the unwritten too.
                let make = || match dtype {
                    DType::E4M3 => Tensor::zeros(dev, dtype, &shape),
                    _ => Tensor::empty(dev, dtype, &shape),
                };
                Ok([make()?, make()?])
            })
            .collect::<DecoderResult<Vec<_>>>()?;
        let kv_scales = match dtype {
            DType::E4M3 => Some(dev.stream().htod(&KvScales::values(1.0, 1.0)?)?),
            _ => None,
        };
        Ok(Self {
            batch,
            capacity,
            heads: cfg.num_attention_heads,
            layers,
            lens: vec![0; batch],
            sliding,
            kv_scales,
            scratch: Vec::new(),
        })
    }

    /// What the cache holds: BF16, or E4M3 codes.
    pub fn dtype(&self) -> DType {
        if self.kv_scales.is_some() {
            DType::E4M3
        } else {
            DType::BF16
        }
    }

    /// The per-tensor scales of an E4M3 cache: keys are stored as `E4M3(k · k_scale)` and read
    /// as `code / k_scale` (values likewise); `448 / k_scale` is the largest key kept (1, the
    /// default: up to 448, as an uncalibrated vLLM cache). Every layer's, from the next step on
    /// (tokens cached before keep the scales they were stored with: set them before the
    /// prompt). A host upload: not inside a capture.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for a BF16 cache; scales that are not finite and positive;
    /// the device's errors.
    pub fn set_kv_scales(&mut self, dev: &Device, k_scale: f32, v_scale: f32) -> DecoderResult<()> {
        let Some(buf) = self.kv_scales.as_mut() else {
            return Err(DecoderError::input("the cache holds bf16: kv scales are for an e4m3 cache"));
        };
        let values = KvScales::values(k_scale, v_scale)?;
        let stream = dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "DecoderCache::set_kv_scales")?;
        stream.memcpy_htod(&values, buf).map_err(te_runtime::Error::from)?;
        Ok(())
    }

    /// Sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per sequence at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Tokens cached per sequence.
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Bytes of the caches on the device (with an E4M3 cache's prefill scratch once made).
    pub fn bytes(&self) -> usize {
        self.layers.iter().chain(&self.scratch).flatten().map(Tensor::num_bytes).sum()
    }

    /// Rows a sequence of the sliding-window layers when they keep only their window (`window +
    /// chunk`), else `None` (every layer keeps `capacity` rows).
    pub fn sliding_capacity(&self) -> Option<usize> {
        self.sliding.as_ref().map(|s| s.capacity)
    }

    /// The most new tokens one step may feed a sequence (`None`: up to the capacity).
    pub fn max_step_tokens(&self) -> Option<usize> {
        self.sliding.as_ref().map(|s| s.capacity - s.keep)
    }

    /// Forgets every cached token (the memory stays).
    pub fn clear(&mut self) {
        self.lens.iter_mut().for_each(|l| *l = 0);
        if let Some(s) = &mut self.sliding {
            s.bases.iter_mut().for_each(|b| *b = 0);
        }
    }

    /// The global layers' view and the sliding layers' one (if they keep only their window).
    fn views(&self) -> (View<'_>, Option<View<'_>>) {
        let global = View { capacity: self.capacity, bases: None };
        (global, self.sliding.as_ref().map(|s| View { capacity: s.capacity, bases: Some(&s.bases) }))
    }

    /// Makes room in the sliding-window layers' rows for `new[j]` more tokens of sequence `j`:
    /// a sequence whose rows would overflow keeps its last `window` positions, moved to the
    /// front (device copies; outside any CUDA graph capture: the captured steps read the rows
    /// where this leaves them).
    ///
    /// # Errors
    /// [`DecoderError::Input`] for more new tokens than a step may feed
    /// ([`DecoderCache::max_step_tokens`]); the device's errors.
    pub(super) fn make_room(&mut self, dev: &Device, new: &[usize]) -> DecoderResult<()> {
        let Some(s) = &mut self.sliding else { return Ok(()) };
        let chunk = s.capacity - s.keep;
        for (j, &n) in new.iter().enumerate() {
            if n > chunk {
                return Err(DecoderError::input(format!(
                    "sequence {j}: {n} new tokens in one step, but the sliding-window layers take {chunk} at a time: \
                     feed it in chunks (Decoder::forward_step does)"
                )));
            }
            let stored = self.lens[j] - s.bases[j];
            if stored + n <= s.capacity {
                continue;
            }
            // Rows [stored − keep, stored) of sequence j to [0, keep): staged through a copy,
            // since the two ranges may overlap.
            let from = j * s.capacity + stored - s.keep;
            for (l, [k, v]) in self.layers.iter_mut().enumerate() {
                if !s.layers[l] {
                    continue;
                }
                for t in [k, v] {
                    let row = t.shape()[2] * t.shape()[3];
                    let staged = t.reshape(&[t.shape()[0] * t.shape()[1], row])?.narrow(dev, from..from + s.keep)?;
                    let bytes = row * t.dtype().size_bytes();
                    let dst = t.data_mut()?;
                    let mut view = dst.slice_mut(j * s.capacity * bytes..(j * s.capacity + s.keep) * bytes);
                    dev.stream().memcpy_dtod(staged.data(), &mut view).map_err(te_runtime::Error::from)?;
                }
            }
            s.bases[j] = self.lens[j] - s.keep;
        }
        Ok(())
    }

    pub(super) fn layer(&self, l: usize) -> [&Tensor; 2] {
        let [k, v] = &self.layers[l];
        [k, v]
    }

    /// Layer `l`'s caches to append to, with an E4M3 cache's scales.
    pub(super) fn layer_mut(&mut self, l: usize) -> ([&mut Tensor; 2], Option<KvScales<'_>>) {
        let [k, v] = &mut self.layers[l];
        ([k, v], self.kv_scales.as_ref().map(KvScales))
    }

    /// The scales of an E4M3 cache.
    pub(super) fn scales(&self) -> Option<KvScales<'_>> {
        self.kv_scales.as_ref().map(KvScales)
    }

    /// Layer `l`'s keys and values as the fused attention of a prefill reads them: the cache
    /// itself (BF16), or every row of an E4M3 cache dequantized into the scratch of its shape
    /// (made on first use).
    ///
    /// # Errors
    /// The device's errors (out of memory, launches).
    pub(super) fn prefill_layer(&mut self, dev: &Device, l: usize) -> DecoderResult<[&Tensor; 2]> {
        let Some(scales) = &self.kv_scales else {
            let [k, v] = &self.layers[l];
            return Ok([k, v]);
        };
        let shape = self.layers[l][0].shape().to_vec();
        let i = match self.scratch.iter().position(|[k, _]| k.shape() == shape.as_slice()) {
            Some(i) => i,
            None => {
                let make = || Tensor::empty(dev, DType::BF16, &shape);
                self.scratch.push([make()?, make()?]);
                self.scratch.len() - 1
            }
        };
        let [ks, vs] = &mut self.scratch[i];
        let [k, v] = &self.layers[l];
        dequantize(dev, k, &scales.slice(2..3), ks)?;
        dequantize(dev, v, &scales.slice(3..4), vs)?;
        let [ks, vs] = &self.scratch[i];
        Ok([ks, vs])
    }
}

/// Fails unless a cache can hold `dtype` (BF16 or E4M3).
pub(super) fn check_kv_dtype(dtype: DType) -> DecoderResult<()> {
    match dtype {
        DType::BF16 | DType::E4M3 => Ok(()),
        _ => Err(DecoderError::input(format!("a KV cache holds bf16 or e4m3, not {dtype}"))),
    }
}

/// The sizes of a step: sequences, the most new tokens of one, the most tokens of one after it.
#[derive(Debug, Clone, Copy)]
pub(super) struct StepShape {
    batch: usize,
    max_new: usize,
    max_total: usize,
    capacity: usize,
}

impl StepShape {
    /// The sizes of a step of `batch` attention sequences of at most `max_new` new and
    /// `max_total` cached tokens each, in a view of `capacity` rows a sequence.
    pub fn new(batch: usize, max_new: usize, max_total: usize, capacity: usize) -> Self {
        Self { batch, max_new, max_total, capacity }
    }

    fn base(&self, cfg: &DecoderConfig, layout: QkvLayout, (sq, sk): (usize, usize)) -> AttentionShape {
        AttentionShape::new(layout, self.batch, (sq, sk), (cfg.num_attention_heads, cfg.num_gqa_groups), cfg.head_dim)
            .with_scale(cfg.softmax_scale())
    }

    /// The decode kernels' problem: one query per sequence over the cache.
    pub fn decode_shape(&self, cfg: &DecoderConfig, window: Option<(i64, i64)>) -> AttentionShape {
        AttentionShape::decode(
            self.batch,
            cfg.num_attention_heads,
            cfg.num_gqa_groups,
            cfg.head_dim,
            self.capacity,
            cfg.softmax_scale(),
        )
        .with_sliding_window(window)
    }

    /// The fused attention's problem: packed queries over the sequences' cached keys, causal
    /// aligned at the bottom right (the new tokens are the last of each sequence).
    pub fn prefill_shape(&self, cfg: &DecoderConfig, window: Option<(i64, i64)>) -> AttentionShape {
        self.base(cfg, QkvLayout::Thd, (self.max_new, self.max_total))
            .with_mask(AttnMaskType::PaddingCausalBottomRight, window)
    }
}

/// How a step attends.
#[derive(Debug)]
pub(super) enum StepAttention {
    /// One new token per sequence: the split-K decode kernels over `seqlens` (i32 `[batch]`,
    /// cached rows after the step).
    Decode { seqlens: CudaSlice<i32> },
    /// The fused attention: `cu_q` (i32 `[batch + 1]` prefix sums of the new tokens, also their
    /// packed offsets), `cu_kv` (prefix sums of the cached rows after the step), `off_kv` (`j ·
    /// capacity`, the sequences' first rows), `lse` (f32 workspace).
    Prefill { cu_q: CudaSlice<i32>, cu_kv: CudaSlice<i32>, off_kv: CudaSlice<i32>, lse: CudaSlice<f32> },
}

/// A step's tables for the layers of one cache view: the new tokens' positions and rows, the
/// sizes, the attention's tables.
#[derive(Debug)]
pub(super) struct ViewTables {
    pub rows: TokenRows,
    pub shape: StepShape,
    pub attention: StepAttention,
}

/// A step's tables: the global layers', and the sliding-window layers' when they keep only their
/// window (else they use the global ones).
#[derive(Debug)]
pub(super) struct StepTables {
    pub global: ViewTables,
    pub sliding: Option<ViewTables>,
}

impl StepTables {
    /// The tables of a layer with sliding window `window` (or none).
    pub fn for_layer(&mut self, window: Option<(i64, i64)>) -> &mut ViewTables {
        match (&mut self.sliding, window) {
            (Some(s), Some(_)) => s,
            _ => &mut self.global,
        }
    }
}

/// One step over a cache: its tables.
pub(super) struct Step<'a> {
    pub cache: &'a mut DecoderCache,
    pub tables: &'a mut StepTables,
}

/// The device tables of a decode step (one new token per sequence) kept across steps at fixed
/// addresses, so that a CUDA graph captured over them replays every later step: the token ids,
/// their positions and cache rows, the rows cached after the step. [`DecodeTables::update`]
/// refills them (host copies, before a replay).
#[derive(Debug)]
pub(super) struct DecodeTables {
    pub ids: CudaSlice<i32>,
    pub tables: StepTables,
}

/// Positions, rows and rows cached after the step of `new[j]` tokens for sequence `j` in `view`,
/// with the view's sizes.
struct ViewPlan {
    positions: Vec<i32>,
    rows: Vec<i32>,
    totals: Vec<usize>,
    shape: StepShape,
}

fn view_plan(cache: &DecoderCache, view: View<'_>, new: &[usize]) -> DecoderResult<ViewPlan> {
    let (mut positions, mut rows, mut totals) = (Vec::new(), Vec::new(), Vec::with_capacity(new.len()));
    for (j, (&n, &past)) in new.iter().zip(&cache.lens).enumerate() {
        let base = view.base(j);
        if past + n > cache.capacity || past - base + n > view.capacity {
            return Err(DecoderError::input(format!(
                "sequence {j}: {past} cached and {n} new tokens exceed the cache's capacity of {}",
                cache.capacity
            )));
        }
        for p in past..past + n {
            positions.push(p as i32);
            rows.push((j * view.capacity + p - base) as i32);
        }
        totals.push(past - base + n);
    }
    let shape = StepShape {
        batch: cache.batch,
        max_new: new.iter().copied().max().unwrap_or(0),
        max_total: totals.iter().copied().max().unwrap_or(0),
        capacity: view.capacity,
    };
    Ok(ViewPlan { positions, rows, totals, shape })
}

fn to_i32(v: &[usize]) -> Vec<i32> {
    v.iter().map(|&x| x as i32).collect()
}

impl DecodeTables {
    /// The tables of the next step of `cache` with the token `ids[j]` for sequence `j` (room made
    /// by [`DecoderCache::make_room`] first).
    pub fn new(dev: &Device, cache: &DecoderCache, ids: &[i32]) -> DecoderResult<Self> {
        check_batch(cache, ids.len())?;
        let new = vec![1; cache.batch];
        let (global, sliding) = cache.views();
        let make = |view: View<'_>| -> DecoderResult<ViewTables> {
            let p = view_plan(cache, view, &new)?;
            Ok(ViewTables {
                rows: TokenRows::from_host(dev, &p.positions, &p.rows, cache.batch * view.capacity)?,
                shape: p.shape,
                attention: StepAttention::Decode { seqlens: dev.stream().htod(&to_i32(&p.totals))? },
            })
        };
        let tables = StepTables { global: make(global)?, sliding: sliding.map(make).transpose()? };
        Ok(Self { ids: dev.stream().htod(ids)?, tables })
    }

    /// Refills the tables in place for the next step of `cache` with the tokens `ids`.
    pub fn update(&mut self, dev: &Device, cache: &DecoderCache, ids: &[i32]) -> DecoderResult<()> {
        check_batch(cache, ids.len())?;
        te_runtime::graph::refuse_in_capture(dev.stream(), "DecodeTables::update")?;
        let new = vec![1; cache.batch];
        let (global, sliding) = cache.views();
        let fill = |t: &mut ViewTables, view: View<'_>| -> DecoderResult<()> {
            let p = view_plan(cache, view, &new)?;
            t.rows.update(dev, &p.positions, &p.rows)?;
            if let StepAttention::Decode { seqlens } = &mut t.attention {
                dev.stream().memcpy_htod(&to_i32(&p.totals), seqlens).map_err(te_runtime::Error::from)?;
            }
            Ok(())
        };
        fill(&mut self.tables.global, global)?;
        match (&mut self.tables.sliding, sliding) {
            (Some(t), Some(view)) => fill(t, view)?,
            (None, None) => {}
            _ => return Err(DecoderError::input("the decode tables were made for another cache")),
        }
        dev.stream().memcpy_htod(ids, &mut self.ids).map_err(te_runtime::Error::from)?;
        Ok(())
    }
}

fn check_batch(cache: &DecoderCache, n: usize) -> DecoderResult<()> {
    if n != cache.batch {
        return Err(DecoderError::input(format!("{n} sequences for a cache of batch {}", cache.batch)));
    }
    Ok(())
}

/// The tables of a step of `new[j]` tokens for sequence `j` after `cache.lens()[j]` (room made
/// by [`DecoderCache::make_room`] first): positions and cache rows per token, and the
/// attention's tables, for each view of the cache.
pub(super) fn plan(dev: &Device, cache: &DecoderCache, new: &[usize]) -> DecoderResult<StepTables> {
    check_batch(cache, new.len())?;
    if new.iter().all(|&n| n == 0) {
        return Err(DecoderError::input("a step needs at least one new token"));
    }
    let (global, sliding) = cache.views();
    let make = |view: View<'_>| -> DecoderResult<ViewTables> {
        let p = view_plan(cache, view, new)?;
        let rows = TokenRows::from_host(dev, &p.positions, &p.rows, cache.batch * view.capacity)?;
        let stream = dev.stream();
        let attention = if new.iter().all(|&n| n == 1) {
            StepAttention::Decode { seqlens: stream.htod(&to_i32(&p.totals))? }
        } else {
            let prefix = |v: &mut dyn Iterator<Item = usize>| -> Vec<i32> {
                let mut acc = 0;
                std::iter::once(0)
                    .chain(v.map(|x| {
                        acc += x as i32;
                        acc
                    }))
                    .collect()
            };
            let cu_q = prefix(&mut new.iter().copied());
            let cu_kv = prefix(&mut p.totals.iter().copied());
            let off_kv: Vec<i32> = (0..=cache.batch).map(|j| (j * view.capacity) as i32).collect();
            let lse_len = cache.batch * p.shape.max_new * cache.heads;
            // SAFETY: f32 has no invalid bit patterns; the kernel writes the entries it reads.
            let lse = unsafe { stream.alloc::<f32>(lse_len.max(1)) }.map_err(te_runtime::Error::from)?;
            StepAttention::Prefill {
                cu_q: stream.htod(&cu_q)?,
                cu_kv: stream.htod(&cu_kv)?,
                off_kv: stream.htod(&off_kv)?,
                lse,
            }
        };
        Ok(ViewTables { rows, shape: p.shape, attention })
    };
    Ok(StepTables { global: make(global)?, sliding: sliding.map(make).transpose()? })
}

/// Records that the step's tokens are cached.
pub(super) fn advance(cache: &mut DecoderCache, new: &[usize]) {
    for (l, n) in cache.lens.iter_mut().zip(new) {
        *l += n;
    }
}
