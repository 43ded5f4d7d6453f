//! Generation with the GPU GPT (`Gpt::generate`: the prompt in one prefill, then one token per
//! sequence per step over the KV cache, each step replayed from a CUDA graph; greedy sampling on
//! the host), GPT `small` architecture in BF16 (random weights: the speed does not depend on
//! them), at batch 1 and 32 with prompts of 128 and 900 tokens, 64 new tokens. Wall-clock time
//! (the host samples every token, as `te generate` does): prefill tokens/s (the prompt and the
//! first token) and decode tokens/s (all sequences) over the other 63 steps. The decode floor:
//! the bytes a step must read (every GEMM weight once, the LM head's included, and the cached
//! keys and values of every layer at the mean length) over the copy bandwidth of this run; the
//! `decode ÷ floor` ratio is the "within 3× of the floor". `benches/anchors/generate.py`
//! runs Hugging Face `GPT2LMHeadModel` of the same sizes (eager, and static cache +
//! `torch.compile`). At prompt 900 the cache also runs as E4M3 codes (`Gpt::inference_params_fp8`,
//! "bf16 + e4m3 kv": half the cache bytes of the floor).

use crate::harness::{time_generation, Bench, Work};
use te_models::generate::SamplingConfig;
use te_models::gpt::{GenerateOptions, Gpt, GptConfig};

const NEW_TOKENS: usize = 64;

pub fn run(b: &mut Bench) {
    let work = "gpt small generate";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let cfg = GptConfig { hidden_dropout: 0.0, ..GptConfig::small() };
    let (h, f, v, layers) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.num_layers);
    let weight_bytes = 2 * (layers * (4 * h * h + 2 * h * f) + h * v) as u64;
    let mut model = Gpt::new(&dev, cfg).unwrap();
    model.set_training(false);
    let greedy = SamplingConfig::greedy();
    let shapes =
        [(1, 128, false), (1, 900, false), (32, 128, false), (32, 900, false), (1, 900, true), (32, 900, true)];
    for (batch, prompt, e4m3) in shapes {
        let prompts: Vec<Vec<i32>> =
            (0..batch).map(|j| (0..prompt).map(|i| ((i * 31 + j * 7) % 256) as i32).collect()).collect();
        let mut params = match e4m3 {
            true => model.inference_params_fp8(batch, prompt + NEW_TOKENS).unwrap(),
            false => model.inference_params(batch, prompt + NEW_TOKENS).unwrap(),
        };
        let (label, kv_elem_bytes) = if e4m3 { ("bf16 + e4m3 kv", 1) } else { ("bf16", 2) };
        let options = GenerateOptions { cuda_graph: true, ..Default::default() };
        let (prefill, step) = time_generation(NEW_TOKENS, |mark| {
            model
                .generate(&mut params, &prompts, NEW_TOKENS, (&greedy, 0), options, |i, _| {
                    if i == 0 {
                        mark();
                    }
                    Ok(())
                })
                .unwrap();
        });
        let shape = format!("b{batch} prompt {prompt}");
        let mean_len = (prompt + NEW_TOKENS / 2) as u64;
        let kv_bytes = (layers * batch) as u64 * mean_len * 2 * h as u64 * kv_elem_bytes;
        // Rows beside `generate.py`'s (compare.py's section "generate").
        let row = |pass, tokens| Work {
            section: "generate",
            work: work.into(),
            pass,
            variant: format!("ours {label}"),
            precision: "bf16",
            flops_fp8: 0,
            tokens: Some(tokens as u64),
        };
        b.record_work(&shape, prefill, 0, None, row("prefill", batch * prompt));
        b.record_work(&shape, step, 0, Some(weight_bytes + kv_bytes), row("decode step", batch));
        let prefill_tps = (batch * prompt) as f64 / (prefill.median_us * 1e-6);
        let decode_tps = batch as f64 / (step.median_us * 1e-6);
        let floor_us = (weight_bytes + kv_bytes) as f64 / (b.copy_gbps * 1e3);
        let shape = if e4m3 { format!("{label} {shape}") } else { shape };
        b.record_ratio(&format!("{work} {shape}: prefill tokens/s"), prefill_tps, None);
        b.record_ratio(&format!("{work} {shape}: decode tokens/s"), decode_tps, None);
        b.record_ratio(&format!("{work} {shape}: decode step ÷ floor"), step.median_us / floor_us, Some((false, 3.0)));
        println!(
            "{work} {shape}: prefill {prefill_tps:.0} tokens/s, decode {decode_tps:.0} tokens/s ({:.1} µs a step, floor \
             {floor_us:.1} µs)",
            step.median_us
        );
    }
}
