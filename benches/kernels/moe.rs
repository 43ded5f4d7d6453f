//! Family 16 and 17 kernels, memory-bound: blockwise FP8 quantization of bf16 (1×128 tiles with
//! the transposed 128×1-tiled copy: read 2 B, write 2 × 1 B per element, plus the scales; with
//! the bias gradient fused the same, unfused 2 B more read; 128×128 blocks row-wise: read 2 B,
//! write 1 B) and the MoE permutation of 8192 tokens × 4096 hidden to top-2 of 8 experts
//! (permute: read 2 B, write 2 × 2 B per token element; unpermute with probabilities: read
//! 2 × 2 B, write 2 B), and the top-k softmax router forward of 8192 tokens × 64 experts to the
//! top 8 (read 2 B and write the 4 B score per logit, write 8 B per slot); and `MoeMLP` (the
//! block) at `moe-small`'s layer shape with the rows per expert on the host or the device.

use crate::harness::{random_bytes, Bench};
use te_nn::modules::{MoeMLP, MoeMLPConfig};
use te_runtime::ops::block_quantize::{
    block_dbias_workspace_len, quantize, quantize_dbias, BlockFp8, BlockQuantizeParams,
};
use te_runtime::ops::cast_transpose::{dbias, DbiasOut};
use te_runtime::ops::moe::{permute, routing_map, unpermute, MoeRouting};
use te_runtime::ops::moe_router::{topk_router, RouterConfig, RouterOutput};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    let dev = b.dev().clone();
    let bf16 = |rows: usize, cols: usize, seed| {
        Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, rows * cols, seed)).unwrap()
    };
    if b.enabled("block_quantize") {
        for (rows, cols) in [(8192usize, 8192usize), (16384, 4096)] {
            let (x, n) = (bf16(rows, cols, 1), (rows * cols) as u64);
            let p1 = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
            let mut q1 = BlockFp8::new(&dev, [rows, cols], &p1, true, true).unwrap();
            let st = b.time(5, 50, |_| quantize(&dev, &x, &p1, &mut q1).unwrap());
            b.record("block_quantize 1x128 + 128x1ᵀ bf16→e4m3", &format!("{rows}x{cols}"), st, Some(4 * n), None);
            let p2 = BlockQuantizeParams { block_dim: 2, ..p1 };
            let mut q2 = BlockFp8::new(&dev, [rows, cols], &p2, true, false).unwrap();
            let st = b.time(5, 50, |_| quantize(&dev, &x, &p2, &mut q2).unwrap());
            b.record("block_quantize 128x128 bf16→e4m3", &format!("{rows}x{cols}"), st, Some(3 * n), None);
        }
        // A gradient's cast with its bias gradient: fused into the column-wise pass, and the
        // unfused way (quantize, then a ones GEMM that reads dy again) for comparison.
        let (rows, cols) = (8192usize, 16384usize);
        let (dy, n, shape) = (bf16(rows, cols, 3), (rows * cols) as u64, format!("{rows}x{cols}"));
        let p1 = BlockQuantizeParams { dtype: DType::E4M3, block_dim: 1, epsilon: 0.0, power_2: true };
        let mut q = BlockFp8::new(&dev, [rows, cols], &p1, true, true).unwrap();
        let mut db = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
        let mut ws = dev.stream().alloc_zeros::<f32>(block_dbias_workspace_len(rows, cols)).unwrap();
        let st = b.time(5, 50, |_| {
            let d = DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() };
            quantize_dbias(&dev, &dy, &p1, &mut q, d).unwrap()
        });
        b.record("block_quantize 1x128 + 128x1ᵀ + dbias bf16→e4m3", &shape, st, Some(4 * n), None);
        let st = b.time(5, 50, |_| {
            quantize(&dev, &dy, &p1, &mut q).unwrap();
            dbias(&dev, &dy, &mut db).unwrap()
        });
        b.record("block_quantize 1x128 + 128x1ᵀ, dbias by a ones GEMM bf16→e4m3", &shape, st, Some(6 * n), None);
    }
    if b.enabled("moe_permute") {
        let (tokens, hidden, experts, k) = (8192usize, 4096usize, 8usize, 2usize);
        let indices: Vec<i32> = (0..tokens * k).map(|i| ((i / k * 5 + i % k * 3) % experts) as i32).collect();
        let idx = dev.stream().clone_htod(&indices).unwrap();
        let mut routing = MoeRouting::new(&dev, tokens, k, experts).unwrap();
        routing_map(&dev, &idx, &mut routing).unwrap();
        let probs = dev.stream().clone_htod(&vec![0.5f32; tokens * k]).unwrap();
        let x = bf16(tokens, hidden, 2);
        let shape = format!("{tokens}x{hidden} top{k} of {experts}");
        let n = (tokens * hidden) as u64;
        let st = b.time(5, 50, |_| routing_map(&dev, &idx, &mut routing).unwrap());
        b.record("moe routing map", &shape, st, Some(4 * (tokens * k * (experts + 1)) as u64), None);
        let mut y = Tensor::zeros(&dev, DType::BF16, &[tokens * k, hidden]).unwrap();
        let st = b.time(5, 50, |_| permute(&dev, &x, &routing, None, &mut y).unwrap());
        b.record("moe permute bf16", &shape, st, Some(2 * n + 2 * 2 * n), None);
        let mut out = Tensor::empty(&dev, DType::BF16, &[tokens, hidden]).unwrap();
        let st = b.time(5, 50, |_| unpermute(&dev, &y, &routing, Some(&probs), &mut out).unwrap());
        b.record("moe unpermute bf16", &shape, st, Some(2 * 2 * n + 2 * n), None);
    }
    if b.enabled("moe_router") {
        let (tokens, experts, k) = (8192usize, 64usize, 8usize);
        let logits = bf16(tokens, experts, 3);
        let mut out = RouterOutput::new(&dev, tokens, experts, RouterConfig::new(k)).unwrap();
        let st = b.time(5, 50, |_| topk_router(&dev, &logits, &mut out).unwrap());
        let bytes = (tokens * experts * (2 + 4) + tokens * k * (4 + 4)) as u64;
        b.record("moe_router top-k softmax fwd bf16", &format!("{tokens}x{experts} top{k}"), st, Some(bytes), None);
    }
    if b.enabled("moe_mlp") {
        // `moe-small`'s MoE block without biases (8 × 1024 tokens, hidden 768, 8 experts of
        // ffn 1536, top-2), BF16, forward + backward: the rows per expert copied to the host (one
        // synchronization a forward, then one cuBLASLt GEMM per expert) against kept on the device
        // (one grouped launch per pass, no synchronization).
        let (tokens, h, f) = (8192, 768, 1536);
        let (x, dy) = (bf16(tokens, h, 5), bf16(tokens, h, 6));
        let gemm = (2 * 2 * tokens * 2 * h * f) as u64; // fc1 and fc2 of the top-2 slots
        for device_m_splits in [false, true] {
            let cfg = MoeMLPConfig { bias: false, device_m_splits, ..MoeMLPConfig::new(h, f, 8, 2) };
            let mut m = MoeMLP::new(&dev, cfg).unwrap();
            let st = b.time_phases(3, 20, 2, |marks| {
                let (_, ctx) = m.forward(&x).unwrap();
                marks.mark();
                m.backward(ctx, &dy).unwrap();
                marks.mark();
            });
            let variant = if device_m_splits { "device m_splits" } else { "host m_splits" };
            let shape = format!("{tokens}x{h} ffn{f} e8 top2");
            b.record_flops(&format!("moe_mlp fwd bf16, {variant}"), &shape, st.phases[0], gemm);
            b.record_flops(&format!("moe_mlp fwd+bwd bf16, {variant}"), &shape, st.total, 3 * gemm);
        }
    }
}
