//! [`HostCast`]: how a GEMM operand is read on the host, the fake quantization the CPU twins
//! (`te_models::cpu`) emulate the GPU's FP8 GEMMs with. Recipes say which cast each operand gets
//! ([`super::ScalingRecipe::host_forward_casts`], [`super::ScalingRecipe::host_grad_casts`]);
//! the casts equal [`te_runtime::numerics::round_to`] bit for bit, the scales follow
//! `te_reference::scaling` (TE `common/recipe/current_scaling.cu`) and the blockwise casts are
//! `te_reference::block_scaling`'s.

use half::bf16;
use rayon::prelude::*;
use te_codegen::DType;
use te_reference::block_scaling::{dequantize_blockwise, quantize_blockwise, BlockParams, BlockTiling};
use te_reference::scaling::current_scale;

/// How one GEMM operand is cast before an f32 GEMM on the host.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostCast {
    /// Exact f32.
    Exact,
    /// Rounded to BF16 (nearest even), as a BF16 model's GEMMs read it.
    Bf16,
    /// Per-tensor FP8 with a given scale: `fp8(x · scale) / scale` (delayed scaling's slot scale).
    Fp8 {
        /// E4M3 or E5M2.
        dtype: DType,
        /// The scale the codes were cast with.
        scale: f32,
    },
    /// Per-tensor FP8 with the scale of the operand's own amax (current scaling: TE's
    /// `scale = fp8_max / max(amax, amax_epsilon)`, 1 when that amax is 0, inf or NaN, rounded
    /// down to a power of 2 with `power_2_scale`; `te_reference::scaling::current_scale`).
    Current {
        /// E4M3 or E5M2.
        dtype: DType,
        /// Floor of the amax.
        amax_epsilon: f32,
        /// Scales rounded down to powers of 2.
        power_2_scale: bool,
    },
    /// Blockwise FP8 of a `[rows, cols]` operand (`te_reference::block_scaling`).
    Block {
        /// The blocks.
        tiling: BlockTiling,
        /// Rows of the operand.
        rows: usize,
        /// Columns of the operand.
        cols: usize,
        /// The block scale rule.
        params: BlockParams,
    },
}

impl HostCast {
    /// `x` as the GEMM reads it (parallel over the rayon pool).
    ///
    /// # Panics
    /// For [`HostCast::Block`], when `x` is not `rows · cols` long or the dtype is not FP8
    /// (caller bugs, as `te_reference::block_scaling::quantize_blockwise`).
    pub fn apply(&self, x: &[f32]) -> Vec<f32> {
        match *self {
            HostCast::Exact => x.to_vec(),
            HostCast::Bf16 => par_fill(x.len(), |i| bf16::from_f32(x[i]).to_f32()),
            HostCast::Fp8 { dtype, scale } => {
                let (grid, scale_inv) = (Fp8Grid::new(dtype), 1.0 / scale);
                par_fill(x.len(), |i| grid.round(x[i] * scale) * scale_inv)
            }
            HostCast::Current { dtype, amax_epsilon, power_2_scale } => {
                let fp8_max = dtype.fp8_max().unwrap_or(1.0);
                let (scale, _) = current_scale(host_amax(x), fp8_max, amax_epsilon, power_2_scale);
                HostCast::Fp8 { dtype, scale }.apply(x)
            }
            HostCast::Block { tiling, rows, cols, params } => {
                let q = quantize_blockwise(x, rows, cols, tiling, &params);
                dequantize_blockwise(&q, rows, cols, tiling, params.dtype)
            }
        }
    }
}

/// The largest `|x|` (0 for an empty slice, NaN ignored), reduced over the rayon pool.
pub fn host_amax(x: &[f32]) -> f32 {
    x.par_chunks(1 << 14).map(|c| c.iter().fold(0.0f32, |a, v| a.max(v.abs()))).reduce(|| 0.0, f32::max)
}

/// `[f(0), ..., f(n - 1)]`, filled in chunks over the rayon pool.
fn par_fill(n: usize, f: impl Fn(usize) -> f32 + Sync) -> Vec<f32> {
    const CHUNK: usize = 1 << 14;
    let mut out = vec![0.0; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, o)| {
        o.iter_mut().enumerate().for_each(|(i, o)| *o = f(c * CHUNK + i));
    });
    out
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use te_runtime::numerics::round_to;

    #[test]
    fn fast_casts_match_the_reference_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let specials = [0.0, -0.0, f32::INFINITY, f32::NEG_INFINITY, 448.0, 464.0, 480.0, 57344.0, 61440.0, 1e-9];
        let random = (0..200_000).map(|_| f32::from_bits(rng.random::<u32>()));
        for x in specials.into_iter().chain(random).filter(|x| !x.is_nan()) {
            for dtype in [DType::E4M3, DType::E5M2] {
                assert_eq!(Fp8Grid::new(dtype).round(x).to_bits(), round_to(dtype, x).to_bits(), "{dtype} {x:e}");
            }
        }
        assert!(Fp8Grid::new(DType::E4M3).round(f32::NAN).is_nan());
    }

    /// Current scaling by hand: the scale from the operand's own amax (TE's rules: epsilon
    /// floor, power of 2, 1 for a zero or non-finite amax), then the per-tensor cast.
    #[test]
    fn current_casts_scale_by_their_own_amax() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let x: Vec<f32> = (0..3000).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        let a = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        for (dtype, eps, pow2) in [(DType::E4M3, 0.0, false), (DType::E5M2, 0.0, true), (DType::E4M3, 10.0, false)] {
            let fp8_max = dtype.fp8_max().unwrap();
            let mut scale = fp8_max / a.max(eps);
            if pow2 {
                scale = f32::from_bits(scale.to_bits() & 0xff80_0000);
            }
            let want: Vec<f32> = x.iter().map(|&v| round_to(dtype, v * scale) * (1.0 / scale)).collect();
            let got = HostCast::Current { dtype, amax_epsilon: eps, power_2_scale: pow2 }.apply(&x);
            assert_eq!(got, want, "{dtype} epsilon {eps} power_2 {pow2}");
            assert_eq!(got, HostCast::Fp8 { dtype, scale }.apply(&x));
        }
        // A zero or non-finite amax: scale 1.
        let cur = HostCast::Current { dtype: DType::E4M3, amax_epsilon: 0.0, power_2_scale: false };
        assert_eq!(cur.apply(&[0.0; 4]), [0.0; 4]);
        let inf = [f32::INFINITY, 1.5, -600.0];
        assert_eq!(cur.apply(&inf), [448.0, 1.5, -448.0]);
        assert_eq!(host_amax(&[f32::NAN, -2.0]), 2.0);
        assert_eq!(HostCast::Bf16.apply(&[1.0 + 1e-3]), [bf16::from_f32(1.0 + 1e-3).to_f32()]);
        assert_eq!(HostCast::Exact.apply(&[1.0 + 1e-3]), [1.0 + 1e-3]);
    }
}
