//! Kernel argument declarations: the one list of an entry point's parameters.
//!
//! Each family declares, next to its spec, one `const` slice of [`KernelArg`] per entry-point
//! signature. The renderer turns it into the `extern "C"` parameter list of the template
//! (`{{ params.0 }}` for entry point 0, `{{ params.1 }}` for entry point 1, ...), the launchers in
//! te-runtime push their arguments by name against it (a wrong name, order or count is an
//! internal error before anything launches), and the spec's documentation links to it.

use serde::Serialize;

/// The C type of a TMA tensor map passed by value (`cuTensorMapEncodeTiled`'s 128 bytes, read in
/// place by `cp.async.bulk.tensor`; the templates declare `TmaDesc`).
pub const TMA_DESC: &str = "const __grid_constant__ TmaDesc";

/// How a kernel uses an argument.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ArgRole {
    /// A device pointer the kernel only reads.
    Read,
    /// A device pointer the kernel writes (and may read back what it wrote).
    Write,
    /// A device pointer the kernel reads and updates in place (amax, accumulators).
    ReadWrite,
    /// A value passed by value (sizes, seeds, scalars).
    Scalar,
}

/// A spec option an optional argument depends on: the argument is in the signature only when
/// the spec has the option ([`super::Family::has`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum ArgCond {
    /// A fused bias input (activation, dropout forward).
    Bias,
    /// A fused residual input (dropout forward).
    Residual,
    /// The column sums of the input gradient (cast + transpose with dbias).
    Dbias,
    /// The forward input of a fused activation backward (cast + transpose with dact).
    Dact,
    /// An FP8 output with its scale, amax and scale_inv (activation, norm forward).
    Fp8Out,
    /// LayerNorm's mean and beta (absent for RMSNorm).
    LayerNorm,
    /// The gradient of the logits (cross-entropy with a backward).
    Grad,
    /// A per-sequence key length (softmax with a padding mask).
    Padding,
    /// TMA tensor maps of the inputs (the warp-specialized attention forward).
    Tma,
    /// The per-head q and k norms' weights and epsilon (the fused qkv + RoPE step).
    QkNorm,
    /// A residual add before the pre-norm: the sublayer output and the sum's output (the decode
    /// GEMV's `AddNorm` and `ResidualNorm`).
    ResidualAdd,
    /// The sandwich norm's post-norm of that sublayer output (the decode GEMV's `AddNorm`).
    AddNorm,
    /// That post-norm's LayerNorm bias.
    AddNormBeta,
    /// A pre-norm of the input rows (the decode GEMV's prologue).
    PreNorm,
    /// That pre-norm's LayerNorm bias.
    PreNormBeta,
    /// An FP8 weight's per-tensor `scale_inv`.
    Fp8Weight,
    /// An E4M3 KV cache's per-tensor scales (decode attention).
    Fp8KvCache,
}

/// One parameter of a kernel entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct KernelArg {
    /// The parameter's name in the kernel (and in the launcher's push).
    pub name: &'static str,
    /// Its C type as the kernel declares it (`const void* __restrict__`, `u64`, `float`).
    pub ctype: &'static str,
    /// How the kernel uses it.
    pub role: ArgRole,
    /// What it is (shape, dtype, units).
    pub doc: &'static str,
    /// The spec option it depends on, when it is optional.
    pub when: Option<ArgCond>,
}

impl KernelArg {
    /// A device pointer the kernel reads: `const <elem>* __restrict__`.
    pub const fn read(name: &'static str, ctype: &'static str, doc: &'static str) -> Self {
        Self { name, ctype, role: ArgRole::Read, doc, when: None }
    }

    /// A device pointer the kernel writes.
    pub const fn write(name: &'static str, ctype: &'static str, doc: &'static str) -> Self {
        Self { name, ctype, role: ArgRole::Write, doc, when: None }
    }

    /// A device pointer the kernel reads and updates.
    pub const fn read_write(name: &'static str, ctype: &'static str, doc: &'static str) -> Self {
        Self { name, ctype, role: ArgRole::ReadWrite, doc, when: None }
    }

    /// A value passed by value.
    pub const fn scalar(name: &'static str, ctype: &'static str, doc: &'static str) -> Self {
        Self { name, ctype, role: ArgRole::Scalar, doc, when: None }
    }

    /// This argument, present only when the spec has `cond`.
    pub const fn when(self, cond: ArgCond) -> Self {
        Self { when: Some(cond), ..self }
    }

    /// The C declaration: `<ctype> <name>`.
    pub fn declaration(&self) -> String {
        format!("{} {}", self.ctype, self.name)
    }

    /// The size in bytes a scalar's Rust value must have (`u64` 8, `float`/`int`/`u32` 4), or
    /// `None` for a pointer or an unknown scalar type.
    pub fn scalar_size(&self) -> Option<usize> {
        match (self.role, self.ctype) {
            (ArgRole::Scalar, "u64" | "long long" | "unsigned long long") => Some(8),
            (ArgRole::Scalar, "float" | "int" | "u32" | "unsigned") => Some(4),
            (ArgRole::Scalar, TMA_DESC) => Some(128),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::catalog::spec_catalog;
    use crate::render::render;
    use crate::Arch;

    /// The `extern "C"` entry points of a rendered module: name and parameter list.
    fn entry_points(src: &str) -> Vec<(String, Vec<String>)> {
        let mut out = Vec::new();
        for part in src.split("extern \"C\" __global__ void").skip(1) {
            // Skip attributes with arguments (`__launch_bounds__(...)`, `__cluster_dims__(...)`):
            // the entry point is the identifier before the next `(`.
            let mut part = part;
            let mut open = part.find('(').unwrap();
            while part[..open].trim().starts_with("__") && part[..open].trim().ends_with("__") {
                let close = part[open..].find(')').unwrap() + open;
                part = &part[close + 1..];
                open = part.find('(').unwrap();
            }
            let (head, rest) = (part[..open].trim().to_string(), &part[open + 1..]);
            let params = &rest[..rest.find(')').unwrap()];
            let params = params.split(',').map(|p| p.split_whitespace().collect::<Vec<_>>().join(" ")).collect();
            out.push((head, params));
        }
        out
    }

    #[test]
    fn rendered_signatures_are_the_declared_ones() {
        let specs = spec_catalog(Arch::Sm90a);
        assert!(specs.len() > 400, "the catalog spans every family");
        for spec in specs {
            let src = render(&spec).unwrap();
            let found = entry_points(&src);
            let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, spec.entry_points(), "{}: entry points", spec.name());
            for (entry, (name, params)) in found.iter().enumerate() {
                let declared: Vec<String> = spec.family().params(entry).iter().map(|a| a.declaration()).collect();
                assert_eq!(params, &declared, "{name}: parameters");
            }
        }
    }

    #[test]
    fn optional_arguments_follow_the_spec_options() {
        use crate::spec::{CastTransposeSpec, Direction, Family, NormKind, NormSpec};
        use crate::DType;
        let ct = CastTransposeSpec::new(DType::BF16, DType::E5M2, 64, true, None, Arch::Sm90a);
        let names: Vec<&str> = ct.params(0).iter().map(|a| a.name).collect();
        assert_eq!(names, ["x", "q", "q_t", "scale_ptr", "amax_ptr", "scale_inv_ptr", "dbias_partial", "rows"]);
        let rms = NormSpec::new(
            NormKind::RmsNorm,
            Direction::Fwd,
            DType::BF16,
            DType::BF16,
            DType::BF16,
            64,
            false,
            Arch::Sm90a,
        );
        let names: Vec<&str> = rms.params(0).iter().map(|a| a.name).collect();
        assert_eq!(names, ["x", "gamma", "y", "rsigma_out", "eps", "rows"]);
    }
}
