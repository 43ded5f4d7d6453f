//! Family 18: the mixture-of-experts top-k softmax router and the auxiliary load-balancing loss
//! (TE 2.x `fused_topk_with_score_function` with `score_function="softmax"` and
//! `fused_moe_aux_loss`, `transformer_engine/common/fused_router/`; the loss is the Switch
//! Transformer's in Megatron-LM's form). The numerics are those of `te_runtime::reference::moe`
//! (`topk_router`, `aux_loss`).

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// The router kernels of one logits dtype and expert bucket, four entry points (`tokens`,
/// `experts` ≤ [`MoeRouterSpec::max_experts`], `k` ≤ `experts`, `pre_softmax`,
/// `scaling_factor` and `coeff` run time). One warp per token: each lane holds the logits of
/// experts `lane`, `lane + 32`, ... in registers (`max_experts / 32` of them).
///
/// - `<name>` ([`MoeRouterSpec::FWD_ARGS`]): the softmax over all experts in f64, rounded to
///   f32 (`scores`, `[tokens, experts]`, what the auxiliary loss reads), and the top `k` of the
///   logits (`pre_softmax` 0, TE's default) or of the scores (`pre_softmax` 1) by the total
///   order of f32 (`f32::total_cmp`), ties to the lower expert index, best first: `indices`
///   (i32 `[tokens, k]`, what `routing_map` of family 17 takes) and `probs` (f32 `[tokens,
///   k]`): the softmax of the `k` chosen logits in f64, or the chosen scores, times
///   `scaling_factor`.
/// - `<name>_bwd` ([`MoeRouterSpec::BWD_ARGS`]): `d_logits` (`[tokens, experts]`, the spec's
///   dtype) from `d_probs` (f32 `[tokens, k]`), the forward's `indices` and `scores`: with
///   `pre_softmax`, `s_i · (G_i − sf · Σ_j d_probs_j · s_{e_j})` (`G` is `sf · d_probs_j` at
///   expert `e_j`, 0 elsewhere); without, `sf · q_j · (d_probs_j − Σ_m q_m · d_probs_m)` at
///   `e_j` with `q_j = s_{e_j} / Σ_m s_{e_m}` (the forward's softmax of the chosen logits) and 0
///   elsewhere.
/// - `<name>_aux_loss` ([`MoeRouterSpec::AUX_ARGS`], one block of
///   [`MoeRouterSpec::AUX_THREADS`]): `loss = C · Σ_{t,e} scores[t, e] · tokens_per_expert[e]`
///   with `C = coeff · E / (k · T²)`, summed in f64 in a fixed order (deterministic).
/// - `<name>_aux_loss_bwd` ([`MoeRouterSpec::AUX_BWD_ARGS`]): the loss's gradient through the
///   softmax, `d_logits[t, i] (+)= s_i · (g_i − Σ_e s_e · g_e)` with `g_e = d_loss · (f32)(C ·
///   tokens_per_expert[e])`, added to what `d_logits` holds when `accumulate` is 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct MoeRouterSpec {
    /// Logits (and their gradient): bf16, f16 or f32.
    pub dtype: DType,
    /// Experts the kernels hold per token: 32, 64, 128, 256 or 512 (32 lanes × a power of two).
    pub max_experts: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl MoeRouterSpec {
    /// Threads per block of the per-token entry points (one warp a token).
    pub const THREADS: usize = 256;
    /// Tokens per block of the per-token entry points.
    pub const TOKENS_PER_BLOCK: usize = Self::THREADS / 32;
    /// Threads of the one block of `_aux_loss`.
    pub const AUX_THREADS: usize = 1024;
    /// The most experts a router of this family takes.
    pub const MAX_EXPERTS: usize = 512;

    /// The kernels of `dtype` for `experts` experts on `arch`: the smallest bucket that holds
    /// them (an `experts` above [`MoeRouterSpec::MAX_EXPERTS`] gives a spec that does not
    /// validate).
    pub fn new(dtype: DType, experts: usize, arch: Arch) -> Self {
        let per_lane = experts.div_ceil(32).max(1).checked_next_power_of_two().unwrap_or(usize::MAX);
        Self { dtype, max_experts: per_lane.saturating_mul(32), arch }
    }

    /// Arguments of the forward (entry point 0).
    pub const FWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("logits", "const void* __restrict__", "`[tokens, experts]` router logits"),
        KernelArg::write("indices", "int* __restrict__", "i32 `[tokens, k]` chosen experts, best first"),
        KernelArg::write("probs", "float* __restrict__", "f32 `[tokens, k]` routing probabilities"),
        KernelArg::write("scores", "float* __restrict__", "f32 `[tokens, experts]` softmax over all experts"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("experts", "u64", "experts"),
        KernelArg::scalar("k", "u64", "experts per token (top-k)"),
        KernelArg::scalar("pre_softmax", "int", "1: top-k of the softmax scores; 0: softmax of the top-k logits"),
        KernelArg::scalar("scaling_factor", "float", "factor of the probabilities"),
    ];

    /// Arguments of the backward (entry point 1).
    pub const BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("indices", "const int* __restrict__", "i32 `[tokens, k]` from the forward"),
        KernelArg::read("scores", "const float* __restrict__", "f32 `[tokens, experts]` from the forward"),
        KernelArg::read("d_probs", "const float* __restrict__", "f32 `[tokens, k]` gradient of the probabilities"),
        KernelArg::write("d_logits", "void* __restrict__", "`[tokens, experts]` gradient of the logits"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("experts", "u64", "experts"),
        KernelArg::scalar("k", "u64", "experts per token (top-k)"),
        KernelArg::scalar("pre_softmax", "int", "the forward's pre_softmax"),
        KernelArg::scalar("scaling_factor", "float", "the forward's scaling_factor"),
    ];

    /// Arguments of the auxiliary loss (entry point 2).
    pub const AUX_ARGS: &'static [KernelArg] = &[
        KernelArg::read("scores", "const float* __restrict__", "f32 `[tokens, experts]` from the forward"),
        KernelArg::read("tokens_per_expert", "const int* __restrict__", "i32 `[experts]` tokens routed to each expert"),
        KernelArg::write("loss", "float* __restrict__", "f32 `[1]` the loss"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("experts", "u64", "experts"),
        KernelArg::scalar("k", "u64", "experts per token (top-k)"),
        KernelArg::scalar("coeff", "float", "the loss coefficient"),
    ];

    /// Arguments of the auxiliary loss's backward (entry point 3).
    pub const AUX_BWD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("scores", "const float* __restrict__", "f32 `[tokens, experts]` from the forward"),
        KernelArg::read("tokens_per_expert", "const int* __restrict__", "i32 `[experts]` as in the loss"),
        KernelArg::read("d_loss", "const float* __restrict__", "f32 `[1]` gradient of the loss"),
        KernelArg::read_write("d_logits", "void* __restrict__", "`[tokens, experts]` gradient of the logits"),
        KernelArg::scalar("tokens", "u64", "tokens"),
        KernelArg::scalar("experts", "u64", "experts"),
        KernelArg::scalar("k", "u64", "experts per token (top-k)"),
        KernelArg::scalar("coeff", "float", "the loss coefficient"),
        KernelArg::scalar("accumulate", "int", "1: add to d_logits; 0: overwrite it"),
    ];
}

impl Family for MoeRouterSpec {
    fn family(&self) -> &'static str {
        "moe_router"
    }
    fn template(&self) -> &'static str {
        "moe_router.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!("{}_e{}", self.dtype, self.max_experts)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &["", "_bwd", "_aux_loss", "_aux_loss_bwd"]
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            0 => Self::FWD_ARGS,
            1 => Self::BWD_ARGS,
            2 => Self::AUX_ARGS,
            _ => Self::AUX_BWD_ARGS,
        }
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("threads", &Self::THREADS);
        ctx.insert("aux_threads", &Self::AUX_THREADS);
        ctx.insert("per_lane", &(self.max_experts / 32));
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("the MoE router takes bf16, f16 or f32 logits, not {}", self.dtype));
        }
        if !(32..=Self::MAX_EXPERTS).contains(&self.max_experts) || !(self.max_experts / 32).is_power_of_two() {
            return Err(format!(
                "the MoE router holds 32, 64, 128, 256 or {} experts per token, not {}",
                Self::MAX_EXPERTS,
                self.max_experts
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::MoeRouterSpec;
    use crate::render::render;
    use crate::spec::KernelSpec;
    use crate::{Arch, DType, DiskCache, KernelCompiler};

    /// Every bucket of every dtype on `arch`.
    fn specs(arch: Arch) -> Vec<KernelSpec> {
        let mut v = Vec::new();
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            for experts in [8, 64, 100, 256, 512] {
                v.push(MoeRouterSpec::new(dtype, experts, arch).into());
            }
        }
        v
    }

    #[test]
    fn buckets_and_refusals() {
        let b = |e| MoeRouterSpec::new(DType::BF16, e, Arch::Sm90a).max_experts;
        assert_eq!(
            [b(0), b(1), b(32), b(33), b(64), b(65), b(128), b(129), b(512)],
            [32, 32, 32, 64, 64, 128, 128, 256, 512]
        );
        let too_many: KernelSpec = MoeRouterSpec::new(DType::BF16, 513, Arch::Sm90a).into();
        assert!(too_many.validate().unwrap_err().to_string().contains("1024"));
        let huge: KernelSpec = MoeRouterSpec::new(DType::F32, usize::MAX, Arch::Sm90a).into();
        assert!(huge.validate().is_err());
        let fp8: KernelSpec = MoeRouterSpec::new(DType::E4M3, 64, Arch::Sm90a).into();
        assert!(fp8.validate().unwrap_err().to_string().contains("e4m3"));
        let spec: KernelSpec = MoeRouterSpec::new(DType::BF16, 64, Arch::Sm90a).into();
        assert_eq!(spec.name(), "te_moe_router_bf16_e64_sm_90a");
    }

    /// The rendered entry points carry exactly the declared parameters (the catalog's check of
    /// `args.rs`, for this family's specs).
    #[test]
    fn rendered_signatures_are_the_declared_ones() {
        for spec in specs(Arch::Sm90a) {
            let src = render(&spec).unwrap();
            let mut rest = src.as_str();
            for (entry, name) in spec.entry_points().iter().enumerate() {
                let at = rest.find(&format!(" {name}(")).unwrap_or_else(|| panic!("{name} is not defined"));
                let after = &rest[at + name.len() + 2..];
                let params: Vec<String> = after[..after.find(')').unwrap()]
                    .split(',')
                    .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
                    .collect();
                let declared: Vec<String> = spec.family().params(entry).iter().map(|a| a.declaration()).collect();
                assert_eq!(params, declared, "{name}");
                rest = after;
            }
        }
    }

    /// Every bucket of every dtype compiles with NVRTC for Hopper and Ada, each CUBIN defining
    /// the four entry points.
    #[test]
    fn every_router_spec_compiles() {
        let c = KernelCompiler::new(DiskCache::disabled())
            .expect("NVRTC must be loadable: source scripts/env.sh, which installs it");
        for arch in [Arch::Sm90a, Arch::Sm89] {
            for spec in specs(arch) {
                let (bin, _) = c.compile(&spec).unwrap_or_else(|e| panic!("{}: {e}", spec.name()));
                for e in spec.entry_points() {
                    assert!(bin.bytes.windows(e.len()).any(|w| w == e.as_bytes()), "{} lacks {e}", spec.name());
                }
            }
        }
    }
}
