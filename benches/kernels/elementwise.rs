//! Family 8: gradient accumulation `main_grad += grad`, f32 += bf16 at 4096x16384 (per element:
//! read dst 4 B and src 2 B, write dst 4 B; target ≥ 0.85 of copy bandwidth, as for the other
//! streaming kernels), and a bf16 residual add (read 2 + 2 B, write 2 B; no target).

use crate::harness::{random_bytes, Bench, Target};
use te_runtime::ops::elementwise::{add, add_assign};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("elementwise") && !b.enabled("add_assign") {
        return;
    }
    let dev = b.dev().clone();
    let (rows, cols) = (4096usize, 16384usize);
    let n = rows * cols;
    let shape = format!("{rows}x{cols}");
    let tensor = |dtype, seed| Tensor::from_bytes(&dev, dtype, &[rows, cols], &random_bytes(dtype, n, seed)).unwrap();

    let mut main_grad = tensor(DType::F32, 1);
    let grad = tensor(DType::BF16, 2);
    let st = b.time(5, 50, |_| add_assign(&dev, &mut main_grad, &grad).unwrap());
    b.record("add_assign f32 += bf16", &shape, st, Some(10 * n as u64), Some(Target::CopyFraction(0.85)));
    drop(main_grad);

    let residual = tensor(DType::BF16, 3);
    let mut out = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let st = b.time(5, 50, |_| add(&dev, &residual, &grad, &mut out).unwrap());
    b.record("add bf16 + bf16 → bf16", &shape, st, Some(6 * n as u64), None);
}
