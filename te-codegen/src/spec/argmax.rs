//! Family 21: the row-wise argmax of logits (greedy decoding on the device: the index of each
//! row's largest value, the lowest index of ties, as `torch.argmax` and the host sampler pick).

use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// `out[r] = argmax_c x[r, c]` over `rows × cols` values of `dtype` (row-major), the lowest `c`
/// of ties, compared as f32; a row holding a NaN gives `-1` (the caller reports it). One block of
/// [`ArgmaxSpec::threads`] threads per row (any row count: blocks stride over the rows); each
/// thread scans a strided share of the row, then a warp and a block reduction of `(value,
/// index)` pairs.
///
/// Entry points: `<name>` ([`ArgmaxSpec::ARGS`]); for few rows, `<name>_split` ([`ArgmaxSpec::SPLIT_ARGS`]:
/// grid `(parts, rows)`, each block the best of its `ceil(cols / parts)` columns, `-2` for a part
/// holding a NaN) then `<name>_merge` ([`ArgmaxSpec::MERGE_ARGS`]: a block per row over its parts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ArgmaxSpec {
    /// Element type of `x`: f32, bf16 or f16.
    pub dtype: DType,
    /// Threads per block: a multiple of 32, at most 1024.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl ArgmaxSpec {
    /// The spec with 1024 threads a row (a 262k vocabulary is 256 values a thread).
    pub fn new(dtype: DType, arch: Arch) -> Self {
        Self { dtype, threads: 1024, arch }
    }

    /// Arguments of the entry point.
    pub const ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` values"),
        KernelArg::write("out", "int* __restrict__", "i32 `[rows]`: each row's argmax, −1 for a row with a NaN"),
        KernelArg::scalar("rows", "u64", "rows"),
        KernelArg::scalar("cols", "u64", "values per row"),
    ];

    /// Arguments of `<name>_split`.
    pub const SPLIT_ARGS: &'static [KernelArg] = &[
        KernelArg::read("x", "const void* __restrict__", "`[rows, cols]` values"),
        KernelArg::write("part_v", "float* __restrict__", "f32 `[rows, parts]`: each part's best value"),
        KernelArg::write("part_i", "int* __restrict__", "i32 `[rows, parts]`: its index, −2 for a part with a NaN"),
        KernelArg::scalar("rows", "u64", "rows"),
        KernelArg::scalar("cols", "u64", "values per row"),
        KernelArg::scalar("parts", "u32", "parts a row is split into (the grid's x)"),
    ];

    /// Arguments of `<name>_merge`.
    pub const MERGE_ARGS: &'static [KernelArg] = &[
        KernelArg::read("part_v", "const float* __restrict__", "f32 `[rows, parts]`"),
        KernelArg::read("part_i", "const int* __restrict__", "i32 `[rows, parts]`"),
        KernelArg::write("out", "int* __restrict__", "i32 `[rows]`: each row's argmax, −1 for a row with a NaN"),
        KernelArg::scalar("rows", "u64", "rows"),
        KernelArg::scalar("parts", "u32", "parts a row was split into"),
    ];
}

impl Family for ArgmaxSpec {
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match entry {
            1 => Self::SPLIT_ARGS,
            2 => Self::MERGE_ARGS,
            _ => Self::ARGS,
        }
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        &["", "_split", "_merge"]
    }
    fn family(&self) -> &'static str {
        "argmax"
    }
    fn template(&self) -> &'static str {
        "argmax.cu.tera"
    }
    fn name_parts(&self) -> String {
        format!("{}_t{}", self.dtype, self.threads)
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        if !self.dtype.is_high_precision() {
            return Err(format!("argmax reads f32, bf16 or f16, not {}", self.dtype));
        }
        if self.threads == 0 || self.threads % 32 != 0 || self.threads > 1024 {
            return Err(format!("threads = {} must be a multiple of 32 up to 1024", self.threads));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_validate_and_name_themselves() {
        let s = ArgmaxSpec::new(DType::BF16, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_argmax_bf16_t1024_sm_90a");
        assert!(ArgmaxSpec::new(DType::E4M3, Arch::Sm89).validate().unwrap_err().contains("e4m3"));
        let s = ArgmaxSpec { threads: 100, ..ArgmaxSpec::new(DType::F32, Arch::Sm89) };
        assert!(s.validate().unwrap_err().contains("multiple of 32"));
    }
}
