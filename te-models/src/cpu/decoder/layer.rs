//! One layer of [`DecoderRef`]: its parameters (taken from the internal names) and its forward
//! over packed tokens (the formula of the [`crate::decoder`] docs).

use super::cache::{AttentionParams, DecoderKvCache};
use super::{take, DecoderRef, Dense, Norm};
use crate::decoder::{DecoderConfig, DecoderResult, WeightTensor};
use rayon::prelude::*;
use std::collections::BTreeMap;
use te_codegen::spec::RopeFormat;
use te_codegen::DType;
use te_nn::modules::NormKind;

type Tensors = BTreeMap<String, WeightTensor>;

/// A norm's parameters under `prefix` + `weight` (and `bias` for LayerNorm).
fn take_norm(cfg: &DecoderConfig, t: &mut Tensors, weight: &str, bias: &str) -> DecoderResult<Norm> {
    let beta = if cfg.normalization == NormKind::LayerNorm { Some(take(t, bias)?) } else { None };
    Ok(Norm { gamma: take(t, weight)?, beta })
}

/// The final norm's parameters.
pub(super) fn take_final_norm(cfg: &DecoderConfig, t: &mut Tensors) -> DecoderResult<Norm> {
    take_norm(cfg, t, "final_norm.weight", "final_norm.bias")
}

/// Layer `l`'s parameters (see [`crate::decoder`] for the names).
#[derive(Debug, Clone)]
pub(super) struct Layer {
    norm1: Norm,
    qkv: Dense,
    q_norm: Option<Norm>,
    k_norm: Option<Norm>,
    proj: Dense,
    post_attn_norm: Option<Norm>,
    norm2: Norm,
    fc1: Dense,
    fc2: Dense,
    post_mlp_norm: Option<Norm>,
}

impl Layer {
    /// Takes layer `l`'s parameters out of `t`, GEMM weights `[n_out, n_in]` through `weight(w, n_out)`.
    pub fn take(
        cfg: &DecoderConfig,
        l: usize,
        t: &mut Tensors,
        weight: &dyn Fn(Vec<f32>, usize) -> Vec<f32>,
    ) -> DecoderResult<Self> {
        let p = |name: &str| format!("layers.{l}.{name}");
        let dense = |t: &mut Tensors, w: &str, b: Option<&str>, n_out: usize| -> DecoderResult<Dense> {
            let w = weight(take(t, &p(w))?, n_out);
            let b = b.map(|b| take(t, &p(b))).transpose()?;
            Ok(Dense { w, b, n_out })
        };
        let (sa, mlp) = ("self_attention", "layernorm_mlp");
        let norm1 = take_norm(
            cfg,
            t,
            &p(&format!("{sa}.layernorm_qkv.layer_norm_weight")),
            &p(&format!("{sa}.layernorm_qkv.layer_norm_bias")),
        )?;
        let qkv_bias = format!("{sa}.layernorm_qkv.bias");
        let qkv = dense(t, &format!("{sa}.layernorm_qkv.weight"), cfg.qkv_bias.then_some(&qkv_bias), cfg.qkv_size())?;
        let qk = |t: &mut Tensors, which: &str| -> DecoderResult<Option<Norm>> {
            cfg.qk_norm
                .then(|| {
                    take_norm(
                        cfg,
                        t,
                        &p(&format!("{sa}.{which}_layernorm.weight")),
                        &p(&format!("{sa}.{which}_layernorm.bias")),
                    )
                })
                .transpose()
        };
        let (q_norm, k_norm) = (qk(t, "q")?, qk(t, "k")?);
        let proj_bias = format!("{sa}.proj.bias");
        let proj = dense(t, &format!("{sa}.proj.weight"), cfg.proj_bias.then_some(&proj_bias), cfg.hidden_size)?;
        let sandwich = |t: &mut Tensors, name: &str| -> DecoderResult<Option<Norm>> {
            cfg.sandwich_norm
                .then(|| take_norm(cfg, t, &p(&format!("{name}.weight")), &p(&format!("{name}.bias"))))
                .transpose()
        };
        let post_attn_norm = sandwich(t, "post_attention_layernorm")?;
        let norm2 = take_norm(cfg, t, &p(&format!("{mlp}.layer_norm_weight")), &p(&format!("{mlp}.layer_norm_bias")))?;
        let (fc1_bias, fc2_bias) = (format!("{mlp}.fc1_bias"), format!("{mlp}.fc2_bias"));
        let fc1 = dense(t, &format!("{mlp}.fc1_weight"), cfg.mlp_bias.then_some(&fc1_bias), cfg.fc1_size())?;
        let fc2 = dense(t, &format!("{mlp}.fc2_weight"), cfg.mlp_bias.then_some(&fc2_bias), cfg.hidden_size)?;
        let post_mlp_norm = sandwich(t, "post_mlp_layernorm")?;
        Ok(Self { norm1, qkv, q_norm, k_norm, proj, post_attn_norm, norm2, fc1, fc2, post_mlp_norm })
    }

    /// `x + post_norm(y)` (the residual add, with Gemma's sandwich norm when present).
    fn residual(m: &DecoderRef, x: &[f32], y: Vec<f32>, post: &Option<Norm>) -> Vec<f32> {
        let y = match post {
            Some(n) => m.norm(n).forward(&y),
            None => y,
        };
        x.iter().zip(&y).map(|(a, b)| a + b).collect()
    }

    /// Layer `l` over `x` `[T, hidden]`: `lens[j]` new tokens of sequence `j` (packed in order),
    /// at the positions after the cache's; appends their keys and values to the cache.
    pub fn forward(
        &self,
        m: &DecoderRef,
        l: usize,
        x: Vec<f32>,
        lens: &[usize],
        cache: &mut DecoderKvCache,
    ) -> DecoderResult<Vec<f32>> {
        let cfg = m.config();
        let (h, t) = (cfg.hidden_size, x.len() / cfg.hidden_size);
        let (heads, groups, d) = (cfg.num_attention_heads, cfg.num_gqa_groups, cfg.head_dim);
        let (qw, kw) = (heads * d, groups * d);
        let a = m.norm(&self.norm1).forward(&x);
        let qkv = m.layer_linear(&a, t, &self.qkv);
        let (mut q, mut k, mut v) =
            (Vec::with_capacity(t * qw), Vec::with_capacity(t * kw), Vec::with_capacity(t * kw));
        for row in qkv.chunks_exact(qw + 2 * kw) {
            q.extend_from_slice(&row[..qw]);
            k.extend_from_slice(&row[qw..qw + kw]);
            v.extend_from_slice(&row[qw + kw..]);
        }
        // qk-norm: RMSNorm over each head's channels (rows of head_dim).
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = m.norm(qn).forward(&q);
            k = m.norm(kn).forward(&k);
        }
        let rope = cfg.layer_rope(l);
        let params = AttentionParams {
            heads,
            groups,
            head_dim: d,
            scale: cfg.softmax_scale(),
            window: cfg.layer_window(l),
            softcap: cfg.attn_logit_softcapping,
        };
        let starts: Vec<usize> = lens.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect();
        let positions: Vec<usize> = cache.lens().to_vec();
        let (seqs, keep) = cache.layer_mut(l);
        let outs: Vec<DecoderResult<Vec<f32>>> = seqs
            .par_iter_mut()
            .enumerate()
            .map(|(j, kv)| {
                let (t0, s, p0) = (starts[j], lens[j], positions[j]);
                if s == 0 {
                    return Ok(Vec::new());
                }
                let angles = rope.angles(d, p0..p0 + s);
                let rot = |x: &[f32], n: usize| {
                    te_reference::rope::forward(x, &angles, RopeFormat::Sbhd, [s, 1, n, d], d, DType::F32)
                };
                let qj = rot(&q[t0 * qw..(t0 + s) * qw], heads);
                let kj = rot(&k[t0 * kw..(t0 + s) * kw], groups);
                kv.attend(&qj, &kj, &v[t0 * kw..(t0 + s) * kw], &params, keep)
            })
            .collect();
        let mut o = Vec::with_capacity(t * qw);
        for out in outs {
            o.extend(out?);
        }
        let attn = m.layer_linear(&o, t, &self.proj);
        let x = Self::residual(m, &x, attn, &self.post_attn_norm);
        let n2 = m.norm(&self.norm2).forward(&x);
        let pre = m.layer_linear(&n2, t, &self.fc1);
        let (f, act) = (cfg.ffn_hidden_size, cfg.activation.function());
        let hidden: Vec<f32> = if cfg.activation.is_gated() {
            pre.chunks_exact(2 * f).flat_map(|r| (0..f).map(move |c| act(r[c]) * r[f + c])).collect()
        } else {
            pre.iter().map(|&v| act(v)).collect()
        };
        let mlp = m.layer_linear(&hidden, t, &self.fc2);
        debug_assert_eq!(mlp.len(), t * h);
        Ok(Self::residual(m, &x, mlp, &self.post_mlp_norm))
    }
}
