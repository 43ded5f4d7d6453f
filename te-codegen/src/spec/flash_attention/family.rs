//! [`Family`] for [`FlashAttnSpec`]: the entry points, their arguments and conditions, the
//! template and its context, the name and the validation of a flash-attention spec.

use super::*;

impl Family for FlashAttnSpec {
    fn has(&self, cond: ArgCond) -> bool {
        cond == ArgCond::Tma && self.direction == Direction::Fwd && self.warp_specialized
    }
    fn args(&self, entry: usize) -> &'static [KernelArg] {
        match (self.direction, entry) {
            (Direction::Fwd, 0) if self.fp8 => Self::FWD_FP8_ARGS,
            (Direction::Fwd, _) if self.fp8 => Self::QUANTIZE_ARGS,
            (Direction::Fwd, _) => Self::FWD_ARGS,
            (Direction::Bwd, 0) => Self::BWD_DOT_ARGS,
            (Direction::Bwd, 1) if self.fp8 => Self::BWD_FP8_DKDV_ARGS,
            (Direction::Bwd, _) if self.fp8 => Self::BWD_FP8_DQ_ARGS,
            (Direction::Bwd, 1) => Self::BWD_DKDV_ARGS,
            (Direction::Bwd, 2) => Self::BWD_DQ_ARGS,
            (Direction::Bwd, _) => Self::BWD_DKDV_SUM_ARGS,
        }
    }
    fn entry_suffixes(&self) -> &'static [&'static str] {
        match self.direction {
            Direction::Fwd if self.fp8 => &["", "_quantize"],
            Direction::Fwd => &[""],
            Direction::Bwd if self.fp8 => &["_dot_do_o", "_dkdv", "_dq"],
            Direction::Bwd => &["_dot_do_o", "_dkdv", "_dq", "_dkdv_sum"],
        }
    }
    fn family(&self) -> &'static str {
        "flash_attn"
    }
    fn template(&self) -> &'static str {
        match self.direction {
            Direction::Fwd => "flash_attn_fwd.cu.tera",
            Direction::Bwd if self.fp8 => "flash_attn_bwd_fp8.cu.tera",
            Direction::Bwd => "flash_attn_bwd.cu.tera",
        }
    }
    fn name_parts(&self) -> String {
        let drop = if self.dropout { "_drop" } else { "" };
        let wg = match (self.wgmma, self.fp8) {
            (_, true) if self.grad_e5m2 => "_fp8_e5m2",
            (_, true) if self.warp_specialized => "_fp8_ws",
            (_, true) => "_fp8",
            (true, false) if self.warp_specialized => "_ws",
            (true, false) => "_wg",
            (false, false) => "",
        };
        let (dir, dt, d, m, n) = (self.direction.name(), self.dtype, self.head_dim, self.block_m, self.block_n);
        let dv = if self.head_dim_v == d { String::new() } else { format!("_v{}", self.head_dim_v) };
        format!("{dir}_{dt}_d{d}{dv}_m{m}_n{n}{wg}{drop}")
    }
    fn arch(&self) -> Arch {
        self.arch
    }
    fn context(&self, ctx: &mut tera::Context) {
        ctx.insert("t", self.dtype.type_tag());
        ctx.insert("mma_type", if self.dtype == DType::F16 { "f16" } else { "bf16" });
        ctx.insert("head_dim", &self.head_dim);
        ctx.insert("head_dim_v", &self.head_dim_v);
        ctx.insert("block_m", &self.block_m);
        ctx.insert("block_n", &self.block_n);
        ctx.insert("dkdv_tile_m", &self.dkdv_tile_m());
        ctx.insert("dkdv_stages", &self.dkdv_stages());
        ctx.insert("dkdv_channels", &self.fp8_dkdv_channels());
        ctx.insert("dq_key_tile", &self.dq_key_tile());
        ctx.insert("smem_ld", &self.smem_ld());
        ctx.insert("dropout", &self.dropout);
        ctx.insert("wgmma", &self.wgmma);
        ctx.insert("fp8", &self.fp8);
        ctx.insert("grad_e5m2", &self.grad_e5m2);
        ctx.insert("ws", &self.warp_specialized);
        // FlashAttention-3's ping-pong between the two consumer warpgroups of the 16-bit
        // warp-specialized forward. Measured on an H100 (2026-11-25, d128 causal): b4 s2048 312 →
        // 304 µs (440 → 453 TFLOP/s), b4 s4096 h32/kv8 1 005 → 985 µs, b1 s16384 3 447 → 3 420
        // µs; the FP8 forward is slower with it (s2048 263 → 265 µs, s16384 2 784 → 2 869 µs),
        // so it keeps the warpgroups free-running (with TMA loads too: s8192 1 432 → 1 477 µs).
        // The forward's producer keeps 40 registers: 24 measured no faster with TMA (s8192 bf16
        // 1 747 → 1 754 µs, FP8 1 432 → 1 461 µs). The FP8 forward at d256 (2026-11-27, b4 s4096
        // h8/kv1): 342 µs free-running, 345 µs with ping-pong.
        let ping_pong = self.warp_specialized && self.direction == Direction::Fwd && self.block_m == 128 && !self.fp8;
        ctx.insert("ping_pong", &ping_pong);
        // setmaxnreg budget of each consumer thread (a multiple of 8, at most 240).
        let consumers = self.block_m / 16 * 32 * self.channel_split();
        // The block starts with the registers its launch got (64 K / threads, a multiple of 8, per
        // thread); setmaxnreg only moves them: an increase beyond that pool never returns. The
        // backward's producer keeps 24, the forward's 40 (fewer spill its loads).
        let producer_regs = if self.direction == Direction::Bwd { 24 } else { 40 };
        let threads = consumers + 128;
        let pool = 65536 / threads / 8 * 8 * threads;
        ctx.insert("ws_producer_regs", &producer_regs);
        ctx.insert("ws_consumer_regs", &((pool - 128 * producer_regs) / consumers.max(1) / 8 * 8).min(240));
        ctx.insert("grad_type", if self.grad_e5m2 { "E5M2" } else { "E4M3" });
        // The 8-bit wgmma operand types: F8_QK, F8_XG, F8_GX (x = e4m3, g = the gradients' type).
        let g = if self.grad_e5m2 { "e5m2" } else { "e4m3" };
        let pairs = match self.direction {
            Direction::Fwd => vec![(0, "e4m3", "e4m3")],
            Direction::Bwd => vec![(0, "e4m3", "e4m3"), (1, "e4m3", g), (2, g, "e4m3")],
        };
        ctx.insert("fp8_pairs", &pairs);
        // The wgmma shapes the kernels use, as (n, n / 8): S-like products (both operands in shared
        // memory) and P·V-like ones (A in registers).
        // With a channel split: each warpgroup's half of the S-like columns, and the P·V-like
        // products from shared memory (B MN-major) on its half of the channels.
        let cs = self.channel_split();
        ctx.insert("csplit", &cs);
        let mut ss = match self.direction {
            Direction::Fwd => vec![self.block_n],
            Direction::Bwd => vec![self.dkdv_tile_m() / cs, self.dq_key_tile() / cs],
        };
        ss.dedup();
        let shapes = |ns: Vec<usize>| ns.into_iter().map(|n| (n, n / 8)).collect::<Vec<_>>();
        ctx.insert("wgmma_ss_n", &shapes(ss));
        let mut rs = vec![self.head_dim, self.head_dim_v];
        if self.fp8 && self.direction == Direction::Bwd {
            rs.push(self.fp8_dkdv_channels());
        }
        rs.sort_unstable();
        rs.dedup();
        let mut ss_t = if cs > 1 { vec![self.head_dim / cs, self.head_dim_v / cs] } else { vec![] };
        ss_t.dedup();
        ctx.insert("wgmma_rs_n", &shapes(if cs > 1 { vec![] } else { rs }));
        ctx.insert("wgmma_ss_t_n", &shapes(ss_t));
    }
    fn validate(&self) -> Result<(), String> {
        if !matches!(self.dtype, DType::BF16 | DType::F16) {
            return Err(format!("fused attention runs on bf16 or f16, not {}", self.dtype));
        }
        if !FLASH_HEAD_DIMS.contains(&self.head_dim) {
            return Err(format!("head_dim = {} is not one of {FLASH_HEAD_DIMS:?}", self.head_dim));
        }
        if self.direction == Direction::Bwd && self.head_dim.max(self.head_dim_v) > 128 && !self.wgmma {
            return Err(format!(
                "the fused backward takes head dims above 128 only on sm_90a (wgmma), got {} (q, k) and {} (v) on {} \
                 (use the unfused backend)",
                self.head_dim, self.head_dim_v, self.arch
            ));
        }
        if self.head_dim_v != self.head_dim
            && !(self.wgmma && !self.fp8 && self.head_dim_v % 64 == 0 && self.head_dim_v <= 256)
        {
            return Err(format!(
                "head_dim_v = {} other than head_dim = {} is a setting of the 16-bit sm_90a (wgmma) kernels, with \
                 head_dim_v a multiple of 64 up to 256 (use the unfused backend)",
                self.head_dim_v, self.head_dim
            ));
        }
        if self.channel_split() > 1 {
            // Each warpgroup's channel half starts at a 64-channel column block of the tiles.
            let (d, dv) = (self.head_dim, self.head_dim_v);
            if d % 128 != 0 || dv % 128 != 0 || !self.warp_specialized || self.block_n != 64 || self.block_m != 64 {
                return Err(format!(
                    "the backward above head dim 128 splits the channels of both gradients in halves of whole \
                     64-channel blocks: head_dim and head_dim_v 128 or 256 (got {d} and {dv}), warp-specialized, 64 × 64 \
                     blocks (use the unfused backend)"
                ));
            }
        }
        for (what, n) in [("block_m", self.block_m), ("block_n", self.block_n)] {
            if n == 0 || n % 16 != 0 || n > 128 {
                return Err(format!("{what} = {n} must be a multiple of 16 in [16, 128]"));
            }
        }
        if self.wgmma {
            if self.arch != Arch::Sm90a {
                return Err("wgmma kernels are sm_90a only".into());
            }
            if self.head_dim % 64 != 0 || self.block_m % 64 != 0 {
                return Err(format!(
                    "wgmma tiles need head_dim and block_m multiples of 64 (got {} and {})",
                    self.head_dim, self.block_m
                ));
            }
        }
        if self.fp8
            && self.direction == Direction::Bwd
            && !(self.wgmma
                && self.head_dim % 128 == 0
                && self.head_dim <= 256
                && self.block_m == 128
                && self.block_n == 128
                && !self.dropout)
        {
            return Err(format!(
                "the FP8 backward is the sm_90a wgmma kernel at head_dim 128 or 256 with 128 × 128 blocks and no dropout, got \
                 {} head_dim {} blocks {} × {}{} (use the bf16/f16 backward)",
                self.arch,
                self.head_dim,
                self.block_m,
                self.block_n,
                if self.dropout { " with dropout" } else { "" }
            ));
        }
        if self.warp_specialized
            && !(self.wgmma
                && (self.block_m == 128 || self.channel_split() > 1)
                && !(self.fp8 && self.direction == Direction::Bwd))
        {
            return Err(
                "warp specialization is a setting of the 16-bit wgmma kernels and the FP8 forward with 128-row \
                        blocks (or the backward's channel split above head dim 128)"
                    .into(),
            );
        }
        if self.grad_e5m2 && !(self.fp8 && self.direction == Direction::Bwd) {
            return Err("grad_e5m2 (E5M2 dO and dS) is a setting of the FP8 backward only".into());
        }
        if self.fp8
            && self.direction == Direction::Fwd
            && !(self.wgmma && self.head_dim % 128 == 0 && self.block_n == Self::FP8_KEY_TILE)
        {
            return Err(format!(
                "FP8 attention is the sm_90a wgmma forward at head_dim 128 or 256 with 128-key tiles, got {} head_dim {} \
                 block_n {} (use the bf16/f16 kernels)",
                self.arch, self.head_dim, self.block_n
            ));
        }
        if self.direction == Direction::Bwd && self.block_n % self.dkdv_tile_m() != 0 && self.dkdv_tile_m() % 16 != 0 {
            return Err("the dK/dV query tile must be a multiple of 16".into());
        }
        let smem = (0..self.entry_suffixes().len()).map(|e| self.shared_bytes(e)).max().unwrap_or(0);
        if smem > 227 * 1024 {
            return Err(format!("the tiles need {smem} bytes of shared memory, above the 227 KiB of an SM"));
        }
        Ok(())
    }
}
