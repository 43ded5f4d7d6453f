//! ZeRO-3 of a [`DecoderLm`] ([`DecoderLm::set_zero3`]; PyTorch FSDP with one unit a layer,
//! DeepSpeed's stage 3): each data-parallel rank keeps its pieces of every layer's 16-bit
//! weights (te-nn's [`ParamShards`]); a layer's whole weights are gathered into a ring of two
//! transient buffer sets just before its forward (the next layer's gather prefetched on a side
//! stream, overlapping this layer's compute) and released after it, and gathered again before
//! its backward (prefetched in reverse order; under full recompute the recomputed forward reads
//! the backward's gather: one gather a layer for the backward). The embedding, the final norm
//! and the LM head stay whole on every rank for the whole step. The gradients are ZeRO-2's
//! (each piece reduced to its owner during the backward); the optimizer updates the pieces in
//! place (`te_train::optim::AdamW::step_sharded` with [`DecoderLm::zero3_pieces`]).
//!
//! Under an FP8 recipe whose weight scale is the weight's own amax (current scaling), the GEMM
//! weights are gathered as FP8 codes (torchao's float8 all-gather with FSDP: half the bytes of
//! bf16; [`DecoderLm::set_zero3_fp8_gather`]): at each forward's start the pieces' amaxes are
//! all-reduced once, each gather casts this rank's pieces with the whole weight's scale, and the
//! layers' GEMMs read the gathered codes (the same codes their own cast of the whole weight
//! makes, so the step is the bf16 gather's bit for bit). Other recipes gather bf16.
//!
//! The layers' parameters point at the ring's buffers, so a released layer's parameters read
//! another layer's values: what reads the model outside a step goes through
//! [`DecoderLm::with_whole_parameters`] (a checkpoint save), [`DecoderLm::zero3_reshard`]
//! (after a load wrote whole values) or [`DecoderLm::zero3_unshard`] (the end of a run).

use super::DecoderLm;
use std::cell::{Cell, RefCell};
use std::sync::Arc;
use te_nn::fp8::{fp8_mode, Fp8Mode, ScalingState};
use te_nn::modules::{Module, ModuleVisitor, ModuleVisitorMut, Param, ParamKind, ParamMut, Recompute};
use te_nn::parallel::{Gathered, GradShards, ParamShards};
use te_runtime::dist::ProcessGroup;
use te_runtime::{Error, Result, Tensor};

const MODULE: &str = "DecoderLm (ZeRO-3)";

/// The sharded layers of a [`DecoderLm`]: the store (group `l` is layer `l`) and where each
/// layer's parameters start in the model's traversal order.
#[derive(Debug)]
pub(super) struct Zero3 {
    store: ParamShards,
    /// The traversal index of each layer's first parameter.
    first: Vec<usize>,
}

impl Zero3 {
    /// Before a forward: no slot's values are reused (an optimizer step or a load may have
    /// changed the pieces since they were gathered). A gather the last forward left behind
    /// (its last layer's, prefetched for a backward that did not come: an evaluation) is
    /// waited for before its slot takes another layer (`ParamShards::prefetch`).
    ///
    /// Under an FP8 recipe whose weight cast can be split over pieces (and with the FP8 gather
    /// on) the GEMM weights' amaxes are all-reduced here, a collective: every rank's forward
    /// starts it.
    pub(super) fn begin_forward(&mut self, fp8_gather: bool) -> Result<()> {
        self.store.release_all();
        let quantizer = match fp8_mode() {
            Fp8Mode::Fp8(recipe) if fp8_gather => recipe.scaling().sharded_weight_quantizer(self.device())?,
            _ => None,
        };
        self.store.set_fp8_gather(quantizer)
    }

    /// The device the pieces live on.
    fn device(&self) -> &Arc<te_runtime::Device> {
        self.store.device()
    }

    /// Gathers layer `l` (or waits for its prefetch), points its parameters at the buffers
    /// and starts gathering `next` (the following layer of the pass) on the side stream.
    pub(super) fn enter(&mut self, l: usize, layer: &mut dyn Module, next: Option<usize>) -> Result<()> {
        let values = self.store.gather(l)?;
        point(layer, &values)?;
        if let Some(n) = next.filter(|&n| n < self.first.len()) {
            self.store.prefetch(n)?;
        }
        Ok(())
    }

    /// Ends layer `l`'s use of its buffers: its parameters are set again (dropping any FP8
    /// weight the layer cast from them, and the transposes of gathered FP8 codes) and the slot
    /// is free for the next gather.
    pub(super) fn leave(&mut self, l: usize, layer: &mut dyn Module) -> Result<()> {
        let values = self.store.held(l).ok_or_else(|| Error::internal(MODULE, format!("layer {l} left ungathered")))?;
        point(layer, &values)?;
        self.store.release(l);
        Ok(())
    }

    /// Starts gathering layer `l` on the side stream (the backward's first layer, while the
    /// head runs).
    pub(super) fn prefetch(&mut self, l: usize) -> Result<()> {
        self.store.prefetch(l)
    }
}

/// Sets `module`'s parameters, in traversal order, to `values` (each a clone sharing the
/// buffer; a GEMM weight gathered as FP8 codes handed in as such).
fn point(module: &mut dyn Module, values: &[Gathered]) -> Result<()> {
    let mut values = values.iter();
    module.visit_mut("", &mut |path: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
        match values.next() {
            Some(Gathered::High(t)) => p.set(t.clone()),
            Some(Gathered::Fp8(f)) => p.set_gathered_fp8(f.clone()),
            None => Err(Error::internal(MODULE, format!("no gathered tensor for {path}"))),
        }
    })
}

/// Which of `module`'s parameters (traversal order) can be gathered as FP8 codes: the GEMM
/// weights whose dims FP8 GEMMs take (multiples of 16).
fn fp8_marks(module: &dyn Module) -> Result<Vec<bool>> {
    let mut out = Vec::new();
    module.visit("", &mut |_: &str, kind: ParamKind, p: &dyn Param| -> Result<()> {
        out.push(kind == ParamKind::Weight && matches!(p.shape(), [o, i] if o % 16 == 0 && i % 16 == 0));
        Ok(())
    })?;
    Ok(out)
}

/// Each parameter's tensor of `module`, in traversal order.
fn tensors_of(module: &dyn Module) -> Result<Vec<Tensor>> {
    let mut out = Vec::new();
    module.visit("", &mut |path: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
        let t = p.tensor().ok_or_else(|| Error::Config {
            module: MODULE,
            message: format!("{path} is an FP8-only weight (fp8_model_init): ZeRO-3 shards high-precision weights"),
        })?;
        out.push(t.clone());
        Ok(())
    })?;
    Ok(out)
}

/// Parameters of `module`.
fn count(module: &dyn Module) -> usize {
    let mut n = 0;
    // The counter never fails, and a traversal fails only with its visitor's error.
    let _ = module.visit("", &mut |_: &str, _: ParamKind, _: &dyn Param| -> Result<()> {
        n += 1;
        Ok(())
    });
    n
}

impl DecoderLm {
    /// Shards the layers' weights over the data-parallel `group` (ZeRO stage 3, see the module
    /// docs): `shards` says which rank owns which elements of each parameter (the whole model's
    /// traversal order: the optimizer's split, `te_train::optim::AdamW::zero_shards`; build the
    /// optimizer afterwards from [`DecoderLm::zero3_pieces`] with `AdamW::new_zero3`, so the
    /// whole weights and its state are never on the device together). Each
    /// rank keeps its pieces of each layer's weights and frees the rest; the embedding, final
    /// norm and LM head stay whole. Every rank of `group` calls it (it creates a side-stream
    /// communicator and gathers each layer once to set up the ring). A data-parallel backward
    /// then hands its parts over in reverse traversal order
    /// (`te_nn::parallel::DataParallel::begin_step_reversed`).
    ///
    /// # Errors
    /// [`Error::Config`] without full activation recompute ([`DecoderLm::set_recompute`]: the
    /// saved contexts would hold every layer's weights until the backward, so nothing would be
    /// freed), when the layers are sharded already, or for shards of another parameter count;
    /// the store's errors ([`ParamShards::new`]: a group on a side stream, shards over another
    /// number of ranks); NCCL and allocation errors.
    pub fn set_zero3(&mut self, group: Arc<ProcessGroup>, shards: GradShards) -> Result<()> {
        let config = |message: String| Error::Config { module: MODULE, message };
        if self.recompute != Recompute::Full {
            return Err(config(
                "ZeRO-3 gathers each layer's weights for its forward and again for its backward, which needs full \
                 activation recompute (without it the saved contexts keep every layer's weights): add --recompute \
                 full (DecoderLm::set_recompute(Recompute::Full)), or use --zero 2"
                    .into(),
            ));
        }
        if self.zero3.is_some() {
            return Err(config("the layers are sharded already: call zero3_unshard first".into()));
        }
        let total = self.num_parameters_count();
        if shards.len() != total {
            return Err(config(format!(
                "shards of {} parameters for a model of {total}: pass the grad_shards of an optimizer of this model",
                shards.len()
            )));
        }
        let mut store = ParamShards::new(group, shards, 2)?;
        let mut first = Vec::with_capacity(self.layers.len());
        let mut at = count(&self.embedding);
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let params: Vec<(usize, Tensor)> = (at..).zip(tensors_of(layer)?).collect();
            store.add_group_fp8(&params, &fp8_marks(layer)?)?;
            first.push(at);
            at += params.len();
            // The layer's parameters onto the ring at once: its whole tensors are freed before
            // the next layer's pieces are taken (the setup holds one layer more, not the model).
            drop(params);
            point(layer, &store.gather(l)?)?;
            store.release(l);
        }
        self.zero3 = Some(Zero3 { store, first });
        Ok(())
    }

    /// ZeRO-3: whether FP8 steps gather the layers' GEMM weights as FP8 codes (default on; see
    /// the module docs; `te train --zero3-fp8-gather`): half the gather's bytes, the same step
    /// bit for bit. Only under a recipe whose weight scale is the weight's own amax (current
    /// scaling: `--recipe current`); under delayed and blockwise scaling the weights are
    /// gathered in bf16 either way. Off, every gather is bf16 (to compare the two). Applies
    /// from the next forward, sharded or not yet.
    pub fn set_zero3_fp8_gather(&mut self, enabled: bool) {
        self.zero3_fp8_gather = enabled;
    }

    /// ZeRO-3: whether the last forward gathered the GEMM weights as FP8 codes
    /// ([`DecoderLm::set_zero3_fp8_gather`]); `false` when not sharded.
    pub fn zero3_gathers_fp8(&self) -> bool {
        self.zero3.as_ref().is_some_and(|z| z.store.fp8_gather())
    }

    /// Whether the layers' weights are sharded ([`DecoderLm::set_zero3`]).
    pub fn is_zero3(&self) -> bool {
        self.zero3.is_some()
    }

    /// ZeRO-3: this rank's pieces of the sharded weights by traversal index
    /// ([`ParamShards::local_pieces`]: `Some` for each layer parameter, `None` for the
    /// embedding, final norm and head), what the optimizer writes its update into; `None`
    /// when not sharded.
    pub fn zero3_pieces(&self) -> Option<Vec<Option<Tensor>>> {
        self.zero3.as_ref().map(|z| z.store.local_pieces())
    }

    /// ZeRO-3: bytes of the layer weights this rank keeps and of all of them whole
    /// ([`ParamShards::bytes`]); `None` when not sharded.
    pub fn zero3_bytes(&self) -> Option<(u64, u64)> {
        self.zero3.as_ref().map(|z| z.store.bytes())
    }

    /// Calls `f` with the model as a read-only [`Module`] whose parameters are all whole (what a
    /// checkpoint save takes), else the model itself. Under ZeRO-3 a collective: every rank
    /// calls it, and the view gathers the layers one at a time as `f`'s traversal reaches them
    /// (a layer's whole tensors are dropped when the next layer's are gathered: stream-ordered,
    /// after the copies issued from them), so the save holds one layer whole at a time, not the
    /// model. The layers `f` does not reach (a rank that writes nothing) are gathered after it,
    /// so every rank issues the same gathers in the same order. `f` visits the view at most once.
    ///
    /// # Errors
    /// The gathers' errors; `f`'s; [`Error::Config`] for a second visit of the view.
    pub fn with_whole_parameters(&self, f: &mut dyn FnMut(&dyn Module) -> Result<()>) -> Result<()> {
        let Some(z) = &self.zero3 else { return f(self) };
        let view = WholeView { model: self, zero3: z, held: RefCell::new(Held::default()), visited: Cell::new(false) };
        let out = f(&view);
        // The layers the traversal did not reach, gathered (and dropped) in order.
        let rest = view.held.borrow_mut().up_to(z, z.first.len());
        out.and(rest)
    }

    /// ZeRO-3, after the layers' parameters were set to whole values on every rank (a
    /// checkpoint load): keeps this rank's pieces of them and points the layers at the ring
    /// again. Nothing to do when not sharded.
    ///
    /// # Errors
    /// Shape, copy and NCCL errors.
    pub fn zero3_reshard(&mut self) -> Result<()> {
        let Some(z) = &mut self.zero3 else { return Ok(()) };
        // No slot keeps a layer (an evaluation's forward leaves the last one gathered for a
        // backward): each layer is gathered anew below, in bf16 (the next forward decides).
        z.store.release_all();
        z.store.set_fp8_gather(None)?;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            z.store.scatter(l, &tensors_of(layer)?)?;
            point(layer, &z.store.gather(l)?)?;
            z.store.release(l);
        }
        Ok(())
    }

    /// ZeRO-3 off: every layer's weights gathered whole into its own tensors and the store
    /// dropped (what export, generation and [`DecoderLm::to_weights`] read). Every rank calls
    /// it. Nothing to do when not sharded.
    ///
    /// # Errors
    /// NCCL and allocation errors (the layers stay sharded then).
    pub fn zero3_unshard(&mut self) -> Result<()> {
        let Some(z) = &self.zero3 else { return Ok(()) };
        let whole = (0..self.layers.len()).map(|l| z.store.gather_whole(l)).collect::<Result<Vec<_>>>()?;
        for (layer, tensors) in self.layers.iter_mut().zip(whole) {
            point(layer, &tensors.into_iter().map(Gathered::High).collect::<Vec<_>>())?;
        }
        self.zero3 = None;
        Ok(())
    }

    /// Parameters of the model (count, not elements).
    fn num_parameters_count(&self) -> usize {
        count(self)
    }
}

impl Zero3 {
    /// The layer whose parameters include traversal index `i`, and `i`'s place among them;
    /// `None` for a parameter outside the layers (embedding, final norm, head).
    fn layer_of(&self, i: usize) -> Option<(usize, usize)> {
        let l = self.first.iter().rposition(|&f| f <= i)?;
        let k = i - self.first[l];
        (k < self.store.params(l).len()).then_some((l, k))
    }
}

/// The model with whole tensors in place of the sharded ones ([`DecoderLm::with_whole_parameters`]).
struct WholeView<'a> {
    model: &'a DecoderLm,
    zero3: &'a Zero3,
    held: RefCell<Held>,
    visited: Cell<bool>,
}

/// The layers a [`WholeView`] gathered so far (in order), and the last one's whole tensors.
#[derive(Default)]
struct Held {
    /// Layers `0..gathered` were gathered.
    gathered: usize,
    /// The whole tensors of layer `gathered − 1`, while the traversal is in it.
    tensors: Vec<Tensor>,
}

impl Held {
    /// Gathers the layers from `self.gathered` up to and including `l − 1` (each dropped when
    /// the next arrives), keeping the last one's tensors.
    fn up_to(&mut self, z: &Zero3, l: usize) -> Result<()> {
        while self.gathered < l {
            // The previous layer's tensors go first: one layer whole at a time.
            self.tensors = Vec::new();
            self.tensors = z.store.gather_whole(self.gathered)?;
            self.gathered += 1;
        }
        Ok(())
    }
}

impl Module for WholeView<'_> {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        if self.visited.replace(true) {
            return Err(Error::Config {
                module: MODULE,
                message: "the whole-parameter view of a ZeRO-3 model gathers its layers once: visit it once".into(),
            });
        }
        self.model.visit(prefix, &mut Substitute { visitor, view: self, next: 0 })
    }

    fn visit_mut(&mut self, _: &str, _: &mut dyn ModuleVisitorMut) -> Result<()> {
        Err(Error::Config {
            module: MODULE,
            message: "the whole-parameter view of a ZeRO-3 model is read-only: write the model itself".into(),
        })
    }
}

/// Hands the wrapped visitor each parameter, a sharded one with its whole tensor (its layer
/// gathered when the traversal enters it).
struct Substitute<'a, 'v> {
    visitor: &'a mut dyn ModuleVisitor,
    view: &'a WholeView<'v>,
    next: usize,
}

impl ModuleVisitor for Substitute<'_, '_> {
    fn param(&mut self, path: &str, kind: ParamKind, param: &dyn Param) -> Result<()> {
        let i = self.next;
        self.next += 1;
        let Some((l, k)) = self.view.zero3.layer_of(i) else { return self.visitor.param(path, kind, param) };
        let mut held = self.view.held.borrow_mut();
        held.up_to(self.view.zero3, l + 1)?;
        if held.gathered != l + 1 {
            return Err(Error::internal(MODULE, format!("{path}: layer {l} visited after a later layer")));
        }
        let tensor =
            held.tensors.get(k).ok_or_else(|| Error::internal(MODULE, format!("{path}: no gathered tensor")))?;
        self.visitor.param(path, kind, &WholeParam { inner: param, tensor })
    }

    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> Result<()> {
        self.visitor.fp8_state(path, state)
    }
}

/// A parameter read with its whole tensor.
struct WholeParam<'a> {
    inner: &'a dyn Param,
    tensor: &'a Tensor,
}

impl Param for WholeParam<'_> {
    fn shape(&self) -> &[usize] {
        self.tensor.shape()
    }

    fn dtype(&self) -> te_codegen::DType {
        self.tensor.dtype()
    }

    fn tensor(&self) -> Option<&Tensor> {
        Some(self.tensor)
    }

    fn grad(&self) -> Option<&Tensor> {
        self.inner.grad()
    }

    fn main_grad(&self) -> Option<&Tensor> {
        self.inner.main_grad()
    }

    fn tensor_parallel(&self) -> bool {
        self.inner.tensor_parallel()
    }
}
