//! Family 9: RoPE forward and backward, sbhd bf16, s = 2048, b = 4, h = 32, d = d2 = 128 (per
//! element: read 2 B, write 2 B; plus the `[s, d2]` f32 angles, read once per position; target
//! ≥ 0.85 of copy bandwidth, as for the other streaming kernels).

use crate::harness::{random_bytes, Bench, Target};
use te_runtime::ops::rope::{backward, forward, RopeFormat};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("rope") {
        return;
    }
    let dev = b.dev().clone();
    let (s, batch, h, d) = (2048usize, 4usize, 32usize, 128usize);
    let shape = [s, batch, h, d];
    let n = s * batch * h * d;
    let label = format!("{s}x{batch}x{h}x{d}");
    let angles: Vec<f32> = (0..s)
        .flat_map(|p| (0..d).map(move |c| p as f32 * 10000f32.powf(-2.0 * (c % (d / 2)) as f32 / d as f32)))
        .collect();
    let freqs = Tensor::from_f32(&dev, DType::F32, &[s, 1, 1, d], &angles).unwrap();
    let t = Tensor::from_bytes(&dev, DType::BF16, &shape, &random_bytes(DType::BF16, n, 1)).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &shape).unwrap();
    let bytes = Some((4 * n + 4 * s * d) as u64);

    let st = b.time(5, 50, |_| forward(&dev, RopeFormat::Sbhd, &t, &freqs, &mut out).unwrap());
    b.record("rope fwd sbhd bf16", &label, st, bytes, Some(Target::CopyFraction(0.85)));
    let st = b.time(5, 50, |_| backward(&dev, RopeFormat::Sbhd, &t, &freqs, &mut out).unwrap());
    b.record("rope bwd sbhd bf16", &label, st, bytes, Some(Target::CopyFraction(0.85)));
}
