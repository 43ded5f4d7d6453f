//! Family 11 on the GPU: the fused multi-tensor AdamW step against the CPU reference (masters,
//! moments and parameters bit for bit; the norm within f32 rounding and identical run to run)
//! over tensors of odd sizes that span several chunks, in every grad/param dtype; and
//! `optim::AdamW` end to end on a derived two-layer model after a backward (parameters moved as
//! the reference says, versions bumped, clipping, typed errors).

use crate::common::{device, randn};
use std::sync::Arc;
use te_nn::modules::{Linear, LinearConfig};
use te_nn::Module;
use te_reference::optimizer as reference;
use te_runtime::numerics;
use te_runtime::ops::optimizer::scalars::{AdamWHyper, AdamWScalars};
use te_runtime::ops::optimizer::{adamw_step, adamw_step_reduced, AdamWArgs, AdamWTensor, CHUNK};
use te_runtime::{DType, Device, Error, Tensor};
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

/// `(elements, grad dtype, param dtype, weight decay, the tensor's first step)`.
const CASES: [(usize, DType, DType, f32, u64); 6] = [
    (1, DType::BF16, DType::BF16, 0.1, 1),
    (7, DType::F32, DType::BF16, 0.0, 1),
    (4099, DType::F16, DType::F16, 0.1, 4),
    (CHUNK + 5, DType::F32, DType::F32, 0.05, 1),
    (3 * CHUNK + 1, DType::BF16, DType::F32, 0.1, 2),
    (2 * CHUNK, DType::BF16, DType::BF16, 0.1, 1),
];

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Host copies of one tensor's state.
struct HostState {
    grad: Vec<f32>,
    master: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
}

/// Runs `steps` fused steps over the CASES tensors and checks each against the reference.
fn run_steps(dev: &Arc<Device>, max_grad_norm: f32, steps: u64) -> Vec<f32> {
    let s = dev.stream();
    let mut host: Vec<HostState> = CASES
        .iter()
        .enumerate()
        .map(|(i, &(n, gt, _, _, _))| HostState {
            grad: randn(10 + i as u64, n, 1.0).into_iter().map(|x| numerics::round_to(gt, x)).collect(),
            master: randn(20 + i as u64, n, 0.5),
            // Non-zero moments, as after earlier steps (v ≥ 0).
            m: randn(30 + i as u64, n, 0.1),
            v: randn(40 + i as u64, n, 0.1).into_iter().map(|x| x * x).collect(),
        })
        .collect();
    let grads: Vec<Tensor> =
        CASES.iter().zip(&host).map(|(c, h)| Tensor::from_f32(dev, c.1, &[c.0], &h.grad).unwrap()).collect();
    let mut params: Vec<Tensor> = CASES.iter().map(|c| Tensor::zeros(dev, c.2, &[c.0]).unwrap()).collect();
    let mut masters: Vec<_> = host.iter().map(|h| s.clone_htod(&h.master).unwrap()).collect();
    let mut ms: Vec<_> = host.iter().map(|h| s.clone_htod(&h.m).unwrap()).collect();
    let mut vs: Vec<_> = host.iter().map(|h| s.clone_htod(&h.v).unwrap()).collect();
    let mut norm_out = s.alloc_zeros::<f32>(2).unwrap();
    let mut norms = Vec::new();
    for step in 0..steps {
        let args = AdamWArgs {
            lr: 1e-3 * (step + 1) as f32,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            max_grad_norm,
            skip_nonfinite: false,
        };
        let mut tensors: Vec<AdamWTensor> = grads
            .iter()
            .zip(params.iter_mut())
            .zip(masters.iter_mut().zip(ms.iter_mut()).zip(vs.iter_mut()))
            .zip(&CASES)
            .map(|(((grad, param), ((master, exp_avg), exp_avg_sq)), c)| AdamWTensor {
                grad,
                param,
                master,
                exp_avg,
                exp_avg_sq,
                weight_decay: c.3,
                step: c.4 + step,
                // After the first step one tensor is a replicated copy another rank counts.
                in_norm: step == 0 || c.0 != 4099,
            })
            .collect();
        // The partial sums pass through the reduction hook once, one per chunk.
        let chunks: usize = CASES.iter().map(|c| c.0.div_ceil(CHUNK)).sum();
        let mut reduced = 0;
        adamw_step_reduced(dev, &mut tensors, &args, &mut norm_out, &mut |partials| {
            assert_eq!(partials.len(), chunks);
            reduced += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(reduced, 1);
        drop(tensors);
        let out = s.clone_dtoh(&norm_out).unwrap();
        let counted: Vec<&[f32]> =
            host.iter().zip(&CASES).filter(|(_, c)| step == 0 || c.0 != 4099).map(|(h, _)| h.grad.as_slice()).collect();
        let want_norm = reference::global_norm(&counted);
        assert!((out[0] - want_norm).abs() <= 1e-5 * want_norm, "norm {} vs reference {want_norm}", out[0]);
        assert_eq!(out[1].to_bits(), reference::clip_coef(out[0], max_grad_norm).to_bits(), "clip coefficient");
        norms.push(out[0]);
        for (i, (h, c)) in host.iter_mut().zip(&CASES).enumerate() {
            let hyper = AdamWHyper {
                lr: args.lr,
                beta1: args.beta1,
                beta2: args.beta2,
                eps: args.eps,
                weight_decay: c.3,
                step: c.4 + step,
            };
            let want_p = reference::adamw_step(
                &AdamWScalars::new(&hyper),
                out[1],
                &h.grad,
                &mut h.master,
                &mut h.m,
                &mut h.v,
                c.2,
            );
            let what = format!("step {step}, tensor {i} ({} elements, grad {}, param {})", c.0, c.1, c.2);
            assert_eq!(bits(&s.clone_dtoh(&masters[i]).unwrap()), bits(&h.master), "{what}: master");
            assert_eq!(bits(&s.clone_dtoh(&ms[i]).unwrap()), bits(&h.m), "{what}: exp_avg");
            assert_eq!(bits(&s.clone_dtoh(&vs[i]).unwrap()), bits(&h.v), "{what}: exp_avg_sq");
            let got_p = params[i].to_bytes(dev).unwrap();
            assert_eq!(got_p, numerics::encode(c.2, &want_p), "{what}: param");
        }
    }
    norms
}

#[test]
fn fused_adamw_matches_the_reference_bit_for_bit() {
    let Some(dev) = device() else { return };
    let norms = run_steps(&dev, f32::INFINITY, 3);
    // The same gradients every step: the norm is reproduced bit for bit (from the second step
    // on, one tensor is left out of it: smaller).
    assert!(norms[1..].iter().all(|n| n.to_bits() == norms[1].to_bits()), "{norms:?}");
    assert!(norms[0] > norms[1], "{norms:?}");
}

#[test]
fn clipping_scales_the_gradients_by_the_device_coefficient() {
    let Some(dev) = device() else { return };
    // The gradients' norm is ~ sqrt(4.5 * CHUNK) ≫ 1: the coefficient is < 1 (checked against
    // the reference inside, and used by the reference update).
    let norms = run_steps(&dev, 1.0, 2);
    assert!(reference::clip_coef(norms[0], 1.0) < 1e-2, "{norms:?}");
}

#[test]
fn bad_arguments_are_typed_errors() {
    let Some(dev) = device() else { return };
    let s = dev.stream();
    let mut norm_out = s.alloc_zeros::<f32>(2).unwrap();
    let args = AdamWArgs { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, max_grad_norm: 1.0, skip_nonfinite: false };
    assert!(matches!(adamw_step(&dev, &mut [], &args, &mut norm_out), Err(Error::Shape { .. })));
    let grad = Tensor::zeros(&dev, DType::E4M3, &[8]).unwrap();
    let mut param = Tensor::zeros(&dev, DType::BF16, &[8]).unwrap();
    let (mut a, mut b, mut c) = (s.alloc_zeros(8).unwrap(), s.alloc_zeros(8).unwrap(), s.alloc_zeros(7).unwrap());
    let mut t = [AdamWTensor {
        grad: &grad,
        param: &mut param,
        master: &mut a,
        exp_avg: &mut b,
        exp_avg_sq: &mut c,
        weight_decay: 0.0,
        step: 1,
        in_norm: true,
    }];
    let e = adamw_step(&dev, &mut t, &args, &mut norm_out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("tensor 0"), "{e}");
    let bad = AdamWArgs { max_grad_norm: 0.0, ..args };
    assert!(matches!(adamw_step(&dev, &mut t, &bad, &mut norm_out), Err(Error::Argument { .. })));
}

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

const T: usize = 16;
const H: usize = 64;
const F: usize = 96;

fn mlp(dev: &Arc<Device>) -> Mlp {
    Mlp {
        fc1: Linear::new(dev, LinearConfig { seed: 1, ..LinearConfig::new(H, F) }).unwrap(),
        fc2: Linear::new(dev, LinearConfig { seed: 2, ..LinearConfig::new(F, H) }).unwrap(),
    }
}

/// A bf16 forward and backward of both layers (each on its own input).
fn backward(dev: &Device, m: &mut Mlp) {
    let x = Tensor::from_f32(dev, DType::BF16, &[T, H], &randn(3, T * H, 1.0)).unwrap();
    let (y, ctx) = m.fc1.forward(&x).unwrap();
    let h = y.clone();
    m.fc1.backward(ctx, &Tensor::from_f32(dev, DType::BF16, &[T, F], &randn(4, T * F, 1.0)).unwrap()).unwrap();
    let (_, ctx) = m.fc2.forward(&h).unwrap();
    m.fc2.backward(ctx, &Tensor::from_f32(dev, DType::BF16, &[T, H], &randn(5, T * H, 1.0)).unwrap()).unwrap();
}

/// Every parameter and gradient of the model, as f32, in traversal order.
fn snapshot(dev: &Device, m: &Mlp) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (mut p, mut g) = (Vec::new(), Vec::new());
    m.visit("", &mut |_: &str, _, t: &dyn te_nn::modules::Param| -> te_runtime::Result<()> {
        p.push(t.tensor().unwrap().to_f32(dev)?);
        g.push(t.grad().unwrap().to_f32(dev)?);
        Ok(())
    })
    .unwrap();
    (p, g)
}

#[test]
fn adamw_steps_a_model_as_the_reference_says() {
    let Some(dev) = device() else { return };
    let mut model = mlp(&dev);
    let lr = LrSchedule::WarmupCosine { peak: 1e-2, warmup_steps: 2, total_steps: 10, min_lr: 1e-3 };
    let config = AdamWConfig { max_grad_norm: Some(0.5), decay_biases_and_norms: false, ..AdamWConfig::new(lr) };
    let mut opt = AdamW::new(&dev, &model, config).unwrap();
    assert!(matches!(opt.step(&mut model), Err(Error::Config { .. })), "no gradients yet");
    backward(&dev, &mut model);
    let (mut masters, grads) = snapshot(&dev, &model);
    let mut moments: Vec<(Vec<f32>, Vec<f32>)> =
        masters.iter().map(|p| (vec![0.0; p.len()], vec![0.0; p.len()])).collect();
    let versions = (model.fc1.params().version(), model.fc2.params().version());
    for step in 1..=2u64 {
        let stats = opt.step(&mut model).unwrap();
        assert_eq!((stats.step, stats.params_updated, stats.lr), (step, 4, lr.lr(step)));
        let want_norm = reference::global_norm(&grads.iter().map(Vec::as_slice).collect::<Vec<_>>());
        assert!((stats.grad_norm - want_norm).abs() <= 1e-5 * want_norm, "{} vs {want_norm}", stats.grad_norm);
        assert!(stats.grad_norm > 0.5 && stats.clip_coef < 1.0, "clipping kicks in: {stats:?}");
        assert_eq!(stats.clip_coef, reference::clip_coef(stats.grad_norm, 0.5));
        let (got, _) = snapshot(&dev, &model);
        let kinds = ["weight", "bias", "weight", "bias"];
        for (i, ((master, (m, v)), grad)) in masters.iter_mut().zip(&mut moments).zip(&grads).enumerate() {
            let weight_decay = if kinds[i] == "weight" { 0.01 } else { 0.0 };
            let h = AdamWHyper { lr: stats.lr, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay, step };
            let want = reference::adamw_step(&AdamWScalars::new(&h), stats.clip_coef, grad, master, m, v, DType::BF16);
            assert_eq!(bits(&got[i]), bits(&want), "step {step}: parameter {i} ({})", kinds[i]);
            assert_eq!(bits(&dev.stream().clone_dtoh(&opt.states()[i].master).unwrap()), bits(master));
        }
        // Weight and bias of each layer were written: two version bumps per layer and step.
        assert_eq!(
            (model.fc1.params().version(), model.fc2.params().version()),
            (versions.0 + 2 * step, versions.1 + 2 * step)
        );
    }
    assert_eq!(opt.states().iter().map(|s| s.step).collect::<Vec<_>>(), [2, 2, 2, 2]);
}

/// `skip_nonfinite` (Megatron's skipped iteration): a NaN gradient leaves parameters, masters
/// and moments as they were and the step uncounted; without it the NaN spreads, as in PyTorch.
#[test]
fn nonfinite_steps_are_skipped_on_request() {
    let Some(dev) = device() else { return };
    let nan_backward = |m: &mut Mlp| {
        let mut xs = randn(3, T * H, 1.0);
        xs[5] = f32::NAN;
        let x = Tensor::from_f32(&dev, DType::BF16, &[T, H], &xs).unwrap();
        let (_, ctx) = m.fc1.forward(&x).unwrap();
        m.fc1.backward(ctx, &Tensor::from_f32(&dev, DType::BF16, &[T, F], &randn(4, T * F, 1.0)).unwrap()).unwrap();
    };
    for skip_nonfinite in [true, false] {
        let mut model = mlp(&dev);
        let config = AdamWConfig { skip_nonfinite, ..AdamWConfig::new(LrSchedule::Constant(1e-2)) };
        let mut opt = AdamW::new(&dev, &model, config).unwrap();
        backward(&dev, &mut model);
        assert!(!opt.step(&mut model).unwrap().skipped);
        let (before, _) = snapshot(&dev, &model);
        model.zero_grad();
        let states = |opt: &AdamW| -> Vec<Vec<f32>> {
            let s = dev.stream();
            opt.states()
                .iter()
                .flat_map(|p| [&p.master, &p.exp_avg, &p.exp_avg_sq])
                .map(|t| s.clone_dtoh(t).unwrap())
                .collect()
        };
        let state_before = states(&opt);
        backward(&dev, &mut model);
        nan_backward(&mut model);
        let stats = opt.step(&mut model).unwrap();
        assert!(stats.grad_norm.is_nan(), "{stats:?}");
        let (after, _) = snapshot(&dev, &model);
        if skip_nonfinite {
            assert!(stats.skipped && stats.step == 1 && opt.step_count() == 1, "{stats:?}");
            assert_eq!(
                after.iter().map(|p| bits(p)).collect::<Vec<_>>(),
                before.iter().map(|p| bits(p)).collect::<Vec<_>>()
            );
            let state_after = states(&opt);
            for (a, b) in state_after.iter().zip(&state_before) {
                assert_eq!(bits(a), bits(b), "masters and moments unchanged");
            }
            assert!(opt.states().iter().all(|p| p.step == 1), "parameter steps unchanged");
        } else {
            assert!(!stats.skipped && stats.step == 2, "{stats:?}");
            assert!(after.iter().flatten().any(|x| x.is_nan()), "PyTorch's arithmetic spreads the NaN");
        }
    }
}

#[test]
fn a_different_model_is_refused() {
    let Some(dev) = device() else { return };
    let model = mlp(&dev);
    let mut opt = AdamW::new(&dev, &model, AdamWConfig::new(LrSchedule::Constant(1e-3))).unwrap();
    let mut other = Mlp {
        fc1: Linear::new(&dev, LinearConfig::new(H, F)).unwrap(),
        fc2: Linear::new(&dev, LinearConfig { bias: false, ..LinearConfig::new(F, H) }).unwrap(),
    };
    backward(&dev, &mut other);
    let e = opt.step(&mut other).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("changed"), "{e}");
}

#[test]
fn optimizer_state_files_round_trip_and_bad_files_are_refused() {
    let Some(dev) = device() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer.safetensors");
    let mut model = mlp(&dev);
    let config = AdamWConfig::new(LrSchedule::Constant(1e-2));
    let mut opt = AdamW::new(&dev, &model, config).unwrap();
    for _ in 0..2 {
        backward(&dev, &mut model);
        opt.step(&mut model).unwrap();
        model.zero_grad();
    }
    opt.save_state(&path).unwrap();
    let mut fresh = AdamW::new(&dev, &mlp(&dev), config).unwrap();
    fresh.load_state(&path).unwrap();
    assert_eq!(fresh.step_count(), 2);
    for (a, b) in opt.states().iter().zip(fresh.states()) {
        assert_eq!((a.path.as_str(), a.step), (b.path.as_str(), b.step));
        for (x, y) in [(&a.master, &b.master), (&a.exp_avg, &b.exp_avg), (&a.exp_avg_sq, &b.exp_avg_sq)] {
            assert_eq!(bits(&dev.stream().clone_dtoh(x).unwrap()), bits(&dev.stream().clone_dtoh(y).unwrap()));
        }
    }
    // Another model's optimizer: every tensor that does not fit is named, nothing changes.
    let other = Mlp {
        fc1: Linear::new(&dev, LinearConfig::new(H, F)).unwrap(),
        fc2: Linear::new(&dev, LinearConfig { bias: false, ..LinearConfig::new(F, 2 * H) }).unwrap(),
    };
    let mut wrong = AdamW::new(&dev, &other, config).unwrap();
    let e = wrong.load_state(&path).unwrap_err().to_string();
    assert!(e.contains("fc2.weight.master is F32 [64, 96], expected F32 [128, 96]"), "{e}");
    assert_eq!(wrong.step_count(), 0);
    // A truncated file and a missing one are errors, never panics.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = fresh.load_state(&path).unwrap_err();
    assert!(matches!(e, Error::Checkpoint { .. }), "{e}");
    let e = fresh.load_state(dir.path().join("missing.safetensors")).unwrap_err();
    assert!(e.to_string().contains("cannot read"), "{e}");
}
