//! Family 19's launchers: grouped GEMMs whose group sizes `m_splits` stay on the device (what
//! [`super::moe::routing_map`] writes), one launch for every group, no host synchronization:
//! the expert GEMMs of a `GroupedLinear` that a CUDA graph can capture and replay with other
//! routings (TE's `GroupedLinear` with device `m_splits`; PyTorch's `torch._grouped_mm(x, w,
//! offs)`). Hopper only (wgmma).
//!
//! - [`grouped_gemm_rows`]: `d[o_g + i] = alpha · a[o_g + i] · B_gᵀ` (forward: `B_g` the weight
//!   `[out, in]`; dgrad: `B_g` the weight read MN-major, or its transposed FP8 codes).
//! - [`grouped_gemm_reduction`]: `D_g (+)= alpha · Σ_{t ∈ group g} A[t]ᵀ B[t]` (wgrad: A = dy,
//!   B = x, MN-major in 16-bit; their transposed codes, K-major, in FP8).
//!
//! Sizes the kernel cannot take (negative, summing past the rows, or FP8 wgrad sizes that are
//! not multiples of 16) set the `status` flag ([`GroupedStatus`]) instead of touching memory
//! outside the tensors; [`GroupedStatus::check`] turns it into a typed error.

use super::check_dtype;
use super::launch::Launch;
use crate::graph::HostCopies;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig};
use te_codegen::spec::{GroupedGemmSpec, GroupedSplit};
use te_codegen::{Arch, DType, KernelSpec};

const OP: &str = "grouped_gemm";

/// A device table of one device address per group (the B operands or outputs, or FP8
/// `scale_inv`s), uploaded again only when an address changes: steady-state calls (and a CUDA
/// graph's capture) upload nothing.
#[derive(Debug)]
pub struct GroupedPtrs {
    host: Vec<u64>,
    table: CudaSlice<u64>,
}

impl GroupedPtrs {
    /// A table of `groups` entries (at least one).
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device, groups: usize) -> Result<Self> {
        Ok(Self { host: vec![0; groups.max(1)], table: dev.stream().alloc_zeros::<u64>(groups.max(1))? })
    }

    fn refresh(&mut self, dev: &Device, ptrs: &[u64]) -> Result<&CudaSlice<u64>> {
        if ptrs.len() > self.host.len() {
            self.host = vec![0; ptrs.len()];
            self.table = dev.stream().alloc_zeros::<u64>(ptrs.len())?;
        }
        if self.host[..ptrs.len()] != *ptrs {
            if dev.capturing() {
                return Err(Error::Shape {
                    op: OP,
                    message: "the grouped operands moved while a CUDA graph captures: run the call once before \
                              capturing, and keep its tensors alive and in place"
                        .into(),
                });
            }
            self.host[..ptrs.len()].copy_from_slice(ptrs);
            dev.stream().memcpy_htod(&self.host, &mut self.table)?;
        }
        Ok(&self.table)
    }
}

/// The address tables of one grouped GEMM call site: its operands' (B or D), their FP8
/// `scale_inv`s', and its biases' (forward) or bias gradients' (wgrad).
#[derive(Debug)]
pub struct GroupedTables {
    ptrs: GroupedPtrs,
    scales: GroupedPtrs,
    bias: GroupedPtrs,
}

impl GroupedTables {
    /// Tables of `groups` entries.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device, groups: usize) -> Result<Self> {
        Ok(Self {
            ptrs: GroupedPtrs::new(dev, groups)?,
            scales: GroupedPtrs::new(dev, groups)?,
            bias: GroupedPtrs::new(dev, groups)?,
        })
    }
}

/// The device flag the grouped kernels set on sizes they had to clamp (i32, 0 = fine).
#[derive(Debug)]
pub struct GroupedStatus(CudaSlice<i32>);

impl GroupedStatus {
    /// A cleared flag.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device) -> Result<Self> {
        Ok(Self(dev.stream().alloc_zeros::<i32>(1)?))
    }

    /// Reads the flag (a synchronization) and clears it.
    ///
    /// # Errors
    /// [`Error::Shape`] when a launch since the last check got sizes that were negative, summed
    /// past the rows of its tensors, or (FP8 wgrad) were not multiples of 16: its outputs are not
    /// the product of the sizes given. [`Error::Capture`] inside a CUDA graph capture (a read to
    /// the host cannot be recorded: check after the replay). Driver failures.
    pub fn check(&mut self, dev: &Device) -> Result<()> {
        let v = dev.stream().dtoh(&self.0)?;
        if v.first().copied().unwrap_or(0) != 0 {
            dev.stream().memset_zeros(&mut self.0)?;
            return Err(Error::Shape {
                op: OP,
                message: "device m_splits were negative, summed past the rows of the input, or (FP8 wgrad) were \
                          not multiples of 16: the grouped GEMM clamped them; pad each expert's rows (TE's \
                          Fp8Padding) and route at most the input's rows"
                    .into(),
            });
        }
        Ok(())
    }
}

/// An FP8 operand's `scale_inv` (f32 `[1]`).
pub type ScaleInv<'a> = CudaView<'a, f32>;

fn spec_of(
    dev: &Device,
    split: GroupedSplit,
    a: DType,
    b: DType,
    major: (bool, bool),
    out: DType,
) -> Result<GroupedGemmSpec> {
    if dev.arch() != Arch::Sm90a {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "the grouped GEMM with device m_splits runs on Hopper (sm_90a), not {}: pass m_splits on the host",
                dev.arch()
            ),
        });
    }
    let spec = GroupedGemmSpec::new(split, a, b, out, dev.arch()).with_major(major.0, major.1);
    KernelSpec::GroupedGemm(spec).validate()?;
    Ok(spec)
}

fn multiple_of_16(what: &str, v: usize) -> Result<()> {
    if v % 16 != 0 || v == 0 {
        return Err(Error::Shape {
            op: OP,
            message: format!("{what} = {v} must be a positive multiple of 16 (16-byte rows for the tensor-core loads)"),
        });
    }
    Ok(())
}

fn addr(dev: &Device, t: &Tensor) -> u64 {
    t.data().device_ptr(dev.stream()).0
}

fn grid(blocks: usize) -> Result<LaunchConfig> {
    let blocks = u32::try_from(blocks.max(1)).map_err(|_| Error::Shape {
        op: OP,
        message: format!("{blocks} tiles exceed one launch grid: split the batch"),
    })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (GroupedGemmSpec::THREADS as u32, 1, 1),
        shared_mem_bytes: GroupedGemmSpec::SHARED_BYTES as u32,
    })
}

fn function(dev: &Device, spec: GroupedGemmSpec) -> Result<cudarc::driver::CudaFunction> {
    let f = dev.function(&KernelSpec::GroupedGemm(spec), 0)?;
    f.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        GroupedGemmSpec::SHARED_BYTES as i32,
    )?;
    Ok(f)
}

fn check_splits(m_splits: &CudaSlice<i32>, groups: usize) -> Result<()> {
    if groups == 0 || m_splits.len() != groups {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "m_splits must be i32 [groups] with groups >= 1: {} values for {groups} groups",
                m_splits.len()
            ),
        });
    }
    Ok(())
}

fn check_fp8(a: DType, a_scale: &Option<ScaleInv<'_>>, b_scales: Option<usize>, groups: usize) -> Result<()> {
    if a.is_fp8() != a_scale.is_some() || a.is_fp8() != b_scales.is_some() {
        return Err(Error::Shape {
            op: OP,
            message: "FP8 operands take their scale_inv (A one value, B one per group), 16-bit ones none".into(),
        });
    }
    if let Some(n) = b_scales {
        if n != groups {
            return Err(Error::Shape { op: OP, message: format!("{n} B scale_inv for {groups} groups") });
        }
    }
    Ok(())
}

/// The B operands of a rows-split grouped GEMM: one tensor per group, all of one dtype and
/// shape, `[n, k]` K-major or `[k, n]` MN-major (16-bit only), with their FP8 `scale_inv`.
#[derive(Debug)]
pub struct GroupedWeights<'a> {
    /// One tensor per group.
    pub tensors: &'a [&'a Tensor],
    /// Stored `[n, k]` (true) or `[k, n]`.
    pub k_major: bool,
    /// FP8: each group's `scale_inv` (f32 `[1]`).
    pub scale_inv: Option<&'a [ScaleInv<'a>]>,
    /// Each group's bias `[n]` in D's dtype, added to its rows.
    pub bias: Option<&'a [&'a Tensor]>,
}

/// `d[o_g + i, :] = alpha · a[o_g + i, :] · B_gᵀ` for the `m_splits[g]` rows of every group `g`
/// (`o_g` the rows before it), and zeros in `d`'s rows past `Σ m_splits`. `a [rows, k]` (bf16,
/// f16, or FP8 codes with `a_scale_inv`), `d [rows, n]` (bf16, f16 or f32), `B_g` per
/// [`GroupedWeights`]. `tables` (two entries per group, [`GroupedPtrs`]) keeps the device
/// address tables between calls.
///
/// # Errors
/// [`Error::Shape`] on a device that is not Hopper, `k` or `n` not positive multiples of 16,
/// mismatched shapes, counts or scales; [`Error::DType`] for unsupported element types; compile
/// and launch failures. Bad device sizes show in `status` ([`GroupedStatus::check`]).
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_rows(
    dev: &Device,
    a: &Tensor,
    a_scale_inv: Option<ScaleInv<'_>>,
    b: &GroupedWeights<'_>,
    m_splits: &CudaSlice<i32>,
    d: &mut Tensor,
    alpha: f32,
    (tables, status): (&mut GroupedTables, &mut GroupedStatus),
) -> Result<()> {
    let groups = b.tensors.len();
    check_splits(m_splits, groups)?;
    let (rows, k) = a.as_2d(OP)?;
    check_dtype(OP, "d", d, |t| matches!(t, DType::BF16 | DType::F16 | DType::F32), "bf16, f16 or f32")?;
    let (d_rows, n) = d.as_2d(OP)?;
    let b_dtype = b.tensors[0].dtype();
    let want = if b.k_major { [n, k] } else { [k, n] };
    for (g, t) in b.tensors.iter().enumerate() {
        if t.dtype() != b_dtype || t.shape() != want {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "B of group {g} is {} {:?}; every group's must be {b_dtype} {want:?} for a [{rows}, {k}] input and a \
                     [{d_rows}, {n}] output",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    if d_rows != rows {
        return Err(Error::Shape { op: OP, message: format!("d has {d_rows} rows, a {rows}") });
    }
    multiple_of_16("k (input features)", k)?;
    multiple_of_16("n (output features)", n)?;
    check_fp8(a.dtype(), &a_scale_inv, b.scale_inv.map(<[_]>::len), groups)?;
    if let Some(bias) = b.bias {
        if bias.len() != groups || bias.iter().any(|t| t.dtype() != d.dtype() || t.shape() != [n]) {
            return Err(Error::Shape {
                op: OP,
                message: format!("the biases must be one {} [{n}] per group ({groups})", d.dtype()),
            });
        }
    }
    let spec = spec_of(dev, GroupedSplit::Rows, a.dtype(), b_dtype, (true, b.k_major), d.dtype())?;
    let f = function(dev, spec)?;
    let s = dev.stream();
    let b_addrs: Vec<u64> = b.tensors.iter().map(|t| addr(dev, t)).collect();
    let scale_addrs: Vec<u64> = b.scale_inv.unwrap_or(&[]).iter().map(|v| v.device_ptr(s).0).collect();
    let bias_addrs: Vec<u64> = b.bias.unwrap_or(&[]).iter().map(|t| addr(dev, t)).collect();
    let b_table = tables.ptrs.refresh(dev, &b_addrs)?;
    let s_table = if scale_addrs.is_empty() { None } else { Some(tables.scales.refresh(dev, &scale_addrs)?) };
    let bias_table = if bias_addrs.is_empty() { None } else { Some(tables.bias.refresh(dev, &bias_addrs)?) };
    let (null, sizes) = (0u64, [rows as u64, 0u64, n as u64, k as u64, groups as u64]);
    let cfg = grid(spec.blocks(rows, 0, n, groups))?;
    let mut l = Launch::new(OP, s, &f, &spec, 0);
    l.ptr("a", a.data()).ptr("b", &null).ptr("b_ptrs", b_table).ptr("d", d.data_mut()?);
    l.ptr("d_ptrs", &null).ptr("m_splits", m_splits);
    match (&a_scale_inv, s_table) {
        (Some(av), Some(tb)) => l.ptr("a_scale_inv", av).ptr("b_scale_inv", tb),
        _ => l.ptr("a_scale_inv", &null).ptr("b_scale_inv", &null),
    };
    match bias_table {
        Some(t) => l.ptr("bias_ptrs", t),
        None => l.ptr("bias_ptrs", &null),
    };
    l.ptr("status", &mut status.0);
    l.scalar("total", &sizes[0]).scalar("m", &sizes[1]).scalar("n", &sizes[2]).scalar("k", &sizes[3]);
    l.scalar("groups", &sizes[4]).scalar("alpha", &alpha);
    // SAFETY: a is [rows, k], d [rows, n], every B_g [n, k] or [k, n] and every bias [n] of the
    // spec's dtypes (checked); the tables hold those tensors' addresses and scale_invs (refreshed
    // above); the kernel clamps the device sizes to the rows, so it stays inside the tensors.
    unsafe { l.launch(cfg) }
}

/// `D_g (+)= alpha · Σ_{t ∈ group g} A_t ⊗ B_t`, i.e. `D_g = alpha · A_gᵀ · B_g` over the
/// `m_splits[g]` reduction rows of every group (wgrad: `D_g [m, n]` from `dy [total, m]` and `x
/// [total, n]`): `a` is `[total, m]` (MN-major, 16-bit) or `[m, total]` (K-major: transposed
/// codes), `b` `[total, n]` or `[n, total]`; each `d[g]` `[m, n]` (bf16, f16, or f32 with
/// `accumulate`). A group with no rows writes zeros (or leaves an accumulated `D_g`).
///
/// # Errors
/// As [`grouped_gemm_rows`] (`m` and `n` positive multiples of 16); an FP8 operand that is not
/// K-major. Device sizes that are not multiples of 16 with a K-major operand show in `status`.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm_reduction(
    dev: &Device,
    (a, a_k_major, a_scale_inv): (&Tensor, bool, Option<ScaleInv<'_>>),
    (b, b_k_major, b_scale_inv): (&Tensor, bool, Option<ScaleInv<'_>>),
    m_splits: &CudaSlice<i32>,
    d: &mut [&mut Tensor],
    (alpha, accumulate): (f32, bool),
    (tables, status): (&mut GroupedTables, &mut GroupedStatus),
) -> Result<()> {
    let groups = d.len();
    check_splits(m_splits, groups)?;
    let (ar, ac) = a.as_2d(OP)?;
    let (br, bc) = b.as_2d(OP)?;
    let (total, m) = if a_k_major { (ac, ar) } else { (ar, ac) };
    let (b_total, n) = if b_k_major { (bc, br) } else { (br, bc) };
    if b_total != total || a.dtype().is_fp8() != b.dtype().is_fp8() {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "a {} {:?} and b {} {:?} must share the reduction rows (got {total} and {b_total})",
                a.dtype(),
                a.shape(),
                b.dtype(),
                b.shape()
            ),
        });
    }
    let out = d[0].dtype();
    for (g, t) in d.iter().enumerate() {
        if t.dtype() != out || t.shape() != [m, n] {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "D of group {g} is {} {:?}; every group's must be {out} [{m}, {n}]",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    multiple_of_16("m (output rows)", m)?;
    multiple_of_16("n (output columns)", n)?;
    check_fp8(a.dtype(), &a_scale_inv, b_scale_inv.as_ref().map(|_| groups), groups)?;
    let spec = spec_of(dev, GroupedSplit::Reduction, a.dtype(), b.dtype(), (a_k_major, b_k_major), out)?
        .accumulating(accumulate);
    let f = function(dev, spec)?;
    let s = dev.stream();
    let mut d_addrs = Vec::with_capacity(groups);
    for t in d.iter_mut() {
        d_addrs.push(t.data_mut()?.device_ptr_mut(s).0);
    }
    let d_table = tables.ptrs.refresh(dev, &d_addrs)?;
    // With the reduction split the kernel reads B's scale_inv through `b_scale_inv[0]`: a
    // one-entry table holding its address.
    let b_scale_cell = match &b_scale_inv {
        Some(v) => Some(tables.scales.refresh(dev, &[v.device_ptr(s).0])?),
        None => None,
    };
    let (null, sizes) = (0u64, [total as u64, m as u64, n as u64, 0u64, groups as u64]);
    let cfg = grid(spec.blocks(total, m, n, groups))?;
    let mut l = Launch::new(OP, s, &f, &spec, 0);
    l.ptr("a", a.data()).ptr("b", b.data()).ptr("b_ptrs", &null).ptr("d", &null).ptr("d_ptrs", d_table);
    l.ptr("m_splits", m_splits);
    match (&a_scale_inv, b_scale_cell) {
        (Some(av), Some(cell)) => l.ptr("a_scale_inv", av).ptr("b_scale_inv", cell),
        _ => l.ptr("a_scale_inv", &null).ptr("b_scale_inv", &null),
    };
    l.ptr("bias_ptrs", &null).ptr("status", &mut status.0);
    l.scalar("total", &sizes[0]).scalar("m", &sizes[1]).scalar("n", &sizes[2]).scalar("k", &sizes[3]);
    l.scalar("groups", &sizes[4]).scalar("alpha", &alpha);
    // SAFETY: a and b hold `total` reduction rows of m and n columns in the declared orders, and
    // every D_g is [m, n] of the output dtype (checked); the table holds the D_g addresses
    // (refreshed above) and the one-entry cell B's scale_inv address; the kernel clamps the
    // device sizes to `total`.
    unsafe { l.launch(cfg) }
}

/// The bias gradient of a rows-split forward: `dbias_g[c] (+)= Σ_{t ∈ group g} dy[t, c]` for
/// `dy [total, m]` (bf16/f16) and each `dbias[g]` `[m]` (bf16, f16 or f32), summed in f32 in a
/// fixed order (the same bits every run); a group of no rows writes zeros (or leaves an
/// accumulated gradient as it is). Uses `tables`' bias table.
///
/// # Errors
/// [`Error::Shape`] for a device that is not Hopper, `m` not a positive multiple of 16, or
/// gradients of another shape or dtypes; [`Error::DType`] for an FP8 `dy`; compile and launch
/// failures. Bad device sizes are clamped (the status flag of the GEMMs reports them).
pub fn grouped_dbias(
    dev: &Device,
    dy: &Tensor,
    m_splits: &CudaSlice<i32>,
    dbias: &mut [&mut Tensor],
    accumulate: bool,
    tables: &mut GroupedTables,
) -> Result<()> {
    let groups = dbias.len();
    check_splits(m_splits, groups)?;
    check_dtype(OP, "dy", dy, |t| matches!(t, DType::BF16 | DType::F16), "bf16 or f16")?;
    let (total, m) = dy.as_2d(OP)?;
    multiple_of_16("m (bias features)", m)?;
    let out = dbias[0].dtype();
    if dbias.iter().any(|t| t.dtype() != out || t.shape() != [m]) {
        return Err(Error::Shape { op: OP, message: format!("every group's dbias must be {out} [{m}]") });
    }
    let spec =
        spec_of(dev, GroupedSplit::Reduction, dy.dtype(), dy.dtype(), (false, false), out)?.accumulating(accumulate);
    let f = dev.function(&KernelSpec::GroupedGemm(spec), 1)?;
    let s = dev.stream();
    let mut addrs = Vec::with_capacity(groups);
    for t in dbias.iter_mut() {
        addrs.push(t.data_mut()?.device_ptr_mut(s).0);
    }
    let table = tables.bias.refresh(dev, &addrs)?;
    let sizes = [total as u64, m as u64, groups as u64];
    let blocks = u32::try_from(m.div_ceil(GroupedGemmSpec::DBIAS_COLS)).unwrap_or(u32::MAX);
    let cfg = LaunchConfig { grid_dim: (blocks, groups as u32, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    let mut l = Launch::new(OP, s, &f, &spec, 1);
    l.ptr("a", dy.data()).ptr("m_splits", m_splits).ptr("dbias_ptrs", table);
    l.scalar("total", &sizes[0]).scalar("m", &sizes[1]).scalar("groups", &sizes[2]);
    // SAFETY: dy is [total, m] 16-bit and every dbias [m] of the spec's output dtype (checked);
    // the table holds their addresses (refreshed above); the kernel clamps the sizes to `total`.
    unsafe { l.launch(cfg) }
}
