//! CUDA graphs (`te_runtime::graph`): a captured forward + backward replays exactly what the eager
//! calls compute on new inputs, gradients accumulating as they do; a capture that breaks a rule
//! (a kernel or a GEMM shape not prepared, a host read, a nested capture) is a typed error naming
//! it, and the device works on afterwards.

use crate::common::{assert_bits_eq, device, randn};
use te_nn::modules::{LayerNormMLP, LayerNormMLPConfig};
use te_runtime::graph::{CaptureRule, Graph};
use te_runtime::{DType, Error, Tensor};

const T: usize = 192;
const H: usize = 256;
const F: usize = 1024;

#[test]
fn a_captured_forward_and_backward_replays_the_eager_bits() {
    let Some(dev) = device() else { return };
    let up = |seed, std| Tensor::from_f32(&dev, DType::BF16, &[T, H], &randn(seed, T * H, std)).unwrap();
    let bits = |t: &Tensor| t.to_bytes(&dev).unwrap();
    // Two modules of one seed: `graphed` replays, `eager` calls; both see the same steps.
    let mut graphed = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, F)).unwrap();
    let mut eager = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, F)).unwrap();
    let (x, dy) = (up(1, 1.0), up(2, 1e-2));
    let step = |m: &mut LayerNormMLP, x: &Tensor, dy: &Tensor| -> te_runtime::Result<(Tensor, Tensor)> {
        let (y, ctx) = m.forward(x)?;
        let dx = m.backward(ctx, dy)?;
        Ok((y, dx))
    };
    // Two warm-up steps load every kernel and choose every GEMM algorithm: the first makes the
    // gradient buffers, the second meets the GEMMs that accumulate into them (as the replays do).
    for _ in 0..2 {
        step(&mut graphed, &x, &dy).unwrap();
        step(&mut eager, &x, &dy).unwrap();
    }
    let (graph, (y, dx)) = Graph::capture(&dev, || step(&mut graphed, &x, &dy)).unwrap();
    for seed in [10, 20, 30] {
        let (xs, dys) = (up(seed, 1.0), up(seed + 1, 1e-2));
        x.copy_from(&xs).unwrap();
        dy.copy_from(&dys).unwrap();
        graph.replay().unwrap();
        let (want_y, want_dx) = step(&mut eager, &xs, &dys).unwrap();
        assert_bits_eq(&format!("step {seed}: y"), &bits(&y), &bits(&want_y));
        assert_bits_eq(&format!("step {seed}: dx"), &bits(&dx), &bits(&want_dx));
    }
    // Five steps of gradients each: two warm-ups and three replays, accumulated alike.
    for (name, g, e) in [
        ("fc1 weight_grad", graphed.fc1().weight_grad(), eager.fc1().weight_grad()),
        ("fc2 weight_grad", graphed.fc2().weight_grad(), eager.fc2().weight_grad()),
    ] {
        assert_bits_eq(name, &bits(g.unwrap()), &bits(e.unwrap()));
    }
}

#[test]
fn a_capture_that_breaks_a_rule_names_it_and_the_device_works_on() {
    let Some(dev) = device() else { return };
    let x = Tensor::from_f32(&dev, DType::BF16, &[T, H], &randn(3, T * H, 1.0)).unwrap();
    let rule = |what: &str, e: Error| match e {
        Error::Capture { rule, .. } => rule,
        other => panic!("{what}: expected a capture error, got {other}"),
    };
    // Never run before: its kernels are not loaded, its GEMMs not chosen.
    let mut fresh = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, 3 * H)).unwrap();
    let e = Graph::capture(&dev, || fresh.forward(&x)).map(|_| ()).unwrap_err();
    let r = rule("a module never run", e);
    assert!(matches!(r, CaptureRule::KernelsLoadedBefore | CaptureRule::GemmAlgorithmsChosenBefore), "{r:?}");
    // A GEMM shape not met before, its kernels loaded: the module ran once at another size.
    fresh.forward(&x).unwrap();
    let x2 = Tensor::from_f32(&dev, DType::BF16, &[2 * T, H], &randn(4, 2 * T * H, 1.0)).unwrap();
    let e = Graph::capture(&dev, || fresh.forward(&x2)).map(|_| ()).unwrap_err();
    assert_eq!(rule("a new GEMM shape", e), CaptureRule::GemmAlgorithmsChosenBefore);
    // A host read.
    let e = Graph::capture(&dev, || fresh.forward(&x)?.0.to_f32(&dev)).map(|_| ()).unwrap_err();
    assert_eq!(rule("a host read", e), CaptureRule::NoHostTransfers);
    // A capture inside a capture.
    let e = Graph::capture(&dev, || Graph::capture(&dev, || Ok(())).map(|_| ())).map(|_| ()).unwrap_err();
    assert_eq!(rule("a nested capture", e), CaptureRule::OneCaptureAtATime);
    // After each failure the device runs eager work and captures again.
    let (want, _) = fresh.forward(&x).expect("an eager forward after the failed captures");
    let (graph, (got, _)) = Graph::capture(&dev, || fresh.forward(&x)).expect("a capture after the failed ones");
    graph.replay().expect("its replay");
    assert_bits_eq("forward after failed captures", &got.to_bytes(&dev).unwrap(), &want.to_bytes(&dev).unwrap());
    // copy_from checks shapes and dtypes.
    assert!(matches!(x.copy_from(&x2), Err(Error::Shape { .. })));
}
