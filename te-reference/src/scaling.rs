//! Family 7 reference: delayed-scaling update and current-scaling scales, with TE's rules
//! (`common/recipe/delayed_scaling.cu`, `common/recipe/current_scaling.cu`).

use te_codegen::spec::AmaxComputeAlgo;

/// The host twin of [`te_runtime::ops::scaling::ScalingGroup`]: `n` slots sharing a format and margin.
#[derive(Debug)]
pub struct HostScalingGroup<'a> {
    /// `[n, history_len]` tensor-major, `[t][0]` the newest amax.
    pub amax_history: &'a mut [f32],
    /// `[n]`.
    pub scale: &'a mut [f32],
    /// `[n]`.
    pub scale_inv: &'a mut [f32],
    /// Entries per history row.
    pub history_len: usize,
    /// Largest finite value of the group's FP8 format.
    pub fp8_max: f32,
    /// Scales are divided by `2^margin`.
    pub margin: f32,
}

/// Delayed-scaling update of every slot of every group, in place, with the rules of
/// [`te_codegen::spec::ScalingKind::DelayedUpdate`] and `scaled_max = `[`scaled_max`]`(fp8_max,
/// margin)` per group. No validation: sizes must agree (`[n, history_len]`, `[n]`, `[n]`).
pub fn delayed_update(groups: &mut [HostScalingGroup<'_>], algo: AmaxComputeAlgo) {
    for g in groups.iter_mut() {
        let scaled_max = scaled_max(g.fp8_max, g.margin);
        let rows = g.amax_history.chunks_exact_mut(g.history_len);
        for ((h, scale), scale_inv) in rows.zip(g.scale.iter_mut()).zip(g.scale_inv.iter_mut()) {
            let last = h[0];
            let amax = match algo {
                AmaxComputeAlgo::MostRecent => last,
                AmaxComputeAlgo::Max => h.iter().fold(0.0f32, |a, &v| a.max(v)),
            };
            if last != 0.0 {
                h.rotate_left(1);
                // A non-finite newest amax keeps this update's scale (below) but enters the
                // history as 0 (TE keeps it, freezing the scale for the history's length).
                let n = h.len();
                h[n - 1] = if last.is_finite() { last } else { 0.0 };
                h[0] = 0.0;
            }
            if amax.is_finite() && amax > 0.0 {
                *scale = scaled_max / amax;
            }
            if scale.is_infinite() {
                *scale = f32::MAX;
            }
            *scale_inv = 1.0 / *scale;
        }
    }
}

/// `scaled_max` of a format and margin: `fp8_max * 2^-margin`.
pub fn scaled_max(fp8_max: f32, margin: f32) -> f32 {
    fp8_max * (-margin).exp2()
}

/// Current-scaling `(scale, scale_inv)` of one tensor from its `amax` (an infinite scale
/// becomes `f32::MAX`).
pub fn current_scale(amax: f32, fp8_max: f32, amax_epsilon: f32, power_2_scale: bool) -> (f32, f32) {
    let s = scale_from_amax(amax, fp8_max, amax_epsilon, power_2_scale, f32::MAX);
    (s, 1.0 / s)
}

/// TE's `compute_scale_from_amax` (`common/recipe/recipe_common.cuh`), the scale of current and
/// block scaling: `amax` floored at `epsilon`; 1 when it is 0, infinite or NaN; else `fp8_max /
/// amax` rounded to nearest, `value_for_inf` when that overflows (`f32::MAX` for current
/// scaling, the input type's largest finite value for block scaling), then with `power_2` only
/// its exponent bits kept (rounded down to a power of 2).
pub fn scale_from_amax(amax: f32, fp8_max: f32, epsilon: f32, power_2: bool, value_for_inf: f32) -> f32 {
    let a = if amax < epsilon { epsilon } else { amax };
    if !(a > 0.0 && a.is_finite()) {
        return 1.0;
    }
    let mut s = fp8_max / a;
    if s.is_infinite() {
        s = value_for_inf;
    }
    if power_2 {
        s = f32::from_bits(s.to_bits() & 0xff80_0000);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(hist: &[f32], old_scale: f32, algo: AmaxComputeAlgo) -> (Vec<f32>, f32, f32) {
        let mut h = hist.to_vec();
        let (mut s, mut si) = ([old_scale], [0.0]);
        let g = HostScalingGroup {
            amax_history: &mut h,
            scale: &mut s,
            scale_inv: &mut si,
            history_len: hist.len(),
            fp8_max: 448.0,
            margin: 0.0,
        };
        delayed_update(&mut [g], algo);
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
        // ... and a non-finite newest amax is rolled in as 0, so the next update uses the rest.
        let (h, s, _) = run(&[f32::INFINITY, 2.0, 1.0], 3.0, AmaxComputeAlgo::Max);
        assert_eq!((h.clone(), s), (vec![0.0, 1.0, 0.0], 3.0));
        assert_eq!(run(&[0.5, 1.0, 0.0], s, AmaxComputeAlgo::Max).1, 448.0);
        assert_eq!(run(&[f32::NAN, 2.0, 1.0], 3.0, AmaxComputeAlgo::Max).0, vec![0.0, 1.0, 0.0]);
        assert_eq!(run(&[f32::INFINITY], 3.0, AmaxComputeAlgo::MostRecent), (vec![0.0], 3.0, 1.0 / 3.0));
        assert_eq!(run(&[f32::NAN, 0.0], 3.0, AmaxComputeAlgo::MostRecent).1, 3.0);
        assert_eq!(run(&[0.0, 2.0, 5.0], 3.0, AmaxComputeAlgo::Max).0, vec![0.0, 2.0, 5.0]);
        // A tiny amax overflows the scale to inf, which becomes FLT_MAX (never inf or NaN).
        let (_, s, si) = run(&[1e-45, 0.0], 1.0, AmaxComputeAlgo::Max);
        assert_eq!(s, f32::MAX);
        assert!(si > 0.0 && si.is_finite());
        assert_eq!(scaled_max(448.0, 2.0), 112.0);
    }

    #[test]
    fn groups_use_their_own_length_format_and_margin() {
        // Group 0: 2 slots × len 3, E4M3, margin 1; group 1: 1 slot × len 2, E5M2, margin 0.
        let (mut h0, mut s0, mut si0) = (vec![1.0, 2.0, 4.0, 0.0, 0.0, 0.0], vec![1.0; 2], vec![0.0; 2]);
        let (mut h1, mut s1, mut si1) = (vec![8.0, 2.0], vec![5.0], vec![0.0]);
        let mut groups = [
            HostScalingGroup {
                amax_history: &mut h0,
                scale: &mut s0,
                scale_inv: &mut si0,
                history_len: 3,
                fp8_max: 448.0,
                margin: 1.0,
            },
            HostScalingGroup {
                amax_history: &mut h1,
                scale: &mut s1,
                scale_inv: &mut si1,
                history_len: 2,
                fp8_max: 57344.0,
                margin: 0.0,
            },
        ];
        delayed_update(&mut groups, AmaxComputeAlgo::Max);
        assert_eq!((h0, s0, si0), (vec![0.0, 4.0, 1.0, 0.0, 0.0, 0.0], vec![56.0, 1.0], vec![1.0 / 56.0, 1.0]));
        assert_eq!((h1, s1, si1), (vec![0.0, 8.0], vec![7168.0], vec![1.0 / 7168.0]));
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
