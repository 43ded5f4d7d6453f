//! Family 15 on the GPU: the cache append and the split-K decode attention against the f64 CPU
//! reference of attention (one query per sequence over its cached keys is the
//! `padding_causal_bottom_right` mask with `sq = 1`), at the tolerances of `attention`: head
//! dims 32 to 256 (96: idle lanes), bf16 and f16, GQA and MQA (blocks serving 1 to 4 query heads
//! of a KV head, and 7 heads over one served one a block), one split and many (a long cache
//! on few queries), lengths 0 (zeros), 1, not multiples of anything, and the full capacity; q, k
//! and v read from a fused QKV projection's rows; sliding windows (`(left, 0)`); and typed errors.

use crate::attention::check;
use crate::common::{device, randn};
use te_reference::attention as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::decode_attention::{append_kv, cache_shape, decode, Strided};
use te_runtime::{DType, Device, Error, Tensor};

/// One decode step: the cache holds `lens[b] − 1` tokens of random keys and values, the new
/// token's q, k and v are rows of a fused `[batch, (heads + 2·groups)·d]` tensor; append, then
/// attend; compare the output with the reference over the cache as the host writes it.
fn check_step(dev: &Device, dtype: DType, p: AttentionShape, lens: &[usize], seed: u64) {
    let (b, h, g, d, cap) = (p.batch, p.heads, p.groups, p.head_dim, p.sk);
    let vals = |seed, n| -> Vec<f32> { randn(seed, n, 1.0).into_iter().map(|x| round_to(dtype, x)).collect() };
    let mut k = vals(seed, b * cap * g * d);
    let mut v = vals(seed + 1, b * cap * g * d);
    let row = (h + 2 * g) * d;
    let qkv = vals(seed + 2, b * row);
    // What the cache holds after the append: the new token at position len − 1.
    let (host_k, host_v) = (k.clone(), v.clone());
    for (j, &len) in lens.iter().enumerate() {
        if len == 0 {
            continue;
        }
        for gi in 0..g {
            let at = ((j * cap + len - 1) * g + gi) * d;
            let src = j * row + h * d + gi * d;
            k[at..at + d].copy_from_slice(&qkv[src..src + d]);
            let src = j * row + (h + g) * d + gi * d;
            v[at..at + d].copy_from_slice(&qkv[src..src + d]);
        }
    }
    let shape = cache_shape(&p);
    let mut k_cache = Tensor::from_f32(dev, dtype, &shape, &host_k).unwrap();
    let mut v_cache = Tensor::from_f32(dev, dtype, &shape, &host_v).unwrap();
    let qkv_t = Tensor::from_f32(dev, dtype, &[b, row], &qkv).unwrap();
    let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
    let seqlens = dev.stream().clone_htod(&lens_i32).unwrap();
    let new = |offset| Strided { tensor: &qkv_t, offset, row };
    append_kv(dev, &p, 1, [new(h * d), new((h + g) * d)], &seqlens, [&mut k_cache, &mut v_cache]).unwrap();
    assert_eq!(k_cache.to_f32(dev).unwrap(), k, "keys appended at len − 1, the rest untouched");
    assert_eq!(v_cache.to_f32(dev).unwrap(), v, "values appended at len − 1, the rest untouched");
    let mut out = Tensor::zeros(dev, dtype, &[b, h * d]).unwrap();
    decode(dev, &p, new(0), [&k_cache, &v_cache], &seqlens, (&mut out, h * d)).unwrap();
    let got = out.to_f32(dev).unwrap();
    let q: Vec<f32> = (0..b).flat_map(|j| qkv[j * row..j * row + h * d].to_vec()).collect();
    // The decode problem is the reference's padding_causal_bottom_right with sq = 1 over the
    // cache (the same shape the kernels ran).
    let want = reference::forward(&p, Some(lens), &q, &k, &v).out;
    let what = format!("{dtype} d{d} b{b} h{h}/g{g} capacity {cap} lens {lens:?}");
    check(&what, dtype, &got, &want);
    for (j, &len) in lens.iter().enumerate() {
        if len == 0 {
            assert!(got[j * h * d..(j + 1) * h * d].iter().all(|&x| x == 0.0), "{what}: a length of 0 gives zeros");
        }
    }
}

fn params(batch: usize, heads: usize, groups: usize, head_dim: usize, capacity: usize) -> AttentionShape {
    AttentionShape::decode(batch, heads, groups, head_dim, capacity, 1.0 / (head_dim as f32).sqrt())
}

#[test]
fn decode_matches_the_reference_over_head_dims_and_lengths() {
    let Some(dev) = device() else { return };
    for (dtype, d, seed) in
        [(DType::BF16, 32, 1), (DType::F16, 64, 2), (DType::BF16, 96, 3), (DType::BF16, 128, 4), (DType::F16, 256, 5)]
    {
        check_step(&dev, dtype, params(3, 8, 2, d, 300), &[1, 77, 300], seed);
    }
    // GPT small at batch 1: 12 heads over a long cache (many splits), and a short one.
    check_step(&dev, DType::BF16, params(1, 12, 12, 64, 1024), &[900], 10);
    check_step(&dev, DType::BF16, params(1, 12, 12, 64, 1024), &[129], 11);
    // MQA, a sequence of length 0 next to a full one, a batch of 32.
    check_step(&dev, DType::F16, params(2, 4, 1, 128, 40), &[0, 40], 12);
    let lens: Vec<usize> = (0..32).map(|j| 1 + j * 29 % 128).collect();
    check_step(&dev, DType::BF16, params(32, 4, 4, 64, 128), &lens, 13);
    // Sliding windows (Gemma 3's local layers: MQA, d 256): a window shorter than the cache, one
    // longer than a sequence, and a window of a single key (left 0).
    let window = |p: AttentionShape, left| p.with_sliding_window(Some((left, 0)));
    check_step(&dev, DType::BF16, window(params(3, 4, 1, 256, 1024), 511), &[1000, 300, 512], 14);
    check_step(&dev, DType::F16, window(params(1, 8, 2, 128, 2048), 100), &[1777], 15);
    check_step(&dev, DType::BF16, window(params(2, 4, 2, 64, 64), 0), &[64, 9], 16);
    // Query heads per KV head that a block serves (DecodeAttnSpec::q_per_block_for): 3 with idle
    // lanes (d 96), and 7 (Qwen2's 14 over 2: one head a block).
    check_step(&dev, DType::BF16, params(2, 12, 4, 96, 200), &[200, 33], 17);
    check_step(&dev, DType::BF16, params(2, 14, 2, 64, 100), &[99, 1], 18);
}

#[test]
fn decode_refuses_bad_calls() {
    let Some(dev) = device() else { return };
    let p = params(2, 4, 2, 64, 16);
    let cache = Tensor::zeros(&dev, DType::BF16, &cache_shape(&p)).unwrap();
    let q = Tensor::zeros(&dev, DType::BF16, &[2, 4 * 64]).unwrap();
    let seqlens = dev.stream().clone_htod(&[1i32, 2]).unwrap();
    let mut out = Tensor::zeros(&dev, DType::BF16, &[2, 4 * 64]).unwrap();
    let run = |p: &AttentionShape, q: Strided<'_>, cache: &Tensor, out: &mut Tensor| {
        decode(&dev, p, q, [cache, cache], &seqlens, (out, 4 * 64))
    };
    let q_at = |offset, row| Strided { tensor: &q, offset, row };
    run(&p, q_at(0, 256), &cache, &mut out).unwrap();
    let shape = |r: Result<(), Error>| matches!(r, Err(Error::Shape { .. }));
    assert!(shape(run(&params(2, 4, 3, 64, 16), q_at(0, 256), &cache, &mut out)), "groups not dividing heads");
    assert!(shape(run(&params(2, 4, 2, 60, 16), q_at(0, 256), &cache, &mut out)), "head_dim not a multiple of 8");
    assert!(shape(run(&p, q_at(4, 256), &cache, &mut out)), "misaligned offset");
    assert!(shape(run(&p, q_at(8, 256), &cache, &mut out)), "q too small for its rows");
    let short = Tensor::zeros(&dev, DType::BF16, &[2, 8, 2, 64]).unwrap();
    assert!(shape(run(&p, q_at(0, 256), &short, &mut out)), "a cache of another shape");
    let f16 = Tensor::zeros(&dev, DType::F16, &cache_shape(&p)).unwrap();
    assert!(matches!(run(&p, q_at(0, 256), &f16, &mut out), Err(Error::DType { .. })));
    let e = run(&AttentionShape { sq: 2, ..p }, q_at(0, 256), &cache, &mut out).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("AttentionShape::decode"), "{e}");
    let one = dev.stream().clone_htod(&[1i32]).unwrap();
    let e = decode(&dev, &p, q_at(0, 256), [&cache, &cache], &one, (&mut out, 256)).unwrap_err();
    assert!(e.to_string().contains("lengths"), "{e}");
}
