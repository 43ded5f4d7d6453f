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
//! Sliding-window layers keep every position like the others (their attention reads only the
//! window): simple and exact, at the cost of the memory a ring buffer would save.

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::AttnMaskType;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::qkv_rope::TokenRows;
use te_runtime::{Device, Tensor};

/// The KV cache of every layer for `batch` sequences of up to `capacity` tokens each.
#[derive(Debug)]
pub struct DecoderCache {
    batch: usize,
    capacity: usize,
    heads: usize,
    layers: Vec<[Tensor; 2]>,
    lens: Vec<usize>,
}

impl DecoderCache {
    /// An empty cache (BF16) for `cfg`'s layers.
    ///
    /// # Errors
    /// [`DecoderError::Input`] for a zero batch or capacity, or a capacity beyond the model's
    /// `max_position_embeddings`; out of memory.
    pub fn new(dev: &Arc<Device>, cfg: &DecoderConfig, batch: usize, capacity: usize) -> DecoderResult<Self> {
        if batch == 0 || capacity == 0 {
            return Err(DecoderError::input(format!(
                "a KV cache needs batch ≥ 1 and capacity ≥ 1, got {batch}, {capacity}"
            )));
        }
        if capacity > cfg.max_position_embeddings {
            return Err(DecoderError::input(format!(
                "{capacity} tokens per sequence exceed the model's max_position_embeddings = {}: shorten the prompt or \
                 the number of new tokens",
                cfg.max_position_embeddings
            )));
        }
        let shape = [batch, capacity, cfg.num_gqa_groups, cfg.head_dim];
        let layers = (0..cfg.num_layers)
            .map(|_| Ok([Tensor::empty(dev, DType::BF16, &shape)?, Tensor::empty(dev, DType::BF16, &shape)?]))
            .collect::<DecoderResult<Vec<_>>>()?;
        Ok(Self { batch, capacity, heads: cfg.num_attention_heads, layers, lens: vec![0; batch] })
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

    /// Bytes of the caches on the device.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(Tensor::num_bytes).sum()
    }

    /// Forgets every cached token (the memory stays).
    pub fn clear(&mut self) {
        self.lens.iter_mut().for_each(|l| *l = 0);
    }

    pub(super) fn layer(&self, l: usize) -> [&Tensor; 2] {
        let [k, v] = &self.layers[l];
        [k, v]
    }

    pub(super) fn layer_mut(&mut self, l: usize) -> [&mut Tensor; 2] {
        let [k, v] = &mut self.layers[l];
        [k, v]
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
    /// lengths after the step).
    Decode { seqlens: CudaSlice<i32> },
    /// The fused attention: `cu_q` (i32 `[batch + 1]` prefix sums of the new tokens, also their
    /// packed offsets), `cu_kv` (prefix sums of the lengths after the step), `off_kv` (`j ·
    /// capacity`, the sequences' cache offsets), `lse` (f32 workspace).
    Prefill { cu_q: CudaSlice<i32>, cu_kv: CudaSlice<i32>, off_kv: CudaSlice<i32>, lse: CudaSlice<f32> },
}

/// One step over a cache: the tokens' positions and rows, the attention's tables.
pub(super) struct Step<'a> {
    pub cache: &'a mut DecoderCache,
    pub rows: &'a TokenRows,
    pub shape: StepShape,
    pub attention: &'a mut StepAttention,
}

/// The device tables of a decode step (one new token per sequence) kept across steps at fixed
/// addresses, so that a CUDA graph captured over them replays every later step: the token ids,
/// their positions and cache rows, the lengths after the step. [`DecodeTables::update`] refills
/// them (host copies, before a replay).
#[derive(Debug)]
pub(super) struct DecodeTables {
    pub ids: CudaSlice<i32>,
    pub rows: TokenRows,
    pub shape: StepShape,
    pub attention: StepAttention,
}

/// Positions, cache rows and lengths after the step of one token per sequence of `cache`.
fn decode_rows(cache: &DecoderCache) -> DecoderResult<(Vec<i32>, Vec<i32>, Vec<i32>)> {
    if let Some(j) = cache.lens.iter().position(|&l| l + 1 > cache.capacity) {
        return Err(DecoderError::input(format!(
            "sequence {j}: {} cached tokens fill the cache's capacity of {}",
            cache.lens[j], cache.capacity
        )));
    }
    let positions: Vec<i32> = cache.lens.iter().map(|&l| l as i32).collect();
    let rows = cache.lens.iter().enumerate().map(|(j, &l)| (j * cache.capacity + l) as i32).collect();
    let seqlens = cache.lens.iter().map(|&l| l as i32 + 1).collect();
    Ok((positions, rows, seqlens))
}

impl DecodeTables {
    /// The tables of the next step of `cache` with the token `ids[j]` for sequence `j`.
    pub fn new(dev: &Device, cache: &DecoderCache, ids: &[i32]) -> DecoderResult<Self> {
        if ids.len() != cache.batch {
            return Err(DecoderError::input(format!("{} tokens for a cache of batch {}", ids.len(), cache.batch)));
        }
        let (positions, rows, seqlens) = decode_rows(cache)?;
        let stream = dev.stream();
        let shape = StepShape { batch: cache.batch, max_new: 1, max_total: 0, capacity: cache.capacity };
        Ok(Self {
            ids: stream.htod(ids)?,
            rows: TokenRows::from_host(dev, &positions, &rows, cache.batch * cache.capacity)?,
            shape,
            attention: StepAttention::Decode { seqlens: stream.htod(&seqlens)? },
        })
    }

    /// Refills the tables in place for the next step of `cache` with the tokens `ids`.
    pub fn update(&mut self, dev: &Device, cache: &DecoderCache, ids: &[i32]) -> DecoderResult<()> {
        if ids.len() != cache.batch {
            return Err(DecoderError::input(format!("{} tokens for a cache of batch {}", ids.len(), cache.batch)));
        }
        let (positions, rows, seqlens) = decode_rows(cache)?;
        te_runtime::graph::refuse_in_capture(dev.stream(), "DecodeTables::update")?;
        dev.stream().memcpy_htod(ids, &mut self.ids).map_err(te_runtime::Error::from)?;
        self.rows.update(dev, &positions, &rows)?;
        if let StepAttention::Decode { seqlens: s } = &mut self.attention {
            dev.stream().memcpy_htod(&seqlens, s).map_err(te_runtime::Error::from)?;
        }
        Ok(())
    }
}

/// The host tables of a step of `new[j]` tokens for sequence `j` after `cache.lens()[j]`:
/// positions and cache rows per token, and the attention's tables.
pub(super) fn plan(
    dev: &Device,
    cache: &DecoderCache,
    new: &[usize],
) -> DecoderResult<(TokenRows, StepShape, StepAttention)> {
    if new.len() != cache.batch {
        return Err(DecoderError::input(format!("{} sequences for a cache of batch {}", new.len(), cache.batch)));
    }
    let (mut positions, mut rows) = (Vec::new(), Vec::new());
    for (j, (&n, &past)) in new.iter().zip(&cache.lens).enumerate() {
        if past + n > cache.capacity {
            return Err(DecoderError::input(format!(
                "sequence {j}: {past} cached and {n} new tokens exceed the cache's capacity of {}",
                cache.capacity
            )));
        }
        for p in past..past + n {
            positions.push(p as i32);
            rows.push((j * cache.capacity + p) as i32);
        }
    }
    if positions.is_empty() {
        return Err(DecoderError::input("a step needs at least one new token"));
    }
    let token_rows = TokenRows::from_host(dev, &positions, &rows, cache.batch * cache.capacity)?;
    let totals: Vec<usize> = new.iter().zip(&cache.lens).map(|(n, p)| n + p).collect();
    let shape = StepShape {
        batch: cache.batch,
        max_new: new.iter().copied().max().unwrap_or(0),
        max_total: totals.iter().copied().max().unwrap_or(0),
        capacity: cache.capacity,
    };
    let stream = dev.stream();
    let attention = if new.iter().all(|&n| n == 1) {
        let lens: Vec<i32> = totals.iter().map(|&t| t as i32).collect();
        StepAttention::Decode { seqlens: stream.htod(&lens)? }
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
        let cu_kv = prefix(&mut totals.iter().copied());
        let off_kv: Vec<i32> = (0..=cache.batch).map(|j| (j * cache.capacity) as i32).collect();
        let lse_len = cache.batch * shape.max_new * cache.heads;
        // SAFETY: f32 has no invalid bit patterns; the kernel writes the entries it reads.
        let lse = unsafe { stream.alloc::<f32>(lse_len.max(1)) }.map_err(te_runtime::Error::from)?;
        StepAttention::Prefill {
            cu_q: stream.htod(&cu_q)?,
            cu_kv: stream.htod(&cu_kv)?,
            off_kv: stream.htod(&off_kv)?,
            lse,
        }
    };
    Ok((token_rows, shape, attention))
}

/// Records that the step's tokens are cached.
pub(super) fn advance(cache: &mut DecoderCache, new: &[usize]) {
    for (l, n) in cache.lens.iter_mut().zip(new) {
        *l += n;
    }
}
