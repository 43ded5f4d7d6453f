//! The input of a GEMM behind a norm (`LayerNormLinear`, fc1 of `LayerNormMLP`): the norm's
//! output, cast to FP8 in the norm kernel when the GEMM runs FP8 GEMMs, and gathered by the
//! GEMM's hook when this rank holds a token shard (sequence parallelism): as FP8 codes when the
//! ranks share the scale (TE's FP8 all-gather), else in 16 bits.

use super::gemm_core::LinearInput;
use crate::fp8::Quantizer;
use crate::modules::norm::{NormParams, NormStats};
use crate::parallel::GemmParallel;
use te_runtime::{Result, Tensor};

/// What [`norm_gemm_input`] gives: the GEMM's input, the norm's statistics (for its backward)
/// and, with `return_ln`, the norm's output in `x`'s dtype (this rank's tokens).
pub(crate) struct NormInput {
    pub input: LinearInput,
    pub stats: NormStats,
    pub ln_out: Option<Tensor>,
}

impl NormInput {
    /// The GEMM input's shape.
    pub(crate) fn gemm_shape(&self) -> Vec<usize> {
        self.input.shape()
    }
}

/// The norm of `x` as the input of a GEMM whose FP8 input quantizer is `q` (`None`: a
/// high-precision pass) and whose hook is `comm`; `return_ln` also returns the norm's output
/// (then computed in high precision and cast separately), `grad` a training forward (the FP8
/// input keeps its transpose for wgrad).
///
/// # Errors
/// Kernel, cast, NCCL and allocation errors.
pub(crate) fn norm_gemm_input(
    norm: &NormParams,
    x: &Tensor,
    q: Option<&dyn Quantizer>,
    comm: &GemmParallel,
    return_ln: bool,
    grad: bool,
) -> Result<NormInput> {
    let gathers = comm.gathers_input();
    match q {
        // A token shard under FP8 with shared scales: the norm casts this rank's tokens, their
        // codes are gathered (TE's FP8 all-gather) and transposed whole for wgrad.
        // With the communication overlap the shard's codes are gathered beside the GEMMs.
        Some(q) if gathers && !return_ln && comm.gathers_fp8(q) => {
            let (ln8, stats) = norm.forward_fp8(x, q, false)?;
            let input = match comm.overlaps_gather() {
                true => LinearInput::shard(LinearInput::Fp8(ln8), comm),
                false => LinearInput::Fp8(comm.gather_fp8(ln8, grad)?),
            };
            Ok(NormInput { input, stats, ln_out: None })
        }
        // The whole tokens under FP8: the norm kernel writes the GEMM's FP8 input.
        Some(q) if !gathers && !return_ln => {
            let (ln8, stats) = norm.forward_fp8(x, q, grad)?;
            Ok(NormInput { input: LinearInput::Fp8(ln8), stats, ln_out: None })
        }
        // The norm in 16 bits; a token shard is gathered (as FP8 codes under current scaling,
        // cast with the whole's amax), the GEMM casts the rest.
        _ => {
            let (ln, stats) = norm.forward(x, x.dtype())?;
            let codes = match q {
                Some(q) => comm.gather_cast(&ln, q, grad)?,
                None => None,
            };
            let input = match codes {
                Some(f) => LinearInput::Fp8(f),
                // A 16-bit shard: gathered beside the GEMMs with the communication overlap.
                None if comm.overlaps_gather() => LinearInput::shard(LinearInput::High(ln.clone()), comm),
                None => LinearInput::High(comm.gather_input(&ln)?),
            };
            Ok(NormInput { input, stats, ln_out: return_ln.then_some(ln) })
        }
    }
}
