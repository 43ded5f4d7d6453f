"""PyTorch anchor for benches/kernels/gpt.rs: one training step of a GPT-2-style nn.Module with
the sizes of the Rust presets (te_runtime::models::gpt::GptConfig), in
  torch eager bf16, torch.compile bf16, torchao float8 tensorwise + compile.

The model: token embedding (vocab 256) + learned position embedding, pre-LN blocks (LayerNorm,
fused QKV with bias, causal scaled_dot_product_attention on the flash backend, projection,
dropout 0.1, residual; LayerNorm, fc1, GELU(tanh), fc2, dropout 0.1, residual), final LayerNorm,
LM head without bias; the parameter count is checked against the Rust formula.
- small: 12 layers, hidden 768, 12 heads, ffn 3072, seq 1024, batch 8;
- large: 24 layers, hidden 2048, 16 heads, ffn 8192, seq 2048, batch 2.

The step is PyTorch's usual mixed precision, the counterpart of ours (BF16 compute, FP32 master
weights): FP32 parameters, forward and loss under torch.autocast(bfloat16) (phase fwd),
`loss.backward()` (bwd), `clip_grad_norm_(1.0)`, fused AdamW (betas 0.9/0.95, weight decay 0.1
on matrices) and `zero_grad(set_to_none=True)` (optimizer). Compiled variants compile each block
and the head (regional compilation: one compiled graph serves every block, which keeps the cold
start short); torchao converts every Linear (the LM head too, as ours runs it in FP8) before.

FLOPs and optimizer bytes as gpt.rs. Writes $OUT/anchor-gpt.json (or ./anchor-gpt.json); a
variant that raises becomes an "error" row and the run goes on (exit status 1 at the end).
"""

import argparse
import math
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import (Results, add_step_rows, failed_row, first_call_s, float8_config, phase_times, skipped_row,
                    torchao_version)

VOCAB = 256
OPTIMIZER_BYTES_PER_PARAM = 30  # gpt.rs: OPTIMIZER_BYTES_PER_PARAM
PRESETS = {
    "small": {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "seq": 1024, "batch": 8},
    "large": {"layers": 24, "hidden": 2048, "heads": 16, "ffn": 8192, "seq": 2048, "batch": 2},
}
# variant -> (torchao recipe or None, compiled)
VARIANTS = {
    "torch eager bf16": (None, False),
    "torch.compile bf16": (None, True),
    "torchao tensorwise+compile": ("tensorwise", True),
}


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h = c["hidden"]
        self.heads = c["heads"]
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, c["ffn"])
        self.fc2 = nn.Linear(c["ffn"], h)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, self.heads, 3, h // self.heads).unbind(3)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.dropout(self.proj(a.transpose(1, 2).reshape(b, s, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class Head(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, VOCAB, bias=False)

    def forward(self, x):
        return self.lm_head(self.ln(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, c["hidden"])
        self.wpe = nn.Embedding(c["seq"], c["hidden"])
        self.blocks = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.head = Head(c["hidden"])

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def num_parameters(c):
    """GptConfig::num_parameters of te-runtime."""
    h, f, s, L = c["hidden"], c["ffn"], c["seq"], c["layers"]
    layer = (3 * h * h + 3 * h) + (h * h + h) + (2 * h * f + f + h) + 4 * h
    return (VOCAB + s) * h + L * layer + 2 * h + VOCAB * h


def adamw(model):
    """The step's optimizer, ours: fused AdamW, betas 0.9/0.95, weight decay 0.1 on matrices only."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-4, betas=(0.9, 0.95), fused=True,
    )


def run(preset, variant, args, res):
    c = PRESETS[preset]
    recipe, compiled = VARIANTS[variant]
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialized on the GPU: seconds less for 1.2 B parameters
        model = GPT(c).train()
    params = sum(p.numel() for p in model.parameters())
    if params != num_parameters(c):
        raise RuntimeError(f"the model has {params} parameters, GptConfig's formula {num_parameters(c)}")
    if recipe:
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, config=float8_config(recipe))
    if compiled:
        for block in model.blocks:
            block.compile()
        model.head.compile()
    opt = adamw(model)
    b, s = c["batch"], c["seq"]
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens = torch.randint(0, VOCAB, (b, s + 1), device="cuda", generator=gen)
    ids, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(mark):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()

    first_s = first_call_s(lambda: step(lambda: None))
    warmup = args.warmup + (1 if compiled else 0)
    iters = args.iters if preset == "small" else max(3, math.ceil(args.iters * 0.6))
    phases = phase_times(step, lambda: None, warmup, iters, 3)
    step_us = phases[1]
    h, f, L = c["hidden"], c["ffn"], c["layers"]
    n_tok = b * s
    gemm = 2 * n_tok * (L * (4 * h * h + 2 * h * f) + h * VOCAB)
    fwd = gemm + 2 * L * b * s * s * h
    fp8 = gemm if recipe else 0
    opt_bytes = OPTIMIZER_BYTES_PER_PARAM * params
    precision = "fp8" if recipe else "bf16"
    # Frames dynamo compiled so far in this process: one block graph serving all blocks stays small.
    frames = torch._dynamo.utils.counters.get("frames", {}).get("ok")
    extra = {"first_step_s": first_s, "parameters": params, "dynamo_frames_compiled": frames}
    work, shape = f"gpt {preset}", f"b{b} s{s}"
    add_step_rows(res, "gpt", work, shape, variant, precision, phases, fwd, fp8, opt_bytes, n_tok, **extra)
    print(f"gpt {preset} {variant}: {n_tok / (sorted(step_us)[len(step_us) // 2] * 1e-6):.0f} tokens/s, "
          f"first step {first_s:.1f} s, {frames} dynamo frames compiled so far", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="small,large", help="comma-separated subset of small,large")
    p.add_argument("--variants", help="comma-separated subset of: " + ",".join(VARIANTS) + " (default: all)")
    p.add_argument("--iters", type=int, default=10, help="timed steps of small (large: 60%%, at least 3)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps after the first (compiled: one more)")
    args = p.parse_args()
    presets = args.presets.split(",")
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    if set(presets) - set(PRESETS) or set(variants) - set(VARIANTS):
        p.error(f"presets from {','.join(PRESETS)}, variants from {','.join(VARIANTS)}")
    ao_version = torchao_version() if any(VARIANTS[v][0] for v in variants) else None
    res = Results("anchor-gpt.json", torchao=ao_version, warmup=args.warmup, iters=args.iters)
    for preset in presets:
        c = PRESETS[preset]
        shape = f"b{c['batch']} s{c['seq']}"
        for variant in variants:
            if VARIANTS[variant][0] and ao_version is None:
                res.add(skipped_row("gpt", f"gpt {preset}", shape, variant, "torchao does not import"))
                continue
            print(f"running gpt {preset} / {variant} ...", flush=True)
            try:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    run(preset, variant, args, res)
            except Exception as e:  # keep the other rows; reported, exit 1
                traceback.print_exc()
                res.add(failed_row("gpt", f"gpt {preset}", shape, variant, f"{type(e).__name__}: {e}"))
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    res.finish()


if __name__ == "__main__":
    main()
