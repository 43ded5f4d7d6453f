//! Full activation recompute (`Gpt::set_recompute`, `DecoderLm::set_recompute`,
//! `te train --recompute full`; TE's `checkpoint`): training steps with it equal the steps
//! without it bit for bit — losses, every gradient, the weights after the updates, the FP8
//! scaling states (no amax history updated twice) and the dropout stream — in BF16, FP8 delayed
//! scaling (the backward outside the forward's scope, as the trainer runs it, and inside it)
//! and FP8 current scaling, with dropout on and gradient accumulation; a GPT-2-small run keeps
//! less memory with it, within its estimate; what it does not replay yet is refused.

mod selective;

use crate::common::{device, Fp8States};
use crate::gpt::batch;
use std::sync::Arc;
use te_models::decoder::train::{DecoderLm, DecoderLmCtx};
use te_models::gpt::{GptCtx, GptLoss, MicroBatch};
use te_models::{Gpt, GptConfig};
use te_nn::fp8::{DelayedScaling, Float8CurrentScaling, Fp8Autocast, Recipe};
use te_nn::modules::{MoeConfig, Param, ParamKind, ParamMut, Recompute, TokenIds};
use te_nn::Module;
use te_runtime::{DType, Device, Error, Result, Tensor};
use te_train::{Backend, Precision, TrainConfig, Trainer};

/// Every parameter's gradient as bits, by path.
pub(crate) fn grad_bits(dev: &Device, m: &dyn Module) -> Vec<(String, Vec<u32>)> {
    let mut out = Vec::new();
    m.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        if let Some(g) = p.grad() {
            out.push((path.to_owned(), g.to_f32(dev)?.iter().map(|x| x.to_bits()).collect()));
        }
        Ok(())
    })
    .unwrap();
    out
}

/// Every FP8 scaling state (amax history, scale, scale_inv) as bits, by path.
pub(crate) fn fp8_bits(m: &dyn Module) -> Vec<(String, Vec<u32>)> {
    let mut states = Fp8States::default();
    m.visit("", &mut states).unwrap();
    states
        .0
        .iter()
        .map(|(path, s)| {
            let snap = s.snapshot().unwrap();
            let bits = snap.amax_history.iter().chain(&snap.scale).chain(&snap.scale_inv).map(|x| x.to_bits());
            (path.clone(), bits.collect())
        })
        .collect()
}

/// `p -= lr · grad` on every parameter (f32 on the host, rounded to the parameter's dtype).
pub(crate) fn sgd(dev: &Device, m: &mut dyn Module, lr: f32) {
    m.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
        let (Some(t), Some(g)) = (p.tensor(), p.grad()) else { return Ok(()) };
        let (w, g) = (t.to_f32(dev)?, g.to_f32(dev)?);
        let new: Vec<f32> = w.iter().zip(&g).map(|(w, g)| w - lr * g).collect();
        p.set(Tensor::from_f32(dev, t.dtype(), t.shape(), &new)?)
    })
    .unwrap();
    m.zero_grad();
}

/// Where the backward runs relative to the forward's `fp8_autocast` scope.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Backward {
    /// After the scope's exit (the trainer's way, TE's training loops').
    Outside,
    /// Inside the forward's scope.
    Inside,
}

/// A model trained by micro-batches: a forward returning the loss and a context, the backward
/// of that context (`Gpt`, `DecoderLm`).
pub(crate) trait MicroModel {
    /// What the forward keeps for the backward.
    type Ctx;
    /// `forward_loss_with`.
    fn forward(&mut self, ids: &TokenIds, targets: &TokenIds, mb: MicroBatch) -> Result<(GptLoss, Self::Ctx)>;
    /// `backward`.
    fn backward(&mut self, ctx: Self::Ctx) -> Result<()>;
}

impl MicroModel for Gpt {
    type Ctx = GptCtx;
    fn forward(&mut self, ids: &TokenIds, targets: &TokenIds, mb: MicroBatch) -> Result<(GptLoss, GptCtx)> {
        self.forward_loss_with(ids, targets, mb)
    }
    fn backward(&mut self, ctx: GptCtx) -> Result<()> {
        Gpt::backward(self, ctx)
    }
}

impl MicroModel for DecoderLm {
    type Ctx = DecoderLmCtx;
    fn forward(&mut self, ids: &TokenIds, targets: &TokenIds, mb: MicroBatch) -> Result<(GptLoss, DecoderLmCtx)> {
        self.forward_loss_with(ids, targets, mb)
    }
    fn backward(&mut self, ctx: DecoderLmCtx) -> Result<()> {
        DecoderLm::backward(self, ctx)
    }
}

/// One micro-batch of `m`: its forward and backward under `fp8` (`None`: BF16), the backward
/// where `backward` says; the loss's bits.
pub(crate) fn micro_batch<M: MicroModel>(
    m: &mut M,
    (ids, targets): (&TokenIds, &TokenIds),
    mb: MicroBatch,
    (fp8, backward): (Option<Recipe>, Backward),
) -> u32 {
    let loss = match (fp8, backward) {
        (None, _) => {
            let (loss, ctx) = m.forward(ids, targets, mb).unwrap();
            m.backward(ctx).unwrap();
            loss
        }
        (Some(r), Backward::Outside) => {
            let (loss, ctx) = Fp8Autocast::new(r).run(|| m.forward(ids, targets, mb)).unwrap();
            m.backward(ctx).unwrap();
            loss
        }
        (Some(r), Backward::Inside) => Fp8Autocast::new(r)
            .run(|| {
                let (loss, ctx) = m.forward(ids, targets, mb)?;
                m.backward(ctx)?;
                Ok(loss)
            })
            .unwrap(),
    };
    loss.value().unwrap().to_bits()
}

/// What one step of a model shows: its micro-batches' losses, gradients, FP8 states.
pub(crate) type StepBits = (Vec<u32>, Vec<(String, Vec<u32>)>, Vec<(String, Vec<u32>)>);

/// Asserts that the steps `got` show the bits of the steps `want`: each step's losses, every
/// gradient and every FP8 state; with `keeps_states` (delayed scaling) that there are states.
pub(crate) fn assert_same_steps(what: &str, want: &[StepBits], got: &[StepBits], keeps_states: bool) {
    for (step, (w, g)) in want.iter().zip(got).enumerate() {
        assert_eq!(g.0, w.0, "{what}: step {step} losses");
        assert_eq!(g.1.len(), w.1.len(), "{what}: step {step} gradient count");
        for ((path, gb), (_, wb)) in g.1.iter().zip(&w.1) {
            assert!(gb == wb, "{what}: step {step}: the gradient of {path} differs");
        }
        assert_eq!(g.2.len(), w.2.len(), "{what}: step {step}: FP8 state count");
        for ((path, gb), (_, wb)) in g.2.iter().zip(&w.2) {
            assert!(gb == wb, "{what}: step {step}: the FP8 state {path} differs (amax recorded twice?)");
        }
        if keeps_states {
            assert!(!w.2.is_empty(), "{what}: delayed scaling keeps states");
        }
    }
}

/// `steps` SGD steps of `gpt` of two micro-batches each (`is_first_microbatch`, weight 1/2)
/// under `fp8` (`None`: BF16), each step's bits.
pub(crate) fn gpt_steps(
    dev: &Arc<Device>,
    gpt: &mut Gpt,
    fp8: Option<Recipe>,
    backward: Backward,
    steps: usize,
) -> Vec<StepBits> {
    let micro: Vec<(TokenIds, TokenIds)> = vec![batch(dev, 32, 4), batch(dev, 32, 4)];
    let mut out = Vec::new();
    for _ in 0..steps {
        let mut losses = Vec::new();
        for (i, (ids, targets)) in micro.iter().enumerate() {
            let mb = MicroBatch { is_first_microbatch: Some(i == 0), grad_scale: 0.5 };
            losses.push(micro_batch(gpt, (ids, targets), mb, (fp8, backward)));
        }
        out.push((losses, grad_bits(dev, gpt), fp8_bits(gpt)));
        sgd(dev, gpt, 0.1);
    }
    out
}

/// The key property: with dropout on, in BF16, FP8 delayed scaling (backward outside and inside
/// the forward's scope) and FP8 current scaling, three steps of two micro-batches with full
/// recompute give the very bits of the steps without it, and leave the weights, the FP8 states
/// and the dropout stream where they leave them.
#[test]
fn gpt_full_recompute_steps_are_bit_exact() {
    let Some(dev) = device() else { return };
    let cfg = GptConfig {
        hidden_size: 64,
        num_layers: 3,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        hidden_dropout: 0.1,
        seed: 11,
        ..GptConfig::tiny()
    };
    let delayed: Recipe = DelayedScaling { amax_history_len: 4, ..Default::default() }.into();
    let current: Recipe = Float8CurrentScaling::default().into();
    let cases = [
        (None, Backward::Outside),
        (Some(delayed), Backward::Outside),
        (Some(delayed), Backward::Inside),
        (Some(current), Backward::Outside),
    ];
    for (fp8, backward) in cases {
        let what = format!("{fp8:?}, backward {backward:?}");
        let mut plain = Gpt::new(&dev, cfg.clone()).unwrap();
        let mut recomputed = Gpt::new(&dev, cfg.clone()).unwrap();
        recomputed.set_recompute(Recompute::Full).unwrap();
        assert_eq!(recomputed.recompute(), Recompute::Full);
        let want = gpt_steps(&dev, &mut plain, fp8, backward, 3);
        let got = gpt_steps(&dev, &mut recomputed, fp8, backward, 3);
        assert_same_steps(&what, &want, &got, fp8 == Some(delayed));
        let weights = |m: &Gpt| {
            let mut v = Vec::new();
            m.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
                v.push(p.tensor().unwrap().to_f32(&dev)?.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
                Ok(())
            })
            .unwrap();
            v
        };
        assert!(weights(&plain) == weights(&recomputed), "{what}: weights after the steps");
        assert_eq!(plain.dropout_offset(), recomputed.dropout_offset(), "{what}: dropout stream");
        assert!(plain.dropout_offset() > 0, "{what}: dropout ran");
    }
}

/// What the recompute does not replay yet is refused with a configuration error: a MoE model,
/// FP8 attention (`fp8_dpa`).
#[test]
fn gpt_full_recompute_refuses_what_it_cannot_replay() {
    let Some(dev) = device() else { return };
    let tiny = GptConfig { num_layers: 1, seq_length: 32, ..GptConfig::tiny() };
    let mut moe = Gpt::new(&dev, GptConfig { moe: Some(MoeConfig::new(4, 2)), ..tiny.clone() }).unwrap();
    let e = moe.set_recompute(Recompute::Full).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("MoE"), "{e}");
    let mut gpt = Gpt::new(&dev, tiny).unwrap();
    gpt.set_recompute(Recompute::Full).unwrap();
    let (ids, targets) = batch(&dev, 32, 2);
    let dpa: Recipe = DelayedScaling { fp8_dpa: true, ..Default::default() }.into();
    let e = Fp8Autocast::new(dpa).run(|| gpt.forward_loss(&ids, &targets)).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("fp8_dpa"), "{e}");
}

/// GPT-2 small on 8 × 1024 tokens (activations dominate): two steps through the trainer with
/// full recompute have the losses of the steps without it, bit for bit, and a high-water mark
/// well below theirs (the estimate checked before allocating bounds it).
#[test]
fn trainer_full_recompute_lowers_the_peak_memory_of_gpt_small() {
    let Some(dev) = device() else { return };
    let corpus = crate::train::corpus();
    let cfg = TrainConfig {
        model: GptConfig::small(),
        batch: 8,
        grad_accum: 1,
        eval_interval: 2,
        eval_batches: 1,
        ..TrainConfig::new(GptConfig::small(), 2)
    };
    for precision in [Precision::Bf16, Precision::Fp8] {
        let run = |mode: Recompute| {
            let trainer = Trainer::new(cfg.clone(), Backend::Gpu(dev.clone())).unwrap();
            let mut trainer = trainer.with_recompute(mode).unwrap();
            assert_eq!(trainer.recompute(), mode);
            trainer.train(&corpus, precision, |_| {}).unwrap()
        };
        let (none, full) = (run(Recompute::None), run(Recompute::Full));
        assert_eq!(crate::train::losses(&full.records), crate::train::losses(&none.records), "{precision:?}: losses");
        let mib = |b: u64| b >> 20;
        let what = format!(
            "{precision:?}: peak {} MiB without recompute, {} MiB with",
            mib(none.peak_memory),
            mib(full.peak_memory)
        );
        eprintln!("{what}");
        // 11 of 12 layers' activations (about 2.3 GB) are not kept.
        assert!(full.peak_memory + (1 << 30) < none.peak_memory, "{what}");
        let estimate = Gpt::training_bytes_with(&cfg.model, cfg.batch, precision == Precision::Fp8, 1, Recompute::Full);
        assert!(full.peak_memory <= estimate, "{what}, estimate {} MiB", mib(estimate));
    }
}

/// The decoder family: steps of a small Llama with full recompute (BF16, FP8 delayed scaling)
/// give the bits of the steps without it.
#[test]
fn decoder_full_recompute_steps_are_bit_exact() {
    use te_models::decoder::DecoderConfig;
    let Some(dev) = device() else { return };
    let config = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": false}"#;
    let cfg = DecoderConfig::from_hf_json(config).unwrap();
    let weights = DecoderLm::new(&dev, cfg, DType::BF16).unwrap().to_weights().unwrap();
    let (s, b) = (64, 2);
    let ids: Vec<i32> = (0..s * b).map(|i| ((i * 7919 + 13) % 512) as i32).collect();
    let targets: Vec<i32> = (0..s * b).map(|i| ((i * 104_729 + 5) % 512) as i32).collect();
    let ids = TokenIds::from_host(&dev, &[s, b], &ids).unwrap();
    let targets = TokenIds::from_host(&dev, &[s, b], &targets).unwrap();
    let delayed: Recipe = DelayedScaling { amax_history_len: 4, ..Default::default() }.into();
    for fp8 in [None, Some(delayed)] {
        let steps = |mode: Recompute| {
            let mut m = DecoderLm::from_weights(&dev, &weights, DType::BF16).unwrap();
            m.set_recompute(mode).unwrap();
            let mut out = Vec::new();
            for _ in 0..3 {
                let (loss, ctx) = match fp8 {
                    Some(r) => Fp8Autocast::new(r).run(|| m.forward_loss_with(&ids, &targets, MicroBatch::default())),
                    None => m.forward_loss_with(&ids, &targets, MicroBatch::default()),
                }
                .unwrap();
                m.backward(ctx).unwrap();
                out.push((loss.value().unwrap().to_bits(), grad_bits(&dev, &m), fp8_bits(&m)));
                sgd(&dev, &mut m, 0.05);
            }
            out
        };
        let (want, got) = (steps(Recompute::None), steps(Recompute::Full));
        for (step, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(g.0, w.0, "{fp8:?}: step {step} loss");
            assert!(g.1 == w.1, "{fp8:?}: step {step} gradients differ");
            assert!(g.2 == w.2, "{fp8:?}: step {step} FP8 states differ");
        }
    }
}
