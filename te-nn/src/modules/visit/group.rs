//! A weight and an optional bias with their gradients, as TE's layers keep them ([`LinearParams`],
//! [`NormParams`]), seen as two [`Param`]s.

use super::{join_path, ModuleVisitor, ModuleVisitorMut, Param, ParamKind, ParamMut};
use crate::fp8::Float8Tensor;
use crate::modules::{LinearParams, NormParams};
use std::ops::{Deref, DerefMut};
use te_codegen::DType;
use te_runtime::{Result, Tensor};

/// The weight or the bias of a [`Group`] (the index into its pairs).
#[derive(Debug, Clone, Copy)]
pub(super) enum Slot {
    Weight = 0,
    Bias = 1,
}

/// A weight and an optional bias with their gradients, as TE's layers keep them
/// ([`LinearParams`], [`NormParams`]): pairs indexed by [`Slot`]. Only a GEMM weight can be an
/// FP8-only tensor (`fp8_model_init`) and have a caller's `main_grad`.
pub(super) trait Group {
    /// Kinds of the weight and the bias.
    const KINDS: [ParamKind; 2];
    /// What the weight is, in the error of an FP8 write to a group that cannot take one.
    const WEIGHT: &'static str;
    /// The high-precision weight and bias.
    fn tensors(&self) -> [Option<&Tensor>; 2];
    /// The accumulated gradients of the weight and the bias.
    fn grads(&self) -> [Option<&Tensor>; 2];
    /// The FP8-only weight.
    fn fp8_weight(&self) -> Option<&Float8Tensor> {
        None
    }
    /// The weight a ZeRO-3 step gathered as FP8 codes (see
    /// [`LinearParams::set_gathered_fp8_weight`]).
    fn gathered_fp8(&self) -> Option<&Float8Tensor> {
        None
    }
    /// The caller's `main_grad` of the weight.
    fn main_grad(&self) -> Option<&Tensor> {
        None
    }
    /// Whether the weight and the bias are tensor-parallel slices ([`Param::tensor_parallel`]).
    fn tensor_parallel(&self) -> [bool; 2] {
        [false; 2]
    }
    /// The dtype the layer keeps its parameters in.
    fn params_dtype(&self) -> DType;
    /// Replaces the tensor of `slot`.
    fn set(&mut self, slot: Slot, value: Tensor) -> Result<()>;
    /// Replaces the FP8-only weight.
    fn set_fp8_weight(&mut self, _: Float8Tensor) -> Result<()> {
        Err(not_fp8(Self::WEIGHT))
    }
    /// Hands in the weight gathered as FP8 codes for a step.
    fn set_gathered_fp8(&mut self, _: Float8Tensor) -> Result<()> {
        Err(not_fp8(Self::WEIGHT))
    }
    /// Drops the weight and bias gradients.
    fn clear_grads(&mut self);
    /// The gradients the optimizer reads (the weight's `main_grad` in its place when there is
    /// one), writable.
    fn grads_mut(&mut self) -> [Option<&mut Tensor>; 2];
    /// Takes the gradient of `slot` out, leaving the other; `None` for a weight with a
    /// caller's `main_grad`.
    fn take_grad(&mut self, slot: Slot) -> Option<Tensor>;
}

impl Group for LinearParams {
    const KINDS: [ParamKind; 2] = [ParamKind::Weight, ParamKind::Bias];
    const WEIGHT: &'static str = "a GEMM weight";

    fn tensors(&self) -> [Option<&Tensor>; 2] {
        [self.weight(), self.bias()]
    }

    fn grads(&self) -> [Option<&Tensor>; 2] {
        [self.weight_grad(), self.bias_grad()]
    }

    fn fp8_weight(&self) -> Option<&Float8Tensor> {
        LinearParams::fp8_weight(self)
    }

    fn gathered_fp8(&self) -> Option<&Float8Tensor> {
        LinearParams::gathered_fp8_weight(self)
    }

    fn main_grad(&self) -> Option<&Tensor> {
        LinearParams::main_grad(self)
    }

    fn params_dtype(&self) -> DType {
        LinearParams::params_dtype(self)
    }

    fn tensor_parallel(&self) -> [bool; 2] {
        LinearParams::tensor_parallel(self)
    }

    fn set(&mut self, slot: Slot, value: Tensor) -> Result<()> {
        match slot {
            Slot::Weight => self.set_weight(value),
            Slot::Bias => self.set_bias(value),
        }
    }

    fn set_fp8_weight(&mut self, value: Float8Tensor) -> Result<()> {
        LinearParams::set_fp8_weight(self, value)
    }

    fn set_gathered_fp8(&mut self, value: Float8Tensor) -> Result<()> {
        LinearParams::set_gathered_fp8_weight(self, value)
    }

    fn clear_grads(&mut self) {
        self.zero_grad();
    }

    fn grads_mut(&mut self) -> [Option<&mut Tensor>; 2] {
        LinearParams::grads_mut(self)
    }

    fn take_grad(&mut self, slot: Slot) -> Option<Tensor> {
        match slot {
            Slot::Weight if LinearParams::main_grad(self).is_some() => None,
            Slot::Weight => self.take_weight_grad(),
            Slot::Bias => self.take_bias_grad(),
        }
    }
}

impl Group for NormParams {
    const KINDS: [ParamKind; 2] = [ParamKind::NormWeight, ParamKind::NormBias];
    const WEIGHT: &'static str = "a norm parameter";

    fn tensors(&self) -> [Option<&Tensor>; 2] {
        [Some(self.weight()), self.bias()]
    }

    fn grads(&self) -> [Option<&Tensor>; 2] {
        [self.weight_grad(), self.bias_grad()]
    }

    fn params_dtype(&self) -> DType {
        self.config().params_dtype
    }

    fn set(&mut self, slot: Slot, value: Tensor) -> Result<()> {
        match slot {
            Slot::Weight => self.set_weight(value),
            Slot::Bias => self.set_bias(value),
        }
    }

    fn clear_grads(&mut self) {
        self.zero_grad();
    }

    fn grads_mut(&mut self) -> [Option<&mut Tensor>; 2] {
        NormParams::grads_mut(self)
    }

    fn take_grad(&mut self, slot: Slot) -> Option<Tensor> {
        let [weight, bias] = self.take_grads_of([matches!(slot, Slot::Weight), matches!(slot, Slot::Bias)]);
        weight.or(bias)
    }
}

/// The error of an FP8 write to `what`, which is never FP8-only.
fn not_fp8(what: &str) -> te_runtime::Error {
    te_runtime::Error::Config { module: "ParamMut::set_fp8", message: format!("{what} is never an FP8-only weight") }
}

/// The FP8-only tensor of `slot`: only a weight can be one.
fn fp8_weight<G: Group + ?Sized>(group: &G, slot: Slot) -> Option<&Float8Tensor> {
    match slot {
        Slot::Weight => group.fp8_weight(),
        Slot::Bias => None,
    }
}

/// The weight of `slot` gathered as FP8 codes for a step: only a weight can be one.
fn gathered_fp8<G: Group + ?Sized>(group: &G, slot: Slot) -> Option<&Float8Tensor> {
    match slot {
        Slot::Weight => group.gathered_fp8(),
        Slot::Bias => None,
    }
}

/// One tensor of a group as a [`Param`]: `R` is `&G` (read) or `&mut G` (write).
struct View<R> {
    group: R,
    slot: Slot,
}

impl<R: Deref<Target: Group>> Param for View<R> {
    fn shape(&self) -> &[usize] {
        match (self.tensor(), self.fp8_tensor().or_else(|| gathered_fp8(&*self.group, self.slot))) {
            (Some(t), _) => t.shape(),
            (None, Some(f)) => f.shape(),
            (None, None) => &[],
        }
    }

    fn dtype(&self) -> DType {
        match (self.tensor(), self.fp8_tensor()) {
            (Some(t), _) => t.dtype(),
            (None, Some(f)) => f.dtype(),
            (None, None) => self.group.params_dtype(),
        }
    }

    fn tensor(&self) -> Option<&Tensor> {
        self.group.tensors()[self.slot as usize]
    }

    fn fp8_tensor(&self) -> Option<&Float8Tensor> {
        fp8_weight(&*self.group, self.slot)
    }

    fn grad(&self) -> Option<&Tensor> {
        self.group.grads()[self.slot as usize]
    }

    fn main_grad(&self) -> Option<&Tensor> {
        match self.slot {
            Slot::Weight => self.group.main_grad(),
            Slot::Bias => None,
        }
    }

    fn tensor_parallel(&self) -> bool {
        self.group.tensor_parallel()[self.slot as usize]
    }
}

impl<R: DerefMut<Target: Group>> ParamMut for View<R> {
    fn set(&mut self, value: Tensor) -> Result<()> {
        self.group.set(self.slot, value)
    }

    fn set_fp8(&mut self, value: Float8Tensor) -> Result<()> {
        match self.slot {
            Slot::Weight => self.group.set_fp8_weight(value),
            Slot::Bias => Err(not_fp8("a bias")),
        }
    }

    fn set_gathered_fp8(&mut self, value: Float8Tensor) -> Result<()> {
        match self.slot {
            Slot::Weight => self.group.set_gathered_fp8(value),
            Slot::Bias => Err(not_fp8("a bias")),
        }
    }

    fn zero_grad(&mut self) {
        self.group.clear_grads();
    }

    fn grad_mut(&mut self) -> Option<&mut Tensor> {
        let [weight, bias] = self.group.grads_mut();
        match self.slot {
            Slot::Weight => weight,
            Slot::Bias => bias,
        }
    }

    fn take_grad(&mut self) -> Option<Tensor> {
        self.group.take_grad(self.slot)
    }
}

/// The weight and bias slots of `group` with their names and kinds, less those without a tensor
/// (a layer made without bias).
fn slots<'n, G: Group>(group: &G, names: [&'n str; 2]) -> Vec<(Slot, &'n str, ParamKind)> {
    [Slot::Weight, Slot::Bias]
        .into_iter()
        .zip(names)
        .zip(G::KINDS)
        .map(|((slot, name), kind)| (slot, name, kind))
        .filter(|&(slot, ..)| {
            group.tensors()[slot as usize].is_some()
                || fp8_weight(group, slot).is_some()
                || gathered_fp8(group, slot).is_some()
        })
        .collect()
}

/// Hands each tensor of `group` to `visitor` as `prefix.names[i]`.
pub(super) fn visit_group<G: Group>(
    group: &G,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitor,
) -> Result<()> {
    for (slot, name, kind) in slots(group, names) {
        visitor.param(&join_path(prefix, name), kind, &View { group, slot })?;
    }
    Ok(())
}

/// As [`visit_group`], writable.
pub(super) fn visit_group_mut<G: Group>(
    group: &mut G,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitorMut,
) -> Result<()> {
    for (slot, name, kind) in slots(group, names) {
        visitor.param(&join_path(prefix, name), kind, &mut View { group: &mut *group, slot })?;
    }
    Ok(())
}
