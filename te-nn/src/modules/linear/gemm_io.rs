//! What goes in and out of the GEMM core besides the tensors of its parameters: its input
//! (high precision, FP8, or a token shard it gathers beside its GEMMs) and the bias gradient a
//! gradient cast computes on the way.

use crate::fp8::Float8Tensor;
use crate::parallel::GemmParallel;
use cudarc::driver::CudaSlice;
use te_codegen::DType;
use te_runtime::ops::cast_transpose::{dbias_workspace_len, DbiasOut};
use te_runtime::{Device, Result, Tensor};

/// The input of a GEMM layer's forward: high precision, or already FP8 (a fused producer, e.g.
/// the norm of `LayerNormLinear`, cast it with the layer's input quantizer; with its transpose
/// when backward will run).
#[derive(Debug)]
pub(crate) enum LinearInput {
    High(Tensor),
    Fp8(Float8Tensor),
    /// This rank's token shard (`High` or `Fp8`, the FP8 one without transpose) of an input the
    /// GEMM's hook gathers (column-parallel under sequence parallelism) overlapped with the GEMM
    /// ([`GemmParallel::overlaps_gather`]); `whole` is the gathered shape.
    Shard {
        input: Box<LinearInput>,
        whole: Vec<usize>,
    },
}

impl LinearInput {
    /// The GEMM input's shape (the gathered one for a shard).
    pub(crate) fn shape(&self) -> Vec<usize> {
        match self {
            LinearInput::High(t) => t.shape().to_vec(),
            LinearInput::Fp8(f) => f.shape().to_vec(),
            LinearInput::Shard { whole, .. } => whole.clone(),
        }
    }

    /// `input`, this rank's token shard, to be gathered by `comm` beside the GEMM (for a hook
    /// that [`GemmParallel::overlaps_gather`]; the core gathers it first where it cannot).
    pub(crate) fn shard(input: LinearInput, comm: &GemmParallel) -> LinearInput {
        let mut whole = input.shape();
        if let Some(d0) = whole.first_mut() {
            *d0 = comm.input_tokens(*d0);
        }
        LinearInput::Shard { input: Box::new(input), whole }
    }
}

/// How this rank's forward GEMM meets its collective ([`crate::parallel::overlap`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Overlap {
    /// One GEMM; the collectives (if any) before or after it.
    None,
    /// The input is a token shard, all-gathered shard by shard beside the GEMMs of the arrived
    /// shards.
    Gather,
    /// The output is reduce-scattered block by block beside the GEMMs of the next blocks.
    ReduceScatter,
}

/// The bias gradient a gradient cast computes on the way (TE `cast_transpose_dbias`): the
/// `[cols]` output and the kernel's f32 workspace.
#[derive(Debug)]
pub(crate) struct DbiasBuffers {
    dbias: Tensor,
    workspace: CudaSlice<f32>,
}

impl DbiasBuffers {
    /// Buffers for the column sums of a `[rows, cols]` gradient of `dtype`.
    pub(crate) fn new(dev: &Device, dtype: DType, rows: usize, cols: usize) -> Result<Self> {
        let dbias = Tensor::empty(dev, dtype, &[cols])?;
        // SAFETY: f32 has no invalid bit patterns; the workspace is scratch the kernel writes
        // before it reads it (`DbiasOut::workspace`).
        let workspace = unsafe { dev.stream().alloc::<f32>(dbias_workspace_len(rows, cols)) }?;
        Ok(Self { dbias, workspace })
    }

    /// The outputs for the cast.
    pub(crate) fn out(&mut self) -> DbiasOut<'_> {
        DbiasOut { dbias: &mut self.dbias, workspace: self.workspace.as_view_mut() }
    }

    /// The bias gradient `[cols]`.
    pub(crate) fn into_dbias(self) -> Tensor {
        self.dbias
    }
}
