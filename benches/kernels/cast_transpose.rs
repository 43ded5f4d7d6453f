//! Families 2, 3 and the fused dact of 4: cast + transpose bf16 → FP8 (read 2 B, write 1 + 1 B
//! per element; the headline memory-bound kernel, target ≥ 0.85 of copy bandwidth), with dbias,
//! and with a fused dGELU (read 2 + 2 B, write 1 + 1 B); the FP8 byte transpose (read 1 B, write
//! 1 B; target ≥ 0.8 of copy bandwidth).

use crate::harness::{random_bytes, Bench, Target};
use te_codegen::spec::Activation;
use te_runtime::ops::cast_transpose::{
    cast_transpose, cast_transpose_dact, dbias_workspace_len, transpose_fp8, DbiasOut,
};
use te_runtime::ops::Fp8Meta;
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if b.enabled("transpose_fp8") {
        transpose(b);
    }
    if !b.enabled("cast_transpose") {
        return;
    }
    let dev = b.dev().clone();
    for (rows, cols) in [(8192usize, 8192usize), (16384, 4096)] {
        let n = rows * cols;
        let x = Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, n, 1)).unwrap();
        let mut q = Tensor::zeros(&dev, DType::E4M3, &[rows, cols]).unwrap();
        let mut q_t = Tensor::zeros(&dev, DType::E4M3, &[cols, rows]).unwrap();
        let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
        let st = b.time(5, 50, |_| cast_transpose(&dev, &x, &mut q, &mut q_t, &mut meta.scaling(), None).unwrap());
        let shape = format!("{rows}x{cols}");
        b.record("cast_transpose bf16→e4m3 (+amax)", &shape, st, Some(4 * n as u64), Some(Target::CopyFraction(0.85)));
    }

    let (rows, cols) = (8192usize, 8192usize);
    let n = rows * cols;
    let shape = format!("{rows}x{cols}");
    let dy = Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, n, 2)).unwrap();
    let act_in = Tensor::from_bytes(&dev, DType::BF16, &[rows, cols], &random_bytes(DType::BF16, n, 3)).unwrap();
    let mut q = Tensor::zeros(&dev, DType::E5M2, &[rows, cols]).unwrap();
    let mut q_t = Tensor::zeros(&dev, DType::E5M2, &[cols, rows]).unwrap();
    let mut db = Tensor::zeros(&dev, DType::BF16, &[cols]).unwrap();
    let mut ws = dev.stream().alloc_zeros::<f32>(dbias_workspace_len(rows, cols)).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let st = b.time(5, 50, |_| {
        let d = DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() };
        cast_transpose(&dev, &dy, &mut q, &mut q_t, &mut meta.scaling(), Some(d)).unwrap()
    });
    b.record("cast_transpose_dbias bf16→e5m2", &shape, st, Some(4 * n as u64), None);
    let st = b.time(5, 50, |_| {
        let d = DbiasOut { dbias: &mut db, workspace: ws.as_view_mut() };
        cast_transpose_dact(&dev, Activation::Gelu, &dy, &act_in, &mut q, &mut q_t, &mut meta.scaling(), Some(d))
            .unwrap()
    });
    b.record("cast_transpose_dbias_dgelu bf16→e5m2", &shape, st, Some(6 * n as u64), None);
}

/// The lazy transposed copy of an FP8 weight: 8192x8192 E4M3 codes.
fn transpose(b: &mut Bench) {
    let dev = b.dev().clone();
    let (rows, cols) = (8192usize, 8192usize);
    let n = rows * cols;
    let x = Tensor::from_bytes(&dev, DType::E4M3, &[rows, cols], &random_bytes(DType::E4M3, n, 4)).unwrap();
    let mut x_t = Tensor::zeros(&dev, DType::E4M3, &[cols, rows]).unwrap();
    let st = b.time(5, 50, |_| transpose_fp8(&dev, &x, &mut x_t).unwrap());
    b.record("transpose_fp8 e4m3", &format!("{rows}x{cols}"), st, Some(2 * n as u64), Some(Target::CopyFraction(0.8)));
}
