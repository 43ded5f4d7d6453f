//! Family 10: dropout with a counter-based RNG (Philox4x32-10): the fused
//! `out = residual + dropout(x + bias)` of Megatron's `bias_dropout_add` (TE's hidden dropout
//! after the attention projection and fc2), plain dropout (attention probabilities), and the
//! backward from the saved keep mask (TE `common/dropout/dropout.cu`).

use super::cast::{check_pow2, check_threads};
use super::{ArgCond, Direction, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Dropout over a flat tensor of `n` elements (`n` and, with a bias, the row width `cols` are
/// run-time arguments), in chunks of 8 elements: one thread per chunk, one mask byte per chunk.
///
/// Random bits: element `i` takes word `i % 4` of the Philox4x32-10 block with key
/// `(seed_lo, seed_hi)` and counter `(q_lo, q_hi, offset_lo, offset_hi)`, `q = i / 4` (all
/// 32-bit words, little-endian halves of the u64s). It is kept iff that word `r` (32 bits) is
/// below `keep_threshold = min(2^32, ceil((1 - p) · 2^32))`, i.e. `r · 2^-32 < 1 - p`. A
/// threshold of 0 (`p = 1`) or `2^32` (`p = 0`) keeps none or all without running the RNG.
///
/// Forward, per element (f32, each operation rounded, no contraction): `v = x [+ bias[i % cols]]`,
/// `d = kept ? v · scale : 0`, `out = [residual +] d`, rounded once to `output`. Bit `i % 8` of
/// mask byte `i / 8` is 1 iff element `i` was kept; the bits past `n` in the last byte are 0.
/// Backward: `dx = kept ? dout · scale : 0`, rounded to `output`. `scale` is the f32
/// `1 / (1 - p)` (0 for `p = 1`), computed by the caller.
///
/// Entry points: [`DropoutSpec::FWD_ARGS`] (`bias` and `cols` iff [`DropoutSpec::bias`],
/// `residual` iff [`DropoutSpec::residual`]), [`DropoutSpec::BWD_ARGS`]; `x`/`dout` are of
/// `input`, `out`/`dx` of `output`, and `out` overlaps no input. Launch: a grid-stride
/// loop over the `n / 8` whole chunks (each thread loads `unroll` chunks before computing them,
/// any block count); the `n % 8` tail elements go to thread 0 of block 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DropoutSpec {
    /// Forward (random mask) or backward (saved mask).
    pub direction: Direction,
    /// Type of `x` and `bias` (forward) or `dout` (backward): f32, bf16 or f16.
    pub input: DType,
    /// Type of `out` and `residual` (forward) or `dx` (backward): f32, bf16 or f16.
    pub output: DType,
    /// Forward: add a `[cols]` bias, broadcast over rows, before the dropout.
    pub bias: bool,
    /// Forward: add a residual (of the output type) after the dropout.
    pub residual: bool,
    /// Chunks of 8 elements each thread loads before computing them.
    pub unroll: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl DropoutSpec {
    /// Forward with the default tuning (4 chunks in flight per thread, 256 threads).
    pub fn forward(input: DType, output: DType, bias: bool, residual: bool, arch: Arch) -> Self {
        Self { direction: Direction::Fwd, input, output, bias, residual, unroll: 4, threads: 256, arch }
    }

    /// Backward with the default tuning.
    pub fn backward(dout: DType, dx: DType, arch: Arch) -> Self {
        Self { direction: Direction::Bwd, bias: false, residual: false, ..Self::forward(dout, dx, false, false, arch) }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl DropoutSpec {
    /// Arguments of the `fwd` entry point.
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[n]` input"),
        KernelArg::read("bias", "const void* __restrict__", "`[cols]` bias added before the dropout")
            .when(ArgCond::Bias),
        KernelArg::read("residual", "const void* __restrict__", "`[n]` residual added after the dropout")
            .when(ArgCond::Residual),
        KernelArg::write("out", "void* __restrict__", "`[n]` output"),
        KernelArg::write("mask", "u8* __restrict__", "`[ceil(n / 8)]` bit-packed keep mask"),
        KernelArg::scalar("n", "u64", "elements"),
        KernelArg::scalar("cols", "u64", "columns (the bias length)").when(ArgCond::Bias),
        KernelArg::scalar("seed", "u64", "Philox key"),
        KernelArg::scalar("offset", "u64", "Philox counter offset"),
        KernelArg::read(
            "offset_base",
            "const u64* __restrict__",
            "`[1]` added to `offset`: the device's graph-safe Philox base (0 outside CUDA graph replays)",
        ),
        KernelArg::scalar(
            "threshold",
            "u64",
            "keep an element when its 32-bit Philox draw is below it: `min(2^32, ceil((1 - p) · 2^32))`",
        ),
        KernelArg::scalar("scale", "float", "`1 / (1 - p)`"),
    ];

    /// Arguments of the `bwd` entry point.
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dout", "const void* __restrict__", "`[n]` output gradient"),
        KernelArg::read("mask", "const u8* __restrict__", "`[ceil(n / 8)]` bit-packed keep mask of the forward"),
        KernelArg::write("dx", "void* __restrict__", "`[n]` input gradient"),
        KernelArg::scalar("n", "u64", "elements"),
        KernelArg::scalar("scale", "float", "`1 / (1 - p)`"),
    ];
}

impl Family for DropoutSpec {
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match self.direction {
            Direction::Fwd => Self::FWD_ARGS,
            Direction::Bwd => Self::BWD_ARGS,
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Bias => self.bias,
            ArgCond::Residual => self.residual,
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "dropout"
    }
    fn template(&self) -> &'static str {
        "dropout.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_{}{}{}_u{}_t{}",
            self.direction.name(),
            self.input,
            self.output,
            if self.bias { "_bias" } else { "" },
            if self.residual { "_res" } else { "" },
            self.unroll,
            self.threads
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("direction", self.direction.name());
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("bias", &self.bias);
        ctx.insert("residual", &self.residual);
        ctx.insert("unroll", &self.unroll);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        for (arg, dt) in [("input", self.input), ("output", self.output)] {
            if !dt.is_high_precision() {
                return Err(format!("dropout takes f32, bf16 or f16; `{arg}` is {dt}: dequantize FP8 tensors first"));
            }
        }
        if self.direction == Direction::Bwd && (self.bias || self.residual) {
            return Err("the dropout backward takes no bias or residual (d residual = dout, dbias = Σ dx)".into());
        }
        check_pow2("unroll", self.unroll, 1, 8)?;
        check_threads(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_the_flags() {
        let s = DropoutSpec::forward(DType::BF16, DType::F32, true, true, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_dropout_fwd_bf16_f32_bias_res_u4_t256_sm_90a");
        let s = DropoutSpec::backward(DType::F16, DType::F16, Arch::Sm89);
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_dropout_bwd_f16_f16_u4_t256_sm_89");
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let e = DropoutSpec::forward(DType::E4M3, DType::BF16, false, false, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("`input` is e4m3"), "{e}");
        let s = DropoutSpec::backward(DType::BF16, DType::BF16, Arch::Sm90a);
        let e = DropoutSpec { bias: true, ..s }.validate().unwrap_err();
        assert!(e.contains("no bias"), "{e}");
        let e = DropoutSpec { threads: 100, ..s }.validate().unwrap_err();
        assert!(e.contains("threads"), "{e}");
    }
}
