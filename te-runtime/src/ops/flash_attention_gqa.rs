//! GQA/MQA in the fused backward: the query heads of a key/value group split over several
//! `_dkdv` blocks per key block, and the deterministic sum of their partial dK/dV (`_dkdv_sum`).
//!
//! Without a split a `_dkdv` block loops over every query head of its group, so an MQA grid has
//! few, long blocks (b4 s4096 h32/kv1 d128: 128 blocks of 32 heads each on 132 SMs; fwd+bwd 1.49×
//! cuDNN's time on an H100, 1.17× with 8 splits). FlashAttention-3 splits the same way with
//! atomics; here each split writes f32 partial sums that one more kernel adds in split order, so
//! the gradients stay the same bits run to run.

use super::flash_attention::{function, grid, push_cu, CuSeqlens, FlashAttnParams, Scalars, OP};
use super::launch::Launch;
use crate::{Device, Result};
use cudarc::driver::CudaSlice;
use te_codegen::spec::FlashAttnSpec;

/// Largest f32 workspace of the split dK/dV sums, in bytes: fewer splits beyond it.
const DKDV_SPLIT_BYTES: usize = 256 << 20;

/// Into how many blocks `_dkdv` splits the query heads of a group: 1 when there is one query head
/// a group or the key blocks alone give at least 4 blocks an SM (`sms` SMs), else the smallest
/// divisor of `heads_per_group` that does, as long as the workspace (`splits · batch · groups ·
/// sk · (head_dim + head_dim_v)` f32) stays within 256 MiB. The split depends on the SM count, so
/// the bits of dK and dV are the same run to run on one GPU model.
pub fn dkdv_splits(p: &FlashAttnParams, spec: &FlashAttnSpec, sms: usize) -> usize {
    let sh = &p.shape;
    let hpg = sh.heads_per_group();
    let blocks = sh.sk.div_ceil(spec.block_n) * sh.groups * sh.batch;
    let want = (4 * sms.max(1)).div_ceil(blocks.max(1));
    let bytes = |s: usize| s * sh.batch * sh.groups * sh.sk * (sh.head_dim + sh.head_dim_v) * 4;
    let mut splits = (1..=hpg).find(|&s| hpg % s == 0 && s >= want).unwrap_or(hpg);
    while splits > 1 && bytes(splits) > DKDV_SPLIT_BYTES {
        splits = (1..splits).rev().find(|&s| hpg % s == 0).unwrap_or(1);
    }
    splits
}

/// `_dkdv_sum`: `dk = scale · Σ_split acc`, `dv = Σ_split acc` from the `splits` partial sums in
/// `acc` (`[splits, batch, groups, sk, head_dim + head_dim_v]` f32, as `_dkdv` wrote them), into
/// dk and dv at their device addresses and the call's kv and v strides.
pub(super) fn dkdv_sum(
    dev: &Device,
    spec: &FlashAttnSpec,
    p: &FlashAttnParams,
    cu: Option<CuSeqlens<'_>>,
    s: &Scalars,
    (acc, splits): (&CudaSlice<f32>, u64),
    [dk, dv]: [u64; 2],
) -> Result<()> {
    let sh = &p.shape;
    let f = function(dev, spec, 3)?;
    let mut l = Launch::new(OP, dev.stream(), &f, spec, 3);
    l.ptr("dkdv_acc", acc).ptr("dk", &dk).ptr("dv", &dv).scalar("kv_splits", &splits);
    push_cu(&mut l, cu);
    s.push_q(&mut l).push_kv(&mut l).push_o(&mut l).push_mask(&mut l).push_dropout(&mut l);
    // A thread per 4 channels of a key row.
    let threads = sh.sk * (sh.head_dim + sh.head_dim_v) / 4;
    let mut cfg = grid(threads.div_ceil(256), p, 256, 0);
    cfg.grid_dim.1 = sh.groups as u32;
    // SAFETY: reads the workspace `_dkdv` wrote (every split's rows below each sequence's length);
    // writes dk and dv, checked by the backward, as `_dkdv` would have without a split.
    unsafe { l.launch(cfg) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::attention_shape::{AttentionShape, QkvLayout};
    use te_codegen::spec::Direction;
    use te_codegen::{Arch, DType};

    fn splits(batch: usize, seq: usize, (heads, groups): (usize, usize), d: usize) -> usize {
        let shape = AttentionShape::new(QkvLayout::Bshd, batch, (seq, seq), (heads, groups), d);
        let spec = shape.flash_spec(Direction::Bwd, DType::BF16, Arch::Sm90a);
        dkdv_splits(&FlashAttnParams::dense(shape), &spec, 132)
    }

    #[test]
    fn query_heads_split_where_the_key_blocks_leave_sms_idle() {
        // MHA never splits; MQA at b4 s4096 (128 key blocks) splits 32 heads 8 ways.
        assert_eq!(splits(4, 4096, (32, 32), 128), 1);
        assert_eq!(splits(4, 4096, (32, 1), 128), 8);
        // GQA 4:1 at b4 s4096: 1 024 key blocks already; 8:1 at b2 s8192: 512, split in 2.
        assert_eq!(splits(4, 4096, (32, 8), 128), 1);
        assert_eq!(splits(2, 8192, (32, 4), 128), 2);
        // Gemma 3's MQA (8 heads of one KV head, d256, 64-key blocks): 256 blocks, 4 splits.
        assert_eq!(splits(4, 4096, (8, 1), 256), 4);
        // A small call splits all the way; the workspace bound keeps a long MQA call's small.
        assert_eq!(splits(1, 129, (32, 8), 64), 4);
        let long = splits(1, 262_144, (32, 1), 128);
        assert!(long * 262_144 * 256 * 4 <= DKDV_SPLIT_BYTES && long >= 1, "{long}");
    }
}
