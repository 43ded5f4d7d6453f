//! Family 18's launchers: the mixture-of-experts top-k softmax router and the auxiliary
//! load-balancing loss, forward and backward (TE 2.x `pytorch/router.py`:
//! `fused_topk_with_score_function` with `score_function="softmax"` and `fused_moe_aux_loss`,
//! whose kernels are `transformer_engine/common/fused_router/`; the loss is the Switch
//! Transformer's, Fedus et al. 2021, eq. 4, in Megatron-LM's `switch_load_balancing_loss_func`
//! form).
//!
//! [`topk_router`] turns logits `[tokens, experts]` into each token's `k` experts (i32
//! `[tokens, k]`, what [`super::moe::routing_map`] takes), their probabilities (f32 `[tokens,
//! k]`) and the softmax over all experts (f32 `[tokens, experts]`, the auxiliary loss's
//! scores); [`topk_router_backward`] is the logits' gradient from the probabilities' gradient;
//! [`aux_loss`] is the loss of the scores and the tokens per expert (`m_splits` of
//! [`super::moe::MoeRouting`]), [`aux_loss_backward`] adds its gradient to the logits'. The
//! numerics are `te_reference::moe`'s (`te_reference::moe::topk_router`,
//! `te_reference::moe::aux_loss`): softmaxes in f64 rounded to f32, the top k by
//! `f32::total_cmp` with ties to the lower expert, the loss summed in f64.

use super::check_dtype;
use super::launch::Launch;
use crate::DeviceBuffer;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::MoeRouterSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "moe_router";

/// The router's options (TE's `topk`, `use_pre_softmax`, `scaling_factor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouterConfig {
    /// Experts per token (`topk`), 1 to the number of experts.
    pub k: usize,
    /// `true`: softmax over all experts, then the `k` best probabilities as they are. `false`
    /// (TE's default): the `k` best logits, then a softmax over those `k` (each token's
    /// probabilities sum to `scaling_factor`).
    pub pre_softmax: bool,
    /// Factor of every probability (TE's `scaling_factor`; 1 when TE's is `None`).
    pub scaling_factor: f32,
}

impl RouterConfig {
    /// Top-`k` routing with TE's defaults: softmax after the top-k, scaling factor 1.
    pub const fn new(k: usize) -> Self {
        Self { k, pre_softmax: false, scaling_factor: 1.0 }
    }
}

/// A routing of `tokens` tokens over `experts` experts ([`topk_router`] fills it), and what its
/// backward and the auxiliary loss read.
#[derive(Debug)]
pub struct RouterOutput {
    /// Tokens routed.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// The options.
    pub config: RouterConfig,
    /// i32 `[tokens, k]`: token `t`'s `j`-th best expert at `t · k + j` (one element at least).
    pub indices: DeviceBuffer<i32>,
    /// f32 `[tokens, k]`: the routing probabilities of those experts (one element at least).
    pub probs: DeviceBuffer<f32>,
    /// f32 `[tokens, experts]`: the softmax over all experts (one element at least).
    pub scores: DeviceBuffer<f32>,
}

impl RouterOutput {
    /// Storage for the routing of `tokens` tokens over `experts` experts with `config`.
    ///
    /// # Errors
    /// [`Error::Shape`] when `experts` is 0 or above [`MoeRouterSpec::MAX_EXPERTS`] (512), `k`
    /// is 0 or above `experts`, or `tokens · experts` reaches 2^62; [`Error::Argument`] for a
    /// scaling factor that is not finite; allocation failures.
    pub fn new(dev: &Device, tokens: usize, experts: usize, config: RouterConfig) -> Result<Self> {
        let k = config.k;
        if !(1..=MoeRouterSpec::MAX_EXPERTS).contains(&experts) || !(1..=experts).contains(&k) {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "the router takes 1 to {} experts (got {experts}) and k from 1 to the experts (got {k})",
                    MoeRouterSpec::MAX_EXPERTS
                ),
            });
        }
        let elements = tokens.checked_mul(experts).filter(|&n| n < 1 << 62).ok_or_else(|| Error::Shape {
            op: OP,
            message: format!("{tokens} tokens × {experts} experts are too many: route the batch in parts"),
        })?;
        if !config.scaling_factor.is_finite() {
            return Err(Error::Argument {
                op: OP,
                message: format!("scaling_factor = {} is not finite", config.scaling_factor),
            });
        }
        let stream = dev.stream();
        Ok(Self {
            tokens,
            experts,
            config,
            // At least one element each (a 0-byte allocation is refused).
            indices: stream.alloc_zeros::<i32>((tokens * k).max(1))?.into(),
            probs: stream.alloc_zeros::<f32>((tokens * k).max(1))?.into(),
            scores: stream.alloc_zeros::<f32>(elements.max(1))?.into(),
        })
    }

    /// The kernels of `dtype` for this routing's experts on `dev`.
    fn spec(&self, dev: &Device, dtype: DType) -> MoeRouterSpec {
        MoeRouterSpec::new(dtype, self.experts, dev.arch())
    }

    /// The sizes every entry point takes: tokens, experts, k.
    fn sizes(&self) -> [u64; 3] {
        [self.tokens as u64, self.experts as u64, self.config.k as u64]
    }

    /// One warp per token.
    fn token_grid(&self) -> Result<LaunchConfig> {
        let blocks =
            u32::try_from(self.tokens.div_ceil(MoeRouterSpec::TOKENS_PER_BLOCK)).map_err(|_| Error::Shape {
                op: OP,
                message: format!("{} tokens exceed one launch grid: route the batch in parts", self.tokens),
            })?;
        Ok(LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (MoeRouterSpec::THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Fails unless `t` is `[tokens, experts]` (leading dims folded) of a bf16, f16 or f32 dtype.
    fn check_logits(&self, what: &'static str, t: &Tensor) -> Result<()> {
        check_dtype(OP, what, t, DType::is_high_precision, "bf16, f16 or f32")?;
        let (rows, cols) = t.as_2d(OP)?;
        if (rows, cols) != (self.tokens, self.experts) {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "`{what}` {:?} must be [tokens, experts] = [{}, {}] for this routing",
                    t.shape(),
                    self.tokens,
                    self.experts
                ),
            });
        }
        Ok(())
    }
}

/// Fails unless the f32/i32 buffer `what` holds `want` values (or 1, the least allocation, when
/// `want` is 0).
fn check_len(what: &str, len: usize, want: usize, layout: &str) -> Result<()> {
    if len == want || (want == 0 && len == 1) {
        Ok(())
    } else {
        Err(Error::Shape { op: OP, message: format!("`{what}` must be {layout} ({want} values), got {len}") })
    }
}

/// Routes each token of `logits` (`[tokens, experts]` bf16, f16 or f32, leading dims folded) to
/// its `k` best experts into `out` ([`RouterOutput::new`]), as TE's
/// `fused_topk_with_score_function(logits, topk, use_pre_softmax, None, None, scaling_factor,
/// "softmax")`, in `te_reference::moe::topk_router`'s numerics:
/// - `scores[t, e]`: the softmax over all experts, in f64 rounded to f32;
/// - `indices[t, j]`: the `k` best logits (`pre_softmax` false) or scores (true), best first,
///   ordered by `f32::total_cmp` with ties to the lower expert;
/// - `probs[t, j]`: the softmax of those `k` logits in f64 rounded to f32, or their scores,
///   times `scaling_factor` in f32.
///
/// # Errors
/// [`Error::DType`] for FP8 logits; [`Error::Shape`] when `logits` is not `[tokens, experts]`
/// of `out` or the tokens exceed a launch grid; compile and launch failures.
pub fn topk_router(dev: &Device, logits: &Tensor, out: &mut RouterOutput) -> Result<()> {
    out.check_logits("logits", logits)?;
    if out.tokens == 0 {
        return Ok(());
    }
    let spec = out.spec(dev, logits.dtype());
    let f = dev.function(&KernelSpec::MoeRouter(spec), 0)?;
    let (sizes, grid) = (out.sizes(), out.token_grid()?);
    let (pre, sf) = (i32::from(out.config.pre_softmax), out.config.scaling_factor);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("logits", logits.data()).ptr("indices", &mut *out.indices).ptr("probs", &mut *out.probs);
    l.ptr("scores", &mut *out.scores);
    l.scalar("tokens", &sizes[0]).scalar("experts", &sizes[1]).scalar("k", &sizes[2]);
    l.scalar("pre_softmax", &pre).scalar("scaling_factor", &sf);
    // SAFETY: logits holds tokens · experts elements of the spec's dtype (checked), indices and
    // probs tokens · k, scores tokens · experts (allocated so); experts ≤ the spec's bucket and
    // 1 ≤ k ≤ experts (RouterOutput::new); warp w of block b writes token b · 8 + w's rows only.
    unsafe { l.launch(grid) }
}

/// The gradient of [`topk_router`]'s logits into `d_logits` (`[tokens, experts]`, bf16, f16 or
/// f32, every element written) from the probabilities' gradient `d_probs` (f32 `[tokens, k]`,
/// e.g. [`super::moe::unpermute_dprobs`]'s) and `r`'s `indices` and `scores` (TE's
/// `fused_topk_with_score_function` backward, softmax): with `sf` the scaling factor and `s` a
/// token's scores,
/// - `pre_softmax`: `d_logits[i] = s_i · (G_i − sf · Σ_j d_probs_j · s_{e_j})`, `G_i = sf ·
///   d_probs_j` when `i = e_j`, else 0;
/// - otherwise: `d_logits[e_j] = sf · q_j · (d_probs_j − Σ_m q_m · d_probs_m)` with `q_j =
///   s_{e_j} / Σ_m s_{e_m}` (the forward's softmax over the chosen `k`), 0 at the other experts.
///
/// Computed in f32. [`aux_loss_backward`] with `accumulate` adds the auxiliary loss's part.
///
/// # Errors
/// [`Error::DType`] for an FP8 `d_logits`; [`Error::Shape`] when `d_probs` is not `tokens · k`
/// long or `d_logits` not `[tokens, experts]`; compile and launch failures.
pub fn topk_router_backward(
    dev: &Device,
    r: &RouterOutput,
    d_probs: &CudaSlice<f32>,
    d_logits: &mut Tensor,
) -> Result<()> {
    r.check_logits("d_logits", d_logits)?;
    check_len("d_probs", d_probs.len(), r.tokens * r.config.k, "f32 [tokens, k]")?;
    if r.tokens == 0 {
        return Ok(());
    }
    let spec = r.spec(dev, d_logits.dtype());
    let f = dev.function(&KernelSpec::MoeRouter(spec), 1)?;
    let (sizes, grid) = (r.sizes(), r.token_grid()?);
    let (pre, sf) = (i32::from(r.config.pre_softmax), r.config.scaling_factor);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 1);
    l.ptr("indices", &*r.indices).ptr("scores", &*r.scores).ptr("d_probs", d_probs);
    l.ptr("d_logits", d_logits.data_mut()?);
    l.scalar("tokens", &sizes[0]).scalar("experts", &sizes[1]).scalar("k", &sizes[2]);
    l.scalar("pre_softmax", &pre).scalar("scaling_factor", &sf);
    // SAFETY: indices and d_probs hold tokens · k values, scores tokens · experts, d_logits
    // tokens · experts elements of the spec's dtype (checked); indices outside [0, experts)
    // are skipped by the kernel.
    unsafe { l.launch(grid) }
}

/// Checks the auxiliary loss's inputs and the one-value buffer `what`.
fn check_aux(r: &RouterOutput, tokens_per_expert: &CudaSlice<i32>, coeff: f32, what: &str, one: usize) -> Result<()> {
    check_len("tokens_per_expert", tokens_per_expert.len(), r.experts, "i32 [experts]")?;
    check_len(what, one, 1, "f32 [1]")?;
    if !coeff.is_finite() {
        return Err(Error::Argument { op: OP, message: format!("coeff = {coeff} is not finite") });
    }
    Ok(())
}

/// The auxiliary load-balancing loss of `r`'s scores into `loss` (f32 `[1]`), as TE's
/// `fused_moe_aux_loss(probs=r.scores, tokens_per_expert, total_num_tokens=tokens,
/// num_experts=experts, topk=k, coeff)` and `te_reference::moe::aux_loss`:
///
/// `loss = coeff · E / (k · T²) · Σ_e tokens_per_expert[e] · Σ_t scores[t, e]`
///
/// for `T` tokens and `E` experts (Switch Transformer's `α · E · Σ_e f_e · P_e`); a balanced
/// routing with uniform scores gives `coeff`. `tokens_per_expert` (i32 `[experts]`) is usually
/// `m_splits` of [`super::moe::routing_map`] over `r.indices`. One block sums in f64 in a fixed
/// order: the same value every run. With no tokens the loss is 0.
///
/// # Errors
/// [`Error::Shape`] when `tokens_per_expert` is not `experts` long or `loss` not 1;
/// [`Error::Argument`] for a `coeff` that is not finite; compile and launch failures.
pub fn aux_loss(
    dev: &Device,
    r: &RouterOutput,
    tokens_per_expert: &CudaSlice<i32>,
    coeff: f32,
    loss: &mut CudaSlice<f32>,
) -> Result<()> {
    check_aux(r, tokens_per_expert, coeff, "loss", loss.len())?;
    if r.tokens == 0 {
        dev.stream().memset_zeros(loss)?;
        return Ok(());
    }
    // The loss reads f32 scores only: any dtype's module has it; bf16's is the common one.
    let spec = r.spec(dev, DType::BF16);
    let f = dev.function(&KernelSpec::MoeRouter(spec), 2)?;
    let sizes = r.sizes();
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 2);
    l.ptr("scores", &*r.scores).ptr("tokens_per_expert", tokens_per_expert).ptr("loss", loss);
    l.scalar("tokens", &sizes[0]).scalar("experts", &sizes[1]).scalar("k", &sizes[2]).scalar("coeff", &coeff);
    let cfg =
        LaunchConfig { grid_dim: (1, 1, 1), block_dim: (MoeRouterSpec::AUX_THREADS as u32, 1, 1), shared_mem_bytes: 0 };
    // SAFETY: scores holds tokens · experts f32, tokens_per_expert experts i32, loss one f32
    // (checked); one block writes loss[0] once.
    unsafe { l.launch(cfg) }
}

/// The gradient of [`aux_loss`] with respect to the logits, through the softmax of the scores
/// (TE's `fused_moe_aux_loss` backward, then the backward of the aux-loss scores'
/// softmax): with `s` a token's scores and `g_e = d_loss · (f32)(C · tokens_per_expert[e])`,
/// `C = coeff · E / (k · T²)` (the gradient `te_reference::moe::aux_loss` returns),
///
/// `d_logits[t, i] = s_i · (g_i − Σ_e s_e · g_e)`,
///
/// in f32, added to `d_logits` (`[tokens, experts]`, bf16, f16 or f32) when `accumulate` (after
/// [`topk_router_backward`]: the logits' whole gradient), written over it otherwise. `d_loss`
/// is f32 `[1]` on the device (the loss's upstream gradient, TE's `grad_aux_loss`).
///
/// # Errors
/// As [`aux_loss`] for `tokens_per_expert`, `coeff` and `d_loss` (1 value); [`Error::DType`] for
/// an FP8 `d_logits`, [`Error::Shape`] when it is not `[tokens, experts]`; compile and launch
/// failures.
pub fn aux_loss_backward(
    dev: &Device,
    r: &RouterOutput,
    tokens_per_expert: &CudaSlice<i32>,
    coeff: f32,
    d_loss: &CudaSlice<f32>,
    d_logits: &mut Tensor,
    accumulate: bool,
) -> Result<()> {
    check_aux(r, tokens_per_expert, coeff, "d_loss", d_loss.len())?;
    r.check_logits("d_logits", d_logits)?;
    if r.tokens == 0 {
        return Ok(());
    }
    let spec = r.spec(dev, d_logits.dtype());
    let f = dev.function(&KernelSpec::MoeRouter(spec), 3)?;
    let (sizes, grid, acc) = (r.sizes(), r.token_grid()?, i32::from(accumulate));
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 3);
    l.ptr("scores", &*r.scores).ptr("tokens_per_expert", tokens_per_expert).ptr("d_loss", d_loss);
    l.ptr("d_logits", d_logits.data_mut()?);
    l.scalar("tokens", &sizes[0]).scalar("experts", &sizes[1]).scalar("k", &sizes[2]);
    l.scalar("coeff", &coeff).scalar("accumulate", &acc);
    // SAFETY: scores holds tokens · experts f32, tokens_per_expert experts i32, d_loss one f32,
    // d_logits tokens · experts elements of the spec's dtype (checked); each warp reads and
    // writes its token's row only.
    unsafe { l.launch(grid) }
}
