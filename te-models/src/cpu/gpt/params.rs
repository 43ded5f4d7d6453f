//! The parameters of [`GptRef`]: their names, shapes and kinds in the GPU model's
//! [`te_nn::Module::named_parameters`] order, the GPU model's init (same seeds and normal
//! draws), loading from named values, and the accessors the forward and backward use.

use super::{GemmPrecision, GptRef, MODEL};
use crate::gpt::GptConfig;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use te_nn::modules::ParamKind;
use te_runtime::{Error, Result};

/// Parameters per layer, in [`GptRef::params`] order.
pub(super) const PER_LAYER: usize = 12;

/// One parameter: its path as [`te_nn::Module::named_parameters`] of the GPU model names it,
/// its shape, kind and f32 values (row-major).
#[derive(Debug, Clone, PartialEq)]
pub struct NamedParam {
    /// Dotted path (`layers.0.self_attention.layernorm_qkv.weight`).
    pub name: String,
    /// Shape as stored on the GPU (`[out, in]` for GEMM weights).
    pub shape: Vec<usize>,
    /// GEMM weight, bias, norm parameter or embedding table (decides weight decay).
    pub kind: ParamKind,
    /// The values, `shape.iter().product()` of them.
    pub value: Vec<f32>,
}

/// `n` values `~ N(0, std)` from `seed`, the GPU modules' init.
fn normal(n: usize, std: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    match Normal::new(0.0f32, std) {
        Ok(d) => (0..n).map(|_| d.sample(&mut rng)).collect(),
        Err(_) => vec![0.0; n],
    }
}

/// Names, shapes and kinds of the parameters of `cfg`, in [`te_nn::Module::named_parameters`]
/// order of the GPU model.
fn layout(cfg: &GptConfig) -> Vec<(String, Vec<usize>, ParamKind)> {
    let (h, f, v) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size);
    let mut out = vec![
        ("embedding.weight".to_string(), vec![v, h], ParamKind::Embedding),
        ("position_embedding.weight".to_string(), vec![cfg.seq_length, h], ParamKind::Embedding),
    ];
    for l in 0..cfg.num_layers {
        let parts: [(&str, Vec<usize>, ParamKind); PER_LAYER] = [
            ("self_attention.layernorm_qkv.layer_norm_weight", vec![h], ParamKind::NormWeight),
            ("self_attention.layernorm_qkv.layer_norm_bias", vec![h], ParamKind::NormBias),
            ("self_attention.layernorm_qkv.weight", vec![3 * h, h], ParamKind::Weight),
            ("self_attention.layernorm_qkv.bias", vec![3 * h], ParamKind::Bias),
            ("self_attention.proj.weight", vec![h, h], ParamKind::Weight),
            ("self_attention.proj.bias", vec![h], ParamKind::Bias),
            ("layernorm_mlp.layer_norm_weight", vec![h], ParamKind::NormWeight),
            ("layernorm_mlp.layer_norm_bias", vec![h], ParamKind::NormBias),
            ("layernorm_mlp.fc1_weight", vec![f, h], ParamKind::Weight),
            ("layernorm_mlp.fc1_bias", vec![f], ParamKind::Bias),
            ("layernorm_mlp.fc2_weight", vec![h, f], ParamKind::Weight),
            ("layernorm_mlp.fc2_bias", vec![h], ParamKind::Bias),
        ];
        out.extend(parts.into_iter().map(|(n, s, k)| (format!("layers.{l}.{n}"), s, k)));
    }
    out.push(("final_norm.weight".into(), vec![h], ParamKind::NormWeight));
    out.push(("final_norm.bias".into(), vec![h], ParamKind::NormBias));
    out.push(("lm_head.weight".into(), vec![v, h], ParamKind::Weight));
    out
}

/// The checks of `Gpt::new` that the CPU model needs.
fn check_config(cfg: &GptConfig) -> Result<()> {
    let bad = |message: String| Err(Error::Config { module: MODEL, message });
    if cfg.vocab_size == 0 || cfg.num_layers == 0 || cfg.seq_length == 0 || cfg.hidden_size == 0 {
        return bad("vocab_size, num_layers, seq_length and hidden_size must be ≥ 1".into());
    }
    if cfg.ffn_hidden_size == 0 || cfg.num_attention_heads == 0 || cfg.hidden_size % cfg.num_attention_heads != 0 {
        return bad(format!(
            "num_attention_heads = {} must divide hidden_size = {}, and ffn_hidden_size must be ≥ 1",
            cfg.num_attention_heads, cfg.hidden_size
        ));
    }
    if cfg.moe.is_some() {
        return bad(
            "the CPU reference GPT has dense MLPs only: a mixture-of-experts config (`moe`) runs on the GPU".into()
        );
    }
    if !(0.0..=1.0).contains(&cfg.hidden_dropout) {
        return bad(format!("hidden_dropout must be in [0, 1], got {}", cfg.hidden_dropout));
    }
    Ok(())
}

impl GptRef {
    /// A freshly initialized model with the GPU model's init (the same seeds and normal draws:
    /// before rounding to `params_dtype`, the values of `Gpt::new`), GEMMs in
    /// [`GemmPrecision::F32`].
    ///
    /// # Errors
    /// [`Error::Config`] for zero sizes, heads that do not divide the hidden size, a dropout
    /// outside `[0, 1]`, a mixture-of-experts config (`moe`: GPU only).
    pub fn new(cfg: &GptConfig) -> Result<Self> {
        check_config(cfg)?;
        let (h, f, seed) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.seed);
        let mut values = vec![normal(cfg.vocab_size * h, 0.02, seed), normal(cfg.seq_length * h, 0.01, seed + 1)];
        for l in 0..cfg.num_layers {
            let s = seed + 16 * (l as u64 + 1);
            let (ones, zeros) = (vec![1.0; h], vec![0.0; h]);
            values.extend([
                ones.clone(),
                zeros.clone(),
                normal(3 * h * h, 0.023, s),
                vec![0.0; 3 * h],
                normal(h * h, 0.023, s + 1),
                zeros.clone(),
                ones,
                zeros.clone(),
                normal(f * h, 0.023, s + 2),
                vec![0.0; f],
                normal(h * f, 0.023, s + 3),
                zeros,
            ]);
        }
        values.extend([vec![1.0; h], vec![0.0; h], normal(cfg.vocab_size * h, 0.023, seed + 2)]);
        let params = layout(cfg)
            .into_iter()
            .zip(values)
            .map(|((name, shape, kind), value)| NamedParam { name, shape, kind, value })
            .collect();
        Ok(Self { cfg: cfg.clone(), params, precision: GemmPrecision::F32, fp8: Vec::new(), forwards: 0 })
    }

    /// A model holding `named` (e.g. a GPU model's `named_parameters`, widened to f32): every
    /// parameter of `cfg`'s layout exactly once, in any order.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad `cfg` (as [`GptRef::new`]), a missing, unknown or repeated
    /// name, or a value count that does not match the shape.
    pub fn from_named(cfg: &GptConfig, named: Vec<(String, Vec<f32>)>) -> Result<Self> {
        let mut model = Self::new(cfg)?;
        let bad = |message: String| Err(Error::Config { module: MODEL, message });
        let mut seen = vec![false; model.params.len()];
        for (name, value) in named {
            let Some(i) = model.params.iter().position(|p| p.name == name) else {
                return bad(format!("unknown parameter `{name}`"));
            };
            let p = &mut model.params[i];
            if std::mem::replace(&mut seen[i], true) {
                return bad(format!("parameter `{name}` given twice"));
            }
            if value.len() != p.value.len() {
                return bad(format!(
                    "`{name}` must hold {} values ({:?}), got {}",
                    p.value.len(),
                    p.shape,
                    value.len()
                ));
            }
            p.value = value;
        }
        let missing: Vec<&str> = model.params.iter().zip(&seen).filter(|(_, &s)| !s).map(|(p, _)| &*p.name).collect();
        if !missing.is_empty() {
            return bad(format!("missing parameters: {}", missing.join(", ")));
        }
        Ok(model)
    }

    /// The configuration (`params_dtype` is ignored: parameters are f32).
    pub fn config(&self) -> &GptConfig {
        &self.cfg
    }

    /// The parameters, in the GPU model's [`te_nn::Module::named_parameters`] order.
    pub fn params(&self) -> &[NamedParam] {
        &self.params
    }

    /// Total parameter count (as [`GptConfig::num_parameters`]).
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.value.len()).sum()
    }

    /// An upper estimate of the host memory, in bytes, that training a model of `cfg` on
    /// batches of `batch` sequences of `cfg.seq_length` takes (f32 throughout): the parameters
    /// six times over (values, gradients, the step's accumulated gradients, AdamW's two moments,
    /// the GEMM operands as cast), per layer what the forward keeps for the backward
    /// (`t · (8h + 3f)` floats for `t = batch · seq` tokens, and the attention probabilities
    /// `batch · heads · seq²` twice: kept, and the backward's `dP`), and the logits and their
    /// gradient (`2 · t · vocab`). What `te train` checks against the free memory before
    /// building the model, so that a configuration the machine cannot hold is refused instead of
    /// aborting the process.
    pub fn training_bytes(cfg: &GptConfig, batch: usize) -> u64 {
        let (h, f, v) = (cfg.hidden_size as u64, cfg.ffn_hidden_size as u64, cfg.vocab_size as u64);
        let (s, b) = (cfg.seq_length as u64, batch as u64);
        let t = s * b;
        let params = cfg.num_parameters() as u64;
        let probs = b.saturating_mul(cfg.num_attention_heads as u64).saturating_mul(s.saturating_mul(s));
        let layer = t.saturating_mul(8 * h + 3 * f).saturating_add(probs.saturating_mul(2));
        let floats =
            (6 * params).saturating_add((cfg.num_layers as u64).saturating_mul(layer)).saturating_add(2 * t * v);
        floats.saturating_mul(4)
    }

    /// Values of parameter `i` of layer `l`.
    pub(super) fn lp(&self, l: usize, i: usize) -> &[f32] {
        &self.params[2 + PER_LAYER * l + i].value
    }

    /// Values of the `i`-th parameter after the layers (final norm weight, bias, LM head).
    pub(super) fn tail(&self, i: usize) -> &[f32] {
        &self.params[2 + PER_LAYER * self.cfg.num_layers + i].value
    }
}
