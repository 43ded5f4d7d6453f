//! FP8 attention in the module (TE's `fp8_dpa`): which fused calls run in FP8, the quantizers of
//! q, k, v and of the backward's dO and dS, and the delayed-scaling states they keep.
//!
//! Slots, as TE's `fp8_meta` of `DotProductAttention`: q, k, v share the forward input slot
//! ([`GemmTensor::Input`], TE's `META_QKV`, visited as `fp8_fwd`); dO the backward slot of the
//! same state pair (`fp8_bwd`, delayed scaling only); dS its own backward state (TE's `META_DP`,
//! `fp8_dp`) under the recipe's [`crate::fp8::ScalingRecipe::attention_ds_recipe`]: the run's
//! own delayed scaling, or under current scaling (q, k, v and dO take their current amax) a
//! delayed scale of history 1 from the most recent amax, as TE's recipe table for
//! `Float8CurrentScaling` attention says (`dot_product_attention.py`: "creates a new FP8DS
//! recipe for S, dP").

use super::{Inputs, MODULE};
use crate::fp8::{fp8_mode, Fp8Mode, Fp8StateSlot, GemmScaling, GemmTensor, GradScaling, Quantizer, ScalingState};
use std::sync::Arc;
use te_codegen::DType;
use te_runtime::ops::attention_shape::AttentionShape;
use te_runtime::ops::flash_attention_fp8;
use te_runtime::{Device, Result};

/// The FP8 scaling of one `DotProductAttention`.
#[derive(Debug)]
pub(super) struct Fp8Scalings {
    /// Forward: q, k, v ([`GemmTensor::Input`]); backward: dO.
    qkv: GemmScaling,
    /// Backward: dS (TE's dP quantizer).
    dp: GemmScaling,
}

/// How a fused forward runs in FP8: the quantizer of q, k and v, and, when the FP8 backward
/// follows, what its casts need.
#[derive(Debug)]
pub(super) struct Fp8Forward {
    pub quantizer: Box<dyn Quantizer>,
    pub backward: Option<Fp8Backward>,
}

/// TE `fp8_mha`: the consumer of the attention output (the output projection of
/// `MultiheadAttention`) asks for it in E4M3, cast with `quantizer` (the projection's input
/// quantizer); `backward`: a backward follows the forward.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fp8OutputRequest<'a> {
    pub quantizer: &'a dyn Quantizer,
    pub backward: bool,
}

impl<'a> Fp8OutputRequest<'a> {
    /// The quantizer of the E4M3 output when the FP8 forward `f` can write it: the cast fuses
    /// into the kernel (a delayed scale; a current scale needs the amax before any code is
    /// written) and the backward, if one follows, is the FP8 one (the 16-bit backward reads a
    /// 16-bit output). Else `None`: the output stays 16-bit and the consumer casts it.
    pub(super) fn takes(self, f: &Fp8Forward) -> Option<&'a dyn Quantizer> {
        let fuses = self.quantizer.fuses_cast() && self.quantizer.dtype() == DType::E4M3;
        (fuses && (!self.backward || f.backward.is_some())).then_some(self.quantizer)
    }
}

/// What an FP8 forward keeps for the FP8 backward's casts (dO and dS): the recipes it ran under
/// and its tickets of the scope's backward group (the last backward updates the scales).
#[derive(Debug)]
pub(crate) struct Fp8Backward {
    d_o: GradScaling,
    ds: GradScaling,
}

impl Fp8Backward {
    /// Marks the backward done.
    ///
    /// # Errors
    /// Errors of the scale update.
    pub(super) fn finish(self) -> Result<()> {
        self.d_o.finish()?;
        self.ds.finish()
    }
}

/// TE's `NVTE_FP8_DPA_BWD=0`: the FP8 forward is followed by the 16-bit backward.
fn env_keeps_16_bit_backward() -> bool {
    std::env::var("NVTE_FP8_DPA_BWD").is_ok_and(|v| v.trim() == "0")
}

impl Fp8Scalings {
    pub(super) fn new(dev: &Arc<Device>) -> Self {
        Self { qkv: GemmScaling::new(dev), dp: GemmScaling::new(dev) }
    }

    /// The FP8 plan of a fused forward of `inputs`: under an `fp8_autocast` recipe with `fp8_dpa`,
    /// where the FP8 kernels take the call (else `None`: 16 bits, with a debug log saying why).
    /// In `training` the FP8 backward follows where it takes the call (head_dim 128 or 256, no
    /// attention dropout) and `NVTE_FP8_DPA_BWD` is not `0`; else the 16-bit backward. Under
    /// calibration the inputs' amax is recorded into the QKV slot instead, and the forward stays
    /// 16-bit.
    pub(super) fn forward(
        &mut self,
        dev: &Device,
        inputs: &Inputs,
        dims: &AttentionShape,
        training: bool,
        dropout: bool,
    ) -> Result<Option<Fp8Forward>> {
        let (recipe, calibrating) = match fp8_mode() {
            Fp8Mode::Fp8(r) => (r, false),
            Fp8Mode::Calibrating(r) => (r, true),
            Fp8Mode::HighPrecision => return Ok(None),
        };
        if !recipe.fp8_dpa() {
            return Ok(None);
        }
        let (dtype, thd) = (inputs.dtype(), matches!(inputs, Inputs::Thd(_)));
        if dims.head_dim_v != dims.head_dim {
            tracing::debug!("{MODULE}: fp8_dpa is set, the forward stays 16-bit: FP8 attention takes one head dim");
            return Ok(None);
        }
        if let Some(why) = flash_attention_fp8::unsupported_reason(dev.arch(), dtype, dims.head_dim, thd) {
            tracing::debug!("{MODULE}: fp8_dpa is set, the forward stays 16-bit: {why}");
            return Ok(None);
        }
        let quantizer = self.qkv.forward_tensor(&recipe, GemmTensor::Input)?;
        if calibrating {
            for t in inputs.tensors() {
                quantizer.calibrate(t)?;
            }
            return Ok(None);
        }
        let backward = if !training {
            None
        } else if env_keeps_16_bit_backward() {
            tracing::debug!("{MODULE}: NVTE_FP8_DPA_BWD=0, the backward stays 16-bit");
            None
        } else if let Some(why) =
            flash_attention_fp8::backward_unsupported_reason(dev.arch(), dtype, dims.head_dim, thd, dropout)
        {
            tracing::debug!("{MODULE}: the backward stays 16-bit: {why}");
            None
        } else {
            Some(Fp8Backward { d_o: self.qkv.grad(&recipe)?, ds: self.dp.grad(&recipe.attention_ds_recipe().into())? })
        };
        Ok(Some(Fp8Forward { quantizer, backward }))
    }

    /// The quantizers of the FP8 backward of a forward that kept `b`: dO's (E5M2 under HYBRID)
    /// and dS's (always a delayed-scaling slot, whose cast the kernel fuses).
    pub(super) fn backward(&mut self, b: &Fp8Backward) -> Result<(Box<dyn Quantizer>, Box<dyn Quantizer>)> {
        Ok((self.qkv.grad_output(&b.d_o)?, self.dp.grad_output(&b.ds)?))
    }

    /// The states made so far, by visiting name: `fp8_fwd` (q, k, v), `fp8_bwd` (dO), `fp8_dp` (dS).
    pub(super) fn states(&self) -> [(&'static str, Option<&Arc<ScalingState>>); 3] {
        [("fp8_fwd", self.qkv.fwd_state()), ("fp8_bwd", self.qkv.bwd_state_opt()), ("fp8_dp", self.dp.bwd_state_opt())]
    }

    /// The state slots, for a writable traversal (checkpoint loads), named as
    /// [`Fp8Scalings::states`].
    pub(super) fn state_slots(&mut self) -> [(&'static str, Fp8StateSlot<'_>); 3] {
        let [fwd, bwd] = self.qkv.state_slots();
        let [_, dp] = self.dp.state_slots();
        [("fp8_fwd", fwd), ("fp8_bwd", bwd), ("fp8_dp", dp)]
    }
}
