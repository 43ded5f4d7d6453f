//! Context parallelism (`te_nn::parallel::ContextParallel`, the CP issue): the attention of a
//! sequence split over 2 (and, where the machine has them, 4) ranks in load-balanced chunks against the fused
//! attention of the whole sequence in one process, on the same seeded inputs: each rank's rows
//! of the output and of `dq`, `dk`, `dv`, under the ring (`CpCommType::P2p`, TE's
//! `cp_comm_type="p2p"`: keys and values passed around the ranks, outputs merged by their LSE)
//! and the all-gather, and the two against each other. Causal (GQA, a chunk of 37 tokens: no
//! tile multiple), causal with a sliding window (the ring runs such a layer as the all-gather),
//! and no mask. Plus the typed refusals, on one GPU.
//!
//! The ranks run as in [`crate::multi_gpu`]; skip with fewer GPUs or without NCCL.

use crate::common::{device, randn};
use crate::multi_gpu::{on_ranks, rel_err, Layout};
use std::sync::Arc;
use te_nn::modules::{AttnMaskType, DotProductAttention, DotProductAttentionConfig, QkvFormat};
use te_nn::parallel::{ContextParallel, CpCommType};
use te_runtime::dist::ProcessGroup;
use te_runtime::{DType, Device, Tensor};

/// Tokens a chunk (each rank holds two), sequences, query heads, KV heads, head dim.
const C: usize = 37;
const B: usize = 2;
const H: usize = 4;
const G: usize = 2;
const D: usize = 128;

fn module(dev: &Arc<Device>, mask: AttnMaskType, window: Option<(i64, i64)>) -> DotProductAttention {
    let cfg = DotProductAttentionConfig {
        num_gqa_groups: Some(G),
        attn_mask_type: mask,
        window_size: window,
        ..DotProductAttentionConfig::new(H, D)
    };
    DotProductAttention::new(dev, cfg).unwrap()
}

fn tensor(dev: &Device, seed: u64, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32(dev, DType::BF16, shape, &randn(seed, n, 1.0)).unwrap()
}

/// This rank's output and `dq`, `dk`, `dv` of the context-parallel attention over `cp` (on the
/// host), for the inputs `[q, k, v, d_out]` of the whole sequence.
fn run_cp(
    dev: &Arc<Device>,
    cp: &ContextParallel,
    mask: AttnMaskType,
    window: Option<(i64, i64)>,
    inputs: [&Tensor; 4],
) -> [Vec<f32>; 4] {
    let cp_mask = if mask == AttnMaskType::Causal { AttnMaskType::CausalBottomRight } else { mask };
    let mut attn = module(dev, cp_mask, window);
    let [ql, kl, vl, dl] = inputs.map(|t| cp.shard(dev, t).unwrap());
    let (out_l, ctx) = attn.forward_context_parallel(cp, &ql, &kl, &vl).unwrap();
    assert_eq!(out_l.shape(), [2 * C, B, H * D]);
    let ring = cp.comm_type() == CpCommType::P2p && window.is_none();
    assert_eq!(ctx.comm_type(), if ring { CpCommType::P2p } else { CpCommType::AllGather });
    assert_eq!(ctx.calls().is_none(), ring);
    let (dq_l, dk_l, dv_l) = attn.backward_context_parallel(cp, ctx, &dl).unwrap();
    [&out_l, &dq_l, &dk_l, &dv_l].map(|t| t.to_f32(dev).unwrap())
}

/// One rank's check: the whole sequence's attention here against the context-parallel one over
/// `pg` under `comm`, for the reference mask `mask` (`Causal` is run as `CausalBottomRight` on
/// the ranks).
fn check(dev: &Arc<Device>, pg: &Arc<ProcessGroup>, mask: AttnMaskType, window: Option<(i64, i64)>, comm: CpCommType) {
    let cp = ContextParallel::new(pg.clone()).unwrap().with_comm_type(comm);
    let s = 2 * cp.size() * C;
    let q = tensor(dev, 1, &[s, B, H, D]);
    let k = tensor(dev, 2, &[s, B, G, D]);
    let v = tensor(dev, 3, &[s, B, G, D]);
    let d_out = tensor(dev, 4, &[s, B, H * D]);
    let mut whole = module(dev, mask, window);
    let (out, ctx) = whole.forward(&q, &k, &v, None).unwrap();
    let (dq, dk, dv) = whole.backward(ctx, &d_out).unwrap();

    let [out_l, dq_l, dk_l, dv_l] = run_cp(dev, &cp, mask, window, [&q, &k, &v, &d_out]);
    let host = |t: &Tensor| t.to_f32(dev).unwrap();
    let mine = |t: &Tensor| host(&cp.shard(dev, t).unwrap());
    let r = cp.rank();
    for (what, got, want, bound) in [
        ("out", &out_l, mine(&out), 5e-3),
        ("dq", &dq_l, mine(&dq), 1e-2),
        ("dk", &dk_l, mine(&dk), 1e-2),
        ("dv", &dv_l, mine(&dv), 1e-2),
    ] {
        let e = rel_err(got, &want);
        eprintln!("rank {r} {comm} {mask:?} window {window:?}: {what} relative error {e:.2e}");
        assert!(e <= bound, "rank {r} {comm}: {what} relative error {e} above {bound}");
    }
    // The parts put back together are the whole output.
    let out_l = Tensor::from_f32(dev, DType::BF16, &[2 * C, B, H * D], &out_l).unwrap();
    let e = rel_err(&host(&cp.unshard(dev, &out_l).unwrap()), &host(&out));
    assert!(e <= 5e-3, "rank {r} {comm}: the unsharded output's relative error {e}");
}

/// The ring against the all-gather on the same inputs: the same output and gradients within
/// the fused attention's rounding (the ring merges in f32 and sums the key/value gradients in
/// bf16 around the ranks; the all-gather's chunks see their keys in one call).
fn ring_against_all_gather(dev: &Arc<Device>, pg: &Arc<ProcessGroup>, mask: AttnMaskType) {
    let s = 2 * pg.size() * C;
    let inputs = [tensor(dev, 11, &[s, B, H, D]), tensor(dev, 12, &[s, B, G, D]), tensor(dev, 13, &[s, B, G, D])];
    let d_out = tensor(dev, 14, &[s, B, H * D]);
    let [q, k, v] = &inputs;
    let base = ContextParallel::new(pg.clone()).unwrap();
    let ring = run_cp(dev, &base.clone().with_comm_type(CpCommType::P2p), mask, None, [q, k, v, &d_out]);
    let gather = run_cp(dev, &base.with_comm_type(CpCommType::AllGather), mask, None, [q, k, v, &d_out]);
    for (what, (a, b), bound) in ["out", "dq", "dk", "dv"]
        .into_iter()
        .zip(ring.iter().zip(&gather))
        .zip([5e-3, 1e-2, 1e-2, 1e-2])
        .map(|((w, p), b)| (w, p, b))
    {
        let e = rel_err(a, b);
        eprintln!("rank {} p2p vs all_gather {mask:?}: {what} relative error {e:.2e}", pg.rank());
        assert!(e <= bound, "rank {}: p2p vs all_gather {what} relative error {e} above {bound}", pg.rank());
    }
}

fn on(test: &str, world: usize) {
    on_ranks(test, world, Layout::OneNode, |_, dev, pg| {
        let pg = Arc::new(pg);
        for comm in [CpCommType::P2p, CpCommType::AllGather] {
            check(dev, &pg, AttnMaskType::Causal, None, comm);
            check(dev, &pg, AttnMaskType::Causal, Some((50, 0)), comm);
            check(dev, &pg, AttnMaskType::NoMask, None, comm);
        }
        ring_against_all_gather(dev, &pg, AttnMaskType::Causal);
        ring_against_all_gather(dev, &pg, AttnMaskType::NoMask);
    });
}

#[test]
fn context_parallel_attention_on_two_ranks_equals_the_whole_sequence() {
    on("context_parallel::context_parallel_attention_on_two_ranks_equals_the_whole_sequence", 2);
}

/// Where the machine has 4 GPUs (skipped with fewer, even under `TE_REQUIRE_MULTI_GPU=1`: the
/// suite's multi-GPU runs take 2).
#[test]
fn context_parallel_attention_on_four_ranks_equals_the_whole_sequence() {
    if std::env::var("TE_MULTI_GPU_TEST").is_err() && te_runtime::device::device_count() < 4 {
        eprintln!("skipping: 4 GPUs needed, {} here", te_runtime::device::device_count());
        return;
    }
    on("context_parallel::context_parallel_attention_on_four_ranks_equals_the_whole_sequence", 4);
}

#[test]
fn context_parallel_refuses_what_it_does_not_split() {
    let Some(dev) = device() else { return };
    let cp = ContextParallel::new(Arc::new(ProcessGroup::single(&dev).unwrap())).unwrap();
    let (q, k, v) = (tensor(&dev, 1, &[6, 1, H, D]), tensor(&dev, 2, &[6, 1, G, D]), tensor(&dev, 3, &[6, 1, G, D]));
    let err = module(&dev, AttnMaskType::Causal, None).forward_context_parallel(&cp, &q, &k, &v).unwrap_err();
    assert!(err.to_string().contains("causal_bottom_right"), "{err}");
    let mut bshd = DotProductAttention::new(
        &dev,
        DotProductAttentionConfig {
            num_gqa_groups: Some(G),
            qkv_format: QkvFormat::Bshd,
            attn_mask_type: AttnMaskType::CausalBottomRight,
            ..DotProductAttentionConfig::new(H, D)
        },
    )
    .unwrap();
    let err = bshd.forward_context_parallel(&cp, &q, &k, &v).unwrap_err();
    assert!(err.to_string().contains("sbhd"), "{err}");
    let odd = tensor(&dev, 4, &[5, 1, H, D]);
    let err =
        module(&dev, AttnMaskType::CausalBottomRight, None).forward_context_parallel(&cp, &odd, &k, &v).unwrap_err();
    assert!(err.to_string().contains("two chunks"), "{err}");
    let err = cp.shard(&dev, &tensor(&dev, 5, &[7, 1, H, D])).unwrap_err();
    assert!(err.to_string().contains("multiple of 2 · cp"), "{err}");
    // One rank: the context-parallel attention is the plain one, under either exchange.
    let (want, _) = module(&dev, AttnMaskType::Causal, None).forward(&q, &k, &v, None).unwrap();
    for comm in [CpCommType::P2p, CpCommType::AllGather] {
        let one = cp.clone().with_comm_type(comm);
        let mut attn = module(&dev, AttnMaskType::CausalBottomRight, None);
        let (out, _) = attn.forward_context_parallel(&one, &q, &k, &v).unwrap();
        let e = rel_err(&out.to_f32(&dev).unwrap(), &want.to_f32(&dev).unwrap());
        assert!(e <= 5e-3, "one rank, {comm}: relative error {e}");
    }
    // The ring runs the fused kernels: f32 inputs or a forced unfused backend are refused with
    // the way out.
    let f32_input = |seed, shape: &[usize]| {
        Tensor::from_f32(&dev, DType::F32, shape, &randn(seed, shape.iter().product(), 1.0)).unwrap()
    };
    let (q32, k32, v32) = (f32_input(1, &[6, 1, H, D]), f32_input(2, &[6, 1, G, D]), f32_input(3, &[6, 1, G, D]));
    let err = module(&dev, AttnMaskType::CausalBottomRight, None)
        .forward_context_parallel(&cp, &q32, &k32, &v32)
        .unwrap_err();
    assert!(err.to_string().contains("all_gather"), "{err}");
    let mut unfused = DotProductAttention::new(
        &dev,
        DotProductAttentionConfig {
            num_gqa_groups: Some(G),
            attn_mask_type: AttnMaskType::CausalBottomRight,
            backend: te_nn::modules::AttentionBackend::Unfused,
            ..DotProductAttentionConfig::new(H, D)
        },
    )
    .unwrap();
    let err = unfused.forward_context_parallel(&cp, &q, &k, &v).unwrap_err();
    assert!(err.to_string().contains("all_gather"), "{err}");
}
