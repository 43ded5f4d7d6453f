//! Family 7 on the GPU: the bulk delayed-scaling update and current scaling, bit-exact against
//! the reference, amax edge cases included (0, tiny, normal, inf, NaN).

use crate::common::{device, randn};
use te_codegen::spec::AmaxComputeAlgo;
use te_runtime::ops::scaling;
use te_runtime::reference::scaling as reference;
use te_runtime::Error;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn delayed_update_matches_reference_with_edge_cases() {
    let Some(dev) = device() else { return };
    for &(n, len) in &[(1usize, 1usize), (7, 5), (300, 1024), (33, 1500)] {
        for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
            let mut hist: Vec<f32> = randn(n as u64 * 31 + len as u64, n * len, 10.0).iter().map(|v| v.abs()).collect();
            // Tensor t gets an edge case in its newest slot (and t % 5 == 4 one inside).
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
            let old_scale: Vec<f32> = (0..n).map(|t| 1.0 + t as f32).collect();
            let s = dev.stream();
            let mut h_d = s.clone_htod(&hist).unwrap();
            let mut scale_d = s.clone_htod(&old_scale).unwrap();
            let mut scale_inv_d = s.alloc_zeros::<f32>(n).unwrap();
            scaling::delayed_scaling_update(&dev, &mut h_d, &mut scale_d, &mut scale_inv_d, len, algo, 448.0, 1.0)
                .unwrap();
            let (mut h, mut sc, mut si) = (hist.clone(), old_scale.clone(), vec![0.0; n]);
            reference::delayed_update(&mut h, &mut sc, &mut si, len, algo, reference::scaled_max(448.0, 1.0));
            let what = format!("n={n} len={len} {algo:?}");
            assert_eq!(bits(&s.clone_dtoh(&h_d).unwrap()), bits(&h), "{what}: history");
            let got_scale = s.clone_dtoh(&scale_d).unwrap();
            assert_eq!(bits(&got_scale), bits(&sc), "{what}: scale");
            assert_eq!(bits(&s.clone_dtoh(&scale_inv_d).unwrap()), bits(&si), "{what}: scale_inv");
            assert!(got_scale.iter().all(|v| v.is_finite() && *v > 0.0), "{what}: no NaN/inf/zero scale");
        }
    }
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
    let mut h = s.alloc_zeros::<f32>(10).unwrap();
    let mut sc = s.alloc_zeros::<f32>(3).unwrap();
    let mut si = s.alloc_zeros::<f32>(3).unwrap();
    let e = scaling::delayed_scaling_update(&dev, &mut h, &mut sc, &mut si, 4, AmaxComputeAlgo::Max, 448.0, 0.0)
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[3, 4]"), "{e}");
}
