"""Training-step anchor for fine-tuning a decoder of the family: transformers' Gemma3ForCausalLM
with Gemma 3 270M's configuration (random weights: the speed does not depend on them), BF16
parameters, fused AdamW with global-norm clipping, next-token loss over [batch, seq] windows,
eager and torch.compile, beside `kernels-bench --bench "gemma3 270m train"`
(benches/kernels/decoder_train.rs; issue 35's tokens/s target):

  python3 benches/anchors/finetune.py [--batch 8] [--seq 1024] [--iters 10] [--variants eager,compile]

Writes $OUT/anchor-finetune.json (benches/anchors/common.py's rows, section "gpt", work "gemma3
270m train": forward, backward, optimizer and the whole step per variant, FLOPs as the Rust bench
counts them), which benches/compare.py merges with our rows.
"""

import argparse
import traceback

import torch
import transformers

from common import Results, add_step_rows, failed_row, first_call_s, phase_times

OPTIMIZER_BYTES_PER_PARAM = 30  # as benches/kernels/gpt.rs
VARIANTS = {"eager": "transformers eager bf16", "compile": "transformers compile bf16"}


def gemma3_270m():
    from transformers import Gemma3TextConfig

    layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]
    return Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, layer_types=layer_types, max_position_embeddings=32768,
        rms_norm_eps=1e-6, tie_word_embeddings=True, final_logit_softcapping=None,
        rope_parameters=dict(full_attention=dict(rope_type="default", rope_theta=1000000.0),
                             sliding_attention=dict(rope_type="default", rope_theta=10000.0)),
    )


def flops(cfg, batch, seq):
    """Forward FLOPs as decoder_train.rs counts them: the GEMMs (head included) and the
    attention over the keys each query sees (causal, or its window)."""
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    hq, g, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    t = batch * seq
    per_layer = h * (hq + 2 * g) * d + hq * d * h + h * 2 * f + f * h
    gemm = 2 * t * cfg.num_hidden_layers * per_layer + 2 * t * h * v
    attention = 0
    for kind in cfg.layer_types:
        left = cfg.sliding_window - 1 if kind == "sliding_attention" else None
        seen = sum(min(i, left) + 1 for i in range(seq)) if left is not None else seq * (seq + 1) // 2
        attention += 4 * batch * hq * seen * d
    return gemm + attention


def run(variant, args, res):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = gemma3_270m()
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
    fwd_model = torch.compile(model) if variant == "compile" else model
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")

    def step(mark):
        loss = fwd_model(input_ids=ids, labels=ids).loss
        mark()
        loss.backward()
        mark()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark()

    first_s = first_call_s(lambda: step(lambda: None))
    torch.cuda.reset_peak_memory_stats()
    phases = phase_times(step, lambda: None, args.warmup, args.iters, 3)
    fwd = flops(cfg, args.batch, args.seq)
    opt_bytes = OPTIMIZER_BYTES_PER_PARAM * params
    tokens = args.batch * args.seq
    extra = {"first_step_s": first_s, "parameters": params,
             "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "transformers": transformers.__version__}
    shape = f"b{args.batch} s{args.seq}"
    add_step_rows(res, "gpt", "gemma3 270m train", shape, VARIANTS[variant], "bf16", phases, fwd, 0, opt_bytes, tokens,
                  **extra)
    step_us = phases[1]
    median = sorted(step_us)[len(step_us) // 2]
    print(f"gemma3 270m train {VARIANTS[variant]}: {tokens / (median * 1e-6):.0f} tokens/s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="eager,compile")
    args = p.parse_args()
    res = Results("anchor-finetune.json", warmup=args.warmup, iters=args.iters)
    for v in args.variants.split(","):
        if v not in VARIANTS:
            p.error(f"variants from {','.join(VARIANTS)}")
        try:
            run(v, args, res)
        except Exception as e:  # keep the other rows; reported, exit 1
            traceback.print_exc()
            res.add(failed_row("gpt", "gemma3 270m train", f"b{args.batch} s{args.seq}", VARIANTS[v],
                               f"{type(e).__name__}: {e}"))
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    res.finish()


if __name__ == "__main__":
    main()
