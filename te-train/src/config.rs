//! The settings of a training run: the model, the steps and batches, AdamW and its learning-rate
//! schedule, evaluation, the data order, the FP8 recipe and the non-finite policy
//! ([`TrainConfig`]), and the numeric format of one run ([`Precision`]).

use crate::data::Batcher;
use crate::error::TrainError;
use crate::optim::{AdamWConfig, LrSchedule};
use te_models::gpt::GptConfig;
use te_nn::fp8::Recipe;

/// The numeric format of a run (`fp8` or `bf16` in config files).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// GEMMs in FP8 under `fp8_autocast` with [`TrainConfig::recipe`].
    Fp8,
    /// Everything in BF16.
    Bf16,
}

impl Precision {
    /// `fp8` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp8 => "fp8",
            Precision::Bf16 => "bf16",
        }
    }

    /// The precision [`Precision::name`] names.
    ///
    /// # Errors
    /// A message naming the names it knows, for another name.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "fp8" => Ok(Precision::Fp8),
            "bf16" => Ok(Precision::Bf16),
            p => Err(format!("precision `{p}`: expected fp8 or bf16")),
        }
    }
}

/// Settings of one training run (the same for its FP8 and BF16 runs).
///
/// The optimizer is AdamW with FP32 master weights, betas (0.9, 0.95), decoupled weight decay
/// `weight_decay` on GEMM weights only, global-norm clipping at `max_grad_norm`, and a learning
/// rate warming up linearly to `lr` over `warmup_steps`, then decaying along a cosine to `min_lr`
/// at `steps` (nanoGPT's GPT-2 recipe by default: decay 0.1, `min_lr = lr / 10`;
/// [`TrainConfig::adamw_config`]).
#[derive(Debug, Clone, PartialEq)]
pub struct TrainConfig {
    /// The model (its `seed` seeds the initial weights and the dropout stream).
    pub model: GptConfig,
    /// Optimizer steps, ≥ 1.
    pub steps: u64,
    /// Sequences per micro-batch (of each data-parallel rank), ≥ 1.
    pub batch: usize,
    /// Micro-batches per optimizer step, ≥ 1 (gradients accumulate; FP8 weights are cast once
    /// per step through `is_first_microbatch`).
    pub grad_accum: usize,
    /// Peak learning rate, finite and ≥ 0.
    pub lr: f32,
    /// Linear warmup steps, ≤ `steps`.
    pub warmup_steps: u64,
    /// The learning rate at the end of the cosine decay (at `steps`), finite, in `[0, lr]`;
    /// `None`: a tenth of `lr`.
    pub min_lr: Option<f32>,
    /// AdamW's decoupled weight decay on the GEMM weights (Loshchilov & Hutter), finite and ≥ 0.
    pub weight_decay: f32,
    /// Global-norm clipping threshold, > 0 (`f32::INFINITY`: no clipping).
    pub max_grad_norm: f32,
    /// Evaluate every this many steps (and at the last), ≥ 1.
    pub eval_interval: u64,
    /// Validation batches per evaluation, ≥ 1 (the same fixed batches every time).
    pub eval_batches: usize,
    /// Seed of the data order (the model seed is in `model`).
    pub data_seed: u64,
    /// The FP8 recipe of [`Precision::Fp8`] runs (recorded in their checkpoints): TE's
    /// `DelayedScaling` (HYBRID, amax history 1024, max) by default, `Float8CurrentScaling` or
    /// `Float8BlockScaling` (Hopper GPUs, or the CPU path). The CPU path emulates delayed and
    /// blockwise scaling ([`crate::Backend::Cpu`]).
    pub recipe: Recipe,
    /// Steps with a NaN or infinite loss or gradient norm that are skipped (weights not
    /// updated) before the run stops ([`crate::NonFiniteGuard`]); 0: the first one stops it.
    pub skip_nonfinite_steps: u64,
    /// GPU runs: capture a whole training step (every micro-batch's forward and backward and
    /// the AdamW update) in a CUDA graph after one eager step and replay it for the rest of the
    /// run (TE's `make_graphed_callables` for the whole step; PyTorch's `torch.cuda.graph`),
    /// bit for bit the eager steps. Runs the graph cannot hold step eagerly, with a message:
    /// data- or tensor-parallel runs, MoE models, packed (`thd`) batches, fine-tuning a
    /// decoder of the family.
    pub cuda_graph: bool,
}

impl TrainConfig {
    /// `steps` steps of `model` with `te train`'s GPU defaults: batch 8, no gradient
    /// accumulation, peak learning rate 6e-4 warming up over the first 5% of the steps and
    /// decaying to a tenth of it, weight decay 0.1, clipping at 1.0, an evaluation of 8 batches every 5% of the steps, the data order seeded
    /// with the model's seed, TE's default `DelayedScaling`, and no non-finite step skipped.
    pub fn new(model: GptConfig, steps: u64) -> Self {
        let twentieth = (steps / 20).max(1);
        Self {
            data_seed: model.seed,
            model,
            steps,
            batch: 8,
            grad_accum: 1,
            lr: 6e-4,
            warmup_steps: twentieth,
            min_lr: None,
            weight_decay: 0.1,
            max_grad_norm: 1.0,
            eval_interval: twentieth,
            eval_batches: 8,
            recipe: Recipe::default(),
            skip_nonfinite_steps: 0,
            cuda_graph: false,
        }
    }

    /// Checks every setting's range (the model's geometry is checked when it is built).
    ///
    /// # Errors
    /// [`TrainError::Config`] naming the field and its range; [`TrainError::Runtime`] for an FP8
    /// recipe [`Recipe::validate`] refuses.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |field: &'static str, message: String| Err(TrainError::Config { field, message });
        if self.steps == 0 {
            return bad("steps", "0 optimizer steps: train at least 1".into());
        }
        if self.batch == 0 || self.grad_accum == 0 {
            return bad(
                if self.batch == 0 { "batch" } else { "grad_accum" },
                format!(
                    "batch {} and grad_accum {}: both must be at least 1 (sequences per micro-batch, micro-batches per \
                     step)",
                    self.batch, self.grad_accum
                ),
            );
        }
        if self.model.seq_length == 0 {
            return bad("model.seq_length", "sequences of 0 tokens: give at least 1 (te train --seq-length)".into());
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr", format!("the peak learning rate must be finite and ≥ 0, got {}", self.lr));
        }
        if self.warmup_steps > self.steps {
            return bad(
                "warmup_steps",
                format!(
                    "{} warmup steps exceed the run's {} steps: warm up over at most all of them",
                    self.warmup_steps, self.steps
                ),
            );
        }
        if let Some(m) = self.min_lr.filter(|m| !(m.is_finite() && (0.0..=self.lr).contains(m))) {
            return bad(
                "min_lr",
                format!(
                    "the final learning rate must be finite and in [0, lr = {}], got {m}: decay to at most the peak",
                    self.lr
                ),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("weight_decay", format!("the weight decay must be finite and ≥ 0, got {}", self.weight_decay));
        }
        if self.max_grad_norm.is_nan() || self.max_grad_norm <= 0.0 {
            return bad("max_grad_norm", format!("the clipping threshold must be > 0, got {}", self.max_grad_norm));
        }
        if self.eval_interval == 0 {
            return bad("eval_interval", "0: evaluate every N ≥ 1 steps (and at the last one)".into());
        }
        if self.eval_batches == 0 {
            return bad("eval_batches", "0 validation batches: evaluate on at least 1".into());
        }
        self.recipe.validate()?;
        Ok(())
    }

    /// The run's AdamW: betas (0.9, 0.95), `weight_decay` on GEMM weights only, clipping at
    /// `max_grad_norm` (none when infinite), warmup then cosine decay to `min_lr`, and non-finite steps skipped on the device (the [`crate::NonFiniteGuard`]
    /// decides whether the run goes on).
    pub fn adamw_config(&self) -> AdamWConfig {
        let schedule = LrSchedule::WarmupCosine {
            peak: self.lr,
            warmup_steps: self.warmup_steps,
            total_steps: self.steps,
            min_lr: self.min_lr.unwrap_or(self.lr / 10.0),
        };
        AdamWConfig {
            max_grad_norm: Some(self.max_grad_norm).filter(|m| m.is_finite()),
            weight_decay: self.weight_decay,
            betas: (0.9, 0.95),
            decay_biases_and_norms: false,
            // A non-finite step leaves the weights alone; `NonFiniteGuard` decides whether to go on.
            skip_nonfinite: true,
            ..AdamWConfig::new(schedule)
        }
    }

    /// The validation batches of every evaluation: the same fixed windows each time, on the GPU
    /// and on the CPU path.
    pub(crate) fn eval_batcher(&self, seq: usize) -> Batcher {
        Batcher::new(self.data_seed ^ 0x5eed, seq, self.batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use te_nn::fp8::DelayedScaling;

    #[test]
    fn defaults_follow_the_steps_and_validate() {
        let cfg = TrainConfig::new(GptConfig { seed: 5, ..GptConfig::tiny() }, 200);
        assert_eq!((cfg.warmup_steps, cfg.eval_interval, cfg.data_seed), (10, 10, 5));
        cfg.validate().unwrap();
        let short = TrainConfig::new(GptConfig::tiny(), 3);
        assert_eq!((short.warmup_steps, short.eval_interval), (1, 1));
        short.validate().unwrap();
        let adamw = cfg.adamw_config();
        adamw.validate().unwrap();
        assert_eq!((adamw.betas, adamw.weight_decay, adamw.max_grad_norm), ((0.9, 0.95), 0.1, Some(1.0)));
        assert!(adamw.skip_nonfinite && !adamw.decay_biases_and_norms);
        assert_eq!(adamw.lr.lr(cfg.steps), cfg.lr / 10.0, "cosine decay to a tenth");
        // The flags' settings reach the optimizer; an infinite threshold is no clipping.
        let set = TrainConfig { min_lr: Some(0.0), weight_decay: 0.0, max_grad_norm: f32::INFINITY, ..cfg };
        set.validate().unwrap();
        let adamw = set.adamw_config();
        adamw.validate().unwrap();
        assert_eq!((adamw.weight_decay, adamw.max_grad_norm, adamw.lr.lr(set.steps)), (0.0, None, 0.0));
    }

    /// Each out-of-range setting is refused, naming its field.
    #[test]
    fn validation_names_the_field() {
        let ok = TrainConfig::new(GptConfig::tiny(), 20);
        let cases: Vec<(TrainConfig, &str)> = vec![
            (TrainConfig { steps: 0, ..ok.clone() }, "steps"),
            (TrainConfig { batch: 0, ..ok.clone() }, "batch"),
            (TrainConfig { grad_accum: 0, ..ok.clone() }, "grad_accum"),
            (TrainConfig { model: GptConfig { seq_length: 0, ..GptConfig::tiny() }, ..ok.clone() }, "model.seq_length"),
            (TrainConfig { lr: f32::NAN, ..ok.clone() }, "lr"),
            (TrainConfig { lr: -1.0, ..ok.clone() }, "lr"),
            (TrainConfig { warmup_steps: 21, ..ok.clone() }, "warmup_steps"),
            (TrainConfig { max_grad_norm: 0.0, ..ok.clone() }, "max_grad_norm"),
            (TrainConfig { min_lr: Some(1.0), ..ok.clone() }, "min_lr"),
            (TrainConfig { min_lr: Some(-1e-5), ..ok.clone() }, "min_lr"),
            (TrainConfig { weight_decay: f32::NAN, ..ok.clone() }, "weight_decay"),
            (TrainConfig { weight_decay: -0.1, ..ok.clone() }, "weight_decay"),
            (TrainConfig { eval_interval: 0, ..ok.clone() }, "eval_interval"),
            (TrainConfig { eval_batches: 0, ..ok.clone() }, "eval_batches"),
        ];
        for (cfg, want) in cases {
            let e = cfg.validate().unwrap_err();
            assert!(matches!(&e, TrainError::Config { field, .. } if *field == want), "{want}: {e}");
            assert!(e.to_string().starts_with("invalid training configuration"), "{e}");
        }
        let recipe = TrainConfig { recipe: DelayedScaling { amax_history_len: 0, ..Default::default() }.into(), ..ok };
        let e = recipe.validate().unwrap_err();
        assert!(matches!(e, TrainError::Runtime(_)) && e.to_string().contains("amax_history_len"), "{e}");
    }

    #[test]
    fn precisions_have_names() {
        for p in [Precision::Fp8, Precision::Bf16] {
            assert_eq!(Precision::from_name(p.name()), Ok(p));
        }
        assert!(Precision::from_name("fp16").unwrap_err().contains("expected fp8 or bf16"));
    }
}
