//! Family 23 on the GPU: the LSE merge of partial attention outputs (the ring of context
//! parallelism) against the CPU reference (`te_reference::attn_merge`), sbhd and bshd, bf16 and
//! f16, 37-query chunks and a head dim of 96 (no tile or warp multiple): a first part over every
//! query, a part over the second half, a part over every query with rows that saw no key
//! (`+inf`); the finished output, the merged LSE and its second halves. Plus the typed refusals.

use crate::common::{device, randn};
use te_reference::attn_merge as reference;
use te_runtime::graph::HostCopies;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::ops::attn_merge::{merge_finish, merge_step, MergeAcc};
use te_runtime::{DType, Error, Tensor};

const C: usize = 37;

#[test]
fn merged_parts_match_the_reference() {
    let Some(dev) = device() else { return };
    for (layout, dtype) in [(QkvLayout::Sbhd, DType::BF16), (QkvLayout::Bshd, DType::F16)] {
        let acc_shape = AttentionShape::new(layout, 2, (2 * C, 2 * C), (3, 3), 96);
        let half = AttentionShape { sq: C, ..acc_shape };
        let out_shape = |s: &AttentionShape| match layout {
            QkvLayout::Bshd => vec![s.batch, s.sq, s.heads * s.head_dim_v],
            _ => vec![s.sq, s.batch, s.heads * s.head_dim_v],
        };
        let parts = [(acc_shape, 0usize, 1u64), (half, C, 2), (acc_shape, 0, 3)];
        let mut acc = MergeAcc::new(&dev, &acc_shape).unwrap();
        let mut ref_out = vec![0.0; acc_shape.out_len()];
        let mut ref_lse = vec![0.0; acc_shape.lse_len()];
        for (i, (shape, offset, seed)) in parts.into_iter().enumerate() {
            let out: Vec<f32> = randn(seed, shape.out_len(), 1.0).into_iter().map(|v| round_to(dtype, v)).collect();
            let mut lse: Vec<f32> = randn(seed + 10, shape.lse_len(), 2.0);
            if i == 2 {
                // Rows that saw no key in this part: +inf (their outputs are not read).
                lse.iter_mut().step_by(5).for_each(|v| *v = f32::INFINITY);
            }
            let t = Tensor::from_f32(&dev, dtype, &out_shape(&shape), &out).unwrap();
            let l = dev.stream().htod(&lse).unwrap();
            merge_step(&dev, &mut acc, &shape, &t, &l, offset, i == 0).unwrap();
            reference::merge_step(&acc_shape, &mut ref_out, &mut ref_lse, &shape, &out, &lse, offset, i == 0);
        }
        let mut out = Tensor::empty(&dev, dtype, &out_shape(&acc_shape)).unwrap();
        let mut lse_half = dev.stream().alloc_zeros::<f32>(acc_shape.lse_len() / 2).unwrap();
        merge_finish(&dev, &mut acc, &mut out, &mut lse_half).unwrap();
        let ref_half = reference::merge_finish(&acc_shape, &mut ref_lse);
        let got = out.to_f32(&dev).unwrap();
        let want: Vec<f32> = ref_out.iter().map(|&v| round_to(dtype, v)).collect();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 8e-3 * scale, "{layout:?} {dtype}: output off by {worst} (scale {scale})");
        for (what, got, want) in [
            ("lse", dev.stream().dtoh(acc.lse()).unwrap(), ref_lse.clone()),
            ("lse_half", dev.stream().dtoh(&lse_half).unwrap(), ref_half),
        ] {
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{layout:?} {dtype} {what}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn merge_refuses_parts_that_do_not_fit() {
    let Some(dev) = device() else { return };
    let shape = AttentionShape::new(QkvLayout::Sbhd, 1, (8, 8), (2, 2), 64);
    let mut acc = MergeAcc::new(&dev, &shape).unwrap();
    let out = Tensor::zeros(&dev, DType::BF16, &[8, 1, 128]).unwrap();
    let lse = dev.stream().alloc_zeros::<f32>(16).unwrap();
    // A first part must cover every query; a part may not run past them.
    let err = merge_step(&dev, &mut acc, &shape, &out, &lse, 2, true).unwrap_err();
    assert!(matches!(err, Error::Shape { .. }), "{err}");
    let err = merge_step(&dev, &mut acc, &shape, &out, &lse, 1, false).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    let f32_out = Tensor::zeros(&dev, DType::F32, &[8, 1, 128]).unwrap();
    assert!(matches!(merge_step(&dev, &mut acc, &shape, &f32_out, &lse, 0, true), Err(Error::DType { .. })));
    let thd = AttentionShape { layout: QkvLayout::Thd, ..shape };
    assert!(MergeAcc::new(&dev, &thd).is_err());
}
