//! Tensor-parallel sharding: which slice of each parameter a rank of a tensor-parallel group
//! holds, in Megatron-LM's layout with TE's module names (`parallel_mode`):
//!
//! - column-parallel GEMMs split their output features: the fused QKV projection by heads (each
//!   rank holds its `heads / tp` query heads and `groups / tp` key/value heads, as
//!   `[q | k | v]`: the local attention's own fused layout), `fc1` by rows of its weight and
//!   bias;
//! - row-parallel GEMMs split their input features: the attention's `proj` and `fc2` by columns
//!   of their weights; their biases stay whole (added once, after the all-reduce);
//! - everything else is replicated: the norms, the embeddings and the LM head (Megatron splits
//!   the vocabulary too; with a 256-byte vocabulary it is not worth it here), FP8 scaling
//!   states (their amaxes are reduced over the group, so every rank holds the same).
//!
//! Slices work on raw bytes of any element size, so weights in bf16, f32 or FP8 codes and
//! optimizer states split alike. Sources: Megatron-LM `core/tensor_parallel/layers.py`
//! (`ColumnParallelLinear`, `RowParallelLinear`), TE `pytorch/module/linear.py`
//! (`parallel_mode`).
//!
//! The GEMM modules slice their initial weights by the same [`Split`]s
//! ([`super::GemmParallel::shard_weight`]), so a tensor-parallel model starts from the slices of
//! the single-GPU model's weights, and its checkpoints split and merge by [`TpLayout`]
//! (`crate::checkpoint::tp`).

use te_runtime::{Error, Result};

/// One rank's place in a tensor-parallel group of `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TpRank {
    /// `0..size`.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

/// How one tensor splits over the group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds all of it.
    Replicated,
    /// Rank `r` holds the `r`-th of `size` equal slices along this dimension.
    Dim(usize),
    /// Dimension 0 made of this many equal parts, each split as [`Split::Dim`]`(0)`: rank `r`
    /// holds its slice of every part, in order (a gated fc1 `[2·ffn, hidden]`, `[a | b]` of
    /// SwiGLU/GeGLU, is 2 parts: each rank gates its own features).
    Parts(usize),
    /// The fused QKV projection's output dimension (dim 0 of its weight and bias), `[q heads |
    /// k heads | v heads]` of `head_dim` each: rank `r` holds its `heads / size` query heads and
    /// `groups / size` key/value heads of each part, in that order.
    Qkv {
        /// Query heads.
        heads: usize,
        /// Key/value heads.
        groups: usize,
        /// Channels per head.
        head_dim: usize,
    },
}

/// The shape a split tensor of `shape` has on each rank.
fn dim_len(op: &str, shape: &[usize], dim: usize) -> Result<usize> {
    shape.get(dim).copied().ok_or_else(|| Error::Dist {
        message: format!("{op}: a tensor of shape {shape:?} has no dimension {dim} to split"),
    })
}

impl Split {
    /// The `(offset, length)` runs of dimension-0 rows (Qkv) or of the split dimension (Dim) that
    /// rank `r` holds, in order.
    fn runs(&self, name: &str, shape: &[usize], tp: TpRank) -> Result<Vec<(usize, usize)>> {
        let n = tp.size;
        let uneven = |what: String| Error::Dist {
            message: format!(
                "{name}: {what} does not split over {n} tensor-parallel ranks: choose a tensor-parallel size that \
                 divides it"
            ),
        };
        match *self {
            Split::Replicated => Ok(vec![(0, 0)]),
            Split::Dim(d) => {
                let len = dim_len(name, shape, d)?;
                if len % n != 0 {
                    return Err(uneven(format!("dimension {d} of {shape:?} ({len})")));
                }
                let part = len / n;
                Ok(vec![(tp.rank * part, part)])
            }
            Split::Parts(parts) => {
                let len = dim_len(name, shape, 0)?;
                if parts == 0 || len % (parts * n) != 0 {
                    return Err(uneven(format!("each of the {parts} parts of dimension 0 of {shape:?}")));
                }
                let (part, slice) = (len / parts, len / parts / n);
                Ok((0..parts).map(|p| (p * part + tp.rank * slice, slice)).collect())
            }
            Split::Qkv { heads, groups, head_dim } => {
                let len = dim_len(name, shape, 0)?;
                if len != (heads + 2 * groups) * head_dim {
                    return Err(Error::Dist {
                        message: format!(
                            "{name}: dimension 0 of {shape:?} is not (heads {heads} + 2 × groups {groups}) × head_dim \
                             {head_dim}: the tensor is not this attention's fused QKV"
                        ),
                    });
                }
                if heads % n != 0 {
                    return Err(uneven(format!("num_attention_heads = {heads}")));
                }
                if groups % n != 0 {
                    return Err(uneven(format!("num_gqa_groups = {groups}")));
                }
                let (hq, hg) = (heads / n * head_dim, groups / n * head_dim);
                let r = tp.rank;
                Ok(vec![(r * hq, hq), (heads * head_dim + r * hg, hg), ((heads + groups) * head_dim + r * hg, hg)])
            }
        }
    }

    /// The split dimension (0 for Qkv and Parts), or `None` when replicated.
    pub(crate) fn dim(&self) -> Option<usize> {
        match *self {
            Split::Replicated => None,
            Split::Dim(d) => Some(d),
            Split::Parts(_) | Split::Qkv { .. } => Some(0),
        }
    }

    /// The shape of rank `tp.rank`'s slice of a tensor of `shape`.
    ///
    /// # Errors
    /// [`Error::Dist`] for a dimension that does not split evenly (or heads or groups that do
    /// not), or a tensor without the dimension, naming `name`.
    pub fn shard_shape(&self, name: &str, shape: &[usize], tp: TpRank) -> Result<Vec<usize>> {
        let runs = self.runs(name, shape, tp)?;
        let mut out = shape.to_vec();
        if let Some(d) = self.dim() {
            out[d] = runs.iter().map(|r| r.1).sum();
        }
        Ok(out)
    }

    /// Rank `tp.rank`'s slice of `bytes`, a row-major tensor of `shape` with `elem` bytes an
    /// element.
    ///
    /// # Errors
    /// As [`Split::shard_shape`]; [`Error::Dist`] when `bytes` does not hold the shape.
    pub fn shard(&self, name: &str, bytes: &[u8], shape: &[usize], elem: usize, tp: TpRank) -> Result<Vec<u8>> {
        check_len(name, bytes.len(), shape, elem)?;
        let runs = self.runs(name, shape, tp)?;
        let Some(d) = self.dim() else { return Ok(bytes.to_vec()) };
        let (outer, len, inner) = split_at(shape, d, elem);
        let mut out = Vec::with_capacity(bytes.len() / tp.size);
        for o in 0..outer {
            let row = &bytes[o * len * inner..(o + 1) * len * inner];
            for &(at, n) in &runs {
                out.extend_from_slice(&row[at * inner..(at + n) * inner]);
            }
        }
        Ok(out)
    }

    /// The whole tensor of `shape` from every rank's slice (`shards[r]`, `size = shards.len()`):
    /// the inverse of [`Split::shard`]. A replicated tensor must be the same on every rank.
    ///
    /// # Errors
    /// As [`Split::shard_shape`]; [`Error::Dist`] for a slice of the wrong length, or a
    /// replicated tensor that differs between ranks (naming both).
    pub fn merge(&self, name: &str, shards: &[&[u8]], shape: &[usize], elem: usize) -> Result<Vec<u8>> {
        let size = shards.len();
        if size == 0 {
            return Err(Error::Dist { message: format!("{name}: no shards to merge") });
        }
        let Some(d) = self.dim() else {
            check_len(name, shards[0].len(), shape, elem)?;
            if let Some(r) = (1..size).find(|&r| shards[r] != shards[0]) {
                return Err(Error::Dist {
                    message: format!(
                        "{name}: replicated, yet rank {r}'s copy differs from rank 0's: the shards are not of one \
                         checkpoint"
                    ),
                });
            }
            return Ok(shards[0].to_vec());
        };
        let total: usize = shape.iter().product::<usize>() * elem;
        let (outer, len, inner) = split_at(shape, d, elem);
        let mut out = vec![0u8; total];
        for (rank, shard) in shards.iter().enumerate() {
            let tp = TpRank { rank, size };
            let runs = self.runs(name, shape, tp)?;
            if shard.len() != total / size {
                return Err(Error::Dist {
                    message: format!(
                        "{name}: rank {rank}'s slice has {} bytes, a {size}-way slice of {shape:?} has {}",
                        shard.len(),
                        total / size
                    ),
                });
            }
            let mut from = 0;
            for o in 0..outer {
                for &(at, n) in &runs {
                    let dst = o * len * inner + at * inner;
                    out[dst..dst + n * inner].copy_from_slice(&shard[from..from + n * inner]);
                    from += n * inner;
                }
            }
        }
        Ok(out)
    }
}

/// `(outer, len, inner bytes)` of dimension `d` of `shape`.
fn split_at(shape: &[usize], d: usize, elem: usize) -> (usize, usize, usize) {
    let outer = shape[..d].iter().product();
    let inner = shape[d + 1..].iter().product::<usize>() * elem;
    (outer, shape[d], inner)
}

fn check_len(name: &str, bytes: usize, shape: &[usize], elem: usize) -> Result<()> {
    let want = shape.iter().product::<usize>() * elem;
    if bytes == want {
        Ok(())
    } else {
        Err(Error::Dist { message: format!("{name}: {bytes} bytes do not hold {shape:?} of {elem}-byte elements") })
    }
}

/// The tensor-parallel layout of a model built from TE's modules, by tensor name: the QKV
/// projections of attention blocks with `heads` query and `groups` key/value heads of
/// `head_dim`, `fc1` / `fc2` of MLPs, the attention output projection; checked against the
/// group size when made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpLayout {
    /// Query heads of every attention block.
    pub heads: usize,
    /// Key/value heads.
    pub groups: usize,
    /// Channels per head.
    pub head_dim: usize,
    /// MLP width.
    pub ffn_hidden_size: usize,
    /// Parts of `fc1`'s output features, each split separately ([`Split::Parts`]): 2 for a
    /// gated activation (SwiGLU, GeGLU: `fc1` is `[a | b]`, `[2·ffn, hidden]`, and each rank
    /// gates its own features, as `LayerNormMLP` slices it), 1 otherwise.
    pub fc1_parts: usize,
    /// Ranks in the group.
    pub size: usize,
}

impl TpLayout {
    /// The layout of `size` ranks for attention blocks of `heads` / `groups` heads of `head_dim`
    /// and MLPs of `ffn_hidden_size`.
    ///
    /// # Errors
    /// [`Error::Dist`] for `size = 0` or a size that does not divide the heads, the groups
    /// (GQA: each rank needs whole key/value heads) or the MLP width.
    pub fn new(heads: usize, groups: usize, head_dim: usize, ffn_hidden_size: usize, size: usize) -> Result<Self> {
        let bad = |message: String| Err(Error::Dist { message });
        if size == 0 {
            return bad("a tensor-parallel size of 0: it must be ≥ 1".into());
        }
        for (what, n) in
            [("num_attention_heads", heads), ("num_gqa_groups", groups), ("ffn_hidden_size", ffn_hidden_size)]
        {
            if n % size != 0 {
                return bad(format!(
                    "{what} = {n} does not split over {size} tensor-parallel ranks: choose a size that divides it"
                ));
            }
        }
        Ok(Self { heads, groups, head_dim, ffn_hidden_size, fc1_parts: 1, size })
    }

    /// This layout for MLPs with a gated activation (`fc1` split by halves) or not.
    pub fn with_gated_fc1(self, gated: bool) -> Self {
        Self { fc1_parts: if gated { 2 } else { 1 }, ..self }
    }

    /// How the tensor `name` splits: a parameter (`layers.0.layernorm_mlp.fc1_weight`), an
    /// optimizer state of one (`….master`, `….exp_avg`, `….exp_avg_sq`: as the parameter; `….step`
    /// replicated), an FP8 scaling state or `scale_inv` (replicated).
    pub fn split_of(&self, name: &str) -> Split {
        let param = ["master", "exp_avg", "exp_avg_sq"]
            .iter()
            .find_map(|s| name.strip_suffix(&format!(".{s}")))
            .unwrap_or(name);
        let (module, leaf) = param.rsplit_once('.').unwrap_or(("", param));
        let qkv = Split::Qkv { heads: self.heads, groups: self.groups, head_dim: self.head_dim };
        let module_leaf = module.rsplit('.').next().unwrap_or(module);
        match (module_leaf, leaf) {
            ("layernorm_qkv" | "qkv", "weight" | "bias") => qkv,
            ("proj", "weight") => Split::Dim(1),
            (_, "fc1_weight" | "fc1_bias") if self.fc1_parts > 1 => Split::Parts(self.fc1_parts),
            (_, "fc1_weight" | "fc1_bias") => Split::Dim(0),
            (_, "fc2_weight") => Split::Dim(1),
            _ => Split::Replicated,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    /// `y = x · Wᵀ` (`x [t, k]`, `w [n, k]`).
    fn linear(x: &[f32], w: &[f32], t: usize, k: usize, n: usize) -> Vec<f32> {
        (0..t).flat_map(|i| (0..n).map(move |j| (0..k).map(|c| x[i * k + c] * w[j * k + c]).sum::<f32>())).collect()
    }

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0).collect()
    }

    /// The arithmetic the sharding stands for: fc1 split column-wise and fc2 row-wise, each rank
    /// computes its part of the MLP (`x · W1_rᵀ`, then `· W2_rᵀ`) and the sum over ranks (the
    /// all-reduce) is the unsplit product; concatenating column-parallel outputs gives the unsplit
    /// first product.
    #[test]
    fn column_then_row_parallel_products_sum_to_the_whole() {
        let (t, h, f, n) = (3, 8, 12, 3);
        let layout = TpLayout::new(6, 3, 2, f, n).unwrap();
        let (x, w1, w2) = (values(t * h, 1), values(f * h, 2), values(h * f, 3));
        let whole = linear(&linear(&x, &w1, t, h, f), &w2, t, f, h);
        let mut sum = vec![0.0f32; t * h];
        let mut cols = vec![Vec::new(); t];
        for rank in 0..n {
            let tp = TpRank { rank, size: n };
            let w1r = f32s(&layout.split_of("m.fc1_weight").shard("fc1", &f32_bytes(&w1), &[f, h], 4, tp).unwrap());
            let w2r = f32s(&layout.split_of("m.fc2_weight").shard("fc2", &f32_bytes(&w2), &[h, f], 4, tp).unwrap());
            let a = linear(&x, &w1r, t, h, f / n);
            for (i, c) in cols.iter_mut().enumerate() {
                c.extend_from_slice(&a[i * f / n..(i + 1) * f / n]);
            }
            let y = linear(&a, &w2r, t, f / n, h);
            sum.iter_mut().zip(y).for_each(|(s, v)| *s += v);
        }
        let full_a = linear(&x, &w1, t, h, f);
        assert_eq!(cols.concat(), full_a, "column-parallel outputs concatenate to the whole");
        assert!(sum.iter().zip(&whole).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())), "{sum:?} vs {whole:?}");
    }

    /// The QKV weight splits by heads: each rank's slice is `[its q heads | its k heads | its v
    /// heads]`, and the slices merge back bit for bit (bf16-sized elements, a bias too).
    #[test]
    fn qkv_splits_by_heads_and_merges_back() {
        let (heads, groups, d, hidden) = (4, 2, 3, 5);
        let rows = (heads + 2 * groups) * d;
        let layout = TpLayout::new(heads, groups, d, 8, 2).unwrap();
        let split = layout.split_of("layers.0.self_attention.layernorm_qkv.weight");
        assert_eq!(split, Split::Qkv { heads, groups, head_dim: d });
        // Element (row, col) holds row * 100 + col: the rows a rank gets are readable.
        let w: Vec<u8> =
            (0..rows * hidden).flat_map(|i| ((i / hidden * 100 + i % hidden) as u16).to_le_bytes()).collect();
        let row_of = |b: &[u8], i: usize| u16::from_le_bytes([b[i * hidden * 2], b[i * hidden * 2 + 1]]) / 100;
        let r1 = split.shard("qkv", &w, &[rows, hidden], 2, TpRank { rank: 1, size: 2 }).unwrap();
        let got: Vec<u16> = (0..rows / 2).map(|i| row_of(&r1, i)).collect();
        // q heads 2, 3 (rows 6..12), k head 1 (rows 15..18), v head 1 (rows 21..24).
        assert_eq!(got, [6, 7, 8, 9, 10, 11, 15, 16, 17, 21, 22, 23]);
        assert_eq!(split.shard_shape("qkv", &[rows, hidden], TpRank { rank: 1, size: 2 }).unwrap(), [rows / 2, hidden]);
        let r0 = split.shard("qkv", &w, &[rows, hidden], 2, TpRank { rank: 0, size: 2 }).unwrap();
        assert_eq!(split.merge("qkv", &[&r0, &r1], &[rows, hidden], 2).unwrap(), w);
        let bias = f32_bytes(&values(rows, 9));
        let parts: Vec<Vec<u8>> =
            (0..2).map(|rank| split.shard("qkv bias", &bias, &[rows], 4, TpRank { rank, size: 2 }).unwrap()).collect();
        assert_eq!(split.merge("qkv bias", &[&parts[0], &parts[1]], &[rows], 4).unwrap(), bias);
    }

    /// A gated fc1 `[a | b]` splits by halves: each rank holds its rows of `a` then of `b`, and
    /// the slices merge back; parts that do not divide are refused.
    #[test]
    fn parts_split_each_part_and_merge_back() {
        let (rows, cols) = (8, 3);
        let w = f32_bytes(&(0..rows * cols).map(|i| (i / cols) as f32).collect::<Vec<_>>());
        let split = Split::Parts(2);
        let r1 = split.shard("fc1", &w, &[rows, cols], 4, TpRank { rank: 1, size: 2 }).unwrap();
        let got: Vec<f32> = f32s(&r1).chunks(cols).map(|r| r[0]).collect();
        assert_eq!(got, [2.0, 3.0, 6.0, 7.0], "rank 1: rows 2, 3 of a and 6, 7 of b");
        let r0 = split.shard("fc1", &w, &[rows, cols], 4, TpRank { rank: 0, size: 2 }).unwrap();
        assert_eq!(split.merge("fc1", &[&r0, &r1], &[rows, cols], 4).unwrap(), w);
        let e = split.shard("fc1", &w, &[rows, cols], 4, TpRank { rank: 0, size: 3 }).unwrap_err();
        assert!(e.to_string().contains("3 tensor-parallel ranks"), "{e}");
    }

    /// Names map to TE's parallel modes; optimizer states follow their parameter; biases of
    /// row-parallel GEMMs, norms, embeddings and FP8 states are replicated.
    #[test]
    fn tensor_names_map_to_their_split() {
        let l = TpLayout::new(4, 4, 8, 64, 2).unwrap();
        let qkv = Split::Qkv { heads: 4, groups: 4, head_dim: 8 };
        for (name, want) in [
            ("layers.3.self_attention.layernorm_qkv.weight", qkv),
            ("layers.3.self_attention.qkv.bias", qkv),
            ("layers.3.self_attention.layernorm_qkv.layer_norm_weight", Split::Replicated),
            ("layers.3.self_attention.proj.weight", Split::Dim(1)),
            ("layers.3.self_attention.proj.bias", Split::Replicated),
            ("layers.3.layernorm_mlp.fc1_weight", Split::Dim(0)),
            ("layers.3.layernorm_mlp.fc1_bias.exp_avg", Split::Dim(0)),
            ("layers.3.layernorm_mlp.fc2_weight.master", Split::Dim(1)),
            ("layers.3.layernorm_mlp.fc2_bias", Split::Replicated),
            ("layers.3.layernorm_mlp.fc1_weight.step", Split::Replicated),
            ("layers.3.layernorm_mlp.fc1_fp8_fwd.amax_history", Split::Replicated),
            ("layers.3.self_attention.proj.fp8_fwd.scale", Split::Replicated),
            ("embedding.weight", Split::Replicated),
            ("lm_head.weight", Split::Replicated),
        ] {
            assert_eq!(l.split_of(name), want, "{name}");
        }
    }

    /// A gated MLP's fc1 (and its optimizer states) splits by halves, as `LayerNormMLP` slices
    /// its initial weight (`Split::Parts(2)`: each rank gates its own features); fc2 is split as
    /// for any MLP.
    #[test]
    fn a_gated_fc1_splits_by_halves() {
        let gated = TpLayout::new(4, 4, 8, 64, 2).unwrap().with_gated_fc1(true);
        assert_eq!(gated.split_of("layers.0.layernorm_mlp.fc1_weight"), Split::Parts(2));
        assert_eq!(gated.split_of("layers.0.layernorm_mlp.fc1_bias.exp_avg"), Split::Parts(2));
        assert_eq!(gated.split_of("layers.0.layernorm_mlp.fc2_weight"), Split::Dim(1));
        assert_eq!(gated.with_gated_fc1(false).split_of("layers.0.layernorm_mlp.fc1_weight"), Split::Dim(0));
    }

    /// Sizes that do not divide the heads, the groups or the MLP are refused naming them;
    /// replicated copies that differ and slices of the wrong length are refused when merging.
    #[test]
    fn bad_splits_are_typed_errors() {
        for (heads, groups, ffn, says) in [
            (6, 6, 64, "num_attention_heads = 6"),
            (8, 2, 64, "num_gqa_groups = 2"),
            (8, 8, 30, "ffn_hidden_size = 30"),
        ] {
            let e = TpLayout::new(heads, groups, 8, ffn, 4).unwrap_err().to_string();
            assert!(e.contains(says) && e.contains("4 tensor-parallel ranks"), "{e}");
        }
        assert!(TpLayout::new(4, 4, 8, 64, 0).is_err());
        let e = Split::Dim(1).shard("w", &[0u8; 4 * 6], &[2, 3], 4, TpRank { rank: 0, size: 2 }).unwrap_err();
        assert!(e.to_string().contains("dimension 1 of [2, 3] (3)"), "{e}");
        let e = Split::Dim(0).shard("w", &[0u8; 10], &[2, 3], 4, TpRank { rank: 0, size: 2 }).unwrap_err();
        assert!(e.to_string().contains("10 bytes"), "{e}");
        let e = Split::Replicated.merge("norm", &[&[1, 2], &[1, 3]], &[2], 1).unwrap_err();
        assert!(e.to_string().contains("rank 1's copy differs"), "{e}");
        let e = Split::Dim(0).merge("w", &[&[0; 4], &[0; 3]], &[2, 2], 2).unwrap_err();
        assert!(e.to_string().contains("rank 1's slice has 3 bytes"), "{e}");
        let e = Split::Qkv { heads: 2, groups: 1, head_dim: 4 }.shard(
            "qkv",
            &[0; 15],
            &[15],
            1,
            TpRank { rank: 0, size: 1 },
        );
        assert!(e.unwrap_err().to_string().contains("not this attention's fused QKV"));
    }
}
