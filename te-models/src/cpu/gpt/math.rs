//! The f32 arithmetic of [`super::GptRef`]: a strided GEMM on `matrixmultiply` with rows split
//! over the rayon pool, the linear layer, column sums (bias gradients), TE's tanh GELU through
//! `exp`, and causal attention forward and backward over the fused `qkv` activations.

use rayon::prelude::*;

/// `[f(0), …, f(n - 1)]`, computed in parallel chunks.
pub(super) fn par_fill(n: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0.0; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        o.iter_mut().enumerate().for_each(|(i, o)| *o = f(c * CHUNK + i));
    });
    out
}

/// A strided view of a matrix: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    pub(super) data: &'a [f32],
    pub(super) rs: usize,
    pub(super) cs: usize,
}

impl<'a> View<'a> {
    /// Row-major `[rows, cols]` from `data`.
    pub(super) fn rows(data: &'a [f32], cols: usize) -> Self {
        Self { data, rs: cols, cs: 1 }
    }

    /// The transpose of row-major `[rows, cols]` data (a `[cols, rows]` view).
    pub(super) fn t(data: &'a [f32], cols: usize) -> Self {
        Self { data, rs: 1, cs: cols }
    }

    /// Rows from `r` on.
    pub(super) fn skip_rows(self, r: usize) -> Self {
        Self { data: &self.data[r * self.rs..], ..self }
    }

    pub(super) fn check(&self, rows: usize, cols: usize) {
        let last = (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(last < self.data.len(), "GEMM view out of bounds");
    }
}

/// `c [m, n] (row-major) = a [m, k] · b [k, n] + beta · c`, rows of `c` split over the rayon
/// pool when the product is large.
pub(super) fn gemm(m: usize, k: usize, n: usize, a: View<'_>, b: View<'_>, beta: f32, c: &mut [f32]) {
    assert_eq!(c.len(), m * n, "GEMM output must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.iter_mut().for_each(|v| *v *= beta);
        return;
    }
    a.check(m, k);
    b.check(k, n);
    let threads = rayon::current_num_threads();
    let rows = if m * n * k >= 1 << 18 && threads > 1 { m.div_ceil(threads) } else { m };
    c.par_chunks_mut(rows * n).enumerate().for_each(|(i, c)| {
        let (a, mi) = (a.skip_rows(i * rows), c.len() / n);
        // SAFETY: the views hold every element the product reads (checked above; `skip_rows`
        // only drops rows before this chunk's), and `c` is this chunk's `[mi, n]` block.
        unsafe {
            matrixmultiply::sgemm(
                mi,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                a.rs as isize,
                a.cs as isize,
                b.data.as_ptr(),
                b.rs as isize,
                b.cs as isize,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    });
}

/// `y [t, out] = x [t, in] · w [out, in]ᵀ + bias`.
pub(super) fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, t: usize, n_out: usize, n_in: usize) -> Vec<f32> {
    let mut y = match bias {
        Some(b) => b.iter().copied().cycle().take(t * n_out).collect(),
        None => vec![0.0; t * n_out],
    };
    gemm(t, n_in, n_out, View::rows(x, n_in), View::t(w, n_in), 1.0, &mut y);
    y
}

/// `Σ_rows x` of `[rows, cols]` in f64, rounded once.
pub(super) fn column_sums(x: &[f32], cols: usize) -> Vec<f32> {
    let mut s = vec![0.0f64; cols];
    for row in x.chunks_exact(cols) {
        s.iter_mut().zip(row).for_each(|(s, &v)| *s += f64::from(v));
    }
    s.into_iter().map(|v| v as f32).collect()
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// The `tanh` of TE's tanh-approximated GELU, `gelu(x) = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`
/// ([`super::activation::gelu`]), through `exp` (`1 − 2/(e^{2u} + 1)`, exact to f32 rounding
/// in absolute terms, which is what the GELU needs) and shared with the backward.
pub(super) fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    1.0 - 2.0 / ((2.0 * u).exp() + 1.0)
}

/// [`super::activation::dgelu`] at `x` from `t = gelu_tanh(x)`.
pub(super) fn dgelu(x: f32, t: f32) -> f32 {
    0.5 * x * ((1.0 - t * t) * (SQRT_2_OVER_PI + 3.0 * 0.044715 * SQRT_2_OVER_PI * x * x)) + 0.5 * (1.0 + t)
}

/// Causal attention over `qkv: [s·b, 3·heads·d]` (rows `[q | k | v]`, head `j` at columns
/// `j·d..`): the output `[s·b, heads·d]` and each `(sequence, head)`'s probabilities `[s, s]`.
pub(super) fn attention_forward(qkv: &[f32], s: usize, b: usize, heads: usize, d: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (hd, w) = (heads * d, 3 * heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..b * heads)
        .into_par_iter()
        .map(|task| {
            let (j, hh) = (task / heads, task % heads);
            let col = |part: usize| &qkv[j * w + part * hd + hh * d..];
            let mut p = vec![0.0; s * s];
            gemm(
                s,
                d,
                s,
                View { data: col(0), rs: b * w, cs: 1 },
                View { data: col(1), rs: 1, cs: b * w },
                0.0,
                &mut p,
            );
            for (i, row) in p.chunks_exact_mut(s).enumerate() {
                let m = row[..=i].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
                let mut sum = 0.0f32;
                for v in &mut row[..=i] {
                    *v = (*v * scale - m).exp();
                    sum += *v;
                }
                row[..=i].iter_mut().for_each(|v| *v /= sum);
                row[i + 1..].fill(0.0);
            }
            let mut o = vec![0.0; s * d];
            gemm(s, s, d, View::rows(&p, s), View { data: col(2), rs: b * w, cs: 1 }, 0.0, &mut o);
            (o, p)
        })
        .collect();
    let mut out = vec![0.0; s * b * hd];
    let mut probs = Vec::with_capacity(blocks.len());
    for (task, (o, p)) in blocks.into_iter().enumerate() {
        let (j, hh) = (task / heads, task % heads);
        for (i, row) in o.chunks_exact(d).enumerate() {
            let at = (i * b + j) * hd + hh * d;
            out[at..at + d].copy_from_slice(row);
        }
        probs.push(p);
    }
    (out, probs)
}

/// The gradient `[s·b, 3·heads·d]` of `qkv` for `d_o: [s·b, heads·d]`, from the forward's
/// probabilities.
pub(super) fn attention_backward(
    qkv: &[f32],
    probs: &[Vec<f32>],
    d_o: &[f32],
    s: usize,
    b: usize,
    heads: usize,
    d: usize,
) -> Vec<f32> {
    let (hd, w) = (heads * d, 3 * heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let blocks: Vec<[Vec<f32>; 3]> = (0..b * heads)
        .into_par_iter()
        .map(|task| {
            let (j, hh) = (task / heads, task % heads);
            let col = |part: usize| &qkv[j * w + part * hd + hh * d..];
            let dov = View { data: &d_o[j * hd + hh * d..], rs: b * hd, cs: 1 };
            let p = &probs[task];
            let mut dp = vec![0.0; s * s];
            gemm(s, d, s, dov, View { data: col(2), rs: 1, cs: b * w }, 0.0, &mut dp);
            let mut dv = vec![0.0; s * d];
            gemm(s, s, d, View::t(p, s), dov, 0.0, &mut dv);
            // dS = P ∘ (dP − rowsum(P ∘ dP)), times the softmax scale.
            for (ds, p) in dp.chunks_exact_mut(s).zip(p.chunks_exact(s)) {
                let dot: f32 = ds.iter().zip(p).map(|(a, b)| a * b).sum();
                ds.iter_mut().zip(p).for_each(|(g, &p)| *g = p * (*g - dot) * scale);
            }
            let mut dq = vec![0.0; s * d];
            gemm(s, s, d, View::rows(&dp, s), View { data: col(1), rs: b * w, cs: 1 }, 0.0, &mut dq);
            let mut dk = vec![0.0; s * d];
            gemm(s, s, d, View::t(&dp, s), View { data: col(0), rs: b * w, cs: 1 }, 0.0, &mut dk);
            [dq, dk, dv]
        })
        .collect();
    let mut dqkv = vec![0.0; s * b * w];
    for (task, parts) in blocks.iter().enumerate() {
        let (j, hh) = (task / heads, task % heads);
        for (part, g) in parts.iter().enumerate() {
            for (i, row) in g.chunks_exact(d).enumerate() {
                let at = (i * b + j) * w + part * hd + hh * d;
                dqkv[at..at + d].copy_from_slice(row);
            }
        }
    }
    dqkv
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_reference::activation;

    #[test]
    fn gelu_through_exp_matches_the_reference() {
        for x in [0.0f32, 0.3, -1.7, 2.5, 8.0, -30.0] {
            assert!((0.5 * x * (1.0 + gelu_tanh(x)) - activation::gelu(x)).abs() < 1e-6);
            assert!((dgelu(x, gelu_tanh(x)) - activation::dgelu(x)).abs() < 1e-6);
        }
    }
}
