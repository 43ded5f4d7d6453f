//! Family 22, the decode GEMV, beside what it replaces: Gemma 3 270M's four GEMMs of a layer and
//! its LM head at one, two, four and eight token rows, each fused GEMV against the same work unfused
//! (te-nn `Norm::infer`, the cuBLASLt `Linear::infer`, the activation kernel, `add_assign`).
//! Both run as a decode step runs them, replayed from a CUDA graph: [`REPS`] copies captured
//! once, the replay timed and divided, so launch gaps inside a graph count and host launch costs
//! do not. The floor: the weight's bytes over this run's copy bandwidth.

use crate::harness::{Bench, Stats};
use std::sync::Arc;
use te_codegen::spec::{Activation, GemvEpilogue, NormKind};
use te_nn::modules::{Linear, LinearConfig, Norm, NormConfig};
use te_runtime::graph::HostCopies;
use te_runtime::ops::activation;
use te_runtime::ops::elementwise::add_assign;
use te_runtime::ops::gemv::{gemv, GemvInput, GemvMatrix, GemvNorm, GemvNormKind, GemvWeight};
use te_runtime::{DType, Device, Tensor};

/// Launches a graph holds.
const REPS: usize = 20;

/// Per-launch time (µs) of `body` replayed from a graph of [`REPS`] copies.
fn graphed(b: &Bench, body: impl FnMut()) -> Stats {
    b.graphed(REPS, body)
}

/// Gemma 3 270M: hidden 640, q/k/v 4 + 1 + 1 heads of 256, ffn 2048 (GeGLU), vocab 262 144.
const H: usize = 640;

fn rand(dev: &Arc<Device>, shape: &[usize], std: f32, seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((((i + seed) * 2_654_435_761) % 2001) as f32 - 1000.0) * std / 577.0).collect();
    Tensor::from_f32(dev, DType::BF16, shape, &v).unwrap()
}

fn norm(dev: &Arc<Device>) -> Norm {
    let nc = NormConfig { hidden_size: H, eps: 1e-6, zero_centered_gamma: true, params_dtype: DType::BF16 };
    Norm::new(dev, NormKind::RmsNorm, nc).unwrap()
}

fn linear(dev: &Arc<Device>, n_out: usize, n_in: usize) -> Linear {
    let lc = LinearConfig { bias: false, params_dtype: DType::BF16, init_std: 0.02, ..LinearConfig::new(n_in, n_out) };
    Linear::new(dev, lc).unwrap()
}

pub fn run(b: &mut Bench) {
    let work = "gemv";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let kind = GemvNormKind { kind: NormKind::RmsNorm, eps: 1e-6, zero_centered_gamma: true };
    let (n1, n2) = (norm(&dev), norm(&dev));
    // (name, n_out weight rows, k, what runs around it)
    #[derive(Clone, Copy, PartialEq)]
    enum Part {
        Qkv,
        Proj,
        Fc1,
        Fc2,
        Head,
    }
    for (name, rows_out, k, part) in [
        ("qkv (norm)", 1536, H, Part::Qkv),
        ("proj (store)", H, 1024, Part::Proj),
        ("fc1 (add + norm, geglu)", 2 * 2048, H, Part::Fc1),
        ("fc2 (residual)", H, 2048, Part::Fc2),
        ("lm head (norm)", 262_144, H, Part::Head),
    ] {
        let mut lin = linear(&dev, rows_out, k);
        let w = lin.params().weight().unwrap().clone();
        let n = if part == Part::Fc1 { rows_out / 2 } else { rows_out };
        let floor_us = (rows_out * k * 2) as f64 / (b.copy_gbps * 1e3);
        for m in [1, 2, 4, 8] {
            let x = rand(&dev, &[m, k], 1.0, 1);
            let a = rand(&dev, &[m, k], 1.0, 2);
            let mut out = Tensor::zeros(&dev, DType::BF16, &[m, n]).unwrap();
            let mut h_out = Tensor::zeros(&dev, DType::BF16, &[m, k]).unwrap();
            let fused = graphed(b, || {
                let wg = GemvMatrix { weight: GemvWeight::Bf16(&w), bias: None, constant: true };
                let input = match part {
                    Part::Qkv | Part::Head => {
                        GemvInput::Norm { x: &x, kind, norm: GemvNorm { gamma: n1.params().weight(), beta: None } }
                    }
                    Part::Fc1 => GemvInput::AddNorm {
                        x: &x,
                        a: &a,
                        kind,
                        post: GemvNorm { gamma: n1.params().weight(), beta: None },
                        norm: GemvNorm { gamma: n2.params().weight(), beta: None },
                        h_out: &mut h_out,
                    },
                    Part::Proj | Part::Fc2 => GemvInput::Plain(&x),
                };
                let epilogue = match part {
                    Part::Fc1 => GemvEpilogue::Act(Activation::Geglu),
                    Part::Fc2 => GemvEpilogue::Residual,
                    _ => GemvEpilogue::Store,
                };
                gemv(&dev, input, wg, epilogue, &mut out).unwrap();
            });
            let mut resid = Tensor::zeros(&dev, DType::BF16, &[m, n]).unwrap();
            let unfused = graphed(b, || match part {
                Part::Qkv | Part::Head => {
                    let xn = n1.infer(&x).unwrap();
                    drop(lin.infer(&xn).unwrap());
                }
                Part::Proj => drop(lin.infer(&x).unwrap()),
                Part::Fc1 => {
                    let an = n1.infer(&a).unwrap();
                    let mut h = x.clone();
                    add_assign(&dev, &mut h, &an).unwrap();
                    let hn = n2.infer(&h).unwrap();
                    let f = lin.infer(&hn).unwrap();
                    let mut act = Tensor::empty(&dev, DType::BF16, &[m, n]).unwrap();
                    activation::forward(&dev, Activation::Geglu, &f, None, &mut act, None).unwrap();
                }
                Part::Fc2 => {
                    let y = lin.infer(&x).unwrap();
                    add_assign(&dev, &mut resid, &y).unwrap();
                }
            });
            let shape = format!("m{m} [{rows_out}, {k}]");
            b.record(&format!("{work} {name} fused"), &shape, fused, Some((rows_out * k * 2) as u64), None);
            b.record(&format!("{work} {name} unfused"), &shape, unfused, Some((rows_out * k * 2) as u64), None);
            println!(
                "{work} {name} {shape}: fused {:.2} µs, unfused {:.2} µs ({:.2}×), floor {floor_us:.2} µs",
                fused.median_us,
                unfused.median_us,
                unfused.median_us / fused.median_us
            );
        }
    }
}

/// The rest of a Gemma 3 270M decode step at batch 1, graph-replayed as the step runs it: a
/// layer's fused qk-norm + RoPE + cache append, its decode attention (split-K and combine) over
/// 256 and 1 152 cached positions, nine graph allocations (what a layer allocates), the argmax of
/// a 262 144-wide row.
pub fn decode_parts(b: &mut Bench) {
    let work = "gemma3 270m decode parts";
    if !b.enabled(work) {
        return;
    }
    use te_runtime::ops::argmax::argmax;
    use te_runtime::ops::attention_shape::AttentionShape;
    use te_runtime::ops::decode_attention::{decode, Strided};
    use te_runtime::ops::qkv_rope::{qkv_rope, QkNorm, TokenRows};
    let dev = b.dev().clone();
    let (heads, groups, d) = (4, 1, 256);
    for len in [256, 1152] {
        let capacity = len + 64;
        let mut k_cache = Tensor::zeros(&dev, DType::BF16, &[1, capacity, groups, d]).unwrap();
        let mut v_cache = Tensor::zeros(&dev, DType::BF16, &[1, capacity, groups, d]).unwrap();
        let qkv = rand(&dev, &[1, (heads + 2 * groups) * d], 1.0, 3);
        let gamma = rand(&dev, &[d], 0.1, 4);
        let inv: Vec<f32> = (0..d / 2).map(|i| 1e4f32.powf(-(2.0 * i as f32) / d as f32)).collect();
        let inv_freq = Tensor::from_f32(&dev, DType::F32, &[d / 2], &inv).unwrap();
        let rows = TokenRows::from_host(&dev, &[len as i32 - 1], &[len as i32 - 1], capacity).unwrap();
        let mut q = Tensor::zeros(&dev, DType::BF16, &[1, heads, d]).unwrap();
        let rope = graphed(b, || {
            let norm = QkNorm { q_gamma: &gamma, k_gamma: &gamma, eps: 1e-6, zero_centered_gamma: true };
            qkv_rope(
                &dev,
                &qkv,
                (heads, groups, d),
                Some(norm),
                &inv_freq,
                &rows,
                &mut q,
                [&mut k_cache, &mut v_cache],
            )
            .unwrap();
        });
        let p = AttentionShape::decode(1, heads, groups, d, capacity, 0.0625);
        let seqlens = dev.stream().htod(&[len as i32]).unwrap();
        let mut o = Tensor::zeros(&dev, DType::BF16, &[1, heads * d]).unwrap();
        let attn = graphed(b, || {
            let qs = Strided { tensor: &q, offset: 0, row: heads * d };
            decode(&dev, &p, qs, [&k_cache, &v_cache], &seqlens, (&mut o, heads * d)).unwrap();
        });
        println!("{work} len {len}: qkv_rope {:.2} µs, decode attention {:.2} µs", rope.median_us, attn.median_us);
        b.record(&format!("{work} qkv_rope"), &format!("len {len}"), rope, None, None);
        b.record(&format!("{work} decode attention"), &format!("len {len}"), attn, None, None);
    }
    let alloc = graphed(b, || {
        let t: Vec<Tensor> = (0..9).map(|_| Tensor::empty(&dev, DType::BF16, &[1, 2048]).unwrap()).collect();
        drop(t);
    });
    let logits = rand(&dev, &[1, 262_144], 1.0, 5);
    let mut picks = dev.stream().htod(&[0i32]).unwrap();
    let am = graphed(b, || argmax(&dev, &logits, &mut picks).unwrap());
    println!("{work}: nine allocations {:.2} µs, argmax of 262 144 {:.2} µs", alloc.median_us, am.median_us);
    b.record(&format!("{work} nine allocations"), "", alloc, None, None);
    b.record(&format!("{work} argmax"), "[1, 262144]", am, None, None);
}
