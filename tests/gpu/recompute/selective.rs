//! Selective activation recompute of the decoder family (`DecoderLm::set_recompute` with
//! `Recompute::Selective`, `te train --model … --recompute selective`; Megatron-LM's
//! `--recompute-granularity selective --recompute-modules mlp`): each layer keeps its attention
//! context and its MLP block's input, and the backward runs the MLP block's forward again with
//! the first forward's FP8 scales. Steps with it equal the steps without it (and with full
//! recompute) bit for bit — losses, every gradient, the FP8 scaling states (no amax history
//! updated twice), the weights after the updates — for a small Llama and a Gemma-3-style model
//! (sandwich norms, tied head, sliding window) in BF16, FP8 delayed scaling (the backward
//! outside and inside the forward's scope) and FP8 current scaling, with two micro-batches a
//! step; on a shape where the MLP dominates, the step's high-water mark lies between full
//! recompute's and none's; what it does not run is refused with a configuration error.

use super::{assert_same_steps, fp8_bits, grad_bits, micro_batch, sgd, Backward, StepBits};
use crate::common::device;
use std::sync::Arc;
use te_models::decoder::train::DecoderLm;
use te_models::decoder::{DecoderConfig, DecoderWeights};
use te_models::gpt::MicroBatch;
use te_models::{Gpt, GptConfig};
use te_nn::fp8::{DelayedScaling, Float8CurrentScaling, Fp8Autocast, Recipe};
use te_nn::modules::{Param, ParamKind, Recompute, TokenIds};
use te_nn::Module;
use te_runtime::{DType, Device, Error, Result};

/// A random Llama: `layers` layers of hidden size `h` (a multiple of 64), SwiGLU of `ffn`,
/// heads of 32 channels (`h / 32` query heads over `h / 64` key-value groups), untied head,
/// vocabulary `vocab`.
fn llama(layers: usize, h: usize, ffn: usize, vocab: usize) -> DecoderConfig {
    let json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {vocab},
        "hidden_size": {h}, "intermediate_size": {ffn}, "num_hidden_layers": {layers}, "num_attention_heads": {},
        "num_key_value_heads": {}, "head_dim": 32, "max_position_embeddings": 2048, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": false}}"#,
        h / 32,
        h / 64
    );
    DecoderConfig::from_hf_json(&json).unwrap()
}

/// A random Gemma-3-style model of three layers: sandwich norms, q/k norms, GELU (tanh), a
/// sliding window of 16, tied head, vocabulary 512.
fn gemma3() -> DecoderConfig {
    let json = r#"{"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 16, "query_pre_attn_scalar": 32,
        "max_position_embeddings": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true}"#;
    let cfg = DecoderConfig::from_hf_json(json).unwrap();
    assert!(cfg.sandwich_norm, "a Gemma 3 config has the sandwich norms");
    cfg
}

/// Deterministic ids and targets `[s, b]` over a vocabulary of `vocab`, shifted by `seed`.
fn batch(dev: &Arc<Device>, s: usize, b: usize, vocab: usize, seed: usize) -> (TokenIds, TokenIds) {
    let ids: Vec<i32> = (0..s * b).map(|i| ((i * 7919 + 13 + seed) % vocab) as i32).collect();
    let targets: Vec<i32> = (0..s * b).map(|i| ((i * 104_729 + 5 + seed) % vocab) as i32).collect();
    (TokenIds::from_host(dev, &[s, b], &ids).unwrap(), TokenIds::from_host(dev, &[s, b], &targets).unwrap())
}

/// Every parameter as bits.
fn param_bits(dev: &Device, m: &dyn Module) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    m.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        if let Some(t) = p.tensor() {
            out.push(t.to_f32(dev)?.iter().map(|x| x.to_bits()).collect());
        }
        Ok(())
    })
    .unwrap();
    out
}

/// Three SGD steps of a model of `weights` in `mode` under `fp8` (`None`: BF16), two
/// micro-batches a step (`is_first_microbatch`, weight 1/2), the backward where `backward`
/// says: each step's bits, and the weights after the steps.
fn steps(
    dev: &Arc<Device>,
    weights: &DecoderWeights,
    mode: Recompute,
    (fp8, backward): (Option<Recipe>, Backward),
) -> (Vec<StepBits>, Vec<Vec<u32>>) {
    let vocab = weights.config().vocab_size;
    let micro = [batch(dev, 64, 2, vocab, 0), batch(dev, 64, 2, vocab, 1)];
    let mut m = DecoderLm::from_weights(dev, weights, DType::BF16).unwrap();
    m.set_recompute(mode).unwrap();
    assert_eq!(m.recompute(), mode);
    let mut out = Vec::new();
    for _ in 0..3 {
        let mut losses = Vec::new();
        for (i, (ids, targets)) in micro.iter().enumerate() {
            let mb = MicroBatch { is_first_microbatch: Some(i == 0), grad_scale: 0.5 };
            losses.push(micro_batch(&mut m, (ids, targets), mb, (fp8, backward)));
        }
        out.push((losses, grad_bits(dev, &m), fp8_bits(&m)));
        sgd(dev, &mut m, 0.05);
    }
    (out, param_bits(dev, &m))
}

/// Selective and full recompute of a model of `cfg` against no recompute, in every precision
/// and backward placement: the same bits.
fn assert_selective_is_bit_exact(dev: &Arc<Device>, cfg: DecoderConfig, name: &str) {
    let weights = DecoderLm::new(dev, cfg, DType::BF16).unwrap().to_weights().unwrap();
    let delayed: Recipe = DelayedScaling { amax_history_len: 4, ..Default::default() }.into();
    let current: Recipe = Float8CurrentScaling::default().into();
    let cases = [
        (None, Backward::Outside),
        (Some(delayed), Backward::Outside),
        (Some(delayed), Backward::Inside),
        (Some(current), Backward::Outside),
    ];
    for case in cases {
        let (want, want_weights) = steps(dev, &weights, Recompute::None, case);
        for mode in [Recompute::Selective, Recompute::Full] {
            let what = format!("{name}, {mode} recompute, {:?}, backward {:?}", case.0, case.1);
            let (got, got_weights) = steps(dev, &weights, mode, case);
            assert_same_steps(&what, &want, &got, case.0 == Some(delayed));
            assert!(got_weights == want_weights, "{what}: weights after the steps");
        }
    }
}

/// The key property on a small Llama (GQA, SwiGLU, untied head): selective recompute (and full)
/// gives the bits of no recompute.
#[test]
fn llama_steps_equal_no_recompute_bit_for_bit() {
    let Some(dev) = device() else { return };
    assert_selective_is_bit_exact(&dev, llama(3, 64, 128, 512), "Llama");
}

/// The same on a Gemma-3-style model, whose MLP block ends in the post-MLP sandwich norm (run
/// again with the MLP).
#[test]
fn gemma3_steps_equal_no_recompute_bit_for_bit() {
    let Some(dev) = device() else { return };
    assert_selective_is_bit_exact(&dev, gemma3(), "Gemma 3");
}

/// An 8-layer Llama of hidden size 512 (16 heads, 4 groups) with an MLP of 4 × 512 (SwiGLU: fc1
/// of 4096) on 8 × 1024
/// tokens, the gradients kept from a first step: the second step's high-water mark above the
/// memory in use before it is lower with selective recompute than without (seven MLP contexts
/// not kept: fc1's output alone is 64 MiB a layer) and higher than with full recompute (every
/// layer's attention context kept), in BF16 and FP8 delayed scaling; the losses are the same
/// bits. The numbers and the estimates printed.
#[test]
fn peak_memory_lies_between_full_and_none() {
    let Some(dev) = device() else { return };
    let cfg = llama(8, 512, 2048, 1024);
    let weights = DecoderLm::new(&dev, cfg.clone(), DType::BF16).unwrap().to_weights().unwrap();
    let (s, b) = (1024, 8);
    let (ids, targets) = batch(&dev, s, b, 1024, 0);
    let t = (s * b) as u64;
    let delayed: Recipe = DelayedScaling::default().into();
    for fp8 in [None, Some(delayed)] {
        let run = |mode: Recompute| {
            let mut m = DecoderLm::from_weights(&dev, &weights, DType::BF16).unwrap();
            m.set_recompute(mode).unwrap();
            let step = |m: &mut DecoderLm| {
                let (loss, ctx) = match fp8 {
                    Some(r) => Fp8Autocast::new(r).run(|| m.forward_loss_with(&ids, &targets, MicroBatch::default())),
                    None => m.forward_loss_with(&ids, &targets, MicroBatch::default()),
                }
                .unwrap();
                m.backward(ctx).unwrap();
                loss.value().unwrap().to_bits()
            };
            // The first step allocates the gradients and warms the kernels; the second is measured.
            step(&mut m);
            dev.synchronize().unwrap();
            let before = dev.memory_in_use().unwrap();
            dev.reset_peak_memory().unwrap();
            let loss = step(&mut m);
            dev.synchronize().unwrap();
            (loss, dev.peak_memory().unwrap().saturating_sub(before))
        };
        let (none_loss, none) = run(Recompute::None);
        let (selective_loss, selective) = run(Recompute::Selective);
        let (full_loss, full) = run(Recompute::Full);
        let mib = |x: u64| x as f64 / (1u64 << 20) as f64;
        let estimate = |mode| mib(DecoderLm::training_bytes_with(&cfg, b, s, fp8.is_some(), mode));
        let what = format!(
            "{fp8:?}: step peak above the resident {:.1} MiB without recompute, {:.1} MiB selective, {:.1} MiB full \
             (estimates of the whole run {:.1} / {:.1} / {:.1} MiB)",
            mib(none),
            mib(selective),
            mib(full),
            estimate(Recompute::None),
            estimate(Recompute::Selective),
            estimate(Recompute::Full)
        );
        eprintln!("{what}");
        assert_eq!(selective_loss, none_loss, "{what}: loss");
        assert_eq!(full_loss, none_loss, "{what}: loss");
        // Seven MLP contexts not kept: at least their fc1 outputs' FP8 or BF16 codes and more.
        let fc1_fp8 = t * 4096;
        assert!(selective + 4 * fc1_fp8 <= none, "{what}: selective below none");
        // Seven attention contexts kept beyond full recompute's inputs: at least a hidden state
        // of each.
        let hidden = t * 512 * 2;
        assert!(full + 4 * hidden <= selective, "{what}: selective above full");
    }
}

/// What selective recompute does not run is refused with a configuration error naming what to
/// change: the GPT presets (full or none), the activation offload (full recompute's), FP8
/// attention (`fp8_dpa`).
#[test]
fn refusals_name_what_to_change() {
    let Some(dev) = device() else { return };
    let tiny = GptConfig { num_layers: 1, seq_length: 32, ..GptConfig::tiny() };
    let mut gpt = Gpt::new(&dev, tiny).unwrap();
    let e = gpt.set_recompute(Recompute::Selective).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("--recompute full"), "{e}");
    assert_eq!(gpt.recompute(), Recompute::None);
    let mut m = DecoderLm::new(&dev, llama(2, 64, 128, 512), DType::BF16).unwrap();
    m.set_recompute(Recompute::Selective).unwrap();
    let (ids, targets) = batch(&dev, 16, 2, 512, 0);
    m.set_offload_activations(1).unwrap();
    let e = m.forward_loss_with(&ids, &targets, MicroBatch::default()).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("Recompute::Full"), "{e}");
    m.set_offload_activations(0).unwrap();
    let dpa: Recipe = DelayedScaling { fp8_dpa: true, ..Default::default() }.into();
    let e = Fp8Autocast::new(dpa).run(|| m.forward_loss_with(&ids, &targets, MicroBatch::default())).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("fp8"), "{e}");
    // Without FP8 attention the same model trains.
    let (loss, ctx) = m.forward_loss_with(&ids, &targets, MicroBatch::default()).unwrap();
    m.backward(ctx).unwrap();
    assert!(loss.value().unwrap().is_finite());
}
