//! One layer of [`super::Decoder`] on the GPU: its modules (te-nn `Norm` and `Linear`, so FP8
//! GEMMs and `fp8_model_init` weights come with them) and its forward over the packed tokens of a
//! step (the formula of the [`crate::decoder`] docs): norm → QKV GEMM → the fused qk-norm + RoPE +
//! cache append (`ops::qkv_rope`, BF16 or E4M3 codes) → attention over the cache (the fused
//! attention for a prefill, the split-K decode kernels for one token per sequence) → projection →
//! (sandwich norm) → residual → norm → fc1 → activation → fc2 → (sandwich norm) → residual.

use super::cache::{Step, StepAttention};
use super::{upload, Tensors};
use crate::decoder::{DecoderConfig, DecoderError, DecoderResult};
use std::sync::Arc;
use te_codegen::spec::GemvEpilogue;
use te_codegen::DType;
use te_nn::fp8::{fp8_model_init, Float8CurrentScaling, Float8CurrentScalingQuantizer, Float8Tensor, Quantizer};
use te_nn::modules::{Activation, Linear, LinearConfig, Norm, NormConfig, NormKind};
use te_runtime::ops::activation;
use te_runtime::ops::decode_attention::{decode, decode_fp8, Strided};
use te_runtime::ops::elementwise::add_assign;
use te_runtime::ops::flash_attention::{self, CuSeqlens, FlashAttnParams, Qkv};
use te_runtime::ops::gemv::{gemv, GemvInput, GemvMatrix, GemvNorm};
use te_runtime::ops::qkv_rope::{qkv_rope, qkv_rope_fp8, QkNorm};
use te_runtime::{Device, Tensor};

/// A norm module of `cfg`'s kind with the weight (and LayerNorm's bias) under `weight` / `bias`.
pub(super) fn norm(
    dev: &Arc<Device>,
    cfg: &DecoderConfig,
    t: &mut Tensors,
    (weight, bias): (&str, &str),
    hidden: usize,
) -> DecoderResult<Norm> {
    let nc = NormConfig {
        hidden_size: hidden,
        eps: cfg.layernorm_epsilon,
        zero_centered_gamma: cfg.zero_centered_gamma,
        params_dtype: DType::BF16,
    };
    let mut m = Norm::new(dev, cfg.normalization, nc)?;
    m.params_mut().set_weight(upload(dev, t, weight, &[hidden])?)?;
    if cfg.normalization == NormKind::LayerNorm {
        m.params_mut().set_bias(upload(dev, t, bias, &[hidden])?)?;
    }
    Ok(m)
}

/// A GEMM `[n_out, n_in]` with an optional bias from `t`; FP8-only (E4M3, its own current
/// scale) with `fp8`, as TE's `fp8_model_init`.
pub(super) fn linear(
    dev: &Arc<Device>,
    t: &mut Tensors,
    (weight, bias): (&str, Option<&str>),
    (n_out, n_in): (usize, usize),
    fp8: bool,
) -> DecoderResult<Linear> {
    let w = upload(dev, t, weight, &[n_out, n_in])?;
    let b = bias.map(|b| upload(dev, t, b, &[n_out])).transpose()?;
    linear_from(dev, w, b, fp8)
}

/// A GEMM of the weight `w: [n_out, n_in]` BF16 (shared, not copied, when kept BF16) and an
/// optional bias; FP8-only with `fp8`.
pub(super) fn linear_from(dev: &Arc<Device>, w: Tensor, bias: Option<Tensor>, fp8: bool) -> DecoderResult<Linear> {
    let (n_out, n_in) = (w.shape()[0], w.shape()[1]);
    let lc = LinearConfig {
        bias: bias.is_some(),
        params_dtype: DType::BF16,
        init_std: 0.0,
        ..LinearConfig::new(n_in, n_out)
    };
    let mut m = if fp8 { fp8_model_init(true, || Linear::new(dev, lc))? } else { Linear::new(dev, lc)? };
    if fp8 {
        m.params_mut().set_fp8_weight(quantize_e4m3(dev, &w)?)?;
    } else {
        m.params_mut().set_weight(w)?;
    }
    finish(m, bias)
}

/// A GEMM of the FP8-only weight `w` (shared, not copied), without bias.
pub(super) fn linear_fp8(dev: &Arc<Device>, w: Float8Tensor) -> DecoderResult<Linear> {
    let (n_out, n_in) = (w.shape()[0], w.shape()[1]);
    let lc = LinearConfig { bias: false, params_dtype: DType::BF16, init_std: 0.0, ..LinearConfig::new(n_in, n_out) };
    let mut m = fp8_model_init(true, || Linear::new(dev, lc))?;
    m.params_mut().set_fp8_weight(w)?;
    Ok(m)
}

fn finish(mut m: Linear, bias: Option<Tensor>) -> DecoderResult<Linear> {
    if let Some(b) = bias {
        m.params_mut().set_bias(b)?;
    }
    Ok(m)
}

/// `w` in E4M3 scaled by its own amax (current scaling).
pub(super) fn quantize_e4m3(dev: &Arc<Device>, w: &Tensor) -> DecoderResult<Float8Tensor> {
    let q = Float8CurrentScalingQuantizer::new(dev, DType::E4M3, Float8CurrentScaling::default())?;
    Ok(q.quantize(w, false, None)?)
}

/// Layer `l`'s modules.
#[derive(Debug)]
pub(super) struct Layer {
    norm1: Norm,
    qkv: Linear,
    /// q and k norms' weights `[head_dim]`.
    qk_norm: Option<[Tensor; 2]>,
    proj: Linear,
    post_attn_norm: Option<Norm>,
    norm2: Norm,
    fc1: Linear,
    fc2: Linear,
    post_mlp_norm: Option<Norm>,
    /// Index of the layer's RoPE table in the model's.
    pub rope: usize,
    /// The sliding window `(left, 0)`, or `None` for a global layer.
    pub window: Option<(i64, i64)>,
    activation: Activation,
}

impl Layer {
    /// Takes layer `l`'s parameters out of `t` onto the device.
    pub fn new(
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        l: usize,
        t: &mut Tensors,
        (rope, fp8): (usize, bool),
    ) -> DecoderResult<Self> {
        let p = |name: &str| format!("layers.{l}.{name}");
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let activation = cfg.activation.te_activation().ok_or_else(|| {
            DecoderError::config(
                "activation",
                format!("the GPU path has no fused kernel for {} yet: run it with --cpu", cfg.activation.name()),
            )
        })?;
        let (sa, mlp) = ("self_attention", "layernorm_mlp");
        let qkv_norm =
            (p(&format!("{sa}.layernorm_qkv.layer_norm_weight")), p(&format!("{sa}.layernorm_qkv.layer_norm_bias")));
        let norm1 = norm(dev, cfg, t, (&qkv_norm.0, &qkv_norm.1), h)?;
        let qkv_b = p(&format!("{sa}.layernorm_qkv.bias"));
        let qkv = linear(
            dev,
            t,
            (&p(&format!("{sa}.layernorm_qkv.weight")), cfg.qkv_bias.then_some(qkv_b.as_str())),
            (cfg.qkv_size(), h),
            fp8,
        )?;
        let qk_norm = if cfg.qk_norm {
            let q = upload(dev, t, &p(&format!("{sa}.q_layernorm.weight")), &[d])?;
            let k = upload(dev, t, &p(&format!("{sa}.k_layernorm.weight")), &[d])?;
            Some([q, k])
        } else {
            None
        };
        let proj_b = p(&format!("{sa}.proj.bias"));
        let proj = linear(
            dev,
            t,
            (&p(&format!("{sa}.proj.weight")), cfg.proj_bias.then_some(proj_b.as_str())),
            (h, cfg.attention_size()),
            fp8,
        )?;
        let sandwich = |t: &mut Tensors, name: &str| -> DecoderResult<Option<Norm>> {
            if cfg.sandwich_norm {
                let (w, b) = (p(&format!("{name}.weight")), p(&format!("{name}.bias")));
                Ok(Some(norm(dev, cfg, t, (&w, &b), h)?))
            } else {
                Ok(None)
            }
        };
        let post_attn_norm = sandwich(t, "post_attention_layernorm")?;
        let mlp_norm = (p(&format!("{mlp}.layer_norm_weight")), p(&format!("{mlp}.layer_norm_bias")));
        let norm2 = norm(dev, cfg, t, (&mlp_norm.0, &mlp_norm.1), h)?;
        let (fc1_b, fc2_b) = (p(&format!("{mlp}.fc1_bias")), p(&format!("{mlp}.fc2_bias")));
        let fc1 = linear(
            dev,
            t,
            (&p(&format!("{mlp}.fc1_weight")), cfg.mlp_bias.then_some(fc1_b.as_str())),
            (cfg.fc1_size(), h),
            fp8,
        )?;
        let fc2 = linear(
            dev,
            t,
            (&p(&format!("{mlp}.fc2_weight")), cfg.mlp_bias.then_some(fc2_b.as_str())),
            (h, cfg.ffn_hidden_size),
            fp8,
        )?;
        let post_mlp_norm = sandwich(t, "post_mlp_layernorm")?;
        Ok(Self {
            norm1,
            qkv,
            qk_norm,
            proj,
            post_attn_norm,
            norm2,
            fc1,
            fc2,
            post_mlp_norm,
            rope,
            window: cfg.layer_window(l),
            activation,
        })
    }

    /// Bytes of the layer's parameters on the device.
    pub fn parameter_bytes(&self) -> usize {
        let norms = [Some(&self.norm1), Some(&self.norm2), self.post_attn_norm.as_ref(), self.post_mlp_norm.as_ref()];
        let norm_bytes: usize = norms
            .into_iter()
            .flatten()
            .map(|n| n.params().weight().num_bytes() + n.params().bias().map_or(0, Tensor::num_bytes))
            .sum();
        let qk: usize = self.qk_norm.iter().flatten().map(Tensor::num_bytes).sum();
        let gemms: usize =
            [&self.qkv, &self.proj, &self.fc1, &self.fc2].iter().map(|m| m.params().parameter_bytes()).sum();
        norm_bytes + qk + gemms
    }

    /// The layer's forward over the step's packed tokens `x: [tokens, hidden]` (updated in
    /// place), appending the step's keys and values to layer `l`'s cache.
    pub fn forward(
        &mut self,
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        x: &mut Tensor,
        step: &mut Step<'_>,
        (l, inv_freq): (usize, &Tensor),
    ) -> DecoderResult<()> {
        let tokens = x.shape()[0];
        let n1 = self.norm1.infer(x)?;
        let qkv = self.qkv.infer(&n1)?;
        drop(n1);
        let o = self.attend(dev, cfg, qkv, step, (l, inv_freq))?;
        let mut a = self.proj.infer(&o)?;
        drop(o);
        if let Some(n) = &self.post_attn_norm {
            a = n.infer(&a)?;
        }
        add_assign(dev, x, &a)?;
        drop(a);
        let n2 = self.norm2.infer(x)?;
        let f = self.fc1.infer(&n2)?;
        drop(n2);
        let mut act = Tensor::empty(dev, DType::BF16, &[tokens, cfg.ffn_hidden_size])?;
        activation::forward(dev, self.activation, &f, None, &mut act, None)?;
        drop(f);
        let mut m = self.fc2.infer(&act)?;
        if let Some(n) = &self.post_mlp_norm {
            m = n.infer(&m)?;
        }
        add_assign(dev, x, &m)?;
        Ok(())
    }

    /// The layer's forward over a decode step's few token rows through the fused GEMVs
    /// (`ops::gemv`: four launches for the four GEMMs and the norms, bias, activation and
    /// residual adds around them): the pre-norm (after the previous layer's pending sandwich add)
    /// and QKV; the fused qk-norm, RoPE and cache append; the decode attention; the projection
    /// (with the residual add, or stored for the sandwich norm); the MLP norm (after the sandwich
    /// add), fc1 and the activation; fc2 (with the residual add, or left pending for the next
    /// layer's prologue). FP8 weights are read as E4M3 codes with their scale (the activations
    /// stay BF16).
    pub fn forward_decode(
        &mut self,
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        s: &mut DecodeStream,
        step: &mut Step<'_>,
        (l, inv_freq): (usize, &Tensor),
    ) -> DecoderResult<()> {
        let (tokens, h) = (s.x.shape()[0], cfg.hidden_size);
        let mut qkv = Tensor::empty(dev, DType::BF16, &[tokens, cfg.qkv_size()])?;
        s.gemv(dev, &self.norm1, (&self.qkv, GemvEpilogue::Store), &mut qkv)?;
        let o = self.attend(dev, cfg, qkv, step, (l, inv_freq))?;
        let proj = matrix(&self.proj)?;
        match &self.post_attn_norm {
            Some(post) => {
                let mut a = Tensor::empty(dev, DType::BF16, &[tokens, h])?;
                gemv(dev, GemvInput::Plain(&o), proj, GemvEpilogue::Store, &mut a)?;
                s.pending = Some((a, norm_weights(post)));
            }
            None => gemv(dev, GemvInput::Plain(&o), proj, GemvEpilogue::Residual, &mut s.x)?,
        }
        drop(o);
        let mut act = Tensor::empty(dev, DType::BF16, &[tokens, cfg.ffn_hidden_size])?;
        s.gemv(dev, &self.norm2, (&self.fc1, GemvEpilogue::Act(self.activation)), &mut act)?;
        let fc2 = matrix(&self.fc2)?;
        match &self.post_mlp_norm {
            Some(post) => {
                let mut m = Tensor::empty(dev, DType::BF16, &[tokens, h])?;
                gemv(dev, GemvInput::Plain(&act), fc2, GemvEpilogue::Store, &mut m)?;
                s.pending = Some((m, norm_weights(post)));
            }
            None => gemv(dev, GemvInput::Plain(&act), fc2, GemvEpilogue::Residual, &mut s.x)?,
        }
        Ok(())
    }

    /// The attention of a step from its projected `qkv: [tokens, qkv_size]`: qk-norm, RoPE and the
    /// cache append fused, then the decode kernels (one token per sequence) or the fused
    /// attention (a prefill) over layer `l`'s cache. Returns `o: [tokens, heads · head_dim]`.
    fn attend(
        &self,
        dev: &Arc<Device>,
        cfg: &DecoderConfig,
        qkv: Tensor,
        step: &mut Step<'_>,
        (l, inv_freq): (usize, &Tensor),
    ) -> DecoderResult<Tensor> {
        let (heads, groups, d) = (cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim);
        let tokens = qkv.shape()[0];
        let mut q = Tensor::empty(dev, DType::BF16, &[tokens, heads, d])?;
        let norm = self.qk_norm.as_ref().map(|[q, k]| QkNorm {
            q_gamma: q,
            k_gamma: k,
            eps: cfg.layernorm_epsilon,
            zero_centered_gamma: cfg.zero_centered_gamma,
        });
        // The layer's view of the cache: its own rows (a sliding-window layer's may be fewer).
        let view = step.tables.for_layer(self.window);
        let dims = (heads, groups, d);
        match step.cache.layer_mut(l) {
            (cache, Some(sc)) => qkv_rope_fp8(dev, &qkv, dims, norm, inv_freq, &view.rows, &mut q, cache, sc)?,
            (cache, None) => qkv_rope(dev, &qkv, dims, norm, inv_freq, &view.rows, &mut q, cache)?,
        }
        drop(qkv);
        let mut o = Tensor::empty(dev, DType::BF16, &[tokens, heads * d])?;
        match &mut view.attention {
            StepAttention::Decode { seqlens } => {
                let p = view.shape.decode_shape(cfg, self.window);
                let qs = Strided { tensor: &q, offset: 0, row: heads * d };
                let cache = step.cache.layer(l);
                match step.cache.scales() {
                    Some(sc) => decode_fp8(dev, &p, qs, cache, sc, seqlens, (&mut o, heads * d))?,
                    None => decode(dev, &p, qs, cache, seqlens, (&mut o, heads * d))?,
                }
            }
            StepAttention::Prefill { cu_q, cu_kv, off_kv, lse } => {
                let [k_cache, v_cache] = step.cache.prefill_layer(dev, l)?;
                let shape = view.shape.prefill_shape(cfg, self.window);
                let p = FlashAttnParams {
                    shape,
                    q: shape.q_strides(),
                    kv: shape.k_strides(),
                    v: shape.v_strides(),
                    o: shape.o_strides(),
                };
                let cu = CuSeqlens { q: cu_q, kv: cu_kv, offsets: Some((cu_q, off_kv)) };
                flash_attention::forward(dev, &p, Qkv::Apart([&q, k_cache, v_cache]), Some(cu), &mut o, lse)?;
            }
        }
        Ok(o)
    }
}

/// A norm module's weights as the GEMV prologue reads them (`γ` and LayerNorm's `β`, shared).
pub(super) fn norm_weights(n: &Norm) -> (Tensor, Option<Tensor>) {
    (n.params().weight().clone(), n.params().bias().cloned())
}

/// A GEMM module's weight (BF16, or its E4M3 codes with their scale) and bias as the GEMV reads
/// them ([`te_nn::modules::LinearParams::gemv_matrix`]).
pub(super) fn matrix(m: &Linear) -> DecoderResult<GemvMatrix<'_>> {
    m.params()
        .gemv_matrix()
        .ok_or_else(|| DecoderError::config("precision", "the decode GEMV reads BF16 or per-tensor FP8 weights only"))
}

/// The residual stream of a decode step between the fused GEMVs: the hidden rows `x: [tokens,
/// hidden]`, and a sandwich-norm sublayer's output not yet post-normed and added, with its
/// post-norm's weights (the next GEMV's `AddNorm` prologue adds it).
#[derive(Debug)]
pub(super) struct DecodeStream {
    /// `[tokens, hidden]` BF16.
    pub x: Tensor,
    /// The pending sublayer output `[tokens, hidden]` and its post-norm's `γ`, `β`.
    pub pending: Option<(Tensor, (Tensor, Option<Tensor>))>,
}

impl DecodeStream {
    /// The stream of the embedded rows `x`.
    pub fn new(x: Tensor) -> Self {
        Self { x, pending: None }
    }

    /// `out = epilogue(pre(x) · w)` for the module `m` after the pre-norm `pre`, adding the
    /// pending sublayer output into the stream first when there is one (the GEMV's `AddNorm`;
    /// the model's norms share `pre`'s kind and options).
    pub fn gemv(
        &mut self,
        dev: &Arc<Device>,
        pre: &Norm,
        (m, epilogue): (&Linear, GemvEpilogue),
        out: &mut Tensor,
    ) -> DecoderResult<()> {
        let mat = matrix(m)?;
        let (kind, norm) = pre
            .params()
            .gemv_norm()
            .ok_or_else(|| DecoderError::config("precision", "the decode GEMV reads BF16 norm weights only"))?;
        match self.pending.take() {
            None => gemv(dev, GemvInput::Norm { x: &self.x, kind, norm }, mat, epilogue, out)?,
            Some((a, (gamma, beta))) => {
                let mut h = Tensor::empty(dev, DType::BF16, self.x.shape())?;
                let post = GemvNorm { gamma: &gamma, beta: beta.as_ref() };
                let input = GemvInput::AddNorm { x: &self.x, a: &a, kind, post, norm, h_out: &mut h };
                gemv(dev, input, mat, epilogue, out)?;
                self.x = h;
            }
        }
        Ok(())
    }
}
