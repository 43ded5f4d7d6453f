"""PyTorch anchor for benches/kernels/gemm.rs: torch._scaled_mm (cuBLASLt FP8, per-tensor scales)
on the same shapes, E4M3 row-major A times column-major B (`b.t()` of a row-major [n, k]),
bf16 output, fast accumulation; plus a bf16 `a @ b.t()` of 8192^3 as the device reference.

Timing: CUDA events around each call after 10 warm-up calls, median of 50, random data.
Writes $OUT/anchor-scaled-mm.json (or ./anchor-scaled-mm.json). On the GPU machine, after the
Rust benchmark: `.gpu/bin/kernels-bench --bench gemm; python3 benches/anchors/scaled_mm.py`.
"""

import json
import os
import statistics

import torch

FP8_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 8192), (8192, 4096, 16384)]
WARMUP, ITERS = 10, 50


def median_ms(fn):
    """Median time of `fn()` in ms, each call between two CUDA events."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(ITERS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def row(name, m, n, k, ms):
    return {"name": name, "shape": f"{m}x{n}x{k}", "median_us": ms * 1e3, "tflops": 2 * m * n * k / (ms * 1e-3) / 1e12}


def main():
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)

    def uniform(rows, cols):
        return torch.rand(rows, cols, device=dev, generator=gen) * 4 - 2

    rows = []
    scale = torch.tensor(0.5, device=dev)
    for m, n, k in FP8_SHAPES:
        a = uniform(m, k).to(torch.float8_e4m3fn)
        b = uniform(n, k).to(torch.float8_e4m3fn)
        ms = median_ms(
            lambda: torch._scaled_mm(a, b.t(), scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True)
        )
        rows.append(row("torch._scaled_mm e4m3×e4m3→bf16 fast accum", m, n, k, ms))
        del a, b
    s = 8192
    a, b = uniform(s, s).to(torch.bfloat16), uniform(s, s).to(torch.bfloat16)
    rows.append(row("torch bf16 a @ b.t() (device reference)", s, s, s, median_ms(lambda: a @ b.t())))

    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda, "rows": rows}
    path = os.path.join(os.environ.get("OUT", "."), "anchor-scaled-mm.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    for r in rows:
        print(f"{r['name']:<48} {r['shape']:>18} {r['median_us']:>10.1f} µs {r['tflops']:>8.0f} TFLOP/s")
    print(f"JSON written to {path}")


if __name__ == "__main__":
    main()
