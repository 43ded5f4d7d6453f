//! [`DecoderKvCache`]: the keys and values of every layer for a batch of sequences of their own
//! lengths (after RoPE, so a cached key never moves), grown as tokens come. A sliding-window
//! layer keeps only the `sliding_window − 1` newest tokens of each sequence, all a later query can
//! see besides itself; a global layer keeps every token.

use crate::decoder::{DecoderConfig, DecoderError, DecoderResult};
use te_codegen::spec::AttnMaskType;
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};

/// One sequence's keys and values in one layer: `[kept, groups · head_dim]` each, the newest
/// last.
#[derive(Debug, Clone, Default)]
pub(super) struct SeqKv {
    k: Vec<f32>,
    v: Vec<f32>,
}

/// What one layer's attention needs besides q, k and v.
#[derive(Debug, Clone, Copy)]
pub(super) struct AttentionParams {
    pub heads: usize,
    pub groups: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// TE's `window_size` `(left, 0)` of a sliding layer.
    pub window: Option<(i64, i64)>,
    pub softcap: Option<f32>,
}

impl SeqKv {
    /// Appends `s` new tokens' keys and values (`k`, `v`: `[s, groups · head_dim]`, RoPE applied)
    /// and returns the attention of their queries `q` (`[s, heads · head_dim]`) over the kept
    /// tokens and themselves, causal and bottom-right aligned (new token `i` is at position
    /// `kept + i` of the keys), windowed for a sliding layer: `[s, heads · head_dim]`. Then keeps
    /// the newest `keep` tokens (all when `None`). Runs [`te_reference::attention::forward`] (or
    /// its soft-capped form).
    pub fn attend(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        p: &AttentionParams,
        keep: Option<usize>,
    ) -> DecoderResult<Vec<f32>> {
        let row = p.groups * p.head_dim;
        let s = q.len() / (p.heads * p.head_dim);
        self.k.extend_from_slice(k);
        self.v.extend_from_slice(v);
        let keys = self.k.len() / row;
        let shape = AttentionShape::new(QkvLayout::Bshd, 1, (s, keys), (p.heads, p.groups), p.head_dim)
            .with_scale(p.scale)
            .with_mask(AttnMaskType::CausalBottomRight, p.window);
        shape.validate("DecoderRef attention")?;
        let out = match p.softcap {
            Some(cap) => te_reference::attention::forward_softcapped(&shape, None, q, &self.k, &self.v, cap).out,
            None => te_reference::attention::forward(&shape, None, q, &self.k, &self.v).out,
        };
        if let Some(keep) = keep.filter(|&n| keys > n) {
            let drop = (keys - keep) * row;
            self.k.drain(..drop);
            self.v.drain(..drop);
        }
        Ok(out)
    }

    /// Tokens kept.
    fn kept(&self, row: usize) -> usize {
        self.k.len() / row.max(1)
    }
}

/// The KV cache of a batch (see the module docs), made by [`super::DecoderRef::kv_cache`] and
/// filled by [`super::DecoderRef::forward_cached`]. Memory: per global layer `2 · len ·
/// groups · head_dim` f32 per sequence, per sliding layer at most `2 · (window − 1) · groups ·
/// head_dim`.
#[derive(Debug, Clone)]
pub struct DecoderKvCache {
    /// Tokens seen per sequence (the position of its next token).
    lens: Vec<usize>,
    /// `[layer][sequence]`.
    layers: Vec<Vec<SeqKv>>,
    /// Tokens kept per layer: `Some(window − 1)` for a sliding layer.
    keep: Vec<Option<usize>>,
    /// `groups · head_dim`.
    row: usize,
}

impl DecoderKvCache {
    /// An empty cache for `batch` sequences of a model of `cfg`.
    pub(super) fn new(cfg: &DecoderConfig, batch: usize) -> Self {
        let keep = (0..cfg.num_layers).map(|l| cfg.layer_window(l).map(|(left, _)| left as usize)).collect();
        Self {
            lens: vec![0; batch],
            layers: (0..cfg.num_layers).map(|_| vec![SeqKv::default(); batch]).collect(),
            keep,
            row: cfg.num_gqa_groups * cfg.head_dim,
        }
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.lens.len()
    }

    /// Tokens seen by each sequence (the position of its next token).
    pub fn lens(&self) -> &[usize] {
        &self.lens
    }

    /// Tokens layer `l` holds for sequence `j` (`None` out of range): the sequence's length for
    /// a global layer, at most `sliding_window − 1` for a sliding one.
    pub fn kept(&self, l: usize, j: usize) -> Option<usize> {
        self.layers.get(l)?.get(j).map(|s| s.kept(self.row))
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(|s| 4 * (s.k.len() + s.v.len())).sum()
    }

    /// Forgets every token (new sequences start at position 0).
    pub fn clear(&mut self) {
        self.lens.iter_mut().for_each(|n| *n = 0);
        self.layers.iter_mut().flatten().for_each(|s| *s = SeqKv::default());
    }

    /// Checks that a model of `cfg` made it.
    pub(super) fn check(&self, cfg: &DecoderConfig) -> DecoderResult<()> {
        let fresh = Self::new(cfg, 0);
        if self.layers.len() != fresh.layers.len() || self.keep != fresh.keep || self.row != fresh.row {
            return Err(DecoderError::input(
                "the KV cache was made by a model of another shape: make it with this model's kv_cache",
            ));
        }
        Ok(())
    }

    /// Layer `l`'s sequences and how many tokens it keeps.
    pub(super) fn layer_mut(&mut self, l: usize) -> (&mut [SeqKv], Option<usize>) {
        (&mut self.layers[l], self.keep[l])
    }

    /// Counts the new tokens of each sequence once every layer has attended.
    pub(super) fn advance(&mut self, new: &[usize]) {
        self.lens.iter_mut().zip(new).for_each(|(n, s)| *n += s);
    }
}
