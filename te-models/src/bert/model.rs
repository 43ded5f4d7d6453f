//! [`Bert`]: the encoder on the device built from the modules (weights loaded into post-LN
//! transformer layers), its hidden states and pooled embeddings, FP8 calibration and the choice
//! of which GEMMs run in FP8.

use super::{l2_normalize, mean_pool_normalize, pad_batch, BertConfig, BertError, BertResult, BertWeights};
use std::sync::Arc;
use te_codegen::DType;
use te_nn::fp8::{
    fp8_autocast, fp8_model_init, DelayedScaling, Float8CurrentScaling, Float8CurrentScalingQuantizer, Float8Tensor,
    Fp8Autocast, Quantizer, Recipe,
};
use te_nn::modules::{
    AttentionInputs, AttnMaskType, Norm, NormConfig, NormKind, PaddingSeqlens, QkvFormat, TokenIds, TransformerLayer,
    TransformerLayerConfig,
};

mod graph;
use te_runtime::ops::elementwise::add;
use te_runtime::ops::embedding::{embedding_forward, embedding_forward_fp8};
use te_runtime::{Device, Tensor};

/// The dtype of the layers' GEMM weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightPrecision {
    /// BF16 weights, BF16 GEMMs.
    Bf16,
    /// E4M3 weights made under `fp8_model_init` (1 byte per parameter), FP8 GEMMs.
    Fp8,
}

/// How FP8 GEMM inputs (activations) are scaled with [`WeightPrecision::Fp8`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationScaling {
    /// `Float8CurrentScaling`: each activation scaled by its own amax just before its cast (an
    /// amax kernel and a scale kernel per GEMM input; no calibration, robust to outliers in a
    /// batch).
    Current,
    /// `DelayedScaling` with the scales of a calibration pass ([`Bert::calibrate`], TE's
    /// `fp8_autocast(calibrating=True)`): no amax pass before the casts; every later batch
    /// still records its amax (the history is the running max).
    Calibrated,
}

impl ActivationScaling {
    /// The recipe of the layers' FP8 GEMMs: TE's `Float8CurrentScaling()` or `DelayedScaling()`.
    pub fn recipe(self) -> Recipe {
        match self {
            ActivationScaling::Current => Float8CurrentScaling::default().into(),
            ActivationScaling::Calibrated => DelayedScaling::default().into(),
        }
    }
}

/// The word-embedding table: BF16, or E4M3 codes with a per-tensor scale (1 byte per entry; the
/// lookup dequantizes to BF16).
#[derive(Debug)]
enum WordTable {
    High(Tensor),
    Fp8(Float8Tensor),
}

/// Which GEMMs of each layer run in FP8 under [`WeightPrecision::Fp8`]: the attention block's
/// (QKV and output projection) and the MLP's (fc1, fc2). A block left out runs its GEMMs in BF16
/// inside a disabled `fp8_autocast` scope, on its FP8 weights dequantized at each call: for GEMMs
/// too small for FP8 to pay for its input casts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fp8Gemms {
    /// QKV and output projection in FP8.
    pub attention: bool,
    /// fc1 and fc2 in FP8.
    pub mlp: bool,
}

impl Fp8Gemms {
    /// Every GEMM in FP8 (the default).
    pub const ALL: Fp8Gemms = Fp8Gemms { attention: true, mlp: true };
}

/// [`TransformerLayer::infer_with`] of a post-LN or pre-LN layer block by block, each block's
/// GEMMs in FP8 or (inside a disabled scope) BF16 as `gemms` says.
fn layer_infer_split(
    dev: &Arc<Device>,
    layer: &mut TransformerLayer,
    x: &Tensor,
    inputs: AttentionInputs<'_>,
    gemms: Fp8Gemms,
    recipe: Recipe,
) -> te_runtime::Result<Tensor> {
    let a = fp8_autocast(gemms.attention, recipe, || layer.self_attention_mut().infer_with(x, inputs))?;
    let mut h1 = Tensor::empty(dev, x.dtype(), x.shape())?;
    add(dev, &a, x, &mut h1)?;
    let y = fp8_autocast(gemms.mlp, recipe, || {
        // The MLP returns its norm's output exactly when the residual is taken after it.
        let mlp = layer.layernorm_mlp_mut().ok_or_else(|| te_runtime::Error::Config {
            module: "Bert",
            message: "BERT layers have dense MLPs (moe is not supported)".into(),
        })?;
        let m = mlp.infer_with(&h1, Default::default())?;
        let mut y = m.out.into_high(dev, h1.dtype())?;
        te_runtime::ops::elementwise::add_assign(dev, &mut y, m.ln_out.as_ref().unwrap_or(&h1))?;
        Ok(y)
    })?;
    match layer.output_norm() {
        Some(n) => n.infer(&y),
        None => Ok(y),
    }
}

/// A batch's pooled output: sums still on the device, or embeddings pooled on the host.
enum Pooled {
    Device(Tensor),
    Host(Vec<Vec<f32>>),
}

/// A BERT encoder on the device for inference.
#[derive(Debug)]
pub struct Bert {
    dev: Arc<Device>,
    cfg: BertConfig,
    precision: WeightPrecision,
    scaling: ActivationScaling,
    calibrated: bool,
    host_pooling: bool,
    fp8_gemms: Fp8Gemms,
    word: WordTable,
    pos: Tensor,
    emb_norm: Norm,
    layers: Vec<TransformerLayer>,
    /// Batches replayed from CUDA graphs per padded shape ([`Bert::set_cuda_graph`]).
    graphs: graph::BatchGraphs,
}

fn upload(dev: &Arc<Device>, shape: &[usize], values: &[f32]) -> BertResult<Tensor> {
    Ok(Tensor::from_f32(dev, DType::BF16, shape, values)?)
}

impl Bert {
    /// The model with `weights` on `dev`; FP8 layers are made under `fp8_model_init` and start
    /// with [`ActivationScaling::Current`]. With [`WeightPrecision::Fp8`] the word-embedding
    /// table is FP8 too (see [`Bert::new_with`]).
    ///
    /// # Errors
    /// [`BertError::Tensor`] for missing or mismatched tensors; device and module failures.
    pub fn new(
        dev: &Arc<Device>,
        cfg: &BertConfig,
        weights: &BertWeights,
        precision: WeightPrecision,
    ) -> BertResult<Self> {
        Self::new_with(dev, cfg, weights, precision, precision == WeightPrecision::Fp8)
    }

    /// As [`Bert::new`], choosing the word-embedding table's storage: `fp8_word_embeddings`
    /// keeps it as E4M3 codes with one per-tensor scale (its own amax; 1 byte per entry, the
    /// lookup dequantizes to BF16), otherwise BF16. The table is about half of MiniLM's
    /// parameters, so FP8 weight memory is about half of BF16's only with it.
    ///
    /// # Errors
    /// As [`Bert::new`].
    pub fn new_with(
        dev: &Arc<Device>,
        cfg: &BertConfig,
        weights: &BertWeights,
        precision: WeightPrecision,
        fp8_word_embeddings: bool,
    ) -> BertResult<Self> {
        weights.validate(cfg)?;
        let (h, f) = (cfg.hidden_size, cfg.intermediate_size);
        let word =
            upload(dev, &[cfg.vocab_size, h], weights.get("embeddings.word_embeddings.weight", &[cfg.vocab_size, h])?)?;
        let word = if fp8_word_embeddings { WordTable::Fp8(quantize_e4m3(dev, &word)?) } else { WordTable::High(word) };
        let pos = upload(dev, &[cfg.max_position_embeddings, h], &weights.position_table(cfg)?)?;
        let norm_cfg = NormConfig { eps: cfg.layer_norm_eps, params_dtype: DType::BF16, ..NormConfig::new(h) };
        let mut emb_norm = Norm::new(dev, NormKind::LayerNorm, norm_cfg)?;
        emb_norm.params_mut().set_weight(upload(dev, &[h], weights.get("embeddings.LayerNorm.weight", &[h])?)?)?;
        emb_norm.params_mut().set_bias(upload(dev, &[h], weights.get("embeddings.LayerNorm.bias", &[h])?)?)?;
        let fp8 = precision == WeightPrecision::Fp8;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let layer_cfg = TransformerLayerConfig {
                layernorm_epsilon: cfg.layer_norm_eps,
                hidden_dropout: 0.0,
                attention_dropout: 0.0,
                self_attn_mask_type: AttnMaskType::Padding,
                activation: cfg.activation,
                apply_residual_connection_post_layernorm: true,
                output_layernorm: true,
                qkv_format: QkvFormat::Bshd,
                params_dtype: DType::BF16,
                ..TransformerLayerConfig::new(h, f, cfg.num_attention_heads)
            };
            let mut layer = fp8_model_init(fp8, || TransformerLayer::new(dev, layer_cfg))?;
            let p = format!("encoder.layer.{l}.");
            let g = |name: &str, shape: &[usize]| weights.get(&format!("{p}{name}"), shape);
            let (qkv_w, qkv_b) = weights.qkv(cfg, l)?;
            let set = |params: &mut te_nn::modules::LinearParams, w: &[f32], b: &[f32], shape: [usize; 2]| {
                set_linear(dev, params, w, b, shape, fp8)
            };
            let attn = layer.self_attention_mut();
            set(attn.qkv_params_mut(), &qkv_w, &qkv_b, [3 * h, h])?;
            set(
                attn.proj_params_mut(),
                g("attention.output.dense.weight", &[h, h])?,
                g("attention.output.dense.bias", &[h])?,
                [h, h],
            )?;
            let mlp = layer
                .layernorm_mlp_mut()
                .ok_or_else(|| te_runtime::Error::internal("Bert", "a BERT layer without a dense MLP"))?;
            mlp.norm_params_mut().set_weight(upload(dev, &[h], g("attention.output.LayerNorm.weight", &[h])?)?)?;
            mlp.norm_params_mut().set_bias(upload(dev, &[h], g("attention.output.LayerNorm.bias", &[h])?)?)?;
            set(mlp.fc1_mut(), g("intermediate.dense.weight", &[f, h])?, g("intermediate.dense.bias", &[f])?, [f, h])?;
            set(mlp.fc2_mut(), g("output.dense.weight", &[h, f])?, g("output.dense.bias", &[h])?, [h, f])?;
            let out = layer.output_norm_mut().ok_or_else(|| {
                te_runtime::Error::internal("Bert::new", "a layer built with output_layernorm has no output norm")
            })?;
            out.params_mut().set_weight(upload(dev, &[h], g("output.LayerNorm.weight", &[h])?)?)?;
            out.params_mut().set_bias(upload(dev, &[h], g("output.LayerNorm.bias", &[h])?)?)?;
            layers.push(layer);
        }
        Ok(Self {
            dev: dev.clone(),
            cfg: cfg.clone(),
            precision,
            scaling: ActivationScaling::Current,
            calibrated: false,
            host_pooling: false,
            fp8_gemms: Fp8Gemms::ALL,
            word,
            pos,
            emb_norm,
            layers,
            graphs: graph::BatchGraphs::default(),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &BertConfig {
        &self.cfg
    }

    /// The weight precision.
    pub fn precision(&self) -> WeightPrecision {
        self.precision
    }

    /// The activation scaling (meaningful with FP8 weights).
    pub fn scaling(&self) -> ActivationScaling {
        self.scaling
    }

    /// Chooses the activation scaling; [`ActivationScaling::Calibrated`] needs
    /// [`Bert::calibrate`] before the next forward.
    pub fn set_scaling(&mut self, scaling: ActivationScaling) {
        self.scaling = scaling;
    }

    /// Bytes of every parameter on the device: embedding tables and norms (BF16) and the layers'
    /// GEMM weights (BF16, or E4M3 codes plus one f32 `scale_inv` each) and biases.
    pub fn weight_bytes(&self) -> usize {
        self.embedding_bytes() + self.layer_weight_bytes()
    }

    /// Bytes of the embedding tables and the embedding norm.
    pub fn embedding_bytes(&self) -> usize {
        let n = self.emb_norm.params();
        let word = match &self.word {
            WordTable::High(t) => t.num_bytes(),
            WordTable::Fp8(t) => t.num_bytes(),
        };
        word + self.pos.num_bytes() + n.weight().num_bytes() + n.bias().map_or(0, Tensor::num_bytes)
    }

    /// Bytes of the transformer layers' parameters (GEMM weights, biases, norms).
    pub fn layer_weight_bytes(&self) -> usize {
        use te_nn::modules::{Module, ParamKind};
        let mut total = 0usize;
        for layer in &self.layers {
            let _ = layer.visit("", &mut |_: &str, _: ParamKind, p: &dyn te_nn::modules::Param| {
                total += match p.fp8_tensor() {
                    Some(f) => f.num_bytes(),
                    None => p.tensor().map_or(0, Tensor::num_bytes),
                };
                Ok(())
            });
        }
        total
    }

    fn recipe(&self) -> Recipe {
        self.scaling.recipe()
    }

    /// Final hidden states `[b, s, hidden]` (BF16) for `ids: [b, s]` (row-major, padded with
    /// any valid id) and the real length of each row.
    ///
    /// # Errors
    /// [`BertError::Input`] for an empty batch, `s` above `max_position_embeddings`, lengths
    /// outside `1..=s` or ids outside the vocabulary; [`BertError::Runtime`] for device
    /// failures, or for [`ActivationScaling::Calibrated`] before [`Bert::calibrate`].
    pub fn hidden_states(&mut self, ids: &[i32], batch: usize, seq: usize, lens: &[usize]) -> BertResult<Tensor> {
        self.check_input(ids, batch, seq, lens)?;
        let (tokens, positions) = self.token_tables(ids, batch, seq)?;
        self.hidden_from(&tokens, &positions, lens, None)
    }

    /// The ids `[b · s]` and their positions (`0..s` per row) on the device.
    fn token_tables(&self, ids: &[i32], batch: usize, seq: usize) -> BertResult<(TokenIds, TokenIds)> {
        let tokens = TokenIds::from_host(&self.dev, &[batch * seq], ids)?;
        let positions: Vec<i32> = (0..batch).flat_map(|_| 0..seq as i32).collect();
        let positions = TokenIds::from_host(&self.dev, &[batch * seq], &positions)?;
        Ok((tokens, positions))
    }

    /// [`Bert::hidden_states`] of checked inputs on the device: `tokens` and `positions`
    /// `[b · s]` (`b` = `lens.len()`), and the padding tables of `lens` when made before (a
    /// CUDA graph's static input; else the attention uploads its own).
    fn hidden_from(
        &mut self,
        tokens: &TokenIds,
        positions: &TokenIds,
        lens: &[usize],
        padding: Option<&PaddingSeqlens>,
    ) -> BertResult<Tensor> {
        let fp8 = self.precision == WeightPrecision::Fp8;
        if fp8 && self.scaling == ActivationScaling::Calibrated && !self.calibrated {
            return Err(BertError::Input {
                message: "calibrated FP8 scaling needs Bert::calibrate on sample text first (or use current scaling)"
                    .into(),
            });
        }
        let batch = lens.len();
        let x = self.embed_tokens(tokens, positions, batch, tokens.len() / batch.max(1))?;
        let recipe = self.recipe();
        let gemms = self.fp8_gemms;
        let dev = self.dev.clone();
        let layers = &mut self.layers;
        let inputs = AttentionInputs { seq_lens: Some(lens), padding, ..Default::default() };
        let y = fp8_autocast(fp8, recipe, || {
            let mut x = x;
            for layer in layers.iter_mut() {
                x = if !fp8 || gemms == Fp8Gemms::ALL {
                    layer.infer_with(&x, inputs)?
                } else {
                    layer_infer_split(&dev, layer, &x, inputs, gemms, recipe)?
                };
            }
            Ok(x)
        })?;
        Ok(y)
    }

    /// Which blocks' GEMMs run in FP8 with [`WeightPrecision::Fp8`] (default: all).
    pub fn fp8_gemms(&self) -> Fp8Gemms {
        self.fp8_gemms
    }

    /// Chooses which blocks' GEMMs run in FP8; the others run in BF16 on their FP8 weights
    /// dequantized at each call (weights stay 1 byte per parameter).
    pub fn set_fp8_gemms(&mut self, gemms: Fp8Gemms) {
        self.fp8_gemms = gemms;
    }

    fn check_input(&self, ids: &[i32], batch: usize, seq: usize, lens: &[usize]) -> BertResult<()> {
        let bad = |message: String| Err(BertError::Input { message });
        if batch == 0 || seq == 0 {
            return bad("empty batch".into());
        }
        if seq > self.cfg.max_position_embeddings {
            return bad(format!(
                "sequence length {seq} exceeds max_position_embeddings = {}; truncate the input",
                self.cfg.max_position_embeddings
            ));
        }
        if ids.len() != batch * seq || lens.len() != batch {
            return bad(format!("{} ids and {} lengths for a [{batch}, {seq}] batch", ids.len(), lens.len()));
        }
        if let Some(l) = lens.iter().find(|&&l| l == 0 || l > seq) {
            return bad(format!("length {l} outside 1..={seq}"));
        }
        if let Some(id) = ids.iter().find(|&&i| i < 0 || i as usize >= self.cfg.vocab_size) {
            return bad(format!("token id {id} outside the vocabulary of {}", self.cfg.vocab_size));
        }
        Ok(())
    }

    /// `LN(word[ids] + pos[j])`, `[b, s, hidden]` BF16.
    fn embed_tokens(&self, tokens: &TokenIds, positions: &TokenIds, batch: usize, seq: usize) -> BertResult<Tensor> {
        let h = self.cfg.hidden_size;
        let mut w = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        match &self.word {
            WordTable::High(t) => embedding_forward(&self.dev, t, tokens.data(), &mut w)?,
            WordTable::Fp8(t) => embedding_forward_fp8(&self.dev, t.data(), t.scale_inv(), tokens.data(), &mut w)?,
        }
        let mut p = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        embedding_forward(&self.dev, &self.pos, positions.data(), &mut p)?;
        let mut sum = Tensor::empty(&self.dev, DType::BF16, &[batch, seq, h])?;
        add(&self.dev, &w, &p, &mut sum)?;
        Ok(self.emb_norm.infer(&sum)?)
    }

    /// Sentence embeddings (mean over the real tokens, L2-normalised, f32 `[hidden]` each) of
    /// `seqs`, token ids with `[CLS]`/`[SEP]`, as one batch padded (with id 0) to the longest
    /// length rounded up to a multiple of 16 (the FP8 GEMMs' granularity).
    ///
    /// # Errors
    /// [`BertError::Input`] for an empty sequence or one longer than `max_position_embeddings`
    /// (truncate before); as [`Bert::hidden_states`].
    pub fn embed(&mut self, seqs: &[Vec<u32>]) -> BertResult<Vec<Vec<f32>>> {
        Ok(self.embed_batches(std::slice::from_ref(&seqs.to_vec()))?.remove(0))
    }

    /// [`Bert::embed`] of several batches with one host synchronisation: every batch is
    /// enqueued (embeddings, layers, pooling GEMM) before the first pooled sums are copied back,
    /// so the device never waits for the host between batches. Results per batch, in order.
    ///
    /// # Errors
    /// As [`Bert::embed`], for the first failing batch.
    pub fn embed_batches(&mut self, batches: &[Vec<Vec<u32>>]) -> BertResult<Vec<Vec<Vec<f32>>>> {
        let h = self.cfg.hidden_size;
        let mut pending = Vec::with_capacity(batches.len());
        for seqs in batches {
            let (ids, batch, seq, lens) = pad_batch(seqs, self.cfg.max_position_embeddings)?;
            if self.graphs.enabled() && !self.host_pooling {
                self.check_input(&ids, batch, seq, &lens)?;
                if let Some(sums) = self.embed_graphed(&ids, seq, &lens)? {
                    pending.push(Pooled::Device(sums));
                    continue;
                }
            }
            let hidden = self.hidden_states(&ids, batch, seq, &lens)?;
            if !self.host_pooling {
                match self.pool_on_device(&hidden, batch, seq, &lens) {
                    Ok(sums) => {
                        pending.push(Pooled::Device(sums));
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!("pooling on the device failed ({e}); pooling on the host from now on");
                        self.host_pooling = true;
                    }
                }
            }
            let host = hidden.to_f32(&self.dev)?;
            pending.push(Pooled::Host(mean_pool_normalize(&host, seq, h, &lens)));
        }
        pending
            .into_iter()
            .map(|p| match p {
                Pooled::Device(sums) => Ok(sums.to_f32(&self.dev)?.chunks_exact(h).map(l2_normalize).collect()),
                Pooled::Host(v) => Ok(v),
            })
            .collect()
    }

    /// Per-sequence sums of the real tokens' hidden states, `[b, hidden]` f32 on the device: one
    /// strided batched GEMM `sum_i[1, hidden] = m_i[1, s] · H_i[s, hidden]` with `m_i` the 0/1
    /// mask of real tokens (the mean's `1 / len` cancels in the L2 normalisation), so only
    /// `b · hidden` floats cross to the host, later.
    fn pool_on_device(&self, hidden: &Tensor, batch: usize, seq: usize, lens: &[usize]) -> BertResult<Tensor> {
        let mask = Tensor::from_f32(&self.dev, hidden.dtype(), &[batch, seq], &pool_mask(lens, seq))?;
        self.pool_sums(hidden, &mask)
    }

    /// The pooling GEMM of [`Bert::pool_on_device`] with its mask `[b, s]` on the device.
    fn pool_sums(&self, hidden: &Tensor, mask: &Tensor) -> BertResult<Tensor> {
        use te_runtime::gemm::{gemm_strided_batched, GemmConfig, MatrixView, StridedBatch};
        let h = self.cfg.hidden_size;
        let &[batch, seq] = mask.shape() else {
            return Err(te_runtime::Error::internal("Bert::pool_sums", "the mask must be [b, s]").into());
        };
        let mut sums = Tensor::empty(&self.dev, DType::F32, &[batch, h])?;
        let geometry = StridedBatch {
            count: batch,
            a: MatrixView { offset: 0, rows: 1, cols: seq, row_stride: seq, batch_stride: seq },
            a_transposed: false,
            b: MatrixView::contiguous(seq, h),
            b_transposed: true,
            d: MatrixView { offset: 0, rows: 1, cols: h, row_stride: h, batch_stride: h },
        };
        gemm_strided_batched(&self.dev, mask, hidden, &mut sums, &geometry, &GemmConfig::default())?;
        Ok(sums)
    }

    /// Whether [`Bert::embed`] pools on the device (false after [`Bert::set_host_pooling`] or a
    /// failed device pooling).
    pub fn pools_on_device(&self) -> bool {
        !self.host_pooling
    }

    /// Pools on the host instead of the device (a debugging switch; the device path falls back
    /// to it by itself when its GEMM fails).
    pub fn set_host_pooling(&mut self, host: bool) {
        self.host_pooling = host;
    }

    /// Runs the batches in `fp8_autocast(calibrating = true)` with a delayed-scaling recipe:
    /// GEMMs in BF16, every FP8 input's amax recorded; at the scope's exit the scales are set
    /// from them, and the model switches to [`ActivationScaling::Calibrated`]. A no-op (but
    /// the switch) with BF16 weights.
    ///
    /// # Errors
    /// As [`Bert::embed`].
    pub fn calibrate(&mut self, batches: &[Vec<Vec<u32>>]) -> BertResult<()> {
        self.scaling = ActivationScaling::Calibrated;
        if self.precision != WeightPrecision::Fp8 {
            self.calibrated = true;
            return Ok(());
        }
        let guard = Fp8Autocast::calibrating(ActivationScaling::Calibrated.recipe()).enter()?;
        for b in batches {
            let (ids, batch, seq, lens) = pad_batch(b, self.cfg.max_position_embeddings)?;
            self.check_input(&ids, batch, seq, &lens)?;
            let (tokens, positions) = self.token_tables(&ids, batch, seq)?;
            let mut x = self.embed_tokens(&tokens, &positions, batch, seq)?;
            let inputs = AttentionInputs { seq_lens: Some(&lens), ..Default::default() };
            for layer in self.layers.iter_mut() {
                x = layer.infer_with(&x, inputs)?;
            }
        }
        guard.exit()?;
        self.calibrated = true;
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &Arc<Device> {
        &self.dev
    }
}

/// The 0/1 mask `[b, s]` of each row's real tokens (row-major, as f32).
fn pool_mask(lens: &[usize], seq: usize) -> Vec<f32> {
    lens.iter().flat_map(|&l| (0..seq).map(move |t| if t < l { 1.0 } else { 0.0 })).collect()
}

fn set_linear(
    dev: &Arc<Device>,
    params: &mut te_nn::modules::LinearParams,
    w: &[f32],
    b: &[f32],
    shape: [usize; 2],
    fp8: bool,
) -> BertResult<()> {
    let wt = upload(dev, &shape, w)?;
    if fp8 {
        params.set_fp8_weight(quantize_e4m3(dev, &wt)?)?;
    } else {
        params.set_weight(wt)?;
    }
    params.set_bias(upload(dev, &[shape[0]], b)?)?;
    Ok(())
}

/// E4M3 codes of `t` scaled by its own amax (current scaling), no transpose.
fn quantize_e4m3(dev: &Arc<Device>, t: &Tensor) -> BertResult<Float8Tensor> {
    let q = Float8CurrentScalingQuantizer::new(dev, DType::E4M3, Float8CurrentScaling::default())?;
    Ok(q.quantize(t, false, None)?)
}
