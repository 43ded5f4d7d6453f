//! Family 22 launcher: the GEMV of a decode step ([`te_codegen::spec::GemvSpec`]) — a few token
//! rows against a weight read once, with the norm before it (and a sandwich norm's residual add
//! before that), the bias, the activation and the residual add after it in the same launch.
//! A decode step at batch 1 spends its time launching kernels; this makes a transformer layer's
//! four GEMMs and their neighbours four launches.

use super::launch::PdlLaunch;
use super::{check_dtype, check_shape, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use te_codegen::spec::{Family, GemvEpilogue, GemvPrologue, GemvSpec, NormKind};
use te_codegen::{Arch, DType, KernelSpec};

const OP: &str = "gemv";

/// A norm of the prologue: `γ` `[k]` BF16 (as stored: `γ − 1` under `zero_centered_gamma`) and,
/// for LayerNorm, `β` `[k]` BF16.
#[derive(Debug, Clone, Copy)]
pub struct GemvNorm<'a> {
    /// `γ`.
    pub gamma: &'a Tensor,
    /// `β` (LayerNorm only).
    pub beta: Option<&'a Tensor>,
}

/// The norms' shared options (a model uses one kind of norm).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GemvNormKind {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Added to the variance.
    pub eps: f32,
    /// The norms scale by `1 + γ`.
    pub zero_centered_gamma: bool,
}

/// What the GEMV multiplies: the rows `x: [m, k]` BF16 as they are, normalized, or normalized
/// after a residual add (a sandwich norm's, or a pre-norm layer's).
#[derive(Debug)]
pub enum GemvInput<'a> {
    /// `x`.
    Plain(&'a Tensor),
    /// `norm(x)`.
    Norm {
        /// `[m, k]`.
        x: &'a Tensor,
        /// The options of `norm`.
        kind: GemvNormKind,
        /// The norm's weights.
        norm: GemvNorm<'a>,
    },
    /// `h = x + post(a)` is written to `h_out` (`[m, k]`, not `x`), then `norm(h)` is multiplied.
    AddNorm {
        /// `[m, k]`: the residual stream.
        x: &'a Tensor,
        /// `[m, k]`: the sublayer's output.
        a: &'a Tensor,
        /// The options of both norms.
        kind: GemvNormKind,
        /// The sublayer's post-norm (`post_attention_layernorm`, `post_feedforward_layernorm`).
        post: GemvNorm<'a>,
        /// The next pre-norm.
        norm: GemvNorm<'a>,
        /// `[m, k]`: receives `h`.
        h_out: &'a mut Tensor,
    },
    /// `h = x + a` is written to `h_out` (`[m, k]`, not `x`), then `norm(h)` is multiplied: a
    /// pre-norm layer's residual add before its MLP's norm.
    ResidualNorm {
        /// `[m, k]`: the residual stream.
        x: &'a Tensor,
        /// `[m, k]`: the sublayer's output.
        a: &'a Tensor,
        /// The options of the norm.
        kind: GemvNormKind,
        /// The norm.
        norm: GemvNorm<'a>,
        /// `[m, k]`: receives `h`.
        h_out: &'a mut Tensor,
    },
}

/// The weight `[n · weight_rows, k]`: BF16, or FP8 codes with their per-tensor `scale_inv`.
#[derive(Debug, Clone, Copy)]
pub enum GemvWeight<'a> {
    /// BF16 values.
    Bf16(&'a Tensor),
    /// E4M3 or E5M2 codes; the value is `code · scale_inv[0]`.
    Fp8 {
        /// The codes.
        data: &'a Tensor,
        /// f32 `[1]`.
        scale_inv: &'a CudaSlice<f32>,
    },
}

impl GemvWeight<'_> {
    fn tensor(&self) -> &Tensor {
        match self {
            GemvWeight::Bf16(t) | GemvWeight::Fp8 { data: t, .. } => t,
        }
    }
}

/// The matrix side of a [`gemv`]: the weight, the bias (BF16 `[n · weight_rows]`) and whether
/// both are constant.
#[derive(Debug, Clone, Copy)]
pub struct GemvMatrix<'a> {
    /// `[n · weight_rows, k]`.
    pub weight: GemvWeight<'a>,
    /// BF16 `[n · weight_rows]`.
    pub bias: Option<&'a Tensor>,
    /// The weight, its scale and the bias are not written by the kernel launched just before
    /// (model weights during inference): on Hopper the GEMV then starts loading the weight
    /// before that kernel has finished (programmatic dependent launch), which hides its launch
    /// and its first loads behind that kernel's tail.
    pub constant: bool,
}

/// The most token rows for which the decode paths run [`gemv`] instead of a GEMM: past two rows
/// its shared-memory reads of the rows outgrow what it saves (H100, Gemma 3 270M's shapes,
/// graph-replayed: 1.6–3.1× faster than the unfused GEMM and kernels at one row, 1.3–2.0× at
/// two, 0.8–1.2× at four, 0.4–0.7× at eight; `benches/kernels/gemv.rs`).
pub const DECODE_MAX_ROWS: usize = 2;

/// The most token rows one [`gemv`] takes for `k` input features (1 to 8; 0 for `k` beyond
/// 49 152).
pub fn max_rows(k: usize) -> usize {
    GemvSpec::max_rows(k)
}

/// The kernel [`gemv`] runs on `arch` for a `weight` dtype, `k` features and `m` rows, the
/// prologue `(prologue, norm kind, zero_centered_gamma)` and `(bias, epilogue)`: one spec per
/// power of two of rows (fewer accumulators for a single sequence). Prewarm lists
/// (`te_nn::modules::TransformerLayerConfig::kernel_specs`) name the kernels through it.
pub fn gemv_spec(
    arch: Arch,
    weight: DType,
    (k, m): (usize, usize),
    (prologue, norm, zero_centered_gamma): (GemvPrologue, NormKind, bool),
    (bias, epilogue): (bool, GemvEpilogue),
) -> GemvSpec {
    let rows = m.next_power_of_two().min(max_rows(k)).max(1);
    GemvSpec::new(weight, k, rows, arch)
        .with_prologue(prologue, norm, zero_centered_gamma)
        .with_epilogue(bias, epilogue)
}

/// `out[r, j] = epilogue(round(p[r] · w[j] · s + bias[j]))` for the rows `p` of `input`
/// (BF16 `[m, k]`, `m ≤ `[`max_rows`]`(k)`), the matrix's weight `w: [n · weight_rows, k]` and
/// `out: [m, n]` BF16; `Residual` adds into `out` in place, a gated activation reads weight (and
/// bias) rows `j` and `n + j` (see [`GemvSpec`] for the arithmetic).
///
/// # Errors
/// [`Error::DType`] for inputs or outputs other than BF16 or a weight other than BF16 or FP8;
/// [`Error::Shape`] for mismatched shapes, more rows than [`max_rows`], a `k` that is not a
/// multiple of 16 bytes of weight, a LayerNorm without `β` (or an RMSNorm with one);
/// compile and launch failures.
pub fn gemv(
    dev: &Device,
    input: GemvInput<'_>,
    matrix: GemvMatrix<'_>,
    epilogue: GemvEpilogue,
    out: &mut Tensor,
) -> Result<()> {
    let GemvMatrix { weight, bias, constant } = matrix;
    let shape_err = |message: String| Error::Shape { op: OP, message };
    let w = weight.tensor();
    check_dtype(OP, "weight", w, |d| matches!(d, DType::BF16 | DType::E4M3 | DType::E5M2), "bf16, e4m3 or e5m2")?;
    if matches!(weight, GemvWeight::Bf16(_)) != (w.dtype() == DType::BF16) {
        return Err(shape_err(format!(
            "a {} weight must come as GemvWeight::{}",
            w.dtype(),
            if w.dtype() == DType::BF16 { "Bf16" } else { "Fp8" }
        )));
    }
    let (x, prologue, kind) = match &input {
        GemvInput::Plain(x) => (*x, GemvPrologue::None, None),
        GemvInput::Norm { x, kind, .. } => (*x, GemvPrologue::Norm, Some(*kind)),
        GemvInput::AddNorm { x, kind, .. } => (*x, GemvPrologue::AddNorm, Some(*kind)),
        GemvInput::ResidualNorm { x, kind, .. } => (*x, GemvPrologue::ResidualNorm, Some(*kind)),
    };
    check_dtype(OP, "x", x, |d| d == DType::BF16, "bf16")?;
    let (m, k) = x.as_2d(OP)?;
    let wr = epilogue.weight_rows();
    let (w_rows, w_k) = w.as_2d(OP)?;
    if w_k != k || w_rows % wr != 0 || w_rows == 0 {
        return Err(shape_err(format!(
            "the weight is [{w_rows}, {w_k}]: it must be [n · {wr}, {k}] for x [{m}, {k}]{}",
            if wr == 2 { " (a gated activation reads [gate; up] rows)" } else { "" }
        )));
    }
    let n = w_rows / wr;
    let max = max_rows(k);
    if m == 0 || m > max {
        return Err(shape_err(format!(
            "x has {m} rows: a GEMV of k = {k} takes 1 to {max}; run a GEMM for more tokens"
        )));
    }
    check_dtype(OP, "out", out, |d| d == DType::BF16, "bf16")?;
    check_shape(OP, "out", out, &[m, n])?;
    if let Some(b) = bias {
        check_dtype(OP, "bias", b, |d| d == DType::BF16, "bf16")?;
        check_shape(OP, "bias", b, &[w_rows])?;
    }
    let norm_kind = kind.map_or(NormKind::RmsNorm, |k| k.kind);
    let check_residual = |a: &Tensor, h_out: &Tensor| -> Result<()> {
        check_dtype(OP, "a", a, |d| d == DType::BF16, "bf16")?;
        check_shape(OP, "a", a, &[m, k])?;
        check_dtype(OP, "h_out", h_out, |d| d == DType::BF16, "bf16")?;
        check_shape(OP, "h_out", h_out, &[m, k])
    };
    let check_norm = |what: &str, nw: &GemvNorm<'_>| -> Result<()> {
        check_dtype(OP, "gamma", nw.gamma, |d| d == DType::BF16, "bf16")?;
        check_shape(OP, what, nw.gamma, &[k])?;
        match (norm_kind, nw.beta) {
            (NormKind::LayerNorm, Some(b)) => {
                check_dtype(OP, "beta", b, |d| d == DType::BF16, "bf16")?;
                check_shape(OP, what, b, &[k])
            }
            (NormKind::RmsNorm, None) => Ok(()),
            (kind, _) => Err(shape_err(format!("{what}: a {} takes β only for LayerNorm", kind.name()))),
        }
    };
    match &input {
        GemvInput::Plain(_) => {}
        GemvInput::Norm { norm, .. } => check_norm("norm", norm)?,
        GemvInput::AddNorm { a, post, norm, h_out, .. } => {
            check_norm("post", post)?;
            check_norm("norm", norm)?;
            check_residual(a, h_out)?;
        }
        GemvInput::ResidualNorm { a, norm, h_out, .. } => {
            check_norm("norm", norm)?;
            check_residual(a, h_out)?;
        }
    }
    let zc = kind.is_some_and(|k| k.zero_centered_gamma);
    let eps = kind.map_or(0.0, |k| k.eps);
    let spec = gemv_spec(dev.arch(), w.dtype(), (k, m), (prologue, norm_kind, zc), (bias.is_some(), epilogue));
    spec.validate().map_err(shape_err)?;
    let f = dev.function(&KernelSpec::Gemv(spec), 0)?;
    let shared = spec.shared_bytes();
    if shared > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared as i32)?;
    }
    let stream = dev.stream();
    let addr = |t: &Tensor| t.data().device_ptr(stream).0;
    let programmatic = constant && dev.arch() == Arch::Sm90a;
    let mut l = PdlLaunch::new(OP, stream, &f, (&spec, 0), programmatic);
    l.ptr("x", addr(x));
    let pre = match &input {
        GemvInput::Plain(_) => None,
        GemvInput::Norm { norm, .. } => Some(*norm),
        GemvInput::AddNorm { a, post, norm, .. } => {
            l.ptr("a", addr(a)).ptr("gamma0", addr(post.gamma));
            if let Some(b) = post.beta {
                l.ptr("beta0", addr(b));
            }
            Some(*norm)
        }
        GemvInput::ResidualNorm { a, norm, .. } => {
            l.ptr("a", addr(a));
            Some(*norm)
        }
    };
    if let GemvInput::AddNorm { h_out, .. } | GemvInput::ResidualNorm { h_out, .. } = input {
        l.ptr("h_out", h_out.data_mut()?.device_ptr_mut(stream).0);
    }
    if let Some(norm) = pre {
        l.ptr("gamma1", addr(norm.gamma));
        if let Some(b) = norm.beta {
            l.ptr("beta1", addr(b));
        }
    }
    l.ptr("w", addr(w));
    if let GemvWeight::Fp8 { scale_inv, .. } = weight {
        l.ptr("w_scale_inv", scale_inv.device_ptr(stream).0);
    }
    if let Some(b) = bias {
        l.ptr("bias", addr(b));
    }
    l.ptr("out", out.data_mut()?.device_ptr_mut(stream).0);
    l.scalar32("m", m as u32).scalar32("n", n as u32).scalar32("eps", eps.to_bits());
    // Enough blocks to fill the GPU, each recomputing the prologue once and striding over the
    // outputs (a warp per output).
    let blocks = n.div_ceil(GemvSpec::WARPS).min(dev.sm_count() * 8);
    // SAFETY: the arguments follow `GemvSpec::ARGS` for this spec: x (and a, h_out) hold `m · k`
    // BF16, the norms' weights `k`, w `n · weight_rows · k` elements of its dtype, the bias `n ·
    // weight_rows`, out `m · n` (all checked above); h_out and out are distinct tensors from the
    // inputs (borrowed mutably); the dynamic shared memory is `spec.shared_bytes()`. On Hopper
    // the template waits (`griddepcontrol.wait`) after its first weight loads, before it reads
    // the rows or writes anything.
    unsafe { l.launch(launch_1d(blocks, GemvSpec::THREADS, shared as u32)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_kernel_per_power_of_two_of_rows_within_the_shared_memory() {
        let spec = |k, m| {
            let pro = (GemvPrologue::Norm, NormKind::RmsNorm, true);
            gemv_spec(Arch::Sm90a, DType::BF16, (k, m), pro, (false, GemvEpilogue::Store))
        };
        let rows = |k, m| spec(k, m).rows;
        assert_eq!([rows(640, 1), rows(640, 2), rows(640, 3), rows(640, 5), rows(640, 8)], [1, 2, 4, 8, 8]);
        // k = 8192: six rows fit 96 KiB, so five rows take the six-row kernel.
        assert_eq!((max_rows(8192), rows(8192, 5)), (6, 6));
        let s = spec(640, 1);
        assert!(s.zero_centered_gamma && s.prologue == GemvPrologue::Norm && s.validate().is_ok());
        // A plain prologue drops the norm options.
        let plain = gemv_spec(
            Arch::Sm89,
            DType::E4M3,
            (2048, 2),
            (GemvPrologue::None, NormKind::LayerNorm, true),
            (true, GemvEpilogue::Residual),
        );
        assert!(!plain.zero_centered_gamma && plain.bias && plain.validate().is_ok());
        assert_eq!(DECODE_MAX_ROWS, 2);
    }
}
