//! `MoeMLP`: the mixture-of-experts MLP block, a drop-in for [`super::LayerNormMLP`] in a
//! [`super::TransformerLayer`] (Megatron-LM's `MoELayer` with `TopKRouter` and `TEGroupedMLP`,
//! `megatron/core/transformer/moe/{moe_layer,router,experts,token_dispatcher}.py`, over TE's
//! `GroupedLinear`, `moe_permute`/`moe_unpermute` and fused router kernels).
//!
//! `x [tokens, hidden]` → norm → router `Linear` (`hidden → num_experts`, no bias, always in
//! high precision: Megatron keeps the router out of FP8) → top-k softmax router
//! ([`te_runtime::ops::moe_router::topk_router`]) → routing map and rows per expert
//! ([`te_runtime::ops::moe::routing_map`]; copied to the host for the expert GEMMs' `m_splits`, as TE
//! and Megatron do with `.tolist()`, or kept on the device with
//! [`MoeMLPConfig::device_m_splits`]) → [`te_runtime::ops::moe::permute`] → fc1 [`GroupedLinear`] →
//! activation → fc2 [`GroupedLinear`] → [`te_runtime::ops::moe::unpermute`] weighted by the routing
//! probabilities → `[tokens, hidden]`. The residual is the caller's, as for `LayerNormMLP`.
//!
//! The forward also computes the Switch-Transformer load-balancing loss
//! ([`te_runtime::ops::moe_router::aux_loss`], coefficient [`MoeMLPConfig::aux_loss_coeff`]) and the
//! backward adds its gradient to the router's: the aux loss is part of the training objective
//! (Megatron's `MoEAuxLossAutoScaler`, gradient `d_loss = 1` times
//! [`MoeMLPCtx::set_aux_loss_grad`]).
//!
//! FP8: under `fp8_autocast` the expert GEMMs run in FP8 through `GroupedLinear`, whose
//! training pass needs every nonzero row group to be a multiple of 16. Each expert's rows are
//! then padded with zero rows to the next multiple of 16 before fc1 and the padding dropped
//! after fc2 (TE's `Fp8Padding` / `Fp8Unpadding`, `pytorch/module/fp8_padding.py`): one extra
//! copy of the permuted activations each way in forward and in backward, and up to `15 ·
//! num_experts` padded rows of GEMM work. The padded rows' gradients are zero, so they add
//! nothing to the weight gradients. Inference needs no padding.

use super::grouped_linear::{GroupedLinear, GroupedLinearConfig, GroupedLinearCtx};
use super::linear::check_input;
use super::norm::{NormConfig, NormKind, NormParams, NormStats};
use super::params::convert;
use super::{next_module_id, Activation, ForwardOptions, Linear, LinearConfig, LinearCtx, Stamp};
use crate::fp8::{fp8_autocast, fp8_mode, Fp8Mode, Recipe};
use cudarc::driver::CudaSlice;
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::graph::HostCopies;
use te_runtime::ops::activation;
use te_runtime::ops::elementwise::add_assign;
use te_runtime::ops::moe::{permute, routing_map, unpermute, unpermute_dprobs, MoeRouting};
use te_runtime::ops::moe_router::{
    aux_loss, aux_loss_backward, topk_router, topk_router_backward, RouterConfig, RouterOutput,
};
use te_runtime::{Device, DeviceBuffer, Error, Result, Tensor};

const MODULE: &str = "MoeMLP";

/// The row groups of the FP8 expert GEMMs are padded to multiples of this.
pub const FP8_ROW_ALIGNMENT: usize = 16;

/// Arguments of [`MoeMLP::new`] (Megatron's `TransformerConfig` MoE fields: `num_moe_experts`,
/// `moe_router_topk`, `moe_aux_loss_coeff`, `moe_router_pre_softmax`, `moe_ffn_hidden_size`).
#[derive(Debug, Clone)]
pub struct MoeMLPConfig {
    /// Model width: the norm's size, fc1's input, fc2's output, the router's input.
    pub hidden_size: usize,
    /// Each expert's fc1 output (×2 for the gated SwiGLU/GeGLU, whose fc1 is `[2·ffn, hidden]`);
    /// Megatron's `moe_ffn_hidden_size`.
    pub ffn_hidden_size: usize,
    /// Experts (Megatron `num_moe_experts`), 1 to 512 (the router kernel's limit).
    pub num_experts: usize,
    /// Experts per token (Megatron `moe_router_topk`), 1 to `num_experts`.
    pub topk: usize,
    /// Weight of the load-balancing loss (Megatron `moe_aux_loss_coeff`). Default 1e-2.
    pub aux_loss_coeff: f32,
    /// Softmax over all experts before the top-k (Megatron `moe_router_pre_softmax`); default
    /// false: the top-k logits, then a softmax over those `k`.
    pub pre_softmax: bool,
    /// Norm epsilon. Default 1e-5.
    pub eps: f32,
    /// LayerNorm (default) or RMSNorm.
    pub normalization: NormKind,
    /// TE `zero_centered_gamma`.
    pub zero_centered_gamma: bool,
    /// The experts' activation: GELU (default), ReLU, SwiGLU or GeGLU.
    pub activation: Activation,
    /// The experts' fc1 and fc2 have biases (the router never has one). Default true.
    pub bias: bool,
    /// Dtype of all parameters and gradients. Default BF16.
    pub params_dtype: DType,
    /// Std of the normal weight init (router and experts).
    pub init_std: f32,
    /// Seed of the weight init: the router uses `seed`, expert `i`'s fc1 `seed + 2^32 + i`, its
    /// fc2 `seed + 2^33 + i`.
    pub seed: u64,
    /// Keep the rows per expert on the device outside `fp8_autocast`: the expert GEMMs run as
    /// one grouped launch per pass ([`GroupedLinear::forward_device`]) and a 16-bit forward and
    /// backward never wait for the GPU (TE and Megatron copy `m_splits` to the host), so a CUDA
    /// graph ([`te_runtime::graph::Graph`]) can capture them. Needs
    /// Hopper and `hidden_size`/`ffn_hidden_size` multiples of 16 (checked by [`MoeMLP::new`]);
    /// FP8 passes and f32 inputs take the host's splits. Default false.
    pub device_m_splits: bool,
}

impl MoeMLPConfig {
    /// `num_experts` experts of `hidden_size → ffn_hidden_size → hidden_size`, `topk` per token,
    /// with the defaults documented on the fields.
    pub fn new(hidden_size: usize, ffn_hidden_size: usize, num_experts: usize, topk: usize) -> Self {
        Self {
            hidden_size,
            ffn_hidden_size,
            num_experts,
            topk,
            aux_loss_coeff: 1e-2,
            pre_softmax: false,
            eps: 1e-5,
            normalization: NormKind::LayerNorm,
            zero_centered_gamma: false,
            activation: Activation::Gelu,
            bias: true,
            params_dtype: DType::BF16,
            init_std: 0.023,
            seed: 0,
            device_m_splits: false,
        }
    }

    /// fc1's outputs per expert: `2 · ffn` for gated activations, else `ffn`.
    pub fn fc1_out(&self) -> usize {
        if self.activation.is_gated() {
            2 * self.ffn_hidden_size
        } else {
            self.ffn_hidden_size
        }
    }

    /// The norm's, the router's and the two expert layers' configs.
    pub(crate) fn parts(&self) -> (NormConfig, LinearConfig, GroupedLinearConfig, GroupedLinearConfig) {
        let (h, e) = (self.hidden_size, self.num_experts);
        let norm = NormConfig {
            eps: self.eps,
            zero_centered_gamma: self.zero_centered_gamma,
            params_dtype: self.params_dtype,
            ..NormConfig::new(h)
        };
        let router = LinearConfig {
            bias: false,
            params_dtype: self.params_dtype,
            init_std: self.init_std,
            seed: self.seed,
            ..LinearConfig::new(h, e)
        };
        let grouped = |in_f, out_f, seed| GroupedLinearConfig {
            bias: self.bias,
            params_dtype: self.params_dtype,
            init_std: self.init_std,
            seed,
            ..GroupedLinearConfig::new(e, in_f, out_f)
        };
        let fc1 = grouped(h, self.fc1_out(), self.seed.wrapping_add(1 << 32));
        let fc2 = grouped(self.ffn_hidden_size, h, self.seed.wrapping_add(1 << 33));
        (norm, router, fc1, fc2)
    }

    /// Checks the router's sizes and the coefficient.
    fn check(&self) -> Result<()> {
        let max = te_codegen::spec::MoeRouterSpec::MAX_EXPERTS;
        let config = |message: String| Error::Config { module: MODULE, message };
        if !(1..=max).contains(&self.num_experts) {
            return Err(config(format!("num_experts = {} must be in [1, {max}]", self.num_experts)));
        }
        if !(1..=self.num_experts).contains(&self.topk) {
            return Err(config(format!("topk = {} must be in [1, num_experts = {}]", self.topk, self.num_experts)));
        }
        if !self.aux_loss_coeff.is_finite() || self.aux_loss_coeff < 0.0 {
            return Err(config(format!("aux_loss_coeff = {} must be finite and ≥ 0", self.aux_loss_coeff)));
        }
        if self.hidden_size == 0 || self.ffn_hidden_size == 0 {
            return Err(config("hidden_size and ffn_hidden_size must be ≥ 1".into()));
        }
        if self.device_m_splits && (self.hidden_size % 16 != 0 || self.ffn_hidden_size % 16 != 0) {
            return Err(config(format!(
                "device_m_splits needs hidden_size ({}) and ffn_hidden_size ({}) multiples of 16 (the grouped \
                 GEMM's 16-byte rows); set it to false for the host's splits",
                self.hidden_size, self.ffn_hidden_size
            )));
        }
        Ok(())
    }

    /// Parameters of a block of this config: norm `2h` (LayerNorm) or `h` (RMSNorm), router `E ·
    /// h`, and per expert `h · fc1_out + ffn · h` (+ `fc1_out + h` biases).
    pub fn num_parameters(&self) -> usize {
        let (h, f, e) = (self.hidden_size, self.ffn_hidden_size, self.num_experts);
        let norm = match self.normalization {
            NormKind::LayerNorm => 2 * h,
            NormKind::RmsNorm => h,
        };
        let bias = if self.bias { self.fc1_out() + h } else { 0 };
        let expert = h.saturating_mul(self.fc1_out()).saturating_add(f.saturating_mul(h)).saturating_add(bias);
        norm.saturating_add(e.saturating_mul(h)).saturating_add(e.saturating_mul(expert))
    }
}

/// The mixture-of-experts options of a [`super::TransformerLayer`] (and of a GPT): its MLP
/// becomes a [`MoeMLP`] of `num_experts` experts, each of the layer's `ffn_hidden_size`
/// (Megatron's `num_moe_experts`, `moe_router_topk`, `moe_aux_loss_coeff`,
/// `moe_router_pre_softmax`).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeConfig {
    /// Experts, 1 to 512.
    pub num_experts: usize,
    /// Experts per token, 1 to `num_experts`.
    pub topk: usize,
    /// Weight of the load-balancing loss added to the training loss (Megatron default 1e-2).
    pub aux_loss_coeff: f32,
    /// Softmax before the top-k (default false).
    pub pre_softmax: bool,
    /// Keep each layer's rows per expert on the device ([`MoeMLPConfig::device_m_splits`]: one
    /// grouped GEMM launch per expert pass, no host synchronization; Hopper). Default false.
    #[serde(default)]
    pub device_m_splits: bool,
}

impl MoeConfig {
    /// `num_experts` experts, `topk` per token, aux loss coefficient 1e-2, softmax after the
    /// top-k, the rows per expert copied to the host.
    pub const fn new(num_experts: usize, topk: usize) -> Self {
        Self { num_experts, topk, aux_loss_coeff: 1e-2, pre_softmax: false, device_m_splits: false }
    }
}

/// What [`MoeMLP::forward`] saves for [`MoeMLP::backward`], and the forward's aux loss.
#[derive(Debug)]
pub struct MoeMLPCtx {
    stamp: Stamp<2>,
    x: Tensor,
    stats: NormStats,
    router_ctx: LinearCtx,
    router: RouterOutput,
    routing: MoeRouting,
    /// Rows per expert, and the padded rows per expert the GEMMs ran (FP8) when they differ.
    m_splits: Vec<usize>,
    padded: Option<Vec<usize>>,
    fc1: GroupedLinearCtx,
    /// fc1's output (padded under FP8), the activation's input.
    pre_act: Tensor,
    fc2: GroupedLinearCtx,
    /// fc2's output without padding `[tokens · k, hidden]`: the probabilities' gradient reads it.
    y_perm: Tensor,
    aux_loss: DeviceBuffer<f32>,
    aux_loss_grad: f32,
    dev: Arc<Device>,
}

impl MoeMLPCtx {
    /// The load-balancing loss of this forward (f32 `[1]` on the device, coefficient included).
    pub fn aux_loss(&self) -> &CudaSlice<f32> {
        &self.aux_loss
    }

    /// [`MoeMLPCtx::aux_loss`] copied to the host (waits for the stream).
    ///
    /// # Errors
    /// Copy failures.
    pub fn aux_loss_value(&self) -> Result<f32> {
        Ok(self.dev.stream().dtoh(&self.aux_loss)?.first().copied().unwrap_or(0.0))
    }

    /// The gradient of the objective with respect to the aux loss the backward propagates
    /// (default 1: the aux loss is added to the loss once; a micro-batch weight `w` of the loss
    /// makes it `w`). A value of 0 leaves the router with the task gradient only.
    pub fn set_aux_loss_grad(&mut self, grad: f32) {
        self.aux_loss_grad = grad;
    }

    /// Rows per expert of this forward (before padding); empty when they stayed on the device
    /// ([`MoeMLPConfig::device_m_splits`]: read [`MoeMLPCtx::device_tokens_per_expert`]).
    pub fn tokens_per_expert(&self) -> &[usize] {
        &self.m_splits
    }

    /// Rows per expert of this forward on the device (i32 `[num_experts]`, what
    /// [`te_runtime::ops::moe::routing_map`] wrote).
    pub fn device_tokens_per_expert(&self) -> &CudaSlice<i32> {
        &self.routing.m_splits
    }

    /// The router's output of this forward: each token's experts (i32 `[tokens, topk]`), their
    /// probabilities and the softmax scores (f32), on the device.
    pub fn router_output(&self) -> &RouterOutput {
        &self.router
    }

    /// The rows per expert the expert GEMMs ran: [`MoeMLPCtx::tokens_per_expert`] padded to
    /// multiples of 16 under FP8 training, else the same.
    pub fn gemm_splits(&self) -> &[usize] {
        self.padded.as_deref().unwrap_or(&self.m_splits)
    }

    /// Device bytes held for backward (approximate): the saved activations of the experts and
    /// the routing buffers.
    pub fn saved_bytes(&self) -> usize {
        self.stats.bytes()
            + self.fc1.saved_bytes()
            + self.fc2.saved_bytes()
            + self.pre_act.num_bytes()
            + self.y_perm.num_bytes()
            + self.router_ctx.saved_bytes()
            + 4 * (self.router.scores.len() + 2 * self.router.probs.len() + self.routing.row_id_map.len())
    }
}

/// `y = unpermute(fc2(act(fc1(permute(norm(x))))), probs)` for `x: [..., hidden]` (f32, bf16 or
/// f16), `y` of `x`'s shape and dtype; see the module docs.
#[derive(Debug)]
pub struct MoeMLP {
    dev: Arc<Device>,
    id: u64,
    cfg: MoeMLPConfig,
    norm: NormParams,
    router: Linear,
    fc1: GroupedLinear,
    fc2: GroupedLinear,
}

/// What one forward produced: the output and, in training, the context.
type Run = (Tensor, Option<MoeMLPCtx>);

impl MoeMLP {
    /// A block initialized as documented on [`MoeMLPConfig::seed`].
    ///
    /// # Errors
    /// [`Error::Config`] for `num_experts` outside `[1, 512]`, `topk` outside `[1,
    /// num_experts]`, a negative or non-finite `aux_loss_coeff`, zero sizes, and what `Linear`,
    /// `GroupedLinear` and the norm refuse; allocation failures.
    pub fn new(dev: &Arc<Device>, cfg: MoeMLPConfig) -> Result<Self> {
        cfg.check()?;
        if cfg.device_m_splits && dev.arch() != te_codegen::Arch::Sm90a {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "device_m_splits runs the experts' grouped GEMM, which needs Hopper (sm_90a), not {}; set it to false",
                    dev.arch()
                ),
            });
        }
        let (norm_cfg, router_cfg, fc1_cfg, fc2_cfg) = cfg.parts();
        let norm = NormParams::new(dev, MODULE, cfg.normalization, norm_cfg)?;
        let router = Linear::new(dev, router_cfg)?;
        let fc1 = GroupedLinear::new(dev, fc1_cfg)?;
        let fc2 = GroupedLinear::new(dev, fc2_cfg)?;
        Ok(Self { dev: dev.clone(), id: next_module_id(), cfg, norm, router, fc1, fc2 })
    }

    /// The configuration.
    pub fn config(&self) -> &MoeMLPConfig {
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

    /// The router `[num_experts, hidden]` (no bias).
    pub fn router(&self) -> &Linear {
        &self.router
    }

    /// The router, mutably.
    pub fn router_mut(&mut self) -> &mut Linear {
        &mut self.router
    }

    /// The experts' fc1 (`[fc1_out, hidden]` per expert).
    pub fn fc1(&self) -> &GroupedLinear {
        &self.fc1
    }

    /// The experts' fc1, mutably.
    pub fn fc1_mut(&mut self) -> &mut GroupedLinear {
        &mut self.fc1
    }

    /// The experts' fc2 (`[hidden, ffn]` per expert).
    pub fn fc2(&self) -> &GroupedLinear {
        &self.fc2
    }

    /// The experts' fc2, mutably.
    pub fn fc2_mut(&mut self) -> &mut GroupedLinear {
        &mut self.fc2
    }

    fn stamp(&self) -> Stamp<2> {
        Stamp::new(self.id, [self.norm.version(), self.router.params().version()])
    }

    /// Forward for training: `y` (`x`'s shape and dtype) and the context (which holds the aux
    /// loss, [`MoeMLPCtx::aux_loss`]).
    ///
    /// # Errors
    /// [`Error::Shape`] / [`Error::DType`] for an input that is not `[..., hidden]` f32/bf16/f16
    /// or has no rows; under FP8, feature sizes that are not multiples of 16 (the expert rows are
    /// padded); kernel, GEMM and copy failures.
    pub fn forward(&mut self, x: &Tensor) -> Result<(Tensor, MoeMLPCtx)> {
        self.forward_with(x, ForwardOptions::default())
    }

    /// [`MoeMLP::forward`] with options: `is_first_microbatch` goes to the expert GEMMs (their
    /// FP8 weight caches); `fp8_output` is refused (the output is a weighted sum of rows).
    ///
    /// # Errors
    /// As [`MoeMLP::forward`]; [`Error::Config`] for `fp8_output`.
    pub fn forward_with(&mut self, x: &Tensor, opts: ForwardOptions) -> Result<(Tensor, MoeMLPCtx)> {
        if opts.fp8_output {
            return Err(Error::Config {
                module: MODULE,
                message: "fp8_output is not supported: the output is the probability-weighted sum of the experts' rows"
                    .into(),
            });
        }
        let (y, ctx) = self.run(x, opts, true)?;
        Ok((y, ctx.ok_or_else(|| Error::internal(MODULE, "a training forward saved nothing"))?))
    }

    /// Forward for inference: no context, no aux loss, no padding (any row counts under FP8).
    ///
    /// # Errors
    /// As [`MoeMLP::forward`].
    pub fn infer(&mut self, x: &Tensor) -> Result<Tensor> {
        Ok(self.run(x, ForwardOptions::default(), false)?.0)
    }

    fn run(&mut self, x: &Tensor, opts: ForwardOptions, grad: bool) -> Result<Run> {
        check_input(MODULE, x, self.cfg.hidden_size)?;
        let dev = self.dev.clone();
        let (dt, h, k, e) = (x.dtype(), self.cfg.hidden_size, self.cfg.topk, self.cfg.num_experts);
        let (tokens, _) = x.as_2d(MODULE)?;
        let (ln, stats) = self.norm.forward(x, dt)?;
        let ln = ln.reshape(&[tokens, h])?;
        // The router in high precision: a disabled scope inside the caller's.
        let router = &mut self.router;
        let (logits, router_ctx) = if grad {
            let (l, c) = fp8_autocast(false, Recipe::default(), || router.forward(&ln))?;
            (l, Some(c))
        } else {
            (fp8_autocast(false, Recipe::default(), || router.infer(&ln))?, None)
        };
        let rcfg = RouterConfig { k, pre_softmax: self.cfg.pre_softmax, scaling_factor: 1.0 };
        let mut r = RouterOutput::new(&dev, tokens, e, rcfg)?;
        topk_router(&dev, &logits, &mut r)?;
        let mut routing = MoeRouting::new(&dev, tokens, k, e)?;
        routing_map(&dev, &r.indices, &mut routing)?;
        let fp8 = matches!(fp8_mode(), Fp8Mode::Fp8(_) | Fp8Mode::Calibrating(_));
        let on_device = self.cfg.device_m_splits && !fp8 && matches!(dt, DType::BF16 | DType::F16);
        let m_splits = if on_device { Vec::new() } else { host_splits(&dev, &routing)? };
        let mut x_perm = Tensor::empty(&dev, dt, &[routing.rows(), h])?;
        permute(&dev, &ln, &routing, None, &mut x_perm)?;
        // FP8 training: pad every expert's rows to a multiple of 16 (TE's Fp8Padding).
        let padded =
            (grad && matches!(fp8_mode(), Fp8Mode::Fp8(_))).then(|| pad_splits(&m_splits)).filter(|p| *p != m_splits);
        let splits = padded.as_deref().unwrap_or(&m_splits);
        if let Some(p) = &padded {
            x_perm = move_groups(&dev, &x_perm, &m_splits, p)?;
        }
        let (pre_act, fc1_ctx) = match (grad, on_device) {
            (true, false) => {
                let (y, c) = self.fc1.forward_with(&x_perm, splits, opts)?;
                (y, Some(c))
            }
            (true, true) => {
                let (y, c) = self.fc1.forward_device(&x_perm, &routing.m_splits)?;
                (y, Some(c))
            }
            (false, false) => (self.fc1.infer(&x_perm, splits)?, None),
            (false, true) => (self.fc1.infer_device(&x_perm, &routing.m_splits)?, None),
        };
        drop(x_perm);
        let rows = pre_act.shape()[0];
        let mut act = Tensor::empty(&dev, dt, &[rows, self.cfg.ffn_hidden_size])?;
        activation::forward(&dev, self.cfg.activation, &pre_act, None, &mut act, None)?;
        let (mut y_perm, fc2_ctx) = match (grad, on_device) {
            (true, false) => {
                let (y, c) = self.fc2.forward_with(&act, splits, opts)?;
                (y, Some(c))
            }
            (true, true) => {
                let (y, c) = self.fc2.forward_device(&act, &routing.m_splits)?;
                (y, Some(c))
            }
            (false, false) => (self.fc2.infer(&act, splits)?, None),
            (false, true) => (self.fc2.infer_device(&act, &routing.m_splits)?, None),
        };
        drop(act);
        if let Some(p) = &padded {
            y_perm = move_groups(&dev, &y_perm, p, &m_splits)?;
        }
        let mut out = Tensor::empty(&dev, dt, &[tokens, h])?;
        unpermute(&dev, &y_perm, &routing, Some(&r.probs), &mut out)?;
        let out = out.reshape(x.shape())?;
        let (Some(router_ctx), Some(fc1), Some(fc2)) = (router_ctx, fc1_ctx, fc2_ctx) else {
            return Ok((out, None));
        };
        let mut aux = dev.stream().alloc_zeros::<f32>(1)?;
        aux_loss(&dev, &r, &routing.m_splits, self.cfg.aux_loss_coeff, &mut aux)?;
        let ctx = MoeMLPCtx {
            stamp: self.stamp(),
            x: x.clone(),
            stats,
            router_ctx,
            router: r,
            routing,
            m_splits,
            padded,
            fc1,
            pre_act,
            fc2,
            y_perm,
            aux_loss: DeviceBuffer::new(aux),
            aux_loss_grad: 1.0,
            dev,
        };
        Ok((out, Some(ctx)))
    }

    /// Backward: `dx` (`x`'s shape and dtype) for `grad_output`; every parameter gradient
    /// accumulates, the router's with the aux loss's part (times
    /// [`MoeMLPCtx::set_aux_loss_grad`], default 1).
    ///
    /// # Errors
    /// [`Error::Context`] for another module's or a stale context; [`Error::Shape`] /
    /// [`Error::DType`] for a `grad_output` that is not the output's shape in f32/bf16/f16;
    /// kernel, GEMM and copy failures.
    pub fn backward(&mut self, ctx: MoeMLPCtx, grad_output: &Tensor) -> Result<Tensor> {
        ctx.stamp.check(MODULE, self.stamp())?;
        te_runtime::ops::check_shape(MODULE, "grad_output", grad_output, ctx.x.shape())?;
        let dev = self.dev.clone();
        let (dt, h) = (ctx.x.dtype(), self.cfg.hidden_size);
        let tokens = ctx.routing.tokens;
        let dy = convert(&dev, grad_output.clone(), dt)?.reshape(&[tokens, h])?;
        // unpermute: out[t] = Σ_j p[t, j] · y[row(t, j)].
        let mut d_probs = dev.stream().alloc_zeros::<f32>((tokens * self.cfg.topk).max(1))?;
        unpermute_dprobs(&dev, &dy, &ctx.y_perm, &ctx.routing, &mut d_probs)?;
        let mut d_y = Tensor::zeros(&dev, dt, &[ctx.routing.rows(), h])?;
        permute(&dev, &dy, &ctx.routing, Some(&ctx.router.probs), &mut d_y)?;
        drop(ctx.y_perm);
        if let Some(p) = &ctx.padded {
            d_y = move_groups(&dev, &d_y, &ctx.m_splits, p)?;
        }
        let d_act = self.fc2.backward(ctx.fc2, &d_y)?;
        drop(d_y);
        let d_act = convert(&dev, d_act, dt)?;
        let mut d_pre = Tensor::empty(&dev, dt, ctx.pre_act.shape())?;
        activation::backward(&dev, self.cfg.activation, &d_act, &ctx.pre_act, &mut d_pre, None)?;
        drop(d_act);
        let mut d_x_perm = convert(&dev, self.fc1.backward(ctx.fc1, &d_pre)?, dt)?;
        drop(d_pre);
        if let Some(p) = &ctx.padded {
            d_x_perm = move_groups(&dev, &d_x_perm, p, &ctx.m_splits)?;
        }
        // permute's backward: the k copies of each token summed back.
        let mut d_ln = Tensor::empty(&dev, dt, &[tokens, h])?;
        unpermute(&dev, &d_x_perm, &ctx.routing, None, &mut d_ln)?;
        drop(d_x_perm);
        // Router: the probabilities' gradient, plus the aux loss's, into the logits.
        let mut d_logits = Tensor::empty(&dev, dt, &[tokens, self.cfg.num_experts])?;
        topk_router_backward(&dev, &ctx.router, &d_probs, &mut d_logits)?;
        let d_aux = device_scalar(&dev, ctx.aux_loss_grad)?;
        let coeff = self.cfg.aux_loss_coeff;
        aux_loss_backward(&dev, &ctx.router, &ctx.routing.m_splits, coeff, &d_aux, &mut d_logits, true)?;
        let d_ln_router = convert(&dev, self.router.backward(ctx.router_ctx, &d_logits)?, dt)?;
        add_assign(&dev, &mut d_ln, &d_ln_router)?;
        self.norm.backward(&d_ln.reshape(ctx.x.shape())?, &ctx.x, &ctx.stats)
    }
}

/// `[value]` on the device, written by a memset (no host upload: a CUDA graph captures it with
/// the value).
fn device_scalar(dev: &Device, value: f32) -> Result<CudaSlice<f32>> {
    use cudarc::driver::DevicePtrMut;
    let stream = dev.stream();
    let mut out = stream.alloc_zeros::<f32>(1)?;
    {
        let (ptr, _guard) = out.device_ptr_mut(stream);
        // SAFETY: `ptr` is a live allocation of one f32; the memset writes those 4 bytes, ordered
        // on the stream every op of this crate uses.
        unsafe { cudarc::driver::sys::cuMemsetD32Async(ptr, value.to_bits(), 1, stream.cu_stream()) }.result()?;
    }
    Ok(out)
}

/// Rows per expert of `routing`, copied to the host (one stream synchronization).
fn host_splits(dev: &Device, routing: &MoeRouting) -> Result<Vec<usize>> {
    let splits = dev.stream().dtoh(&*routing.m_splits)?;
    splits
        .into_iter()
        .map(|m| usize::try_from(m).map_err(|_| Error::internal(MODULE, format!("a negative expert row count {m}"))))
        .collect()
}

/// Each split rounded up to a multiple of [`FP8_ROW_ALIGNMENT`] (0 stays 0).
pub(crate) fn pad_splits(splits: &[usize]) -> Vec<usize> {
    splits.iter().map(|&m| m.next_multiple_of(FP8_ROW_ALIGNMENT)).collect()
}

/// The row groups of `x` (`[Σ from, cols]`, group `i` of `from[i]` rows) copied into a new
/// `[Σ to, cols]` tensor with group `i` at `to[i]` rows: the first `min(from[i], to[i])` rows
/// of each group are kept, rows past them are zero (padding) or dropped (unpadding). One copy
/// per group (TE's `Fp8Padding` / `Fp8Unpadding`).
fn move_groups(dev: &Device, x: &Tensor, from: &[usize], to: &[usize]) -> Result<Tensor> {
    let (rows, cols) = x.as_2d(MODULE)?;
    if from.len() != to.len() || from.iter().sum::<usize>() != rows {
        return Err(Error::internal(MODULE, format!("row groups {from:?} do not match {rows} rows")));
    }
    let total: usize = to.iter().sum();
    let grows = from.iter().zip(to).any(|(f, t)| t > f);
    let mut out = match grows {
        true => Tensor::zeros(dev, x.dtype(), &[total, cols])?,
        false => Tensor::empty(dev, x.dtype(), &[total, cols])?,
    };
    let row_bytes = cols * x.dtype().size_bytes();
    let (mut src, mut dst) = (0, 0);
    let out_data = out.data_mut()?;
    for (&f, &t) in from.iter().zip(to) {
        let n = f.min(t);
        if n > 0 {
            let view = x.data().slice(src * row_bytes..(src + n) * row_bytes);
            let mut target = out_data.slice_mut(dst * row_bytes..(dst + n) * row_bytes);
            dev.stream().memcpy_dtod(&view, &mut target)?;
        }
        src += f;
        dst += t;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_pad_to_sixteen_and_zero_stays_zero() {
        assert_eq!(pad_splits(&[0, 1, 16, 17, 33]), vec![0, 16, 16, 32, 48]);
    }

    #[test]
    fn configs_are_checked() {
        let ok = MoeMLPConfig::new(64, 128, 8, 2);
        ok.check().unwrap();
        let e = MoeMLPConfig { topk: 9, ..ok.clone() }.check().unwrap_err();
        assert!(e.to_string().contains("topk = 9"), "{e}");
        let e = MoeMLPConfig { num_experts: 0, topk: 0, ..ok.clone() }.check().unwrap_err();
        assert!(e.to_string().contains("num_experts = 0"), "{e}");
        let e = MoeMLPConfig { num_experts: 513, ..ok.clone() }.check().unwrap_err();
        assert!(e.to_string().contains("513"), "{e}");
        let e = MoeMLPConfig { aux_loss_coeff: f32::NAN, ..ok.clone() }.check().unwrap_err();
        assert!(e.to_string().contains("aux_loss_coeff"), "{e}");
    }

    #[test]
    fn parameter_count_adds_the_router_and_the_experts() {
        let c = MoeMLPConfig::new(64, 128, 8, 2);
        assert_eq!(c.num_parameters(), 2 * 64 + 8 * 64 + 8 * (64 * 128 + 128 * 64 + 128 + 64));
        let g = MoeMLPConfig { activation: Activation::Swiglu, bias: false, ..c };
        assert_eq!(g.num_parameters(), 2 * 64 + 8 * 64 + 8 * (64 * 256 + 128 * 64));
        let (_, router, fc1, fc2) = g.parts();
        assert!(!router.bias && router.out_features == 8);
        assert_eq!((fc1.out_features, fc2.in_features, fc1.num_gemms), (256, 128, 8));
        assert_ne!(fc1.seed, fc2.seed);
    }
}
