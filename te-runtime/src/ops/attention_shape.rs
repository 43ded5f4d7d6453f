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

mod layout;
mod mask;
mod validate;

pub use layout::{HeadStrides, QkvLayout};

use super::dropout::DropoutParams;
use te_codegen::spec::{AttnMaskType, DecodeAttnSpec, Direction, FlashAttnSpec};
use te_codegen::{Arch, DType};

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

    /// With the sliding window `(left, 0)` of a causal mask (transformers' `sliding_window = left
    /// + 1`), or none: the decode kernels take this one window kind.
    pub fn with_sliding_window(self, window: Option<(i64, i64)>) -> Self {
        match window {
            Some(w) => self.with_mask(self.mask, Some(w)),
            None => self,
        }
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
            .with_q_per_block(DecodeAttnSpec::q_per_block_for(self.heads, self.groups))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Result;
    use te_codegen::spec::QkvFormat;
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
