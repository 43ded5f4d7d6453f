//! Family 20: the attention input of a generation or prefill step, fused — the projection's
//! `q | k | v` rows split per head, optional qk-norm (RMSNorm over each head's channels, Qwen3's
//! and Gemma 3's `q_norm` / `k_norm`), RoPE at each token's own position, the queries written
//! dense and the keys and values appended to the KV cache (TE's `InferenceParams` step,
//! transformers' `apply_rotary_pos_emb` + `past_key_values.update`), in the model's dtype or as
//! E4M3 codes with per-tensor scales (vLLM's `kv_cache_dtype="fp8"`).

use super::{ArgCond, Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// One launch over `tokens` rows of the fused projection output `qkv: [tokens, (heads + 2 ·
/// groups) · d]` (all q heads, then all k heads, then all v heads of a token, as
/// `ops::flash_attention::Qkv::Packed` reads them). `d` is specialized; `heads`, `groups` and
/// `tokens` are run-time.
///
/// For each token `t` at position `p = positions[t]` and each head row `x` (math in f32):
/// - q and k heads, with `qk_norm`: `x ← round(x · rsqrt(mean(x²) + eps) · γ')` with `γ' = γ`
///   or `1 + γ` (`zero_centered_gamma`), `γ` the q or k norm's `[d]` weight, rounded once to the
///   dtype (transformers rounds the norm's output before RoPE too);
/// - q and k heads: RoPE non-interleaved ("rotate half") over all `d` channels: with `half =
///   d / 2`, `θ_c = p · inv_freq[c mod half]` (one f32 product, as transformers'
///   `inv_freq @ position_ids`), `y_c = x_c·cos θ_c − x_{c+half}·sin θ_c` for `c < half` and
///   `y_c = x_c·cos θ_c + x_{c−half}·sin θ_c` above (each `fmaf(x, cos, rounded(±x'·sin))`,
///   `sincosf`), rounded once to the dtype;
/// - q heads go to `q_out[t, h, :]` (`[tokens, heads, d]`), k and v heads to row `rows[t]` of
///   the caches `k_cache`, `v_cache` (`[cache_rows, groups, d]`: the `[batch, capacity, groups,
///   d]` caches of `ops::decode_attention` with `rows[t] = sequence · capacity + p`); v is copied
///   bit for bit;
/// - an E4M3 cache ([`QkvRopeSpec::with_fp8_cache`]) stores `E4M3(k · k_scale)` with `k` the
///   rotated key rounded to the dtype first, and `E4M3(v · v_scale)` (round to nearest even,
///   saturating at ±448; `kv_scales` of `ops::decode_attention`, which reads the codes back).
///
/// Entry point `<name>` ([`QkvRopeSpec::ARGS`]): launch [`QkvRopeSpec::THREADS`] threads per
/// block (`WARPS` warps, each one head row at a time: lane `l < d / vec` owns channels `[l·vec,
/// l·vec + vec)`), any block count (blocks stride over the `tokens · (heads + 2 · groups)` rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct QkvRopeSpec {
    /// Element type of `qkv`, `q_out`, the caches and the norm weights: f32, bf16 or f16.
    pub dtype: DType,
    /// Head dimension: a multiple of `2 · vec` with `d / vec ≤ 32` (bf16/f16: up to 256; f32:
    /// up to 128).
    pub d: usize,
    /// Channels per 16-byte access: `16 / size_of(dtype)`.
    pub vec: usize,
    /// RMSNorm of each q and k head before RoPE (`q_gamma`, `k_gamma`, `eps` in the signature).
    pub qk_norm: bool,
    /// The norm scales by `1 + γ` (TE's `zero_centered_gamma`, `Gemma3RMSNorm`).
    pub zero_centered_gamma: bool,
    /// What the caches hold: `dtype`, or E4M3 codes (bf16/f16 only; `kv_scales` in the
    /// signature).
    pub kv_cache: DType,
    /// Target architecture.
    pub arch: Arch,
}

impl QkvRopeSpec {
    /// Warps per block.
    pub const WARPS: usize = 8;
    /// Threads per block.
    pub const THREADS: usize = 32 * Self::WARPS;

    /// The spec for heads of `d` channels in `dtype`.
    pub fn new(dtype: DType, d: usize, qk_norm: bool, zero_centered_gamma: bool, arch: Arch) -> Self {
        let vec = (16 / dtype.size_bytes().max(1)).max(1);
        Self { dtype, d, vec, qk_norm, zero_centered_gamma: qk_norm && zero_centered_gamma, kv_cache: dtype, arch }
    }

    /// This kernel appending to an E4M3 cache with per-tensor scales (see the type's docs).
    pub const fn with_fp8_cache(self) -> Self {
        Self { kv_cache: DType::E4M3, ..self }
    }

    /// Whether the caches hold E4M3 codes.
    pub fn fp8_cache(&self) -> bool {
        self.kv_cache == DType::E4M3
    }

    /// The largest head dimension `dtype` takes: `32 · vec`.
    pub fn max_d(dtype: DType) -> usize {
        32 * (16 / dtype.size_bytes().max(1))
    }

    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("qkv", "const void* __restrict__", "`[tokens, (heads + 2·groups)·d]` projection output"),
        KernelArg::read("q_gamma", "const void* __restrict__", "`[d]` the q norm's weight").when(ArgCond::QkNorm),
        KernelArg::read("k_gamma", "const void* __restrict__", "`[d]` the k norm's weight").when(ArgCond::QkNorm),
        KernelArg::read("inv_freq", "const float* __restrict__", "f32 `[d / 2]` RoPE inverse frequencies"),
        KernelArg::read("positions", "const int* __restrict__", "i32 `[tokens]`: each token's position"),
        KernelArg::read("rows", "const int* __restrict__", "i32 `[tokens]`: each token's cache row"),
        KernelArg::write("q_out", "void* __restrict__", "`[tokens, heads, d]` rotated queries"),
        KernelArg::write("k_cache", "void* __restrict__", "`[cache_rows, groups, d]` keys"),
        KernelArg::write("v_cache", "void* __restrict__", "`[cache_rows, groups, d]` values"),
        KernelArg::scalar("tokens", "u64", "tokens of the step"),
        KernelArg::scalar("heads", "u32", "query heads"),
        KernelArg::scalar("groups", "u32", "key/value heads"),
        KernelArg::scalar("eps", "float", "the norm's epsilon").when(ArgCond::QkNorm),
        KernelArg::read("kv_scales", "const float* __restrict__", super::decode_attention::KV_SCALES_DOC)
            .when(ArgCond::Fp8KvCache),
    ];
}

impl Family for QkvRopeSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        let _ = entry;
        Self::ARGS
    }
    fn has(&self, cond: ArgCond) -> bool {
        match cond {
            ArgCond::QkNorm => self.qk_norm,
            ArgCond::Fp8KvCache => self.fp8_cache(),
            _ => false,
        }
    }
    fn family(&self) -> &'static str {
        "qkv_rope"
    }
    fn template(&self) -> &'static str {
        "qkv_rope.cu.tera"
    }
    fn name_parts(&self) -> String {
        let norm = match (self.qk_norm, self.zero_centered_gamma) {
            (false, _) => "plain",
            (true, false) => "qknorm",
            (true, true) => "qknorm1p",
        };
        let cache = if self.fp8_cache() { "_kv8" } else { "" };
        format!("{}_d{}_v{}_{norm}{cache}", self.dtype, self.d, self.vec)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("d", &self.d);
        ctx.insert("vec", &self.vec);
        ctx.insert("warps", &Self::WARPS);
        ctx.insert("qk_norm", &self.qk_norm);
        ctx.insert("zero_centered_gamma", &self.zero_centered_gamma);
        ctx.insert("fp8_cache", &self.fp8_cache());
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("qkv_rope works on f32, bf16 or f16, not {}", self.dtype));
        }
        if self.vec * self.dtype.size_bytes() != 16 {
            return Err(format!("vec = {} must fill one 16-byte access of {}", self.vec, self.dtype));
        }
        let max = Self::max_d(self.dtype);
        if self.d == 0 || self.d % (2 * self.vec) != 0 || self.d > max {
            return Err(format!(
                "head dim d = {} must be a multiple of {} up to {max} for {}",
                self.d,
                2 * self.vec,
                self.dtype
            ));
        }
        if self.zero_centered_gamma && !self.qk_norm {
            return Err("zero_centered_gamma needs qk_norm".into());
        }
        if self.kv_cache != self.dtype && !(self.kv_cache == DType::E4M3 && self.dtype.size_bytes() == 2) {
            return Err(format!(
                "the caches hold {} (qkv's dtype) or, for bf16/f16, e4m3 codes; not {}",
                self.dtype, self.kv_cache
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_name_their_options_and_refuse_what_the_template_cannot_do() {
        let s = QkvRopeSpec::new(DType::BF16, 256, true, true, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_qkv_rope_bf16_d256_v8_qknorm1p_sm_90a");
        let s = QkvRopeSpec::new(DType::F32, 128, false, true, Arch::Sm89);
        s.validate().unwrap();
        assert!(!s.zero_centered_gamma);
        assert!(QkvRopeSpec::new(DType::F32, 256, false, false, Arch::Sm89).validate().unwrap_err().contains("128"));
        assert!(QkvRopeSpec::new(DType::BF16, 72, true, false, Arch::Sm89).validate().unwrap_err().contains("16"));
        assert!(QkvRopeSpec::new(DType::E4M3, 64, true, false, Arch::Sm89).validate().unwrap_err().contains("e4m3"));
        let s =
            QkvRopeSpec { zero_centered_gamma: true, ..QkvRopeSpec::new(DType::BF16, 64, false, false, Arch::Sm89) };
        assert!(s.validate().unwrap_err().contains("qk_norm"));
        let s = QkvRopeSpec::new(DType::BF16, 256, true, true, Arch::Sm90a).with_fp8_cache();
        s.validate().unwrap();
        assert!(s.has(ArgCond::Fp8KvCache) && s.has(ArgCond::QkNorm));
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_qkv_rope_bf16_d256_v8_qknorm1p_kv8_sm_90a");
        let s = QkvRopeSpec::new(DType::F32, 64, false, false, Arch::Sm89).with_fp8_cache();
        assert!(s.validate().unwrap_err().contains("e4m3"));
        let s = QkvRopeSpec { kv_cache: DType::E5M2, ..QkvRopeSpec::new(DType::BF16, 64, false, false, Arch::Sm89) };
        assert!(s.validate().unwrap_err().contains("e5m2"));
    }
}
