//! Predicted kernel lists against the kernels a run loads: every kernel a GPT's FP8 (delayed and
//! blockwise scaling) and BF16 training steps with AdamW load is in `Gpt::all_kernel_specs` plus `AdamW::kernel_specs`
//! (what `te prewarm --preset` compiles), and the device-free `GptConfig::kernel_specs` agrees.

use crate::common::device;
use te_models::gpt::{Gpt, GptConfig};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Recipe};
use te_nn::modules::{KernelTarget, TokenIds};
use te_nn::Module;
use te_runtime::{Device, Result};
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

/// Training steps of a GPT of `cfg` on a device of its own (its kernel cache then holds what
/// these steps load, nothing of the other tests): one step per entry of `recipes` (`None`: BF16),
/// each followed by an AdamW step. Returns the device and the model.
fn trained(cfg: &GptConfig, recipes: &[Option<Recipe>]) -> (std::sync::Arc<Device>, Gpt) {
    let dev = Device::new(0).unwrap();
    let (s, b) = (cfg.seq_length, 2);
    let ids: Vec<i32> = (0..s * b).map(|k| ((k * 31 + 7) % 256) as i32).collect();
    let targets: Vec<i32> = (0..s * b).map(|k| ((k * 31 + 38) % 256) as i32).collect();
    let ids = TokenIds::from_host(&dev, &[s, b], &ids).unwrap();
    let targets = TokenIds::from_host(&dev, &[s, b], &targets).unwrap();
    let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
    let opt_cfg = AdamWConfig { max_grad_norm: Some(1.0), ..AdamWConfig::new(LrSchedule::Constant(1e-3)) };
    let mut opt = AdamW::new(&dev, &gpt, opt_cfg).unwrap();
    for &fp8 in recipes {
        let mut fwd_bwd = || -> Result<()> {
            let (_, ctx) = gpt.forward_loss(&ids, &targets)?;
            gpt.backward(ctx)
        };
        match fp8 {
            Some(recipe) => fp8_autocast(true, recipe, fwd_bwd).unwrap(),
            None => fwd_bwd().unwrap(),
        }
        opt.step(&mut gpt).unwrap();
        gpt.zero_grad();
    }
    dev.synchronize().unwrap();
    (dev, gpt)
}

#[test]
fn a_gpt_training_step_loads_only_predicted_kernels() {
    if device().is_none() {
        return;
    }
    let cfg = GptConfig {
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        ..GptConfig::tiny()
    };
    let s = cfg.seq_length;
    // Two FP8 steps (the second with scales from the first's amaxes), one under blockwise
    // scaling, then one in BF16.
    let (delayed, block) = (Recipe::from(DelayedScaling::default()), Recipe::from(Float8BlockScaling::default()));
    let (dev, gpt) = trained(&cfg, &[Some(delayed), Some(delayed), Some(block), None]);

    let target = KernelTarget::new(s, dev.arch());
    let block_target = KernelTarget { recipe: block, ..target };
    let mut predicted = gpt.all_kernel_specs(&target);
    predicted.extend(gpt.all_kernel_specs(&block_target));
    AdamW::kernel_specs(&target, &mut predicted);
    let used = dev.kernels().loaded_specs();
    assert!(used.len() >= 20, "only {} kernels loaded", used.len());
    let missing: Vec<String> = used.iter().filter(|s| !predicted.contains(s)).map(|s| s.name()).collect();
    assert!(missing.is_empty(), "loaded but not predicted: {missing:?}");
    assert_eq!(gpt.all_kernel_specs(&target), cfg.kernel_specs(&target), "the device-free list agrees");
    assert_eq!(gpt.all_kernel_specs(&block_target), cfg.kernel_specs(&block_target), "and under block scaling");
}

#[test]
fn a_moe_gpt_training_step_loads_only_predicted_kernels() {
    if device().is_none() {
        return;
    }
    let cfg = GptConfig {
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 4,
        ffn_hidden_size: 128,
        seq_length: 32,
        moe: Some(te_nn::modules::MoeConfig::new(4, 2)),
        ..GptConfig::tiny()
    };
    let s = cfg.seq_length;
    let delayed = Recipe::from(DelayedScaling::default());
    let (dev, gpt) = trained(&cfg, &[Some(delayed), Some(delayed), None]);
    let target = KernelTarget::new(s, dev.arch());
    let mut predicted = gpt.all_kernel_specs(&target);
    AdamW::kernel_specs(&target, &mut predicted);
    let used = dev.kernels().loaded_specs();
    let missing: Vec<String> = used.iter().filter(|s| !predicted.contains(s)).map(|s| s.name()).collect();
    assert!(missing.is_empty(), "loaded but not predicted: {missing:?}");
    assert!(used.iter().any(|s| matches!(s, te_nn::modules::KernelSpec::MoeRouter(_))));
    assert_eq!(gpt.all_kernel_specs(&target), cfg.kernel_specs(&target), "the device-free list agrees");
}
