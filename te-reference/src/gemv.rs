//! Family 22 reference: the decode GEMV (`ops::gemv`), mirroring `te-codegen/templates/gemv.cu.tera`
//! (see [`GemvSpec`] for the arithmetic): the prologue's norms with f32 statistics and BF16
//! outputs, the product in f32, `y = round(acc · s + bias)`, then the epilogue. The kernel sums in
//! a warp tree, this in row order, so outputs agree within a few f32 ulps before their rounding
//! (see `tests/gpu/gemv.rs`).

use crate::activation::{gelu, gelu_erf, relu, silu};
use te_codegen::spec::{Activation, GemvEpilogue, GemvPrologue, GemvSpec, NormKind};
use te_codegen::DType;
use te_runtime::numerics::round_to;

/// The element-wise function of `a` (a gated activation's gate function).
fn act(a: Activation) -> fn(f32) -> f32 {
    match a {
        Activation::Gelu | Activation::Geglu => gelu,
        Activation::GeluErf => gelu_erf,
        Activation::Relu => relu,
        Activation::Swiglu => silu,
    }
}

/// A norm's weights as the kernel reads them: `γ` (`[k]`, as stored) and LayerNorm's `β`.
pub type NormWeights<'a> = (&'a [f32], Option<&'a [f32]>);

/// The inputs of [`gemv`], values widened to f32 (BF16 values; the weight as its codes' values,
/// before `w_scale_inv`).
#[derive(Debug, Clone, Copy)]
pub struct GemvInputs<'a> {
    /// `[m, k]`: the input rows (`AddNorm`: the residual stream).
    pub x: &'a [f32],
    /// `AddNorm` / `ResidualNorm`: `[m, k]` the sublayer output, and its post-norm's weights
    /// (`AddNorm` only).
    pub add: Option<(&'a [f32], Option<NormWeights<'a>>)>,
    /// The pre-norm's weights (`Norm`, `AddNorm`).
    pub norm: Option<NormWeights<'a>>,
    /// `[n · weight_rows, k]`.
    pub w: &'a [f32],
    /// The FP8 weight's `scale_inv` (1 for BF16).
    pub w_scale_inv: f32,
    /// `[n · weight_rows]`.
    pub bias: Option<&'a [f32]>,
    /// `[m, n]`: the output before the call (read by `Residual`).
    pub out: &'a [f32],
}

/// `round(norm(row))` in BF16 with f32 statistics (the kernel's `norm_row`).
fn norm_row(spec: &GemvSpec, row: &[f32], (gamma, beta): NormWeights<'_>, eps: f32) -> Vec<f32> {
    let k = row.len() as f32;
    let layer_norm = spec.norm == NormKind::LayerNorm;
    let mu = if layer_norm { row.iter().sum::<f32>() / k } else { 0.0 };
    let var = row.iter().map(|&x| (x - mu) * (x - mu)).sum::<f32>() / k;
    let rsigma = 1.0 / (var + eps).sqrt();
    row.iter()
        .enumerate()
        .map(|(c, &x)| {
            let g = if spec.zero_centered_gamma { gamma[c] + 1.0 } else { gamma[c] };
            let b = if layer_norm { beta.map_or(0.0, |b| b[c]) } else { 0.0 };
            round_to(DType::BF16, (x - mu) * rsigma * g + b)
        })
        .collect()
}

/// What `ops::gemv::gemv` writes for `m` rows and `n` outputs: `(out [m, n], h_out [m, k] for
/// AddNorm)`, BF16 values widened.
///
/// # Panics
/// If the inputs do not match the spec (a missing norm or sublayer input; caller bugs).
pub fn gemv(spec: &GemvSpec, inp: &GemvInputs<'_>, (m, n): (usize, usize), eps: f32) -> (Vec<f32>, Option<Vec<f32>>) {
    let k = spec.k;
    let wr = spec.epilogue.weight_rows();
    assert_eq!(inp.x.len(), m * k, "x is not [{m}, {k}]");
    assert_eq!(inp.w.len(), wr * n * k, "w is not [{}, {k}]", wr * n);
    let adds = matches!(spec.prologue, GemvPrologue::AddNorm | GemvPrologue::ResidualNorm);
    let mut h_out = adds.then(|| vec![0.0; m * k]);
    let mut out = inp.out.to_vec();
    let pre_norm = || match inp.norm {
        Some(n) => n,
        None => panic!("a {} prologue needs the pre-norm's weights", spec.prologue.name()),
    };
    for r in 0..m {
        let x = &inp.x[r * k..(r + 1) * k];
        let p: Vec<f32> = match spec.prologue {
            GemvPrologue::None => x.to_vec(),
            GemvPrologue::Norm => norm_row(spec, x, pre_norm(), eps),
            GemvPrologue::AddNorm | GemvPrologue::ResidualNorm => {
                let Some((a, post)) = inp.add else {
                    panic!("a {} prologue needs the sublayer output", spec.prologue.name())
                };
                let a = &a[r * k..(r + 1) * k];
                let a = match post {
                    Some(post) if spec.prologue == GemvPrologue::AddNorm => norm_row(spec, a, post, eps),
                    _ => a.to_vec(),
                };
                let h: Vec<f32> = x.iter().zip(&a).map(|(x, a)| round_to(DType::BF16, x + a)).collect();
                if let Some(h_out) = h_out.as_mut() {
                    h_out[r * k..(r + 1) * k].copy_from_slice(&h);
                }
                norm_row(spec, &h, pre_norm(), eps)
            }
        };
        for j in 0..n {
            let y: Vec<f32> = (0..wr)
                .map(|g| {
                    let row = j + g * n;
                    let w = &inp.w[row * k..(row + 1) * k];
                    let acc = w.iter().zip(&p).fold(0.0f32, |acc, (w, x)| w.mul_add(*x, acc));
                    round_to(DType::BF16, acc * inp.w_scale_inv + inp.bias.map_or(0.0, |b| b[row]))
                })
                .collect();
            let o = &mut out[r * n + j];
            *o = round_to(
                DType::BF16,
                match spec.epilogue {
                    GemvEpilogue::Store => y[0],
                    GemvEpilogue::Residual => *o + y[0],
                    GemvEpilogue::Act(a) if a.is_gated() => act(a)(y[0]) * y[1],
                    GemvEpilogue::Act(a) => act(a)(y[0]),
                },
            );
        }
    }
    (out, h_out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_codegen::Arch;

    #[test]
    fn a_layer_norm_then_swiglu_by_hand() {
        // k = 8, one row, two outputs: LayerNorm of 1..8, weights picking channels.
        let spec = GemvSpec::new(DType::BF16, 8, 1, Arch::Sm90a)
            .with_prologue(GemvPrologue::Norm, NormKind::LayerNorm, false)
            .with_epilogue(true, GemvEpilogue::Act(Activation::Swiglu));
        let x: Vec<f32> = (1..=8).map(|v| v as f32).collect();
        let (gamma, beta) = (vec![1.0; 8], vec![0.0; 8]);
        let mut w = vec![0.0; 4 * 8];
        w[7] = 1.0; // gate 0 = xhat[7]
        w[8] = 1.0; // gate 1 = xhat[0]
        w[2 * 8 + 7] = 2.0; // up 0 = 2 xhat[7]
        w[3 * 8] = 1.0; // up 1 = xhat[0]
        let bias = [0.0, 0.0, 0.5, 0.0];
        let inp = GemvInputs {
            x: &x,
            add: None,
            norm: Some((&gamma, Some(&beta))),
            w: &w,
            w_scale_inv: 1.0,
            bias: Some(&bias),
            out: &[0.0; 2],
        };
        let (out, h) = gemv(&spec, &inp, (1, 2), 0.0);
        assert!(h.is_none());
        // xhat = (x - 4.5) / sqrt(5.25): xhat[7] = 1.5275, xhat[0] = -1.5275 (each rounded to BF16).
        let x7 = round_to(DType::BF16, 3.5 / 5.25f32.sqrt());
        let up0 = round_to(DType::BF16, 2.0 * x7 + 0.5);
        let want0 = round_to(DType::BF16, x7 / (1.0 + (-x7).exp()) * up0);
        let want1 = round_to(DType::BF16, -x7 / (1.0 + x7.exp()) * -x7);
        assert_eq!(out, vec![want0, want1]);
    }

    #[test]
    fn add_norm_writes_the_residual_stream() {
        let spec = GemvSpec::new(DType::BF16, 8, 2, Arch::Sm90a)
            .with_prologue(GemvPrologue::AddNorm, NormKind::RmsNorm, true)
            .with_epilogue(false, GemvEpilogue::Residual);
        let x: Vec<f32> = (0..16).map(|v| v as f32 * 0.25).collect();
        let a = vec![2.0; 16];
        let zeros = vec![0.0; 8];
        let w: Vec<f32> = (0..8).map(|c| if c == 3 { 1.0 } else { 0.0 }).collect();
        let inp = GemvInputs {
            x: &x,
            add: Some((&a, Some((&zeros, None)))),
            norm: Some((&zeros, None)),
            w: &w,
            w_scale_inv: 0.5,
            bias: None,
            out: &[10.0, 20.0],
        };
        let (out, h) = gemv(&spec, &inp, (2, 1), 1e-6);
        // RMSNorm of a constant row with g = 1 + 0 is 1 (within eps): h = x + 1.
        let h = h.unwrap();
        assert_eq!(h[3], 1.75);
        assert_eq!(h[8 + 3], 3.75);
        // out = out + round(norm(h)[3] * 0.5).
        let rms = |row: &[f32]| (row.iter().map(|v| v * v).sum::<f32>() / 8.0 + 1e-6).sqrt();
        let p0 = round_to(DType::BF16, h[3] / rms(&h[..8]));
        assert_eq!(out[0], round_to(DType::BF16, 10.0 + round_to(DType::BF16, p0 * 0.5)));
    }
}
