"""Training-step anchor for fine-tuning a decoder of the family: transformers' Gemma3ForCausalLM
with Gemma 3 270M's configuration (random weights: the speed does not depend on them), BF16
parameters, fused AdamW, next-token loss over [batch, seq] windows, eager and torch.compile,
beside `examples/finetune.rs` (issue 35's tokens/s target):

  python3 benches/anchors/finetune.py [--batch 8] [--seq 1024] [--steps 20] [--variants eager,compile]

Prints one JSON line per variant: tokens/s (median step after warmup), step ms, peak GiB.
"""

import argparse
import json
import statistics
import time

import torch
import transformers


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


def run(variant, batch, seq, steps, warmup):
    from transformers import Gemma3ForCausalLM

    torch.manual_seed(0)
    cfg = gemma3_270m()
    cfg._attn_implementation = "sdpa"
    model = Gemma3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, fused=True)
    fwd = torch.compile(model) if variant == "compile" else model
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t)
    ms = statistics.median(times) * 1e3
    return {"anchor": f"transformers {variant}", "model": "gemma3-270m (random)", "batch": batch, "seq": seq,
            "step_ms": ms, "tokens_per_s": batch * seq / (ms / 1e3),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss),
            "transformers": transformers.__version__, "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--variants", default="eager,compile")
    a = p.parse_args()
    for v in a.variants.split(","):
        print(json.dumps(run(v, a.batch, a.seq, a.steps, a.warmup)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
