//! The GEMM part of `Linear`, `LayerNormLinear` and `LayerNormMLP` (TE `_Linear`'s autograd
//! function): parameters, FP8 scaling, and forward/backward of `y = x · Wᵀ + b`, with the
//! GEMM's parallelism hook ([`GemmParallel`]) called around it: the output reduced at the end of
//! the forward, the output gradient gathered at the start of the backward and the dgrad reduced
//! at its end (the identity on a single GPU). The input is the caller's to gather (a norm in
//! front may gather it as FP8 codes: `norm_input`).
//!
//! The FP8 dataflow is described in the parent module's docs.

use super::super::params::{convert, fp8_dim, LinearParams};
use super::super::Output;
use super::gemm_io::Overlap;
pub(crate) use super::gemm_io::{DbiasBuffers, LinearInput};
use super::ForwardOptions;
use crate::fp8::{Float8Tensor, ForwardQuantizers, Fp8Mode, Fp8StateSlot, GemmScaling, GradScaling, Quantizer};
use crate::fp8::{Recipe, ScalingState};
use crate::parallel::{GemmParallel, PendingReduce};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::gemm::{gemm, Epilogue, Fp8Output, GemmConfig, Operand, Output as GemmOut};
use te_runtime::{ops, Device, Error, Result, Tensor};

/// What a GEMM layer's forward runs in, decided once per forward from the autocast scope.
#[derive(Debug)]
pub(crate) enum Pass {
    /// GEMMs in the parameters' precision.
    High,
    /// High-precision GEMMs; the input's and weight's amaxes are recorded.
    Calibrating(ForwardQuantizers),
    /// FP8 GEMMs.
    Fp8(Fp8Pass),
}

/// An FP8 forward: its quantizers and the recipe they came from (which backward reuses).
#[derive(Debug)]
pub(crate) struct Fp8Pass {
    q: ForwardQuantizers,
    recipe: Recipe,
}

impl Pass {
    /// The quantizer of the GEMM input in an FP8 pass.
    pub(crate) fn fp8_input(&self) -> Option<&dyn Quantizer> {
        match self {
            Pass::Fp8(p) => Some(&*p.q.input),
            _ => None,
        }
    }
}

/// What an FP8 forward saved for backward.
#[derive(Debug)]
pub(crate) struct Fp8Saved {
    /// `x8ᵀ [in, tokens]`; `None` when the owner recomputes it before backward (see
    /// [`LinearCore::recompute_input`]).
    pub input_t: Option<Float8Tensor>,
    /// `W8` with its transpose.
    pub weight: Float8Tensor,
    /// The gradient casts of backward.
    pub grad: GradScaling,
}

/// What a GEMM layer's forward saved for backward.
#[derive(Debug)]
pub(crate) enum Saved {
    /// FP8 GEMMs.
    Fp8(Fp8Saved),
    /// High-precision GEMMs: the input and weight (shared, not copied).
    High { input: Tensor, weight: Tensor },
}

impl Saved {
    /// Device bytes held only for backward (the FP8 input transpose; high-precision tensors are
    /// shared with the caller and the parameters).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            Saved::Fp8(s) => s.input_t.as_ref().map_or(0, Float8Tensor::num_bytes),
            Saved::High { .. } => 0,
        }
    }
}

/// The GEMM part of `Linear`, `LayerNormLinear` and `LayerNormMLP`.
#[derive(Debug)]
pub(crate) struct LinearCore {
    pub params: LinearParams,
    module: &'static str,
    /// The GEMM's parallelism: the collectives around it.
    comm: GemmParallel,
    /// The GEMM adds the bias (false for `return_bias`, and for the row-parallel ranks that
    /// leave it to rank 0).
    bias_fwd: bool,
    /// Backward computes the bias gradient (false for `return_bias`).
    bias_bwd: bool,
    /// FP8 forward saves the input transpose (false: the owner recomputes it before backward).
    save_input: bool,
    scaling: GemmScaling,
}

impl LinearCore {
    /// The core of a whole GEMM on this GPU: the forward adds the bias with `bias_fwd`, the
    /// backward computes its gradient with `bias_bwd`.
    pub(crate) fn new(params: LinearParams, module: &'static str, bias_fwd: bool, bias_bwd: bool) -> Self {
        Self::with_comm(params, module, GemmParallel::single(), bias_fwd, bias_bwd)
    }

    /// The core of `params` placed by `comm` (see [`LinearParams::for_gemm`]): the forward adds
    /// the bias with `bias_fwd` where `comm` says this rank adds it, the backward computes its
    /// gradient with `bias_bwd`.
    pub(crate) fn with_comm(
        params: LinearParams,
        module: &'static str,
        comm: GemmParallel,
        bias_fwd: bool,
        bias_bwd: bool,
    ) -> Self {
        let scaling = GemmScaling::new(params.device());
        let bias_fwd = bias_fwd && comm.adds_bias();
        Self { params, module, comm, bias_fwd, bias_bwd, save_input: true, scaling }
    }

    /// The GEMM's parallelism hook.
    pub(crate) fn comm(&self) -> &GemmParallel {
        &self.comm
    }

    /// FP8 forwards stop saving the input transpose; the owner recomputes it and hands it back
    /// with [`Fp8Saved::input_t`] before backward (activation recomputation).
    pub(crate) fn recompute_input(&mut self) {
        self.save_input = false;
    }

    fn internal(&self, message: &str) -> Error {
        Error::internal(self.module, message)
    }

    fn dev(&self) -> Arc<Device> {
        self.params.device().clone()
    }

    /// The pass a forward in `mode` runs: its quantizers built from the module's scaling state.
    pub(crate) fn pass(&mut self, mode: Fp8Mode) -> Result<Pass> {
        Ok(match mode {
            Fp8Mode::HighPrecision => Pass::High,
            Fp8Mode::Calibrating(r) => Pass::Calibrating(self.scaling.forward(&r)?),
            Fp8Mode::Fp8(recipe) => Pass::Fp8(Fp8Pass { q: self.scaling.forward(&recipe)?, recipe }),
        })
    }

    /// The forward delayed-scaling state (input, weight, output slots).
    pub(crate) fn fwd_state(&self) -> Option<&Arc<ScalingState>> {
        self.scaling.fwd_state()
    }

    /// The backward delayed-scaling state (the output gradient's slot).
    pub(crate) fn bwd_state(&self) -> Option<&Arc<ScalingState>> {
        self.scaling.bwd_state_opt()
    }

    /// The forward and backward state slots, for a writable traversal.
    pub(crate) fn state_slots(&mut self) -> [Fp8StateSlot<'_>; 2] {
        self.scaling.state_slots()
    }

    /// Checks the GEMM dims under FP8: features always, tokens when transposes are made.
    pub(crate) fn check_fp8_dims(&self, tokens: usize, grad: bool) -> Result<()> {
        fp8_dim(self.module, "in_features", self.params.in_features())?;
        fp8_dim(self.module, "out_features", self.params.out_features())?;
        if grad {
            fp8_dim(self.module, "tokens (the product of the input's leading dims)", tokens)?;
        }
        Ok(())
    }

    /// Forward of `pass`; `x` is the GEMM's input (gathered, when the hook gathers it), `shape`
    /// its shape, `dtype` the output's. The output is the layer's: the ranks' sum for a
    /// row-parallel GEMM ([`GemmParallel::reduce_output`]).
    ///
    /// # Errors
    /// [`GemmParallel::check_fp8_output`]'s; FP8 dims; GEMM, kernel and NCCL failures.
    pub(crate) fn forward(
        &mut self,
        x: LinearInput,
        shape: &[usize],
        dtype: DType,
        pass: &Pass,
        opts: ForwardOptions,
        grad: bool,
    ) -> Result<(Output, Option<Saved>)> {
        self.comm.check_fp8_output(self.module, opts.fp8_output)?;
        // The row-parallel reduce-scatter overlapped with the GEMM's blocks (16-bit outputs of
        // high-precision or per-tensor FP8 GEMMs).
        let rs = self.comm.overlaps_reduce_scatter() && !opts.fp8_output && !matches!(pass, Pass::Calibrating(_));
        let (out, saved, reduced) = self.forward_local(x, shape, dtype, pass, opts, grad, rs)?;
        // An FP8 output is never one to reduce (`check_fp8_output`).
        let out = match out {
            Output::High(y) if !reduced => Output::High(self.comm.reduce_output(self.module, y)?),
            out => out,
        };
        Ok((out, saved))
    }

    /// This rank's GEMM of [`LinearCore::forward`]; with `rs` (overlapped reduce-scatter asked
    /// for) the output may come reduce-scattered already: the third value says whether it did.
    #[allow(clippy::too_many_arguments)]
    fn forward_local(
        &mut self,
        x: LinearInput,
        shape: &[usize],
        dtype: DType,
        pass: &Pass,
        opts: ForwardOptions,
        grad: bool,
        rs: bool,
    ) -> Result<(Output, Option<Saved>, bool)> {
        // A token shard: gathered beside the GEMMs where they can run shard by shard (16-bit
        // outputs of high-precision or per-tensor FP8 GEMMs), else gathered first.
        let (x, gather) = match x {
            LinearInput::Shard { input, .. } => match (pass, *input) {
                (Pass::High, x @ LinearInput::High(_)) if !opts.fp8_output => (x, true),
                (Pass::Fp8(_), LinearInput::Fp8(f)) if !opts.fp8_output && f.block_scale().is_none() => {
                    (LinearInput::Fp8(f), true)
                }
                (_, LinearInput::High(x)) => (LinearInput::High(self.comm.gather_input(&x)?), false),
                (_, LinearInput::Fp8(f)) => (LinearInput::Fp8(self.comm.gather_fp8(f, grad)?), false),
                (_, LinearInput::Shard { .. }) => return Err(self.internal("a shard of a shard")),
            },
            x => (x, false),
        };
        let ov = match (gather, rs) {
            (true, _) => Overlap::Gather,
            (false, true) => Overlap::ReduceScatter,
            (false, false) => Overlap::None,
        };
        match (pass, x) {
            (Pass::Fp8(p), x) => {
                let tokens = shape.split_last().map_or(0, |(_, lead)| lead.iter().product());
                self.check_fp8_dims(tokens, grad)?;
                self.forward_fp8(x, shape, dtype, p, opts, grad, ov)
            }
            (Pass::Calibrating(q), LinearInput::High(x)) => {
                q.input.calibrate(&x)?;
                self.params.calibrate_weight(&*q.weight)?;
                self.forward_high(&x, grad, Overlap::None)
            }
            (Pass::High, LinearInput::High(x)) => self.forward_high(&x, grad, ov),
            (_, LinearInput::Fp8(_)) => Err(self.internal("an FP8 input outside an FP8 pass")),
            (_, LinearInput::Shard { .. }) => Err(self.internal("a token shard left ungathered")),
        }
    }

    /// This rank's GEMM `run` of the input `x` (16-bit, or FP8 codes) as `ov` says: once; over
    /// the ranks' shards as they arrive (`x` a token shard: the whole input is returned with
    /// `keep_input`); or block by block, each reduce-scattered beside the next. The input
    /// returned is the whole one (`None` only for a gather without `keep_input`); the `bool`
    /// whether the output is reduce-scattered.
    fn run_gemm(
        &self,
        x: &Tensor,
        keep_input: bool,
        ov: Overlap,
        mut run: impl FnMut(&Tensor) -> Result<Tensor>,
    ) -> Result<(Option<Tensor>, Tensor, bool)> {
        match ov {
            Overlap::None => Ok((Some(x.clone()), run(x)?, false)),
            Overlap::Gather => {
                let (whole, y) = self.comm.gather_gemm(x, keep_input, run)?;
                Ok((whole, y, false))
            }
            // Too few rows to split into GEMMs that fill the GPU: one GEMM, reduced after.
            Overlap::ReduceScatter if self.comm.reduce_scatter_chunks(x.shape()) <= 1 => {
                Ok((Some(x.clone()), run(x)?, false))
            }
            Overlap::ReduceScatter => {
                let dev = self.dev();
                let rows = x.shape().first().copied().unwrap_or(0);
                let chunks = self.comm.reduce_scatter_chunks(x.shape());
                let y = self.comm.gemm_reduce_scatter(self.module, rows, chunks, |r| run(&x.narrow(&dev, r)?))?;
                Ok((Some(x.clone()), y, true))
            }
        }
    }

    fn forward_high(&mut self, x: &Tensor, grad: bool, ov: Overlap) -> Result<(Output, Option<Saved>, bool)> {
        let dev = self.dev();
        let w = self.params.weight_high(x.dtype())?;
        let n_out = self.params.out_features();
        let bias = self.added_bias(x.dtype())?;
        let cfg = GemmConfig { epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias), ..Default::default() };
        let run = |x: &Tensor| -> Result<Tensor> {
            let mut y = Tensor::empty(&dev, x.dtype(), &out_shape(x.shape(), n_out))?;
            gemm(&dev, Operand::new(x), Operand::new(&w), GemmOut::new(&mut y), &cfg)?;
            Ok(y)
        };
        let (input, y, reduced) = self.run_gemm(x, grad, ov, run)?;
        let saved = match (grad, input) {
            (true, Some(input)) => Some(Saved::High { input, weight: w }),
            (true, None) => return Err(self.internal("the gathered input was not kept")),
            (false, _) => None,
        };
        Ok((Output::High(y), saved, reduced))
    }

    /// The bias the forward adds (none with `return_bias`), in `dtype`.
    fn added_bias(&self, dtype: DType) -> Result<Option<Tensor>> {
        if self.bias_fwd {
            self.params.bias_as(dtype)
        } else {
            Ok(None)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn forward_fp8(
        &mut self,
        x: LinearInput,
        shape: &[usize],
        dtype: DType,
        pass: &Fp8Pass,
        opts: ForwardOptions,
        grad: bool,
        ov: Overlap,
    ) -> Result<(Output, Option<Saved>, bool)> {
        let (dev, q) = (self.dev(), &pass.q);
        let x8 = match x {
            LinearInput::Fp8(f) => f,
            LinearInput::High(x) => q.input.quantize(&x, grad && self.save_input, None)?,
            LinearInput::Shard { .. } => return Err(self.internal("a token shard left ungathered")),
        };
        // Per-tensor scales only: a block of rows of blockwise codes has no scales of its own.
        let ov = if x8.block_scale().is_some() { Overlap::None } else { ov };
        let w8 = self.params.fp8_weight_for(&*q.weight, opts.is_first_microbatch, grad)?;
        // cuBLASLt's FP8 GEMMs take a bf16 bias for an f32 output (the output dtype otherwise).
        let bias = self.added_bias(if dtype == DType::F32 { DType::BF16 } else { dtype })?;
        let cfg = GemmConfig {
            // TE's fprop uses the fast accumulator; block-scaled GEMMs have only the precise one.
            fast_accum: x8.block_scale().is_none(),
            epilogue: bias.as_ref().map_or(Epilogue::None, Epilogue::Bias),
            ..Default::default()
        };
        let n_out = self.params.out_features();
        if ov != Overlap::None {
            // Overlapped with its collective: the GEMMs of shards or blocks of the codes, which
            // share the whole's scale.
            let scale = x8.scale_inv_shared();
            let run = |codes: &Tensor| -> Result<Tensor> {
                let part = Float8Tensor::from_parts(codes.clone(), None, scale.clone())?;
                let mut y = Tensor::empty(&dev, dtype, &out_shape(codes.shape(), n_out))?;
                gemm(&dev, part.operand(), w8.operand(), GemmOut::new(&mut y), &cfg)?;
                Ok(y)
            };
            let (codes, y, reduced) = self.run_gemm(x8.data(), grad && self.save_input, ov, run)?;
            let x8 = match (ov, codes) {
                // The whole codes of the gathered shards, transposed for wgrad below.
                (Overlap::Gather, Some(codes)) => {
                    let mut whole = Float8Tensor::from_parts(codes, None, scale)?;
                    whole.ensure_transpose(&dev)?;
                    whole
                }
                _ => x8,
            };
            return self.fp8_saved(Output::High(y), x8, w8, pass, grad).map(|(o, s)| (o, s, reduced));
        }
        let shape = out_shape(shape, n_out);
        let operands = || (x8.operand(), w8.operand());
        let out = if !opts.fp8_output {
            let mut y = Tensor::empty(&dev, dtype, &shape)?;
            let (a, b) = operands();
            gemm(&dev, a, b, GemmOut::new(&mut y), &cfg)?;
            Output::High(y)
        } else if q.output.fuses_cast() {
            // The GEMM epilogue scales and casts the output and writes its amax.
            let mut y = Tensor::empty(&dev, q.output.dtype(), &shape)?;
            let scale_inv = q.output.fused_cast(&mut |s| {
                let fp8 = Fp8Output { scale: s.scale.slice(0..1), amax: s.amax.slice_mut(0..1) };
                let (a, b) = operands();
                gemm(&dev, a, b, GemmOut { tensor: &mut y, fp8: Some(fp8) }, &cfg)
            })?;
            Output::Fp8(Float8Tensor::from_parts(y, None, scale_inv)?)
        } else {
            // The output's scale needs its amax first: GEMM to high precision, then cast.
            let mut y = Tensor::empty(&dev, dtype, &shape)?;
            let (a, b) = operands();
            gemm(&dev, a, b, GemmOut::new(&mut y), &cfg)?;
            Output::Fp8(q.output.quantize(&y, false, None)?)
        };
        self.fp8_saved(out, x8, w8, pass, grad).map(|(o, s)| (o, s, false))
    }

    /// What an FP8 forward of output `out` saves for backward (with `grad`): the input's
    /// transpose (unless recomputed), the FP8 weight and the gradient scaling.
    fn fp8_saved(
        &mut self,
        out: Output,
        x8: Float8Tensor,
        w8: Float8Tensor,
        pass: &Fp8Pass,
        grad: bool,
    ) -> Result<(Output, Option<Saved>)> {
        if !grad {
            return Ok((out, None));
        }
        let input_t = match self.save_input {
            true => Some(x8.into_transposed().ok_or_else(|| self.internal("the FP8 input has no transpose"))?),
            false => None,
        };
        let grad = self.scaling.grad(&pass.recipe)?;
        Ok((out, Some(Saved::Fp8(Fp8Saved { input_t, weight: w8, grad }))))
    }

    /// The quantizer of the output gradient of a backward whose forward kept `g`.
    pub(crate) fn grad_quantizer(&mut self, g: &GradScaling) -> Result<Box<dyn Quantizer>> {
        self.scaling.grad_output(g)
    }

    /// Backward: `dy` `[..., out]` (this rank's token shard of it for a row-parallel GEMM
    /// under sequence parallelism: gathered first) → `dx` (`input_shape`, `dy`'s dtype; the
    /// ranks' sum for a column-parallel GEMM) when asked; wgrad and bgrad accumulate into the
    /// parameters.
    pub(crate) fn backward(
        &mut self,
        saved: Saved,
        dy: &Tensor,
        input_shape: &[usize],
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let dx = match saved {
            // A 16-bit backward whose output gradient is a token shard, with the communication
            // overlap: the shards gathered beside the dgrad GEMMs of the arrived ones.
            Saved::High { input, weight } if input_grad && self.comm.overlaps_grad_gather() => {
                ops::check_dtype(self.module, "grad_output", dy, DType::is_high_precision, "f32, bf16 or f16")?;
                self.params.check_main_grad()?;
                self.backward_high(dy, &input, &weight, true, true)?
            }
            saved => {
                let dy = self.comm.gather_grad_output(dy)?;
                self.backward_local(saved, &dy, input_shape, input_grad)?
            }
        };
        self.reduce_dgrad(dx)
    }

    /// The layer's input gradient from this rank's dgrad, whose reduction
    /// ([`GemmParallel::start_reduce_dgrad`]) started before the wgrad GEMM: waited for (or run)
    /// now.
    fn reduce_dgrad(&self, dx: Option<PendingReduce>) -> Result<Option<Tensor>> {
        dx.map(PendingReduce::finish).transpose()
    }

    /// Starts the reduction of this rank's dgrad `dx` ([`GemmParallel::start_reduce_dgrad`]:
    /// on the side stream beside the wgrad GEMM issued next, with the communication overlap).
    fn start_reduce_dgrad(&self, dx: Tensor) -> Result<PendingReduce> {
        self.comm.start_reduce_dgrad(self.module, dx)
    }

    /// This rank's GEMMs of [`LinearCore::backward`].
    fn backward_local(
        &mut self,
        saved: Saved,
        dy: &Tensor,
        input_shape: &[usize],
        input_grad: bool,
    ) -> Result<Option<PendingReduce>> {
        ops::check_dtype(self.module, "grad_output", dy, DType::is_high_precision, "f32, bf16 or f16")?;
        ops::check_shape(self.module, "grad_output", dy, &out_shape(input_shape, self.params.out_features()))?;
        self.params.check_main_grad()?;
        match saved {
            Saved::Fp8(s) => {
                let q = self.grad_quantizer(&s.grad)?;
                let (tokens, n_out) = dy.as_2d(self.module)?;
                let mut dbias = match self.params.bias().is_some() && self.bias_bwd {
                    true => Some(DbiasBuffers::new(&self.dev(), dy.dtype(), tokens, n_out)?),
                    false => None,
                };
                let dy8 = q.quantize(dy, true, dbias.as_mut().map(DbiasBuffers::out))?;
                let dbias = dbias.map(DbiasBuffers::into_dbias);
                self.backward_fp8_local(&dy8, dbias, s, input_shape, dy.dtype(), input_grad)
            }
            Saved::High { input, weight } => self.backward_high(dy, &input, &weight, input_grad, false),
        }
    }

    /// FP8 backward from an already cast `dy8` (with transpose; the whole output gradient, as
    /// [`LinearCore::backward`] gathers it) and its bias gradient: dgrad when asked (the ranks'
    /// sum for a column-parallel GEMM), wgrad and bgrad into the parameters; then the forward's
    /// gradient scaling is done with. A fused producer (the dact cast of `LayerNormMLP`) calls it
    /// directly.
    pub(crate) fn backward_fp8(
        &mut self,
        dy8: &Float8Tensor,
        dbias: Option<Tensor>,
        saved: Fp8Saved,
        input_shape: &[usize],
        dtype: DType,
        input_grad: bool,
    ) -> Result<Option<Tensor>> {
        let dx = self.backward_fp8_local(dy8, dbias, saved, input_shape, dtype, input_grad)?;
        self.reduce_dgrad(dx)
    }

    /// This rank's GEMMs of [`LinearCore::backward_fp8`]: the dgrad first, its reduction
    /// started before the wgrad GEMM.
    fn backward_fp8_local(
        &mut self,
        dy8: &Float8Tensor,
        dbias: Option<Tensor>,
        saved: Fp8Saved,
        input_shape: &[usize],
        dtype: DType,
        input_grad: bool,
    ) -> Result<Option<PendingReduce>> {
        let input_t = saved.input_t.ok_or_else(|| self.internal("the FP8 input was not restored"))?;
        let dx = match input_grad {
            true => Some(self.start_reduce_dgrad(self.fp8_dgrad(dy8, &saved.weight, input_shape, dtype)?)?),
            false => None,
        };
        let a = dy8.transpose_operand().ok_or_else(|| self.internal("the grad_output cast made no transpose"))?;
        self.params.accumulate_wgrad(a, input_t.operand(), None)?;
        if let Some(d) = dbias {
            self.params.accumulate_bias_grad(d)?;
        }
        saved.grad.finish()?;
        Ok(dx)
    }

    /// FP8 dgrad `dx = dy8 · (W8ᵀ)ᵀ` with the split accumulator (TE).
    fn fp8_dgrad(
        &self,
        dy8: &Float8Tensor,
        weight: &Float8Tensor,
        input_shape: &[usize],
        dtype: DType,
    ) -> Result<Tensor> {
        let dev = self.dev();
        let w_t = weight.transpose_operand().ok_or_else(|| self.internal("the saved FP8 weight has no transpose"))?;
        let mut dx = Tensor::empty(&dev, dtype, input_shape)?;
        gemm(&dev, dy8.operand(), w_t, GemmOut::new(&mut dx), &GemmConfig::default())?;
        Ok(dx)
    }

    /// 16-bit backward: dgrad (its reduction started) when `input_grad`, then wgrad and bgrad.
    /// With `gather`, `dy` is this rank's token shard, all-gathered beside the dgrad GEMMs of the
    /// arrived shards ([`GemmParallel::gather_gemm`]; `input_grad` must be set).
    fn backward_high(
        &mut self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        input_grad: bool,
        gather: bool,
    ) -> Result<Option<PendingReduce>> {
        let dev = self.dev();
        let dy = convert(&dev, dy.clone(), x.dtype())?;
        let n_in = x.shape().last().copied().unwrap_or(0);
        // dx [t, in] = dy [t, out] · W [out, in]: B = Wᵀ as stored transposed.
        let dgrad = |dy: &Tensor| -> Result<Tensor> {
            let mut dx = Tensor::empty(&dev, x.dtype(), &out_shape(dy.shape(), n_in))?;
            gemm(&dev, Operand::new(dy), Operand::new(w).transposed(), GemmOut::new(&mut dx), &GemmConfig::default())?;
            Ok(dx)
        };
        let (dy, dx) = match (gather, input_grad) {
            (true, true) => {
                let (whole, dx) = self.comm.gather_gemm(&dy, true, dgrad)?;
                let whole = whole.ok_or_else(|| self.internal("the gathered output gradient was not kept"))?;
                let n_out = self.params.out_features();
                ops::check_shape(self.module, "grad_output", &whole, &out_shape(x.shape(), n_out))?;
                (whole, Some(dx))
            }
            (true, false) => return Err(self.internal("an overlapped output-gradient gather without dgrad")),
            (false, true) => {
                let dx = dgrad(&dy)?;
                (dy, Some(dx))
            }
            (false, false) => (dy, None),
        };
        let dx = dx.map(|dx| self.start_reduce_dgrad(dx)).transpose()?;
        // dW [out, in] = dyᵀ [out, t] · x [t, in]; the bias gradient Σ_t dy comes from the same
        // GEMM's BGRADB epilogue (TE's non-FP8 wgrad with `grad = true`).
        let (_, n_out) = dy.as_2d(self.module)?;
        let mut dbias = match (self.params.bias(), self.bias_bwd) {
            (Some(_), true) => Some(Tensor::empty(&dev, x.dtype(), &[n_out])?),
            _ => None,
        };
        self.params.accumulate_wgrad(Operand::new(&dy).transposed(), Operand::new(x).transposed(), dbias.as_mut())?;
        if let Some(d) = dbias {
            self.params.accumulate_bias_grad(d)?;
        }
        Ok(dx)
    }
}

/// `[..., out]` for an input `[..., in]`.
pub(crate) fn out_shape(input: &[usize], out: usize) -> Vec<usize> {
    let mut s = input.to_vec();
    if let Some(last) = s.last_mut() {
        *last = out;
    }
    s
}
