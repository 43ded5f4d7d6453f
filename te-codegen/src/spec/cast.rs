//! Family 1: element-wise FP8 quantize (with amax and scale_inv), dequantize, and amax alone.

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Which element-wise cast a [`CastSpec`] renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CastKind {
    /// `q = fp8(x * scale)` (round to nearest even, saturate to ±max, NaN kept), atomically
    /// maxes `|x|` into `amax`, writes `scale_inv = 1 / scale`.
    Quantize,
    /// `y = q * scale_inv` into a high-precision type.
    Dequantize,
    /// `amax = max(amax, max |x|)` with no output; the first step of current scaling.
    Amax,
}

/// Element-wise cast over a flat tensor of `n` elements (`n` is a run-time argument).
///
/// Kernel arguments: [`CastSpec::QUANTIZE_ARGS`], [`CastSpec::DEQUANTIZE_ARGS`], [`CastSpec::AMAX_ARGS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CastSpec {
    /// Which cast.
    pub kind: CastKind,
    /// Input element type.
    pub input: DType,
    /// Output element type (equal to `input` for [`CastKind::Amax`]).
    pub output: DType,
    /// Elements per thread per vector access (16 bytes of the wider type).
    pub vec: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl CastSpec {
    /// Arguments of [`CastKind::Quantize`].
    pub const QUANTIZE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[n]` input, f32/bf16/f16"),
        KernelArg::write("q", "void* __restrict__", "`[n]` FP8 codes"),
        KernelArg::read("scale_ptr", "const float* __restrict__", "`[1]` scale"),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax, maxed with `max |x|`"),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "`[1]` `1 / scale`"),
        KernelArg::scalar("n", "u64", "elements"),
    ];

    /// Arguments of [`CastKind::Dequantize`].
    pub const DEQUANTIZE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("q", "const void* __restrict__", "`[n]` FP8 codes"),
        KernelArg::write("y", "void* __restrict__", "`[n]` output, f32/bf16/f16"),
        KernelArg::read("scale_inv_ptr", "const float* __restrict__", "`[1]` scale_inv"),
        KernelArg::scalar("n", "u64", "elements"),
    ];

    /// Arguments of [`CastKind::Amax`].
    pub const AMAX_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[n]` input, f32/bf16/f16"),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax, maxed with `max |x|` (NaN skipped)"),
        KernelArg::scalar("n", "u64", "elements"),
    ];

    /// Quantize `input` (f32/bf16/f16) to `output` (E4M3/E5M2) with the default tuning.
    pub fn quantize(input: DType, output: DType, arch: Arch) -> Self {
        Self { kind: CastKind::Quantize, input, output, vec: 16 / input.size_bytes(), threads: 256, arch }
    }

    /// Dequantize `input` (E4M3/E5M2) to `output` (f32/bf16/f16) with the default tuning.
    pub fn dequantize(input: DType, output: DType, arch: Arch) -> Self {
        Self { kind: CastKind::Dequantize, input, output, vec: 16 / output.size_bytes(), threads: 256, arch }
    }

    /// Amax of an `input` tensor with the default tuning.
    pub fn amax(input: DType, arch: Arch) -> Self {
        Self { kind: CastKind::Amax, input, output: input, vec: 16 / input.size_bytes(), threads: 256, arch }
    }
}

impl Family for CastSpec {
    fn family(&self) -> &'static str {
        match self.kind {
            CastKind::Quantize => "quantize",
            CastKind::Dequantize => "dequantize",
            CastKind::Amax => "amax",
        }
    }
    fn template(&self) -> &'static str {
        "cast.cu.tera"
    }
    fn name_parts(&self) -> String {
        match self.kind {
            CastKind::Amax => format!("{}_v{}_t{}", self.input, self.vec, self.threads),
            _ => format!("{}_{}_v{}_t{}", self.input, self.output, self.vec, self.threads),
        }
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match self.kind {
            CastKind::Quantize => Self::QUANTIZE_ARGS,
            CastKind::Dequantize => Self::DEQUANTIZE_ARGS,
            CastKind::Amax => Self::AMAX_ARGS,
        }
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("kind", self.family());
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("vec", &self.vec);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        match self.kind {
            CastKind::Quantize if !(self.input.is_high_precision() && self.output.is_fp8()) => {
                return Err(format!(
                    "quantize goes from f32/bf16/f16 to e4m3/e5m2, not {} → {}",
                    self.input, self.output
                ))
            }
            CastKind::Dequantize if !(self.input.is_fp8() && self.output.is_high_precision()) => {
                return Err(format!(
                    "dequantize goes from e4m3/e5m2 to f32/bf16/f16, not {} → {}",
                    self.input, self.output
                ))
            }
            CastKind::Amax if !self.input.is_high_precision() || self.output != self.input => {
                return Err(format!(
                    "amax takes an f32/bf16/f16 input (output = input), not {} → {}",
                    self.input, self.output
                ))
            }
            _ => {}
        }
        check_pow2("vec", self.vec, 1, 16)?;
        check_threads(self.threads)
    }
}

/// `v` must be a power of two in `[lo, hi]`.
pub(crate) fn check_pow2(what: &str, v: usize, lo: usize, hi: usize) -> Result<(), String> {
    if v.is_power_of_two() && (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(format!("{what} = {v} must be a power of two in [{lo}, {hi}]"))
    }
}

/// A block size must be a multiple of 32 in `[32, 1024]`.
pub(crate) fn check_threads(t: usize) -> Result<(), String> {
    if t % 32 == 0 && (32..=1024).contains(&t) {
        Ok(())
    } else {
        Err(format!("threads = {t} must be a multiple of 32 in [32, 1024]"))
    }
}
