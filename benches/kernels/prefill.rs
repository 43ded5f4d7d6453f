//! The decoder's prefill eager against replayed from its length bucket's CUDA graph
//! (`Decoder::set_prefill_graphs`) on Gemma 3 270M (the real GGUF when `TE_GEMMA_GGUF` names it,
//! else its architecture with random weights, as `decoder.rs`): batch 1 × 128 tokens, batch 1 ×
//! 1000, and batch 8 of mixed lengths (60 to 140 tokens, 800 together, bucket 1024), BF16. Each
//! variant times a generation of one token (the prefill, the LM head of each prompt's last token,
//! the greedy pick back on the host: the time to the first token) by the wall clock, 20 calls
//! after 3 untimed ones (the graph is captured at the second): "eager" packs the prompts without
//! padding (`PrefillGraphs::Off`, the default), "padded eager" runs the graph's padded shape
//! without the graph (`PaddedEager`: the padding's cost alone), "graph" replays it (`On`). The
//! capture's own cost (the second call, warm-up done) is printed beside.

use crate::decoder::weights;
use crate::harness::{Bench, Stats, Work};
use te_models::decoder::gpu::{prefill_bucket, PrefillGraphs};
use te_models::decoder::{DecodeOptions, Decoder, GpuPrecision};

const WARMUP: usize = 3;
const ITERS: usize = 20;

pub fn run(b: &mut Bench) {
    let work = "gemma3 270m prefill";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let (w, source) = weights();
    println!("{work}: {source}");
    let mixed = [60, 75, 90, 100, 105, 110, 120, 140];
    let shapes: [(&str, Vec<usize>); 3] =
        [("b1 prompt 128", vec![128]), ("b1 prompt 1000", vec![1000]), ("b8 mixed 60-140", mixed.to_vec())];
    let opts = DecodeOptions { stop_at_eos: false, ..DecodeOptions::greedy(1) };
    for (shape, lens) in shapes {
        let tokens: usize = lens.iter().sum();
        let bucket = prefill_bucket(tokens).unwrap_or(tokens);
        let prompts: Vec<Vec<i32>> = lens
            .iter()
            .enumerate()
            .map(|(j, &n)| (0..n).map(|i| (3 + (i * 7919 + j * 104_729) % 200_000) as i32).collect())
            .collect();
        let mut eager_us = None;
        for (variant, mode) in
            [("eager", PrefillGraphs::Off), ("padded eager", PrefillGraphs::PaddedEager), ("graph", PrefillGraphs::On)]
        {
            let mut model = Decoder::new(&dev, w.clone(), GpuPrecision::Bf16).unwrap();
            model.set_prefill_graphs(mode);
            let mut call = || {
                let start = std::time::Instant::now();
                model.generate(&prompts, &opts, &mut |_, _| Ok(())).unwrap();
                start.elapsed().as_secs_f64() * 1e6
            };
            let warm: Vec<f64> = (0..WARMUP).map(|_| call()).collect();
            let stats = Stats::from_samples((0..ITERS).map(|_| call()).collect());
            if let Some(why) = model.graph_fallback() {
                println!("{work} {shape} {variant}: a graph fell back: {why}");
            }
            let replays = model.prefill_graph_stats().replays;
            if mode == PrefillGraphs::On {
                assert!(replays >= ITERS as u64, "{work} {shape}: {replays} replays of the prefill graph");
                println!(
                    "{work} {shape}: the capture's call (warm) took {:.0} µs, a replayed call {:.0} µs",
                    warm[1], stats.median_us
                );
            }
            b.record_work(
                shape,
                stats,
                0,
                None,
                Work {
                    section: "generate",
                    work: work.into(),
                    pass: "prefill",
                    variant: format!("ours bf16 {variant}"),
                    precision: "bf16",
                    flops_fp8: 0,
                    tokens: Some(tokens as u64),
                },
            );
            let tps = tokens as f64 / (stats.median_us * 1e-6);
            b.record_ratio(&format!("{work} {shape} {variant}: prompt tokens/s"), tps, None);
            let eager = *eager_us.get_or_insert(stats.median_us);
            if mode != PrefillGraphs::Off {
                b.record_ratio(&format!("{work} {shape} {variant}: eager ÷ {variant}"), eager / stats.median_us, None);
            }
            println!(
                "{work} {shape} ({tokens} tokens, bucket {bucket}) {variant}: {:.0} µs ({:.0}–{:.0}), {tps:.0} tokens/s",
                stats.median_us, stats.min_us, stats.max_us
            );
        }
    }
}
