//! The grouped GEMM with device `m_splits` (family 19) pass by pass at the `grouped_linear`
//! shape (8 experts, 8192 rows split unevenly, 4096 → 14336, Mixtral's FFN) and at `moe-small`'s
//! fc1 (8 experts, 8 × 1024 tokens routed top-2, 768 → 1536), beside the same
//! products as one cuBLASLt GEMM per expert on the host's splits (what `GroupedLinear::forward`
//! runs): fprop (`x · W_gᵀ`), dgrad (`dy · W_g`, W read MN-major), wgrad (`dy_gᵀ · x_g`, both
//! MN-major, written and accumulated), and FP8 E4M3 fprop. TFLOP/s = `2·m·n·k / time`.

use crate::harness::{random_bytes, Bench};
use te_runtime::gemm::{gemm, GemmConfig, Operand, Output};
use te_runtime::ops::grouped_gemm::{
    grouped_gemm_reduction, grouped_gemm_rows, GroupedStatus, GroupedTables, GroupedWeights,
};
use te_runtime::{DType, Tensor};

/// `(rows per expert, in_features, out_features)`.
const SHAPES: [([usize; 8], usize, usize); 2] = [
    ([1536, 512, 2048, 768, 1024, 256, 1280, 768], 4096, 14336),
    ([2304, 1792, 2560, 1536, 2048, 1792, 2304, 2048], 768, 1536),
];

pub fn run(b: &mut Bench) {
    if !b.enabled("grouped_gemm") {
        return;
    }
    for (splits, k, n) in SHAPES {
        one_shape(b, &splits, k, n);
    }
}

fn one_shape(b: &mut Bench, per_expert: &[usize], k: usize, n: usize) {
    let dev = b.dev().clone();
    let rows: usize = per_expert.iter().sum();
    let random = |dtype, shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_bytes(&dev, dtype, shape, &random_bytes(dtype, n, seed)).unwrap()
    };
    let (x, dy) = (random(DType::BF16, &[rows, k], 1), random(DType::BF16, &[rows, n], 2));
    let w: Vec<Tensor> = (0..per_expert.len()).map(|g| random(DType::BF16, &[n, k], 10 + g as u64)).collect();
    let wr: Vec<&Tensor> = w.iter().collect();
    let splits = dev.stream().clone_htod(&per_expert.iter().map(|&m| m as i32).collect::<Vec<_>>()).unwrap();
    let mut tables = GroupedTables::new(&dev, 8).unwrap();
    let mut status = GroupedStatus::new(&dev).unwrap();
    let flops = (2 * rows * k * n) as u64;
    let shape = format!("{rows}x{k}->{n} e{}", per_expert.len());
    let (xs, dys) = (x.split_rows(&dev, per_expert).unwrap(), dy.split_rows(&dev, per_expert).unwrap());

    let mut y = Tensor::empty(&dev, DType::BF16, &[rows, n]).unwrap();
    let st = b.time(3, 20, |_| {
        let g = GroupedWeights { tensors: &wr, k_major: true, scale_inv: None, bias: None };
        grouped_gemm_rows(&dev, &x, None, &g, &splits, &mut y, 1.0, (&mut tables, &mut status)).unwrap()
    });
    b.record_flops("grouped_gemm fprop bf16, device splits", &shape, st, flops);
    let mut ys: Vec<Tensor> = per_expert.iter().map(|&m| Tensor::empty(&dev, DType::BF16, &[m, n]).unwrap()).collect();
    let st = b.time(3, 20, |_| {
        for ((xi, wi), yi) in xs.iter().zip(&w).zip(&mut ys) {
            gemm(&dev, Operand::new(xi), Operand::new(wi), Output::new(yi), &GemmConfig::default()).unwrap();
        }
    });
    b.record_flops("grouped_gemm fprop bf16, cuBLASLt per expert", &shape, st, flops);

    let mut dx = Tensor::empty(&dev, DType::BF16, &[rows, k]).unwrap();
    let st = b.time(3, 20, |_| {
        let g = GroupedWeights { tensors: &wr, k_major: false, scale_inv: None, bias: None };
        grouped_gemm_rows(&dev, &dy, None, &g, &splits, &mut dx, 1.0, (&mut tables, &mut status)).unwrap()
    });
    b.record_flops("grouped_gemm dgrad bf16, device splits", &shape, st, flops);

    let mut dw: Vec<Tensor> =
        (0..per_expert.len()).map(|_| Tensor::zeros(&dev, DType::BF16, &[n, k]).unwrap()).collect();
    for accumulate in [false, true] {
        let st = b.time(3, 20, |_| {
            let mut targets: Vec<&mut Tensor> = dw.iter_mut().collect();
            let (a, bb) = ((&dy, false, None), (&x, false, None));
            let mode = (1.0, accumulate);
            grouped_gemm_reduction(&dev, a, bb, &splits, &mut targets, mode, (&mut tables, &mut status)).unwrap()
        });
        let name = format!("grouped_gemm wgrad bf16{}, device splits", if accumulate { " +=" } else { "" });
        b.record_flops(&name, &shape, st, flops);
    }
    let st = b.time(3, 20, |_| {
        for ((dyi, xi), dwi) in dys.iter().zip(&xs).zip(&mut dw) {
            let (a, bb) = (Operand::new(dyi).transposed(), Operand::new(xi).transposed());
            let cfg = GemmConfig { accumulate: true, ..Default::default() };
            gemm(&dev, a, bb, Output::new(dwi), &cfg).unwrap();
        }
    });
    b.record_flops("grouped_gemm wgrad bf16 +=, cuBLASLt per expert", &shape, st, flops);

    // FP8 E4M3 fprop, one scale_inv per expert.
    let x8 = random(DType::E4M3, &[rows, k], 3);
    let w8: Vec<Tensor> = (0..per_expert.len()).map(|g| random(DType::E4M3, &[n, k], 20 + g as u64)).collect();
    let w8r: Vec<&Tensor> = w8.iter().collect();
    let si = dev.stream().clone_htod(&[0.5f32]).unwrap();
    let sis: Vec<_> = (0..per_expert.len()).map(|_| si.slice(..)).collect();
    let st = b.time(3, 20, |_| {
        let g = GroupedWeights { tensors: &w8r, k_major: true, scale_inv: Some(&sis), bias: None };
        grouped_gemm_rows(&dev, &x8, Some(si.slice(..)), &g, &splits, &mut y, 1.0, (&mut tables, &mut status)).unwrap()
    });
    b.record_flops("grouped_gemm fprop e4m3, device splits", &shape, st, flops);
    let x8s = x8.split_rows(&dev, per_expert).unwrap();
    let cfg = GemmConfig { fast_accum: true, ..Default::default() };
    let st = b.time(3, 20, |_| {
        for ((xi, wi), yi) in x8s.iter().zip(&w8).zip(&mut ys) {
            let (a, bb) = (Operand::fp8(xi, si.as_view()), Operand::fp8(wi, si.as_view()));
            gemm(&dev, a, bb, Output::new(yi), &cfg).unwrap();
        }
    });
    b.record_flops("grouped_gemm fprop e4m3, cuBLASLt per expert", &shape, st, flops);
    status.check(&dev).unwrap();
}
