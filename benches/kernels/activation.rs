//! Family 4: GELU forward bf16 → E4M3 (read 2 B + write 1 B per element), SwiGLU forward bf16 →
//! E4M3 (read 2 × 2 B, write 1 B per output) and GELU backward bf16 (read dy and x, write dx:
//! 6 B per element). Bytes moved, no target.

use crate::harness::{random_bytes, Bench};
use te_codegen::spec::Activation;
use te_runtime::ops::{activation, Fp8Meta};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("activation") && !b.enabled("gelu") && !b.enabled("swiglu") {
        return;
    }
    let dev = b.dev().clone();
    let (rows, cols) = (8192usize, 16384usize);
    let n = rows * cols;
    let shape = format!("{rows}x{cols}");
    let bf16 = |shape: &[usize], seed| {
        let n = shape.iter().product();
        Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, n, seed)).unwrap()
    };

    let x = bf16(&[rows, cols], 1);
    let mut q = Tensor::zeros(&dev, DType::E4M3, &[rows, cols]).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let st = b.time(5, 50, |_| {
        activation::forward(&dev, Activation::Gelu, &x, None, &mut q, Some(&mut meta.scaling())).unwrap()
    });
    b.record("activation gelu fwd bf16→e4m3", &shape, st, Some(3 * n as u64), None);

    let xg = bf16(&[rows, 2 * cols], 2);
    let st = b.time(5, 50, |_| {
        activation::forward(&dev, Activation::Swiglu, &xg, None, &mut q, Some(&mut meta.scaling())).unwrap()
    });
    b.record("activation swiglu fwd bf16→e4m3", &format!("{shape} (in x2)"), st, Some(5 * n as u64), None);
    drop(xg);

    let dy = bf16(&[rows, cols], 3);
    let mut dx = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let st = b.time(5, 50, |_| activation::backward(&dev, Activation::Gelu, &dy, &x, &mut dx, None).unwrap());
    b.record("activation gelu bwd bf16", &shape, st, Some(6 * n as u64), None);
}
