//! `te embed`'s CUDA graphs (`Bert::set_cuda_graph`): batches of a padded shape met before
//! replay from that shape's graph, bit for bit the eager batches, in BF16, FP8 with current
//! scaling and FP8 with calibrated (delayed) scaling, on MiniLM's architecture with seeded
//! random weights (no download needed).

use crate::common::device;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use te::embed::buckets;
use te_models::bert::{ActivationScaling, Bert, BertConfig, BertWeights, HostTensor, WeightPrecision};

/// MiniLM-L6's tensors drawn uniformly from ±0.08 (norm weights around 1).
fn random_weights(cfg: &BertConfig) -> BertWeights {
    let mut rng = StdRng::seed_from_u64(11);
    let tensors: HashMap<String, HostTensor> = BertWeights::layout(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let n: usize = shape.iter().product();
            let base = if name.ends_with("LayerNorm.weight") { 1.0 } else { 0.0 };
            let data = (0..n).map(|_| base + rng.random_range(-0.08f32..0.08)).collect();
            (name, HostTensor { shape, data })
        })
        .collect();
    BertWeights::from_tensors(tensors)
}

#[test]
fn graphed_batches_are_bit_exact_with_eager_batches() {
    let Some(dev) = device() else { return };
    let cfg = BertConfig::minilm_l6();
    let weights = random_weights(&cfg);
    let mut rng = StdRng::seed_from_u64(5);
    // [CLS] … [SEP] of 3 to 45 tokens: padded shapes of 16, 32 and 48 positions.
    let seqs: Vec<Vec<u32>> = (0..220)
        .map(|_| {
            let n = rng.random_range(3..=45);
            let mut s = vec![101u32];
            s.extend((0..n - 2).map(|_| rng.random_range(1000..cfg.vocab_size as u32)));
            s.push(102);
            s
        })
        .collect();
    let lengths: Vec<usize> = seqs.iter().map(Vec::len).collect();
    let batches: Vec<Vec<Vec<u32>>> =
        buckets(&lengths, 16).iter().map(|b| b.iter().map(|&i| seqs[i].clone()).collect()).collect();
    let shapes: HashSet<(usize, usize)> =
        batches.iter().map(|b| (b.len(), b.iter().map(Vec::len).max().unwrap().div_ceil(16) * 16)).collect();
    let expected_replays = (batches.len() - shapes.len()) as u64;
    assert!(
        expected_replays >= 6,
        "the batches must repeat shapes: {} batches, {} shapes",
        batches.len(),
        shapes.len()
    );
    let variants = [
        ("bf16", WeightPrecision::Bf16, ActivationScaling::Current),
        ("fp8 current", WeightPrecision::Fp8, ActivationScaling::Current),
        ("fp8 calibrated", WeightPrecision::Fp8, ActivationScaling::Calibrated),
    ];
    for (what, precision, scaling) in variants {
        let run = |graphs: bool| {
            let mut m = Bert::new(&dev, &cfg, &weights, precision).unwrap();
            m.set_scaling(scaling);
            if scaling == ActivationScaling::Calibrated {
                m.calibrate(&batches[..3]).unwrap();
            }
            m.set_cuda_graph(graphs);
            // Twice over the batches: the second pass replays every shape.
            let first = m.embed_batches(&batches).unwrap();
            let second = m.embed_batches(&batches).unwrap();
            (first, second, m.graph_replays())
        };
        let (eager1, eager2, none) = run(false);
        assert_eq!(none, 0);
        let (graph1, graph2, replays) = run(true);
        assert_eq!(replays, expected_replays + batches.len() as u64, "{what}: replays");
        let bits = |v: &Vec<Vec<Vec<f32>>>| -> Vec<u32> { v.iter().flatten().flatten().map(|x| x.to_bits()).collect() };
        assert_eq!(bits(&graph1), bits(&eager1), "{what}: first pass");
        assert_eq!(bits(&graph2), bits(&eager2), "{what}: second pass");
        assert!(graph1.iter().flatten().all(|e| e.iter().all(|x| x.is_finite())), "{what}: finite");
    }
}
