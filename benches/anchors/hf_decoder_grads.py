"""The gradients transformers computes for the tiny random decoders of hf_tiny_models.py (Llama,
Qwen2, Qwen3, Gemma 3 without final soft-capping, which te_models::decoder::train::DecoderLm
refuses), for tests/gpu/decoder_train.rs to check DecoderLm's loss and every parameter
gradient against:

  python3 benches/anchors/hf_decoder_grads.py --out DIR [--device cuda|cpu]

DIR/<model>/: config.json, model.safetensors (save_pretrained, float32, every weight already
on the BF16 grid so that a BF16 model holds the same values) and grads.safetensors:
  ids                I32 [B, S]  seeded random token ids, B = 3 rows of S = 37 tokens
  loss               F32 [1]     transformers' mean next-token cross-entropy over the rows
                                 (model(input_ids=ids, labels=ids): the last position of each
                                 row has no target)
  grad.<hf name>     F32         d loss / d parameter, every parameter (named_parameters: a
                                 tied head's share is in model.embed_tokens.weight)
Computed in float32 with attn_implementation="eager" and TF32 off. Prints a JSON line per model.
"""

import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_tiny_models import models, randomize  # noqa: E402

B, S = 3, 37


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=4321)
    args = p.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for i, (name, cls, cfg) in enumerate(models()):
        if name == "gemma3":
            cfg.final_logit_softcapping = None
        cfg._attn_implementation = "eager"
        model = cls(cfg).to(torch.float32)
        model.config._attn_implementation = "eager"
        randomize(model, zero_centered=name == "gemma3", seed=args.seed + i)
        with torch.no_grad():
            for q in model.parameters():
                q.copy_(q.to(torch.bfloat16).float())
        model.to(args.device).train()
        g = torch.Generator().manual_seed(args.seed + 100 + i)
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        x = ids.to(args.device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grads = {f"grad.{n}": q.grad.detach().float().cpu().contiguous() for n, q in model.named_parameters()}
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        model.to("cpu").save_pretrained(out)
        if os.path.exists(os.path.join(out, "generation_config.json")):
            os.remove(os.path.join(out, "generation_config.json"))
        tensors = {"ids": ids.to(torch.int32), "loss": loss.detach().float().cpu().reshape(1), **grads}
        save_file(tensors, os.path.join(out, "grads.safetensors"),
                  metadata={"transformers": transformers.__version__, "torch": torch.__version__})
        print(json.dumps({"model": name, "dir": out, "loss": float(loss.detach()), "params": len(grads),
                          "tied": bool(getattr(model.config, "tie_word_embeddings", False)),
                          "transformers": transformers.__version__}), flush=True)


if __name__ == "__main__":
    main()
