//! `thd`: variable-length sequences packed one after another (TE `qkv_format = "thd"`), with
//! TE's `cu_seqlens_q` / `cu_seqlens_kv` and their `_padded` variants, checked on the host before
//! they reach the kernels.

use super::{
    backend, check_dtype, check_shape, fused, high, AttentionBackend, AttentionCtx, DType, DotProductAttention, Inputs,
    Saved, MODULE,
};
use te_runtime::ops::attention_shape::{AttentionShape, QkvLayout};
use te_runtime::{Error, Result, Tensor};

/// The sequences of a `thd` call: host prefix sums of `batch + 1` entries starting at 0 (TE's
/// `cu_seqlens_q`, `cu_seqlens_kv`, `cu_seqlens_q_padded`, `cu_seqlens_kv_padded`).
///
/// Sequence `b` has `cu_seqlens_q[b + 1] − cu_seqlens_q[b]` queries and `cu_seqlens_kv[b + 1] −
/// cu_seqlens_kv[b]` keys. Without the `_padded` offsets its tokens start at `cu_seqlens_*[b]`;
/// with them at `cu_seqlens_*_padded[b]`, each padded slot at least as long as its sequence
/// (tokens between the sequences get zero outputs and gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThdSeqlens<'a> {
    /// Query (and output) lengths as prefix sums.
    pub cu_seqlens_q: &'a [usize],
    /// Key and value lengths as prefix sums.
    pub cu_seqlens_kv: &'a [usize],
    /// Where each sequence's queries start, when padding separates them.
    pub cu_seqlens_q_padded: Option<&'a [usize]>,
    /// Where each sequence's keys and values start, when padding separates them.
    pub cu_seqlens_kv_padded: Option<&'a [usize]>,
}

impl<'a> ThdSeqlens<'a> {
    /// Sequences packed without padding between them.
    pub fn new(cu_seqlens_q: &'a [usize], cu_seqlens_kv: &'a [usize]) -> Self {
        Self { cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded: None, cu_seqlens_kv_padded: None }
    }
}

/// A checked [`ThdSeqlens`] as the kernels take it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Checked {
    pub batch: usize,
    /// The longest query and key sequences.
    pub max_q: usize,
    pub max_kv: usize,
    /// `cu_seqlens_q`, `cu_seqlens_kv`, and the token offsets of q and kv, as i32.
    pub cu: [Vec<i32>; 2],
    pub offsets: [Vec<i32>; 2],
}

fn shape_error<T>(message: String) -> Result<T> {
    Err(Error::Shape { op: MODULE, message })
}

/// Checks one prefix-sum table: `batch + 1` entries from 0, not decreasing, the last within
/// `tokens`; returns it as i32 and its longest step.
fn prefix(name: &str, cu: &[usize], batch: usize, tokens: usize, first_zero: bool) -> Result<(Vec<i32>, usize)> {
    if cu.len() != batch + 1 {
        return shape_error(format!("{name} must hold batch + 1 = {} entries, got {}", batch + 1, cu.len()));
    }
    if first_zero && cu[0] != 0 {
        return shape_error(format!("{name} must start at 0, got {}", cu[0]));
    }
    if let Some(b) = (0..batch).find(|&b| cu[b + 1] < cu[b]) {
        return shape_error(format!(
            "{name} must not decrease (prefix sums of the sequence lengths): entry {} is {} after {}",
            b + 1,
            cu[b + 1],
            cu[b]
        ));
    }
    if cu[batch] > tokens {
        return shape_error(format!(
            "{name} ends at {} tokens but the tensor holds {tokens}: the lengths and the tensor disagree",
            cu[batch]
        ));
    }
    let as_i32 = cu.iter().map(|&v| i32::try_from(v)).collect::<std::result::Result<Vec<_>, _>>().or_else(|_| {
        shape_error(format!("{name} holds offsets beyond i32 (TE's cu_seqlens dtype): split the batch"))
    })?;
    let longest = cu.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    Ok((as_i32, longest))
}

impl ThdSeqlens<'_> {
    /// Checks the tables against the `tokens_q` rows of q and `tokens_kv` of k and v.
    ///
    /// # Errors
    /// [`Error::Shape`] for tables of different lengths or fewer than 2 entries, not starting at
    /// 0, decreasing, ending past the tensors' tokens, beyond i32, or a padded slot shorter than
    /// its sequence.
    pub(super) fn check(&self, tokens_q: usize, tokens_kv: usize) -> Result<Checked> {
        let batch = self.cu_seqlens_q.len().saturating_sub(1);
        if batch == 0 {
            return shape_error(format!(
                "cu_seqlens_q must hold batch + 1 ≥ 2 entries (0, then the running total of each sequence's length), \
                 got {:?}",
                self.cu_seqlens_q
            ));
        }
        let (cu_q, max_q) = prefix("cu_seqlens_q", self.cu_seqlens_q, batch, tokens_q, true)?;
        let (cu_kv, max_kv) = prefix("cu_seqlens_kv", self.cu_seqlens_kv, batch, tokens_kv, true)?;
        let padded = |name: &str, table: Option<&[usize]>, cu: &[usize], tokens: usize| -> Result<Vec<i32>> {
            let Some(table) = table else {
                return prefix(name, cu, batch, tokens, true).map(|p| p.0);
            };
            let (offsets, _) = prefix(name, table, batch, tokens, false)?;
            if let Some(b) = (0..batch).find(|&b| table[b + 1] - table[b] < cu[b + 1] - cu[b]) {
                return shape_error(format!(
                    "{name}: sequence {b} has {} tokens but its padded slot only {}",
                    cu[b + 1] - cu[b],
                    table[b + 1] - table[b]
                ));
            }
            Ok(offsets)
        };
        let off_q = padded("cu_seqlens_q_padded", self.cu_seqlens_q_padded, self.cu_seqlens_q, tokens_q)?;
        let off_kv = padded("cu_seqlens_kv_padded", self.cu_seqlens_kv_padded, self.cu_seqlens_kv, tokens_kv)?;
        Ok(Checked { batch, max_q, max_kv, cu: [cu_q, cu_kv], offsets: [off_q, off_kv] })
    }
}

impl DotProductAttention {
    /// Attention over variable-length sequences packed one after another (TE `qkv_format =
    /// "thd"`): q `[total_q, h, d]`, k and v `[total_kv, g, d]` (bf16 or f16), sequence `b`
    /// at the tokens `seqs` gives it ([`ThdSeqlens`]). Every query attends the keys of its own
    /// sequence under the mask and window of the configuration, the diagonal placed by the
    /// sequence's own lengths; the padding and non-padding mask types act alike here (the
    /// lengths come from `cu_seqlens`). `qkv_format` of the configuration is not read.
    ///
    /// Output: `[total_q, h · d]`, q's dtype; tokens no sequence owns (padding between padded
    /// slots) are zeros, and so are their gradients. [`DotProductAttention::backward`] takes the
    /// context.
    ///
    /// # Errors
    /// - [`Error::Config`]: the fused backend cannot run the call (dtype, head_dim, attention
    ///   dropout in training, or the unfused backend forced): `thd` has no unfused backend, as
    ///   in TE.
    /// - [`Error::DType`] / [`Error::Shape`]: q, k, v not 3-D with the configured heads and
    ///   head_dim, of different dtypes, or `seqs` not matching them ([`ThdSeqlens`]'s rules).
    /// - Kernel failures.
    pub fn forward_thd(
        &mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqs: ThdSeqlens<'_>,
    ) -> Result<(Tensor, AttentionCtx)> {
        check_dtype(MODULE, "q", q, DType::is_high_precision, "f32, bf16 or f16")?;
        let same = format!("{} (the dtype of `q`)", q.dtype());
        check_dtype(MODULE, "k", k, |d| d == q.dtype(), &same)?;
        check_dtype(MODULE, "v", v, |d| d == q.dtype(), &same)?;
        let (h, g, d, dv) =
            (self.cfg.num_attention_heads, self.cfg.groups(), self.cfg.kv_channels, self.cfg.kv_channels_v());
        let rows = |name: &str, t: &Tensor, heads: usize, w: usize| -> Result<usize> {
            match *t.shape() {
                [n, th, tw] if th == heads && tw == w => Ok(n),
                _ => Err(Error::Shape {
                    op: MODULE,
                    message: format!(
                        "thd `{name}` must be [tokens, {heads}, {w}] ({heads} heads of {w} channels), got {:?}",
                        t.shape()
                    ),
                }),
            }
        };
        let (tokens_q, tokens_kv) = (rows("q", q, h, d)?, rows("k", k, g, d)?);
        check_shape(MODULE, "v", v, &[tokens_kv, g, dv])?;
        let c = seqs.check(tokens_q, tokens_kv)?;
        let backend = backend::select(&self.cfg, q.dtype(), self.dev.arch(), self.training)?;
        if backend != AttentionBackend::Fused {
            let why =
                te_runtime::ops::flash_attention::unsupported_reason(self.dev.arch(), q.dtype(), d, dv, self.training)
                    .unwrap_or_else(|| {
                        "the unfused backend is configured or the environment turns the fused one off".into()
                    });
            return Err(Error::Config {
                module: MODULE,
                message: format!(
                    "thd runs on the fused backend only (as in TE) and it cannot take this call: {why}; use bf16/f16, \
                     head_dim in {:?}, or pad the sequences into bshd/sbhd",
                    te_codegen::spec::FLASH_HEAD_DIMS
                ),
            });
        }
        // The longest sequences as sq and sk (at least 1: a batch of empty sequences still
        // launches), the lengths from the tables.
        let shape =
            AttentionShape { layout: QkvLayout::Thd, ..self.cfg.shape(c.batch, (c.max_q.max(1), c.max_kv.max(1))) };
        shape.validate(MODULE)?;
        let drop = self.next_dropout();
        let shape = shape.with_dropout((drop.p > 0.0).then_some(drop));
        let inputs = Inputs::Thd([q.clone(), k.clone(), v.clone()]);
        let fp8 = self.scaling.forward(&self.dev, &inputs, &shape, self.training, shape.dropout.is_some())?;
        self.log_backend(backend, fp8.is_some(), &shape, q.dtype());
        let seqs = fused::DeviceSeqlens::upload(&self.dev, [&c.cu[0], &c.cu[1]], Some([&c.offsets[0], &c.offsets[1]]))?;
        let out_shape = vec![tokens_q, h * dv];
        let (out, saved) = fused::forward(
            &self.dev,
            &shape,
            Some(seqs),
            inputs.fused(&shape)?,
            &out_shape,
            fp8.as_ref().map(|f| fused::Fp8Call { quantizer: &*f.quantizer, keep: f.backward.is_some(), out: None }),
        )?;
        let out = high(out)?;
        let ctx = AttentionCtx {
            module_id: self.id,
            shape,
            inputs,
            packed: false,
            out_shape,
            saved: Saved::Fused(Box::new(saved)),
            fp8: fp8.is_some(),
            fp8_backward: fp8.and_then(|f| f.backward),
        };
        Ok((out, ctx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<Checked>) -> String {
        match r {
            Err(Error::Shape { message, .. }) => message,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn tables_are_checked_and_converted() {
        let c = ThdSeqlens::new(&[0, 5, 5, 12], &[0, 3, 9, 9]).check(12, 9).unwrap();
        assert_eq!((c.batch, c.max_q, c.max_kv), (3, 7, 6));
        assert_eq!(c.cu, [vec![0, 5, 5, 12], vec![0, 3, 9, 9]]);
        assert_eq!(c.offsets, c.cu, "no padding: sequences start at their cu_seqlens");
        let padded = ThdSeqlens {
            cu_seqlens_q_padded: Some(&[0, 8, 8, 16]),
            cu_seqlens_kv_padded: Some(&[0, 4, 12, 12]),
            ..ThdSeqlens::new(&[0, 5, 5, 12], &[0, 3, 9, 9])
        };
        assert_eq!(padded.check(16, 12).unwrap().offsets, [vec![0, 8, 8, 16], vec![0, 4, 12, 12]]);
    }

    #[test]
    fn bad_tables_say_what_is_wrong() {
        let e = message(ThdSeqlens::new(&[0, 5, 3], &[0, 1, 2]).check(10, 10));
        assert!(e.contains("must not decrease") && e.contains("entry 2 is 3 after 5"), "{e}");
        let e = message(ThdSeqlens::new(&[1, 5], &[0, 1]).check(10, 10));
        assert!(e.contains("must start at 0"), "{e}");
        let e = message(ThdSeqlens::new(&[0, 5], &[0, 1, 2]).check(10, 10));
        assert!(e.contains("cu_seqlens_kv must hold batch + 1 = 2 entries"), "{e}");
        let e = message(ThdSeqlens::new(&[0, 11], &[0, 1]).check(10, 10));
        assert!(e.contains("ends at 11 tokens but the tensor holds 10"), "{e}");
        let e = message(ThdSeqlens::new(&[0], &[0]).check(10, 10));
        assert!(e.contains("≥ 2 entries"), "{e}");
        let short = ThdSeqlens { cu_seqlens_q_padded: Some(&[0, 4, 9]), ..ThdSeqlens::new(&[0, 5, 9], &[0, 1, 2]) };
        let e = message(short.check(10, 10));
        assert!(e.contains("sequence 0 has 5 tokens but its padded slot only 4"), "{e}");
    }
}
