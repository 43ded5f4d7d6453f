//! Runtime of the Transformer Engine for Rust, the lowest GPU layer: the device and its stream
//! ([`Device`]), JIT-loaded kernels ([`kernels`]: spec → loaded module, compiled by `te-codegen`),
//! device tensors ([`Tensor`]), CUDA graphs ([`graph`]; [`DeviceBuffer`] for buffers a capture may
//! allocate), cuBLASLt GEMMs ([`gemm`]), one launcher per
//! fused kernel family ([`ops`]), host element conversions ([`numerics`]), the host Philox stream
//! of the dropout kernels ([`philox`]) and multi-process communication ([`dist`]: the launch
//! environment, the rendezvous, NCCL process groups).
//!
//! The layers above it are crates of their own: `te-nn` (FP8 recipes and quantizers, TE's modules,
//! parallel layers), `te-models` (GPT, BERT, generation, checkpoints), `te-train` (optimizers, the
//! trainer) and `te-reference` (the CPU oracle of every kernel family).
//!
//! Every GPU entry point returns a typed [`Error`] instead of panicking: a missing driver or
//! NVRTC, a GPU without FP8, bad shapes and dtype mismatches all say what to change.

pub mod device;
pub mod dist;
pub mod gemm;
pub mod graph;
pub mod graph_memory;
pub mod kernels;
pub mod numerics;
pub mod offload;
pub mod ops;
pub mod philox;
pub mod tensor;

pub use device::Device;
pub use graph_memory::DeviceBuffer;
pub use te_codegen::{Arch, DType};
pub use tensor::Tensor;

/// Errors of the runtime.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// libcuda could not be loaded.
    #[error("the CUDA driver (libcuda.so) was not found: install an NVIDIA driver, or put the folder holding libcuda.so on LD_LIBRARY_PATH")]
    DriverMissing,
    /// The driver loaded but reports no device (or not the one asked for).
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: usize,
    },
    /// The GPU has no FP8 support (pre-Ada) or is not a target yet.
    #[error("{device} has compute capability {major}.{minor}; the FP8 kernels target Ada (8.9) and Hopper (9.0)")]
    UnsupportedArch {
        /// Device name.
        device: String,
        /// Compute capability major.
        major: i32,
        /// Compute capability minor.
        minor: i32,
    },
    /// Rendering or compiling a kernel failed (or NVRTC is missing).
    #[error(transparent)]
    Codegen(#[from] te_codegen::Error),
    /// A CUDA driver call failed.
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// A device allocation the GPU's free memory cannot hold.
    #[error(
        "out of GPU memory: {what} needs {} MiB, {} MiB of {} MiB are free; lower the batch size or the \
         sequence length (te train: --batch, --seq-length, --grad-accum for the same tokens per step)",
        requested >> 20,
        free >> 20,
        total >> 20
    )]
    OutOfMemory {
        /// What was being allocated (a tensor's dtype and shape).
        what: String,
        /// Bytes asked for.
        requested: u64,
        /// Bytes free on the device when it failed.
        free: u64,
        /// The device's memory.
        total: u64,
    },
    /// libcublasLt could not be loaded (the GEMMs need it).
    #[error("cuBLASLt (libcublasLt.so.13) was not found: `pip install nvidia-cublas` (CUDA 13) and put its `nvidia/cu13/lib` folder on LD_LIBRARY_PATH, or put the lib folder of a CUDA 13 toolkit on LD_LIBRARY_PATH")]
    CublasLtMissing,
    /// A cuBLASLt call failed.
    #[error("cuBLASLt call failed: {0}")]
    Cublas(#[from] cudarc::cublaslt::result::CublasError),
    /// A GEMM cuBLASLt cannot run (no algorithm for these shapes, dtypes and epilogue) or
    /// arguments that do not fit together (an FP8 operand without its scale_inv, ...); the
    /// message names the problem.
    #[error("gemm: {message}")]
    Gemm {
        /// The problem and what cuBLASLt answered.
        message: String,
    },
    /// A shape an op cannot take; the message says what to change.
    #[error("{op}: {message}")]
    Shape {
        /// The op.
        op: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A scalar argument out of its range (a dropout probability outside `[0, 1]`, ...); the
    /// message says what is accepted.
    #[error("{op}: {message}")]
    Argument {
        /// The op.
        op: &'static str,
        /// The value and the accepted range.
        message: String,
    },
    /// An argument of the wrong element type.
    #[error("{op}: `{arg}` must be {expected}, got {got}")]
    DType {
        /// The op.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// What is accepted.
        expected: String,
        /// What was passed.
        got: te_codegen::DType,
    },
    /// An FP8 recipe with a field out of range, or used where it cannot work.
    #[error("FP8 recipe: {message}")]
    Recipe {
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A module configuration that cannot work; the message says what to change.
    #[error("{module}: {message}")]
    Config {
        /// The module.
        module: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
    /// `fp8_autocast` scopes used out of order.
    #[error("fp8_autocast: {message}")]
    Autocast {
        /// What is wrong and how to fix it.
        message: String,
    },
    /// A checkpoint that cannot be written or read: an I/O failure, a truncated or corrupt
    /// file, or tensors that do not match the model (the message lists every missing,
    /// unexpected and mismatched name).
    #[error("checkpoint: {message}")]
    Checkpoint {
        /// What is wrong, naming the file and the tensors.
        message: String,
    },
    /// A broken invariant of this library (a bug, never the caller's input): the message names
    /// what did not hold. Please report it.
    #[error("internal error in {op}: {message} (a bug in te-runtime; please report it)")]
    Internal {
        /// Where it was found.
        op: &'static str,
        /// What did not hold.
        message: String,
    },
    /// A CUDA graph capture that broke one of its rules ([`graph::CaptureRule`], named in the
    /// message with what to do); the capture was discarded and the device is usable.
    #[error("CUDA graph capture: {rule}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    Capture {
        /// The rule.
        rule: graph::CaptureRule,
        /// What broke it (the kernel, the GEMM, the driver's answer).
        detail: String,
    },
    /// A variable of a multi-process launch (`RANK`, `WORLD_SIZE`, ..., `torchrun`'s) that is
    /// missing or wrong.
    #[error("distributed launch: {var}: {message}")]
    DistEnv {
        /// The environment variable.
        var: String,
        /// What is wrong with it.
        message: String,
    },
    /// A multi-process run could not proceed: the rendezvous (a peer that never connected, a
    /// mismatched world size or rank), a collective, or a shape that does not split over the
    /// ranks.
    #[error("distributed run: {message}")]
    Dist {
        /// What failed and what to do.
        message: String,
    },
    /// NCCL could not be loaded ([`dist::nccl_available`] checks before any NCCL call: cudarc
    /// would panic). cudarc loads it as `libnccl.so`; PyTorch's wheel (`nvidia-nccl-cu13`) ships
    /// only `libnccl.so.2`, in `site-packages/nvidia/nccl/lib`: `source scripts/nccl-path.sh`
    /// makes a `libnccl.so` link to it and puts the link's folder on `LD_LIBRARY_PATH`.
    #[error("NCCL could not be loaded: {hint}")]
    NcclMissing {
        /// What was searched and found, and how to make it loadable.
        hint: String,
    },
    /// An NCCL call failed (or NCCL is too old for it): the call, NCCL's result code and its
    /// last error text, and what usually causes it.
    #[error("NCCL {op} failed: {message}")]
    Nccl {
        /// The NCCL function, e.g. `ncclAllReduce`.
        op: &'static str,
        /// The result code, NCCL's explanation, and what to check.
        message: String,
    },
    /// A backward called with a context it cannot use: made by another module, or by a forward
    /// whose weights have changed since.
    #[error("{module} backward: {message}")]
    Context {
        /// The module.
        module: &'static str,
        /// What is wrong and how to fix it.
        message: String,
    },
}

/// Result with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An [`Error::Internal`]: `op` found that `message` did not hold.
    pub fn internal(op: &'static str, message: impl Into<String>) -> Self {
        Error::Internal { op, message: message.into() }
    }
}
