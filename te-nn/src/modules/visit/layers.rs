//! [`Module`] for TE's GEMM and norm layers (`Linear`, `Norm`, `LayerNormLinear`, `LayerNormMLP`,
//! `GroupedLinear`)
//! under TE's state-dict names, and the building blocks of a hand-written impl
//! ([`visit_linear_params`], [`visit_norm_params`]).

use super::group::{visit_group, visit_group_mut};
use super::{join_path, Module, ModuleVisitor, ModuleVisitorMut};
use crate::fp8::ScalingState;
use crate::modules::{
    Fp8StateSlot, GroupedLinear, KernelSpec, KernelTarget, LayerNormLinear, LayerNormMLP, Linear, LinearParams, MoeMLP,
    Norm, NormParams,
};
use std::sync::Arc;
use te_runtime::Result;

/// TE's names of a GEMM's or a `LayerNorm`'s own tensors.
const WEIGHT_BIAS: [&str; 2] = ["weight", "bias"];
/// TE's names of the norm fused in front of a GEMM.
const LAYER_NORM: [&str; 2] = ["layer_norm_weight", "layer_norm_bias"];

impl Module for Linear {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_linear_params(self.params(), prefix, WEIGHT_BIAS, visitor)?;
        let states = [("fp8_fwd", self.fp8_forward_state()), ("fp8_bwd", self.fp8_backward_state())];
        visit_states(prefix, &states, |path, s| visitor.fp8_state(path, s))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_linear_params_mut(self.params_mut(), prefix, WEIGHT_BIAS, visitor)?;
        let [fwd, bwd] = self.fp8_state_slots();
        visit_slots(prefix, [("fp8_fwd", fwd), ("fp8_bwd", bwd)], visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.config().kernel_specs(target, specs);
    }
}

impl Module for Norm {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_norm_params(self.params(), prefix, WEIGHT_BIAS, visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_norm_params_mut(self.params_mut(), prefix, WEIGHT_BIAS, visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.params().config().kernel_specs(self.params().kind(), target, specs);
    }
}

impl Module for LayerNormLinear {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_norm_params(self.norm_params(), prefix, LAYER_NORM, visitor)?;
        visit_linear_params(self.params(), prefix, WEIGHT_BIAS, visitor)?;
        let states = [("fp8_fwd", self.fp8_forward_state()), ("fp8_bwd", self.fp8_backward_state())];
        visit_states(prefix, &states, |path, s| visitor.fp8_state(path, s))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_norm_params_mut(self.norm_params_mut(), prefix, LAYER_NORM, visitor)?;
        visit_linear_params_mut(self.params_mut(), prefix, WEIGHT_BIAS, visitor)?;
        let [fwd, bwd] = self.fp8_state_slots();
        visit_slots(prefix, [("fp8_fwd", fwd), ("fp8_bwd", bwd)], visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.config().kernel_specs(target, specs);
    }
}

impl Module for LayerNormMLP {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_norm_params(self.norm_params(), prefix, LAYER_NORM, visitor)?;
        visit_linear_params(self.fc1(), prefix, ["fc1_weight", "fc1_bias"], visitor)?;
        visit_linear_params(self.fc2(), prefix, ["fc2_weight", "fc2_bias"], visitor)?;
        visit_states(prefix, &self.fp8_states(), |path, s| visitor.fp8_state(path, s))
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_norm_params_mut(self.norm_params_mut(), prefix, LAYER_NORM, visitor)?;
        visit_linear_params_mut(self.fc1_mut(), prefix, ["fc1_weight", "fc1_bias"], visitor)?;
        visit_linear_params_mut(self.fc2_mut(), prefix, ["fc2_weight", "fc2_bias"], visitor)?;
        visit_slots(prefix, self.fp8_state_slots(), visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.config().kernel_specs(target, specs);
    }
}

/// `layer_norm_weight`, `layer_norm_bias` (the norm, as in `LayerNormMLP`), `router.weight`,
/// and the experts as two `GroupedLinear`s: `experts.fc1.weight{i}`, `experts.fc1.bias{i}`,
/// `experts.fc2.weight{i}`, ... with their FP8 states `experts.fc1.fp8_fwd{i}`, ... (Megatron's
/// `mlp.router.weight`, `mlp.experts.linear_fc1.weight{i}` in TE's `GroupedLinear` naming).
impl Module for MoeMLP {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        visit_norm_params(self.norm_params(), prefix, LAYER_NORM, visitor)?;
        self.router().visit(&join_path(prefix, "router"), visitor)?;
        self.fc1().visit(&join_path(prefix, "experts.fc1"), visitor)?;
        self.fc2().visit(&join_path(prefix, "experts.fc2"), visitor)
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        visit_norm_params_mut(self.norm_params_mut(), prefix, LAYER_NORM, visitor)?;
        self.router_mut().visit_mut(&join_path(prefix, "router"), visitor)?;
        self.fc1_mut().visit_mut(&join_path(prefix, "experts.fc1"), visitor)?;
        self.fc2_mut().visit_mut(&join_path(prefix, "experts.fc2"), visitor)
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.config().kernel_specs(target, specs);
    }
}

/// TE's names: `weight{i}`, `bias{i}` for GEMM `i`; the scaling states `fp8_fwd{i}`,
/// `fp8_bwd{i}`.
impl Module for GroupedLinear {
    fn visit(&self, prefix: &str, visitor: &mut dyn ModuleVisitor) -> Result<()> {
        for (i, [fwd, bwd]) in self.fp8_states().into_iter().enumerate() {
            let (weight, bias) = (format!("weight{i}"), format!("bias{i}"));
            if let Some(p) = self.params(i) {
                visit_linear_params(p, prefix, [&weight, &bias], visitor)?;
            }
            let (f, b) = (format!("fp8_fwd{i}"), format!("fp8_bwd{i}"));
            visit_states(prefix, &[(&f, fwd), (&b, bwd)], |path, s| visitor.fp8_state(path, s))?;
        }
        Ok(())
    }

    fn visit_mut(&mut self, prefix: &str, visitor: &mut dyn ModuleVisitorMut) -> Result<()> {
        for i in 0..self.config().num_gemms {
            let (weight, bias) = (format!("weight{i}"), format!("bias{i}"));
            if let Some(p) = self.params_mut(i) {
                visit_linear_params_mut(p, prefix, [&weight, &bias], visitor)?;
            }
            let (f, b) = (format!("fp8_fwd{i}"), format!("fp8_bwd{i}"));
            if let Some([fwd, bwd]) = self.fp8_state_slots(i) {
                visit_slots(prefix, [(f.as_str(), fwd), (b.as_str(), bwd)], visitor)?;
            }
        }
        Ok(())
    }

    fn kernel_specs(&self, target: &KernelTarget, specs: &mut Vec<KernelSpec>) {
        self.config().kernel_specs(target, specs);
    }
}

/// Hands a GEMM's weight and (when it has one) bias to `visitor` as `prefix.names[0]` and
/// `prefix.names[1]` (TE's state-dict names: `["weight", "bias"]`, `["fc1_weight", "fc1_bias"]`):
/// the building block of a hand-written [`Module`] impl.
///
/// # Errors
/// The visitor's first error.
pub fn visit_linear_params(
    params: &LinearParams,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitor,
) -> Result<()> {
    visit_group(params, prefix, names, visitor)
}

/// As [`visit_linear_params`], writable.
///
/// # Errors
/// The visitor's first error.
pub fn visit_linear_params_mut(
    params: &mut LinearParams,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitorMut,
) -> Result<()> {
    visit_group_mut(params, prefix, names, visitor)
}

/// Hands a norm's gamma and (LayerNorm) beta to `visitor` as `prefix.names[0]` and
/// `prefix.names[1]` (TE: `["weight", "bias"]` for a `LayerNorm`, `["layer_norm_weight",
/// "layer_norm_bias"]` for the norm fused into a GEMM layer).
///
/// # Errors
/// The visitor's first error.
pub fn visit_norm_params(
    params: &NormParams,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitor,
) -> Result<()> {
    visit_group(params, prefix, names, visitor)
}

/// As [`visit_norm_params`], writable.
///
/// # Errors
/// The visitor's first error.
pub fn visit_norm_params_mut(
    params: &mut NormParams,
    prefix: &str,
    names: [&str; 2],
    visitor: &mut dyn ModuleVisitorMut,
) -> Result<()> {
    visit_group_mut(params, prefix, names, visitor)
}

/// Calls `f` with `prefix.name` and the state of each `(name, state)` whose state exists.
pub(crate) fn visit_states(
    prefix: &str,
    states: &[(&str, Option<&Arc<ScalingState>>)],
    mut f: impl FnMut(&str, &Arc<ScalingState>) -> Result<()>,
) -> Result<()> {
    for (name, state) in states {
        if let Some(s) = state {
            f(&join_path(prefix, name), s)?;
        }
    }
    Ok(())
}

/// Hands each `(name, slot)` to `visitor` as `prefix.name`.
pub(crate) fn visit_slots<const N: usize>(
    prefix: &str,
    slots: [(&str, Fp8StateSlot<'_>); N],
    visitor: &mut dyn ModuleVisitorMut,
) -> Result<()> {
    for (name, mut slot) in slots {
        visitor.fp8_state_slot(&join_path(prefix, name), &mut slot)?;
    }
    Ok(())
}
