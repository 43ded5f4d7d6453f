//! The NCCL process group with one rank (the groundwork of the multi-GPU issue; several ranks need
//! several GPUs): every collective is the identity or a copy, checked bit for bit, on tensors of
//! each dtype and on f32 slices; `init` through the rendezvous; sub-groups; typed errors.
//!
//! Skips without a GPU, and without a loadable NCCL (`source scripts/nccl-path.sh` makes
//! PyTorch's loadable) unless `TE_REQUIRE_GPU=1`, where a missing NCCL fails with the typed
//! error's hint. NCCL that loads but does not work fails always.

use crate::common::{device, randn};
use std::sync::Arc;
use te_runtime::dist::{nccl_available, reduce_amax_max, DistEnv, ProcessGroup, ReduceOp};
use te_runtime::{DType, Device, Error, Tensor};

/// The GPU when NCCL loads too; `None` (skip) otherwise, unless `TE_REQUIRE_GPU=1`.
fn nccl_device() -> Option<Arc<Device>> {
    let dev = device()?;
    match nccl_available() {
        Ok(_) => Some(dev),
        Err(e @ Error::NcclMissing { .. }) => {
            let required = std::env::var("TE_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "TE_REQUIRE_GPU=1 and a GPU is here, but {e}");
            eprintln!("skipping NCCL test: {e}");
            None
        }
        Err(e) => panic!("NCCL loads but cannot be used: {e}"),
    }
}

fn tensor(dev: &Device, dtype: DType, shape: &[usize], seed: u64) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_f32(dev, dtype, shape, &randn(seed, n, 3.0)).unwrap()
}

fn bytes(dev: &Device, t: &Tensor) -> Vec<u8> {
    t.to_bytes(dev).unwrap()
}

#[test]
fn one_rank_all_reduce_is_the_identity() {
    let Some(dev) = nccl_device() else { return };
    let pg = ProcessGroup::single(&dev).unwrap();
    assert_eq!((pg.rank(), pg.size(), pg.ranks()), (0, 1, &[0usize][..]));
    for (i, dtype) in [DType::F32, DType::BF16, DType::F16].into_iter().enumerate() {
        let mut t = tensor(&dev, dtype, &[7, 33], i as u64);
        let want = bytes(&dev, &t);
        let saved = t.clone();
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
            pg.all_reduce(&mut t, op).unwrap();
            assert_eq!(bytes(&dev, &t), want, "{dtype} {op:?}");
        }
        assert_eq!(bytes(&dev, &saved), want, "{dtype}: the clone kept its storage");
    }
    let values: Vec<f32> = randn(9, 1000, 10.0).iter().map(|v| v.abs()).collect();
    let mut amaxes = dev.stream().clone_htod(&values).unwrap();
    reduce_amax_max(&pg, &mut amaxes).unwrap();
    pg.all_reduce(&mut amaxes, ReduceOp::Sum).unwrap();
    assert_eq!(dev.stream().clone_dtoh(&amaxes).unwrap(), values, "f32 slice");
    pg.barrier().unwrap();
}

#[test]
fn one_rank_gather_scatter_and_broadcast_copy() {
    let Some(dev) = nccl_device() else { return };
    let pg = ProcessGroup::single(&dev).unwrap();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let input = tensor(&dev, dtype, &[5, 3, 8], 100 + i as u64);
        let mut output = Tensor::zeros(&dev, dtype, &[5, 3, 8]).unwrap();
        pg.all_gather(&input, &mut output).unwrap();
        assert_eq!(bytes(&dev, &output), bytes(&dev, &input), "all_gather {dtype}");
        let mut b = input.clone();
        pg.broadcast(&mut b, 0).unwrap();
        assert_eq!(bytes(&dev, &b), bytes(&dev, &input), "broadcast {dtype}");
        if dtype.is_fp8() {
            continue;
        }
        let mut part = Tensor::zeros(&dev, dtype, &[5, 3, 8]).unwrap();
        pg.reduce_scatter(&input, &mut part, ReduceOp::Sum).unwrap();
        assert_eq!(bytes(&dev, &part), bytes(&dev, &input), "reduce_scatter {dtype}");
    }
    let values = randn(7, 64, 1.0);
    let src = dev.stream().clone_htod(&values).unwrap();
    let mut dst = dev.stream().alloc_zeros::<f32>(64).unwrap();
    pg.all_gather(&src, &mut dst).unwrap();
    assert_eq!(dev.stream().clone_dtoh(&dst).unwrap(), values, "f32 slice all_gather");
    let mut dst = dev.stream().alloc_zeros::<f32>(64).unwrap();
    pg.reduce_scatter(&src, &mut dst, ReduceOp::Sum).unwrap();
    assert_eq!(dev.stream().clone_dtoh(&dst).unwrap(), values, "f32 slice reduce_scatter");
    // Empty tensors are no-ops.
    let mut empty = Tensor::zeros(&dev, DType::BF16, &[0, 4]).unwrap();
    pg.all_reduce(&mut empty, ReduceOp::Sum).unwrap();
}

#[test]
fn bad_arguments_are_typed_errors() {
    let Some(dev) = nccl_device() else { return };
    let pg = ProcessGroup::single(&dev).unwrap();
    let input = tensor(&dev, DType::BF16, &[4, 8], 1);
    let mut wrong = Tensor::zeros(&dev, DType::BF16, &[8, 8]).unwrap();
    let e = pg.all_gather(&input, &mut wrong).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("[4, 8]"), "{e}");
    let mut other = Tensor::zeros(&dev, DType::F32, &[4, 8]).unwrap();
    let e = pg.all_gather(&input, &mut other).unwrap_err();
    assert!(matches!(e, Error::DType { got: DType::F32, .. }), "{e}");
    let mut fp8 = Tensor::zeros(&dev, DType::E4M3, &[4, 8]).unwrap();
    let e = pg.all_reduce(&mut fp8, ReduceOp::Max).unwrap_err();
    assert!(matches!(e, Error::DType { got: DType::E4M3, .. }), "{e}");
    let mut b = input.clone();
    let e = pg.broadcast(&mut b, 1).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("root 1"), "{e}");
    let e = pg.new_group(&[1]).unwrap_err();
    assert!(matches!(e, Error::Argument { .. }), "{e}");
}

/// `init` with `RANK=0 WORLD_SIZE=1` at a free port (the rendezvous hands the id over without
/// TCP for one rank), then sub-groups of it by `ncclCommSplit`.
#[test]
fn init_and_sub_groups() {
    let Some(dev) = nccl_device() else { return };
    let port = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port();
    let env = DistEnv {
        rank: 0,
        world_size: 1,
        local_rank: 0,
        local_world_size: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    };
    let world = ProcessGroup::init(&dev, &env).unwrap();
    assert_eq!((world.rank(), world.size()), (0, 1));
    let tp = world.split(|r| Some(r / 2)).unwrap().expect("a member of its color");
    assert_eq!((tp.rank(), tp.size(), tp.ranks()), (0, 1, &[0usize][..]));
    assert!(world.split(|_| None).unwrap().is_none(), "no color: no group");
    let dp = world.new_group(&[0]).unwrap().expect("a member");
    let mut x = tensor(&dev, DType::F32, &[16], 3);
    let want = bytes(&dev, &x);
    tp.all_reduce(&mut x, ReduceOp::Sum).unwrap();
    dp.all_reduce(&mut x, ReduceOp::Max).unwrap();
    world.barrier().unwrap();
    assert_eq!(bytes(&dev, &x), want);
    dp.abort();
    drop(tp);
    let again = ProcessGroup::init(&dev, &env).unwrap();
    again.barrier().unwrap();
}
