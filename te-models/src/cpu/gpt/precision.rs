//! GEMM-input emulation of [`GptRef`]: each GEMM reads its operands rounded to BF16, or
//! fake-quantized to FP8 with delayed scaling per operand as TE's `DelayedScaling` does (amax
//! history, `max` or newest, margin; initial scale 1; the update of
//! [`te_reference::scaling::delayed_update`]). The casts equal [`te_runtime::numerics::round_to`]
//! bit for bit; the GEMMs themselves stay f32.

use super::math::par_fill;
use super::GptRef;
use half::bf16;
use rayon::prelude::*;
use te_codegen::DType;
use te_nn::fp8::{DelayedScaling, Float8BlockScaling, ScalingSnapshot};
use te_reference::block_scaling::{dequantize_blockwise, quantize_blockwise, BlockParams, BlockTiling};
use te_reference::scaling::{delayed_update, HostScalingGroup};
use te_runtime::Result;

/// How the GEMM inputs are rounded before each f32 GEMM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GemmPrecision {
    /// Exact f32 inputs (the check against a GPU model built with `params_dtype: F32`).
    F32,
    /// Inputs rounded to BF16 (round to nearest even), as a BF16 model's GEMMs read them.
    Bf16,
    /// Inputs fake-quantized to FP8 with delayed scaling per operand, as under
    /// [`te_nn::fp8::fp8_autocast`] with this recipe.
    Fp8(DelayedScaling),
    /// Inputs fake-quantized to FP8 blockwise ([`Float8BlockScaling`], DeepSeek-V3's recipe):
    /// the forward's input in 1×128 tiles along its features and the weight in 128×128 blocks
    /// (the recipe's block dims); the backward's output gradient in 1×128 tiles along its
    /// features for the dgrad GEMM and along the tokens for the wgrad GEMM, which reads the
    /// forward input quantized along the tokens too ([`te_reference::block_scaling`]:
    /// TE re-quantizes the transposed operands rather than transposing codes). Stateless.
    Fp8Block(Float8BlockScaling),
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

impl Scaling {
    /// The state as a checkpoint holds it, with `slots ≥ n` slots (the device model's forward
    /// state has an output slot no GEMM records: scale 1, zero history).
    fn snapshot(&self, slots: usize, history_len: usize) -> ScalingSnapshot {
        let pad = slots.saturating_sub(self.scale.len());
        let mut snap = ScalingSnapshot {
            amax_history: self.history.clone(),
            scale: self.scale.clone(),
            scale_inv: self.scale_inv.clone(),
            history_len,
        };
        snap.amax_history.extend(std::iter::repeat_n(0.0, pad * history_len));
        snap.scale.extend(std::iter::repeat_n(1.0, pad));
        snap.scale_inv.extend(std::iter::repeat_n(1.0, pad));
        snap
    }

    /// Takes the first slots of `snap` (a checkpoint's), its histories fitted to
    /// `history_len` as the device state's `conform` does (the newest entries kept, zeros
    /// added).
    fn restore(&mut self, snap: &ScalingSnapshot, history_len: usize) {
        let n = self.scale.len();
        let old = snap.history_len.max(1);
        self.history = vec![0.0; n * history_len];
        for (dst, src) in self.history.chunks_exact_mut(history_len).zip(snap.amax_history.chunks_exact(old)) {
            let k = old.min(history_len);
            dst[..k].copy_from_slice(&src[..k]);
        }
        self.scale = snap.scale.iter().copied().take(n).collect();
        self.scale_inv = snap.scale_inv.iter().copied().take(n).collect();
    }

    /// Back to a fresh state: scale 1, zero history.
    fn reset(&mut self) {
        self.history.iter_mut().for_each(|h| *h = 0.0);
        self.scale.iter_mut().for_each(|s| *s = 1.0);
        self.scale_inv.iter_mut().for_each(|s| *s = 1.0);
    }
}

/// The FP8 state of one GEMM: input and weight (forward), output gradient (backward).
#[derive(Debug, Clone)]
pub(super) struct GemmScaling {
    fwd: Scaling,
    bwd: Scaling,
}

impl GemmScaling {
    /// `[forward, backward]` as a checkpoint holds them: `[fwd_slots, 1]` slots.
    pub(super) fn snapshots(&self, fwd_slots: usize, history_len: usize) -> [ScalingSnapshot; 2] {
        [self.fwd.snapshot(fwd_slots, history_len), self.bwd.snapshot(1, history_len)]
    }

    /// Restores the forward (`0`) or backward (`1`) state from a checkpoint's snapshot, or
    /// resets it (`None`: the checkpoint holds none).
    pub(super) fn restore(&mut self, direction: usize, snap: Option<&ScalingSnapshot>, history_len: usize) {
        let s = if direction == 0 { &mut self.fwd } else { &mut self.bwd };
        match snap {
            Some(snap) => s.restore(snap, history_len),
            None => s.reset(),
        }
    }
}

/// How one GEMM operand is cast.
#[derive(Debug, Clone, Copy)]
pub(super) enum Cast {
    Exact,
    Bf16,
    Fp8(DType, f32),
    /// Blockwise FP8 of a `[rows, cols]` operand.
    Block {
        tiling: BlockTiling,
        rows: usize,
        cols: usize,
        params: BlockParams,
    },
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

/// The operand `x` as the GEMM reads it.
pub(super) fn cast(x: &[f32], c: Cast) -> Vec<f32> {
    match c {
        Cast::Exact => x.to_vec(),
        Cast::Bf16 => par_fill(x.len(), |i| bf16::from_f32(x[i]).to_f32()),
        Cast::Fp8(dtype, scale) => {
            let (grid, scale_inv) = (Fp8Grid::new(dtype), 1.0 / scale);
            par_fill(x.len(), |i| grid.round(x[i] * scale) * scale_inv)
        }
        Cast::Block { tiling, rows, cols, params } => {
            let q = quantize_blockwise(x, rows, cols, tiling, &params);
            dequantize_blockwise(&q, rows, cols, tiling, params.dtype)
        }
    }
}

/// The tiling of an operand quantized with block dimension `dim` (1: 1×128 tiles along its
/// rows, or `across` the rows when the GEMM contracts over them; 2: 128×128 blocks).
fn tiling(dim: usize, across: bool) -> BlockTiling {
    match (dim, across) {
        (2, _) => BlockTiling::Square,
        (_, false) => BlockTiling::Rows,
        (_, true) => BlockTiling::Columns,
    }
}

/// The blockwise cast of a `[rows, cols]` operand under `r` with block dimension `dim`.
fn block(r: &Float8BlockScaling, dim: usize, across: bool, [rows, cols]: [usize; 2], dtype: DType) -> Cast {
    let params = BlockParams {
        dtype,
        epsilon: r.amax_epsilon,
        power_2: r.power_2_scale,
        // The GPU model's activations, weights and gradients are bf16.
        value_for_inf: half::bf16::MAX.to_f32(),
    };
    Cast::Block { tiling: tiling(dim, across), rows, cols, params }
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

    /// [`te_runtime::numerics::round_to`]`(dtype, x)` for the FP8 `dtype` (the GPU's
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

/// The largest `|x|` (0 for an empty slice), reduced over the rayon pool.
fn amax(x: &[f32]) -> f32 {
    x.par_chunks(1 << 14).map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs()))).reduce(|| 0.0, f32::max)
}

impl GptRef {
    /// The GEMM input precision.
    pub fn precision(&self) -> GemmPrecision {
        self.precision
    }

    /// Sets the GEMM input precision; for FP8, starts fresh delayed-scaling state (scales 1,
    /// empty histories), as a new GPU model has.
    ///
    /// # Errors
    /// [`te_runtime::Error::Recipe`] for an invalid FP8 recipe (history length 0, a margin that is not
    /// finite).
    pub fn set_precision(&mut self, precision: GemmPrecision) -> Result<()> {
        self.fp8 = match &precision {
            GemmPrecision::Fp8(recipe) => {
                te_nn::fp8::Recipe::Delayed(*recipe).validate()?;
                let gemm = GemmScaling {
                    fwd: Scaling::new(2, recipe.fp8_format.forward_dtype(), recipe),
                    bwd: Scaling::new(1, recipe.fp8_format.backward_dtype(), recipe),
                };
                // The LM head has FP8 state only when it runs in FP8 (`fp8_lm_head`).
                vec![gemm; 4 * self.cfg.num_layers + usize::from(self.cfg.fp8_lm_head)]
            }
            GemmPrecision::Fp8Block(recipe) => {
                recipe.validate()?;
                Vec::new()
            }
            _ => Vec::new(),
        };
        self.precision = precision;
        Ok(())
    }

    /// Whether GEMM `g` runs in FP8: under FP8, every layer GEMM, and the LM head (the last)
    /// only with `fp8_lm_head` (else in BF16, as on the GPU).
    pub(super) fn fp8_gemm(&self, g: usize) -> bool {
        let fp8_gemms = 4 * self.cfg.num_layers + usize::from(self.cfg.fp8_lm_head);
        match self.precision {
            GemmPrecision::Fp8(_) => g < self.fp8.len(),
            GemmPrecision::Fp8Block(_) => g < fp8_gemms,
            _ => false,
        }
    }

    /// The casts of GEMM `g`'s forward operands, input `[t, n_in]` and weight `[n_out, n_in]`,
    /// and of the input as the wgrad GEMM reads it (`None`: as the forward).
    fn forward_casts(&self, g: usize, [t, n_out, n_in]: [usize; 3]) -> ([Cast; 2], Option<Cast>) {
        match self.precision {
            GemmPrecision::F32 => ([Cast::Exact; 2], None),
            GemmPrecision::Bf16 => ([Cast::Bf16; 2], None),
            _ if !self.fp8_gemm(g) => ([Cast::Bf16; 2], None),
            GemmPrecision::Fp8(_) => {
                let s = &self.fp8[g].fwd;
                ([Cast::Fp8(s.dtype, s.scale[0]), Cast::Fp8(s.dtype, s.scale[1])], None)
            }
            GemmPrecision::Fp8Block(r) => {
                let dt = r.fp8_format.forward_dtype();
                let x = block(&r, r.x_block_scaling_dim, false, [t, n_in], dt);
                let w = block(&r, r.w_block_scaling_dim, false, [n_out, n_in], dt);
                let x_wgrad = block(&r, r.x_block_scaling_dim, true, [t, n_in], dt);
                ([x, w], Some(x_wgrad))
            }
        }
    }

    /// GEMM `g`'s operands (input `x` `[t, n_in]`, weight `w` `[n_out, n_in]`) as it reads
    /// them, their amaxes added to `amaxes` under delayed-scaling FP8.
    pub(super) fn gemm_operands(
        &self,
        g: usize,
        x: &[f32],
        w: &[f32],
        n_in: usize,
        amaxes: &mut Vec<[f32; 2]>,
    ) -> Operands {
        // FP8 GEMMs record their operands' amaxes; so does a calibration's high-precision pass
        // (`calibrate`: BF16 casts, the FP8 states kept).
        if g < self.fp8.len() {
            amaxes.push([amax(x), amax(w)]);
        }
        let dims = [x.len() / n_in.max(1), w.len() / n_in.max(1), n_in];
        let ([cx, cw], c_wgrad) = self.forward_casts(g, dims);
        Operands { x: cast(x, cx), w: cast(w, cw), x_wgrad: c_wgrad.map(|c| cast(x, c)) }
    }

    /// How GEMM `g`'s backward reads the output gradient `dy` `[t, n_out]`: for the dgrad GEMM
    /// and, when it differs, for the wgrad GEMM; its amax added to `amaxes` under
    /// delayed-scaling FP8.
    pub(super) fn grad_casts(&self, g: usize, dy: &[f32], n_out: usize, amaxes: &mut Vec<f32>) -> (Cast, Option<Cast>) {
        match self.precision {
            GemmPrecision::F32 => (Cast::Exact, None),
            GemmPrecision::Bf16 => (Cast::Bf16, None),
            _ if !self.fp8_gemm(g) => (Cast::Bf16, None),
            GemmPrecision::Fp8(_) => {
                amaxes.push(amax(dy));
                let s = &self.fp8[g].bwd;
                (Cast::Fp8(s.dtype, s.scale[0]), None)
            }
            GemmPrecision::Fp8Block(r) => {
                let (dt, dims) = (r.fp8_format.backward_dtype(), [dy.len() / n_out.max(1), n_out]);
                let d = r.grad_block_scaling_dim;
                (block(&r, d, false, dims, dt), Some(block(&r, d, true, dims, dt)))
            }
        }
    }

    /// TE's FP8 calibration (`fp8_autocast(calibrating=True)`) under FP8: `ids` `[s, b]` run
    /// through the evaluation forward with BF16 GEMM inputs, every FP8 GEMM's input and weight
    /// amaxes recorded, then the forward scales updated from them. What an FP8 inference of a
    /// model trained without FP8 (no scales of its own) starts from. Without FP8 it does nothing.
    ///
    /// # Errors
    /// As [`GptRef::logits`].
    pub fn calibrate(&mut self, ids: &[i32], s: usize, b: usize) -> Result<()> {
        let GemmPrecision::Fp8(recipe) = self.precision else { return Ok(()) };
        self.check_batch(ids, &vec![crate::gpt::IGNORE_INDEX; ids.len()], s, b)?;
        self.precision = GemmPrecision::Bf16;
        let amaxes = self.logits_of(ids, s, b, None, None).amaxes;
        self.precision = GemmPrecision::Fp8(recipe);
        self.update_forward_scaling(&amaxes);
        Ok(())
    }

    /// Under FP8, folds a forward's `[input, weight]` amaxes of every FP8 GEMM into the
    /// histories and updates the forward scales.
    pub(super) fn update_forward_scaling(&mut self, amaxes: &[[f32; 2]]) {
        if let GemmPrecision::Fp8(recipe) = self.precision {
            for (g, a) in self.fp8.iter_mut().zip(amaxes) {
                g.fwd.record(a, recipe.amax_history_len);
                g.fwd.update(&recipe);
            }
        }
    }

    /// Under FP8, folds a backward's output-gradient amaxes into the histories and updates the
    /// backward scales.
    pub(super) fn update_backward_scaling(&mut self, amaxes: &[f32]) {
        if let GemmPrecision::Fp8(recipe) = self.precision {
            // `amaxes` runs from the last FP8 GEMM down to layer 0's qkv.
            for (g, a) in self.fp8.iter_mut().rev().zip(amaxes) {
                g.bwd.record(&[*a], recipe.amax_history_len);
                g.bwd.update(&recipe);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use te_runtime::numerics::round_to;

    /// Calibration sets every FP8 GEMM's forward scales from a high-precision pass (the weight
    /// scale is `448 / amax(w)`), and brings the FP8 logits of a fresh model (scale 1: weights
    /// of std 0.023 near E4M3's subnormals) closer to the BF16 ones.
    #[test]
    fn calibration_sets_the_scales_from_a_high_precision_pass() {
        use crate::gpt::GptConfig;
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
        fp8.set_precision(GemmPrecision::Fp8(DelayedScaling::default())).unwrap();
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
        assert_eq!(fp8.fp8[0].fwd.scale[1], 448.0 / amax_w);
        assert!(fp8.fp8.iter().all(|g| g.fwd.scale.iter().all(|&s| s > 1.0)));
        // Without FP8 it does nothing.
        let before = bf16.clone();
        bf16.calibrate(&ids, 16, 2).unwrap();
        assert_eq!(bf16.logits(&ids, 16, 2).unwrap(), before.logits(&ids, 16, 2).unwrap());
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
    }
}
