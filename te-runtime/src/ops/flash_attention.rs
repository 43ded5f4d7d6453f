//! Family 14 launchers: fused attention (FlashAttention-2, [`te_codegen::spec::FlashAttnSpec`]),
//! forward with `softmax_lse` and the deterministic backward. The module-level API with masks,
//! formats and backend selection is `DotProductAttention`; this layer takes strides, so that q,
//! k and v may be any `bshd`/`sbhd` tensors (or heads inside a fused QKV tensor).

pub use super::attention_shape::HeadStrides;
use super::attention_shape::{AttentionShape, QkvLayout};
use super::check_dtype;
use super::dropout::{keep_scale, keep_threshold};
pub use super::flash_attention_gqa::dkdv_splits;
use super::flash_attention_gqa::dkdv_sum;
use super::launch::Launch;
use super::tma::TensorMap;
use crate::{Device, Error, Result, Tensor};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};
use std::sync::Arc;
use te_codegen::spec::{ArgCond, Direction, FlashAttnSpec, FLASH_HEAD_DIMS};
use te_codegen::{Arch, DType, KernelSpec};

pub(super) const OP: &str = "flash attention";

/// One fused attention call: its problem ([`AttentionShape`]: sizes, layout, mask, window,
/// scale, dropout) and where the heads of q, k, v and the output sit ([`HeadStrides`], in
/// elements; [`FlashAttnParams::dense`] for tensors dense in the shape's layout, other strides for
/// heads inside a fused QKV tensor).
///
/// The kernels take the mask as the shape's resolved window and diagonal: query `i` of sequence
/// `b` (valid lengths `lq`, `lk`: from the `cu_seqlens` when given, else `sq`, `sk`) sees key `j`
/// iff [`AttentionShape::attends`] says so (TE's `window_size` and `*_bottom_right` masks; causal is
/// the window `(−1, 0)`). Attention dropout ([`AttentionShape::dropout`]) draws element `i` of a
/// dense `[batch, heads, sq, sk]` tensor by [`crate::ops::dropout`]'s rule, so that the unfused
/// backend and `reference::dropout` draw the same mask; the backward takes the forward's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlashAttnParams {
    /// The problem. Head dims: `head_dim` one of [`FLASH_HEAD_DIMS`]; `head_dim_v` the same, or on
    /// Hopper (sm_90a, bf16/f16) another of 64, 128 and 256 with `head_dim` one of them too, as
    /// FlashAttention-3 and cuDNN take it. The backward above 128 is Hopper's only, with both head
    /// dims 128 or 256.
    pub shape: AttentionShape,
    /// q and dq.
    pub q: HeadStrides,
    /// k and dk.
    pub kv: HeadStrides,
    /// v and dv.
    pub v: HeadStrides,
    /// o and d_o.
    pub o: HeadStrides,
}

impl FlashAttnParams {
    /// A call on q, k, v and the output each dense in the shape's layout
    /// ([`AttentionShape::q_strides`] and its siblings).
    pub fn dense(shape: AttentionShape) -> Self {
        Self { shape, q: shape.q_strides(), kv: shape.k_strides(), v: shape.v_strides(), o: shape.o_strides() }
    }
}

/// q, k and v (or their gradients dq, dk, dv): three tensors, or the heads of one fused QKV
/// tensor (the projection's `[.., (h + 2g) · head_dim]` output, all q heads then all k heads then
/// all v heads at each position), each from an element offset (`[0, h · d, (h + g) · d]` there).
/// The strides of [`FlashAttnParams`] say where the heads sit in either case.
#[derive(Debug)]
pub enum Qkv<T> {
    /// `[q, k, v]` in tensors of their own.
    Apart([T; 3]),
    /// One tensor and the element offsets of q's, k's and v's first head (multiples of 8).
    Packed(T, [usize; 3]),
}

impl<T: std::ops::Deref<Target = Tensor>> Qkv<T> {
    /// `(tensor, element offset)` of q, k and v.
    pub fn parts(&self) -> [(&Tensor, usize); 3] {
        match self {
            Qkv::Apart([q, k, v]) => [(q, 0), (k, 0), (v, 0)],
            Qkv::Packed(t, [a, b, c]) => [(t, *a), (t, *b), (t, *c)],
        }
    }
}

/// Valid lengths of variable-length sequences: i32 `[batch + 1]` prefix sums (`cu[b + 1] −
/// cu[b]` valid positions of sequence `b`, TE's `cu_seqlens_q` / `_kv`). Lengths beyond the padded
/// `sq` / `sk` are clamped by the kernels.
#[derive(Debug, Clone, Copy)]
pub struct CuSeqlens<'a> {
    /// Queries.
    pub q: &'a CudaSlice<i32>,
    /// Keys and values.
    pub kv: &'a CudaSlice<i32>,
    /// `thd` (packed sequences): i32 `[batch + 1]` token offsets of each sequence in q, o (and
    /// their gradients) and in k, v (TE's `cu_seqlens_q_padded` / `_kv_padded`, or the
    /// `cu_seqlens` themselves without padding between sequences). Sequence `b` then owns
    /// tokens `[offsets[b], offsets[b + 1])` at the row strides (the batch strides are unused;
    /// `sq` / `sk` are the longest sequences), and the kernels touch no token outside them.
    /// `None`: each sequence starts at its batch stride (`bshd` / `sbhd`).
    pub offsets: Option<(&'a CudaSlice<i32>, &'a CudaSlice<i32>)>,
}

impl CuSeqlens<'_> {
    /// Whether the tensors are packed (`thd`).
    pub(super) fn thd(cu: Option<Self>) -> bool {
        cu.is_some_and(|c| c.offsets.is_some())
    }
}

/// Rows a tensor holds from `offset` at strides `s` for `heads` heads of `d` (the `thd` bound
/// the kernels clamp token offsets to).
pub(super) fn capacity(t: &Tensor, offset: usize, s: HeadStrides, heads: usize, d: usize) -> u64 {
    let first = offset + (heads.max(1) - 1) * s.head + d;
    if t.numel() < first || s.row == 0 {
        return 0;
    }
    ((t.numel() - first) / s.row + 1) as u64
}

/// Why the fused kernels cannot run a call of this dtype, head dims (q and k; v and o) and arch
/// (`training`: the backward is needed too), or `None` when they can.
pub fn unsupported_reason(
    arch: Arch,
    dtype: DType,
    head_dim: usize,
    head_dim_v: usize,
    training: bool,
) -> Option<String> {
    if !matches!(dtype, DType::BF16 | DType::F16) {
        return Some(format!("the fused kernels take bf16 or f16, not {dtype}"));
    }
    if !FLASH_HEAD_DIMS.contains(&head_dim) {
        return Some(format!("head_dim = {head_dim} is not one of the fused kernels' {FLASH_HEAD_DIMS:?}"));
    }
    if head_dim_v != head_dim || training {
        let dir = if training { Direction::Bwd } else { Direction::Fwd };
        let spec = FlashAttnSpec::new(dir, dtype, head_dim, arch).with_head_dim_v(head_dim_v);
        return KernelSpec::FlashAttn(spec).validate().err().map(|e| match e {
            te_codegen::Error::InvalidSpec { reason, .. } => reason,
            other => other.to_string(),
        });
    }
    None
}

/// `out = softmax(scale · Q · Kᵀ, masked) · V` per (sequence, head) and `lse = ln Σ_j exp(scale ·
/// s_ij)` over the visible keys.
///
/// - `qkv`: `q` bf16/f16 at `p.q` strides, `[.., sq, heads, head_dim]`; `k`: q's dtype at
///   `p.kv` strides, `[.., sk, groups, head_dim]`; `v` at `p.v` strides, `[.., sk, groups,
///   head_dim_v]` (three tensors or one fused, [`Qkv`]); query head `h` reads key/value head `h /
///   (heads / groups)`.
/// - `out`: q's dtype at `p.o` strides, `[.., sq, heads, head_dim_v]`. Rows of padded queries (`i >= lq`) and of queries that
///   see no key are zeros.
/// - `lse`: f32 `[batch, heads, sq]`; `+inf` where a row sees no key.
///
/// # Errors
/// [`Error::DType`] for other dtypes; the shape's errors ([`AttentionShape::validate`]: sizes,
/// `groups` not dividing `heads` as [`Error::Shape`], scale, dropout and a window the mask does not
/// take as [`Error::Argument`]); [`Error::Shape`] for head dims the kernels do not take
/// ([`unsupported_reason`]), more than 65535 heads or sequences, a tensor smaller than its strides
/// reach from its offset, strides or offsets not 16-byte aligned, `cu_seqlens` or `lse` too short;
/// sequence tables the layout and mask do not take ([`AttentionShape::check_tables`]: a padding
/// mask without `cu_seqlens` is an [`Error::Config`]); compile and launch failures.
pub fn forward(
    dev: &Device,
    p: &FlashAttnParams,
    qkv: Qkv<&Tensor>,
    cu: Option<CuSeqlens<'_>>,
    out: &mut Tensor,
    lse: &mut CudaSlice<f32>,
) -> Result<()> {
    let parts = qkv.parts();
    check(p, parts, cu, Direction::Fwd, dev.arch())?;
    let sh = &p.shape;
    let q = parts[0].0;
    check_same(out, q, "out")?;
    let (batch, sq, _) = reach(p);
    check_extent("out", out, 0, p.o, batch, sq, sh.heads, sh.head_dim_v)?;
    check_len("lse", lse.len(), sh.lse_len())?;
    let [(k, k_off), (v, v_off)] = [parts[1], parts[2]];
    let total_q =
        capacity(q, parts[0].1, p.q, sh.heads, sh.head_dim).min(capacity(out, 0, p.o, sh.heads, sh.head_dim_v));
    let total_kv =
        capacity(k, k_off, p.kv, sh.groups, sh.head_dim).min(capacity(v, v_off, p.v, sh.groups, sh.head_dim_v));
    let spec = sh.flash_spec(Direction::Fwd, q.dtype(), dev.arch());
    let f = function(dev, &spec, 0)?;
    let cfg = grid(sh.sq.div_ceil(spec.block_m), p, spec.threads_m(), spec.shared_bytes(0));
    let s = Scalars::new(p, [total_q, total_kv]);
    let stream = dev.stream();
    let q_dtype = q.dtype();
    let ([q, k, v], _guards) = addresses(stream, parts);
    let input = |base, strides, seq, heads, width| TmaInput { base, strides, seq, heads, width };
    let qk = [input(q, p.q, sh.sq, sh.heads, sh.head_dim), input(k, p.kv, sh.sk, sh.groups, sh.head_dim)];
    let v_input = TmaV::Heads(input(v, p.v, sh.sk, sh.groups, sh.head_dim_v));
    let maps = TmaMaps::new(&spec, cu, sh.batch, q_dtype, qk, v_input);
    let mut l = Launch::new(OP, stream, &f, &spec, 0);
    l.ptr("q", &q).ptr("k", &k).ptr("v", &v).ptr("o", out.data_mut()?).ptr("lse", &*lse);
    maps.push(&mut l);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: q, k, v (from their offsets) and out hold every element their strides reach for
    // the sizes (checked), the addresses and strides are 16-byte aligned, lse holds batch ·
    // heads · sq f32 and the cu_seqlens batch + 1 i32 (checked); out and lse are distinct
    // allocations (`&mut`); the guards keep q, k and v's allocations in use until the launch.
    unsafe { l.launch(cfg) }
}

/// One input a tensor map covers: its device address, strides (elements), positions, heads
/// and channels per head.
#[derive(Debug, Clone, Copy)]
pub(super) struct TmaInput {
    pub base: u64,
    pub strides: HeadStrides,
    pub seq: usize,
    pub heads: usize,
    pub width: usize,
}

/// The layout of v for its tensor map.
#[derive(Debug, Clone, Copy)]
pub(super) enum TmaV {
    /// Heads like q and k.
    Heads(TmaInput),
    /// The FP8 forward's Vᵀ codes `[batch, groups, head_dim, vt_row]`.
    Transposed { base: u64, groups: usize, vt_row: usize },
}

/// The tensor maps of a warp-specialized forward ([`ArgCond::Tma`]): its producer loads with TMA
/// when the inputs are dense without `cu_seqlens` (rows past a padded or packed sequence must
/// read as zeros, which only its cp.async path does) and the driver encodes every map.
pub(super) struct TmaMaps {
    maps: Option<([TensorMap; 3], i32)>,
}

impl TmaMaps {
    /// The maps of q, k and v (`batch` sequences; 16-bit `dtype`, or e4m3 for FP8) for `spec`'s
    /// tiles: boxes of one 128-byte row of channels by `block_m` (q) or `block_n` (k, v) rows.
    pub(super) fn new(
        spec: &FlashAttnSpec,
        cu: Option<CuSeqlens<'_>>,
        batch: usize,
        dtype: DType,
        [q, k]: [TmaInput; 2],
        v: TmaV,
    ) -> Self {
        if !KernelSpec::FlashAttn(*spec).family().has(ArgCond::Tma) {
            return Self { maps: None };
        }
        let unused = Self { maps: Some(([TensorMap::unused(); 3], 0)) };
        if cu.is_some() {
            return unused;
        }
        let es = dtype.size_bytes() as u64;
        let map = |t: TmaInput, rows: usize| {
            let s = t.strides;
            TensorMap::tiled(
                t.base,
                dtype,
                [t.width as u64, t.heads as u64, t.seq as u64, batch as u64],
                [s.head as u64 * es, s.row as u64 * es, s.batch as u64 * es],
                [(128 / es) as u32, 1, rows as u32, 1],
            )
        };
        let v = match v {
            TmaV::Heads(t) => map(t, spec.block_n),
            // Bytes (vt_row, head_dim, groups, batch), a box of block_n keys by every channel.
            TmaV::Transposed { base, groups, vt_row } => {
                let (d, g, row) = (spec.head_dim as u64, groups as u64, vt_row as u64);
                TensorMap::tiled(
                    base,
                    dtype,
                    [row, d, g, batch as u64],
                    [row, d * row, g * d * row],
                    [spec.block_n as u32, d as u32, 1, 1],
                )
            }
        };
        match (map(q, spec.block_m), map(k, spec.block_n), v) {
            (Ok(q), Ok(k), Ok(v)) => Self { maps: Some(([q, k, v], 1)) },
            (q, k, v) => {
                let why = [q.err(), k.err(), v.err()].into_iter().flatten().next();
                tracing::debug!("{OP}: the driver encodes no tensor map ({why:?}): the forward loads with cp.async");
                unused
            }
        }
    }

    /// Pushes `tma_q`, `tma_k`, `tma_v` and `use_tma` where the spec takes them.
    pub(super) fn push<'a>(&'a self, l: &mut Launch<'a>) {
        if let Some(([q, k, v], on)) = &self.maps {
            l.scalar("tma_q", q).scalar("tma_k", k).scalar("tma_v", v).scalar("use_tma", on);
        }
    }
}

/// The device addresses of `(tensor, element offset)` parts, with the guards that order their
/// use on `stream`.
pub(super) fn addresses<'a, const N: usize>(
    stream: &'a Arc<CudaStream>,
    parts: [(&'a Tensor, usize); N],
) -> ([u64; N], Vec<SyncOnDrop<'a>>) {
    let mut guards = Vec::with_capacity(N);
    let addrs = parts.map(|(t, offset)| {
        let (base, guard) = t.data().device_ptr(stream);
        guards.push(guard);
        base + (offset * t.dtype().size_bytes()) as u64
    });
    (addrs, guards)
}

/// As [`addresses`], for tensors the kernels write.
pub(super) fn addresses_mut<'a>(
    stream: &'a Arc<CudaStream>,
    t: &'a mut Qkv<&mut Tensor>,
) -> Result<([u64; 3], Vec<SyncOnDrop<'a>>)> {
    let mut guards = Vec::with_capacity(3);
    let addrs = match t {
        Qkv::Apart(ts) => {
            let mut addrs = [0u64; 3];
            for (addr, t) in addrs.iter_mut().zip(ts.iter_mut()) {
                let (base, guard) = t.data_mut()?.device_ptr_mut(stream);
                guards.push(guard);
                *addr = base;
            }
            addrs
        }
        Qkv::Packed(t, offsets) => {
            let size = t.dtype().size_bytes();
            let (base, guard) = t.data_mut()?.device_ptr_mut(stream);
            guards.push(guard);
            offsets.map(|o| base + (o * size) as u64)
        }
    };
    Ok((addrs, guards))
}

/// The gradients of [`forward`]: `(dq, dk, dv)` written in q's, k's and v's layout (`dq` at
/// `p.q` strides, `dk` at `p.kv`, `dv` at `p.v` strides, three tensors or one fused like `qkv`; every
/// element the strides reach is written, padded positions with zeros, nothing else).
///
/// `out` and `lse` are the forward's, `d_out` the output gradient at `p.o` strides. The kernels
/// use no atomics: the same inputs give the same bits on the same GPU model. With GQA/MQA, when
/// the key blocks alone would fill the GPU poorly, the query heads of a group are split over
/// several blocks per key block ([`dkdv_splits`]) whose f32 partial dK/dV a fourth kernel adds in
/// a fixed order (a workspace of `splits · batch · groups · sk · (head_dim + head_dim_v)` f32).
///
/// # Errors
/// As [`forward`] (head dims above 128 on other GPUs than Hopper); the workspace's allocation.
#[allow(clippy::too_many_arguments)] // the backward's tensors, each named as in TE
pub fn backward(
    dev: &Device,
    p: &FlashAttnParams,
    qkv: Qkv<&Tensor>,
    out: &Tensor,
    d_out: &Tensor,
    lse: &CudaSlice<f32>,
    cu: Option<CuSeqlens<'_>>,
    mut grads: Qkv<&mut Tensor>,
) -> Result<()> {
    let parts = qkv.parts();
    check(p, parts, cu, Direction::Bwd, dev.arch())?;
    let q = parts[0].0;
    check_same(out, q, "out")?;
    let totals = check_grads(p, (out, d_out), &grads, parts.map(Some))?;
    check_len("lse", lse.len(), p.shape.lse_len())?;
    let spec = p.shape.flash_spec(Direction::Bwd, q.dtype(), dev.arch());
    let s = Scalars::new(p, totals);
    let stream = dev.stream();
    let ([q, k, v], _in_guards) = addresses(stream, parts);
    let ([dq, dk, dv], _out_guards) = addresses_mut(stream, &mut grads)?;
    let delta = dot_do_o(dev, &spec, p, cu, (out, d_out), None, &s)?;

    let splits = dkdv_splits(p, &spec, dev.sm_count());
    let sh = &p.shape;
    let acc_len = splits * sh.batch * sh.groups * sh.sk * (sh.head_dim + sh.head_dim_v);
    // SAFETY: f32 has no invalid bit patterns; `_dkdv` writes every element `_dkdv_sum` reads
    // (the rows below each sequence's length, every channel, every split).
    let mut acc = if splits > 1 { Some(unsafe { stream.alloc::<f32>(acc_len) }?) } else { None };
    let kv_splits = splits as u64;
    let f = function(dev, &spec, 1)?;
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 1);
    l.ptr("q", &q).ptr("k", &k).ptr("v", &v).ptr("d_o", d_out.data());
    l.ptr("lse", lse).ptr("delta", &delta).ptr("dk", &dk).ptr("dv", &dv);
    match acc.as_mut() {
        Some(a) => l.ptr("dkdv_acc", a),
        None => l.ptr("dkdv_acc", &NULL),
    };
    l.scalar("kv_splits", &kv_splits);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: as the forward's, for dk and dv at the kv and v strides: held `&mut` (one fused tensor
    // or two), and the heads they write are disjoint from each other and from every input; with
    // splits, the workspace holds every split's rows (`acc_len`).
    unsafe { l.launch(dkdv_grid(p, &spec, splits)) }?;
    if let Some(a) = &acc {
        dkdv_sum(dev, &spec, p, cu, &s, (a, kv_splits), [dk, dv])?;
    }

    let f = function(dev, &spec, 2)?;
    let mut l = Launch::new(OP, dev.stream(), &f, &spec, 2);
    l.ptr("q", &q).ptr("k", &k).ptr("v", &v).ptr("d_o", d_out.data());
    l.ptr("lse", lse).ptr("delta", &delta).ptr("dq", &dq);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // SAFETY: as the forward's, for dq at the q strides (disjoint from dk and dv, written
    // before on the same stream).
    unsafe { l.launch(dq_grid(p, &spec)) }
}

/// The launch of a backward spec's `_dkdv`: a block per `block_n` keys of a key/value head and
/// split of its group's query heads.
pub(super) fn dkdv_grid(p: &FlashAttnParams, spec: &FlashAttnSpec, splits: usize) -> LaunchConfig {
    let mut cfg = grid(p.shape.sk.div_ceil(spec.block_n), p, spec.threads_n(), spec.shared_bytes(1));
    cfg.grid_dim.1 = (p.shape.groups * splits) as u32;
    cfg
}

/// The launch of a backward spec's `_dq` (a block per `block_m` queries of a head).
pub(super) fn dq_grid(p: &FlashAttnParams, spec: &FlashAttnSpec) -> LaunchConfig {
    grid(p.shape.sq.div_ceil(spec.block_m), p, spec.threads_m(), spec.shared_bytes(2))
}

/// The backward's checks of the forward's output and its gradient (`(out, d_out)`, 16-bit at the
/// o strides) and of the gradients `grads` (their dtype, offsets and extents); returns the rows
/// the q side and the kv side hold (what `thd` token offsets are clamped to), bounded by the
/// inputs `ins` read at the gradients' strides.
pub(super) fn check_grads(
    p: &FlashAttnParams,
    (out, d_out): (&Tensor, &Tensor),
    grads: &Qkv<&mut Tensor>,
    ins: [Option<(&Tensor, usize)>; 3],
) -> Result<[u64; 2]> {
    let (batch, sq, sk) = reach(p);
    let sh = &p.shape;
    let mut total_q = u64::MAX;
    let mut total_kv = u64::MAX;
    check_dtype(OP, "out", out, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    for (name, t) in [("out", out), ("d_out", d_out)] {
        check_same(t, out, name)?;
        check_extent(name, t, 0, p.o, batch, sq, sh.heads, sh.head_dim_v)?;
        total_q = total_q.min(capacity(t, 0, p.o, sh.heads, sh.head_dim_v));
    }
    let g = match grads {
        Qkv::Apart([a, b, c]) => Qkv::Apart([&**a, &**b, &**c]),
        Qkv::Packed(t, o) => Qkv::Packed(&**t, *o),
    };
    for (((name, (t, offset)), (s, seq, heads, d)), input) in ["dq", "dk", "dv"]
        .into_iter()
        .zip(g.parts())
        .zip([
            (p.q, sq, sh.heads, sh.head_dim),
            (p.kv, sk, sh.groups, sh.head_dim),
            (p.v, sk, sh.groups, sh.head_dim_v),
        ])
        .zip(ins)
    {
        check_same(t, out, name)?;
        check_offset(name, offset)?;
        check_extent(name, t, offset, s, batch, seq, heads, d)?;
        let cap = capacity(t, offset, s, heads, d);
        let cap = input.map_or(cap, |(i, o)| cap.min(capacity(i, o, s, heads, d)));
        if name == "dq" {
            total_q = total_q.min(cap);
        } else {
            total_kv = total_kv.min(cap);
        }
    }
    Ok([total_q, total_kv])
}

/// `_dot_do_o` of a backward spec: `delta = rowsum(dO ⊙ O)`, f32 `[batch, heads, sq]`, from the
/// checked ([`check_grads`]) 16-bit output and its gradient, or from the E4M3 codes of the output
/// descaled by `o_scale_inv` (TE's `fp8_mha`; one f32).
pub(super) fn dot_do_o(
    dev: &Device,
    spec: &FlashAttnSpec,
    p: &FlashAttnParams,
    cu: Option<CuSeqlens<'_>>,
    (out, d_out): (&Tensor, &Tensor),
    o_scale_inv: Option<&CudaSlice<f32>>,
    s: &Scalars,
) -> Result<CudaSlice<f32>> {
    // SAFETY: f32 has no invalid bit patterns; `_dot_do_o` writes every element.
    let mut delta = unsafe { dev.stream().alloc::<f32>(p.shape.lse_len()) }?;
    let f = function(dev, spec, 0)?;
    let cfg = grid(p.shape.sq.div_ceil(8), p, 256, 0);
    let mut l = Launch::new(OP, dev.stream(), &f, spec, 0);
    l.ptr("o", out.data()).ptr("d_o", d_out.data()).ptr("delta", &mut delta);
    match o_scale_inv {
        Some(si) => l.ptr("o_scale_inv", si),
        None => l.ptr("o_scale_inv", &NULL),
    };
    match cu {
        Some(c) => l.ptr("cu_seqlens_q", c.q),
        None => l.ptr("cu_seqlens_q", &NULL),
    };
    match cu.and_then(|c| c.offsets) {
        Some((q, _)) => l.ptr("seq_offsets_q", q),
        None => l.ptr("seq_offsets_q", &NULL),
    };
    s.push_o(&mut l).push_mask(&mut l);
    // SAFETY: out and d_out reach batch · sq rows of heads · head_dim_v at their strides; delta
    // holds batch · heads · sq f32 (the grid's rows); checked by the caller.
    unsafe { l.launch(cfg) }?;
    Ok(delta)
}

/// A null device pointer, for absent `cu_seqlens`.
pub(super) static NULL: u64 = 0;

pub(super) fn push_cu<'a>(l: &mut Launch<'a>, cu: Option<CuSeqlens<'a>>) {
    match cu {
        Some(c) => l.ptr("cu_seqlens_q", c.q).ptr("cu_seqlens_kv", c.kv),
        None => l.ptr("cu_seqlens_q", &NULL).ptr("cu_seqlens_kv", &NULL),
    };
    match cu.and_then(|c| c.offsets) {
        Some((q, kv)) => l.ptr("seq_offsets_q", q).ptr("seq_offsets_kv", kv),
        None => l.ptr("seq_offsets_q", &NULL).ptr("seq_offsets_kv", &NULL),
    };
}

/// `(batch, sq, sk)` the strides must reach: the call's, or for `thd` one row (the kernels
/// clamp the token offsets to the rows the tensors hold; [`check_call`] makes sure the tables of
/// `thd` come with it).
pub(super) fn reach(p: &FlashAttnParams) -> (usize, usize, usize) {
    if p.shape.layout == QkvLayout::Thd {
        (1, 1, 1)
    } else {
        (p.shape.batch, p.shape.sq, p.shape.sk)
    }
}

/// The by-value arguments, kept alive for the launches that borrow them.
pub(super) struct Scalars {
    q: [u64; 3],
    kv: [u64; 3],
    v: [u64; 3],
    o: [u64; 3],
    sizes: [u64; 4],
    totals: [u64; 2],
    /// Philox seed, offset and keep threshold; the keep scale.
    dropout: [u64; 3],
    keep_scale: f32,
    scale: f32,
    window: [i64; 2],
    bottom_right: i32,
}

impl Scalars {
    pub(super) fn new(p: &FlashAttnParams, totals: [u64; 2]) -> Self {
        let s = |h: HeadStrides| [h.batch as u64, h.row as u64, h.head as u64];
        let sh = &p.shape;
        Self {
            q: s(p.q),
            kv: s(p.kv),
            v: s(p.v),
            o: s(p.o),
            sizes: [sh.sq as u64, sh.sk as u64, sh.heads as u64, sh.heads_per_group() as u64],
            totals,
            dropout: sh.dropout.map_or([0; 3], |d| [d.seed, d.offset, keep_threshold(d.p)]),
            keep_scale: sh.dropout.map_or(1.0, |d| keep_scale(d.p)),
            scale: sh.scale,
            window: [sh.window.0, sh.window.1],
            bottom_right: i32::from(sh.bottom_right()),
        }
    }
    pub(super) fn push_q<'a>(&'a self, l: &mut Launch<'a>) -> &'a Self {
        l.scalar("q_batch", &self.q[0]).scalar("q_row", &self.q[1]).scalar("q_head", &self.q[2]);
        self
    }
    pub(super) fn push_kv<'a>(&'a self, l: &mut Launch<'a>) -> &'a Self {
        l.scalar("kv_batch", &self.kv[0]).scalar("kv_row", &self.kv[1]).scalar("kv_head", &self.kv[2]);
        l.scalar("v_batch", &self.v[0]).scalar("v_row", &self.v[1]).scalar("v_head", &self.v[2]);
        self
    }
    pub(super) fn push_o<'a>(&'a self, l: &mut Launch<'a>) -> &'a Self {
        l.scalar("o_batch", &self.o[0]).scalar("o_row", &self.o[1]).scalar("o_head", &self.o[2]);
        self
    }
    pub(super) fn push_mask<'a>(&'a self, l: &mut Launch<'a>) -> &'a Self {
        l.scalar("sq", &self.sizes[0]).scalar("sk", &self.sizes[1]);
        l.scalar("total_q", &self.totals[0]).scalar("total_kv", &self.totals[1]);
        l.scalar("heads", &self.sizes[2]).scalar("heads_per_group", &self.sizes[3]);
        l.scalar("scale", &self.scale).scalar("window_left", &self.window[0]).scalar("window_right", &self.window[1]);
        l.scalar("bottom_right", &self.bottom_right);
        self
    }
    pub(super) fn push_dropout<'a>(&'a self, l: &mut Launch<'a>) -> &'a Self {
        l.scalar("dropout_seed", &self.dropout[0]).scalar("dropout_offset", &self.dropout[1]);
        l.scalar("keep_threshold", &self.dropout[2]).scalar("keep_scale", &self.keep_scale);
        self
    }
}

/// The compiled entry point, allowed the dynamic shared memory of its tiles.
pub(super) fn function(dev: &Device, spec: &FlashAttnSpec, entry: usize) -> Result<CudaFunction> {
    let f = dev.function(&KernelSpec::FlashAttn(*spec), entry)?;
    let bytes = spec.shared_bytes(entry);
    if bytes > 48 * 1024 {
        f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)?;
    }
    Ok(f)
}

/// Grid (`blocks`, heads, batch) of `threads` threads.
pub(super) fn grid(blocks: usize, p: &FlashAttnParams, threads: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, p.shape.heads as u32, p.shape.batch as u32),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// The checks both directions share.
pub(super) fn check(
    p: &FlashAttnParams,
    parts: [(&Tensor, usize); 3],
    cu: Option<CuSeqlens<'_>>,
    dir: Direction,
    arch: Arch,
) -> Result<()> {
    let [(q, q_off), (k, k_off), (v, v_off)] = parts;
    check_dtype(OP, "q", q, |d| matches!(d, DType::BF16 | DType::F16), "bf16 or f16")?;
    check_same(k, q, "k")?;
    check_same(v, q, "v")?;
    let sh = &p.shape;
    if let Some(why) = unsupported_reason(arch, q.dtype(), sh.head_dim, sh.head_dim_v, dir == Direction::Bwd) {
        return Err(Error::Shape { op: OP, message: why });
    }
    check_call(p, cu)?;
    for (name, offset) in [("q", q_off), ("k", k_off), ("v", v_off)] {
        check_offset(name, offset)?;
    }
    let (batch, sq, sk) = reach(p);
    check_extent("q", q, q_off, p.q, batch, sq, sh.heads, sh.head_dim)?;
    check_extent("k", k, k_off, p.kv, batch, sk, sh.groups, sh.head_dim)?;
    check_extent("v", v, v_off, p.v, batch, sk, sh.groups, sh.head_dim_v)
}

/// The shape ([`AttentionShape::validate`]), the kernels' grid limits and the strides of a call.
pub(super) fn check_params(p: &FlashAttnParams) -> Result<()> {
    let sh = &p.shape;
    sh.validate(OP)?;
    let shape = |message: String| Err(Error::Shape { op: OP, message });
    if sh.heads > 65535 || sh.batch > 65535 || sh.sq > i32::MAX as usize || sh.sk > i32::MAX as usize {
        return shape(format!("at most 65535 heads and sequences, got {} and {}", sh.heads, sh.batch));
    }
    for (name, s) in [("q", p.q), ("kv", p.kv), ("v", p.v), ("o", p.o)] {
        if [s.batch, s.row, s.head].iter().any(|x| x % 8 != 0) {
            return shape(format!(
                "the {name} strides {s:?} must be multiples of 8 elements (16 bytes) for the kernels' vector loads"
            ));
        }
    }
    Ok(())
}

/// [`check_params`] and the sequence tables of a call: those the shape's layout and mask need
/// ([`AttentionShape::check_tables`]), each `batch + 1` entries.
pub(super) fn check_call(p: &FlashAttnParams, cu: Option<CuSeqlens<'_>>) -> Result<()> {
    check_params(p)?;
    p.shape.check_tables(OP, cu.is_some(), CuSeqlens::thd(cu))?;
    if let Some(c) = cu {
        let n = p.shape.batch + 1;
        check_len("cu_seqlens_q", c.q.len(), n)?;
        check_len("cu_seqlens_kv", c.kv.len(), n)?;
        if let Some((q, kv)) = c.offsets {
            check_len("seq_offsets_q", q.len(), n)?;
            check_len("seq_offsets_kv", kv.len(), n)?;
        }
    }
    Ok(())
}

fn check_same(t: &Tensor, q: &Tensor, name: &'static str) -> Result<()> {
    check_dtype(OP, name, t, |d| d == q.dtype(), &format!("{} (the dtype of `q`)", q.dtype()))
}

#[allow(clippy::too_many_arguments)] // the tensor, where its heads start, and their geometry
pub(super) fn check_extent(
    name: &str,
    t: &Tensor,
    offset: usize,
    s: HeadStrides,
    batch: usize,
    seq: usize,
    heads: usize,
    d: usize,
) -> Result<()> {
    let need = offset + s.extent(batch, seq, heads, d);
    if t.numel() < need {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "`{name}` {:?} holds {} elements, its strides {s:?} reach {need} from offset {offset} for {batch} \
                 sequences of {seq} positions and {heads} heads of {d}",
                t.shape(),
                t.numel()
            ),
        });
    }
    Ok(())
}

pub(super) fn check_offset(name: &str, offset: usize) -> Result<()> {
    if offset % 8 != 0 {
        return Err(Error::Shape {
            op: OP,
            message: format!(
                "`{name}` starts at element {offset}: offsets must be multiples of 8 elements (16 bytes) for the \
                 kernels' vector loads"
            ),
        });
    }
    Ok(())
}

pub(super) fn check_len(name: &str, len: usize, need: usize) -> Result<()> {
    if len < need {
        return Err(Error::Shape { op: OP, message: format!("`{name}` holds {len} elements, the call needs {need}") });
    }
    Ok(())
}
