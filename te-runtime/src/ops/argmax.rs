//! Family 21 launcher: the row-wise argmax of logits ([`te_codegen::spec::ArgmaxSpec`]), greedy
//! decoding on the device: a step downloads one i32 per sequence instead of its whole row of
//! logits (a 262k vocabulary is 512 kB a row in BF16).

use super::launch::Launch;
use super::{check_dtype, check_nonempty, launch_1d};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::ArgmaxSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "argmax";

/// `out[r]` = the index of row `r`'s largest value of `x: [rows, cols]` (any leading dims fold
/// into rows; f32, bf16 or f16), the lowest index of ties, compared in f32; `-1` for a row that
/// holds a NaN. `out`: i32 `[rows]`.
///
/// # Errors
/// [`Error::DType`] for FP8 `x`; [`Error::Shape`] for an empty `x`, `cols ≥ 2³¹` or an `out` of
/// another length; compile and launch failures.
pub fn argmax(dev: &Device, x: &Tensor, out: &mut CudaSlice<i32>) -> Result<()> {
    check_dtype(OP, "x", x, DType::is_high_precision, "f32, bf16 or f16")?;
    check_nonempty(OP, "x", x)?;
    let (rows, cols) = x.as_2d(OP)?;
    if cols >= i32::MAX as usize || out.len() != rows {
        return Err(Error::Shape {
            op: OP,
            message: format!("x is [{rows}, {cols}] (cols < 2³¹) and out must hold {rows} i32, got {}", out.len()),
        });
    }
    let spec = ArgmaxSpec::new(x.dtype(), dev.arch());
    let (rows_arg, cols_arg) = (rows as u64, cols as u64);
    // Few long rows (a decode step's logits): each row split over many blocks, then merged.
    let parts =
        if rows * 8 <= dev.sm_count() { cols.div_ceil(spec.threads * 8).min(2 * dev.sm_count() / rows) } else { 1 };
    if parts > 1 {
        let stream = dev.stream();
        // SAFETY: plain numbers; the split kernel writes every `rows · parts` entry before the
        // merge kernel reads them (same stream).
        let (mut part_v, mut part_i) =
            unsafe { (stream.alloc::<f32>(rows * parts)?, stream.alloc::<i32>(rows * parts)?) };
        let (split_f, merge_f) =
            (dev.function(&KernelSpec::Argmax(spec), 1)?, dev.function(&KernelSpec::Argmax(spec), 2)?);
        let parts_arg = parts as u32;
        let mut l = Launch::new(OP, stream, &split_f, &spec, 1);
        l.ptr("x", x.data()).ptr("part_v", &mut part_v).ptr("part_i", &mut part_i);
        l.scalar("rows", &rows_arg).scalar("cols", &cols_arg).scalar("parts", &parts_arg);
        let grid = LaunchConfig {
            grid_dim: (parts_arg, rows as u32, 1),
            block_dim: (spec.threads as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments follow `ArgmaxSpec::SPLIT_ARGS`: x holds `rows · cols` values of
        // the spec's dtype (checked above), the partials `rows · parts` entries, one per block.
        unsafe { l.launch(grid) }?;
        let mut l = Launch::new(OP, stream, &merge_f, &spec, 2);
        l.ptr("part_v", &part_v).ptr("part_i", &part_i).ptr("out", out);
        l.scalar("rows", &rows_arg).scalar("parts", &parts_arg);
        // SAFETY: the arguments follow `ArgmaxSpec::MERGE_ARGS`: the partials written above, out
        // `rows` i32 (checked above); one block per row.
        return unsafe { l.launch(launch_1d(rows, spec.threads, 0)) };
    }
    let f = dev.function(&KernelSpec::Argmax(spec), 0)?;
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("x", x.data()).ptr("out", out).scalar("rows", &rows_arg).scalar("cols", &cols_arg);
    // SAFETY: the arguments follow `ArgmaxSpec::ARGS`: x holds `rows · cols` values of the
    // spec's dtype, out `rows` i32 (checked above); blocks stride over the rows.
    unsafe { l.launch(launch_1d(rows.min(65_535), spec.threads, 0)) }
}
