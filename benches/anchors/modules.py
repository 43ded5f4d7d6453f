"""PyTorch anchor for the module benchmarks: forward + backward of TE's LayerNormMLP and of a pre-LN
GPT TransformerLayer (TE quickstart `BasicTransformerLayer` with flash attention), built from plain
torch modules and run as (a) eager BF16, (b) torch.compile BF16, (c) torchao float8 training
(`convert_to_float8_training`, default tensorwise dynamic scaling) + torch.compile.

Shapes (bf16 parameters and activations, training mode):
- layernorm_mlp: LayerNorm(4096) -> Linear(4096, 16384) -> GELU(tanh) -> Linear(16384, 4096),
  input [8192, 4096].
- transformer_layer: hidden 4096, 32 heads, ffn 16384, input [seq 2048, batch 4, 4096] as TE;
  x + dropout(proj(attn(qkv(LN(x))))), then + dropout(MLP(LN(.))); hidden_dropout 0.1,
  attention_dropout 0.0; scaled_dot_product_attention is_causal=True, restricted to the flash
  backend (on CUDA and CPU alike).

One step = `out = model(x); out.backward(dy)` with a fixed random `dy` and `x.requires_grad`
(dgrad of the input is computed, as for a layer inside a network). Before every step, outside
the timed region, the parameter and input gradients are set to None, so each backward writes
fresh gradients (no accumulation kernels).

Timing: CUDA events around each step after `--warmup` steps (twice as many for compiled variants;
the first step's wall time, which includes compilation, is reported as first_step_s), median of
`--iters` steps. Memory (CUDA only), measured on one extra step after timing:
- peak_mem_bytes: torch.cuda.max_memory_allocated() during the step minus memory_allocated()
  before it (parameters, x and dy are resident before; parameter gradients are included).
- forward_retained_bytes: memory_allocated() after the forward minus before it minus the output:
  what the autograd graph holds for backward, beyond parameters and input.
Saved tensors (any device), one more step under torch.autograd.graph.saved_tensors_hooks, distinct
storages (tensor subclasses flattened to their inner tensors):
- saved_for_backward_bytes: storages other than the parameters' and x's (activations, casts,
  masks, statistics) -- the figure the Rust modules report as saved_bytes.
- saved_tensors_total_bytes: all of them, parameters and x included.

A variant that raises is reported (traceback, an "error" row in the JSON and table) and the run
goes on; the exit status is then 1. Rows skipped because torchao does not import have "skipped".

Writes $OUT/anchor-modules.json (or ./anchor-modules.json) and prints a table. On the GPU machine
(carry `.whl` holding the torchao wheel):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  python3 benches/anchors/modules.py
CPU smoke run of the code paths: `python3 benches/anchors/modules.py --device cpu --tiny --variants eager`
(compile works there too, given a C++ compiler; torchao emulates float8 matmuls on CPU, ~30 s a step).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

SHAPES = {
    "full": {
        "layernorm_mlp": {"hidden": 4096, "ffn": 16384, "tokens": 8192},
        "transformer_layer": {"hidden": 4096, "heads": 32, "ffn": 16384, "seq": 2048, "batch": 4},
    },
    "tiny": {
        "layernorm_mlp": {"hidden": 256, "ffn": 1024, "tokens": 512},
        "transformer_layer": {"hidden": 256, "heads": 4, "ffn": 1024, "seq": 128, "batch": 2},
    },
}
MODULES = ("layernorm_mlp", "transformer_layer")
VARIANTS = ("eager", "compile", "torchao")
LN_EPS = 1e-5
DTYPE = torch.bfloat16


def layernorm_mlp(cfg):
    """TE LayerNormMLP: LayerNorm -> fc1 (bias) -> GELU(tanh) -> fc2 (bias)."""
    h, ffn = cfg["hidden"], cfg["ffn"]
    return nn.Sequential(
        nn.LayerNorm(h, eps=LN_EPS), nn.Linear(h, ffn), nn.GELU(approximate="tanh"), nn.Linear(ffn, h)
    )


class TransformerLayer(nn.Module):
    """Pre-LN GPT block as TE's quickstart BasicTransformerLayer, on [seq, batch, hidden], with
    flash attention through scaled_dot_product_attention, QKV interleaved per head
    ([s, b, heads, 3, head_dim], TE's default), and hidden dropout after both the attention
    projection and the MLP (as TE's TransformerLayer)."""

    def __init__(self, cfg):
        super().__init__()
        h, ffn = cfg["hidden"], cfg["ffn"]
        self.heads = cfg["heads"]
        self.attention_dropout = cfg["attention_dropout"]
        self.ln1 = nn.LayerNorm(h, eps=LN_EPS)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h, eps=LN_EPS)
        self.fc1 = nn.Linear(h, ffn)
        self.fc2 = nn.Linear(ffn, h)
        self.dropout = nn.Dropout(cfg["hidden_dropout"])

    def forward(self, x):
        s, b, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(s, b, self.heads, 3, h // self.heads)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))  # [b, heads, s, head_dim]
        ctx = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attention_dropout if self.training else 0.0, is_causal=True
        )
        x = x + self.dropout(self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


def build(module, variant, cfg, device):
    """The module in training mode, in DTYPE on `device`, prepared for `variant`."""
    torch.manual_seed(0)
    model = (layernorm_mlp(cfg) if module == "layernorm_mlp" else TransformerLayer(cfg)).to(device, DTYPE)
    model.train()
    if variant == "torchao":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model)
    return model if variant == "eager" else torch.compile(model)


def input_shape(module, cfg):
    if module == "layernorm_mlp":
        return (cfg["tokens"], cfg["hidden"])
    return (cfg["seq"], cfg["batch"], cfg["hidden"])


def model_flops(module, cfg):
    """FLOPs of one forward + backward: 3x the forward's GEMMs, plus for attention 3x its two
    batched matmuls over the causal half."""
    h, ffn = cfg["hidden"], cfg["ffn"]
    if module == "layernorm_mlp":
        return 3 * 2 * cfg["tokens"] * 2 * h * ffn
    s, b = cfg["seq"], cfg["batch"]
    linear = 2 * s * b * (4 * h * h + 2 * h * ffn)
    attention = 2 * 2 * b * s * s * h * 0.5
    return 3 * (linear + attention)


def time_steps(step, reset, device, warmup, iters):
    """Per-step milliseconds of `step()` over `iters` runs after `warmup` runs; `reset()` runs
    before every step, outside the timed region. CUDA events on CUDA, perf_counter elsewhere."""
    for _ in range(warmup):
        reset()
        step()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            reset()
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events]


def storages(t):
    """(key, bytes) of the storages behind `t`, looking through tensor subclasses."""
    if is_traceable_wrapper_subclass(t):
        inner_names, _ = t.__tensor_flatten__()
        return [kv for name in inner_names for kv in storages(getattr(t, name))]
    st = t.untyped_storage()
    return [((st.device, st.data_ptr()), st.nbytes())]


def saved_tensor_bytes(model, x, dy, reset):
    """(bytes of distinct storages saved for backward excluding parameters and x, all of them)."""
    resident = {key for t in [x, *model.parameters()] for key, _ in storages(t)}
    saved = {}

    def pack(t):
        saved.update(storages(t))
        return t

    reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.backward(dy)
    total = sum(saved.values())
    return total - sum(n for key, n in saved.items() if key in resident), total


def cuda_memory(model, x, dy, reset):
    """(peak bytes of one step above the bytes allocated before it, bytes the forward retains
    beyond its output)."""
    reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = model(x)
    torch.cuda.synchronize()
    retained = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.backward(dy)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, retained


def run_variant(module, variant, cfg, device, args):
    model = build(module, variant, cfg, device)
    gen = torch.Generator(device=device).manual_seed(1)
    shape = input_shape(module, cfg)
    x = torch.randn(shape, device=device, dtype=DTYPE, generator=gen).requires_grad_(True)
    dy = torch.randn(shape, device=device, dtype=DTYPE, generator=gen)

    def reset():
        model.zero_grad(set_to_none=True)
        x.grad = None

    def step():
        model(x).backward(dy)

    reset()
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0

    warmup = args.warmup if variant == "eager" else 2 * args.warmup
    times = time_steps(step, reset, device, warmup, args.iters)
    median = statistics.median(times)
    peak, retained = cuda_memory(model, x, dy, reset) if device.type == "cuda" else (None, None)
    saved, saved_total = saved_tensor_bytes(model, x, dy, reset)
    return {
        "module": module,
        "variant": variant,
        "config": cfg,
        "median_ms": median,
        "min_ms": min(times),
        "max_ms": max(times),
        "tflops": model_flops(module, cfg) / (median * 1e-3) / 1e12,
        "first_step_s": first_step_s,
        "peak_mem_bytes": peak,
        "forward_retained_bytes": retained,
        "saved_for_backward_bytes": saved,
        "saved_tensors_total_bytes": saved_total,
    }


def torchao_version():
    """torchao's version, or None (with a message) when it does not import."""
    try:
        import torchao
    except ImportError as e:
        print(f"torchao does not import ({e}): skipping the torchao variant")
        return None
    return torchao.__version__


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=MODULES, help="run one module (default: both)")
    p.add_argument("--variants", default=None, help=f"comma-separated subset of {','.join(VARIANTS)} (default: all on CUDA, eager elsewhere)")
    p.add_argument("--iters", type=int, default=50, help="timed steps (default 50)")
    p.add_argument("--warmup", type=int, default=10, help="warm-up steps, doubled for compiled variants (default 10)")
    p.add_argument("--tiny", action="store_true", help="small shapes for a smoke run")
    p.add_argument("--device", default="cuda", help="torch device (default cuda)")
    p.add_argument("--hidden-dropout", type=float, default=0.1, help="transformer_layer hidden dropout (default 0.1)")
    p.add_argument("--attention-dropout", type=float, default=0.0, help="transformer_layer attention dropout (default 0.0; CUDA only: the CPU flash kernel has no dropout)")
    args = p.parse_args()
    device = torch.device(args.device)
    variants = args.variants.split(",") if args.variants else list(VARIANTS if device.type == "cuda" else ["eager"])
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    return args, device, variants


def main():
    args, device, variants = parse_args()
    shapes = dict(SHAPES["tiny" if args.tiny else "full"])
    shapes["transformer_layer"] = dict(
        shapes["transformer_layer"], hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout
    )
    modules = [args.only] if args.only else list(MODULES)

    ao_version = torchao_version() if "torchao" in variants else None
    rows = []
    for module in modules:
        for variant in variants:
            if variant == "torchao" and ao_version is None:
                rows.append({"module": module, "variant": variant, "skipped": "torchao does not import"})
                continue
            print(f"running {module}/{variant} ...", flush=True)
            try:
                # Flash attention for the transformer layer; the backend is chosen while tracing,
                # so this also holds for the compiled variants.
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    rows.append(run_variant(module, variant, shapes[module], device, args))
            except Exception as e:  # keep the other rows of a long GPU run; reported below
                traceback.print_exc()
                rows.append({"module": module, "variant": variant, "error": f"{type(e).__name__}: {e}"})
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()

    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchao": ao_version,
        "dtype": str(DTYPE).removeprefix("torch."),
        "layernorm_eps": LN_EPS,
        "warmup": args.warmup,
        "warmup_compiled": 2 * args.warmup,
        "iters": args.iters,
        "step": "out = model(x); out.backward(dy); x.requires_grad; grads set to None before each step, untimed",
        "rows": rows,
    }
    path = os.path.join(os.environ.get("OUT", "."), "anchor-modules.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

    def mib(n):
        return "-" if n is None else f"{n / 2**20:.1f}"

    print(f"{doc['device']}, torch {doc['torch']}, torchao {ao_version}, {doc['dtype']}, median of {args.iters}")
    print(f"{'module':<18} {'variant':<8} {'median ms':>10} {'min–max ms':>16} {'TFLOP/s':>8} {'peak MiB':>9} {'fwd held MiB':>13} {'saved MiB':>10} {'(+params,x)':>12} {'1st step s':>11}")
    for r in rows:
        if "skipped" in r or "error" in r:
            print(f"{r['module']:<18} {r['variant']:<8} {'skipped: ' + r['skipped'] if 'skipped' in r else 'FAILED: ' + r['error'][:200]}")
            continue
        span = f"{r['min_ms']:.3f}–{r['max_ms']:.3f}"
        print(
            f"{r['module']:<18} {r['variant']:<8} {r['median_ms']:>10.3f} {span:>16} {r['tflops']:>8.0f} "
            f"{mib(r['peak_mem_bytes']):>9} {mib(r['forward_retained_bytes']):>13} "
            f"{mib(r['saved_for_backward_bytes']):>10} {mib(r['saved_tensors_total_bytes']):>12} {r['first_step_s']:>11.1f}"
        )
    print(f"JSON written to {path}")
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
