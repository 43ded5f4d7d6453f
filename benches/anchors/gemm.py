"""PyTorch anchor for benches/kernels/gemm.rs, on the same shapes m x n x k: torch._scaled_mm
(cuBLASLt FP8, per-tensor scales; E4M3 row-major A times column-major B = `b.t()` of a row-major
[n, k]; bf16 output; fast accumulation), a bf16 `a @ b.t()`, and `torch._scaled_mm` with
blockwise scales (1x128 tiles of a, 128x128 blocks of b).

Timing: CUDA events around each call after 10 warm-up calls, median of 50, random data.
Writes $OUT/anchor-gemm.json (or ./anchor-gemm.json); `scripts/bench` runs it.
"""

import argparse
import traceback

import torch

from common import Results, failed_row, phase_times, row

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 8192), (8192, 4096, 16384)]


def block_mm(a, b, m, n, k, found={}):
    """torch._scaled_mm with 1x128 scales of `a` and 128x128 scales of `b.t()`. The layouts
    PyTorch accepts have changed between releases: each known one is tried once per shape, the
    first that runs is kept for the timed calls."""
    mm = lambda sa, sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                         use_fast_accum=False)
    if (m, n, k) not in found:
        full = lambda *s: torch.full(s, 0.5, device="cuda")
        layouts = [
            (full(k // 128, m).t(), full(k // 128, n // 128)),
            (full(k // 128, m).t(), full(n // 128, k // 128).t()),
            (full(k // 128, m).t(), full(n // 128, k // 128)),
            (full(m, k // 128), full(n // 128, k // 128)),
        ]
        errors = []
        for sa, sb in layouts:
            try:
                mm(sa, sb)
                found[(m, n, k)] = (sa, sb)
                break
            except RuntimeError as e:
                errors.append(f"scale_a {tuple(sa.shape)} stride {sa.stride()}, scale_b {tuple(sb.shape)} "
                              f"stride {sb.stride()}: {e}")
        else:
            raise RuntimeError("no scale layout accepted: " + " | ".join(errors))
    return mm(*found[(m, n, k)])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    res = Results("anchor-gemm.json", warmup=args.warmup, iters=args.iters)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def uniform(rows, cols):
        return torch.rand(rows, cols, device="cuda", generator=gen) * 4 - 2

    scale = torch.tensor(0.5, device="cuda")
    for m, n, k in SHAPES:
        shape, flops = f"{m}x{n}x{k}", 2 * m * n * k
        cases = [
            ("torch._scaled_mm", torch.float8_e4m3fn, "fp8", flops,
             lambda a, b: torch._scaled_mm(a, b.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True)),
            ("torch bf16 matmul", torch.bfloat16, "bf16", 0, lambda a, b: a @ b.t()),
            # Blockwise (DeepSeek-V3 / TE Float8BlockScaling): a in 1x128 tiles (its scales
            # outer-dimension-major), b in 128x128 blocks; no fast accumulation.
            ("torch._scaled_mm block 1x128·128x128", torch.float8_e4m3fn, "fp8", flops,
             lambda a, b: block_mm(a, b, m, n, k)),
        ]
        for variant, dtype, precision, flops_fp8, mm in cases:
            try:
                a, b = uniform(m, k).to(dtype), uniform(n, k).to(dtype)

                def step(mark):
                    mm(a, b)
                    mark()

                _, us = phase_times(step, lambda: None, args.warmup, args.iters, 1)
                res.add(row("gemm", "gemm", shape, "gemm", variant, precision, us, flops, flops_fp8))
                del a, b
            except Exception as e:  # keep the other rows; reported and exit status 1
                traceback.print_exc()
                res.add(failed_row("gemm", "gemm", shape, variant, f"{type(e).__name__}: {e}"))
    res.finish()


if __name__ == "__main__":
    main()
