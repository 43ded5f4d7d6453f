//! Family 20 launcher: the attention input of a generation or prefill step, fused
//! ([`te_codegen::spec::QkvRopeSpec`]). From the fused projection's `[tokens, (heads + 2 ·
//! groups) · d]` output: optional qk-norm per head (Qwen3's and Gemma 3's `q_norm` / `k_norm`),
//! RoPE at each token's own position (transformers' `apply_rotary_pos_emb` with `position_ids`),
//! the queries written dense `[tokens, heads, d]` and the keys and values appended to the KV
//! cache at each token's row (in the model's dtype, or E4M3 codes with per-tensor scales:
//! [`qkv_rope_fp8`]). Positions and cache rows are per token ([`TokenRows`]), so one
//! launch serves packed prompts of different lengths (the prefill) and the one-token steps of a
//! batch whose sequences sit at different positions (the decode).

use super::decode_attention::KvScales;
use super::launch::Launch;
use super::{check_dtype, check_shape, grid_stride_blocks, launch_1d};
use crate::graph::HostCopies;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::CudaSlice;
use te_codegen::spec::QkvRopeSpec;
use te_codegen::{DType, KernelSpec};

const OP: &str = "qkv_rope";

/// Where each token of a step sits: its position (the RoPE angle's) and its row of the KV cache
/// (`sequence · capacity + slot`), uploaded as two i32 `[tokens]` device arrays checked against
/// the cache's rows on the host.
#[derive(Debug)]
pub struct TokenRows {
    positions: CudaSlice<i32>,
    rows: CudaSlice<i32>,
    tokens: usize,
    cache_rows: usize,
}

impl TokenRows {
    /// Uploads `positions` and `rows` (one of each per token) for caches of `cache_rows` rows.
    ///
    /// # Errors
    /// [`Error::Shape`] for no tokens, lengths that differ, a negative position or a row
    /// outside `[0, cache_rows)`; allocation and copy failures.
    pub fn from_host(dev: &Device, positions: &[i32], rows: &[i32], cache_rows: usize) -> Result<Self> {
        Self::check(positions, rows, cache_rows)?;
        let stream = dev.stream();
        Ok(Self { positions: stream.htod(positions)?, rows: stream.htod(rows)?, tokens: positions.len(), cache_rows })
    }

    /// Refills the arrays in place (as many tokens as before): the addresses stay, so a CUDA
    /// graph that reads them replays with the new step. A host upload: not inside a capture.
    ///
    /// # Errors
    /// As [`TokenRows::from_host`], and [`Error::Shape`] for another token count;
    /// [`Error::Capture`] inside a capture.
    pub fn update(&mut self, dev: &Device, positions: &[i32], rows: &[i32]) -> Result<()> {
        if positions.len() != self.tokens {
            return Err(Error::Shape {
                op: OP,
                message: format!("{} positions for a table of {} tokens", positions.len(), self.tokens),
            });
        }
        Self::check(positions, rows, self.cache_rows)?;
        crate::graph::refuse_in_capture(dev.stream(), "TokenRows::update")?;
        dev.stream().memcpy_htod(positions, &mut self.positions)?;
        dev.stream().memcpy_htod(rows, &mut self.rows)?;
        Ok(())
    }

    /// Tokens of the step.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// The i32 `[tokens]` positions on the device.
    pub fn positions(&self) -> &CudaSlice<i32> {
        &self.positions
    }

    fn check(positions: &[i32], rows: &[i32], cache_rows: usize) -> Result<()> {
        let bad = |message: String| Err(Error::Shape { op: OP, message });
        if positions.is_empty() || positions.len() != rows.len() {
            return bad(format!(
                "positions ({}) and rows ({}) must be one per token, at least one",
                positions.len(),
                rows.len()
            ));
        }
        if let Some(t) = positions.iter().position(|&p| p < 0) {
            return bad(format!("token {t} has the negative position {}", positions[t]));
        }
        if let Some(t) = rows.iter().position(|&r| r < 0 || r as usize >= cache_rows) {
            return bad(format!("token {t}'s cache row {} is outside the cache's {cache_rows} rows", rows[t]));
        }
        Ok(())
    }
}

/// The per-head RMSNorm of q and k before RoPE (transformers' `q_norm` / `k_norm`).
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    /// `[head_dim]`, the dtype of `qkv`.
    pub q_gamma: &'a Tensor,
    /// `[head_dim]`, the dtype of `qkv`.
    pub k_gamma: &'a Tensor,
    /// Added to the mean square.
    pub eps: f32,
    /// Scale by `1 + γ` (Gemma's convention, TE's `zero_centered_gamma`).
    pub zero_centered_gamma: bool,
}

/// `q_out`, and the step's keys and values in `k_cache` and `v_cache`, from `qkv` (see
/// [`QkvRopeSpec`] for the arithmetic):
///
/// - `qkv`: `[tokens, (heads + 2 · groups) · d]` f32/bf16/f16 (all q heads, all k heads, all
///   v heads of a token), `tokens = rows.tokens()`;
/// - `inv_freq`: f32 `[d / 2]`, the RoPE inverse frequencies (`θ^(−2i/d)`, scaled as the
///   model's `rope_scaling` says);
/// - `q_out`: `[tokens, heads, d]` (or `[tokens, heads · d]`), qkv's dtype;
/// - `k_cache`, `v_cache`: `[.., groups, d]` of qkv's dtype whose leading dims hold the rows of
///   `rows` (`[batch, capacity, groups, d]` for [`super::decode_attention`]).
///
/// # Errors
/// [`Error::DType`] for FP8 or mismatched dtypes, an `inv_freq` that is not f32;
/// [`Error::Shape`] for a head dim the kernel does not take ([`QkvRopeSpec`]'s `validate`), `groups`
/// not dividing `heads`, tensors of other shapes, caches with fewer rows than `rows` was made
/// for; compile and launch failures.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope(
    dev: &Device,
    qkv: &Tensor,
    dims: (usize, usize, usize),
    norm: Option<QkNorm<'_>>,
    inv_freq: &Tensor,
    rows: &TokenRows,
    q_out: &mut Tensor,
    cache: [&mut Tensor; 2],
) -> Result<()> {
    launch(dev, qkv, dims, norm, inv_freq, rows, q_out, cache, None)
}

/// [`qkv_rope`] appending to an E4M3 cache: each key is stored as `E4M3(k · k_scale)` (`k` the
/// rotated key rounded to qkv's dtype), each value as `E4M3(v · v_scale)`, with the scales of
/// `ops::decode_attention` ([`KvScales`]; the decode kernels read the codes back with their
/// inverses). qkv bf16 or f16.
///
/// # Errors
/// As [`qkv_rope`], for E4M3 caches; [`Error::Shape`] for `scales` of fewer than 4 floats.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_fp8(
    dev: &Device,
    qkv: &Tensor,
    dims: (usize, usize, usize),
    norm: Option<QkNorm<'_>>,
    inv_freq: &Tensor,
    rows: &TokenRows,
    q_out: &mut Tensor,
    cache: [&mut Tensor; 2],
    scales: KvScales<'_>,
) -> Result<()> {
    launch(dev, qkv, dims, norm, inv_freq, rows, q_out, cache, Some(scales))
}

#[allow(clippy::too_many_arguments)] // qkv_rope's arguments and the optional scales
fn launch(
    dev: &Device,
    qkv: &Tensor,
    (heads, groups, d): (usize, usize, usize),
    norm: Option<QkNorm<'_>>,
    inv_freq: &Tensor,
    rows: &TokenRows,
    q_out: &mut Tensor,
    [k_cache, v_cache]: [&mut Tensor; 2],
    scales: Option<KvScales<'_>>,
) -> Result<()> {
    let dtype = qkv.dtype();
    check_dtype(OP, "qkv", qkv, DType::is_high_precision, "f32, bf16 or f16")?;
    let same = dtype.to_string();
    check_dtype(OP, "q_out", q_out, |t| t == dtype, &same)?;
    let cached = if scales.is_some() { DType::E4M3 } else { dtype };
    check_dtype(OP, "k_cache", k_cache, |t| t == cached, &cached.to_string())?;
    check_dtype(OP, "v_cache", v_cache, |t| t == cached, &cached.to_string())?;
    check_dtype(OP, "inv_freq", inv_freq, |t| t == DType::F32, "f32")?;
    let shape = |message: String| Err(Error::Shape { op: OP, message });
    if heads == 0 || groups == 0 || heads % groups != 0 {
        return shape(format!("groups = {groups} must divide heads = {heads}, both ≥ 1"));
    }
    if let Some(sc) = &scales {
        if sc.0.len() < 4 {
            return shape(format!(
                "kv_scales must hold 4 floats (k_scale, v_scale and their inverses), got {}",
                sc.0.len()
            ));
        }
    }
    let mut spec = QkvRopeSpec::new(dtype, d, norm.is_some(), norm.is_some_and(|n| n.zero_centered_gamma), dev.arch());
    if scales.is_some() {
        spec = spec.with_fp8_cache();
    }
    if let Err(reason) = KernelSpec::QkvRope(spec).validate() {
        return shape(reason.to_string());
    }
    let tokens = rows.tokens;
    check_shape(OP, "qkv", qkv, &[tokens, (heads + 2 * groups) * d])?;
    if q_out.numel() != tokens * heads * d || q_out.shape().first() != Some(&tokens) {
        return shape(format!("q_out must be [{tokens}, {heads}, {d}], got {:?}", q_out.shape()));
    }
    check_shape(OP, "inv_freq", inv_freq, &[d / 2])?;
    for (name, c) in [("k_cache", &*k_cache), ("v_cache", &*v_cache)] {
        let tail = &c.shape()[c.shape().len().saturating_sub(2)..];
        if c.shape().len() < 3 || tail != [groups, d] || c.numel() / (groups * d) < rows.cache_rows {
            return shape(format!(
                "{name} must be [.., {groups}, {d}] with at least {} rows, got {:?}",
                rows.cache_rows,
                c.shape()
            ));
        }
    }
    if let Some(n) = norm {
        for (name, g) in [("q_gamma", n.q_gamma), ("k_gamma", n.k_gamma)] {
            check_dtype(OP, name, g, |t| t == dtype, &same)?;
            check_shape(OP, name, g, &[d])?;
        }
        if !(n.eps.is_finite() && n.eps >= 0.0) {
            return Err(Error::Argument { op: OP, message: format!("eps = {} must be finite and ≥ 0", n.eps) });
        }
    }
    let f = dev.function(&KernelSpec::QkvRope(spec), 0)?;
    let threads = QkvRopeSpec::THREADS;
    let head_rows = tokens * (heads + 2 * groups);
    let cfg = launch_1d(grid_stride_blocks(dev, head_rows * 32, threads), threads, 0);
    let (tokens_arg, heads_arg, groups_arg) = (tokens as u64, heads as u32, groups as u32);
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 0);
    l.ptr("qkv", qkv.data());
    if let Some(n) = &norm {
        l.ptr("q_gamma", n.q_gamma.data()).ptr("k_gamma", n.k_gamma.data());
    }
    l.ptr("inv_freq", inv_freq.data()).ptr("positions", &rows.positions).ptr("rows", &rows.rows);
    l.ptr("q_out", q_out.data_mut()?).ptr("k_cache", k_cache.data_mut()?).ptr("v_cache", v_cache.data_mut()?);
    l.scalar("tokens", &tokens_arg).scalar("heads", &heads_arg).scalar("groups", &groups_arg);
    let eps = norm.map_or(0.0, |n| n.eps);
    if norm.is_some() {
        l.scalar("eps", &eps);
    }
    if let Some(sc) = &scales {
        l.ptr("kv_scales", sc.0);
    }
    // SAFETY: the arguments follow `QkvRopeSpec::ARGS` (the norm's only with qk_norm, the scales
    // only with an E4M3 cache, 4 floats, checked above): qkv holds
    // `tokens · (heads + 2·groups) · d` elements, q_out `tokens · heads · d`, the caches at least
    // `cache_rows · groups · d` of the spec's cache dtype, inv_freq `d / 2` f32, the gammas `d`
    // (checked above); positions and rows hold `tokens` i32 with every row inside the caches
    // (checked when uploaded); the outputs are distinct allocations (`&mut`).
    unsafe { l.launch(cfg) }
}
