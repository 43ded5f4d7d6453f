//! Family 14's FP8 forward (TE's `fp8_dpa`, FlashAttention-3's FP8 path) on Hopper: q, k and v
//! quantized to E4M3 with per-tensor scales ([`quantize`], one cast per tensor with TE's
//! scale / amax / scale_inv contract), then `softmax(scale · Q · Kᵀ) · V` on
//! e4m3 `wgmma` with P quantized to E4M3 inside the kernel, the output in bf16/f16
//! ([`forward`]). The backward stays 16-bit (TE's `NVTE_FP8_DPA_BWD=0` mode: FP8 forward, F16/BF16
//! backward): it recomputes P from the 16-bit q, k and the LSE this forward saves.

use super::flash_attention::{
    addresses, capacity, check_call, check_extent, check_len, check_offset, function, grid, push_cu, reach, CuSeqlens,
    FlashAttnParams, HeadStrides, Scalars, OP,
};
use super::launch::Launch;
use super::Fp8Scaling;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, LaunchConfig};
use te_codegen::spec::{FlashAttnSpec, QkvFormat};
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
///   fragments carry them (so that no shuffle is needed; only [`quantize`] writes it).
#[derive(Debug)]
pub struct Fp8Operands {
    /// E4M3 queries.
    pub q: Tensor,
    /// E4M3 keys.
    pub k: Tensor,
    /// E4M3 Vᵀ.
    pub vt: Tensor,
}

impl Fp8Operands {
    /// Uninitialized operands for the sizes of `p` ([`quantize`] writes every byte).
    ///
    /// # Errors
    /// Allocation failures.
    pub fn new(dev: &Device, p: &FlashAttnParams) -> Result<Self> {
        Ok(Self {
            q: Tensor::empty(dev, DType::E4M3, &[p.batch, p.sq, p.heads, p.head_dim])?,
            k: Tensor::empty(dev, DType::E4M3, &[p.batch, p.sk, p.groups, p.head_dim])?,
            vt: Tensor::empty(dev, DType::E4M3, &[p.batch, p.groups, p.head_dim, vt_row(p.sk)])?,
        })
    }
}

fn vt_row(sk: usize) -> usize {
    sk.div_ceil(KEY_TILE) * KEY_TILE
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
/// E4M3 operand of `out`, with `scaling` (TE's cast contract: `x · scale` rounded to nearest and
/// saturated, `amax` raised to max |x|, `scale_inv` written `1 / scale`; a quantizer's
/// `fused_cast` hands these views).
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
    let (t, offset) = x;
    let dtype = t.dtype();
    if let Some(why) = unsupported_reason(dev.arch(), dtype, p.head_dim, false) {
        return Err(Error::Shape { op: OP, message: why });
    }
    check_call(p, None)?;
    check_offset("x", offset)?;
    check_operands(p, out)?;
    let (strides, seq, heads, y, transpose) = match which {
        Fp8Operand::Q => (p.q, p.sq, p.heads, &mut out.q, 0i32),
        Fp8Operand::K => (p.kv, p.sk, p.groups, &mut out.k, 0),
        Fp8Operand::V => (p.kv, p.sk, p.groups, &mut out.vt, 1),
    };
    check_extent("x", t, offset, strides, p.batch, seq, heads, p.head_dim)?;
    let spec = FlashAttnSpec::fp8_forward(dtype, p.head_dim, dev.arch());
    let f = function(dev, &spec, 1)?;
    let stream = dev.stream();
    let ([src, _, _], _guards) = addresses(stream, [x, x, x]);
    let s = [strides.batch as u64, strides.row as u64, strides.head as u64];
    let sizes = [seq as u64, heads as u64, vt_row(p.sk) as u64];
    let mut l = Launch::new(OP, stream, &f, &spec, 1);
    l.ptr("x", &src).ptr("y", y.data_mut()?);
    l.ptr("scale_ptr", &scaling.scale).ptr("amax_ptr", &mut scaling.amax).ptr("scale_inv_ptr", &mut scaling.scale_inv);
    l.scalar("x_batch", &s[0]).scalar("x_row", &s[1]).scalar("x_head", &s[2]);
    l.scalar("seq", &sizes[0]).scalar("heads", &sizes[1]).scalar("y_row", &sizes[2]);
    l.scalar("transpose", &transpose);
    let cfg = LaunchConfig {
        grid_dim: (seq.div_ceil(KEY_TILE) as u32, heads as u32, p.batch as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: spec.shared_bytes(1) as u32,
    };
    // SAFETY: x reaches batch · seq rows of heads · head_dim at its strides from its offset
    // (checked); y is the dense (or Vᵀ, vt_row keys per row) E4M3 tensor of those sizes
    // (`check_operands`), a distinct allocation (`&mut`); the scaling views are one f32 each.
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
    if let Some(why) = unsupported_reason(dev.arch(), out.dtype(), p.head_dim, CuSeqlens::thd(cu)) {
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
    let p8 = FlashAttnParams {
        q: HeadStrides::dense(QkvFormat::Bshd, p.batch, p.sq, p.heads, p.head_dim),
        kv: HeadStrides::dense(QkvFormat::Bshd, p.batch, p.sk, p.groups, p.head_dim),
        ..*p
    };
    check_call(&p8, cu)?;
    let (batch, sq, _) = reach(p, cu);
    check_extent("out", out, 0, p.o, batch, sq, p.heads, p.head_dim)?;
    check_len("lse", lse.len(), p.batch * p.heads * p.sq)?;
    let spec = FlashAttnSpec::fp8_forward(out.dtype(), p.head_dim, dev.arch()).with_dropout(p.dropout.is_some());
    let f = function(dev, &spec, 0)?;
    let cfg = grid(p.sq.div_ceil(spec.block_m), p, spec.threads_m(), spec.shared_bytes(0));
    let totals = [(p.batch * p.sq) as u64, (p.batch * p.sk) as u64];
    let total_o = capacity(out, 0, p.o, p.heads, p.head_dim);
    let s = Scalars::new(&p8, [totals[0].min(total_o), totals[1]]);
    let vt_row = vt_row(p.sk) as u64;
    let stream = dev.stream();
    let mut l = Launch::new(OP, stream, &f, &spec, 0);
    l.ptr("q", operands.q.data()).ptr("k", operands.k.data()).ptr("v", operands.vt.data());
    l.ptr("o", out.data_mut()?).ptr("lse", &*lse);
    l.ptr("scale_inv_q", scale_inv[0]).ptr("scale_inv_k", scale_inv[1]).ptr("scale_inv_v", scale_inv[2]);
    l.scalar("vt_row", &vt_row);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: the operands are the dense E4M3 q, k and the Vᵀ of `p`'s sizes (checked), out
    // reaches every row its strides address for the sizes (checked), lse holds batch · heads ·
    // sq f32 and the cu_seqlens batch + 1 i32; out and lse are distinct allocations (`&mut`).
    unsafe { l.launch(cfg) }
}

/// The operands' dtypes and shapes are those of `p`.
fn check_operands(p: &FlashAttnParams, o: &Fp8Operands) -> Result<()> {
    let want = [
        ("q", &o.q, vec![p.batch, p.sq, p.heads, p.head_dim]),
        ("k", &o.k, vec![p.batch, p.sk, p.groups, p.head_dim]),
        ("vt", &o.vt, vec![p.batch, p.groups, p.head_dim, vt_row(p.sk)]),
    ];
    for (name, t, shape) in want {
        if t.dtype() != DType::E4M3 || t.shape() != shape.as_slice() {
            return Err(Error::Shape {
                op: OP,
                message: format!(
                    "FP8 operand `{name}` is {} {:?}, the call needs e4m3 {shape:?} (make it with Fp8Operands::new)",
                    t.dtype(),
                    t.shape()
                ),
            });
        }
    }
    Ok(())
}
