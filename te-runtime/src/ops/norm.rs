//! Family 5 launchers: LayerNorm / RMSNorm forward (optionally FP8 output with amax and
//! scale_inv) and backward (dx, and dgamma/dbeta through a deterministic two-kernel reduction).
//! Semantics follow TE's `nvte_layernorm_fwd/bwd` and `nvte_rmsnorm_fwd/bwd`
//! (`common/normalization/`); the math is documented on [`NormSpec`].

use super::launch::Launch;
use super::{check_dtype, check_fp8_cols, check_nonempty, check_shape, launch_1d, Fp8Scaling};
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::{Direction, NormKind, NormSpec};
use te_codegen::{DType, KernelSpec};

const HP: &str = "f32, bf16 or f16";

/// Inputs of a forward normalization.
#[derive(Debug, Clone, Copy)]
pub struct NormFwdArgs<'a> {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// `[.., hidden]`, f32/bf16/f16; leading dims fold into `rows`.
    pub x: &'a Tensor,
    /// `[hidden]`, f32/bf16/f16 (stored as `gamma - 1` when `zero_centered_gamma`).
    pub gamma: &'a Tensor,
    /// `[hidden]`, gamma's dtype: required for LayerNorm, `None` for RMSNorm.
    pub beta: Option<&'a Tensor>,
    /// Added to the variance (LayerNorm) or mean square (RMSNorm).
    pub eps: f32,
    /// TE's `zero_centered_gamma`: the kernel scales by `1 + gamma`.
    pub zero_centered_gamma: bool,
}

/// Outputs of a forward normalization (caller-allocated, as in TE).
#[derive(Debug)]
pub struct NormFwdOut<'a, 's> {
    /// Same shape as `x`: f32/bf16/f16, or E4M3/E5M2 (then `fp8` is required and
    /// `hidden % 16 == 0`).
    pub y: &'a mut Tensor,
    /// `[rows]` f32 row means: required for LayerNorm, `None` for RMSNorm.
    pub mu: Option<&'a mut CudaSlice<f32>>,
    /// `[rows]` f32 `1 / sqrt(var + eps)` (RMSNorm: `1 / sqrt(mean(x²) + eps)`).
    pub rsigma: &'a mut CudaSlice<f32>,
    /// FP8 scaling of `y`: reads `scale`, maxes `|y|` (before scaling) into `amax`, writes
    /// `scale_inv`. Required exactly when `y` is FP8.
    pub fp8: Option<&'a mut Fp8Scaling<'s>>,
}

/// Inputs of a backward normalization.
#[derive(Debug, Clone, Copy)]
pub struct NormBwdArgs<'a> {
    /// LayerNorm or RMSNorm.
    pub kind: NormKind,
    /// Gradient of `y`: the shape and dtype of `x`.
    pub dy: &'a Tensor,
    /// The forward input `[.., hidden]`, f32/bf16/f16.
    pub x: &'a Tensor,
    /// `[rows]` saved by the forward: required for LayerNorm, `None` for RMSNorm.
    pub mu: Option<&'a CudaSlice<f32>>,
    /// `[rows]` saved by the forward.
    pub rsigma: &'a CudaSlice<f32>,
    /// `[hidden]`, f32/bf16/f16, as passed to the forward.
    pub gamma: &'a Tensor,
    /// As passed to the forward.
    pub zero_centered_gamma: bool,
}

/// Outputs of a backward normalization (caller-allocated).
#[derive(Debug)]
pub struct NormBwdOut<'a> {
    /// Shape of `x`, f32/bf16/f16.
    pub dx: &'a mut Tensor,
    /// `[hidden]` in gamma's dtype (the gradient of the stored gamma).
    pub dgamma: &'a mut Tensor,
    /// `[hidden]` in gamma's dtype: required for LayerNorm, `None` for RMSNorm.
    pub dbeta: Option<&'a mut Tensor>,
}

fn shape_err(op: &'static str, message: String) -> Error {
    Error::Shape { op, message }
}

/// `[rows]` statistics buffer check.
fn check_stat(op: &'static str, arg: &str, len: usize, rows: usize) -> Result<()> {
    if len == rows {
        Ok(())
    } else {
        Err(shape_err(op, format!("`{arg}` must hold {rows} f32 (one per row), got {len}")))
    }
}

/// `beta`/`mu`/`dbeta` must be given for LayerNorm and omitted for RMSNorm.
fn check_presence(op: &'static str, kind: NormKind, arg: &str, present: bool) -> Result<()> {
    match (kind, present) {
        (NormKind::LayerNorm, false) => Err(shape_err(op, format!("LayerNorm needs `{arg}`; pass Some(..)"))),
        (NormKind::RmsNorm, true) => Err(shape_err(op, format!("RMSNorm takes no `{arg}`; pass None"))),
        _ => Ok(()),
    }
}

/// Checks `x` and `gamma`; returns `(rows, hidden)`.
fn check_input(op: &'static str, x: &Tensor, gamma: &Tensor) -> Result<(usize, usize)> {
    check_dtype(op, "x", x, DType::is_high_precision, HP)?;
    check_dtype(op, "gamma", gamma, DType::is_high_precision, HP)?;
    check_nonempty(op, "x", x)?;
    let (rows, hidden) = x.as_2d(op)?;
    check_shape(op, "gamma", gamma, &[hidden])?;
    Ok((rows, hidden))
}

/// Normalizes each row of `x: [rows, hidden]`:
/// LayerNorm `y = (x - mu) * rsigma * g + beta`, RMSNorm `y = x * rsigma * g`, with
/// `g = zero_centered_gamma ? 1 + gamma : gamma`, saving `mu` (LayerNorm) and `rsigma`. With an
/// FP8 `y`, writes `fp8(y * scale)`, maxes `|y|` into `amax` and writes `scale_inv = 1 / scale`
/// (TE's fused LayerNorm + cast for LayerNormLinear).
///
/// # Errors
/// [`Error::DType`] for a non-f32/bf16/f16 `x`/`gamma`, `beta` not of gamma's dtype, or an FP8
/// `y` without `fp8` scaling (or scaling with a high-precision `y`); [`Error::Shape`] for an
/// empty `x`, `gamma`/`beta` not `[hidden]`, `y` not of `x`'s shape, an FP8 `y` with
/// `hidden % 16 != 0` (says what to pad to), `mu`/`rsigma` not `[rows]`, `beta`/`mu` missing
/// for LayerNorm or given for RMSNorm; compile and launch failures.
pub fn norm_fwd(dev: &Device, args: &NormFwdArgs<'_>, out: NormFwdOut<'_, '_>) -> Result<()> {
    const OP: &str = "norm_fwd";
    let NormFwdArgs { kind, x, gamma, beta, eps, zero_centered_gamma } = *args;
    let NormFwdOut { y, mu, rsigma, fp8 } = out;
    let (rows, hidden) = check_input(OP, x, gamma)?;
    check_presence(OP, kind, "beta", beta.is_some())?;
    check_presence(OP, kind, "mu", mu.is_some())?;
    if let Some(b) = beta {
        check_dtype(OP, "beta", b, |d| d == gamma.dtype(), &format!("{} (gamma's dtype)", gamma.dtype()))?;
        check_shape(OP, "beta", b, &[hidden])?;
    }
    check_shape(OP, "y", y, x.shape())?;
    match (y.dtype().is_fp8(), fp8.is_some()) {
        (true, false) => {
            check_dtype(OP, "y", y, DType::is_high_precision, &format!("{HP} when no FP8 scaling is passed"))?
        }
        (false, true) => check_dtype(OP, "y", y, DType::is_fp8, "e4m3 or e5m2 when FP8 scaling is passed")?,
        _ => {}
    }
    if y.dtype().is_fp8() {
        check_fp8_cols(OP, "hidden", hidden)?;
    }
    if let Some(m) = &mu {
        check_stat(OP, "mu", m.len(), rows)?;
    }
    check_stat(OP, "rsigma", rsigma.len(), rows)?;

    let spec = NormSpec::new(
        kind,
        Direction::Fwd,
        x.dtype(),
        y.dtype(),
        gamma.dtype(),
        hidden,
        zero_centered_gamma,
        dev.arch(),
    );
    let f = dev.function(&KernelSpec::Norm(spec), 0)?;
    // Persistent grid (as TE's tuned kernels): as many blocks as can be resident, each looping
    // over rows with gamma/beta kept in registers.
    let resident = f.occupancy_max_active_blocks_per_multiprocessor(spec.threads as u32, 0, None)?.max(1) as usize;
    let cfg = launch_1d(rows.min(dev.sm_count() * resident), spec.threads, 0);
    let rows_arg = rows as u64;
    let mut b = Launch::new(OP, dev.stream(), &f, &spec, 0);
    b.ptr("x", x.data()).ptr("gamma", gamma.data());
    if let Some(beta) = beta {
        b.ptr("beta", beta.data());
    }
    b.ptr("y", y.data_mut()?);
    if let Some(mu) = mu {
        b.ptr("mu_out", mu);
    }
    b.ptr("rsigma_out", rsigma);
    if let Some(s) = fp8 {
        b.ptr("scale_ptr", &s.scale).ptr("amax_ptr", &mut s.amax).ptr("scale_inv_ptr", &mut s.scale_inv);
    }
    b.scalar("eps", &eps).scalar("rows", &rows_arg);
    // SAFETY: arguments match the forward signature documented on `NormSpec` for this kind and
    // output (beta/mu only for LayerNorm, scaling only for FP8 `y`): `x`/`y` hold rows × hidden
    // elements of the spec's dtypes, `gamma`/`beta` hidden, `mu`/`rsigma` rows f32 (all checked).
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Gradients of [`norm_fwd`] (TE `ln_bwd_kernels.cuh` / `rmsnorm_bwd_kernels.cuh`): with
/// `xhat = (x - mu) * rsigma` (RMSNorm `x * rsigma`) and `dyg = dy * g`, LayerNorm
/// `dx = rsigma * (dyg - mean(dyg) - xhat * mean(dyg * xhat))`, RMSNorm
/// `dx = rsigma * (dyg - xhat * mean(dyg * xhat))`, `dgamma = Σ_rows dy * xhat`,
/// `dbeta = Σ_rows dy`. dgamma/dbeta are reduced through f32 partials `[parts, hidden]`
/// (`parts = ceil(rows / 32)`, a stream-ordered workspace this call allocates) summed in a fixed
/// order, so they are bitwise reproducible run to run.
///
/// # Errors
/// [`Error::DType`] for non-f32/bf16/f16 tensors, `dy` not of `x`'s dtype, or
/// `dgamma`/`dbeta` not of gamma's dtype; [`Error::Shape`] for an empty `x`, `dy`/`dx` not of
/// `x`'s shape, `gamma`/`dgamma`/`dbeta` not `[hidden]`, `mu`/`rsigma` not `[rows]`,
/// `mu`/`dbeta` missing for LayerNorm or given for RMSNorm; allocation, compile and launch
/// failures.
pub fn norm_bwd(dev: &Device, args: &NormBwdArgs<'_>, out: NormBwdOut<'_>) -> Result<()> {
    const OP: &str = "norm_bwd";
    let NormBwdArgs { kind, dy, x, mu, rsigma, gamma, zero_centered_gamma } = *args;
    let NormBwdOut { dx, dgamma, dbeta } = out;
    let (rows, hidden) = check_input(OP, x, gamma)?;
    check_presence(OP, kind, "mu", mu.is_some())?;
    check_presence(OP, kind, "dbeta", dbeta.is_some())?;
    check_dtype(OP, "dy", dy, |d| d == x.dtype(), &format!("{} (x's dtype)", x.dtype()))?;
    check_shape(OP, "dy", dy, x.shape())?;
    check_dtype(OP, "dx", dx, DType::is_high_precision, HP)?;
    check_shape(OP, "dx", dx, x.shape())?;
    let wt = format!("{} (gamma's dtype)", gamma.dtype());
    check_dtype(OP, "dgamma", dgamma, |d| d == gamma.dtype(), &wt)?;
    check_shape(OP, "dgamma", dgamma, &[hidden])?;
    if let Some(db) = &dbeta {
        check_dtype(OP, "dbeta", db, |d| d == gamma.dtype(), &wt)?;
        check_shape(OP, "dbeta", db, &[hidden])?;
    }
    if let Some(m) = mu {
        check_stat(OP, "mu", m.len(), rows)?;
    }
    check_stat(OP, "rsigma", rsigma.len(), rows)?;

    let spec = NormSpec::new(
        kind,
        Direction::Bwd,
        x.dtype(),
        dx.dtype(),
        gamma.dtype(),
        hidden,
        zero_centered_gamma,
        dev.arch(),
    );
    let ks = KernelSpec::Norm(spec);
    let (main, reduce) = (dev.function(&ks, 0)?, dev.function(&ks, 1)?);
    let parts = rows.div_ceil(spec.bwd_rows_per_block());
    let stream = dev.stream();
    // SAFETY: uninitialized f32 workspaces; the main kernel writes every element of
    // [parts, hidden] (each block writes its whole partial row) before `_reduce` reads them,
    // in stream order.
    let mut dg_part = unsafe { stream.alloc::<f32>(parts * hidden) }?;
    // SAFETY: as above (only LayerNorm's kernels touch it; one f32 for RMSNorm).
    let mut db_part = unsafe { stream.alloc::<f32>(if dbeta.is_some() { parts * hidden } else { 1 }) }?;
    let ln = dbeta.is_some();
    let (rows_arg, parts_arg) = (rows as u64, parts as u64);

    let mut b = Launch::new(OP, stream, &main, &spec, 0);
    b.ptr("dy", dy.data()).ptr("x", x.data());
    if let Some(mu) = mu {
        b.ptr("mu_in", mu);
    }
    b.ptr("rsigma_in", rsigma).ptr("gamma", gamma.data()).ptr("dx", dx.data_mut()?).ptr("dgamma_part", &mut dg_part);
    if ln {
        b.ptr("dbeta_part", &mut db_part);
    }
    b.scalar("rows", &rows_arg);
    // SAFETY: arguments match the backward signature documented on `NormSpec` (mu and
    // dbeta_partial only for LayerNorm); `dy`/`x`/`dx` hold rows × hidden elements, `gamma`
    // hidden, `mu`/`rsigma` rows f32, the partials parts × hidden f32 (all checked above).
    unsafe { b.launch(launch_1d(parts, spec.threads, 0)) }?;

    let mut b = Launch::new(OP, stream, &reduce, &spec, 1);
    b.ptr("dgamma_part", &dg_part);
    if ln {
        b.ptr("dbeta_part", &db_part);
    }
    b.ptr("dgamma", dgamma.data_mut()?);
    if let Some(db) = dbeta {
        b.ptr("dbeta", db.data_mut()?);
    }
    b.scalar("parts", &parts_arg);
    let cfg = launch_1d(hidden.div_ceil(NormSpec::REDUCE_COLS), NormSpec::REDUCE_THREADS, 0);
    // SAFETY: arguments match the `_reduce` signature documented on `NormSpec`: partials of
    // parts × hidden f32, `dgamma`/`dbeta` hidden elements of the weight dtype.
    unsafe { b.launch(cfg) }?;
    Ok(())
}
