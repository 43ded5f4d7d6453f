//! MoE token permutation on the GPU (`ops::moe`, TE's `moe_permute` / `moe_unpermute`) against
//! the CPU reference (`reference::moe`): the routing map and `m_splits` exactly, permuted rows
//! bit for bit, the weighted unpermute within f32 rounding (1 ulp in bf16), the probabilities'
//! gradient, dropped slots (index -1 or past the experts), shapes that are not multiples of
//! anything, typed errors.

use crate::common::{device, randn};
use te_reference::moe;
use te_runtime::numerics::round_to;
use te_runtime::ops::moe::{permute, routing_map, unpermute, unpermute_dprobs, MoeRouting};
use te_runtime::{DType, Device, Error, Tensor};

/// `row_id_map` and `m_splits` of `indices` by the rule (dropped slots -1).
fn host_map(indices: &[i32], tokens: usize, k: usize, experts: usize) -> (Vec<i32>, Vec<i32>) {
    let (mut map, mut m_splits, mut next) = (vec![-1; tokens * k], vec![0; experts], 0);
    for (e, split) in m_splits.iter_mut().enumerate() {
        for (i, &v) in indices.iter().enumerate() {
            if v == e as i32 {
                map[(i % k) * tokens + i / k] = next;
                next += 1;
                *split += 1;
            }
        }
    }
    (map, m_splits)
}

fn host(dev: &Device, t: &Tensor) -> Vec<f32> {
    t.to_f32(dev).unwrap()
}

fn route(dev: &Device, indices: &[i32], tokens: usize, k: usize, experts: usize) -> MoeRouting {
    let idx = dev.stream().clone_htod(indices).unwrap();
    let mut r = MoeRouting::new(dev, tokens, k, experts).unwrap();
    routing_map(dev, &idx, &mut r).unwrap();
    r
}

/// `permute` into a zeroed tensor.
fn permuted(dev: &Device, x: &Tensor, r: &MoeRouting, probs: Option<&cudarc::driver::CudaSlice<f32>>) -> Tensor {
    let mut out = Tensor::zeros(dev, x.dtype(), &[r.rows(), x.shape()[1]]).unwrap();
    permute(dev, x, r, probs, &mut out).unwrap();
    out
}

fn unpermuted(dev: &Device, y: &Tensor, r: &MoeRouting, probs: Option<&cudarc::driver::CudaSlice<f32>>) -> Tensor {
    let mut out = Tensor::empty(dev, y.dtype(), &[r.tokens, y.shape()[1]]).unwrap();
    unpermute(dev, y, r, probs, &mut out).unwrap();
    out
}

#[test]
fn moe_permutation_matches_the_reference() {
    let Some(dev) = device() else { return };
    let (tokens, hidden, experts, k) = (37, 99, 6, 2);
    let logits: Vec<f32> = randn(1, tokens * experts, 1.0);
    let r = moe::topk_router(&logits, tokens, experts, k, false, 1.0);
    let indices: Vec<i32> = r.experts.iter().map(|&e| e as i32).collect();
    let routing = route(&dev, &indices, tokens, k, experts);
    for dtype in [DType::F32, DType::BF16] {
        let x: Vec<f32> = randn(2, tokens * hidden, 1.0).into_iter().map(|v| round_to(dtype, v)).collect();
        let (want_p, want_map, want_splits) = moe::permute(&x, hidden, &r.experts, k, experts);
        let got_map = dev.stream().clone_dtoh(&routing.row_id_map).unwrap();
        let got_splits = dev.stream().clone_dtoh(&routing.m_splits).unwrap();
        assert_eq!(got_map, want_map.iter().map(|&v| v as i32).collect::<Vec<_>>(), "row_id_map");
        assert_eq!(got_splits, want_splits.iter().map(|&v| v as i32).collect::<Vec<_>>(), "m_splits");
        let xt = Tensor::from_f32(&dev, dtype, &[tokens, hidden], &x).unwrap();
        let p = permuted(&dev, &xt, &routing, None);
        assert_eq!(host(&dev, &p), want_p, "{dtype}: permuted rows");

        // Unpermute with the routing probabilities: the tokens back.
        let probs = dev.stream().clone_htod(&r.probs).unwrap();
        let back = host(&dev, &unpermuted(&dev, &p, &routing, Some(&probs)));
        let want = moe::unpermute(&want_p, hidden, &want_map, k, Some(&r.probs));
        let ulp = if dtype == DType::BF16 { 1.0 / 128.0 } else { 1e-6 };
        for (g, w) in back.iter().zip(&want) {
            assert!((g - w).abs() <= ulp * w.abs() + 1e-30, "{dtype}: unpermute {g} vs {w}");
        }
        assert!(back.iter().zip(&x).all(|(a, b)| (a - b).abs() <= 2.0 * ulp * b.abs() + 1e-6), "{dtype}: x back");

        // The probabilities' gradient, and y's (permute of d_out with the probabilities).
        let d_out: Vec<f32> = randn(3, tokens * hidden, 1.0).into_iter().map(|v| round_to(dtype, v)).collect();
        let d_out_t = Tensor::from_f32(&dev, dtype, &[tokens, hidden], &d_out).unwrap();
        let mut dp = dev.stream().alloc_zeros::<f32>(tokens * k).unwrap();
        unpermute_dprobs(&dev, &d_out_t, &p, &routing, &mut dp).unwrap();
        let dp = dev.stream().clone_dtoh(&dp).unwrap();
        for t in 0..tokens {
            for j in 0..k {
                let row = want_map[j * tokens + t];
                let w: f64 =
                    (0..hidden).map(|h| f64::from(d_out[t * hidden + h]) * f64::from(want_p[row * hidden + h])).sum();
                let g = f64::from(dp[t * k + j]);
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{dtype}: d_probs[{t}, {j}] {g} vs {w}");
            }
        }
        let dy = host(&dev, &permuted(&dev, &d_out_t, &routing, Some(&probs)));
        for t in 0..tokens {
            for j in 0..k {
                let row = want_map[j * tokens + t];
                for h in 0..hidden {
                    let w = round_to(dtype, d_out[t * hidden + h] * r.probs[t * k + j]);
                    assert_eq!(dy[row * hidden + h], w, "{dtype}: d_y row {row}");
                }
            }
        }
    }
}

#[test]
fn dropped_slots_and_errors() {
    let Some(dev) = device() else { return };
    let (tokens, hidden, experts, k) = (300, 16, 5, 3);
    let mut indices: Vec<i32> = (0..tokens * k).map(|i| ((i * 7 + i / k) % experts) as i32).collect();
    // Distinct experts per token are not required by the map; drop two slots.
    indices[4] = -1;
    indices[11] = 99;
    let routing = route(&dev, &indices, tokens, k, experts);
    let (want_map, want_splits) = host_map(&indices, tokens, k, experts);
    assert_eq!(dev.stream().clone_dtoh(&routing.row_id_map).unwrap(), want_map);
    assert_eq!(dev.stream().clone_dtoh(&routing.m_splits).unwrap(), want_splits);
    let x: Vec<f32> = (0..tokens * hidden).map(|i| i as f32).collect();
    let xt = Tensor::from_f32(&dev, DType::F32, &[tokens, hidden], &x).unwrap();
    let p = host(&dev, &permuted(&dev, &xt, &routing, None));
    let kept = want_splits.iter().sum::<i32>() as usize;
    assert_eq!(kept, tokens * k - 2);
    assert!(p[kept * hidden..].iter().all(|&v| v == 0.0), "the rows of dropped slots stay zero");
    let pt = Tensor::from_f32(&dev, DType::F32, &[tokens * k, hidden], &p).unwrap();
    let back = host(&dev, &unpermuted(&dev, &pt, &routing, None));
    for t in 0..tokens {
        let slots = (0..k).filter(|&j| want_map[j * tokens + t] >= 0).count() as f32;
        assert!((0..hidden).all(|h| back[t * hidden + h] == slots * x[t * hidden + h]), "token {t}");
    }

    // Typed errors.
    let idx = dev.stream().clone_htod(&indices).unwrap();
    let mut small = MoeRouting::new(&dev, tokens - 1, k, experts).unwrap();
    assert!(matches!(routing_map(&dev, &idx, &mut small), Err(Error::Shape { .. })), "indices of another size");
    assert!(matches!(MoeRouting::new(&dev, tokens, k, 0), Err(Error::Shape { .. })));
    assert!(matches!(MoeRouting::new(&dev, tokens, 0, experts), Err(Error::Shape { .. })));
    let mut out = Tensor::zeros(&dev, DType::F32, &[tokens * k, hidden]).unwrap();
    let wrong = Tensor::zeros(&dev, DType::F32, &[tokens + 1, hidden]).unwrap();
    assert!(matches!(permute(&dev, &wrong, &routing, None, &mut out), Err(Error::Shape { .. })));
    let fp8 = Tensor::zeros(&dev, DType::E4M3, &[tokens, hidden]).unwrap();
    assert!(matches!(permute(&dev, &fp8, &routing, None, &mut out), Err(Error::DType { .. })));
    let probs = dev.stream().clone_htod(&[0.5f32; 7]).unwrap();
    let e = permute(&dev, &xt, &routing, Some(&probs), &mut out).unwrap_err();
    assert!(e.to_string().contains("probs"), "{e}");
    let mut bf16_out = Tensor::zeros(&dev, DType::BF16, &[tokens * k, hidden]).unwrap();
    let e = permute(&dev, &xt, &routing, None, &mut bf16_out).unwrap_err();
    assert!(e.to_string().contains("out is bf16"), "{e}");
    // No tokens: nothing to do.
    let none = dev.stream().clone_htod(&[0i32]).unwrap();
    let mut empty = MoeRouting::new(&dev, 0, 1, experts).unwrap();
    routing_map(&dev, &none, &mut empty).unwrap();
}
