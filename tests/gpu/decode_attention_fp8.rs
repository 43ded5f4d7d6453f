//! Family 15 over an E4M3 KV cache (`append_kv_fp8`, `decode_fp8`, vLLM's `kv_cache_dtype="fp8"`
//! with per-tensor scales): the append stores `E4M3(x · scale)` exactly as the host's cast of the
//! same values, and the decode matches the f64 reference of attention over the dequantized cache
//! (`code · scale_inv`) at the 16-bit tolerances: GPT's, Llama's and Gemma 3's head dims, GQA and
//! MQA, one split and many; and typed errors.

use crate::attention::check;
use crate::common::{device, randn};
use te_reference::attention as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::decode_attention::{append_kv_fp8, cache_shape, decode_fp8, KvScales, Strided};
use te_runtime::{DType, Device, Error, Tensor};

/// Powers of two, so that `scale_inv` is exact and the reference's dequantization is the kernel's.
const K_SCALE: f32 = 64.0;
const V_SCALE: f32 = 32.0;

fn e4m3(x: f32) -> f32 {
    round_to(DType::E4M3, x)
}

fn check_step(dev: &Device, p: AttentionShape, lens: &[usize], seed: u64) {
    let dtype = DType::BF16;
    let (b, h, g, d, cap) = (p.batch, p.heads, p.groups, p.head_dim, p.sk);
    let vals = |seed, n| -> Vec<f32> { randn(seed, n, 1.0).into_iter().map(|x| round_to(dtype, x)).collect() };
    // The cache's codes (as values): what earlier appends stored.
    let mut k: Vec<f32> = vals(seed, b * cap * g * d).into_iter().map(|x| e4m3(x * K_SCALE)).collect();
    let mut v: Vec<f32> = vals(seed + 1, b * cap * g * d).into_iter().map(|x| e4m3(x * V_SCALE)).collect();
    let row = (h + 2 * g) * d;
    let qkv = vals(seed + 2, b * row);
    let (host_k, host_v) = (k.clone(), v.clone());
    for (j, &len) in lens.iter().enumerate() {
        if len == 0 {
            continue;
        }
        for gi in 0..g {
            let at = ((j * cap + len - 1) * g + gi) * d;
            for x in 0..d {
                k[at + x] = e4m3(qkv[j * row + h * d + gi * d + x] * K_SCALE);
                v[at + x] = e4m3(qkv[j * row + (h + g) * d + gi * d + x] * V_SCALE);
            }
        }
    }
    let shape = cache_shape(&p);
    let mut k_cache = Tensor::from_f32(dev, DType::E4M3, &shape, &host_k).unwrap();
    let mut v_cache = Tensor::from_f32(dev, DType::E4M3, &shape, &host_v).unwrap();
    let scales = dev.stream().clone_htod(&[K_SCALE, V_SCALE, 1.0 / K_SCALE, 1.0 / V_SCALE]).unwrap();
    let qkv_t = Tensor::from_f32(dev, dtype, &[b, row], &qkv).unwrap();
    let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let seqlens = dev.stream().clone_htod(&lens_i32).unwrap();
    let new = |offset| Strided { tensor: &qkv_t, offset, row };
    let cache = [&mut k_cache, &mut v_cache];
    append_kv_fp8(dev, &p, 1, [new(h * d), new((h + g) * d)], &seqlens, cache, KvScales(&scales)).unwrap();
    let what = format!("e4m3 cache d{d} b{b} h{h}/g{g} capacity {cap} lens {lens:?}");
    assert_eq!(k_cache.to_f32(dev).unwrap(), k, "{what}: keys cast as the host casts them, the rest untouched");
    assert_eq!(v_cache.to_f32(dev).unwrap(), v, "{what}: values cast as the host casts them");
    let mut out = Tensor::zeros(dev, dtype, &[b, h * d]).unwrap();
    decode_fp8(dev, &p, new(0), [&k_cache, &v_cache], KvScales(&scales), &seqlens, (&mut out, h * d)).unwrap();
    let got = out.to_f32(dev).unwrap();
    let q: Vec<f32> = (0..b).flat_map(|j| qkv[j * row..j * row + h * d].to_vec()).collect();
    let k_deq: Vec<f32> = k.iter().map(|x| x / K_SCALE).collect();
    let v_deq: Vec<f32> = v.iter().map(|x| x / V_SCALE).collect();
    let want = reference::forward(&p, Some(lens), &q, &k_deq, &v_deq).out;
    check(&what, dtype, &got, &want);
}

fn params(batch: usize, heads: usize, groups: usize, head_dim: usize, capacity: usize) -> AttentionShape {
    AttentionShape::decode(batch, heads, groups, head_dim, capacity, 1.0 / (head_dim as f32).sqrt())
}

#[test]
fn an_e4m3_cache_matches_the_reference_over_its_dequantized_values() {
    let Some(dev) = device() else { return };
    // GPT small at batch 1 (12 heads, many splits over a long cache).
    check_step(&dev, params(1, 12, 12, 64, 1024), &[900], 1);
    // Llama-style GQA, lengths 1, odd, full.
    check_step(&dev, params(3, 8, 2, 128, 300), &[1, 77, 300], 2);
    // Gemma 3's MQA at head dim 256, and a sliding window.
    check_step(&dev, params(2, 4, 1, 256, 512), &[511, 40], 3);
    check_step(&dev, params(1, 4, 1, 256, 1024).with_sliding_window(Some((511, 0))), &[1000], 4);
    // Three query heads a block, idle lanes (d 96).
    check_step(&dev, params(2, 12, 4, 96, 200), &[200, 33], 5);
}

#[test]
fn an_e4m3_cache_refuses_bad_calls() {
    let Some(dev) = device() else { return };
    let p = params(2, 4, 2, 64, 16);
    let bf16 = Tensor::zeros(&dev, DType::BF16, &cache_shape(&p)).unwrap();
    let codes = Tensor::zeros(&dev, DType::E4M3, &cache_shape(&p)).unwrap();
    let q = Tensor::zeros(&dev, DType::BF16, &[2, 4 * 64]).unwrap();
    let seqlens = dev.stream().clone_htod(&[1i32, 2]).unwrap();
    let scales = dev.stream().clone_htod(&[1.0f32, 1.0, 1.0, 1.0]).unwrap();
    let two = dev.stream().clone_htod(&[1.0f32, 1.0]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[2, 4 * 64]).unwrap();
    let q_at = Strided { tensor: &q, offset: 0, row: 256 };
    decode_fp8(&dev, &p, q_at, [&codes, &codes], KvScales(&scales), &seqlens, (&mut out, 256)).unwrap();
    let e = decode_fp8(&dev, &p, q_at, [&bf16, &bf16], KvScales(&scales), &seqlens, (&mut out, 256)).unwrap_err();
    assert!(matches!(e, Error::DType { .. }) && e.to_string().contains("e4m3"), "{e}");
    let e = decode_fp8(&dev, &p, q_at, [&codes, &codes], KvScales(&two), &seqlens, (&mut out, 256)).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("4"), "{e}");
}
