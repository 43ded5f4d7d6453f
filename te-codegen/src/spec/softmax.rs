//! Family 6: scaled softmax with no mask, a causal mask or a padding mask, and its backward.

use super::cast::check_threads;
use super::{Direction, Family};
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
/// Arguments, forward: `(x, [mask], y, scale, sq, heads, rows)` with `rows = batch*heads*sq`;
/// backward: `(dy, y, dx, scale, rows)`. `scale` is f32, the sizes u64.
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
    /// A spec with the default tuning: one warp per row up to 1024 keys, a wider group beyond.
    pub fn new(mask: MaskKind, direction: Direction, dtype: DType, sk: usize, arch: Arch) -> Self {
        let mask = if direction == Direction::Bwd { MaskKind::None } else { mask };
        let threads_per_row = (sk.div_ceil(32)).next_power_of_two().clamp(32, 512);
        Self { mask, direction, dtype, sk, threads_per_row, threads: threads_per_row.max(128), arch }
    }
}

impl Family for SoftmaxSpec {
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
        check_threads(self.threads)
    }
}
