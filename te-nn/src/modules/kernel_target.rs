//! [`KernelTarget`]: what kernels are specialized for besides a module's own sizes.

use crate::fp8::{Float8BlockScaling, Recipe};
use te_codegen::spec::{BlockQuantizeSpec, CastSpec, ScalingSpec};
use te_codegen::{Arch, DType, KernelSpec};

/// What kernels are specialized for besides a module's own sizes: the precision of the run, its
/// FP8 recipe, the attention key length and the GPU. Modules add their kernels for a target
/// ([`crate::Module::kernel_specs`], from their config's `kernel_specs`, e.g.
/// [`crate::modules::LinearConfig::kernel_specs`]).
///
/// Every list adds the kernels of both the FP8 path and (where it differs) the high-precision
/// one, forward and backward: a superset of what one step loads.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KernelTarget {
    /// Type of parameters, activations and gradients (a module's own `params_dtype` overrides it
    /// for that module's kernels).
    pub params_dtype: DType,
    /// FP8 recipe: its family picks the scaling kernels, its format the FP8 type of gradients
    /// (E5M2 with [`crate::fp8::Format::Hybrid`], else E4M3), delayed scaling's
    /// `amax_compute_algo` the history reduction, current scaling's `power_2_scale` the scale
    /// kernel. The other knobs do not change the kernels.
    pub recipe: Recipe,
    /// Attention key length of the batches (the softmax kernels specialize it).
    pub seq_length: usize,
    /// Whether attention forwards get rotary angles (RoPE kernels of the head dimension).
    pub rotary: bool,
    /// GPU architecture.
    pub arch: Arch,
}

impl KernelTarget {
    /// A BF16 target with TE's default recipe ([`Recipe::default`]: delayed scaling, hybrid
    /// format, max of the amax history), no RoPE, for keys of `seq_length` on `arch`.
    pub fn new(seq_length: usize, arch: Arch) -> Self {
        Self { params_dtype: DType::BF16, recipe: Recipe::default(), seq_length, rotary: false, arch }
    }

    /// This target with another `params_dtype` (a module's own).
    pub fn with_dtype(self, params_dtype: DType) -> Self {
        Self { params_dtype, ..self }
    }

    /// FP8 type of forward tensors (inputs, weights): E4M3.
    pub fn fwd_fp8(&self) -> DType {
        self.recipe.format().forward_dtype()
    }

    /// FP8 type of gradients: E5M2 with the hybrid format, else E4M3.
    pub fn bwd_fp8(&self) -> DType {
        self.recipe.format().backward_dtype()
    }

    /// What every FP8 module needs: casts of weights and inputs forward and of gradients
    /// backward, their dequantize, the amax of current scaling, and the recipe's scaling update.
    pub fn fp8_common(&self, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        for q in [self.fwd_fp8(), self.bwd_fp8()] {
            specs.push(CastSpec::quantize(dt, q, arch).into());
            specs.push(CastSpec::dequantize(q, dt, arch).into());
        }
        if let Recipe::Current(_) = self.recipe {
            specs.push(CastSpec::amax(dt, arch).into());
        }
        match self.recipe {
            Recipe::Delayed(r) => specs.push(ScalingSpec::delayed(r.amax_compute_algo, arch).into()),
            Recipe::Current(r) => specs.push(ScalingSpec::current(r.power_2_scale, arch).into()),
            Recipe::Block(b) => specs.extend(block_quantize_specs(&b, dt, arch)),
        }
    }
}

/// The blockwise casts of [`Recipe::Block`] for `dt` activations: inputs and weights forward,
/// gradients backward, in their block dims (none for an f32 `dt`, which the recipe does not cast).
pub(crate) fn block_quantize_specs(b: &Float8BlockScaling, dt: DType, arch: Arch) -> Vec<KernelSpec> {
    if !matches!(dt, DType::BF16 | DType::F16) {
        return Vec::new();
    }
    let (fwd, bwd) = (b.fp8_format.forward_dtype(), b.fp8_format.backward_dtype());
    let mut v: Vec<KernelSpec> =
        [(fwd, b.x_block_scaling_dim), (fwd, b.w_block_scaling_dim), (bwd, b.grad_block_scaling_dim)]
            .into_iter()
            .map(|(q, dim)| BlockQuantizeSpec::new(dt, q, dim, arch).into())
            .collect();
    v.sort();
    v.dedup();
    v
}
