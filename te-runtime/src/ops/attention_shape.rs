//! The problem shape of the attention family, declared once: [`AttentionShape`] holds TE
//! `DotProductAttention`'s sizes, `qkv_format` ([`QkvLayout`]), `attn_mask_type`,
//! `window_size`, `softmax_scale` and attention dropout. The fused kernels' specs are built from
//! it ([`AttentionShape::flash_spec`] and its FP8 and decode siblings); the launchers of
//! [`super::flash_attention`], [`super::flash_attention_fp8`] and [`super::decode_attention`]
//! take it; the CPU oracle (`te_reference::attention`) and `te_nn`'s `DotProductAttention` use it.
//! Its validation ([`AttentionShape::validate`], [`AttentionShape::check_seq_lens`],
//! [`AttentionShape::check_tables`]) and the mask rule ([`AttentionShape::attends`], TE's
//! `get_full_mask`) live here and nowhere else.
//!
//! Where the heads of a tensor sit in memory is [`HeadStrides`]: dense in the layout
//! ([`AttentionShape::q_strides`] and siblings), or inside a fused QKV tensor (the module's).

use super::dropout::DropoutParams;
use crate::{Error, Result};
use std::ops::Range;
use te_codegen::spec::{AttnMaskType, DecodeAttnSpec, Direction, FlashAttnSpec, QkvFormat};
use te_codegen::{Arch, DType};

/// Memory layout of q, k, v, the output and their gradients (TE `qkv_format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QkvLayout {
    /// `[batch, seq, heads, head_dim]`.
    Bshd,
    /// `[seq, batch, heads, head_dim]` (TE's default, Megatron's layout).
    Sbhd,
    /// `[tokens, heads, head_dim]`: variable-length sequences packed one after another, sequence
    /// `b` at the token offsets its `cu_seqlens` give (TE's `cu_seqlens_q` / `_kv`, or their
    /// `_padded` variants); `sq` and `sk` are the longest sequences (TE's `max_seqlen_q` / `_kv`).
    Thd,
}

impl QkvLayout {
    /// The dense format of `bshd` and `sbhd`; `None` for `thd`.
    pub fn format(self) -> Option<QkvFormat> {
        match self {
            QkvLayout::Bshd => Some(QkvFormat::Bshd),
            QkvLayout::Sbhd => Some(QkvFormat::Sbhd),
            QkvLayout::Thd => None,
        }
    }

    /// TE's name: `"bshd"`, `"sbhd"` or `"thd"`.
    pub fn name(self) -> &'static str {
        match self {
            QkvLayout::Bshd => "bshd",
            QkvLayout::Sbhd => "sbhd",
            QkvLayout::Thd => "thd",
        }
    }
}

impl From<QkvFormat> for QkvLayout {
    fn from(format: QkvFormat) -> Self {
        match format {
            QkvFormat::Bshd => QkvLayout::Bshd,
            QkvFormat::Sbhd => QkvLayout::Sbhd,
        }
    }
}

/// Where the heads of one tensor sit: element `x` of head `h` at position `s` of sequence `b` is
/// element `b · batch + s · row + h · head + x` (all in elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadStrides {
    /// Between sequences.
    pub batch: usize,
    /// Between positions of one sequence.
    pub row: usize,
    /// Between heads of one position.
    pub head: usize,
}

impl HeadStrides {
    /// A dense `[batch, seq, heads, head_dim]` (bshd) or `[seq, batch, heads, head_dim]` (sbhd)
    /// tensor.
    pub fn dense(format: QkvFormat, batch: usize, seq: usize, heads: usize, head_dim: usize) -> Self {
        let hd = heads * head_dim;
        match format {
            QkvFormat::Bshd => Self { batch: seq * hd, row: hd, head: head_dim },
            QkvFormat::Sbhd => Self { batch: hd, row: batch * hd, head: head_dim },
        }
    }

    /// A `thd` tensor `[tokens, heads, head_dim]`: rows of `heads · head_dim`, no batch stride
    /// (each sequence starts at its token offset).
    pub fn tokens(heads: usize, head_dim: usize) -> Self {
        Self { batch: 0, row: heads * head_dim, head: head_dim }
    }

    /// The element index of channel `x` of head `h` at position `s` of sequence `b`.
    pub fn index(&self, b: usize, s: usize, h: usize, x: usize) -> usize {
        b * self.batch + s * self.row + h * self.head + x
    }

    /// One past the largest element index read for `batch` sequences of `seq` positions and
    /// `heads` heads of `head_dim` (each at least 1).
    pub(super) fn extent(&self, batch: usize, seq: usize, heads: usize, head_dim: usize) -> usize {
        self.index(batch.max(1) - 1, seq.max(1) - 1, heads.max(1) - 1, head_dim)
    }
}

/// One attention problem: `O = softmax(scale · Q · Kᵀ, masked) · V` per (sequence, query head),
/// with TE's vocabulary.
///
/// - q `[batch, sq, heads, head_dim]`, k `[batch, sk, groups, head_dim]`, v `[batch, sk, groups,
///   head_dim_v]`, the output `[batch, sq, heads, head_dim_v]` in bshd (sbhd swaps the first two
///   dims, thd packs the sequences: [`QkvLayout`]); query head `h` reads key/value head `h /
///   (heads / groups)` ([`AttentionShape::heads_per_group`]).
/// - The mask ([`AttentionShape::attends`]): TE's `attn_mask_type` with the sliding window
///   `(left, right)` resolved (−1 = unbounded; causal masks `(left, 0)`), `true` = masked out in
///   TE's boolean masks, i.e. `attends` false. Padding masks read the valid length of each
///   sequence, which comes with the call ([`AttentionShape::check_seq_lens`] on the host,
///   [`AttentionShape::check_tables`] for the kernels' `cu_seqlens`).
/// - Attention dropout on the probabilities after the softmax's normalization (`p` and the
///   Philox stream, [`DropoutParams`]), kept ones scaled by `1 / (1 − p)`; a backward takes the
///   forward's.
///
/// The fields are public; [`AttentionShape::validate`] checks a shape before use (every
/// launcher calls it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    /// Sequences.
    pub batch: usize,
    /// Queries per sequence (the padded length; `thd`: the longest sequence).
    pub sq: usize,
    /// Keys and values per sequence (the padded length; `thd`: the longest sequence).
    pub sk: usize,
    /// Query heads (TE `num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (TE `num_gqa_groups`, Hugging Face's `num_key_value_heads`): divides
    /// `heads`; `heads` is MHA, 1 is MQA.
    pub groups: usize,
    /// Channels per head of q and k.
    pub head_dim: usize,
    /// Channels per head of v and the output (TE's `kv_channels = (head_dim_qk, head_dim_v)`).
    pub head_dim_v: usize,
    /// Memory layout of q, k, v and the output (TE `qkv_format`).
    pub layout: QkvLayout,
    /// TE `attn_mask_type`.
    pub mask: AttnMaskType,
    /// The sliding window `(left, right)` around the mask's diagonal, resolved as
    /// [`AttnMaskType::window`] does TE's `window_size` (−1 = unbounded; `(-1, -1)` no window,
    /// causal masks `(left, 0)`); [`AttentionShape::with_mask`] resolves it.
    pub window: (i64, i64),
    /// `softmax_scale`: multiplies `Q · Kᵀ` before the softmax (finite, > 0).
    pub scale: f32,
    /// Attention dropout (`p` in `(0, 1]` and its Philox stream); `None`: none.
    pub dropout: Option<DropoutParams>,
}

impl AttentionShape {
    /// `batch` sequences of `(sq, sk)` queries and keys, `(heads, groups)` query and key/value
    /// heads of `head_dim` channels each (v too) in `layout`, with no mask and no window, scale
    /// `1 / √head_dim` (TE's default) and no dropout. The `with_*` methods set the rest.
    pub fn new(
        layout: QkvLayout,
        batch: usize,
        (sq, sk): (usize, usize),
        (heads, groups): (usize, usize),
        head_dim: usize,
    ) -> Self {
        Self {
            batch,
            sq,
            sk,
            heads,
            groups,
            head_dim,
            head_dim_v: head_dim,
            layout,
            mask: AttnMaskType::NoMask,
            window: (-1, -1),
            scale: 1.0 / (head_dim as f32).sqrt(),
            dropout: None,
        }
    }

    /// The attention of one generation step over a KV cache (the decode kernels,
    /// [`super::decode_attention`]): `batch` sequences of one query each (`sq = 1`), `heads`
    /// query heads over `groups` key/value heads of `head_dim`, over the first `seq_lens[b]` of
    /// `capacity` cached positions (`sk = capacity`, the `padding_causal_bottom_right` mask: the
    /// query sees every cached key of its sequence), the cache bshd `[batch, capacity, groups,
    /// head_dim]`, with `scale`.
    pub fn decode(batch: usize, heads: usize, groups: usize, head_dim: usize, capacity: usize, scale: f32) -> Self {
        Self { scale, ..Self::new(QkvLayout::Bshd, batch, (1, capacity), (heads, groups), head_dim) }
            .with_mask(AttnMaskType::PaddingCausalBottomRight, None)
    }

    /// With `mask` and TE's `window_size` resolved for it ([`AttnMaskType::window`]: `None` is no
    /// window, `(left, 0)` for causal masks). A window TE refuses is kept as given, so that
    /// [`AttentionShape::validate`] says why.
    pub fn with_mask(self, mask: AttnMaskType, window_size: Option<(i64, i64)>) -> Self {
        let window = match (mask.window(window_size), window_size) {
            (Ok(w), _) => w,
            (Err(_), Some(w)) => w,
            (Err(_), None) => (-1, -1),
        };
        Self { mask, window, ..self }
    }

    /// With `head_dim_v` channels per head of v and the output.
    pub fn with_head_dim_v(self, head_dim_v: usize) -> Self {
        Self { head_dim_v, ..self }
    }

    /// With `softmax_scale = scale`.
    pub fn with_scale(self, scale: f32) -> Self {
        Self { scale, ..self }
    }

    /// With attention dropout (`None`: none).
    pub fn with_dropout(self, dropout: Option<DropoutParams>) -> Self {
        Self { dropout, ..self }
    }

    /// Query heads per key/value head (`heads / groups`; 0 for a shape with no groups, which
    /// [`AttentionShape::validate`] refuses).
    pub fn heads_per_group(&self) -> usize {
        self.heads.checked_div(self.groups).unwrap_or(0)
    }

    /// Whether the diagonal of the causal mask and of the window is aligned bottom-right (`off =
    /// lk − lq`, [`AttnMaskType::is_bottom_right`]) rather than top-left.
    pub fn bottom_right(&self) -> bool {
        self.mask.is_bottom_right()
    }

    /// Elements of a dense (bshd / sbhd) q: `batch · sq · heads · head_dim`.
    pub fn q_len(&self) -> usize {
        self.batch * self.sq * self.heads * self.head_dim
    }

    /// Elements of a dense k: `batch · sk · groups · head_dim`.
    pub fn kv_len(&self) -> usize {
        self.batch * self.sk * self.groups * self.head_dim
    }

    /// Elements of a dense v: `batch · sk · groups · head_dim_v`.
    pub fn v_len(&self) -> usize {
        self.batch * self.sk * self.groups * self.head_dim_v
    }

    /// Elements of a dense output (and of its gradient): `batch · sq · heads · head_dim_v`.
    pub fn out_len(&self) -> usize {
        self.batch * self.sq * self.heads * self.head_dim_v
    }

    /// `[batch, heads, sq, sk]`: the scores and probabilities of every (sequence, query head),
    /// dense (the unfused backend's buffers; attention dropout draws element `i` of it).
    pub fn scores_shape(&self) -> [usize; 4] {
        [self.batch, self.heads, self.sq, self.sk]
    }

    /// f32 elements of `softmax_lse` (and of the backward's `delta`): `[batch, heads, sq]`.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads * self.sq
    }

    /// Strides of a tensor of `heads` heads of `width` over `seq` positions, dense in the layout.
    fn strides(&self, seq: usize, heads: usize, width: usize) -> HeadStrides {
        match self.layout.format() {
            Some(format) => HeadStrides::dense(format, self.batch, seq, heads, width),
            None => HeadStrides::tokens(heads, width),
        }
    }

    /// Strides of q (and dq), dense in the layout.
    pub fn q_strides(&self) -> HeadStrides {
        self.strides(self.sq, self.heads, self.head_dim)
    }

    /// Strides of k (and dk), dense in the layout.
    pub fn k_strides(&self) -> HeadStrides {
        self.strides(self.sk, self.groups, self.head_dim)
    }

    /// Strides of v (and dv), dense in the layout.
    pub fn v_strides(&self) -> HeadStrides {
        self.strides(self.sk, self.groups, self.head_dim_v)
    }

    /// Strides of the output (and of its gradient), dense in the layout.
    pub fn o_strides(&self) -> HeadStrides {
        self.strides(self.sq, self.heads, self.head_dim_v)
    }

    /// The valid `(queries, keys)` of one sequence: `(sq, sk)`, or for a sequence of `seq_len`
    /// valid positions (a padding mask's length, TE's one length for queries and keys) `(min(len,
    /// sq), min(len, sk))`. `thd` sequences take their lengths from `cu_seqlens` instead.
    pub fn valid_lengths(&self, seq_len: Option<usize>) -> (usize, usize) {
        match seq_len {
            Some(len) => (len.min(self.sq), len.min(self.sk)),
            None => (self.sq, self.sk),
        }
    }

    /// The keys query `i` of a sequence with `(lq, lk)` valid queries and keys attends: one
    /// contiguous range within `0..lk` (`0..0` when empty, e.g. for `i >= lq`). With `t = i + off` its diagonal (`off = lk − lq`
    /// bottom-right, else 0) and `(left, right)` the window: `j < lk`, `j <= t` for causal masks,
    /// `j >= t − left` and `j <= t + right` for the window's bounded sides (TE's
    /// `get_full_mask`; the kernels skip and mask the same keys).
    pub fn keys(&self, (lq, lk): (usize, usize), i: usize) -> Range<usize> {
        if i >= lq {
            return 0..0;
        }
        let off = if self.bottom_right() { lk as i64 - lq as i64 } else { 0 };
        let t = i as i64 + off;
        let (left, right) = self.window;
        let mut hi = lk as i64; // exclusive
        if self.mask.is_causal() {
            hi = hi.min(t + 1);
        }
        if right >= 0 {
            hi = hi.min(t + right + 1);
        }
        let lo = if left >= 0 { (t - left).max(0) } else { 0 };
        if lo < hi {
            lo as usize..hi as usize
        } else {
            0..0
        }
    }

    /// Whether query `i` of a sequence with `(lq, lk)` valid queries and keys
    /// ([`AttentionShape::valid_lengths`]) attends key `j` ([`AttentionShape::keys`]); `false` is
    /// TE's `true` = masked out. A query that attends no key gets a zero output.
    pub fn attends(&self, lengths: (usize, usize), i: usize, j: usize) -> bool {
        self.keys(lengths, i).contains(&j)
    }

    /// Checks the shape; errors name `op`, the caller.
    ///
    /// # Errors
    /// - [`Error::Shape`]: a size of 0 (`batch`, `sq`, `sk`, `heads`, `groups`, either head dim),
    ///   `groups` not dividing `heads`.
    /// - [`Error::Argument`]: `scale` not finite and positive; dropout `p` outside `(0, 1]`; a
    ///   window bound below −1, or a window the mask does not take (TE's `check_set_window_size`,
    ///   [`AttnMaskType::window`]: causal masks `(left, 0)`, the others `(-1, -1)` or both bounds
    ///   ≥ 0).
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let argument = |message: String| Err(Error::Argument { op, message });
        let sizes = [self.batch, self.sq, self.sk, self.heads, self.groups];
        if sizes.contains(&0) || self.heads % self.groups != 0 {
            return Err(Error::Shape {
                op,
                message: format!(
                    "batch, sq, sk, heads and groups must be ≥ 1 with groups dividing heads (each key/value head \
                     serves heads / groups query heads), got {}, {}, {}, {} and {}",
                    self.batch, self.sq, self.sk, self.heads, self.groups
                ),
            });
        }
        if self.head_dim == 0 || self.head_dim_v == 0 {
            return Err(Error::Shape {
                op,
                message: format!("head_dim and head_dim_v must be ≥ 1, got {} and {}", self.head_dim, self.head_dim_v),
            });
        }
        if !(self.scale.is_finite() && self.scale > 0.0) {
            return argument(format!("softmax_scale must be finite and > 0, got {}", self.scale));
        }
        if let Some(d) = self.dropout {
            if !(d.p > 0.0 && d.p <= 1.0) {
                return argument(format!("attention dropout p must be in (0, 1] (None for no dropout), got {}", d.p));
            }
        }
        match self.mask.window(Some(self.window)) {
            Ok(w) if w == self.window => Ok(()),
            Ok(w) => argument(format!(
                "attn_mask_type = {} resolves window {:?} to {w:?}: set the resolved window (AttentionShape::with_mask \
                 resolves TE's window_size)",
                self.mask.name(),
                self.window
            )),
            Err(message) => argument(message),
        }
    }

    /// Checks the host lengths of a call's sequences against the mask and the layout: padding
    /// masks on bshd / sbhd need `seq_lens`, the valid length of each sequence, at most `max(sq,
    /// sk)` ([`AttentionShape::valid_lengths`] caps it by each); other masks and `thd` (whose
    /// lengths are its `cu_seqlens`) take none.
    ///
    /// # Errors
    /// [`Error::Config`] (naming `op`) for `seq_lens` missing with a padding mask or given with
    /// another mask or `thd`; [`Error::Shape`] for `seq_lens` not one per sequence or a length above
    /// `max(sq, sk)`.
    pub fn check_seq_lens(&self, op: &'static str, seq_lens: Option<&[usize]>) -> Result<()> {
        let config = |message: String| Err(Error::Config { module: op, message });
        let needs = self.mask.is_padding() && self.layout != QkvLayout::Thd;
        let lens = match seq_lens {
            None if !needs => return Ok(()),
            None => {
                return config(format!(
                    "attn_mask_type = {} needs seq_lens: the valid length of each sequence of the batch",
                    self.mask.name()
                ))
            }
            Some(_) if self.layout == QkvLayout::Thd => {
                return config("thd reads the lengths of its sequences from cu_seqlens: pass no seq_lens".into())
            }
            Some(_) if !needs => {
                return config(format!(
                    "seq_lens are only read by padding masks; attn_mask_type = {} takes None (or configure padding / \
                     padding_causal)",
                    self.mask.name()
                ))
            }
            Some(lens) => lens,
        };
        let shape = |message: String| Err(Error::Shape { op, message });
        if lens.len() != self.batch {
            return shape(format!("seq_lens must hold one length per sequence ({}), got {}", self.batch, lens.len()));
        }
        let (sq, sk) = (self.sq, self.sk);
        if let Some((b, &len)) = lens.iter().enumerate().find(|(_, &len)| len > sq.max(sk)) {
            return shape(format!("seq_lens[{b}] = {len} exceeds the sequence lengths (sq = {sq}, sk = {sk})"));
        }
        Ok(())
    }

    /// Checks which sequence tables a kernel call passes against the layout and the mask:
    /// `cu_seqlens` (the valid lengths, i32 `[batch + 1]` prefix sums) and, for `thd`, the token
    /// offsets of each sequence. `thd` needs both; bshd / sbhd take `cu_seqlens` with a padding
    /// mask (and need them there), never token offsets.
    ///
    /// # Errors
    /// [`Error::Shape`] (naming `op`) for `thd` without both tables or token offsets on bshd /
    /// sbhd; [`Error::Config`] for `cu_seqlens` missing with a padding mask or given with another.
    pub fn check_tables(&self, op: &'static str, cu_seqlens: bool, offsets: bool) -> Result<()> {
        let shape = |message: String| Err(Error::Shape { op, message });
        let config = |message: String| Err(Error::Config { module: op, message });
        match self.layout {
            QkvLayout::Thd if !(cu_seqlens && offsets) => shape(
                "thd needs cu_seqlens and the token offsets of each sequence (cu_seqlens_*_padded, or the \
                 cu_seqlens themselves)"
                    .into(),
            ),
            QkvLayout::Thd => Ok(()),
            _ if offsets => shape(format!(
                "token offsets place the sequences of thd; q, k and v are {}: set the layout to thd or pass no \
                 offsets",
                self.layout.name()
            )),
            _ if self.mask.is_padding() && !cu_seqlens => config(format!(
                "attn_mask_type = {} needs cu_seqlens: the valid length of each sequence",
                self.mask.name()
            )),
            _ if !self.mask.is_padding() && cu_seqlens => config(format!(
                "cu_seqlens are read by padding masks (and thd); attn_mask_type = {} takes none (or configure a \
                 padding mask)",
                self.mask.name()
            )),
            _ => Ok(()),
        }
    }

    /// The fused 16-bit kernels of this shape ([`FlashAttnSpec`]: forward or backward, `dtype`
    /// the bf16/f16 of q, k, v and the output, for `arch`): the tiles of its head dims
    /// ([`FlashAttnSpec::with_head_dim_v`]) and its dropout variant.
    pub fn flash_spec(&self, direction: Direction, dtype: DType, arch: Arch) -> FlashAttnSpec {
        FlashAttnSpec::new(direction, dtype, self.head_dim, arch)
            .with_head_dim_v(self.head_dim_v)
            .with_dropout(self.dropout.is_some())
    }

    /// The FP8 forward of this shape ([`FlashAttnSpec::fp8_forward`], `dtype` the 16-bit type of
    /// the call), with its dropout variant.
    pub fn flash_fp8_forward_spec(&self, dtype: DType, arch: Arch) -> FlashAttnSpec {
        FlashAttnSpec::fp8_forward(dtype, self.head_dim, arch).with_dropout(self.dropout.is_some())
    }

    /// The FP8 casts of this shape's operands: the `_quantize` entry point of the FP8 forward
    /// spec without dropout (the casts draw no random numbers, so every call shares one module).
    pub fn flash_fp8_quantize_spec(&self, dtype: DType, arch: Arch) -> FlashAttnSpec {
        FlashAttnSpec::fp8_forward(dtype, self.head_dim, arch)
    }

    /// The FP8 backward of this shape ([`FlashAttnSpec::fp8_backward`], `dtype` the 16-bit type of
    /// the gradients; dO and dS in E5M2 with `grad_e5m2`).
    pub fn flash_fp8_backward_spec(&self, dtype: DType, arch: Arch, grad_e5m2: bool) -> FlashAttnSpec {
        FlashAttnSpec::fp8_backward(dtype, self.head_dim, arch, grad_e5m2)
    }

    /// The decode kernels of this shape ([`DecodeAttnSpec`], `dtype` that of q, the cache and the
    /// output).
    pub fn decode_spec(&self, dtype: DType, arch: Arch) -> DecodeAttnSpec {
        DecodeAttnSpec::new(dtype, self.head_dim, arch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use AttnMaskType::*;

    const OP: &str = "test";

    fn shape() -> AttentionShape {
        AttentionShape::new(QkvLayout::Bshd, 2, (3, 5), (4, 2), 8)
    }

    fn message(r: Result<()>) -> String {
        match r {
            Err(e) => e.to_string(),
            Ok(()) => panic!("expected an error"),
        }
    }

    #[test]
    fn derived_quantities() {
        let s = shape().with_head_dim_v(6);
        assert_eq!((s.heads_per_group(), s.scale), (2, 1.0 / 8f32.sqrt()));
        assert_eq!(
            (s.q_len(), s.kv_len(), s.v_len(), s.out_len()),
            (2 * 3 * 4 * 8, 2 * 5 * 2 * 8, 2 * 5 * 2 * 6, 2 * 3 * 4 * 6)
        );
        assert_eq!((s.scores_shape(), s.lse_len()), ([2, 4, 3, 5], 2 * 4 * 3));
        assert_eq!(AttentionShape { groups: 0, ..s }.heads_per_group(), 0, "no division by zero");
        assert_eq!(s.q_strides(), HeadStrides { batch: 3 * 32, row: 32, head: 8 });
        assert_eq!(s.v_strides(), HeadStrides { batch: 5 * 12, row: 12, head: 6 });
        let sbhd = AttentionShape { layout: QkvLayout::Sbhd, ..s };
        assert_eq!(sbhd.k_strides(), HeadStrides { batch: 16, row: 2 * 16, head: 8 });
        assert_eq!(sbhd.o_strides(), HeadStrides { batch: 24, row: 2 * 24, head: 6 });
        let thd = AttentionShape { layout: QkvLayout::Thd, ..s };
        assert_eq!(
            (thd.q_strides(), thd.v_strides()),
            (HeadStrides::tokens(4, 8), HeadStrides { batch: 0, row: 12, head: 6 })
        );
        assert_eq!(sbhd.q_strides().index(1, 2, 3, 4), 32 + 2 * 64 + 3 * 8 + 4);
        assert_eq!(s.q_strides().extent(2, 3, 4, 8), s.q_len());
        assert_eq!((QkvLayout::from(QkvFormat::Sbhd), QkvLayout::Thd.format()), (QkvLayout::Sbhd, None));
        assert_eq!(QkvLayout::Bshd.name(), "bshd");
    }

    #[test]
    fn with_mask_resolves_te_window_size() {
        assert_eq!(shape().with_mask(Causal, None).window, (-1, 0));
        assert_eq!(shape().with_mask(PaddingCausal, Some((-1, -1))).window, (-1, 0));
        assert_eq!(shape().with_mask(Padding, Some((3, 5))).window, (3, 5));
        assert_eq!(shape().with_mask(NoMask, None).window, (-1, -1));
        // A window TE refuses stays as given: validate says why.
        let bad = shape().with_mask(Causal, Some((4, 2)));
        assert_eq!(bad.window, (4, 2));
        assert!(message(bad.validate(OP)).contains("window_size must be (left, 0)"));
        let d = AttentionShape::decode(3, 8, 2, 64, 100, 0.125);
        assert_eq!(
            (d.sq, d.sk, d.mask, d.window, d.layout, d.scale),
            (1, 100, PaddingCausalBottomRight, (-1, 0), QkvLayout::Bshd, 0.125)
        );
        d.validate(OP).unwrap();
    }

    #[test]
    fn validation_errors_are_typed_and_say_what_to_change() {
        shape().validate(OP).unwrap();
        for (bad, says) in [
            (AttentionShape { groups: 3, ..shape() }, "groups dividing heads"),
            (AttentionShape { groups: 0, ..shape() }, "got 2, 3, 5, 4 and 0"),
            (AttentionShape { sk: 0, ..shape() }, "must be ≥ 1"),
        ] {
            let e = bad.validate(OP).unwrap_err();
            assert!(matches!(e, Error::Shape { op: OP, .. }) && e.to_string().contains(says), "{e}");
        }
        let e = shape().with_head_dim_v(0).validate(OP).unwrap_err();
        assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains("head_dim_v must be ≥ 1"), "{e}");
        let drop = |p| Some(DropoutParams { p, seed: 1, offset: 2 });
        shape().with_dropout(drop(1.0)).validate(OP).unwrap();
        for (bad, says) in [
            (shape().with_scale(0.0), "softmax_scale"),
            (shape().with_scale(f32::NAN), "softmax_scale"),
            (shape().with_dropout(drop(0.0)), "dropout p must be in (0, 1]"),
            (shape().with_dropout(drop(1.5)), "dropout p"),
            (AttentionShape { window: (-2, 0), ..shape() }, "≥ 0, or −1"),
            (AttentionShape { window: (-1, 0), ..shape() }, "set attn_mask_type = causal"),
            (AttentionShape { window: (-1, 4), ..shape().with_mask(Padding, None) }, "one-sided"),
            (
                AttentionShape { window: (-1, -1), ..shape().with_mask(CausalBottomRight, None) },
                "resolves window (-1, -1) to (-1, 0)",
            ),
        ] {
            let e = bad.validate(OP).unwrap_err();
            assert!(matches!(e, Error::Argument { op: OP, .. }) && e.to_string().contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn seq_lens_and_tables_follow_the_mask_and_layout() {
        let padded = shape().with_mask(PaddingCausal, None);
        padded.check_seq_lens(OP, Some(&[5, 0])).unwrap();
        shape().check_seq_lens(OP, None).unwrap();
        let config = |r: Result<()>, says: &str| match r {
            Err(Error::Config { module: OP, message }) => assert!(message.contains(says), "{message}"),
            other => panic!("expected a config error saying {says}, got {other:?}"),
        };
        config(padded.check_seq_lens(OP, None), "needs seq_lens");
        config(shape().check_seq_lens(OP, Some(&[1, 1])), "only read by padding masks");
        let thd = AttentionShape { layout: QkvLayout::Thd, ..padded };
        thd.check_seq_lens(OP, None).unwrap();
        config(thd.check_seq_lens(OP, Some(&[1, 1])), "cu_seqlens");
        let e = padded.check_seq_lens(OP, Some(&[3])).unwrap_err();
        assert!(
            matches!(e, Error::Shape { .. }) && e.to_string().contains("one length per sequence (2), got 1"),
            "{e}"
        );
        let e = padded.check_seq_lens(OP, Some(&[3, 6])).unwrap_err();
        assert!(e.to_string().contains("seq_lens[1] = 6 exceeds"), "{e}");

        padded.check_tables(OP, true, false).unwrap();
        shape().check_tables(OP, false, false).unwrap();
        thd.check_tables(OP, true, true).unwrap();
        config(padded.check_tables(OP, false, false), "needs cu_seqlens");
        config(shape().check_tables(OP, true, false), "read by padding masks");
        for (s, cu, offsets, says) in [
            (thd, true, false, "thd needs"),
            (thd, false, false, "thd needs"),
            (shape(), true, true, "set the layout to thd"),
        ] {
            let e = s.check_tables(OP, cu, offsets).unwrap_err();
            assert!(matches!(e, Error::Shape { .. }) && e.to_string().contains(says), "{e}");
        }
    }

    /// TE's diagonals and windows on a 3 × 5 sequence (sq < sk, as in decoding), and the padding
    /// lengths capped by sq and sk.
    #[test]
    fn attends_follows_te() {
        let visible = |mask, window, lengths: (usize, usize), i| -> Vec<usize> {
            let s = AttentionShape::new(QkvLayout::Bshd, 1, (3, 5), (1, 1), 1).with_mask(mask, window);
            s.validate(OP).unwrap();
            (0..5).filter(|&j| s.attends(lengths, i, j)).collect()
        };
        assert_eq!(visible(Causal, None, (3, 5), 0), [0]);
        assert_eq!(visible(CausalBottomRight, None, (3, 5), 0), [0, 1, 2]);
        assert_eq!(visible(CausalBottomRight, None, (3, 5), 2), [0, 1, 2, 3, 4]);
        assert_eq!(visible(CausalBottomRight, Some((1, 0)), (3, 5), 2), [3, 4]);
        assert_eq!(visible(Causal, Some((1, 0)), (3, 5), 2), [1, 2]);
        assert_eq!(visible(NoMask, Some((0, 1)), (3, 5), 0), [2, 3], "no_mask windows are bottom-right aligned");
        assert_eq!(visible(NoMask, None, (3, 5), 1), [0, 1, 2, 3, 4]);
        // Padding lengths 2: the diagonal ends at the last valid key; queries past 2 see nothing.
        let s = AttentionShape::new(QkvLayout::Bshd, 1, (3, 5), (1, 1), 1);
        assert_eq!(s.valid_lengths(Some(2)), (2, 2));
        assert_eq!(s.valid_lengths(Some(4)), (3, 4));
        assert_eq!(s.valid_lengths(None), (3, 5));
        assert_eq!(visible(PaddingCausalBottomRight, None, (2, 2), 1), [0, 1]);
        assert_eq!(visible(PaddingCausalBottomRight, None, (2, 2), 2), Vec::<usize>::new());
        assert_eq!(visible(PaddingCausal, None, (3, 3), 0), [0]);
        assert_eq!(visible(Padding, None, (0, 0), 0), Vec::<usize>::new(), "a sequence of length 0");
        // sq > sk bottom-right: the first queries see no key.
        let s = AttentionShape::new(QkvLayout::Bshd, 1, (5, 3), (1, 1), 1).with_mask(CausalBottomRight, None);
        assert_eq!((s.keys((5, 3), 1), s.keys((5, 3), 2), s.keys((5, 3), 4)), (0..0, 0..1, 0..3));
    }

    /// `keys` is TE's elementwise rule (`get_full_mask`) for every mask, window and length pair.
    #[test]
    fn keys_is_the_elementwise_rule() {
        for (sq, sk) in [(3, 6), (6, 3), (4, 4), (1, 7)] {
            for mask in AttnMaskType::ALL {
                for window in [None, Some((1, 0)), Some((0, 0)), Some((2, 1)), Some((-1, -1)), Some((0, 3))] {
                    let s = AttentionShape::new(QkvLayout::Sbhd, 1, (sq, sk), (1, 1), 1).with_mask(mask, window);
                    if s.validate(OP).is_err() {
                        continue;
                    }
                    for lengths in [(sq, sk), (sq.min(2), sk.min(2)), (0, 0), (sq, 1)] {
                        let (lq, lk) = lengths;
                        for i in 0..sq {
                            let t = i as i64 + if mask.is_bottom_right() { lk as i64 - lq as i64 } else { 0 };
                            let (left, right) = s.window;
                            for j in 0..sk {
                                let jj = j as i64;
                                let want = i < lq
                                    && j < lk
                                    && !(mask.is_causal() && jj > t
                                        || left >= 0 && jj < t - left
                                        || right >= 0 && jj > t + right);
                                assert_eq!(
                                    s.attends(lengths, i, j),
                                    want,
                                    "{} {window:?} {lengths:?} ({i}, {j})",
                                    mask.name()
                                );
                            }
                            let keys = s.keys(lengths, i);
                            assert!(keys.end <= lk && (keys.start < keys.end || keys == (0..0)), "{keys:?}");
                        }
                    }
                }
            }
        }
    }

    /// The specs are those the launchers built before the shape held their inputs.
    #[test]
    fn specs_follow_the_shape() {
        let s = AttentionShape::new(QkvLayout::Bshd, 1, (64, 64), (2, 2), 128).with_head_dim_v(64);
        let want = FlashAttnSpec::new(Direction::Bwd, DType::BF16, 128, Arch::Sm90a).with_head_dim_v(64);
        assert_eq!(s.flash_spec(Direction::Bwd, DType::BF16, Arch::Sm90a), want);
        let drop = s.with_dropout(Some(DropoutParams { p: 0.1, seed: 0, offset: 0 }));
        assert_eq!(drop.flash_spec(Direction::Bwd, DType::BF16, Arch::Sm90a), want.with_dropout(true));
        let fp8 = FlashAttnSpec::fp8_forward(DType::F16, 128, Arch::Sm90a);
        assert_eq!(drop.flash_fp8_forward_spec(DType::F16, Arch::Sm90a), fp8.with_dropout(true));
        assert_eq!(drop.flash_fp8_quantize_spec(DType::F16, Arch::Sm90a), fp8);
        let bwd = FlashAttnSpec::fp8_backward(DType::BF16, 128, Arch::Sm90a, true);
        assert_eq!(s.flash_fp8_backward_spec(DType::BF16, Arch::Sm90a, true), bwd);
        assert_eq!(s.decode_spec(DType::BF16, Arch::Sm89), DecodeAttnSpec::new(DType::BF16, 128, Arch::Sm89));
    }
}
