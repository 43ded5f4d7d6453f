//! The decoder's prefill replayed from CUDA graphs per length bucket
//! (`Decoder::set_prefill_graphs(PrefillGraphs::On)`) on the tiny random fixtures (Qwen2, Qwen3,
//! Gemma 3; and the `TE_HF_TINY` ones when set): the replayed prefill's logits (each prompt's last
//! token) and greedy tokens equal the eager prefill of the same padded shape
//! (`PrefillGraphs::PaddedEager`) bit for bit, over several calls that reuse a bucket's graph with
//! other prompts, a second bucket, BF16 and E4M3 KV caches, FP8 GEMMs, and the sliding-window
//! layers' smaller rows; a prefill past the largest bucket runs eagerly. Against the unpadded
//! eager prefill (`PrefillGraphs::Off`): the padded GEMMs may pick other cuBLASLt algorithms (and
//! FP8's amax sees the padding rows), so the logits agree within BF16 rounding: max |Δ| ≤ 2·10⁻²
//! (the bound `decoder.rs` puts on a sequence alone against it batched, the same change of GEMM
//! rows), FP8 GEMMs within a mean KL of 0.1 of the next-token distributions (FP8 against BF16's
//! bound in `decoder.rs`). The graphs stay
//! within their bounds (buckets, caches) as shapes come and go.

use crate::common::device;
use std::path::{Path, PathBuf};
use te_codegen::DType;
use te_models::decoder::gpu::prefill_plan::{MAX_PREFILL_CACHES, MAX_PREFILL_GRAPHS};
use te_models::decoder::gpu::{PrefillGraphs, PREFILL_GRAPH_MAX_TOKENS};
use te_models::decoder::{DecodeOptions, Decoder, DecoderWeights, GpuPrecision};
use te_nn::fp8::Recipe;

const NEW_TOKENS: usize = 8;

/// The fixtures the fused attention takes (head dims 32 and 64), and `TE_HF_TINY`'s.
fn models() -> Vec<(String, PathBuf)> {
    let repo = Path::new("te-models/tests/fixtures/decoder");
    let mut v: Vec<(String, PathBuf)> =
        ["qwen2", "qwen3", "gemma3"].iter().map(|m| (m.to_string(), repo.join(m))).collect();
    if let Ok(dir) = std::env::var("TE_HF_TINY") {
        for m in ["llama", "qwen2", "qwen3", "gemma3"] {
            v.push((format!("{m} (made here)"), Path::new(&dir).join(m)));
        }
    }
    v
}

/// Prompts of `lens` tokens, from `seed` (ids in the fixtures' vocabulary of 300).
fn prompts(lens: &[usize], seed: usize) -> Vec<Vec<i32>> {
    lens.iter()
        .enumerate()
        .map(|(j, &n)| (0..n).map(|i| (1 + (i * 37 + j * 101 + seed * 13) % 290) as i32).collect())
        .collect()
}

/// A tolerance check of the padded prefill's logits against the unpadded one's.
type Close<'a> = &'a dyn Fn(&str, &[f32], &[f32]);

/// One decoder of `dir` per prefill mode: graphs, the padded shape eagerly, unpadded eagerly.
struct Trio {
    graph: Decoder,
    padded: Decoder,
    eager: Decoder,
}

impl Trio {
    fn new(dev: &std::sync::Arc<te_runtime::Device>, dir: &Path, precision: GpuPrecision, kv: DType) -> Self {
        let make = |mode| {
            let mut m = Decoder::new(dev, DecoderWeights::from_hf_dir(dir).unwrap(), precision).unwrap();
            m.set_kv_cache_dtype(kv).unwrap();
            m.set_prefill_graphs(mode);
            m
        };
        Self {
            graph: make(PrefillGraphs::On),
            padded: make(PrefillGraphs::PaddedEager),
            eager: make(PrefillGraphs::Off),
        }
    }

    fn each(&mut self, f: impl Fn(&mut Decoder)) {
        for m in [&mut self.graph, &mut self.padded, &mut self.eager] {
            f(m);
        }
    }

    /// `set` through every decoder: the graph's logits and greedy tokens equal the padded eager
    /// prefill's bit for bit; the logits within `close` of the unpadded prefill's. Returns the
    /// graph's logits.
    fn check(&mut self, what: &str, set: &[Vec<i32>], close: Close<'_>) -> Vec<f32> {
        let got = self.graph.prefill_logits(set, NEW_TOKENS).unwrap();
        assert!(self.graph.graph_fallback().is_none(), "{what}: {:?}", self.graph.graph_fallback());
        let want = self.padded.prefill_logits(set, NEW_TOKENS).unwrap();
        assert!(got.iter().all(|x| x.is_finite()), "{what}: non-finite logits");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if let Some(i) = bits(&got).iter().zip(bits(&want)).position(|(a, b)| *a != b) {
            panic!("{what}: logit {i} of the graph's prefill is {}, the padded eager one's {}", got[i], want[i]);
        }
        close(what, &got, &self.eager.prefill_logits(set, NEW_TOKENS).unwrap());
        let opts = DecodeOptions { stop_at_eos: false, ..DecodeOptions::greedy(NEW_TOKENS) };
        let tokens = self.graph.generate(set, &opts, &mut |_, _| Ok(())).unwrap();
        assert!(self.graph.graph_fallback().is_none(), "{what}: {:?}", self.graph.graph_fallback());
        let reference = self.padded.generate(set, &opts, &mut |_, _| Ok(())).unwrap();
        assert_eq!(tokens, reference, "{what}: greedy tokens after the graph's prefill and the padded eager one");
        got
    }
}

/// BF16 GEMMs: max |Δ| within 2·10⁻² (scaled by the logits' size past 1).
fn bf16_close(what: &str, got: &[f32], want: &[f32]) {
    let worst = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = want.iter().fold(1f32, |a, b| a.max(b.abs()));
    eprintln!("{what}: padded vs unpadded prefill max |Δ| {worst:.2e} (logits up to {scale:.2})");
    assert!(worst <= 2e-2 * scale, "{what}: the padded prefill's logits differ from the unpadded ones by {worst}");
}

/// FP8 GEMMs: the next-token distributions within a mean KL of 0.1 (`decoder.rs`' bound of FP8
/// against BF16: the padding rows move the activations' amax, so their scales, as much).
fn fp8_close(vocab: usize) -> impl Fn(&str, &[f32], &[f32]) {
    move |what: &str, got: &[f32], want: &[f32]| {
        let kl = mean_kl(want, got, vocab);
        eprintln!("{what}: padded vs unpadded prefill mean KL {kl:.2e}");
        assert!(kl.is_finite() && kl <= 0.1, "{what}: mean KL {kl}");
    }
}

fn mean_kl(p_logits: &[f32], q_logits: &[f32], vocab: usize) -> f64 {
    let log_softmax = |r: &[f32]| -> Vec<f64> {
        let m = r.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let z = r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln() + m;
        r.iter().map(|&x| x as f64 - z).collect()
    };
    let rows = p_logits.len() / vocab;
    let mut total = 0.0;
    for (p, q) in p_logits.chunks(vocab).zip(q_logits.chunks(vocab)) {
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        total += lp.iter().zip(&lq).map(|(a, b)| a.exp() * (a - b)).sum::<f64>();
    }
    total / rows as f64
}

/// Whether the fused attention takes the model's head dim (the repository's Llama fixture has 16).
fn runs_on_the_gpu(dir: &Path) -> bool {
    [32, 64, 96, 128, 256].contains(&DecoderWeights::from_hf_dir(dir).unwrap().config().head_dim)
}

/// Prompts of 5, 17 and 33 tokens (bucket 64) captured at the second prefill and replayed by
/// later calls with other prompts of the same bucket, a second bucket (128), and a prefill past
/// the largest bucket (eager, no graph): bit for bit the padded eager prefill, close to the
/// unpadded one; for BF16 and E4M3 KV caches and FP8 GEMMs.
#[test]
fn prefill_graphs_replay_the_padded_prefill_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut ran = 0;
    for (model, dir) in models() {
        if !runs_on_the_gpu(&dir) {
            continue;
        }
        let vocab = DecoderWeights::from_hf_dir(&dir).unwrap().config().vocab_size;
        let fp8 = GpuPrecision::Fp8 { recipe: Recipe::Current(Default::default()), lm_head: false };
        let (bf, f8) = (&bf16_close as Close<'_>, &fp8_close(vocab) as Close<'_>);
        for (label, precision, kv, close) in [
            ("bf16", GpuPrecision::Bf16, DType::BF16, bf),
            ("bf16 + e4m3 kv", GpuPrecision::Bf16, DType::E4M3, bf),
            ("fp8", fp8, DType::BF16, f8),
        ] {
            let what = format!("{model} {label}");
            let mut t = Trio::new(&dev, &dir, precision, kv);
            let stats = |t: &Trio| t.graph.prefill_graph_stats();
            // Bucket 64: the first prefill warms up (eager), the second (generate's) is captured
            // and replayed.
            t.check(&format!("{what} [5, 17, 33]"), &prompts(&[5, 17, 33], 0), close);
            let s = stats(&t);
            assert_eq!((s.captured, s.replays), (1, 1), "{what}: {s:?}");
            // Other prompts of the same bucket replay the graph.
            t.check(&format!("{what} [7, 20, 30]"), &prompts(&[7, 20, 30], 1), close);
            t.check(&format!("{what} [33, 5, 17]"), &prompts(&[33, 5, 17], 2), close);
            assert_eq!(stats(&t).replays, 5, "{what}: {:?}", stats(&t));
            // Bucket 128: a graph of its own over the same cache.
            t.check(&format!("{what} [30, 41, 27]"), &prompts(&[30, 41, 27], 3), close);
            t.check(&format!("{what} [50, 9, 44]"), &prompts(&[50, 9, 44], 4), close);
            let s = stats(&t);
            assert_eq!((s.captured, s.caches, s.replays), (2, 1, 8), "{what}: {s:?}");
            // Back to bucket 64: its graph is still there.
            t.check(&format!("{what} [6, 6, 6]"), &prompts(&[6, 6, 6], 5), close);
            assert_eq!(stats(&t).replays, 10, "{what}: {:?}", stats(&t));
            // Past the largest bucket: eager, unpadded, no graph (the same logits as `Off`).
            let long = prompts(&[180; 12], 6);
            assert!(long.iter().map(Vec::len).sum::<usize>() > PREFILL_GRAPH_MAX_TOKENS);
            let (a, b) = (t.graph.prefill_logits(&long, 4).unwrap(), t.eager.prefill_logits(&long, 4).unwrap());
            assert!(a == b, "{what}: a prefill past the largest bucket runs as the eager one");
            assert_eq!(stats(&t).replays, 10, "{what}: no replay past the largest bucket");
            // Graphs off: the same padded shape eagerly, bit for bit the replays.
            t.graph.set_cuda_graph(false);
            let set = prompts(&[9, 19, 29], 7);
            let eager = t.graph.prefill_logits(&set, NEW_TOKENS).unwrap();
            assert!(eager == t.padded.prefill_logits(&set, NEW_TOKENS).unwrap(), "{what}: graphs off");
            assert_eq!(stats(&t).replays, 10, "{what}: graphs off replay nothing");
            ran += 1;
        }
    }
    assert!(ran > 0, "no model ran");
}

/// The sliding-window layers' smaller rows (Gemma 3 with a prefill chunk of 16: `window + 16`
/// rows a sequence) hold the padding too: prompts of 5, 17 and 9 tokens padded to 64 spill their
/// padding over all three sequences; the decode steps move the rows past the window and the greedy
/// tokens stay the padded eager prefill's. A prompt longer than the sliding rows runs eagerly.
#[test]
fn prefill_graphs_fit_the_sliding_rows() {
    let Some(dev) = device() else { return };
    let mut ran = 0;
    for (model, dir) in models().into_iter().filter(|(m, _)| m.starts_with("gemma3")) {
        if !runs_on_the_gpu(&dir) {
            continue;
        }
        let mut t = Trio::new(&dev, &dir, GpuPrecision::Bf16, DType::BF16);
        t.each(|m| m.set_prefill_chunk(16).unwrap());
        let rows = t.graph.cache(3, 256).unwrap().sliding_capacity();
        let Some(rows) = rows else { panic!("{model}: a chunk of 16 keeps the sliding rows small") };
        assert!(rows < 5 + 17 + 9, "{model}: {rows} rows a sequence");
        for seed in 0..3 {
            t.check(&format!("{model} sliding [5, 17, 9] #{seed}"), &prompts(&[5, 17, 9], seed), &bf16_close);
        }
        assert_eq!(t.graph.prefill_graph_stats().replays, 5, "{model}");
        // Longer decoding: the rows move to the front several times.
        let set = prompts(&[5, 17, 9], 9);
        let opts = DecodeOptions { stop_at_eos: false, ..DecodeOptions::greedy(3 * rows) };
        let a = t.graph.generate(&set, &opts, &mut |_, _| Ok(())).unwrap();
        assert!(t.graph.graph_fallback().is_none(), "{model}: {:?}", t.graph.graph_fallback());
        assert_eq!(a, t.padded.generate(&set, &opts, &mut |_, _| Ok(())).unwrap(), "{model}: past the window");
        // A prompt longer than the sliding rows: eager (chunked), as `Off`.
        let long = prompts(&[rows + 3, 4], 10);
        let before = t.graph.prefill_graph_stats().replays;
        let (a, b) = (t.graph.prefill_logits(&long, 4).unwrap(), t.eager.prefill_logits(&long, 4).unwrap());
        assert!(a == b, "{model}: a prompt past the sliding rows runs as the eager one");
        assert_eq!(t.graph.prefill_graph_stats().replays, before, "{model}");
        ran += 1;
    }
    assert!(ran > 0, "no Gemma 3 model ran");
}

/// A tiny random Llama whose context (4096 positions) holds every bucket.
fn long_context_weights() -> DecoderWeights {
    let json = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}"#;
    let cfg = te_models::decoder::DecoderConfig::from_hf_json(json).unwrap();
    let mut tensors = std::collections::BTreeMap::new();
    for (k, p) in te_models::decoder::hf_layout(&cfg).into_iter().enumerate() {
        let n: usize = p.shape.iter().product();
        let mut data = crate::common::randn(k as u64 + 1, n, 0.05);
        if p.name.contains("norm") {
            // Llama scales by γ itself: near 1.
            data.iter_mut().for_each(|x| *x += 1.0);
        }
        tensors.insert(p.name, te_models::decoder::WeightTensor { shape: p.shape, data });
    }
    DecoderWeights::from_tensors(cfg, tensors).unwrap()
}

/// `total` tokens over `batch` prompts (the first takes the remainder).
fn split(total: usize, batch: usize) -> Vec<usize> {
    (0..batch).map(|j| total / batch + usize::from(j == 0) * (total % batch)).collect()
}

/// Shapes come and go: batch 8 over every bucket (64 to 2048 tokens) in one cache, then batches 1
/// and 2 in caches of their own. The decoder keeps at most `MAX_PREFILL_GRAPHS` buckets over at
/// most `MAX_PREFILL_CACHES` caches, the least recently used dropped first; a bucket met again
/// after its eviction is warmed up and captured anew (5 replays in 6 prefills), one still held
/// replays at once (6 in 6), and all stay bit for bit the padded eager prefill.
#[test]
fn prefill_graphs_stay_bounded() {
    // Made first: without a GPU the test still checks the model's configuration.
    let weights = long_context_weights();
    let Some(dev) = device() else { return };
    let make = |mode| {
        let mut m = Decoder::new(&dev, weights.clone(), GpuPrecision::Bf16).unwrap();
        m.set_prefill_graphs(mode);
        m
    };
    let mut t = Trio {
        graph: make(PrefillGraphs::On),
        padded: make(PrefillGraphs::PaddedEager),
        eager: make(PrefillGraphs::Off),
    };
    let mut seed = 100;
    let mut run = |t: &mut Trio, batch: usize, total: usize, replays: u64| {
        let set = prompts(&split(total, batch), seed);
        seed += 1;
        let before = t.graph.prefill_graph_stats().replays;
        for _ in 0..3 {
            t.check(&format!("batch {batch}, {total} tokens"), &set, &bf16_close);
        }
        let s = t.graph.prefill_graph_stats();
        assert_eq!(s.replays - before, replays, "batch {batch}, {total} tokens: {s:?}");
        assert!(s.buckets <= MAX_PREFILL_GRAPHS && s.caches <= MAX_PREFILL_CACHES, "{s:?}");
        s
    };
    for total in [40, 100, 200, 300, 450, 600, 900, 1200, 1800] {
        run(&mut t, 8, total, 5);
    }
    let s = t.graph.prefill_graph_stats();
    assert_eq!((s.buckets, s.captured, s.caches), (MAX_PREFILL_GRAPHS, MAX_PREFILL_GRAPHS, 1), "{s:?}");
    // Bucket 64 went first: warmed up and captured anew (bucket 128 goes now).
    run(&mut t, 8, 40, 5);
    // A second cache, then its bucket again: held, it replays at once.
    run(&mut t, 1, 100, 5);
    run(&mut t, 1, 100, 6);
    // A third cache: batch 8's goes with its buckets.
    let s = run(&mut t, 2, 40, 5);
    assert_eq!((s.caches, s.buckets), (2, 2), "{s:?}");
    run(&mut t, 8, 40, 5);
    assert!(t.graph.prefill_graph_stats().cache_bytes > 0);
    t.graph.set_prefill_graphs(PrefillGraphs::Off);
    assert_eq!(t.graph.prefill_graph_stats(), Default::default(), "turning them off drops them");
}
