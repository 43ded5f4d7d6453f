//! Family 5 on the GPU: LayerNorm / RMSNorm forward (high-precision and FP8 outputs) and
//! backward against the CPU reference, determinism of dgamma/dbeta, and typed errors.
//!
//! The reference mirrors the kernels' f32 operations and summation order (same `NormSpec`), so
//! mu, rsigma, FP8 codes and amax are expected bit-exact; high-precision outputs are checked with
//! TE's bf16/fp16/fp32 rtol and atol 1e-3 for bf16/fp16 (normalized values are O(1): one output
//! ulp there is ~4e-3 for bf16, so TE's atol 1e-5 only matters for values near 0, where a
//! last-place difference of an f32 intermediate can flip the rounding of a tiny value).

use crate::common::{assert_bits_eq, assert_close, device, randn};
use cudarc::driver::CudaSlice;
use te_codegen::spec::{Direction, NormKind, NormSpec};
use te_reference::norm as ref_norm;
use te_runtime::numerics;
use te_runtime::ops::norm::{norm_bwd, norm_fwd, NormBwdArgs, NormBwdOut, NormFwdArgs, NormFwdOut};
use te_runtime::ops::Fp8Meta;
use te_runtime::DType;
use te_runtime::{Device, Error, Tensor};

const EPS: f32 = 1e-5;

fn tol(dt: DType) -> (f32, f32) {
    match dt {
        DType::F32 => (1.3e-6, 1e-5),
        DType::F16 => (1e-3, 1e-3),
        _ => (1.6e-2, 1e-3),
    }
}

fn rounded(dt: DType, v: Vec<f32>) -> Vec<f32> {
    v.into_iter().map(|x| numerics::round_to(dt, x)).collect()
}

/// Host inputs of one case: x (rows × hidden, mean 0.5, std 2), gamma near 1 (or near 0 when
/// zero-centered), beta.
struct Case {
    kind: NormKind,
    dt: DType,
    rows: usize,
    hidden: usize,
    zc: bool,
    x: Vec<f32>,
    gamma: Vec<f32>,
    beta: Vec<f32>,
}

impl Case {
    fn new(kind: NormKind, dt: DType, rows: usize, hidden: usize, zc: bool, seed: u64) -> Case {
        let x = rounded(dt, randn(seed, rows * hidden, 2.0).into_iter().map(|v| v + 0.5).collect());
        let g0 = if zc { 0.0 } else { 1.0 };
        let gamma = rounded(dt, randn(seed + 1, hidden, 0.2).into_iter().map(|v| v + g0).collect());
        let beta = rounded(dt, randn(seed + 2, hidden, 0.2));
        Case { kind, dt, rows, hidden, zc, x, gamma, beta }
    }
    fn ln(&self) -> bool {
        self.kind == NormKind::LayerNorm
    }
    fn spec(&self, dir: Direction, out: DType, dev: &Device) -> NormSpec {
        NormSpec::new(self.kind, dir, self.dt, out, self.dt, self.hidden, self.zc, dev.arch())
    }
}

/// Device results of a forward: y bytes, mu, rsigma, and (amax, scale_inv) for FP8.
struct FwdRun {
    y: Vec<u8>,
    mu: Vec<f32>,
    rsigma: Vec<f32>,
    amax_scale_inv: Option<(f32, f32)>,
}

fn run_fwd(dev: &Device, c: &Case, out: DType, scale: f32) -> FwdRun {
    let shape = [c.rows, c.hidden];
    let x = Tensor::from_f32(dev, c.dt, &shape, &c.x).unwrap();
    let gamma = Tensor::from_f32(dev, c.dt, &[c.hidden], &c.gamma).unwrap();
    let beta = Tensor::from_f32(dev, c.dt, &[c.hidden], &c.beta).unwrap();
    let mut y = Tensor::zeros(dev, out, &shape).unwrap();
    let mut mu: CudaSlice<f32> = dev.stream().alloc_zeros(c.rows).unwrap();
    let mut rsigma: CudaSlice<f32> = dev.stream().alloc_zeros(c.rows).unwrap();
    let mut meta = Fp8Meta::new(dev, scale).unwrap();
    let mut scaling = meta.scaling();
    let args = NormFwdArgs {
        kind: c.kind,
        x: &x,
        gamma: &gamma,
        beta: c.ln().then_some(&beta),
        eps: EPS,
        zero_centered_gamma: c.zc,
    };
    let fp8 = out.is_fp8();
    let outs =
        NormFwdOut { y: &mut y, mu: c.ln().then_some(&mut mu), rsigma: &mut rsigma, fp8: fp8.then_some(&mut scaling) };
    norm_fwd(dev, &args, outs).unwrap();
    let s = dev.stream();
    FwdRun {
        y: y.to_bytes(dev).unwrap(),
        mu: s.clone_dtoh(&mu).unwrap(),
        rsigma: s.clone_dtoh(&rsigma).unwrap(),
        amax_scale_inv: fp8.then(|| {
            let (_, a, si) = meta.read(dev).unwrap();
            (a, si)
        }),
    }
}

fn check_fwd(dev: &Device, c: &Case, out: DType) {
    let scale = 3.0;
    let what = format!("{:?} {}→{out} {}x{} zc={}", c.kind, c.dt, c.rows, c.hidden, c.zc);
    let got = run_fwd(dev, c, out, scale);
    let spec = c.spec(Direction::Fwd, out, dev);
    let want = ref_norm::forward(&spec, &c.x, &c.gamma, c.ln().then_some(&c.beta[..]), EPS, scale);
    assert_close(&format!("{what}: rsigma"), &got.rsigma, &want.rsigma, 1e-5, 0.0);
    if c.ln() {
        assert_close(&format!("{what}: mu"), &got.mu, &want.mu, 1e-5, 1e-6);
    }
    if out.is_fp8() {
        assert_bits_eq(&format!("{what}: y codes"), &got.y, &want.y);
        let (amax, scale_inv) = got.amax_scale_inv.unwrap();
        assert_eq!(amax.to_bits(), want.amax.to_bits(), "{what}: amax");
        assert_eq!(scale_inv, want.scale_inv, "{what}: scale_inv");
    } else {
        let (rtol, atol) = tol(out);
        assert_close(
            &format!("{what}: y"),
            &numerics::decode(out, &got.y),
            &numerics::decode(out, &want.y),
            rtol,
            atol,
        );
    }
}

#[test]
fn forward_high_precision_matches_reference() {
    let Some(dev) = device() else { return };
    let mut seed = 10;
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for dt in [DType::BF16, DType::F16, DType::F32] {
            for (rows, hidden) in [(37, 4096), (1, 784), (1000, 1000), (37, 1000)] {
                for zc in [false, true] {
                    seed += 3;
                    check_fwd(&dev, &Case::new(kind, dt, rows, hidden, zc, seed), dt);
                }
            }
        }
    }
}

#[test]
fn forward_fp8_output_is_bit_exact_with_amax() {
    let Some(dev) = device() else { return };
    let mut seed = 200;
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for dt in [DType::BF16, DType::F16, DType::F32] {
            for (rows, hidden) in [(1000, 4096), (1, 4096), (37, 784)] {
                for zc in [false, true] {
                    seed += 3;
                    check_fwd(&dev, &Case::new(kind, dt, rows, hidden, zc, seed), DType::E4M3);
                }
            }
        }
    }
    check_fwd(&dev, &Case::new(NormKind::LayerNorm, DType::BF16, 37, 4096, false, 999), DType::E5M2);
}

/// Runs the backward; returns (dx, dgamma, dbeta) as f32.
fn run_bwd(dev: &Device, c: &Case, dy: &[f32], mu: &[f32], rsigma: &[f32]) -> (Vec<f32>, Vec<f32>, Option<Vec<f32>>) {
    let shape = [c.rows, c.hidden];
    let s = dev.stream();
    let x = Tensor::from_f32(dev, c.dt, &shape, &c.x).unwrap();
    let dyt = Tensor::from_f32(dev, c.dt, &shape, dy).unwrap();
    let gamma = Tensor::from_f32(dev, c.dt, &[c.hidden], &c.gamma).unwrap();
    let mu_d = s.clone_htod(mu).unwrap();
    let rs_d = s.clone_htod(rsigma).unwrap();
    let mut dx = Tensor::zeros(dev, c.dt, &shape).unwrap();
    let mut dgamma = Tensor::zeros(dev, c.dt, &[c.hidden]).unwrap();
    let mut dbeta = Tensor::zeros(dev, c.dt, &[c.hidden]).unwrap();
    let args = NormBwdArgs {
        kind: c.kind,
        dy: &dyt,
        x: &x,
        mu: c.ln().then_some(&mu_d),
        rsigma: &rs_d,
        gamma: &gamma,
        zero_centered_gamma: c.zc,
    };
    let ln = c.ln();
    norm_bwd(dev, &args, NormBwdOut { dx: &mut dx, dgamma: &mut dgamma, dbeta: ln.then_some(&mut dbeta) }).unwrap();
    (dx.to_f32(dev).unwrap(), dgamma.to_f32(dev).unwrap(), ln.then(|| dbeta.to_f32(dev).unwrap()))
}

#[test]
fn backward_matches_reference_and_is_deterministic() {
    let Some(dev) = device() else { return };
    let mut seed = 400;
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        for dt in [DType::BF16, DType::F16, DType::F32] {
            for (rows, hidden) in [(1000, 4096), (37, 784), (1, 1000)] {
                for zc in [false, true] {
                    seed += 3;
                    let c = Case::new(kind, dt, rows, hidden, zc, seed);
                    let what = format!("{kind:?} bwd {dt} {rows}x{hidden} zc={zc}");
                    let dy = rounded(dt, randn(seed + 7, rows * hidden, 1.0));
                    // Statistics from the reference forward (the GPU forward matches them).
                    let f = ref_norm::forward(
                        &c.spec(Direction::Fwd, dt, &dev),
                        &c.x,
                        &c.gamma,
                        c.ln().then_some(&c.beta[..]),
                        EPS,
                        1.0,
                    );
                    let mu = if c.ln() { f.mu.clone() } else { vec![0.0; rows] };
                    let (dx, dgamma, dbeta) = run_bwd(&dev, &c, &dy, &mu, &f.rsigma);
                    let want = ref_norm::backward(
                        &c.spec(Direction::Bwd, dt, &dev),
                        &dy,
                        &c.x,
                        c.ln().then_some(&f.mu[..]),
                        &f.rsigma,
                        &c.gamma,
                    );
                    let (rtol, atol) = tol(dt);
                    assert_close(&format!("{what}: dx"), &dx, &want.dx, rtol, atol);
                    // dgamma/dbeta sum `rows` terms: allow f32 accumulation differences relative
                    // to the magnitude of the sum.
                    let wtol = atol.max(1e-4 * (rows as f32).sqrt());
                    assert_close(&format!("{what}: dgamma"), &dgamma, &want.dgamma, rtol, wtol);
                    if let (Some(got), Some(want)) = (&dbeta, &want.dbeta) {
                        assert_close(&format!("{what}: dbeta"), got, want, rtol, wtol);
                    }
                    let again = run_bwd(&dev, &c, &dy, &mu, &f.rsigma);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&again.1), bits(&dgamma), "{what}: dgamma not deterministic");
                    assert_eq!(
                        again.2.as_deref().map(bits),
                        dbeta.as_deref().map(bits),
                        "{what}: dbeta not deterministic"
                    );
                }
            }
        }
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let Some(dev) = device() else { return };
    let s = dev.stream();
    let x = Tensor::zeros(&dev, DType::BF16, &[4, 1000]).unwrap();
    let gamma = Tensor::zeros(&dev, DType::BF16, &[1000]).unwrap();
    let beta = Tensor::zeros(&dev, DType::BF16, &[1000]).unwrap();
    let bad_gamma = Tensor::zeros(&dev, DType::BF16, &[1024]).unwrap();
    let mut y = Tensor::zeros(&dev, DType::BF16, &[4, 1000]).unwrap();
    let mut y8 = Tensor::zeros(&dev, DType::E4M3, &[4, 1000]).unwrap();
    let mut mu: CudaSlice<f32> = s.alloc_zeros(4).unwrap();
    let mut rs: CudaSlice<f32> = s.alloc_zeros(4).unwrap();
    let mut meta = Fp8Meta::new(&dev, 1.0).unwrap();
    let ln = |gamma, beta| NormFwdArgs {
        kind: NormKind::LayerNorm,
        x: &x,
        gamma,
        beta,
        eps: EPS,
        zero_centered_gamma: false,
    };

    let e = norm_fwd(
        &dev,
        &ln(&bad_gamma, Some(&beta)),
        NormFwdOut { y: &mut y, mu: Some(&mut mu), rsigma: &mut rs, fp8: None },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("gamma"), "{e}");

    let mut sc = meta.scaling();
    let e = norm_fwd(
        &dev,
        &ln(&gamma, Some(&beta)),
        NormFwdOut { y: &mut y8, mu: Some(&mut mu), rsigma: &mut rs, fp8: Some(&mut sc) },
    )
    .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("pad it to 1008"), "{e}");

    let e = norm_fwd(&dev, &ln(&gamma, None), NormFwdOut { y: &mut y, mu: Some(&mut mu), rsigma: &mut rs, fp8: None })
        .unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("beta"), "{e}");

    let e = norm_fwd(
        &dev,
        &ln(&gamma, Some(&beta)),
        NormFwdOut { y: &mut y8, mu: Some(&mut mu), rsigma: &mut rs, fp8: None },
    )
    .unwrap_err();
    assert!(matches!(e, Error::DType { arg: "y", .. }), "{e}");

    let rms = NormFwdArgs {
        kind: NormKind::RmsNorm,
        x: &x,
        gamma: &gamma,
        beta: Some(&beta),
        eps: EPS,
        zero_centered_gamma: false,
    };
    let e = norm_fwd(&dev, &rms, NormFwdOut { y: &mut y, mu: None, rsigma: &mut rs, fp8: None }).unwrap_err();
    assert!(e.to_string().contains("RMSNorm takes no `beta`"), "{e}");

    let mut short: CudaSlice<f32> = s.alloc_zeros(3).unwrap();
    let e = norm_fwd(
        &dev,
        &ln(&gamma, Some(&beta)),
        NormFwdOut { y: &mut y, mu: Some(&mut mu), rsigma: &mut short, fp8: None },
    )
    .unwrap_err();
    assert!(e.to_string().contains("rsigma"), "{e}");

    let empty = Tensor::zeros(&dev, DType::BF16, &[0, 1000]).unwrap();
    let mut ey = Tensor::zeros(&dev, DType::BF16, &[0, 1000]).unwrap();
    let args = NormFwdArgs {
        kind: NormKind::RmsNorm,
        x: &empty,
        gamma: &gamma,
        beta: None,
        eps: EPS,
        zero_centered_gamma: false,
    };
    let e = norm_fwd(&dev, &args, NormFwdOut { y: &mut ey, mu: None, rsigma: &mut rs, fp8: None }).unwrap_err();
    assert!(e.to_string().contains("no elements"), "{e}");

    let mut dx = Tensor::zeros(&dev, DType::BF16, &[4, 1000]).unwrap();
    let mut dg = Tensor::zeros(&dev, DType::BF16, &[1000]).unwrap();
    let bargs = NormBwdArgs {
        kind: NormKind::LayerNorm,
        dy: &x,
        x: &x,
        mu: Some(&mu),
        rsigma: &rs,
        gamma: &gamma,
        zero_centered_gamma: false,
    };
    let e = norm_bwd(&dev, &bargs, NormBwdOut { dx: &mut dx, dgamma: &mut dg, dbeta: None }).unwrap_err();
    assert!(e.to_string().contains("dbeta"), "{e}");
}
