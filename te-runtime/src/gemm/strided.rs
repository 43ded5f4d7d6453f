//! Strided batched GEMMs: `count` independent `D_i = alpha · A_i · B_iᵀ (+ D_i)` in one cuBLASLt
//! call, every matrix addressed inside a larger tensor through a [`MatrixView`] (cuBLAS docs,
//! `cublasLtMatrixLayoutAttribute_t`: `CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT` and
//! `CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET` on each layout, leading dimensions above the row
//! length). Attention runs its per-head products this way on `[batch, seq, heads, head_dim]`
//! tensors, whose head matrices have rows `heads · head_dim` elements apart and start `head_dim`
//! elements apart, as TE's unfused attention runs `torch.baddbmm`/`torch.bmm` on strided views
//! (TE `pytorch/attention/dot_product_attention/backends.py`, `UnfusedDotProductAttention`).

use super::{matmul_desc, rules, run, EpilogueKind, GemmConfig, Geometry, Pointers, Problem};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use te_codegen::DType;

const OP: &str = "gemm_strided_batched";

/// `count` row-major matrices inside a tensor, in elements of its dtype: element `[r, c]` of
/// matrix `i` is element `offset + i · batch_stride + r · row_stride + c` of the tensor (whose
/// own shape does not matter, only its element count).
///
/// E.g. head `h` of batch `b` of a `[batch, seq, heads, head_dim]` tensor is the `[seq,
/// head_dim]` matrix at `offset = (b · seq · heads + h) · head_dim` with `row_stride = heads ·
/// head_dim`; the heads of one batch follow each other at `batch_stride = head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MatrixView {
    /// Elements from the tensor's start to element `[0, 0]` of the first matrix.
    pub offset: usize,
    /// Rows of each matrix as stored.
    pub rows: usize,
    /// Columns of each matrix as stored (contiguous elements).
    pub cols: usize,
    /// Elements between the starts of consecutive rows (the leading dimension), at least `cols`.
    pub row_stride: usize,
    /// Elements between the starts of consecutive matrices (ignored for a single matrix; 0
    /// repeats one operand matrix for every GEMM).
    pub batch_stride: usize,
}

impl MatrixView {
    /// Dense `[rows, cols]` matrices one after another from the tensor's start, as in a
    /// `[count, rows, cols]` tensor.
    pub fn contiguous(rows: usize, cols: usize) -> Self {
        Self { offset: 0, rows, cols, row_stride: cols, batch_stride: rows * cols }
    }

    /// One past the highest element index `count` matrices reach (`rows`, `cols`, `count` ≥ 1);
    /// `None` on overflow.
    fn end(&self, count: usize) -> Option<usize> {
        let last_row = (self.rows - 1).checked_mul(self.row_stride)?;
        let last_matrix = (count - 1).checked_mul(self.batch_stride)?;
        self.offset.checked_add(last_matrix)?.checked_add(last_row)?.checked_add(self.cols)
    }

    /// Whether `count` matrices share no element: stacked (each starts after the previous one
    /// ends) or interleaved (side by side within every row, as the heads of a `[seq, heads,
    /// head_dim]` tensor). Call after [`check_view`] (no overflow).
    fn disjoint(&self, count: usize) -> bool {
        let stacked = self.batch_stride >= (self.rows - 1) * self.row_stride + self.cols;
        let interleaved =
            self.batch_stride >= self.cols && (count - 1) * self.batch_stride + self.cols <= self.row_stride;
        count == 1 || stacked || interleaved
    }
}

/// The geometry of [`gemm_strided_batched`]: `count` GEMMs `D_i[m, n] = A_i[m, k] · B_i[n, k]ᵀ`
/// with each matrix addressed through its view. A view describes the matrix as stored: for an
/// operand marked transposed it is the `[k, m]` (or `[k, n]`) matrix holding the transpose, as
/// with [`super::Operand::transposed`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StridedBatch {
    /// Number of GEMMs, from 1 to `i32::MAX`.
    pub count: usize,
    /// Where the `A_i` are: `[m, k]`, or `[k, m]` with `a_transposed`.
    pub a: MatrixView,
    /// `a` holds the transposes of the `A_i`.
    pub a_transposed: bool,
    /// Where the `B_i` are: `[n, k]`, or `[k, n]` with `b_transposed`.
    pub b: MatrixView,
    /// `b` holds the transposes of the `B_i`.
    pub b_transposed: bool,
    /// Where the `D_i` go: `[m, n]`; the matrices must not overlap (see [`gemm_strided_batched`]).
    pub d: MatrixView,
}

fn shape_error(message: String) -> Error {
    Error::Shape { op: OP, message }
}

/// Fails unless `count` matrices of `v` are non-empty, have rows that do not overlap, and stay
/// inside a tensor of `shape`.
fn check_view(arg: &str, shape: &[usize], v: &MatrixView, count: usize) -> Result<()> {
    if v.rows == 0 || v.cols == 0 {
        return Err(shape_error(format!("the `{arg}` view holds no elements ({} × {})", v.rows, v.cols)));
    }
    if v.row_stride < v.cols {
        return Err(shape_error(format!(
            "the `{arg}` view has row_stride {} below its {} columns: its rows would overlap",
            v.row_stride, v.cols
        )));
    }
    let numel: usize = shape.iter().product();
    match v.end(count) {
        Some(end) if end <= numel => Ok(()),
        end => Err(shape_error(format!(
            "{count} matri{} of the `{arg}` view {v:?} reach element {} but `{arg}` {shape:?} holds {numel} elements",
            if count == 1 { "x" } else { "ces" },
            end.map_or_else(|| "beyond usize::MAX".to_string(), |e| (e - 1).to_string())
        ))),
    }
}

/// Every host-side check of [`gemm_strided_batched`] on the tensors' dtypes and shapes (`a`,
/// `b`, `d`); nothing touches the device.
fn check(dtypes: [DType; 3], shapes: [&[usize]; 3], batch: &StridedBatch, cfg: &GemmConfig<'_>) -> Result<Problem> {
    let count = batch.count;
    if count == 0 || count > i32::MAX as usize {
        return Err(shape_error(format!("count = {count} must be from 1 to {} (cuBLASLt's i32)", i32::MAX)));
    }
    let epilogue = cfg.epilogue.kind();
    if epilogue != EpilogueKind::None {
        return Err(Error::Gemm {
            message: format!("{OP} takes no epilogue (got {epilogue:?}); run the epilogue's op separately"),
        });
    }
    for (arg, dtype) in ["a", "b", "d"].into_iter().zip(dtypes) {
        if dtype.is_fp8() {
            return Err(Error::DType {
                op: OP,
                arg,
                expected: "bf16, f16 or f32 (strided batched GEMMs take no FP8 yet)".into(),
                got: dtype,
            });
        }
    }
    let types = rules::resolve(dtypes[0], dtypes[1], dtypes[2], None, None)?;
    for ((arg, shape), view) in ["a", "b", "d"].into_iter().zip(shapes).zip([&batch.a, &batch.b, &batch.d]) {
        check_view(arg, shape, view, count)?;
    }
    let logical = |v: &MatrixView, transposed: bool| if transposed { (v.cols, v.rows) } else { (v.rows, v.cols) };
    let (m, k) = logical(&batch.a, batch.a_transposed);
    let (n, kb) = logical(&batch.b, batch.b_transposed);
    if kb != k {
        return Err(shape_error(format!(
            "the `a` view ([m, k] = [{m}, {k}]) and the `b` view ([n, k] = [{n}, {kb}]) must share k (counted as \
             stored: columns, or rows when marked transposed)"
        )));
    }
    if (batch.d.rows, batch.d.cols) != (m, n) {
        return Err(shape_error(format!(
            "the `d` view must be [m, n] = [{m}, {n}], got [{}, {}]",
            batch.d.rows, batch.d.cols
        )));
    }
    if !batch.d.disjoint(count) {
        return Err(shape_error(format!(
            "the {count} matrices of the `d` view {:?} overlap (the GEMMs would race on them): make them stacked \
             (batch_stride ≥ (rows - 1) · row_stride + cols) or side by side in each row (batch_stride ≥ cols and \
             (count - 1) · batch_stride + cols ≤ row_stride)",
            batch.d
        )));
    }
    let batch_stride =
        if count > 1 { [batch.a.batch_stride, batch.b.batch_stride, batch.d.batch_stride] } else { [0; 3] };
    Ok(Problem {
        m,
        n,
        k,
        types,
        epilogue,
        fast_accum: false,
        accumulate: cfg.accumulate,
        transposed: (batch.a_transposed, batch.b_transposed),
        geometry: Geometry {
            ld: [batch.a.row_stride, batch.b.row_stride, batch.d.row_stride],
            batch: count,
            batch_stride,
        },
        block: None,
    })
}

/// `D_i = alpha · A_i · B_iᵀ (+ D_i if accumulating)` for every `i < batch.count`, in one
/// cuBLASLt call, each matrix read or written where its [`MatrixView`] says (see
/// [`StridedBatch`]); elements of `d` outside the `D_i` are left untouched.
///
/// `a`, `b`: bf16, f16 or f32, both the same; `d`: their type or f32. The tensors' shapes do not
/// matter beyond their element counts. Of `cfg`, `alpha` and `accumulate` apply; the epilogue
/// must be [`super::Epilogue::None`]. Pointer alignments are computed from the offset pointers
/// and the byte strides between matrices, and belong to the algorithm cache key with the batch
/// count, strides and leading dimensions.
///
/// # Errors
/// - [`Error::Shape`]: `count` 0 or above `i32::MAX`; an empty view, a row stride below the row
///   length, or a view reaching past its tensor; `a` and `b` views that disagree on `k`; a `d`
///   view that is not `[m, n]`, or whose matrices overlap.
/// - [`Error::DType`]: an FP8 tensor, operands of different types, an output they cannot
///   produce.
/// - [`Error::Gemm`]: an epilogue, or no cuBLASLt algorithm for the problem.
/// - [`Error::CublasLtMissing`], [`Error::Cublas`], [`Error::Driver`]: cuBLASLt cannot be loaded
///   or a call fails.
pub fn gemm_strided_batched(
    dev: &Device,
    a: &Tensor,
    b: &Tensor,
    d: &mut Tensor,
    batch: &StridedBatch,
    cfg: &GemmConfig<'_>,
) -> Result<()> {
    let problem = check([a.dtype(), b.dtype(), d.dtype()], [a.shape(), b.shape(), d.shape()], batch, cfg)?;
    let engine = dev.gemm_engine()?;
    dev.context().bind_to_thread()?;
    let s = dev.stream();
    let at = |base: u64, view: &MatrixView, dtype: DType| base + (view.offset * dtype.size_bytes()) as u64;
    let (d_dtype, a_dtype, b_dtype) = (d.dtype(), a.dtype(), b.dtype());
    // The guards keep the buffers borrowed until the call is enqueued (see `gemm`).
    let (a_ptr, _a) = a.data().device_ptr(s);
    let (b_ptr, _b) = b.data().device_ptr(s);
    let (d_ptr, _d) = d.data_mut()?.device_ptr_mut(s);
    let d_ptr = at(d_ptr, &batch.d, d_dtype);
    let ptrs = Pointers { a: at(a_ptr, &batch.a, a_dtype), b: at(b_ptr, &batch.b, b_dtype), c: d_ptr, d: d_ptr };
    let desc = matmul_desc(problem.transposed)?;
    // SAFETY: `check` validated that every view's `count` matrices (rows × cols at its row and
    // batch strides, from its offset, which the pointers include) lie inside its tensor, of the
    // checked dtypes; `d` is borrowed exclusively and its matrices do not overlap; `desc` carries
    // only the transposes.
    unsafe { run(&engine, s, &desc, problem, ptrs, cfg.alpha) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `[seq, head_dim]` matrices of `heads` heads of one batch of `[seq, heads, head_dim]`.
    fn heads(seq: usize, heads: usize, head_dim: usize) -> MatrixView {
        MatrixView { offset: 0, rows: seq, cols: head_dim, row_stride: heads * head_dim, batch_stride: head_dim }
    }

    #[test]
    fn views_end_where_their_last_element_is() {
        assert_eq!(MatrixView::contiguous(3, 4).end(5), Some(60));
        assert_eq!(heads(7, 4, 8).end(4), Some(7 * 32));
        let v = MatrixView { offset: 5, rows: 2, cols: 3, row_stride: 10, batch_stride: 0 };
        assert_eq!(v.end(9), Some(5 + 10 + 3), "batch_stride 0 repeats one matrix");
        assert_eq!(MatrixView { batch_stride: usize::MAX, ..v }.end(3), None);
    }

    #[test]
    fn stacked_and_interleaved_matrices_are_disjoint() {
        assert!(MatrixView::contiguous(3, 4).disjoint(5));
        assert!(heads(7, 4, 8).disjoint(4));
        assert!(!heads(7, 4, 8).disjoint(5), "a fifth head would run into the next row");
        assert!(!MatrixView { batch_stride: 4, ..heads(7, 4, 8) }.disjoint(2), "heads 4 apart but 8 wide");
        assert!(!MatrixView { batch_stride: 11, ..MatrixView::contiguous(3, 4) }.disjoint(2));
        assert!(MatrixView { batch_stride: 0, ..MatrixView::contiguous(3, 4) }.disjoint(1));
        assert!(!MatrixView { batch_stride: 0, ..MatrixView::contiguous(3, 4) }.disjoint(2));
    }

    fn problem(batch: &StridedBatch, shapes: [&[usize]; 3], cfg: &GemmConfig<'_>) -> Result<Problem> {
        check([DType::BF16; 3], shapes, batch, cfg)
    }

    /// Attention's `S = Q · Kᵀ` for the 4 heads of one batch: `q`, `k` `[seq, heads, d]`, `s`
    /// `[heads, sq, sk]`.
    fn scores() -> StridedBatch {
        StridedBatch {
            count: 4,
            a: heads(7, 4, 8),
            a_transposed: false,
            b: heads(9, 4, 8),
            b_transposed: false,
            d: MatrixView::contiguous(7, 9),
        }
    }

    #[test]
    fn check_derives_the_problem_from_the_views() {
        let cfg = GemmConfig::default();
        let p = problem(&scores(), [&[7, 4, 8], &[9, 4, 8], &[4, 7, 9]], &cfg).unwrap();
        assert_eq!((p.m, p.n, p.k, p.transposed), (7, 9, 8, (false, false)));
        assert_eq!(p.geometry, Geometry { ld: [32, 32, 9], batch: 4, batch_stride: [8, 8, 63] });
        // dK = dSᵀ · Q: both operands stored transposed; d = the key heads.
        let dk = StridedBatch {
            count: 4,
            a: MatrixView::contiguous(7, 9),
            a_transposed: true,
            b: heads(7, 4, 8),
            b_transposed: true,
            d: heads(9, 4, 8),
        };
        let p = problem(&dk, [&[4, 7, 9], &[7, 4, 8], &[9, 4, 8]], &cfg).unwrap();
        assert_eq!((p.m, p.n, p.k, p.transposed), (9, 8, 7, (true, true)));
        assert!(p.describe().contains("4 matrices with row strides (a 9, b 32, d 32)"), "{}", p.describe());
        let one = StridedBatch { count: 1, ..scores() };
        assert_eq!(problem(&one, [&[7, 4, 8], &[9, 4, 8], &[7, 9]], &cfg).unwrap().geometry.batch_stride, [0; 3]);
    }

    #[test]
    fn bad_views_are_shape_errors() {
        let cfg = GemmConfig::default();
        let shapes: [&[usize]; 3] = [&[7, 4, 8], &[9, 4, 8], &[4, 7, 9]];
        let message = |batch: StridedBatch, shapes: [&[usize]; 3]| match problem(&batch, shapes, &cfg) {
            Err(Error::Shape { message, .. }) => message,
            other => panic!("expected a shape error, got {other:?}"),
        };
        let e = message(StridedBatch { count: 5, ..scores() }, shapes);
        assert!(e.contains("`a` view") && e.contains("holds 224 elements"), "{e}");
        let e = message(scores(), [&[7, 4, 8], &[9, 4, 8], &[4, 7, 8]]);
        assert!(e.contains("`d` view") && e.contains("reach element 251"), "{e}");
        let e = message(StridedBatch { a: MatrixView { offset: 1, ..heads(7, 4, 8) }, ..scores() }, shapes);
        assert!(e.contains("`a` view"), "{e}");
        let e = message(StridedBatch { a: MatrixView { row_stride: 7, ..heads(7, 4, 8) }, ..scores() }, shapes);
        assert!(e.contains("row_stride 7 below its 8 columns"), "{e}");
        let e = message(StridedBatch { b: MatrixView { cols: 4, ..heads(9, 4, 8) }, ..scores() }, shapes);
        assert!(e.contains("must share k"), "{e}");
        let e = message(StridedBatch { d: MatrixView::contiguous(9, 7), ..scores() }, shapes);
        assert!(e.contains("[m, n] = [7, 9]"), "{e}");
        let e = message(
            StridedBatch { d: MatrixView { batch_stride: 9, ..MatrixView::contiguous(7, 9) }, ..scores() },
            shapes,
        );
        assert!(e.contains("overlap"), "{e}");
        let e = message(StridedBatch { count: 0, ..scores() }, shapes);
        assert!(e.contains("count = 0"), "{e}");
        let e = message(StridedBatch { d: MatrixView { rows: 0, ..MatrixView::contiguous(7, 9) }, ..scores() }, shapes);
        assert!(e.contains("no elements"), "{e}");
    }

    #[test]
    fn fp8_and_mixed_types_are_refused() {
        let shapes: [&[usize]; 3] = [&[7, 4, 8], &[9, 4, 8], &[4, 7, 9]];
        let e = check([DType::E4M3, DType::E4M3, DType::BF16], shapes, &scores(), &GemmConfig::default()).unwrap_err();
        assert!(matches!(e, Error::DType { arg: "a", .. }) && e.to_string().contains("no FP8"), "{e}");
        let e = check([DType::BF16, DType::F16, DType::BF16], shapes, &scores(), &GemmConfig::default()).unwrap_err();
        assert!(matches!(e, Error::DType { arg: "b", .. }), "{e}");
        let cfg = GemmConfig { accumulate: true, ..Default::default() };
        let p = check([DType::BF16, DType::BF16, DType::F32], shapes, &scores(), &cfg).unwrap();
        assert!(p.accumulate && p.types.d == DType::F32);
    }
}
