//! Path-keyed traversal of a model: every parameter (`"layers.3.mlp.fc1_weight"`) and every FP8
//! scaling state (`"layers.3.proj.fp8_fwd"`), in a fixed order, read-only ([`Module::visit`]) or
//! writable ([`Module::visit_mut`]). `#[derive(Module)]` generates the traversal of a model
//! struct; checkpoints, parameter counts, optimizers and `zero_grad` are visitors on top of it.
//! The same recursion collects the kernels a model runs ([`Module::kernel_specs`]), which
//! `te prewarm` compiles ahead of time.

//!
//! Files: the traits and [`join_path`] here; `containers.rs` (slices, `Vec`, arrays, `Option`,
//! `Box` of modules); `layers.rs` (TE's GEMM and norm layers, and the `visit_*_params` building
//! blocks of hand-written impls); `group.rs` (one weight + bias group as [`Param`]s).

mod containers;
mod group;
mod layers;

pub use layers::{visit_linear_params, visit_linear_params_mut, visit_norm_params, visit_norm_params_mut};
pub(crate) use layers::{visit_slots, visit_states};

use super::{Fp8StateSlot, KernelSpec, KernelTarget};
use crate::fp8::{Float8Tensor, ScalingState};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::{Result, Tensor};

/// What a parameter is to the layer that owns it (an optimizer skips weight decay on biases and
/// norms by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// A GEMM weight `[out, in]` (TE `weight`, `fc1_weight`, ...).
    Weight,
    /// A GEMM bias `[out]` (TE `bias`, `fc1_bias`, ...).
    Bias,
    /// A norm's gamma `[hidden]` (TE `LayerNorm.weight`, `layer_norm_weight`).
    NormWeight,
    /// A LayerNorm's beta `[hidden]` (TE `LayerNorm.bias`, `layer_norm_bias`).
    NormBias,
    /// An embedding table `[vocab, hidden]` (`Embedding.weight`).
    Embedding,
}

/// One parameter as a visitor reads it. The library implements it for the tensors of its
/// modules; a hand-written leaf module implements it for its own storage.
pub trait Param {
    /// Shape as stored.
    fn shape(&self) -> &[usize];

    /// Element type as stored: the layer's `params_dtype`, or E4M3 for an FP8-only weight.
    fn dtype(&self) -> DType;

    /// The high-precision tensor; `None` for an FP8-only weight (see [`Param::fp8_tensor`]).
    fn tensor(&self) -> Option<&Tensor>;

    /// The FP8-only weight of a layer made under [`crate::fp8::fp8_model_init`].
    fn fp8_tensor(&self) -> Option<&Float8Tensor> {
        None
    }

    /// The gradient accumulated since the last `zero_grad` (`params_dtype`); `None` before the
    /// first backward, or when wgrad accumulates into [`Param::main_grad`] instead.
    fn grad(&self) -> Option<&Tensor>;

    /// The f32 `main_grad` a GEMM weight's wgrad accumulates into with
    /// `fuse_wgrad_accumulation` (Megatron's `weight.main_grad`).
    fn main_grad(&self) -> Option<&Tensor> {
        None
    }

    /// Split over a tensor-parallel group: each rank holds (and computes the gradient of) its
    /// own slice (TE/Megatron-LM's `tensor_model_parallel` attribute). `false` for a parameter
    /// every rank of the group holds whole (norms, a row-parallel bias, embeddings): its copies
    /// are equal, and it counts once in the gradient norm.
    fn tensor_parallel(&self) -> bool {
        false
    }

    /// Number of elements.
    fn numel(&self) -> usize {
        self.shape().iter().product()
    }
}

/// One parameter as a visitor writes it (a checkpoint load, an optimizer step).
pub trait ParamMut: Param {
    /// Replaces the tensor (of the stored shape, in `params_dtype`); bumps the layer's version,
    /// so contexts saved before are refused and a cached FP8 weight is cast anew. An FP8-only
    /// weight becomes high precision.
    ///
    /// # Errors
    /// [`te_runtime::Error::Shape`] / [`te_runtime::Error::DType`] when `value` does not fit.
    fn set(&mut self, value: Tensor) -> Result<()>;

    /// Replaces an FP8-only weight (see [`Param::fp8_tensor`]) by `value`: E4M3 codes of the
    /// stored shape with their `scale_inv` (a checkpoint's); bumps the version as
    /// [`ParamMut::set`] does. The default refuses: only FP8-only weights take FP8 values.
    ///
    /// # Errors
    /// [`te_runtime::Error::Config`] when the parameter is not an FP8-only weight;
    /// [`te_runtime::Error::Shape`] / [`te_runtime::Error::DType`] when `value` does not fit.
    fn set_fp8(&mut self, value: Float8Tensor) -> Result<()> {
        let _ = value;
        Err(te_runtime::Error::Config {
            module: "ParamMut::set_fp8",
            message: "this parameter is not an FP8-only weight".into(),
        })
    }

    /// Hands a high-precision GEMM weight its values for one step as FP8 codes gathered from the
    /// data-parallel ranks' pieces (ZeRO-3's FP8 all-gather; see
    /// [`crate::modules::LinearParams::set_gathered_fp8_weight`]): E4M3 `[out, in]` with one
    /// `scale_inv`. The parameter keeps its kind, shape and `params_dtype` in a traversal, and
    /// [`Param::tensor`] is `None` until [`ParamMut::set`] hands in high-precision values again.
    /// The default refuses: only GEMM weights take it.
    ///
    /// # Errors
    /// [`te_runtime::Error::Config`] for a parameter that is not a high-precision GEMM weight;
    /// [`te_runtime::Error::Shape`] / [`te_runtime::Error::DType`] when `value` does not fit.
    fn set_gathered_fp8(&mut self, value: Float8Tensor) -> Result<()> {
        let _ = value;
        Err(te_runtime::Error::Config {
            module: "ParamMut::set_gathered_fp8",
            message: "this parameter is not a GEMM weight".into(),
        })
    }

    /// Drops the accumulated gradient. TE's layers keep weight and bias gradients together: this
    /// drops both (the caller's `main_grad` is kept).
    fn zero_grad(&mut self);

    /// The gradient an optimizer reads ([`Param::main_grad`] when there is one, else
    /// [`Param::grad`]), writable: a data-parallel run averages it over the ranks in place
    /// (`crate::parallel::DataParallel`). `None` when there is none yet. The default returns
    /// `None`: a hand-written parameter that does not implement it is left out of such
    /// reductions, so implement it for a parameter trained data-parallel.
    fn grad_mut(&mut self) -> Option<&mut Tensor> {
        None
    }

    /// Takes this parameter's accumulated gradient ([`Param::grad`]) out of its layer, leaving
    /// none (as [`ParamMut::zero_grad`] would, for this parameter only: a bias's gradient stays
    /// when the weight's is taken): a ZeRO-2 backward releases the gradients of the parameters
    /// this rank holds no optimizer state for once their reduction to the owning rank is done
    /// (`crate::parallel::DataParallel`). The caller's `main_grad` ([`Param::main_grad`]) is
    /// never taken: a parameter with one returns `None`, as does the default (nothing is
    /// released: implement it for a hand-written parameter trained with ZeRO-2 to save its
    /// gradient's memory).
    fn take_grad(&mut self) -> Option<Tensor> {
        None
    }
}

/// What a read-only traversal ([`Module::visit`]) calls for each thing it reaches. A closure
/// `FnMut(&str, ParamKind, &dyn Param) -> Result<()>` is a visitor of parameters.
pub trait ModuleVisitor {
    /// The parameter at `path`.
    ///
    /// # Errors
    /// The visitor's own; the traversal stops and returns it.
    fn param(&mut self, path: &str, kind: ParamKind, param: &dyn Param) -> Result<()>;

    /// The FP8 scaling state at `path` (`….fp8_fwd`, `….fp8_bwd`), present once an FP8 forward
    /// (or backward) ran with delayed scaling. Ignored unless overridden.
    ///
    /// # Errors
    /// The visitor's own; the traversal stops and returns it.
    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> Result<()> {
        let _ = (path, state);
        Ok(())
    }
}

/// What a writable traversal ([`Module::visit_mut`]) calls for each thing it reaches. A closure
/// `FnMut(&str, ParamKind, &mut dyn ParamMut) -> Result<()>` is a visitor of parameters.
pub trait ModuleVisitorMut {
    /// The parameter at `path`.
    ///
    /// # Errors
    /// The visitor's own; the traversal stops and returns it.
    fn param(&mut self, path: &str, kind: ParamKind, param: &mut dyn ParamMut) -> Result<()>;

    /// The FP8 scaling state at `path` ([`ScalingState::restore`] writes it through a shared
    /// reference). Ignored unless overridden.
    ///
    /// # Errors
    /// The visitor's own; the traversal stops and returns it.
    fn fp8_state(&mut self, path: &str, state: &Arc<ScalingState>) -> Result<()> {
        let _ = (path, state);
        Ok(())
    }

    /// The place at `path` where a module keeps a scaling state, empty before the module's
    /// first FP8 pass: a visitor that must reach states a fresh model does not have yet (a
    /// checkpoint load) overrides it and fills the slot with [`Fp8StateSlot::get_or_create`].
    /// By default, calls [`ModuleVisitorMut::fp8_state`] when the slot holds a state.
    ///
    /// # Errors
    /// The visitor's own; the traversal stops and returns it.
    fn fp8_state_slot(&mut self, path: &str, slot: &mut Fp8StateSlot<'_>) -> Result<()> {
        match slot.state().cloned() {
            Some(state) => self.fp8_state(path, &state),
            None => Ok(()),
        }
    }
}

impl<F: FnMut(&str, ParamKind, &dyn Param) -> Result<()>> ModuleVisitor for F {
    fn param(&mut self, path: &str, kind: ParamKind, param: &dyn Param) -> Result<()> {
        self(path, kind, param)
    }
}

impl<F: FnMut(&str, ParamKind, &mut dyn ParamMut) -> Result<()>> ModuleVisitorMut for F {
    fn param(&mut self, path: &str, kind: ParamKind, param: &mut dyn ParamMut) -> Result<()> {
        self(path, kind, param)
    }
}

/// A parameter's path, kind, shape and dtype (as stored), from [`Module::named_parameters`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedParameter {
    /// Dotted path from the root (`"layers.0.fc1_weight"`).
    pub path: String,
    /// Weight, bias, norm weight or norm bias.
    pub kind: ParamKind,
    /// Shape as stored.
    pub shape: Vec<usize>,
    /// Element type as stored.
    pub dtype: DType,
}

/// A model, or a part of one: it hands each of its parameters and FP8 scaling states to a
/// visitor under a dotted path, in a fixed order. `#[derive(Module)]` implements it for structs
/// of modules; `Vec`s and arrays add index segments (`layers.3`), an `Option` that is `None` adds
/// nothing.
///
/// An implementation fails only with its visitor's error, and visits the same paths in the same
/// order in [`Module::visit`] and [`Module::visit_mut`].
///
/// ```no_run
/// use te_nn::modules::{LayerNormMLP, LayerNormMLPConfig, Linear, LinearConfig, Norm, NormConfig};
/// use te_nn::Module;
/// use te_runtime::Device;
///
/// #[derive(Module)]
/// struct Model {
///     layers: Vec<LayerNormMLP>,
///     final_norm: Option<Norm>,
///     head: Linear,
///     #[module(skip)]
///     name: String,
/// }
///
/// # fn main() -> te_runtime::Result<()> {
/// let dev = Device::new(0)?;
/// let mlp = || LayerNormMLP::new(&dev, LayerNormMLPConfig::new(1024, 4096));
/// let mut model = Model {
///     layers: vec![mlp()?, mlp()?],
///     final_norm: Some(Norm::layer_norm(&dev, NormConfig::new(1024))?),
///     head: Linear::new(&dev, LinearConfig::new(1024, 32000))?,
///     name: "tiny".into(),
/// };
/// for p in model.named_parameters() {
///     println!("{} {:?} {}", p.path, p.shape, p.dtype); // layers.0.layer_norm_weight [1024] bf16, ...
/// }
/// println!("{} parameters", model.num_parameters());
/// model.zero_grad();
/// # Ok(()) }
/// ```
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a Module",
    note = "a field of a `#[derive(Module)]` struct must be a module: a TE layer, a derived struct, or a Vec, Option, \
            array or Box of them; mark a field that holds no parameters `#[module(skip)]`"
)]
pub trait Module {
    /// Hands every parameter and FP8 scaling state to `visitor`, each under `prefix` joined with
    /// its own path ([`join_path`]); `prefix` is `""` at the root.
    ///
    /// # Errors
    /// The visitor's first error (the traversal stops there).
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()>;

    /// As [`Module::visit`], with the parameters writable.
    ///
    /// # Errors
    /// The visitor's first error (the traversal stops there).
    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()>;

    /// Adds the kernels this module runs for `target` (forward, backward, its FP8 casts and
    /// scaling updates) to `specs`, in any order, repeats allowed. `#[derive(Module)]` adds those
    /// of every visited field, containers those of their elements, TE's layers their own (from
    /// their config: sizes, bias, activation, norm, mask; their `params_dtype` overrides the
    /// target's). The default adds nothing: a hand-written leaf module that launches kernels of
    /// its own overrides it, from the module configs' lists (`LinearConfig::kernel_specs`, ...)
    /// and [`KernelTarget::fp8_common`].
    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        let _ = (target, specs);
    }

    /// [`Module::kernel_specs`], sorted and deduplicated: the list to compile ahead of time
    /// (`te_codegen::prewarm::prewarm`).
    fn kernel_specs_for(&self, target: &KernelTarget) -> Vec<KernelSpec> {
        let mut specs = Vec::new();
        self.kernel_specs(target, &mut specs);
        te_codegen::prewarm::sorted(specs)
    }

    /// Number of parameter elements (an FP8-only weight counts its elements, not its bytes).
    fn num_parameters(&self) -> usize {
        let mut n = 0;
        // The counter never fails, and a traversal fails only with its visitor's error.
        let _ = self.visit("", &mut |_: &str, _: ParamKind, p: &dyn Param| -> Result<()> {
            n += p.numel();
            Ok(())
        });
        n
    }

    /// Every parameter's path, kind, shape and dtype, in traversal order.
    fn named_parameters(&self) -> Vec<NamedParameter> {
        let mut out = Vec::new();
        // The collector never fails, and a traversal fails only with its visitor's error.
        let _ = self.visit("", &mut |path: &str, kind: ParamKind, p: &dyn Param| -> Result<()> {
            out.push(NamedParameter { path: path.to_owned(), kind, shape: p.shape().to_vec(), dtype: p.dtype() });
            Ok(())
        });
        out
    }

    /// Drops every accumulated gradient (PyTorch `zero_grad(set_to_none=True)`); `main_grad`s
    /// are the caller's and are kept.
    fn zero_grad(&mut self) {
        // The visitor never fails, and a traversal fails only with its visitor's error.
        let _ = self.visit_mut("", &mut |_: &str, _: ParamKind, p: &mut dyn ParamMut| -> Result<()> {
            p.zero_grad();
            Ok(())
        });
    }
}

/// `prefix.name`, or `name` at the root (`prefix` empty): how a traversal names what it reaches.
pub fn join_path(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_owned()
    } else {
        format!("{prefix}.{name}")
    }
}
