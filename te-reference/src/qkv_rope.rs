//! Family 20 reference: the fused attention input of a step (`ops::qkv_rope`), mirroring
//! `te-codegen/templates/qkv_rope.cu.tera`: per head row, the optional RMSNorm (`x · rsqrt(mean(x²)
//! + eps) · γ'` rounded to the dtype), then RoPE with `θ = p · inv_freq` (one f32 product),
//! `fma(x, cos, round(±x' · sin))`, rounded to the dtype; v copied. The kernel's sum of squares
//! is a warp tree and its `sincosf` within 2 ulps of the host's `sin_cos`, so outputs agree
//! within a few f32 ulps before the final rounding (see `tests/gpu/qkv_rope.rs`).

use te_codegen::DType;
use te_runtime::numerics::round_to;

/// The norm of [`qkv_rope`]: `q_gamma`, `k_gamma` (`[d]`, as stored), eps, zero-centered gamma.
pub type QkNormRef<'a> = (&'a [f32], &'a [f32], f32, bool);

/// What `ops::qkv_rope::qkv_rope` writes, for `qkv: [tokens, (heads + 2·groups)·d]` (values of
/// `dtype`, widened), `inv_freq: [d / 2]`, per-token `positions` and cache `rows`: returns `q_out`
/// `[tokens, heads, d]` and writes the tokens' keys and values into `k_cache`, `v_cache`
/// (`[cache_rows, groups, d]`), all rounded to `dtype`.
///
/// # Panics
/// If the lengths do not match the shapes (caller bugs).
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope(
    qkv: &[f32],
    (heads, groups, d): (usize, usize, usize),
    norm: Option<QkNormRef<'_>>,
    inv_freq: &[f32],
    positions: &[i32],
    rows: &[i32],
    dtype: DType,
    [k_cache, v_cache]: [&mut [f32]; 2],
) -> Vec<f32> {
    let per = heads + 2 * groups;
    let tokens = positions.len();
    assert_eq!(qkv.len(), tokens * per * d, "qkv is not [{tokens}, {}]", per * d);
    assert_eq!(inv_freq.len(), d / 2);
    let half = d / 2;
    let mut q_out = vec![0.0; tokens * heads * d];
    for t in 0..tokens {
        let p = positions[t] as f32;
        let row = rows[t] as usize;
        for r in 0..per {
            let x = &qkv[(t * per + r) * d..(t * per + r + 1) * d];
            if r >= heads + groups {
                let at = (row * groups + r - heads - groups) * d;
                v_cache[at..at + d].copy_from_slice(x);
                continue;
            }
            let mut f = x.to_vec();
            if let Some((qg, kg, eps, zc)) = norm {
                let ss: f32 = f.iter().map(|v| v * v).sum();
                let rs = 1.0 / (ss / d as f32 + eps).sqrt();
                let g = if r < heads { qg } else { kg };
                for (v, &w) in f.iter_mut().zip(g) {
                    let w = if zc { 1.0 + w } else { w };
                    *v = round_to(dtype, (*v * rs) * w);
                }
            }
            let out = if r < heads {
                &mut q_out[(t * heads + r) * d..(t * heads + r + 1) * d]
            } else {
                let at = (row * groups + r - heads) * d;
                &mut k_cache[at..at + d]
            };
            for c in 0..d {
                let i = if c < half { c } else { c - half };
                let (s, co) = (p * inv_freq[i]).sin_cos();
                let y = if c < half { f[c].mul_add(co, -f[c + half] * s) } else { f[c].mul_add(co, f[c - half] * s) };
                out[c] = round_to(dtype, y);
            }
        }
    }
    q_out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn position_zero_is_the_identity_and_rows_place_keys_and_values() {
        // One token at position 0: no rotation; 2 heads, 1 group, d 4.
        let (h, g, d) = (2, 1, 4);
        let qkv: Vec<f32> = (0..(h + 2 * g) * d).map(|i| i as f32).collect();
        let (mut k, mut v) = (vec![0.0; 3 * g * d], vec![0.0; 3 * g * d]);
        let q = qkv_rope(&qkv, (h, g, d), None, &[1.0, 0.5], &[0], &[2], DType::F32, [&mut k, &mut v]);
        assert_eq!(q, qkv[..8]);
        assert_eq!(k[8..], qkv[8..12]);
        assert_eq!(v[8..], qkv[12..16]);
        assert!(k[..8].iter().chain(&v[..8]).all(|&x| x == 0.0));
        // Position 1 with inv_freq 1: channel pair (0, 2) rotates by 1 rad.
        let q = qkv_rope(&qkv, (h, g, d), None, &[1.0, 0.0], &[1], &[0], DType::F32, [&mut k, &mut v]);
        let (s, c) = 1f32.sin_cos();
        assert!((q[0] - (0.0 * c - 2.0 * s)).abs() < 1e-6 && (q[2] - (2.0 * c + 0.0 * s)).abs() < 1e-6);
        assert_eq!((q[1], q[3]), (1.0, 3.0), "a zero frequency leaves its pair");
        // The norm makes each head's mean square 1 (γ = 1 as 1 + 0).
        let zeros = [0.0; 4];
        let q = qkv_rope(
            &qkv,
            (h, g, d),
            Some((&zeros, &zeros, 0.0, true)),
            &[0.0, 0.0],
            &[5],
            &[0],
            DType::F32,
            [&mut k, &mut v],
        );
        for head in q.chunks(d) {
            let ms: f32 = head.iter().map(|x| x * x).sum::<f32>() / d as f32;
            assert!((ms - 1.0).abs() < 1e-5);
        }
    }
}
