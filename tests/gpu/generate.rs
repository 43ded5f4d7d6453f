//! Generation with the GPU GPT over a KV cache: the cached forward (prefill through the fused
//! attention, decode steps through the decode kernels) against the CPU twin's logits of the
//! whole prefix (BF16 GEMM inputs there, relative Frobenius ≤ 3e-2: the GPU also keeps the
//! residual stream and the norms in BF16) and against the GPU's own prefill of the whole prefix
//! (≤ 2e-2); the decode steps replayed from a CUDA graph give the eager steps' tokens; the cache
//! is reused across calls; an E4M3 cache (`Gpt::inference_params_fp8`) follows the 16-bit one;
//! typed errors.

use crate::common::device;
use te_models::cpu::gpt::{GemmPrecision, GptRef};
use te_models::generate::SamplingConfig;
use te_models::{GenerateOptions, Gpt, GptConfig};
use te_nn::modules::{InferenceParams, Param, ParamKind, TokenIds};
use te_nn::Module;
use te_reference::linear::rel_frobenius;
use te_runtime::{DType, Device, Result};

fn config() -> GptConfig {
    GptConfig {
        hidden_size: 128,
        num_layers: 2,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 64,
        hidden_dropout: 0.0,
        params_dtype: DType::BF16,
        seed: 21,
        ..GptConfig::tiny()
    }
}

/// The GPU model's parameters by name, as f32.
fn named(gpt: &Gpt, dev: &Device) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    gpt.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        out.push((path.to_owned(), p.tensor().expect("a tensor").to_f32(dev)?));
        Ok(())
    })
    .unwrap();
    out
}

/// `[s, b]` row-major ids of `seqs` up to position `s`.
fn prefix(seqs: &[Vec<i32>], s: usize) -> Vec<i32> {
    let b = seqs.len();
    (0..s * b).map(|t| seqs[t % b][t / b]).collect()
}

/// One step of `s` tokens per sequence at position `p0` through the cached forward; the logits
/// of its last position `[b, vocab]`.
fn step(gpt: &mut Gpt, dev: &Device, params: &mut InferenceParams, ids: &[i32], s: usize, p0: usize) -> Vec<f32> {
    let b = ids.len() / s;
    let positions: Vec<i32> = (0..s * b).map(|t| (p0 + t / b) as i32).collect();
    let ids = TokenIds::from_host(dev, &[s, b], ids).unwrap();
    let positions = TokenIds::from_host(dev, &[s, b], &positions).unwrap();
    params.begin_step(s).unwrap();
    let logits = gpt.forward_cached(&ids, &positions, params).unwrap().to_f32(dev).unwrap();
    params.end_step();
    logits[logits.len() - b * 256..].to_vec()
}

#[test]
fn cached_decode_matches_the_cpu_twin_and_the_full_prefill() {
    let Some(dev) = device() else { return };
    let cfg = config();
    let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    gpt.set_training(false);
    let mut cpu = GptRef::from_named(&cfg, named(&gpt, &dev)).unwrap();
    cpu.set_precision(GemmPrecision::Bf16).unwrap();
    // Batch 3 steps through GEMMs, batches 2 and 1 through the fused decode GEMVs.
    for b in [3, 2, 1] {
        let (prompt, total) = (9, 30);
        let seqs: Vec<Vec<i32>> =
            (0..b as i32).map(|j| (0..total as i32).map(|i| (i * 37 + j * 101 + 7) % 256).collect()).collect();
        let mut params = gpt.inference_params(b, 40).unwrap();
        let mut got = step(&mut gpt, &dev, &mut params, &prefix(&seqs, prompt), prompt, 0);
        for pos in prompt..total {
            let want = cpu.logits(&prefix(&seqs, pos), pos, b).unwrap();
            let want = &want[(pos - 1) * b * 256..];
            let e = rel_frobenius(&got, want);
            assert!(e <= 3e-2, "b{b} position {pos}: relative error {e:.3e} against the CPU twin");
            // The GPU's own prefill of the whole prefix, in a cache of its own.
            let mut fresh = gpt.inference_params(b, 40).unwrap();
            let full = step(&mut gpt, &dev, &mut fresh, &prefix(&seqs, pos), pos, 0);
            let e = rel_frobenius(&got, &full);
            assert!(e <= 2e-2, "b{b} position {pos}: relative error {e:.3e} against the GPU prefill");
            let next: Vec<i32> = (0..b).map(|j| seqs[j][pos]).collect();
            got = step(&mut gpt, &dev, &mut params, &next, 1, pos);
        }
        assert_eq!(params.len(), total);
    }
}

#[test]
fn graph_replayed_decode_draws_the_eager_tokens() {
    let Some(dev) = device() else { return };
    let mut gpt = Gpt::new(&dev, config()).unwrap();
    gpt.set_training(false);
    let prompts = vec![vec![72, 101, 108, 108, 111], vec![87, 111, 114, 108, 100]];
    let mut params = gpt.inference_params(2, 64).unwrap();
    let sampled = SamplingConfig { temperature: 1.0, top_k: Some(40), top_p: Some(0.95) };
    for sampling in [SamplingConfig::greedy(), sampled] {
        let mut run = |cuda_graph: bool| {
            let mut streamed = 0;
            let options = GenerateOptions { cuda_graph, ..Default::default() };
            let out = gpt
                .generate(&mut params, &prompts, 40, (&sampling, 5), options, |_, next| {
                    streamed += next.len();
                    Ok(())
                })
                .unwrap();
            assert_eq!(streamed, 80);
            out
        };
        let eager = run(false);
        let graphed = run(true);
        let again = run(true);
        assert_eq!(graphed, eager, "{sampling:?}: the graph replays the eager steps");
        assert_eq!(again, eager, "{sampling:?}: the cache is reused across calls");
        assert!(eager.iter().all(|s| s.len() == 40 && s.iter().all(|t| (0..256).contains(t))));
    }
}

/// Generation gives its memory back: twenty requests in one process (eager and graph-replayed, a
/// new KV cache each, the model built and dropped around them) leave the memory this process can
/// allocate (`Device::memory_info`) where two requests before them left it.
#[test]
fn generation_requests_give_their_memory_back() {
    let Some(dev) = device() else { return };
    let prompts = vec![vec![72, 101, 108, 108, 111]; 4];
    let run = |requests: usize| {
        let mut gpt = Gpt::new(&dev, GptConfig { seq_length: 512, ..config() }).unwrap();
        gpt.set_training(false);
        for r in 0..requests {
            let mut params = gpt.inference_params(4, 512).unwrap();
            let options = GenerateOptions { cuda_graph: r % 2 == 1, ..Default::default() };
            let greedy = SamplingConfig::greedy();
            gpt.generate(&mut params, &prompts, 64, (&greedy, 5), options, |_, _| Ok(())).unwrap();
        }
    };
    // Two requests load every kernel and make the GEMM engine (device state that stays).
    run(2);
    dev.synchronize().unwrap();
    let (start, _) = dev.memory_info().unwrap();
    run(20);
    dev.synchronize().unwrap();
    let (end, _) = dev.memory_info().unwrap();
    let mib = |b: u64| b >> 20;
    assert!(end + (8 << 20) >= start, "{} MiB available before 20 requests, {} after", mib(start), mib(end));
}

#[test]
fn bad_generations_are_typed_errors() {
    let Some(dev) = device() else { return };
    let mut gpt = Gpt::new(&dev, config()).unwrap();
    let e = gpt.inference_params(1, 65).unwrap_err().to_string();
    assert!(e.contains("context of 64"), "{e}");
    let f32_model = Gpt::new(&dev, GptConfig { params_dtype: DType::F32, ..config() }).unwrap();
    assert!(f32_model.inference_params(1, 8).is_err(), "the decode kernels take bf16/f16");
    let mut params = gpt.inference_params(1, 10).unwrap();
    let g = SamplingConfig::greedy();
    let mut run = |prompts: &[Vec<i32>], n| {
        gpt.generate(&mut params, prompts, n, (&g, 0), GenerateOptions::default(), |_, _| Ok(()))
            .unwrap_err()
            .to_string()
    };
    assert!(run(&[vec![1; 6]], 5).contains("10 positions"));
    assert!(run(&[vec![1], vec![2]], 1).contains("batch 1"));
    assert!(run(&[vec![]], 1).contains("empty prompt"));
    assert!(run(&[vec![300]], 1).contains("outside [0, 256)"));
    let mut params = gpt.inference_params(1, 10).unwrap();
    params.begin_step(4).unwrap();
    assert!(params.begin_step(1).is_err(), "one step at a time");
    let ids = TokenIds::from_host(&dev, &[2, 1], &[1, 2]).unwrap();
    let e = gpt.forward_cached(&ids, &ids, &mut params).unwrap_err().to_string();
    assert!(e.contains("begin_step"), "{e}");
    params.end_step();
    assert!(params.begin_step(7).is_err(), "beyond the capacity");
}

/// Decode steps over an E4M3 cache (per-tensor scales 8) against the same steps over the BF16
/// cache: the logits within E4M3's precision (relative Frobenius ≤ 6e-2), batch 3 through GEMMs
/// and batch 1 through the fused GEMVs; the scales' typed errors.
#[test]
fn an_e4m3_kv_cache_follows_the_16_bit_cache() {
    let Some(dev) = device() else { return };
    let mut gpt = Gpt::new(&dev, config()).unwrap();
    gpt.set_training(false);
    for b in [3, 1] {
        let (prompt, total) = (9, 30);
        let seqs: Vec<Vec<i32>> =
            (0..b as i32).map(|j| (0..total as i32).map(|i| (i * 53 + j * 31 + 3) % 256).collect()).collect();
        let mut bf16 = gpt.inference_params(b, 40).unwrap();
        let mut fp8 = gpt.inference_params_fp8(b, 40).unwrap();
        assert_eq!(fp8.dtype(), DType::E4M3);
        fp8.set_kv_scales(8.0, 8.0).unwrap();
        step(&mut gpt, &dev, &mut bf16, &prefix(&seqs, prompt), prompt, 0);
        step(&mut gpt, &dev, &mut fp8, &prefix(&seqs, prompt), prompt, 0);
        for pos in prompt..total {
            let next: Vec<i32> = seqs.iter().map(|s| s[pos]).collect();
            let want = step(&mut gpt, &dev, &mut bf16, &next, 1, pos);
            let got = step(&mut gpt, &dev, &mut fp8, &next, 1, pos);
            let e = rel_frobenius(&got, &want);
            assert!(e <= 6e-2, "b{b} position {pos}: relative error {e:.3e} of the e4m3 cache's logits");
        }
    }
    let mut bf16 = gpt.inference_params(1, 8).unwrap();
    assert!(matches!(bf16.set_kv_scales(1.0, 1.0), Err(te_runtime::Error::Config { .. })));
    let mut fp8 = gpt.inference_params_fp8(1, 8).unwrap();
    assert!(matches!(fp8.set_kv_scales(0.0, 1.0), Err(te_runtime::Error::Argument { .. })));
    assert!(matches!(fp8.set_kv_scales(1.0, f32::NAN), Err(te_runtime::Error::Argument { .. })));
}
