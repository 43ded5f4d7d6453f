//! `GroupedLinear` on the GPU: a loop of `Linear`s with the same weights over the same row
//! groups, bit for bit, in BF16 and under the three FP8 recipes (per-expert scaling states;
//! two steps, so delayed scaling's second runs with scales from the first), including an
//! expert that receives no rows; the CPU reference (`reference::moe::grouped_forward`) at bf16
//! tolerance; parameter names; the typed errors.

use crate::common::{assert_close, bf16, device, host, randn, upload};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8BlockScaling, Float8CurrentScaling, Recipe};
use te_nn::modules::{GroupedLinear, GroupedLinearConfig, Linear, LinearConfig, Module, ParamKind};
use te_reference::moe::grouped_forward;
use te_runtime::{Device, Error};

/// Rows per expert: uneven, one empty, multiples of 16 (FP8 training), 256 in all.
const SPLITS: [usize; 5] = [48, 0, 112, 16, 80];
const IN: usize = 80;
const OUT: usize = 144;

/// The experts with random biases, and one `Linear` per expert holding the same parameters.
fn experts(dev: &std::sync::Arc<Device>) -> (GroupedLinear, Vec<Linear>) {
    let cfg = GroupedLinearConfig { seed: 7, ..GroupedLinearConfig::new(SPLITS.len(), IN, OUT) };
    let mut g = GroupedLinear::new(dev, cfg).unwrap();
    let mut linears = Vec::new();
    for i in 0..SPLITS.len() {
        let b = upload(dev, &bf16(&randn(100 + i as u64, OUT, 0.5)), &[OUT]);
        let p = g.params_mut(i).unwrap();
        p.set_bias(b.clone()).unwrap();
        let mut lin = Linear::new(dev, LinearConfig::new(IN, OUT)).unwrap();
        lin.params_mut().set_weight(p.weight().unwrap().clone()).unwrap();
        lin.params_mut().set_bias(b).unwrap();
        linears.push(lin);
    }
    (g, linears)
}

/// One step of both: `(y, dx, [dW_i], [db_i])` of the grouped layer and of the loop.
type Step = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>, Vec<Vec<f32>>);

fn steps(dev: &Device, g: &mut GroupedLinear, linears: &mut [Linear], x: &[f32], dy: &[f32]) -> (Step, Step) {
    let tokens: usize = SPLITS.iter().sum();
    let (xt, dyt) = (upload(dev, x, &[tokens, IN]), upload(dev, dy, &[tokens, OUT]));
    let (y, ctx) = g.forward(&xt, &SPLITS).unwrap();
    assert_eq!(ctx.m_splits(), SPLITS);
    let dx = g.backward(ctx, &dyt).unwrap();
    let grads = |p: &te_nn::modules::LinearParams| {
        (
            p.weight_grad().map_or(Vec::new(), |t| t.to_f32(dev).unwrap()),
            p.bias_grad().map_or(Vec::new(), |t| t.to_f32(dev).unwrap()),
        )
    };
    let (dw, db): (Vec<_>, Vec<_>) = (0..SPLITS.len()).map(|i| grads(g.params(i).unwrap())).unzip();
    let grouped = (y.to_f32(dev).unwrap(), dx.to_f32(dev).unwrap(), dw, db);

    let (mut y_loop, mut dx_loop) = (Vec::new(), Vec::new());
    let mut start = 0;
    for (lin, &m) in linears.iter_mut().zip(&SPLITS) {
        if m > 0 {
            let xi = upload(dev, &x[start * IN..(start + m) * IN], &[m, IN]);
            let (yi, ctx) = lin.forward(&xi).unwrap();
            let dyi = upload(dev, &dy[start * OUT..(start + m) * OUT], &[m, OUT]);
            dx_loop.extend(lin.backward(ctx, &dyi).unwrap().to_f32(dev).unwrap());
            y_loop.extend(yi.to_f32(dev).unwrap());
        }
        start += m;
    }
    let (dw, db): (Vec<_>, Vec<_>) = linears.iter().map(|l| grads(l.params())).unzip();
    (grouped, (y_loop, dx_loop, dw, db))
}

#[test]
fn grouped_linear_equals_a_loop_of_linears_in_every_precision() {
    let Some(dev) = device() else { return };
    let tokens: usize = SPLITS.iter().sum();
    let x = bf16(&randn(1, tokens * IN, 1.0));
    let dy = bf16(&randn(2, tokens * OUT, 1e-2));
    let recipes: [Option<Recipe>; 4] = [
        None,
        Some(DelayedScaling { amax_history_len: 4, ..Default::default() }.into()),
        Some(Float8CurrentScaling::default().into()),
        Some(Float8BlockScaling::default().into()),
    ];
    for recipe in recipes {
        let (mut g, mut linears) = experts(&dev);
        for step in 0..2 {
            let mut run = || -> te_runtime::Result<(Step, Step)> { Ok(steps(&dev, &mut g, &mut linears, &x, &dy)) };
            let (grouped, looped) = match recipe {
                Some(r) => fp8_autocast(true, r, run).unwrap(),
                None => run().unwrap(),
            };
            let what = format!("{recipe:?} step {step}");
            assert_eq!(grouped.0, looped.0, "{what}: y");
            assert_eq!(grouped.1, looped.1, "{what}: dx");
            // The empty expert's gradients are zeros (its Linear in the loop never ran: none).
            let (mut dw, mut db) = (grouped.2.clone(), grouped.3.clone());
            assert!(dw[1].len() == OUT * IN && dw[1].iter().all(|&v| v == 0.0), "{what}: the empty expert's dW is 0");
            assert!(db[1].len() == OUT && db[1].iter().all(|&v| v == 0.0), "{what}: the empty expert's db is 0");
            assert!(looped.2[1].is_empty() && looped.3[1].is_empty());
            (dw[1], db[1]) = (Vec::new(), Vec::new());
            assert_eq!(dw, looped.2, "{what}: weight gradients (accumulated over the steps)");
            assert_eq!(db, looped.3, "{what}: bias gradients");
        }
        if let Some(Recipe::Delayed(_)) = recipe {
            let states = g.fp8_states();
            assert!(states[0][0].is_some() && states[1][0].is_none(), "a state per expert that ran");
        }
    }
}

#[test]
fn grouped_linear_matches_the_reference_and_names_its_parameters() {
    let Some(dev) = device() else { return };
    let (mut g, _) = experts(&dev);
    let tokens: usize = SPLITS.iter().sum();
    let x = bf16(&randn(3, tokens * IN, 1.0));
    let got = g.infer(&upload(&dev, &x, &[tokens, IN]), &SPLITS).unwrap().to_f32(&dev).unwrap();
    let host = |i: usize, bias: bool| {
        let p = g.params(i).unwrap();
        let t = if bias { p.bias() } else { p.weight() };
        t.unwrap().to_f32(&dev).unwrap()
    };
    let (ws, bs): (Vec<_>, Vec<_>) = (0..SPLITS.len()).map(|i| (host(i, false), host(i, true))).unzip();
    let wr: Vec<&[f32]> = ws.iter().map(Vec::as_slice).collect();
    let br: Vec<&[f32]> = bs.iter().map(Vec::as_slice).collect();
    let want = grouped_forward(&x, &SPLITS, &wr, Some(&br));
    let amax = want.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    assert_close("grouped y", &got, &want, 1.6e-2, 1e-2 * amax);

    let mut names = Vec::new();
    g.visit("experts", &mut |path: &str, kind: ParamKind, _: &dyn te_nn::modules::Param| {
        names.push((path.to_owned(), kind));
        Ok(())
    })
    .unwrap();
    assert_eq!(names.len(), 2 * SPLITS.len());
    assert_eq!(names[0], ("experts.weight0".to_owned(), ParamKind::Weight));
    assert_eq!(names[9], ("experts.bias4".to_owned(), ParamKind::Bias));
}

#[test]
fn grouped_linear_errors_are_typed() {
    let Some(dev) = device() else { return };
    let (mut g, _) = experts(&dev);
    let tokens: usize = SPLITS.iter().sum();
    let x = upload(&dev, &randn(4, tokens * IN, 1.0), &[tokens, IN]);
    let shape_err = |e: Error, what: &str| {
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(what), "{e}");
    };
    shape_err(g.forward(&x, &SPLITS[..4]).unwrap_err(), "m_splits");
    shape_err(g.forward(&x, &[48, 0, 112, 16, 81]).unwrap_err(), "sum to the 256");
    // FP8 training needs every split to be a multiple of 16 and names the expert.
    let odd = [50, 0, 110, 16, 80];
    let e = fp8_autocast(true, DelayedScaling::default(), || g.forward(&x, &odd).map(|_| ())).unwrap_err();
    shape_err(e, "m_splits[0]");
    // ... inference does not.
    fp8_autocast(true, DelayedScaling::default(), || g.infer(&x, &odd)).unwrap();
    // A context outlives no weight update.
    let (y, ctx) = g.forward(&x, &SPLITS).unwrap();
    let w = g.params(0).unwrap().weight().unwrap().clone();
    g.params_mut(0).unwrap().set_weight(w).unwrap();
    let e = g.backward(ctx, &y).unwrap_err();
    assert!(matches!(e, Error::Context { .. }), "{e}");
    let e = GroupedLinear::new(&dev, GroupedLinearConfig::new(0, IN, OUT)).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("num_gemms"), "{e}");
}

/// The device-splits path (one grouped launch per pass) against the host-splits path (one
/// cuBLASLt GEMM per expert) with the same weights, without and with biases: outputs, dx and
/// accumulated weight and bias gradients at bf16 tolerance (different summation orders), the rows
/// past `Σ m_splits` zero, then a CUDA graph of forward + backward replayed with other splits
/// written into the same device buffer.
#[test]
fn device_m_splits_follow_host_m_splits_and_replay_in_a_graph() {
    let Some(dev) = device() else { return };
    for bias in [false, true] {
        device_splits_case(&dev, bias);
    }
}

fn device_splits_case(dev: &std::sync::Arc<Device>, bias: bool) {
    use te_runtime::graph::Graph;
    use te_runtime::{DType, Tensor};
    let dev = dev.clone();
    let (inf, outf) = (96, 160);
    let cfg = GroupedLinearConfig { bias, seed: 3, ..GroupedLinearConfig::new(4, inf, outf) };
    let mut on_device = GroupedLinear::new(&dev, cfg.clone()).unwrap();
    let mut on_host = GroupedLinear::new(&dev, cfg).unwrap();
    if bias {
        for i in 0..4 {
            let b = upload(&dev, &bf16(&randn(40 + i as u64, outf, 0.5)), &[outf]);
            on_device.params_mut(i).unwrap().set_bias(b.clone()).unwrap();
            on_host.params_mut(i).unwrap().set_bias(b).unwrap();
        }
    }
    let rows = 200; // the splits route at most 200 rows; those past them must come out zero
    let x = Tensor::from_f32(&dev, DType::BF16, &[rows, inf], &bf16(&randn(1, rows * inf, 1.0))).unwrap();
    let dy = Tensor::from_f32(&dev, DType::BF16, &[rows, outf], &bf16(&randn(2, rows * outf, 0.1))).unwrap();
    let run_device = |m: &mut GroupedLinear, splits: &cudarc::driver::CudaSlice<i32>| {
        let (y, ctx) = m.forward_device(&x, splits)?;
        let dx = m.backward(ctx, &dy)?;
        Ok::<_, Error>((y, dx))
    };
    let check = |step: &str, y: &Tensor, dx: &Tensor, host: &mut GroupedLinear, splits: &[usize]| {
        let used: usize = splits.iter().sum();
        let (xh, dyh) = (x.narrow(&dev, 0..used).unwrap(), dy.narrow(&dev, 0..used).unwrap());
        let (yh, ctx) = host.forward(&xh, splits).unwrap();
        let dxh = host.backward(ctx, &dyh).unwrap();
        let (yd, dxd) = (y.to_f32(&dev).unwrap(), dx.to_f32(&dev).unwrap());
        assert_close(&format!("{step}: y"), &yd[..used * outf], &yh.to_f32(&dev).unwrap(), 1e-2, 1e-2);
        assert_close(&format!("{step}: dx"), &dxd[..used * inf], &dxh.to_f32(&dev).unwrap(), 1e-2, 1e-3);
        assert!(yd[used * outf..].iter().chain(&dxd[used * inf..]).all(|&v| v == 0.0), "{step}: rows past the splits");
    };
    // Eager: two steps, the second accumulating the weight gradients.
    let first = [64usize, 0, 96, 32];
    let mut splits = dev.stream().clone_htod(&first.map(|m| m as i32)).unwrap();
    for step in ["eager 1", "eager 2"] {
        let (y, dx) = run_device(&mut on_device, &splits).unwrap();
        check(step, &y, &dx, &mut on_host, &first);
    }
    on_device.check_device_splits().unwrap();
    // Captured once, replayed with other routings (an empty expert, all rows, fewer rows).
    let (graph, (y, dx)) = Graph::capture(&dev, || run_device(&mut on_device, &splits)).unwrap();
    for s in [[16usize, 112, 0, 72], [50, 50, 50, 50], [0, 0, 8, 0]] {
        dev.stream().memcpy_htod(&s.map(|m| m as i32), &mut splits).unwrap();
        graph.replay().unwrap();
        check(&format!("replay {s:?}"), &y, &dx, &mut on_host, &s);
    }
    on_device.check_device_splits().unwrap();
    // 2 eager steps and 3 replays accumulated alike.
    for i in 0..4 {
        let (pd, ph) = (on_device.params(i).unwrap(), on_host.params(i).unwrap());
        assert_close(&format!("dW_{i}"), &host(&dev, pd.weight_grad()), &host(&dev, ph.weight_grad()), 2e-2, 2e-2);
        if bias {
            assert_close(&format!("db_{i}"), &host(&dev, pd.bias_grad()), &host(&dev, ph.bias_grad()), 2e-2, 2e-2);
        }
    }
    // Splits that sum past the rows are clamped and reported.
    dev.stream().memcpy_htod(&[150i32, 150, 0, 0], &mut splits).unwrap();
    on_device.infer_device(&x, &splits).unwrap();
    assert!(on_device.check_device_splits().is_err());
    // The device path's typed errors: FP8, features not multiples of 16, a wrong split count.
    let e = fp8_autocast(true, DelayedScaling::default(), || on_device.forward_device(&x, &splits)).unwrap_err();
    assert!(matches!(e, Error::Config { .. }), "{e}");
    let mut odd = GroupedLinear::new(&dev, GroupedLinearConfig::new(4, inf, 40)).unwrap();
    assert!(matches!(odd.forward_device(&x, &splits).unwrap_err(), Error::Config { .. }));
    let three = dev.stream().clone_htod(&[1i32, 2, 3]).unwrap();
    assert!(matches!(on_device.forward_device(&x, &three).unwrap_err(), Error::Shape { .. }));
}
