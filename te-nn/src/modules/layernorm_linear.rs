//! `LayerNormLinear`: a LayerNorm or RMSNorm fused in front of a `Linear` (TE
//! `pytorch/module/layernorm_linear.py`). Under FP8 the norm's output goes through the GEMM's
//! input quantizer: with delayed scaling the norm kernel writes the GEMM input in FP8 directly
//! (cast and amax fused) and a byte transpose of those codes is saved for wgrad, no extra pass
//! over the high-precision activation; with current scaling it is cast after the norm.

use super::linear::check_input;
use super::linear::gemm_core::{LinearCore, Saved};
use super::linear::norm_input::norm_gemm_input;
use super::norm::{NormConfig, NormKind, NormParams, NormStats};
use super::params::{LinearParams, ParamsInit};
use super::{next_module_id, BackwardOptions, ForwardOptions, Output, Stamp};
use crate::fp8::{fp8_mode, Fp8StateSlot, ScalingState};
use crate::parallel::{GemmParallel, ParallelMode, Split, TpConfig};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "LayerNormLinear";

/// Arguments of [`LayerNormLinear::new`] (TE `te.LayerNormLinear(in_features, out_features, ...)`).
#[derive(Debug, Clone)]
pub struct LayerNormLinearConfig {
    /// Size of each input row (the normalized dimension).
    pub in_features: usize,
    /// Size of each output row.
    pub out_features: usize,
    /// Norm epsilon. TE default 1e-5.
    pub eps: f32,
    /// LayerNorm (TE default) or RMSNorm.
    pub normalization: NormKind,
    /// TE `zero_centered_gamma`. Default false.
    pub zero_centered_gamma: bool,
    /// Learn an additive bias. TE default true.
    pub bias: bool,
    /// Do not add the bias; the caller adds `params().bias()` (TE `return_bias`).
    pub return_bias: bool,
    /// Also return the norm's output (TE `return_layernorm_output`, e.g. for a residual taken
    /// after the norm); it is then computed in high precision and cast separately.
    pub return_layernorm_output: bool,
    /// Dtype of all parameters and gradients. Default BF16.
    pub params_dtype: DType,
    /// wgrad accumulates into the caller's f32 `main_grad`.
    pub fuse_wgrad_accumulation: bool,
    /// Std of the normal weight init (TE `init_method_normal(0.023)`).
    pub init_std: f32,
    /// Seed of the weight init.
    pub seed: u64,
    /// Tensor parallelism (TE `tp_group`, `sequence_parallel` with `parallel_mode="column"`; see
    /// [`TpConfig`]): always column-parallel (the norm needs the whole input features; a
    /// row-parallel `Linear` goes after it). `in_features`/`out_features` stay the whole
    /// layer's; each rank holds its slice of the output features. The norm runs on the whole
    /// input, or under sequence parallelism on this rank's token shard (its output is then
    /// all-gathered, as FP8 codes where the ranks share the scale, and the norm's gradients are
    /// summed over the group). Default `None`.
    pub tp: Option<TpConfig>,
}

impl LayerNormLinearConfig {
    /// TE's defaults.
    pub fn new(in_features: usize, out_features: usize) -> Self {
        Self {
            in_features,
            out_features,
            eps: 1e-5,
            normalization: NormKind::LayerNorm,
            zero_centered_gamma: false,
            bias: true,
            return_bias: false,
            return_layernorm_output: false,
            params_dtype: DType::BF16,
            fuse_wgrad_accumulation: false,
            init_std: 0.023,
            seed: 0,
            tp: None,
        }
    }
}

/// Forward results: the output and, with `return_layernorm_output`, the norm's output.
#[derive(Debug, Clone)]
pub struct LayerNormLinearOutput {
    /// `[..., out_features]` (FP8 with `fp8_output`).
    pub out: Output,
    /// `[..., in_features]` in the input's dtype (the input's tokens: this rank's shard under
    /// sequence parallelism).
    pub ln_out: Option<Tensor>,
}

/// What [`LayerNormLinear::forward`] saves for backward.
#[derive(Debug)]
pub struct LayerNormLinearCtx {
    stamp: Stamp<2>,
    x: Tensor,
    stats: NormStats,
    saved: Saved,
    /// The GEMM input's shape (the norm output's, all-gathered under sequence parallelism).
    gemm_shape: Vec<usize>,
}

impl LayerNormLinearCtx {
    /// Device bytes held only for backward: the norm statistics and the FP8 input transpose.
    pub fn saved_bytes(&self) -> usize {
        self.stats.bytes() + self.saved.bytes()
    }
}

/// `y = norm(x) · Wᵀ + b` for `x: [..., in_features]` (f32/bf16/f16); `y: [..., out_features]`
/// in `x`'s dtype.
#[derive(Debug)]
pub struct LayerNormLinear {
    dev: Arc<Device>,
    id: u64,
    cfg: LayerNormLinearConfig,
    norm: NormParams,
    core: LinearCore,
}

impl LayerNormLinear {
    /// A layer initialized as TE does (gamma 1, beta 0, weight `N(0, init_std)`, bias 0).
    ///
    /// # Errors
    /// [`te_runtime::Error::Config`] as for `Linear` and `LayerNorm`; allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: LayerNormLinearConfig) -> Result<Self> {
        Self::with_split(dev, cfg, None)
    }

    /// [`LayerNormLinear::new`] whose weight splits under tensor parallelism as `split` says (a
    /// fused QKV projection by heads; see [`GemmParallel::shard_weight`]); `None`: by rows.
    pub(crate) fn with_split(dev: &Arc<Device>, cfg: LayerNormLinearConfig, split: Option<Split>) -> Result<Self> {
        let norm_cfg = NormConfig {
            hidden_size: cfg.in_features,
            eps: cfg.eps,
            zero_centered_gamma: cfg.zero_centered_gamma,
            params_dtype: cfg.params_dtype,
        };
        let mut norm = NormParams::new(dev, MODULE, cfg.normalization, norm_cfg)?;
        let init = ParamsInit {
            in_features: cfg.in_features,
            out_features: cfg.out_features,
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
            init_std: cfg.init_std,
            seed: cfg.seed,
        };
        let comm = GemmParallel::new(cfg.tp.as_ref(), ParallelMode::Column);
        let params = LinearParams::for_gemm(dev, MODULE, init, &comm, split)?;
        norm.set_sequence_parallel(comm.sequence());
        let core = LinearCore::with_comm(params, MODULE, comm, !cfg.return_bias, !cfg.return_bias);
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, norm, core })
    }

    /// The configuration.
    pub fn config(&self) -> &LayerNormLinearConfig {
        &self.cfg
    }

    /// The GEMM's parallelism hook (column-parallel over `tp`, or the whole GEMM).
    pub(crate) fn gemm_parallel(&self) -> &GemmParallel {
        self.core.comm()
    }

    /// The norm's gamma/beta (TE `layer_norm_weight`, `layer_norm_bias`) and gradients.
    pub fn norm_params(&self) -> &NormParams {
        &self.norm
    }

    /// The norm's parameters, mutably.
    pub fn norm_params_mut(&mut self) -> &mut NormParams {
        &mut self.norm
    }

    /// The GEMM's weight and bias and their gradients.
    pub fn params(&self) -> &LinearParams {
        &self.core.params
    }

    /// The GEMM's parameters, mutably.
    pub fn params_mut(&mut self) -> &mut LinearParams {
        &mut self.core.params
    }

    /// The forward delayed-scaling state of the GEMM (input, weight, output).
    pub fn fp8_forward_state(&self) -> Option<&Arc<ScalingState>> {
        self.core.fwd_state()
    }

    /// The backward delayed-scaling state of the GEMM (the output gradient's slot).
    pub fn fp8_backward_state(&self) -> Option<&Arc<ScalingState>> {
        self.core.bwd_state()
    }

    /// The forward and backward state slots of the GEMM, for a writable traversal.
    pub(crate) fn fp8_state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        self.core.state_slots()
    }

    fn stamp(&self) -> Stamp<2> {
        Stamp::new(self.id, [self.norm.version(), self.core.params.version()])
    }

    /// Forward for training: the output and the context.
    ///
    /// # Errors
    /// As [`LayerNormLinear::forward_with`].
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, LayerNormLinearCtx)> {
        let (out, ctx) = self.forward_with(x, ForwardOptions::default())?;
        Ok((out.out.into_high(&self.dev, x.dtype())?, ctx))
    }

    /// Forward for training with options: the output (FP8 with `fp8_output`), the norm's output
    /// with `return_layernorm_output`, and the context.
    ///
    /// # Errors
    /// Shape and dtype errors of the input (last dim must be `in_features`); under FP8, dims
    /// that are not multiples of 16 (named, with what to pad to); kernel and GEMM failures.
    pub fn forward_with(
        &mut self,
        x: &Tensor,
        opts: ForwardOptions,
    ) -> Result<(LayerNormLinearOutput, LayerNormLinearCtx)> {
        let (out, stats, saved, gemm_shape) = self.run(x, opts, true)?;
        let saved = saved.ok_or_else(|| Error::internal(MODULE, "a training forward saved nothing"))?;
        Ok((out, LayerNormLinearCtx { stamp: self.stamp(), x: x.clone(), stats, saved, gemm_shape }))
    }

    /// Forward for inference: no context, no transposes.
    ///
    /// # Errors
    /// As [`LayerNormLinear::forward_with`], except that the token count may be any size.
    pub fn infer(&mut self, x: &Tensor) -> Result<Tensor> {
        self.infer_with(x, ForwardOptions::default())?.out.into_high(&self.dev, x.dtype())
    }

    /// Forward for inference with options (and the norm's output with
    /// `return_layernorm_output`).
    ///
    /// # Errors
    /// As [`LayerNormLinear::infer`].
    pub fn infer_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<LayerNormLinearOutput> {
        Ok(self.run(x, opts, false)?.0)
    }

    /// The forward: the outputs, the norm's statistics, what the GEMM saved (with `grad`) and
    /// the GEMM input's shape.
    fn run(
        &mut self,
        x: &Tensor,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(LayerNormLinearOutput, NormStats, Option<Saved>, Vec<usize>)> {
        check_input(MODULE, x, self.cfg.in_features)?;
        let pass = self.core.pass(fp8_mode())?;
        if pass.fp8_input().is_some() {
            let (tokens, _) = x.as_2d(MODULE)?;
            self.core.check_fp8_dims(self.core.comm().input_tokens(tokens), grad)?;
        }
        // The norm's output as the GEMM's input: cast to FP8 by the norm kernel where it can,
        // gathered from the ranks' token shards under sequence parallelism.
        let ret = self.cfg.return_layernorm_output;
        let n = norm_gemm_input(&self.norm, x, pass.fp8_input(), self.core.comm(), ret, grad)?;
        let gemm_shape = n.gemm_shape();
        let (input, stats, ln_out) = (n.input, n.stats, n.ln_out);
        let (out, saved) = self.core.forward(input, &gemm_shape, x.dtype(), &pass, opts, grad)?;
        Ok((LayerNormLinearOutput { out, ln_out }, stats, saved, gemm_shape))
    }

    /// Backward: `dx` for `grad_output`; the GEMM's and the norm's parameter gradients
    /// accumulate.
    ///
    /// # Errors
    /// As [`LayerNormLinear::backward_with`].
    pub fn backward(&mut self, ctx: LayerNormLinearCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, BackwardOptions::default())?
            .ok_or_else(|| Error::internal(MODULE, "no input gradient with input_grad = true"))
    }

    /// Backward with options: `grad_ln_out` (with `return_layernorm_output`) adds to the gradient
    /// flowing back from the GEMM into the norm; `None` when `input_grad` is false.
    ///
    /// # Errors
    /// [`te_runtime::Error::Context`] for another module's or a stale context; shape and dtype
    /// errors of `grad_output` / `grad_ln_out`; kernel and GEMM failures.
    pub fn backward_with(
        &mut self,
        ctx: LayerNormLinearCtx,
        grad_output: &Tensor,
        opts: BackwardOptions<'_>,
    ) -> Result<Option<Tensor>> {
        ctx.stamp.check(MODULE, self.stamp())?;
        // Under tensor parallelism the core sums the ranks' dgrads (reduce-scattered back to the
        // token shards under sequence parallelism).
        let d_ln = self
            .core
            .backward(ctx.saved, grad_output, &ctx.gemm_shape, true)?
            .ok_or_else(|| Error::internal(MODULE, "no dgrad with input_grad = true"))?;
        let dx = self.norm.backward_sum(d_ln, opts.grad_ln_out, &ctx.x, &ctx.stats)?;
        Ok(opts.input_grad.then_some(dx))
    }
}
