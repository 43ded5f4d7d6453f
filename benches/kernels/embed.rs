//! `te embed`'s device work on MiniLM-L6's architecture (seeded random weights, so no download):
//! 4 096 sentences of 8 to 64 tokens sorted into batches of 32 and 256, embedded eagerly and
//! with the batches replayed from CUDA graphs per padded shape (`Bert::set_cuda_graph`, te
//! embed's default), BF16 and FP8 (current scaling). One pass = every batch enqueued, then the
//! pooled sums read back (`Bert::embed_batches`); the graphed model ran one pass before (it
//! captures each shape's graph on its second batch), as the eager one did.

use crate::harness::{Bench, Stats};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::time::Instant;
use te_models::bert::{Bert, BertConfig, BertWeights, HostTensor, WeightPrecision};

pub fn run(b: &mut Bench) {
    let work = "minilm embed";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let cfg = BertConfig::minilm_l6();
    let mut rng = StdRng::seed_from_u64(3);
    let tensors: HashMap<String, HostTensor> = BertWeights::layout(&cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let base = if name.ends_with("LayerNorm.weight") { 1.0 } else { 0.0 };
            (name, HostTensor { data: (0..n).map(|_| base + rng.random_range(-0.08f32..0.08)).collect(), shape })
        })
        .collect();
    let weights = BertWeights::from_tensors(tensors);
    let seqs: Vec<Vec<u32>> = (0..4096)
        .map(|_| (0..rng.random_range(8..=64)).map(|_| rng.random_range(1000..cfg.vocab_size as u32)).collect())
        .collect();
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    for batch in [32, 256] {
        let batches: Vec<Vec<Vec<u32>>> = te::embed::buckets(&lengths, batch)
            .iter()
            .map(|ix| ix.iter().map(|&i| seqs[i].clone()).collect())
            .collect();
        for (precision, name) in [(WeightPrecision::Bf16, "bf16"), (WeightPrecision::Fp8, "fp8")] {
            let mut times = Vec::new();
            for graphs in [false, true] {
                let mut m = Bert::new(&dev, &cfg, &weights, precision).unwrap();
                m.set_cuda_graph(graphs);
                m.embed_batches(&batches).unwrap();
                let passes = 5;
                let mut samples = Vec::with_capacity(passes);
                for _ in 0..passes {
                    let t = Instant::now();
                    m.embed_batches(&batches).unwrap();
                    samples.push(t.elapsed().as_secs_f64() * 1e6);
                }
                let st = Stats::from_samples(samples);
                let variant = if graphs { "graph" } else { "eager" };
                let per_s = seqs.len() as f64 / (st.median_us * 1e-6);
                println!("{work} b{batch} {name} {variant}: {per_s:.0} sentences/s ({:.0} µs a pass)", st.median_us);
                b.record(&format!("{work} {name} {variant}"), &format!("b{batch} n{}", seqs.len()), st, None, None);
                b.record_ratio(&format!("{work} b{batch} {name} {variant}: sentences/s"), per_s, None);
                times.push(st.median_us);
            }
            b.record_ratio(&format!("{work} b{batch} {name}: graph speed-up"), times[0] / times[1], None);
        }
    }
}
