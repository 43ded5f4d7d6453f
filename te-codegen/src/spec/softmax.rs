//! Family 6: scaled softmax with no mask, a causal mask or a padding mask, and its backward.

use super::cast::check_threads;
use super::{vector_width, ArgCond, Direction, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Attention mask applied before the softmax. TE's convention: `true` = masked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MaskKind {
    /// Attend everywhere.
    None,
    /// Query `i` sees keys `j <= i` (top-left aligned, TE's `causal`).
    Causal,
    /// A `[batch, sq, sk]` byte mask, nonzero = masked out (TE's `padding` / `arbitrary`).
    Padding,
}

impl MaskKind {
    /// `nomask`, `causal` or `padding`.
    pub const fn name(self) -> &'static str {
        match self {
            MaskKind::None => "nomask",
            MaskKind::Causal => "causal",
            MaskKind::Padding => "padding",
        }
    }
}

/// Softmax over the last dimension of scores `[batch, heads, sq, sk]` (`sk` specialized;
/// `batch`, `heads`, `sq` and `scale` are run-time arguments).
///
/// Forward: `y = softmax(scale * x)` over keys that are not masked; masked keys get exactly 0,
/// and a row whose keys are all masked gives all zeros (not NaN). Computed in f32.
/// Backward: `dx = scale * y * (dy - Σ_j dy_j y_j)`.
///
/// Backward follows TE's form `dx = scale * (dy*y - y * Σ_j dy_j y_j)` (rounded per operation,
/// no fused multiply-add, so the CPU reference mirrors it).
///
/// Arguments: [`SoftmaxSpec::FWD_ARGS`], [`SoftmaxSpec::BWD_ARGS`]. Row `r` belongs to batch
/// `r / (heads*sq)` and query `r % sq`; the padding mask is `[batch, sq, sk]` u8 (shared by the
/// heads) and its rows must start 16-byte aligned: pass a whole allocation.
///
/// Layout: `threads_per_row` threads own one row (a warp for up to 1024 keys, a wider group
/// beyond, reducing through shared memory); each thread holds its keys in registers as
/// 16-byte vectors (`sk` elements split in vectors of the widest power-of-two width dividing
/// `sk`), at most [`SoftmaxSpec::MAX_ELEMS_PER_THREAD`] elements. Blocks stride over groups of
/// `threads / threads_per_row` rows. Causal rows skip loading keys past the query (and their
/// exponentials). Each thread issues all its loads before using any; per key the forward does
/// one `ex2.approx` of `(x*scale - max)*log2(e)` and a multiply by the row's reciprocal sum
/// (corrected to the rounded quotient for f32), with no per-key branch.
/// Sources followed: TE `common/fused_softmax/scaled_masked_softmax.cu`,
/// `scaled_upper_triang_masked_softmax.cu` (except that fully masked rows give zeros).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SoftmaxSpec {
    /// Mask type (forward; the backward needs none).
    pub mask: MaskKind,
    /// Forward or backward.
    pub direction: Direction,
    /// Element type of scores and probabilities: f32, bf16 or f16.
    pub dtype: DType,
    /// Key length, specialized.
    pub sk: usize,
    /// Threads cooperating on one row (32 = one warp per row).
    pub threads_per_row: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl SoftmaxSpec {
    /// Most keys one thread holds in registers (per tensor; the backward holds two tensors).
    pub const MAX_ELEMS_PER_THREAD: usize = 64;

    /// A spec with the default tuning: one warp per row up to 1024 keys, a wider group beyond
    /// (about 32 keys per thread, 512 threads per row at 16384 keys).
    pub fn new(mask: MaskKind, direction: Direction, dtype: DType, sk: usize, arch: Arch) -> Self {
        let mask = if direction == Direction::Bwd { MaskKind::None } else { mask };
        let threads_per_row = (sk.div_ceil(32)).next_power_of_two().clamp(32, 512);
        Self { mask, direction, dtype, sk, threads_per_row, threads: threads_per_row.max(128), arch }
    }

    /// Elements per vector access: the widest power of two ≤ 16 bytes dividing `sk`.
    pub fn vec(&self) -> usize {
        vector_width(self.sk, self.dtype.size_bytes(), 16)
    }

    /// Keys each thread holds: whole vectors, `ceil((sk / vec) / threads_per_row) * vec`.
    pub fn elems_per_thread(&self) -> usize {
        (self.sk / self.vec()).div_ceil(self.threads_per_row) * self.vec()
    }

    /// Rows one block handles per step.
    pub const fn rows_per_block(&self) -> usize {
        self.threads / self.threads_per_row
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl SoftmaxSpec {
    /// Arguments of the `fwd` entry point.
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[batch, heads, sq, sk]` scores"),
        KernelArg::read("mask", "const u8* __restrict__", "`[batch, sq, sk]` bytes, nonzero = masked out")
            .when(ArgCond::Padding),
        KernelArg::write("y", "void* __restrict__", "`[batch, heads, sq, sk]` probabilities"),
        KernelArg::scalar("scale", "float", "multiplies the scores"),
        KernelArg::scalar("sq", "u64", "query length (rows per head)"),
        KernelArg::scalar("heads", "u64", "heads"),
        KernelArg::scalar("rows", "u64", "`batch * heads * sq`"),
    ];

    /// Arguments of the `bwd` entry point.
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("dy", "const void* __restrict__", "`[rows, sk]` gradient of the probabilities"),
        KernelArg::read("y", "const void* __restrict__", "`[rows, sk]` probabilities"),
        KernelArg::write("dx", "void* __restrict__", "`[rows, sk]` gradient of the scores"),
        KernelArg::scalar("scale", "float", "the forward scale"),
        KernelArg::scalar("rows", "u64", "rows"),
    ];
}

impl Family for SoftmaxSpec {
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match self.direction {
            Direction::Fwd => Self::FWD_ARGS,
            Direction::Bwd => Self::BWD_ARGS,
        }
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::Padding => self.mask == MaskKind::Padding,
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "softmax"
    }
    fn template(&self) -> &'static str {
        "softmax.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!(
            "{}_{}_{}_k{}_g{}_t{}",
            self.direction.name(),
            self.mask.name(),
            self.dtype,
            self.sk,
            self.threads_per_row,
            self.threads
        )
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("direction", self.direction.name());
        ctx.insert("mask", self.mask.name());
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("sk", &self.sk);
        ctx.insert("vec", &self.vec());
        ctx.insert("threads_per_row", &self.threads_per_row);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("softmax works on f32, bf16 or f16, not {}", self.dtype));
        }
        if self.sk == 0 || self.sk > 16384 {
            return Err(format!("sk = {} must be in [1, 16384]", self.sk));
        }
        if self.direction == Direction::Bwd && self.mask != MaskKind::None {
            return Err("the softmax backward takes no mask (masked probabilities are 0)".into());
        }
        if !self.threads_per_row.is_power_of_two()
            || !(32..=1024).contains(&self.threads_per_row)
            || self.threads % self.threads_per_row != 0
        {
            return Err(format!(
                "threads_per_row = {} must be a power of two in [32, 1024] dividing threads = {}",
                self.threads_per_row, self.threads
            ));
        }
        let per_thread = self.elems_per_thread();
        if per_thread > Self::MAX_ELEMS_PER_THREAD {
            return Err(format!(
                "sk = {} over threads_per_row = {} leaves {per_thread} keys per thread (at most {}): raise threads_per_row",
                self.sk,
                self.threads_per_row,
                Self::MAX_ELEMS_PER_THREAD
            ));
        }
        check_threads(self.threads)
    }
}
