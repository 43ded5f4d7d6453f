//! One fine-tuning step of Gemma 3 270M (`te_models::decoder::train::DecoderLm`; the real GGUF
//! when `TE_GEMMA_GGUF` names it, else its architecture with random weights: the speed does not
//! depend on them) as `te train --model` runs it: `forward_loss_with`, `backward`, `AdamW::step`
//! and `zero_grad`, batch 8 × seq 1024, in BF16 and in FP8 (DelayedScaling; and with the LM head
//! in FP8 too), and in BF16 over the same tokens as 8 packed documents (`thd`), each phase timed
//! with CUDA events; then the tied LM head and the cross-entropy alone (`Linear` over the
//! embedding's table, forward, the fused loss and its gradient, backward), the part of the step
//! the 262 144-token vocabulary costs. `benches/anchors/finetune.py` times transformers' step.
//!
//! FLOPs: forward `2·tokens·(layers·(h·qkv + attn·h + h·fc1 + ffn·h) + h·vocab)` for the GEMMs
//! plus the attention's (causal, or its window), backward twice that.

use crate::gpt::StepRows;
use crate::harness::{Bench, PhaseStats};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_models::decoder::train::{DecoderLm, DecoderLmCtx, Packing};
use te_models::gpt::{MicroBatch, IGNORE_INDEX};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Recipe};
use te_nn::modules::{Linear, LinearConfig, TokenIds};
use te_nn::Module;
use te_runtime::ops::cross_entropy::{cross_entropy, CrossEntropyGrad};
use te_runtime::{DType, Tensor};
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

const BATCH: usize = 8;
const SEQ: usize = 1024;

pub fn run(b: &mut Bench) {
    let work = "gemma3 270m train";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let (w, source) = crate::decoder::weights();
    let cfg = w.config().clone();
    println!("{work}: {source}");
    let mut model = DecoderLm::from_weights(&dev, &w, DType::BF16).unwrap();
    drop(w);
    let params = model.num_parameters() as u64;
    let opt_cfg = AdamWConfig { max_grad_norm: Some(1.0), ..AdamWConfig::new(LrSchedule::Constant(2e-5)) };
    let mut opt = AdamW::new(&dev, &model, opt_cfg).unwrap();
    let (h, v, tokens) = (cfg.hidden_size, cfg.vocab_size, SEQ * BATCH);
    let mut rng = StdRng::seed_from_u64(7);
    let ids: Vec<i32> = (0..tokens + BATCH).map(|_| rng.random_range(0..v as i32)).collect();
    let ids_t = TokenIds::from_host(&dev, &[SEQ, BATCH], &ids[..tokens]).unwrap();
    let targets = TokenIds::from_host(&dev, &[SEQ, BATCH], &ids[BATCH..]).unwrap();
    let per_layer = h * cfg.qkv_size() + cfg.attention_size() * h + h * cfg.fc1_size() + cfg.ffn_hidden_size * h;
    let head = (2 * tokens * h * v) as u64;
    let gemm = (2 * tokens * cfg.num_layers * per_layer) as u64 + head;
    let attention: u64 = (0..cfg.num_layers)
        .map(|l| {
            // Keys a query sees: causal, or the window.
            let seen = match cfg.layer_window(l) {
                Some((left, _)) => (0..SEQ).map(|i| i.min(left as usize) + 1).sum::<usize>(),
                None => SEQ * (SEQ + 1) / 2,
            };
            (4 * BATCH * cfg.num_attention_heads * seen * cfg.head_dim) as u64
        })
        .sum();
    let shape = format!("b{BATCH} s{SEQ}");
    // The same tokens as packed documents (TE's thd): each column a document of SEQ tokens.
    let col_major: Vec<i32> = (0..tokens).map(|t| ids[(t % SEQ) * BATCH + t / SEQ]).collect();
    let col_targets: Vec<i32> = (0..tokens)
        .map(|t| if t % SEQ + 1 < SEQ { ids[(t % SEQ + 1) * BATCH + t / SEQ] } else { IGNORE_INDEX })
        .collect();
    let thd_ids = TokenIds::from_host(&dev, &[tokens, 1], &col_major).unwrap();
    let thd_targets = TokenIds::from_host(&dev, &[tokens, 1], &col_targets).unwrap();
    let positions: Vec<usize> = (0..tokens).map(|t| t % SEQ).collect();
    let cu: Vec<usize> = (0..=BATCH).map(|b| b * SEQ).collect();
    let st = time_step(b, &mut model, &mut opt, |model| {
        let packing = Packing { position_ids: &positions, cu_seqlens: &cu, cu_seqlens_padded: None };
        model.forward_loss_thd(&thd_ids, &thd_targets, packing, MicroBatch::default()).unwrap().1
    });
    let step = StepRows { work, shape: &shape, variant: "ours bf16 thd", fp8: false, tokens, params };
    step.record(b, &st, gemm + attention, 0);
    let delayed: Option<Recipe> = Some(DelayedScaling::default().into());
    let variants =
        [("ours bf16", None, false), ("ours fp8 delayed", delayed, false), ("ours fp8 + fp8 lm head", delayed, true)];
    for (variant, recipe, fp8_head) in variants {
        let fp8 = recipe.is_some();
        model.set_fp8_lm_head(fp8_head);
        let st = time_step(b, &mut model, &mut opt, |model| {
            let mb = MicroBatch::default();
            match recipe {
                Some(r) => fp8_autocast(true, r, || model.forward_loss_with(&ids_t, &targets, mb)),
                None => model.forward_loss_with(&ids_t, &targets, mb),
            }
            .unwrap()
            .1
        });
        // The head stays BF16 under FP8 (TE's and Megatron's default) unless fp8 lm head.
        let fp8_flops = match (fp8, fp8_head) {
            (false, _) => 0,
            (true, false) => gemm - head,
            (true, true) => gemm,
        };
        let step = StepRows { work, shape: &shape, variant, fp8, tokens, params };
        step.record(b, &st, gemm + attention, fp8_flops);
    }
    drop((model, opt));
    // The tied head and the loss alone: a Linear over a [vocab, hidden] table.
    let lc = LinearConfig { bias: false, params_dtype: DType::BF16, ..LinearConfig::new(h, v) };
    let mut lm = Linear::new(&dev, lc).unwrap();
    let x = Tensor::zeros(&dev, DType::BF16, &[tokens, h]).unwrap();
    let st = b.time_phases(2, 8, 3, |m| {
        let (logits, ctx) = fp8_autocast(false, Recipe::default(), || lm.forward(&x)).unwrap();
        m.mark();
        let mut dlogits = Tensor::empty(&dev, DType::BF16, logits.shape()).unwrap();
        let mut loss = dev.stream().alloc_zeros::<f32>(tokens).unwrap();
        let grad = CrossEntropyGrad { dlogits: &mut dlogits, grad_scale: 1.0 / tokens as f32 };
        cross_entropy(&dev, &logits, targets.data(), IGNORE_INDEX, &mut loss, Some(grad)).unwrap();
        m.mark();
        lm.backward(ctx, &dlogits).unwrap();
        lm.zero_grad();
        m.mark();
    });
    for (i, pass) in ["lm head fwd GEMM", "cross-entropy + gradient", "lm head bwd GEMMs"].iter().enumerate() {
        b.record(&format!("{work} {pass}"), &shape, st.phases[i], None, None);
    }
}

/// The phases of a training step, `forward` giving the loss's context: forward, backward, and
/// the optimizer with `zero_grad`.
fn time_step(
    b: &Bench,
    model: &mut DecoderLm,
    opt: &mut AdamW,
    mut forward: impl FnMut(&mut DecoderLm) -> DecoderLmCtx,
) -> PhaseStats {
    b.time_phases(2, 8, 3, |m| {
        let ctx = forward(model);
        m.mark();
        model.backward(ctx).unwrap();
        m.mark();
        opt.step(model).unwrap();
        model.zero_grad();
        m.mark();
    })
}

/// One Gemma 3 270M layer's parts alone, as `DecoderLm` builds them (a sliding layer: window
/// 512; q/k RMSNorm; RoPE; MQA 4:1 at head_dim 256; GeGLU MLP 640 → 2 × 2048 → 640), forward
/// and backward in BF16, each timed on its own: where a layer's time goes.
pub fn layer_parts(b: &mut Bench) {
    use te_nn::modules::{
        Activation, AttentionInputs, AttnMaskType, LayerNormMLP, LayerNormMLPConfig, MultiheadAttention,
        MultiheadAttentionConfig, NormKind,
    };
    let work = "gemma3 270m layer";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let (h, d) = (640, 256);
    let mha_cfg = MultiheadAttentionConfig {
        kv_channels: Some(d),
        num_gqa_groups: Some(1),
        input_layernorm: true,
        normalization: NormKind::RmsNorm,
        zero_centered_gamma: true,
        attn_mask_type: AttnMaskType::Causal,
        window_size: Some((511, 0)),
        bias: false,
        qk_norm_type: Some(NormKind::RmsNorm),
        qk_norm_before_rope: true,
        softmax_scale: Some(1.0 / 16.0),
        ..MultiheadAttentionConfig::new(h, 4)
    };
    let mut mha = MultiheadAttention::new(&dev, mha_cfg).unwrap();
    let mlp_cfg = LayerNormMLPConfig {
        normalization: NormKind::RmsNorm,
        zero_centered_gamma: true,
        activation: Activation::Geglu,
        bias: false,
        ..LayerNormMLPConfig::new(h, 2048)
    };
    let mut mlp = LayerNormMLP::new(&dev, mlp_cfg).unwrap();
    let x = Tensor::zeros(&dev, DType::BF16, &[SEQ, BATCH, h]).unwrap();
    let angles: Vec<f32> = (0..SEQ * d).map(|i| (i / d) as f32 * 1e-3 * (i % (d / 2)) as f32).collect();
    let freqs = Tensor::from_f32(&dev, DType::F32, &[SEQ, d], &angles).unwrap();
    let shape = format!("b{BATCH} s{SEQ}");
    let st = b.time_phases(2, 10, 4, |m| {
        let inputs = AttentionInputs { rotary_pos_emb: Some(&freqs), ..Default::default() };
        let (a, ca) = mha.forward_with(&x, inputs).unwrap();
        m.mark();
        let (y, cm) = mlp.forward(&a).unwrap();
        m.mark();
        mlp.backward(cm, &y).unwrap();
        m.mark();
        mha.backward(ca, &a).unwrap();
        mha.zero_grad();
        mlp.zero_grad();
        m.mark();
    });
    for (i, part) in ["attention block fwd", "mlp fwd", "mlp bwd", "attention block bwd"].iter().enumerate() {
        b.record(&format!("{work} {part}"), &shape, st.phases[i], None, None);
    }
    // The dot-product attention alone (sbhd, as the block runs it after RoPE).
    use te_nn::modules::{DotProductAttention, DotProductAttentionConfig, QkvFormat};
    let cfg = DotProductAttentionConfig {
        qkv_format: QkvFormat::Sbhd,
        attn_mask_type: AttnMaskType::Causal,
        window_size: Some((511, 0)),
        num_gqa_groups: Some(1),
        softmax_scale: Some(1.0 / 16.0),
        ..DotProductAttentionConfig::new(4, d)
    };
    let mut dpa = DotProductAttention::new(&dev, cfg).unwrap();
    let q = Tensor::zeros(&dev, DType::BF16, &[SEQ, BATCH, 4, d]).unwrap();
    let kv = Tensor::zeros(&dev, DType::BF16, &[SEQ, BATCH, 1, d]).unwrap();
    let dout = Tensor::zeros(&dev, DType::BF16, &[SEQ, BATCH, 4 * d]).unwrap();
    let st = b.time_phases(2, 10, 2, |m| {
        let (_, c) = dpa.forward(&q, &kv, &kv, None).unwrap();
        m.mark();
        dpa.backward(c, &dout).unwrap();
        m.mark();
    });
    for (i, part) in ["core attention fwd", "core attention bwd"].iter().enumerate() {
        b.record(&format!("{work} {part}"), &shape, st.phases[i], None, None);
    }
}
