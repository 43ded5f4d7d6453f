//! Family 7 reference: delayed-scaling update and current-scaling scales, with TE's rules
//! (`common/recipe/delayed_scaling.cu`, `common/recipe/current_scaling.cu`).

use te_codegen::spec::AmaxComputeAlgo;

/// Delayed-scaling update of `n` tensors in place.
///
/// `amax_history`: `[n, len]` tensor-major (`history[0]` newest); `scale`, `scale_inv`: `[n]`.
/// `scaled_max = fp8_max / 2^margin`. See [`te_codegen::spec::ScalingKind::DelayedUpdate`].
pub fn delayed_update(
    amax_history: &mut [f32],
    scale: &mut [f32],
    scale_inv: &mut [f32],
    len: usize,
    algo: AmaxComputeAlgo,
    scaled_max: f32,
) {
    for (t, h) in amax_history.chunks_exact_mut(len).enumerate() {
        let last = h[0];
        let amax = match algo {
            AmaxComputeAlgo::MostRecent => last,
            AmaxComputeAlgo::Max => h.iter().fold(0.0f32, |a, &v| a.max(v)),
        };
        if last != 0.0 {
            h.rotate_left(1);
            h[0] = 0.0;
        }
        let mut s = scale[t];
        if amax.is_finite() && amax > 0.0 {
            s = scaled_max / amax;
        }
        if s.is_infinite() {
            s = f32::MAX;
        }
        scale[t] = s;
        scale_inv[t] = 1.0 / s;
    }
}

/// `scaled_max` of a format and margin: `fp8_max * 2^-margin`.
pub fn scaled_max(fp8_max: f32, margin: f32) -> f32 {
    fp8_max * (-margin).exp2()
}

/// Current-scaling `(scale, scale_inv)` of one tensor from its `amax`.
pub fn current_scale(amax: f32, fp8_max: f32, amax_epsilon: f32, power_2_scale: bool) -> (f32, f32) {
    let a = if amax < amax_epsilon { amax_epsilon } else { amax };
    let mut s = 1.0f32;
    if a > 0.0 && a.is_finite() {
        s = fp8_max / a;
        if s.is_infinite() {
            s = f32::MAX;
        }
        if power_2_scale {
            s = f32::from_bits(s.to_bits() & 0xff80_0000);
        }
    }
    (s, 1.0 / s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(hist: &[f32], old_scale: f32, algo: AmaxComputeAlgo) -> (Vec<f32>, f32, f32) {
        let mut h = hist.to_vec();
        let (mut s, mut si) = ([old_scale], [0.0]);
        delayed_update(&mut h, &mut s, &mut si, hist.len(), algo, 448.0);
        (h, s[0], si[0])
    }

    #[test]
    fn delayed_rules() {
        // Max over the history, then roll: new[i] = old[i+1], new[last] = old[0], new[0] = 0.
        let (h, s, si) = run(&[2.0, 8.0, 4.0, 1.0], 1.0, AmaxComputeAlgo::Max);
        assert_eq!(h, vec![0.0, 4.0, 1.0, 2.0]);
        assert_eq!((s, si), (56.0, 1.0 / 56.0));
        let (_, s, _) = run(&[2.0, 8.0, 4.0, 1.0], 1.0, AmaxComputeAlgo::MostRecent);
        assert_eq!(s, 224.0);
        // amax 0, inf or NaN keeps the old scale; a zero newest amax skips the roll.
        let (h, s, _) = run(&[0.0, 0.0, 0.0], 3.0, AmaxComputeAlgo::Max);
        assert_eq!((h, s), (vec![0.0, 0.0, 0.0], 3.0));
        assert_eq!(run(&[f32::INFINITY, 1.0], 3.0, AmaxComputeAlgo::Max).1, 3.0);
        assert_eq!(run(&[f32::NAN, 0.0], 3.0, AmaxComputeAlgo::MostRecent).1, 3.0);
        assert_eq!(run(&[0.0, 2.0, 5.0], 3.0, AmaxComputeAlgo::Max).0, vec![0.0, 2.0, 5.0]);
        // A tiny amax overflows the scale to inf, which becomes FLT_MAX (never inf or NaN).
        let (_, s, si) = run(&[1e-45, 0.0], 1.0, AmaxComputeAlgo::Max);
        assert_eq!(s, f32::MAX);
        assert!(si > 0.0 && si.is_finite());
        assert_eq!(scaled_max(448.0, 2.0), 112.0);
    }

    #[test]
    fn current_rules() {
        assert_eq!(current_scale(2.0, 448.0, 0.0, false).0, 224.0);
        assert_eq!(current_scale(3.0, 448.0, 0.0, true).0, 128.0);
        for bad in [0.0, f32::INFINITY, f32::NAN] {
            assert_eq!(current_scale(bad, 448.0, 0.0, false), (1.0, 1.0));
        }
        assert_eq!(current_scale(0.0, 448.0, 4.0, false).0, 112.0);
        assert_eq!(current_scale(1e-45, 57344.0, 0.0, false).0, f32::MAX);
    }
}
