//! Family 20 on the GPU: the fused attention input of a step (`ops::qkv_rope`) against the CPU
//! reference: bf16, f16 and f32, head dims 64, 128 and 256 (f32: up to 128), MHA, GQA and MQA,
//! with and without qk-norm (γ and 1 + γ), packed prompts of different lengths at their own
//! positions and cache rows (the prefill) and one token per sequence at scattered positions (the
//! decode), more head rows than the grid; cache rows not written stay untouched; typed errors.
//!
//! Tolerance: as `rope` (the kernel's `sincosf` vs the host's `sin_cos`, ≤ 2 ulps; the norm's
//! sum of squares in another order): one ulp of the dtype plus 1e-5 absolute, with angles up to
//! ~4000 rad (position 4000 × inv_freq 1) where an ulp of the angle is 2.4e-4 rad: atol 1e-3
//! there. v is a copy: bit for bit.

use crate::common::{assert_close, device, randn};
use te_reference::qkv_rope::qkv_rope as reference;
use te_runtime::numerics::round_to;
use te_runtime::ops::qkv_rope::{qkv_rope, QkNorm, TokenRows};
use te_runtime::{DType, Device, Error, Tensor};

struct Case {
    dtype: DType,
    heads: usize,
    groups: usize,
    d: usize,
    norm: Option<bool>,
    positions: Vec<i32>,
    rows: Vec<i32>,
    cache_rows: usize,
}

fn inv_freq(d: usize, theta: f32) -> Vec<f32> {
    (0..d / 2).map(|i| theta.powf(-2.0 * i as f32 / d as f32)).collect()
}

fn run(dev: &Device, c: &Case, seed: u64) {
    let (h, g, d, dt) = (c.heads, c.groups, c.d, c.dtype);
    let tokens = c.positions.len();
    let vals = |seed, n, std| -> Vec<f32> { randn(seed, n, std).into_iter().map(|x| round_to(dt, x)).collect() };
    let qkv = vals(seed, tokens * (h + 2 * g) * d, 2.0);
    let (qg, kg) = (vals(seed + 1, d, 0.3), vals(seed + 2, d, 0.3));
    let freq = inv_freq(d, 10_000.0);
    let mut k_host = vals(seed + 3, c.cache_rows * g * d, 1.0);
    let mut v_host = vals(seed + 4, c.cache_rows * g * d, 1.0);
    let (k0, v0) = (k_host.clone(), v_host.clone());
    let norm_ref = c.norm.map(|zc| (&qg[..], &kg[..], 1e-6, zc));
    let want_q = reference(&qkv, (h, g, d), norm_ref, &freq, &c.positions, &c.rows, dt, [&mut k_host, &mut v_host]);

    let qkv_t = Tensor::from_f32(dev, dt, &[tokens, (h + 2 * g) * d], &qkv).unwrap();
    let (qg_t, kg_t) = (Tensor::from_f32(dev, dt, &[d], &qg).unwrap(), Tensor::from_f32(dev, dt, &[d], &kg).unwrap());
    let freq_t = Tensor::from_f32(dev, DType::F32, &[d / 2], &freq).unwrap();
    let rows = TokenRows::from_host(dev, &c.positions, &c.rows, c.cache_rows).unwrap();
    let mut q = Tensor::zeros(dev, dt, &[tokens, h, d]).unwrap();
    let mut k = Tensor::from_f32(dev, dt, &[c.cache_rows, g, d], &k0).unwrap();
    let mut v = Tensor::from_f32(dev, dt, &[c.cache_rows, g, d], &v0).unwrap();
    let norm = c.norm.map(|zc| QkNorm { q_gamma: &qg_t, k_gamma: &kg_t, eps: 1e-6, zero_centered_gamma: zc });
    qkv_rope(dev, &qkv_t, (h, g, d), norm, &freq_t, &rows, &mut q, [&mut k, &mut v]).unwrap();

    let what = format!("{dt} h{h}/g{g} d{d} norm {:?} tokens {tokens}", c.norm);
    let rtol = match dt {
        DType::BF16 => 2f32.powi(-7),
        DType::F16 => 2f32.powi(-10),
        _ => 1e-6,
    };
    // With the norm, the kernel and the host may round the normalized value (a bf16 of magnitude
    // ≲ 1) to neighbouring values when their rsqrt differ by an ulp; RoPE's cancellation then
    // leaves that ulp as an absolute error: atol one ulp at magnitude 1.
    let atol = match (c.norm, c.positions.iter().any(|&p| p > 100)) {
        (Some(_), _) => rtol.max(1e-3),
        (None, true) => 1e-3,
        (None, false) => 2e-5,
    };
    assert_close(&format!("{what}: q"), &q.to_f32(dev).unwrap(), &want_q, rtol, atol);
    assert_close(&format!("{what}: k cache"), &k.to_f32(dev).unwrap(), &k_host, rtol, atol);
    assert_eq!(v.to_f32(dev).unwrap(), v_host, "{what}: v copied into its rows, the rest untouched");
}

/// Packed prompts of `lens` tokens: sequence `j`'s token `i` at position `i`, cache row `j ·
/// capacity + i`.
fn prefill(lens: &[usize], capacity: usize) -> (Vec<i32>, Vec<i32>) {
    let mut pos = Vec::new();
    let mut rows = Vec::new();
    for (j, &len) in lens.iter().enumerate() {
        for i in 0..len {
            pos.push(i as i32);
            rows.push((j * capacity + i) as i32);
        }
    }
    (pos, rows)
}

#[test]
fn qkv_rope_matches_the_reference() {
    let Some(dev) = device() else { return };
    let mut seed = 1;
    for (dtype, d) in [(DType::BF16, 256), (DType::BF16, 128), (DType::F16, 64), (DType::F32, 128), (DType::BF16, 96)] {
        for (heads, groups) in [(4, 1), (8, 2), (6, 6)] {
            for norm in [None, Some(false), Some(true)] {
                let (positions, rows) = prefill(&[7, 1, 30], 40);
                run(&dev, &Case { dtype, heads, groups, d, norm, positions, rows, cache_rows: 120 }, seed);
                seed += 10;
            }
        }
    }
    // Decode: one token per sequence at scattered positions, far along.
    let positions = vec![4000, 17, 511, 0];
    let rows: Vec<i32> = positions.iter().enumerate().map(|(j, &p)| (j * 4096) as i32 + p).collect();
    let case = Case {
        dtype: DType::BF16,
        heads: 4,
        groups: 1,
        d: 256,
        norm: Some(true),
        positions,
        rows,
        cache_rows: 4 * 4096,
    };
    run(&dev, &case, 99);
    // More head rows than the grid holds at once (grid-stride).
    let (positions, rows) = prefill(&[3000, 2100], 3000);
    run(
        &dev,
        &Case { dtype: DType::BF16, heads: 16, groups: 8, d: 128, norm: None, positions, rows, cache_rows: 6000 },
        7,
    );
}

#[test]
fn qkv_rope_refuses_bad_calls() {
    let Some(dev) = device() else { return };
    let e = TokenRows::from_host(&dev, &[0, 1], &[0, 5], 5).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("outside the cache's 5 rows"), "{e}");
    assert!(TokenRows::from_host(&dev, &[-1], &[0], 5).unwrap_err().to_string().contains("negative position"));
    assert!(TokenRows::from_host(&dev, &[], &[], 5).unwrap_err().to_string().contains("at least one"));
    let rows = TokenRows::from_host(&dev, &[0, 1], &[0, 1], 4).unwrap();
    let qkv = Tensor::zeros(&dev, DType::BF16, &[2, 6 * 64]).unwrap();
    let freq = Tensor::zeros(&dev, DType::F32, &[32]).unwrap();
    let mut q = Tensor::zeros(&dev, DType::BF16, &[2, 4, 64]).unwrap();
    let mut k = Tensor::zeros(&dev, DType::BF16, &[4, 1, 64]).unwrap();
    let mut v = Tensor::zeros(&dev, DType::BF16, &[4, 1, 64]).unwrap();
    qkv_rope(&dev, &qkv, (4, 1, 64), None, &freq, &rows, &mut q, [&mut k, &mut v]).unwrap();
    let e = qkv_rope(&dev, &qkv, (4, 3, 64), None, &freq, &rows, &mut q, [&mut k, &mut v]).unwrap_err();
    assert!(e.to_string().contains("divide"), "{e}");
    let mut small = Tensor::zeros(&dev, DType::BF16, &[3, 1, 64]).unwrap();
    let e = qkv_rope(&dev, &qkv, (4, 1, 64), None, &freq, &rows, &mut q, [&mut small, &mut v]).unwrap_err();
    assert!(e.to_string().contains("at least 4 rows"), "{e}");
    let f16 = Tensor::zeros(&dev, DType::F16, &[4, 1, 64]).unwrap();
    let e = qkv_rope(&dev, &qkv, (4, 1, 64), None, &freq, &rows, &mut q, [&mut k, &mut f16.clone()]).unwrap_err();
    assert!(matches!(e, Error::DType { .. }), "{e}");
    let qkv72 = Tensor::zeros(&dev, DType::BF16, &[2, 6 * 72]).unwrap();
    let mut q72 = Tensor::zeros(&dev, DType::BF16, &[2, 4, 72]).unwrap();
    let freq36 = Tensor::zeros(&dev, DType::F32, &[36]).unwrap();
    let e = qkv_rope(&dev, &qkv72, (4, 1, 72), None, &freq36, &rows, &mut q72, [&mut k, &mut v]).unwrap_err();
    assert!(e.to_string().contains("multiple of 16"), "{e}");
}

/// An E4M3 cache (`qkv_rope_fp8`): the keys are the 16-bit kernel's rotated keys stored as
/// `E4M3(k · k_scale)`, the values `E4M3(v · v_scale)`; rows not written stay as they were.
/// Values: bit for bit (the same f32 product and round-to-nearest-even cast as the host). Keys:
/// bit for bit where the rotated bf16 key equals the reference's, and within one E4M3 step
/// where they differ by the bf16 ulp the q and k tolerance allows above.
#[test]
fn qkv_rope_appends_e4m3_codes_with_their_scales() {
    use te_runtime::graph::HostCopies;
    use te_runtime::numerics::{dequantize, quantize};
    use te_runtime::ops::decode_attention::KvScales;
    use te_runtime::ops::qkv_rope::qkv_rope_fp8;
    let Some(dev) = device() else { return };
    let (dt, cache_rows) = (DType::BF16, 90);
    let (k_scale, v_scale) = (8.0f32, 3.0f32);
    for (h, g, d, norm, seed) in [(8, 2, 128, None, 5u64), (4, 1, 256, Some(true), 6), (6, 3, 64, Some(false), 7)] {
        let (positions, rows) = prefill(&[5, 1, 23], 30);
        let tokens = positions.len();
        let vals = |seed, n, std| -> Vec<f32> { randn(seed, n, std).into_iter().map(|x| round_to(dt, x)).collect() };
        let qkv = vals(seed, tokens * (h + 2 * g) * d, 2.0);
        let (qg, kg) = (vals(seed + 1, d, 0.3), vals(seed + 2, d, 0.3));
        let freq = inv_freq(d, 10_000.0);
        let (mut k_ref, mut v_ref) = (vec![0.0; cache_rows * g * d], vec![0.0; cache_rows * g * d]);
        let norm_ref = norm.map(|zc| (&qg[..], &kg[..], 1e-6, zc));
        let want_q = reference(&qkv, (h, g, d), norm_ref, &freq, &positions, &rows, dt, [&mut k_ref, &mut v_ref]);

        let qkv_t = Tensor::from_f32(&dev, dt, &[tokens, (h + 2 * g) * d], &qkv).unwrap();
        let (qg_t, kg_t) =
            (Tensor::from_f32(&dev, dt, &[d], &qg).unwrap(), Tensor::from_f32(&dev, dt, &[d], &kg).unwrap());
        let freq_t = Tensor::from_f32(&dev, DType::F32, &[d / 2], &freq).unwrap();
        let token_rows = TokenRows::from_host(&dev, &positions, &rows, cache_rows).unwrap();
        let mut q = Tensor::zeros(&dev, dt, &[tokens, h, d]).unwrap();
        let mut k = Tensor::zeros(&dev, DType::E4M3, &[cache_rows, g, d]).unwrap();
        let mut v = Tensor::zeros(&dev, DType::E4M3, &[cache_rows, g, d]).unwrap();
        let scales = dev.stream().htod(&KvScales::values(k_scale, v_scale).unwrap()).unwrap();
        let qn = norm.map(|zc| QkNorm { q_gamma: &qg_t, k_gamma: &kg_t, eps: 1e-6, zero_centered_gamma: zc });
        qkv_rope_fp8(&dev, &qkv_t, (h, g, d), qn, &freq_t, &token_rows, &mut q, [&mut k, &mut v], KvScales(&scales))
            .unwrap();
        let what = format!("e4m3 cache h{h}/g{g} d{d} norm {norm:?}");
        let atol = if norm.is_some() { 2f32.powi(-7).max(1e-3) } else { 2e-5 };
        assert_close(&format!("{what}: q"), &q.to_f32(&dev).unwrap(), &want_q, 2f32.powi(-7), atol);
        let (k_codes, v_codes) = (k.to_bytes(&dev).unwrap(), v.to_bytes(&dev).unwrap());
        let written: std::collections::HashSet<usize> = rows.iter().map(|&r| r as usize).collect();
        let (mut same, mut total) = (0, 0);
        for i in 0..cache_rows * g * d {
            if !written.contains(&(i / (g * d))) {
                assert_eq!((k_codes[i], v_codes[i]), (0, 0), "{what}: element {i} of a row not written changed");
                continue;
            }
            assert_eq!(v_codes[i], quantize(DType::E4M3, v_ref[i] * v_scale), "{what}: v element {i}");
            let want = quantize(DType::E4M3, k_ref[i] * k_scale);
            total += 1;
            if k_codes[i] == want {
                same += 1;
                continue;
            }
            let (got, want) = (dequantize(DType::E4M3, k_codes[i]), dequantize(DType::E4M3, want));
            assert!(
                (got - want).abs() <= 0.125 * want.abs().max(got.abs()) + 2f32.powi(-9),
                "{what}: k element {i}: code {got} vs {want}, more than one E4M3 step apart"
            );
        }
        assert!(same as f64 >= 0.99 * total as f64, "{what}: only {same} of {total} key codes equal the reference's");
        let e = qkv_rope(&dev, &qkv_t, (h, g, d), None, &freq_t, &token_rows, &mut q, [&mut k, &mut v]).unwrap_err();
        assert!(matches!(e, Error::DType { .. }), "{what}: a 16-bit call on an e4m3 cache: {e}");
        let two = dev.stream().htod(&[1.0f32, 1.0]).unwrap();
        let e =
            qkv_rope_fp8(&dev, &qkv_t, (h, g, d), None, &freq_t, &token_rows, &mut q, [&mut k, &mut v], KvScales(&two))
                .unwrap_err();
        assert!(e.to_string().contains("4 floats"), "{what}: {e}");
    }
}
