//! CPU twin of [`crate::models::gpt::Gpt`]: the same architecture, parameter names, shapes and
//! init, in f32 on the host, with the forward intermediates kept for the backward (no
//! recompute), and an AdamW step over its parameters ([`GptAdamW`]). This is the path `te train
//! --preset tiny` takes on a machine without a GPU, and the oracle the GPU model is checked
//! against.
//!
//! Layout as on the GPU: hidden states `[s, b, hidden]` row-major (token `t = i·b + j` is
//! position `i` of sequence `j`). Parts: token embedding plus the learned position embedding,
//! `num_layers` pre-LN layers (`h = x + dropout(proj(attn(qkv(ln1(x)))))`, `y = h +
//! dropout(fc2(gelu(fc1(ln2(h)))))`, causal softmax attention with scale `1/√head_dim`, GELU
//! with TE's tanh approximation), the final LayerNorm, the LM head without bias and the mean
//! cross-entropy over the targets that are not [`IGNORE_INDEX`].
//!
//! Arithmetic: GEMMs in f32 (`matrixmultiply`, rows split over the rayon pool; the GPU
//! accumulates in f32 too) rather than the f64 [`super::gemm::gemm_tn`], and attention with the
//! forward's probabilities kept rather than [`super::transformer::MhaRef`]'s recompute: the
//! speed a CPU training run needs. Norms, embeddings, dropout masks, the loss, the scaling
//! update and the AdamW arithmetic are the references' ([`super::modules::NormRef`],
//! [`super::embedding`], [`super::dropout`], [`super::cross_entropy`], [`super::scaling`],
//! [`super::optimizer`]). [`GemmPrecision`] emulates the
//! GPU's GEMM numerics on the GEMM *inputs*: rounded to BF16, or fake-quantized to FP8 with
//! delayed scaling per operand as TE's `DelayedScaling` does (E4M3 inputs and weights, E5M2
//! output gradients under HYBRID; amax history, `max` or newest, margin; initial scale 1;
//! forward scales updated after each [`GptRef::forward_loss`], gradient scales after each
//! [`GptRef::backward`]; the casts equal [`crate::numerics::round_to`] bit for bit).
//! Everything else stays f32 (the GPU keeps activations in BF16).
//!
//! Hidden dropout: the GPU's Philox masks (seed of layer `l` = `seed + 16·(l + 1)`, offsets
//! `2n + 1` and `2n + 2` for the `n`-th [`GptRef::forward_loss`]), so a GPU model and its twin
//! that ran the same number of forwards drop the same elements. [`GptRef::loss`] (evaluation)
//! runs without dropout.

use super::cross_entropy::cross_entropy;
use super::dropout::{keep_mask, kept};
use super::embedding;
use super::modules::NormRef;
use super::optimizer::{adamw_step, clip_coef, global_norm};
use super::scaling::{delayed_update, HostScalingGroup};
use crate::fp8::DelayedScaling;
use crate::models::gpt::{GptConfig, IGNORE_INDEX};
use crate::modules::{NormKind, ParamKind};
use crate::ops::dropout::{keep_scale, DropoutParams};
use crate::optim::scalars::{AdamWHyper, AdamWScalars};
use crate::{Error, Result};
use half::bf16;
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};
use rayon::prelude::*;
use te_codegen::DType;

const MODEL: &str = "GptRef";
/// Parameters per layer, in [`GptRef::params`] order.
const PER_LAYER: usize = 12;

/// How the GEMM inputs are rounded before each f32 GEMM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemmPrecision {
    /// Exact f32 inputs (the check against a GPU model built with `params_dtype: F32`).
    F32,
    /// Inputs rounded to BF16 (round to nearest even), as a BF16 model's GEMMs read them.
    Bf16,
    /// Inputs fake-quantized to FP8 with delayed scaling per operand, as under
    /// [`crate::fp8::fp8_autocast`] with this recipe.
    Fp8(DelayedScaling),
}

/// One parameter: its path as [`crate::Module::named_parameters`] of the GPU model names it,
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

/// Delayed scaling of `n` operands sharing a format: TE's amax history and scales.
#[derive(Debug, Clone)]
struct Scaling {
    /// `[n, history_len]`, `[slot][0]` the amax being recorded.
    history: Vec<f32>,
    scale: Vec<f32>,
    scale_inv: Vec<f32>,
    fp8_max: f32,
    dtype: DType,
}

impl Scaling {
    fn new(n: usize, dtype: DType, recipe: &DelayedScaling) -> Self {
        Self {
            history: vec![0.0; n * recipe.amax_history_len],
            scale: vec![1.0; n],
            scale_inv: vec![1.0; n],
            fp8_max: dtype.fp8_max().unwrap_or(448.0),
            dtype,
        }
    }

    /// Folds this use's amaxes into the newest history entries.
    fn record(&mut self, amax: &[f32], len: usize) {
        for (slot, &a) in amax.iter().enumerate() {
            let h = &mut self.history[slot * len];
            *h = h.max(a);
        }
    }

    /// TE's update: scales from the histories, then the histories roll.
    fn update(&mut self, recipe: &DelayedScaling) {
        let group = HostScalingGroup {
            amax_history: &mut self.history,
            scale: &mut self.scale,
            scale_inv: &mut self.scale_inv,
            history_len: recipe.amax_history_len,
            fp8_max: self.fp8_max,
            margin: recipe.margin,
        };
        delayed_update(&mut [group], recipe.amax_compute_algo);
    }
}

/// The FP8 state of one GEMM: input and weight (forward), output gradient (backward).
#[derive(Debug, Clone)]
struct GemmScaling {
    fwd: Scaling,
    bwd: Scaling,
}

/// How one GEMM operand is cast.
#[derive(Debug, Clone, Copy)]
enum Cast {
    Exact,
    Bf16,
    Fp8(DType, f32),
}

/// `[f(0), …, f(n - 1)]`, computed in parallel chunks.
fn par_fill(n: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0.0; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        o.iter_mut().enumerate().for_each(|(i, o)| *o = f(c * CHUNK + i));
    });
    out
}

/// The operand `x` as the GEMM reads it.
fn cast(x: &[f32], c: Cast) -> Vec<f32> {
    match c {
        Cast::Exact => x.to_vec(),
        Cast::Bf16 => par_fill(x.len(), |i| bf16::from_f32(x[i]).to_f32()),
        Cast::Fp8(dtype, scale) => {
            let (grid, scale_inv) = (Fp8Grid::new(dtype), 1.0 / scale);
            par_fill(x.len(), |i| grid.round(x[i] * scale) * scale_inv)
        }
    }
}

/// The rounding grid of an FP8 format, for [`Fp8Grid::round`].
#[derive(Debug, Clone, Copy)]
struct Fp8Grid {
    /// Smallest normal value.
    min_normal: f32,
    /// Smallest subnormal (the spacing below `min_normal`).
    step: f32,
    /// Dropped f32 mantissa bits.
    shift: u32,
    /// Largest finite value.
    max: f32,
}

impl Fp8Grid {
    fn new(dtype: DType) -> Self {
        // Mantissa bits, smallest normal exponent, largest finite value.
        let (mant, min_exp, max) = if dtype == DType::E5M2 { (2, -14, 57344.0) } else { (3, -6, 448.0) };
        Self { min_normal: 2f32.powi(min_exp), step: 2f32.powi(min_exp - mant), shift: 23 - mant as u32, max }
    }

    /// [`crate::numerics::round_to`]`(dtype, x)` for the FP8 `dtype` (the GPU's
    /// `cvt.rn.satfinite`: nearest even, saturating to ±max, NaN kept) in a few float
    /// operations instead of a table conversion; the tests check it against `round_to` bit
    /// for bit.
    fn round(&self, x: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let a = x.abs();
        let r = if a < self.min_normal {
            // Subnormals: multiples of a power of two (exact steps).
            (a / self.step).round_ties_even() * self.step
        } else {
            let bits = a.to_bits();
            let bits = bits + ((1 << (self.shift - 1)) - 1) + ((bits >> self.shift) & 1);
            f32::from_bits(bits & !((1 << self.shift) - 1))
        };
        r.min(self.max).copysign(x)
    }
}

fn amax(x: &[f32]) -> f32 {
    x.par_chunks(1 << 14).map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs()))).reduce(|| 0.0, f32::max)
}

/// A strided view of a matrix: element `(r, c)` at `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    /// Row-major `[rows, cols]` from `data`.
    fn rows(data: &'a [f32], cols: usize) -> Self {
        Self { data, rs: cols, cs: 1 }
    }

    /// The transpose of row-major `[rows, cols]` data (a `[cols, rows]` view).
    fn t(data: &'a [f32], cols: usize) -> Self {
        Self { data, rs: 1, cs: cols }
    }

    /// Rows from `r` on.
    fn skip_rows(self, r: usize) -> Self {
        Self { data: &self.data[r * self.rs..], ..self }
    }

    fn check(&self, rows: usize, cols: usize) {
        let last = (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(last < self.data.len(), "GEMM view out of bounds");
    }
}

/// `c [m, n] (row-major) = a [m, k] · b [k, n] + beta · c`, rows of `c` split over the rayon
/// pool when the product is large.
fn gemm(m: usize, k: usize, n: usize, a: View<'_>, b: View<'_>, beta: f32, c: &mut [f32]) {
    assert_eq!(c.len(), m * n, "GEMM output must be [m, n]");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        c.iter_mut().for_each(|v| *v *= beta);
        return;
    }
    a.check(m, k);
    b.check(k, n);
    let threads = rayon::current_num_threads();
    let rows = if m * n * k >= 1 << 18 && threads > 1 { m.div_ceil(threads) } else { m };
    c.par_chunks_mut(rows * n).enumerate().for_each(|(i, c)| {
        let (a, mi) = (a.skip_rows(i * rows), c.len() / n);
        // SAFETY: the views hold every element the product reads (checked above; `skip_rows`
        // only drops rows before this chunk's), and `c` is this chunk's `[mi, n]` block.
        unsafe {
            matrixmultiply::sgemm(
                mi,
                k,
                n,
                1.0,
                a.data.as_ptr(),
                a.rs as isize,
                a.cs as isize,
                b.data.as_ptr(),
                b.rs as isize,
                b.cs as isize,
                beta,
                c.as_mut_ptr(),
                n as isize,
                1,
            );
        }
    });
}

/// `y [t, out] = x [t, in] · w [out, in]ᵀ + bias`.
fn linear(x: &[f32], w: &[f32], bias: Option<&[f32]>, t: usize, n_out: usize, n_in: usize) -> Vec<f32> {
    let mut y = match bias {
        Some(b) => b.iter().copied().cycle().take(t * n_out).collect(),
        None => vec![0.0; t * n_out],
    };
    gemm(t, n_in, n_out, View::rows(x, n_in), View::t(w, n_in), 1.0, &mut y);
    y
}

/// `Σ_rows x` of `[rows, cols]` in f64, rounded once.
fn column_sums(x: &[f32], cols: usize) -> Vec<f32> {
    let mut s = vec![0.0f64; cols];
    for row in x.chunks_exact(cols) {
        s.iter_mut().zip(row).for_each(|(s, &v)| *s += f64::from(v));
    }
    s.into_iter().map(|v| v as f32).collect()
}

const SQRT_2_OVER_PI: f32 = 0.797_884_6;

/// The `tanh` of TE's tanh-approximated GELU, `gelu(x) = x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`
/// ([`super::activation::gelu`]), through `exp` (`1 − 2/(e^{2u} + 1)`, exact to f32 rounding
/// in absolute terms, which is what the GELU needs) and shared with the backward.
fn gelu_tanh(x: f32) -> f32 {
    let u = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
    1.0 - 2.0 / ((2.0 * u).exp() + 1.0)
}

/// [`super::activation::dgelu`] at `x` from `t = gelu_tanh(x)`.
fn dgelu(x: f32, t: f32) -> f32 {
    0.5 * x * ((1.0 - t * t) * (SQRT_2_OVER_PI + 3.0 * 0.044715 * SQRT_2_OVER_PI * x * x)) + 0.5 * (1.0 + t)
}

/// `n` values `~ N(0, std)` from `seed`, the GPU modules' init.
fn normal(n: usize, std: f32, seed: u64) -> Vec<f32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    match Normal::new(0.0f32, std) {
        Ok(d) => (0..n).map(|_| d.sample(&mut rng)).collect(),
        Err(_) => vec![0.0; n],
    }
}

/// What one layer's forward keeps: its input, the attention's `q|k|v` and probabilities, the
/// residual stream, the MLP pre-activation, the masks and every GEMM operand as cast.
#[derive(Debug)]
struct LayerCtx {
    x: Vec<f32>,
    qkv: Vec<f32>,
    /// `[b·heads]` blocks of `[s, s]`.
    probs: Vec<Vec<f32>>,
    h1: Vec<f32>,
    pre: Vec<f32>,
    /// The GELU's `tanh` of each pre-activation.
    tanh: Vec<f32>,
    masks: [Option<Vec<u8>>; 2],
    /// `(input, weight)` of qkv, proj, fc1, fc2.
    gemms: [(Vec<f32>, Vec<f32>); 4],
}

/// What [`GptRef::forward_loss`] saves for [`GptRef::backward`].
#[derive(Debug)]
pub struct GptRefCtx {
    ids: Vec<i32>,
    shape: [usize; 2],
    layers: Vec<LayerCtx>,
    /// Input of the final norm.
    last: Vec<f32>,
    /// `(input, weight)` of the LM head.
    head: (Vec<f32>, Vec<f32>),
    dlogits: Vec<f32>,
    /// The configuration of the model that made it.
    cfg: GptConfig,
}

/// The CPU GPT (see the module docs): parameters in the GPU model's order and names.
#[derive(Debug, Clone)]
pub struct GptRef {
    cfg: GptConfig,
    params: Vec<NamedParam>,
    precision: GemmPrecision,
    /// One per GEMM (`4·l + {qkv, proj, fc1, fc2}`, then the LM head) under FP8, else empty.
    fp8: Vec<GemmScaling>,
    forwards: u64,
}

/// Names, shapes and kinds of the parameters of `cfg`, in [`crate::Module::named_parameters`]
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
    /// outside `[0, 1]`.
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

    /// The parameters, in the GPU model's [`crate::Module::named_parameters`] order.
    pub fn params(&self) -> &[NamedParam] {
        &self.params
    }

    /// Total parameter count (as [`GptConfig::num_parameters`]).
    pub fn num_parameters(&self) -> usize {
        self.params.iter().map(|p| p.value.len()).sum()
    }

    /// The GEMM input precision.
    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Sets the GEMM input precision; for FP8, starts fresh delayed-scaling state (scales 1,
    /// empty histories), as a new GPU model has.
    ///
    /// # Errors
    /// [`Error::Recipe`] for an invalid FP8 recipe (history length 0, a margin that is not
    /// finite).
    pub fn set_precision(&mut self, precision: GemmPrecision) -> Result<()> {
        self.fp8 = match &precision {
            GemmPrecision::Fp8(recipe) => {
                crate::fp8::Recipe::Delayed(*recipe).validate()?;
                let gemm = GemmScaling {
                    fwd: Scaling::new(2, recipe.fp8_format.forward_dtype(), recipe),
                    bwd: Scaling::new(1, recipe.fp8_format.backward_dtype(), recipe),
                };
                // The LM head has FP8 state only when it runs in FP8 (`fp8_lm_head`).
                vec![gemm; 4 * self.cfg.num_layers + usize::from(self.cfg.fp8_lm_head)]
            }
            _ => Vec::new(),
        };
        self.precision = precision;
        Ok(())
    }

    /// Values of parameter `i` of layer `l`.
    fn lp(&self, l: usize, i: usize) -> &[f32] {
        &self.params[2 + PER_LAYER * l + i].value
    }

    /// Values of the `i`-th parameter after the layers (final norm weight, bias, LM head).
    fn tail(&self, i: usize) -> &[f32] {
        &self.params[2 + PER_LAYER * self.cfg.num_layers + i].value
    }

    fn norm<'a>(&self, gamma: &'a [f32], beta: &'a [f32]) -> NormRef<'a> {
        NormRef { kind: NormKind::LayerNorm, gamma, beta: Some(beta), eps: 1e-5, zero_centered_gamma: false }
    }

    /// Whether GEMM `g` runs in FP8: under FP8, every layer GEMM, and the LM head (the last)
    /// only with `fp8_lm_head` (else in BF16, as on the GPU).
    fn fp8_gemm(&self, g: usize) -> bool {
        matches!(self.precision, GemmPrecision::Fp8(_)) && g < self.fp8.len()
    }

    /// The casts of GEMM `g`'s forward operands (input, weight).
    fn forward_casts(&self, g: usize) -> [Cast; 2] {
        match self.precision {
            GemmPrecision::F32 => [Cast::Exact; 2],
            GemmPrecision::Bf16 => [Cast::Bf16; 2],
            GemmPrecision::Fp8(_) if !self.fp8_gemm(g) => [Cast::Bf16; 2],
            GemmPrecision::Fp8(_) => {
                let s = &self.fp8[g].fwd;
                [Cast::Fp8(s.dtype, s.scale[0]), Cast::Fp8(s.dtype, s.scale[1])]
            }
        }
    }

    /// GEMM `g`'s input and weight as it reads them, their amaxes added to `amaxes` under FP8.
    fn gemm_operands(&self, g: usize, x: &[f32], w: &[f32], amaxes: &mut Vec<[f32; 2]>) -> (Vec<f32>, Vec<f32>) {
        if self.fp8_gemm(g) {
            amaxes.push([amax(x), amax(w)]);
        }
        let [cx, cw] = self.forward_casts(g);
        (cast(x, cx), cast(w, cw))
    }

    /// `residual + dropout(x)` with the Philox mask of `(seed, offset)`, or without dropout.
    fn residual_dropout(
        &self,
        x: &[f32],
        residual: &[f32],
        dropout: Option<DropoutParams>,
    ) -> (Vec<f32>, Option<Vec<u8>>) {
        match dropout {
            Some(params) => {
                let mask = keep_mask(x.len(), params);
                let scale = keep_scale(params.p);
                let y = (0..x.len()).map(|i| residual[i] + if kept(&mask, i) { x[i] * scale } else { 0.0 }).collect();
                (y, Some(mask))
            }
            None => (residual.iter().zip(x).map(|(r, v)| r + v).collect(), None),
        }
    }

    fn check_batch(&self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<()> {
        let shape = |message: String| Err(Error::Shape { op: MODEL, message });
        if s == 0 || b == 0 || s > self.cfg.seq_length {
            return shape(format!("need 1 ≤ s ≤ seq_length = {} and b ≥ 1, got s = {s}, b = {b}", self.cfg.seq_length));
        }
        if ids.len() != s * b || targets.len() != s * b {
            return shape(format!(
                "ids and targets must be [s, b] = [{s}, {b}], got {} and {} values",
                ids.len(),
                targets.len()
            ));
        }
        let v = self.cfg.vocab_size as i32;
        if let Some(t) = ids.iter().find(|&&t| !(0..v).contains(&t)) {
            return Err(Error::Argument { op: MODEL, message: format!("token id {t} outside [0, {v})") });
        }
        if let Some(t) = targets.iter().find(|&&t| t != IGNORE_INDEX && !(0..v).contains(&t)) {
            return Err(Error::Argument {
                op: MODEL,
                message: format!("target {t} outside [0, {v}) and not {IGNORE_INDEX}"),
            });
        }
        Ok(())
    }

    /// The forward: mean loss, context and the FP8 amaxes of every GEMM's `[input, weight]`;
    /// `dropout_offset` is the offset of the first dropout call (`None`: no dropout).
    fn run(
        &self,
        ids: &[i32],
        targets: &[i32],
        s: usize,
        b: usize,
        dropout_offset: Option<u64>,
    ) -> Result<(f32, GptRefCtx, Vec<[f32; 2]>)> {
        self.check_batch(ids, targets, s, b)?;
        let cfg = &self.cfg;
        let (h, f, v, t) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, s * b);
        let pos: Vec<i32> = (0..t).map(|i| (i / b) as i32).collect();
        let tok = embedding::forward(&self.params[0].value, h, ids);
        let wpe = embedding::forward(&self.params[1].value, h, &pos);
        let mut x: Vec<f32> = tok.iter().zip(&wpe).map(|(a, b)| a + b).collect();
        let mut amaxes = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let dropout = |k: u64| {
                dropout_offset.filter(|_| cfg.hidden_dropout > 0.0).map(|o| DropoutParams {
                    p: cfg.hidden_dropout,
                    seed: cfg.seed + 16 * (l as u64 + 1),
                    offset: o + k,
                })
            };
            let ln1 = self.norm(self.lp(l, 0), self.lp(l, 1)).forward(&x);
            let qkv_ops = self.gemm_operands(4 * l, &ln1, self.lp(l, 2), &mut amaxes);
            let qkv = linear(&qkv_ops.0, &qkv_ops.1, Some(self.lp(l, 3)), t, 3 * h, h);
            let (o, probs) = attention_forward(&qkv, s, b, cfg.num_attention_heads, h / cfg.num_attention_heads);
            let proj_ops = self.gemm_operands(4 * l + 1, &o, self.lp(l, 4), &mut amaxes);
            let a = linear(&proj_ops.0, &proj_ops.1, Some(self.lp(l, 5)), t, h, h);
            let (h1, mask1) = self.residual_dropout(&a, &x, dropout(0));
            let ln2 = self.norm(self.lp(l, 6), self.lp(l, 7)).forward(&h1);
            let fc1_ops = self.gemm_operands(4 * l + 2, &ln2, self.lp(l, 8), &mut amaxes);
            let pre = linear(&fc1_ops.0, &fc1_ops.1, Some(self.lp(l, 9)), t, f, h);
            let tanh = par_fill(pre.len(), |i| gelu_tanh(pre[i]));
            let act = par_fill(pre.len(), |i| 0.5 * pre[i] * (1.0 + tanh[i]));
            let fc2_ops = self.gemm_operands(4 * l + 3, &act, self.lp(l, 10), &mut amaxes);
            let m = linear(&fc2_ops.0, &fc2_ops.1, Some(self.lp(l, 11)), t, h, f);
            let (y, mask2) = self.residual_dropout(&m, &h1, dropout(1));
            let layer_x = std::mem::replace(&mut x, y);
            layers.push(LayerCtx {
                x: layer_x,
                qkv,
                probs,
                h1,
                pre,
                tanh,
                masks: [mask1, mask2],
                gemms: [qkv_ops, proj_ops, fc1_ops, fc2_ops],
            });
        }
        let yf = self.norm(self.tail(0), self.tail(1)).forward(&x);
        let head = self.gemm_operands(4 * cfg.num_layers, &yf, self.tail(2), &mut amaxes);
        let logits = linear(&head.0, &head.1, None, t, v, h);
        let counted = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
        let grad_scale = if counted == 0 { 0.0 } else { 1.0 / counted as f32 };
        let (loss, dlogits) = cross_entropy(&logits, v, targets, IGNORE_INDEX, grad_scale);
        let mean =
            if counted == 0 { 0.0 } else { (loss.iter().map(|&l| f64::from(l)).sum::<f64>() / counted as f64) as f32 };
        let ctx = GptRefCtx { ids: ids.to_vec(), shape: [s, b], layers, last: x, head, dlogits, cfg: cfg.clone() };
        Ok((mean, ctx, amaxes))
    }

    /// The mean cross-entropy over the targets that are not [`IGNORE_INDEX`] (0 when all are)
    /// and the context for [`GptRef::backward`], with hidden dropout (training). Under FP8 the
    /// forward amaxes enter the histories and the forward scales are updated afterwards.
    ///
    /// `ids`, `targets`: `[s, b]` row-major (`s · b` values, token `i·b + j` at position `i`).
    ///
    /// # Errors
    /// [`Error::Shape`] for `s = 0`, `b = 0`, `s > seq_length` or slices that are not `s · b`
    /// long; [`Error::Argument`] for an id outside `[0, vocab)` or a target outside it that is
    /// not [`IGNORE_INDEX`].
    pub fn forward_loss(&mut self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<(f32, GptRefCtx)> {
        let (loss, ctx, amaxes) = self.run(ids, targets, s, b, Some(2 * self.forwards + 1))?;
        self.forwards += 1;
        if let GemmPrecision::Fp8(recipe) = self.precision {
            for (g, a) in self.fp8.iter_mut().zip(&amaxes) {
                g.fwd.record(a, recipe.amax_history_len);
                g.fwd.update(&recipe);
            }
        }
        Ok((loss, ctx))
    }

    /// The mean loss as [`GptRef::forward_loss`] computes it, for evaluation: no dropout, FP8
    /// with the current scales and nothing recorded.
    ///
    /// # Errors
    /// As [`GptRef::forward_loss`].
    pub fn loss(&self, ids: &[i32], targets: &[i32], s: usize, b: usize) -> Result<f32> {
        Ok(self.run(ids, targets, s, b, None)?.0)
    }

    /// The gradient of the mean loss of `ctx` for every parameter, `(name, values)` in
    /// [`GptRef::params`] order. Under FP8 the output-gradient amaxes enter the histories and
    /// the backward scales are updated afterwards.
    ///
    /// # Errors
    /// [`Error::Context`] for a context made by a model of another configuration.
    pub fn backward(&mut self, ctx: GptRefCtx) -> Result<Vec<(String, Vec<f32>)>> {
        let cfg = &self.cfg;
        let [s, b] = ctx.shape;
        let (h, f, v, t) = (cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, s * b);
        if ctx.cfg != *cfg {
            return Err(Error::Context {
                module: MODEL,
                message: "the context was made by a model of another configuration".into(),
            });
        }
        let heads = cfg.num_attention_heads;
        let mut grads: Vec<Vec<f32>> = self.params.iter().map(|p| vec![0.0; p.value.len()]).collect();
        let mut amaxes = Vec::new();
        let nl = cfg.num_layers;
        let (dyf, dw_head, _) =
            self.linear_backward(4 * nl, &ctx.dlogits, &ctx.head.0, &ctx.head.1, [t, v, h], &mut amaxes);
        let (mut dx, dg, db) = self.norm(self.tail(0), self.tail(1)).backward(&dyf, &ctx.last);
        let base = 2 + PER_LAYER * nl;
        (grads[base], grads[base + 1], grads[base + 2]) = (dg, db, dw_head);
        for (l, c) in ctx.layers.iter().enumerate().rev() {
            let drop = |d: &[f32], mask: &Option<Vec<u8>>| match mask {
                Some(m) => {
                    let scale = keep_scale(cfg.hidden_dropout);
                    d.iter().enumerate().map(|(i, &g)| if kept(m, i) { g * scale } else { 0.0 }).collect()
                }
                None => d.to_vec(),
            };
            let dm = drop(&dx, &c.masks[1]);
            let (fc2_in, fc2_w) = &c.gemms[3];
            let (dact, dw2, db2) = self.linear_backward(4 * l + 3, &dm, fc2_in, fc2_w, [t, h, f], &mut amaxes);
            let dpre = par_fill(dact.len(), |i| dact[i] * dgelu(c.pre[i], c.tanh[i]));
            let (fc1_in, fc1_w) = &c.gemms[2];
            let (dln2, dw1, db1) = self.linear_backward(4 * l + 2, &dpre, fc1_in, fc1_w, [t, f, h], &mut amaxes);
            let (dn2, dg2, dbe2) = self.norm(self.lp(l, 6), self.lp(l, 7)).backward(&dln2, &c.h1);
            let dh1: Vec<f32> = dx.iter().zip(&dn2).map(|(a, b)| a + b).collect();
            let da = drop(&dh1, &c.masks[0]);
            let (proj_in, proj_w) = &c.gemms[1];
            let (d_o, dwp, dbp) = self.linear_backward(4 * l + 1, &da, proj_in, proj_w, [t, h, h], &mut amaxes);
            let dqkv = attention_backward(&c.qkv, &c.probs, &d_o, s, b, heads, h / heads);
            let (qkv_in, qkv_w) = &c.gemms[0];
            let (dln1, dwqkv, dbqkv) = self.linear_backward(4 * l, &dqkv, qkv_in, qkv_w, [t, 3 * h, h], &mut amaxes);
            let (dn1, dg1, dbe1) = self.norm(self.lp(l, 0), self.lp(l, 1)).backward(&dln1, &c.x);
            dx = dh1.iter().zip(&dn1).map(|(a, b)| a + b).collect();
            let layer = [dg1, dbe1, dwqkv, dbqkv, dwp, dbp, dg2, dbe2, dw1, db1, dw2, db2];
            for (i, g) in layer.into_iter().enumerate() {
                grads[2 + PER_LAYER * l + i] = g;
            }
        }
        let pos: Vec<i32> = (0..t).map(|i| (i / b) as i32).collect();
        embedding::backward(&dx, &ctx.ids, &mut grads[0], DType::F32, h);
        embedding::backward(&dx, &pos, &mut grads[1], DType::F32, h);
        if let GemmPrecision::Fp8(recipe) = self.precision {
            // `amaxes` runs from the last FP8 GEMM down to layer 0's qkv.
            for (g, a) in self.fp8.iter_mut().rev().zip(&amaxes) {
                g.bwd.record(&[*a], recipe.amax_history_len);
                g.bwd.update(&recipe);
            }
        }
        Ok(self.params.iter().zip(grads).map(|(p, g)| (p.name.clone(), g)).collect())
    }

    /// `(dx, dw, dbias)` of GEMM `g` (`[t, out, in]`) for `dy` with the forward's cast operands:
    /// `dy` cast as the backward reads it (its amax added to `amaxes` under FP8), `dbias` from
    /// the uncast `dy`.
    fn linear_backward(
        &self,
        g: usize,
        dy: &[f32],
        x: &[f32],
        w: &[f32],
        [t, n_out, n_in]: [usize; 3],
        amaxes: &mut Vec<f32>,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let c = match self.precision {
            GemmPrecision::F32 => Cast::Exact,
            GemmPrecision::Bf16 => Cast::Bf16,
            GemmPrecision::Fp8(_) if !self.fp8_gemm(g) => Cast::Bf16,
            GemmPrecision::Fp8(_) => {
                amaxes.push(amax(dy));
                let s = &self.fp8[g].bwd;
                Cast::Fp8(s.dtype, s.scale[0])
            }
        };
        let dyq = cast(dy, c);
        let mut dx = vec![0.0; t * n_in];
        gemm(t, n_out, n_in, View::rows(&dyq, n_out), View::rows(w, n_in), 0.0, &mut dx);
        let mut dw = vec![0.0; n_out * n_in];
        gemm(n_out, t, n_in, View::t(&dyq, n_out), View::rows(x, n_in), 0.0, &mut dw);
        (dx, dw, column_sums(dy, n_out))
    }
}

/// Causal attention over `qkv: [s·b, 3·heads·d]` (rows `[q | k | v]`, head `j` at columns
/// `j·d..`): the output `[s·b, heads·d]` and each `(sequence, head)`'s probabilities `[s, s]`.
fn attention_forward(qkv: &[f32], s: usize, b: usize, heads: usize, d: usize) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (hd, w) = (heads * d, 3 * heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let blocks: Vec<(Vec<f32>, Vec<f32>)> = (0..b * heads)
        .into_par_iter()
        .map(|task| {
            let (j, hh) = (task / heads, task % heads);
            let col = |part: usize| &qkv[j * w + part * hd + hh * d..];
            let mut p = vec![0.0; s * s];
            gemm(
                s,
                d,
                s,
                View { data: col(0), rs: b * w, cs: 1 },
                View { data: col(1), rs: 1, cs: b * w },
                0.0,
                &mut p,
            );
            for (i, row) in p.chunks_exact_mut(s).enumerate() {
                let m = row[..=i].iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
                let mut sum = 0.0f32;
                for v in &mut row[..=i] {
                    *v = (*v * scale - m).exp();
                    sum += *v;
                }
                row[..=i].iter_mut().for_each(|v| *v /= sum);
                row[i + 1..].fill(0.0);
            }
            let mut o = vec![0.0; s * d];
            gemm(s, s, d, View::rows(&p, s), View { data: col(2), rs: b * w, cs: 1 }, 0.0, &mut o);
            (o, p)
        })
        .collect();
    let mut out = vec![0.0; s * b * hd];
    let mut probs = Vec::with_capacity(blocks.len());
    for (task, (o, p)) in blocks.into_iter().enumerate() {
        let (j, hh) = (task / heads, task % heads);
        for (i, row) in o.chunks_exact(d).enumerate() {
            let at = (i * b + j) * hd + hh * d;
            out[at..at + d].copy_from_slice(row);
        }
        probs.push(p);
    }
    (out, probs)
}

/// The gradient `[s·b, 3·heads·d]` of `qkv` for `d_o: [s·b, heads·d]`, from the forward's
/// probabilities.
fn attention_backward(
    qkv: &[f32],
    probs: &[Vec<f32>],
    d_o: &[f32],
    s: usize,
    b: usize,
    heads: usize,
    d: usize,
) -> Vec<f32> {
    let (hd, w) = (heads * d, 3 * heads * d);
    let scale = 1.0 / (d as f32).sqrt();
    let blocks: Vec<[Vec<f32>; 3]> = (0..b * heads)
        .into_par_iter()
        .map(|task| {
            let (j, hh) = (task / heads, task % heads);
            let col = |part: usize| &qkv[j * w + part * hd + hh * d..];
            let dov = View { data: &d_o[j * hd + hh * d..], rs: b * hd, cs: 1 };
            let p = &probs[task];
            let mut dp = vec![0.0; s * s];
            gemm(s, d, s, dov, View { data: col(2), rs: 1, cs: b * w }, 0.0, &mut dp);
            let mut dv = vec![0.0; s * d];
            gemm(s, s, d, View::t(p, s), dov, 0.0, &mut dv);
            // dS = P ∘ (dP − rowsum(P ∘ dP)), times the softmax scale.
            for (ds, p) in dp.chunks_exact_mut(s).zip(p.chunks_exact(s)) {
                let dot: f32 = ds.iter().zip(p).map(|(a, b)| a * b).sum();
                ds.iter_mut().zip(p).for_each(|(g, &p)| *g = p * (*g - dot) * scale);
            }
            let mut dq = vec![0.0; s * d];
            gemm(s, s, d, View::rows(&dp, s), View { data: col(1), rs: b * w, cs: 1 }, 0.0, &mut dq);
            let mut dk = vec![0.0; s * d];
            gemm(s, s, d, View::t(&dp, s), View { data: col(0), rs: b * w, cs: 1 }, 0.0, &mut dk);
            [dq, dk, dv]
        })
        .collect();
    let mut dqkv = vec![0.0; s * b * w];
    for (task, parts) in blocks.iter().enumerate() {
        let (j, hh) = (task / heads, task % heads);
        for (part, g) in parts.iter().enumerate() {
            for (i, row) in g.chunks_exact(d).enumerate() {
                let at = (i * b + j) * w + part * hd + hh * d;
                dqkv[at..at + d].copy_from_slice(row);
            }
        }
    }
    dqkv
}

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
}

/// AdamW over a [`GptRef`]'s parameters with the GPU optimizer's per-element arithmetic
/// ([`super::optimizer::adamw_step`]); the f32 parameters are the master weights.
#[derive(Debug, Clone)]
pub struct GptAdamW {
    cfg: GptAdamWConfig,
    exp_avg: Vec<Vec<f32>>,
    exp_avg_sq: Vec<Vec<f32>>,
    step: u64,
}

/// What one [`GptAdamW::step`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GptStepStats {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f32,
    /// The clip coefficient applied (1 without clipping).
    pub clip_coef: f32,
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
        self.step += 1;
        let (beta1, beta2) = self.cfg.betas;
        for (((p, (_, g)), m), v) in model.params.iter_mut().zip(grads).zip(&mut self.exp_avg).zip(&mut self.exp_avg_sq)
        {
            let weight_decay = if p.kind == ParamKind::Weight { self.cfg.weight_decay } else { 0.0 };
            let hyper = AdamWHyper { lr, beta1, beta2, eps: self.cfg.eps, weight_decay, step: self.step };
            adamw_step(&AdamWScalars::new(&hyper), clip, g, &mut p.value, m, v, DType::F32);
        }
        Ok(GptStepStats { grad_norm, clip_coef: clip })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::round_to;

    fn micro() -> GptConfig {
        GptConfig {
            vocab_size: 16,
            hidden_size: 32,
            num_layers: 1,
            num_attention_heads: 2,
            ffn_hidden_size: 64,
            seq_length: 8,
            hidden_dropout: 0.0,
            params_dtype: DType::F32,
            seed: 3,
            fp8_lm_head: true,
        }
    }

    /// A repeating pattern `[s, b]`: ids and the next tokens.
    fn pattern(s: usize, b: usize, vocab: usize) -> (Vec<i32>, Vec<i32>) {
        let tok = |i: usize, j: usize| ((3 * i + 5 * j) % vocab) as i32;
        let ids = (0..s * b).map(|t| tok(t / b, t % b)).collect();
        let targets = (0..s * b).map(|t| tok(t / b + 1, t % b)).collect();
        (ids, targets)
    }

    #[test]
    fn fast_casts_match_the_reference_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e-9];
        let random = (0..200_000).map(|_| f32::from_bits(rand::Rng::random::<u32>(&mut rng)));
        for x in specials.into_iter().chain(random).filter(|x| !x.is_nan()) {
            for dtype in [DType::E4M3, DType::E5M2] {
                assert_eq!(Fp8Grid::new(dtype).round(x).to_bits(), round_to(dtype, x).to_bits(), "{dtype} {x:e}");
            }
        }
        assert!(Fp8Grid::new(DType::E4M3).round(f32::NAN).is_nan());
        for x in [0.0f32, 0.3, -1.7, 2.5, 8.0, -30.0] {
            assert!((0.5 * x * (1.0 + gelu_tanh(x)) - super::super::activation::gelu(x)).abs() < 1e-6);
            assert!((dgelu(x, gelu_tanh(x)) - super::super::activation::dgelu(x)).abs() < 1e-6);
        }
    }

    #[test]
    fn layout_matches_the_gpu_parameter_count() {
        for cfg in [micro(), GptConfig::tiny()] {
            let m = GptRef::new(&cfg).unwrap();
            assert_eq!(m.num_parameters(), cfg.num_parameters());
            assert_eq!(m.params()[2].name, "layers.0.self_attention.layernorm_qkv.layer_norm_weight");
            assert_eq!(m.params().last().unwrap().name, "lm_head.weight");
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let cfg = micro();
        let (s, b) = (8, 2);
        let (ids, mut targets) = pattern(s, b, cfg.vocab_size);
        targets[3] = IGNORE_INDEX;
        let mut model = GptRef::new(&cfg).unwrap();
        let (_, ctx) = model.forward_loss(&ids, &targets, s, b).unwrap();
        let grads = model.backward(ctx).unwrap();
        let eps = 1e-2f32;
        for (pi, (name, g)) in grads.iter().enumerate() {
            // The two largest-gradient elements of every parameter.
            let mut order: Vec<usize> = (0..g.len()).collect();
            order.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
            for &i in &order[..2] {
                let at = |x: f32| {
                    let mut m = model.clone();
                    m.params[pi].value[i] = x;
                    f64::from(m.loss(&ids, &targets, s, b).unwrap())
                };
                let x0 = model.params[pi].value[i];
                let fd = ((at(x0 + eps) - at(x0 - eps)) / (2.0 * f64::from(eps))) as f32;
                assert!(
                    (fd - g[i]).abs() <= 0.03 * g[i].abs() + 2e-4,
                    "{name}[{i}]: backward {}, finite difference {fd}",
                    g[i]
                );
            }
        }
    }

    fn train_losses(precision: GemmPrecision, dropout: f32, steps: usize) -> Vec<f32> {
        let cfg = GptConfig { hidden_dropout: dropout, ..micro() };
        let (s, b) = (8, 2);
        let (ids, targets) = pattern(s, b, cfg.vocab_size);
        let mut model = GptRef::new(&cfg).unwrap();
        model.set_precision(precision).unwrap();
        let adam_cfg = GptAdamWConfig { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, max_grad_norm: Some(1.0) };
        let mut opt = GptAdamW::new(&model, adam_cfg);
        (0..steps)
            .map(|_| {
                let (loss, ctx) = model.forward_loss(&ids, &targets, s, b).unwrap();
                let grads = model.backward(ctx).unwrap();
                opt.step(&mut model, &grads, 1e-2).unwrap();
                loss
            })
            .collect()
    }

    #[test]
    fn adamw_learns_a_repeating_pattern_in_every_precision() {
        let fp8 = GemmPrecision::Fp8(DelayedScaling { amax_history_len: 16, ..Default::default() });
        for (precision, dropout) in [(GemmPrecision::F32, 0.0), (GemmPrecision::Bf16, 0.1), (fp8, 0.1)] {
            let losses = train_losses(precision, dropout, 30);
            assert!(losses.iter().all(|l| l.is_finite()), "{precision:?}: {losses:?}");
            assert!(losses[29] < 0.5 * losses[0], "{precision:?}: {} → {}", losses[0], losses[29]);
        }
    }

    #[test]
    fn bf16_and_fp8_gemms_perturb_the_loss_slightly() {
        let (s, b) = (8, 2);
        let (ids, targets) = pattern(s, b, 16);
        let mut m = GptRef::new(&micro()).unwrap();
        let exact = m.loss(&ids, &targets, s, b).unwrap();
        m.set_precision(GemmPrecision::Bf16).unwrap();
        let bf16 = m.loss(&ids, &targets, s, b).unwrap();
        m.set_precision(GemmPrecision::Fp8(DelayedScaling::default())).unwrap();
        // The first forward casts with scale 1 and records the amaxes; the second uses scales
        // fitted to them.
        m.forward_loss(&ids, &targets, s, b).unwrap();
        let fp8 = m.loss(&ids, &targets, s, b).unwrap();
        let (d_bf16, d_fp8) = ((bf16 - exact).abs(), (fp8 - exact).abs());
        assert!(d_bf16 > 0.0 && d_bf16 < 1e-2 * exact, "bf16 {bf16} vs exact {exact}");
        assert!(d_fp8 > d_bf16 && d_fp8 < 5e-2 * exact, "fp8 {fp8} vs exact {exact} (bf16 {bf16})");
    }

    #[test]
    fn bad_inputs_are_errors() {
        let mut m = GptRef::new(&micro()).unwrap();
        let (ids, targets) = pattern(8, 2, 16);
        assert!(matches!(m.forward_loss(&ids, &targets, 8, 3), Err(Error::Shape { .. })));
        assert!(matches!(m.forward_loss(&ids, &targets, 16, 1), Err(Error::Shape { .. })));
        let mut bad = ids.clone();
        bad[0] = 16;
        assert!(matches!(m.forward_loss(&bad, &targets, 8, 2), Err(Error::Argument { .. })));
        let e = GptRef::new(&GptConfig { num_attention_heads: 3, ..micro() }).unwrap_err();
        assert!(e.to_string().contains("num_attention_heads"), "{e}");
        let named: Vec<(String, Vec<f32>)> = m.params().iter().map(|p| (p.name.clone(), p.value.clone())).collect();
        assert_eq!(GptRef::from_named(&micro(), named.clone()).unwrap().params(), m.params());
        let e = GptRef::from_named(&micro(), named[1..].to_vec()).unwrap_err();
        assert!(e.to_string().contains("missing parameters: embedding.weight"), "{e}");
        let mut other = GptRef::new(&GptConfig { num_layers: 2, ..micro() }).unwrap();
        let (_, ctx) = m.forward_loss(&ids, &targets, 8, 2).unwrap();
        assert!(matches!(other.backward(ctx), Err(Error::Context { .. })));
        let (_, ctx) = m.forward_loss(&ids, &targets, 8, 2).unwrap();
        let grads = m.clone().backward(ctx).unwrap();
        let mut opt = GptAdamW::new(
            &other,
            GptAdamWConfig { betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.0, max_grad_norm: None },
        );
        assert!(matches!(opt.step(&mut m, &grads, 1e-3), Err(Error::Config { .. })));
    }
}
