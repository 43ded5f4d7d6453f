//! Family 5 reference: LayerNorm / RMSNorm forward and backward, mirroring the kernels of
//! `te-codegen/templates/norm_fwd.cu.tera` and `te-codegen/templates/norm_bwd.cu.tera` operation for operation.
//!
//! The kernels fix every rounding step (explicit `_rn` intrinsics, no FMA contraction) and every
//! summation order (thread `t` owns the `vec`-element vectors `t, t + threads, ...` of a row and
//! adds its elements in that order; block sums are a butterfly per warp, then a butterfly over
//! the warp sums). Given the same [`NormSpec`] (threads and vector width decide the order),
//! these functions reproduce mu, rsigma, FP8 codes and amax bit for bit; the GPU tests still
//! compare high-precision outputs with TE's tolerances.

use te_codegen::spec::{NormKind, NormSpec};
use te_runtime::numerics::{encode, quantize, round_to};

/// What the forward writes.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// `y: [rows, hidden]` encoded in `spec.output` (FP8: the codes of `y * scale`).
    pub y: Vec<u8>,
    /// `mu: [rows]` (LayerNorm; empty for RMSNorm).
    pub mu: Vec<f32>,
    /// `rsigma: [rows]`.
    pub rsigma: Vec<f32>,
    /// `max |y|` (f32, before scaling; NaN skipped) for an FP8 output, else 0.
    pub amax: f32,
    /// `1 / scale`.
    pub scale_inv: f32,
}

/// What the backward writes, widened to f32.
#[derive(Debug, Clone, PartialEq)]
pub struct Backward {
    /// `dx: [rows, hidden]`, rounded to `spec.output`.
    pub dx: Vec<f32>,
    /// `dgamma: [hidden]`, rounded to `spec.weight`.
    pub dgamma: Vec<f32>,
    /// `dbeta: [hidden]`, rounded to `spec.weight` (LayerNorm only).
    pub dbeta: Option<Vec<f32>>,
}

/// Butterfly sum over 32 lanes as `warp_sum` computes it (every lane ends with these bits).
fn warp_sum(mut v: [f32; 32]) -> f32 {
    for o in [16, 8, 4, 2, 1] {
        let p = v;
        for (i, x) in v.iter_mut().enumerate() {
            *x = p[i] + p[i ^ o];
        }
    }
    v[0]
}

/// The kernels' `block_allsum` of one value per thread.
fn block_sum(per_thread: &[f32]) -> f32 {
    let warps: Vec<f32> = per_thread
        .chunks(32)
        .map(|c| {
            let mut lanes = [0.0f32; 32];
            lanes[..c.len()].copy_from_slice(c);
            warp_sum(lanes)
        })
        .collect();
    if warps.len() == 1 {
        return warps[0];
    }
    let mut lanes = [0.0f32; 32];
    lanes[..warps.len()].copy_from_slice(&warps);
    warp_sum(lanes)
}

/// Column indices thread `t` owns, in the order it visits them.
fn owned(spec: &NormSpec, t: usize) -> impl Iterator<Item = usize> {
    let (vec, threads, nvec) = (spec.vec(), spec.threads, spec.hidden / spec.vec());
    (0..spec.iters())
        .map(move |i| i * threads + t)
        .filter(move |&vi| vi < nvec)
        .flat_map(move |vi| vi * vec..(vi + 1) * vec)
}

/// Per-thread fold of `f(acc, column)` from 0, then the block sum.
fn row_sum(spec: &NormSpec, f: impl Fn(f32, usize) -> f32) -> f32 {
    let per_thread: Vec<f32> = (0..spec.threads).map(|t| owned(spec, t).fold(0.0f32, &f)).collect();
    block_sum(&per_thread)
}

/// The effective gamma: `1 + gamma` when zero-centered.
fn effective_gamma(spec: &NormSpec, gamma: &[f32]) -> Vec<f32> {
    gamma.iter().map(|&g| if spec.zero_centered_gamma { g + 1.0 } else { g }).collect()
}

/// Forward of `x: [rows, hidden]` (values already rounded to `spec.input`), `gamma`/`beta:
/// [hidden]` (rounded to `spec.weight`; `beta` only for LayerNorm), with `scale` used when
/// `spec.output` is FP8.
///
/// # Panics
/// If the lengths disagree with `spec.hidden` or `beta` does not match the kind (caller bugs).
pub fn forward(spec: &NormSpec, x: &[f32], gamma: &[f32], beta: Option<&[f32]>, eps: f32, scale: f32) -> Forward {
    let h = spec.hidden;
    assert!(x.len() % h == 0 && gamma.len() == h, "reference norm forward: lengths");
    assert_eq!(beta.is_some(), spec.kind == NormKind::LayerNorm, "reference norm forward: beta");
    let g = effective_gamma(spec, gamma);
    let hf = h as f32;
    let fp8 = spec.output.is_fp8();
    let mut out = Forward { y: Vec::new(), mu: Vec::new(), rsigma: Vec::new(), amax: 0.0, scale_inv: 1.0 / scale };
    for row in x.chunks_exact(h) {
        let (mu, rs) = match spec.kind {
            NormKind::LayerNorm => {
                let mu = row_sum(spec, |a, c| a + row[c]) / hf;
                let var = row_sum(spec, |a, c| {
                    let d = row[c] - mu;
                    d.mul_add(d, a)
                }) / hf;
                out.mu.push(mu);
                (mu, 1.0 / (var + eps).sqrt())
            }
            NormKind::RmsNorm => {
                let ms = row_sum(spec, |a, c| row[c].mul_add(row[c], a)) / hf;
                (0.0, 1.0 / (ms + eps).sqrt())
            }
        };
        out.rsigma.push(rs);
        let y: Vec<f32> = (0..h)
            .map(|c| match beta {
                Some(b) => ((row[c] - mu) * rs).mul_add(g[c], b[c]),
                None => row[c] * rs * g[c],
            })
            .collect();
        if fp8 {
            out.amax = y.iter().fold(out.amax, |a, v| a.max(v.abs()));
            out.y.extend(y.iter().map(|&v| quantize(spec.output, v * scale)));
        } else {
            out.y.extend(encode(spec.output, &y));
        }
    }
    out
}

/// Backward of `dy, x: [rows, hidden]` (rounded to `spec.input`) with the forward's saved
/// `mu` (LayerNorm only) and `rsigma: [rows]` and `gamma: [hidden]` (rounded to `spec.weight`).
/// dgamma/dbeta are f32 partials per block of `spec.bwd_rows_per_block()` rows, then summed as
/// the `_reduce` kernel does (group `j` adds partials `j, j + G, ...`, then groups in order).
///
/// # Panics
/// If the lengths disagree or `mu` does not match the kind (caller bugs).
pub fn backward(spec: &NormSpec, dy: &[f32], x: &[f32], mu: Option<&[f32]>, rsigma: &[f32], gamma: &[f32]) -> Backward {
    let h = spec.hidden;
    let rows = x.len() / h;
    assert!(x.len() == rows * h && dy.len() == x.len() && rsigma.len() == rows && gamma.len() == h, "lengths");
    assert_eq!(mu.is_some(), spec.kind == NormKind::LayerNorm, "reference norm backward: mu");
    let g = effective_gamma(spec, gamma);
    let hf = h as f32;
    let rpb = spec.bwd_rows_per_block();
    let parts = rows.div_ceil(rpb);
    let mut dg_part = vec![0.0f32; parts * h];
    let mut db_part = vec![0.0f32; parts * h];
    let mut dx = vec![0.0f32; rows * h];
    for r in 0..rows {
        let (xr, dyr) = (&x[r * h..(r + 1) * h], &dy[r * h..(r + 1) * h]);
        let rs = rsigma[r];
        let xhat: Vec<f32> = match mu {
            Some(mu) => xr.iter().map(|&v| (v - mu[r]) * rs).collect(),
            None => xr.iter().map(|&v| v * rs).collect(),
        };
        let dyg: Vec<f32> = dyr.iter().zip(&g).map(|(&d, &g)| d * g).collect();
        let p = r / rpb;
        for c in 0..h {
            dg_part[p * h + c] = dyr[c].mul_add(xhat[c], dg_part[p * h + c]);
            db_part[p * h + c] += dyr[c];
        }
        let m2 = row_sum(spec, |a, c| dyg[c].mul_add(xhat[c], a)) / hf;
        let m1 = if mu.is_some() { row_sum(spec, |a, c| a + dyg[c]) / hf } else { 0.0 };
        for c in 0..h {
            let base = if mu.is_some() { dyg[c] - m1 } else { dyg[c] };
            dx[r * h + c] = round_to(spec.output, rs * (-xhat[c]).mul_add(m2, base));
        }
    }
    let reduce = |part: &[f32]| -> Vec<f32> {
        let groups = NormSpec::REDUCE_GROUPS;
        (0..h)
            .map(|c| {
                let total = (0..groups)
                    .fold(0.0f32, |tot, j| tot + (j..parts).step_by(groups).fold(0.0f32, |a, p| a + part[p * h + c]));
                round_to(spec.weight, total)
            })
            .collect()
    };
    Backward { dx, dgamma: reduce(&dg_part), dbeta: (spec.kind == NormKind::LayerNorm).then(|| reduce(&db_part)) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_codegen::spec::Direction;
    use te_codegen::{Arch, DType};
    use te_runtime::numerics::decode;

    /// Deterministic values in about [-2, 2).
    fn vals(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect()
    }

    fn spec(kind: NormKind, dir: Direction, out: DType, hidden: usize, zc: bool) -> NormSpec {
        NormSpec::new(kind, dir, DType::F32, out, DType::F32, hidden, zc, Arch::Sm90a)
    }

    /// f64 forward of one row: `(y, mu, rsigma)`.
    fn f64_row(kind: NormKind, x: &[f64], g: &[f64], b: &[f64], eps: f64) -> (Vec<f64>, f64, f64) {
        let n = x.len() as f64;
        let (mu, var) = match kind {
            NormKind::LayerNorm => {
                let mu = x.iter().sum::<f64>() / n;
                (mu, x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n)
            }
            NormKind::RmsNorm => (0.0, x.iter().map(|v| v * v).sum::<f64>() / n),
        };
        let rs = 1.0 / (var + eps).sqrt();
        let y = x.iter().enumerate().map(|(c, v)| (v - mu) * rs * g[c] + b[c]).collect();
        (y, mu, rs)
    }

    #[test]
    fn forward_matches_f64() {
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            for (hidden, zc) in [(4096, false), (1000, true), (784, false), (36, true), (7, false)] {
                let s = spec(kind, Direction::Fwd, DType::F32, hidden, zc);
                let rows = 3;
                let x: Vec<f32> = vals(1, rows * hidden).iter().map(|v| v * 3.0 + 0.5).collect();
                let gamma = vals(2, hidden);
                let beta = vals(3, hidden);
                let lnb = (kind == NormKind::LayerNorm).then_some(&beta[..]);
                let f = forward(&s, &x, &gamma, lnb, 1e-5, 1.0);
                let y = decode(DType::F32, &f.y);
                let g64: Vec<f64> = gamma.iter().map(|&g| g as f64 + if zc { 1.0 } else { 0.0 }).collect();
                let b64: Vec<f64> = match lnb {
                    Some(b) => b.iter().map(|&v| v as f64).collect(),
                    None => vec![0.0; hidden],
                };
                for r in 0..rows {
                    let x64: Vec<f64> = x[r * hidden..(r + 1) * hidden].iter().map(|&v| v as f64).collect();
                    let (want, mu, rs) = f64_row(kind, &x64, &g64, &b64, 1e-5);
                    assert!((f.rsigma[r] as f64 - rs).abs() <= 1e-5 * rs, "{kind:?} h{hidden} rsigma");
                    if kind == NormKind::LayerNorm {
                        assert!((f.mu[r] as f64 - mu).abs() <= 1e-5, "{kind:?} h{hidden} mu");
                    }
                    for c in 0..hidden {
                        let got = y[r * hidden + c] as f64;
                        assert!((got - want[c]).abs() <= 1e-4 * (1.0 + want[c].abs()), "{kind:?} h{hidden} y[{r},{c}]");
                    }
                }
            }
        }
    }

    #[test]
    fn fp8_forward_quantizes_y_times_scale_and_tracks_amax() {
        let hidden = 64;
        let s32 = spec(NormKind::LayerNorm, Direction::Fwd, DType::F32, hidden, false);
        let s8 = spec(NormKind::LayerNorm, Direction::Fwd, DType::E4M3, hidden, false);
        let x = vals(4, 2 * hidden);
        let (gamma, beta) = (vals(5, hidden), vals(6, hidden));
        let hp = forward(&s32, &x, &gamma, Some(&beta), 1e-5, 1.0);
        let q = forward(&s8, &x, &gamma, Some(&beta), 1e-5, 8.0);
        let y = decode(DType::F32, &hp.y);
        let want: Vec<u8> = y.iter().map(|&v| quantize(DType::E4M3, v * 8.0)).collect();
        assert_eq!(q.y, want);
        assert_eq!(q.amax, y.iter().fold(0.0f32, |a, v| a.max(v.abs())));
        assert_eq!((q.mu, q.rsigma, q.scale_inv), (hp.mu, hp.rsigma, 0.125));
    }

    #[test]
    fn block_sum_is_the_plain_sum_on_exact_values() {
        let v: Vec<f32> = (0..512).map(|i| i as f32).collect();
        assert_eq!(block_sum(&v), 511.0 * 512.0 / 2.0);
        assert_eq!(block_sum(&v[..32]), 31.0 * 32.0 / 2.0);
    }

    /// Finite differences of `L = Σ dy ⊙ y` in f64 against the reference backward.
    #[test]
    fn backward_matches_finite_differences() {
        let (rows, hidden, eps) = (37, 24, 1e-5f64);
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            for zc in [false, true] {
                let s = spec(kind, Direction::Bwd, DType::F32, hidden, zc);
                let x = vals(7, rows * hidden);
                let dy = vals(8, rows * hidden);
                let gamma = vals(9, hidden);
                let beta = vals(10, hidden);
                let g64 =
                    |gamma: &[f64]| -> Vec<f64> { gamma.iter().map(|g| g + if zc { 1.0 } else { 0.0 }).collect() };
                let to64 = |v: &[f32]| -> Vec<f64> { v.iter().map(|&v| v as f64).collect() };
                let b64 = if kind == NormKind::LayerNorm { to64(&beta) } else { vec![0.0; hidden] };
                let loss = |x: &[f64], gamma: &[f64], beta: &[f64]| -> f64 {
                    (0..rows)
                        .map(|r| {
                            let (y, _, _) = f64_row(kind, &x[r * hidden..(r + 1) * hidden], &g64(gamma), beta, eps);
                            y.iter().zip(&dy[r * hidden..]).map(|(y, &d)| y * d as f64).sum::<f64>()
                        })
                        .sum()
                };
                // Saved statistics from the reference forward.
                let fs = spec(kind, Direction::Fwd, DType::F32, hidden, zc);
                let lnb = (kind == NormKind::LayerNorm).then_some(&beta[..]);
                let f = forward(&fs, &x, &gamma, lnb, eps as f32, 1.0);
                let mu = (kind == NormKind::LayerNorm).then_some(&f.mu[..]);
                let b = backward(&s, &dy, &x, mu, &f.rsigma, &gamma);
                let (x64, gm64) = (to64(&x), to64(&gamma));
                let step = 1e-4;
                let fd = |v: &mut Vec<f64>, i: usize, which: u8| -> f64 {
                    let orig = v[i];
                    let eval = |d: f64, v: &mut Vec<f64>| {
                        v[i] = orig + d;
                        let l = match which {
                            0 => loss(v, &gm64, &b64),
                            1 => loss(&x64, v, &b64),
                            _ => loss(&x64, &gm64, v),
                        };
                        v[i] = orig;
                        l
                    };
                    (eval(step, v) - eval(-step, v)) / (2.0 * step)
                };
                let close = |what: &str, got: f32, want: f64| {
                    assert!(
                        (got as f64 - want).abs() <= 2e-3 * (1.0 + want.abs()),
                        "{kind:?} zc={zc} {what}: {got} vs {want}"
                    );
                };
                for i in (0..rows * hidden).step_by(53) {
                    close("dx", b.dx[i], fd(&mut x64.clone(), i, 0));
                }
                for c in 0..hidden {
                    close("dgamma", b.dgamma[c], fd(&mut gm64.clone(), c, 1));
                    if let Some(db) = &b.dbeta {
                        close("dbeta", db[c], fd(&mut b64.clone(), c, 2));
                    }
                }
                assert_eq!(b.dbeta.is_some(), kind == NormKind::LayerNorm);
            }
        }
    }
}
