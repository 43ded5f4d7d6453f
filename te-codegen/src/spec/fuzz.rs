//! Fuzzing of the spec constructors and checks (reliability issue: random dimensions and dtypes
//! never panic; a spec either validates, and then names itself and sizes its launch, or is
//! refused with a message). Run as ordinary tests: 2 000 cases per family per CI run.

use super::*;
use crate::{Arch, DType};
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = DType> {
    prop::sample::select(DType::ALL.to_vec())
}

fn arch() -> impl Strategy<Value = Arch> {
    prop::sample::select(Arch::ALL.to_vec())
}

fn direction() -> impl Strategy<Value = Direction> {
    prop::sample::select(vec![Direction::Fwd, Direction::Bwd])
}

fn activation() -> impl Strategy<Value = Activation> {
    prop::sample::select(Activation::ALL.to_vec())
}

/// Sizes from 0 through odd values to beyond any tile (and the extremes).
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![0usize..=300, 300usize..70_000, Just(usize::MAX / 4)]
}

/// Validates `spec`; a valid one must name itself and give every entry point's arguments
/// without panicking. Refusals are messages.
fn check(spec: KernelSpec) {
    if spec.validate().is_ok() {
        assert!(!spec.name().is_empty());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn norm_specs(kind in prop::sample::select(vec![NormKind::LayerNorm, NormKind::RmsNorm]), d in direction(),
                  i in dtype(), o in dtype(), w in dtype(), hidden in size(), zc in any::<bool>(), a in arch()) {
        check(NormSpec::new(kind, d, i, o, w, hidden, zc, a).into());
    }

    #[test]
    fn activation_specs(act in activation(), d in direction(), i in dtype(), o in dtype(), cols in size(),
                        bias in any::<bool>(), a in arch()) {
        check(ActivationSpec::new(act, d, i, o, cols, bias, a).into());
    }

    #[test]
    fn softmax_and_rope_specs(mask in prop::sample::select(vec![MaskKind::None, MaskKind::Causal, MaskKind::Padding]),
                              d in direction(), t in dtype(), sk in size(), d2 in size(), a in arch(),
                              f in prop::sample::select(vec![RopeFormat::Sbhd, RopeFormat::Bshd])) {
        check(SoftmaxSpec::new(mask, d, t, sk, a).into());
        check(RopeSpec::new(d, f, t, sk, d2, a).into());
    }

    #[test]
    fn cast_transpose_specs(i in dtype(), o in dtype(), cols in size(), dbias in any::<bool>(),
                            act in prop::option::of(activation()), a in arch()) {
        check(CastTransposeSpec::new(i, o, cols, dbias, act, a).into());
    }

    #[test]
    fn block_quantize_specs(i in dtype(), o in dtype(), block_dim in size(), a in arch()) {
        let spec = BlockQuantizeSpec::new(i, o, block_dim, a);
        check(spec.into());
        for e in 0..spec.entry_suffixes().len() {
            let _ = spec.params(e);
        }
    }

    #[test]
    fn flash_attention_specs(d in direction(), t in dtype(), head_dim in size(), a in arch(), block_m in size(),
                             block_n in size(), wgmma in any::<bool>(), fp8 in any::<bool>(), dropout in any::<bool>(),
                             grad_e5m2 in any::<bool>()) {
        check(FlashAttnSpec::new(d, t, head_dim, a).with_dropout(dropout).into());
        check(FlashAttnSpec::fp8_forward(t, head_dim, a).into());
        check(FlashAttnSpec::fp8_backward(t, head_dim, a, grad_e5m2).with_dropout(dropout).into());
        let raw = FlashAttnSpec { block_m, block_n, wgmma, fp8, grad_e5m2, ..FlashAttnSpec::new(d, t, head_dim, a) };
        check(raw.into());
        if KernelSpec::from(raw).validate().is_ok() {
            for e in 0..3 {
                let _ = raw.shared_bytes(e);
            }
        }
    }

    #[test]
    fn moe_router_specs(t in dtype(), experts in size(), a in arch()) {
        let spec = MoeRouterSpec::new(t, experts, a);
        if (1..=MoeRouterSpec::MAX_EXPERTS).contains(&experts) && t.is_high_precision() {
            prop_assert!(spec.max_experts >= experts && spec.max_experts <= 2 * experts.max(16));
            prop_assert!(KernelSpec::from(spec).validate().is_ok());
        }
        check(spec.into());
    }
}
