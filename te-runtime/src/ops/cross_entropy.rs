//! Family 12 launcher: fused softmax cross-entropy loss per token and its gradient.

use super::launch::Launch;
use super::{check_dtype, grid_stride_blocks, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::CudaSlice;
use te_codegen::spec::CrossEntropySpec;
use te_codegen::{DType, KernelSpec};

/// The gradient [`cross_entropy`] writes next to the loss.
#[derive(Debug)]
pub struct CrossEntropyGrad<'a> {
    /// Written: `[tokens, vocab]` in the logits' dtype, `(softmax - onehot) * grad_scale`; or
    /// FP8 codes (E4M3 / E5M2, saturated to their largest finite value) of it where
    /// [`CrossEntropySpec::for_vocab`] picks the cluster kernel (sm_90a, rows of a multiple of
    /// 16 bytes from 32 KiB).
    pub dlogits: &'a mut Tensor,
    /// Multiplies the gradient: `1 / counted tokens` for a mean loss, `1` for a sum. For FP8
    /// `dlogits`, that times their quantization scale: the codes are `(softmax − onehot) ·
    /// grad_scale`, bounded by `grad_scale` in magnitude, so a `grad_scale` at most the format's
    /// largest value (57 344 for E5M2) uses its range without saturating (`DecoderLm` takes the
    /// largest power of two that fits); `scale_inv` is `1 / scale`.
    pub grad_scale: f32,
}

/// Per-token `loss[t] = logsumexp(logits[t]) - logits[t, targets[t]]` (f32), and with `grad`
/// `dlogits = (softmax(logits) - onehot(targets)) * grad_scale` in the same kernel.
///
/// `logits`: `[tokens, vocab]` (any leading shape, folded into tokens), f32/bf16/f16, `vocab` ≤
/// [`CrossEntropySpec::MAX_VOCAB`]; `targets`: `[tokens]` i32; `loss`: `[tokens]` f32. A target
/// equal to `ignore_index` gives loss 0 and a zero gradient row; any other target outside
/// `[0, vocab)` gives a NaN loss and a zero row. The reduction (mean over the counted tokens)
/// is the caller's: pass `grad_scale = 1 / counted`.
///
/// # Errors
/// [`Error::DType`] for FP8 logits, a `dlogits` of another dtype, or FP8 `dlogits` where the
/// cluster kernel does not run (sm_89, rows under 32 KiB or not a multiple of 16 bytes);
/// [`Error::Shape`] for a vocab
/// of 0 or above the limit, targets or loss of another length than the token count, no tokens,
/// or a `dlogits` of another shape; compile and launch failures.
pub fn cross_entropy(
    dev: &Device,
    logits: &Tensor,
    targets: &CudaSlice<i32>,
    ignore_index: i32,
    loss: &mut CudaSlice<f32>,
    grad: Option<CrossEntropyGrad<'_>>,
) -> Result<()> {
    const OP: &str = "cross_entropy";
    let shape = |message: String| Error::Shape { op: OP, message };
    check_dtype(OP, "logits", logits, DType::is_high_precision, "f32, bf16 or f16")?;
    let (tokens, vocab) = logits.as_2d(OP)?;
    if vocab == 0 || vocab > CrossEntropySpec::MAX_VOCAB {
        return Err(shape(format!("vocab = {vocab} must be in [1, {}]", CrossEntropySpec::MAX_VOCAB)));
    }
    if tokens == 0 {
        return Err(shape(format!("`logits` has shape {:?}, which holds no tokens", logits.shape())));
    }
    for (arg, len) in [("targets", targets.len()), ("loss", loss.len())] {
        if len != tokens {
            return Err(shape(format!("`{arg}` must hold one value per token ({tokens}), got {len}")));
        }
    }
    let dt = logits.dtype();
    // The row held in a cluster's shared memory where the spec takes one and the grid fits.
    let spec = match CrossEntropySpec::for_vocab(dt, grad.is_some(), vocab, dev.arch()) {
        s if s.cluster > 0 && tokens.saturating_mul(s.cluster as usize) <= i32::MAX as usize => s,
        _ => CrossEntropySpec::new(dt, grad.is_some(), dev.arch()),
    };
    let (spec, mut grad) = match grad {
        Some(g) => {
            let gd = g.dlogits.dtype();
            let spec = match gd {
                d if d == dt => spec,
                d if d.is_fp8() && spec.cluster > 0 => CrossEntropySpec { grad_fp8: Some(d), ..spec },
                d => {
                    let why = if d.is_fp8() {
                        format!(
                            "{dt} (the logits' dtype): FP8 dlogits are written by the sm_90a cluster kernel only, for \
                             rows of a multiple of 16 bytes from {} KiB to 1.6 MiB (CrossEntropySpec::for_vocab)",
                            CrossEntropySpec::MIN_CLUSTER_ROW_BYTES >> 10
                        )
                    } else {
                        format!("{dt} (the logits' dtype) or FP8 codes")
                    };
                    return Err(Error::DType { op: OP, arg: "dlogits", expected: why, got: d });
                }
            };
            super::check_shape(OP, "dlogits", g.dlogits, logits.shape())?;
            (spec, Some((g.dlogits.data_mut()?, g.grad_scale)))
        }
        None => (spec, None),
    };
    let f = dev.function(&KernelSpec::CrossEntropy(spec), 0)?;
    let shared = spec.shared_bytes(vocab);
    if shared > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)?;
    }
    let (t, v) = (tokens as u64, vocab as u64);
    let mut builder = Launch::new(OP, dev.stream(), &f, &spec, 0);
    builder.ptr("logits", logits.data()).ptr("targets", targets).ptr("loss", loss);
    if let Some((dlogits, grad_scale)) = &mut grad {
        builder.ptr("dlogits", &mut **dlogits).scalar("grad_scale", &*grad_scale);
    }
    builder.scalar("tokens", &t).scalar("vocab", &v).scalar("ignore_index", &ignore_index);
    // SAFETY: the arguments follow the signature documented on `CrossEntropySpec` (with the
    // `dlogits, grad_scale` pair exactly when the spec has `grad`): `logits` and `dlogits` hold
    // `tokens * vocab` elements of the logits' dtype, `targets` and `loss` `tokens` values
    // (checked above); the kernel reads logits columns `< vocab` and the target column only for
    // targets in `[0, vocab)`. A cluster launch has one cluster a row (`tokens · cluster`
    // blocks, fewer than 2³¹) and its chunk's dynamic shared memory (allowed above).
    let cfg = if spec.cluster > 0 {
        launch_1d(tokens * spec.cluster as usize, spec.threads, shared as u32)
    } else {
        launch_1d(grid_stride_blocks(dev, tokens * spec.threads, spec.threads), spec.threads, 0)
    };
    unsafe { builder.launch(cfg) }?;
    Ok(())
}
