//! Kernel code generation for the Transformer Engine for Rust.
//!
//! The pipeline is pure up to the GPU: a typed [`KernelSpec`] is rendered from a Tera template
//! under `te-codegen/templates/` ([`render`]), compiled by NVRTC to a CUBIN for the target [`Arch`]
//! ([`nvrtc`]), and stored in a checksummed on-disk cache ([`cache`]). [`KernelCompiler`] ties
//! them together; [`prewarm`] compiles a kernel list ahead of time, on a machine without a GPU,
//! and [`catalog`] spans every kernel the templates can produce. Which kernels a module or model
//! runs, loading and launching live in `te-runtime`.

pub mod arch;
pub mod cache;
pub mod catalog;
pub mod compiler;
pub mod dtype;
pub mod nvrtc;
pub mod prewarm;
pub mod render;
pub mod spec;

pub use arch::Arch;
pub use cache::DiskCache;
pub use compiler::{CompileOutcome, KernelCompiler};
pub use dtype::DType;
pub use nvrtc::{Binary, BinaryKind, Nvrtc};
pub use spec::KernelSpec;

use std::path::PathBuf;

/// Errors of spec validation, rendering, compilation and the cache.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A spec the templates do not support.
    #[error("invalid kernel spec {kernel}: {reason}")]
    InvalidSpec {
        /// Kernel name.
        kernel: String,
        /// What is wrong and what to change.
        reason: String,
    },
    /// Tera failed to render a template (an undefined variable, a syntax error).
    #[error("rendering {template} for kernel {kernel} failed: {message}")]
    Render {
        /// Kernel name.
        kernel: String,
        /// Template file.
        template: String,
        /// Tera's error with its causes.
        message: String,
    },
    /// libnvrtc could not be loaded.
    #[error(
        "NVRTC (libnvrtc.so.13) was not found. Install it with `pip install nvidia-cuda-nvrtc==13.0.88` \
         and put its `nvidia/cu13/lib` folder on LD_LIBRARY_PATH (the README's test command does both), \
         or install the CUDA 13 toolkit"
    )]
    NvrtcMissing,
    /// NVRTC rejected a rendered kernel.
    #[error("NVRTC failed to compile kernel {kernel} with options {options:?}; rendered source written to {}\n{log}", source_path.display())]
    Compile {
        /// Kernel name.
        kernel: String,
        /// The NVRTC options used.
        options: Vec<String>,
        /// NVRTC's log.
        log: String,
        /// Where the rendered source was written for inspection.
        source_path: PathBuf,
    },
    /// An NVRTC API call failed outside compilation proper.
    #[error("NVRTC call failed: {0:?}")]
    Nvrtc(#[from] cudarc::nvrtc::result::NvrtcError),
    /// The disk cache could not store a kernel where it had to ([`DiskCache::try_put`]: `te prewarm`).
    #[error(
        "cannot write the kernel cache at {}: {source}; set {} to a writable directory",
        dir.display(),
        cache::CACHE_DIR_ENV
    )]
    CacheWrite {
        /// The cache directory.
        dir: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Kernels [`prewarm::prewarm`] did not get into the disk cache: one line per kernel, its
    /// name and error; the report has every kernel's outcome.
    #[error("{}", report.failure_summary())]
    Prewarm {
        /// What happened to each kernel.
        report: Box<prewarm::PrewarmReport>,
    },
    /// A broken invariant of this crate (a bug, never the caller's input): the message names
    /// what did not hold.
    #[error("internal error in {op}: {message} (a bug in te-codegen; please report it)")]
    Internal {
        /// Where it was found.
        op: &'static str,
        /// What did not hold.
        message: String,
    },
}

/// What FP8 GEMMs (16-byte aligned leading dimensions of 1-byte operands) and the FP8 kernels'
/// vector layouts need every dimension they cast or transpose to be a multiple of.
pub const FP8_ALIGN: usize = 16;

/// Checks that the FP8 dimension `dim` (named in the message, e.g. `in_features`) is a positive
/// multiple of [`FP8_ALIGN`]. The one home of this rule: specs, launchers, modules and configs
/// all call it.
///
/// # Errors
/// `"<dim> = <value> must be a multiple of 16 for FP8; pad it to <next multiple>"`.
pub fn check_fp8_dim(dim: &str, value: usize) -> std::result::Result<(), String> {
    if value > 0 && value % FP8_ALIGN == 0 {
        Ok(())
    } else {
        let padded = value.div_ceil(FP8_ALIGN).max(1) * FP8_ALIGN;
        Err(format!("{dim} = {value} must be a multiple of {FP8_ALIGN} for FP8; pad it to {padded}"))
    }
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
