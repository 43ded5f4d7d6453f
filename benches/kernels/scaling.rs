//! Family 7: the bulk delayed-scaling update of 1000 tensors × history 1024 in one launch.

use crate::harness::{Bench, Target};
use te_codegen::spec::AmaxComputeAlgo;
use te_runtime::ops::scaling;

pub fn run(b: &mut Bench) {
    if !b.enabled("scaling") {
        return;
    }
    let dev = b.dev().clone();
    let (n, len) = (1000usize, 1024usize);
    let s = dev.stream();
    let hist: Vec<f32> = (0..n * len).map(|i| ((i * 7919) % 1000) as f32 * 0.01 + 0.01).collect();
    // A fresh history per launch: after a roll the newest amax is 0 and the next update would
    // skip the roll, so reusing one buffer would time the cheaper path.
    let (warmup, iters) = (5, 100);
    let mut hs: Vec<_> = (0..warmup + iters).map(|_| s.clone_htod(&hist).unwrap()).collect();
    let mut sc = s.clone_htod(&vec![1.0f32; n]).unwrap();
    let mut si = s.alloc_zeros::<f32>(n).unwrap();
    let st = b.time(warmup, iters, |i| {
        scaling::delayed_scaling_update(&dev, &mut hs[i], &mut sc, &mut si, len, AmaxComputeAlgo::Max, 448.0, 0.0)
            .unwrap()
    });
    b.record(
        "delayed scaling update (max), one launch",
        "1000 x 1024",
        st,
        Some(2 * (n * len * 4) as u64),
        Some(Target::MaxMicros(20.0)),
    );
}
