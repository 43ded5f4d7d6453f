"""PyTorch anchor for generation with a real decoder: Gemma 3 270M from its GGUF file (transformers
dequantizes it; BF16 on CUDA), greedy decoding of 128 new tokens at batch 1, 8 and 32 with
random prompts of 128 and 1024 tokens (ids in [3, 200000), seeded), min_new_tokens = max so
every sequence decodes the full length:
  "hf eager":                  model.generate with the default dynamic cache;
  "hf static cache + compile": generation_config.cache_implementation = "static"; with --compile
                               auto (the default) generate compiles the decode step itself
                               (mode "reduce-overhead": CUDA graphs) and the prefill runs eagerly;
                               with --compile forward the whole forward is torch.compile'd
                               (fullgraph=True, generate's own compile off) — on 2026-11-27
                               (torch 2.11, transformers 5.17) that skipped CUDA graphs ("mutated
                               inputs") and then crashed the process with a segmentation fault.
Wall-clock time with torch.cuda.synchronize, as benches/anchors/generate.py and ours: prefill =
generate(max_new_tokens=1) (the prompt and the first token); decode step = (generate(128) −
median prefill) ÷ 127; medians of --reps runs after warm-up (compiled: two full runs per shape,
so CUDA graphs are recorded before timing). Rows in $OUT/anchor-decoder-generate.json (the
format of common.py): section "generate", work "gemma3 270m generate", shape
"b{batch} prompt {prompt}", pass "prefill" / "decode step", variant as above, tokens_per_s =
batch × prompt ÷ prefill, or batch ÷ decode step. A shape that would start after --budget-s
seconds is skipped (a skipped row), to stay inside one device call.

  python3 benches/anchors/decoder_generate.py --model /tmp/gemma/gemma-3-270m-q4_k_m.gguf [--out DIR]
  python3 benches/anchors/decoder_generate.py --random [--out DIR]
--random builds Gemma3ForCausalLM from Gemma 3 270M's config with random weights (transformers'
own init, seeded) instead of loading the GGUF: the speed does not depend on the weights, and the
250 MB file need not travel to the device (benches/kernels/decoder.rs does the same without
TE_GEMMA_GGUF).
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from common import Results, failed_row, first_call_s, row, skipped_row

WORK = "gemma3 270m generate"
# In this order so that torch.compile's automatic dynamic shapes reuse graphs: batch 1 has graphs
# of its own (size 1 is specialized); after b32 at both prompt lengths, batch and length are
# dynamic and b8 compiles nothing new. The compiled variant may not reach the last shapes within
# --budget-s: run it alone (--variants "hf static cache + compile") in a second call if so.
SHAPES = [(1, 128), (32, 128), (32, 1024), (8, 128), (8, 1024), (1, 1024)]
VARIANTS = ["hf eager", "hf static cache + compile"]


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# Gemma 3 270M's config.json (the same as GEMMA3_270M in benches/kernels/decoder.rs).
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
                   rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=512,
                   layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3, query_pre_attn_scalar=256,
                   max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh",
                   tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)


def load(path, attn):
    from transformers import AutoModelForCausalLM

    if path is None:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        torch.manual_seed(0)
        cfg = Gemma3TextConfig(**GEMMA3_270M)
        cfg._attn_implementation = attn
        return Gemma3ForCausalLM(cfg).to(dtype=torch.bfloat16, device="cuda").eval()
    d, f = os.path.split(os.path.abspath(path))
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.bfloat16, attn_implementation=attn)
    return m.to("cuda").eval()


def set_mode(m, eager_forward, compiled, fullgraph, dynamic, auto):
    """Switches the loaded model between the two variants."""
    gc = m.generation_config
    if compiled and auto:
        # transformers' own recipe: a static cache makes generate compile the decode step itself
        # (its CompileConfig: inductor, mode "reduce-overhead", i.e. CUDA graphs); the prefill runs eagerly.
        gc.cache_implementation = "static"
        gc.disable_compile = False
        m.forward = eager_forward
    elif compiled:
        gc.cache_implementation = "static"
        gc.disable_compile = True
        m.forward = torch.compile(eager_forward, mode="reduce-overhead", fullgraph=fullgraph, dynamic=dynamic)
    else:
        gc.cache_implementation = None
        m.forward = eager_forward


def timed(fn, reps):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def prompt_ids(batch, prompt, seed):
    g = torch.Generator().manual_seed(seed * 1_000_003 + batch * 10_007 + prompt)
    return torch.randint(3, 200_000, (batch, prompt), generator=g).to("cuda")


def add(res, r):
    res.add(r)
    print(json.dumps(r), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="the .gguf file")
    src.add_argument("--random", action="store_true", help="Gemma 3 270M's architecture with random weights")
    p.add_argument("--out", help="where the JSON goes (default $OUT, else .)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn", default="sdpa", help="attn_implementation (transformers' default: sdpa)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    p.add_argument("--shapes", default=",".join(f"{b}x{s}" for b, s in SHAPES), help="BATCHxPROMPT,...")
    p.add_argument("--budget-s", type=float, default=225.0, help="skip shapes that would start after this")
    p.add_argument("--compile", choices=["auto", "forward"], default="auto",
                   help="auto: generate's automatic compile of the decode step with the static cache "
                        "(transformers' default; used 2026-11-27 because compiling the whole forward "
                        "crashed the process); forward: torch.compile of the model's forward")
    p.add_argument("--no-fullgraph", action="store_true", help="with --compile forward: fullgraph=False")
    p.add_argument("--dynamic", choices=["auto", "true", "false"], default="auto", help="torch.compile dynamic=")
    args = p.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        os.environ["OUT"] = args.out
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    new = args.new_tokens
    t_start = time.perf_counter()
    # Each (batch, prompt, cache length) is a new graph; the default limit of 8 would fall back to eager.
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    import transformers

    log(f"loading {args.model}")
    m = load(args.model, args.attn)
    eager_forward = m.forward
    res = Results("anchor-decoder-generate.json", model=os.path.basename(args.model) if args.model else "gemma3 270m random weights", attn=args.attn,
                  transformers=transformers.__version__, new_tokens=new, reps=args.reps,
                  load_s=time.perf_counter() - t_start)
    dynamic = {"auto": None, "true": True, "false": False}[args.dynamic]
    for variant in variants:
        if variant not in VARIANTS:
            sys.exit(f"unknown variant {variant!r}")
        compiled = variant != "hf eager"
        set_mode(m, eager_forward, compiled, not args.no_fullgraph, dynamic, args.compile == "auto")
        for batch, prompt in shapes:
            shape = f"b{batch} prompt {prompt}"
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                add(res, skipped_row("generate", WORK, shape, variant, f"budget: {elapsed:.0f} s > {args.budget_s:.0f} s"))
                continue
            log(f"[{elapsed:6.1f} s] {variant} {shape}")
            try:
                ids = prompt_ids(batch, prompt, args.seed)
                mask = torch.ones_like(ids)

                def gen(n):
                    with torch.no_grad():
                        return m.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                          max_new_tokens=n, min_new_tokens=n)

                # Warm-up: the longest run first, so the static cache is made once and reused.
                first_s = first_call_s(lambda: gen(new))
                for _ in range(2 if compiled else 1):
                    out = gen(new)
                    gen(1)
                if out.shape != (batch, prompt + new):
                    raise RuntimeError(f"generate returned {tuple(out.shape)}, expected {(batch, prompt + new)}")
                prefill = timed(lambda: gen(1), args.reps)
                full = timed(lambda: gen(new), args.reps)
                pre = statistics.median(prefill)
                step = [(f - pre) / (new - 1) for f in full]
                extra = {"new_tokens": new, "first_call_s": first_s}
                add(res, row("generate", WORK, shape, "prefill", variant, "bf16", prefill,
                             tokens=batch * prompt, tokens_per_s=batch * prompt / (pre * 1e-6), **extra))
                add(res, row("generate", WORK, shape, "decode step", variant, "bf16", step, tokens=batch,
                             tokens_per_s=batch / (statistics.median(step) * 1e-6), **extra))
            except Exception:  # noqa: BLE001 - reported as a failed row, the run goes on
                add(res, failed_row("generate", WORK, shape, variant, traceback.format_exc(limit=4)))
            torch.cuda.empty_cache()
    log(f"done in {time.perf_counter() - t_start:.0f} s")
    res.finish()


if __name__ == "__main__":
    main()
