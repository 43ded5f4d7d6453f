//! Tests of the CPU GPT: parameter layout, gradients against finite differences, training in
//! every precision, and typed errors.

use super::*;
use crate::generate::SamplingConfig;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, Float8CurrentScaling};

fn micro() -> GptConfig {
    GptConfig {
        vocab_size: 16,
        hidden_size: 32,
        num_layers: 1,
        num_attention_heads: 2,
        ffn_hidden_size: 64,
        seq_length: 8,
        hidden_dropout: 0.0,
        params_dtype: DType::F32,
        seed: 3,
        fp8_lm_head: true,
        moe: None,
    }
}

/// A repeating pattern `[s, b]`: ids and the next tokens.
fn pattern(s: usize, b: usize, vocab: usize) -> (Vec<i32>, Vec<i32>) {
    let tok = |i: usize, j: usize| ((3 * i + 5 * j) % vocab) as i32;
    let ids = (0..s * b).map(|t| tok(t / b, t % b)).collect();
    let targets = (0..s * b).map(|t| tok(t / b + 1, t % b)).collect();
    (ids, targets)
}

#[test]
fn layout_matches_the_gpu_parameter_count() {
    for cfg in [micro(), GptConfig::tiny()] {
        let m = GptRef::new(&cfg).unwrap();
        assert_eq!(m.num_parameters(), cfg.num_parameters());
        assert_eq!(m.params()[2].name, "layers.0.self_attention.layernorm_qkv.layer_norm_weight");
        assert_eq!(m.params().last().unwrap().name, "lm_head.weight");
    }
}

#[test]
fn gradients_match_finite_differences() {
    let cfg = micro();
    let (s, b) = (8, 2);
    let (ids, mut targets) = pattern(s, b, cfg.vocab_size);
    targets[3] = IGNORE_INDEX;
    let mut model = GptRef::new(&cfg).unwrap();
    let (_, ctx) = model.forward_loss(&ids, &targets, s, b).unwrap();
    let grads = model.backward(ctx).unwrap();
    let eps = 1e-2f32;
    for (pi, (name, g)) in grads.iter().enumerate() {
        // The two largest-gradient elements of every parameter.
        let mut order: Vec<usize> = (0..g.len()).collect();
        order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
        for &i in &order[..2] {
            let at = |x: f32| {
                let mut m = model.clone();
                m.params[pi].value[i] = x;
                f64::from(m.loss(&ids, &targets, s, b).unwrap())
            };
            let x0 = model.params[pi].value[i];
            let fd = ((at(x0 + eps) - at(x0 - eps)) / (2.0 * f64::from(eps))) as f32;
            assert!(
                (fd - g[i]).abs() <= 0.03 * g[i].abs() + 2e-4,
                "{name}[{i}]: backward {}, finite difference {fd}",
                g[i]
            );
        }
    }
}

fn train_losses(precision: GemmPrecision, dropout: f32, steps: usize) -> Vec<f32> {
    let cfg = GptConfig { hidden_dropout: dropout, ..micro() };
    let (s, b) = (8, 2);
    let (ids, targets) = pattern(s, b, cfg.vocab_size);
    let mut model = GptRef::new(&cfg).unwrap();
    model.set_precision(precision).unwrap();
    let adam_cfg = GptAdamWConfig {
        betas: (0.9, 0.95),
        eps: 1e-8,
        weight_decay: 0.1,
        max_grad_norm: Some(1.0),
        skip_nonfinite: false,
    };
    let mut opt = GptAdamW::new(&model, adam_cfg);
    (0..steps)
        .map(|_| {
            let (loss, ctx) = model.forward_loss(&ids, &targets, s, b).unwrap();
            let grads = model.backward(ctx).unwrap();
            opt.step(&mut model, &grads, 1e-2).unwrap();
            loss
        })
        .collect()
}

#[test]
fn adamw_learns_a_repeating_pattern_in_every_precision() {
    let fp8 = GemmPrecision::Fp8(DelayedScaling { amax_history_len: 16, ..Default::default() }.into());
    let block = GemmPrecision::Fp8(Float8BlockScaling::default().into());
    let current = GemmPrecision::Fp8(Float8CurrentScaling::default().into());
    let precisions = [(GemmPrecision::F32, 0.0), (GemmPrecision::Bf16, 0.1), (fp8, 0.1), (block, 0.1), (current, 0.1)];
    for (precision, dropout) in precisions {
        let losses = train_losses(precision, dropout, 30);
        assert!(losses.iter().all(|l| l.is_finite()), "{precision:?}: {losses:?}");
        assert!(losses[29] < 0.5 * losses[0], "{precision:?}: {} → {}", losses[0], losses[29]);
    }
}

/// A few steps under current scaling (from its recipe, TE's defaults and power-of-2 scales):
/// finite losses, each below the first, different from BF16's (the casts are on).
#[test]
fn current_scaling_trains_a_few_steps() {
    let bf16 = train_losses(GemmPrecision::Bf16, 0.0, 6);
    for recipe in [Float8CurrentScaling::default(), Float8CurrentScaling { power_2_scale: true, ..Default::default() }]
    {
        let precision = GemmPrecision::from_recipe(&recipe.into()).unwrap();
        assert_eq!(precision, GemmPrecision::Fp8(recipe.into()));
        let losses = train_losses(precision, 0.0, 6);
        assert!(losses.iter().all(|l| l.is_finite()), "{recipe:?}: {losses:?}");
        assert!(losses[1..].iter().all(|&l| l < losses[0]) && losses[5] < losses[1], "{recipe:?}: {losses:?}");
        assert_ne!(losses, bf16, "{recipe:?}");
    }
}

#[test]
fn bf16_and_fp8_gemms_perturb_the_loss_slightly() {
    let (s, b) = (8, 2);
    let (ids, targets) = pattern(s, b, 16);
    let mut m = GptRef::new(&micro()).unwrap();
    let exact = m.loss(&ids, &targets, s, b).unwrap();
    m.set_precision(GemmPrecision::Bf16).unwrap();
    let bf16 = m.loss(&ids, &targets, s, b).unwrap();
    m.set_precision(GemmPrecision::Fp8(DelayedScaling::default().into())).unwrap();
    // The first forward casts with scale 1 and records the amaxes; the second uses scales
    // fitted to them.
    m.forward_loss(&ids, &targets, s, b).unwrap();
    let fp8 = m.loss(&ids, &targets, s, b).unwrap();
    let (d_bf16, d_fp8) = ((bf16 - exact).abs(), (fp8 - exact).abs());
    assert!(d_bf16 > 0.0 && d_bf16 < 1e-2 * exact, "bf16 {bf16} vs exact {exact}");
    assert!(d_fp8 > d_bf16 && d_fp8 < 5e-2 * exact, "fp8 {fp8} vs exact {exact} (bf16 {bf16})");
}

/// Blockwise FP8 (stateless: no warm-up) perturbs the loss and the gradients about as much as
/// per-tensor FP8 with fitted scales; 128×128 activation blocks and float scales work too; a
/// block dimension of 3 is refused.
#[test]
fn blockwise_fp8_gemms_perturb_the_loss_and_gradients_slightly() {
    let (s, b) = (8, 2);
    let (ids, targets) = pattern(s, b, 16);
    let mut m = GptRef::new(&micro()).unwrap();
    let (exact, ctx) = m.forward_loss(&ids, &targets, s, b).unwrap();
    let g_exact = m.backward(ctx).unwrap();
    for recipe in [
        Float8BlockScaling::default(),
        Float8BlockScaling {
            x_block_scaling_dim: 2,
            w_block_scaling_dim: 1,
            power_2_scale: false,
            ..Default::default()
        },
    ] {
        m.set_precision(GemmPrecision::Fp8(recipe.into())).unwrap();
        let (loss, ctx) = m.forward_loss(&ids, &targets, s, b).unwrap();
        let g = m.backward(ctx).unwrap();
        assert!(loss != exact && (loss - exact).abs() < 5e-2 * exact, "{recipe:?}: {loss} vs exact {exact}");
        for ((name, a), (_, e)) in g.iter().zip(&g_exact) {
            let err = te_reference::linear::rel_frobenius(a, e);
            assert!(err < 0.15, "{recipe:?} {name}: relative error {err}");
        }
    }
    let bad = Float8BlockScaling { x_block_scaling_dim: 3, ..Default::default() };
    assert!(matches!(m.set_precision(GemmPrecision::Fp8(bad.into())), Err(Error::Recipe { .. })));
}

#[test]
fn bad_inputs_are_errors() {
    let mut m = GptRef::new(&micro()).unwrap();
    let (ids, targets) = pattern(8, 2, 16);
    assert!(matches!(m.forward_loss(&ids, &targets, 8, 3), Err(Error::Shape { .. })));
    assert!(matches!(m.forward_loss(&ids, &targets, 16, 1), Err(Error::Shape { .. })));
    let mut bad = ids.clone();
    bad[0] = 16;
    assert!(matches!(m.forward_loss(&bad, &targets, 8, 2), Err(Error::Argument { .. })));
    let e = GptRef::new(&GptConfig { num_attention_heads: 3, ..micro() }).unwrap_err();
    assert!(e.to_string().contains("num_attention_heads"), "{e}");
    let named: Vec<(String, Vec<f32>)> = m.params().iter().map(|p| (p.name.clone(), p.value.clone())).collect();
    assert_eq!(GptRef::from_named(&micro(), named.clone()).unwrap().params(), m.params());
    let e = GptRef::from_named(&micro(), named[1..].to_vec()).unwrap_err();
    assert!(e.to_string().contains("missing parameters: embedding.weight"), "{e}");
    let mut other = GptRef::new(&GptConfig { num_layers: 2, ..micro() }).unwrap();
    let (_, ctx) = m.forward_loss(&ids, &targets, 8, 2).unwrap();
    assert!(matches!(other.backward(ctx), Err(Error::Context { .. })));
    let (_, ctx) = m.forward_loss(&ids, &targets, 8, 2).unwrap();
    let grads = m.clone().backward(ctx).unwrap();
    let mut opt = GptAdamW::new(
        &other,
        GptAdamWConfig { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.0, max_grad_norm: None, skip_nonfinite: false },
    );
    assert!(matches!(opt.step(&mut m, &grads, 1e-3), Err(Error::Config { .. })));
}

#[test]
fn generate_decodes_from_the_last_positions_logits() {
    let model = GptRef::new(&micro()).unwrap();
    let prompts = vec![vec![1, 2, 3], vec![4, 4, 0]];
    let greedy = SamplingConfig::greedy();
    let out = model.generate(&prompts, 4, &greedy, 0).unwrap();
    assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), [4, 4]);
    // Each greedy token is the argmax of the full-prefix forward's last row, sequence by
    // sequence (a batch decodes as its prompts alone).
    for (p, new) in prompts.iter().zip(&out) {
        let mut seq = p.clone();
        for &t in new {
            let logits = model.logits(&seq, seq.len(), 1).unwrap();
            let last = &logits[(seq.len() - 1) * 16..];
            let best = (0..16).fold(0, |b, i| if last[i] > last[b] { i } else { b });
            assert_eq!(t, best as i32);
            seq.push(t);
        }
        assert_eq!(model.generate(std::slice::from_ref(p), 4, &greedy, 0).unwrap()[0], *new);
    }
    // Sampling: the same seed, the same tokens; every token in the vocabulary.
    let top = SamplingConfig { temperature: 1.5, top_k: Some(8), top_p: Some(0.95) };
    let a = model.generate(&prompts, 5, &top, 42).unwrap();
    assert_eq!(a, model.generate(&prompts, 5, &top, 42).unwrap());
    assert!(a.iter().flatten().all(|&t| (0..16).contains(&t)));
}

#[test]
fn generate_refuses_what_it_cannot_run() {
    let model = GptRef::new(&micro()).unwrap();
    let g = SamplingConfig::greedy();
    let shape = |r: Result<Vec<Vec<i32>>>| match r {
        Err(Error::Shape { message, .. }) => message,
        other => panic!("expected a shape error, got {other:?}"),
    };
    assert!(shape(model.generate(&[], 1, &g, 0)).contains("no prompt"));
    assert!(shape(model.generate(&[vec![]], 1, &g, 0)).contains("empty prompt"));
    assert!(shape(model.generate(&[vec![1], vec![1, 2]], 1, &g, 0)).contains("one length"));
    // seq_length 8: a prompt of 6 and 3 new tokens do not fit.
    assert!(shape(model.generate(&[vec![1; 6]], 3, &g, 0)).contains("context of 8"));
    assert_eq!(model.generate(&[vec![1; 6]], 2, &g, 0).unwrap()[0].len(), 2);
    assert!(matches!(model.generate(&[vec![99]], 1, &g, 0), Err(Error::Argument { .. })));
    let bad = SamplingConfig { top_k: Some(0), ..g };
    assert!(matches!(model.generate(&[vec![1]], 1, &bad, 0), Err(Error::Argument { .. })));
}

/// Fuzzing (reliability issue): random configurations, shapes, ids and targets (most of them
/// wrong) through `new`, `forward_loss` and `backward` in every precision: no panic, every
/// rejection a typed error, every accepted call a finite loss and one gradient per parameter.
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    fn precision() -> impl Strategy<Value = GemmPrecision> {
        prop_oneof![
            Just(GemmPrecision::F32),
            Just(GemmPrecision::Bf16),
            Just(GemmPrecision::Fp8(DelayedScaling { amax_history_len: 2, ..Default::default() }.into())),
            Just(GemmPrecision::Fp8(Float8BlockScaling::default().into())),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

        #[test]
        fn cpu_gpt_takes_random_shapes_without_panicking(
            (vocab, layers, heads, head_dim, ffn, seq) in (1usize..24, 1usize..3, 1usize..4, 1usize..8, 1usize..24, 1usize..10),
            zero in 0usize..16,
            dropout in prop_oneof![4 => Just(0.0f32), 4 => Just(0.2), 1 => Just(1.0), 1 => Just(-0.1), 1 => Just(f32::NAN)],
            (s, b, exact, in_range) in (0usize..12, 0usize..4, prop::bool::weighted(0.8), prop::bool::weighted(0.8)),
            tokens in prop::collection::vec(-3i32..30, 0..48),
            precision in precision(),
        ) {
            // Mostly a valid configuration; one size in ten zeroed or the hidden size not a
            // multiple of the heads.
            let mut cfg = GptConfig {
                vocab_size: vocab,
                hidden_size: heads * head_dim,
                num_layers: layers,
                num_attention_heads: heads,
                ffn_hidden_size: ffn,
                seq_length: seq,
                hidden_dropout: dropout,
                ..micro()
            };
            match zero {
                0 => cfg.vocab_size = 0,
                1 => cfg.num_layers = 0,
                2 => cfg.num_attention_heads = 0,
                3 => cfg.hidden_size += 1,
                4 => cfg.seq_length = 0,
                5 => cfg.ffn_hidden_size = 0,
                _ => {}
            }
            let mut model = match GptRef::new(&cfg) {
                Ok(m) => m,
                Err(e) => {
                    prop_assert!(matches!(e, Error::Config { .. }), "{e}");
                    return Ok(());
                }
            };
            model.set_precision(precision).unwrap();
            // Mostly `s · b` ids (cycled from `tokens`) within the vocabulary and at most
            // `seq_length + 1` positions; sometimes a wrong count or ids out of range.
            let s = s % (seq + 2);
            let n = if exact { s * b } else { tokens.len() };
            let id = |t: i32| if in_range { t.rem_euclid(vocab as i32) } else { t };
            let ids: Vec<i32> = (0..n).map(|i| id(tokens.get(i % tokens.len().max(1)).copied().unwrap_or(0))).collect();
            let targets: Vec<i32> = ids.iter().rev().map(|&t| if t < 0 { IGNORE_INDEX } else { t }).collect();
            match model.forward_loss(&ids, &targets, s, b) {
                Ok((loss, ctx)) => {
                    prop_assert!(loss.is_finite(), "loss {loss} for {cfg:?}, s {s}, b {b}");
                    let grads = model.backward(ctx).unwrap();
                    prop_assert_eq!(grads.len(), model.params().len());
                    prop_assert!(grads.iter().all(|(_, g)| g.iter().all(|x| x.is_finite())), "{cfg:?}");
                }
                Err(e) => prop_assert!(matches!(e, Error::Shape { .. } | Error::Argument { .. }), "{e}"),
            }
        }
    }
}
