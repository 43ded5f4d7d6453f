//! Tests of the flash-attention spec: names, validation, tiles, shared memory, arguments.
use super::*;

#[test]
fn defaults_validate_and_refuse_what_the_kernels_do_not_take() {
    for d in FLASH_HEAD_DIMS {
        for dtype in [DType::BF16, DType::F16] {
            FlashAttnSpec::new(Direction::Fwd, dtype, d, Arch::Sm90a).validate().unwrap();
            if d <= 128 {
                FlashAttnSpec::new(Direction::Bwd, dtype, d, Arch::Sm89).validate().unwrap();
            }
            FlashAttnSpec::new(Direction::Bwd, dtype, d, Arch::Sm90a).validate().unwrap();
        }
    }
    let e = FlashAttnSpec::new(Direction::Fwd, DType::F32, 64, Arch::Sm90a).validate().unwrap_err();
    assert!(e.contains("bf16 or f16"), "{e}");
    let e = FlashAttnSpec::new(Direction::Fwd, DType::BF16, 80, Arch::Sm90a).validate().unwrap_err();
    assert!(e.contains("head_dim = 80"), "{e}");
    let e = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm89).validate().unwrap_err();
    assert!(e.contains("above 128 only on sm_90a"), "{e}");
}

#[test]
fn backward_above_head_dim_128_splits_the_channels_over_two_warpgroups() {
    let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm90a);
    assert!(bwd.wgmma && bwd.warp_specialized && bwd.channel_split() == 2);
    assert_eq!((bwd.block_m, bwd.block_n, bwd.dkdv_tile_m(), bwd.dkdv_stages()), (64, 64, 64, 2));
    // Two consumer warpgroups on the same 64 rows, and the producer.
    assert_eq!((bwd.threads_m(), bwd.threads_n()), (384, 384));
    // K, V, two stages of Q and dO, Pᵀ and dSᵀ, LSE and delta: within an SM's 227 KiB.
    assert_eq!(bwd.shared_bytes(1), (64 + 2 * 64) * 512 * 2 + 4 * 64 * 64 * 2 + 2 * 2 * 64 * 4 + 1024 + 128);
    assert_eq!(bwd.shared_bytes(2), (64 + 2 * 64) * 512 * 2 + 2 * 64 * 64 * 2 + 1024 + 128);
    assert!(bwd.shared_bytes(1) <= 227 * 1024);
    // 128 (q, k) with 256 (v) takes the split too; below, none does.
    assert_eq!(bwd.with_head_dim_v(128).channel_split(), 2);
    let mixed = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a).with_head_dim_v(256);
    assert_eq!(mixed.channel_split(), 2);
    crate::spec::KernelSpec::from(mixed).validate().unwrap();
    assert_eq!(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a).channel_split(), 1);
    assert_eq!(FlashAttnSpec::new(Direction::Fwd, DType::BF16, 256, Arch::Sm90a).channel_split(), 1);
    // Halves of whole 64-channel blocks only: 64 with 256 is refused.
    let e = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 64, Arch::Sm90a).with_head_dim_v(256).validate();
    assert!(e.unwrap_err().contains("halves"));
    // The 16-bit backward has the split sum of dK and dV; the FP8 one does not.
    assert_eq!(crate::spec::Family::entry_suffixes(&bwd).len(), 4);
    let fp8 = FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true);
    assert_eq!(crate::spec::Family::entry_suffixes(&fp8).len(), 3);
}

#[test]
fn fp8_backward_at_head_dim_256_keeps_head_dim_128_registers() {
    let d128 = FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true);
    assert_eq!((d128.fp8_dkdv_channels(), d128.dq_key_tile()), (128, 128));
    let d256 = FlashAttnSpec::fp8_backward(DType::BF16, 256, Arch::Sm90a, false);
    crate::spec::KernelSpec::from(d256).validate().unwrap();
    // Two 128-channel slabs of dK/dV per key block; 64-key tiles in `_dq`.
    assert_eq!((d256.fp8_dkdv_channels(), d256.dq_key_tile()), (128, 64));
    // K, V, three stages of Q, dO and of the slab's Qᵀ, dOᵀ, LSE and delta.
    assert_eq!(d256.shared_bytes(1), 2 * 128 * 256 + 2 * 3 * 64 * 256 + 2 * 3 * 64 * 128 + 2 * 3 * 64 * 4 + 1024);
    // Q, dO, two stages of 64-key K, V, Kᵀ.
    assert_eq!(d256.shared_bytes(2), (2 * 128 + 6 * 64) * 256 + 1024);
    assert!(d256.shared_bytes(1).max(d256.shared_bytes(2)) <= 227 * 1024);
    // The 16-bit tiles are not the FP8 slabs': their dQ loop keeps block_n.
    let bf16 = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 256, Arch::Sm90a);
    assert_eq!(bf16.dq_key_tile(), bf16.block_n);
    // Dropout and Ada stay refused.
    let e = crate::spec::KernelSpec::from(d256.with_dropout(true)).validate().unwrap_err().to_string();
    assert!(e.contains("no dropout"), "{e}");
    let ada = FlashAttnSpec::fp8_backward(DType::BF16, 256, Arch::Sm89, true);
    assert!(crate::spec::KernelSpec::from(ada).validate().is_err());
}

#[test]
fn hopper_forward_picks_wgmma_where_its_tiles_fit() {
    for (d, wgmma) in [(32, false), (64, true), (96, false), (128, true), (256, true)] {
        let fwd = FlashAttnSpec::new(Direction::Fwd, DType::BF16, d, Arch::Sm90a);
        assert_eq!(fwd.wgmma, wgmma, "head_dim {d}");
        let producer = if fwd.warp_specialized { 128 } else { 0 };
        assert_eq!(fwd.threads_m(), fwd.block_m * 2 + producer, "a warpgroup (128 threads) per 64 rows");
        assert!(!FlashAttnSpec::new(Direction::Fwd, DType::BF16, d, Arch::Sm89).wgmma);
        let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, d.min(128), Arch::Sm90a);
        assert_eq!(bwd.wgmma, d % 64 == 0, "head_dim {d}");
    }
    let fwd = FlashAttnSpec::new(Direction::Fwd, DType::BF16, 128, Arch::Sm90a);
    assert!(crate::spec::KernelSpec::from(fwd).name().contains("_ws"));
    // The warp-specialized forward takes the tensor maps of its TMA loads; the others do not.
    let names = |s: FlashAttnSpec| s.params(0).iter().map(|a| a.name).collect::<Vec<_>>();
    let n = names(fwd);
    let at = n.iter().position(|&x| x == "lse").unwrap();
    assert_eq!(n[at + 1..at + 5], ["tma_q", "tma_k", "tma_v", "use_tma"]);
    assert!(!names(FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a)).contains(&"tma_q"));
    assert!(!names(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a)).contains(&"tma_q"));
    assert_eq!(fwd.params(0).iter().find(|a| a.name == "tma_k").and_then(|a| a.scalar_size()), Some(128));
    // Two K and two V tiles beside Q, 1 KiB for the 1024-byte alignment of the swizzle, the
    // mbarriers of the warp-specialized pipeline.
    assert!(fwd.warp_specialized);
    // Warp-specialized where two consumer warpgroups share the producer: 128-row blocks.
    let bwd = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a);
    assert!(bwd.warp_specialized && bwd.threads_n() == 384 && bwd.threads_m() == 384);
    assert!(FlashAttnSpec::new(Direction::Bwd, DType::BF16, 64, Arch::Sm90a).warp_specialized);
    assert!(!FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a).warp_specialized);
    assert!(!FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true).warp_specialized);
    let e =
        FlashAttnSpec { warp_specialized: true, ..FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a) }
            .validate()
            .unwrap_err();
    assert!(e.contains("warp specialization"), "{e}");
    assert_eq!(fwd.shared_bytes(0), (128 + 4 * 128) * 128 * 2 + 1024 + 128);
    let e = FlashAttnSpec { arch: Arch::Sm89, ..fwd }.validate().unwrap_err();
    assert!(e.contains("sm_90a only"), "{e}");
    let e = FlashAttnSpec { block_m: 32, ..fwd }.validate().unwrap_err();
    assert!(e.contains("multiples of 64"), "{e}");
}
