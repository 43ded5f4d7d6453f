//! [`GptAdamW`]: AdamW over a [`GptRef`]'s f32 parameters (its master weights) with the GPU
//! optimizer's arithmetic: the global gradient norm, PyTorch's clip coefficient and the
//! per-element step of [`te_reference::optimizer`], with the scalars of
//! [`te_runtime::ops::optimizer::scalars::AdamWScalars`].

use super::GptRef;
use te_codegen::DType;
use te_nn::modules::ParamKind;
use te_reference::optimizer::{adamw_step, clip_coef, global_norm};
use te_runtime::ops::optimizer::scalars::{AdamWHyper, AdamWScalars};
use te_runtime::{Error, Result};

/// AdamW settings of [`GptAdamW`] (the learning rate comes with each step).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptAdamWConfig {
    /// `(beta1, beta2)`.
    pub betas: (f32, f32),
    /// Added to the bias-corrected `sqrt(v)`.
    pub eps: f32,
    /// Decoupled weight decay of GEMM weights ([`ParamKind::Weight`]); biases, norms and
    /// embeddings are not decayed (the GPU `AdamW` with `decay_biases_and_norms: false`).
    pub weight_decay: f32,
    /// Global-norm clipping threshold (`None`: no clipping).
    pub max_grad_norm: Option<f32>,
    /// Skip a step whose gradient norm is NaN or infinite (nothing updated, the step not
    /// counted), as the GPU optimizer's `AdamWConfig::skip_nonfinite`.
    pub skip_nonfinite: bool,
}

/// AdamW over a [`GptRef`]'s parameters with the GPU optimizer's per-element arithmetic
/// ([`te_reference::optimizer::adamw_step`]); the f32 parameters are the master weights.
#[derive(Debug, Clone)]
pub struct GptAdamW {
    cfg: GptAdamWConfig,
    pub(super) exp_avg: Vec<Vec<f32>>,
    pub(super) exp_avg_sq: Vec<Vec<f32>>,
    pub(super) step: u64,
}

/// What one [`GptAdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptStepStats {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The clip coefficient applied (1 without clipping).
    pub clip_coef: f32,
    /// The step was skipped (`skip_nonfinite` and a non-finite `grad_norm`).
    pub skipped: bool,
}

impl GptAdamW {
    /// Zero moments for every parameter of `model`.
    pub fn new(model: &GptRef, cfg: GptAdamWConfig) -> Self {
        let zeros: Vec<Vec<f32>> = model.params.iter().map(|p| vec![0.0; p.value.len()]).collect();
        Self { cfg, exp_avg: zeros.clone(), exp_avg_sq: zeros, step: 0 }
    }

    /// Steps taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// One step with learning rate `lr`: clip by the global norm of `grads` (as
    /// [`GptRef::backward`] returns them), then update every parameter.
    ///
    /// # Errors
    /// [`Error::Config`] when `grads` do not match the model's parameters (names, order,
    /// lengths) or the moments were made for another model; nothing changes then.
    pub fn step(&mut self, model: &mut GptRef, grads: &[(String, Vec<f32>)], lr: f32) -> Result<GptStepStats> {
        let matches = grads.len() == model.params.len()
            && self.exp_avg.len() == model.params.len()
            && model
                .params
                .iter()
                .zip(grads)
                .zip(&self.exp_avg)
                .all(|((p, (name, g)), m)| *name == p.name && g.len() == p.value.len() && m.len() == p.value.len());
        if !matches {
            return Err(Error::Config {
                module: "GptAdamW",
                message: "the gradients or moments do not match the model's parameters".into(),
            });
        }
        let slices: Vec<&[f32]> = grads.iter().map(|(_, g)| g.as_slice()).collect();
        let grad_norm = global_norm(&slices);
        let clip = self.cfg.max_grad_norm.map_or(1.0, |m| clip_coef(grad_norm, m));
        if self.cfg.skip_nonfinite && !grad_norm.is_finite() {
            return Ok(GptStepStats { grad_norm, clip_coef: clip, skipped: true });
        }
        self.step += 1;
        let (beta1, beta2) = self.cfg.betas;
        for (((p, (_, g)), m), v) in model.params.iter_mut().zip(grads).zip(&mut self.exp_avg).zip(&mut self.exp_avg_sq)
        {
            let weight_decay = if p.kind == ParamKind::Weight { self.cfg.weight_decay } else { 0.0 };
            let hyper = AdamWHyper { lr, beta1, beta2, eps: self.cfg.eps, weight_decay, step: self.step };
            adamw_step(&AdamWScalars::new(&hyper), clip, g, &mut p.value, m, v, DType::F32);
        }
        Ok(GptStepStats { grad_norm, clip_coef: clip, skipped: false })
    }
}
