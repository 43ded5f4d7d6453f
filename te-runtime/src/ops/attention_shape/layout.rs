//! The memory layouts of the attention family: TE's `qkv_format` ([`QkvLayout`]) and where the
//! heads of one tensor sit ([`HeadStrides`]).

use te_codegen::spec::QkvFormat;

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
    pub(crate) fn extent(&self, batch: usize, seq: usize, heads: usize, head_dim: usize) -> usize {
        self.index(batch.max(1) - 1, seq.max(1) - 1, heads.max(1) - 1, head_dim)
    }
}
