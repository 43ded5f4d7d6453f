//! What cuBLASLt accepts, checked on the host before anything touches the device: the element
//! type combinations of `CUBLAS_COMPUTE_32F` GEMMs and the alignment FP8 GEMMs need.
//!
//! Sources: the cuBLAS docs, `cublasLtMatmul` (tables of supported type combinations, the FP8
//! requirements: TN layout, 16-byte aligned leading dimensions) and
//! `CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE` (the bias type is D's type except for FP8 GEMMs with an
//! f32 or FP8 output); TE `common/gemm/cublaslt_gemm.cu` (C type of an FP8-output GEMM = bias
//! type, bf16 without a bias; leading dimensions of FP8 operands % 16).

use crate::ops::check_fp8_cols;
use crate::{Error, Result};
use te_codegen::DType;

const OP: &str = "gemm";

/// The element types of one GEMM, in this crate's row-major terms (`a`, `b` as passed to
/// [`super::gemm`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Types {
    /// Left operand.
    pub a: DType,
    /// Right operand.
    pub b: DType,
    /// C, the matrix `accumulate` adds: D's type, except for an FP8 D, whose C is bf16 or f16
    /// (cuBLASLt requires C = bias type there; C is never read since FP8 outputs never
    /// accumulate).
    pub c: DType,
    /// Output.
    pub d: DType,
    /// The epilogue vectors (bias, bias gradient).
    pub bias: DType,
    /// The GELU aux matrix (`pre_gelu`): C's type (never FP8, as in TE).
    pub aux: DType,
}

impl Types {
    /// True when the operands are FP8 (then both are).
    pub(crate) fn fp8(&self) -> bool {
        self.a.is_fp8()
    }
}

/// The cuBLASLt element type of `dtype`.
pub(crate) fn cuda_type(dtype: DType) -> cudarc::cublaslt::sys::cudaDataType {
    use cudarc::cublaslt::sys::cudaDataType::*;
    match dtype {
        DType::F32 => CUDA_R_32F,
        DType::BF16 => CUDA_R_16BF,
        DType::F16 => CUDA_R_16F,
        DType::E4M3 => CUDA_R_8F_E4M3,
        DType::E5M2 => CUDA_R_8F_E5M2,
    }
}

fn dtype_error(arg: &'static str, expected: impl Into<String>, got: DType) -> Error {
    Error::DType { op: OP, arg, expected: expected.into(), got }
}

/// Resolves the types of a GEMM from the operand dtypes `a`, `b`, the output dtype `d`, and
/// the dtypes of the epilogue's vector (`bias` or `bgrad`) and aux matrix (`pre_gelu`), each
/// given with its argument name.
///
/// Accepted:
/// - FP8 × FP8 (e4m3 × e4m3, e4m3 × e5m2, e5m2 × e4m3) into bf16, f16, f32, e4m3 or e5m2;
///   bias bf16 for bf16, f32 and FP8 outputs, f16 for f16 outputs, and bf16 or f16 for FP8
///   outputs (it then sets C's type, bf16 without a bias). cuBLASLt may still reject an
///   output for some input pair (it lists e5m2 outputs only for mixed inputs); that surfaces as
///   [`Error::Gemm`] from the heuristic.
/// - bf16 × bf16, f16 × f16, f32 × f32 into the same type or f32; bias of D's type.
///
/// # Errors
/// [`Error::DType`] naming the argument: mixed FP8 and high-precision operands, e5m2 × e5m2
/// (cuBLASLt has no such GEMM), different high-precision operands, an output the inputs cannot
/// produce, a bias or aux of the wrong type.
pub(crate) fn resolve(
    a: DType,
    b: DType,
    d: DType,
    bias: Option<(&'static str, DType)>,
    aux: Option<(&'static str, DType)>,
) -> Result<Types> {
    let (c, bias_type) = if a.is_fp8() {
        if !b.is_fp8() {
            return Err(dtype_error("b", "e4m3 or e5m2 (`a` is FP8)", b));
        }
        if a == DType::E5M2 && b == DType::E5M2 {
            return Err(dtype_error(
                "b",
                "e4m3 when `a` is e5m2 (cuBLASLt has no e5m2 × e5m2 GEMM; quantize the forward tensor as e4m3)",
                b,
            ));
        }
        match d {
            DType::BF16 | DType::F32 => (d, DType::BF16),
            DType::F16 => (d, DType::F16),
            DType::E4M3 | DType::E5M2 => match bias {
                Some((_, t @ (DType::BF16 | DType::F16))) => (t, t),
                Some((arg, t)) => return Err(dtype_error(arg, "bf16 or f16 (an FP8 output takes either)", t)),
                None => (DType::BF16, DType::BF16),
            },
        }
    } else {
        if b != a {
            return Err(dtype_error("b", format!("{a} like `a`"), b));
        }
        if d != a && d != DType::F32 {
            return Err(dtype_error("d", format!("{a} or f32 (the inputs are {a})"), d));
        }
        (d, d)
    };
    if let Some((arg, t)) = bias {
        if t != bias_type {
            return Err(dtype_error(arg, format!("{bias_type} (for {a} × {b} → {d})"), t));
        }
    }
    if let Some((arg, t)) = aux {
        if t != c {
            return Err(dtype_error(arg, format!("{c} (for {a} × {b} → {d})"), t));
        }
    }
    Ok(Types { a, b, c, d, bias: bias_type, aux: c })
}

/// For FP8 GEMMs, checks what cuBLASLt requires of the row-major `D[m, n] = A[m, k] · B[n, k]ᵀ`:
/// leading dimensions that are multiples of 16 bytes, i.e. `k % 16 == 0` for the operands
/// and `n * size % 16 == 0` for D and C. `m` needs nothing. High-precision GEMMs take any shape.
///
/// # Errors
/// [`Error::Shape`] naming the dimension and what to pad it to.
pub(crate) fn check_fp8_alignment(types: &Types, n: usize, k: usize) -> Result<()> {
    if !types.fp8() {
        return Ok(());
    }
    check_fp8_cols(OP, "k (last dim of `a` and `b`; in_features in fprop)", k)?;
    let narrowest = types.d.size_bytes().min(types.c.size_bytes());
    let multiple = 16 / narrowest;
    if n % multiple != 0 {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "n (last dim of `d`; out_features in fprop) = {n} must be a multiple of {multiple} for an FP8 GEMM with a \
                 {} output (rows of D and C must be 16-byte aligned); pad it to {}",
                types.d,
                n.div_ceil(multiple) * multiple
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    fn dtype_arg(e: Error) -> &'static str {
        match e {
            Error::DType { arg, .. } => arg,
            other => panic!("expected a dtype error, got {other}"),
        }
    }

    #[test]
    fn fp8_combinations_follow_the_cublaslt_table() {
        for (a, b) in [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)] {
            let t = resolve(a, b, BF16, None, None).unwrap();
            assert_eq!((t.c, t.bias, t.aux), (BF16, BF16, BF16));
            let t = resolve(a, b, F16, Some(("bias", F16)), None).unwrap();
            assert_eq!((t.c, t.bias), (F16, F16));
            let t = resolve(a, b, F32, Some(("bias", BF16)), None).unwrap();
            assert_eq!((t.c, t.bias, t.aux), (F32, BF16, F32));
            let t = resolve(a, b, E4M3, None, None).unwrap();
            assert_eq!((t.c, t.bias), (BF16, BF16), "no bias: C is bf16, as in TE");
            let t = resolve(a, b, E4M3, Some(("bias", F16)), Some(("pre_gelu", F16))).unwrap();
            assert_eq!((t.c, t.bias, t.aux), (F16, F16, F16), "C follows an f16 bias");
        }
    }

    #[test]
    fn bad_fp8_combinations_name_the_argument() {
        let e = resolve(E5M2, E5M2, BF16, None, None).unwrap_err();
        assert!(e.to_string().contains("no e5m2 × e5m2"), "{e}");
        assert_eq!(dtype_arg(e), "b");
        assert_eq!(dtype_arg(resolve(E4M3, BF16, BF16, None, None).unwrap_err()), "b");
        assert_eq!(dtype_arg(resolve(BF16, E4M3, BF16, None, None).unwrap_err()), "b");
        assert_eq!(dtype_arg(resolve(E4M3, E4M3, F32, Some(("bias", F32)), None).unwrap_err()), "bias");
        assert_eq!(dtype_arg(resolve(E4M3, E4M3, BF16, Some(("bgrad", F16)), None).unwrap_err()), "bgrad");
        assert_eq!(dtype_arg(resolve(E4M3, E4M3, E4M3, Some(("bias", F32)), None).unwrap_err()), "bias");
        assert_eq!(dtype_arg(resolve(E4M3, E4M3, BF16, None, Some(("pre_gelu", E4M3))).unwrap_err()), "pre_gelu");
    }

    #[test]
    fn high_precision_combinations() {
        for x in [BF16, F16, F32] {
            let t = resolve(x, x, x, Some(("bias", x)), Some(("pre_gelu", x))).unwrap();
            assert_eq!((t.c, t.d, t.bias, t.aux), (x, x, x, x));
            let t = resolve(x, x, F32, None, None).unwrap();
            assert_eq!((t.c, t.bias), (F32, F32), "{x} inputs into an f32 output (wgrad into main_grad)");
        }
        assert_eq!(dtype_arg(resolve(BF16, F16, BF16, None, None).unwrap_err()), "b");
        assert_eq!(dtype_arg(resolve(F32, F32, BF16, None, None).unwrap_err()), "d");
        assert_eq!(dtype_arg(resolve(BF16, BF16, E4M3, None, None).unwrap_err()), "d");
        assert_eq!(dtype_arg(resolve(BF16, BF16, BF16, Some(("bias", F32)), None).unwrap_err()), "bias");
    }

    #[test]
    fn fp8_alignment_names_the_dimension_and_the_padding() {
        let bf16_out = resolve(E4M3, E4M3, BF16, None, None).unwrap();
        check_fp8_alignment(&bf16_out, 8, 16).unwrap();
        let e = check_fp8_alignment(&bf16_out, 64, 1000).unwrap_err().to_string();
        assert!(e.contains("k (") && e.contains("= 1000") && e.contains("pad it to 1008"), "{e}");
        let e = check_fp8_alignment(&bf16_out, 1001, 64).unwrap_err().to_string();
        assert!(e.contains("n (") && e.contains("multiple of 8") && e.contains("pad it to 1008"), "{e}");
        let fp8_out = resolve(E4M3, E4M3, E4M3, None, None).unwrap();
        let e = check_fp8_alignment(&fp8_out, 1000, 64).unwrap_err().to_string();
        assert!(e.contains("multiple of 16") && e.contains("pad it to 1008"), "{e}");
        let f32_out = resolve(E4M3, E4M3, F32, None, None).unwrap();
        check_fp8_alignment(&f32_out, 12, 16).unwrap();
        let bf16 = resolve(BF16, BF16, BF16, None, None).unwrap();
        check_fp8_alignment(&bf16, 7, 13).unwrap();
    }
}
