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

/// The rule a failed capture names.
fn rule(what: &str, e: Error) -> CaptureRule {
    match e {
        Error::Capture { rule, .. } => rule,
        other => panic!("{what}: expected a capture error, got {other}"),
    }
}

/// After a failed capture the device runs eager work, captures again and replays: the replay
/// gives the eager bits.
fn works_on(dev: &std::sync::Arc<te_runtime::Device>, m: &mut LayerNormMLP, x: &Tensor, after: &str) {
    let (want, _) = m.forward(x).unwrap_or_else(|e| panic!("an eager forward after {after}: {e}"));
    let (graph, (got, _)) =
        Graph::capture(dev, || m.forward(x)).unwrap_or_else(|e| panic!("a capture after {after}: {e}"));
    graph.replay().unwrap_or_else(|e| panic!("its replay after {after}: {e}"));
    let got = got.to_bytes(dev).unwrap_or_else(|e| panic!("reading the replay's output after {after}: {e}"));
    assert_bits_eq(&format!("forward after {after}"), &got, &want.to_bytes(dev).unwrap());
}

/// Each kind of broken capture is a typed error naming its rule, and after each the device works
/// on: an eager step, a new capture and its replay.
#[test]
fn a_capture_that_breaks_a_rule_names_it_and_the_device_works_on() {
    let Some(dev) = device() else { return };
    let x = Tensor::from_f32(&dev, DType::BF16, &[T, H], &randn(3, T * H, 1.0)).unwrap();
    // Never run before: its kernels are not loaded, its GEMMs not chosen.
    let mut fresh = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, 3 * H)).unwrap();
    let e = Graph::capture(&dev, || fresh.forward(&x)).map(|_| ()).unwrap_err();
    let r = rule("a module never run", e);
    assert!(matches!(r, CaptureRule::KernelsLoadedBefore | CaptureRule::GemmAlgorithmsChosenBefore), "{r:?}");
    works_on(&dev, &mut fresh, &x, "a capture of a module never run");
    // A GEMM shape not met before, its kernels loaded: the module ran at another size.
    let x2 = Tensor::from_f32(&dev, DType::BF16, &[2 * T, H], &randn(4, 2 * T * H, 1.0)).unwrap();
    let e = Graph::capture(&dev, || fresh.forward(&x2)).map(|_| ()).unwrap_err();
    assert_eq!(rule("a new GEMM shape", e), CaptureRule::GemmAlgorithmsChosenBefore);
    works_on(&dev, &mut fresh, &x, "a capture of a new GEMM shape");
    // A host read.
    let e = Graph::capture(&dev, || fresh.forward(&x)?.0.to_f32(&dev)).map(|_| ()).unwrap_err();
    assert_eq!(rule("a host read", e), CaptureRule::NoHostTransfers);
    works_on(&dev, &mut fresh, &x, "a capture with a host read");
    // A capture inside a capture.
    let e = Graph::capture(&dev, || Graph::capture(&dev, || Ok(())).map(|_| ())).map(|_| ()).unwrap_err();
    assert_eq!(rule("a nested capture", e), CaptureRule::OneCaptureAtATime);
    works_on(&dev, &mut fresh, &x, "a nested capture");
    // copy_from checks shapes and dtypes.
    assert!(matches!(x.copy_from(&x2), Err(Error::Shape { .. })));
}

/// What a capture allocated may be dropped before the graph's first replay (when that memory does
/// not exist yet: the forward's context here), and a graph may be dropped without ever replaying,
/// before or after its outputs: the device works on.
#[test]
fn captured_buffers_dropped_before_the_first_replay_leave_the_device_working() {
    let Some(dev) = device() else { return };
    let x = Tensor::from_f32(&dev, DType::BF16, &[T, H], &randn(5, T * H, 1.0)).unwrap();
    let mut m = LayerNormMLP::new(&dev, LayerNormMLPConfig::new(H, 3 * H)).unwrap();
    let (want, _) = m.forward(&x).unwrap();
    let want = want.to_bytes(&dev).unwrap();
    // The output and the context both dropped before the replay.
    let (graph, out) = Graph::capture(&dev, || m.forward(&x)).unwrap();
    drop(out);
    graph.replay().unwrap();
    // Graphs never replayed: dropped before and after their outputs.
    let (graph, out) = Graph::capture(&dev, || m.forward(&x)).unwrap();
    drop(graph);
    drop(out);
    let (graph, out) = Graph::capture(&dev, || m.forward(&x)).unwrap();
    drop(out);
    drop(graph);
    let (y, _) = m.forward(&x).expect("an eager forward after the unlaunched graphs");
    assert_bits_eq("eager forward after the graphs", &y.to_bytes(&dev).unwrap(), &want);
    works_on(&dev, &mut m, &x, "graphs dropped unlaunched");
}
