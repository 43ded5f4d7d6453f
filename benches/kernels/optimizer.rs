//! Family 11: one fused AdamW step (gradient norm + clip coefficient + update) over a GPT-2
//! small sized parameter set, 12 bf16 tensors of ~10.4M elements (124M parameters) with bf16
//! gradients and f32 masters and moments. Per element: the norm reads the grad (2 B); the update
//! reads grad 2 + master 4 + exp_avg 4 + exp_avg_sq 4 and writes master 4 + exp_avg 4 +
//! exp_avg_sq 4 + param 2 (the bf16 param is not read: the master is the source): 30 B in all.
//! Target ≥ 0.8 of copy bandwidth (the table upload and the one-block finalize are included).

use crate::harness::{random_bytes, Bench, Target};
use te_runtime::ops::optimizer::{adamw_step, AdamWArgs, AdamWTensor};
use te_runtime::{DType, Tensor};

pub fn run(b: &mut Bench) {
    if !b.enabled("optimizer") && !b.enabled("adamw") {
        return;
    }
    let dev = b.dev().clone();
    let s = dev.stream();
    let (tensors, n) = (12usize, 10_354_688usize);
    let grads: Vec<Tensor> = (0..tensors)
        .map(|i| Tensor::from_bytes(&dev, DType::BF16, &[n], &random_bytes(DType::BF16, n, i as u64)).unwrap())
        .collect();
    let mut params: Vec<Tensor> = (0..tensors).map(|_| Tensor::zeros(&dev, DType::BF16, &[n]).unwrap()).collect();
    let mut state: Vec<_> = (0..3 * tensors).map(|_| s.alloc_zeros::<f32>(n).unwrap()).collect();
    let mut norm_out = s.alloc_zeros::<f32>(2).unwrap();
    let args = AdamWArgs { lr: 1e-4, beta1: 0.9, beta2: 0.95, eps: 1e-8, max_grad_norm: 1.0, skip_nonfinite: false };
    let st = b.time(3, 20, |i| {
        let mut list: Vec<AdamWTensor> = grads
            .iter()
            .zip(params.iter_mut())
            .zip(state.chunks_mut(3))
            .map(|((grad, param), st)| {
                let [master, exp_avg, exp_avg_sq] = st else { unreachable!("chunks of 3") };
                AdamWTensor {
                    grad,
                    param,
                    master,
                    exp_avg,
                    exp_avg_sq,
                    weight_decay: 0.1,
                    step: i as u64 + 1,
                    in_norm: true,
                }
            })
            .collect();
        adamw_step(&dev, &mut list, &args, &mut norm_out).unwrap();
    });
    let total = tensors * n;
    b.record(
        "adamw step bf16 grads/params, f32 state (norm + clip + update)",
        &format!("{tensors}x{n}"),
        st,
        Some(30 * total as u64),
        Some(Target::CopyFraction(0.8)),
    );
}
