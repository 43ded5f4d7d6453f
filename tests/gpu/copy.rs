//! `copy_columns` (the QKV split and gradient concatenation) against a host copy.

use crate::common::device;
use te_runtime::ops::copy::copy_columns;
use te_runtime::{DType, Error, Tensor};

#[test]
fn copies_column_blocks_exactly() {
    let Some(dev) = device() else { return };
    let (rows, src_cols, dst_cols) = (77, 48, 40);
    let src_v: Vec<f32> = (0..rows * src_cols).map(|i| i as f32).collect();
    let src = Tensor::from_f32(&dev, DType::F32, &[rows, src_cols], &src_v).unwrap();
    let mut dst = Tensor::zeros(&dev, DType::F32, &[rows, dst_cols]).unwrap();
    copy_columns(&dev, &src, 13, &mut dst, 5, 24).unwrap();
    let got = dst.to_f32(&dev).unwrap();
    for r in 0..rows {
        for c in 0..dst_cols {
            let want = if (5..29).contains(&c) { src_v[r * src_cols + 13 + c - 5] } else { 0.0 };
            assert_eq!(got[r * dst_cols + c], want, "row {r} col {c}");
        }
    }
    let e = copy_columns(&dev, &src, 40, &mut dst, 0, 10).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    let mut other = Tensor::zeros(&dev, DType::BF16, &[rows, dst_cols]).unwrap();
    assert!(matches!(copy_columns(&dev, &src, 0, &mut other, 0, 8), Err(Error::DType { .. })));
}
