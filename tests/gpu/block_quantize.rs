//! Blockwise FP8 quantization on the GPU (`ops::block_quantize`, TE's `Float8BlockScaling`)
//! against the CPU reference (`reference::block_scaling`) bit for bit: codes in both
//! orientations and every `scale_inv` in the GEMM-ready layouts, for 1×128 tiles and 128×128
//! blocks, bf16 and f16 inputs, E4M3 and E5M2 codes, power-of-2 and exact scales, an amax
//! floor; shapes that are not multiples of 128; tiles of zeros, infinities, NaN and values too
//! large for the scale; typed errors. The bias gradient fused into the 1D quantization
//! (`quantize_dbias`, and `Float8BlockQuantizer::quantize` with a dbias). Then the block-scaled
//! FP8 GEMMs that read them.

use crate::common::{device, randn};
use te_nn::fp8::{Float8BlockQuantizer, Float8BlockScaling, Quantizer};
use te_reference::block_scaling::{dequantize_blockwise, quantize_blockwise, BlockParams, BlockTiling};
use te_reference::gemm::gemm_tn;
use te_reference::linear::{rel_frobenius, transpose};
use te_runtime::gemm::{gemm, BlockScale, GemmConfig, Operand, Output};
use te_runtime::numerics::round_to;
use te_runtime::ops::block_quantize::{
    block_dbias_workspace_len, quantize, quantize_dbias, scale_shape, BlockCodes, BlockFp8, BlockQuantizeParams,
};
use te_runtime::ops::cast_transpose::{dbias_workspace_len, DbiasOut};
use te_runtime::{DType, Device, Error, Tensor};

/// Values spanning many magnitudes (each row its own), with a zero row, an infinity, a NaN, a
/// subnormal and the largest finite value of `dtype`, rounded to `dtype`.
fn values(rows: usize, cols: usize, dtype: DType, seed: u64) -> Vec<f32> {
    let mut x: Vec<f32> = randn(seed, rows * cols, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * 10f32.powi((i / cols) as i32 % 9 - 4))
        .collect();
    let max = if dtype == DType::F16 { 65504.0 } else { 3.3895e38 };
    for (i, v) in [(0, f32::INFINITY), (cols / 2, f32::NAN), (cols + 1, 1e-40), (2 * cols + 3, -max)] {
        if i < x.len() {
            x[i] = v;
        }
    }
    if rows > 5 {
        x[5 * cols..6 * cols].fill(0.0);
    }
    x.into_iter().map(|v| round_to(dtype, v)).collect()
}

fn scales(dev: &Device, c: &BlockCodes) -> Vec<u32> {
    dev.stream().clone_dtoh(&c.scale_inv).unwrap().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn block_quantize_matches_the_reference_bit_for_bit() {
    let Some(dev) = device() else { return };
    let mut cases = 0;
    for (rows, cols) in [(131, 200), (256, 384), (1, 1), (300, 129), (128, 128), (7, 515)] {
        for (input, output, power_2, epsilon) in [
            (DType::BF16, DType::E4M3, true, 0.0),
            (DType::F16, DType::E4M3, false, 0.0),
            (DType::BF16, DType::E5M2, false, 1e-3),
        ] {
            for block_dim in [1, 2] {
                let what = format!("[{rows}, {cols}] {input} → {output} {block_dim}D power_2 {power_2} eps {epsilon}");
                let x = values(rows, cols, input, (rows * 1000 + cols) as u64);
                let xt = Tensor::from_f32(&dev, input, &[rows, cols], &x).unwrap();
                let params = BlockQuantizeParams { dtype: output, block_dim, epsilon, power_2 };
                let got = quantized(&dev, &xt, &params, true, true);
                let rp = BlockParams { dtype: output, epsilon, power_2, ..BlockParams::te_default(input) };
                let (row_tiling, col_tiling) = match block_dim {
                    1 => (BlockTiling::Rows, BlockTiling::Columns),
                    _ => (BlockTiling::Square, BlockTiling::Square),
                };
                let want_r = quantize_blockwise(&x, rows, cols, row_tiling, &rp);
                let want_c = quantize_blockwise(&x, rows, cols, col_tiling, &rp);
                let (rw, cw) = (got.rowwise.as_ref().unwrap(), got.columnwise.as_ref().unwrap());
                assert_eq!(rw.data.to_bytes(&dev).unwrap(), want_r.codes, "{what}: row-wise codes");
                let want_codes_t = if block_dim == 1 {
                    want_c.codes.clone()
                } else {
                    (0..cols * rows).map(|i| want_r.codes[(i % rows) * cols + i / rows]).collect()
                };
                assert_eq!(cw.data.to_bytes(&dev).unwrap(), want_codes_t, "{what}: column-wise codes");

                // The scales, read through the GEMM-ready layouts.
                let (nbr, nbc) = (rows.div_ceil(128), cols.div_ceil(128));
                let (gr, gc) = (scales(&dev, rw), scales(&dev, cw));
                assert_eq!((rw.scale_rows, rw.ld), scale_shape(rows, cols, block_dim, false));
                assert_eq!((cw.scale_rows, cw.ld), scale_shape(rows, cols, block_dim, true));
                let mut want_gr = vec![0u32; gr.len()];
                let mut want_gc = vec![0u32; gc.len()];
                if block_dim == 1 {
                    for r in 0..rows {
                        for kb in 0..nbc {
                            want_gr[kb * rw.ld + r] = want_r.scale_inv[r * nbc + kb].to_bits();
                        }
                    }
                    for c in 0..cols {
                        for mb in 0..nbr {
                            want_gc[mb * cw.ld + c] = want_c.scale_inv[c * nbr + mb].to_bits();
                        }
                    }
                } else {
                    for rb in 0..nbr {
                        for cb in 0..nbc {
                            let v = want_r.scale_inv[rb * nbc + cb].to_bits();
                            want_gr[rb * rw.ld + cb] = v;
                            want_gc[cb * cw.ld + rb] = v;
                        }
                    }
                }
                assert_eq!(gr, want_gr, "{what}: row-wise scale_inv (padding 0)");
                assert_eq!(gc, want_gc, "{what}: column-wise scale_inv (padding 0)");

                // One orientation alone gives the same bytes.
                let only = quantized(&dev, &xt, &params, false, true);
                assert!(only.rowwise.is_none());
                assert_eq!(only.columnwise.unwrap().data.to_bytes(&dev).unwrap(), want_codes_t, "{what}: alone");
                cases += 1;
            }
        }
    }
    assert_eq!(cases, 36);
}

/// `x` ([rows, cols]) quantized into a fresh [`BlockFp8`].
fn quantized(dev: &Device, x: &Tensor, p: &BlockQuantizeParams, rowwise: bool, columnwise: bool) -> BlockFp8 {
    let (rows, cols) = (x.shape()[0], x.shape()[1]);
    let mut out = BlockFp8::new(dev, [rows, cols], p, rowwise, columnwise).unwrap();
    quantize(dev, x, p, &mut out).unwrap();
    out
}

#[test]
fn block_quantize_errors_are_typed() {
    let Some(dev) = device() else { return };
    let x = Tensor::zeros(&dev, DType::BF16, &[4, 8]).unwrap();
    let p = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
    let mut out = BlockFp8::new(&dev, [4, 8], &p, true, false).unwrap();
    let f32x = Tensor::zeros(&dev, DType::F32, &[4, 8]).unwrap();
    assert!(matches!(quantize(&dev, &f32x, &p, &mut out), Err(Error::DType { .. })));
    let bad = BlockQuantizeParams { block_dim: 3, ..p };
    let e = quantize(&dev, &x, &bad, &mut out).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("block_dim"), "{e}");
    let e = BlockFp8::new(&dev, [4, 8], &BlockQuantizeParams { epsilon: f32::NAN, ..p }, true, false).unwrap_err();
    assert!(e.to_string().contains("epsilon"), "{e}");
    let e = BlockFp8::new(&dev, [4, 8], &BlockQuantizeParams { dtype: DType::BF16, ..p }, true, false).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    assert!(matches!(BlockFp8::new(&dev, [4, 8], &p, false, false), Err(Error::Shape { .. })));
    // An output made for other sizes or blocks.
    let other = Tensor::zeros(&dev, DType::BF16, &[4, 16]).unwrap();
    let e = quantize(&dev, &other, &p, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("BlockFp8::new"), "{e}");
    let e = quantize(&dev, &x, &BlockQuantizeParams { block_dim: 2, ..p }, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    // An empty tensor quantizes to empty codes without a launch.
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 8]).unwrap();
    let q = quantized(&dev, &empty, &p, true, true);
    assert_eq!(q.rowwise.unwrap().data.numel(), 0);
}

/// The spacing of `dtype` (bf16 or f16) at `v`: one unit in the last place.
fn ulp(dtype: DType, v: f64) -> f64 {
    let (mantissa, min_exp) = if dtype == DType::F16 { (10, -14) } else { (7, -126) };
    let e = if v == 0.0 { min_exp } else { (v.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(e - mantissa)
}

/// Checks `got` (`dbias` of `x` `[rows, cols]`, rounded to `dtype`) against the f64 column sums:
/// within one ulp of `dtype` at the sum (the kernel rounds its f32 sum once: half an ulp; the
/// other half covers the f32 accumulation) plus `rows · 2⁻²⁴ · Σ_r |x[r, c]|`, the bound of f32
/// accumulation, which only matters for columns whose terms cancel.
fn check_dbias(got: &[f32], x: &[f32], rows: usize, cols: usize, dtype: DType, what: &str) {
    assert_eq!(got.len(), cols, "{what}: dbias length");
    for (c, &g) in got.iter().enumerate() {
        let (sum, abs): (f64, f64) =
            (0..rows).map(|r| f64::from(x[r * cols + c])).fold((0.0, 0.0), |(s, a), v| (s + v, a + v.abs()));
        let tol = ulp(dtype, sum) + rows as f64 * 2f64.powi(-24) * abs;
        assert!((f64::from(g) - sum).abs() <= tol, "{what}: dbias[{c}] = {g}, the f64 sum {sum} (tolerance {tol:e})");
    }
}

/// A `[rows, cols]` gradient of mixed magnitudes in `dtype` (finite, some columns of zeros).
fn gradient(rows: usize, cols: usize, dtype: DType, seed: u64) -> Vec<f32> {
    randn(seed, rows * cols, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i % cols == 3 { 0.0 } else { round_to(dtype, v * 2f32.powi((i % 11) as i32 - 5)) })
        .collect()
}

/// The bias gradient fused into the 1D quantization: the f64 column sums within one ulp (see
/// [`check_dbias`]), the same bits on a second run, the codes and scales of both orientations
/// bit for bit those of `quantize` (and the column-wise codes the reference's), for shapes that
/// are not multiples of 128 and a workspace that starts as NaN (it needs no initialization).
#[test]
fn block_quantize_dbias_matches_the_column_sums() {
    let Some(dev) = device() else { return };
    for (rows, cols, input, output) in [
        (200, 272, DType::BF16, DType::E4M3),
        (1000, 48, DType::BF16, DType::E5M2),
        (131, 200, DType::F16, DType::E4M3),
        (384, 520, DType::BF16, DType::E4M3),
        (1, 7, DType::BF16, DType::E4M3),
    ] {
        let what = format!("[{rows}, {cols}] {input} → {output}");
        let x = gradient(rows, cols, input, (rows * 7 + cols) as u64);
        let xt = Tensor::from_f32(&dev, input, &[rows, cols], &x).unwrap();
        let p = BlockQuantizeParams { dtype: output, block_dim: 1, epsilon: 0.0, power_2: true };
        let mut db = Tensor::zeros(&dev, input, &[cols]).unwrap();
        let mut ws = dev.stream().clone_htod(&vec![f32::NAN; block_dbias_workspace_len(rows, cols)]).unwrap();
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut out = BlockFp8::new(&dev, [rows, cols], &p, true, true).unwrap();
            quantize_dbias(&dev, &xt, &p, &mut out, DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() }).unwrap();
            runs.push((out, db.to_bytes(&dev).unwrap()));
        }
        assert_eq!(runs[0].1, runs[1].1, "{what}: dbias bits run to run");
        check_dbias(&db.to_f32(&dev).unwrap(), &x, rows, cols, input, &what);

        let plain = quantized(&dev, &xt, &p, true, true);
        let fused = &runs[0].0;
        for (name, a, b) in
            [("row-wise", &fused.rowwise, &plain.rowwise), ("column-wise", &fused.columnwise, &plain.columnwise)]
        {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(a.data.to_bytes(&dev).unwrap(), b.data.to_bytes(&dev).unwrap(), "{what}: {name} codes");
            assert_eq!(scales(&dev, a), scales(&dev, b), "{what}: {name} scale_inv");
        }
        let rp = BlockParams { dtype: output, ..BlockParams::te_default(input) };
        let want_c = quantize_blockwise(&x, rows, cols, BlockTiling::Columns, &rp);
        let cw = fused.columnwise.as_ref().unwrap();
        assert_eq!(cw.data.to_bytes(&dev).unwrap(), want_c.codes, "{what}: column-wise codes vs the reference");

        // Only the column-wise orientation: the same dbias bits.
        let mut only = BlockFp8::new(&dev, [rows, cols], &p, false, true).unwrap();
        quantize_dbias(&dev, &xt, &p, &mut only, DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() }).unwrap();
        assert_eq!(db.to_bytes(&dev).unwrap(), runs[0].1, "{what}: dbias without the row-wise codes");
    }
}

/// `quantize_dbias`'s typed errors, and the zero bias gradient of an input without rows.
#[test]
fn block_quantize_dbias_errors_are_typed() {
    let Some(dev) = device() else { return };
    let (rows, cols) = (200, 48);
    let x = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let p = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
    let mut out = BlockFp8::new(&dev, [rows, cols], &p, true, true).unwrap();
    let mut db = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
    let mut ws = dev.stream().alloc_zeros::<f32>(block_dbias_workspace_len(rows, cols)).unwrap();
    assert_eq!(block_dbias_workspace_len(rows, cols), 2 * cols);
    assert!(block_dbias_workspace_len(rows, cols) <= dbias_workspace_len(rows, cols));

    // 128×128 blocks have no fused dbias.
    let p2 = BlockQuantizeParams { block_dim: 2, ..p };
    let mut out2 = BlockFp8::new(&dev, [rows, cols], &p2, true, true).unwrap();
    let e =
        quantize_dbias(&dev, &x, &p2, &mut out2, DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() }).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("block_dim 1"), "{e}");
    // No column-wise codes.
    let mut rw = BlockFp8::new(&dev, [rows, cols], &p, true, false).unwrap();
    let e =
        quantize_dbias(&dev, &x, &p, &mut rw, DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() }).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("columnwise = true"), "{e}");
    // A dbias of another dtype or length.
    let mut f32db = Tensor::zeros(&dev, DType::F32, &[cols]).unwrap();
    let e = quantize_dbias(&dev, &x, &p, &mut out, DbiasOut { dbias: &mut f32db, workspace: ws.as_view_mut() })
        .unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let mut long = Tensor::zeros(&dev, DType::BF16, &[cols + 1]).unwrap();
    let e =
        quantize_dbias(&dev, &x, &p, &mut out, DbiasOut { dbias: &mut long, workspace: ws.as_view_mut() }).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    // A workspace one float short.
    let mut small = dev.stream().alloc_zeros::<f32>(block_dbias_workspace_len(rows, cols) - 1).unwrap();
    let e = quantize_dbias(&dev, &x, &p, &mut out, DbiasOut { dbias: &mut db, workspace: small.as_view_mut() })
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("block_dbias_workspace_len"), "{e}");

    // No rows: no codes, a zero dbias.
    let empty = Tensor::zeros(&dev, DType::BF16, &[0, cols]).unwrap();
    let mut q0 = BlockFp8::new(&dev, [0, cols], &p, true, true).unwrap();
    let mut ones = Tensor::from_f32(&dev, DType::BF16, &[cols], &vec![1.0; cols]).unwrap();
    quantize_dbias(&dev, &empty, &p, &mut q0, DbiasOut { dbias: &mut ones, workspace: ws.as_view_mut() }).unwrap();
    assert_eq!(ones.to_f32(&dev).unwrap(), vec![0.0; cols]);
}

/// `Float8BlockQuantizer::quantize` with a dbias: the fused path for 1×128 tiles (the same bits
/// as `quantize_dbias`, with a workspace a module sized for cast_transpose) and the ones GEMM for
/// 128×128 blocks (`grad_block_scaling_dim` 2), both within the tolerance of [`check_dbias`].
#[test]
fn block_quantizer_dbias_fused_for_1d_and_a_gemm_for_2d() {
    let Some(dev) = device() else { return };
    if dev.arch() != te_runtime::Arch::Sm90a {
        eprintln!("Float8BlockScaling runs on Hopper; {} skips it", dev.arch());
        return;
    }
    let (rows, cols) = (1000, 48);
    let x = gradient(rows, cols, DType::BF16, 9);
    let xt = Tensor::from_f32(&dev, DType::BF16, &[rows, cols], &x).unwrap();
    let mut ws = dev.stream().alloc_zeros::<f32>(dbias_workspace_len(rows, cols)).unwrap();
    let recipe = Float8BlockScaling::default();
    let mut direct = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
    let p = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
    let mut out = BlockFp8::new(&dev, [rows, cols], &p, true, true).unwrap();
    quantize_dbias(&dev, &xt, &p, &mut out, DbiasOut { dbias: &mut direct, workspace: ws.as_view_mut() }).unwrap();
    for block_dim in [1, 2] {
        let q = Float8BlockQuantizer::new(&dev, DType::E4M3, block_dim, &recipe).unwrap();
        let mut db = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
        q.quantize(&xt, false, Some(DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() })).unwrap();
        let what = format!("Float8BlockQuantizer {block_dim}D");
        check_dbias(&db.to_f32(&dev).unwrap(), &x, rows, cols, DType::BF16, &what);
        if block_dim == 1 {
            assert_eq!(db.to_bytes(&dev).unwrap(), direct.to_bytes(&dev).unwrap(), "{what}: the fused bits");
        }
    }
}

/// Finite values of mixed magnitudes (each row its own), rounded to bf16.
fn finite(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    randn(seed, rows * cols, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| round_to(DType::BF16, v * 2f32.powi((i / cols) as i32 % 7 - 3)))
        .collect()
}

/// The block-scaled FP8 GEMMs of TE's `Float8BlockScaling` on cuBLASLt: fprop `X · Wᵀ` with X in
/// 1×128 tiles and W in 128×128 blocks, and wgrad `dYᵀ · X` with both in 128×1 tiles of their
/// columns (the transposed codes), against an f64 GEMM of the values the codes stand for;
/// shapes that are not multiples of 128; typed errors for what cuBLASLt does not take.
#[test]
fn block_scaled_gemm_matches_the_dequantized_reference() {
    let Some(dev) = device() else { return };
    if dev.arch() != te_runtime::Arch::Sm90a {
        eprintln!("block-scaled FP8 GEMMs run on Hopper; {} skips them", dev.arch());
        return;
    }
    // m is also wgrad's k: a multiple of 16 (FP8), not of 128.
    let (m, n, k) = (208, 336, 200 + 8);
    let p1 = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
    let p2 = BlockQuantizeParams { block_dim: 2, ..p1 };
    let rp = BlockParams::te_default(DType::BF16);
    let (x, w, dy) = (finite(m, k, 1), finite(n, k, 2), finite(m, n, 3));
    let up = |v: &[f32], r, c| Tensor::from_f32(&dev, DType::BF16, &[r, c], v).unwrap();
    let (qx, qw, qdy) = (
        quantized(&dev, &up(&x, m, k), &p1, true, true),
        quantized(&dev, &up(&w, n, k), &p2, true, false),
        quantized(&dev, &up(&dy, m, n), &p1, false, true),
    );
    let (xr, xc, wr, dyc) = (
        qx.rowwise.as_ref().unwrap(),
        qx.columnwise.as_ref().unwrap(),
        qw.rowwise.as_ref().unwrap(),
        qdy.columnwise.as_ref().unwrap(),
    );
    let deq = |v: &[f32], r, c, t| dequantize_blockwise(&quantize_blockwise(v, r, c, t, &rp), r, c, t, DType::E4M3);

    // fprop: Y [m, n] = X · Wᵀ.
    let mut y = Tensor::empty(&dev, DType::BF16, &[m, n]).unwrap();
    let cfg = GemmConfig::default();
    gemm(&dev, operand(xr, BlockScale::Vec128), operand(wr, BlockScale::Blk128x128), Output::new(&mut y), &cfg)
        .unwrap();
    let want = gemm_tn(&deq(&x, m, k, BlockTiling::Rows), &deq(&w, n, k, BlockTiling::Square), m, n, k);
    let e = rel_frobenius(&y.to_f32(&dev).unwrap(), &want);
    eprintln!("block-scaled fprop [{m}, {n}, {k}]: relative Frobenius error {e:.2e}");
    assert!(e < 4e-3, "fprop error {e}");

    // wgrad: dW [n, k] = dYᵀ · X, both operands k(= m)-contiguous transposed codes in 128×1 tiles.
    let mut dw = Tensor::empty(&dev, DType::F32, &[n, k]).unwrap();
    gemm(&dev, operand(dyc, BlockScale::Vec128), operand(xc, BlockScale::Vec128), Output::new(&mut dw), &cfg).unwrap();
    let (dyt, xt) = (deq(&dy, m, n, BlockTiling::Columns), deq(&x, m, k, BlockTiling::Columns));
    let want = gemm_tn(&transpose(&dyt, m, n), &transpose(&xt, m, k), n, k, m);
    let e = rel_frobenius(&dw.to_f32(&dev).unwrap(), &want);
    eprintln!("block-scaled wgrad [{n}, {k}, {m}]: relative Frobenius error {e:.2e}");
    // f32 output: what is left is the FP8 tensor cores' accumulation inside each 128-wide k
    // block, which keeps about 14 bits (the reason DeepSeek-V3 and these scale modes promote
    // to f32 every 128 values); measured 2.3e-4 on an H100.
    assert!(e < 1e-3, "wgrad error {e}");

    // Typed errors: fast accumulation, one operand block-scaled, scales of the wrong size.
    let fast = GemmConfig { fast_accum: true, ..GemmConfig::default() };
    let e =
        gemm(&dev, operand(xr, BlockScale::Vec128), operand(wr, BlockScale::Blk128x128), Output::new(&mut y), &fast)
            .unwrap_err();
    assert!(matches!(e, Error::Gemm { .. }) && e.to_string().contains("fast_accum"), "{e}");
    let scalar = dev.stream().alloc_zeros::<f32>(1).unwrap();
    let plain = Operand::fp8(&wr.data, scalar.as_view());
    let e = gemm(&dev, operand(xr, BlockScale::Vec128), plain, Output::new(&mut y), &cfg).unwrap_err();
    assert!(e.to_string().contains("both blockwise-quantized"), "{e}");
    let e =
        gemm(&dev, operand(xr, BlockScale::Blk128x128), operand(wr, BlockScale::Blk128x128), Output::new(&mut y), &cfg)
            .unwrap_err();
    assert!(e.to_string().contains("scale_inv values"), "{e}");
}

/// One orientation's codes as a block-scaled GEMM operand.
fn operand(c: &BlockCodes, block: BlockScale) -> Operand<'_> {
    Operand::fp8_block(&c.data, c.scale_inv.as_view(), block)
}
