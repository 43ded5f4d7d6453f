//! Family 14's FP8 forward (TE's `fp8_dpa`, FlashAttention-3's FP8 path) on Hopper: q, k and v
//! quantized to E4M3 with per-tensor scales ([`quantize`]), then `softmax(scale · Q · Kᵀ) · V` on
//! e4m3 `wgmma` with P quantized to E4M3 inside the kernel, the output in bf16/f16
//! ([`forward`]). The backward stays 16-bit (TE's `NVTE_FP8_DPA_BWD=0` mode: FP8 forward, F16/BF16
//! backward): it recomputes P from the 16-bit q, k and the LSE this forward saves.

use super::flash_attention::{
    addresses, capacity, check, check_call, check_extent, check_len, function, grid, push_cu, reach, CuSeqlens,
    FlashAttnParams, HeadStrides, Qkv, Scalars, OP,
};
use super::launch::Launch;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::{CudaSlice, DevicePtrMut, LaunchConfig};
use te_codegen::spec::{Direction, FlashAttnSpec, QkvFormat};
use te_codegen::{Arch, DType};

/// Keys per Vᵀ row are padded to a multiple of this (the kernel's key tile).
const KEY_TILE: usize = 128;

/// Per-tensor quantization scales (`x_e4m3 = x · scale`, TE's `scale`; the kernels descale with
/// `1 / scale`, TE's `scale_inv`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8AttnScales {
    /// Of q.
    pub q: f32,
    /// Of k.
    pub k: f32,
    /// Of v.
    pub v: f32,
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

/// Quantizes q, k and v (bf16/f16, the strides of `p`, as [`super::flash_attention::forward`]
/// takes them) to `out`'s E4M3 operands with `scales`, and raises `amax[0..3]` (f32) to the
/// largest |q|, |k|, |v| read (TE's amax for the delayed and current recipes; zero it first for
/// this call's own).
///
/// # Errors
/// As the 16-bit forward's checks; [`Error::Shape`] when the operands are not those of `p` or
/// `amax` holds fewer than 3 values; compile and launch failures.
pub fn quantize(
    dev: &Device,
    p: &FlashAttnParams,
    qkv: Qkv<&Tensor>,
    scales: Fp8AttnScales,
    out: &mut Fp8Operands,
    amax: &mut CudaSlice<f32>,
) -> Result<()> {
    let parts = qkv.parts();
    check(p, parts, None, Direction::Fwd)?;
    let dtype = parts[0].0.dtype();
    if let Some(why) = unsupported_reason(dev.arch(), dtype, p.head_dim, false) {
        return Err(Error::Shape { op: OP, message: why });
    }
    check_operands(p, out)?;
    check_len("amax", amax.len(), 3)?;
    let spec = FlashAttnSpec::fp8_forward(dtype, p.head_dim, dev.arch());
    let f = function(dev, &spec, 1)?;
    let stream = dev.stream();
    let (src, _guards) = addresses(stream, parts);
    let (amax_base, _amax_guard) = amax.device_ptr_mut(stream);
    let vt_row = vt_row(p.sk) as u64;
    let outs = [&mut out.q, &mut out.k, &mut out.vt];
    let geometry = [(p.q, p.sq, p.heads, scales.q), (p.kv, p.sk, p.groups, scales.k), (p.kv, p.sk, p.groups, scales.v)];
    for (i, (y, (s, seq, heads, scale))) in outs.into_iter().zip(geometry).enumerate() {
        let amax_i = amax_base + 4 * i as u64;
        let strides = [s.batch as u64, s.row as u64, s.head as u64];
        let sizes = [seq as u64, heads as u64, vt_row];
        let transpose = i32::from(i == 2);
        let mut l = Launch::new(OP, stream, &f, &spec, 1);
        l.ptr("x", &src[i]).ptr("y", y.data_mut()?).ptr("amax", &amax_i);
        l.scalar("x_batch", &strides[0]).scalar("x_row", &strides[1]).scalar("x_head", &strides[2]);
        l.scalar("seq", &sizes[0]).scalar("heads", &sizes[1]).scalar("y_row", &sizes[2]);
        l.scalar("transpose", &transpose).scalar("scale", &scale);
        let cfg = LaunchConfig {
            grid_dim: (seq.div_ceil(KEY_TILE) as u32, heads as u32, p.batch as u32),
            block_dim: (256, 1, 1),
            shared_mem_bytes: spec.shared_bytes(1) as u32,
        };
        // SAFETY: x reaches batch · seq rows of heads · head_dim at its strides (checked by
        // `check`); y is the dense (or Vᵀ, vt_row keys per row) E4M3 tensor of those sizes
        // (`check_operands`); amax_i is one of the 3 f32 of `amax`; y aliases no input.
        unsafe { l.launch(cfg) }?;
    }
    Ok(())
}

/// `out = softmax(scale · Q · Kᵀ, masked) · V` and `lse` from E4M3 operands: as the 16-bit
/// [`super::flash_attention::forward`] (masks, windows, GQA, `cu_seqlens`, dropout of `p`), with q,
/// k, v the [`Fp8Operands`] made by [`quantize`] with `scales`. `out` is bf16 or f16 at `p.o`
/// strides; `lse` f32 `[batch, heads, sq]` in true (descaled) units, so that the 16-bit backward
/// can recompute P from the 16-bit q and k.
///
/// # Errors
/// [`Error::Shape`] when the call is not one the FP8 kernels take ([`unsupported_reason`]), the
/// operands are not those of `p`, `out` or `lse` are too small; [`Error::Argument`] for scales
/// that are not finite and > 0; compile and launch failures.
pub fn forward(
    dev: &Device,
    p: &FlashAttnParams,
    operands: &Fp8Operands,
    scales: Fp8AttnScales,
    cu: Option<CuSeqlens<'_>>,
    out: &mut Tensor,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    if let Some(why) = unsupported_reason(dev.arch(), out.dtype(), p.head_dim, CuSeqlens::thd(cu)) {
        return Err(Error::Shape { op: OP, message: why });
    }
    if [scales.q, scales.k, scales.v].iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return Err(Error::Argument {
            op: OP,
            message: format!("FP8 attention scales must be finite and > 0, got {scales:?}"),
        });
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
    let descale = [1.0 / (scales.q * scales.k), 1.0 / scales.v];
    let stream = dev.stream();
    let mut l = Launch::new(OP, stream, &f, &spec, 0);
    l.ptr("q", operands.q.data()).ptr("k", operands.k.data()).ptr("v", operands.vt.data());
    l.ptr("o", out.data_mut()?).ptr("lse", &*lse);
    l.scalar("vt_row", &vt_row).scalar("qk_descale", &descale[0]).scalar("v_descale", &descale[1]);
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
