//! Family 7 on the GPU: the bulk delayed-scaling update (one group, many groups of different
//! lengths, formats and margins in one launch, repeated launches of one table) and current
//! scaling, bit-exact against the reference, amax edge cases included (0, tiny, normal, inf, NaN).

use crate::common::{device, randn};
use te_codegen::spec::AmaxComputeAlgo;
use te_reference::scaling::{self as reference, HostScalingGroup};
use te_runtime::ops::scaling::{self, DelayedScalingTable, ScalingGroup};
use te_runtime::{Device, Error};

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Host state of one scaling group: `n` slots × `len`, with amax edge cases.
struct Group {
    n: usize,
    len: usize,
    fp8_max: f32,
    margin: f32,
    hist: Vec<f32>,
    scale: Vec<f32>,
}

/// Slot `t` gets an edge case (0, tiny, normal, inf, NaN) as its newest amax, every 5th slot an
/// inf inside its history, and every 7th an all-zero history; old scales are `1 + t`.
fn group(seed: u64, n: usize, len: usize, fp8_max: f32, margin: f32) -> Group {
    let mut hist: Vec<f32> = randn(seed, n * len, 10.0).iter().map(|v| v.abs()).collect();
    let edge = [0.0, 1e-45, 3.0, f32::INFINITY, f32::NAN];
    for t in 0..n {
        hist[t * len] = edge[t % edge.len()];
        if t % 5 == 4 && len > 2 {
            hist[t * len + 2] = f32::INFINITY;
        }
        if t % 7 == 6 {
            hist[t * len..(t + 1) * len].fill(0.0);
        }
    }
    Group { n, len, fp8_max, margin, hist, scale: (0..n).map(|t| 1.0 + t as f32).collect() }
}

/// Runs `steps` updates of all `groups` in one table (one launch each; `steps == 1` through
/// `delayed_scaling_update`) and checks history, scale and scale_inv bit-exact against the
/// reference.
fn check(dev: &Device, groups: &[Group], algo: AmaxComputeAlgo, steps: usize, what: &str) {
    let s = dev.stream();
    let mut bufs: Vec<_> = groups
        .iter()
        .map(|g| (s.clone_htod(&g.hist).unwrap(), s.clone_htod(&g.scale).unwrap(), s.alloc_zeros::<f32>(g.n).unwrap()))
        .collect();
    let mut dev_groups: Vec<_> = bufs
        .iter_mut()
        .zip(groups)
        .map(|((h, sc, si), g)| ScalingGroup {
            amax_history: h,
            scale: sc,
            scale_inv: si,
            history_len: g.len,
            fp8_max: g.fp8_max,
            margin: g.margin,
        })
        .collect();
    if steps == 1 {
        scaling::delayed_scaling_update(dev, &mut dev_groups, algo).unwrap();
    } else {
        let mut table = DelayedScalingTable::new(dev, &mut dev_groups).unwrap();
        assert_eq!(table.n_slots(), groups.iter().map(|g| g.n).sum::<usize>());
        for _ in 0..steps {
            table.launch(algo).unwrap();
        }
    }
    let mut want: Vec<_> = groups.iter().map(|g| (g.hist.clone(), g.scale.clone(), vec![0.0; g.n])).collect();
    let mut host_groups: Vec<_> = want
        .iter_mut()
        .zip(groups)
        .map(|((h, sc, si), g)| HostScalingGroup {
            amax_history: h,
            scale: sc,
            scale_inv: si,
            history_len: g.len,
            fp8_max: g.fp8_max,
            margin: g.margin,
        })
        .collect();
    for _ in 0..steps {
        reference::delayed_update(&mut host_groups, algo);
    }
    for (i, ((h, sc, si), (wh, wsc, wsi))) in bufs.iter().zip(&want).enumerate() {
        let g = &groups[i];
        let what = format!("{what}, group {i} ({} x {}, max {}, margin {}) {algo:?}", g.n, g.len, g.fp8_max, g.margin);
        assert_eq!(bits(&s.clone_dtoh(h).unwrap()), bits(wh), "{what}: history");
        let got_scale = s.clone_dtoh(sc).unwrap();
        assert_eq!(bits(&got_scale), bits(wsc), "{what}: scale");
        assert_eq!(bits(&s.clone_dtoh(si).unwrap()), bits(wsi), "{what}: scale_inv");
        assert!(got_scale.iter().all(|v| v.is_finite() && *v > 0.0), "{what}: no NaN/inf/zero scale");
    }
}

#[test]
fn delayed_update_matches_reference_with_edge_cases() {
    let Some(dev) = device() else { return };
    for &(n, len) in &[(1usize, 1usize), (7, 5), (300, 1024), (33, 1500)] {
        for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
            check(&dev, &[group(n as u64 * 31 + len as u64, n, len, 448.0, 1.0)], algo, 1, "one group");
        }
    }
}

#[test]
fn delayed_update_of_many_groups_in_one_launch() {
    let Some(dev) = device() else { return };
    // Forward (E4M3) and backward (E5M2) groups of several modules with different history
    // lengths and margins, one launch for all of them.
    let shapes = [
        (3usize, 1024usize, 448.0f32, 0.0f32),
        (2, 1024, 57344.0, 0.0),
        (5, 16, 448.0, 2.0),
        (1, 1, 57344.0, 1.0),
        (40, 300, 448.0, 0.5),
        (7, 1500, 57344.0, 3.0),
        (11, 257, 448.0, -1.0),
    ];
    let groups: Vec<Group> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(n, len, max, margin))| group(i as u64 + 100, n, len, max, margin))
        .collect();
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        check(&dev, &groups, algo, 1, "mixed groups");
        check(&dev, &groups, algo, 3, "mixed groups, 3 launches of one table");
    }
    // 200 modules of 5 slots (3 forward E4M3 + 2 backward E5M2), history 1024, as in the bench.
    let modules: Vec<Group> = (0..200u64)
        .flat_map(|m| [group(2 * m, 3, 1024, 448.0, 0.0), group(2 * m + 1, 2, 1024, 57344.0, 0.0)])
        .collect();
    check(&dev, &modules, AmaxComputeAlgo::Max, 1, "200 modules");
}

#[test]
fn current_scaling_matches_reference_with_edge_cases() {
    let Some(dev) = device() else { return };
    let mut amax: Vec<f32> = randn(5, 1000, 3.0).iter().map(|v| v.abs()).collect();
    amax[..6].copy_from_slice(&[0.0, 1e-45, f32::INFINITY, f32::NAN, 448.0, 1e-3]);
    for (fp8_max, eps, p2) in [(448.0, 0.0, false), (57344.0, 0.0, true), (448.0, 1e-2, false)] {
        let s = dev.stream();
        let a_d = s.clone_htod(&amax).unwrap();
        let mut sc_d = s.alloc_zeros::<f32>(amax.len()).unwrap();
        let mut si_d = s.alloc_zeros::<f32>(amax.len()).unwrap();
        scaling::current_scaling(&dev, &a_d, &mut sc_d, &mut si_d, fp8_max, eps, p2).unwrap();
        let (want_s, want_si): (Vec<f32>, Vec<f32>) =
            amax.iter().map(|&a| reference::current_scale(a, fp8_max, eps, p2)).unzip();
        assert_eq!(bits(&s.clone_dtoh(&sc_d).unwrap()), bits(&want_s), "scale, max {fp8_max} eps {eps} pow2 {p2}");
        assert_eq!(bits(&s.clone_dtoh(&si_d).unwrap()), bits(&want_si), "scale_inv");
    }
}

#[test]
fn mismatched_buffers_are_shape_errors() {
    let Some(dev) = device() else { return };
    let s = dev.stream();
    let (mut h0, mut sc0, mut si0) =
        (s.alloc_zeros::<f32>(8).unwrap(), s.alloc_zeros(2).unwrap(), s.alloc_zeros(2).unwrap());
    let (mut h1, mut sc1, mut si1) =
        (s.alloc_zeros::<f32>(10).unwrap(), s.alloc_zeros(3).unwrap(), s.alloc_zeros(3).unwrap());
    let mut groups = [
        ScalingGroup {
            amax_history: &mut h0,
            scale: &mut sc0,
            scale_inv: &mut si0,
            history_len: 4,
            fp8_max: 448.0,
            margin: 0.0,
        },
        ScalingGroup {
            amax_history: &mut h1,
            scale: &mut sc1,
            scale_inv: &mut si1,
            history_len: 4,
            fp8_max: 448.0,
            margin: 0.0,
        },
    ];
    let e = scaling::delayed_scaling_update(&dev, &mut groups, AmaxComputeAlgo::Max).unwrap_err();
    assert!(
        matches!(e, Error::Shape { .. })
            && e.to_string().contains("group 1: amax_history must be [n, history_len] = [3, 4]"),
        "{e}"
    );
    let e = scaling::delayed_scaling_update(&dev, &mut [], AmaxComputeAlgo::Max).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}
