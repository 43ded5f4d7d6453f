//! Family 10: the hidden dropout `out = residual + dropout(x + bias)` bf16 at 8192x4096, p = 0.1
//! (per element: read x and residual 2 + 2 B, write out 2 B and 1/8 B of mask; target ≥ 0.85
//! of copy bandwidth, as for the other streaming kernels), and its backward (read dout 2 B and
//! the mask, write dx 2 B; no target).

use crate::harness::{random_bytes, Bench, Target};
use te_runtime::ops::dropout::{bias_dropout_add, dropout_backward, mask_bytes, DropoutParams};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("dropout") {
        return;
    }
    let dev = b.dev().clone();
    let (rows, cols) = (8192usize, 4096usize);
    let n = rows * cols;
    let label = format!("{rows}x{cols}");
    let tensor = |shape: &[usize], seed| {
        Tensor::from_bytes(&dev, DType::BF16, shape, &random_bytes(DType::BF16, shape.iter().product(), seed)).unwrap()
    };
    let (x, bias, residual) = (tensor(&[rows, cols], 1), tensor(&[cols], 2), tensor(&[rows, cols], 3));
    let mut out = Tensor::zeros(&dev, DType::BF16, &[rows, cols]).unwrap();
    let mut mask = dev.stream().alloc_zeros::<u8>(mask_bytes(n)).unwrap();
    let params = |i: usize| DropoutParams { p: 0.1, seed: 1234, offset: i as u64 };

    let st =
        b.time(5, 50, |i| bias_dropout_add(&dev, &x, Some(&bias), &residual, params(i), &mut out, &mut mask).unwrap());
    let bytes = (6 * n + mask_bytes(n) + 2 * cols) as u64;
    b.record("bias_dropout_add bf16 p=0.1", &label, st, Some(bytes), Some(Target::CopyFraction(0.85)));

    let st = b.time(5, 50, |_| dropout_backward(&dev, &residual, &mask, 0.1, &mut out).unwrap());
    b.record("dropout bwd bf16", &label, st, Some((4 * n + mask_bytes(n)) as u64), None);
}
