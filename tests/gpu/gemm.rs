//! cuBLASLt GEMMs on the GPU against the f64 reference GEMM of the operands the GPU reads (FP8
//! operands dequantized: codes × scale_inv), at shapes that are not tile multiples (FP8 dims
//! multiples of 16), with non-trivial scale_invs.
//!
//! Tolerances. A GEMM output differs from the f64 reference by its rounding to the output type
//! plus f32 (or, with fast accumulation, coarser) accumulation error, which is absolute: an
//! output near zero is a sum whose terms cancel. So every check is: relative Frobenius error
//! below `min(rtol, 1e-2)`, and elementwise `|got - want| <= rtol · (|want| + rms(want))`,
//! with TE's rtol of the output dtype (bf16 1.6e-2, f16 1e-3), 1e-5 for f32 outputs of
//! bf16/f16/f32 operands (pure f32 compute: TF32 would miss it by 100×), and bf16's 1.6e-2 for
//! every FP8 GEMM (the FP8 accumulator is not f32-exact). FP8 outputs: codes within one FP8
//! step of the reference's quantization of the f32 result, amax within 4e-3 (bf16 rounding).
//!
//! Strided batched GEMMs address matrices inside larger tensors (offsets, row strides above the
//! row length, side-by-side and stacked batches, an element offset that leaves pointers 2-byte
//! aligned) and must leave the rest of the output untouched.
//!
//! Epilogues cuBLASLt may not offer for a dtype combination are run anyway: either the result
//! matches the reference or the call fails with `Error::Gemm`; run with `--nocapture` to see
//! which were rejected.

use crate::common::{device, randn};
use cudarc::driver::CudaSlice;
use te_reference::{cast as ref_cast, gemm as ref_gemm};
use te_runtime::gemm::{gemm, gemm_strided_batched, Epilogue, GemmConfig, MatrixView, Operand, Output, StridedBatch};
use te_runtime::numerics;
use te_runtime::{DType, Device, Error, Tensor};

/// A GEMM input on the device and the f32 values the GPU reads from it.
struct Input {
    tensor: Tensor,
    scale_inv: Option<CudaSlice<f32>>,
    values: Vec<f32>,
}

impl Input {
    /// `N(0, 1)` values of `shape`: quantized with `scale` for FP8 dtypes, rounded otherwise.
    fn new(dev: &Device, dtype: DType, shape: &[usize], seed: u64, scale: f32) -> Input {
        let x = randn(seed, shape.iter().product(), 1.0);
        if dtype.is_fp8() {
            let (codes, _, scale_inv) = ref_cast::quantize(&x, dtype, scale);
            Input {
                tensor: Tensor::from_bytes(dev, dtype, shape, &codes).unwrap(),
                scale_inv: Some(dev.stream().clone_htod(&[scale_inv]).unwrap()),
                values: ref_cast::dequantize(&codes, dtype, scale_inv),
            }
        } else {
            let values: Vec<f32> = x.iter().map(|&v| numerics::round_to(dtype, v)).collect();
            Input { tensor: Tensor::from_f32(dev, dtype, shape, &values).unwrap(), scale_inv: None, values }
        }
    }

    fn operand(&self) -> Operand<'_> {
        Operand {
            tensor: &self.tensor,
            transposed: false,
            scale_inv: self.scale_inv.as_ref().map(|s| s.as_view()),
            block: None,
        }
    }
}

/// The elementwise rtol for an output of `out` from `input` operands (see the module doc).
fn rtol(input: DType, out: DType) -> f32 {
    match (input.is_fp8(), out) {
        (true, _) | (false, DType::BF16) => 1.6e-2,
        (false, DType::F16) => 1e-3,
        _ => 1e-5,
    }
}

fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// Relative Frobenius error below `min(rtol, 1e-2)` and elementwise
/// `|got - want| <= rtol · (|want| + rms(want))`.
fn assert_gemm_close(what: &str, got: &[f32], want: &[f32], rtol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w as f64).powi(2)).sum::<f64>().sqrt();
    let norm = rms(want) * (want.len() as f64).sqrt();
    let frob = diff / norm.max(f64::MIN_POSITIVE);
    assert!(frob < (rtol as f64).min(1e-2), "{what}: relative Frobenius error {frob:.3e} (rtol {rtol})");
    let floor = rms(want) as f32;
    let bad: Vec<_> = got
        .iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (&g, &w))| g.is_nan() || (g - w).abs() > rtol * (w.abs() + floor))
        .take(3)
        .collect();
    assert!(bad.is_empty(), "{what}: elements off (index, (got, want)): {bad:?}; rtol {rtol}, rms {floor}");
}

/// True when the GEMM ran; false (and a note) when cuBLASLt rejected it with `Error::Gemm`.
fn ran(what: &str, result: te_runtime::Result<()>) -> bool {
    match result {
        Ok(()) => true,
        Err(Error::Gemm { message }) => {
            eprintln!("{what}: rejected by cuBLASLt: {message}");
            false
        }
        Err(e) => panic!("{what}: {e}"),
    }
}

/// Runs `d = a · bᵀ` (no epilogue) into a fresh `[m, n]` output of `out` and returns it.
fn run_plain(dev: &Device, a: &Input, b: &Input, out: DType, cfg: &GemmConfig<'_>) -> Vec<f32> {
    let (m, n) = (a.tensor.as_2d("test").unwrap().0, b.tensor.as_2d("test").unwrap().0);
    let mut d = Tensor::zeros(dev, out, &[m, n]).unwrap();
    gemm(dev, a.operand(), b.operand(), Output::new(&mut d), cfg).unwrap();
    d.to_f32(dev).unwrap()
}

#[test]
fn fp8_matches_dequantized_reference() {
    let Some(dev) = device() else { return };
    // `a` is [4, 50, 208]: its leading dims fold into m = 200 rows.
    let (m, n, k) = (200, 336, 208);
    for (i, (ta, tb)) in
        [(DType::E4M3, DType::E4M3), (DType::E4M3, DType::E5M2), (DType::E5M2, DType::E4M3)].into_iter().enumerate()
    {
        let a = Input::new(&dev, ta, &[4, 50, k], 10 + i as u64, 3.7);
        let b = Input::new(&dev, tb, &[n, k], 20 + i as u64, 0.45);
        let want = ref_gemm::gemm_tn(&a.values, &b.values, m, n, k);
        for out in [DType::BF16, DType::F16, DType::F32] {
            for fast_accum in [true, false] {
                let cfg = GemmConfig { fast_accum, ..Default::default() };
                let got = run_plain(&dev, &a, &b, out, &cfg);
                let what = format!("{ta} × {tb} → {out}, fast_accum {fast_accum}");
                assert_gemm_close(&what, &got, &want, rtol(ta, out));
            }
        }
    }
}

#[test]
fn fp8_m_needs_no_padding() {
    let Some(dev) = device() else { return };
    let (m, n, k) = (37, 48, 64);
    let a = Input::new(&dev, DType::E4M3, &[m, k], 30, 2.0);
    let b = Input::new(&dev, DType::E4M3, &[n, k], 31, 5.0);
    let got = run_plain(&dev, &a, &b, DType::BF16, &GemmConfig::default());
    assert_gemm_close("e4m3 × e4m3 → bf16, m = 37", &got, &ref_gemm::gemm_tn(&a.values, &b.values, m, n, k), 1.6e-2);
}

#[test]
fn high_precision_paths() {
    let Some(dev) = device() else { return };
    // High-precision GEMMs take any shape.
    let (m, n, k) = (37, 45, 53);
    let pairs =
        [(DType::BF16, DType::BF16), (DType::BF16, DType::F32), (DType::F16, DType::F16), (DType::F16, DType::F32)];
    for (dtype, out) in pairs.into_iter().chain([(DType::F32, DType::F32)]) {
        let a = Input::new(&dev, dtype, &[m, k], 40, 1.0);
        let b = Input::new(&dev, dtype, &[n, k], 41, 1.0);
        let want: Vec<f32> = ref_gemm::gemm_tn(&a.values, &b.values, m, n, k).iter().map(|v| -0.75 * v).collect();
        let got = run_plain(&dev, &a, &b, out, &GemmConfig { alpha: -0.75, ..Default::default() });
        assert_gemm_close(&format!("{dtype} × {dtype} → {out}, alpha -0.75"), &got, &want, rtol(dtype, out));
    }
}

#[test]
fn accumulate_into_f32() {
    let Some(dev) = device() else { return };
    let (m, n, k) = (80, 144, 112);
    for (ta, tb) in [(DType::BF16, DType::BF16), (DType::E4M3, DType::E5M2)] {
        let a = Input::new(&dev, ta, &[m, k], 50, 3.0);
        let b = Input::new(&dev, tb, &[n, k], 51, 0.7);
        let init = randn(52, m * n, 4.0);
        let mut d = Tensor::from_f32(&dev, DType::F32, &[m, n], &init).unwrap();
        let cfg = GemmConfig { accumulate: true, ..Default::default() };
        gemm(&dev, a.operand(), b.operand(), Output::new(&mut d), &cfg).unwrap();
        let want: Vec<f32> =
            ref_gemm::gemm_tn(&a.values, &b.values, m, n, k).iter().zip(&init).map(|(p, i)| p + i).collect();
        assert_gemm_close(&format!("{ta} × {tb} += f32"), &d.to_f32(&dev).unwrap(), &want, rtol(ta, DType::F32));
    }
}

/// Position of an FP8 code on the number line (sign-magnitude codes are monotonic per sign).
fn code_rank(q: u8) -> i32 {
    if q & 0x80 != 0 {
        -((q & 0x7f) as i32)
    } else {
        q as i32
    }
}

/// Runs an FP8-output GEMM with `scale` and amax pre-filled with 1e9 (cuBLASLt overwrites it);
/// returns `None` when cuBLASLt rejects the combination, else checks codes and amax.
fn check_fp8_output(dev: &Device, ta: DType, tb: DType, out: DType, scale_of_amax: f32) -> Option<()> {
    let (m, n, k) = (80, 144, 112);
    let a = Input::new(dev, ta, &[m, k], 60, 3.0);
    let b = Input::new(dev, tb, &[n, k], 61, 0.6);
    let result = ref_gemm::gemm_tn(&a.values, &b.values, m, n, k);
    let scale = scale_of_amax * out.fp8_max().unwrap() / ref_cast::amax(&result);
    let (want_q, want_amax, _) = ref_cast::quantize(&result, out, scale);
    let mut d = Tensor::zeros(dev, out, &[m, n]).unwrap();
    let scale_buf = dev.stream().clone_htod(&[scale]).unwrap();
    let mut amax = dev.stream().clone_htod(&[1e9f32]).unwrap();
    let what = format!("{ta} × {tb} → {out}, scale {scale_of_amax} × fp8_max / amax");
    let output = Output::fp8(&mut d, scale_buf.as_view(), amax.as_view_mut());
    if !ran(&what, gemm(dev, a.operand(), b.operand(), output, &GemmConfig::default())) {
        return None;
    }
    let got_amax = dev.stream().clone_dtoh(&amax).unwrap()[0];
    assert!(
        (got_amax - want_amax).abs() <= 4e-3 * want_amax,
        "{what}: amax {got_amax}, want {want_amax} (1e9 before the call: it must be overwritten)"
    );
    // The tensor cores' f32 accumulation errs by a small fraction of the output's magnitude:
    // near zero that can move a code by more than one step, so codes match within one step or
    // within 1e-3 of the scaled amax.
    let atol = 1e-3 * scale * want_amax;
    let got_q = d.to_bytes(dev).unwrap();
    for (i, (&g, &w)) in got_q.iter().zip(&want_q).enumerate() {
        let (gv, wv) = (numerics::dequantize(out, g), numerics::dequantize(out, w));
        let near = (code_rank(g) - code_rank(w)).abs() <= 1 || (gv - wv).abs() <= atol;
        assert!(gv.is_finite() && near, "{what}: code {g:#04x} at {i}, want {w:#04x}");
    }
    Some(())
}

#[test]
fn fp8_output_with_scale_and_amax() {
    let Some(dev) = device() else { return };
    check_fp8_output(&dev, DType::E4M3, DType::E4M3, DType::E4M3, 0.5).expect("e4m3 × e4m3 → e4m3 must run");
    // cuBLASLt lists e5m2 outputs for mixed inputs; the others are reported if rejected.
    check_fp8_output(&dev, DType::E4M3, DType::E5M2, DType::E5M2, 0.5);
    check_fp8_output(&dev, DType::E4M3, DType::E5M2, DType::E4M3, 0.5);
    check_fp8_output(&dev, DType::E4M3, DType::E4M3, DType::E5M2, 0.5);
}

#[test]
fn fp8_output_saturates() {
    let Some(dev) = device() else { return };
    // A scale 1.5× too large: the top third of |D| must saturate to ±448, not become NaN.
    check_fp8_output(&dev, DType::E4M3, DType::E4M3, DType::E4M3, 1.5).expect("e4m3 × e4m3 → e4m3 must run");
}

/// One epilogue case: runs it and checks every output against the reference; false when
/// cuBLASLt rejects it.
fn check_epilogue(dev: &Device, ta: DType, tb: DType, out: DType, kind: &str) -> bool {
    let (m, n, k) = (80, 144, 112);
    let a = Input::new(dev, ta, &[m, k], 70, 2.5);
    let b = Input::new(dev, tb, &[n, k], 71, 0.8);
    let product = ref_gemm::gemm_tn(&a.values, &b.values, m, n, k);
    // In the combinations tested here, vectors and `pre_gelu` have D's type (see `Epilogue`).
    let rounded = |seed: u64, len: usize, std: f32| -> Vec<f32> {
        randn(seed, len, std).into_iter().map(|v| numerics::round_to(out, v)).collect()
    };
    let tol = rtol(ta, out);
    let what = format!("{ta} × {tb} → {out}, {kind}");
    let mut d = Tensor::zeros(dev, out, &[m, n]).unwrap();
    let run = |d: &mut Tensor, epilogue: Epilogue<'_>| {
        let cfg = GemmConfig { epilogue, ..Default::default() };
        gemm(dev, a.operand(), b.operand(), Output::new(d), &cfg)
    };
    match kind {
        "none" => {
            if !ran(&what, run(&mut d, Epilogue::None)) {
                return false;
            }
            assert_gemm_close(&what, &d.to_f32(dev).unwrap(), &product, tol);
        }
        "bias" => {
            let bias = rounded(72, n, 1.0);
            let bias_t = Tensor::from_f32(dev, out, &[n], &bias).unwrap();
            if !ran(&what, run(&mut d, Epilogue::Bias(&bias_t))) {
                return false;
            }
            assert_gemm_close(&what, &d.to_f32(dev).unwrap(), &ref_gemm::add_bias(&product, &bias), tol);
        }
        "gelu_aux_bias" => {
            let bias = rounded(73, n, 1.0);
            let bias_t = Tensor::from_f32(dev, out, &[n], &bias).unwrap();
            let mut pre_gelu = Tensor::zeros(dev, out, &[m, n]).unwrap();
            let epilogue = Epilogue::GeluAuxBias { bias: &bias_t, pre_gelu: &mut pre_gelu };
            if !ran(&what, run(&mut d, epilogue)) {
                return false;
            }
            let (want_d, want_pre) = ref_gemm::gelu_aux_bias(&product, &bias);
            assert_gemm_close(&what, &d.to_f32(dev).unwrap(), &want_d, tol);
            assert_gemm_close(&format!("{what}: pre_gelu"), &pre_gelu.to_f32(dev).unwrap(), &want_pre, tol);
        }
        "dgelu_bgrad" => {
            let pre = rounded(74, m * n, 2.0);
            let pre_t = Tensor::from_f32(dev, out, &[m, n], &pre).unwrap();
            let mut bgrad = Tensor::zeros(dev, out, &[n]).unwrap();
            let epilogue = Epilogue::DGeluBgrad { pre_gelu: &pre_t, bgrad: &mut bgrad };
            if !ran(&what, run(&mut d, epilogue)) {
                return false;
            }
            let (want_d, want_bgrad) = ref_gemm::dgelu_bgrad(&product, &pre, n);
            assert_gemm_close(&what, &d.to_f32(dev).unwrap(), &want_d, tol);
            assert_gemm_close(&format!("{what}: bgrad"), &bgrad.to_f32(dev).unwrap(), &want_bgrad, tol);
        }
        "bgradb" => {
            let mut bgrad = Tensor::zeros(dev, out, &[m]).unwrap();
            if !ran(&what, run(&mut d, Epilogue::BgradB { bgrad: &mut bgrad })) {
                return false;
            }
            assert_gemm_close(&what, &d.to_f32(dev).unwrap(), &product, tol);
            let want_bgrad = ref_gemm::row_sums(&a.values, k);
            assert_gemm_close(&format!("{what}: bgrad = row sums of a"), &bgrad.to_f32(dev).unwrap(), &want_bgrad, tol);
        }
        other => panic!("unknown epilogue {other}"),
    }
    true
}

#[test]
fn epilogues_match_reference_or_are_rejected() {
    let Some(dev) = device() else { return };
    let kinds = ["none", "bias", "gelu_aux_bias", "dgelu_bgrad", "bgradb"];
    let combos = [
        (DType::BF16, DType::BF16, DType::BF16),
        (DType::F16, DType::F16, DType::F16),
        (DType::E4M3, DType::E4M3, DType::BF16),
        (DType::E4M3, DType::E5M2, DType::BF16),
    ];
    let mut rejected = Vec::new();
    for (ta, tb, out) in combos {
        for kind in kinds {
            if !check_epilogue(&dev, ta, tb, out, kind) {
                rejected.push(format!("{ta} × {tb} → {out} {kind}"));
            }
        }
    }
    eprintln!("epilogues rejected by cuBLASLt: {rejected:?}");
    // What TE relies on in its forward passes must run.
    for must in ["bf16 × bf16 → bf16 none", "bf16 × bf16 → bf16 bias", "bf16 × bf16 → bf16 gelu_aux_bias"]
        .into_iter()
        .chain(["e4m3 × e4m3 → bf16 none", "e4m3 × e4m3 → bf16 bias"])
    {
        assert!(!rejected.iter().any(|r| r == must), "{must} was rejected");
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let zeros = |dtype, shape: &[usize]| Tensor::zeros(&dev, dtype, shape).unwrap();
    let scale_inv = dev.stream().clone_htod(&[1.0f32]).unwrap();
    fn with<'a>(t: &'a Tensor, scale_inv: &'a CudaSlice<f32>) -> Operand<'a> {
        Operand::fp8(t, scale_inv.as_view())
    }
    let fp8 = |t| with(t, &scale_inv);
    let cfg = GemmConfig::default();

    // k not a multiple of 16 for FP8: the message names k and the padding.
    let (a, b, mut d) =
        (zeros(DType::E4M3, &[32, 1000]), zeros(DType::E4M3, &[64, 1000]), zeros(DType::BF16, &[32, 64]));
    let e = gemm(&dev, fp8(&a), fp8(&b), Output::new(&mut d), &cfg).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("k (") && e.to_string().contains("1008"), "{e}");

    // n not 16-byte aligned in D for FP8.
    let (b2, mut d2) = (zeros(DType::E4M3, &[60, 64]), zeros(DType::BF16, &[32, 60]));
    let a2 = zeros(DType::E4M3, &[32, 64]);
    let e = gemm(&dev, fp8(&a2), fp8(&b2), Output::new(&mut d2), &cfg).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("n (") && e.to_string().contains("64"), "{e}");

    // Missing scale_inv.
    let b3 = zeros(DType::E4M3, &[64, 64]);
    let mut d3 = zeros(DType::BF16, &[32, 64]);
    let e = gemm(&dev, Operand::new(&a2), fp8(&b3), Output::new(&mut d3), &cfg).unwrap_err();
    assert!(matches!(e, Error::Gemm { .. }) && e.to_string().contains("scale_inv"), "{e}");

    // e5m2 × e5m2.
    let (a4, b4) = (zeros(DType::E5M2, &[32, 64]), zeros(DType::E5M2, &[64, 64]));
    let e = gemm(&dev, fp8(&a4), fp8(&b4), Output::new(&mut d3), &cfg).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "b", .. }), "{e}");

    // k mismatch and a wrong output shape.
    let (a5, b5) = (zeros(DType::BF16, &[32, 64]), zeros(DType::BF16, &[64, 48]));
    let mut d5 = zeros(DType::BF16, &[32, 64]);
    let e = gemm(&dev, Operand::new(&a5), Operand::new(&b5), Output::new(&mut d5), &cfg).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("must share k"), "{e}");
    let b6 = zeros(DType::BF16, &[64, 64]);
    let mut d6 = zeros(DType::BF16, &[64, 32]);
    let e = gemm(&dev, Operand::new(&a5), Operand::new(&b6), Output::new(&mut d6), &cfg).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[32, 64]"), "{e}");

    // A bias of the wrong length, an FP8 output that accumulates, an empty operand.
    let bias = zeros(DType::BF16, &[63]);
    let with_bias = GemmConfig { epilogue: Epilogue::Bias(&bias), ..Default::default() };
    let e = gemm(&dev, Operand::new(&a5), Operand::new(&b6), Output::new(&mut d5), &with_bias).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("bias"), "{e}");
    let mut d7 = zeros(DType::E4M3, &[32, 64]);
    let (scale, mut amax) = (dev.stream().clone_htod(&[1.0f32]).unwrap(), dev.stream().alloc_zeros::<f32>(1).unwrap());
    let accumulate = GemmConfig { accumulate: true, ..Default::default() };
    let out = Output::fp8(&mut d7, scale.as_view(), amax.as_view_mut());
    let e = gemm(&dev, fp8(&a2), fp8(&b3), out, &accumulate).unwrap_err();
    assert!(matches!(e, Error::Gemm { .. }) && e.to_string().contains("cannot accumulate"), "{e}");
    let empty = zeros(DType::BF16, &[0, 64]);
    let mut d8 = zeros(DType::BF16, &[0, 64]);
    let e = gemm(&dev, Operand::new(&empty), Operand::new(&b6), Output::new(&mut d8), &cfg).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
}

/// `count` GEMMs on views of larger tensors: `a` side by side in the rows of its tensor from an
/// odd offset, `b` stacked with gaps, `d` stacked with padded rows from an odd offset.
fn strided(count: usize, (m, n, k): (usize, usize, usize), (ta, tb): (bool, bool)) -> (StridedBatch, [usize; 3]) {
    let (ar, ac) = if ta { (k, m) } else { (m, k) };
    let a = MatrixView { offset: 1, rows: ar, cols: ac, row_stride: count * ac + 3, batch_stride: ac };
    let (br, bc) = if tb { (k, n) } else { (n, k) };
    let b = MatrixView { offset: 0, rows: br, cols: bc, row_stride: bc + 2, batch_stride: br * (bc + 2) + 7 };
    let d = MatrixView { offset: 3, rows: m, cols: n, row_stride: n + 5, batch_stride: m * (n + 5) };
    let lens = [1 + ar * a.row_stride, count * b.batch_stride, 3 + count * d.batch_stride];
    (StridedBatch { count, a, a_transposed: ta, b, b_transposed: tb, d }, lens)
}

#[test]
fn strided_batched_matches_reference_and_keeps_the_rest_of_d() {
    let Some(dev) = device() else { return };
    let (count, m, n, k) = (5, 37, 45, 53);
    let pairs =
        [(DType::BF16, DType::BF16), (DType::BF16, DType::F32), (DType::F16, DType::F16), (DType::F32, DType::F32)];
    for (i, (dtype, out)) in pairs.into_iter().enumerate() {
        for transposed in [(false, false), (false, true), (true, false), (true, true)] {
            let (batch, [a_len, b_len, d_len]) = strided(count, (m, n, k), transposed);
            let a = Input::new(&dev, dtype, &[a_len], 80 + i as u64, 1.0);
            let b = Input::new(&dev, dtype, &[b_len], 90 + i as u64, 1.0);
            let inside: Vec<usize> = (0..count)
                .flat_map(|j| (0..m).flat_map(move |r| (0..n).map(move |c| (j, r, c))))
                .map(|(j, r, c)| batch.d.offset + j * batch.d.batch_stride + r * batch.d.row_stride + c)
                .collect();
            for accumulate in [false, true] {
                let init: Vec<f32> = randn(100, d_len, 2.0).into_iter().map(|v| numerics::round_to(out, v)).collect();
                let mut d = Tensor::from_f32(&dev, out, &[d_len], &init).unwrap();
                let cfg = GemmConfig { alpha: 0.5, accumulate, ..Default::default() };
                gemm_strided_batched(&dev, &a.tensor, &b.tensor, &mut d, &batch, &cfg).unwrap();
                let got = d.to_f32(&dev).unwrap();
                let mut want = init.clone();
                ref_gemm::gemm_strided_batched(&a.values, &b.values, &mut want, &batch, 0.5, accumulate);
                let what = format!("{dtype} → {out}, transposed {transposed:?}, accumulate {accumulate}");
                let pick = |v: &[f32]| -> Vec<f32> { inside.iter().map(|&i| v[i]).collect() };
                assert_gemm_close(&what, &pick(&got), &pick(&want), rtol(dtype, out));
                let mut outside = got.clone();
                inside.iter().for_each(|&i| outside[i] = init[i]);
                assert_eq!(outside, init, "{what}: elements outside the views changed");
            }
        }
    }
}

#[test]
fn strided_batched_bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let (batch, [a_len, b_len, d_len]) = strided(3, (16, 24, 32), (false, false));
    let zeros = |dtype, len| Tensor::zeros(&dev, dtype, &[len]).unwrap();
    let (a, b, mut d) = (zeros(DType::BF16, a_len), zeros(DType::BF16, b_len), zeros(DType::BF16, d_len));
    gemm_strided_batched(&dev, &a, &b, &mut d, &batch, &GemmConfig::default()).unwrap();
    // A view past its tensor, an epilogue, FP8.
    let mut short = zeros(DType::BF16, d_len / 2);
    let e = gemm_strided_batched(&dev, &a, &b, &mut short, &batch, &GemmConfig::default()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`d` view"), "{e}");
    let bias = zeros(DType::BF16, 24);
    let cfg = GemmConfig { epilogue: Epilogue::Bias(&bias), ..Default::default() };
    let e = gemm_strided_batched(&dev, &a, &b, &mut d, &batch, &cfg).unwrap_err();
    assert!(matches!(e, Error::Gemm { .. }) && e.to_string().contains("no epilogue"), "{e}");
    let a8 = zeros(DType::E4M3, a_len);
    let e = gemm_strided_batched(&dev, &a8, &b, &mut d, &batch, &GemmConfig::default()).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "a", .. }), "{e}");
}
