//! `DotProductAttention` on the GPU against the f64 CPU reference
//! (`te_reference::attention`): forward and the three gradients for bshd and sbhd, GQA
//! (8 heads, 2 groups), MQA (1 group) and MHA, every mask type, `sq != sk` where the mask allows
//! it, lengths that are not multiples of 8 (sq = 77, padding lengths [77, 50]), head_dim 64 and
//! 128, f16 and f32 once each; padded positions exactly zero; the padding-mask cache; typed errors.
//! Every bf16/f16 case runs on both backends, fused and unfused (`fused_attention` adds the
//! fused backend's own cases).
//!
//! Tolerances. The unfused path stores the scores, probabilities and their gradients in the
//! inputs' dtype, so outputs near zero carry absolute error from the rounding of `P` and `dP`.
//! Every result must have a relative Frobenius error below `frobenius` and elementwise
//! `|got - want| <= rtol · |want| + atol · max|want|`: for bf16 TE's rtol 1.6e-2 with atol 1% of
//! the largest magnitude (a host emulation of the same GEMMs with every intermediate rounded to
//! bf16 needs at most 0.6% on these cases and errs below 0.45% in Frobenius norm,
//! `modules::attention::plan` tests); f16 TE's rtol 1e-3 with atol 0.2% (its unit is 8× finer);
//! f32 1e-4 (the GEMMs compute in pure f32; the softmax's `ex2.approx` errs by ~2 ulps).

use crate::common::{device, randn};
use te_nn::modules::{AttentionBackend, AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use te_reference::attention as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::{DType, Device, Error, Tensor};

/// `(frobenius, rtol, atol as a fraction of max |want|)`; see the module docs.
fn tolerance(dtype: DType) -> (f32, f32, f32) {
    match dtype {
        DType::BF16 => (1e-2, 1.6e-2, 1e-2),
        DType::F16 => (2e-3, 1e-3, 2e-3),
        // TE's E4M3 rtol / atol (tests/pytorch/utils.py); the Frobenius bound is this project's.
        DType::E4M3 => (5e-2, 0.125, 0.0675),
        _ => (1e-4, 1e-4, 1e-4),
    }
}

pub(crate) fn check(what: &str, dtype: DType, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (frobenius, rtol, atol) = tolerance(dtype);
    let amax = want.iter().fold(0f32, |a, &w| a.max(w.abs()));
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| (w as f64).powi(2)).sum();
    let e = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
    assert!(e < frobenius as f64, "{what}: relative Frobenius error {e:.3e} (bound {frobenius})");
    let bad: Vec<_> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (&g, &w))| g.is_nan() || (g - w).abs() > rtol * w.abs() + atol * amax)
        .take(3)
        .collect();
    assert!(bad.is_empty(), "{what}: elements off (index, (got, want)): {bad:?}; rtol {rtol}, atol {atol} × {amax}");
}

/// One attention call to test.
#[derive(Debug, Clone)]
pub(crate) struct Case {
    pub format: QkvFormat,
    pub mask: AttnMaskType,
    pub dtype: DType,
    pub batch: usize,
    pub sq: usize,
    pub sk: usize,
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    pub seq_lens: Option<Vec<usize>>,
    /// TE's `window_size` (`None` in [`Case::new`]).
    pub window: Option<(i64, i64)>,
    /// `Auto` in [`Case::new`]; [`check_case`] runs each backend that takes the dtype.
    pub backend: AttentionBackend,
}

impl Case {
    pub fn new(
        format: QkvFormat,
        mask: AttnMaskType,
        (sq, sk): (usize, usize),
        groups: usize,
        head_dim: usize,
    ) -> Self {
        let seq_lens = mask.is_padding().then(|| vec![77, 50]);
        let backend = AttentionBackend::Auto;
        let (dtype, window) = (DType::BF16, None);
        Case { format, mask, dtype, batch: 2, sq, sk, heads: 8, groups, head_dim, seq_lens, window, backend }
    }

    pub fn config(&self) -> DotProductAttentionConfig {
        DotProductAttentionConfig {
            backend: self.backend,
            num_gqa_groups: Some(self.groups),
            qkv_format: self.format,
            attn_mask_type: self.mask,
            window_size: self.window,
            ..DotProductAttentionConfig::new(self.heads, self.head_dim)
        }
    }

    /// The problem the reference runs (scale `1 / √head_dim`, the mask's resolved window); the
    /// padding lengths are [`Case::seq_lens`].
    pub fn reference(&self) -> AttentionShape {
        let shape = AttentionShape::new(
            self.format.into(),
            self.batch,
            (self.sq, self.sk),
            (self.heads, self.groups),
            self.head_dim,
        )
        .with_mask(self.mask, self.window);
        shape.validate("test").unwrap();
        shape
    }
}

/// Host values of q, k, v and d_out (N(0, 1), rounded to the dtype).
pub(crate) struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_out: Vec<f32>,
}

impl Inputs {
    pub fn new(c: &Case, seed: u64) -> Self {
        let r = c.reference();
        let values = |seed, n| -> Vec<f32> { randn(seed, n, 1.0).into_iter().map(|x| round_to(c.dtype, x)).collect() };
        Inputs {
            q: values(seed, r.q_len()),
            k: values(seed + 1, r.kv_len()),
            v: values(seed + 2, r.kv_len()),
            d_out: values(seed + 3, r.q_len()),
        }
    }
}

/// The GPU's `(out, dq, dk, dv)` on the host.
pub(crate) type Results = [Vec<f32>; 4];

/// Forward and backward of `attn` on the GPU; checks the shapes and (unless `Auto`) that the
/// case's backend ran.
pub(crate) fn run(dev: &Device, attn: &mut DotProductAttention, c: &Case, x: &Inputs) -> Results {
    let q_shape = c.format.shape(c.batch, c.sq, c.heads, c.head_dim);
    let kv_shape = c.format.shape(c.batch, c.sk, c.groups, c.head_dim);
    let upload = |v: &[f32], shape: &[usize]| Tensor::from_f32(dev, c.dtype, shape, v).unwrap();
    let (q, k, v) = (upload(&x.q, &q_shape), upload(&x.k, &kv_shape), upload(&x.v, &kv_shape));
    let (out, ctx) = attn.forward(&q, &k, &v, c.seq_lens.as_deref()).unwrap();
    if c.backend != AttentionBackend::Auto {
        assert_eq!(ctx.backend(), c.backend, "{c:?}: backend");
    }
    let out_shape = [q_shape[0], q_shape[1], c.heads * c.head_dim];
    assert_eq!((out.shape(), out.dtype()), (&out_shape[..], c.dtype), "{c:?}: output");
    let (dq, dk, dv) = attn.backward(ctx, &upload(&x.d_out, &out_shape)).unwrap();
    assert_eq!((dq.shape(), dk.shape(), dv.shape()), (&q_shape[..], &kv_shape[..], &kv_shape[..]), "{c:?}: grads");
    [out, dq, dk, dv].map(|t| t.to_f32(dev).unwrap())
}

/// The backends that take `dtype`: fused (bf16, f16) and unfused.
pub(crate) fn backends(dtype: DType) -> Vec<AttentionBackend> {
    match dtype {
        DType::F32 => vec![AttentionBackend::Unfused],
        _ => vec![AttentionBackend::Fused, AttentionBackend::Unfused],
    }
}

/// Runs `c` on a fresh module per backend (each one that takes the dtype, unless the case
/// names one) and checks everything against the reference; returns the first backend's GPU
/// results and the inputs for further checks.
pub(crate) fn check_case(dev: &std::sync::Arc<Device>, c: &Case, seed: u64) -> (Results, Inputs) {
    let x = Inputs::new(c, seed);
    let list = if c.backend == AttentionBackend::Auto { backends(c.dtype) } else { vec![c.backend] };
    let mut first = None;
    for backend in list {
        let c = Case { backend, ..c.clone() };
        let mut attn = DotProductAttention::new(dev, c.config()).unwrap();
        let got = run(dev, &mut attn, &c, &x);
        compare(&c, &x, &got);
        first.get_or_insert(got);
    }
    (first.unwrap(), x)
}

pub(crate) fn compare(c: &Case, x: &Inputs, got: &Results) {
    let r = c.reference();
    let lens = c.seq_lens.as_deref();
    let f = reference::forward(&r, lens, &x.q, &x.k, &x.v);
    let g = reference::backward(&r, lens, &x.q, &x.k, &x.v, &x.d_out);
    let what = format!(
        "{} {:?} {} window {:?} {} b{} sq{} sk{} h{} g{} d{} lens {:?}",
        c.backend.name(),
        c.format,
        c.mask.name(),
        c.window,
        c.dtype,
        c.batch,
        c.sq,
        c.sk,
        c.heads,
        c.groups,
        c.head_dim,
        c.seq_lens
    );
    for (name, got, want) in
        [("out", &got[0], &f.out), ("dq", &got[1], &g.dq), ("dk", &got[2], &g.dk), ("dv", &got[3], &g.dv)]
    {
        check(&format!("{what}: {name}"), c.dtype, got, want);
    }
}

#[test]
fn no_mask_matches_reference() {
    let Some(dev) = device() else { return };
    check_case(&dev, &Case::new(QkvFormat::Bshd, AttnMaskType::NoMask, (77, 128), 2, 64), 10);
    check_case(&dev, &Case::new(QkvFormat::Sbhd, AttnMaskType::NoMask, (77, 128), 1, 128), 20);
}

#[test]
fn causal_matches_reference() {
    let Some(dev) = device() else { return };
    // Top-left aligned, sq != sk both ways; MHA (8 groups) and GQA.
    check_case(&dev, &Case::new(QkvFormat::Bshd, AttnMaskType::Causal, (77, 100), 8, 128), 30);
    check_case(&dev, &Case::new(QkvFormat::Sbhd, AttnMaskType::Causal, (100, 77), 2, 64), 40);
}

#[test]
fn bottom_right_masks_and_windows_match_reference() {
    let Some(dev) = device() else { return };
    use AttnMaskType::*;
    // sq < sk (decoding with a cache), sq > sk (queries with no key give zeros), windows around
    // both diagonals and a two-sided window without a causal mask; both backends each.
    for (i, (format, mask, sizes, window)) in [
        (QkvFormat::Bshd, CausalBottomRight, (77, 130), None),
        (QkvFormat::Sbhd, CausalBottomRight, (130, 77), None),
        (QkvFormat::Bshd, CausalBottomRight, (77, 130), Some((40, 0))),
        (QkvFormat::Sbhd, Causal, (100, 100), Some((33, 0))),
        (QkvFormat::Bshd, NoMask, (90, 150), Some((20, 7))),
        (QkvFormat::Bshd, PaddingCausalBottomRight, (77, 77), None),
        (QkvFormat::Sbhd, Padding, (77, 77), Some((5, 16))),
    ]
    .into_iter()
    .enumerate()
    {
        let c = Case { window, ..Case::new(format, mask, sizes, 2, 64) };
        let (got, _) = check_case(&dev, &c, 200 + i as u64);
        if mask.is_padding() {
            check_padded_zeros(&c, &got);
        }
    }
}

/// Padded queries give exactly zero outputs and query gradients; padded keys get exactly zero
/// key and value gradients.
pub(crate) fn check_padded_zeros(c: &Case, got: &Results) {
    let lens = c.seq_lens.as_deref().unwrap();
    let at = |seq: usize, n: usize, b: usize, s: usize| -> std::ops::Range<usize> {
        let outer = match c.format {
            QkvFormat::Bshd => b * seq + s,
            QkvFormat::Sbhd => s * c.batch + b,
        };
        outer * n * c.head_dim..(outer + 1) * n * c.head_dim
    };
    for (b, &len) in lens.iter().enumerate() {
        for s in len..c.sq {
            for (name, t) in [("out", &got[0]), ("dq", &got[1])] {
                assert!(t[at(c.sq, c.heads, b, s)].iter().all(|&v| v == 0.0), "{name}: query {s} of sequence {b}");
            }
        }
        for s in len..c.sk {
            for (name, t) in [("dk", &got[2]), ("dv", &got[3])] {
                assert!(t[at(c.sk, c.groups, b, s)].iter().all(|&v| v == 0.0), "{name}: key {s} of sequence {b}");
            }
        }
    }
}

#[test]
fn padding_matches_reference_and_zeros_padded_positions() {
    let Some(dev) = device() else { return };
    for (c, seed) in [
        (Case::new(QkvFormat::Bshd, AttnMaskType::Padding, (77, 77), 1, 64), 50),
        (Case::new(QkvFormat::Sbhd, AttnMaskType::Padding, (77, 77), 2, 128), 60),
        (Case::new(QkvFormat::Bshd, AttnMaskType::PaddingCausal, (77, 77), 2, 128), 70),
        (Case::new(QkvFormat::Sbhd, AttnMaskType::PaddingCausal, (77, 77), 1, 64), 80),
    ] {
        let (got, _) = check_case(&dev, &c, seed);
        check_padded_zeros(&c, &got);
    }
}

#[test]
fn padding_mask_follows_new_lengths() {
    let Some(dev) = device() else { return };
    // One module, three calls: the cached mask (the cu_seqlens) follow when the lengths change.
    for backend in backends(DType::BF16) {
        let mut c = Case { backend, ..Case::new(QkvFormat::Bshd, AttnMaskType::PaddingCausal, (77, 77), 2, 64) };
        let mut attn = DotProductAttention::new(&dev, c.config()).unwrap();
        for (lens, seed) in [(vec![77, 50], 90), (vec![33, 77], 91), (vec![77, 50], 92)] {
            c.seq_lens = Some(lens);
            let x = Inputs::new(&c, seed);
            let got = run(&dev, &mut attn, &c, &x);
            compare(&c, &x, &got);
            check_padded_zeros(&c, &got);
        }
    }
}

#[test]
fn f16_and_f32_match_reference() {
    let Some(dev) = device() else { return };
    let f16 = Case { dtype: DType::F16, ..Case::new(QkvFormat::Sbhd, AttnMaskType::Causal, (77, 77), 2, 64) };
    check_case(&dev, &f16, 100);
    let f32 = Case { dtype: DType::F32, ..Case::new(QkvFormat::Bshd, AttnMaskType::Padding, (77, 77), 1, 64) };
    check_case(&dev, &f32, 110);
}

#[test]
fn errors_are_typed_and_say_what_to_do() {
    let Some(dev) = device() else { return };
    let base = DotProductAttentionConfig {
        qkv_format: QkvFormat::Bshd,
        attn_mask_type: AttnMaskType::NoMask,
        num_gqa_groups: Some(2),
        ..DotProductAttentionConfig::new(8, 64)
    };
    // Configurations.
    let e = DotProductAttention::new(&dev, DotProductAttentionConfig { num_gqa_groups: Some(3), ..base.clone() })
        .unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("must divide num_attention_heads"), "{e}");
    let e = DotProductAttention::new(&dev, DotProductAttentionConfig { attention_dropout: 1.5, ..base.clone() })
        .unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("attention_dropout must be in [0, 1]"), "{e}");

    let mut attn = DotProductAttention::new(&dev, base.clone()).unwrap();
    let t = |dtype, shape: &[usize]| Tensor::zeros(&dev, dtype, shape).unwrap();
    let (q, kv) = (t(DType::BF16, &[2, 16, 8, 64]), t(DType::BF16, &[2, 24, 2, 64]));
    // Shapes: q heads, k groups, v unlike k, a 3-D q, head_dim.
    let shape_err = |r: te_runtime::Result<(Tensor, te_nn::modules::AttentionCtx)>, what: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::Shape { .. }), "{what}: {e}");
        e.to_string()
    };
    let e = shape_err(attn.forward(&t(DType::BF16, &[2, 16, 4, 64]), &kv, &kv, None), "q heads");
    assert!(e.contains("num_attention_heads = 8"), "{e}");
    let e = shape_err(attn.forward(&q, &t(DType::BF16, &[2, 24, 8, 64]), &kv, None), "k groups");
    assert!(e.contains("num_gqa_groups = 2"), "{e}");
    let e = shape_err(attn.forward(&q, &kv, &t(DType::BF16, &[2, 20, 2, 64]), None), "v");
    assert!(e.contains("`v`"), "{e}");
    let e = shape_err(attn.forward(&t(DType::BF16, &[2, 16, 512]), &kv, &kv, None), "3-D q");
    assert!(e.contains("4-D"), "{e}");
    let e = shape_err(attn.forward(&t(DType::BF16, &[3, 16, 8, 64]), &kv, &kv, None), "batch");
    assert!(e.contains("q's batch of 3"), "{e}");
    shape_err(attn.forward(&t(DType::BF16, &[2, 16, 8, 32]), &kv, &kv, None), "head_dim");
    // Dtypes: FP8 q, k unlike q.
    let e = attn.forward(&t(DType::E4M3, &[2, 16, 8, 64]), &kv, &kv, None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "q", .. }), "{e}");
    let e = attn.forward(&q, &t(DType::F16, &[2, 24, 2, 64]), &kv, None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "k", .. }), "{e}");
    // seq_lens given without a padding mask.
    let e = attn.forward(&q, &kv, &kv, Some(&[16, 8])).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("only read by padding masks"), "{e}");
    // seq_lens missing, of the wrong count, or too long for a padding mask.
    let cfg = DotProductAttentionConfig { attn_mask_type: AttnMaskType::Padding, ..base.clone() };
    let mut padded = DotProductAttention::new(&dev, cfg).unwrap();
    let e = padded.forward(&q, &kv, &kv, None).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("needs seq_lens"), "{e}");
    let e = shape_err(padded.forward(&q, &kv, &kv, Some(&[16])), "seq_lens count");
    assert!(e.contains("one length per sequence (2)"), "{e}");
    let e = shape_err(padded.forward(&q, &kv, &kv, Some(&[16, 25])), "seq_lens too long");
    assert!(e.contains("seq_lens[1] = 25"), "{e}");
    padded.forward(&q, &kv, &kv, Some(&[16, 24])).unwrap();

    // Backward: a context of another module, a d_out of the wrong shape or dtype.
    let (out, ctx) = attn.forward(&q, &kv, &kv, None).unwrap();
    let mut other = DotProductAttention::new(&dev, base).unwrap();
    let d_out = t(DType::BF16, out.shape());
    let e = other.backward(ctx, &d_out).unwrap_err();
    assert!(matches!(e, Error::Context { .. }) && e.to_string().contains("another DotProductAttention"), "{e}");
    let (_, ctx) = attn.forward(&q, &kv, &kv, None).unwrap();
    let e = attn.backward(ctx, &q).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[2, 16, 512]"), "{e}");
    let (_, ctx) = attn.forward(&q, &kv, &kv, None).unwrap();
    let e = attn.backward(ctx, &t(DType::F16, out.shape())).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "d_out", .. }), "{e}");
    let (_, ctx) = attn.forward(&q, &kv, &kv, None).unwrap();
    attn.backward(ctx, &d_out).unwrap();
}

/// Attention dropout: p = 1 drops every probability (output and every gradient exactly 0);
/// p = 0.5 keeps about half, so the output moves away from the undropped one, and backward uses
/// the same mask (dv = 0 where every probability of a key was dropped is not required, only
/// finiteness and a change).
#[test]
fn attention_dropout_is_wired_forward_and_backward() {
    let Some(dev) = device() else { return };
    let (b, s, h, d) = (2, 48, 4, 64);
    let shape = [s, b, h, d];
    let n = s * b * h * d;
    let t = |seed| {
        let v: Vec<f32> = randn(seed, n, 1.0).iter().map(|&x| round_to(DType::BF16, x)).collect();
        Tensor::from_f32(&dev, DType::BF16, &shape, &v).unwrap()
    };
    let (q, k, v, dout) = (t(1), t(2), t(3), t(4));
    let dout = dout.reshape(&[s, b, h * d]).unwrap();
    let run = |p: f32| {
        let cfg = DotProductAttentionConfig { attention_dropout: p, ..DotProductAttentionConfig::new(h, d) };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        let (out, ctx) = attn.forward(&q, &k, &v, None).unwrap();
        let (dq, dk, dv) = attn.backward(ctx, &dout).unwrap();
        [out, dq, dk, dv].map(|x| x.to_f32(&dev).unwrap())
    };
    for (i, x) in run(1.0).iter().enumerate() {
        assert!(x.iter().all(|&v| v == 0.0), "p = 1: tensor {i} must be all zeros");
    }
    let (none, half) = (run(0.0), run(0.5));
    for (i, (a, b)) in none.iter().zip(&half).enumerate() {
        assert!(b.iter().all(|v| v.is_finite()), "p = 0.5: tensor {i} finite");
        assert!(a != b, "p = 0.5 changes tensor {i}");
    }
}

/// Attention dropout draws the same mask in both backends from the same stream: the fused
/// kernels (mask recomputed in the forward and both backward kernels) match the unfused backend
/// (mask kept as bits) in the output and every gradient, for GQA, a padding mask and a window.
#[test]
fn fused_dropout_replays_the_unfused_mask() {
    let Some(dev) = device() else { return };
    // sk = 77: each score draws its Philox block; sk = 80, 128: four keys share one (shuffles).
    for (mask, window, p, sizes) in [
        (AttnMaskType::Causal, None, 0.3f32, (77, 77)),
        (AttnMaskType::PaddingCausalBottomRight, Some((30, 0)), 0.1, (77, 77)),
        (AttnMaskType::NoMask, None, 0.5, (77, 80)),
        (AttnMaskType::Causal, None, 0.2, (128, 128)),
        (AttnMaskType::PaddingCausal, None, 0.2, (80, 80)),
    ] {
        let c = Case { window, ..Case::new(QkvFormat::Sbhd, mask, sizes, 2, 64) };
        let x = Inputs::new(&c, 500);
        let mut results = Vec::new();
        for backend in [AttentionBackend::Fused, AttentionBackend::Unfused] {
            let c = Case { backend, ..c.clone() };
            let cfg = DotProductAttentionConfig { attention_dropout: p, ..c.config() };
            let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
            attn.set_dropout_rng(1234, 40);
            results.push(run(&dev, &mut attn, &c, &x));
        }
        let what = format!("{} window {window:?} p {p}", mask.name());
        for (i, name) in ["out", "dq", "dk", "dv"].iter().enumerate() {
            check(&format!("{what}: fused vs unfused {name}"), DType::BF16, &results[0][i], &results[1][i]);
        }
        // Another stream gives another mask.
        let c = Case { backend: AttentionBackend::Fused, ..c };
        let cfg = DotProductAttentionConfig { attention_dropout: p, ..c.config() };
        let mut attn = DotProductAttention::new(&dev, cfg).unwrap();
        attn.set_dropout_rng(1234, 41);
        assert_ne!(run(&dev, &mut attn, &c, &x)[0], results[0][0], "{what}: offset 41 drew the same mask");
    }
}
