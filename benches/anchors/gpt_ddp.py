"""PyTorch anchor for data-parallel training (`te train --nproc-per-node N`): the GPT of gpt.py
(the same sizes as the Rust presets) wrapped in torch.nn.parallel.DistributedDataParallel over
NCCL, one process a GPU, launched with torchrun:

    torchrun --nproc-per-node 2 benches/anchors/gpt_ddp.py --preset large

The step is gpt.py's eager BF16 one (FP32 parameters, forward and loss under
torch.autocast(bfloat16), backward with DDP's bucketed all-reduce overlapped, clip_grad_norm_,
fused AdamW, zero_grad) on `batch` sequences per rank. Also measures the all-reduce bus bandwidth
of this machine (nccl-tests' busbw: 2 (n - 1) / n * bytes / time) on 256 MiB of bf16, the floor
of the gradient communication. Rank 0 prints one line per result and writes
$OUT/anchor-gpt-ddp.json (or ./anchor-gpt-ddp.json). NCCL_NVLS_ENABLE=0 is set unless given.
"""

import argparse
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from gpt import GPT, PRESETS, VOCAB, adamw  # noqa: E402


def bus_bandwidth(world, rank, mib=256, iters=20):
    """All-reduce bus bandwidth in GB/s over `mib` MiB of bf16 (median of `iters`)."""
    x = torch.ones(mib * (1 << 20) // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        dist.all_reduce(x)
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    t = sorted(times)[len(times) // 2]
    return 2 * (world - 1) / world * x.numel() * 2 / t / 1e9


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="large", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, help="sequences per rank (default: the preset's)")
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    c = dict(PRESETS[args.preset])
    if args.batch:
        c["batch"] = args.batch
    busbw = bus_bandwidth(world, rank) if world > 1 else float("nan")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(c).train()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = adamw(model)
    b, s = c["batch"], c["seq"]
    gen = torch.Generator(device="cuda").manual_seed(7 + rank)
    tokens = torch.randint(0, VOCAB, (b, s + 1), device="cuda", generator=gen)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(ddp(ids).flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for _ in range(args.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    step_s = sorted(times)[len(times) // 2]
    tokens_per_s = world * b * s / step_s
    peak = torch.cuda.max_memory_allocated() / (1 << 30)
    if rank == 0:
        result = {
            "preset": args.preset, "world_size": world, "batch_per_rank": b, "seq": s,
            "step_ms": step_s * 1e3, "tokens_per_s": tokens_per_s, "tokens_per_s_per_gpu": tokens_per_s / world,
            "peak_memory_gib_per_gpu": peak, "allreduce_busbw_gbs": busbw,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        }
        print(f"torch DDP {args.preset} x{world}: step {step_s * 1e3:.2f} ms, {tokens_per_s:.0f} tokens/s "
              f"({tokens_per_s / world:.0f} per GPU), peak {peak:.2f} GiB per GPU, all-reduce busbw "
              f"{busbw:.0f} GB/s", flush=True)
        out = os.path.join(os.environ.get("OUT", "."), f"anchor-gpt-ddp-{world}.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
