//! Loading NCCL safely: the probe that runs before any NCCL call (cudarc panics when the library
//! or one of its symbols is missing), the process environment NCCL is started with, and the
//! mapping of NCCL's result codes to [`Error::Nccl`].
//!
//! cudarc 0.19 loads NCCL under the names `libnccl.so`, `libnccl.so.13`, `.12`, ..., `.1`, never
//! `libnccl.so.2`, the only file of PyTorch's wheel (`nvidia-nccl-cu13`,
//! `site-packages/nvidia/nccl/lib/libnccl.so.2`). `scripts/nccl-path.sh` links `libnccl.so` to it
//! and puts the link's folder on `LD_LIBRARY_PATH`; [`Error::NcclMissing`] says so when it finds
//! the versioned file alone.

use crate::{Error, Result};
use cudarc::nccl::result::{self, NcclError};
use cudarc::nccl::sys;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The oldest NCCL this module runs on: 2.18 brought `ncclCommSplit` (sub-groups), and every
/// other call used here (`ncclCommFinalize`, `ncclGetLastError`, bf16, `ncclAvg`) is older.
pub const MIN_NCCL_VERSION: (u32, u32, u32) = (2, 18, 0);

/// The variable that turns NVLink SHARP (NVLS, NVLink multicast) on or off in NCCL.
pub(crate) const NVLS_VAR: &str = "NCCL_NVLS_ENABLE";

/// Makes NCCL start with NVLink multicast off (`NCCL_NVLS_ENABLE=0`) unless the user has set the
/// variable: NVLS allocates multicast objects (`cuMulticastCreate`) over the NVSwitch fabric, and
/// on machines whose GPUs are shared a program that uses them can leave the host's GPUs out of
/// service; an all-reduce over NVLink without it is only a little slower. Set before the first
/// NCCL call, because NCCL reads its parameters once (and a value from `/etc/nccl.conf` does
/// not override one set in the environment). This crate never calls `cuMulticastCreate`.
fn nvls_off_unless_set() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if std::env::var_os(NVLS_VAR).is_none() {
            // Edition 2021: a safe call. It runs once, before NCCL (the only reader) starts.
            std::env::set_var(NVLS_VAR, "0");
        }
    });
}

/// The NCCL version the loaded library reports, `(major, minor, patch)`, after checking that the
/// library loads and is at least [`MIN_NCCL_VERSION`]. Every NCCL entry point of this crate
/// calls it first; the answer is cached for the process (the loader's path cannot change).
/// Also sets `NCCL_NVLS_ENABLE=0` in the process environment when the user has not set it
/// (NVLink multicast stays off; see the module's documentation).
///
/// # Errors
/// [`Error::NcclMissing`]: no `libnccl.so` on the loader's path; its hint names a
/// `libnccl.so.2` found without the unversioned link, or where PyTorch's copy usually is.
/// [`Error::Nccl`] (op `ncclGetVersion`): the library is older than [`MIN_NCCL_VERSION`].
pub fn nccl_available() -> Result<(u32, u32, u32)> {
    static PROBE: OnceLock<std::result::Result<(u32, u32, u32), Probe>> = OnceLock::new();
    nvls_off_unless_set();
    let probe = PROBE.get_or_init(|| {
        // SAFETY: only tries to dlopen the library under cudarc's candidate names.
        if !unsafe { sys::is_culib_present() } {
            return Err(Probe::Missing(missing_hint(&search_dirs())));
        }
        let code = result::get_nccl_version().map_err(|e| Probe::Failed(describe(e, None)))?;
        let version = decode_version(code);
        if version < MIN_NCCL_VERSION {
            return Err(Probe::Failed(too_old(version)));
        }
        Ok(version)
    });
    match probe {
        Ok(v) => Ok(*v),
        Err(Probe::Missing(hint)) => Err(Error::NcclMissing { hint: hint.clone() }),
        Err(Probe::Failed(message)) => Err(Error::Nccl { op: "ncclGetVersion", message: message.clone() }),
    }
}

/// A failed probe, kept for the process ([`Error`] is not `Clone`).
#[derive(Debug)]
enum Probe {
    Missing(String),
    Failed(String),
}

/// `NCCL_VERSION_CODE` as `(major, minor, patch)`: `X*10000 + Y*100 + Z` since 2.9, `X*1000 +
/// Y*100 + Z` before.
pub(crate) fn decode_version(code: i32) -> (u32, u32, u32) {
    let code = code.max(0) as u32;
    if code >= 10000 {
        (code / 10000, code % 10000 / 100, code % 100)
    } else {
        (code / 1000, code % 1000 / 100, code % 100)
    }
}

fn too_old((major, minor, patch): (u32, u32, u32)) -> String {
    let (a, b, c) = MIN_NCCL_VERSION;
    format!(
        "the loaded NCCL is {major}.{minor}.{patch}, older than {a}.{b}.{c} (ncclCommSplit): put a newer \
         libnccl.so first on LD_LIBRARY_PATH (PyTorch's: `source scripts/nccl-path.sh`)"
    )
}

/// The folders the hint looks in: `LD_LIBRARY_PATH`'s, then the usual system ones.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("LD_LIBRARY_PATH")
        .map(|p| std::env::split_paths(&p).filter(|d| !d.as_os_str().is_empty()).collect())
        .unwrap_or_default();
    for d in ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/local/lib"] {
        dirs.push(PathBuf::from(d));
    }
    dirs
}

/// What to do when `libnccl.so` does not load, given the folders to look in for a versioned
/// `libnccl.so.2` (PyTorch's wheel ships only that name, which cudarc does not try).
pub(crate) fn missing_hint(dirs: &[PathBuf]) -> String {
    let versioned = dirs.iter().find_map(|d| versioned_nccl(d));
    let how = "`source scripts/nccl-path.sh` (it finds PyTorch's copy in the Python environment's \
               site-packages/nvidia/nccl/lib, links libnccl.so to it under .tools/nccl/lib and puts that folder \
               on LD_LIBRARY_PATH)";
    match versioned {
        Some(file) => format!(
            "{} is there, but cudarc loads NCCL as libnccl.so (never libnccl.so.2), which is not on the loader's \
             path: run {how}, or `ln -s {} <a folder on LD_LIBRARY_PATH>/libnccl.so`",
            file.display(),
            file.display()
        ),
        None => format!(
            "libnccl.so is not on the loader's path (LD_LIBRARY_PATH and the system folders). With PyTorch \
             installed, NCCL is in the Python environment's site-packages/nvidia/nccl/lib (`python3 -c 'import \
             nvidia.nccl; print(nvidia.nccl.__path__[0] + \"/lib\")'`), as libnccl.so.2 only: run {how}; or \
             install NCCL {}.{}+ (libnccl2 and libnccl-dev, or `pip install nvidia-nccl-cu13`)",
            MIN_NCCL_VERSION.0, MIN_NCCL_VERSION.1
        ),
    }
}

/// `dir/libnccl.so.2` (or another `libnccl.so.2.*` file) when `dir` has one.
fn versioned_nccl(dir: &Path) -> Option<PathBuf> {
    let exact = dir.join("libnccl.so.2");
    if exact.exists() {
        return Some(exact);
    }
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnccl.so.2.")))
}

/// [`Error::Nccl`] for a failed `op`: the result code, NCCL's text for it and its last error on
/// `comm` (the detail of what failed), and what usually causes it.
pub(crate) fn nccl_error(op: &'static str, e: NcclError, comm: Option<sys::ncclComm_t>) -> Error {
    Error::Nccl { op, message: describe(e, comm) }
}

fn describe(e: NcclError, comm: Option<sys::ncclComm_t>) -> String {
    let code = e.0;
    // SAFETY: only called after the library loaded; ncclGetErrorString returns a static string
    // for any code, ncclGetLastError a thread-local one (null comm allowed), or null.
    let (text, last) = unsafe {
        (c_text(sys::ncclGetErrorString(code)), c_text(sys::ncclGetLastError(comm.unwrap_or(std::ptr::null_mut()))))
    };
    let mut message = format!("{code:?} ({text})");
    if !last.is_empty() && last != text {
        message.push_str(&format!(": {last}"));
    }
    message.push_str(&format!("; {}", hint_for(code)));
    message
}

/// The text at `p` (empty for null).
///
/// # Safety
/// `p` is null or a NUL-terminated string that lives for the call.
unsafe fn c_text(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().trim().to_owned()
}

/// What a result code usually means and what to check.
pub(crate) fn hint_for(code: sys::ncclResult_t) -> &'static str {
    use sys::ncclResult_t as R;
    match code {
        R::ncclUnhandledCudaError => {
            "a CUDA call inside NCCL failed: an earlier kernel may have faulted, or the GPU is out of memory; \
             NCCL_DEBUG=WARN prints NCCL's log"
        }
        R::ncclSystemError => {
            "a system call failed (sockets, shared memory): check that /dev/shm is large enough and that the ranks \
             reach each other (NCCL_SOCKET_IFNAME picks the interface); NCCL_DEBUG=WARN prints NCCL's log"
        }
        R::ncclInternalError => "an error inside NCCL; NCCL_DEBUG=INFO prints NCCL's log",
        R::ncclInvalidArgument => {
            "NCCL rejected an argument (a pointer not on this GPU, a dtype this NCCL lacks); NCCL_DEBUG=WARN says which"
        }
        R::ncclInvalidUsage => {
            "NCCL was used wrongly: two ranks on one GPU (each process must open Device::new(LOCAL_RANK), or \
             see only its own GPU), ranks that called different collectives, or a rank missing from the call"
        }
        R::ncclRemoteError => "a peer rank failed or the network between ranks broke; check the other ranks' output",
        _ => "NCCL_DEBUG=WARN prints NCCL's log",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_decode_both_encodings() {
        assert_eq!(decode_version(23203), (2, 32, 3));
        assert_eq!(decode_version(21805), (2, 18, 5));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert!(decode_version(21703) < MIN_NCCL_VERSION && decode_version(21800) >= MIN_NCCL_VERSION);
        assert!(too_old((2, 17, 1)).contains("2.17.1, older than 2.18.0"));
    }

    /// PyTorch's wheel ships `libnccl.so.2` only: the hint names the file and the link to make.
    #[test]
    fn the_hint_names_a_versioned_library_without_its_link() {
        let dir = tempfile::tempdir().unwrap();
        let empty = tempfile::tempdir().unwrap();
        let none = missing_hint(&[empty.path().to_path_buf(), PathBuf::from("/no/such/folder")]);
        for part in ["site-packages/nvidia/nccl/lib", "LD_LIBRARY_PATH", "scripts/nccl-path.sh", "libnccl.so.2"] {
            assert!(none.contains(part), "{part}: {none}");
        }
        std::fs::write(dir.path().join("libnccl.so.2"), b"").unwrap();
        let found = missing_hint(&[empty.path().to_path_buf(), dir.path().to_path_buf()]);
        let file = dir.path().join("libnccl.so.2").display().to_string();
        assert!(found.contains(&format!("{file} is there")) && found.contains("ln -s"), "{found}");
        let full = tempfile::tempdir().unwrap();
        std::fs::write(full.path().join("libnccl.so.2.21.5"), b"").unwrap();
        assert!(missing_hint(&[full.path().to_path_buf()]).contains("libnccl.so.2.21.5 is there"));
    }

    /// The probe never panics: on a machine without NCCL (CI) it is the typed error with the
    /// hint; with NCCL it gives a version no older than the minimum. Either way NVLink
    /// multicast is off unless the environment said otherwise.
    #[test]
    fn the_probe_is_a_typed_error_or_a_recent_version() {
        let user_set = std::env::var_os(NVLS_VAR).is_some();
        let probe = nccl_available();
        eprintln!("NCCL probe: {probe:?}");
        match probe {
            Ok(v) => {
                assert!(v >= MIN_NCCL_VERSION, "{v:?}");
                let e = nccl_error("ncclAllReduce", NcclError(sys::ncclResult_t::ncclInvalidUsage), None).to_string();
                assert!(
                    e.starts_with("NCCL ncclAllReduce failed: ncclInvalidUsage (") && e.contains("LOCAL_RANK"),
                    "{e}"
                );
            }
            Err(e @ Error::NcclMissing { .. }) => {
                let text = e.to_string();
                assert!(text.contains("NCCL could not be loaded") && text.contains("nvidia/nccl/lib"), "{text}");
            }
            Err(e) => panic!("unexpected probe error: {e}"),
        }
        if !user_set {
            assert_eq!(std::env::var(NVLS_VAR).as_deref(), Ok("0"));
        }
        assert!(nccl_available().is_ok() == nccl_available().is_ok(), "cached");
    }

    #[test]
    fn result_codes_have_hints() {
        use sys::ncclResult_t as R;
        assert!(hint_for(R::ncclInvalidUsage).contains("Device::new(LOCAL_RANK)"));
        assert!(hint_for(R::ncclSystemError).contains("/dev/shm"));
        assert!(hint_for(R::ncclRemoteError).contains("peer"));
    }
}
