//! [`KernelTarget`]: what kernels are specialized for besides a module's own sizes.

use crate::fp8::Recipe;
use te_codegen::spec::CastSpec;
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
    /// FP8 recipe: its format picks the FP8 type of gradients (E5M2 with
    /// [`crate::fp8::Format::Hybrid`], else E4M3) and the recipe the kernels it adds
    /// ([`Recipe::kernel_specs`]: delayed scaling's `amax_compute_algo` the history reduction,
    /// current scaling's `power_2_scale` the scale kernel, blockwise scaling's block dims its
    /// casts). The other knobs do not change the kernels.
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
    /// backward, their dequantize, and the kernels the recipe adds (its amax and scale update,
    /// or its blockwise casts: [`Recipe::kernel_specs`]).
    pub fn fp8_common(&self, specs: &mut Vec<KernelSpec>) {
        let (dt, arch) = (self.params_dtype, self.arch);
        for q in [self.fwd_fp8(), self.bwd_fp8()] {
            specs.push(CastSpec::quantize(dt, q, arch).into());
            specs.push(CastSpec::dequantize(q, dt, arch).into());
        }
        self.recipe.kernel_specs(dt, arch, specs);
    }
}
