//! Family 4: bias + activation (+ FP8 cast with amax) forward and the activation backward.

use super::cast::{check_pow2, check_threads};
use super::{vector_width, ArgCond, Direction, Family, KernelArg};
use crate::{check_fp8_dim, Arch, DType};
use serde::{Deserialize, Serialize};

/// Activation functions, with TE's definitions (`common/util/math.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    /// GELU, tanh approximation: `0.5 x (1 + tanh(0.79788456 (x + 0.044715 x³)))` (TE's
    /// default, PyTorch `gelu(approximate="tanh")`).
    Gelu,
    /// GELU, exact erf form: `0.5 x (1 + erf(x / √2))` (PyTorch's default `gelu`, Hugging Face
    /// BERT's `hidden_act = "gelu"`). Never run through cuBLASLt's GELU epilogues, which are the
    /// tanh form.
    #[serde(rename = "gelu_erf")]
    GeluErf,
    /// `max(x, 0)`.
    Relu,
    /// SwiGLU on `[a | b]` (each `cols` wide): `silu(a) * b`, `silu(a) = a / (1 + e^-a)`.
    Swiglu,
    /// GeGLU on `[a | b]`: `gelu(a) * b` with the tanh GELU.
    Geglu,
}

impl Activation {
    /// Every activation.
    pub const ALL: [Activation; 5] =
        [Activation::Gelu, Activation::GeluErf, Activation::Relu, Activation::Swiglu, Activation::Geglu];

    /// Gated (GLU) variants read an input twice as wide as their output.
    pub const fn is_gated(self) -> bool {
        matches!(self, Activation::Swiglu | Activation::Geglu)
    }

    /// Lowercase name (`gelu`, `gelu_erf`, `relu`, `swiglu`, `geglu`).
    pub const fn name(self) -> &'static str {
        match self {
            Activation::Gelu => "gelu",
            Activation::GeluErf => "gelu_erf",
            Activation::Relu => "relu",
            Activation::Swiglu => "swiglu",
            Activation::Geglu => "geglu",
        }
    }
}

impl std::fmt::Display for Activation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Activation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Activation::ALL
            .into_iter()
            .find(|a| a.name() == s.to_ascii_lowercase())
            .ok_or_else(|| format!("unknown activation `{s}`: expected gelu, gelu_erf, relu, swiglu or geglu"))
    }
}

/// Row-wise activation over `[rows, cols]` outputs (`rows` is a run-time argument).
///
/// Forward: `y = act(x + bias)` with `x: [rows, in_cols]`, `bias: [in_cols]` (when `bias`),
/// `y: [rows, cols]`, where `in_cols = 2 * cols` for gated activations and `cols` otherwise.
/// With an FP8 `output` the kernel quantizes with `scale`, maxes `|y|` into `amax` and writes
/// `scale_inv`. Backward: `dx = dact(x) * dy` with `dy: [rows, cols]`, `x` and `dx` `[rows,
/// in_cols]`; an FP8 `output` quantizes `dx` the same way. `bias` is forward-only.
///
/// Kernel arguments: [`ActivationSpec::FWD_ARGS`], [`ActivationSpec::BWD_ARGS`].
///
/// The kernel is a grid-stride loop over the `rows * cols / vec` output vectors: each thread
/// issues the loads for `unroll` of them (1 to 3 input vectors each: `x`, `b` when gated, `dy`
/// in the backward) before computing, so several 16-byte loads are in flight per thread. The FP8 variants reduce `|y|`
/// over the block (TE's amax, NaN skipped) and issue one atomic max per block; block 0 writes
/// `scale_inv = 1 / scale`. Math is f32 (TE `common/util/vectorized_pointwise.h`,
/// `common/activation/activation_template.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ActivationSpec {
    /// The activation.
    pub act: Activation,
    /// Forward or backward.
    pub direction: Direction,
    /// Type of `x` (and `dy`): f32, bf16 or f16.
    pub input: DType,
    /// Type of `y` (forward) or `dx` (backward): high precision or FP8.
    pub output: DType,
    /// Output feature size (`cols`), specialized.
    pub cols: usize,
    /// Forward only: add a `[in_cols]` bias before the activation.
    pub bias: bool,
    /// Output elements per thread per vector access.
    pub vec: usize,
    /// Vectors each thread loads before computing (loads in flight per thread).
    pub unroll: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl ActivationSpec {
    /// A spec with the default tuning: 16-byte input vectors where `cols` allows, 256 threads
    /// per block, and 4 to 6 vector loads in flight per thread (`unroll` 4 for the non-gated
    /// forward, which loads one vector per output vector, 2 for the others, which load 2 or 3).
    pub fn new(
        act: Activation,
        direction: Direction,
        input: DType,
        output: DType,
        cols: usize,
        bias: bool,
        arch: Arch,
    ) -> Self {
        let vec = vector_width(cols, input.size_bytes(), 16);
        let unroll = if direction == Direction::Fwd && !act.is_gated() { 4 } else { 2 };
        Self { act, direction, input, output, cols, bias, vec, unroll, threads: 256, arch }
    }

    /// Width of the input rows: `2 * cols` for gated activations.
    pub const fn in_cols(&self) -> usize {
        if self.act.is_gated() {
            2 * self.cols
        } else {
            self.cols
        }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl ActivationSpec {
    /// Arguments of the `fwd` entry point.
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read(
            "x",
            "const void* __restrict__",
            "`[rows, cols]` input (`2 * cols` wide for a gated activation)",
        ),
        KernelArg::read(
            "bias",
            "const void* __restrict__",
            "`[cols]` bias added before the activation (`2 * cols` when gated)",
        )
        .when(ArgCond::Bias),
        KernelArg::write("y", "void* __restrict__", "`[rows, cols]` output"),
        KernelArg::read("scale_ptr", "const float* __restrict__", "`[1]` scale of the FP8 output")
            .when(ArgCond::Fp8Out),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax of the output, maxed")
            .when(ArgCond::Fp8Out),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "`[1]` `1 / scale`").when(ArgCond::Fp8Out),
        KernelArg::scalar("rows", "u64", "rows"),
    ];

    /// Arguments of the `bwd` entry point.
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dy", "const void* __restrict__", "`[rows, cols]` output gradient"),
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` forward input (`2 * cols` wide when gated)"),
        KernelArg::write("dx", "void* __restrict__", "`[rows, cols]` input gradient (`2 * cols` when gated)"),
        KernelArg::read("scale_ptr", "const float* __restrict__", "`[1]` scale of the FP8 input gradient")
            .when(ArgCond::Fp8Out),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax of the input gradient, maxed")
            .when(ArgCond::Fp8Out),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "`[1]` `1 / scale`").when(ArgCond::Fp8Out),
        KernelArg::scalar("rows", "u64", "rows"),
    ];
}

impl Family for ActivationSpec {
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match self.direction {
            Direction::Fwd => Self::FWD_ARGS,
            Direction::Bwd => Self::BWD_ARGS,
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Bias => self.bias,
            ArgCond::Fp8Out => self.output.is_fp8(),
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "act"
    }
    fn template(&self) -> &'static str {
        "activation.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_{}_{}_c{}{}_v{}_u{}_t{}",
            self.act,
            self.direction.name(),
            self.input,
            self.output,
            self.cols,
            if self.bias { "_bias" } else { "" },
            self.vec,
            self.unroll,
            self.threads
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("act", self.act.name());
        // The element-wise function: GeGLU gates with GELU, SwiGLU with SiLU.
        let elementwise = match self.act {
            Activation::Gelu | Activation::Geglu => "gelu",
            Activation::GeluErf => "gelu_erf",
            Activation::Relu => "relu",
            Activation::Swiglu => "silu",
        };
        ctx.insert("elementwise", elementwise);
        ctx.insert("gated", &self.act.is_gated());
        ctx.insert("direction", self.direction.name());
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("out_fp8", &self.output.is_fp8());
        ctx.insert("cols", &self.cols);
        ctx.insert("in_cols", &self.in_cols());
        ctx.insert("bias", &self.bias);
        ctx.insert("vec", &self.vec);
        ctx.insert("unroll", &self.unroll);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.input.is_high_precision() {
            return Err(format!("activation input must be f32, bf16 or f16, not {}", self.input));
        }
        if self.cols == 0 {
            return Err("cols must be at least 1".into());
        }
        if self.output.is_fp8() {
            check_fp8_dim("cols", self.cols).map_err(|e| format!("FP8 output: {e}"))?;
        }
        if self.bias && self.direction == Direction::Bwd {
            return Err("bias is fused in the forward only; the backward takes x + bias as its input".into());
        }
        if self.cols % self.vec != 0 {
            return Err(format!("vec = {} must divide cols = {}", self.vec, self.cols));
        }
        check_pow2("vec", self.vec, 1, 16)?;
        if self.vec * self.input.size_bytes() > 16 {
            return Err(format!("vec = {} {} elements exceed one 16-byte access", self.vec, self.input));
        }
        check_pow2("unroll", self.unroll, 1, 8)?;
        check_threads(self.threads)
    }
}
