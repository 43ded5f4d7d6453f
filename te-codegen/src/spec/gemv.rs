//! Family 22: the GEMV of a decode step — a GEMM of a few token rows against a weight read once,
//! with the memory-bound work around it fused: the norm before it (and the sandwich norm's
//! residual add before that norm), the bias, the activation and the residual add after it.
//! A decode step at batch 1 is launch-bound (GPT `small`'s was 9.5× its bytes floor with about
//! 13 kernels a layer); this family makes a layer's four GEMMs and their neighbours four launches.

use super::{ArgCond, Family, KernelArg, NormKind};
use crate::spec::Activation;
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// What a block does to the input rows before the product (each block computes it for itself
/// into shared memory: the rows are a few kB).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemvPrologue {
    /// `x` as it is.
    None,
    /// `norm1(x)`: the pre-norm of a `LayerNormLinear` (TE) / `input_layernorm` (Hugging Face).
    Norm,
    /// `h = x + norm0(a)`, written to `h_out` by block 0, then `norm1(h)`: a sandwich-norm
    /// model's residual add (Gemma 3's `post_attention_layernorm` / `post_feedforward_layernorm`)
    /// fused with the next pre-norm.
    AddNorm,
    /// `h = x + a`, written to `h_out` by block 0, then `norm1(h)`: a pre-norm layer's residual
    /// add after the attention fused with the MLP's norm (TE `TransformerLayer`, GPT).
    ResidualNorm,
}

impl GemvPrologue {
    /// `none`, `norm` or `add_norm`.
    pub const fn name(self) -> &'static str {
        match self {
            GemvPrologue::None => "none",
            GemvPrologue::Norm => "norm",
            GemvPrologue::AddNorm => "add_norm",
            GemvPrologue::ResidualNorm => "residual_norm",
        }
    }
}

/// What is done with each output after the product and the bias.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GemvEpilogue {
    /// `out = y`.
    Store,
    /// `out += y` in place: the residual add after an attention projection or fc2.
    Residual,
    /// `out = act(y)`; a gated activation reads weight rows `j` (the gate `a`) and `n + j` (the
    /// up projection `b`) for output `j`: `out = act(a) · b` (TE's `[a | b]` fc1 layout).
    Act(Activation),
}

impl GemvEpilogue {
    /// `store`, `residual` or the activation's name.
    pub const fn name(self) -> &'static str {
        match self {
            GemvEpilogue::Store => "store",
            GemvEpilogue::Residual => "residual",
            GemvEpilogue::Act(a) => a.name(),
        }
    }

    /// Weight rows read per output: 2 for a gated activation, else 1.
    pub const fn weight_rows(self) -> usize {
        match self {
            GemvEpilogue::Act(a) if a.is_gated() => 2,
            _ => 1,
        }
    }
}

/// `out[r, j] = epilogue(round(Σ_c p[r, c] · w[j, c] · s + bias[j]))` for the `m ≤ rows` token
/// rows `r` of `x: [m, k]` BF16 and the `n` outputs `j` of `w: [n · weight_rows, k]` (BF16, or
/// FP8 codes with the per-tensor `s = *w_scale_inv`; BF16 `s = 1`). `k` is specialized, `m`,
/// `n` and `eps` are run-time.
///
/// Arithmetic (mirrored by `te_reference::gemv`):
/// - prologue, per row, f32 statistics over the row's `k` values: LayerNorm `mu = Σx / k`,
///   `var = Σ(x − mu)² / k`; RMSNorm `var = Σx² / k`; `rsigma = 1 / sqrt(var + eps)`; `g = γ` or
///   `1 + γ` (`zero_centered_gamma`); `p = round((x − mu) · rsigma · g + β)` (RMSNorm `round(x ·
///   rsigma · g)`), rounded to BF16 as the unfused norm writes it. `AddNorm`: `h = round(x +
///   round(norm0(a)))` first (the post-norm of `a` under `γ0`/`β0`, then the residual add, each
///   rounded as the unfused kernels round), then `p = round(norm1(h))`; `ResidualNorm` the same
///   with `h = round(x + a)`;
/// - product: f32 fused multiply-adds, each lane over the 8-element vectors `lane + 32 i`, then a
///   butterfly over the warp; `y = acc · s + bias` rounded to BF16 (the GEMM's output);
/// - epilogue: `act` in f32 on the rounded `y` (gated: `act(a) · b`), rounded; `Residual`:
///   `out = round(out + y)`.
///
/// Entry point `<name>` ([`GemvSpec::ARGS`]): blocks of [`GemvSpec::THREADS`] threads, each warp
/// one output at a time (blocks stride over the `n` outputs: any grid, each block recomputing the
/// prologue once), dynamic shared memory [`GemvSpec::shared_bytes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GemvSpec {
    /// Weight type: bf16, e4m3 or e5m2 (FP8 codes scaled by `w_scale_inv`).
    pub weight: DType,
    /// Input features `k` (the weight's row length): a multiple of 16 bytes of weight (8 BF16
    /// or 16 FP8 values).
    pub k: usize,
    /// The most token rows `m` a launch takes (1 to 8): the accumulators a lane holds.
    pub rows: usize,
    /// What is done to `x` first.
    pub prologue: GemvPrologue,
    /// The prologue's norms (ignored without one).
    pub norm: NormKind,
    /// The prologue's norms scale by `1 + γ` (TE's `zero_centered_gamma`).
    pub zero_centered_gamma: bool,
    /// A bias `[n · weight_rows]` BF16 added before the epilogue.
    pub bias: bool,
    /// What is done to each output.
    pub epilogue: GemvEpilogue,
    /// Target architecture.
    pub arch: Arch,
}

impl GemvSpec {
    /// Warps per block.
    pub const WARPS: usize = 8;
    /// Threads per block.
    pub const THREADS: usize = 32 * Self::WARPS;
    /// The most token rows a spec takes.
    pub const MAX_ROWS: usize = 8;
    /// The most shared memory the input rows may take (bytes).
    pub const MAX_SHARED: usize = 96 * 1024;

    /// A plain GEMV (`Store`, no prologue, no bias) of `k` features, up to `rows` token rows.
    pub fn new(weight: DType, k: usize, rows: usize, arch: Arch) -> Self {
        Self {
            weight,
            k,
            rows,
            prologue: GemvPrologue::None,
            norm: NormKind::RmsNorm,
            zero_centered_gamma: false,
            bias: false,
            epilogue: GemvEpilogue::Store,
            arch,
        }
    }

    /// The spec with the prologue `prologue` under norms of `kind`.
    pub fn with_prologue(self, prologue: GemvPrologue, kind: NormKind, zero_centered_gamma: bool) -> Self {
        let norm = prologue != GemvPrologue::None;
        Self { prologue, norm: kind, zero_centered_gamma: norm && zero_centered_gamma, ..self }
    }

    /// The spec with a bias and the epilogue `epilogue`.
    pub fn with_epilogue(self, bias: bool, epilogue: GemvEpilogue) -> Self {
        Self { bias, epilogue, ..self }
    }

    /// Bytes of dynamic shared memory a launch needs: the `rows` prologue rows of `k` BF16
    /// values.
    pub fn shared_bytes(&self) -> usize {
        self.rows * self.k * 2
    }

    /// The most rows a spec of `k` features can take within [`GemvSpec::MAX_SHARED`] (at most
    /// [`GemvSpec::MAX_ROWS`]; 0 when not even one row fits).
    pub fn max_rows(k: usize) -> usize {
        (Self::MAX_SHARED / (2 * k.max(1))).min(Self::MAX_ROWS)
    }

    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const u16* __restrict__", "BF16 `[m, k]` input rows (`AddNorm`: the residual stream)"),
        KernelArg::read("a", "const u16* __restrict__", "BF16 `[m, k]` sublayer output to (post-norm and) add")
            .when(ArgCond::ResidualAdd),
        KernelArg::read("gamma0", "const u16* __restrict__", "BF16 `[k]` post-norm weight").when(ArgCond::AddNorm),
        KernelArg::read("beta0", "const u16* __restrict__", "BF16 `[k]` post-norm bias (LayerNorm)")
            .when(ArgCond::AddNormBeta),
        KernelArg::write("h_out", "u16* __restrict__", "BF16 `[m, k]` `x + (norm0)(a)`, written by block 0")
            .when(ArgCond::ResidualAdd),
        KernelArg::read("gamma1", "const u16* __restrict__", "BF16 `[k]` pre-norm weight").when(ArgCond::PreNorm),
        KernelArg::read("beta1", "const u16* __restrict__", "BF16 `[k]` pre-norm bias (LayerNorm)")
            .when(ArgCond::PreNormBeta),
        KernelArg::read("w", "const void* __restrict__", "`[n · weight_rows, k]` weight (BF16 or FP8 codes)"),
        KernelArg::read("w_scale_inv", "const float* __restrict__", "f32 `[1]` the FP8 weight's scale_inv")
            .when(ArgCond::Fp8Weight),
        KernelArg::read("bias", "const u16* __restrict__", "BF16 `[n · weight_rows]`").when(ArgCond::Bias),
        KernelArg::read_write("out", "u16*", "BF16 `[m, n]` (read too by `Residual`)"),
        KernelArg::scalar("m", "u32", "token rows, 1 to the spec's `rows`"),
        KernelArg::scalar("n", "u32", "outputs per row"),
        KernelArg::scalar("eps", "float", "the norms' epsilon"),
    ];
}

impl Family for GemvSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        let _ = entry;
        Self::ARGS
    }
    fn has(&self, cond: ArgCond) -> bool {
        let layer_norm = self.norm == NormKind::LayerNorm;
        match cond {
            ArgCond::ResidualAdd => matches!(self.prologue, GemvPrologue::AddNorm | GemvPrologue::ResidualNorm),
            ArgCond::AddNorm => self.prologue == GemvPrologue::AddNorm,
            ArgCond::AddNormBeta => self.prologue == GemvPrologue::AddNorm && layer_norm,
            ArgCond::PreNorm => self.prologue != GemvPrologue::None,
            ArgCond::PreNormBeta => self.prologue != GemvPrologue::None && layer_norm,
            ArgCond::Fp8Weight => self.weight.is_fp8(),
            ArgCond::Bias => self.bias,
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "gemv"
    }
    fn template(&self) -> &'static str {
        "gemv.cu.tera"
    }
    fn name_parts(&self) -> String {
        let pro = match self.prologue {
            GemvPrologue::None => String::new(),
            p => format!("_{}_{}{}", p.name(), self.norm.name(), if self.zero_centered_gamma { "_zc" } else { "" }),
        };
        let bias = if self.bias { "_bias" } else { "" };
        format!("{}_k{}_m{}{pro}{bias}_{}", self.weight, self.k, self.rows, self.epilogue.name())
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("w_t", self.weight.type_tag());
        ctx.insert("fp8", &self.weight.is_fp8());
        ctx.insert("k", &self.k);
        ctx.insert("rows", &self.rows);
        ctx.insert("warps", &Self::WARPS);
        ctx.insert("prologue", self.prologue.name());
        ctx.insert("layer_norm", &(self.norm == NormKind::LayerNorm));
        ctx.insert("zero_centered_gamma", &self.zero_centered_gamma);
        ctx.insert("bias", &self.bias);
        let (epilogue, act, gated) = match self.epilogue {
            GemvEpilogue::Act(a) => ("act", a.name(), a.is_gated()),
            e => (e.name(), "", false),
        };
        ctx.insert("epilogue", epilogue);
        ctx.insert("act", act);
        ctx.insert("gated", &gated);
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.weight, DType::BF16 | DType::E4M3 | DType::E5M2) {
            return Err(format!("gemv weights are bf16, e4m3 or e5m2, not {}", self.weight));
        }
        let vec = 16 / self.weight.size_bytes();
        if self.k == 0 || self.k % vec != 0 {
            return Err(format!("k = {} must be a positive multiple of {vec} (16 bytes of {})", self.k, self.weight));
        }
        if self.rows == 0 || self.rows > Self::MAX_ROWS {
            return Err(format!("rows = {} must be 1 to {}", self.rows, Self::MAX_ROWS));
        }
        if self.shared_bytes() > Self::MAX_SHARED {
            return Err(format!(
                "{} rows of k = {} take {} bytes of shared memory, more than {}: take at most {} rows",
                self.rows,
                self.k,
                self.shared_bytes(),
                Self::MAX_SHARED,
                Self::max_rows(self.k)
            ));
        }
        if self.zero_centered_gamma && self.prologue == GemvPrologue::None {
            return Err("zero_centered_gamma needs a norm prologue".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_validate_and_name_themselves() {
        let s = GemvSpec::new(DType::BF16, 640, 1, Arch::Sm90a)
            .with_prologue(GemvPrologue::AddNorm, NormKind::RmsNorm, true)
            .with_epilogue(false, GemvEpilogue::Act(Activation::Geglu));
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_gemv_bf16_k640_m1_add_norm_rmsnorm_zc_geglu_sm_90a");
        assert!(s.has(ArgCond::AddNorm) && s.has(ArgCond::PreNorm) && !s.has(ArgCond::AddNormBeta));
        assert_eq!(s.epilogue.weight_rows(), 2);
        let plain = GemvSpec::new(DType::E4M3, 2048, 8, Arch::Sm89).with_epilogue(true, GemvEpilogue::Residual);
        plain.validate().unwrap();
        assert!(plain.has(ArgCond::Fp8Weight) && plain.has(ArgCond::Bias) && !plain.has(ArgCond::PreNorm));
        assert_eq!(GemvSpec::max_rows(8192), 6);
        assert_eq!(GemvSpec::max_rows(640), 8);
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let e = |s: GemvSpec| s.validate().unwrap_err();
        assert!(e(GemvSpec::new(DType::F32, 64, 1, Arch::Sm90a)).contains("bf16, e4m3 or e5m2"));
        assert!(e(GemvSpec::new(DType::BF16, 100, 1, Arch::Sm90a)).contains("multiple of 8"));
        assert!(e(GemvSpec::new(DType::E4M3, 648, 1, Arch::Sm90a)).contains("multiple of 16"));
        assert!(e(GemvSpec::new(DType::BF16, 64, 9, Arch::Sm90a)).contains("1 to 8"));
        assert!(e(GemvSpec::new(DType::BF16, 16384, 4, Arch::Sm90a)).contains("at most 3 rows"));
        let zc = GemvSpec { zero_centered_gamma: true, ..GemvSpec::new(DType::BF16, 64, 1, Arch::Sm90a) };
        assert!(e(zc).contains("needs a norm prologue"));
    }
}
