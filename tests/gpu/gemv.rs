//! Family 22 on the GPU: the decode GEMV against the CPU reference — each prologue (plain, a
//! norm, a sandwich norm's residual add then a norm, a residual add then a norm), LayerNorm and RMSNorm (zero-centered γ),
//! BF16, E4M3 and E5M2 weights, every epilogue (store, residual, gelu, GeGLU, SwiGLU), one to
//! eight rows, widths that are not tile multiples and a 50k-row head; typed errors.

use crate::common::{assert_close, bf16, device, randn, upload};
use te_codegen::spec::{Activation, GemvEpilogue, GemvPrologue, GemvSpec, NormKind};
use te_reference::gemv::{gemv as reference, GemvInputs};
use te_runtime::graph::HostCopies;
use te_runtime::numerics::round_to;
use te_runtime::ops::gemv::{gemv, max_rows, GemvInput, GemvMatrix, GemvNorm, GemvNormKind, GemvWeight};
use te_runtime::{DType, Error, Tensor};

struct Case {
    weight: DType,
    k: usize,
    m: usize,
    n: usize,
    prologue: GemvPrologue,
    norm: NormKind,
    zc: bool,
    bias: bool,
    epilogue: GemvEpilogue,
}

fn run(case: &Case, seed: u64) {
    let Some(dev) = device() else { return };
    let Case { weight, k, m, n, prologue, norm, zc, bias, epilogue } = *case;
    let what = format!("{weight} k{k} m{m} n{n} {} {} {}", prologue.name(), norm.name(), epilogue.name());
    let wr = epilogue.weight_rows();
    let layer_norm = norm == NormKind::LayerNorm;
    let x = bf16(&randn(seed, m * k, 1.0));
    let a = bf16(&randn(seed + 1, m * k, 2.0));
    let gammas: Vec<Vec<f32>> = (0..2).map(|i| bf16(&randn(seed + 2 + i, k, 0.3))).collect();
    let betas: Vec<Vec<f32>> = (0..2).map(|i| bf16(&randn(seed + 4 + i, k, 0.1))).collect();
    // Weights ~ N(0, 1/√k); FP8 codes of 16× that under scale_inv 1/16.
    let std = 1.0 / (k as f32).sqrt();
    let (w_values, scale_inv) = if weight == DType::BF16 {
        (bf16(&randn(seed + 6, wr * n * k, std)), 1.0)
    } else {
        (randn(seed + 6, wr * n * k, 16.0 * std).into_iter().map(|v| round_to(weight, v)).collect(), 1.0 / 16.0)
    };
    let b = bf16(&randn(seed + 7, wr * n, 0.5));
    let out0 = bf16(&randn(seed + 8, m * n, 1.0));

    let kind = GemvNormKind { kind: norm, eps: 1e-5, zero_centered_gamma: zc };
    let (xd, ad) = (upload(&dev, &x, &[m, k]), upload(&dev, &a, &[m, k]));
    let gd: Vec<Tensor> = gammas.iter().map(|g| upload(&dev, g, &[k])).collect();
    let bd: Vec<Tensor> = betas.iter().map(|g| upload(&dev, g, &[k])).collect();
    let nw = |i: usize| GemvNorm { gamma: &gd[i], beta: layer_norm.then(|| &bd[i]) };
    let wd = Tensor::from_f32(&dev, weight, &[wr * n, k], &w_values).unwrap();
    let s_dev = dev.stream().htod(&[scale_inv]).unwrap();
    let wg =
        if weight == DType::BF16 { GemvWeight::Bf16(&wd) } else { GemvWeight::Fp8 { data: &wd, scale_inv: &s_dev } };
    let bias_d = upload(&dev, &b, &[wr * n]);
    let mut out = upload(&dev, &out0, &[m, n]);
    let mut h_out = Tensor::zeros(&dev, DType::BF16, &[m, k]).unwrap();
    let input = match prologue {
        GemvPrologue::None => GemvInput::Plain(&xd),
        GemvPrologue::Norm => GemvInput::Norm { x: &xd, kind, norm: nw(1) },
        GemvPrologue::AddNorm => {
            GemvInput::AddNorm { x: &xd, a: &ad, kind, post: nw(0), norm: nw(1), h_out: &mut h_out }
        }
        GemvPrologue::ResidualNorm => GemvInput::ResidualNorm { x: &xd, a: &ad, kind, norm: nw(1), h_out: &mut h_out },
    };
    let matrix = GemvMatrix { weight: wg, bias: bias.then_some(&bias_d), constant: (seed / 100) % 2 == 0 };
    gemv(&dev, input, matrix, epilogue, &mut out).unwrap();

    let spec = GemvSpec::new(weight, k, m, dev.arch()).with_prologue(prologue, norm, zc).with_epilogue(bias, epilogue);
    let weights = |i: usize| (gammas[i].as_slice(), layer_norm.then_some(betas[i].as_slice()));
    let inp = GemvInputs {
        x: &x,
        add: match prologue {
            GemvPrologue::AddNorm => Some((a.as_slice(), Some(weights(0)))),
            GemvPrologue::ResidualNorm => Some((a.as_slice(), None)),
            _ => None,
        },
        norm: (prologue != GemvPrologue::None).then(|| weights(1)),
        w: &w_values,
        w_scale_inv: scale_inv,
        bias: bias.then_some(b.as_slice()),
        out: &out0,
    };
    let (want, want_h) = reference(&spec, &inp, (m, n), 1e-5);
    // Sums in another order: a BF16 rounding may land one ulp away (2⁻⁸ relative).
    assert_close(&what, &out.to_f32(&dev).unwrap(), &want, 1e-2, 2e-2);
    if let Some(h) = want_h {
        assert_eq!(h_out.to_f32(&dev).unwrap(), h, "{what}: h_out");
    }
}

#[test]
fn gemv_matches_the_reference() {
    use GemvEpilogue::*;
    use GemvPrologue::*;
    let cases = [
        // Gemma 3 270M's fc1: the sandwich norm's add, RMSNorm (1 + γ), GeGLU.
        Case {
            weight: DType::BF16,
            k: 640,
            m: 1,
            n: 2048,
            prologue: AddNorm,
            norm: NormKind::RmsNorm,
            zc: true,
            bias: false,
            epilogue: Act(Activation::Geglu),
        },
        // GPT's proj + residual in E4M3, three rows, an odd width.
        Case {
            weight: DType::E4M3,
            k: 2048,
            m: 3,
            n: 637,
            prologue: None,
            norm: NormKind::RmsNorm,
            zc: false,
            bias: true,
            epilogue: Residual,
        },
        // GPT's fc1: LayerNorm, bias, gelu, eight rows.
        Case {
            weight: DType::BF16,
            k: 1000,
            m: 8,
            n: 333,
            prologue: Norm,
            norm: NormKind::LayerNorm,
            zc: false,
            bias: true,
            epilogue: Act(Activation::Gelu),
        },
        // Llama's fc1 at k = 8192 (at most six rows), SwiGLU, E5M2.
        Case {
            weight: DType::E5M2,
            k: 8192,
            m: 5,
            n: 96,
            prologue: Norm,
            norm: NormKind::RmsNorm,
            zc: false,
            bias: true,
            epilogue: Act(Activation::Swiglu),
        },
        // A LayerNorm sandwich, storing.
        Case {
            weight: DType::BF16,
            k: 768,
            m: 2,
            n: 2304,
            prologue: AddNorm,
            norm: NormKind::LayerNorm,
            zc: false,
            bias: true,
            epilogue: Store,
        },
        // GPT's fc1 after the attention's residual add: LayerNorm, bias, gelu, two rows.
        Case {
            weight: DType::BF16,
            k: 768,
            m: 2,
            n: 3072,
            prologue: ResidualNorm,
            norm: NormKind::LayerNorm,
            zc: false,
            bias: true,
            epilogue: Act(Activation::Gelu),
        },
        // A head: 50k rows, RMSNorm.
        Case {
            weight: DType::BF16,
            k: 640,
            m: 2,
            n: 50_021,
            prologue: Norm,
            norm: NormKind::RmsNorm,
            zc: true,
            bias: false,
            epilogue: Store,
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        run(case, 100 * i as u64 + 1);
    }
}

/// A BF16 weight without bias, not constant.
fn plain(w: &Tensor) -> GemvMatrix<'_> {
    GemvMatrix { weight: GemvWeight::Bf16(w), bias: None, constant: false }
}

#[test]
fn gemv_refuses_bad_calls() {
    let Some(dev) = device() else { return };
    let x = Tensor::zeros(&dev, DType::BF16, &[2, 64]).unwrap();
    let w = Tensor::zeros(&dev, DType::BF16, &[10, 64]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[2, 10]).unwrap();
    let shape = |e: Error| matches!(e, Error::Shape { .. });
    // A gated activation needs an even number of weight rows: 10 = 2 · 5 works, 9 does not.
    let w9 = Tensor::zeros(&dev, DType::BF16, &[9, 64]).unwrap();
    let e = gemv(&dev, GemvInput::Plain(&x), plain(&w9), GemvEpilogue::Act(Activation::Swiglu), &mut out);
    assert!(shape(e.unwrap_err()));
    // Too many rows for k = 16384 (at most 3).
    let big = Tensor::zeros(&dev, DType::BF16, &[4, 16384]).unwrap();
    let wb = Tensor::zeros(&dev, DType::BF16, &[10, 16384]).unwrap();
    let mut out4 = Tensor::zeros(&dev, DType::BF16, &[4, 10]).unwrap();
    let e = gemv(&dev, GemvInput::Plain(&big), plain(&wb), GemvEpilogue::Store, &mut out4).unwrap_err();
    assert!(e.to_string().contains("takes 1 to 3"), "{e}");
    assert_eq!(max_rows(16384), 3);
    // An RMSNorm with a β.
    let g = Tensor::zeros(&dev, DType::BF16, &[64]).unwrap();
    let kind = GemvNormKind { kind: NormKind::RmsNorm, eps: 1e-6, zero_centered_gamma: false };
    let input = GemvInput::Norm { x: &x, kind, norm: GemvNorm { gamma: &g, beta: Some(&g) } };
    assert!(shape(gemv(&dev, input, plain(&w), GemvEpilogue::Store, &mut out).unwrap_err()));
    // An FP8 weight passed as BF16, and an f32 input.
    let w8 = Tensor::zeros(&dev, DType::E4M3, &[10, 64]).unwrap();
    assert!(gemv(&dev, GemvInput::Plain(&x), plain(&w8), GemvEpilogue::Store, &mut out).is_err());
    let xf = Tensor::zeros(&dev, DType::F32, &[2, 64]).unwrap();
    let e = gemv(&dev, GemvInput::Plain(&xf), plain(&w), GemvEpilogue::Store, &mut out);
    assert!(matches!(e.unwrap_err(), Error::DType { .. }));
    // The output of the wrong shape.
    let mut bad = Tensor::zeros(&dev, DType::BF16, &[2, 11]).unwrap();
    assert!(gemv(&dev, GemvInput::Plain(&x), plain(&w), GemvEpilogue::Store, &mut bad).is_err());
}
