//! [`Launch`]: a kernel launch whose arguments are pushed by name against the family's
//! declaration ([`te_codegen::spec::KernelArg`]), the same list the template's signature is
//! rendered from. A wrong name, a pointer where a scalar belongs (or a scalar of the wrong
//! size), a missing or an extra argument is an [`Error::Internal`] raised before the launch.
//! The checks are a few comparisons per argument: no allocation, no formatting on success.

use crate::{Error, Result};
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg};
use std::ffi::c_void;
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

/// A launch with programmatic dependent launch (Hopper's PDL: the launch attribute
/// `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`, kept by stream capture as a
/// programmatic edge of the graph): the kernel may begin while the previous kernel on the stream
/// is finishing, so its launch and whatever it reads that no earlier kernel writes (a GEMV's
/// weights) overlap that kernel's tail. The kernel must run `griddepcontrol.wait` before it
/// reads anything an earlier kernel wrote and before it writes anything. Arguments are pushed by
/// name against the declaration, as for [`Launch`]; every value travels as a 64-bit slot
/// (device pointers, or 4-byte scalars in the low bytes: the kernel reads the declared size).
pub(crate) struct PdlLaunch<'a> {
    op: &'static str,
    stream: &'a Arc<CudaStream>,
    f: &'a CudaFunction,
    check: ArgCheck<'a>,
    slots: Vec<u64>,
    programmatic: bool,
}

impl<'a> PdlLaunch<'a> {
    /// A launch of `f`, entry point `entry` of `spec`, on `stream`, for the launcher `op`;
    /// `programmatic`: with the PDL attribute (Hopper), else an ordinary launch (Ada has no
    /// PDL; its template has no wait).
    pub(crate) fn new(
        op: &'static str,
        stream: &'a Arc<CudaStream>,
        f: &'a CudaFunction,
        (spec, entry): (&'a dyn Family, usize),
        programmatic: bool,
    ) -> Self {
        Self { op, stream, f, check: ArgCheck::new(spec, entry), slots: Vec::with_capacity(16), programmatic }
    }

    /// Pushes the device address declared as `name`.
    pub(crate) fn ptr(&mut self, name: &'static str, address: CUdeviceptr) -> &mut Self {
        if self.check.push(name, None) {
            self.slots.push(address);
        }
        self
    }

    /// Pushes the 4-byte scalar declared as `name` (its bits).
    pub(crate) fn scalar32(&mut self, name: &'static str, bits: u32) -> &mut Self {
        if self.check.push(name, Some(4)) {
            self.slots.push(u64::from(bits));
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
    /// As [`Launch::launch`], and the kernel waits (`griddepcontrol.wait`) before it touches
    /// what earlier kernels on the stream write or read.
    pub(crate) unsafe fn launch(mut self, cfg: LaunchConfig) -> Result<()> {
        self.check.finish().map_err(|fault| Error::internal(self.op, format!("kernel arguments: {fault}")))?;
        self.stream.context().bind_to_thread()?;
        let mut params: Vec<*mut c_void> = self.slots.iter_mut().map(|v| (v as *mut u64).cast::<c_void>()).collect();
        // SAFETY: an all-zero launch attribute is a valid value of the plain-data C union.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.programmatic),
        };
        // SAFETY: `params` points at one live slot per declared argument, in order (checked
        // above); the buffers behind the addresses are the caller's to keep valid (see Safety).
        unsafe { sys::cuLaunchKernelEx(&config, self.f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
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
