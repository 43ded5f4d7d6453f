//! One fine-tuning step of a decoder LLM (`te_models::decoder::train::DecoderLm`) as `te train
//! --model` runs it: `forward_loss_with`, `backward`, `AdamW::step` and `zero_grad`, each phase
//! timed with CUDA events, in BF16, FP8 (DelayedScaling) and FP8 with the LM head in FP8 too.
//! - `gemma3 270m train`: Gemma 3 270M (the real GGUF when `TE_GEMMA_GGUF` names it, else its
//!   architecture with random weights: the speed does not depend on them), batch 8 × seq 1024;
//!   in BF16 over the same tokens as 8 packed documents (`thd`); documents of mixed lengths
//!   packed (`thd`) against one a row padded to the longest; then the tied LM head and the
//!   cross-entropy alone (`Linear` over the embedding's table, forward, the fused loss and its
//!   gradient, backward), the part of the step the 262 144-token vocabulary costs.
//!   `benches/anchors/finetune.py` times transformers' step.
//! - `llama 1b train`: Llama 3.2 1B's architecture with random weights at batch 4 and 8 of 2 048
//!   tokens, with its model FLOPs utilization.
//!
//! FLOPs: forward `2·tokens·(layers·(h·qkv + attn·h + h·fc1 + ffn·h) + h·vocab)` for the GEMMs
//! plus the attention's (causal, or its window, per document), backward twice that.

use crate::gpt::StepRows;
use crate::harness::{Bench, PhaseStats};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use te_models::decoder::train::{DecoderLm, DecoderLmCtx, Packing};
use te_models::decoder::DecoderConfig;
use te_models::gpt::{MicroBatch, IGNORE_INDEX};
use te_nn::fp8::{fp8_autocast, DelayedScaling, Recipe};
use te_nn::modules::{Linear, LinearConfig, TokenIds};
use te_nn::Module;
use te_runtime::ops::cross_entropy::{cross_entropy, CrossEntropyGrad};
use te_runtime::{DType, Tensor};
use te_train::optim::{AdamW, AdamWConfig, LrSchedule};

const BATCH: usize = 8;
const SEQ: usize = 1024;

/// Llama 3.2 1B's `config.json` (16 layers, hidden 2048, GQA 32 / 8 heads at head_dim 64, SwiGLU
/// 8192, vocabulary 128 256, tied embeddings; its `llama3` RoPE scaling left out: the speed does
/// not depend on it).
const LLAMA_1B: &str = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
 "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5,
 "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
 "tie_word_embeddings": true, "bos_token_id": 128000, "eos_token_id": 128001}"#;

/// The H100 SXM's dense BF16 peak (TFLOP/s) that model FLOPs utilization is a fraction of.
const H100_BF16_PEAK_TFLOPS: f64 = 989.4;

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
    let opt_cfg = AdamWConfig { max_grad_norm: Some(1.0), ..AdamWConfig::new(LrSchedule::Constant(2e-5)) };
    let mut opt = AdamW::new(&dev, &model, opt_cfg).unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    let v = cfg.vocab_size;
    let tokens = SEQ * BATCH;
    let ids: Vec<i32> = (0..tokens + BATCH).map(|_| rng.random_range(0..v as i32)).collect();
    let (gemm, _) = gemm_flops(&cfg, tokens);
    let attention = attention_flops(&cfg, &[SEQ; BATCH]);
    let params = model.num_parameters() as u64;
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
    dense_variants(b, work, (&mut model, &mut opt), (BATCH, SEQ), &ids);
    thd_vs_padded(b, work, (&mut model, &mut opt));
    drop((model, opt));
    // The tied head and the loss alone: a Linear over a [vocab, hidden] table.
    let h = cfg.hidden_size;
    let targets = TokenIds::from_host(&dev, &[SEQ, BATCH], &ids[BATCH..]).unwrap();
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

/// A Llama-architecture model of about 1 B parameters (Llama 3.2 1B's configuration, random
/// weights) trained a step at a time as `te train --model` would: BF16, FP8 (delayed scaling)
/// and FP8 with the LM head in FP8, at batch 4 and 8 of 2 048 tokens; prints the model FLOPs
/// utilization (GEMMs and attention, forward and backward, against the H100's BF16 dense peak).
pub fn llama_1b(b: &mut Bench) {
    let work = "llama 1b train";
    if !b.enabled(work) {
        return;
    }
    let dev = b.dev().clone();
    let w = crate::decoder::random_weights(LLAMA_1B);
    let cfg = w.config().clone();
    let mut model = DecoderLm::from_weights(&dev, &w, DType::BF16).unwrap();
    drop(w);
    println!("{work}: random weights, {} parameters", model.num_parameters());
    let opt_cfg = AdamWConfig { max_grad_norm: Some(1.0), ..AdamWConfig::new(LrSchedule::Constant(2e-5)) };
    let mut opt = AdamW::new(&dev, &model, opt_cfg).unwrap();
    let seq = 2048;
    for batch in [4, 8] {
        let mut rng = StdRng::seed_from_u64(11);
        let ids: Vec<i32> = (0..(seq + 1) * batch).map(|_| rng.random_range(0..cfg.vocab_size as i32)).collect();
        dense_variants(b, work, (&mut model, &mut opt), (batch, seq), &ids);
    }
}

/// Times `model`'s step over `batch` windows of `seq` tokens (`ids`: `(seq + 1) · batch` ids,
/// seq-major; the targets the ids one row on) in BF16, FP8 (delayed scaling) and FP8 with the LM
/// head in FP8, records the rows and prints tokens/s and model FLOPs utilization.
fn dense_variants(
    b: &mut Bench,
    work: &str,
    (model, opt): (&mut DecoderLm, &mut AdamW),
    (batch, seq): (usize, usize),
    ids: &[i32],
) {
    let dev = b.dev().clone();
    let cfg = model.config().clone();
    let tokens = batch * seq;
    let ids_t = TokenIds::from_host(&dev, &[seq, batch], &ids[..tokens]).unwrap();
    let targets = TokenIds::from_host(&dev, &[seq, batch], &ids[batch..tokens + batch]).unwrap();
    let (gemm, head) = gemm_flops(&cfg, tokens);
    let attention = attention_flops(&cfg, &vec![seq; batch]);
    let params = model.num_parameters() as u64;
    let shape = format!("b{batch} s{seq}");
    let delayed: Option<Recipe> = Some(DelayedScaling::default().into());
    let variants =
        [("ours bf16", None, false), ("ours fp8 delayed", delayed, false), ("ours fp8 + fp8 lm head", delayed, true)];
    let mut bf16_ms = None;
    for (variant, recipe, fp8_head) in variants {
        let fp8 = recipe.is_some();
        model.set_fp8_lm_head(fp8_head);
        let st = time_step(b, model, opt, |model| {
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
        let ms = st.total.median_us / 1e3;
        let tflops = 3.0 * (gemm + attention) as f64 / (ms * 1e-3) / 1e12;
        let speedup = bf16_ms.map_or(String::new(), |base: f64| format!(", step {:.3}× BF16's", base / ms));
        println!(
            "{work} {shape} {variant}: {ms:.2} ms a step, model {tflops:.1} TFLOP/s = {:.1} % of the H100's BF16 \
             dense peak ({H100_BF16_PEAK_TFLOPS}){speedup}",
            100.0 * tflops / H100_BF16_PEAK_TFLOPS
        );
        bf16_ms.get_or_insert(ms);
    }
    model.set_fp8_lm_head(false);
}

/// The same documents of mixed lengths (log-uniform in 32 ..= SEQ tokens, 8 192 tokens in all)
/// trained a step in two layouts: packed in one row with `cu_seqlens` (`thd`) and one document
/// a row padded to the longest (rounded up to 16; pads ignored by the loss: what a padding
/// collator gives), in BF16 and FP8; tokens/s counts the documents' tokens only.
fn thd_vs_padded(b: &mut Bench, work: &str, (model, opt): (&mut DecoderLm, &mut AdamW)) {
    let dev = b.dev().clone();
    let cfg = model.config().clone();
    let real = SEQ * BATCH;
    let mut rng = StdRng::seed_from_u64(23);
    let (lo, hi) = ((32f64).ln(), (SEQ as f64).ln());
    let mut lens = Vec::new();
    while lens.iter().sum::<usize>() < real {
        let left = real - lens.iter().sum::<usize>();
        lens.push((rng.random_range(lo..=hi).exp() as usize).clamp(2, SEQ).min(left.max(2)));
    }
    let docs: Vec<Vec<i32>> =
        lens.iter().map(|&n| (0..n).map(|_| rng.random_range(0..cfg.vocab_size as i32)).collect()).collect();
    let target = |d: &[i32], i: usize| if i + 1 < d.len() { d[i + 1] } else { IGNORE_INDEX };
    // thd: the documents one after another.
    let flat: Vec<i32> = docs.iter().flatten().copied().collect();
    let flat_targets: Vec<i32> = docs.iter().flat_map(|d| (0..d.len()).map(|i| target(d, i))).collect();
    let positions: Vec<usize> = docs.iter().flat_map(|d| 0..d.len()).collect();
    let mut cu = vec![0];
    for d in &docs {
        cu.push(cu.last().unwrap() + d.len());
    }
    let thd_ids = TokenIds::from_host(&dev, &[real, 1], &flat).unwrap();
    let thd_targets = TokenIds::from_host(&dev, &[real, 1], &flat_targets).unwrap();
    // padded: [s, b] seq-major, document b in column b.
    let (rows, cols) = (lens.iter().max().unwrap().next_multiple_of(16), docs.len());
    let mut pad_ids = vec![0; rows * cols];
    let mut pad_targets = vec![IGNORE_INDEX; rows * cols];
    for (c, d) in docs.iter().enumerate() {
        for i in 0..d.len() {
            pad_ids[i * cols + c] = d[i];
            pad_targets[i * cols + c] = target(d, i);
        }
    }
    let pad_ids = TokenIds::from_host(&dev, &[rows, cols], &pad_ids).unwrap();
    let pad_targets = TokenIds::from_host(&dev, &[rows, cols], &pad_targets).unwrap();
    // Useful work: the documents' tokens and their causal attention alone.
    let (gemm, head) = gemm_flops(&cfg, real);
    let attention = attention_flops(&cfg, &lens);
    let params = model.num_parameters() as u64;
    let shape = format!("{} documents, {real} tokens; padded {cols} × {rows}", docs.len());
    println!("{work} thd vs padded: {shape}");
    let delayed: Recipe = DelayedScaling::default().into();
    for recipe in [None, Some(delayed)] {
        let fp8 = recipe.is_some();
        let autocast = |f: &mut dyn FnMut() -> DecoderLmCtx| match recipe {
            Some(r) => fp8_autocast(true, r, || Ok::<_, te_runtime::Error>(f())).unwrap(),
            None => f(),
        };
        let thd = time_step(b, model, opt, |model| {
            let packing = Packing { position_ids: &positions, cu_seqlens: &cu, cu_seqlens_padded: None };
            autocast(&mut || model.forward_loss_thd(&thd_ids, &thd_targets, packing, MicroBatch::default()).unwrap().1)
        });
        let padded = time_step(b, model, opt, |model| {
            autocast(&mut || model.forward_loss_with(&pad_ids, &pad_targets, MicroBatch::default()).unwrap().1)
        });
        let p = if fp8 { "fp8" } else { "bf16" };
        let fp8_flops = if fp8 { gemm - head } else { 0 };
        for (variant, st) in [(format!("ours {p} mixed thd"), &thd), (format!("ours {p} mixed padded"), &padded)] {
            let step = StepRows { work, shape: &shape, variant: &variant, fp8, tokens: real, params };
            step.record(b, st, gemm + attention, fp8_flops);
        }
        println!(
            "{work} {p}: thd {:.2} ms, padded {:.2} ms a step of the same {real} tokens: thd {:.2}× the padded layout's \
             tokens/s",
            thd.total.median_us / 1e3,
            padded.total.median_us / 1e3,
            padded.total.median_us / thd.total.median_us
        );
    }
}

/// A forward's GEMM FLOPs over `tokens` tokens, and of them the LM head's.
fn gemm_flops(cfg: &DecoderConfig, tokens: usize) -> (u64, u64) {
    let h = cfg.hidden_size;
    let per_layer = h * cfg.qkv_size() + cfg.attention_size() * h + h * cfg.fc1_size() + cfg.ffn_hidden_size * h;
    let head = (2 * tokens * h * cfg.vocab_size) as u64;
    ((2 * tokens * cfg.num_layers * per_layer) as u64 + head, head)
}

/// A forward's attention FLOPs (`QKᵀ` and `PV`) over documents of `lens` tokens: each query
/// sees the keys before it, or its window.
fn attention_flops(cfg: &DecoderConfig, lens: &[usize]) -> u64 {
    (0..cfg.num_layers)
        .map(|l| {
            let seen: usize = lens
                .iter()
                .map(|&n| match cfg.layer_window(l) {
                    Some((left, _)) => (0..n).map(|i| i.min(left as usize) + 1).sum::<usize>(),
                    None => n * (n + 1) / 2,
                })
                .sum();
            (4 * cfg.num_attention_heads * seen * cfg.head_dim) as u64
        })
        .sum()
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
