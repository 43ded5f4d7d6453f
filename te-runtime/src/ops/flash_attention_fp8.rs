//! Family 14's FP8 forward (TE's `fp8_dpa`, FlashAttention-3's FP8 path) on Hopper: q, k and v
//! quantized to E4M3 with per-tensor scales ([`quantize`], one cast per tensor with TE's
//! scale / amax / scale_inv contract), then `softmax(scale · Q · Kᵀ) · V` on
//! e4m3 `wgmma` with P quantized to E4M3 inside the kernel, the output in bf16/f16
//! ([`forward`]); and the FP8 backward (TE's default `NVTE_FP8_DPA_BWD=1`, [`backward`]): dO cast
//! to E5M2 (HYBRID) or E4M3 ([`quantize_grad`]), every product on 8-bit `wgmma`, dS quantized
//! with a delayed scale whose amax the kernel records (TE's dP quantizer), the gradients in
//! bf16/f16. A caller may instead run the 16-bit backward after the FP8 forward (TE's
//! `NVTE_FP8_DPA_BWD=0`): it recomputes P from the 16-bit q, k and the LSE this forward saves.

use super::attention_shape::{AttentionShape, QkvLayout};
use super::flash_attention::{
    addresses, addresses_mut, capacity, check_call, check_extent, check_grads, check_len, check_offset, check_params,
    dkdv_grid, dot_do_o, dq_grid, function, grid, push_cu, reach, CuSeqlens, FlashAttnParams, HeadStrides, Qkv,
    Scalars, TmaInput, TmaMaps, TmaV, NULL, OP,
};
use super::launch::Launch;
use super::Fp8Scaling;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::FlashAttnSpec;
use te_codegen::{Arch, DType};

/// Keys per Vᵀ row are padded to a multiple of this (the kernel's key tile).
const KEY_TILE: usize = FlashAttnSpec::FP8_KEY_TILE;

/// Which operand of an FP8 attention call [`quantize`] makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Operand {
    /// Queries: dense `[batch, sq, heads, head_dim]`.
    Q,
    /// Keys: dense `[batch, sk, groups, head_dim]`.
    K,
    /// Values, transposed: `[batch, groups, head_dim, vt_row]`.
    V,
}

/// The E4M3 operands of an FP8 attention forward, for `batch` sequences of `sq` queries and `sk`
/// keys, `heads` query and `groups` key/value heads of `head_dim`:
/// - `q`: `[batch, sq, heads, head_dim]`, dense (bshd);
/// - `k`: `[batch, sk, groups, head_dim]`, dense;
/// - `vt`: `[batch, groups, head_dim, vt_row]`: v transposed, `vt_row` = `sk` rounded up to a
///   multiple of 128, zero past `sk`, the keys of each chunk of 32 in the order the kernel's P
///   fragments carry them (so that no shuffle is needed; only [`quantize`] writes it);
/// - `backward`: what the FP8 [`backward`] reads besides, made in the same casts.
#[derive(Debug)]
pub struct Fp8Operands {
    /// E4M3 queries.
    pub q: Tensor,
    /// E4M3 keys.
    pub k: Tensor,
    /// E4M3 Vᵀ.
    pub vt: Tensor,
    /// The transposed and dense codes of the FP8 backward ([`Fp8Operands::with_backward`]).
    pub backward: Option<Fp8BackwardOperands>,
}

/// The E4M3 codes the FP8 [`backward`] needs besides the forward's (same scales): Qᵀ and Kᵀ
/// (transposed like Vᵀ: `[batch, heads | groups, head_dim, sq | sk rounded up to 128]`, the
/// positions of each chunk of 32 permuted) for the products whose k runs over positions, and v
/// dense `[batch, sk, groups, head_dim]`.
#[derive(Debug)]
pub struct Fp8BackwardOperands {
    /// E4M3 Qᵀ.
    pub qt: Tensor,
    /// E4M3 Kᵀ.
    pub kt: Tensor,
    /// E4M3 values, dense.
    pub v: Tensor,
}

impl Fp8Operands {
    /// Uninitialized operands of a forward for the sizes of `p` ([`quantize`] writes every byte).
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device, p: &FlashAttnParams) -> Result<Self> {
        let sh = &p.shape;
        Ok(Self {
            q: Tensor::empty(dev, DType::E4M3, &dense(sh, Side::Q))?,
            k: Tensor::empty(dev, DType::E4M3, &dense(sh, Side::Kv))?,
            vt: Tensor::empty(dev, DType::E4M3, &transposed(sh, Side::Kv))?,
            backward: None,
        })
    }

    /// Uninitialized operands of a forward and the FP8 [`backward`] after it.
    ///
    /// # Errors
    /// Allocation failures.
    pub fn with_backward(dev: &Device, p: &FlashAttnParams) -> Result<Self> {
        let sh = &p.shape;
        Ok(Self {
            backward: Some(Fp8BackwardOperands {
                qt: Tensor::empty(dev, DType::E4M3, &transposed(sh, Side::Q))?,
                kt: Tensor::empty(dev, DType::E4M3, &transposed(sh, Side::Kv))?,
                v: Tensor::empty(dev, DType::E4M3, &dense(sh, Side::Kv))?,
            }),
            ..Self::new(dev, p)?
        })
    }
}

/// The output gradient's FP8 codes for the FP8 [`backward`] ([`quantize_grad`]): `d_o` dense
/// `[batch, sq, heads, head_dim]` and `d_ot` transposed `[batch, heads, head_dim, sq rounded up to
/// 128]` (positions permuted as Qᵀ's), E5M2 or E4M3.
#[derive(Debug)]
pub struct Fp8Grad {
    /// dO, dense.
    pub d_o: Tensor,
    /// dOᵀ.
    pub d_ot: Tensor,
}

impl Fp8Grad {
    /// Uninitialized codes of `dtype` (E5M2 or E4M3) for the sizes of `p`.
    ///
    /// # Errors
    /// [`Error::DType`] for another dtype; allocation failures.
    pub fn new(dev: &Device, p: &FlashAttnParams, dtype: DType) -> Result<Self> {
        let sh = &p.shape;
        if !matches!(dtype, DType::E5M2 | DType::E4M3) {
            return Err(Error::DType {
                op: OP,
                arg: "d_o",
                got: dtype,
                expected: "e5m2 or e4m3 (the FP8 backward's gradient codes)".into(),
            });
        }
        Ok(Self {
            d_o: Tensor::empty(dev, dtype, &dense(sh, Side::Q))?,
            d_ot: Tensor::empty(dev, dtype, &transposed(sh, Side::Q))?,
        })
    }
}

/// Positions per transposed row: `seq` rounded up to the kernels' 128-position tile.
fn trow(seq: usize) -> usize {
    seq.div_ceil(KEY_TILE) * KEY_TILE
}

/// The query side (q, dO: `sq` positions of `heads` heads) or the key/value side (k, v: `sk` of
/// `groups`) of a call.
#[derive(Debug, Clone, Copy)]
enum Side {
    Q,
    Kv,
}

/// `(positions, heads)` of one side of `sh`.
fn side(sh: &AttentionShape, side: Side) -> (usize, usize) {
    match side {
        Side::Q => (sh.sq, sh.heads),
        Side::Kv => (sh.sk, sh.groups),
    }
}

/// The dense FP8 codes of one side: `[batch, seq, heads, head_dim]`.
fn dense(sh: &AttentionShape, which: Side) -> Vec<usize> {
    let (seq, heads) = side(sh, which);
    vec![sh.batch, seq, heads, sh.head_dim]
}

/// The transposed FP8 codes of one side: `[batch, heads, head_dim, seq rounded up to 128]`.
fn transposed(sh: &AttentionShape, which: Side) -> Vec<usize> {
    let (seq, heads) = side(sh, which);
    vec![sh.batch, heads, sh.head_dim, trow(seq)]
}

/// Why the FP8 forward cannot run this call on `arch`, or `None` when it can.
pub fn unsupported_reason(arch: Arch, dtype: DType, head_dim: usize, thd: bool) -> Option<String> {
    if arch != Arch::Sm90a {
        return Some(format!("FP8 attention runs on Hopper (sm_90a) wgmma, not {arch}"));
    }
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Some(format!("FP8 attention takes bf16 or f16 q, k, v and output, not {dtype}"));
    }
    if head_dim % 128 != 0 || head_dim > 256 {
        return Some(format!("FP8 attention takes head_dim 128 or 256, got {head_dim}"));
    }
    if thd {
        return Some("FP8 attention takes bshd or sbhd, not thd (packed sequences)".into());
    }
    None
}

/// Quantizes one of q, k, v (`x`: bf16/f16 from element `offset` at the strides of `p`, as
/// [`super::flash_attention::forward`] takes it, e.g. heads inside a fused QKV tensor) into its
/// E4M3 codes in `out` (and, for operands made [`Fp8Operands::with_backward`], the backward's
/// codes of it in the same pass), with `scaling` (TE's cast contract: `x · scale` rounded to
/// nearest and saturated, `amax` raised to max |x|, `scale_inv` written `1 / scale`; a
/// quantizer's `fused_cast` hands these views).
///
/// # Errors
/// [`Error::Shape`] when the FP8 kernels do not take the call ([`unsupported_reason`]), the
/// operands are not those of `p`, or `x` is smaller than its strides reach; the 16-bit
/// forward's checks of `p`; compile and launch failures.
pub fn quantize(
    dev: &Device,
    p: &FlashAttnParams,
    which: Fp8Operand,
    x: (&Tensor, usize),
    scaling: &mut Fp8Scaling<'_>,
    out: &mut Fp8Operands,
) -> Result<()> {
    let sh = &p.shape;
    check_operands(p, out)?;
    let bwd = out.backward.as_mut();
    let (strides, seq, heads, y, yt) = match which {
        Fp8Operand::Q => (p.q, sh.sq, sh.heads, Some(&mut out.q), bwd.map(|b| &mut b.qt)),
        Fp8Operand::K => (p.kv, sh.sk, sh.groups, Some(&mut out.k), bwd.map(|b| &mut b.kt)),
        Fp8Operand::V => (p.v, sh.sk, sh.groups, bwd.map(|b| &mut b.v), Some(&mut out.vt)),
    };
    launch_quantize(dev, p, x, (strides, seq, heads), (y, yt), scaling, 0)
}

/// Quantizes the output gradient `d_out` (bf16/f16 at `p.o` strides, as the 16-bit backward
/// takes it) into `out`'s dense and transposed codes (E5M2 or E4M3, `out`'s dtype) with
/// `scaling`, as [`quantize`] does.
///
/// # Errors
/// As [`quantize`]; [`Error::Shape`] when `out` is not [`Fp8Grad::new`]'s for `p`.
pub fn quantize_grad(
    dev: &Device,
    p: &FlashAttnParams,
    d_out: &Tensor,
    scaling: &mut Fp8Scaling<'_>,
    out: &mut Fp8Grad,
) -> Result<()> {
    let sh = &p.shape;
    check_grad(p, out)?;
    let e5m2 = i32::from(out.d_o.dtype() == DType::E5M2);
    let seq = (p.o, sh.sq, sh.heads);
    launch_quantize(dev, p, (d_out, 0), seq, (Some(&mut out.d_o), Some(&mut out.d_ot)), scaling, e5m2)
}

/// The `_quantize` launch: `x` (at `strides`, `seq` positions of `heads` heads) into the dense
/// codes `y` and the transposed `yt` (either may be absent; shapes checked by the caller).
fn launch_quantize(
    dev: &Device,
    p: &FlashAttnParams,
    (t, offset): (&Tensor, usize),
    (strides, seq, heads): (HeadStrides, usize, usize),
    (y, yt): (Option<&mut Tensor>, Option<&mut Tensor>),
    scaling: &mut Fp8Scaling<'_>,
    e5m2: i32,
) -> Result<()> {
    let sh = &p.shape;
    let dtype = t.dtype();
    if let Some(why) = unsupported_reason(dev.arch(), dtype, sh.head_dim, false) {
        return Err(Error::Shape { op: OP, message: why });
    }
    check_params(p)?;
    check_offset("x", offset)?;
    check_extent("x", t, offset, strides, sh.batch, seq, heads, sh.head_dim)?;
    let spec = sh.flash_fp8_quantize_spec(dtype, dev.arch());
    let f = function(dev, &spec, 1)?;
    let stream = dev.stream();
    let ([src, _, _], _guards) = addresses(stream, [(t, offset); 3]);
    let s = [strides.batch as u64, strides.row as u64, strides.head as u64];
    let sizes = [seq as u64, heads as u64, trow(seq) as u64];
    let mut l = Launch::new(OP, stream, &f, &spec, 1);
    l.ptr("x", &src);
    match y {
        Some(y) => l.ptr("y", y.data_mut()?),
        None => l.ptr("y", &NULL),
    };
    match yt {
        Some(yt) => l.ptr("yt", yt.data_mut()?),
        None => l.ptr("yt", &NULL),
    };
    l.ptr("scale_ptr", &scaling.scale).ptr("amax_ptr", &mut scaling.amax).ptr("scale_inv_ptr", &mut scaling.scale_inv);
    l.scalar("x_batch", &s[0]).scalar("x_row", &s[1]).scalar("x_head", &s[2]);
    l.scalar("seq", &sizes[0]).scalar("heads", &sizes[1]).scalar("y_row", &sizes[2]);
    l.scalar("e5m2", &e5m2);
    let cfg = LaunchConfig {
        grid_dim: (seq.div_ceil(KEY_TILE) as u32, heads as u32, sh.batch as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: spec.shared_bytes(1) as u32,
    };
    // SAFETY: x reaches batch · seq rows of heads · head_dim at its strides from its offset
    // (checked); y is the dense and yt the transposed (trow(seq) positions per row) 8-bit tensor
    // of those sizes (checked by the callers), distinct allocations (`&mut`); the scaling views
    // are one f32 each.
    unsafe { l.launch(cfg) }
}

/// `out = softmax(scale · Q · Kᵀ, masked) · V` and `lse` from E4M3 operands: as the 16-bit
/// [`super::flash_attention::forward`] (masks, windows, GQA, `cu_seqlens`, dropout of `p`), with q,
/// k, v the [`Fp8Operands`] made by [`quantize`] and `scale_inv` their casts' `scale_inv` (q, k,
/// v; one f32 each, read on the device). `out` is bf16 or f16 at `p.o`
/// strides; `lse` f32 `[batch, heads, sq]` in true (descaled) units, so that the 16-bit backward
/// can recompute P from the 16-bit q and k.
///
/// # Errors
/// [`Error::Shape`] when the call is not one the FP8 kernels take ([`unsupported_reason`]), the
/// operands are not those of `p`, `out` or `lse` are too small or a `scale_inv` is empty; compile
/// and launch failures.
pub fn forward(
    dev: &Device,
    p: &FlashAttnParams,
    operands: &Fp8Operands,
    scale_inv: [&CudaSlice<f32>; 3],
    cu: Option<CuSeqlens<'_>>,
    out: &mut Tensor,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let dtype = out.dtype();
    launch_forward(dev, p, operands, scale_inv, cu, (out, dtype, None), lse)
}

/// [`forward`] with the output written as E4M3 codes for an FP8 consumer (TE's `fp8_mha`: the
/// output projection's GEMM reads them): `out` E4M3 at `p.o` strides, cast with `o_scaling`
/// (TE's contract: each element rounded to `dtype`, the 16-bit type of the call, then `o ·
/// scale` rounded to nearest and saturated; `amax` raised to max |o|; `scale_inv` written `1 /
/// scale`). The codes equal a cast of [`forward`]'s output bit for bit. The FP8 [`backward`]
/// takes them as its `out` (with [`Fp8BwdScaleInv::o`]).
///
/// # Errors
/// As [`forward`]; [`Error::DType`] when `out` is not E4M3.
#[allow(clippy::too_many_arguments)] // forward's arguments and the output's cast
pub fn forward_fp8_out(
    dev: &Device,
    p: &FlashAttnParams,
    operands: &Fp8Operands,
    scale_inv: [&CudaSlice<f32>; 3],
    cu: Option<CuSeqlens<'_>>,
    (out, dtype): (&mut Tensor, DType),
    o_scaling: &mut Fp8Scaling<'_>,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    if out.dtype() != DType::E4M3 {
        return Err(Error::DType {
            op: OP,
            arg: "out",
            got: out.dtype(),
            expected: "e4m3 (the FP8 output; use forward for a 16-bit one)".into(),
        });
    }
    launch_forward(dev, p, operands, scale_inv, cu, (out, dtype, Some(o_scaling)), lse)
}

/// The forward launch: `out` 16-bit (`o_scaling` `None`, `dtype` its dtype) or E4M3 cast with
/// `o_scaling` (`dtype` the call's 16-bit type).
fn launch_forward(
    dev: &Device,
    p: &FlashAttnParams,
    operands: &Fp8Operands,
    scale_inv: [&CudaSlice<f32>; 3],
    cu: Option<CuSeqlens<'_>>,
    (out, dtype, o_scaling): (&mut Tensor, DType, Option<&mut Fp8Scaling<'_>>),
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let sh = &p.shape;
    if let Some(why) = unsupported_reason(dev.arch(), dtype, sh.head_dim, sh.layout == QkvLayout::Thd) {
        return Err(Error::Shape { op: OP, message: why });
    }
    for (name, s) in ["q", "k", "v"].into_iter().zip(scale_inv) {
        check_len(name, s.len(), 1).map_err(|_| Error::Shape {
            op: OP,
            message: format!("the scale_inv of {name} is empty: pass the one its cast wrote ([1] f32)"),
        })?;
    }
    check_operands(p, operands)?;
    // The kernel reads q and k densely (checked as the operands' shapes).
    let bshd = FlashAttnParams::dense(AttentionShape { layout: QkvLayout::Bshd, ..*sh });
    let p8 = FlashAttnParams { q: bshd.q, kv: bshd.kv, v: bshd.v, ..*p };
    check_call(&p8, cu)?;
    let (batch, sq, _) = reach(p);
    check_extent("out", out, 0, p.o, batch, sq, sh.heads, sh.head_dim)?;
    check_len("lse", lse.len(), sh.lse_len())?;
    let spec = sh.flash_fp8_forward_spec(dtype, dev.arch());
    let f = function(dev, &spec, 0)?;
    let cfg = grid(sh.sq.div_ceil(spec.block_m), p, spec.threads_m(), spec.shared_bytes(0));
    let totals = [(sh.batch * sh.sq) as u64, (sh.batch * sh.sk) as u64];
    let total_o = capacity(out, 0, p.o, sh.heads, sh.head_dim);
    let s = Scalars::new(&p8, [totals[0].min(total_o), totals[1]]);
    let vt_row = trow(sh.sk) as u64;
    let stream = dev.stream();
    let ([q, k, vt], _guards) = addresses(stream, [(&operands.q, 0), (&operands.k, 0), (&operands.vt, 0)]);
    let input = |base, strides, seq, heads| TmaInput { base, strides, seq, heads, width: sh.head_dim };
    let qk = [input(q, p8.q, sh.sq, sh.heads), input(k, p8.kv, sh.sk, sh.groups)];
    let vt_map = TmaV::Transposed { base: vt, groups: sh.groups, vt_row: trow(sh.sk) };
    let maps = TmaMaps::new(&spec, cu, sh.batch, DType::E4M3, qk, vt_map);
    let mut l = Launch::new(OP, stream, &f, &spec, 0);
    l.ptr("q", &q).ptr("k", &k).ptr("v", &vt);
    l.ptr("o", out.data_mut()?).ptr("lse", &*lse);
    l.ptr("scale_inv_q", scale_inv[0]).ptr("scale_inv_k", scale_inv[1]).ptr("scale_inv_v", scale_inv[2]);
    match o_scaling {
        Some(o) => l.ptr("o_scale", &o.scale).ptr("o_amax", &mut o.amax).ptr("o_scale_inv", &mut o.scale_inv),
        None => l.ptr("o_scale", &NULL).ptr("o_amax", &NULL).ptr("o_scale_inv", &NULL),
    };
    l.scalar("vt_row", &vt_row);
    maps.push(&mut l);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: the operands are the dense E4M3 q, k and the Vᵀ of `p`'s sizes (checked; the tensor
    // maps cover them and nothing else), the guards keep them in use until the launch; out
    // reaches every row its strides address for the sizes (checked), lse holds batch · heads ·
    // sq f32 and the cu_seqlens batch + 1 i32; out and lse are distinct allocations (`&mut`); the
    // output scaling's views (when given) are one f32 each, null pointers otherwise.
    unsafe { l.launch(cfg) }
}

/// Why the FP8 [`backward`] cannot run this call on `arch`, or `None` when it can: the
/// forward's conditions ([`unsupported_reason`]: head_dim 128 or 256), no attention dropout.
pub fn backward_unsupported_reason(
    arch: Arch,
    dtype: DType,
    head_dim: usize,
    thd: bool,
    dropout: bool,
) -> Option<String> {
    if let Some(why) = unsupported_reason(arch, dtype, head_dim, thd) {
        return Some(why);
    }
    if dropout {
        return Some("the FP8 attention backward takes no attention dropout".into());
    }
    None
}

/// The `scale_inv` (one f32 each, on the device) of the codes an FP8 [`backward`] reads: q, k
/// and v (the forward's casts) and dO ([`quantize_grad`]'s).
#[derive(Debug, Clone, Copy)]
pub struct Fp8BwdScaleInv<'a> {
    /// q's, k's and v's.
    pub qkv: [&'a CudaSlice<f32>; 3],
    /// dO's.
    pub d_o: &'a CudaSlice<f32>,
    /// The output's, when the forward wrote it as E4M3 codes ([`forward_fp8_out`]); `None` for
    /// a 16-bit output.
    pub o: Option<&'a CudaSlice<f32>>,
}

/// The gradients of an FP8 [`forward`]: `(dq, dk, dv)` written in the layout `grads` gives (`dq`
/// at `p.q` strides, `dk`, `dv` at `p.kv` strides, three tensors or one fused; bf16/f16 as `out`;
/// every element the strides reach is written, padded positions with zeros).
///
/// - `operands`: the forward's codes, made [`Fp8Operands::with_backward`] and cast by
///   [`quantize`]; `grad`: dO's codes from [`quantize_grad`]; `scale_inv`: their scales.
/// - `ds`: dS's scaling (a delayed-scaling slot, TE's dP quantizer): dS is quantized to the
///   gradient codes' format as `dS · scale`, and `amax` is raised to max |dS| (true units);
///   `scale_inv` is not written.
/// - `out`, `d_out`: the forward's output (16-bit, or its E4M3 codes with
///   [`Fp8BwdScaleInv::o`]) and its 16-bit gradient at `p.o` strides (for `delta = rowsum(dO ⊙
///   O)`); `lse`: the forward's.
///
/// P is quantized as `P · 256` to E4M3, as in the forward. No atomics but the amax: the same
/// inputs give the same gradient bits.
///
/// # Errors
/// [`Error::Shape`] when the call is not one the FP8 backward takes
/// ([`backward_unsupported_reason`]), the operands lack the backward's codes or are not those of
/// `p`, a tensor or `lse` is too small, a `scale_inv` is empty; the 16-bit backward's checks of
/// `p`, `out`, `d_out` and the gradients; compile and launch failures.
#[allow(clippy::too_many_arguments)] // the backward's tensors, each named as in TE
pub fn backward(
    dev: &Device,
    p: &FlashAttnParams,
    (operands, grad): (&Fp8Operands, &Fp8Grad),
    scale_inv: Fp8BwdScaleInv<'_>,
    ds: &mut Fp8Scaling<'_>,
    (out, d_out): (&Tensor, &Tensor),
    lse: &CudaSlice<f32>,
    cu: Option<CuSeqlens<'_>>,
    mut grads: Qkv<&mut Tensor>,
) -> Result<()> {
    let sh = &p.shape;
    let dtype = d_out.dtype();
    let why =
        backward_unsupported_reason(dev.arch(), dtype, sh.head_dim, sh.layout == QkvLayout::Thd, sh.dropout.is_some());
    if let Some(why) = why {
        return Err(Error::Shape { op: OP, message: why });
    }
    check_operands(p, operands)?;
    let Some(codes) = &operands.backward else {
        return Err(Error::Shape {
            op: OP,
            message: "the FP8 operands hold no backward codes: make them with Fp8Operands::with_backward".into(),
        });
    };
    check_grad(p, grad)?;
    let scales = scale_inv.qkv.into_iter().chain([scale_inv.d_o]).chain(scale_inv.o);
    for (name, s) in ["q", "k", "v", "d_o", "out"].into_iter().zip(scales) {
        check_len(name, s.len(), 1).map_err(|_| Error::Shape {
            op: OP,
            message: format!("the scale_inv of {name} is empty: pass the one its cast wrote ([1] f32)"),
        })?;
    }
    check_call(p, cu)?;
    let totals = match scale_inv.o {
        None => check_grads(p, (out, d_out), &grads, [None; 3])?,
        Some(_) => {
            // E4M3 output codes: d_out carries the 16-bit checks, out its own extent.
            if out.dtype() != DType::E4M3 {
                return Err(Error::DType {
                    op: OP,
                    arg: "out",
                    got: out.dtype(),
                    expected: "e4m3 codes with an output scale_inv (or no scale_inv for a 16-bit output)".into(),
                });
            }
            let (batch, sq, _) = reach(p);
            check_extent("out", out, 0, p.o, batch, sq, sh.heads, sh.head_dim)?;
            let [total_q, total_kv] = check_grads(p, (d_out, d_out), &grads, [None; 3])?;
            [total_q.min(capacity(out, 0, p.o, sh.heads, sh.head_dim)), total_kv]
        }
    };
    check_len("lse", lse.len(), sh.lse_len())?;
    let spec = sh.flash_fp8_backward_spec(dtype, dev.arch(), grad.d_o.dtype() == DType::E5M2);
    let s = Scalars::new(p, totals);
    let trows = [trow(sh.sq) as u64, trow(sh.sk) as u64];
    let stream = dev.stream();
    let ([dq, dk, dv], _out_guards) = addresses_mut(stream, &mut grads)?;
    let delta = dot_do_o(dev, &spec, p, cu, (out, d_out), scale_inv.o, &s)?;
    let [sq_, sk_, sv_] = scale_inv.qkv;

    let f = function(dev, &spec, 1)?;
    let mut l = Launch::new(OP, stream, &f, &spec, 1);
    l.ptr("q", operands.q.data()).ptr("k", operands.k.data()).ptr("v", codes.v.data());
    l.ptr("d_o", grad.d_o.data()).ptr("qt", codes.qt.data()).ptr("d_ot", grad.d_ot.data());
    l.ptr("lse", lse).ptr("delta", &delta).ptr("dk", &dk).ptr("dv", &dv);
    l.ptr("scale_inv_q", sq_).ptr("scale_inv_k", sk_).ptr("scale_inv_v", sv_).ptr("scale_inv_do", scale_inv.d_o);
    l.ptr("ds_scale", &ds.scale).ptr("ds_amax", &mut ds.amax).scalar("q_trow", &trows[0]);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: the codes are the dense and transposed 8-bit tensors of `p`'s sizes (checked), dk
    // and dv reach every row their kv strides address (checked), held `&mut` and disjoint; lse
    // and delta hold batch · heads · sq f32, the cu_seqlens batch + 1 i32, the scales one f32.
    // Above head dim 128 a block per 128-channel slab of dK and dV (`fp8_dkdv_channels`).
    let slabs = spec.head_dim / spec.fp8_dkdv_channels();
    unsafe { l.launch(dkdv_grid(p, &spec, slabs)) }?;

    let f = function(dev, &spec, 2)?;
    let mut l = Launch::new(OP, stream, &f, &spec, 2);
    l.ptr("q", operands.q.data()).ptr("k", operands.k.data()).ptr("v", codes.v.data());
    l.ptr("d_o", grad.d_o.data()).ptr("kt", codes.kt.data());
    l.ptr("lse", lse).ptr("delta", &delta).ptr("dq", &dq);
    l.ptr("scale_inv_q", sq_).ptr("scale_inv_k", sk_).ptr("scale_inv_v", sv_).ptr("scale_inv_do", scale_inv.d_o);
    l.ptr("ds_scale", &ds.scale).scalar("k_trow", &trows[1]);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: as `_dkdv`'s, for dq at the q strides (disjoint from dk and dv, written before on
    // the same stream).
    unsafe { l.launch(dq_grid(p, &spec)) }
}

/// The operands' dtypes and shapes are those of `p`.
/// The FP8 kernels take one head dim for q, k and v.
fn check_one_head_dim(p: &FlashAttnParams) -> Result<()> {
    let sh = &p.shape;
    if sh.head_dim_v != sh.head_dim {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "FP8 attention takes one head dim for q, k and v, got {} and head_dim_v {} (run the call in bf16/f16)",
                sh.head_dim, sh.head_dim_v
            ),
        });
    }
    Ok(())
}

fn check_operands(p: &FlashAttnParams, o: &Fp8Operands) -> Result<()> {
    let sh = &p.shape;
    check_one_head_dim(p)?;
    let mut want = vec![
        ("q", &o.q, dense(sh, Side::Q)),
        ("k", &o.k, dense(sh, Side::Kv)),
        ("vt", &o.vt, transposed(sh, Side::Kv)),
    ];
    if let Some(b) = &o.backward {
        want.push(("qt", &b.qt, transposed(sh, Side::Q)));
        want.push(("kt", &b.kt, transposed(sh, Side::Kv)));
        want.push(("v", &b.v, dense(sh, Side::Kv)));
    }
    for (name, t, shape) in want {
        if t.dtype() != DType::E4M3 || t.shape() != shape.as_slice() {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "FP8 operand `{name}` is {} {:?}, the call needs e4m3 {shape:?} (make it with Fp8Operands::new, or \
                     with_backward for the FP8 backward)",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    Ok(())
}

/// The gradient codes' dtypes and shapes are those of `p`.
fn check_grad(p: &FlashAttnParams, g: &Fp8Grad) -> Result<()> {
    let sh = &p.shape;
    check_one_head_dim(p)?;
    let dtype = g.d_o.dtype();
    let want = [("d_o", &g.d_o, dense(sh, Side::Q)), ("d_ot", &g.d_ot, transposed(sh, Side::Q))];
    for (name, t, shape) in want {
        if !matches!(dtype, DType::E5M2 | DType::E4M3) || t.dtype() != dtype || t.shape() != shape.as_slice() {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "FP8 gradient `{name}` is {} {:?}, the call needs e5m2 or e4m3 (both alike) {shape:?} (make it \
                     with Fp8Grad::new)",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    Ok(())
}
