//! AdamW over a model's parameters (Loshchilov & Hutter 2019; PyTorch `torch.optim.AdamW` with
//! `clip_grad_norm_`; Megatron-LM's FP32 master weights of a BF16 model).

use super::zero::Zero;
use super::{AdamWConfig, ZeroStage};
use cudarc::driver::CudaSlice;
use std::ops::Range;
use std::sync::Arc;
use te_codegen::DType;
use te_nn::modules::{KernelSpec, KernelTarget, Module, Param, ParamKind, ParamMut};
use te_runtime::dist::{ProcessGroup, ReduceOp};
use te_runtime::graph::HostCopies;
use te_runtime::ops::optimizer::{adamw_step_sharded, adamw_step_table, AdamWArgs, AdamWTable, AdamWTensor};
use te_runtime::{Device, Error, Result, Tensor};

const MODULE: &str = "AdamW";

/// What one [`AdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// The global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The factor the gradients were scaled by: `min(1, max_grad_norm / (grad_norm + 1e-6))`,
    /// 1 without clipping.
    pub clip_coef: f32,
    /// The learning rate of the step.
    pub lr: f32,
    /// The optimizer's step number (1 after the first step).
    pub step: u64,
    /// Parameters updated (those with a gradient).
    pub params_updated: usize,
    /// The step was skipped ([`AdamWConfig::skip_nonfinite`] and a non-finite `grad_norm`):
    /// parameters, masters and moments are as before it, and `step` did not advance.
    pub skipped: bool,
}

/// The optimizer state of one parameter.
#[derive(Debug)]
pub struct ParamState {
    /// The parameter's path in the model.
    pub path: String,
    /// Weight, bias, norm weight or norm bias.
    pub kind: ParamKind,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// The model's dtype of the parameter.
    pub dtype: DType,
    /// Updates of this parameter so far (its bias-correction step; a step without a gradient
    /// does not count, as in PyTorch). Kept on every rank of a sharded optimizer, also for a
    /// parameter it holds no piece of.
    pub step: u64,
    /// The elements of the parameter (flattened, row-major) whose state this rank holds: all of
    /// them, `0..numel`, unless the optimizer is sharded ([`AdamW::new_zero`]); empty when it
    /// holds none.
    pub piece: Range<usize>,
    /// f32 master weight of `piece`, one per element. A rank that holds no piece of the
    /// parameter keeps one unused value here and in the moments (CUDA allocates no empty
    /// buffer).
    pub master: CudaSlice<f32>,
    /// f32 first moment of `piece`.
    pub exp_avg: CudaSlice<f32>,
    /// f32 second moment of `piece`.
    pub exp_avg_sq: CudaSlice<f32>,
    /// A tensor-parallel slice ([`Param::tensor_parallel`]): it counts in the gradient norm on
    /// every rank of the group; a replicated parameter on the group's rank 0 only.
    pub tensor_parallel: bool,
}

impl ParamState {
    /// Elements of the parameter.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// AdamW with FP32 master weights for a [`Module`]'s parameters: global-norm clipping, then one
/// fused multi-tensor update (PyTorch `torch.optim.AdamW` arithmetic, see
/// [`te_runtime::ops::optimizer::adamw_step`]), after which each updated parameter is the new master
/// rounded to its dtype.
///
/// ```no_run
/// use te_nn::modules::{Linear, LinearConfig};
/// use te_train::optim::{AdamW, AdamWConfig, LrSchedule};
/// use te_nn::Module;
/// use te_runtime::Device;
///
/// #[derive(Module)]
/// struct Mlp {
///     fc1: Linear,
///     fc2: Linear,
/// }
///
/// # fn main() -> te_runtime::Result<()> {
/// let dev = Device::new(0)?;
/// let mut model = Mlp {
///     fc1: Linear::new(&dev, LinearConfig::new(1024, 4096))?,
///     fc2: Linear::new(&dev, LinearConfig::new(4096, 1024))?,
/// };
/// let lr = LrSchedule::WarmupCosine { peak: 6e-4, warmup_steps: 100, total_steps: 10_000, min_lr: 6e-5 };
/// let mut opt = AdamW::new(&dev, &model, AdamWConfig { max_grad_norm: Some(1.0), ..AdamWConfig::new(lr) })?;
/// // ... forward and backward ...
/// let stats = opt.step(&mut model)?;
/// println!("grad norm {} lr {}", stats.grad_norm, stats.lr);
/// model.zero_grad();
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AdamW {
    pub(super) dev: Arc<Device>,
    config: AdamWConfig,
    pub(super) step: u64,
    pub(super) params: Vec<ParamState>,
    /// `[grad_norm, clip_coef]` of the last step, on the device.
    norm_out: CudaSlice<f32>,
    /// The tensor-parallel group the model's layers split over: the gradient norm sums every
    /// rank's part ([`AdamW::with_tensor_parallel`]).
    tensor_parallel: Option<Arc<ProcessGroup>>,
    /// The fused kernels' chunk table, kept from step to step (a captured step replays it).
    table: AdamWTable,
    /// The data-parallel group the state is sharded over ([`AdamW::new_zero`]); `None`:
    /// every rank holds all of it.
    pub(super) zero: Option<Zero>,
}

/// A step [`AdamW::issue`] queued on the device and [`AdamW::finish`] completes on the host:
/// what the host must know of it once the device has run it.
#[derive(Debug, Clone, PartialEq)]
pub struct PendingStep {
    /// The step's number (the optimizer's count + 1 when it was issued).
    step: u64,
    /// Its learning rate.
    lr: f32,
    /// Which parameters (in traversal order) had a gradient: those it updates.
    updated: Vec<bool>,
}

impl AdamW {
    /// Allocates the state of every parameter of `model`, in traversal order: the f32 master
    /// copied from the parameter (a host round trip, once) and zeroed moments (3 × 4 bytes per
    /// parameter element). The masters are the source of truth afterwards: a parameter changed
    /// behind the optimizer's back (a checkpoint load) is overwritten by the next step; build a
    /// new optimizer then.
    ///
    /// # Errors
    /// [`Error::Argument`] for a config out of range ([`AdamWConfig::validate`]);
    /// [`Error::Config`] for a model without parameters or with an FP8-only weight
    /// ([`te_nn::fp8::fp8_model_init`]: it has no high-precision value to train); allocation and
    /// copy failures.
    pub fn new<M: Module + ?Sized>(dev: &Arc<Device>, model: &M, config: AdamWConfig) -> Result<Self> {
        Self::build(dev, model, config, None, None)
    }

    /// The optimizer of [`AdamW::new`] sharded over the data-parallel `group` (ZeRO stage 1:
    /// Megatron-LM's distributed optimizer, `megatron/core/optimizer/distrib_optimizer.py`;
    /// Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    /// Models"): this rank holds the masters and moments of its contiguous piece of the model
    /// only ([`Partition`](super::Partition), pieces starting at multiples of
    /// [`CHUNK`](te_runtime::ops::optimizer::CHUNK) elements of a parameter): 3 × 4 bytes per
    /// owned element, about `1 / group.size()` of [`AdamW::new`]'s. The gradients stay whole
    /// on every rank (averaged by [`te_nn::parallel::DataParallel`]); each step updates this
    /// rank's pieces of the parameters, and in-place broadcasts of every piece from its owner
    /// (one NCCL group on the device's stream, an all-gather's volume) make every rank's
    /// parameters whole again. The clipping norm sums every rank's per-chunk partials in the
    /// replicated step's order, so a step is bit for bit [`AdamW::new`]'s, clipping and skipped
    /// non-finite steps included. Every rank of `group` builds it from the same model and
    /// steps together; its state file is the replicated optimizer's ([`AdamW::save_state`]).
    ///
    /// # Errors
    /// As [`AdamW::new`]; [`Error::Argument`] for a group on a side stream
    /// ([`ProcessGroup::with_side_stream`]: pass the data-parallel group on the device's
    /// stream, [`te_nn::parallel::DataParallel::group`]) or on another GPU than `dev`.
    pub fn new_zero<M: Module + ?Sized>(
        dev: &Arc<Device>,
        model: &M,
        config: AdamWConfig,
        group: Arc<ProcessGroup>,
    ) -> Result<Self> {
        Self::build(dev, model, config, Some((group, ZeroStage::OptimizerStates)), None)
    }

    /// [`AdamW::new`], sharded over the group of `zero` at its stage (1 to 3) when given; the
    /// masters of the parameters `local` holds (ZeRO-3, by traversal index) from those pieces.
    pub(super) fn build<M: Module + ?Sized>(
        dev: &Arc<Device>,
        model: &M,
        config: AdamWConfig,
        zero: Option<(Arc<ProcessGroup>, ZeroStage)>,
        local: Option<&[Option<Tensor>]>,
    ) -> Result<Self> {
        config.validate()?;
        let stream = dev.stream();
        // Each parameter's path, kind, shape, dtype, tensor-parallel flag and tensor.
        let mut found = Vec::new();
        model.visit("", &mut |path: &str, kind: ParamKind, p: &dyn Param| -> Result<()> {
            let t = p.tensor().ok_or_else(|| Error::Config {
                module: MODULE,
                message: format!("{path} is an FP8-only weight (fp8_model_init); train a high-precision model"),
            })?;
            found.push((path.to_owned(), kind, p.shape().to_vec(), p.dtype(), p.tensor_parallel(), t.clone()));
            Ok(())
        })?;
        if found.is_empty() {
            return Err(Error::Config { module: MODULE, message: "the model has no parameters to optimize".into() });
        }
        let numels: Vec<usize> = found.iter().map(|f| f.5.numel()).collect();
        let zero = match zero {
            Some((group, stage)) => Some(Zero::new(dev, group, &numels, stage)?),
            None => None,
        };
        let mut params = Vec::with_capacity(found.len());
        for (i, (path, kind, shape, dtype, tensor_parallel, t)) in found.into_iter().enumerate() {
            let piece = zero.as_ref().map_or(0..numels[i], |z| z.piece(i));
            let master = match piece.is_empty() {
                true => stream.alloc_zeros(1)?,
                false => match local.and_then(|l| l.get(i)).and_then(Option::as_ref) {
                    // ZeRO-3: this rank's piece is all the model holds of the weight.
                    Some(held) if held.numel() == piece.len() => stream.htod(&held.to_f32(dev)?)?,
                    Some(held) => {
                        return Err(Error::Config {
                            module: MODULE,
                            message: format!(
                                "{path}: a local piece of {} elements for this rank's piece {piece:?}: shard the \
                                 model with this optimizer's split (AdamW::zero_shards)",
                                held.numel()
                            ),
                        })
                    }
                    None => {
                        let values = t.to_f32(dev)?;
                        let master = values.get(piece.clone()).ok_or_else(|| {
                            Error::internal(MODULE, format!("{path} holds {} values, not {piece:?}", values.len()))
                        })?;
                        stream.htod(master)?
                    }
                },
            };
            let len = piece.len().max(1);
            params.push(ParamState {
                path,
                kind,
                shape,
                dtype,
                step: 0,
                master,
                exp_avg: stream.alloc_zeros(len)?,
                exp_avg_sq: stream.alloc_zeros(len)?,
                piece,
                tensor_parallel,
            });
        }
        Ok(Self {
            dev: dev.clone(),
            config,
            step: 0,
            params,
            norm_out: stream.alloc_zeros(2)?,
            tensor_parallel: None,
            table: AdamWTable::default(),
            zero,
        })
    }

    /// This optimizer for one rank of a model whose layers split over `group` (tensor
    /// parallelism, [`te_nn::parallel::TpConfig`]): the clipping norm is the whole model's, the
    /// same on every rank (each rank's slices, and the replicated parameters once: Megatron-LM's
    /// `clip_grad_norm` over the model-parallel group), so the replicated parameters stay
    /// equal. Every rank of the group steps together.
    pub fn with_tensor_parallel(self, group: Arc<ProcessGroup>) -> Self {
        Self { tensor_parallel: Some(group), ..self }
    }

    /// The settings.
    pub fn config(&self) -> &AdamWConfig {
        &self.config
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The state of every parameter, in traversal order.
    pub fn states(&self) -> &[ParamState] {
        &self.params
    }

    /// Bytes of f32 state this rank holds (masters and both moments: 12 per element of its
    /// pieces).
    pub fn state_bytes(&self) -> u64 {
        self.params.iter().map(|s| 12 * s.piece.len() as u64).sum()
    }

    /// Bytes of f32 state a replicated optimizer of the same model holds on each rank (12 per
    /// parameter element): [`AdamW::state_bytes`] of [`AdamW::new`].
    pub fn replicated_state_bytes(&self) -> u64 {
        self.params.iter().map(|s| 12 * s.numel() as u64).sum()
    }

    /// The ranks the state is sharded over ([`AdamW::new_zero`]); `None` when replicated.
    pub fn zero_ranks(&self) -> Option<usize> {
        self.zero.as_ref().map(Zero::world)
    }

    /// One optimizer step: gathers each parameter's gradient (its `main_grad` when it has one,
    /// else its `grad`; a parameter with neither is skipped: its state and value stay as they
    /// are, as PyTorch skips `grad = None`), computes the global norm of those gradients and the
    /// clip coefficient on the device, updates masters and moments with the step's rate
    /// (`lr.lr(step)`) in one fused launch, and writes each updated parameter in place (the
    /// new master rounded to its dtype, into the parameter's own storage: every clone of the
    /// tensor sees it) and hands it back through [`ParamMut::set`], which bumps the layer's
    /// version, so contexts saved before are stale and a cached FP8 weight is cast anew.
    /// Gradients are not cleared: call the model's `zero_grad`.
    ///
    /// [`AdamW::issue`] then [`AdamW::finish`]. Host synchronization: reading the norm for
    /// [`StepStats`] waits for the step's kernels (the update itself never waits: clipping
    /// reads the coefficient on the device).
    ///
    /// # Errors
    /// [`Error::Config`] when the model's parameters (paths, shapes, dtypes, order) are not the
    /// ones the optimizer was built for, when no parameter has a gradient (run a backward
    /// first), or for a ZeRO-2 optimizer (its ranks hold different gradients: step it with
    /// [`AdamW::step_reduced`]); kernel, allocation and copy failures. The step counts only when
    /// it succeeds and is not skipped ([`AdamWConfig::skip_nonfinite`]).
    pub fn step<M: Module + ?Sized>(&mut self, model: &mut M) -> Result<StepStats> {
        let pending = self.issue(model)?;
        self.finish(&pending)
    }

    /// Queues the step [`AdamW::step`] describes on the device without waiting for it: the
    /// step is counted by [`AdamW::finish`], after the device ran it. Inside a CUDA graph
    /// capture ([`te_runtime::graph::Graph::capture`]) it records the step, reading the chunk
    /// table an earlier step outside the capture left: before each replay,
    /// [`AdamW::prepare_replay`] writes the replayed step's learning rate and bias corrections
    /// into it.
    ///
    /// # Errors
    /// As [`AdamW::step`]; [`Error::Capture`] inside a capture when no step of the same
    /// parameters ran outside it.
    pub fn issue<M: Module + ?Sized>(&mut self, model: &mut M) -> Result<PendingStep> {
        self.issue_marked(model, None, None)
    }

    /// [`AdamW::issue`] of the parameters `reduced` marks (traversal order; every rank passes
    /// the same marks), or of those with a gradient when `None` (refused for a ZeRO-2
    /// optimizer, whose ranks hold different gradients). `local` (ZeRO-3, by traversal index):
    /// the tensors holding this rank's pieces of the sharded parameters, written instead of
    /// the model's (which are transient buffers), neither broadcast nor handed back after.
    pub(super) fn issue_marked<M: Module + ?Sized>(
        &mut self,
        model: &mut M,
        reduced: Option<&[bool]>,
        local: Option<&[Option<Tensor>]>,
    ) -> Result<PendingStep> {
        let (grads, params) = self.gather(model, local)?;
        if local.is_none() && self.zero_stage() == ZeroStage::Parameters {
            return Err(Error::Config {
                module: MODULE,
                message: "a ZeRO-3 optimizer writes this rank's pieces of the sharded weights: step it with \
                          AdamW::step_sharded and the model's pieces"
                    .into(),
            });
        }
        let sharded = |i: usize| local.and_then(|l| l.get(i)).is_some_and(Option::is_some);
        let dev = self.dev.clone();
        let step = self.step + 1;
        let lr = self.config.lr.lr(step);
        let updated = self.updated(&grads, reduced)?;
        if let Some(zero) = &self.zero {
            let stage = zero.stage().number();
            te_runtime::graph::refuse_in_capture(
                dev.stream(),
                &format!(
                    "a ZeRO-{stage} optimizer step (its norm gather and parameter broadcasts are issued from the \
                     host: step it eagerly)"
                ),
            )?;
            if self.tensor_parallel.is_some() {
                return Err(Error::Config {
                    module: MODULE,
                    message: format!(
                        "a ZeRO-{stage} optimizer (AdamW::new_zero) with tensor parallelism (with_tensor_parallel) is \
                         not built yet: use AdamW::new for a tensor-parallel model"
                    ),
                });
            }
        }
        let (weight_decay, decay_all) = (self.config.weight_decay, self.config.decay_biases_and_norms);
        let counts_copies = self.tensor_parallel.as_ref().is_none_or(|g| g.rank() == 0);
        let args = self.args(lr);
        let mut tensors = Vec::with_capacity(grads.len());
        let mut offsets = Vec::with_capacity(grads.len());
        // ZeRO-3: this rank's pieces of the sharded parameters are written, not the model's.
        let targets: Vec<&Tensor> = params
            .iter()
            .enumerate()
            .map(|(i, p)| local.and_then(|l| l.get(i)).and_then(Option::as_ref).unwrap_or(p))
            .collect();
        for (((s, g), param), _) in self.params.iter_mut().zip(&grads).zip(targets).zip(&updated).filter(|t| *t.1) {
            if let (Some(grad), false) = (g, s.piece.is_empty()) {
                let decays = decay_all || s.kind == ParamKind::Weight;
                offsets.push(s.piece.start);
                tensors.push(AdamWTensor {
                    grad,
                    param,
                    master: &mut s.master,
                    exp_avg: &mut s.exp_avg,
                    exp_avg_sq: &mut s.exp_avg_sq,
                    weight_decay: if decays { weight_decay } else { 0.0 },
                    step: s.step + 1,
                    in_norm: s.tensor_parallel || counts_copies,
                });
            }
        }
        match &self.zero {
            Some(zero) => adamw_step_sharded(
                &dev,
                &mut tensors,
                &offsets,
                &args,
                &mut self.norm_out,
                &mut |local| zero.gather_partials(&dev, &updated, local),
                &mut self.table,
            )?,
            None => {
                let group = self.tensor_parallel.clone();
                adamw_step_table(
                    &dev,
                    &mut tensors,
                    &args,
                    &mut self.norm_out,
                    &mut |partials| match &group {
                        Some(g) => {
                            g.all_reduce(partials, ReduceOp::Sum)?;
                            g.wait()
                        }
                        None => Ok(()),
                    },
                    &mut self.table,
                )?
            }
        }
        drop(tensors);
        // The sharded parameters stay pieces: the next gathers carry the new values.
        let whole: Vec<bool> = updated.iter().enumerate().map(|(i, &u)| u && !sharded(i)).collect();
        if let Some(zero) = &self.zero {
            // Every rank's pieces from their owners: the parameters are whole again.
            zero.broadcast_params(&params, &whole)?;
        }
        // The same storage handed back: the version bump tells the layers their values changed.
        let written = params.into_iter().zip(&whole).map(|(p, &u)| u.then_some(p)).collect();
        self.write_back(model, written)?;
        Ok(PendingStep { step, lr, updated })
    }

    /// Completes a step the device ran ([`AdamW::issue`], or a replay of a captured one
    /// [`AdamW::prepare_replay`] prepared): reads the gradient norm (waiting for the step's
    /// kernels) and, unless the step was skipped ([`AdamWConfig::skip_nonfinite`] and a
    /// non-finite norm), counts it for the optimizer and each updated parameter.
    ///
    /// # Errors
    /// [`Error::Config`] for a step of another parameter list; copy failures (a failed kernel
    /// of the step surfaces here).
    pub fn finish(&mut self, pending: &PendingStep) -> Result<StepStats> {
        if pending.updated.len() != self.params.len() || pending.step != self.step + 1 {
            return Err(self.mismatch(format!(
                "finishing step {} of {} parameters after step {}",
                pending.step,
                pending.updated.len(),
                self.step
            )));
        }
        let out = self.dev.stream().dtoh(&self.norm_out)?;
        let skipped = self.config.skip_nonfinite && !out[0].is_finite();
        if !skipped {
            for (s, &u) in self.params.iter_mut().zip(&pending.updated) {
                s.step += u64::from(u);
            }
            self.step = pending.step;
        }
        let params_updated = pending.updated.iter().filter(|&&u| u).count();
        Ok(StepStats { grad_norm: out[0], clip_coef: out[1], lr: pending.lr, step: self.step, params_updated, skipped })
    }

    /// Before replaying a CUDA graph that captured `captured` ([`AdamW::issue`] inside the
    /// capture): writes the next step's learning rate and each updated parameter's bias
    /// corrections into the chunk table the graph reads, and returns that step for
    /// [`AdamW::finish`] after the replay. The graph updates the parameters `captured` updated.
    ///
    /// # Errors
    /// [`Error::Config`] for a step of another parameter list; [`Error::Argument`] when no step
    /// built the table; [`Error::Capture`] inside a capture; copy failures.
    pub fn prepare_replay(&mut self, captured: &PendingStep) -> Result<PendingStep> {
        if let Some(zero) = &self.zero {
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "a ZeRO-{} optimizer step is never captured in a CUDA graph (AdamW::issue refuses it): step it \
                     eagerly",
                    zero.stage().number()
                ),
            });
        }
        if captured.updated.len() != self.params.len() {
            return Err(self.mismatch(format!("a captured step of {} parameters", captured.updated.len())));
        }
        let step = self.step + 1;
        let lr = self.config.lr.lr(step);
        let steps: Vec<u64> = self
            .params
            .iter()
            .zip(&captured.updated)
            .filter(|(s, &u)| u && !s.piece.is_empty())
            .map(|(s, _)| s.step + 1)
            .collect();
        self.table.refresh(&self.dev, &self.args(lr), &steps)?;
        Ok(PendingStep { step, lr, updated: captured.updated.clone() })
    }

    /// The kernel's hyper-parameters at learning rate `lr`.
    fn args(&self, lr: f32) -> AdamWArgs {
        let (beta1, beta2) = self.config.betas;
        AdamWArgs {
            lr,
            beta1,
            beta2,
            eps: self.config.eps,
            max_grad_norm: self.config.max_grad_norm.unwrap_or(f32::INFINITY),
            skip_nonfinite: self.config.skip_nonfinite,
        }
    }

    /// Each parameter's gradient (main_grad first) and its tensor (sharing its storage: the
    /// step writes it in place), in one traversal that checks the model's parameter list. A
    /// ZeRO-3 parameter `local` holds a piece of stands as that piece: the model's transient
    /// tensor is not written (and a GEMM weight gathered as FP8 codes has none).
    fn gather<M: Module + ?Sized>(
        &self,
        model: &M,
        local: Option<&[Option<Tensor>]>,
    ) -> Result<(Vec<Option<Tensor>>, Vec<Tensor>)> {
        let (mut grads, mut params) = (Vec::with_capacity(self.params.len()), Vec::with_capacity(self.params.len()));
        model.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            let i = grads.len();
            self.check_param(i, path, p.shape(), p.dtype())?;
            let piece = local.and_then(|l| l.get(i)).and_then(Option::as_ref);
            let t = p.tensor().or(piece).ok_or_else(|| Error::Config {
                module: MODULE,
                message: format!("{path} became an FP8-only weight; build a new AdamW for the new model"),
            })?;
            grads.push(p.main_grad().or(p.grad()).cloned());
            params.push(t.clone());
            Ok(())
        })?;
        if grads.len() != self.params.len() {
            return Err(self.mismatch(format!("the model has {} parameters", grads.len())));
        }
        Ok((grads, params))
    }

    /// Hands each new parameter to the model.
    fn write_back<M: Module + ?Sized>(&self, model: &mut M, new_params: Vec<Option<Tensor>>) -> Result<()> {
        let mut values = new_params.into_iter();
        let mut i = 0;
        model.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
            self.check_param(i, path, p.shape(), p.dtype())?;
            i += 1;
            match values.next().flatten() {
                Some(v) => p.set(v),
                None => Ok(()),
            }
        })
    }

    /// Fails unless parameter `i` of the model is the one the optimizer holds state for.
    fn check_param(&self, i: usize, path: &str, shape: &[usize], dtype: DType) -> Result<()> {
        match self.params.get(i) {
            Some(s) if s.path == path && s.shape == shape && s.dtype == dtype => Ok(()),
            Some(s) => Err(self.mismatch(format!(
                "parameter {i} is {path} {shape:?} {dtype}, the optimizer's is {} {:?} {}",
                s.path, s.shape, s.dtype
            ))),
            None => Err(self.mismatch(format!("parameter {i} ({path}) is new"))),
        }
    }

    pub(super) fn mismatch(&self, what: String) -> Error {
        Error::Config {
            module: MODULE,
            message: format!(
                "the model's parameters changed since the optimizer was built ({} parameters): {what}; build a new \
                 AdamW for the new model",
                self.params.len()
            ),
        }
    }
}

impl AdamW {
    /// Adds the kernels a step runs (the gradient norm for clipping, AdamW) for `target` to
    /// `specs`: a training job prewarms them with its model's
    /// ([`Module::kernel_specs_for`](te_nn::modules::Module::kernel_specs_for)).
    pub fn kernel_specs(target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        specs.extend(te_runtime::ops::optimizer::kernel_specs(target.arch));
    }
}
