//! Family 6: causal softmax forward and backward, bf16, batch*heads = 64, sq = sk = 2048. Bytes
//! moved: forward reads the visible half of the scores (the kernel skips keys past the query)
//! and writes every probability; backward reads dy and y and writes dx. No target.

use crate::harness::{random_bytes, Bench};
use te_runtime::ops::softmax::{self, Mask};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("softmax") {
        return;
    }
    let dev = b.dev().clone();
    let (bh, sq, sk) = (64usize, 2048usize, 2048usize);
    let shape = [1, bh, sq, sk];
    let n = bh * sq * sk;
    let label = format!("{bh}x{sq}x{sk}");
    let scale = 1.0 / 128f32.sqrt();
    let bf16 = |seed| Tensor::from_bytes(&dev, DType::BF16, &shape, &random_bytes(DType::BF16, n, seed)).unwrap();

    let x = bf16(1);
    let mut y = Tensor::zeros(&dev, DType::BF16, &shape).unwrap();
    let st = b.time(5, 50, |_| softmax::forward(&dev, &x, Mask::Causal, scale, &mut y).unwrap());
    // Reads: keys 0..=q of each row in whole 16-byte vectors (≈ half), writes: all.
    let read = bh * (0..sq).map(|q| (q / 8 + 1) * 8).sum::<usize>();
    b.record("softmax fwd causal bf16", &label, st, Some(2 * (read + n) as u64), None);

    let dy = bf16(2);
    let mut dx = Tensor::zeros(&dev, DType::BF16, &shape).unwrap();
    let st = b.time(5, 50, |_| softmax::backward(&dev, &dy, &y, scale, &mut dx).unwrap());
    b.record("softmax bwd bf16", &label, st, Some(6 * n as u64), None);
}
