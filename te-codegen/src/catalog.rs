//! [`spec_catalog`]: specs spanning every discrete choice the templates offer, so CI can prove
//! that every kind of kernel the project can produce renders and compiles.

use crate::spec::*;
use crate::{Arch, DType};

/// Specs covering every discrete option of every template on `arch` (all dtype pairs, fusions,
/// activations, masks, directions), at feature sizes that are and are not tile multiples.
pub fn spec_catalog(arch: Arch) -> Vec<KernelSpec> {
    let hp = [DType::F32, DType::BF16, DType::F16];
    let fp8 = [DType::E4M3, DType::E5M2];
    let mut v: Vec<KernelSpec> = Vec::new();
    for &i in &hp {
        v.push(CastSpec::amax(i, arch).into());
        for &q in &fp8 {
            v.push(CastSpec::quantize(i, q, arch).into());
            v.push(CastSpec::dequantize(q, i, arch).into());
            for cols in [784, 4096] {
                v.push(CastTransposeSpec::new(i, q, cols, false, None, arch).into());
                v.push(CastTransposeSpec::new(i, q, cols, true, None, arch).into());
            }
            for act in [Activation::Gelu, Activation::GeluErf, Activation::Relu] {
                v.push(CastTransposeSpec::new(i, q, 784, true, Some(act), arch).into());
                v.push(CastTransposeSpec::new(i, q, 784, false, Some(act), arch).into());
            }
        }
        for act in Activation::ALL {
            for out in [i, DType::E4M3, DType::E5M2] {
                for bias in [false, true] {
                    v.push(ActivationSpec::new(act, Direction::Fwd, i, out, 784, bias, arch).into());
                }
                v.push(ActivationSpec::new(act, Direction::Bwd, i, out, 784, false, arch).into());
            }
        }
        for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
            for zc in [false, true] {
                for hidden in [784, 4096] {
                    for out in [i, DType::E4M3, DType::E5M2] {
                        v.push(NormSpec::new(kind, Direction::Fwd, i, out, i, hidden, zc, arch).into());
                    }
                    v.push(NormSpec::new(kind, Direction::Bwd, i, i, i, hidden, zc, arch).into());
                }
                v.push(NormSpec::new(kind, Direction::Fwd, i, i, i, 1000, zc, arch).into());
            }
        }
        for mask in [MaskKind::None, MaskKind::Causal, MaskKind::Padding] {
            for sk in [77, 1024, 4096] {
                v.push(SoftmaxSpec::new(mask, Direction::Fwd, i, sk, arch).into());
            }
        }
        for sk in [77, 1024, 4096] {
            v.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, i, sk, arch).into());
        }
        v.push(EmbeddingSpec::forward(i, arch).into());
        v.push(EmbeddingSpec::forward_fp8(DType::E4M3, i, arch).into());
        for grad in [false, true] {
            v.push(CrossEntropySpec::new(i, grad, arch).into());
        }
        // The cluster forms (sm_90a): one block a row (32k), Llama 3's 128k, Gemma 3's 262k.
        for vocab in [32_000, 128_256, 262_144] {
            let s = CrossEntropySpec::for_vocab(i, true, vocab, arch);
            if s.cluster > 0 {
                v.push(s.into());
            }
        }
        for &j in &hp {
            v.push(EmbeddingSpec::backward(i, j, arch).into());
            v.push(ElementwiseSpec::add_assign(i, j, arch).into());
            if i == j {
                v.push(ElementwiseSpec::scale_assign(i, arch).into());
            }
            for &o in &hp {
                v.push(ElementwiseSpec::add(i, j, o, arch).into());
            }
        }
    }
    for dtype in [DType::BF16, DType::F16] {
        for d in FLASH_HEAD_DIMS {
            for dropout in [false, true] {
                v.push(FlashAttnSpec::new(Direction::Fwd, dtype, d, arch).with_dropout(dropout).into());
                // The backward above head dim 128 is Hopper's (wgmma) only.
                if d <= 128 || arch == Arch::Sm90a {
                    v.push(FlashAttnSpec::new(Direction::Bwd, dtype, d, arch).with_dropout(dropout).into());
                }
                // The FP8 forward (Hopper only, head dims 128 and 256).
                if arch == Arch::Sm90a && d % 128 == 0 {
                    v.push(FlashAttnSpec::fp8_forward(dtype, d, arch).with_dropout(dropout).into());
                }
            }
            // The FP8 backward (Hopper only, head dims 128 and 256; no dropout), E5M2 or E4M3
            // gradients.
            if arch == Arch::Sm90a && d % 128 == 0 {
                for grad_e5m2 in [true, false] {
                    v.push(FlashAttnSpec::fp8_backward(dtype, d, arch, grad_e5m2).into());
                }
            }
        }
        // head_dim_v other than head_dim (Hopper only): each way round, and past 128 (the
        // backward's channel split).
        if arch == Arch::Sm90a {
            for (d, dv) in [(128, 64), (64, 128), (128, 256), (256, 128)] {
                v.push(FlashAttnSpec::new(Direction::Fwd, dtype, d, arch).with_head_dim_v(dv).into());
                v.push(FlashAttnSpec::new(Direction::Bwd, dtype, d, arch).with_head_dim_v(dv).into());
            }
        }
    }
    // The decode GEMV: each prologue and norm (storing), each epilogue (after a LayerNorm),
    // BF16 and FP8 weights, one row and the most, a width that is not a power of two.
    for (weight, k, rows) in [(DType::BF16, 640, 1), (DType::E4M3, 2048, 8), (DType::BF16, 8192, 4)] {
        let base = GemvSpec::new(weight, k, rows, arch);
        for (prologue, norm, zc) in [
            (GemvPrologue::None, NormKind::RmsNorm, false),
            (GemvPrologue::Norm, NormKind::RmsNorm, true),
            (GemvPrologue::AddNorm, NormKind::RmsNorm, true),
            (GemvPrologue::AddNorm, NormKind::LayerNorm, false),
            (GemvPrologue::ResidualNorm, NormKind::LayerNorm, false),
        ] {
            v.push(base.with_prologue(prologue, norm, zc).into());
        }
        for (bias, epilogue) in [
            (false, GemvEpilogue::Store),
            (true, GemvEpilogue::Residual),
            (true, GemvEpilogue::Act(Activation::Gelu)),
            (false, GemvEpilogue::Act(Activation::Geglu)),
            (true, GemvEpilogue::Act(Activation::Swiglu)),
        ] {
            let s = base.with_prologue(GemvPrologue::Norm, NormKind::LayerNorm, false);
            v.push(s.with_epilogue(bias, epilogue).into());
        }
    }
    for dtype in [DType::BF16, DType::F16] {
        v.push(AttnMergeSpec::new(dtype, arch).into());
    }
    for &i in &hp {
        v.push(ArgmaxSpec::new(i, arch).into());
        // The fused qkv + RoPE + cache step: the largest head dim of the dtype, a small one, and
        // each norm option.
        for d in [64, QkvRopeSpec::max_d(i)] {
            for (qk_norm, zc) in [(false, false), (true, false), (true, true)] {
                v.push(QkvRopeSpec::new(i, d, qk_norm, zc, arch).into());
            }
        }
    }
    // Appending to an E4M3 KV cache (Gemma 3's d256 with its 1 + γ qk-norm, Llama's plain d128).
    for (d, qk_norm, zc) in [(256, true, true), (128, false, false), (64, true, false)] {
        v.push(QkvRopeSpec::new(DType::BF16, d, qk_norm, zc, arch).with_fp8_cache().into());
    }
    for &i in &hp {
        for dir in [Direction::Fwd, Direction::Bwd] {
            for format in [RopeFormat::Sbhd, RopeFormat::Bshd] {
                // Full rotation, partial rotation (copy jobs), an odd half (scalar accesses).
                for (d, d2) in [(128, 128), (128, 64), (80, 30)] {
                    v.push(RopeSpec::new(dir, format, i, d, d2, arch).into());
                }
            }
        }
        for &o in &hp {
            for bias in [false, true] {
                for residual in [false, true] {
                    v.push(DropoutSpec::forward(i, o, bias, residual, arch).into());
                }
            }
            v.push(DropoutSpec::backward(i, o, arch).into());
        }
    }
    for &q in &fp8 {
        for cols in [784, 4096] {
            v.push(CastTransposeSpec::transpose(q, cols, arch).into());
        }
    }
    for algo in [AmaxComputeAlgo::Max, AmaxComputeAlgo::MostRecent] {
        v.push(ScalingSpec::delayed(algo, arch).into());
    }
    for p2 in [false, true] {
        v.push(ScalingSpec::current(p2, arch).into());
    }
    v.push(OptimizerSpec::grad_norm(arch).into());
    v.push(OptimizerSpec::adamw(arch).into());
    // Decode attention: every lane count (8 channels a thread, 1 to 32 threads a key), one with
    // idle lanes (96).
    for dtype in [DType::BF16, DType::F16] {
        for d in [8, 32, 64, 96, 128, 256] {
            v.push(DecodeAttnSpec::new(dtype, d, arch).into());
        }
    }
    // Over an E4M3 cache: GPT's, Llama's and Gemma 3's head dims.
    for d in [64, 128, 256] {
        v.push(DecodeAttnSpec::new(DType::BF16, d, arch).with_fp8_cache().into());
    }
    // Several query heads of one KV head a block (GQA): Gemma 3's and Llama 3's 4, 3 with idle
    // lanes, 2; over 16-bit and E4M3 caches.
    for (d, qg) in [(256, 4), (128, 4), (96, 3), (64, 2)] {
        let s = DecodeAttnSpec::new(DType::BF16, d, arch).with_q_per_block(qg);
        v.push(s.into());
        v.push(s.with_fp8_cache().into());
    }
    // Blockwise FP8 quantization: both inputs, both formats, both block shapes.
    for input in [DType::BF16, DType::F16] {
        for output in [DType::E4M3, DType::E5M2] {
            for block_dim in [1, 2] {
                v.push(BlockQuantizeSpec::new(input, output, block_dim, arch).into());
            }
        }
    }
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        v.push(MoePermuteSpec::new(dtype, arch).into());
        // The top-k router, one kernel set per expert-count bucket.
        for experts in [32, 64, 128, 256, 512] {
            v.push(MoeRouterSpec::new(dtype, experts, arch).into());
        }
    }
    // The grouped GEMM (Hopper): every split, operand order, FP8 pair and output.
    if arch == Arch::Sm90a {
        use GroupedSplit::{Reduction, Rows};
        for t in [DType::BF16, DType::F16] {
            for out in [t, DType::F32] {
                v.push(GroupedGemmSpec::new(Rows, t, t, out, arch).into());
                v.push(GroupedGemmSpec::new(Rows, t, t, out, arch).with_major(true, false).into());
            }
            for (a_k, b_k) in [(false, false), (true, true)] {
                for acc in [false, true] {
                    let s = GroupedGemmSpec::new(Reduction, t, t, DType::F32, arch).with_major(a_k, b_k);
                    v.push(s.accumulating(acc).into());
                }
                for acc in [false, true] {
                    v.push(
                        GroupedGemmSpec::new(Reduction, t, t, t, arch).with_major(a_k, b_k).accumulating(acc).into(),
                    );
                }
            }
        }
        for (a, b) in [(DType::E4M3, DType::E4M3), (DType::E5M2, DType::E4M3), (DType::E4M3, DType::E5M2)] {
            for out in [DType::BF16, DType::F32] {
                v.push(GroupedGemmSpec::new(Rows, a, b, out, arch).into());
                v.push(GroupedGemmSpec::new(Reduction, a, b, out, arch).accumulating(out == DType::F32).into());
            }
        }
    }
    crate::prewarm::sorted(v)
}
