//! `LayerNormMLP`: norm → fc1 (+bias) → activation → fc2 (+bias) (TE
//! `pytorch/module/layernorm_mlp.py`).
//!
//! FP8 forward with delayed scaling: the norm kernel writes fc1's FP8 input (cast + amax fused),
//! fc1 adds its bias in the cuBLASLt epilogue, the activation kernel writes fc2's FP8 input
//! (activation + cast + amax fused), and byte transposes of the two FP8 inputs are saved for the
//! wgrads. Backward: fc2's dgrad gives the activation gradient; for GELU/ReLU one kernel applies
//! the activation derivative, casts to FP8, transposes and reduces fc1's bias gradient (TE
//! `cast_transpose_dbias_dgelu`); gated activations run their backward kernel first.

use super::linear::{check_ctx, check_input, out_shape, LinearCore, LinearInput, Saved, BWD_GRAD_OUTPUT, FWD_INPUT};
use super::norm::{NormConfig, NormKind, NormParams, NormStats};
use super::params::{LinearParams, ParamsInit};
use super::state_slot::Fp8StateSlot;
use super::{next_module_id, ForwardOptions, Output};
use crate::fp8::{fp8_mode, quantize_current, Float8Tensor, Fp8Mode, Recipe, ScalingState};
use crate::ops::cast_transpose::{cast_transpose_dact, dbias_workspace_len, DbiasOut};
use crate::ops::{self, activation};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::spec::Activation;
use te_codegen::DType;

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
        }
    }
}

/// What [`LayerNormMLP::forward`] saves for backward.
#[derive(Debug)]
pub struct LayerNormMLPCtx {
    module_id: u64,
    version: u64,
    x: Tensor,
    stats: NormStats,
    fc1: Saved,
    /// fc1's output including its bias: the activation's input `[tokens, fc1_out]`.
    pre_act: Tensor,
    fc2: Saved,
    /// With `recompute_activation` under delayed scaling: the scale fc2's input was cast with.
    act_scale: Option<CudaSlice<f32>>,
}

impl LayerNormMLPCtx {
    /// Device bytes held only for backward: norm statistics, fc1's FP8 input transpose (or
    /// nothing in high precision: the norm output is then kept, counted here), the
    /// pre-activation, and fc2's FP8 input transpose (or the high-precision activation).
    pub fn saved_bytes(&self) -> usize {
        let high = |s: &Saved| match s {
            Saved::High { input, .. } => input.num_bytes(),
            Saved::Fp8 { .. } => s.bytes(),
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
        let norm = NormParams::new(dev, MODULE, cfg.normalization, norm_cfg)?;
        let init = |in_features, out_features, seed| ParamsInit {
            in_features,
            out_features,
            bias: cfg.bias,
            params_dtype: cfg.params_dtype,
            fuse_wgrad_accumulation: cfg.fuse_wgrad_accumulation,
            init_std: cfg.init_std,
            seed,
        };
        let fc1_out = if cfg.activation.is_gated() { 2 * f } else { f };
        let fc1 = LinearParams::new(dev, MODULE, init(h, fc1_out, cfg.seed))?;
        let mut fc2 = LinearCore::new(LinearParams::new(dev, MODULE, init(f, h, cfg.seed + 1))?, MODULE, true, true);
        if cfg.recompute_activation {
            fc2.recompute_input();
        }
        Ok(Self {
            dev: dev.clone(),
            id: next_module_id(),
            cfg,
            norm,
            fc1: LinearCore::new(fc1, MODULE, true, true),
            fc2,
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
            ("fc1_fp8_fwd", self.fc1.fwd_state_opt()),
            ("fc1_fp8_bwd", self.fc1.bwd_state_opt()),
            ("fc2_fp8_fwd", self.fc2.fwd_state_opt()),
            ("fc2_fp8_bwd", self.fc2.bwd_state_opt()),
        ]
    }

    /// The state slots of the two GEMMs under the names of [`LayerNormMLP::fp8_states`], for a
    /// writable traversal.
    pub(crate) fn fp8_state_slots(&mut self) -> [(&'static str, Fp8StateSlot<'_>); 4] {
        let [fc1_fwd, fc1_bwd] = self.fc1.state_slots();
        let [fc2_fwd, fc2_bwd] = self.fc2.state_slots();
        [("fc1_fp8_fwd", fc1_fwd), ("fc1_fp8_bwd", fc1_bwd), ("fc2_fp8_fwd", fc2_fwd), ("fc2_fp8_bwd", fc2_bwd)]
    }

    fn version(&self) -> u64 {
        let (a, b, c) = (self.norm.version(), self.fc1.params.version(), self.fc2.params.version());
        a.wrapping_mul(1 << 42).wrapping_add(b.wrapping_mul(1 << 21)).wrapping_add(c)
    }

    /// Forward for training: `y` and the context.
    ///
    /// # Errors
    /// Shape and dtype errors of the input (last dim `hidden_size`); under FP8, dims that are not
    /// multiples of 16 (named, with what to pad to); kernel and GEMM failures.
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, LayerNormMLPCtx)> {
        let (y, _, ctx) = self.run(x, ForwardOptions::default(), true)?;
        let ctx = ctx.ok_or_else(|| Error::Shape { op: MODULE, message: "internal: nothing saved".into() })?;
        Ok((y, ctx))
    }

    /// Forward for training that also returns the norm's output (`return_layernorm_output`).
    ///
    /// # Errors
    /// [`Error::Config`] without `return_layernorm_output`; as [`LayerNormMLP::forward`].
    pub fn forward_ln(&mut self, x: &Tensor) -> Result<(Tensor, Tensor, LayerNormMLPCtx)> {
        self.forward_ln_with(x, ForwardOptions::default())
    }

    /// [`LayerNormMLP::forward_ln`] with options.
    ///
    /// # Errors
    /// As [`LayerNormMLP::forward_ln`].
    pub fn forward_ln_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<(Tensor, Tensor, LayerNormMLPCtx)> {
        let (y, ln, ctx) = self.run(x, opts, true)?;
        match (ln, ctx) {
            (Some(ln), Some(ctx)) => Ok((y, ln, ctx)),
            _ => Err(Error::Config {
                module: MODULE,
                message: "forward_ln needs return_layernorm_output = true in the configuration".into(),
            }),
        }
    }

    /// Forward for training with options (`is_first_microbatch` applies to both weights).
    ///
    /// # Errors
    /// As [`LayerNormMLP::forward`].
    pub fn forward_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<(Tensor, LayerNormMLPCtx)> {
        let (y, _, ctx) = self.run(x, opts, true)?;
        let ctx = ctx.ok_or_else(|| Error::Shape { op: MODULE, message: "internal: nothing saved".into() })?;
        Ok((y, ctx))
    }

    /// Forward for inference: no context, no transposes.
    ///
    /// # Errors
    /// As [`LayerNormMLP::forward`], except that the token count may be any size.
    pub fn infer(&mut self, x: &Tensor) -> Result<Tensor> {
        Ok(self.run(x, ForwardOptions::default(), false)?.0)
    }

    /// Forward for inference that also returns the norm's output (`return_layernorm_output`;
    /// post-LN blocks take their residual from it): `(y, ln(x))`, no context, no transposes.
    ///
    /// # Errors
    /// [`Error::Config`] without `return_layernorm_output`; as [`LayerNormMLP::infer`].
    pub fn infer_ln(&mut self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        match self.run(x, ForwardOptions::default(), false)? {
            (y, Some(ln), _) => Ok((y, ln)),
            _ => Err(Error::Config {
                module: MODULE,
                message: "infer_ln needs return_layernorm_output = true in the configuration".into(),
            }),
        }
    }

    #[allow(clippy::type_complexity)]
    fn run(
        &mut self,
        x: &Tensor,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Tensor, Option<Tensor>, Option<LayerNormMLPCtx>)> {
        check_input(MODULE, x, self.cfg.hidden_size)?;
        let mode = fp8_mode();
        let dt = x.dtype();
        let (tokens, _) = x.as_2d(MODULE)?;
        let delayed = match mode {
            Fp8Mode::Fp8(Recipe::Delayed(r)) => {
                self.fc1.check_fp8_dims(tokens, grad)?;
                self.fc2.check_fp8_dims(tokens, grad)?;
                Some(r)
            }
            _ => None,
        };
        // Norm → fc1 input (FP8 from the kernel under delayed scaling).
        let mut ln_out = None;
        let (fc1_in, stats) = match &delayed {
            Some(r) if !self.cfg.return_layernorm_output => {
                let state = self.fc1.fwd_state(r)?;
                let (mut ln8, stats) = self.norm.forward_fp8(x, &state, FWD_INPUT)?;
                if grad {
                    ln8.ensure_transpose(&self.dev)?;
                }
                (LinearInput::Fp8(ln8), stats)
            }
            _ => {
                let (ln, stats) = self.norm.forward(x, dt)?;
                ln_out = self.cfg.return_layernorm_output.then(|| ln.clone());
                (LinearInput::High(ln), stats)
            }
        };
        let fc1_opts = ForwardOptions { fp8_output: false, ..opts };
        let (pre_act, fc1_saved) = self.fc1.forward(fc1_in, x.shape(), dt, mode, fc1_opts, grad)?;
        let Output::High(pre_act) = pre_act else {
            return Err(Error::Shape { op: MODULE, message: "internal: fc1 gave an FP8 output".into() });
        };
        // Activation → fc2 input (FP8 from the kernel under delayed scaling).
        let act_shape = out_shape(x.shape(), self.cfg.ffn_hidden_size);
        let recompute = self.cfg.recompute_activation && grad;
        let mut act_scale = None;
        let fc2_in = match &delayed {
            Some(r) => {
                let state = self.fc2.fwd_state(r)?;
                let mut y = Tensor::empty(&self.dev, state.dtype(), &act_shape)?;
                let ((), scale_inv) = state.cast_with(FWD_INPUT, |fp8| {
                    activation::forward(&self.dev, self.cfg.activation, &pre_act, None, &mut y, Some(fp8))
                })?;
                let mut act8 = Float8Tensor::from_parts(y, None, scale_inv)?;
                if recompute {
                    act_scale = Some(state.scale_copy(FWD_INPUT)?);
                } else if grad {
                    act8.ensure_transpose(&self.dev)?;
                }
                LinearInput::Fp8(act8)
            }
            None => {
                let mut y = Tensor::empty(&self.dev, dt, &act_shape)?;
                activation::forward(&self.dev, self.cfg.activation, &pre_act, None, &mut y, None)?;
                LinearInput::High(y)
            }
        };
        let (out, fc2_saved) = self.fc2.forward(fc2_in, &act_shape, dt, mode, opts, grad)?;
        let y = out.into_high(&self.dev, dt)?;
        let ctx = match (fc1_saved, fc2_saved) {
            (Some(fc1), Some(fc2)) => Some(LayerNormMLPCtx {
                module_id: self.id,
                version: self.version(),
                x: x.clone(),
                stats,
                fc1,
                pre_act,
                fc2,
                act_scale,
            }),
            _ => None,
        };
        Ok((y, ln_out, ctx))
    }

    /// Backward: `dx` for `grad_output`; every parameter gradient accumulates.
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; shape and dtype errors of
    /// `grad_output`; [`Error::Config`] for a missing `main_grad`; kernel and GEMM failures.
    pub fn backward(&mut self, ctx: LayerNormMLPCtx, grad_output: &Tensor) -> Result<Tensor> {
        self.backward_with(ctx, grad_output, None)
    }

    /// Backward with the gradient of the returned norm output ([`LayerNormMLP::forward_ln`]),
    /// added to the gradient flowing back from fc1.
    ///
    /// # Errors
    /// As [`LayerNormMLP::backward`]; a `grad_ln_out` of another shape than the input.
    pub fn backward_with(
        &mut self,
        ctx: LayerNormMLPCtx,
        grad_output: &Tensor,
        grad_ln_out: Option<&Tensor>,
    ) -> Result<Tensor> {
        check_ctx(MODULE, (ctx.module_id, ctx.version), self.id, self.version())?;
        let act_shape = out_shape(ctx.x.shape(), self.cfg.ffn_hidden_size);
        let internal = |m: &str| Error::Shape { op: MODULE, message: format!("internal: {m}") };
        let mut fc2_saved = ctx.fc2;
        if let Saved::Fp8 { input_t: None, recipe, .. } = &fc2_saved {
            let act_t = self.recompute_act_t(&ctx.pre_act, *recipe, ctx.act_scale.as_ref())?;
            fc2_saved.restore_input(act_t);
        }
        let d_act =
            self.fc2.backward(fc2_saved, grad_output, &act_shape, true)?.ok_or_else(|| internal("no fc2 dgrad"))?;
        let fc1_shape = ctx.pre_act.shape().to_vec();
        let act = self.cfg.activation;
        let d_ln = match ctx.fc1 {
            // GELU/ReLU under FP8: dact + cast + transpose + dbias in one kernel.
            Saved::Fp8 { input_t: Some(input_t), weight, recipe, ticket } if !act.is_gated() => {
                let (d8, dbias) = self.dact_cast(act, &d_act, &ctx.pre_act, recipe)?;
                let dx = self.fc1.backward_fp8_quantized(
                    &d8,
                    dbias,
                    &input_t,
                    &weight,
                    ctx.x.shape(),
                    grad_output.dtype(),
                    true,
                )?;
                if let Some(t) = ticket {
                    t.finish()?;
                }
                dx
            }
            saved => {
                let mut d_pre = Tensor::empty(&self.dev, ctx.pre_act.dtype(), &fc1_shape)?;
                let d_act = super::params::convert(&self.dev, d_act, ctx.pre_act.dtype())?;
                activation::backward(&self.dev, act, &d_act, &ctx.pre_act, &mut d_pre, None)?;
                self.fc1.backward(saved, &d_pre, ctx.x.shape(), true)?
            }
        }
        .ok_or_else(|| internal("no fc1 dgrad"))?;
        let mut d_ln = d_ln;
        if let Some(g) = grad_ln_out {
            ops::check_shape(MODULE, "grad_ln_out", g, ctx.x.shape())?;
            ops::elementwise::add_assign(&self.dev, &mut d_ln, g)?;
        }
        self.norm.backward(&d_ln, &ctx.x, &ctx.stats)
    }

    /// fc2's FP8 input transpose, recomputed from fc1's output as the forward made it: with the
    /// forward's scale (delayed) or the same amax (current).
    fn recompute_act_t(
        &self,
        pre_act: &Tensor,
        recipe: Recipe,
        scale: Option<&CudaSlice<f32>>,
    ) -> Result<Float8Tensor> {
        let dev = &self.dev;
        let act = self.cfg.activation;
        let shape = out_shape(pre_act.shape(), self.cfg.ffn_hidden_size);
        let act8 = match (recipe, scale) {
            (Recipe::Delayed(_), Some(scale)) => {
                let mut y = Tensor::empty(dev, DType::E4M3, &shape)?;
                let (mut amax, mut scale_inv) =
                    (dev.stream().alloc_zeros::<f32>(1)?, dev.stream().alloc_zeros::<f32>(1)?);
                let mut fp8 = ops::Fp8Scaling {
                    scale: scale.as_view(),
                    amax: amax.as_view_mut(),
                    scale_inv: scale_inv.as_view_mut(),
                };
                activation::forward(dev, act, pre_act, None, &mut y, Some(&mut fp8))?;
                let mut f = Float8Tensor::from_parts(y, None, Arc::new(scale_inv))?;
                f.ensure_transpose(dev)?;
                f
            }
            (Recipe::Current(c), _) => {
                let mut y = Tensor::empty(dev, pre_act.dtype(), &shape)?;
                activation::forward(dev, act, pre_act, None, &mut y, None)?;
                quantize_current(dev, &y, DType::E4M3, &c, true, None)?
            }
            (Recipe::Delayed(_), None) => {
                return Err(Error::Shape { op: MODULE, message: "internal: no saved activation scale".into() })
            }
        };
        act8.into_transposed().ok_or_else(|| Error::Shape { op: MODULE, message: "internal: no transpose".into() })
    }

    /// `d_pre = d_act · act'(pre_act)` cast to fc1's gradient format with its transpose and the
    /// bias gradient, in one kernel.
    fn dact_cast(
        &mut self,
        act: Activation,
        d_act: &Tensor,
        pre_act: &Tensor,
        recipe: Recipe,
    ) -> Result<(Float8Tensor, Option<Tensor>)> {
        let dev = self.dev.clone();
        let d_act = super::params::convert(&dev, d_act.clone(), pre_act.dtype())?;
        let (tokens, cols) = pre_act.as_2d(MODULE)?;
        let mut dbias = match self.fc1.params.bias() {
            Some(_) => Some(Tensor::empty(&dev, pre_act.dtype(), &[cols])?),
            None => None,
        };
        // SAFETY: f32 has no invalid bit patterns; the kernel writes the scratch before reading.
        let mut ws = unsafe { dev.stream().alloc::<f32>(dbias_workspace_len(tokens, cols).max(1)) }?;
        let ((out, out_t), scale_inv) = match recipe {
            Recipe::Delayed(r) => {
                let state = self.fc1.bwd_state(&r)?;
                let dtype = state.dtype();
                state.cast_with(BWD_GRAD_OUTPUT, |fp8: &mut ops::Fp8Scaling<'_>| {
                    let mut out = Tensor::empty(&dev, dtype, pre_act.shape())?;
                    let mut out_t = Tensor::empty(&dev, dtype, &[cols, tokens])?;
                    let db = dbias_out(&mut dbias, &mut ws);
                    cast_transpose_dact(&dev, act, &d_act, pre_act, &mut out, &mut out_t, fp8, db)?;
                    Ok((out, out_t))
                })?
            }
            Recipe::Current(c) => {
                // Current scaling needs the amax of the derivative before the cast: compute it
                // in high precision first, then cast as a plain gradient.
                let mut d_pre = Tensor::empty(&dev, pre_act.dtype(), pre_act.shape())?;
                activation::backward(&dev, act, &d_act, pre_act, &mut d_pre, None)?;
                let dtype = c.fp8_format.backward_dtype();
                let d8 = quantize_current(&dev, &d_pre, dtype, &c, true, dbias_out(&mut dbias, &mut ws))?;
                return Ok((d8, dbias));
            }
        };
        Ok((Float8Tensor::from_parts(out, Some(out_t), scale_inv)?, dbias))
    }
}

/// The dbias outputs of a cast, when there is a bias gradient.
fn dbias_out<'a>(dbias: &'a mut Option<Tensor>, ws: &'a mut CudaSlice<f32>) -> Option<DbiasOut<'a>> {
    dbias.as_mut().map(|d| DbiasOut { dbias: d, workspace: ws.as_view_mut() })
}
