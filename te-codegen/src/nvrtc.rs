//! NVRTC through cudarc: CUBIN for the target arch, PTX only as a fallback.
//!
//! cudarc panics when it cannot load libnvrtc, so [`Nvrtc::load`] probes for the library first
//! and returns [`Error::NvrtcMissing`] instead.

use crate::{Arch, Error, Result};
use cudarc::nvrtc::{result, sys};
use std::ffi::{CStr, CString};

/// What a compiled [`Binary`] holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BinaryKind {
    /// Machine code for the exact target (`sm_90a`, `sm_89`).
    Cubin,
    /// PTX for the virtual target, JIT-compiled by the driver at load (fallback when this
    /// NVRTC cannot emit machine code for the target).
    Ptx,
}

/// A compiled kernel module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binary {
    /// CUBIN or PTX.
    pub kind: BinaryKind,
    /// The image; PTX is NUL-terminated so the driver can load it as is.
    pub bytes: Vec<u8>,
}

/// A loaded NVRTC library.
#[derive(Debug, Clone)]
pub struct Nvrtc {
    version: (i32, i32),
    supported_archs: Vec<i32>,
}

/// Destroys an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `create_program` and is destroyed exactly once, here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

impl Nvrtc {
    /// Loads libnvrtc and reads its version and supported architectures.
    ///
    /// # Errors
    /// [`Error::NvrtcMissing`] when the library cannot be found.
    pub fn load() -> Result<Self> {
        // SAFETY: only tries to dlopen the candidate library names; no symbol is called.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NvrtcMissing);
        }
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library is present; both out-pointers are valid for writes.
        unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result()?;
        let mut n = 0;
        // SAFETY: valid out-pointer.
        unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) }.result()?;
        let mut supported_archs = vec![0i32; n.max(0) as usize];
        // SAFETY: the buffer holds exactly the `n` entries NVRTC reported.
        unsafe { sys::nvrtcGetSupportedArchs(supported_archs.as_mut_ptr()) }.result()?;
        Ok(Self { version: (major, minor), supported_archs })
    }

    /// NVRTC's version `(major, minor)`.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The `sm_XX` numbers this NVRTC can emit machine code for.
    pub fn supported_archs(&self) -> &[i32] {
        &self.supported_archs
    }

    /// The options and output kind used for `arch`: CUBIN when NVRTC supports the arch,
    /// otherwise PTX for its virtual arch.
    pub fn options(&self, arch: Arch) -> (Vec<String>, BinaryKind) {
        let (target, kind) = if self.supported_archs.contains(&arch.sm_number()) {
            (arch.name(), BinaryKind::Cubin)
        } else {
            (arch.virtual_name(), BinaryKind::Ptx)
        };
        let opts = vec![
            format!("--gpu-architecture={target}"),
            "--std=c++17".to_string(),
            "--extra-device-vectorization".to_string(),
        ];
        (opts, kind)
    }

    /// Compiles `source` (the rendered module of kernel `name`) with `options`.
    ///
    /// # Errors
    /// [`Error::Compile`] with NVRTC's log and the path where the source was written.
    pub fn compile(&self, name: &str, source: &str, options: &[String], kind: BinaryKind) -> Result<Binary> {
        let src = CString::new(source)
            .map_err(|_| compile_error(name, source, options, "source contains a NUL byte".into()))?;
        let cname = CString::new(format!("{name}.cu"))
            .map_err(|_| compile_error(name, source, options, "kernel name contains a NUL byte".into()))?;
        let prog = Program(result::create_program(&src, Some(&cname))?);
        // SAFETY: `prog` is a live program; `src` and `cname` outlive it (dropped after `prog`).
        let compiled = unsafe { result::compile_program(prog.0, options) };
        if compiled.is_err() {
            // SAFETY: live program.
            let log = unsafe { result::get_program_log(prog.0) }.map(|l| c_chars_to_string(&l)).unwrap_or_default();
            return Err(compile_error(name, source, options, log));
        }
        let bytes = match kind {
            BinaryKind::Cubin => {
                let mut size = 0usize;
                // SAFETY: live, compiled program; valid out-pointer.
                unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }.result()?;
                let mut buf = vec![0u8; size];
                // SAFETY: `buf` holds the `size` bytes NVRTC reported.
                unsafe { sys::nvrtcGetCUBIN(prog.0, buf.as_mut_ptr().cast()) }.result()?;
                buf
            }
            BinaryKind::Ptx => {
                // SAFETY: live, compiled program.
                let ptx = unsafe { result::get_ptx(prog.0) }?;
                ptx.into_iter().map(|c| c as u8).collect()
            }
        };
        Ok(Binary { kind, bytes })
    }
}

fn c_chars_to_string(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

/// Writes the failing source next to the other failures and builds the error.
fn compile_error(name: &str, source: &str, options: &[String], log: String) -> Error {
    let dir = std::env::temp_dir().join("te-kernel-failures");
    let source_path = dir.join(format!("{name}.cu"));
    if std::fs::create_dir_all(&dir).and_then(|_| std::fs::write(&source_path, source)).is_err() {
        tracing::warn!("could not write the failing source of {name} to {}", source_path.display());
    }
    Error::Compile { kernel: name.to_string(), options: options.to_vec(), log, source_path }
}
