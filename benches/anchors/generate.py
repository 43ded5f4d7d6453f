"""PyTorch anchor for benches/kernels/generate.rs: text generation with Hugging Face transformers'
GPT2LMHeadModel configured to the GPT `small` preset (12 layers, hidden 768, 12 heads, ffn
3072, context 1024, byte vocabulary 256, GELU tanh), BF16, random weights, greedy decoding of 64
new tokens at batch 1 and 32 with prompts of 128 and 900 tokens:
  "hf eager":                  model.generate with the default dynamic cache;
  "hf static cache + compile": generation_config.cache_implementation = "static" and the
                               forward compiled with torch.compile(mode="reduce-overhead"),
                               which replays CUDA graphs (Hugging Face's documented fast path).
Wall-clock time as ours: prefill = generate(max_new_tokens=1) (the prompt and the first token),
decode = (generate(64) − prefill) / 63 per step. Writes $OUT/anchor-generate.json rows with
section "generate", work "gpt small generate", shape "b{batch} prompt {prompt}", pass
"prefill" / "decode step", and the tokens/s in `tokens_per_s`.
"""

import argparse
import time
import traceback

import torch

from common import Results, failed_row, row

NEW_TOKENS = 64
SHAPES = [(1, 128), (1, 900), (32, 128), (32, 900)]
WORK = "gpt small generate"


def model(compiled):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=256,
        n_positions=1024,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_inner=3072,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
    )
    m = GPT2LMHeadModel(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    if compiled:
        m.generation_config.cache_implementation = "static"
        m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    return m


def timed(fn, reps):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    res = Results("anchor-generate.json")
    for variant, compiled in [("hf eager", False), ("hf static cache + compile", True)]:
        try:
            m = model(compiled)
        except Exception:  # noqa: BLE001 - reported as a failed row, the run goes on
            res.add(failed_row("generate", WORK, "-", variant, traceback.format_exc(limit=3)))
            continue
        for batch, prompt in SHAPES:
            shape = f"b{batch} prompt {prompt}"
            try:
                ids = torch.randint(0, 256, (batch, prompt), device="cuda")
                mask = torch.ones_like(ids)

                def gen(n):
                    with torch.no_grad():
                        m.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

                gen(NEW_TOKENS)  # warm-up (and compilation)
                gen(1)
                prefill = timed(lambda: gen(1), args.reps)
                full = timed(lambda: gen(NEW_TOKENS), args.reps)
                step = [(f - min(prefill)) / (NEW_TOKENS - 1) for f in full]
                res.add(row("generate", WORK, shape, "prefill", variant, "bf16", prefill,
                            tokens_per_s=batch * prompt / (min(prefill) * 1e-6)))
                res.add(row("generate", WORK, shape, "decode step", variant, "bf16", step,
                            tokens_per_s=batch / (sorted(step)[len(step) // 2] * 1e-6)))
            except Exception:  # noqa: BLE001
                res.add(failed_row("generate", WORK, shape, variant, traceback.format_exc(limit=3)))
        del m
        torch.cuda.empty_cache()
    res.finish()


if __name__ == "__main__":
    main()
