//! CPU reference of the norm-fused modules (`LayerNorm`/`RMSNorm`, `LayerNormLinear`,
//! `LayerNormMLP`) in exact f64 math on the f32 values given: what the GPU modules approximate
//! in BF16 or FP8. Checked here against finite differences.

use super::activation;
use super::gemm::gemm_tn;
use super::linear::transpose;
use te_codegen::spec::{Activation, NormKind};

/// A norm's settings and parameters (`gamma` as stored: `gamma - 1` when zero-centered).
#[derive(Debug, Clone)]
pub struct NormRef<'a> {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// `[hidden]`.
    pub gamma: &'a [f32],
    /// `[hidden]` (LayerNorm).
    pub beta: Option<&'a [f32]>,
    /// Epsilon.
    pub eps: f32,
    /// TE `zero_centered_gamma`.
    pub zero_centered_gamma: bool,
}

impl NormRef<'_> {
    fn g(&self, c: usize) -> f64 {
        f64::from(self.gamma[c]) + if self.zero_centered_gamma { 1.0 } else { 0.0 }
    }

    /// `y = norm(x)` for `x: [rows, hidden]`.
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        let h = self.gamma.len();
        let mut y = Vec::with_capacity(x.len());
        for row in x.chunks_exact(h) {
            let (mu, rs) = self.stats(row);
            for (c, &v) in row.iter().enumerate() {
                let b = self.beta.map_or(0.0, |b| f64::from(b[c]));
                y.push(((f64::from(v) - mu) * rs * self.g(c) + b) as f32);
            }
        }
        y
    }

    fn stats(&self, row: &[f32]) -> (f64, f64) {
        let h = row.len() as f64;
        let mu = match self.kind {
            NormKind::LayerNorm => row.iter().map(|&v| f64::from(v)).sum::<f64>() / h,
            NormKind::RmsNorm => 0.0,
        };
        let var = row.iter().map(|&v| (f64::from(v) - mu).powi(2)).sum::<f64>() / h;
        (mu, 1.0 / (var + f64::from(self.eps)).sqrt())
    }

    /// `(dx, dgamma, dbeta)` for `dy` at `x` (dbeta empty for RMSNorm).
    pub fn backward(&self, dy: &[f32], x: &[f32]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let h = self.gamma.len();
        let hf = h as f64;
        let (mut dg, mut db) = (vec![0.0f64; h], vec![0.0f64; h]);
        let mut dx = Vec::with_capacity(x.len());
        for (row, g) in x.chunks_exact(h).zip(dy.chunks_exact(h)) {
            let (mu, rs) = self.stats(row);
            let xhat: Vec<f64> = row.iter().map(|&v| (f64::from(v) - mu) * rs).collect();
            let gy: Vec<f64> = (0..h).map(|c| f64::from(g[c]) * self.g(c)).collect();
            for c in 0..h {
                dg[c] += f64::from(g[c]) * xhat[c];
                db[c] += f64::from(g[c]);
            }
            let mean_gy = gy.iter().sum::<f64>() / hf;
            let mean_gy_xhat = gy.iter().zip(&xhat).map(|(a, b)| a * b).sum::<f64>() / hf;
            for c in 0..h {
                let centered = match self.kind {
                    NormKind::LayerNorm => gy[c] - mean_gy,
                    NormKind::RmsNorm => gy[c],
                };
                dx.push((rs * (centered - xhat[c] * mean_gy_xhat)) as f32);
            }
        }
        let db = if self.kind == NormKind::LayerNorm { db } else { Vec::new() };
        (dx, dg.into_iter().map(|v| v as f32).collect(), db.into_iter().map(|v| v as f32).collect())
    }
}

/// A GEMM layer's parameters: `w: [out, in]`, optional `b: [out]`.
#[derive(Debug, Clone, Copy)]
pub struct DenseRef<'a> {
    /// `[out, in]`.
    pub w: &'a [f32],
    /// `[out]`.
    pub b: Option<&'a [f32]>,
}

impl DenseRef<'_> {
    /// `x · wᵀ + b` for `x: [rows, in]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Vec<f32> {
        let n_in = x.len() / rows;
        let n_out = self.w.len() / n_in;
        let mut y = gemm_tn(x, self.w, rows, n_out, n_in);
        if let Some(b) = self.b {
            for r in y.chunks_exact_mut(n_out) {
                r.iter_mut().zip(b).for_each(|(v, &b)| *v += b);
            }
        }
        y
    }

    /// `(dx, dw, db)` for `dy: [rows, out]` at `x: [rows, in]`.
    pub fn backward(&self, dy: &[f32], x: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let n_in = x.len() / rows;
        let n_out = dy.len() / rows;
        let dx = gemm_tn(dy, &transpose(self.w, n_out, n_in), rows, n_in, n_out);
        let dw = gemm_tn(&transpose(dy, rows, n_out), &transpose(x, rows, n_in), n_out, n_in, rows);
        let mut db = vec![0.0f64; n_out];
        for r in dy.chunks_exact(n_out) {
            db.iter_mut().zip(r).for_each(|(s, &v)| *s += f64::from(v));
        }
        (dx, dw, db.into_iter().map(|v| v as f32).collect())
    }
}

/// Gradients of `LayerNormMLP` (and, without the fc2 fields, `LayerNormLinear`).
#[derive(Debug, Clone)]
pub struct MlpGrads {
    /// `[rows, hidden]`.
    pub dx: Vec<f32>,
    /// Norm gamma and beta.
    pub dgamma: Vec<f32>,
    /// Empty for RMSNorm.
    pub dbeta: Vec<f32>,
    /// fc1 weight and bias.
    pub dw1: Vec<f32>,
    /// `[fc1_out]`.
    pub db1: Vec<f32>,
    /// fc2 weight and bias.
    pub dw2: Vec<f32>,
    /// `[hidden]`.
    pub db2: Vec<f32>,
}

/// `LayerNormLinear` forward: `(y, ln)`.
pub fn layernorm_linear_forward(norm: &NormRef<'_>, fc: &DenseRef<'_>, x: &[f32], rows: usize) -> (Vec<f32>, Vec<f32>) {
    let ln = norm.forward(x);
    (fc.forward(&ln, rows), ln)
}

/// `LayerNormLinear` backward, the GEMM's gradients in `dw1`/`db1` (`dw2`/`db2` empty).
pub fn layernorm_linear_backward(
    norm: &NormRef<'_>,
    fc: &DenseRef<'_>,
    dy: &[f32],
    x: &[f32],
    rows: usize,
) -> MlpGrads {
    let ln = norm.forward(x);
    let (d_ln, dw1, db1) = fc.backward(dy, &ln, rows);
    let (dx, dgamma, dbeta) = norm.backward(&d_ln, x);
    MlpGrads { dx, dgamma, dbeta, dw1, db1, dw2: Vec::new(), db2: Vec::new() }
}

/// `LayerNormMLP` forward: `y = fc2(act(fc1(norm(x))))`.
pub fn layernorm_mlp_forward(
    norm: &NormRef<'_>,
    fc1: &DenseRef<'_>,
    act: Activation,
    fc2: &DenseRef<'_>,
    x: &[f32],
    rows: usize,
) -> Vec<f32> {
    let pre = fc1.forward(&norm.forward(x), rows);
    let ffn = fc2.w.len() / (x.len() / rows);
    fc2.forward(&activation::forward(act, &pre, None, ffn), rows)
}

/// `LayerNormMLP` backward.
pub fn layernorm_mlp_backward(
    norm: &NormRef<'_>,
    fc1: &DenseRef<'_>,
    act: Activation,
    fc2: &DenseRef<'_>,
    dy: &[f32],
    x: &[f32],
    rows: usize,
) -> MlpGrads {
    let ln = norm.forward(x);
    let pre = fc1.forward(&ln, rows);
    let ffn = fc2.w.len() / (x.len() / rows);
    let a = activation::forward(act, &pre, None, ffn);
    let (d_a, dw2, db2) = fc2.backward(dy, &a, rows);
    let d_pre = activation::backward(act, &d_a, &pre, ffn);
    let (d_ln, dw1, db1) = fc1.backward(&d_pre, &ln, rows);
    let (dx, dgamma, dbeta) = norm.backward(&d_ln, x);
    MlpGrads { dx, dgamma, dbeta, dw1, db1, dw2, db2 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0) - 0.5)
            .collect()
    }

    /// `Σ dy · f(x)` as a function of one input element, by central differences.
    fn numeric(f: &dyn Fn(&[f32]) -> Vec<f32>, x: &[f32], dy: &[f32], i: usize) -> f64 {
        let eps = 1e-3f32;
        let mut xp = x.to_vec();
        xp[i] += eps;
        let mut xm = x.to_vec();
        xm[i] -= eps;
        let dot = |y: Vec<f32>| y.iter().zip(dy).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>();
        (dot(f(&xp)) - dot(f(&xm))) / (2.0 * f64::from(eps))
    }

    #[test]
    fn norm_gradients_match_finite_differences() {
        let (rows, h) = (3, 8);
        let x = vals(rows * h, 1);
        let dy = vals(rows * h, 2);
        let gamma: Vec<f32> = vals(h, 3).iter().map(|v| v + 1.0).collect();
        let beta = vals(h, 4);
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            let beta = (kind == NormKind::LayerNorm).then_some(beta.as_slice());
            let norm = NormRef { kind, gamma: &gamma, beta, eps: 1e-5, zero_centered_gamma: false };
            let (dx, dg, _) = norm.backward(&dy, &x);
            for i in [0, 5, 13, 23] {
                let n = numeric(&|x| norm.forward(x), &x, &dy, i);
                assert!((f64::from(dx[i]) - n).abs() < 2e-3, "{kind:?} dx[{i}]: {} vs {n}", dx[i]);
            }
            let g0 = gamma.clone();
            let fg = |g: &[f32]| NormRef { kind, gamma: g, beta, eps: 1e-5, zero_centered_gamma: false }.forward(&x);
            let n = numeric(&fg, &g0, &dy, 2);
            assert!((f64::from(dg[2]) - n).abs() < 2e-3, "{kind:?} dgamma: {} vs {n}", dg[2]);
        }
    }

    #[test]
    fn mlp_gradients_match_finite_differences() {
        let (rows, h, f) = (2, 8, 12);
        let x = vals(rows * h, 5);
        let dy = vals(rows * h, 6);
        let gamma = vec![1.0f32; h];
        let beta = vec![0.0f32; h];
        let norm = NormRef {
            kind: NormKind::LayerNorm,
            gamma: &gamma,
            beta: Some(&beta),
            eps: 1e-5,
            zero_centered_gamma: false,
        };
        for act in [Activation::Gelu, Activation::Swiglu] {
            let f1 = if act.is_gated() { 2 * f } else { f };
            let w1 = vals(f1 * h, 7);
            let b1 = vals(f1, 8);
            let w2 = vals(h * f, 9);
            let b2 = vals(h, 10);
            let (fc1, fc2) = (DenseRef { w: &w1, b: Some(&b1) }, DenseRef { w: &w2, b: Some(&b2) });
            let g = layernorm_mlp_backward(&norm, &fc1, act, &fc2, &dy, &x, rows);
            for i in [1, 9] {
                let n = numeric(&|x| layernorm_mlp_forward(&norm, &fc1, act, &fc2, x, rows), &x, &dy, i);
                assert!((f64::from(g.dx[i]) - n).abs() < 2e-3, "{act:?} dx[{i}]: {} vs {n}", g.dx[i]);
            }
            let fw1 = |w: &[f32]| layernorm_mlp_forward(&norm, &DenseRef { w, b: Some(&b1) }, act, &fc2, &x, rows);
            let n = numeric(&fw1, &w1, &dy, 3);
            assert!((f64::from(g.dw1[3]) - n).abs() < 2e-3, "{act:?} dw1: {} vs {n}", g.dw1[3]);
            let fb1 = |b: &[f32]| layernorm_mlp_forward(&norm, &DenseRef { w: &w1, b: Some(b) }, act, &fc2, &x, rows);
            let n = numeric(&fb1, &b1, &dy, 4);
            assert!((f64::from(g.db1[4]) - n).abs() < 2e-3, "{act:?} db1: {} vs {n}", g.db1[4]);
        }
    }
}
