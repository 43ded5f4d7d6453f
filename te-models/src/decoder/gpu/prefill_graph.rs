//! Prefills replayed from CUDA graphs, one per length bucket ([`Decoder::set_prefill_graphs`]).
//!
//! A prefill's packed prompt tokens are padded up to a bucket ([`PREFILL_BUCKETS`], at most
//! [`PREFILL_GRAPH_MAX_TOKENS`] tokens; the padding is laid out as [`super::prefill_plan`]'s
//! docs say: it never changes a prompt's keys, values or logits), and the prefill of `(batch,
//! bucket)` runs in a KV cache the decoder keeps ([`CacheKey`]: batch, a rounded capacity, the
//! sliding layers' chunk, the cached dtype) over static device tables (ids, positions, cache
//! rows, `cu_seqlens`, key offsets, the rows of each prompt's last token) that each prefill
//! refills before it runs. The first prefill of a bucket runs eagerly on the padded shape (it
//! loads every kernel and picks every GEMM algorithm), the second is captured and replayed, the
//! later ones replay. The generation then decodes in that cache (its decode steps replayed from
//! their own graph as before) and hands it back, so a server's next request of the same key
//! replays without capturing again. A capture that fails leaves the bucket eager, the reason in
//! [`Decoder::graph_fallback`].

use super::cache::{self, StepAttention, StepShape, StepTables, ViewTables};
use super::prefill_plan::{prefill_bucket, CacheKey, PaddedPlan, MAX_PREFILL_CACHES, MAX_PREFILL_GRAPHS};
#[cfg(doc)]
use super::prefill_plan::{PREFILL_BUCKETS, PREFILL_GRAPH_MAX_TOKENS};
use super::{Decoder, DecoderCache};
use crate::decoder::{DecoderError, DecoderResult};
use cudarc::driver::CudaSlice;
use te_codegen::DType;
use te_runtime::graph::{Graph, HostCopies};
use te_runtime::ops::embedding::embedding_forward;
use te_runtime::ops::qkv_rope::TokenRows;
use te_runtime::{Device, Tensor};

/// How [`Decoder::generate`] (and [`Decoder::prefill_logits`]) run a prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillGraphs {
    /// The prompts packed without padding, eagerly, in a cache of exactly the capacity the
    /// generation needs (the default).
    #[default]
    Off,
    /// Padded to their bucket and replayed from the bucket's CUDA graph while
    /// [`Decoder::set_cuda_graph`] is on (the first prefill of a bucket runs eagerly, the second
    /// is captured); with graphs off, eagerly on the padded shape (the same numbers). Prefills
    /// past [`PREFILL_GRAPH_MAX_TOKENS`], or whose padding does not fit the cache, run as `Off`.
    On,
    /// The padded shape of `On`, always eagerly: what `On` replays, bit for bit (tests,
    /// timings).
    PaddedEager,
}

/// What the prefill graphs hold ([`Decoder::prefill_graph_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefillGraphStats {
    /// Buckets held (captured, warming up, or whose capture failed), at most
    /// [`super::prefill_plan::MAX_PREFILL_GRAPHS`].
    pub buckets: usize,
    /// Captured graphs among them.
    pub captured: usize,
    /// KV caches held, at most [`super::prefill_plan::MAX_PREFILL_CACHES`].
    pub caches: usize,
    /// Their bytes on the device (the graphs' own memory, the peak of a padded prefill's
    /// activations each, is not counted).
    pub cache_bytes: usize,
    /// Prefills replayed from a graph since the decoder was made.
    pub replays: u64,
}

/// The static device tables of one bucket's padded prefill, refilled before each run.
#[derive(Debug)]
struct PrefillTables {
    /// Token ids `[bucket]`.
    ids: CudaSlice<i32>,
    /// Packed rows `[batch]` of each prompt's last token.
    last: CudaSlice<i32>,
    step: StepTables,
}

impl PrefillTables {
    /// The tables of `plan` over `cache`'s views, for a model of `heads` attention heads.
    fn new(dev: &Device, heads: usize, cache: &DecoderCache, plan: &PaddedPlan) -> DecoderResult<Self> {
        let stream = dev.stream();
        let cu = plan.cu_seqlens();
        let sequences = 2 * plan.batch();
        let make = |capacity: usize| -> DecoderResult<ViewTables> {
            let rows = TokenRows::from_host(dev, &plan.positions, &plan.rows(capacity), plan.batch() * capacity)?;
            // Every bound at the bucket: the launch grid is the graph's, whatever the lengths.
            let shape = StepShape::new(sequences, plan.bucket, plan.bucket, capacity);
            // SAFETY: f32 has no invalid bit patterns; the kernel writes the entries it reads.
            let lse =
                unsafe { stream.alloc::<f32>(sequences * plan.bucket * heads) }.map_err(te_runtime::Error::from)?;
            let attention = StepAttention::Prefill {
                cu_q: stream.htod(&cu)?,
                cu_kv: stream.htod(&cu)?,
                off_kv: stream.htod(&plan.kv_offsets(capacity))?,
                lse,
            };
            Ok(ViewTables { rows, shape, attention })
        };
        let step =
            StepTables { global: make(cache.capacity())?, sliding: cache.sliding_capacity().map(make).transpose()? };
        Ok(Self { ids: stream.htod(&plan.ids)?, last: stream.htod(&plan.last_rows())?, step })
    }

    /// Refills the tables in place for `plan` (host copies: not inside a capture).
    fn update(&mut self, dev: &Device, cache: &DecoderCache, plan: &PaddedPlan) -> DecoderResult<()> {
        let stream = dev.stream();
        te_runtime::graph::refuse_in_capture(stream, "PrefillTables::update")?;
        let cu = plan.cu_seqlens();
        let copy = |src: &[i32], dst: &mut CudaSlice<i32>| -> DecoderResult<()> {
            if src.len() != dst.len() {
                return Err(DecoderError::input(format!("a prefill table of {} for {} entries", dst.len(), src.len())));
            }
            stream.memcpy_htod(src, dst).map_err(te_runtime::Error::from)?;
            Ok(())
        };
        let fill = |t: &mut ViewTables, capacity: usize| -> DecoderResult<()> {
            t.rows.update(dev, &plan.positions, &plan.rows(capacity))?;
            let StepAttention::Prefill { cu_q, cu_kv, off_kv, .. } = &mut t.attention else {
                return Err(DecoderError::input("the prefill tables hold a decode step's"));
            };
            copy(&cu, cu_q)?;
            copy(&cu, cu_kv)?;
            copy(&plan.kv_offsets(capacity), off_kv)
        };
        fill(&mut self.step.global, cache.capacity())?;
        match (&mut self.step.sliding, cache.sliding_capacity()) {
            (Some(t), Some(capacity)) => fill(t, capacity)?,
            (None, None) => {}
            _ => return Err(DecoderError::input("the prefill tables were made for another cache")),
        }
        copy(&plan.ids, &mut self.ids)?;
        copy(&plan.last_rows(), &mut self.last)
    }
}

/// Where a bucket's prefill stands.
#[derive(Debug)]
enum State {
    /// Not run yet: its first prefill runs eagerly (the warm-up).
    Cold,
    /// Run eagerly once: captured at its next prefill.
    Warm,
    /// Captured: the graph, and the logits `[batch, vocab]` its replays write.
    Captured { graph: Graph, logits: Tensor },
    /// The capture failed (why): its prefills run eagerly.
    Failed(String),
}

/// One bucket of a cache: its state (the graph, dropped before the tables it reads) and tables.
#[derive(Debug)]
struct BucketGraph {
    bucket: usize,
    used: u64,
    state: State,
    tables: PrefillTables,
}

/// A cache kept for the prefill graphs, with the buckets captured over it (dropped first).
#[derive(Debug)]
pub(super) struct Slot {
    key: CacheKey,
    used: u64,
    buckets: Vec<BucketGraph>,
    cache: DecoderCache,
}

/// The prefill graphs of a decoder: the mode and the caches with their buckets, least recently
/// used first out.
#[derive(Debug, Default)]
pub(super) struct PrefillStore {
    mode: PrefillGraphs,
    slots: Vec<Slot>,
    tick: u64,
    replays: u64,
}

impl PrefillStore {
    fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The slot of `key`, out of the store while a generation uses its cache (the graphs go
    /// with it, so none can outlive the cache it writes into).
    fn take(&mut self, key: &CacheKey) -> Option<Box<Slot>> {
        let i = self.slots.iter().position(|s| s.key == *key)?;
        Some(Box::new(self.slots.remove(i)))
    }

    /// Puts `slot` back, then drops what is past the bounds: caches without buckets, the least
    /// recently used caches past [`MAX_PREFILL_CACHES`] and buckets past [`MAX_PREFILL_GRAPHS`].
    fn put_back(&mut self, mut slot: Slot) {
        slot.used = self.tick();
        self.slots.push(slot);
        self.evict();
    }

    fn evict(&mut self) {
        self.slots.retain(|s| !s.buckets.is_empty());
        while self.slots.len() > MAX_PREFILL_CACHES {
            let oldest = (0..self.slots.len()).min_by_key(|&i| self.slots[i].used).unwrap_or(0);
            self.slots.remove(oldest);
        }
        while self.slots.iter().map(|s| s.buckets.len()).sum::<usize>() > MAX_PREFILL_GRAPHS {
            let oldest = self
                .slots
                .iter()
                .enumerate()
                .flat_map(|(i, s)| s.buckets.iter().enumerate().map(move |(k, b)| (b.used, i, k)))
                .min();
            let Some((_, i, k)) = oldest else { break };
            self.slots[i].buckets.remove(k);
            self.slots.retain(|s| !s.buckets.is_empty());
        }
    }

    fn stats(&self) -> PrefillGraphStats {
        let buckets = self.slots.iter().flat_map(|s| &s.buckets);
        PrefillGraphStats {
            buckets: buckets.clone().count(),
            captured: buckets.filter(|b| matches!(b.state, State::Captured { .. })).count(),
            caches: self.slots.len(),
            cache_bytes: self.slots.iter().map(|s| s.cache.bytes()).sum(),
            replays: self.replays,
        }
    }
}

/// The cache a generation decodes in after its prefill: its own, or a prefill graph's (handed
/// back to the store by [`Decoder::restore`]).
#[derive(Debug)]
pub(super) enum HeldCache {
    Own(Box<DecoderCache>),
    Slot(Box<Slot>),
}

impl HeldCache {
    pub fn cache_mut(&mut self) -> &mut DecoderCache {
        match self {
            Self::Own(c) => c,
            Self::Slot(s) => &mut s.cache,
        }
    }
}

/// A model error inside a capture closure as the runtime's.
fn runtime(e: DecoderError) -> te_runtime::Error {
    match e {
        DecoderError::Runtime(e) => e,
        other => te_runtime::Error::internal("Decoder::prefill", other.to_string()),
    }
}

impl Decoder {
    /// How [`Decoder::generate`] runs its prefill (see [`PrefillGraphs`]; default
    /// [`PrefillGraphs::Off`]). With [`PrefillGraphs::On`] the decoder keeps, across
    /// generations, up to [`super::prefill_plan::MAX_PREFILL_CACHES`] KV caches (of the rounded
    /// capacity [`super::prefill_plan::prefill_capacity`]) and up to
    /// [`super::prefill_plan::MAX_PREFILL_GRAPHS`] buckets over them, each captured graph with the
    /// memory of one padded prefill's activations. Changing the mode drops them.
    pub fn set_prefill_graphs(&mut self, mode: PrefillGraphs) {
        if mode != self.prefill.mode {
            self.prefill = super::prefill_graph::PrefillStore { mode, ..Default::default() };
        }
    }

    /// How the prefill runs ([`Decoder::set_prefill_graphs`]).
    pub fn prefill_graphs(&self) -> PrefillGraphs {
        self.prefill.mode
    }

    /// What the prefill graphs hold now and their replays so far.
    pub fn prefill_graph_stats(&self) -> PrefillGraphStats {
        self.prefill.stats()
    }

    /// The logits `[batch, vocab]` (f32 on the host, soft-capped) of each prompt's last token,
    /// computed as [`Decoder::generate`] computes them before its first draw when it is asked for
    /// `max_new_tokens` (which sizes the cache): the same prefill, padded and replayed from a
    /// graph under [`PrefillGraphs::On`]. The cache is not kept (a prefill graph's goes back to
    /// the store).
    ///
    /// # Errors
    /// [`DecoderError::Input`] for no prompt, an empty one, an id outside the vocabulary, a
    /// prompt plus `max_new_tokens` past the model's `max_position_embeddings`; the device's
    /// errors.
    pub fn prefill_logits(&mut self, prompts: &[Vec<i32>], max_new_tokens: usize) -> DecoderResult<Vec<f32>> {
        if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
            return Err(DecoderError::input("a prefill needs at least one prompt, none of them empty"));
        }
        self.check_ids(prompts)?;
        let capacity = prompts.iter().map(Vec::len).max().unwrap_or(1) + max_new_tokens;
        self.graph_fallback = None;
        let (held, logits) = self.prefill(prompts, capacity)?;
        let out = logits.to_f32(&self.dev);
        drop(logits);
        self.restore(held);
        let mut out = out?;
        self.softcap(&mut out);
        Ok(out)
    }

    /// Hands a prefill graph's cache back to the store after the generation that used it.
    pub(super) fn restore(&mut self, held: HeldCache) {
        if let HeldCache::Slot(slot) = held {
            self.prefill.put_back(*slot);
        }
    }

    /// The prefill of `prompts` (ids checked) in a cache of `capacity` tokens a sequence (or the
    /// prefill graphs' rounded one): the cache, holding the prompts, and the logits `[batch,
    /// vocab]` BF16 of each prompt's last token.
    pub(super) fn prefill(&mut self, prompts: &[Vec<i32>], capacity: usize) -> DecoderResult<(HeldCache, Tensor)> {
        if self.prefill.mode != PrefillGraphs::Off {
            if let Some(done) = self.padded_prefill(prompts, capacity)? {
                return Ok(done);
            }
        }
        let mut cache = self.cache(prompts.len(), capacity)?;
        let hidden = self.forward_step(&mut cache, prompts)?;
        let last: Vec<usize> = prompts
            .iter()
            .scan(0, |acc, p| {
                *acc += p.len();
                Some(*acc - 1)
            })
            .collect();
        let logits = self.head(&self.gather_rows(&hidden, &last)?)?;
        Ok((HeldCache::Own(Box::new(cache)), logits))
    }

    /// The padded prefill in a kept cache, or `None` when it does not apply (past the largest
    /// bucket, or padding the cache has no room for).
    fn padded_prefill(&mut self, prompts: &[Vec<i32>], capacity: usize) -> DecoderResult<Option<(HeldCache, Tensor)>> {
        let total: usize = prompts.iter().map(Vec::len).sum();
        let Some(bucket) = prefill_bucket(total) else { return Ok(None) };
        let key = CacheKey::new(&self.cfg, (prompts.len(), capacity, bucket), self.prefill_chunk, self.kv_cache_dtype);
        let mut slot = match self.prefill.take(&key) {
            Some(slot) => slot,
            None => {
                let cache = DecoderCache::with_chunk_dtype(
                    &self.dev,
                    &self.cfg,
                    key.batch,
                    key.capacity,
                    key.chunk,
                    key.dtype,
                )?;
                Box::new(Slot { key, used: 0, buckets: Vec::new(), cache })
            }
        };
        slot.cache.clear();
        let room = slot.cache.sliding_capacity().map_or(slot.cache.capacity(), |s| s.min(slot.cache.capacity()));
        let Some(plan) = PaddedPlan::new(prompts, bucket, room) else {
            self.prefill.put_back(*slot);
            return Ok(None);
        };
        // An error drops the slot with its graphs: a failed run leaves nothing half-made behind.
        let logits = self.run_bucket(&mut slot, &plan)?;
        cache::advance(&mut slot.cache, &plan.lens);
        Ok(Some((HeldCache::Slot(slot), logits)))
    }

    /// Runs `plan` in `slot`'s cache from its bucket's graph (replayed, or captured after one
    /// eager run) or eagerly on the padded shape. Returns the logits `[batch, vocab]`, valid until
    /// the bucket's next run.
    fn run_bucket(&mut self, slot: &mut Slot, plan: &PaddedPlan) -> DecoderResult<Tensor> {
        let used = self.prefill.tick();
        let Slot { buckets, cache, .. } = slot;
        let i = match buckets.iter().position(|g| g.bucket == plan.bucket) {
            Some(i) => i,
            None => {
                let tables = PrefillTables::new(&self.dev, self.cfg.num_attention_heads, cache, plan)?;
                buckets.push(BucketGraph { bucket: plan.bucket, used, state: State::Cold, tables });
                buckets.len() - 1
            }
        };
        let g = &mut buckets[i];
        g.used = used;
        g.tables.update(&self.dev, cache, plan)?;
        let what = format!("prefill of batch {} padded to {} tokens", plan.batch(), plan.bucket);
        if !(self.cuda_graph && self.prefill.mode == PrefillGraphs::On) {
            return self.padded_logits(cache, &mut g.tables);
        }
        match &g.state {
            State::Captured { graph, logits } => {
                graph.replay()?;
                self.prefill.replays += 1;
                Ok(logits.clone())
            }
            State::Cold => {
                g.state = State::Warm;
                self.padded_logits(cache, &mut g.tables)
            }
            State::Failed(why) => {
                self.note_fallback(format!("{what}: not captured ({why})"));
                self.padded_logits(cache, &mut g.tables)
            }
            State::Warm => {
                let dev = self.dev.clone();
                let tables = &mut g.tables;
                let captured = Graph::capture(&dev, || self.padded_logits(cache, tables).map_err(runtime));
                match captured {
                    Ok((graph, logits)) => {
                        graph.replay()?;
                        self.prefill.replays += 1;
                        g.state = State::Captured { graph, logits: logits.clone() };
                        Ok(logits)
                    }
                    Err(e) => {
                        self.note_fallback(format!("{what}: not captured ({e})"));
                        g.state = State::Failed(e.to_string());
                        self.padded_logits(cache, &mut g.tables)
                    }
                }
            }
        }
    }

    /// The padded step over `t` in `cache` (every layer, the final norm, each prompt's last row,
    /// the LM head): device work only, so that it can be captured. Returns the logits `[batch,
    /// vocab]` BF16; the cache's lengths are the caller's to advance.
    fn padded_logits(&mut self, cache: &mut DecoderCache, t: &mut PrefillTables) -> DecoderResult<Tensor> {
        let hidden = self.run(&t.ids, cache::Step { cache, tables: &mut t.step })?;
        let mut rows = Tensor::empty(&self.dev, DType::BF16, &[t.last.len(), self.cfg.hidden_size])?;
        embedding_forward(&self.dev, &hidden, &t.last, &mut rows)?;
        drop(hidden);
        self.head(&rows)
    }

    /// Adds `why` to [`Decoder::graph_fallback`].
    pub(super) fn note_fallback(&mut self, why: String) {
        self.graph_fallback = Some(match self.graph_fallback.take() {
            Some(before) => format!("{before}; {why}"),
            None => why,
        });
    }
}
