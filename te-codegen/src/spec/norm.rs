//! Family 5: LayerNorm and RMSNorm forward (optionally writing FP8 with amax) and backward.

use super::cast::check_threads;
use super::{vector_width, ArgCond, Direction, Family, KernelArg};
use crate::{check_fp8_dim, Arch, DType};
use serde::{Deserialize, Serialize};

/// Which normalization.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NormKind {
    /// `y = (x - mu) * rsigma * g + beta`, `rsigma = 1/sqrt(var + eps)` (biased variance).
    LayerNorm,
    /// `y = x * rsigma * g`, `rsigma = 1/sqrt(mean(x²) + eps)`.
    RmsNorm,
}

impl NormKind {
    /// `layernorm` or `rmsnorm`.
    pub const fn name(self) -> &'static str {
        match self {
            NormKind::LayerNorm => "layernorm",
            NormKind::RmsNorm => "rmsnorm",
        }
    }
}

impl std::str::FromStr for NormKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "layernorm" => Ok(NormKind::LayerNorm),
            "rmsnorm" => Ok(NormKind::RmsNorm),
            _ => Err(format!("unknown normalization `{s}`: expected layernorm or rmsnorm")),
        }
    }
}

/// Row-wise normalization of `x: [rows, hidden]` (`rows` and `eps` are run-time arguments).
///
/// `g = zero_centered_gamma ? 1 + gamma : gamma` (TE's `zero_centered_gamma`). Forward saves
/// `mu: [rows]` (LayerNorm) and `rsigma: [rows]` in f32; an FP8 `output` is quantized with
/// `scale`, maxes `|y|` (f32, before scaling, as TE) into `amax` and writes `scale_inv`.
/// Backward (TE `common/normalization/layernorm/ln_bwd_kernels.cuh`): with
/// `xhat = (x - mu) * rsigma` (RMSNorm: `x * rsigma`) and `dyg = dy * g`, LayerNorm
/// `dx = rsigma * (dyg - mean(dyg) - xhat * mean(dyg * xhat))`, RMSNorm
/// `dx = rsigma * (dyg - xhat * mean(dyg * xhat))`; `dgamma = Σ_rows dy * xhat`,
/// `dbeta = Σ_rows dy`, reduced deterministically (per-block f32 partials, then a fixed-order
/// second kernel).
///
/// Entry points, forward: `<name>` ([`NormSpec::FWD_ARGS`]); backward: `<name>`
/// ([`NormSpec::BWD_ARGS`]) and `<name>_reduce` ([`NormSpec::REDUCE_ARGS`]), with
/// `parts = ceil(rows / rows_per_block)` from [`NormSpec::bwd_rows_per_block`].
///
/// Launch shapes: forward and backward use blocks of [`NormSpec::threads`] threads (forward: a
/// grid-stride loop over rows, one row per block at a time; backward: `parts` blocks);
/// `_reduce` uses blocks of [`NormSpec::REDUCE_THREADS`] threads, one block per
/// [`NormSpec::REDUCE_COLS`] columns.
///
/// Arithmetic (fixed so the CPU reference in `te_runtime::reference::norm` can mirror it bit
/// for bit): each thread owns the vectors `i * threads + t` of [`NormSpec::vec`] elements and
/// accumulates them in order; block sums are a butterfly `warp_sum` per warp, then a butterfly
/// over the warp sums; LayerNorm statistics are two-pass from registers (`mu = Σx / hidden`,
/// `var = Σ(x - mu)² / hidden`), RMSNorm uses `Σx² / hidden`; `rsigma = 1 / sqrt(var + eps)`
/// rounded correctly (TE uses the approximate `rsqrtf`, within 2 ulp).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NormSpec {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Forward or backward.
    pub direction: Direction,
    /// Type of `x` (and `dy`).
    pub input: DType,
    /// Type of `y` (forward; may be FP8) or `dx` (backward; high precision).
    pub output: DType,
    /// Type of `gamma`/`beta` and of `dgamma`/`dbeta`.
    pub weight: DType,
    /// Feature size, specialized.
    pub hidden: usize,
    /// Gamma is stored as `gamma - 1`.
    pub zero_centered_gamma: bool,
    /// Threads per block (one row per block in the forward).
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl NormSpec {
    /// A spec with the default tuning.
    // Every argument is a spec field a caller must choose; a builder would only hide that.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        kind: NormKind,
        direction: Direction,
        input: DType,
        output: DType,
        weight: DType,
        hidden: usize,
        zero_centered_gamma: bool,
        arch: Arch,
    ) -> Self {
        // About four 16-byte vectors per thread per row (TE's tuned LayerNorm for hidden 4096
        // bf16 uses 4 warps × 16-byte loads, i.e. the same 128 threads), 32..=512 threads.
        let mut s = Self { kind, direction, input, output, weight, hidden, zero_centered_gamma, threads: 32, arch };
        s.threads = (hidden / s.vec()).div_ceil(4).next_power_of_two().clamp(32, 512);
        s
    }

    /// Threads of a `_reduce` block: [`Self::REDUCE_COLS`] columns × [`Self::REDUCE_GROUPS`]
    /// groups of partial rows.
    pub const REDUCE_THREADS: usize = Self::REDUCE_COLS * Self::REDUCE_GROUPS;
    /// Columns of `dgamma`/`dbeta` each `_reduce` block writes (one warp wide).
    pub const REDUCE_COLS: usize = 32;
    /// Groups a `_reduce` block splits the partials into: group `j` sums partial rows
    /// `j, j + G, j + 2G, ...` in order, then the group sums are added in order `0..G`.
    pub const REDUCE_GROUPS: usize = 32;

    /// Most row elements one thread may hold in registers (see [`Self::iters`]).
    pub const MAX_ELEMS_PER_THREAD: usize = 128;

    /// Rows each backward block handles (so `parts = ceil(rows / this)`): 32, but 4 for the
    /// one- and two-warp blocks of short rows (at most 512 16-bit elements: Gemma 3 270M's
    /// hidden 640 is 80 vectors, one warp; the q/k norms' head_dim rows), which with 32 left
    /// about two warps on an SM (8 192 rows: 256 blocks) and the kernel latency-bound.
    pub const fn bwd_rows_per_block(&self) -> usize {
        if self.threads <= 64 {
            4
        } else {
            32
        }
    }

    /// Elements per vector access: the largest power of two dividing `hidden` with at most 16
    /// bytes per access of `x`, `gamma` and (high-precision) `y`/`dx`.
    pub fn vec(&self) -> usize {
        let widest = self.input.size_bytes().max(self.weight.size_bytes()).max(self.output.size_bytes());
        vector_width(self.hidden, widest, 16)
    }

    /// Vector accesses per thread per row: `ceil(hidden / vec / threads)`.
    pub fn iters(&self) -> usize {
        (self.hidden / self.vec()).div_ceil(self.threads)
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl NormSpec {
    /// Arguments of the `fwd` entry point.
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, hidden]` input"),
        KernelArg::read("gamma", "const void* __restrict__", "`[hidden]` weight"),
        KernelArg::read("beta", "const void* __restrict__", "`[hidden]` bias").when(ArgCond::LayerNorm),
        KernelArg::write("y", "void* __restrict__", "`[rows, hidden]` output"),
        KernelArg::write("mu_out", "float* __restrict__", "`[rows]` f32 mean").when(ArgCond::LayerNorm),
        KernelArg::write("rsigma_out", "float* __restrict__", "`[rows]` f32 `1 / sqrt(var + eps)`"),
        KernelArg::read("scale_ptr", "const float* __restrict__", "`[1]` scale of the FP8 output")
            .when(ArgCond::Fp8Out),
        KernelArg::read_write("amax_ptr", "float* __restrict__", "`[1]` amax of the output, maxed")
            .when(ArgCond::Fp8Out),
        KernelArg::write("scale_inv_ptr", "float* __restrict__", "`[1]` `1 / scale`").when(ArgCond::Fp8Out),
        KernelArg::scalar("eps", "float", "added to the variance"),
        KernelArg::scalar("rows", "u64", "rows"),
    ];

    /// Arguments of the `bwd` entry point.
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dy", "const void* __restrict__", "`[rows, hidden]` output gradient"),
        KernelArg::read("x", "const void* __restrict__", "`[rows, hidden]` forward input"),
        KernelArg::read("mu_in", "const float* __restrict__", "`[rows]` f32 mean of the forward")
            .when(ArgCond::LayerNorm),
        KernelArg::read("rsigma_in", "const float* __restrict__", "`[rows]` f32 rsigma of the forward"),
        KernelArg::read("gamma", "const void* __restrict__", "`[hidden]` weight"),
        KernelArg::write("dx", "void* __restrict__", "`[rows, hidden]` input gradient"),
        KernelArg::write("dgamma_part", "float* __restrict__", "`[parts, hidden]` f32 partial sums of dgamma"),
        KernelArg::write("dbeta_part", "float* __restrict__", "`[parts, hidden]` f32 partial sums of dbeta")
            .when(ArgCond::LayerNorm),
        KernelArg::scalar("rows", "u64", "rows"),
    ];

    /// Arguments of the `reduce` entry point.
    pub const REDUCE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dgamma_part", "const float* __restrict__", "`[parts, hidden]` f32 partial sums of dgamma"),
        KernelArg::read("dbeta_part", "const float* __restrict__", "`[parts, hidden]` f32 partial sums of dbeta")
            .when(ArgCond::LayerNorm),
        KernelArg::write("dgamma", "void* __restrict__", "`[hidden]` weight gradient"),
        KernelArg::write("dbeta", "void* __restrict__", "`[hidden]` bias gradient").when(ArgCond::LayerNorm),
        KernelArg::scalar("parts", "u64", "partial-sum rows"),
    ];
}

impl Family for NormSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match (self.direction, entry) {
            (Direction::Fwd, _) => Self::FWD_ARGS,
            (Direction::Bwd, 0) => Self::BWD_ARGS,
            (Direction::Bwd, _) => Self::REDUCE_ARGS,
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::LayerNorm => self.kind == NormKind::LayerNorm,
            ArgCond::Fp8Out => self.output.is_fp8(),
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        self.kind.name()
    }
    fn template(&self) -> &'static str {
        match self.direction {
            Direction::Fwd => "norm_fwd.cu.tera",
            Direction::Bwd => "norm_bwd.cu.tera",
        }
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_{}_w{}_h{}{}_t{}",
            self.direction.name(),
            self.input,
            self.output,
            self.weight,
            self.hidden,
            if self.zero_centered_gamma { "_zc" } else { "" },
            self.threads
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("rmsnorm", &(self.kind == NormKind::RmsNorm));
        ctx.insert("in_t", self.input.type_tag());
        ctx.insert("out_t", self.output.type_tag());
        ctx.insert("out_fp8", &self.output.is_fp8());
        ctx.insert("w_t", self.weight.type_tag());
        ctx.insert("hidden", &self.hidden);
        ctx.insert("zero_centered_gamma", &self.zero_centered_gamma);
        ctx.insert("threads", &self.threads);
        ctx.insert("vec", &self.vec());
        ctx.insert("iters", &self.iters());
        ctx.insert("rows_per_block", &self.bwd_rows_per_block());
        ctx.insert("reduce_cols", &Self::REDUCE_COLS);
        ctx.insert("reduce_groups", &Self::REDUCE_GROUPS);
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        match self.direction {
            Direction::Fwd => &[""],
            Direction::Bwd => &["", "_reduce"],
        }
    }
    fn validate(&self) -> Result<(), String> {
        if !self.input.is_high_precision() || !self.weight.is_high_precision() {
            return Err(format!(
                "norm input and weights must be f32, bf16 or f16 (input {}, weight {})",
                self.input, self.weight
            ));
        }
        if self.direction == Direction::Bwd && self.output.is_fp8() {
            return Err("the norm backward writes dx in f32, bf16 or f16, not FP8".into());
        }
        if self.hidden == 0 {
            return Err("hidden must be at least 1".into());
        }
        if self.output.is_fp8() {
            check_fp8_dim("hidden", self.hidden).map_err(|e| format!("FP8 output: {e}"))?;
        }
        check_threads(self.threads)?;
        // Each thread keeps its share of a row in registers; beyond this it would spill.
        let per_thread = self.iters() * self.vec();
        if per_thread > Self::MAX_ELEMS_PER_THREAD {
            return Err(format!(
                "hidden = {} with threads = {} keeps {per_thread} elements per thread in registers \
                 (at most {}): raise threads",
                self.hidden,
                self.threads,
                Self::MAX_ELEMS_PER_THREAD
            ));
        }
        Ok(())
    }
}
