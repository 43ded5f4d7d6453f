//! The grouped GEMM with device `m_splits` (`ops::grouped_gemm`, family 19) against an f64
//! product on the host: both splits (rows: forward/dgrad; reduction: wgrad), K-major and
//! MN-major operands, bf16/f16/f32 outputs, accumulation, FP8 pairs with their scale_inv, groups
//! of 0 rows, sizes that are not tile multiples, the zeroed tail past `Σ m_splits`, the device
//! status of bad sizes and the host's typed errors.

use crate::common::{device, randn};
use cudarc::driver::CudaSlice;
use te_runtime::numerics::round_to;
use te_runtime::ops::grouped_gemm::{
    grouped_dbias, grouped_gemm_reduction, grouped_gemm_rows, GroupedStatus, GroupedTables, GroupedWeights,
};
use te_runtime::{DType, Device, Error, Tensor};

fn tables(dev: &Device, groups: usize) -> GroupedTables {
    GroupedTables::new(dev, groups).unwrap()
}

fn rounded(dtype: DType, v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| round_to(dtype, x)).collect()
}

/// Relative Frobenius error of `got` against `want`.
fn rel_fro(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&g, &w) in got.iter().zip(want) {
        num += (g as f64 - w).powi(2);
        den += w * w;
    }
    (num / den.max(1e-300)).sqrt()
}

fn splits(dev: &Device, s: &[i32]) -> CudaSlice<i32> {
    dev.stream().clone_htod(s).unwrap()
}

/// `[rows, n]` of `Σ_k a[r, k] · B_g[c, k]` per group (B_g given `[n, k]`), zeros past the groups.
fn rows_reference(a: &[f32], b: &[Vec<f32>], s: &[i32], rows: usize, k: usize, n: usize, mul: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0f64; rows * n];
    let mut r0 = 0usize;
    for (g, &m) in s.iter().enumerate() {
        for r in r0..r0 + m as usize {
            for c in 0..n {
                let acc: f64 = (0..k).map(|i| a[r * k + i] as f64 * b[g][c * k + i] as f64).sum();
                out[r * n + c] = acc * mul[g];
            }
        }
        r0 += m as usize;
    }
    out
}

fn transpose(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols * rows).map(|i| v[(i % rows) * cols + i / rows]).collect()
}

#[test]
fn rows_split_matches_the_f64_product() {
    let Some(dev) = device() else { return };
    let (rows, k, n) = (470, 96, 144);
    let s = [37, 0, 200, 129, 64]; // Σ 430: 40 rows of zeros after them
    let groups = s.len();
    for (t, b_k_major, out, with_bias) in [
        (DType::BF16, true, DType::BF16, true),
        (DType::BF16, false, DType::F32, true),
        (DType::F16, true, DType::F16, false),
        (DType::F16, false, DType::BF16, false),
    ] {
        let a = rounded(t, randn(1, rows * k, 1.0));
        let b: Vec<Vec<f32>> = (0..groups).map(|g| rounded(t, randn(10 + g as u64, n * k, 1.0))).collect();
        let at = Tensor::from_f32(&dev, t, &[rows, k], &a).unwrap();
        let bt: Vec<Tensor> = b
            .iter()
            .map(|w| {
                if b_k_major {
                    Tensor::from_f32(&dev, t, &[n, k], w).unwrap()
                } else {
                    Tensor::from_f32(&dev, t, &[k, n], &transpose(w, n, k)).unwrap()
                }
            })
            .collect();
        let refs: Vec<&Tensor> = bt.iter().collect();
        let mut d = Tensor::from_f32(&dev, out, &[rows, n], &vec![7.0; rows * n]).unwrap();
        let (mut tab, mut st) = (tables(&dev, groups), GroupedStatus::new(&dev).unwrap());
        let bias: Vec<Vec<f32>> = (0..groups).map(|g| rounded(out, randn(30 + g as u64, n, 4.0))).collect();
        let bias_t: Vec<Tensor> = bias.iter().map(|v| Tensor::from_f32(&dev, out, &[n], v).unwrap()).collect();
        let bias_refs: Vec<&Tensor> = bias_t.iter().collect();
        let bias_arg = with_bias.then_some(bias_refs.as_slice());
        let w = GroupedWeights { tensors: &refs, k_major: b_k_major, scale_inv: None, bias: bias_arg };
        grouped_gemm_rows(&dev, &at, None, &w, &splits(&dev, &s), &mut d, 0.5, (&mut tab, &mut st)).unwrap();
        st.check(&dev).unwrap();
        let got = d.to_f32(&dev).unwrap();
        let mut want = rows_reference(&a, &b, &s, rows, k, n, &[0.5; 5]);
        if with_bias {
            let mut r0 = 0;
            for (g, &m) in s.iter().enumerate() {
                for r in r0..r0 + m as usize {
                    for c in 0..n {
                        want[r * n + c] += bias[g][c] as f64;
                    }
                }
                r0 += m as usize;
            }
        }
        let err = rel_fro(&got, &want);
        let tol = if out == DType::F32 { 1e-5 } else { 4e-3 };
        assert!(err < tol, "{t} b_k_major {b_k_major} -> {out} bias {with_bias}: relative error {err}");
        assert!(got[430 * n..].iter().all(|&v| v == 0.0), "{t}: the tail past the groups must be zeros");
    }
}

#[test]
fn rows_split_in_fp8_applies_the_scale_invs() {
    let Some(dev) = device() else { return };
    let (rows, k, n) = (300, 160, 272);
    let s = [64, 128, 0, 96];
    let groups = s.len();
    for (ta, tb) in [(DType::E4M3, DType::E4M3), (DType::E5M2, DType::E4M3)] {
        let a = rounded(ta, randn(2, rows * k, 8.0));
        let b: Vec<Vec<f32>> = (0..groups).map(|g| rounded(tb, randn(20 + g as u64, n * k, 8.0))).collect();
        let at = Tensor::from_f32(&dev, ta, &[rows, k], &a).unwrap();
        let bt: Vec<Tensor> = b.iter().map(|w| Tensor::from_f32(&dev, tb, &[n, k], w).unwrap()).collect();
        let refs: Vec<&Tensor> = bt.iter().collect();
        let a_si = dev.stream().clone_htod(&[0.125f32]).unwrap();
        let b_si: Vec<CudaSlice<f32>> =
            (0..groups).map(|g| dev.stream().clone_htod(&[0.25f32 * (g + 1) as f32]).unwrap()).collect();
        let b_views: Vec<_> = b_si.iter().map(|v| v.slice(..)).collect();
        let mut d = Tensor::zeros(&dev, DType::BF16, &[rows, n]).unwrap();
        let (mut tab, mut st) = (tables(&dev, groups), GroupedStatus::new(&dev).unwrap());
        let w = GroupedWeights { tensors: &refs, k_major: true, scale_inv: Some(&b_views), bias: None };
        let sp = splits(&dev, &s);
        grouped_gemm_rows(&dev, &at, Some(a_si.slice(..)), &w, &sp, &mut d, 1.0, (&mut tab, &mut st)).unwrap();
        st.check(&dev).unwrap();
        let mul: Vec<f64> = (0..groups).map(|g| 0.125 * 0.25 * (g + 1) as f64).collect();
        let err = rel_fro(&d.to_f32(&dev).unwrap(), &rows_reference(&a, &b, &s, rows, k, n, &mul));
        assert!(err < 4e-3, "{ta} x {tb}: relative error {err}");
    }
}

/// `D_g[i, j] = Σ_{t ∈ g} a[t, i] · b[t, j]` (a `[total, m]`, b `[total, n]`).
fn reduction_reference(a: &[f32], b: &[f32], s: &[i32], m: usize, n: usize, mul: f64) -> Vec<Vec<f64>> {
    let mut t0 = 0usize;
    s.iter()
        .map(|&len| {
            let mut d = vec![0.0f64; m * n];
            for t in t0..t0 + len as usize {
                for i in 0..m {
                    for j in 0..n {
                        d[i * n + j] += a[t * m + i] as f64 * b[t * n + j] as f64 * mul;
                    }
                }
            }
            t0 += len as usize;
            d
        })
        .collect()
}

#[test]
fn reduction_split_matches_the_f64_product() {
    let Some(dev) = device() else { return };
    let (total, m, n) = (250, 144, 112);
    let s = [48, 0, 131, 17]; // Σ 196: the last 54 rows belong to no group
    let groups = s.len();
    for (t, k_major, out, accumulate) in [
        (DType::BF16, false, DType::F32, false),
        (DType::BF16, false, DType::F32, true),
        (DType::BF16, false, DType::BF16, false),
        (DType::BF16, false, DType::BF16, true),
        (DType::F16, false, DType::F32, true),
    ] {
        let a = rounded(t, randn(3, total * m, 1.0));
        let b = rounded(t, randn(4, total * n, 1.0));
        let at = Tensor::from_f32(&dev, t, &[total, m], &a).unwrap();
        let bt = Tensor::from_f32(&dev, t, &[total, n], &b).unwrap();
        let start = 3.0f32;
        let mut d: Vec<Tensor> =
            (0..groups).map(|_| Tensor::from_f32(&dev, out, &[m, n], &vec![start; m * n]).unwrap()).collect();
        let mut refs: Vec<&mut Tensor> = d.iter_mut().collect();
        let (mut tab, mut st) = (tables(&dev, groups), GroupedStatus::new(&dev).unwrap());
        grouped_gemm_reduction(
            &dev,
            (&at, k_major, None),
            (&bt, k_major, None),
            &splits(&dev, &s),
            &mut refs,
            (2.0, accumulate),
            (&mut tab, &mut st),
        )
        .unwrap();
        st.check(&dev).unwrap();
        let want = reduction_reference(&a, &b, &s, m, n, 2.0);
        for (g, (dg, wg)) in d.iter().zip(&want).enumerate() {
            let got = dg.to_f32(&dev).unwrap();
            let wg: Vec<f64> = wg.iter().map(|&w| if accumulate { w + start as f64 } else { w }).collect();
            if s[g] == 0 {
                let empty = if accumulate { start } else { 0.0 };
                assert!(got.iter().all(|&v| v == empty), "{t}: group {g} has no rows: {empty} everywhere");
                continue;
            }
            let err = rel_fro(&got, &wg);
            let tol = if out == DType::F32 { 1e-5 } else { 4e-3 };
            assert!(err < tol, "{t} -> {out} acc {accumulate}: group {g} relative error {err}");
        }
    }
}

#[test]
fn reduction_split_in_fp8_reads_transposed_codes() {
    let Some(dev) = device() else { return };
    let (total, m, n) = (208, 48, 160);
    let s = [64, 16, 0, 112]; // multiples of 16; Σ 192
    let groups = s.len();
    let a = rounded(DType::E5M2, randn(5, total * m, 4.0));
    let b = rounded(DType::E4M3, randn(6, total * n, 4.0));
    // K-major: the transposes, [m, total] and [n, total].
    let at = Tensor::from_f32(&dev, DType::E5M2, &[m, total], &transpose(&a, total, m)).unwrap();
    let bt = Tensor::from_f32(&dev, DType::E4M3, &[n, total], &transpose(&b, total, n)).unwrap();
    let (sa, sb) = (dev.stream().clone_htod(&[0.5f32]).unwrap(), dev.stream().clone_htod(&[0.125f32]).unwrap());
    let mut d: Vec<Tensor> = (0..groups).map(|_| Tensor::zeros(&dev, DType::F32, &[m, n]).unwrap()).collect();
    let mut refs: Vec<&mut Tensor> = d.iter_mut().collect();
    let (mut tab, mut st) = (tables(&dev, groups), GroupedStatus::new(&dev).unwrap());
    grouped_gemm_reduction(
        &dev,
        (&at, true, Some(sa.slice(..))),
        (&bt, true, Some(sb.slice(..))),
        &splits(&dev, &s),
        &mut refs,
        (1.0, true),
        (&mut tab, &mut st),
    )
    .unwrap();
    st.check(&dev).unwrap();
    let want = reduction_reference(&a, &b, &s, m, n, 0.5 * 0.125);
    for (g, (dg, wg)) in d.iter().zip(&want).enumerate() {
        let got = dg.to_f32(&dev).unwrap();
        if s[g] == 0 {
            assert!(got.iter().all(|&v| v == 0.0), "group {g}");
        } else {
            // Hopper's FP8 wgmma accumulates with fewer bits than f32 (as cuBLASLt's fast
            // accumulation): 6e-5 here.
            let err = rel_fro(&got, wg);
            assert!(err < 1e-3, "group {g}: relative error {err}");
        }
    }
}

#[test]
fn bad_sizes_are_flagged_and_bad_shapes_are_typed_errors() {
    let Some(dev) = device() else { return };
    let (rows, k, n) = (64, 32, 32);
    let at = Tensor::from_f32(&dev, DType::BF16, &[rows, k], &randn(7, rows * k, 1.0)).unwrap();
    let bt = Tensor::from_f32(&dev, DType::BF16, &[n, k], &randn(8, n * k, 1.0)).unwrap();
    let refs = [&bt, &bt];
    let w = GroupedWeights { tensors: &refs, k_major: true, scale_inv: None, bias: None };
    let (mut tab, mut st) = (tables(&dev, 2), GroupedStatus::new(&dev).unwrap());
    let mut d = Tensor::zeros(&dev, DType::BF16, &[rows, n]).unwrap();
    for bad in [[-1, 8], [40, 40]] {
        grouped_gemm_rows(&dev, &at, None, &w, &splits(&dev, &bad), &mut d, 1.0, (&mut tab, &mut st)).unwrap();
        let err = st.check(&dev).unwrap_err();
        assert!(matches!(err, Error::Shape { .. }) && err.to_string().contains("m_splits"), "{bad:?}: {err}");
        st.check(&dev).unwrap(); // cleared
    }
    // FP8 wgrad sizes must be multiples of 16.
    let a8 = Tensor::zeros(&dev, DType::E4M3, &[n, rows]).unwrap();
    let s8 = dev.stream().clone_htod(&[1.0f32]).unwrap();
    let mut dd: Vec<Tensor> = (0..2).map(|_| Tensor::zeros(&dev, DType::F32, &[n, n]).unwrap()).collect();
    let mut drefs: Vec<&mut Tensor> = dd.iter_mut().collect();
    grouped_gemm_reduction(
        &dev,
        (&a8, true, Some(s8.slice(..))),
        (&a8, true, Some(s8.slice(..))),
        &splits(&dev, &[8, 40]),
        &mut drefs,
        (1.0, false),
        (&mut tab, &mut st),
    )
    .unwrap();
    assert!(st.check(&dev).is_err(), "a split of 8 rows in FP8 wgrad");
    // Host-side: k not a multiple of 16, the wrong number of splits, a B of another shape.
    let a_odd = Tensor::zeros(&dev, DType::BF16, &[rows, 24]).unwrap();
    let b_odd = Tensor::zeros(&dev, DType::BF16, &[n, 24]).unwrap();
    let odd = [&b_odd, &b_odd];
    let w_odd = GroupedWeights { tensors: &odd, k_major: true, scale_inv: None, bias: None };
    let e = grouped_gemm_rows(&dev, &a_odd, None, &w_odd, &splits(&dev, &[32, 32]), &mut d, 1.0, (&mut tab, &mut st));
    assert!(e.unwrap_err().to_string().contains("multiple of 16"));
    let e = grouped_gemm_rows(&dev, &at, None, &w, &splits(&dev, &[64]), &mut d, 1.0, (&mut tab, &mut st));
    assert!(e.unwrap_err().to_string().contains("m_splits"));
    let mixed = [&bt, &b_odd];
    let w_mixed = GroupedWeights { tensors: &mixed, k_major: true, scale_inv: None, bias: None };
    let e = grouped_gemm_rows(&dev, &at, None, &w_mixed, &splits(&dev, &[32, 32]), &mut d, 1.0, (&mut tab, &mut st));
    assert!(e.unwrap_err().to_string().contains("group 1"));
}

/// The bias gradient of the rows split: each group's column sums of dy, written and accumulated
/// in bf16 and f32, an empty group, rows past the groups ignored; the same bits every run.
#[test]
fn dbias_sums_each_groups_rows() {
    let Some(dev) = device() else { return };
    let (total, m) = (300, 208);
    let s = [70, 0, 129, 33]; // Σ 232
    let dy = rounded(DType::BF16, randn(9, total * m, 1.0));
    let dyt = Tensor::from_f32(&dev, DType::BF16, &[total, m], &dy).unwrap();
    let mut want = vec![vec![0.0f64; m]; s.len()];
    let mut r0 = 0;
    for (g, &rows) in s.iter().enumerate() {
        for r in r0..r0 + rows as usize {
            for c in 0..m {
                want[g][c] += dy[r * m + c] as f64;
            }
        }
        r0 += rows as usize;
    }
    let mut tab = tables(&dev, s.len());
    for (out, accumulate) in [(DType::BF16, false), (DType::F32, false), (DType::F32, true), (DType::BF16, true)] {
        let start = 2.0f32;
        let mut d: Vec<Tensor> =
            (0..s.len()).map(|_| Tensor::from_f32(&dev, out, &[m], &vec![start; m]).unwrap()).collect();
        let mut refs: Vec<&mut Tensor> = d.iter_mut().collect();
        grouped_dbias(&dev, &dyt, &splits(&dev, &s), &mut refs, accumulate, &mut tab).unwrap();
        let first: Vec<Vec<u8>> = d.iter().map(|t| t.to_bytes(&dev).unwrap()).collect();
        for (g, dg) in d.iter().enumerate() {
            let got = dg.to_f32(&dev).unwrap();
            let base = if accumulate { start as f64 } else { 0.0 };
            let tol = if out == DType::F32 { 1e-4 } else { 1e-2 };
            for (c, (&x, &w)) in got.iter().zip(&want[g]).enumerate() {
                let w = w + base;
                assert!(
                    (x as f64 - w).abs() <= tol * (1.0 + w.abs()),
                    "{out} acc {accumulate}: group {g} col {c}: {x} vs {w}"
                );
            }
        }
        if !accumulate {
            let mut refs: Vec<&mut Tensor> = d.iter_mut().collect();
            grouped_dbias(&dev, &dyt, &splits(&dev, &s), &mut refs, false, &mut tab).unwrap();
            for (g, dg) in d.iter().enumerate() {
                assert_eq!(dg.to_bytes(&dev).unwrap(), first[g], "{out}: group {g} deterministic");
            }
        }
    }
}
