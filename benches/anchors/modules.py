"""PyTorch anchor for benches/kernels/modules.rs: the TE modules' work built from plain torch
modules, forward, backward and both timed separately, as
  torch eager bf16, torch.compile bf16,
  torchao float8 training (`convert_to_float8_training`) with the tensorwise recipe + compile,
  and with the rowwise recipe + compile.

Shapes (bf16 parameters and activations, training mode), as modules.rs:
- linear: Linear(4096, 16384) and Linear(16384, 4096), input [8192, in];
- layernorm_linear: LayerNorm(4096) -> Linear(4096, 12288), input [8192, 4096];
- layernorm_mlp: LayerNorm(4096) -> Linear(4096, 16384) -> GELU(tanh) -> Linear(16384, 4096),
  input [8192, 4096];
- grouped_linear: torch._grouped_mm of 8 experts' weights [14336, 4096] over 8192 rows split
  unevenly (GROUPED_SPLITS), no bias (the torchao variants are skipped: no nn.Linear in it);
- transformer_layer: hidden 4096, 32 heads, ffn 16384, input [seq 2048, batch 4, 4096] as TE;
  x + dropout(proj(attn(qkv(LN(x))))), then + dropout(MLP(LN(.))); hidden_dropout 0.1,
  attention_dropout 0.0; scaled_dot_product_attention is_causal=True on the flash backend.

One step = `out = model(x)` (phase fwd), `out.backward(dy)` (phase bwd) with a fixed random `dy`
and `x.requires_grad` (the input's gradient is computed, as for a layer inside a network); CUDA
events before, between and after. Before each step, untimed, the gradients are set to None, so
each backward writes fresh gradients. `--warmup` steps first (twice as many for compiled
variants; the first step's wall time, compilation included, is kept as first_step_s).
FLOPs as modules.rs: the GEMMs (at the FP8 rate under torchao) and causal attention's half.

`--memory` adds, per variant, the bytes saved for backward (distinct storages under
saved_tensors_hooks, parameters and x excluded) and the peak memory of one step.

Writes $OUT/anchor-modules.json (or ./anchor-modules.json); a variant that raises becomes an
"error" row and the run goes on (exit status 1 at the end). `scripts/bench` runs it.
"""

import argparse
import traceback

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from common import Results, failed_row, first_call_s, float8_config, phase_times, row, skipped_row, torchao_version

TOKENS, HIDDEN, FFN = 8192, 4096, 16384
SEQ, BATCH, HEADS = 2048, 4, 32
# grouped_linear: rows per expert (8192 in all, uneven) and the experts' FFN width, as modules.rs.
GROUPED_SPLITS = [1536, 512, 2048, 768, 1024, 256, 1280, 768]
GROUPED_FFN = 14336
LN_EPS = 1e-5
DTYPE = torch.bfloat16
# In order of interest (a run cut short loses the last): (work, shape as modules.rs spells it,
# builder, input shape, dy shape, forward FLOPs, of which GEMMs)
WORKS = [
    ("layernorm_mlp", f"{TOKENS}x{HIDDEN} ffn{FFN}",
     lambda: nn.Sequential(nn.LayerNorm(HIDDEN, eps=LN_EPS), nn.Linear(HIDDEN, FFN), nn.GELU(approximate="tanh"),
                           nn.Linear(FFN, HIDDEN)),
     (TOKENS, HIDDEN), (TOKENS, HIDDEN), 4 * TOKENS * HIDDEN * FFN, 4 * TOKENS * HIDDEN * FFN),
    ("transformer_layer", f"s{SEQ} b{BATCH} h{HIDDEN} heads{HEADS} ffn{FFN}", lambda: TransformerLayer(),
     (SEQ, BATCH, HIDDEN), (SEQ, BATCH, HIDDEN),
     2 * SEQ * BATCH * HIDDEN * (4 * HIDDEN + 2 * FFN) + 2 * BATCH * SEQ * SEQ * HIDDEN,
     2 * SEQ * BATCH * HIDDEN * (4 * HIDDEN + 2 * FFN)),
    ("layernorm_linear", f"{TOKENS}x{HIDDEN}->{3 * HIDDEN}",
     lambda: nn.Sequential(nn.LayerNorm(HIDDEN, eps=LN_EPS), nn.Linear(HIDDEN, 3 * HIDDEN)),
     (TOKENS, HIDDEN), (TOKENS, 3 * HIDDEN), 2 * TOKENS * HIDDEN * 3 * HIDDEN, 2 * TOKENS * HIDDEN * 3 * HIDDEN),
    ("grouped_linear", f"{TOKENS}x{HIDDEN}->{GROUPED_FFN} e{len(GROUPED_SPLITS)}", lambda: GroupedLinear(),
     (TOKENS, HIDDEN), (TOKENS, GROUPED_FFN), 2 * TOKENS * HIDDEN * GROUPED_FFN, 2 * TOKENS * HIDDEN * GROUPED_FFN),
    ("linear", f"{TOKENS}x4096->16384", lambda: nn.Linear(4096, 16384), (TOKENS, 4096), (TOKENS, 16384),
     2 * TOKENS * 4096 * 16384, 2 * TOKENS * 4096 * 16384),
    ("linear", f"{TOKENS}x16384->4096", lambda: nn.Linear(16384, 4096), (TOKENS, 16384), (TOKENS, 4096),
     2 * TOKENS * 4096 * 16384, 2 * TOKENS * 4096 * 16384),
]

# variant -> (torchao recipe or None, compiled); torchao variants run their GEMMs in FP8
VARIANTS = {
    "torch eager bf16": (None, False),
    "torch.compile bf16": (None, True),
    "torchao tensorwise+compile": ("tensorwise", True),
    "torchao rowwise+compile": ("rowwise", True),
}


class TransformerLayer(nn.Module):
    """Pre-LN GPT block as TE's TransformerLayer, on [seq, batch, hidden], with flash attention
    through scaled_dot_product_attention, QKV interleaved per head ([s, b, heads, 3, head_dim],
    TE's default), hidden dropout 0.1 after the attention projection and after the MLP."""

    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN, eps=LN_EPS)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x):
        s, b, h = x.shape
        qkv = self.qkv(self.ln1(x)).view(s, b, HEADS, 3, h // HEADS)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))  # [b, heads, s, head_dim]
        ctx = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(ctx.permute(2, 0, 1, 3).reshape(s, b, h)))
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh")))


class GroupedLinear(nn.Module):
    """TE's GroupedLinear without bias as torch._grouped_mm: expert i maps rows
    offs[i-1]:offs[i] of x [tokens, HIDDEN] through its weight [GROUPED_FFN, HIDDEN]."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(len(GROUPED_SPLITS), GROUPED_FFN, HIDDEN) * 0.02)
        offs = torch.cumsum(torch.tensor(GROUPED_SPLITS), 0).to(torch.int32)
        self.register_buffer("offs", offs, persistent=False)

    def forward(self, x):
        return torch._grouped_mm(x, self.weight.transpose(-2, -1), offs=self.offs)


def build(builder, recipe, compiled):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = builder().to(DTYPE).train()
    if recipe is not None:
        from torchao.float8 import convert_to_float8_training

        # A root nn.Linear is replaced, not modified: keep the returned module.
        model = convert_to_float8_training(model, config=float8_config(recipe))
    return torch.compile(model) if compiled else model


def storages(t):
    """(key, bytes) of the storages behind `t`, looking through tensor subclasses."""
    if is_traceable_wrapper_subclass(t):
        inner_names, _ = t.__tensor_flatten__()
        return [kv for name in inner_names for kv in storages(getattr(t, name))]
    st = t.untyped_storage()
    return [((st.device, st.data_ptr()), st.nbytes())]


def memory(model, x, dy, reset):
    """(bytes saved for backward beyond the parameters and x, peak bytes of one step above the
    bytes allocated before it)."""
    resident = {key for t in [x, *model.parameters()] for key, _ in storages(t)}
    saved = {}

    def pack(t):
        saved.update(storages(t))
        return t

    reset()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    out.backward(dy)
    reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model(x).backward(dy)
    torch.cuda.synchronize()
    return sum(n for key, n in saved.items() if key not in resident), torch.cuda.max_memory_allocated() - before


def run(work, shape, builder, x_shape, dy_shape, flops, gemm_flops, variant, args, res):
    recipe, compiled = VARIANTS[variant]
    model = build(builder, recipe, compiled)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(x_shape, device="cuda", dtype=DTYPE, generator=gen).requires_grad_(True)
    dy = torch.randn(dy_shape, device="cuda", dtype=DTYPE, generator=gen)

    def reset():
        model.zero_grad(set_to_none=True)
        x.grad = None

    def step(mark):
        out = model(x)
        mark()
        out.backward(dy)
        mark()

    reset()
    first_s = first_call_s(lambda: model(x).backward(dy))
    warmup = 2 * args.warmup if compiled else args.warmup
    (fwd, bwd), total = phase_times(step, reset, warmup, args.iters, 2)
    extra = {"first_step_s": first_s}
    if args.memory:
        extra["saved_for_backward_bytes"], extra["peak_step_bytes"] = memory(model, x, dy, reset)
    fp8 = gemm_flops if recipe else 0
    for pass_, us, times in [("fwd", fwd, 1), ("bwd", bwd, 2), ("fwd+bwd", total, 3)]:
        res.add(row("modules", work, shape, pass_, variant, "fp8" if recipe else "bf16", us, times * flops, times * fp8, **extra))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated works to run (default: all): " + ",".join(sorted({w[0] for w in WORKS})))
    p.add_argument("--variants", help="comma-separated subset of: " + ",".join(VARIANTS) + " (default: all)")
    p.add_argument("--iters", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps, doubled for compiled variants (default 3)")
    p.add_argument("--memory", action="store_true", help="also measure saved-for-backward and peak bytes")
    args = p.parse_args()
    variants = args.variants.split(",") if args.variants else list(VARIANTS)
    works = args.only.split(",") if args.only else sorted({w[0] for w in WORKS})
    for name, known in [("variants", VARIANTS), ("works", {w[0] for w in WORKS})]:
        unknown = set(variants if name == "variants" else works) - set(known)
        if unknown:
            p.error(f"unknown {name} {sorted(unknown)}; choose from {','.join(known)}")

    needs_ao = any(VARIANTS[v][0] for v in variants)
    ao_version = torchao_version() if needs_ao else None
    res = Results("anchor-modules.json", torchao=ao_version, warmup=args.warmup, iters=args.iters)
    for work, shape, *spec in WORKS:
        if work not in works:
            continue
        for variant in variants:
            if VARIANTS[variant][0] and work == "grouped_linear":
                res.add(skipped_row("modules", work, shape, variant, "torchao converts nn.Linear only"))
                continue
            if VARIANTS[variant][0] and ao_version is None:
                res.add(skipped_row("modules", work, shape, variant, "torchao does not import"))
                continue
            print(f"running {work} {shape} / {variant} ...", flush=True)
            try:
                # Flash attention for the layer; the backend is chosen while tracing, so this
                # holds for the compiled variants too.
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    run(work, shape, *spec, variant, args, res)
            except Exception as e:  # keep the other rows of a long GPU run; reported, exit 1
                traceback.print_exc()
                res.add(failed_row("modules", work, shape, variant, f"{type(e).__name__}: {e}"))
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    res.finish()


if __name__ == "__main__":
    main()
