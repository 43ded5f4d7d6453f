//! GEMMs on cuBLASLt: FP8 with per-tensor scales and bf16/f16/f32, with TE's fused epilogues
//! (TE `common/gemm/cublaslt_gemm.cu`; cuBLAS docs, `cublasLtMatmul`).
//!
//! The API is row-major: `D[m, n] = alpha · A[m, k] · B[n, k]ᵀ (+ D)`, then the epilogue, both
//! operands k-contiguous ("TN", the only layout Hopper FP8 GEMMs take). In a Linear: fprop
//! `Y = X · Wᵀ` is `gemm(X, W)`, dgrad `dX = dY · W` is `gemm(dY, Wᵀ)`, wgrad `dW = dYᵀ · X` is
//! `gemm(dYᵀ, Xᵀ)`, the transposes being the copies cast-transpose writes. bf16/f16/f32 operands
//! may instead be given as stored transposed ([`Operand::transposed`]): the high-precision
//! backward needs no transposed copies.
//!
//! cuBLASLt is column-major, where the row-major `D[m, n]` is the `n × m` matrix `B · Aᵀ`. So
//! cuBLASLt's A is our `b` (`TRANSA = T`, `lda = k`), its B is our `a` (`TRANSB = N`,
//! `ldb = k`), its `m, n` are our `n, m`, and `ldc = ldd = n`. Compute type
//! `CUBLAS_COMPUTE_32F` (f32 GEMMs are pure f32, no TF32), scale type f32.
//!
//! [`gemm_strided_batched`] runs `count` such GEMMs in one call on matrices addressed inside
//! larger tensors ([`MatrixView`]: offset, row stride, stride between matrices), e.g. the heads
//! of attention's `[batch, seq, heads, head_dim]` tensors without copies.
//!
//! Descriptors and layouts are created for every call (host microseconds, small next to any GEMM
//! worth running on a GPU); the algorithm the heuristic picks is cached per device, keyed by
//! everything that can change its answer: shape, dtypes, epilogue, accumulation mode, leading
//! dimensions, batch count and strides, and pointer alignments. Work is issued on
//! [`Device::stream`].

mod engine;
mod lt;
mod rules;
mod strided;

pub(crate) use engine::Engine;
pub use strided::{gemm_strided_batched, MatrixView, StridedBatch};

use crate::ops::{check_nonempty, check_shape};
use crate::{Device, Error, Result, Tensor};
use cudarc::cublaslt::result;
use cudarc::cublaslt::sys::{self, cublasLtMatmulDescAttributes_t as Attr};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use engine::{alignment, unsupported};
use lt::{Layout, MatmulDesc};
use rules::{cuda_type, Types};
use std::ffi::c_void;
use te_codegen::DType;

const OP: &str = "gemm";

/// `cublasOperation_t` values (`cublas_api.h`), which cudarc's cuBLASLt bindings do not export.
const CUBLAS_OP_N: i32 = 0;
const CUBLAS_OP_T: i32 = 1;

/// One operand of [`gemm`].
#[derive(Debug)]
pub struct Operand<'a> {
    /// Row-major `[.., k]` (leading dims folded into rows, see [`Tensor::as_2d`]): e4m3 or e5m2
    /// codes, or bf16, f16, f32. With `transposed`, stored as `[k, rows]` instead.
    pub tensor: &'a Tensor,
    /// The tensor holds the operand's transpose, `[k, rows]` (bf16/f16/f32 only: Hopper's FP8
    /// GEMMs take only k-contiguous operands, so FP8 needs the transposed copy).
    pub transposed: bool,
    /// For FP8 tensors (required): `1 / scale` of the cast that wrote the codes, one f32 on the
    /// device, which cuBLASLt multiplies the product by (`A_SCALE_POINTER`/`B_SCALE_POINTER`).
    /// Must be `None` for other dtypes.
    pub scale_inv: Option<CudaView<'a, f32>>,
    /// Blockwise scales (TE `Float8BlockScaling`): `scale_inv` then holds one f32 per block
    /// in the layout of [`BlockScale`] instead of one per tensor. Both operands or neither.
    pub block: Option<BlockScale>,
}

/// How the `scale_inv` of a blockwise-scaled FP8 operand `[rows, k]` is laid out (TE's
/// `GEMM_READY` layouts, which cuBLASLt's block scale modes read; Hopper, cuBLAS 12.9 or later;
/// [`crate::ops::block_quantize`] writes them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockScale {
    /// One scale per 1×128 tile along k: `[⌈k/128⌉, round_up(rows, 4)]`, the rows contiguous
    /// (`CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F`).
    Vec128,
    /// One scale per 128×128 block: `[⌈rows/128⌉, round_up(⌈k/128⌉, 4)]`
    /// (`CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F`).
    Blk128x128,
}

impl BlockScale {
    /// `(rows, leading dimension)` of the scales of an operand of `rows` rows and `k` columns
    /// (the one home of these layouts; TE's `Float8BlockQuantizer::get_scale_shape`).
    pub fn shape(self, rows: usize, k: usize) -> (usize, usize) {
        let round4 = |n: usize| n.div_ceil(4) * 4;
        match self {
            BlockScale::Vec128 => (k.div_ceil(128), round4(rows)),
            BlockScale::Blk128x128 => (rows.div_ceil(128), round4(k.div_ceil(128))),
        }
    }

    /// The number of f32 scales of an operand of `rows` rows and `k` columns.
    pub fn len(self, rows: usize, k: usize) -> usize {
        let (r, ld) = self.shape(rows, k);
        r * ld
    }

    /// The index in the scales of element `(r, c)` of an operand of `rows` rows and `k`
    /// columns.
    pub fn index(self, rows: usize, k: usize, (r, c): (usize, usize)) -> usize {
        let (_, ld) = self.shape(rows, k);
        match self {
            BlockScale::Vec128 => (c / 128) * ld + r,
            BlockScale::Blk128x128 => (r / 128) * ld + c / 128,
        }
    }

    fn cublaslt(self) -> i32 {
        match self {
            BlockScale::Vec128 => sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32,
            BlockScale::Blk128x128 => {
                sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as i32
            }
        }
    }
}

impl<'a> Operand<'a> {
    /// A bf16, f16 or f32 operand.
    pub fn new(tensor: &'a Tensor) -> Self {
        Self { tensor, transposed: false, scale_inv: None, block: None }
    }

    /// The same operand, read from a tensor that stores its transpose `[k, rows]`.
    pub fn transposed(self) -> Self {
        Self { transposed: true, ..self }
    }

    /// An FP8 operand and its `scale_inv`.
    pub fn fp8(tensor: &'a Tensor, scale_inv: CudaView<'a, f32>) -> Self {
        Self { tensor, transposed: false, scale_inv: Some(scale_inv), block: None }
    }

    /// A blockwise-scaled FP8 operand: its codes and their `scale_inv` in `block`'s layout.
    pub fn fp8_block(tensor: &'a Tensor, scale_inv: CudaView<'a, f32>, block: BlockScale) -> Self {
        Self { tensor, transposed: false, scale_inv: Some(scale_inv), block: Some(block) }
    }
}

/// The output of [`gemm`].
#[derive(Debug)]
pub struct Output<'a> {
    /// Row-major `[m, n]` (leading dims folded): bf16, f16, f32, or e4m3/e5m2 codes.
    pub tensor: &'a mut Tensor,
    /// For FP8 outputs (required): their scaling. Must be `None` for other dtypes.
    pub fp8: Option<Fp8Output<'a>>,
}

impl<'a> Output<'a> {
    /// A bf16, f16 or f32 output.
    pub fn new(tensor: &'a mut Tensor) -> Self {
        Self { tensor, fp8: None }
    }

    /// An FP8 output with its scaling.
    pub fn fp8(tensor: &'a mut Tensor, scale: CudaView<'a, f32>, amax: CudaViewMut<'a, f32>) -> Self {
        Self { tensor, fp8: Some(Fp8Output { scale, amax }) }
    }
}

/// Scaling of an FP8 output (each one f32 on the device).
#[derive(Debug)]
pub struct Fp8Output<'a> {
    /// Read: the quantization scale, `d = fp8(result * scale)` (`D_SCALE_POINTER`).
    pub scale: CudaView<'a, f32>,
    /// Written: `max |result|` over D before scaling (`AMAX_D_POINTER`). cuBLASLt **overwrites**
    /// it ("set to the maximum of absolute values in the output matrix", cuBLAS docs), unlike
    /// the cast kernels of [`crate::ops`], which max into their amax.
    pub amax: CudaViewMut<'a, f32>,
}

/// Options of [`gemm`]; [`GemmConfig::default`] is `alpha = 1`, no accumulation, split
/// accumulator, no epilogue.
#[derive(Debug)]
pub struct GemmConfig<'a> {
    /// Multiplies `A · Bᵀ` (on top of the FP8 scale_invs).
    pub alpha: f32,
    /// Adds the previous content of D (`beta = 1` with C = D), e.g. wgrad into an f32
    /// `main_grad`. Not for FP8 outputs (as in TE). An epilogue applies to the sum.
    pub accumulate: bool,
    /// FP8 only (ignored otherwise): accumulate in the tensor cores' faster, less precise
    /// accumulator (`CUBLASLT_MATMUL_DESC_FAST_ACCUM`). TE turns it on in fprop and uses the split
    /// (precise) accumulator in dgrad and wgrad.
    pub fast_accum: bool,
    /// What is fused after the product.
    pub epilogue: Epilogue<'a>,
}

impl Default for GemmConfig<'_> {
    fn default() -> Self {
        Self { alpha: 1.0, accumulate: false, fast_accum: false, epilogue: Epilogue::None }
    }
}

/// What cuBLASLt fuses after the product `P = alpha · A · Bᵀ (+ D)`: TE's four epilogues.
///
/// Vectors (`bias`, `bgrad`) take the bias type of the dtype combination: D's type for
/// bf16/f16/f32 operands; for FP8 operands bf16 (f16 for an f16 output, bf16 or f16 for an FP8
/// output). `pre_gelu` takes C's type: D's type, or the bias type for an FP8 output; never FP8.
#[derive(Debug)]
pub enum Epilogue<'a> {
    /// `D = P`.
    None,
    /// `D = P + bias`, `bias: [n]` added to every row (`CUBLASLT_EPILOGUE_BIAS`; fprop).
    Bias(&'a Tensor),
    /// `pre_gelu = P + bias`, `D = gelu(pre_gelu)` (tanh approximation), with `bias: [n]` and
    /// `pre_gelu: [m, n]` written (`GELU_AUX_BIAS`; fprop of an MLP's first Linear, which keeps
    /// `pre_gelu` for backward).
    GeluAuxBias {
        /// `[n]`, read.
        bias: &'a Tensor,
        /// `[m, n]`, written.
        pre_gelu: &'a mut Tensor,
    },
    /// `D = P * gelu'(pre_gelu)` and `bgrad[n] = Σ_m D` (column sums of D), with `pre_gelu:
    /// [m, n]` from the forward (`DGELU_BGRAD`; dgrad of an MLP's second Linear: D is the
    /// gradient of the first Linear's output and `bgrad` the first Linear's bias gradient).
    DGeluBgrad {
        /// `[m, n]`, read.
        pre_gelu: &'a Tensor,
        /// `[n]`, written.
        bgrad: &'a mut Tensor,
    },
    /// `D = P` and `bgrad[m] = Σ_k a[m, k]` (row sums of `a`, the operand cuBLASLt sees as B:
    /// `BGRADB`, "bias gradient of B, reduced over k"). Useful in wgrad `dW = dYᵀ · X`, where
    /// `a = dYᵀ: [out_features, tokens]` and so `bgrad = Σ_tokens dY = dbias`. TE issues it for
    /// high-precision wgrad; with FP8 it takes dbias from the unquantized `dY` in its
    /// cast-transpose-dbias kernel instead. cuBLASLt 13 runs it only with `a` stored transposed
    /// (`dY` itself, [`Operand::transposed`], TE's NT wgrad layout): measured on an H200, the
    /// k-contiguous `a` is rejected for bf16, f16 and FP8 alike (an [`Error::Gemm`]).
    BgradB {
        /// `[m]`, written.
        bgrad: &'a mut Tensor,
    },
}

/// [`Epilogue`] without its tensors: what the algorithm depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum EpilogueKind {
    None,
    Bias,
    GeluAuxBias,
    DGeluBgrad,
    BgradB,
}

impl EpilogueKind {
    fn cublaslt(self) -> sys::cublasLtEpilogue_t {
        use sys::cublasLtEpilogue_t::*;
        match self {
            EpilogueKind::None => CUBLASLT_EPILOGUE_DEFAULT,
            EpilogueKind::Bias => CUBLASLT_EPILOGUE_BIAS,
            EpilogueKind::GeluAuxBias => CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
            EpilogueKind::DGeluBgrad => CUBLASLT_EPILOGUE_DGELU_BGRAD,
            EpilogueKind::BgradB => CUBLASLT_EPILOGUE_BGRADB,
        }
    }
}

/// An epilogue tensor and its argument name.
type Named<'t> = Option<(&'static str, &'t Tensor)>;

impl Epilogue<'_> {
    fn kind(&self) -> EpilogueKind {
        match self {
            Epilogue::None => EpilogueKind::None,
            Epilogue::Bias(_) => EpilogueKind::Bias,
            Epilogue::GeluAuxBias { .. } => EpilogueKind::GeluAuxBias,
            Epilogue::DGeluBgrad { .. } => EpilogueKind::DGeluBgrad,
            Epilogue::BgradB { .. } => EpilogueKind::BgradB,
        }
    }

    /// The vector (`bias` or `bgrad`) and the aux matrix (`pre_gelu`), where present.
    fn tensors(&self) -> (Named<'_>, Named<'_>) {
        match self {
            Epilogue::None => (None, None),
            Epilogue::Bias(bias) => (Some(("bias", bias)), None),
            Epilogue::GeluAuxBias { bias, pre_gelu } => (Some(("bias", bias)), Some(("pre_gelu", pre_gelu))),
            Epilogue::DGeluBgrad { pre_gelu, bgrad } => (Some(("bgrad", bgrad)), Some(("pre_gelu", pre_gelu))),
            Epilogue::BgradB { bgrad } => (Some(("bgrad", bgrad)), None),
        }
    }
}

/// Where the matrices of a GEMM sit, in elements: the row strides (leading dimensions) of `a`
/// and `b` as stored and of `d`, the number of matrices, and the strides between consecutive
/// matrices of `a`, `b` and `d` (all 0 for a single GEMM).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Geometry {
    ld: [usize; 3],
    batch: usize,
    batch_stride: [usize; 3],
}

impl Geometry {
    /// One GEMM on whole tensors: rows of `k` elements, or of `m` / `n` when stored transposed.
    fn dense(m: usize, n: usize, k: usize, transposed: (bool, bool)) -> Self {
        let ld = [if transposed.0 { m } else { k }, if transposed.1 { n } else { k }, n];
        Self { ld, batch: 1, batch_stride: [0; 3] }
    }
}

/// A validated GEMM in row-major terms.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Problem {
    m: usize,
    n: usize,
    k: usize,
    types: Types,
    epilogue: EpilogueKind,
    fast_accum: bool,
    accumulate: bool,
    /// `a` and `b` stored transposed.
    transposed: (bool, bool),
    geometry: Geometry,
    /// Blockwise scales of `a` and `b` (both or neither).
    block: Option<(BlockScale, BlockScale)>,
}

impl Problem {
    /// E.g. `D[200, 336] bf16 = A[200, 208] e4m3 · B[336, 208]ᵀ e5m2, epilogue Bias (bf16)`.
    fn describe(&self) -> String {
        let Problem { m, n, k, types: t, epilogue, fast_accum, accumulate, transposed, geometry: g, block } = self;
        let mut s = format!("D[{m}, {n}] {} = A[{m}, {k}] {} · B[{n}, {k}]ᵀ {}", t.d, t.a, t.b);
        if let Some((ba, bb)) = block {
            s += &format!(" (block scales: a {ba:?}, b {bb:?})");
        }
        if transposed.0 || transposed.1 {
            s += &format!(" (stored transposed: a {}, b {})", transposed.0, transposed.1);
        }
        if *g != Geometry::dense(*m, *n, *k, *transposed) {
            let ([la, lb, ld], [sa, sb, sd]) = (g.ld, g.batch_stride);
            s += &format!(
                ", {} matri{} with row strides (a {la}, b {lb}, d {ld}) and strides between matrices (a {sa}, b {sb}, \
                 d {sd})",
                g.batch,
                if g.batch == 1 { "x" } else { "ces" }
            );
        }
        match epilogue {
            EpilogueKind::None => {}
            EpilogueKind::Bias | EpilogueKind::BgradB => s += &format!(", epilogue {epilogue:?} ({})", t.bias),
            _ => s += &format!(", epilogue {epilogue:?} (vector {}, pre_gelu {})", t.bias, t.aux),
        }
        if t.fp8() {
            s += if *fast_accum { ", fast accumulation" } else { ", split accumulation" };
        }
        if *accumulate {
            s += ", accumulating into D";
        }
        s
    }
}

/// The algorithm cache key of [`Engine`]: the problem and the pointer alignments, `[A, B, C, D]`
/// in cuBLASLt's operand order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct AlgoKey {
    problem: Problem,
    alignments: [u32; 4],
}

fn gemm_error(message: String) -> Error {
    Error::Gemm { message }
}

/// Fails unless `t` folds to `[rows, cols]`.
fn check_2d(arg: &str, t: &Tensor, rows: usize, cols: usize) -> Result<()> {
    if t.as_2d(OP)? == (rows, cols) {
        Ok(())
    } else {
        Err(Error::Shape {
            op: OP,
            message: format!("`{arg}` must be [m, n] = [{rows}, {cols}] (leading dims folded), got {:?}", t.shape()),
        })
    }
}

/// Fails unless a device scalar holds at least one f32.
fn check_scalar(arg: &str, len: usize) -> Result<()> {
    if len >= 1 {
        Ok(())
    } else {
        Err(Error::Shape { op: OP, message: format!("`{arg}` must hold one f32, got an empty view") })
    }
}

/// Every host-side check of [`gemm`]; nothing touches the device.
fn check(a: &Operand<'_>, b: &Operand<'_>, d: &Output<'_>, cfg: &GemmConfig<'_>) -> Result<Problem> {
    check_nonempty(OP, "a", a.tensor)?;
    check_nonempty(OP, "b", b.tensor)?;
    check_nonempty(OP, "d", d.tensor)?;
    for (arg, op) in [("a", a), ("b", b)] {
        if op.transposed && op.tensor.dtype().is_fp8() {
            return Err(gemm_error(format!(
                "`{arg}` is {} and marked transposed: FP8 GEMMs take only k-contiguous operands (TN); pass the \
                 transposed FP8 copy (cast_transpose's `out_t`) untransposed",
                op.tensor.dtype()
            )));
        }
    }
    let logical = |op: &Operand<'_>| -> Result<(usize, usize)> {
        let (r, c) = op.tensor.as_2d(OP)?;
        Ok(if op.transposed { (c, r) } else { (r, c) })
    };
    let (m, k) = logical(a)?;
    let (n, kb) = logical(b)?;
    if kb != k {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "`a` {:?} and `b` {:?} must share k (their last dim, or first when stored transposed; D = A · Bᵀ \
                 contracts it); got {k} and {kb}",
                a.tensor.shape(),
                b.tensor.shape()
            ),
        });
    }
    check_2d("d", d.tensor, m, n)?;
    let (vector, aux) = cfg.epilogue.tensors();
    let dtype_of = |t: Named<'_>| t.map(|(arg, t)| (arg, t.dtype()));
    let types = rules::resolve(a.tensor.dtype(), b.tensor.dtype(), d.tensor.dtype(), dtype_of(vector), dtype_of(aux))?;
    rules::check_fp8_alignment(&types, n, k)?;
    for (arg, op) in [("a", a), ("b", b)] {
        let dtype = op.tensor.dtype();
        match &op.scale_inv {
            None if dtype.is_fp8() => {
                return Err(gemm_error(format!("`{arg}` is {dtype}: pass its scale_inv (`Operand::fp8`)")))
            }
            Some(_) if !dtype.is_fp8() => {
                return Err(gemm_error(format!("`{arg}` is {dtype}: a scale_inv applies only to FP8 operands")))
            }
            Some(v) => match op.block {
                None => check_scalar("scale_inv", v.len())?,
                Some(block) => {
                    let (rows, k) = logical(op)?;
                    if v.len() != block.len(rows, k) {
                        return Err(gemm_error(format!(
                            "`{arg}` [{rows}, {k}] with {block:?} block scales needs {} scale_inv values, got {} \
                             (ops::block_quantize writes them)",
                            block.len(rows, k),
                            v.len()
                        )));
                    }
                }
            },
            None => {}
        }
    }
    match &d.fp8 {
        None if types.d.is_fp8() => {
            return Err(gemm_error(format!("`d` is {}: pass its scale and amax (`Output::fp8`)", types.d)))
        }
        Some(_) if !types.d.is_fp8() => {
            return Err(gemm_error(format!("`d` is {}: FP8 scaling applies only to e4m3/e5m2 outputs", types.d)))
        }
        Some(f) => {
            check_scalar("scale", f.scale.len())?;
            check_scalar("amax", f.amax.len())?;
        }
        None => {}
    }
    if cfg.accumulate && types.d.is_fp8() {
        return Err(gemm_error(format!(
            "an FP8 output ({}) cannot accumulate (cuBLASLt reads C in {}); accumulate into a bf16 or f32 output",
            types.d, types.c
        )));
    }
    let block = match (a.block, b.block) {
        (None, None) => None,
        (Some(ba), Some(bb)) => {
            if cfg.fast_accum {
                return Err(gemm_error(
                    "block-scaled FP8 GEMMs accumulate precisely only: set fast_accum to false (cuBLASLt has no fast \
                     accumulation with block scales)"
                        .into(),
                ));
            }
            if types.d.is_fp8() {
                return Err(gemm_error(format!(
                    "a block-scaled FP8 GEMM writes bf16, f16 or f32, not {} (quantize its output afterwards)",
                    types.d
                )));
            }
            Some((ba, bb))
        }
        _ => return Err(gemm_error(
            "one operand has block scales and the other not: pass both blockwise-quantized (Operand::fp8_block) or \
                 neither"
                .into(),
        )),
    };
    let epilogue = cfg.epilogue.kind();
    if let Some((arg, t)) = vector {
        check_shape(OP, arg, t, &[if epilogue == EpilogueKind::BgradB { m } else { n }])?;
    }
    if let Some((arg, t)) = aux {
        check_2d(arg, t, m, n)?;
    }
    Ok(Problem {
        m,
        n,
        k,
        types,
        epilogue,
        fast_accum: cfg.fast_accum,
        accumulate: cfg.accumulate,
        transposed: (a.transposed, b.transposed),
        geometry: Geometry::dense(m, n, k, (a.transposed, b.transposed)),
        block,
    })
}

/// `D[m, n] = alpha · A[m, k] · B[n, k]ᵀ (+ D if accumulating)`, then the epilogue, on cuBLASLt
/// (see the [module docs](self) for the layout and [`Epilogue`] for the fusions).
///
/// `a: [.., k]` and `b: [.., k]` (leading dims folded into `m` and `n` rows), both FP8 with
/// their scale_inv (e4m3 × e4m3, e4m3 × e5m2, e5m2 × e4m3), or both bf16, f16 or f32. `d:
/// [m, n]` (leading dims folded): bf16, f16, f32 or, after FP8 operands, e4m3/e5m2 with a
/// scale and amax; after bf16/f16 operands their type or f32, after f32 operands f32.
/// FP8 GEMMs need `k % 16 == 0` and 16-byte aligned rows of D (`n % 8` for a 16-bit output,
/// `n % 16` for an FP8 one, `n % 4` for f32); `m` is free.
///
/// The first call on a device loads cuBLASLt and allocates its 32 MiB workspace; the first
/// call for each problem asks the heuristic for an algorithm.
///
/// # Errors
/// - [`Error::Shape`]: empty tensors, `k` differing between `a` and `b`, `d` or epilogue tensors
///   of the wrong shape, FP8 dimensions that are not multiples of 16 (the message says what to
///   pad to).
/// - [`Error::DType`]: a dtype combination cuBLASLt does not take (e5m2 × e5m2, FP8 × bf16, an
///   f16 output of bf16 operands, a bias of the wrong type, ...), naming the argument.
/// - [`Error::Gemm`]: a missing or superfluous `scale_inv` or FP8 output scaling, accumulation
///   into an FP8 output, or no cuBLASLt algorithm for the problem (the message describes it).
/// - [`Error::CublasLtMissing`], [`Error::Cublas`], [`Error::Driver`]: cuBLASLt cannot be loaded
///   or a call fails.
pub fn gemm(dev: &Device, a: Operand<'_>, b: Operand<'_>, d: Output<'_>, cfg: &GemmConfig<'_>) -> Result<()> {
    let problem = check(&a, &b, &d, cfg)?;
    let engine = dev.gemm_engine()?;
    dev.context().bind_to_thread()?;
    let s = dev.stream();
    let (n, types, epilogue) = (problem.n, problem.types, problem.epilogue);
    let Output { tensor: d_tensor, fp8: mut d_fp8 } = d;

    // Device pointers. The guards order other streams after this call when cudarc tracks
    // events; this crate's devices run everything on one stream with tracking off.
    let (a_ptr, _a) = a.tensor.data().device_ptr(s);
    let (b_ptr, _b) = b.tensor.data().device_ptr(s);
    let (d_ptr, _d) = d_tensor.data_mut()?.device_ptr_mut(s);
    let scale_invs = a.scale_inv.as_ref().zip(b.scale_inv.as_ref()).map(|(x, y)| (x.device_ptr(s), y.device_ptr(s)));
    let d_scaling = d_fp8.as_mut().map(|f| (f.scale.device_ptr(s), f.amax.device_ptr_mut(s)));
    let (vector, aux) = cfg.epilogue.tensors();
    // `bgrad` and `pre_gelu` (in `GeluAuxBias`) are written through these pointers: the
    // `&mut Tensor` in the epilogue guarantees nothing else uses them meanwhile.
    let vector_ptr = vector.map(|(_, t)| t.data().device_ptr(s));
    let aux_ptr = aux.map(|(_, t)| t.data().device_ptr(s));
    // FP8 outputs never accumulate, so C is never read there; TE passes null as well.
    let c_ptr = if types.d.is_fp8() { 0 } else { d_ptr };

    let mut desc = matmul_desc(problem.transposed)?;
    if let Some(((a_scale_inv, _), (b_scale_inv, _))) = &scale_invs {
        // cuBLASLt's A is our `b` and its B our `a`.
        desc.set(Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, *b_scale_inv)?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, *a_scale_inv)?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_FAST_ACCUM, cfg.fast_accum as i8)?;
    }
    if let Some((ba, bb)) = problem.block {
        // cuBLASLt's A is our `b` and its B our `a`.
        desc.set(Attr::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, bb.cublaslt())?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, ba.cublaslt())?;
    }
    if let Some(((scale, _), (amax, _))) = &d_scaling {
        desc.set(Attr::CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, *scale)?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, *amax)?;
    }
    desc.set(Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, epilogue.cublaslt())?;
    if let Some((ptr, _)) = &vector_ptr {
        desc.set(Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, *ptr)?;
        if types.fp8() {
            desc.set(Attr::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, cuda_type(types.bias))?;
        }
    }
    if let Some((ptr, _)) = &aux_ptr {
        desc.set(Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, *ptr)?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, n as i64)?;
        desc.set(Attr::CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, cuda_type(types.aux))?;
    }
    let ptrs = Pointers { a: a_ptr, b: b_ptr, c: c_ptr, d: d_ptr };
    // SAFETY: `check` validated the buffers against the problem's dense geometry (`a`: m·k, `b`:
    // n·k, `d` and aux: m·n elements, vectors: n or m elements of the checked dtypes); the scale
    // pointers in `desc` hold one f32 each; every buffer is borrowed (the guards above) until
    // the call is enqueued, and `d`, `bgrad` and `pre_gelu` exclusively.
    unsafe { run(&engine, s, &desc, problem, ptrs, cfg.alpha) }
}

/// A matmul descriptor computing in f32 (`CUBLAS_COMPUTE_32F`, f32 alpha and beta) with the
/// transposes of operands stored as `transposed` (`a`, `b`).
fn matmul_desc(transposed: (bool, bool)) -> Result<MatmulDesc> {
    let mut desc = MatmulDesc::new(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
    // cuBLASLt's A is `b`: k-contiguous (`[n, k]` row-major = k × n column-major) needs TRANSA = T;
    // stored transposed (`[k, n]` = n × k) it is used as is. Its B is `a`, the other way round.
    desc.set(Attr::CUBLASLT_MATMUL_DESC_TRANSA, if transposed.1 { CUBLAS_OP_N } else { CUBLAS_OP_T })?;
    desc.set(Attr::CUBLASLT_MATMUL_DESC_TRANSB, if transposed.0 { CUBLAS_OP_T } else { CUBLAS_OP_N })?;
    Ok(desc)
}

/// Device addresses of one call in row-major terms, each at the first element its GEMM reads
/// or writes; `c` is `d`, or null for an FP8 output (never read).
struct Pointers {
    a: u64,
    b: u64,
    c: u64,
    d: u64,
}

/// What [`gemm`] and [`gemm_strided_batched`] end in: the layouts of the problem's geometry, the
/// algorithm for it (cached), and the matmul enqueued on `stream`.
///
/// Pointer alignments are taken from the pointers themselves and, for batched GEMMs, the byte
/// strides between matrices (every matrix's start must have the alignment the algorithm
/// assumes).
///
/// # Safety
/// Every pointer must address a device buffer that holds all the elements the problem's
/// geometry reaches (`batch` matrices of `rows × cols` at the given row and batch strides) in
/// the problem's dtypes, stay alive until the call is enqueued, and `d` must not be written by
/// anyone else meanwhile; `desc` must come from [`matmul_desc`] for the problem's transposes and
/// carry only attributes whose device pointers are valid likewise.
unsafe fn run(
    engine: &Engine,
    stream: &CudaStream,
    desc: &MatmulDesc,
    problem: Problem,
    ptrs: Pointers,
    alpha: f32,
) -> Result<()> {
    let Problem { m, n, k, types, transposed, geometry: g, .. } = problem;
    let [ld_a, ld_b, ld_d] = g.ld;
    // Column-major layouts: cuBLASLt's A is `b` stored k × n (n × k when transposed), its B is
    // `a` stored k × m (m × k when transposed).
    let mut layout_a = if transposed.1 {
        Layout::new(cuda_type(types.b), n, k, ld_b)?
    } else {
        Layout::new(cuda_type(types.b), k, n, ld_b)?
    };
    let mut layout_b = if transposed.0 {
        Layout::new(cuda_type(types.a), m, k, ld_a)?
    } else {
        Layout::new(cuda_type(types.a), k, m, ld_a)?
    };
    let mut layout_c = Layout::new(cuda_type(types.c), n, m, ld_d)?;
    let mut layout_d = Layout::new(cuda_type(types.d), n, m, ld_d)?;
    let [stride_a, stride_b, stride_d] = g.batch_stride;
    if g.batch > 1 {
        layout_a.set_batch(g.batch, stride_b)?;
        layout_b.set_batch(g.batch, stride_a)?;
        layout_c.set_batch(g.batch, stride_d)?;
        layout_d.set_batch(g.batch, stride_d)?;
    }
    let align = |ptr: u64, stride: usize, dtype: DType| alignment(ptr | (stride * dtype.size_bytes()) as u64);
    let alignments = [
        align(ptrs.b, stride_b, types.b),
        align(ptrs.a, stride_a, types.a),
        align(ptrs.c, stride_d, types.c),
        align(ptrs.d, stride_d, types.d),
    ];
    let key = AlgoKey { problem, alignments };
    let describe = || key.problem.describe();
    let algo = engine.algo(&key, desc, [&layout_a, &layout_b, &layout_c, &layout_d], describe)?;
    let beta: f32 = if key.problem.accumulate { 1.0 } else { 0.0 };
    let (workspace, workspace_bytes) = engine.workspace();
    // SAFETY: the handle, descriptor and layouts are live; the layouts describe the geometry the
    // caller guarantees the buffers hold (see `# Safety`); alpha and beta are host f32 (default
    // pointer mode) alive across the call; the workspace holds `workspace_bytes` and is only used
    // by work on this stream; the algorithm came from the heuristic for this descriptor, these
    // layouts and these alignments.
    unsafe {
        result::matmul(
            engine.handle().raw(),
            desc.raw(),
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            ptrs.b as *const c_void,
            layout_a.raw(),
            ptrs.a as *const c_void,
            layout_b.raw(),
            ptrs.c as *const c_void,
            layout_c.raw(),
            ptrs.d as *mut c_void,
            layout_d.raw(),
            &algo,
            workspace as *mut c_void,
            workspace_bytes,
            stream.cu_stream() as sys::cudaStream_t,
        )
    }
    .map_err(|e| unsupported(e, describe))
}
