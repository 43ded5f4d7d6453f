//! Family 15, the decode attention kernels (`ops::decode_attention::decode` / `decode_fp8`: the
//! split-K pass and the combine) on the shapes of the models' decode steps, over a BF16 cache
//! and an E4M3 one: GPT `small` (12 heads of 64, MHA) at batch 1 and 32, 932 cached tokens;
//! Gemma 3 270M (4 query heads over 1 KV head of 256) at batch 32, 1088 tokens; a Llama-3-8B
//! layer (32 heads over 8 of 128) at batch 8, 4096 tokens. Replayed from a CUDA graph of
//! [`REPS`] calls, as a decode step runs them. The floor: the cached keys and values read once
//! (`2 · batch · len · groups · head_dim` elements) over this run's copy bandwidth.

use crate::harness::Bench;
use te_runtime::graph::HostCopies;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::decode_attention::{decode, decode_fp8, KvScales, Strided};
use te_runtime::{DType, Tensor};

/// Calls a graph holds.
const REPS: usize = 20;

pub fn run(b: &mut Bench) {
    let work = "decode attention";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    // (what, batch, heads, groups, head_dim, cached tokens)
    let shapes = [
        ("gpt small", 1, 12, 12, 64, 932),
        ("gpt small", 32, 12, 12, 64, 932),
        ("gemma3 270m", 32, 4, 1, 256, 1088),
        ("llama3 8b", 8, 32, 8, 128, 4096),
    ];
    for (model, batch, heads, groups, d, len) in shapes {
        let capacity = len + 32;
        let p = AttentionShape::decode(batch, heads, groups, d, capacity, 1.0 / (d as f32).sqrt());
        let n_q = batch * heads * d;
        let qv: Vec<f32> = (0..n_q).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) * 1e-3).collect();
        let q = Tensor::from_f32(&dev, DType::BF16, &[batch, heads * d], &qv).unwrap();
        let mut out = Tensor::zeros(&dev, DType::BF16, &[batch, heads * d]).unwrap();
        let seqlens = dev.stream().htod(&vec![len as i32; batch]).unwrap();
        let scales = dev.stream().htod(&KvScales::values(1.0, 1.0).unwrap()).unwrap();
        let elems = batch * capacity * groups * d;
        let kv: Vec<f32> = (0..elems).map(|i| ((i * 2_654_435_761 % 2001) as f32 - 1000.0) * 1e-3).collect();
        let shape = [batch, capacity, groups, d];
        for dtype in [DType::BF16, DType::E4M3] {
            let k = Tensor::from_f32(&dev, dtype, &shape, &kv).unwrap();
            let v = Tensor::from_f32(&dev, dtype, &shape, &kv).unwrap();
            let qs = Strided { tensor: &q, offset: 0, row: heads * d };
            let st = b.graphed(REPS, || {
                match dtype {
                    DType::E4M3 => {
                        decode_fp8(&dev, &p, qs, [&k, &v], KvScales(&scales), &seqlens, (&mut out, heads * d))
                    }
                    _ => decode(&dev, &p, qs, [&k, &v], &seqlens, (&mut out, heads * d)),
                }
                .unwrap()
            });
            let bytes = (2 * batch * len * groups * d * dtype.size_bytes()) as u64;
            let cache = if dtype == DType::E4M3 { "e4m3" } else { "bf16" };
            let shape = format!("{model} b{batch} h{heads}/{groups} d{d} len {len}");
            b.record(&format!("{work} {cache} cache"), &shape, st, Some(bytes), None);
            let floor_us = bytes as f64 / (b.copy_gbps * 1e3);
            println!("{work} {cache} cache {shape}: {:.1} µs, floor {floor_us:.1} µs", st.median_us);
        }
    }
}
