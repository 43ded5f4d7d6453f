//! The kernels each module runs: the device-free lists of the module configs, the one home of
//! the per-module kernel lists. A built module's [`Module::kernel_specs`](super::Module) is its
//! config's list; `te prewarm` compiles them ahead of time ([`crate::prewarm::ModelConfig`],
//! `te_codegen::prewarm::prewarm`).
//!
//! Every list is for a [`KernelTarget`] (precision, FP8 recipe, key length, RoPE, GPU), with the
//! config's own `params_dtype` overriding the target's where the config has one, and holds the
//! kernels of both the FP8 path and (where it differs) the high-precision one, forward and
//! backward: a superset of what one step loads. Lists may repeat kernels;
//! `te_codegen::prewarm::sorted` deduplicates.

use super::multihead_attention::QkvProjConfig;
use super::transformer_layer::MlpConfig;
use super::{
    DotProductAttentionConfig, EmbeddingConfig, GroupedLinearConfig, KernelSpec, KernelTarget, LayerNormLinearConfig,
    LayerNormMLPConfig, LinearConfig, MoeMLPConfig, MultiheadAttentionConfig, NormConfig, NormKind,
    TransformerLayerConfig,
};
use te_codegen::spec::{
    ActivationSpec, AttnMergeSpec, CastTransposeSpec, Direction, DropoutSpec, ElementwiseSpec, EmbeddingSpec,
    FlashAttnSpec, MaskKind, MoePermuteSpec, MoeRouterSpec, NormSpec, RopeSpec, ScalingSpec, SoftmaxSpec,
};
use te_codegen::DType;
use te_runtime::ops::flash_attention_fp8;

/// A LayerNorm or RMSNorm over `hidden` features in `t`'s dtype: forward with an FP8 output
/// (feeding a GEMM) and a plain one, and backward.
fn norm(t: &KernelTarget, kind: NormKind, hidden: usize, zero_centered_gamma: bool, specs: &mut Vec<KernelSpec>) {
    let (dt, arch) = (t.params_dtype, t.arch);
    for out in [t.fwd_fp8(), dt] {
        specs.push(NormSpec::new(kind, Direction::Fwd, dt, out, dt, hidden, zero_centered_gamma, arch).into());
    }
    specs.push(NormSpec::new(kind, Direction::Bwd, dt, dt, dt, hidden, zero_centered_gamma, arch).into());
}

/// A GEMM layer `[tokens, in_features] → [tokens, out_features]` in `t`'s dtype:
/// [`KernelTarget::fp8_common`]; the cast + transpose of the input (and of a weight with
/// `in_features` inputs) saved for wgrad and the byte transpose of its FP8 codes (an FP8 input or
/// cached weight); the cast + transpose (+ dbias with `bias`) of `dY`, and the accumulation of
/// the weight gradient (into `params_dtype` gradients and an f32 `main_grad`) and bias gradient.
fn linear(t: &KernelTarget, in_features: usize, out_features: usize, bias: bool, specs: &mut Vec<KernelSpec>) {
    let (dt, arch) = (t.params_dtype, t.arch);
    t.fp8_common(specs);
    specs.push(CastTransposeSpec::new(dt, t.fwd_fp8(), in_features, false, None, arch).into());
    specs.push(CastTransposeSpec::transpose(t.fwd_fp8(), in_features, arch).into());
    specs.push(CastTransposeSpec::new(dt, t.bwd_fp8(), out_features, bias, None, arch).into());
    specs.push(ElementwiseSpec::add_assign(DType::F32, dt, arch).into());
    specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
}

impl LinearConfig {
    /// The kernels a `Linear` of this config runs for `target` (this config's `params_dtype`
    /// applies): [`KernelTarget::fp8_common`], the cast + transpose of the input
    /// `[tokens, in_features]` (and of the weight) saved for wgrad, the byte transpose of an FP8
    /// input or cached weight, the cast + transpose (+ dbias with `bias`) of
    /// `dY: [tokens, out_features]`, and gradient accumulation (into the `params_dtype`
    /// gradients and an f32 `main_grad`). With `tp`, for this rank's slice of the features.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let (n_in, n_out) = self.local_features();
        linear(&target.with_dtype(self.params_dtype), n_in, n_out, self.bias, specs);
    }
}

impl GroupedLinearConfig {
    /// The kernels a `GroupedLinear` of this config runs for `target`: those of one of its
    /// GEMMs ([`LinearConfig::kernel_specs`]; the row groups move by copies, no kernel), and on
    /// Hopper, for a layer the device-`m_splits` path can take (16-bit, features multiples of
    /// 16), its grouped GEMMs: fprop, dgrad (the weights MN-major) and wgrad (written or
    /// accumulated into the gradients' dtype, or the f32 `main_grad`), and with `bias` the bias
    /// gradient's column sums (into the `params_dtype` gradient).
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        linear(&target.with_dtype(self.params_dtype), self.in_features, self.out_features, self.bias, specs);
        let t = self.params_dtype;
        let device_path =
            matches!(t, DType::BF16 | DType::F16) && self.in_features % 16 == 0 && self.out_features % 16 == 0;
        if target.arch == te_codegen::Arch::Sm90a && device_path {
            use te_codegen::spec::{GroupedGemmSpec, GroupedSplit};
            let rows = GroupedGemmSpec::new(GroupedSplit::Rows, t, t, t, target.arch);
            specs.push(rows.into());
            specs.push(rows.with_major(true, false).into());
            let wgrad_dtype = if self.fuse_wgrad_accumulation { DType::F32 } else { self.params_dtype };
            let wgrad =
                GroupedGemmSpec::new(GroupedSplit::Reduction, t, t, wgrad_dtype, target.arch).with_major(false, false);
            specs.push(wgrad.accumulating(true).into());
            if !self.fuse_wgrad_accumulation {
                specs.push(wgrad.into());
            } else if self.bias {
                let dbias =
                    GroupedGemmSpec::new(GroupedSplit::Reduction, t, t, t, target.arch).with_major(false, false);
                specs.push(dbias.accumulating(true).into());
                specs.push(dbias.into());
            }
        }
    }
}

impl NormConfig {
    /// The kernels a norm of `kind` (the `Norm` constructor's argument, beside this config)
    /// over `hidden_size` features runs for `target` (this config's `params_dtype` applies):
    /// forward with an FP8 output (feeding a GEMM) and a plain one, and backward.
    pub fn kernel_specs(&self, kind: NormKind, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        norm(&target.with_dtype(self.params_dtype), kind, self.hidden_size, self.zero_centered_gamma, specs);
    }
}

impl LayerNormLinearConfig {
    /// The kernels a `LayerNormLinear` of this config runs for `target` (this config's
    /// `params_dtype` applies): the norm's over `in_features` ([`NormConfig::kernel_specs`]) and
    /// the GEMM's ([`LinearConfig::kernel_specs`]).
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let t = target.with_dtype(self.params_dtype);
        norm(&t, self.normalization, self.in_features, self.zero_centered_gamma, specs);
        linear(&t, self.in_features, self.out_features, self.bias, specs);
    }
}

impl LayerNormMLPConfig {
    /// The kernels a `LayerNormMLP` of this config runs for `target` (this config's
    /// `params_dtype` applies): the norm and fc1 `hidden → ffn` (`2 · ffn` outputs when gated) as
    /// [`LayerNormLinearConfig::kernel_specs`]; the activation forward into FP8 (bias fused or
    /// not) and in high precision (no FP8, current scaling), and its backward; the fused
    /// dact + cast + transpose (+ dbias) of fc1's `dY` (GELU, ReLU); fc2 `ffn → hidden` as
    /// [`LinearConfig::kernel_specs`].
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let t = target.with_dtype(self.params_dtype);
        let (dt, arch, act, ffn) = (t.params_dtype, t.arch, self.activation, self.ffn_hidden_size);
        let fc1_out = if act.is_gated() { 2 * ffn } else { ffn };
        norm(&t, self.normalization, self.hidden_size, self.zero_centered_gamma, specs);
        linear(&t, self.hidden_size, fc1_out, self.bias, specs);
        for fused_bias in [false, true] {
            specs.push(ActivationSpec::new(act, Direction::Fwd, dt, t.fwd_fp8(), ffn, fused_bias, arch).into());
        }
        specs.push(ActivationSpec::new(act, Direction::Fwd, dt, dt, ffn, false, arch).into());
        specs.push(ActivationSpec::new(act, Direction::Bwd, dt, dt, ffn, false, arch).into());
        if !act.is_gated() {
            specs.push(CastTransposeSpec::new(dt, t.bwd_fp8(), ffn, self.bias, Some(act), arch).into());
        }
        linear(&t, ffn, self.hidden_size, self.bias, specs);
    }
}

impl MoeMLPConfig {
    /// The kernels a `MoeMLP` of this config runs for `target` (this config's `params_dtype`
    /// applies): the norm's over `hidden_size` ([`NormConfig::kernel_specs`]); the router's
    /// (a `Linear` `hidden → num_experts` without bias, [`LinearConfig::kernel_specs`]: a
    /// superset, it runs in high precision); the top-k router, its backward and the aux loss
    /// with its backward (`MoeRouterSpec`, in the model's dtype and in bf16, which the aux loss
    /// always loads); the routing map, permute, unpermute and the probabilities' gradient
    /// (`MoePermuteSpec`, the model's dtype and bf16, which the routing map loads); the experts'
    /// fc1 and fc2 ([`GroupedLinearConfig::kernel_specs`]); the activation forward and backward
    /// in high precision; the sum of the experts' and the router's input gradients.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let t = target.with_dtype(self.params_dtype);
        let (dt, arch, ffn) = (t.params_dtype, t.arch, self.ffn_hidden_size);
        let (norm_cfg, router, fc1, fc2) = self.parts();
        norm_cfg.kernel_specs(self.normalization, &t, specs);
        router.kernel_specs(&t, specs);
        for d in [dt, DType::BF16] {
            specs.push(KernelSpec::MoeRouter(MoeRouterSpec::new(d, self.num_experts, arch)));
            specs.push(KernelSpec::MoePermute(MoePermuteSpec::new(d, arch)));
        }
        fc1.kernel_specs(&t, specs);
        specs.push(ActivationSpec::new(self.activation, Direction::Fwd, dt, dt, ffn, false, arch).into());
        specs.push(ActivationSpec::new(self.activation, Direction::Bwd, dt, dt, ffn, false, arch).into());
        fc2.kernel_specs(&t, specs);
        specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
    }
}

impl DotProductAttentionConfig {
    /// The kernels a `DotProductAttention` of this config runs in training for `target`, in the
    /// target's dtype (that of q, k, v). On the fused backend: the FlashAttention-2 forward and
    /// backward of the head dim (their dropout variants with `attention_dropout`), the LSE merge
    /// and gradient sum of the context-parallel ring, and with a
    /// recipe that sets `fp8_dpa` the FP8 forward (with its `_quantize`) and the FP8 casts and
    /// scaling kernels of the recipe, where the FP8 kernels take the head dim and arch, and the
    /// FP8 backward where its kernels take the call. On the unfused one: the softmax forward for the mask and its
    /// backward at [`KernelTarget::seq_length`] keys, dropout of the probabilities and its
    /// backward, and (GQA, fewer key/value groups than heads) the f32 sum of the key/value
    /// gradients over the heads of a group.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let (dt, arch, sk) = (target.params_dtype, target.arch, target.seq_length);
        if self.runs_fused(dt, arch) {
            let dropout = self.attention_dropout > 0.0;
            for dir in [Direction::Fwd, Direction::Bwd] {
                specs.push(KernelSpec::FlashAttn(
                    FlashAttnSpec::new(dir, dt, self.kv_channels, arch)
                        .with_head_dim_v(self.kv_channels_v())
                        .with_dropout(dropout),
                ));
            }
            // The LSE merge and the gradient sums of the context-parallel ring (one small kernel a
            // dtype: the config does not say whether a run splits its sequences).
            specs.push(AttnMergeSpec::new(dt, arch).into());
            specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
            // fp8_dpa: the FP8 forward and its casts where the FP8 kernels take the call.
            let d = self.kv_channels;
            let fp8_takes =
                d == self.kv_channels_v() && flash_attention_fp8::unsupported_reason(arch, dt, d, false).is_none();
            if target.recipe.fp8_dpa() && fp8_takes {
                specs.push(FlashAttnSpec::fp8_forward(dt, d, arch).with_dropout(dropout).into());
                target.fp8_common(specs);
                // The FP8 backward where its kernels take the call; dS's delayed scale update
                // (the recipe's dS recipe: the run's own under delayed scaling, history 1 from
                // the most recent amax under current scaling).
                if flash_attention_fp8::backward_unsupported_reason(arch, dt, d, false, dropout).is_none() {
                    let e5m2 = target.bwd_fp8() == DType::E5M2;
                    specs.push(FlashAttnSpec::fp8_backward(dt, d, arch, e5m2).into());
                    let ds = target.recipe.attention_ds_recipe();
                    specs.push(ScalingSpec::delayed(ds.amax_compute_algo, arch).into());
                }
            }
            return;
        }
        let heads = self.num_attention_heads;
        specs.push(SoftmaxSpec::new(self.softmax_mask(), Direction::Fwd, dt, sk, arch).into());
        specs.push(SoftmaxSpec::new(MaskKind::None, Direction::Bwd, dt, sk, arch).into());
        specs.push(DropoutSpec::forward(dt, dt, false, false, arch).into());
        specs.push(DropoutSpec::backward(dt, dt, arch).into());
        if self.num_gqa_groups.unwrap_or(heads) < heads {
            specs.push(ElementwiseSpec::add_assign(dt, DType::F32, arch).into());
        }
    }
}

impl MultiheadAttentionConfig {
    /// The kernels a `MultiheadAttention` of this config runs for `target` (this config's
    /// `params_dtype` applies): those of its QKV projection (behind the input norm with
    /// `input_layernorm`), its attention, the q/k norms (with `qk_norm_type`), RoPE of q and k
    /// over the head dimension (forward and backward, with [`KernelTarget::rotary`]) and its
    /// output projection. A config
    /// `MultiheadAttention::new` rejects (heads or groups that do not divide) adds nothing: no
    /// such module runs.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let Ok(parts) = self.parts() else { return };
        match &parts.qkv {
            QkvProjConfig::Norm(c) => c.kernel_specs(target, specs),
            QkvProjConfig::Plain(c) => c.kernel_specs(target, specs),
        }
        let t = target.with_dtype(self.params_dtype);
        parts.attention.kernel_specs(&t, specs);
        if let Some((kind, c)) = &parts.qk_norm {
            c.kernel_specs(*kind, &t, specs);
        }
        if t.rotary {
            let d = parts.attention.kv_channels;
            for dir in [Direction::Fwd, Direction::Bwd] {
                specs.push(RopeSpec::new(dir, self.rope_format(), t.params_dtype, d, d, t.arch).into());
            }
        }
        parts.proj.kernel_specs(&t, specs);
    }
}

impl TransformerLayerConfig {
    /// The kernels a `TransformerLayer` of this config runs for `target` (this config's
    /// `params_dtype` applies): those of its self-attention
    /// ([`MultiheadAttentionConfig::kernel_specs`]), its MLP
    /// ([`LayerNormMLPConfig::kernel_specs`], or [`MoeMLPConfig::kernel_specs`] with `moe`) and, post-LN, its output norm, from the part
    /// configs `TransformerLayer::new` builds; and the residual connections:
    /// `residual + dropout(x)` (with and without a fused bias), its backward, the add of two
    /// branches and the accumulation of the residual gradient.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let parts = self.parts();
        parts.attention.kernel_specs(target, specs);
        match &parts.mlp {
            MlpConfig::Dense(c) => c.kernel_specs(target, specs),
            MlpConfig::Moe(c) => c.kernel_specs(target, specs),
        }
        if let Some((kind, c)) = &parts.output_norm {
            c.kernel_specs(*kind, target, specs);
        }
        let (dt, arch) = (self.params_dtype, target.arch);
        for bias in [false, true] {
            specs.push(DropoutSpec::forward(dt, dt, bias, true, arch).into());
        }
        specs.push(DropoutSpec::backward(dt, dt, arch).into());
        specs.push(ElementwiseSpec::add(dt, dt, dt, arch).into());
        specs.push(ElementwiseSpec::add_assign(dt, dt, arch).into());
    }

    /// The decode GEMVs a generation step of one or two sequences runs through
    /// (`TransformerLayer::infer_cached` of a pre-LN BF16 layer with a dense MLP, no tensor
    /// parallelism; none for other layers): the norm + QKV, the projection, the residual add +
    /// MLP norm + fc1 + activation, fc2 + the residual add, at each row count. Not part of
    /// [`TransformerLayerConfig::kernel_specs`]: a model that generates adds them (the GPT's list
    /// does).
    pub fn decode_gemv_specs(&self, arch: te_codegen::Arch, specs: &mut Vec<KernelSpec>) {
        use te_codegen::spec::{GemvEpilogue, GemvPrologue};
        use te_runtime::ops::gemv::{gemv_spec, max_rows, DECODE_MAX_ROWS};
        let parts = self.parts();
        let (MlpConfig::Dense(mlp), a) = (&parts.mlp, &parts.attention) else { return };
        let width = a.num_attention_heads * a.kv_channels.unwrap_or(a.hidden_size / a.num_attention_heads.max(1));
        let (h, ffn) = (self.hidden_size, self.ffn_hidden_size);
        let fits = [h, width, ffn].iter().all(|&k| k % 16 == 0 && max_rows(k) >= DECODE_MAX_ROWS);
        if self.params_dtype != DType::BF16
            || self.output_layernorm
            || self.apply_residual_connection_post_layernorm
            || self.tp.is_some()
            || !fits
        {
            return;
        }
        let (kind, zc) = (self.normalization, self.zero_centered_gamma);
        let plain = (GemvPrologue::None, kind, false);
        let qkv_bias = a.qkv_bias.unwrap_or(a.bias);
        for m in 1..=DECODE_MAX_ROWS {
            let spec = |k, prologue, epilogue| gemv_spec(arch, DType::BF16, (k, m), prologue, epilogue).into();
            specs.push(spec(h, (GemvPrologue::Norm, kind, zc), (qkv_bias, GemvEpilogue::Store)));
            specs.push(spec(width, plain, (a.bias, GemvEpilogue::Store)));
            specs.push(spec(h, (GemvPrologue::ResidualNorm, kind, zc), (mlp.bias, GemvEpilogue::Act(mlp.activation))));
            specs.push(spec(ffn, plain, (mlp.bias, GemvEpilogue::Residual)));
        }
    }
}

impl EmbeddingConfig {
    /// The kernels an `Embedding` of this config runs for `target` (this config's
    /// `params_dtype` applies): the gather forward and the scatter-add backward into a
    /// `params_dtype` gradient.
    pub fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, target.arch);
        specs.push(EmbeddingSpec::forward(dt, arch).into());
        specs.push(EmbeddingSpec::backward(dt, dt, arch).into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::{DelayedScaling, Float8CurrentScaling, Format};
    use crate::modules::AttnMaskType;
    use te_codegen::spec::{CastSpec, ScalingSpec};
    use te_codegen::Arch;

    #[test]
    fn lists_follow_the_target() {
        let t = KernelTarget::new(1024, Arch::Sm90a);
        let mut specs = Vec::new();
        LinearConfig { bias: false, ..LinearConfig::new(768, 256) }.kernel_specs(&t, &mut specs);
        let dy: KernelSpec = CastTransposeSpec::new(DType::BF16, DType::E5M2, 256, false, None, Arch::Sm90a).into();
        assert!(specs.contains(&dy), "no dbias without a bias");
        let e4m3 = KernelTarget {
            recipe: Float8CurrentScaling { fp8_format: Format::E4M3, ..Default::default() }.into(),
            ..t.with_dtype(DType::F16)
        };
        specs.clear();
        e4m3.fp8_common(&mut specs);
        assert!(specs.iter().all(|s| !matches!(s, KernelSpec::Cast(c) if c.output == DType::E5M2)));
        assert!(specs.contains(&CastSpec::amax(DType::F16, Arch::Sm90a).into()));
        specs.clear();
        let attention = DotProductAttentionConfig {
            attn_mask_type: AttnMaskType::Causal,
            ..DotProductAttentionConfig::new(12, 64)
        };
        attention.kernel_specs(&t, &mut specs);
        EmbeddingConfig::new(256, 768).kernel_specs(&t, &mut specs);
        // bf16 at head_dim 64 runs fused (with attention dropout too); f32 unfused, at the target's keys.
        assert!(specs.contains(&FlashAttnSpec::new(Direction::Fwd, DType::BF16, 64, Arch::Sm90a).into()));
        assert!(!specs.iter().any(|s| matches!(s, KernelSpec::Softmax(_))));
        assert!(specs.contains(&EmbeddingSpec::backward(DType::BF16, DType::BF16, Arch::Sm90a).into()));
        specs.clear();
        attention.kernel_specs(&t.with_dtype(DType::F32), &mut specs);
        assert!(
            specs.contains(&SoftmaxSpec::new(MaskKind::Causal, Direction::Fwd, DType::F32, 1024, Arch::Sm90a).into())
        );
        specs.clear();
        DotProductAttentionConfig { attention_dropout: 0.1, ..attention }.kernel_specs(&t, &mut specs);
        let dropout = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 64, Arch::Sm90a).with_dropout(true);
        // The forward and backward, and the context-parallel ring's LSE merge and gradient sum.
        assert_eq!(specs.len(), 4, "{specs:?}");
        assert!(specs.contains(&AttnMergeSpec::new(DType::BF16, Arch::Sm90a).into()), "{specs:?}");
        assert!(specs.contains(&dropout.into()), "{specs:?}");
        // fp8_dpa adds the FP8 forward at head_dim 128 on Hopper, nothing at 64 or on Ada.
        let fp8_dpa = KernelTarget { recipe: DelayedScaling { fp8_dpa: true, ..Default::default() }.into(), ..t };
        let fp8 = FlashAttnSpec::fp8_forward(DType::BF16, 128, Arch::Sm90a);
        for (d, arch, want) in [(128, Arch::Sm90a, true), (64, Arch::Sm90a, false), (128, Arch::Sm89, false)] {
            specs.clear();
            DotProductAttentionConfig::new(8, d).kernel_specs(&KernelTarget { arch, ..fp8_dpa }, &mut specs);
            let has = specs.iter().any(|s| matches!(s, KernelSpec::FlashAttn(f) if f.fp8));
            assert_eq!(has, want, "head_dim {d} on {arch}: {specs:?}");
        }
        specs.clear();
        DotProductAttentionConfig::new(8, 128).kernel_specs(&fp8_dpa, &mut specs);
        assert!(
            specs.contains(&fp8.into())
                && specs.contains(&ScalingSpec::delayed(te_codegen::spec::AmaxComputeAlgo::Max, Arch::Sm90a).into())
        );
        // ... and the FP8 backward (E5M2 gradients under HYBRID), but not with attention dropout.
        assert!(specs.contains(&FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true).into()), "{specs:?}");
        // Under current scaling dS keeps a delayed scale of history 1 from the most recent amax.
        let most_recent: KernelSpec =
            ScalingSpec::delayed(te_codegen::spec::AmaxComputeAlgo::MostRecent, Arch::Sm90a).into();
        assert!(!specs.contains(&most_recent));
        specs.clear();
        let current = KernelTarget { recipe: Float8CurrentScaling { fp8_dpa: true, ..Default::default() }.into(), ..t };
        DotProductAttentionConfig::new(8, 128).kernel_specs(&current, &mut specs);
        assert!(specs.contains(&most_recent) && specs.contains(&ScalingSpec::current(false, Arch::Sm90a).into()));
        specs.clear();
        let dropout = DotProductAttentionConfig { attention_dropout: 0.1, ..DotProductAttentionConfig::new(8, 128) };
        dropout.kernel_specs(&fp8_dpa, &mut specs);
        assert!(!specs.iter().any(|s| matches!(s, KernelSpec::FlashAttn(f) if f.fp8 && f.direction == Direction::Bwd)));
        specs.clear();
        DotProductAttentionConfig::new(8, 128).kernel_specs(&t, &mut specs);
        assert!(!specs.contains(&fp8.into()), "no fp8_dpa, no FP8 forward");
    }
}
