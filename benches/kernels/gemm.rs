//! cuBLASLt GEMMs in TFLOP/s (`2·m·n·k / time`) at Linear shapes `tokens × out_features ×
//! in_features`: FP8 E4M3 × E4M3 → bf16 with fast accumulation (TE's fprop) beside a bf16 GEMM
//! of the same shape, and the blockwise-scaled FP8 GEMM of TE's `Float8BlockScaling` (1×128 tiles
//! times 128×128 blocks, precise accumulation). The best rate of each precision is the GEMM peak
//! of compare.py's roofline.
//! `benches/anchors/gemm.py` times `torch._scaled_mm` and a bf16 `torch.matmul` on the same
//! shapes.

use crate::harness::{random_bytes, Bench, Work};
use te_runtime::gemm::{gemm, BlockScale, GemmConfig, Operand, Output};
use te_runtime::{DType, Tensor};

/// `(m, n, k)`; `benches/anchors/gemm.py` has the same list.
const SHAPES: [(usize, usize, usize); 4] =
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
    let work = |variant: &str, flops_fp8| Work {
        section: "gemm",
        work: "gemm".into(),
        pass: "gemm",
        variant: variant.into(),
        precision: if flops_fp8 > 0 { "fp8" } else { "bf16" },
        flops_fp8,
        tokens: None,
    };
    for (m, n, k) in SHAPES {
        let (shape, flops) = (format!("{m}x{n}x{k}"), (2 * m * n * k) as u64);
        let x = random(DType::E4M3, m, k, 1);
        let w = random(DType::E4M3, n, k, 2);
        let mut y = Tensor::empty(&dev, DType::BF16, &[m, n]).unwrap();
        let cfg = GemmConfig { fast_accum: true, ..Default::default() };
        let st = b.time(10, 50, |_| {
            let (x, w) = (Operand::fp8(&x, scale_inv.as_view()), Operand::fp8(&w, scale_inv.as_view()));
            gemm(&dev, x, w, Output::new(&mut y), &cfg).unwrap()
        });
        b.record_work(&shape, st, flops, None, work("ours fp8", flops));
        // TE's Float8BlockScaling fprop: X in 1x128 tiles, W in 128x128 blocks, precise
        // accumulation (cuBLASLt has no fast accumulation with block scales).
        let sx = dev.stream().clone_htod(&vec![0.5f32; BlockScale::Vec128.len(m, k)]).unwrap();
        let sw = dev.stream().clone_htod(&vec![0.5f32; BlockScale::Blk128x128.len(n, k)]).unwrap();
        let st = b.time(10, 50, |_| {
            let xo = Operand::fp8_block(&x, sx.as_view(), BlockScale::Vec128);
            let wo = Operand::fp8_block(&w, sw.as_view(), BlockScale::Blk128x128);
            gemm(&dev, xo, wo, Output::new(&mut y), &GemmConfig::default()).unwrap()
        });
        b.record_work(&shape, st, flops, None, work("ours fp8 block 1x128·128x128", flops));
        let x = random(DType::BF16, m, k, 3);
        let w = random(DType::BF16, n, k, 4);
        let st = b.time(10, 50, |_| {
            gemm(&dev, Operand::new(&x), Operand::new(&w), Output::new(&mut y), &GemmConfig::default()).unwrap()
        });
        b.record_work(&shape, st, flops, None, work("ours bf16", 0));
    }
}
