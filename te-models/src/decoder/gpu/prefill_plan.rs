//! The host side of the prefill graphs ([`super::Decoder::set_prefill_graphs`]): the length
//! buckets a prefill's packed tokens are padded to, the capacity of the cache a bucket's graph
//! runs in, and the padded step's tables (where each token goes, which rows the attention reads).
//!
//! A padded prefill of prompts of lengths `len_j` (`Σ len_j = total`, from an empty cache) runs
//! `bucket` tokens: prompt `j`'s tokens are followed by `pad_j ≥ 0` padding tokens (id 0,
//! positions `0..pad_j`), `Σ pad_j = bucket − total`. To the fused attention the padding after
//! prompt `j` is a sequence of its own (the attention runs `2 · batch` sequences: prompt 0, its
//! padding, prompt 1, ...), causal over its own keys, so every padding row holds finite values
//! computed from a token (an FP8 amax over the step sees nothing undefined) and no prompt sees a
//! padding key. The padding's keys and values are written to cache rows of prompt `j`'s sequence
//! after its prompt (positions `len_j..len_j + pad_j`): rows that the prefill's attention of prompt
//! `j` does not read (it reads `len_j` rows) and that the decode steps overwrite before they read
//! them (step `p` writes position `p`, then attends over positions `≤ p`). So `pad_j` is at most
//! the free rows `room − len_j` of the sequence, `room` the smallest view of the cache (the
//! sliding-window layers may keep fewer rows a sequence), filled sequence after sequence.

use crate::decoder::DecoderConfig;

/// The totals a padded prefill rounds its packed tokens (all prompts together) up to: doubling
/// up to 256, then half-octave steps (the padding wastes at most a third of a step's work past
/// 256 tokens, and launch overhead, which the graph saves, dominates below).
pub const PREFILL_BUCKETS: [usize; 9] = [64, 128, 256, 384, 512, 768, 1024, 1536, 2048];

/// The most prompt tokens (all sequences together) a prefill graph takes; a longer prefill runs
/// eagerly (compute-bound: the launch overhead a graph saves is small beside its GEMMs).
pub const PREFILL_GRAPH_MAX_TOKENS: usize = 2048;

/// Prefill buckets (captured graphs or buckets warming up) a decoder keeps at most, all caches
/// together; the least recently used goes first.
pub const MAX_PREFILL_GRAPHS: usize = 8;

/// KV caches the prefill graphs keep at most (each graph writes into one cache, kept with it
/// across generations); the least recently used goes first, with its graphs.
pub const MAX_PREFILL_CACHES: usize = 2;

/// The least capacity of a prefill graph's cache: short requests share one cache (and so their
/// graphs) whatever their number of new tokens.
pub const MIN_PREFILL_CAPACITY: usize = 256;

/// The bucket of a prefill of `tokens` packed prompt tokens: the least of [`PREFILL_BUCKETS`]
/// holding them, `None` past [`PREFILL_GRAPH_MAX_TOKENS`] (eager).
pub fn prefill_bucket(tokens: usize) -> Option<usize> {
    PREFILL_BUCKETS.iter().copied().find(|&b| b >= tokens)
}

/// `n` rounded up to the next of `2^k · {1, 1.25, 1.5, 1.75}` (at most 25 % more).
fn round_quarter_octave(n: usize) -> usize {
    if n <= 8 || n.is_power_of_two() {
        return n;
    }
    let half = n.next_power_of_two() / 2;
    let step = half / 4;
    half + (n - half).div_ceil(step) * step
}

/// The capacity (tokens a sequence) of the cache a prefill graph of `batch` prompts padded to
/// `bucket` runs in when the generation needs `needed` (longest prompt + new tokens): `needed`,
/// at least [`MIN_PREFILL_CAPACITY`] and `⌈bucket / batch⌉` (room for the padding), rounded up to
/// the next `2^k · {1, 1.25, 1.5, 1.75}` (so that requests of nearby lengths share a cache and its
/// graphs, for at most 25 % more memory), at most `max_positions` (the model's
/// `max_position_embeddings`) unless `needed` is more (then the cache refuses it as the eager path
/// does).
pub fn prefill_capacity(needed: usize, bucket: usize, batch: usize, max_positions: usize) -> usize {
    let want = needed.max(MIN_PREFILL_CAPACITY).max(bucket.div_ceil(batch.max(1)));
    round_quarter_octave(want).min(max_positions).max(needed)
}

/// The host tables of one padded prefill step from an empty cache (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct PaddedPlan {
    /// The step's tokens (`bucket`).
    pub bucket: usize,
    /// The prompts' lengths `[batch]`.
    pub lens: Vec<usize>,
    /// Padding tokens after each prompt `[batch]`.
    pub pad: Vec<usize>,
    /// Token ids `[bucket]`: each prompt, then its padding (id 0).
    pub ids: Vec<i32>,
    /// Positions `[bucket]`: `0..len_j` for prompt `j`, `0..pad_j` for its padding.
    pub positions: Vec<i32>,
}

impl PaddedPlan {
    /// The plan of `prompts` padded to `bucket` tokens in a cache of `room` rows a sequence (the
    /// least of its views), or `None` when they do not fit: more tokens than `bucket`, a prompt
    /// longer than `room`, or fewer free rows than padding tokens.
    pub fn new(prompts: &[Vec<i32>], bucket: usize, room: usize) -> Option<Self> {
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let total: usize = lens.iter().sum();
        if prompts.is_empty() || total > bucket || lens.iter().any(|&n| n > room) {
            return None;
        }
        let mut left = bucket - total;
        let pad: Vec<usize> = lens
            .iter()
            .map(|&n| {
                let p = left.min(room - n);
                left -= p;
                p
            })
            .collect();
        if left > 0 {
            return None;
        }
        let (mut ids, mut positions) = (Vec::with_capacity(bucket), Vec::with_capacity(bucket));
        for (prompt, &p) in prompts.iter().zip(&pad) {
            ids.extend_from_slice(prompt);
            positions.extend((0..prompt.len()).map(|i| i as i32));
            ids.extend(std::iter::repeat_n(0, p));
            positions.extend((0..p).map(|i| i as i32));
        }
        Some(Self { bucket, lens, pad, ids, positions })
    }

    /// Prompts.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// The attention's `2 · batch` sequences' lengths: prompt 0, its padding, prompt 1, ...
    fn seqlens(&self) -> impl Iterator<Item = usize> + '_ {
        self.lens.iter().zip(&self.pad).flat_map(|(&n, &p)| [n, p])
    }

    /// Prefix sums `[2 · batch + 1]` of the attention's sequences: the queries' packed offsets
    /// (`cu_seqlens_q`, also their `seq_offsets`) and, from an empty cache, the keys' counts
    /// (`cu_seqlens_kv`).
    pub fn cu_seqlens(&self) -> Vec<i32> {
        let mut acc = 0;
        std::iter::once(0)
            .chain(self.seqlens().map(|n| {
                acc += n as i32;
                acc
            }))
            .collect()
    }

    /// Each token's cache row `[bucket]` in a view of `capacity` rows a sequence: prompt `j`'s
    /// token `p` at `j · capacity + p`, its padding token `i` at `j · capacity + len_j + i`.
    pub fn rows(&self, capacity: usize) -> Vec<i32> {
        let mut rows = Vec::with_capacity(self.bucket);
        for (j, (&n, &p)) in self.lens.iter().zip(&self.pad).enumerate() {
            rows.extend((j * capacity..j * capacity + n + p).map(|r| r as i32));
        }
        rows
    }

    /// The keys' first rows `[2 · batch + 1]` in a view of `capacity` rows a sequence: prompt
    /// `j` at `j · capacity`, its padding at `j · capacity + len_j`, and `batch · capacity` last
    /// (the fused attention reads sequence `s`'s keys within `[off[s], off[s + 1])`).
    pub fn kv_offsets(&self, capacity: usize) -> Vec<i32> {
        let mut off: Vec<i32> = self
            .lens
            .iter()
            .enumerate()
            .flat_map(|(j, &n)| [j * capacity, j * capacity + n])
            .map(|r| r as i32)
            .collect();
        off.push((self.batch() * capacity) as i32);
        off
    }

    /// The packed rows `[batch]` of each prompt's last token.
    pub fn last_rows(&self) -> Vec<i32> {
        let cu = self.cu_seqlens();
        (0..self.batch()).map(|j| cu[2 * j + 1] - 1).collect()
    }
}

/// What a prefill graph's shape depends on besides its bucket: the cache it writes into (batch,
/// capacity, the sliding layers' chunk, which fixes their rows, and the cached dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct CacheKey {
    pub batch: usize,
    pub capacity: usize,
    pub chunk: usize,
    pub dtype: te_codegen::DType,
}

impl CacheKey {
    /// The key of a generation of `lens` prompts needing `needed` tokens a sequence, padded to
    /// `bucket`, on `cfg` with the decoder's prefill chunk and KV-cache dtype.
    pub fn new(
        cfg: &DecoderConfig,
        (batch, needed, bucket): (usize, usize, usize),
        chunk: usize,
        dtype: te_codegen::DType,
    ) -> Self {
        let capacity = prefill_capacity(needed, bucket, batch, cfg.max_position_embeddings);
        Self { batch, capacity, chunk, dtype }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_and_stop_at_the_cap() {
        assert_eq!(prefill_bucket(0), Some(64));
        assert_eq!(prefill_bucket(1), Some(64));
        assert_eq!(prefill_bucket(64), Some(64));
        assert_eq!(prefill_bucket(65), Some(128));
        assert_eq!(prefill_bucket(5 + 17 + 33), Some(64));
        assert_eq!(prefill_bucket(300), Some(384));
        assert_eq!(prefill_bucket(800), Some(1024));
        assert_eq!(prefill_bucket(1025), Some(1536));
        assert_eq!(prefill_bucket(PREFILL_GRAPH_MAX_TOKENS), Some(PREFILL_GRAPH_MAX_TOKENS));
        assert_eq!(prefill_bucket(PREFILL_GRAPH_MAX_TOKENS + 1), None);
        assert!(PREFILL_BUCKETS.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(PREFILL_BUCKETS.last(), Some(&PREFILL_GRAPH_MAX_TOKENS));
    }

    #[test]
    fn capacities_round_to_quarter_octaves_within_the_model() {
        assert_eq!(round_quarter_octave(256), 256);
        assert_eq!(round_quarter_octave(257), 320);
        assert_eq!(round_quarter_octave(1100), 1280);
        assert_eq!(round_quarter_octave(1793), 2048);
        for n in 1..5000 {
            let r = round_quarter_octave(n);
            assert!(r >= n && r * 4 <= n * 5 + 4, "{n} → {r}");
        }
        // Short requests share the least capacity whatever their new tokens.
        assert_eq!(prefill_capacity(25, 64, 2, 32768), 256);
        assert_eq!(prefill_capacity(200, 64, 2, 32768), 256);
        // Nearby lengths share a capacity.
        assert_eq!(prefill_capacity(1100, 1024, 8, 32768), prefill_capacity(1250, 1024, 8, 32768));
        // Room for the padding at batch 1.
        assert_eq!(prefill_capacity(300, 2048, 1, 32768), 2048);
        // Never past the model's positions, unless the request is (the cache refuses it then).
        assert_eq!(prefill_capacity(100, 512, 1, 256), 256);
        assert_eq!(prefill_capacity(300, 512, 1, 256), 300);
    }

    #[test]
    fn keys_differ_by_what_the_shape_depends_on() {
        let cfg = crate::decoder::DecoderConfig::from_hf_json(
            r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "max_position_embeddings": 4096}"#,
        )
        .unwrap();
        use te_codegen::DType::{BF16, E4M3};
        let key = |batch, needed, bucket, chunk, dtype| CacheKey::new(&cfg, (batch, needed, bucket), chunk, dtype);
        let base = key(2, 40, 64, 1024, BF16);
        assert_eq!(base, key(2, 100, 64, 1024, BF16), "new tokens within the least capacity");
        assert_ne!(base, key(3, 40, 64, 1024, BF16), "batch");
        assert_ne!(base, key(2, 40, 64, 1024, E4M3), "kv dtype");
        assert_ne!(base, key(2, 40, 64, 512, BF16), "prefill chunk");
        assert_ne!(base, key(2, 400, 64, 1024, BF16), "capacity");
    }

    fn prompts(lens: &[usize]) -> Vec<Vec<i32>> {
        lens.iter().enumerate().map(|(j, &n)| (0..n).map(|i| (100 * j + i + 1) as i32).collect()).collect()
    }

    #[test]
    fn padding_follows_each_prompt_in_its_free_rows() {
        let p = prompts(&[5, 17, 33]);
        let plan = PaddedPlan::new(&p, 64, 40).unwrap();
        // 9 padding tokens: all after the first prompt (35 free rows).
        assert_eq!(plan.pad, [9, 0, 0]);
        assert_eq!(plan.ids.len(), 64);
        assert_eq!(&plan.ids[..5], &p[0][..]);
        assert!(plan.ids[5..14].iter().all(|&id| id == 0));
        assert_eq!(&plan.ids[14..31], &p[1][..]);
        assert_eq!(plan.positions[5..14], (0..9).collect::<Vec<i32>>()[..]);
        assert_eq!(plan.cu_seqlens(), [0, 5, 14, 31, 31, 64, 64]);
        assert_eq!(plan.last_rows(), [4, 30, 63]);
        let rows = plan.rows(40);
        assert_eq!(rows.len(), 64);
        assert_eq!(&rows[..14], &(0..14).collect::<Vec<i32>>()[..], "prompt 0 and its padding at rows 0..14");
        assert_eq!(rows[14], 40);
        assert_eq!(rows[31], 80);
        assert_eq!(plan.kv_offsets(40), [0, 5, 40, 57, 80, 113, 120]);
        // Rows are distinct and inside their sequence's block.
        let mut sorted = rows.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 64);
    }

    #[test]
    fn padding_spills_over_sequences_and_refuses_what_does_not_fit() {
        let p = prompts(&[30, 30]);
        // Room 40: 10 free rows after each prompt, 4 padding tokens.
        let plan = PaddedPlan::new(&p, 64, 40).unwrap();
        assert_eq!(plan.pad, [4, 0]);
        // Room 33: 3 free rows each; 4 padding tokens spill into the second sequence.
        let plan = PaddedPlan::new(&p, 64, 33).unwrap();
        assert_eq!(plan.pad, [3, 1]);
        assert_eq!(plan.cu_seqlens(), [0, 30, 33, 63, 64]);
        // Room 31: 2 free rows for 4 tokens.
        assert_eq!(PaddedPlan::new(&p, 64, 31), None);
        // More tokens than the bucket, a prompt past the room.
        assert_eq!(PaddedPlan::new(&prompts(&[40, 30]), 64, 100), None);
        assert_eq!(PaddedPlan::new(&prompts(&[50]), 64, 40), None);
        // An exact fit needs no padding.
        assert_eq!(PaddedPlan::new(&prompts(&[64]), 64, 64).unwrap().pad, [0]);
    }
}
