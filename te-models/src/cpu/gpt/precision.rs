//! GEMM-input emulation of [`GptRef`]: each GEMM reads its operands exact, rounded to BF16, or
//! fake-quantized to FP8 as the GPU's quantizers of the run's recipe cast them. The recipe
//! decides every cast and the state it keeps (`te_nn::fp8::ScalingRecipe`'s
//! `host_forward_casts`, `host_grad_casts` and `host_state`: delayed scaling's amax
//! histories per GEMM, with the update of [`te_reference::scaling::delayed_update`]; current
//! scaling's per-operand amax; blockwise scaling's tiles); the casts equal
//! [`te_runtime::numerics::round_to`] bit for bit; the GEMMs themselves stay f32. This file maps
//! [`GemmPrecision`] to its recipe and orders the casts, amax records and scale updates of a
//! pass.

use super::GptRef;
use te_nn::fp8::{host_amax, HostCast, Recipe};
use te_runtime::Result;

/// How the GEMM inputs are rounded before each f32 GEMM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemmPrecision {
    /// Exact f32 inputs (the check against a GPU model built with `params_dtype: F32`).
    F32,
    /// Inputs rounded to BF16 (round to nearest even), as a BF16 model's GEMMs read them.
    Bf16,
    /// Inputs fake-quantized to FP8 as the recipe's quantizers cast them on the GPU (the
    /// recipe's own CPU emulation, `te_nn::fp8::ScalingRecipe::host_forward_casts` /
    /// `host_grad_casts` / `host_state`): delayed scaling's amax histories per GEMM (`max` or
    /// newest, margin; initial scale 1; forward scales updated after each
    /// [`GptRef::forward_loss`], gradient scales after each [`GptRef::backward`]); current
    /// scaling's per-operand amax (`fp8_max / max(amax, amax_epsilon)`); blockwise scaling's
    /// 1×128 tiles and 128×128 blocks (the wgrad GEMM reading the input re-quantized along the
    /// tokens, as TE does). E4M3 inputs and weights, E5M2 output gradients under HYBRID.
    Fp8(Recipe),
}

impl GemmPrecision {
    /// The precision that emulates `recipe` ([`GemmPrecision::Fp8`], what a trainer running FP8
    /// on the CPU asks for), once the recipe validates.
    ///
    /// # Errors
    /// [`te_runtime::Error::Recipe`] for a recipe [`Recipe::validate`] refuses.
    pub fn from_recipe(recipe: &Recipe) -> Result<GemmPrecision> {
        recipe.validate()?;
        Ok(GemmPrecision::Fp8(*recipe))
    }

    /// The FP8 recipe emulated (`None`: F32 or BF16).
    pub fn recipe(&self) -> Option<Recipe> {
        match *self {
            GemmPrecision::F32 | GemmPrecision::Bf16 => None,
            GemmPrecision::Fp8(r) => Some(r),
        }
    }

    /// The cast of a GEMM that does not run in FP8: exact under F32, else BF16 (as on the
    /// GPU, where an FP8 model's high-precision GEMMs read BF16).
    fn high_cast(&self) -> HostCast {
        match self {
            GemmPrecision::F32 => HostCast::Exact,
            _ => HostCast::Bf16,
        }
    }
}

/// A GEMM's operands as it reads them: the input and weight of the forward (and dgrad), and
/// the input as the wgrad GEMM reads it when that differs (blockwise FP8: tiles along the
/// tokens).
#[derive(Debug, Clone)]
pub(super) struct Operands {
    pub(super) x: Vec<f32>,
    pub(super) w: Vec<f32>,
    pub(super) x_wgrad: Option<Vec<f32>>,
}

impl Operands {
    /// The input as the wgrad GEMM reads it.
    pub(super) fn wgrad_input(&self) -> &[f32] {
        self.x_wgrad.as_deref().unwrap_or(&self.x)
    }
}

impl GptRef {
    /// The GEMM input precision.
    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Sets the GEMM input precision; under FP8 with a recipe that keeps state (delayed
    /// scaling), starts fresh state (scales 1, empty histories), as a new GPU model has.
    ///
    /// # Errors
    /// [`te_runtime::Error::Recipe`] for an invalid FP8 recipe (history length 0, a margin that
    /// is not finite, a block dimension other than 1 or 2, ...).
    pub fn set_precision(&mut self, precision: GemmPrecision) -> Result<()> {
        let recipe = precision.recipe();
        if let Some(r) = &recipe {
            r.validate()?;
        }
        self.fp8 = match recipe.and_then(|r| r.scaling().host_state()) {
            // The LM head has FP8 state only when it runs in FP8 (`fp8_lm_head`).
            Some(state) => vec![state; self.fp8_gemms()],
            None => Vec::new(),
        };
        self.precision = precision;
        Ok(())
    }

    /// How many GEMMs run in FP8 under an FP8 precision: every layer GEMM, and the LM head
    /// (the last) only with `fp8_lm_head` (else in BF16, as on the GPU).
    fn fp8_gemms(&self) -> usize {
        4 * self.cfg.num_layers + usize::from(self.cfg.fp8_lm_head)
    }

    /// Whether GEMM `g` runs in FP8.
    pub(super) fn fp8_gemm(&self, g: usize) -> bool {
        self.precision.recipe().is_some() && g < self.fp8_gemms()
    }

    /// The casts of GEMM `g`'s forward operands, input `[t, n_in]` and weight `[n_out, n_in]`,
    /// and of the input as the wgrad GEMM reads it (`None`: as the forward).
    fn forward_casts(&self, g: usize, dims: [usize; 3]) -> ([HostCast; 2], Option<HostCast>) {
        match self.precision.recipe() {
            Some(r) if self.fp8_gemm(g) => r.scaling().host_forward_casts(self.fp8.get(g), dims),
            _ => ([self.precision.high_cast(); 2], None),
        }
    }

    /// GEMM `g`'s operands (input `x` `[t, n_in]`, weight `w` `[n_out, n_in]`) as it reads
    /// them, their amaxes added to `amaxes` where the GEMM keeps scaling state.
    pub(super) fn gemm_operands(
        &self,
        g: usize,
        x: &[f32],
        w: &[f32],
        n_in: usize,
        amaxes: &mut Vec<[f32; 2]>,
    ) -> Operands {
        // FP8 GEMMs with state record their operands' amaxes; so does a calibration's
        // high-precision pass (`calibrate`: BF16 casts, the FP8 states kept).
        if g < self.fp8.len() {
            amaxes.push([host_amax(x), host_amax(w)]);
        }
        let dims = [x.len() / n_in.max(1), w.len() / n_in.max(1), n_in];
        let ([cx, cw], c_wgrad) = self.forward_casts(g, dims);
        Operands { x: cx.apply(x), w: cw.apply(w), x_wgrad: c_wgrad.map(|c| c.apply(x)) }
    }

    /// How GEMM `g`'s backward reads the output gradient `dy` `[t, n_out]`: for the dgrad GEMM
    /// and, when it differs, for the wgrad GEMM; its amax added to `amaxes` where the GEMM
    /// keeps scaling state.
    pub(super) fn grad_casts(
        &self,
        g: usize,
        dy: &[f32],
        n_out: usize,
        amaxes: &mut Vec<f32>,
    ) -> (HostCast, Option<HostCast>) {
        match self.precision.recipe() {
            Some(r) if self.fp8_gemm(g) => {
                let state = self.fp8.get(g);
                if state.is_some() {
                    amaxes.push(host_amax(dy));
                }
                r.scaling().host_grad_casts(state, [dy.len() / n_out.max(1), n_out])
            }
            _ => (self.precision.high_cast(), None),
        }
    }

    /// TE's FP8 calibration (`fp8_autocast(calibrating=True)`) under a recipe that keeps amax
    /// histories (delayed scaling): `ids` `[s, b]` run through the evaluation forward with BF16
    /// GEMM inputs, every FP8 GEMM's input and weight amaxes recorded, then the forward scales
    /// updated from them. What an FP8 inference of a model trained without FP8 (no scales of its
    /// own) starts from. Otherwise (no FP8, or current or blockwise scaling, which need no
    /// calibration) it does nothing.
    ///
    /// # Errors
    /// As [`GptRef::logits`].
    pub fn calibrate(&mut self, ids: &[i32], s: usize, b: usize) -> Result<()> {
        if self.fp8.is_empty() {
            return Ok(());
        }
        self.check_batch(ids, &vec![crate::gpt::IGNORE_INDEX; ids.len()], s, b)?;
        let precision = std::mem::replace(&mut self.precision, GemmPrecision::Bf16);
        let amaxes = self.logits_of(ids, s, b, None, None).amaxes;
        self.precision = precision;
        self.update_forward_scaling(&amaxes);
        Ok(())
    }

    /// Folds a forward's `[input, weight]` amaxes of every FP8 GEMM with state into the
    /// histories and updates the forward scales.
    pub(super) fn update_forward_scaling(&mut self, amaxes: &[[f32; 2]]) {
        for (state, a) in self.fp8.iter_mut().zip(amaxes) {
            state.update_forward(*a);
        }
    }

    /// Folds a backward's output-gradient amaxes into the histories and updates the backward
    /// scales.
    pub(super) fn update_backward_scaling(&mut self, amaxes: &[f32]) {
        // `amaxes` runs from the last FP8 GEMM down to layer 0's qkv.
        for (state, a) in self.fp8.iter_mut().rev().zip(amaxes) {
            state.update_backward(*a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::GptConfig;
    use te_codegen::DType;
    use te_nn::fp8::{DelayedScaling, Float8CurrentScaling, Format};
    use te_runtime::numerics::round_to;

    /// Calibration sets every FP8 GEMM's forward scales from a high-precision pass (the weight
    /// scale is `448 / amax(w)`), and brings the FP8 logits of a fresh model (scale 1: weights
    /// of std 0.023 near E4M3's subnormals) closer to the BF16 ones.
    #[test]
    fn calibration_sets_the_scales_from_a_high_precision_pass() {
        let cfg = GptConfig {
            num_layers: 2,
            hidden_size: 32,
            num_attention_heads: 2,
            ffn_hidden_size: 64,
            seq_length: 16,
            ..GptConfig::tiny()
        };
        let ids: Vec<i32> = (0..32).map(|i| (i * 29) % 256).collect();
        let mut bf16 = GptRef::new(&cfg).unwrap();
        bf16.set_precision(GemmPrecision::Bf16).unwrap();
        let want = bf16.logits(&ids, 16, 2).unwrap();
        let mut fp8 = bf16.clone();
        fp8.set_precision(GemmPrecision::Fp8(DelayedScaling::default().into())).unwrap();
        let err = |m: &GptRef| {
            let got = m.logits(&ids, 16, 2).unwrap();
            let num: f32 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
            (num / want.iter().map(|b| b * b).sum::<f32>()).sqrt()
        };
        let before = err(&fp8);
        fp8.calibrate(&ids, 16, 2).unwrap();
        let after = err(&fp8);
        assert!(after < 0.06 && after < before, "relative RMS error {before} before, {after} after");
        let w = bf16.lp(0, 2);
        let amax_w = w.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert_eq!(fp8.fp8[0].forward_scales()[1], 448.0 / amax_w);
        assert!(fp8.fp8.iter().all(|g| g.forward_scales().iter().all(|&s| s > 1.0)));
        // Without FP8 it does nothing.
        let before = bf16.clone();
        bf16.calibrate(&ids, 16, 2).unwrap();
        assert_eq!(bf16.logits(&ids, 16, 2).unwrap(), before.logits(&ids, 16, 2).unwrap());
    }

    /// Each recipe maps to its precision and back; a recipe validation refuses is refused.
    #[test]
    fn precisions_follow_their_recipe() {
        for recipe in Recipe::all() {
            let p = GemmPrecision::from_recipe(&recipe).unwrap();
            assert_eq!(p.recipe(), Some(recipe));
        }
        let current = Float8CurrentScaling { power_2_scale: true, ..Default::default() };
        assert_eq!(GemmPrecision::from_recipe(&current.into()).unwrap(), GemmPrecision::Fp8(current.into()));
        assert_eq!(GemmPrecision::Bf16.recipe(), None);
        let bad = Recipe::from(Float8CurrentScaling { amax_epsilon: f32::NAN, ..Default::default() });
        let e = GemmPrecision::from_recipe(&bad).unwrap_err();
        assert!(matches!(e, te_runtime::Error::Recipe { .. }) && e.to_string().contains("amax_epsilon"), "{e}");
        let mut m = GptRef::new(&GptConfig { num_layers: 1, ..GptConfig::tiny() }).unwrap();
        assert!(m
            .set_precision(GemmPrecision::Fp8(Float8CurrentScaling { amax_epsilon: -1.0, ..current }.into()))
            .is_err());
    }

    /// `x` fake-quantized by hand as TE's current scaling casts it: `scale = fp8_max / amax`,
    /// `fp8(x · scale) · (1 / scale)`.
    fn by_hand(x: &[f32], dtype: DType) -> Vec<f32> {
        let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = dtype.fp8_max().unwrap() / amax;
        x.iter().map(|&v| round_to(dtype, v * scale) * (1.0 / scale)).collect()
    }

    /// Under current scaling a forward/backward casts each operand of a GEMM with its own amax
    /// (E4M3 forward, E5M2 gradients under HYBRID), as computed by hand, keeps no state and
    /// records no amax; the backward's gradients are finite and differ from BF16's.
    #[test]
    fn current_scaling_casts_each_operand_with_its_own_amax() {
        let cfg =
            GptConfig { num_layers: 1, hidden_size: 64, ffn_hidden_size: 128, seq_length: 16, ..GptConfig::tiny() };
        let (s, b) = (16, 2);
        let ids: Vec<i32> = (0..s * b).map(|i| ((i * 37 + 11) % 256) as i32).collect();
        let targets: Vec<i32> = (0..s * b).map(|i| ((i * 37 + 48) % 256) as i32).collect();
        let mut m = GptRef::new(&cfg).unwrap();
        let mut bf16 = m.clone();
        bf16.set_precision(GemmPrecision::Bf16).unwrap();
        m.set_precision(GemmPrecision::from_recipe(&"current".parse().unwrap()).unwrap()).unwrap();
        assert!(m.fp8.is_empty(), "current scaling keeps no state");
        let (loss, ctx) = m.forward_loss(&ids, &targets, s, b).unwrap();
        assert!(loss.is_finite());
        // fc1 of layer 0 (GEMM 2): its input is ln2(h1), its weight the parameter.
        let layer = &ctx.layers[0];
        let ln2 = m.norm(m.lp(0, 6), m.lp(0, 7)).forward(&layer.h1);
        let fc1 = &layer.gemms[2];
        assert_eq!(fc1.x, by_hand(&ln2, DType::E4M3), "fc1 input");
        assert_eq!(fc1.w, by_hand(m.lp(0, 8), DType::E4M3), "fc1 weight");
        assert!(fc1.x_wgrad.is_none(), "wgrad reads the same codes");
        // The output gradient of fc1 (any [t, ffn] values): E5M2 with its own amax, one cast.
        let dy: Vec<f32> = (0..s * b * cfg.ffn_hidden_size).map(|i| ((i * 7919) % 1000) as f32 * 1e-5 - 5e-3).collect();
        let mut amaxes = Vec::new();
        let (c, c_wgrad) = m.grad_casts(2, &dy, cfg.ffn_hidden_size, &mut amaxes);
        assert!(c_wgrad.is_none() && amaxes.is_empty());
        assert_eq!(c.apply(&dy), by_hand(&dy, DType::E5M2), "fc1 output gradient");
        // E4M3 gradients under the E4M3 format.
        let e4m3 = Float8CurrentScaling { fp8_format: Format::E4M3, ..Default::default() };
        let mut m4 = m.clone();
        m4.set_precision(GemmPrecision::Fp8(e4m3.into())).unwrap();
        assert_eq!(m4.grad_casts(2, &dy, cfg.ffn_hidden_size, &mut amaxes).0.apply(&dy), by_hand(&dy, DType::E4M3));
        // The LM head stays BF16 without fp8_lm_head.
        assert!(!m.fp8_gemm(4) && m.fp8_gemm(3));
        let grads = m.backward(ctx).unwrap();
        let (_, ctx16) = bf16.forward_loss(&ids, &targets, s, b).unwrap();
        let grads16 = bf16.backward(ctx16).unwrap();
        for ((name, g), (_, g16)) in grads.iter().zip(&grads16) {
            assert!(g.iter().all(|v| v.is_finite()), "{name}");
            let err = te_reference::linear::rel_frobenius(g, g16);
            assert!(err < 0.2, "{name}: relative error {err} against BF16");
        }
        assert!(grads.iter().zip(&grads16).any(|((_, g), (_, g16))| g != g16), "FP8 casts change the gradients");
        // Calibration has nothing to do.
        let before = m.logits(&ids[..s], s, 1).unwrap();
        m.calibrate(&ids[..s], s, 1).unwrap();
        assert_eq!(m.logits(&ids[..s], s, 1).unwrap(), before);
    }
}
