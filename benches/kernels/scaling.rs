//! Family 7: the bulk delayed-scaling update of 1000 tensor slots × history 1024 in one launch,
//! built as 200 groups of 5 slots (200 modules, each owning its buffers): the whole call, the
//! launch of a pre-built slot table, the table build + upload alone, and the host time of the
//! call while the stream is busy (whether the table upload waits for the stream).

use crate::harness::{Bench, Stats, Target};
use cudarc::driver::CudaSlice;
use te_codegen::spec::AmaxComputeAlgo;
use te_runtime::ops::scaling::{self, DelayedScalingTable, ScalingGroup};

const GROUPS: usize = 200;
const SLOTS: usize = 5;
const LEN: usize = 1024;

/// The buffers of one module: history `[SLOTS, LEN]`, scale and scale_inv `[SLOTS]`.
type Module = (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>);

fn groups(modules: &mut [Module]) -> Vec<ScalingGroup<'_>> {
    modules
        .iter_mut()
        .map(|(h, sc, si)| ScalingGroup {
            amax_history: h,
            scale: sc,
            scale_inv: si,
            history_len: LEN,
            fp8_max: 448.0,
            margin: 0.0,
        })
        .collect()
}

pub fn run(b: &mut Bench) {
    if !b.enabled("scaling") {
        return;
    }
    let dev = b.dev().clone();
    let s = dev.stream();
    let (algo, shape) = (AmaxComputeAlgo::Max, format!("{GROUPS} groups x {SLOTS} x {LEN}"));
    let bytes = Some(2 * (GROUPS * SLOTS * LEN * 4) as u64);
    let hist: Vec<f32> = (0..SLOTS * LEN).map(|i| ((i * 7919) % 1000) as f32 * 0.01 + 0.01).collect();
    // Fresh histories per launch: after a roll the newest amax is 0 and the next update would
    // skip the roll, so reusing one set of buffers would time the cheaper path.
    let (warmup, iters) = (5, 100);
    let mut states: Vec<Vec<Module>> = (0..warmup + iters)
        .map(|_| {
            (0..GROUPS)
                .map(|_| {
                    let h = s.clone_htod(&hist).unwrap();
                    (h, s.clone_htod(&[1.0f32; SLOTS]).unwrap(), s.alloc_zeros::<f32>(SLOTS).unwrap())
                })
                .collect()
        })
        .collect();

    // The whole call: host table build, upload, launch, stream-ordered free.
    let st =
        b.time(warmup, iters, |i| scaling::delayed_scaling_update(&dev, &mut groups(&mut states[i]), algo).unwrap());
    b.record("delayed scaling update (max), one launch", &shape, st, bytes, Some(Target::MaxMicros(20.0)));

    // The launch alone, tables built and uploaded beforehand.
    for (h, _, _) in states.iter_mut().flatten() {
        s.memcpy_htod(&hist, h).unwrap();
    }
    let mut all_groups: Vec<_> = states.iter_mut().map(|m| groups(m)).collect();
    let mut tables: Vec<_> = all_groups.iter_mut().map(|g| DelayedScalingTable::new(&dev, g).unwrap()).collect();
    let st = b.time(warmup, iters, |i| tables[i].launch(algo).unwrap());
    b.record("  launch of a pre-built slot table", &shape, st, bytes, None);
    drop(tables);
    drop(all_groups);

    // The table build + upload alone (nothing launched; the free is stream-ordered).
    let st = b.time(warmup, iters, |_| drop(DelayedScalingTable::new(&dev, &mut groups(&mut states[0])).unwrap()));
    b.record("  slot table build + upload", &format!("{} slots", GROUPS * SLOTS), st, None, None);

    // Host time of the whole call queued behind a 1 GiB copy: about the call's own host cost
    // when the upload does not wait for the stream, about the copy's time (the "device copy"
    // row) when it does. The histories were rolled already; only the host time counts here.
    let n = 1usize << 30;
    let src = s.alloc_zeros::<u8>(n).unwrap();
    let mut dst = s.alloc_zeros::<u8>(n).unwrap();
    let host_us: Vec<f64> = (0..20)
        .map(|i| {
            s.synchronize().unwrap();
            s.memcpy_dtod(&src, &mut dst).unwrap();
            let t = std::time::Instant::now();
            scaling::delayed_scaling_update(&dev, &mut groups(&mut states[i]), algo).unwrap();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    s.synchronize().unwrap();
    b.record("  host µs of the call behind a 1 GiB copy", &shape, Stats::from_samples(host_us), None, None);
}
