//! FP8 between the attention and the output projection (TE's `fp8_mha`): the FP8 attention
//! forward writes its output as E4M3 codes (`ops::flash_attention_fp8::forward_fp8_out`) that
//! equal a cast of its 16-bit output bit for bit (amax and scale_inv by TE's contract); the FP8
//! backward takes those codes for `rowsum(dO ⊙ O)` within a fraction of the FP8 error of the
//! 16-bit output's; and `MultiheadAttention` under a recipe with `fp8_mha` hands them to its
//! projection: the same output bits and projection gradients as `fp8_dpa` alone (the
//! projection's cast is the one the kernel fused), the other gradients within that fraction.

use crate::common::randn;
use crate::fp8_attention::{hopper, params, to_format};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Float8CurrentScaling, Recipe};
use te_nn::modules::{AttnMaskType, MultiheadAttention, MultiheadAttentionConfig, QkvFormat};
use te_runtime::numerics::round_to;
use te_runtime::ops::flash_attention::{FlashAttnParams, Qkv};
use te_runtime::ops::flash_attention_fp8::{self as fp8, Fp8BwdScaleInv, Fp8Grad, Fp8Operand, Fp8Operands};
use te_runtime::ops::Fp8Meta;
use te_runtime::{DType, Device, Error, Tensor};

/// Relative RMS bound between the kernels' gradients whose `delta = rowsum(dO ⊙ O)` read the
/// E4M3 output and those that read the 16-bit one. E4M3's ±6.25% per element averages over
/// `head_dim` products in delta, but `dS = P ⊙ (dP − delta)` subtracts numbers of about delta's
/// size, which amplifies its error: measured 3.2% on dq (H100), as TE's FP8 backward, which reads
/// the FP8 output too.
const DELTA_RMS_TOL: f64 = 0.06;
/// The same for `MultiheadAttention`'s dx and QKV weight gradient against `fp8_dpa` alone (the
/// projections' dgrad and wgrad average it further): measured 1.5%.
const MHA_RMS_TOL: f64 = 0.03;

fn rel_rms(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    assert!(got.iter().all(|g| g.is_finite()), "non-finite values");
    let err: f64 = got.iter().zip(want).map(|(&g, &w)| (f64::from(g) - f64::from(w)).powi(2)).sum();
    let norm: f64 = want.iter().map(|&w| f64::from(w).powi(2)).sum();
    (err / norm.max(1e-30)).sqrt()
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, &v| a.max(v.abs()))
}

/// bf16 q, k, v of `p` in `format` (host values bshd), cast to the FP8 operands (with the
/// backward's codes) with the scales of their amax; the operands and the metas.
fn operands(dev: &Device, p: &FlashAttnParams, format: QkvFormat, seed: u64) -> (Fp8Operands, [Fp8Meta; 3]) {
    let (b, d) = (p.shape.batch, p.shape.head_dim);
    let mut ops = Fp8Operands::with_backward(dev, p).unwrap();
    let shapes = [
        (Fp8Operand::Q, p.shape.sq, p.shape.heads, 1.0),
        (Fp8Operand::K, p.shape.sk, p.shape.groups, 2.0),
        (Fp8Operand::V, p.shape.sk, p.shape.groups, 0.5),
    ];
    let metas = shapes.map(|(which, s, h, std)| {
        let host: Vec<f32> =
            randn(seed + which as u64, b * s * h * d, std).into_iter().map(|x| round_to(DType::BF16, x)).collect();
        let t = Tensor::from_f32(dev, DType::BF16, &format.shape(b, s, h, d), &to_format(&host, format, b, s, h, d))
            .unwrap();
        let mut meta = Fp8Meta::new(dev, 448.0 / amax(&host)).unwrap();
        fp8::quantize(dev, p, which, (&t, 0), &mut meta.scaling(), &mut ops).unwrap();
        meta
    });
    (ops, metas)
}

#[test]
fn fp8_output_is_the_cast_of_the_16_bit_output() {
    let Some(dev) = hopper() else { return };
    let (batch, heads, groups) = (2, 4, 2);
    for (sq, sk, mask, d, format, seed) in [
        (200, 333, AttnMaskType::NoMask, 128, QkvFormat::Bshd, 500),
        (333, 333, AttnMaskType::Causal, 128, QkvFormat::Sbhd, 510),
        (77, 300, AttnMaskType::CausalBottomRight, 256, QkvFormat::Bshd, 520),
    ] {
        let what = format!("sq {sq} sk {sk} {} d {d} {format:?}", mask.name());
        let p = params((batch, sq, sk), (heads, groups, d), mask, format);
        let (ops, metas) = operands(&dev, &p, format, seed);
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        let mut out = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();
        let out16 = out.to_f32(&dev).unwrap();
        // A scale past 448 / amax: the largest outputs saturate, as TE's cast does.
        let scale = 1.5 * 448.0 / amax(&out16);
        let mut meta = Fp8Meta::new(&dev, scale).unwrap();
        let mut o8 = Tensor::empty(&dev, DType::E4M3, &[batch, sq, heads, d]).unwrap();
        let mut lse8 = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        fp8::forward_fp8_out(&dev, &p, &ops, si, None, (&mut o8, DType::BF16), &mut meta.scaling(), &mut lse8).unwrap();
        let want: Vec<f32> = out16.iter().map(|&v| round_to(DType::E4M3, v * scale)).collect();
        assert!(o8.to_f32(&dev).unwrap() == want, "{what}: E4M3 output = the cast of the 16-bit output");
        let (_, got_amax, scale_inv) = meta.read(&dev).unwrap();
        assert_eq!(got_amax, amax(&out16), "{what}: amax of the output");
        assert_eq!(scale_inv, 1.0 / scale, "{what}: scale_inv");
        let lse_of = |l| dev.stream().clone_dtoh(l).unwrap();
        assert!(lse_of(&lse8) == lse_of(&lse), "{what}: softmax_lse unchanged");

        // Typed errors: a 16-bit tensor where the codes go; the 16-bit entry point keeps its
        // dtype rule.
        let e = fp8::forward_fp8_out(&dev, &p, &ops, si, None, (&mut out, DType::BF16), &mut meta.scaling(), &mut lse8)
            .unwrap_err();
        assert!(matches!(e, Error::DType { .. }) && e.to_string().contains("e4m3"), "{e}");
        let e = fp8::forward(&dev, &p, &ops, si, None, &mut o8, &mut lse8).unwrap_err();
        assert!(e.to_string().contains("bf16 or f16"), "{e}");
    }
}

#[test]
fn fp8_backward_reads_the_e4m3_output() {
    let Some(dev) = hopper() else { return };
    let (batch, heads, groups, d) = (2, 4, 2, 128);
    for (sq, sk, mask, format, seed) in
        [(200, 333, AttnMaskType::NoMask, QkvFormat::Bshd, 600), (333, 333, AttnMaskType::Causal, QkvFormat::Sbhd, 610)]
    {
        let what = format!("sq {sq} sk {sk} {} {format:?}", mask.name());
        let p = params((batch, sq, sk), (heads, groups, d), mask, format);
        let (ops, metas) = operands(&dev, &p, format, seed);
        let si = [&metas[0].scale_inv, &metas[1].scale_inv, &metas[2].scale_inv];
        let mut out = Tensor::empty(&dev, DType::BF16, &[batch, sq, heads, d]).unwrap();
        let mut lse = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        fp8::forward(&dev, &p, &ops, si, None, &mut out, &mut lse).unwrap();
        let mut ometa = Fp8Meta::new(&dev, 448.0 / amax(&out.to_f32(&dev).unwrap())).unwrap();
        let mut o8 = Tensor::empty(&dev, DType::E4M3, &[batch, sq, heads, d]).unwrap();
        let mut lse8 = dev.stream().alloc_zeros::<f32>(batch * heads * sq).unwrap();
        fp8::forward_fp8_out(&dev, &p, &ops, si, None, (&mut o8, DType::BF16), &mut ometa.scaling(), &mut lse8)
            .unwrap();

        let hdo: Vec<f32> =
            randn(seed + 9, batch * sq * heads * d, 1e-3).into_iter().map(|x| round_to(DType::BF16, x)).collect();
        let d_out = Tensor::from_f32(&dev, DType::BF16, &[batch, sq, heads, d], &hdo).unwrap();
        let mut gmeta = Fp8Meta::new(&dev, 57344.0 / amax(&hdo)).unwrap();
        let mut g8 = Fp8Grad::new(&dev, &p, DType::E5M2).unwrap();
        fp8::quantize_grad(&dev, &p, &d_out, &mut gmeta.scaling(), &mut g8).unwrap();
        let run = |out: &Tensor, o: Option<&cudarc::driver::CudaSlice<f32>>| -> Vec<Vec<f32>> {
            let new = |s: usize, h: usize| Tensor::empty(&dev, DType::BF16, &format.shape(batch, s, h, d)).unwrap();
            let (mut dq, mut dk, mut dv) = (new(sq, heads), new(sk, groups), new(sk, groups));
            let mut ds = Fp8Meta::new(&dev, 1048576.0).unwrap();
            let scale_inv = Fp8BwdScaleInv { qkv: si, d_o: &gmeta.scale_inv, o };
            let grads = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
            fp8::backward(&dev, &p, (&ops, &g8), scale_inv, &mut ds.scaling(), (out, &d_out), &lse, None, grads)
                .unwrap();
            [&dq, &dk, &dv].iter().map(|t| t.to_f32(&dev).unwrap()).collect()
        };
        let want = run(&out, None);
        let got = run(&o8, Some(&ometa.scale_inv));
        for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
            let e = rel_rms(g, w);
            eprintln!("{what}: {name} from the E4M3 output, relative RMS {e:.4} against the 16-bit output's");
            assert!(e <= DELTA_RMS_TOL, "{what}: {name} relative RMS {e:.4}");
        }
        // dV does not read delta: the same bits.
        assert!(got[2] == want[2], "{what}: dv does not depend on the output");
        assert!(run(&o8, Some(&ometa.scale_inv)) == got, "{what}: deterministic");
        // E4M3 codes without their scale_inv are refused, as is a scale_inv beside 16-bit values.
        let new = |s: usize, h: usize| Tensor::empty(&dev, DType::BF16, &format.shape(batch, s, h, d)).unwrap();
        let (mut dq, mut dk, mut dv) = (new(sq, heads), new(sk, groups), new(sk, groups));
        let mut ds = Fp8Meta::new(&dev, 1.0).unwrap();
        let scale_inv = Fp8BwdScaleInv { qkv: si, d_o: &gmeta.scale_inv, o: Some(&ometa.scale_inv) };
        let grads = Qkv::Apart([&mut dq, &mut dk, &mut dv]);
        let e = fp8::backward(&dev, &p, (&ops, &g8), scale_inv, &mut ds.scaling(), (&out, &d_out), &lse, None, grads)
            .unwrap_err();
        assert!(matches!(e, Error::DType { .. }) && e.to_string().contains("e4m3"), "{e}");
    }
}

/// A causal sbhd `MultiheadAttention` of 4 heads of 128 with the input norm and biases.
fn mha(dev: &std::sync::Arc<Device>) -> MultiheadAttention {
    let cfg = MultiheadAttentionConfig {
        input_layernorm: true,
        attn_mask_type: AttnMaskType::Causal,
        qkv_format: QkvFormat::Sbhd,
        bias: true,
        params_dtype: DType::BF16,
        seed: 77,
        ..MultiheadAttentionConfig::new(512, 4)
    };
    MultiheadAttention::new(dev, cfg).unwrap()
}

/// One training step of `m` under `recipe`: the output, whether the attention wrote it in E4M3,
/// dx, and the projections' weight gradients (QKV, proj).
fn mha_step(dev: &Device, m: &mut MultiheadAttention, x: &Tensor, dy: &Tensor, recipe: Recipe) -> [Vec<f32>; 4] {
    m.qkv_params_mut().zero_grad();
    m.proj_params_mut().zero_grad();
    let (y, ctx) = fp8_autocast(true, recipe, || m.forward(x)).unwrap();
    assert!(ctx.attention().unwrap().fp8(), "the attention ran in FP8");
    let fp8_out = ctx.attention().unwrap().fp8_output();
    let dx = m.backward(ctx, dy).unwrap();
    let host = |t: Option<&Tensor>| t.unwrap().to_f32(dev).unwrap();
    let flag = vec![f32::from(u8::from(fp8_out))];
    let (wq, wp) = (host(m.qkv_params().weight_grad()), host(m.proj_params().weight_grad()));
    [[y.to_f32(dev).unwrap(), flag].concat(), dx.to_f32(dev).unwrap(), wq, wp]
}

#[test]
fn multihead_attention_hands_the_e4m3_output_to_its_projection() {
    let Some(dev) = hopper() else { return };
    let (s, b, hidden) = (192, 2, 512);
    let up = |seed, std| {
        let v: Vec<f32> = randn(seed, s * b * hidden, std).into_iter().map(|x| round_to(DType::BF16, x)).collect();
        Tensor::from_f32(&dev, DType::BF16, &[s, b, hidden], &v).unwrap()
    };
    let (x, dy) = (up(700, 1.0), up(701, 1e-2));
    let delayed = DelayedScaling { amax_history_len: 4, ..Default::default() };
    let dpa = Recipe::from(DelayedScaling { fp8_dpa: true, ..delayed });
    let mha_recipe = Recipe::from(DelayedScaling { fp8_mha: true, ..delayed });
    let (mut a, mut m) = (mha(&dev), mha(&dev));
    // Step 1 starts from fresh scales; step 2 runs on the amaxes step 1 recorded.
    for step in 1..=2 {
        let want = mha_step(&dev, &mut a, &x, &dy, dpa);
        let got = mha_step(&dev, &mut m, &x, &dy, mha_recipe);
        let flag = |v: &[f32]| v[v.len() - 1];
        assert_eq!((flag(&want[0]), flag(&got[0])), (0.0, 1.0), "step {step}: only fp8_mha writes E4M3");
        assert!(
            got[0] == want[0][..want[0].len() - 1].iter().chain([&1.0]).copied().collect::<Vec<_>>(),
            "step {step}: the output bits of fp8_dpa"
        );
        assert!(got[3] == want[3], "step {step}: the projection's weight gradient bits of fp8_dpa");
        for (name, i) in [("dx", 1), ("qkv wgrad", 2)] {
            let e = rel_rms(&got[i], &want[i]);
            eprintln!("step {step}: MultiheadAttention {name} under fp8_mha, relative RMS {e:.4} against fp8_dpa");
            assert!(e <= MHA_RMS_TOL, "step {step}: {name} relative RMS {e:.4}");
        }
    }
    // Inference: the same output bits as fp8_dpa.
    let infer = |m: &mut MultiheadAttention, r| {
        fp8_autocast(true, r, || m.infer_with(&x, Default::default())).unwrap().to_f32(&dev).unwrap()
    };
    assert!(infer(&mut m, mha_recipe) == infer(&mut a, dpa), "inference output bits of fp8_dpa");
    // Current scaling cannot fuse the output cast: 16-bit output, the bits of fp8_dpa (fresh
    // modules: the delayed steps above left dS histories that differ by their delta).
    let (mut a, mut m) = (mha(&dev), mha(&dev));
    let current = Float8CurrentScaling::default();
    let (cur_dpa, cur_mha) = (
        Recipe::from(Float8CurrentScaling { fp8_dpa: true, ..current }),
        Recipe::from(Float8CurrentScaling { fp8_mha: true, ..current }),
    );
    let want = mha_step(&dev, &mut a, &x, &dy, cur_dpa);
    let got = mha_step(&dev, &mut m, &x, &dy, cur_mha);
    assert!(got == want, "current scaling: fp8_mha runs as fp8_dpa, bit for bit");
}
