//! cuBLASLt GEMMs in TFLOP/s (`2·m·n·k / time`): FP8 E4M3 × E4M3 → bf16 with fast accumulation
//! (TE's fprop) at Linear shapes `tokens × out_features × in_features`, and a bf16 GEMM as the
//! device's reference. `benches/anchors/scaled_mm.py` times `torch._scaled_mm` on the same shapes.

use crate::harness::{random_bytes, Bench};
use te_runtime::gemm::{gemm, GemmConfig, Operand, Output};
use te_runtime::{DType, Tensor};

const FP8_SHAPES: [(usize, usize, usize); 4] =
    [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 8192), (8192, 4096, 16384)];

pub fn run(b: &mut Bench) {
    if !b.enabled("gemm") {
        return;
    }
    let dev = b.dev().clone();
    let random = |dtype, rows: usize, cols: usize, seed| {
        Tensor::from_bytes(&dev, dtype, &[rows, cols], &random_bytes(dtype, rows * cols, seed)).unwrap()
    };
    let scale_inv = dev.stream().clone_htod(&[0.5f32]).unwrap();
    for (m, n, k) in FP8_SHAPES {
        let x = random(DType::E4M3, m, k, 1);
        let w = random(DType::E4M3, n, k, 2);
        let mut y = Tensor::zeros(&dev, DType::BF16, &[m, n]).unwrap();
        let cfg = GemmConfig { fast_accum: true, ..Default::default() };
        let st = b.time(10, 50, |_| {
            let (x, w) = (Operand::fp8(&x, scale_inv.as_view()), Operand::fp8(&w, scale_inv.as_view()));
            gemm(&dev, x, w, Output::new(&mut y), &cfg).unwrap()
        });
        b.record_flops("gemm e4m3×e4m3→bf16 fast accum", &format!("{m}x{n}x{k}"), st, (2 * m * n * k) as u64);
    }
    let s = 8192;
    let x = random(DType::BF16, s, s, 3);
    let w = random(DType::BF16, s, s, 4);
    let mut y = Tensor::zeros(&dev, DType::BF16, &[s, s]).unwrap();
    let st = b.time(10, 50, |_| {
        gemm(&dev, Operand::new(&x), Operand::new(&w), Output::new(&mut y), &GemmConfig::default()).unwrap()
    });
    b.record_flops("gemm bf16×bf16→bf16 (device reference)", &format!("{s}x{s}x{s}"), st, (2 * s * s * s) as u64);
}
