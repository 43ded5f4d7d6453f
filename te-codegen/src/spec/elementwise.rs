//! Family 8: element-wise binary ops on high-precision tensors: `out = a + b` (residual adds) and
//! the in-place `dst += src` (gradient accumulation, e.g. an f32 `main_grad` += a bf16 wgrad).

use super::cast::{check_pow2, check_threads};
use super::{Family, KernelArg};
use crate::{Arch, DType};
use serde::{Deserialize, Serialize};

/// Which element-wise op an [`ElementwiseSpec`] renders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ElementwiseOp {
    /// `out = a + b` over three tensors.
    Add,
    /// `dst += src` in place.
    AddAssign,
    /// `dst *= alpha` in place (`ElementwiseSpec::scale_assign`: Gemma's embedding multiplier).
    ScaleAssign,
}

impl ElementwiseOp {
    /// `add` or `add_assign`: the family part of the kernel name.
    pub const fn name(self) -> &'static str {
        match self {
            ElementwiseOp::Add => "add",
            ElementwiseOp::AddAssign => "add_assign",
            ElementwiseOp::ScaleAssign => "scale_assign",
        }
    }
}

/// Element-wise add over a flat tensor of `n` elements (`n` is a run-time argument).
///
/// Math: both operands widened to f32, one f32 add, rounded once (nearest even) to the output
/// type: what PyTorch computes for `a + b` and `main_grad.add_(grad)` (f32 "opmath").
///
/// Entry point `<name>`: [`ElementwiseSpec::ADD_ARGS`] ([`ElementwiseOp::Add`]),
/// [`ElementwiseSpec::ADD_ASSIGN_ARGS`] ([`ElementwiseOp::AddAssign`]). `a` and `b` may be the
/// same buffer; `out` must not
/// overlap `a` or `b` (all three are `__restrict__`): the in-place form has its own entry point,
/// which reads and writes `dst` through one pointer. Launch: a grid-stride loop over the
/// `n / vec` vectors (each thread loads `unroll` vectors of both operands before computing them,
/// any block count), then the `n % vec` tail elements one per thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ElementwiseSpec {
    /// Which op.
    pub op: ElementwiseOp,
    /// Type of `a` (or `dst`): f32, bf16 or f16.
    pub a: DType,
    /// Type of `b` (or `src`): f32, bf16 or f16.
    pub b: DType,
    /// Type of `out`: f32, bf16 or f16; equal to `a` for [`ElementwiseOp::AddAssign`].
    pub out: DType,
    /// Elements per thread per vector access (at most 16 bytes of the widest type).
    pub vec: usize,
    /// Vectors each thread loads before computing (loads in flight per thread).
    pub unroll: usize,
    /// Threads per block.
    pub threads: usize,
    /// Target architecture.
    pub arch: Arch,
}

impl ElementwiseSpec {
    /// `out = a + b` with the default tuning.
    pub fn add(a: DType, b: DType, out: DType, arch: Arch) -> Self {
        Self::with_defaults(ElementwiseOp::Add, a, b, out, arch)
    }

    /// `dst += src` with the default tuning.
    pub fn add_assign(dst: DType, src: DType, arch: Arch) -> Self {
        Self::with_defaults(ElementwiseOp::AddAssign, dst, src, dst, arch)
    }

    /// Default tuning: 16-byte accesses of the widest of the three types (8 or 4 bytes of the
    /// narrower ones), 4 vectors per operand in flight per thread, 256 threads per block.
    /// `dst *= alpha` in place: `dst[i] = round(f32(dst[i]) · alpha)`.
    pub fn scale_assign(dst: DType, arch: Arch) -> Self {
        Self::with_defaults(ElementwiseOp::ScaleAssign, dst, dst, dst, arch)
    }

    fn with_defaults(op: ElementwiseOp, a: DType, b: DType, out: DType, arch: Arch) -> Self {
        let widest = a.size_bytes().max(b.size_bytes()).max(out.size_bytes());
        Self { op, a, b, out, vec: 16 / widest, unroll: 4, threads: 256, arch }
    }
}

/// The kernel arguments of each entry point (see [`KernelArg`]): the template's signatures are
/// rendered from these lists and the launchers push against them.
impl ElementwiseSpec {
    /// Arguments of the `add` entry point.
    pub const ADD_ARGS: &'static [KernelArg] = &[
        KernelArg::read("a", "const void* __restrict__", "`[n]` first operand"),
        KernelArg::read("b", "const void* __restrict__", "`[n]` second operand"),
        KernelArg::write("out", "void* __restrict__", "`[n]` `a + b`"),
        KernelArg::scalar("n", "u64", "elements"),
    ];

    /// Arguments of the `add_assign` entry point.
    pub const ADD_ASSIGN_ARGS: &'static [KernelArg] = &[
        KernelArg::read_write("dst", "void* __restrict__", "`[n]` updated in place: `dst += src`"),
        KernelArg::read("src", "const void* __restrict__", "`[n]` added"),
        KernelArg::scalar("n", "u64", "elements"),
    ];

    /// Arguments of the in-place scale.
    pub const SCALE_ASSIGN_ARGS: &'static [KernelArg] = &[
        KernelArg::read_write("dst", "void* __restrict__", "`[n]` updated in place: `dst *= alpha`"),
        KernelArg::scalar("n", "u64", "elements"),
        KernelArg::scalar("alpha", "float", "the factor"),
    ];
}

impl Family for ElementwiseSpec {
    fn args(&self, _: usize) -> &'static [KernelArg] {
        match self.op {
            ElementwiseOp::Add => Self::ADD_ARGS,
            ElementwiseOp::AddAssign => Self::ADD_ASSIGN_ARGS,
            ElementwiseOp::ScaleAssign => Self::SCALE_ASSIGN_ARGS,
        }
    }
    fn family(&self) -> &'static str {
        self.op.name()
    }
    fn template(&self) -> &'static str {
        "elementwise.cu.tera"
    }
    fn name_parts(&self) -> String {
        match self.op {
            ElementwiseOp::Add => {
                format!("{}_{}_{}_v{}_u{}_t{}", self.a, self.b, self.out, self.vec, self.unroll, self.threads)
            }
            ElementwiseOp::AddAssign => {
                format!("{}_{}_v{}_u{}_t{}", self.a, self.b, self.vec, self.unroll, self.threads)
            }
            ElementwiseOp::ScaleAssign => format!("{}_v{}_u{}_t{}", self.a, self.vec, self.unroll, self.threads),
        }
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("op", self.op.name());
        ctx.insert("a_t", self.a.type_tag());
        ctx.insert("b_t", self.b.type_tag());
        ctx.insert("out_t", self.out.type_tag());
        ctx.insert("vec", &self.vec);
        ctx.insert("unroll", &self.unroll);
        ctx.insert("threads", &self.threads);
    }
    fn validate(&self) -> Result<(), String> {
        let (a, b) = match self.op {
            ElementwiseOp::Add => ("a", "b"),
            ElementwiseOp::AddAssign => ("dst", "src"),
            ElementwiseOp::ScaleAssign => ("dst", "dst"),
        };
        for (arg, dt) in [(a, self.a), (b, self.b), ("out", self.out)] {
            if !dt.is_high_precision() {
                return Err(format!(
                    "{} takes f32, bf16 or f16; `{arg}` is {dt}: dequantize FP8 tensors first",
                    self.op.name()
                ));
            }
        }
        if self.op == ElementwiseOp::ScaleAssign && (self.b != self.a || self.out != self.a) {
            return Err(format!("scale_assign reads and writes `dst` ({}) only", self.a));
        }
        if self.op == ElementwiseOp::AddAssign && self.out != self.a {
            return Err(format!(
                "add_assign writes `dst` in its own type: out = {} must equal dst = {} (use add for another output type)",
                self.out, self.a
            ));
        }
        check_pow2("vec", self.vec, 1, 16)?;
        let widest = self.a.size_bytes().max(self.b.size_bytes()).max(self.out.size_bytes());
        if self.vec * widest > 16 {
            return Err(format!("vec = {} elements of {widest} bytes exceed one 16-byte access", self.vec));
        }
        check_pow2("unroll", self.unroll, 1, 8)?;
        check_threads(self.threads)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_with_16_byte_accesses_of_the_widest_type() {
        let s = ElementwiseSpec::add_assign(DType::F32, DType::BF16, Arch::Sm90a);
        s.validate().unwrap();
        assert_eq!((s.vec, s.out), (4, DType::F32));
        let s = ElementwiseSpec::add(DType::BF16, DType::F16, DType::BF16, Arch::Sm89);
        s.validate().unwrap();
        assert_eq!(s.vec, 8);
        assert_eq!(super::super::KernelSpec::from(s).name(), "te_add_bf16_f16_bf16_v8_u4_t256_sm_89");
    }

    #[test]
    fn bad_specs_say_what_to_change() {
        let e = ElementwiseSpec::add(DType::E4M3, DType::BF16, DType::BF16, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("`a` is e4m3") && e.contains("dequantize"), "{e}");
        let e = ElementwiseSpec::add_assign(DType::F32, DType::E5M2, Arch::Sm90a).validate().unwrap_err();
        assert!(e.contains("`src` is e5m2"), "{e}");
        let s = ElementwiseSpec::add_assign(DType::F32, DType::BF16, Arch::Sm90a);
        let e = ElementwiseSpec { out: DType::BF16, ..s }.validate().unwrap_err();
        assert!(e.contains("use add"), "{e}");
        let e = ElementwiseSpec { vec: 8, ..s }.validate().unwrap_err();
        assert!(e.contains("16-byte"), "{e}");
    }
}
