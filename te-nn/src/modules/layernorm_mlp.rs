//! `LayerNormMLP`: norm → fc1 (+bias) → activation → fc2 (+bias) (TE
//! `pytorch/module/layernorm_mlp.py`).
//!
//! FP8: the norm's and the activation's outputs go through fc1's and fc2's input quantizers.
//! With delayed scaling the norm kernel writes fc1's FP8 input (cast + amax fused), fc1 adds its
//! bias in the cuBLASLt epilogue, the activation kernel writes fc2's FP8 input (activation, cast
//! and amax fused), and byte transposes of the two FP8 inputs are saved for the wgrads (with current
//! scaling each is cast after its producer). Backward: fc2's dgrad gives the activation gradient;
//! for GELU/ReLU one kernel applies the activation derivative, casts to FP8, transposes and
//! reduces fc1's bias gradient (TE `cast_transpose_dbias_dgelu`; with current scaling the
//! derivative is cast after); gated activations run their backward kernel first.

use super::linear::check_input;
use super::linear::gemm_core::{out_shape, DbiasBuffers, LinearCore, LinearInput, Saved};
use super::linear::norm_input::norm_gemm_input;
use super::norm::{NormConfig, NormKind, NormParams, NormStats};
use super::params::{convert, LinearParams, ParamsInit};
use super::{next_module_id, BackwardOptions, ForwardOptions, Output, Stamp};
use crate::fp8::quantizer::produce_fp8;
use crate::fp8::{fp8_mode, Float8Tensor, Fp8StateSlot, Quantizer, ScalingState};
use crate::parallel::{GemmParallel, ParallelMode, Split, TpConfig};
use std::sync::Arc;
use te_codegen::spec::Activation;
use te_codegen::DType;
use te_runtime::ops::activation;
use te_runtime::ops::cast_transpose::cast_transpose_dact;
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "LayerNormMLP";

/// Arguments of [`LayerNormMLP::new`] (TE `te.LayerNormMLP(hidden_size, ffn_hidden_size, ...)`).
#[derive(Debug, Clone)]
pub struct LayerNormMLPConfig {
    /// Model width: the norm's size, fc1's input and fc2's output.
    pub hidden_size: usize,
    /// fc1's output (×2 for the gated SwiGLU/GeGLU, whose fc1 is `[2·ffn, hidden]`).
    pub ffn_hidden_size: usize,
    /// Norm epsilon. TE default 1e-5.
    pub eps: f32,
    /// LayerNorm (TE default) or RMSNorm.
    pub normalization: NormKind,
    /// TE `zero_centered_gamma`.
    pub zero_centered_gamma: bool,
    /// GELU (tanh approximation, TE default), ReLU, SwiGLU or GeGLU.
    pub activation: Activation,
    /// fc1 and fc2 have biases. TE default true.
    pub bias: bool,
    /// FP8 only: do not keep fc2's FP8 input for its wgrad; recompute it in backward from the
    /// saved fc1 output (activation + cast with the forward's scale, then the byte transpose), as
    /// torch.compile's partitioner does. Saves 1 byte per ffn activation for one more activation
    /// pass in backward. Default false (TE keeps it).
    pub recompute_activation: bool,
    /// Also return the norm's output (TE `return_layernorm_output`: a BERT-style block takes its
    /// residual after the norm); it is then computed in high precision and cast separately.
    pub return_layernorm_output: bool,
    /// Dtype of all parameters and gradients. Default BF16.
    pub params_dtype: DType,
    /// wgrads accumulate into the caller's f32 `main_grad`s.
    pub fuse_wgrad_accumulation: bool,
    /// Std of the normal weight init.
    pub init_std: f32,
    /// Seed of the weight init (fc2 uses `seed + 1`).
    pub seed: u64,
    /// Tensor parallelism (TE `tp_group`, `sequence_parallel`, `set_parallel_mode=True`; see
    /// [`TpConfig`]): fc1 column-parallel (each rank its `ffn / tp` features; of a gated fc1, its
    /// part of both halves), fc2 row-parallel, the ranks' partial outputs summed. Sizes stay the
    /// whole block's. Under sequence parallelism the input and output are this rank's token shard
    /// and the norm runs on it. Default `None`.
    pub tp: Option<TpConfig>,
}

impl LayerNormMLPConfig {
    /// TE's defaults.
    pub fn new(hidden_size: usize, ffn_hidden_size: usize) -> Self {
        Self {
            hidden_size,
            ffn_hidden_size,
            eps: 1e-5,
            normalization: NormKind::LayerNorm,
            zero_centered_gamma: false,
            activation: Activation::Gelu,
            bias: true,
            recompute_activation: false,
            return_layernorm_output: false,
            params_dtype: DType::BF16,
            fuse_wgrad_accumulation: false,
            init_std: 0.023,
            seed: 0,
            tp: None,
        }
    }
}

/// Forward results: the output and, with `return_layernorm_output`, the norm's output (a
/// post-LN block takes its residual from it).
#[derive(Debug, Clone)]
pub struct LayerNormMLPOutput {
    /// `[..., hidden]` (FP8 with `fp8_output`).
    pub out: Output,
    /// `[..., hidden]` in the input's dtype (the input's tokens: this rank's shard under
    /// sequence parallelism).
    pub ln_out: Option<Tensor>,
}

/// What [`LayerNormMLP::forward`] saves for backward.
#[derive(Debug)]
pub struct LayerNormMLPCtx {
    stamp: Stamp<3>,
    x: Tensor,
    stats: NormStats,
    fc1: Saved,
    /// fc1's output including its bias: the activation's input `[tokens, fc1_out]`.
    pre_act: Tensor,
    fc2: Saved,
    /// With `recompute_activation` under FP8: how fc2's input was cast, to cast it again.
    act_quantizer: Option<Box<dyn Quantizer>>,
    /// fc1's input shape (the norm output's, all-gathered under sequence parallelism).
    gemm_shape: Vec<usize>,
}

impl LayerNormMLPCtx {
    /// Device bytes held only for backward: norm statistics, fc1's FP8 input transpose (or
    /// nothing in high precision: the norm output is then kept, counted here), the
    /// pre-activation, and fc2's FP8 input transpose (or the high-precision activation).
    pub fn saved_bytes(&self) -> usize {
        let high = |s: &Saved| match s {
            Saved::High { input, .. } => input.num_bytes(),
            Saved::Fp8(_) => s.bytes(),
        };
        self.stats.bytes() + high(&self.fc1) + self.pre_act.num_bytes() + high(&self.fc2)
    }
}

/// `y = fc2(act(fc1(norm(x))))` for `x: [..., hidden]` (f32/bf16/f16); `y` in `x`'s dtype.
#[derive(Debug)]
pub struct LayerNormMLP {
    dev: Arc<Device>,
    id: u64,
    cfg: LayerNormMLPConfig,
    norm: NormParams,
    fc1: LinearCore,
    fc2: LinearCore,
    /// This rank's ffn features (`ffn_hidden_size / tp`).
    ffn_local: usize,
}

impl LayerNormMLP {
    /// A block initialized as TE does.
    ///
    /// # Errors
    /// [`Error::Config`] as for `Linear` and `LayerNorm`; allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: LayerNormMLPConfig) -> Result<Self> {
        let (h, f) = (cfg.hidden_size, cfg.ffn_hidden_size);
        let norm_cfg = NormConfig {
            hidden_size: h,
            eps: cfg.eps,
            zero_centered_gamma: cfg.zero_centered_gamma,
            params_dtype: cfg.params_dtype,
        };
        let mut norm = NormParams::new(dev, MODULE, cfg.normalization, norm_cfg)?;
        let init = |in_features, out_features, seed| ParamsInit {
            in_features,
            out_features,
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
            init_std: cfg.init_std,
            seed,
        };
        // fc1 column-parallel (a gated fc1 split by halves: each rank gates its own features),
        // fc2 row-parallel; the identity on one GPU.
        let parts = if cfg.activation.is_gated() { 2 } else { 1 };
        let (fc1_comm, fc2_comm) = (
            GemmParallel::new(cfg.tp.as_ref(), ParallelMode::Column),
            GemmParallel::new(cfg.tp.as_ref(), ParallelMode::Row),
        );
        let ffn_local = fc1_comm.split_count(MODULE, "ffn_hidden_size", f)?;
        let fc1 =
            LinearParams::for_gemm(dev, MODULE, init(h, parts * f, cfg.seed), &fc1_comm, Some(Split::Parts(parts)))?;
        let fc2 = LinearParams::for_gemm(dev, MODULE, init(f, h, cfg.seed + 1), &fc2_comm, None)?;
        norm.set_sequence_parallel(fc1_comm.sequence());
        let mut fc2 = LinearCore::with_comm(fc2, MODULE, fc2_comm, true, true);
        if cfg.recompute_activation {
            fc2.recompute_input();
        }
        Ok(Self {
            dev: dev.clone(),
            id: next_module_id(),
            cfg,
            norm,
            fc1: LinearCore::with_comm(fc1, MODULE, fc1_comm, true, true),
            fc2,
            ffn_local,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &LayerNormMLPConfig {
        &self.cfg
    }

    /// The norm's parameters.
    pub fn norm_params(&self) -> &NormParams {
        &self.norm
    }

    /// The norm's parameters, mutably.
    pub fn norm_params_mut(&mut self) -> &mut NormParams {
        &mut self.norm
    }

    /// fc1 `[fc1_out, hidden]` (TE `fc1_weight`, `fc1_bias`).
    pub fn fc1(&self) -> &LinearParams {
        &self.fc1.params
    }

    /// fc1, mutably.
    pub fn fc1_mut(&mut self) -> &mut LinearParams {
        &mut self.fc1.params
    }

    /// fc2 `[hidden, ffn]` (TE `fc2_weight`, `fc2_bias`).
    pub fn fc2(&self) -> &LinearParams {
        &self.fc2.params
    }

    /// fc2, mutably.
    pub fn fc2_mut(&mut self) -> &mut LinearParams {
        &mut self.fc2.params
    }

    /// The delayed-scaling states of the two GEMMs, named as checkpoints store them
    /// (`fc1_fp8_fwd`, `fc1_fp8_bwd`, `fc2_fp8_fwd`, `fc2_fp8_bwd`); `None` before the first FP8
    /// forward with delayed scaling.
    pub fn fp8_states(&self) -> [(&'static str, Option<&Arc<ScalingState>>); 4] {
        [
            ("fc1_fp8_fwd", self.fc1.fwd_state()),
            ("fc1_fp8_bwd", self.fc1.bwd_state()),
            ("fc2_fp8_fwd", self.fc2.fwd_state()),
            ("fc2_fp8_bwd", self.fc2.bwd_state()),
        ]
    }

    /// The state slots of the two GEMMs under the names of [`LayerNormMLP::fp8_states`], for a
    /// writable traversal.
    pub(crate) fn fp8_state_slots(&mut self) -> [(&'static str, Fp8StateSlot<'_>); 4] {
        let [fc1_fwd, fc1_bwd] = self.fc1.state_slots();
        let [fc2_fwd, fc2_bwd] = self.fc2.state_slots();
        [("fc1_fp8_fwd", fc1_fwd), ("fc1_fp8_bwd", fc1_bwd), ("fc2_fp8_fwd", fc2_fwd), ("fc2_fp8_bwd", fc2_bwd)]
    }

    fn stamp(&self) -> Stamp<3> {
        Stamp::new(self.id, [self.norm.version(), self.fc1.params.version(), self.fc2.params.version()])
    }

    /// Forward for training: `y` (the input's dtype) and the context.
    ///
    /// # Errors
    /// As [`LayerNormMLP::forward_with`].
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, LayerNormMLPCtx)> {
        let (out, ctx) = self.forward_with(x, ForwardOptions::default())?;
        Ok((out.out.into_high(&self.dev, x.dtype())?, ctx))
    }

    /// Forward for training with options (`is_first_microbatch` applies to both weights,
    /// `fp8_output` to fc2's output): the output, the norm's output with
    /// `return_layernorm_output`, and the context.
    ///
    /// # Errors
    /// Shape and dtype errors of the input (last dim `hidden_size`); under FP8, dims that are not
    /// multiples of 16 (named, with what to pad to); kernel and GEMM failures.
    pub fn forward_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<(LayerNormMLPOutput, LayerNormMLPCtx)> {
        let (out, ctx) = self.run(x, opts, true)?;
        let ctx = ctx.ok_or_else(|| Error::internal(MODULE, "a training forward saved nothing"))?;
        Ok((out, ctx))
    }

    /// Forward for inference: no context, no transposes.
    ///
    /// # Errors
    /// As [`LayerNormMLP::forward_with`], except that the token count may be any size.
    pub fn infer(&mut self, x: &Tensor) -> Result<Tensor> {
        self.infer_with(x, ForwardOptions::default())?.out.into_high(&self.dev, x.dtype())
    }

    /// Forward for inference with options (and the norm's output with
    /// `return_layernorm_output`).
    ///
    /// # Errors
    /// As [`LayerNormMLP::infer`].
    pub fn infer_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<LayerNormMLPOutput> {
        Ok(self.run(x, opts, false)?.0)
    }

    fn run(
        &mut self,
        x: &Tensor,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(LayerNormMLPOutput, Option<LayerNormMLPCtx>)> {
        check_input(MODULE, x, self.cfg.hidden_size)?;
        // fc2's output: refuse one the ranks would have to sum before anything runs.
        self.fc2.comm().check_fp8_output(MODULE, opts.fp8_output)?;
        let mode = fp8_mode();
        let dt = x.dtype();
        let (pass1, pass2) = (self.fc1.pass(mode)?, self.fc2.pass(mode)?);
        if pass1.fp8_input().is_some() {
            let (tokens, _) = x.as_2d(MODULE)?;
            let tokens = self.fc1.comm().input_tokens(tokens);
            self.fc1.check_fp8_dims(tokens, grad)?;
            self.fc2.check_fp8_dims(tokens, grad)?;
        }
        // Norm → fc1 input (through fc1's input quantizer under FP8; gathered from the ranks'
        // token shards under sequence parallelism).
        let ret = self.cfg.return_layernorm_output;
        let n = norm_gemm_input(&self.norm, x, pass1.fp8_input(), self.fc1.comm(), ret, grad)?;
        let gemm_shape = n.gemm_shape();
        let (fc1_in, stats, ln_out) = (n.input, n.stats, n.ln_out);
        let fc1_opts = ForwardOptions { fp8_output: false, ..opts };
        let (pre_act, fc1_saved) = self.fc1.forward(fc1_in, &gemm_shape, dt, &pass1, fc1_opts, grad)?;
        let Output::High(pre_act) = pre_act else {
            return Err(Error::internal(MODULE, "fc1 gave an FP8 output without fp8_output"));
        };
        // Activation → fc2 input (through fc2's input quantizer under FP8).
        let act_shape = out_shape(&gemm_shape, self.ffn_local);
        let recompute = self.cfg.recompute_activation && grad;
        let (dev, act) = (self.dev.clone(), self.cfg.activation);
        let mut act_quantizer = None;
        let fc2_in = match pass2.fp8_input() {
            Some(q) => {
                let act8 = produce_fp8(q, &dev, &act_shape, dt, grad && !recompute, &mut |y, fp8| {
                    activation::forward(&dev, act, &pre_act, None, y, fp8)
                })?;
                if recompute {
                    act_quantizer = Some(q.frozen()?);
                }
                LinearInput::Fp8(act8)
            }
            None => {
                let mut y = Tensor::empty(&dev, dt, &act_shape)?;
                activation::forward(&dev, act, &pre_act, None, &mut y, None)?;
                LinearInput::High(y)
            }
        };
        // Under tensor parallelism fc2's core sums the ranks' partial outputs (reduce-scattered
        // to the token shards under sequence parallelism).
        let (out, fc2_saved) = self.fc2.forward(fc2_in, &act_shape, dt, &pass2, opts, grad)?;
        let ctx = match (fc1_saved, fc2_saved) {
            (Some(fc1), Some(fc2)) => Some(LayerNormMLPCtx {
                stamp: self.stamp(),
                x: x.clone(),
                stats,
                fc1,
                pre_act,
                fc2,
                act_quantizer,
                gemm_shape,
            }),
            _ => None,
        };
        Ok((LayerNormMLPOutput { out, ln_out }, ctx))
    }

    /// Backward: `dx` for `grad_output`; every parameter gradient accumulates.
    ///
    /// # Errors
    /// As [`LayerNormMLP::backward_with`].
    pub fn backward(&mut self, ctx: LayerNormMLPCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, BackwardOptions::default())?
            .ok_or_else(|| Error::internal(MODULE, "no input gradient with input_grad = true"))
    }

    /// Backward with options: `grad_ln_out` (with `return_layernorm_output`) adds to the gradient
    /// flowing back from fc1 into the norm; `None` when `input_grad` is false.
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; shape and dtype errors of
    /// `grad_output` / `grad_ln_out`; [`Error::Config`] for a missing `main_grad`; kernel and
    /// GEMM failures.
    pub fn backward_with(
        &mut self,
        ctx: LayerNormMLPCtx,
        grad_output: &Tensor,
        opts: BackwardOptions<'_>,
    ) -> Result<Option<Tensor>> {
        ctx.stamp.check(MODULE, self.stamp())?;
        let act_shape = out_shape(&ctx.gemm_shape, self.ffn_local);
        let no_grad = |what: &str| Error::internal(MODULE, format!("no {what} dgrad with input_grad = true"));
        let mut fc2_saved = ctx.fc2;
        if let Saved::Fp8(s) = &mut fc2_saved {
            if s.input_t.is_none() {
                let q = ctx.act_quantizer.as_deref().ok_or_else(|| {
                    Error::internal(MODULE, "recompute_activation without the quantizer of fc2's input")
                })?;
                s.input_t = Some(self.recompute_act_t(&ctx.pre_act, q)?);
            }
        }
        // fc2's core gathers a token shard of the output gradient (sequence parallelism); fc1's
        // sums the ranks' dgrads (reduce-scattered back to the token shards).
        let d_act = self.fc2.backward(fc2_saved, grad_output, &act_shape, true)?.ok_or_else(|| no_grad("fc2"))?;
        let act = self.cfg.activation;
        let d_ln = match ctx.fc1 {
            // GELU/ReLU under FP8: dact + cast + transpose + dbias in one kernel.
            Saved::Fp8(s) if !act.is_gated() => {
                let q = self.fc1.grad_quantizer(&s.grad)?;
                let (d8, dbias) = self.dact_cast(act, &d_act, &ctx.pre_act, &*q)?;
                self.fc1.backward_fp8(&d8, dbias, s, &ctx.gemm_shape, grad_output.dtype(), true)?
            }
            saved => {
                let mut d_pre = Tensor::empty(&self.dev, ctx.pre_act.dtype(), ctx.pre_act.shape())?;
                let d_act = convert(&self.dev, d_act, ctx.pre_act.dtype())?;
                activation::backward(&self.dev, act, &d_act, &ctx.pre_act, &mut d_pre, None)?;
                self.fc1.backward(saved, &d_pre, &ctx.gemm_shape, true)?
            }
        }
        .ok_or_else(|| no_grad("fc1"))?;
        let dx = self.norm.backward_sum(d_ln, opts.grad_ln_out, &ctx.x, &ctx.stats)?;
        Ok(opts.input_grad.then_some(dx))
    }

    /// fc2's FP8 input transpose, recomputed from fc1's output as the forward made it: `q` is the
    /// forward's input quantizer, frozen (the same scale, or the same amax).
    fn recompute_act_t(&self, pre_act: &Tensor, q: &dyn Quantizer) -> Result<Float8Tensor> {
        let (dev, act) = (&self.dev, self.cfg.activation);
        let shape = out_shape(pre_act.shape(), self.ffn_local);
        let act8 = produce_fp8(q, dev, &shape, pre_act.dtype(), true, &mut |y, fp8| {
            activation::forward(dev, act, pre_act, None, y, fp8)
        })?;
        act8.into_transposed().ok_or_else(|| Error::internal(MODULE, "the recomputed activation has no transpose"))
    }

    /// `d_pre = d_act · act'(pre_act)` cast by `q` (fc1's gradient quantizer) with its transpose
    /// and the bias gradient: one kernel when `q` fuses its cast, else the derivative in high
    /// precision first (current scaling needs its amax), then the cast.
    fn dact_cast(
        &mut self,
        act: Activation,
        d_act: &Tensor,
        pre_act: &Tensor,
        q: &dyn Quantizer,
    ) -> Result<(Float8Tensor, Option<Tensor>)> {
        let dev = self.dev.clone();
        let d_act = convert(&dev, d_act.clone(), pre_act.dtype())?;
        let (tokens, cols) = pre_act.as_2d(MODULE)?;
        let mut dbias = match self.fc1.params.bias() {
            Some(_) => Some(DbiasBuffers::new(&dev, pre_act.dtype(), tokens, cols)?),
            None => None,
        };
        let d8 = if q.fuses_cast() {
            let mut out = Tensor::empty(&dev, q.dtype(), pre_act.shape())?;
            let mut out_t = Tensor::empty(&dev, q.dtype(), &[cols, tokens])?;
            let scale_inv = q.fused_cast(&mut |fp8| {
                let db = dbias.as_mut().map(DbiasBuffers::out);
                cast_transpose_dact(&dev, act, &d_act, pre_act, &mut out, &mut out_t, fp8, db)
            })?;
            Float8Tensor::from_parts(out, Some(out_t), scale_inv)?
        } else {
            let mut d_pre = Tensor::empty(&dev, pre_act.dtype(), pre_act.shape())?;
            activation::backward(&dev, act, &d_act, pre_act, &mut d_pre, None)?;
            q.quantize(&d_pre, true, dbias.as_mut().map(DbiasBuffers::out))?
        };
        Ok((d8, dbias.map(DbiasBuffers::into_dbias)))
    }
}
