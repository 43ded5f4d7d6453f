//! The GPT of the training job on the GPU: the embedding kernels bit-exact against the CPU
//! reference and the fused cross-entropy within float rounding (odd token counts, vocab 256 and
//! 50257, ignored and out-of-range targets); a tiny GPT whose loss at init is ln(256), whose
//! gradients match finite differences of the loss (f32 parameters), and whose loss falls under a
//! few manual SGD steps through the visitor, in BF16 and in FP8 (DelayedScaling).

use crate::common::{assert_bits_eq, assert_close, device, randn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_codegen::spec::CrossEntropySpec;
use te_models::{Gpt, GptConfig, IGNORE_INDEX};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Recipe};
use te_nn::modules::{Embedding, EmbeddingConfig, Param, ParamKind, ParamMut, TokenIds};
use te_nn::Module;
use te_reference::cross_entropy as ce_ref;
use te_reference::embedding as emb_ref;
use te_runtime::numerics::{encode, round_to};
use te_runtime::ops::cross_entropy::{cross_entropy, CrossEntropyGrad};
use te_runtime::ops::embedding::{embedding_backward, embedding_forward, EmbeddingGradIndex};
use te_runtime::{DType, Device, Error, Result, Tensor};

const HIGH_PRECISION: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

fn rounded(dtype: DType, v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| round_to(dtype, x)).collect()
}

/// `n` ids in `[0, vocab)`, every 7th replaced by `-1` and every 11th by `vocab` (out of range).
fn ids(seed: u64, n: usize, vocab: usize) -> Vec<i32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|i| match i {
            _ if i % 7 == 3 => -1,
            _ if i % 11 == 5 => vocab as i32,
            _ => rng.random_range(0..vocab as i32),
        })
        .collect()
}

#[test]
fn embedding_kernels_are_bit_exact() {
    let Some(dev) = device() else { return };
    // Byte-level, GPT-2's and Gemma 3's vocabularies (262,144: the backward's cost does not
    // grow with the vocabulary).
    for (vocab, hidden, tokens) in [(256, 80, 37), (256, 1100, 301), (50257, 64, 1001), (262_144, 64, 4099)] {
        let id = ids(vocab as u64 + tokens as u64, tokens, vocab);
        let ids_dev = dev.stream().clone_htod(&id).unwrap();
        let index = EmbeddingGradIndex::from_host(&dev, &id).unwrap();
        for dt in HIGH_PRECISION {
            let table = rounded(dt, randn(1, vocab * hidden, 1.0));
            let table_dev = Tensor::from_f32(&dev, dt, &[vocab, hidden], &table).unwrap();
            let mut out = Tensor::zeros(&dev, dt, &[tokens, hidden]).unwrap();
            embedding_forward(&dev, &table_dev, &ids_dev, &mut out).unwrap();
            let want = encode(dt, &emb_ref::forward(&table, hidden, &id));
            let what = format!("embedding fwd {dt} vocab {vocab} hidden {hidden} tokens {tokens}");
            assert_bits_eq(&what, &out.to_bytes(&dev).unwrap(), &want);
            for grad_dt in [DType::F32, dt] {
                let mut want = rounded(grad_dt, randn(2, vocab * hidden, 0.1));
                let mut dtable = Tensor::from_f32(&dev, grad_dt, &[vocab, hidden], &want).unwrap();
                // Two backwards accumulate.
                for step in 0..2 {
                    let dout = rounded(dt, randn(3 + step, tokens * hidden, 1.0));
                    let dout_dev = Tensor::from_f32(&dev, dt, &[tokens, hidden], &dout).unwrap();
                    embedding_backward(&dev, &dout_dev, &index, &mut dtable).unwrap();
                    emb_ref::backward(&dout, &id, &mut want, grad_dt, hidden);
                }
                let what = format!("embedding bwd {dt} -> {grad_dt} vocab {vocab} hidden {hidden} tokens {tokens}");
                assert_bits_eq(&what, &dtable.to_bytes(&dev).unwrap(), &encode(grad_dt, &want));
            }
        }
    }
}

#[test]
fn cross_entropy_matches_reference() {
    let Some(dev) = device() else { return };
    // On sm_90a the rows from 32 KiB on are held in a thread-block cluster's shared memory
    // (`CrossEntropySpec::for_vocab`): 40 008 splits unevenly over 2 blocks (bf16), Llama 3's
    // 128 256 over 4, Gemma 3's 262 144 over 8.
    for (vocab, tokens) in [(256, 37), (50257, 19), (1000, 301), (262_144, 9), (40_008, 23), (128_256, 33)] {
        let mut targets = ids(tokens as u64, tokens, vocab);
        // -1 is the ignore index; the out-of-range targets are data bugs: NaN loss, zero grad.
        targets[0] = IGNORE_INDEX;
        let t_dev = dev.stream().clone_htod(&targets).unwrap();
        let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let grad_scale = 1.0 / counted as f32;
        for dt in HIGH_PRECISION {
            let logits = rounded(dt, randn(7 + vocab as u64, tokens * vocab, 3.0));
            let l_dev = Tensor::from_f32(&dev, dt, &[tokens, vocab], &logits).unwrap();
            let (want_loss, want_grad) = ce_ref::cross_entropy(&logits, vocab, &targets, IGNORE_INDEX, grad_scale);
            let mut loss = dev.stream().alloc_zeros::<f32>(tokens).unwrap();
            let mut dlogits = Tensor::zeros(&dev, dt, &[tokens, vocab]).unwrap();
            let grad = CrossEntropyGrad { dlogits: &mut dlogits, grad_scale };
            cross_entropy(&dev, &l_dev, &t_dev, IGNORE_INDEX, &mut loss, Some(grad)).unwrap();
            let what = format!("cross_entropy {dt} vocab {vocab} tokens {tokens}");
            let got_loss = dev.stream().clone_dtoh(&loss).unwrap();
            assert_close(&format!("{what} loss"), &got_loss, &want_loss, 1e-5, 1e-5);
            let want_grad = rounded(dt, want_grad);
            let tol = grad_scale * if dt == DType::F32 { 1e-6 } else { 1e-4 };
            let rtol = if dt == DType::F32 { 1e-5 } else { 1e-2 };
            assert_close(&format!("{what} dlogits"), &dlogits.to_f32(&dev).unwrap(), &want_grad, rtol, tol);
            // FP8 (E5M2) dlogits where the cluster kernel runs: the same gradient within E5M2's
            // rounding (2 mantissa bits) once divided by the scale that maps its bound to 57344.
            if CrossEntropySpec::for_vocab(dt, true, vocab, dev.arch()).cluster > 0 {
                let scale = (57344.0 / grad_scale).log2().floor().exp2();
                let mut codes = Tensor::zeros(&dev, DType::E5M2, &[tokens, vocab]).unwrap();
                let mut loss8 = dev.stream().alloc_zeros::<f32>(tokens).unwrap();
                let grad = CrossEntropyGrad { dlogits: &mut codes, grad_scale: grad_scale * scale };
                cross_entropy(&dev, &l_dev, &t_dev, IGNORE_INDEX, &mut loss8, Some(grad)).unwrap();
                let got: Vec<f32> = codes.to_f32(&dev).unwrap().iter().map(|c| c / scale).collect();
                // Below E5M2's smallest subnormal (2^-16 of the scaled value) a value may flush.
                assert_close(&format!("{what} e5m2 dlogits"), &got, &want_grad, 0.126, grad_scale * 2e-5);
                let l8 = dev.stream().clone_dtoh(&loss8).unwrap();
                assert_eq!(
                    l8.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got_loss.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what}: the loss does not depend on the gradient's dtype"
                );
            }
            // The loss-only kernel gives the same losses.
            let mut loss_only = dev.stream().alloc_zeros::<f32>(tokens).unwrap();
            cross_entropy(&dev, &l_dev, &t_dev, IGNORE_INDEX, &mut loss_only, None).unwrap();
            let a = dev.stream().clone_dtoh(&loss_only).unwrap();
            if CrossEntropySpec::for_vocab(dt, true, vocab, dev.arch()).cluster == 0 {
                assert_eq!(
                    a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    got_loss.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{what}: loss-only kernel"
                );
            } else {
                // The cluster merges the blocks' sums in another order.
                assert_close(&format!("{what}: loss-only kernel"), &a, &got_loss, 1e-6, 1e-6);
            }
        }
    }
}

#[test]
fn kernel_errors_are_typed() {
    let Some(dev) = device() else { return };
    let ids_dev = dev.stream().clone_htod(&[0i32, 1, 2]).unwrap();
    let table = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[2, 8]).unwrap();
    let e = embedding_forward(&dev, &table, &ids_dev, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("3 ids"), "{e}");
    let mut out = Tensor::zeros(&dev, DType::F32, &[3, 8]).unwrap();
    let e = embedding_forward(&dev, &table, &ids_dev, &mut out).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out", .. }), "{e}");
    let mut flat = Tensor::zeros(&dev, DType::F32, &[32]).unwrap();
    let mut index = EmbeddingGradIndex::from_host(&dev, &[0, 1, 2]).unwrap();
    let e = embedding_backward(&dev, &out, &index, &mut flat).unwrap_err();
    assert!(e.to_string().contains("[vocab, hidden]"), "{e}");
    let e = index.update(&dev, &[0, 1]).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("2 ids for an index of 3"), "{e}");
    let mut dtable = Tensor::zeros(&dev, DType::F32, &[4, 8]).unwrap();
    let short = Tensor::zeros(&dev, DType::F32, &[2, 8]).unwrap();
    assert!(embedding_backward(&dev, &short, &index, &mut dtable).is_err(), "dout of 2 tokens for an index of 3");

    let logits = Tensor::zeros(&dev, DType::BF16, &[3, 8]).unwrap();
    let mut loss = dev.stream().alloc_zeros::<f32>(2).unwrap();
    let e = cross_entropy(&dev, &logits, &ids_dev, -1, &mut loss, None).unwrap_err();
    assert!(e.to_string().contains("`loss` must hold one value per token (3)"), "{e}");
    let mut loss = dev.stream().alloc_zeros::<f32>(3).unwrap();
    let mut d = Tensor::zeros(&dev, DType::F32, &[3, 8]).unwrap();
    let grad = CrossEntropyGrad { dlogits: &mut d, grad_scale: 1.0 };
    let e = cross_entropy(&dev, &logits, &ids_dev, -1, &mut loss, Some(grad)).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "dlogits", .. }), "{e}");
    // FP8 dlogits of rows the cluster kernel does not take (8 classes).
    let mut d8 = Tensor::zeros(&dev, DType::E5M2, &[3, 8]).unwrap();
    let grad = CrossEntropyGrad { dlogits: &mut d8, grad_scale: 1.0 };
    let e = cross_entropy(&dev, &logits, &ids_dev, -1, &mut loss, Some(grad)).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "dlogits", .. }) && e.to_string().contains("cluster kernel"), "{e}");
    let q = Tensor::zeros(&dev, DType::E4M3, &[3, 16]).unwrap();
    let e = cross_entropy(&dev, &q, &ids_dev, -1, &mut loss, None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "logits", .. }), "{e}");
}

#[test]
fn embedding_module_accumulates_its_gradient_and_refuses_stale_contexts() {
    let Some(dev) = device() else { return };
    let cfg = EmbeddingConfig { params_dtype: DType::F32, ..EmbeddingConfig::new(10, 16) };
    let mut emb = Embedding::new(&dev, cfg).unwrap();
    let tok = TokenIds::from_host(&dev, &[3, 2], &[1, 2, 3, 1, -1, 9]).unwrap();
    let (y, ctx) = emb.forward(&tok).unwrap();
    assert_eq!(y.shape(), [3, 2, 16]);
    let table = emb.weight().to_f32(&dev).unwrap();
    assert_eq!(y.to_f32(&dev).unwrap(), emb_ref::forward(&table, 16, tok.host()));
    let ones = Tensor::from_f32(&dev, DType::F32, &[3, 2, 16], &[1.0; 96]).unwrap();
    emb.backward(ctx, &ones).unwrap();
    let (_, ctx) = emb.forward(&tok).unwrap();
    emb.backward(ctx, &ones).unwrap();
    let g = emb.weight_grad().unwrap().to_f32(&dev).unwrap();
    assert_eq!(&g[16..32], &[4.0; 16], "id 1 twice per backward, two backwards");
    assert_eq!(&g[..16], &[0.0; 16]);
    assert_eq!(&g[9 * 16..], &[2.0; 16]);
    let named = emb.named_parameters();
    assert_eq!((named[0].path.as_str(), named[0].kind), ("weight", ParamKind::Embedding));

    let (_, ctx) = emb.forward(&tok).unwrap();
    emb.set_weight(Tensor::zeros(&dev, DType::F32, &[10, 16]).unwrap()).unwrap();
    let e = emb.backward(ctx, &ones).unwrap_err();
    assert!(matches!(e, Error::Context { .. }), "{e}");
}

/// A small GPT with deterministic layers (no dropout).
pub(crate) fn config(dtype: DType) -> GptConfig {
    GptConfig {
        hidden_size: 64,
        num_layers: 2,
        num_attention_heads: 4,
        ffn_hidden_size: 256,
        seq_length: 32,
        hidden_dropout: 0.0,
        params_dtype: dtype,
        seed: 7,
        ..GptConfig::tiny()
    }
}

/// A fixed `[s, b]` batch of bytes of text and its next-byte targets (the last target ignored).
pub(crate) fn batch(dev: &Device, s: usize, b: usize) -> (TokenIds, TokenIds) {
    let text = b"To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the slings";
    // Sequence j starts at byte 13 * j; element (i, j) of [s, b] is row-major i * b + j.
    let byte = |i: usize, j: usize| i32::from(text[(13 * j + i) % text.len()]);
    let ids: Vec<i32> = (0..s * b).map(|k| byte(k / b, k % b)).collect();
    let tg: Vec<i32> = (0..s * b).map(|k| if k / b + 1 == s { IGNORE_INDEX } else { byte(k / b + 1, k % b) }).collect();
    (TokenIds::from_host(dev, &[s, b], &ids).unwrap(), TokenIds::from_host(dev, &[s, b], &tg).unwrap())
}

#[test]
fn loss_at_init_is_log_vocab_and_parameters_are_counted() {
    let Some(dev) = device() else { return };
    for dt in [DType::F32, DType::BF16] {
        let cfg = config(dt);
        let mut gpt = Gpt::new(&dev, cfg.clone()).unwrap();
        assert_eq!(gpt.num_parameters(), cfg.num_parameters());
        let named = gpt.named_parameters();
        let paths: Vec<&str> = named.iter().map(|p| p.path.as_str()).collect();
        for p in ["embedding.weight", "position_embedding.weight", "final_norm.weight", "lm_head.weight"] {
            assert!(paths.contains(&p), "{p} missing from {paths:?}");
        }
        assert!(paths.iter().any(|p| p.starts_with("layers.1.layernorm_mlp.")), "{paths:?}");
        let (ids, targets) = batch(&dev, 32, 2);
        let (loss, _) = gpt.forward_loss(&ids, &targets).unwrap();
        assert!((loss - 256f32.ln()).abs() < 0.1, "{dt}: loss at init {loss}, ln 256 = {}", 256f32.ln());
    }
}

/// The value of `path`'s parameter, its gradient, and its shape.
pub(crate) fn param_and_grad(gpt: &Gpt, dev: &Device, path: &str) -> (Vec<f32>, Vec<f32>) {
    let mut found = None;
    gpt.visit("", &mut |p: &str, _: ParamKind, param: &dyn Param| -> Result<()> {
        if p == path {
            found = Some((param.tensor().unwrap().to_f32(dev)?, param.grad().unwrap().to_f32(dev)?));
        }
        Ok(())
    })
    .unwrap();
    found.unwrap_or_else(|| panic!("no parameter {path}"))
}

/// Writes `value` into element `i` of `path`'s parameter.
pub(crate) fn poke(gpt: &mut Gpt, dev: &Device, path: &str, i: usize, value: f32) {
    gpt.visit_mut("", &mut |p: &str, _: ParamKind, param: &mut dyn ParamMut| -> Result<()> {
        if p == path {
            let t = param.tensor().unwrap();
            let mut v = t.to_f32(dev)?;
            v[i] = value;
            let new = Tensor::from_f32(dev, t.dtype(), t.shape(), &v)?;
            param.set(new)?;
        }
        Ok(())
    })
    .unwrap();
}

#[test]
fn gradients_match_finite_differences_of_the_loss() {
    let Some(dev) = device() else { return };
    let mut gpt = Gpt::new(&dev, config(DType::F32)).unwrap();
    let (ids, targets) = batch(&dev, 16, 2);
    let (_, ctx) = gpt.forward_loss(&ids, &targets).unwrap();
    gpt.backward(ctx).unwrap();
    let paths = [
        "lm_head.weight",
        "final_norm.bias",
        "layers.1.layernorm_mlp.fc2_weight",
        "layers.0.self_attention.layernorm_qkv.weight",
        "embedding.weight",
        "position_embedding.weight",
    ];
    // Small against the embeddings' scale (0.02; the LayerNorms after them are far from linear
    // over steps of that size), large against the loss's f32 rounding.
    let eps = 1e-3f32;
    for path in paths {
        let (value, grad) = param_and_grad(&gpt, &dev, path);
        // The element with the largest gradient: finite differences resolve it best.
        let i = (0..grad.len()).max_by(|&a, &b| grad[a].abs().total_cmp(&grad[b].abs())).unwrap();
        let mut loss_at = |x: f32| {
            poke(&mut gpt, &dev, path, i, x);
            gpt.forward_loss(&ids, &targets).unwrap().0
        };
        let fd = (loss_at(value[i] + eps) - loss_at(value[i] - eps)) / (2.0 * eps);
        poke(&mut gpt, &dev, path, i, value[i]);
        let g = grad[i];
        assert!((fd - g).abs() <= 0.05 * g.abs() + 5e-4, "{path}[{i}]: backward {g}, finite difference {fd}");
    }
}

/// `steps` SGD steps (`p -= lr * grad` through the visitor) on one batch; the losses.
pub(crate) fn sgd_losses(dev: &Device, gpt: &mut Gpt, fp8: Option<Recipe>, steps: usize, lr: f32) -> Vec<f32> {
    let (ids, targets) = batch(dev, 32, 2);
    (0..steps)
        .map(|_| {
            let mut step = || -> Result<f32> {
                let (loss, ctx) = gpt.forward_loss(&ids, &targets)?;
                gpt.backward(ctx)?;
                Ok(loss)
            };
            let loss = match fp8 {
                Some(recipe) => fp8_autocast(true, recipe, step),
                None => step(),
            }
            .unwrap();
            gpt.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
                let (Some(t), Some(g)) = (p.tensor(), p.grad()) else { return Ok(()) };
                let (w, g) = (t.to_f32(dev)?, g.to_f32(dev)?);
                let new: Vec<f32> = w.iter().zip(&g).map(|(w, g)| w - lr * g).collect();
                let new = Tensor::from_f32(dev, t.dtype(), t.shape(), &new)?;
                p.set(new)
            })
            .unwrap();
            gpt.zero_grad();
            loss
        })
        .collect()
}

#[test]
fn sgd_steps_lower_the_loss_in_bf16_and_fp8() {
    let Some(dev) = device() else { return };
    let delayed = DelayedScaling { amax_history_len: 4, ..Default::default() };
    for fp8 in [None, Some(delayed.into()), Some(Float8BlockScaling::default().into())] {
        let mut gpt = Gpt::new(&dev, config(DType::BF16)).unwrap();
        let losses = sgd_losses(&dev, &mut gpt, fp8, 10, 0.2);
        assert!(losses.iter().all(|l| l.is_finite()), "fp8 = {fp8:?}: {losses:?}");
        let (first, last) = (losses[0], losses[losses.len() - 1]);
        assert!(last < first - 0.3, "fp8 = {fp8:?}: the loss did not fall: {losses:?}");
    }
}

#[test]
fn model_errors_are_typed() {
    let Some(dev) = device() else { return };
    let mut gpt = Gpt::new(&dev, config(DType::BF16)).unwrap();
    let (ids, targets) = batch(&dev, 33, 2);
    let e = gpt.forward_loss(&ids, &targets).unwrap_err();
    assert!(e.to_string().contains("exceeds seq_length = 32"), "{e}");
    let (ids, _) = batch(&dev, 8, 2);
    let flat = TokenIds::from_host(&dev, &[16], &[0; 16]).unwrap();
    let e = gpt.forward_loss(&ids, &flat).unwrap_err();
    assert!(e.to_string().contains("targets must have the ids' shape"), "{e}");
    let e = gpt.forward_loss(&flat, &flat).unwrap_err();
    assert!(e.to_string().contains("ids must be [s, b]"), "{e}");
    let e = Gpt::new(&dev, GptConfig { num_attention_heads: 5, ..config(DType::BF16) }).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
}
