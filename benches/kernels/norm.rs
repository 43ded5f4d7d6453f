//! Family 5: LayerNorm / RMSNorm at 8192x4096 bf16. Forward to E4M3 reads x (2 B) and writes y
//! (1 B) per element, plus gamma/beta and the f32 mu/rsigma per row; the backward reads dy and x
//! and writes dx (2 B each), plus the f32 dgamma/dbeta partials.

use crate::harness::{random_bytes, Bench, Target};
use cudarc::driver::CudaSlice;
use te_codegen::spec::NormKind;
use te_runtime::ops::norm::{norm_bwd, norm_fwd, NormBwdArgs, NormBwdOut, NormFwdArgs, NormFwdOut};
use te_runtime::ops::Fp8Meta;
use te_runtime::{DType, Tensor};

const ROWS: usize = 8192;
const HIDDEN: usize = 4096;

pub fn run(b: &mut Bench) {
    if !b.enabled("norm") {
        return;
    }
    let dev = b.dev().clone();
    let (n, shape) = (ROWS * HIDDEN, [ROWS, HIDDEN]);
    let x = Tensor::from_bytes(&dev, DType::BF16, &shape, &random_bytes(DType::BF16, n, 1)).unwrap();
    let gamma = Tensor::from_bytes(&dev, DType::BF16, &[HIDDEN], &random_bytes(DType::BF16, HIDDEN, 2)).unwrap();
    let beta = Tensor::from_bytes(&dev, DType::BF16, &[HIDDEN], &random_bytes(DType::BF16, HIDDEN, 3)).unwrap();
    let mut mu: CudaSlice<f32> = dev.stream().alloc_zeros(ROWS).unwrap();
    let mut rsigma: CudaSlice<f32> = dev.stream().alloc_zeros(ROWS).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let label = format!("{ROWS}x{HIDDEN}");
    let small = (2 * HIDDEN * 2 + 2 * ROWS * 4) as u64; // gamma, beta, mu, rsigma

    let cases = [
        ("layernorm fwd bf16→e4m3", NormKind::LayerNorm, DType::E4M3, Some(Target::CopyFraction(0.80))),
        ("layernorm fwd bf16→bf16", NormKind::LayerNorm, DType::BF16, None),
        ("rmsnorm fwd bf16→e4m3", NormKind::RmsNorm, DType::E4M3, None),
    ];
    for (name, kind, out, target) in cases {
        let ln = kind == NormKind::LayerNorm;
        let mut y = Tensor::zeros(&dev, out, &shape).unwrap();
        let args = NormFwdArgs {
            kind,
            x: &x,
            gamma: &gamma,
            beta: ln.then_some(&beta),
            eps: 1e-5,
            zero_centered_gamma: false,
        };
        let st = b.time(5, 50, |_| {
            let mut sc = meta.scaling();
            let outs = NormFwdOut {
                y: &mut y,
                mu: ln.then_some(&mut mu),
                rsigma: &mut rsigma,
                fp8: out.is_fp8().then_some(&mut sc),
            };
            norm_fwd(&dev, &args, outs).unwrap()
        });
        let bytes = (n * (2 + out.size_bytes())) as u64 + small;
        b.record(name, &label, st, Some(bytes), target);
    }

    let dy = Tensor::from_bytes(&dev, DType::BF16, &shape, &random_bytes(DType::BF16, n, 4)).unwrap();
    let mut dx = Tensor::zeros(&dev, DType::BF16, &shape).unwrap();
    let mut dgamma = Tensor::zeros(&dev, DType::BF16, &[HIDDEN]).unwrap();
    let mut dbeta = Tensor::zeros(&dev, DType::BF16, &[HIDDEN]).unwrap();
    let args = NormBwdArgs {
        kind: NormKind::LayerNorm,
        dy: &dy,
        x: &x,
        mu: Some(&mu),
        rsigma: &rsigma,
        gamma: &gamma,
        zero_centered_gamma: false,
    };
    let st = b.time(5, 50, |_| {
        norm_bwd(&dev, &args, NormBwdOut { dx: &mut dx, dgamma: &mut dgamma, dbeta: Some(&mut dbeta) }).unwrap()
    });
    // dy, x read and dx written; partials written and read back (2 arrays × 2 passes).
    let parts = ROWS.div_ceil(32);
    let bytes = (n * 6) as u64 + small + (4 * parts * HIDDEN * 4) as u64;
    b.record("layernorm bwd bf16", &label, st, Some(bytes), None);
}
