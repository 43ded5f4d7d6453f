//! [`Launch`]: a kernel launch whose arguments are pushed by name against the family's
//! declaration ([`te_codegen::spec::KernelArg`]), the same list the template's signature is
//! rendered from. A wrong name, a pointer where a scalar belongs (or a scalar of the wrong
//! size), a missing or an extra argument is an [`Error::Internal`] raised before the launch.
//! The checks are a few comparisons per argument: no allocation, no formatting on success.

use crate::{Error, Result};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use std::sync::Arc;
use te_codegen::spec::{ArgRole, Family, KernelArg};

/// A kernel launch being built: push each declared argument by name, then [`Launch::launch`].
pub(crate) struct Launch<'a> {
    op: &'static str,
    builder: LaunchArgs<'a>,
    check: ArgCheck<'a>,
}

impl<'a> Launch<'a> {
    /// A launch of `f`, entry point `entry` of `spec`, on `stream`, for the launcher `op`.
    pub(crate) fn new(
        op: &'static str,
        stream: &'a Arc<CudaStream>,
        f: &'a CudaFunction,
        spec: &'a dyn Family,
        entry: usize,
    ) -> Self {
        Self { op, builder: stream.launch_builder(f), check: ArgCheck::new(spec, entry) }
    }

    /// Pushes the device pointer declared as `name` (a slice or view, read or written).
    pub(crate) fn ptr<A>(&mut self, name: &'static str, a: A) -> &mut Self
    where
        LaunchArgs<'a>: PushKernelArg<A>,
    {
        if self.check.push(name, None) {
            self.builder.arg(a);
        }
        self
    }

    /// Pushes the by-value argument declared as `name`.
    pub(crate) fn scalar<T: DeviceRepr>(&mut self, name: &'static str, v: &'a T) -> &mut Self {
        if self.check.push(name, Some(std::mem::size_of::<T>())) {
            self.builder.arg(v);
        }
        self
    }

    /// Launches with `cfg` once every declared argument was pushed in order.
    ///
    /// # Errors
    /// [`Error::Internal`] naming the first mismatch with the declaration (nothing launched);
    /// launch failures.
    ///
    /// # Safety
    /// As [`LaunchArgs::launch`]: the pushed buffers hold what the kernel reads and writes for
    /// `cfg` (sizes and dtypes the launcher checked), and written buffers alias nothing else.
    pub(crate) unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        self.check.finish().map_err(|fault| Error::internal(self.op, format!("kernel arguments: {fault}")))?;
        // SAFETY: forwarded to the caller.
        unsafe { self.builder.launch(cfg) }?;
        Ok(())
    }
}

/// The walk of a launcher's pushes along an entry point's declaration: optional arguments the
/// spec lacks are skipped, the first mismatch is kept.
struct ArgCheck<'a> {
    spec: &'a dyn Family,
    decl: &'static [KernelArg],
    next: usize,
    fault: Option<String>,
}

impl<'a> ArgCheck<'a> {
    fn new(spec: &'a dyn Family, entry: usize) -> Self {
        Self { spec, decl: spec.args(entry), next: 0, fault: None }
    }

    /// Index of the next argument this spec passes, at or after `from`.
    fn next_present(&self, from: usize) -> usize {
        (from..self.decl.len()).find(|&i| self.decl[i].when.is_none_or(|c| self.spec.has(c))).unwrap_or(self.decl.len())
    }

    /// Records the push of `name` (`scalar`: the size of a by-value argument, `None` for a
    /// pointer); false once anything mismatched.
    fn push(&mut self, name: &'static str, scalar: Option<usize>) -> bool {
        if self.fault.is_some() {
            return false;
        }
        let i = self.next_present(self.next);
        let Some(arg) = self.decl.get(i) else {
            self.fault = Some(format!("`{name}` pushed after the last declared argument"));
            return false;
        };
        self.next = i + 1;
        let ok = arg.name == name
            && match scalar {
                None => arg.role != ArgRole::Scalar,
                Some(size) => arg.scalar_size() == Some(size),
            };
        if !ok {
            let pushed = scalar.map_or("a pointer".to_string(), |s| format!("a {s}-byte value"));
            self.fault = Some(format!(
                "pushed `{name}` ({pushed}) where the declaration has `{}` ({})",
                arg.declaration(),
                arg.doc
            ));
        }
        ok
    }

    /// Ok when every argument this spec passes was pushed, in order.
    fn finish(self) -> std::result::Result<(), String> {
        if let Some(fault) = self.fault {
            return Err(fault);
        }
        match self.decl.get(self.next_present(self.next)) {
            Some(a) => Err(format!("`{}` was not pushed", a.name)),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ArgCheck;
    use te_codegen::spec::{CastTransposeSpec, CrossEntropySpec};
    use te_codegen::{Arch, DType};

    #[test]
    fn pushes_in_declared_order_pass_and_optional_ones_follow_the_spec() {
        let plain = CastTransposeSpec::new(DType::BF16, DType::E4M3, 64, false, None, Arch::Sm90a);
        let mut c = ArgCheck::new(&plain, 0);
        for name in ["x", "q", "q_t", "scale_ptr", "amax_ptr", "scale_inv_ptr"] {
            assert!(c.push(name, None), "{name}");
        }
        assert!(c.push("rows", Some(8)));
        c.finish().unwrap();

        let with_dbias = CastTransposeSpec { dbias: true, ..plain };
        let mut c = ArgCheck::new(&with_dbias, 0);
        for name in ["x", "q", "q_t", "scale_ptr", "amax_ptr", "scale_inv_ptr"] {
            c.push(name, None);
        }
        c.push("rows", Some(8));
        let e = c.finish().unwrap_err();
        assert!(e.contains("pushed `rows`") && e.contains("dbias_partial"), "{e}");
    }

    #[test]
    fn a_wrong_name_a_wrong_kind_or_a_missing_argument_is_reported() {
        let spec = CrossEntropySpec::new(DType::BF16, false, Arch::Sm90a);
        let mut c = ArgCheck::new(&spec, 0);
        c.push("logits", None);
        c.push("loss", None);
        let e = c.finish().unwrap_err();
        assert!(e.contains("pushed `loss`") && e.contains("targets"), "{e}");

        let mut c = ArgCheck::new(&spec, 0);
        for name in ["logits", "targets", "loss"] {
            c.push(name, None);
        }
        c.push("tokens", Some(4));
        assert!(c.finish().unwrap_err().contains("a 4-byte value"));

        let mut c = ArgCheck::new(&spec, 0);
        c.push("logits", None);
        assert_eq!(c.finish().unwrap_err(), "`targets` was not pushed");
    }
}
