//! Blockwise FP8 quantization on the GPU (`ops::block_quantize`, TE's `Float8BlockScaling`)
//! against the CPU reference (`reference::block_scaling`) bit for bit: codes in both
//! orientations and every `scale_inv` in the GEMM-ready layouts, for 1×128 tiles and 128×128
//! blocks, bf16 and f16 inputs, E4M3 and E5M2 codes, power-of-2 and exact scales, an amax
//! floor; shapes that are not multiples of 128; tiles of zeros, infinities, NaN and values too
//! large for the scale; typed errors. Then the block-scaled FP8 GEMMs that read them.

use crate::common::{device, randn};
use te_runtime::gemm::{gemm, BlockScale, GemmConfig, Operand, Output};
use te_runtime::numerics::round_to;
use te_runtime::ops::block_quantize::{quantize, scale_shape, BlockCodes, BlockFp8, BlockQuantizeParams};
use te_runtime::reference::block_scaling::{dequantize_blockwise, quantize_blockwise, BlockParams, BlockTiling};
use te_runtime::reference::gemm::gemm_tn;
use te_runtime::reference::linear::{rel_frobenius, transpose};
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
