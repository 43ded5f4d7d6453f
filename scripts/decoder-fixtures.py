#!/usr/bin/env python3
"""Reference fixtures of the decoder family (te-models/tests/fixtures/decoder/), made by
Hugging Face transformers' own modeling code: for Llama, Qwen2, Qwen3 and Gemma 3, a tiny model
with random weights (created from a config, weights rounded to BF16 (Qwen2: F16) and saved with
`save_pretrained`: config.json + model.safetensors in that dtype), and `reference.safetensors`
with the f32 logits transformers computes on fixed token ids and its greedy continuations.
Qwen2 is saved in shards, so the import of a sharded directory is tested on transformers' own
index.
The Rust tests (te-models/tests/decoder_hf.rs) read these files; CI needs no Python.

Regenerate (CPU is enough; a few seconds):
    python3 -m venv /tmp/ref && /tmp/ref/bin/pip install torch transformers safetensors numpy
    /tmp/ref/bin/python scripts/decoder-fixtures.py

Tested with transformers 5.24.0 and torch 2.15.0.

reference.safetensors holds:
- ids     I32 [T]        two sequences (lengths `lens`) packed one after the other
- lens    I32 [2]
- logits  F32 [T, vocab] each sequence run alone from position 0, attn_implementation="eager", f32
- greedy  I32 [2, NEW]   model.generate(do_sample=False, max_new_tokens=NEW) of each sequence alone
                         (-1 after an EOS stopped it)
"""

import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
import transformers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

VOCAB = 300
LENS = [20, 13]
NEW = 8
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "te-models", "tests", "fixtures", "decoder")


def models():
    common = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256)
    yield "llama", LlamaForCausalLM, LlamaConfig(
        **common,
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ), torch.bfloat16
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(
        **common,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        eos_token_id=3,
    ), torch.float16
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(
        **common,
        hidden_size=48,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        tie_word_embeddings=True,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        eos_token_id=[3, 4],
    ), torch.bfloat16
    yield "gemma3", Gemma3ForCausalLM, Gemma3TextConfig(
        **common,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        query_pre_attn_scalar=24,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=2.0,
        rope_parameters=dict(
            full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1000000.0),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0),
        ),
    ), torch.bfloat16


def randomize(model, dtype, zero_centered):
    """Weights large enough that every layer moves the residual stream (so logits spread, top-1 is
    well defined and a tied head does not just echo the input token), rounded to `dtype`."""
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                # Gemma multiplies the embedding by √hidden and normalizes every layer's output.
                embed = 0.05 if zero_centered else 0.25
                std = embed if "embed" in name else 1.5 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif "norm" in name:
                base = 0.0 if zero_centered else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:  # biases
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            p.copy_(p.to(dtype).to(torch.float32))


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(99)
    seqs = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENS]
    for name, cls, cfg, dtype in models():
        cfg._attn_implementation = "eager"
        model = cls(cfg).to(torch.float32).eval()
        model.config._attn_implementation = "eager"
        randomize(model, dtype, zero_centered=name.startswith("gemma"))
        out = os.path.join(OUT, name)
        os.makedirs(out, exist_ok=True)
        with torch.no_grad():
            logits = torch.cat([model(input_ids=s[None]).logits[0] for s in seqs])
            greedy = torch.full((len(seqs), NEW), -1, dtype=torch.int32)
            for j, s in enumerate(seqs):
                gen = model.generate(
                    input_ids=s[None],
                    attention_mask=torch.ones(1, len(s), dtype=torch.long),
                    do_sample=False,
                    max_new_tokens=NEW,
                    pad_token_id=0,
                )[0, len(s):]
                greedy[j, : len(gen)] = gen.to(torch.int32)
        # Qwen2 is saved in shards (model.safetensors.index.json + model-0000i-of-0000n.safetensors).
        shard = "60KB" if name == "qwen2" else "50GB"
        model.to(dtype).save_pretrained(out, max_shard_size=shard)
        # The config keeps `dtype`; drop fields irrelevant here to keep the file small and stable.
        save_file(
            {
                "ids": torch.cat(seqs).to(torch.int32),
                "lens": torch.tensor(LENS, dtype=torch.int32),
                "logits": logits.to(torch.float32).contiguous(),
                "greedy": greedy,
            },
            os.path.join(out, "reference.safetensors"),
            metadata={"transformers": transformers.__version__, "torch": torch.__version__},
        )
        if os.path.exists(os.path.join(out, "generation_config.json")):
            os.remove(os.path.join(out, "generation_config.json"))
        sizes = {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))}
        print(name, json.dumps(sizes), "greedy", greedy.tolist(), file=sys.stderr)


if __name__ == "__main__":
    main()
