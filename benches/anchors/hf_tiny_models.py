"""Tiny random decoder models made by Hugging Face transformers' own classes on the GPU machine
(its transformers, not the one of the committed fixtures), saved in the layout and reference
format of te-models/tests/fixtures/decoder/ (scripts/decoder-fixtures.py), so that the same Rust
test code (te-models/tests/decoder_hf.rs `reference`) checks them:

  python3 benches/anchors/hf_tiny_models.py --out DIR [--device cpu|cuda]

DIR/<model>/ for llama, qwen2, qwen3 and gemma3:
  config.json, model.safetensors   save_pretrained in float32 (safetensors, transformers 5's only
                                   format; generation_config.json removed, as in the fixtures)
  reference.safetensors            ids    I32 [T]        two sequences, lengths 7 and 13, packed
                                   lens   I32 [2]
                                   logits F32 [T, vocab] each sequence alone from position 0,
                                                         attn_implementation="eager", float32
                                   greedy I32 [2, 8]     model.generate(do_sample=False,
                                                         max_new_tokens=8) of each sequence alone,
                                                         -1 after an EOS stopped it
The models (vocab 512, hidden 64, random weights, seeded):
  llama   LlamaForCausalLM, 2 layers, GQA 4 heads : 2 KV heads, head_dim 32 (the fused attention's smallest), rope llama3 scaling
          (factor 8, low/high freq factors 1/4, original context 32: all three frequency bands)
  qwen2   Qwen2ForCausalLM, 3 layers, q/k/v bias, GQA 4:2, head_dim 32, untied head
  qwen3   Qwen3ForCausalLM, 2 layers, q/k RMSNorm, head_dim 32 (heads × head_dim = 128 ≠ hidden)
  gemma3  Gemma3ForCausalLM, 4 layers sliding, sliding, full, sliding; sliding_window 4, head_dim
          32, GQA 4:2, query_pre_attn_scalar 48, final_logit_softcapping 3.0, local/global rope
Prints one JSON line per model. CPU by default (deterministic, seconds).
"""

import argparse
import json
import math
import os

import torch
import transformers
from safetensors.torch import save_file

VOCAB = 512
LENS = [7, 13]
NEW = 8


def models():
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, max_position_embeddings=256,
                  num_attention_heads=4, num_key_value_heads=2)
    yield "llama", LlamaForCausalLM, LlamaConfig(
        **common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=False, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32),
    )
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(
        **common, num_hidden_layers=3, head_dim=32, tie_word_embeddings=False, eos_token_id=3,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    )
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(
        **common, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, eos_token_id=[3, 4],
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
    )
    yield "gemma3", Gemma3ForCausalLM, Gemma3TextConfig(
        **common, num_hidden_layers=4, head_dim=32, query_pre_attn_scalar=48, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    )


def randomize(model, zero_centered, seed):
    """Weights large enough that every layer moves the residual stream, so the logits spread and
    top-1 is well defined (transformers' own init, std 0.02, gives near-uniform logits). Gemma's
    norms are zero-centered (x · (1 + γ)); the others' are γ around 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = (0.05 if zero_centered else 0.25) if "embed" in name else 1.5 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:
                p.copy_((0.0 if zero_centered else 1.0) + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def check_config(name, cfg):
    """The settings this file is about, as the config reports them (a transformers version that
    ignored one would otherwise make a silently easier model)."""
    rope = json.dumps(getattr(cfg, "rope_parameters", None), default=str)
    want = {"llama": ["llama3"], "gemma3": ["linear", "sliding_attention"]}.get(name, [])
    missing = [w for w in want if w not in rope]
    if name == "gemma3":
        missing += [] if cfg.sliding_window == 4 and cfg.final_logit_softcapping == 3.0 else ["sliding/softcap"]
        missing += [] if cfg.layer_types[2] == "full_attention" else ["layer_types"]
    if missing:
        raise RuntimeError(f"{name}: transformers {transformers.__version__} dropped {missing}: {rope}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(99)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    for i, (name, cls, cfg) in enumerate(models()):
        cfg._attn_implementation = "eager"
        check_config(name, cfg)
        model = cls(cfg).to(torch.float32).eval()
        model.config._attn_implementation = "eager"
        randomize(model, zero_centered=name == "gemma3", seed=args.seed + i)
        model.to(args.device)
        with torch.no_grad():
            logits = torch.cat([model(input_ids=s[None].to(args.device)).logits[0].float().cpu() for s in seqs])
            greedy = torch.full((len(seqs), NEW), -1, dtype=torch.int32)
            for j, s in enumerate(seqs):
                x = s[None].to(args.device)
                gen = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                                     max_new_tokens=NEW, pad_token_id=0)[0, len(s):].cpu()
                greedy[j, : len(gen)] = gen.to(torch.int32)  # alone, an EOS stop just ends it early
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        model.to("cpu").save_pretrained(out)
        if os.path.exists(os.path.join(out, "generation_config.json")):
            os.remove(os.path.join(out, "generation_config.json"))
        save_file(
            {"ids": torch.cat(seqs).to(torch.int32), "lens": torch.tensor(LENS, dtype=torch.int32),
             "logits": logits.contiguous(), "greedy": greedy},
            os.path.join(out, "reference.safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__},
        )
        sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
        top = logits.max(dim=1).values
        print(json.dumps({"model": name, "dir": out, "files": sizes, "greedy": greedy.tolist(),
                          "logit_abs_max": float(logits.abs().max()), "top_logit_mean": float(top.mean()),
                          "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main()
