//! Families 2, 3 and the fused dact of 4 on the GPU: cast + transpose (+ dbias) (+ dact) against
//! the CPU reference. FP8 codes of both copies, amax and scale_inv bit-exact (a fused GELU may
//! move a rare code by one step: the GPU's `tanhf` differs from the CPU's by ulps), dbias within
//! bf16 tolerance and bit-identical run to run. The FP8 byte transpose bit-exact against a CPU
//! transpose.

use crate::common::{assert_bits_eq, assert_close, device, randn};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_codegen::spec::{Activation, CastTransposeSpec};
use te_reference::cast_transpose::{cast_transpose as reference, transpose, CastTransposeRef};
use te_runtime::numerics;
use te_runtime::ops::cast_transpose::{
    cast_transpose, cast_transpose_dact, dbias_workspace_len, transpose_fp8, DbiasOut,
};
use te_runtime::ops::Fp8Meta;
use te_runtime::{Arch, DType, Device, Error, Tensor};

/// Shapes: tile multiples, rows and cols not multiples of the 64 x 128 tile (and rows % 16 != 0,
/// the byte path of `out_t`), a single tile row, a single row.
const SHAPES: [(usize, usize); 4] = [(256, 4096), (1000, 784), (17, 16), (1, 48)];

/// What one GPU run produced.
struct Run {
    q: Vec<u8>,
    q_t: Vec<u8>,
    amax: f32,
    scale_inv: f32,
    dbias: Option<Vec<u8>>,
}

/// Runs the op on `x` (`[rows, cols]`, values already rounded to `input`) and reads back.
// One argument per axis of the test matrix (dtypes, shape, fusions, scale): each case reads as
// one call; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Device,
    input: DType,
    out: DType,
    rows: usize,
    cols: usize,
    x: &[f32],
    act: Option<(Activation, &[f32])>,
    dbias: bool,
    scale: f32,
) -> Run {
    let xt = Tensor::from_f32(dev, input, &[rows, cols], x).unwrap();
    let mut q = Tensor::zeros(dev, out, &[rows, cols]).unwrap();
    let mut q_t = Tensor::zeros(dev, out, &[cols, rows]).unwrap();
    let mut meta = Fp8Meta::new(dev, scale).unwrap();
    let mut db = Tensor::zeros(dev, input, &[cols]).unwrap();
    let mut ws = dev.stream().alloc_zeros::<f32>(dbias_workspace_len(rows, cols)).unwrap();
    let d = dbias.then(|| DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() });
    match act {
        None => cast_transpose(dev, &xt, &mut q, &mut q_t, &mut meta.scaling(), d).unwrap(),
        Some((act, a)) => {
            let at = Tensor::from_f32(dev, input, &[rows, cols], a).unwrap();
            cast_transpose_dact(dev, act, &xt, &at, &mut q, &mut q_t, &mut meta.scaling(), d).unwrap()
        }
    }
    let (_, amax, scale_inv) = meta.read(dev).unwrap();
    Run {
        q: q.to_bytes(dev).unwrap(),
        q_t: q_t.to_bytes(dev).unwrap(),
        amax,
        scale_inv,
        dbias: dbias.then(|| db.to_bytes(dev).unwrap()),
    }
}

/// `n` values `~ N(0, std)` rounded to `dtype`.
fn inputs(seed: u64, n: usize, std: f32, dtype: DType) -> Vec<f32> {
    randn(seed, n, std).into_iter().map(|v| numerics::round_to(dtype, v)).collect()
}

fn spec(input: DType, out: DType, cols: usize, dbias: bool, act: Option<Activation>) -> CastTransposeSpec {
    CastTransposeSpec::new(input, out, cols, dbias, act, Arch::Sm90a)
}

/// dbias against the reference: rtol of bf16, atol 1e-5 per summed row.
fn check_dbias(what: &str, got: &Run, want: &CastTransposeRef, input: DType, rows: usize) {
    let got = numerics::decode(input, got.dbias.as_ref().expect("dbias requested"));
    assert_close(&format!("{what}: dbias"), &got, want.dbias.as_ref().unwrap(), 1.6e-2, 1e-5 * rows as f32);
}

/// Values that probe rounding, saturation, subnormals and NaN/inf (as in the cast tests).
fn specials() -> Vec<f32> {
    let mut v = vec![0.0, -0.0, 1.0, -1.0, 1.0625, 1.1875, 448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 57344.0, 61440.0];
    v.extend([f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::MIN_POSITIVE, 1e-40]);
    for e in -20..-5 {
        v.push(2f32.powi(e));
        v.push(-1.5 * 2f32.powi(e));
    }
    v
}

#[test]
fn cast_transpose_is_bit_exact_with_amax_scale_inv_and_dbias() {
    let Some(dev) = device() else { return };
    for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
        for input in [DType::F32, DType::BF16, DType::F16] {
            for out in [DType::E4M3, DType::E5M2] {
                for dbias in [false, true] {
                    let mut x = inputs(200 + i as u64, rows * cols, 3.0, input);
                    // Specials (inf, NaN) make column sums inf/NaN: only without dbias.
                    if !dbias && x.len() >= 64 {
                        let sp: Vec<f32> = specials().into_iter().map(|v| numerics::round_to(input, v)).collect();
                        x[..sp.len()].copy_from_slice(&sp);
                    }
                    let scale = 7.5f32;
                    let got = run(&dev, input, out, rows, cols, &x, None, dbias, scale);
                    let want = reference(&spec(input, out, cols, dbias, None), &x, None, rows, scale);
                    let what = format!("cast_transpose {input}->{out} {rows}x{cols} dbias={dbias}");
                    assert_bits_eq(&format!("{what}: out"), &got.q, &want.q);
                    assert_bits_eq(&format!("{what}: out_t"), &got.q_t, &want.q_t);
                    assert_eq!(got.amax.to_bits(), want.amax.to_bits(), "{what}: amax");
                    assert_eq!(got.scale_inv.to_bits(), want.scale_inv.to_bits(), "{what}: scale_inv");
                    if dbias {
                        check_dbias(&what, &got, &want, input, rows);
                    }
                }
            }
        }
    }
}

/// Codes equal except, at no more than 1 + 1 in 1000 places, a neighbouring code of the same sign.
fn assert_codes_near(what: &str, got: &[u8], want: &[u8]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut off = 0usize;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g != w {
            let neighbours = (g & 0x80) == (w & 0x80) && (g & 0x7f).abs_diff(w & 0x7f) == 1;
            assert!(neighbours, "{what}: byte {i}: got {g:#04x}, want {w:#04x} (not neighbouring codes)");
            off += 1;
        }
    }
    assert!(off <= 1 + got.len() / 1000, "{what}: {off}/{} codes differ by one step", got.len());
}

#[test]
fn fused_dact_matches_reference() {
    let Some(dev) = device() else { return };
    for (i, &(rows, cols)) in SHAPES.iter().enumerate() {
        for input in [DType::F32, DType::BF16, DType::F16] {
            for (out, dbias) in [(DType::E5M2, true), (DType::E4M3, false)] {
                for act in [Activation::Gelu, Activation::Relu] {
                    let dy = inputs(300 + i as u64, rows * cols, 1.0, input);
                    let a = inputs(400 + i as u64, rows * cols, 2.0, input);
                    let scale = 3.0f32;
                    let got = run(&dev, input, out, rows, cols, &dy, Some((act, &a)), dbias, scale);
                    let want = reference(&spec(input, out, cols, dbias, Some(act)), &dy, Some(&a), rows, scale);
                    let what = format!("cast_transpose d{act} {input}->{out} {rows}x{cols} dbias={dbias}");
                    // Both copies always hold the same codes.
                    let mut transposed = vec![0u8; got.q.len()];
                    for r in 0..rows {
                        for c in 0..cols {
                            transposed[c * rows + r] = got.q[r * cols + c];
                        }
                    }
                    assert_bits_eq(&format!("{what}: out_t vs out"), &got.q_t, &transposed);
                    match act {
                        // ReLU' is exactly 0 or 1: everything matches bit for bit.
                        Activation::Relu => {
                            assert_bits_eq(&format!("{what}: out"), &got.q, &want.q);
                            assert_eq!(got.amax.to_bits(), want.amax.to_bits(), "{what}: amax");
                        }
                        _ => {
                            assert_codes_near(&format!("{what}: out"), &got.q, &want.q);
                            assert_close(&format!("{what}: amax"), &[got.amax], &[want.amax], 1e-5, 0.0);
                        }
                    }
                    assert_eq!(got.scale_inv.to_bits(), want.scale_inv.to_bits(), "{what}: scale_inv");
                    if dbias {
                        check_dbias(&what, &got, &want, input, rows);
                    }
                }
            }
        }
    }
}

#[test]
fn dbias_bits_are_the_same_run_to_run() {
    let Some(dev) = device() else { return };
    // Many row tiles (more than the dbias kernel's slices), rows not a tile multiple.
    let (rows, cols) = (4133, 1024);
    let dy = inputs(500, rows * cols, 1.0, DType::BF16);
    let a = inputs(501, rows * cols, 2.0, DType::BF16);
    for act in [None, Some(Activation::Gelu)] {
        let act_arg = act.map(|k| (k, a.as_slice()));
        let first = run(&dev, DType::BF16, DType::E5M2, rows, cols, &dy, act_arg, true, 1.0);
        let second = run(&dev, DType::BF16, DType::E5M2, rows, cols, &dy, act_arg, true, 1.0);
        let what = format!("dbias {act:?} {rows}x{cols}");
        assert_bits_eq(&what, second.dbias.as_ref().unwrap(), first.dbias.as_ref().unwrap());
        assert_bits_eq(&format!("{what}: out_t"), &second.q_t, &first.q_t);
    }
}

#[test]
fn amax_accumulates_across_calls() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (64, 128);
    let big = inputs(600, rows * cols, 5.0, DType::BF16);
    let small = inputs(601, rows * cols, 0.5, DType::BF16);
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let mut q = Tensor::zeros(&dev, DType::E4M3, &[rows, cols]).unwrap();
    let mut q_t = Tensor::zeros(&dev, DType::E4M3, &[cols, rows]).unwrap();
    for x in [&big, &small] {
        let xt = Tensor::from_f32(&dev, DType::BF16, &[rows, cols], x).unwrap();
        cast_transpose(&dev, &xt, &mut q, &mut q_t, &mut meta.scaling(), None).unwrap();
    }
    let want = reference(&spec(DType::BF16, DType::E4M3, cols, false, None), &big, None, rows, 1.0).amax;
    assert_eq!(meta.read(&dev).unwrap().1, want);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let x = Tensor::zeros(&dev, DType::BF16, &[4, 1000]).unwrap();
    let mut q = Tensor::zeros(&dev, DType::E4M3, &[4, 1000]).unwrap();
    let mut q_t = Tensor::zeros(&dev, DType::E4M3, &[1000, 4]).unwrap();
    let e = cast_transpose(&dev, &x, &mut q, &mut q_t, &mut meta.scaling(), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("pad it to 1008"), "{e}");

    let x = Tensor::zeros(&dev, DType::BF16, &[4, 32]).unwrap();
    let mut q = Tensor::zeros(&dev, DType::E4M3, &[4, 32]).unwrap();
    let mut wrong_t = Tensor::zeros(&dev, DType::E4M3, &[4, 32]).unwrap();
    let e = cast_transpose(&dev, &x, &mut q, &mut wrong_t, &mut meta.scaling(), None).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("out_t"), "{e}");

    let mut q_t = Tensor::zeros(&dev, DType::E4M3, &[32, 4]).unwrap();
    let mut not_fp8 = Tensor::zeros(&dev, DType::BF16, &[4, 32]).unwrap();
    let e = cast_transpose(&dev, &x, &mut not_fp8, &mut q_t, &mut meta.scaling(), None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out", .. }), "{e}");

    let mut other_format = Tensor::zeros(&dev, DType::E5M2, &[32, 4]).unwrap();
    let e = cast_transpose(&dev, &x, &mut q, &mut other_format, &mut meta.scaling(), None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out_t", .. }), "{e}");

    let mut db = Tensor::zeros(&dev, DType::F32, &[32]).unwrap();
    let mut ws = dev.stream().alloc_zeros::<f32>(dbias_workspace_len(4, 32)).unwrap();
    let d = Some(DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() });
    let e = cast_transpose(&dev, &x, &mut q, &mut q_t, &mut meta.scaling(), d).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "dbias", .. }), "{e}");

    let mut db = Tensor::zeros(&dev, DType::BF16, &[32]).unwrap();
    let mut small = dev.stream().alloc_zeros::<f32>(16).unwrap();
    let d = Some(DbiasOut { dbias: &mut db, workspace: small.as_view_mut() });
    let e = cast_transpose(&dev, &x, &mut q, &mut q_t, &mut meta.scaling(), d).unwrap_err();
    assert!(e.to_string().contains("dbias_workspace_len"), "{e}");

    let a = Tensor::zeros(&dev, DType::BF16, &[4, 32]).unwrap();
    let e =
        cast_transpose_dact(&dev, Activation::Swiglu, &x, &a, &mut q, &mut q_t, &mut meta.scaling(), None).unwrap_err();
    assert!(e.to_string().contains("gated"), "{e}");
    let a16 = Tensor::zeros(&dev, DType::F16, &[4, 32]).unwrap();
    let e =
        cast_transpose_dact(&dev, Activation::Gelu, &x, &a16, &mut q, &mut q_t, &mut meta.scaling(), None).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "act_in", .. }), "{e}");

    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 32]).unwrap();
    let mut q0 = Tensor::zeros(&dev, DType::E4M3, &[0, 32]).unwrap();
    let mut q0_t = Tensor::zeros(&dev, DType::E4M3, &[32, 0]).unwrap();
    let e = cast_transpose(&dev, &empty, &mut q0, &mut q0_t, &mut meta.scaling(), None).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");
}

/// Random FP8 codes (every byte value, NaN codes included: the transpose only moves bytes).
fn random_codes(seed: u64, n: usize) -> Vec<u8> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| rng.random::<u8>()).collect()
}

#[test]
fn transpose_fp8_is_a_bit_exact_byte_transpose() {
    let Some(dev) = device() else { return };
    // One tile; cols a tile multiple + 16; rows and cols not multiples of the 128 x 128 tile
    // (rows % 16 != 0: the byte path); a few rows; tile multiples; one row past a tile.
    let shapes: [&[usize]; 7] =
        [&[16, 16], &[48, 4112], &[1000, 784], &[3, 4096], &[256, 4096], &[129, 48], &[2, 500, 784]];
    for (i, &shape) in shapes.iter().enumerate() {
        let cols = shape[shape.len() - 1];
        let rows = shape.iter().product::<usize>() / cols;
        for dtype in [DType::E4M3, DType::E5M2] {
            let codes = random_codes(700 + i as u64, rows * cols);
            let x = Tensor::from_bytes(&dev, dtype, shape, &codes).unwrap();
            let mut out_t = Tensor::zeros(&dev, dtype, &[cols, rows]).unwrap();
            transpose_fp8(&dev, &x, &mut out_t).unwrap();
            let what = format!("transpose_fp8 {dtype} {shape:?}");
            assert_bits_eq(&what, &out_t.to_bytes(&dev).unwrap(), &transpose(&codes, rows, cols));
        }
    }
}

#[test]
fn transpose_fp8_of_cast_transpose_output_is_its_out_t() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (1000, 784);
    let x = inputs(800, rows * cols, 3.0, DType::BF16);
    let got = run(&dev, DType::BF16, DType::E4M3, rows, cols, &x, None, false, 7.5);
    let q = Tensor::from_bytes(&dev, DType::E4M3, &[rows, cols], &got.q).unwrap();
    let mut q_t = Tensor::zeros(&dev, DType::E4M3, &[cols, rows]).unwrap();
    transpose_fp8(&dev, &q, &mut q_t).unwrap();
    assert_bits_eq("transpose_fp8(out) vs out_t", &q_t.to_bytes(&dev).unwrap(), &got.q_t);
}

#[test]
fn transpose_fp8_bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let x = Tensor::zeros(&dev, DType::E4M3, &[4, 32]).unwrap();
    let mut wrong_t = Tensor::zeros(&dev, DType::E4M3, &[4, 32]).unwrap();
    let e = transpose_fp8(&dev, &x, &mut wrong_t).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("`out_t` must have shape [32, 4]"), "{e}");

    let mut other_format = Tensor::zeros(&dev, DType::E5M2, &[32, 4]).unwrap();
    let e = transpose_fp8(&dev, &x, &mut other_format).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "out_t", .. }), "{e}");

    let hp = Tensor::zeros(&dev, DType::BF16, &[4, 32]).unwrap();
    let mut hp_t = Tensor::zeros(&dev, DType::BF16, &[32, 4]).unwrap();
    let e = transpose_fp8(&dev, &hp, &mut hp_t).unwrap_err();
    assert!(matches!(e, Error::DType { arg: "x", .. }) && e.to_string().contains("cast_transpose"), "{e}");

    let odd = Tensor::zeros(&dev, DType::E4M3, &[4, 1000]).unwrap();
    let mut odd_t = Tensor::zeros(&dev, DType::E4M3, &[1000, 4]).unwrap();
    let e = transpose_fp8(&dev, &odd, &mut odd_t).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("pad it to 1008"), "{e}");

    let empty = Tensor::zeros(&dev, DType::E4M3, &[0, 32]).unwrap();
    let mut empty_t = Tensor::zeros(&dev, DType::E4M3, &[32, 0]).unwrap();
    let e = transpose_fp8(&dev, &empty, &mut empty_t).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");

    let scalar = Tensor::zeros(&dev, DType::E4M3, &[]).unwrap();
    let e = transpose_fp8(&dev, &scalar, &mut empty_t).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
}
