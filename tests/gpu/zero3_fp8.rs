//! ZeRO-3's FP8 all-gather (torchao's float8 all-gather with FSDP): under current scaling the
//! layers' GEMM weights are gathered as E4M3 codes with the scale of the whole weight's amax
//! (`ParamShards::set_fp8_gather`, `DecoderLm::set_zero3_fp8_gather`), half the bytes of bf16.
//!
//! - `ParamShards`: the gathered codes and `scale_inv` are the quantizer's cast of the whole
//!   weight bit for bit, also for a weight a rank owns none of and with the amax on the other
//!   rank; unmarked parameters stay bf16; off again, the gathers are bf16; the refusals.
//! - `DecoderLm`: a ZeRO-3 step under current scaling with the FP8 gather gives the losses and
//!   gradients of the bf16 gather and of the unsharded model bit for bit, and it did gather
//!   FP8; under delayed scaling it gathers bf16; a layer holding gathered codes refuses a
//!   high-precision GEMM with a configuration error.
//!
//! Each multi-GPU test re-runs this binary as its ranks (`multi_gpu::on_ranks`); skipped with
//! fewer than two GPUs or without NCCL, unless `TE_REQUIRE_MULTI_GPU=1`.

use crate::common::{device, randn};
use crate::multi_gpu::{on_ranks, Layout};
use crate::offload::batch;
use crate::recompute::grad_bits;
use std::sync::Arc;
use te_models::decoder::train::DecoderLm;
use te_models::decoder::DecoderConfig;
use te_nn::fp8::{
    DelayedScaling, Float8CurrentScaling, Float8CurrentScalingQuantizer, Float8Quantizer, Fp8Autocast, Quantizer,
    Recipe, ScalingRecipe,
};
use te_nn::modules::{Linear, LinearConfig, Param, ParamKind, Recompute};
use te_nn::parallel::{Gathered, GradShards, ParamShards, Shard};
use te_nn::Module;
use te_runtime::{DType, Device, Error, Tensor};
use te_train::optim::AdamW;

/// A Llama (GQA) of 3 layers of hidden 128: every GEMM weight's dims are multiples of 16, and
/// fc1 (98 304 elements) is split between the two ranks' pieces.
fn config() -> DecoderConfig {
    let json = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
        "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": false}"#;
    DecoderConfig::from_hf_json(json).unwrap()
}

/// On two ranks: a weight split unevenly whose amax lies in rank 1's piece, a weight whole on
/// rank 1 (rank 0 owns none of it) and a norm weight whole on rank 0 (unmarked). With the FP8
/// gather on, the two weights arrive as the codes and `scale_inv` of the quantizer's cast of
/// the whole weight, bit for bit, and the norm weight as bf16; off, everything is bf16.
#[test]
fn param_shards_fp8_gather_casts_the_whole_weight() {
    let test = "zero3_fp8::param_shards_fp8_gather_casts_the_whole_weight";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        let s = |root, range| Shard { root, range };
        let owners = vec![vec![s(0, 0..700), s(1, 700..1536)], vec![s(1, 0..1024)], vec![s(0, 0..64)]];
        let shards = GradShards::new(2, owners).unwrap();
        let shapes: [&[usize]; 3] = [&[32, 48], &[16, 64], &[64]];
        let mut first = randn(1, 1536, 0.5);
        first[1200] = 9.5; // the amax, in rank 1's piece
        let values = [first, randn(2, 1024, 0.02), randn(3, 64, 1.0)];
        let whole: Vec<Tensor> =
            (0..3).map(|i| Tensor::from_f32(dev, DType::BF16, shapes[i], &values[i]).unwrap()).collect();
        let mut store = ParamShards::new(group.clone(), shards, 2).unwrap();
        let params: Vec<(usize, Tensor)> = whole.iter().cloned().enumerate().collect();
        let e = store.add_group_fp8(&params, &[true, true, true]).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("2-D"), "{e}");
        store.add_group_fp8(&params, &[true, true, false]).unwrap();
        let recipe = Float8CurrentScaling::default();
        let q = Float8CurrentScalingQuantizer::new(dev, DType::E4M3, recipe).unwrap();
        let quantizer = || recipe.sharded_weight_quantizer(dev).unwrap().expect("current scaling gathers FP8");
        store.set_fp8_gather(Some(quantizer())).unwrap();
        assert!(store.fp8_gather());
        let got = store.gather(0).unwrap();
        for (i, g) in got.iter().enumerate() {
            match (i, g) {
                (0 | 1, Gathered::Fp8(f)) => {
                    let want = q.quantize(&whole[i], false, None).unwrap();
                    assert_eq!(
                        f.data().to_bytes(dev).unwrap(),
                        want.data().to_bytes(dev).unwrap(),
                        "rank {} {i}",
                        env.rank
                    );
                    let (a, b) = (f.scale_inv_host(dev).unwrap(), want.scale_inv_host(dev).unwrap());
                    assert_eq!(a.to_bits(), b.to_bits(), "rank {} {i}: scale_inv", env.rank);
                    assert!(f.transpose().is_none(), "the transpose is the layer's to make");
                }
                (2, Gathered::High(t)) => assert_eq!(t.to_bytes(dev).unwrap(), whole[2].to_bytes(dev).unwrap()),
                (i, g) => panic!("rank {}: parameter {i} gathered as {g:?}", env.rank),
            }
        }
        assert_eq!(store.held(0).map(|v| v.len()), Some(3), "the slot holds the group");
        store.release(0);
        assert!(store.held(0).is_none(), "released");
        // Off again: bf16, the values themselves.
        store.set_fp8_gather(None).unwrap();
        let got = store.gather(0).unwrap();
        for (g, w) in got.iter().zip(&whole) {
            assert!(matches!(g, Gathered::High(_)), "rank {}: bf16 with the gather off", env.rank);
            assert_eq!(g.data().to_bytes(dev).unwrap(), w.to_bytes(dev).unwrap());
        }
        store.release(0);
        // A quantizer whose scale is not the tensor's amax is refused.
        let given: Box<dyn Quantizer> = Box::new(Float8Quantizer::new(dev, DType::E4M3, 1.0).unwrap());
        let e = store.set_fp8_gather(Some(given)).unwrap_err();
        assert!(matches!(e, Error::Argument { .. }) && e.to_string().contains("amax"), "{e}");
        assert!(!store.fp8_gather());
        group.barrier().unwrap();
    });
}

/// One forward and backward of `m` on two micro-batches' worth of tokens under `recipe`: the
/// loss bits and the gradients' bits.
fn step(dev: &Arc<Device>, m: &mut DecoderLm, recipe: Recipe) -> (u32, Vec<(String, Vec<u32>)>) {
    let (ids, targets) = batch(dev, 64, 2);
    m.zero_grad();
    let (loss, ctx) = Fp8Autocast::new(recipe).run(|| m.forward_loss(&ids, &targets)).unwrap();
    m.backward(ctx).unwrap();
    (loss.to_bits(), grad_bits(dev, m))
}

/// A ZeRO-3 step under current scaling gathers the GEMM weights as FP8 codes and gives the
/// losses and gradients of the bf16 gather and of the unsharded model bit for bit (the codes
/// are the layer's own cast of the whole weight); under delayed scaling it gathers bf16.
#[test]
fn zero_3_fp8_gather_equals_the_bf16_gather_bit_for_bit() {
    let test = "zero3_fp8::zero_3_fp8_gather_equals_the_bf16_gather_bit_for_bit";
    on_ranks(test, 2, Layout::OneNode, |env, dev, pg| {
        let group = Arc::new(pg);
        let current: Recipe = Float8CurrentScaling::default().into();
        let mut whole = DecoderLm::new(dev, config(), DType::BF16).unwrap();
        whole.set_recompute(Recompute::Full).unwrap();
        let want = step(dev, &mut whole, current);
        let mut m = DecoderLm::new(dev, config(), DType::BF16).unwrap();
        m.set_recompute(Recompute::Full).unwrap();
        m.set_zero3(group.clone(), AdamW::zero_shards(&m, 2).unwrap()).unwrap();
        let fp8 = step(dev, &mut m, current);
        assert!(m.zero3_gathers_fp8(), "rank {}: current scaling gathers FP8 codes", env.rank);
        m.set_zero3_fp8_gather(false);
        let bf16 = step(dev, &mut m, current);
        assert!(!m.zero3_gathers_fp8(), "rank {}: the gather turned off", env.rank);
        let what = format!("rank {}", env.rank);
        assert_eq!(fp8.0, bf16.0, "{what}: the loss, FP8 against bf16 gather");
        assert_eq!(fp8.0, want.0, "{what}: the loss, FP8 gather against the unsharded model");
        assert_eq!(fp8.1.len(), want.1.len(), "{what}");
        for ((pf, gf), ((pb, gb), (pw, gw))) in fp8.1.iter().zip(bf16.1.iter().zip(&want.1)) {
            assert_eq!((pf, pf), (pb, pw));
            assert!(gf == gb, "{what}: {pf}: the gradient, FP8 against bf16 gather");
            assert!(gf == gw, "{what}: {pf}: the gradient, FP8 gather against the unsharded model");
        }
        m.set_zero3_fp8_gather(true);
        let delayed: Recipe = DelayedScaling::default().into();
        step(dev, &mut m, delayed);
        assert!(!m.zero3_gathers_fp8(), "rank {}: delayed scaling gathers bf16", env.rank);
        m.zero3_unshard().unwrap();
        group.barrier().unwrap();
    });
}

/// A layer holding a weight gathered as FP8 codes runs its FP8 GEMM from them (the output of
/// the layer's own cast of the weight, bit for bit) and refuses a high-precision forward with
/// a configuration error; a high-precision weight handed in again runs in bf16.
#[test]
fn a_gathered_fp8_weight_serves_fp8_gemms_only() {
    let Some(dev) = device() else { return };
    let mut lin = Linear::new(&dev, LinearConfig::new(64, 48)).unwrap();
    let w = lin.params().weight().unwrap().clone();
    let x = Tensor::from_f32(&dev, DType::BF16, &[32, 64], &randn(9, 32 * 64, 1.0)).unwrap();
    let current: Recipe = Float8CurrentScaling::default().into();
    let (want, _) = Fp8Autocast::new(current).run(|| lin.forward(&x)).unwrap();
    let q = Float8CurrentScalingQuantizer::new(&dev, DType::E4M3, Float8CurrentScaling::default()).unwrap();
    let codes = q.quantize(&w, false, None).unwrap();
    let e = lin.params_mut().set_gathered_fp8_weight(q.quantize(&x, false, None).unwrap()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    lin.params_mut().set_gathered_fp8_weight(codes).unwrap();
    assert!(lin.params().weight().is_none() && lin.params().gathered_fp8_weight().is_some());
    let mut shape = Vec::new();
    lin.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> te_runtime::Result<()> {
        shape.push((p.shape().to_vec(), p.dtype()));
        Ok(())
    })
    .unwrap();
    assert_eq!(shape[0], (vec![48, 64], DType::BF16), "a gathered weight keeps its place, shape and dtype");
    let (got, _) = Fp8Autocast::new(current).run(|| lin.forward(&x)).unwrap();
    assert_eq!(got.to_bytes(&dev).unwrap(), want.to_bytes(&dev).unwrap(), "the FP8 GEMM from the gathered codes");
    let e = lin.forward(&x).unwrap_err();
    assert!(matches!(e, Error::Config { .. }) && e.to_string().contains("gathered as FP8"), "{e}");
    lin.params_mut().set_weight(w).unwrap();
    lin.forward(&x).unwrap();
}
