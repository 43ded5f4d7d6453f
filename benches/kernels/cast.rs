//! Family 1: quantize bf16 → E4M3 (read 2 B + write 1 B per element).

use crate::harness::{random_bytes, Bench};
use te_runtime::ops::{cast, Fp8Meta};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("quantize") {
        return;
    }
    let dev = b.dev().clone();
    for (rows, cols) in [(8192usize, 8192usize), (16384, 4096)] {
        let n = rows * cols;
        let x = Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, n, 1)).unwrap();
        let mut q = Tensor::zeros(&dev, DType::E4M3, &[rows, cols]).unwrap();
        let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
        let st = b.time(5, 50, |_| cast::quantize(&dev, &x, &mut q, &mut meta.scaling()).unwrap());
        b.record("quantize bf16→e4m3", &format!("{rows}x{cols}"), st, Some(3 * n as u64), None);
    }
}
