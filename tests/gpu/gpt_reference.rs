//! The GPU GPT against its CPU twin [`GptRef`] (the model of `te train`'s CPU path): the same
//! init from the same seeds, and with f32 parameters loaded by name, the same loss (rel 1e-4)
//! and every parameter gradient (relative Frobenius ≤ 1e-3); with hidden dropout, the same
//! Philox masks and so the same loss.

use crate::common::device;
use te_models::cpu::gpt::GptRef;
use te_models::{Gpt, GptConfig, IGNORE_INDEX};
use te_nn::modules::{Param, ParamKind, TokenIds};
use te_nn::Module;
use te_reference::linear::rel_frobenius;
use te_runtime::{DType, Device, Result};

fn config(hidden_dropout: f32) -> GptConfig {
    GptConfig {
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        hidden_dropout,
        params_dtype: DType::F32,
        seed: 11,
        ..GptConfig::tiny()
    }
}

/// Host `[s, b]` ids and next-byte targets of a text (the last position ignored).
fn batch(s: usize, b: usize) -> (Vec<i32>, Vec<i32>) {
    let text = b"Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds";
    let byte = |i: usize, j: usize| i32::from(text[(17 * j + i) % text.len()]);
    let ids = (0..s * b).map(|k| byte(k / b, k % b)).collect();
    let targets = (0..s * b).map(|k| if k / b + 1 == s { IGNORE_INDEX } else { byte(k / b + 1, k % b) }).collect();
    (ids, targets)
}

/// Every parameter (and its gradient, when `grads`) of the GPU model, by name, as f32.
fn named(gpt: &Gpt, dev: &Device, grads: bool) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    gpt.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        let t = if grads { p.grad().expect("a gradient after backward") } else { p.tensor().expect("a tensor") };
        out.push((path.to_owned(), t.to_f32(dev)?));
        Ok(())
    })
    .unwrap();
    out
}

#[test]
fn the_cpu_twin_has_the_gpu_init() {
    let Some(dev) = device() else { return };
    let cfg = config(0.0);
    let gpu = named(&Gpt::new(&dev, cfg.clone()).unwrap(), &dev, false);
    let cpu = GptRef::new(&cfg).unwrap();
    let cpu: Vec<(String, Vec<f32>)> = cpu.params().iter().map(|p| (p.name.clone(), p.value.clone())).collect();
    assert_eq!(gpu.len(), cpu.len());
    for ((gn, gv), (cn, cv)) in gpu.iter().zip(&cpu) {
        assert_eq!(gn, cn, "parameter order");
        assert!(gv == cv, "{gn}: the CPU init differs from the GPU's");
    }
}

#[test]
fn loss_and_every_gradient_match_the_cpu_twin() {
    let Some(dev) = device() else { return };
    let cfg = config(0.0);
    let (s, b) = (32, 4);
    let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    let mut cpu = GptRef::from_named(&cfg, named(&gpt, &dev, false)).unwrap();
    let (ids, targets) = batch(s, b);
    let ids_dev = TokenIds::from_host(&dev, &[s, b], &ids).unwrap();
    let targets_dev = TokenIds::from_host(&dev, &[s, b], &targets).unwrap();
    let (loss, ctx) = gpt.forward_loss(&ids_dev, &targets_dev).unwrap();
    gpt.backward(ctx).unwrap();
    let (want, cpu_ctx) = cpu.forward_loss(&ids, &targets, s, b).unwrap();
    assert!((loss - want).abs() <= 1e-4 * want.abs(), "loss: GPU {loss}, CPU {want}");
    let cpu_grads = cpu.backward(cpu_ctx).unwrap();
    let gpu_grads = named(&gpt, &dev, true);
    assert_eq!(gpu_grads.len(), cpu_grads.len());
    for ((gn, g), (cn, c)) in gpu_grads.iter().zip(&cpu_grads) {
        assert_eq!(gn, cn, "gradient order");
        let err = rel_frobenius(g, c);
        assert!(err <= 1e-3, "{gn}: relative Frobenius error {err:.2e}");
    }
}

#[test]
fn dropout_masks_match_the_cpu_twin() {
    let Some(dev) = device() else { return };
    let cfg = config(0.1);
    let (s, b) = (32, 4);
    let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    let mut cpu = GptRef::from_named(&cfg, named(&gpt, &dev, false)).unwrap();
    let (ids, targets) = batch(s, b);
    let ids_dev = TokenIds::from_host(&dev, &[s, b], &ids).unwrap();
    let targets_dev = TokenIds::from_host(&dev, &[s, b], &targets).unwrap();
    // Two forwards: the second uses the next Philox offsets on both.
    for call in 0..2 {
        let (loss, _) = gpt.forward_loss(&ids_dev, &targets_dev).unwrap();
        let (want, _) = cpu.forward_loss(&ids, &targets, s, b).unwrap();
        assert!((loss - want).abs() <= 1e-4 * want.abs(), "forward {call}: GPU {loss}, CPU {want}");
    }
}
