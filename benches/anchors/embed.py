"""PyTorch anchor for `te embed --bench`: sentence-transformers (all-MiniLM-L6-v2 from a local
directory, PyTorch eager) on the same sentences, the same maximum length (256) and the same batch
size (256) on the same GPU, in fp16 (timed) and fp32 (the accuracy anchor).

Prints and writes $OUT/anchor-embed.json (or ./anchor-embed.json): sentences/s of fp16 (median
of --iters passes after one warm-up pass, each pass synchronised), and, for every .npy of our
embeddings given with --ours NAME=PATH, the per-sentence cosine (min, mean) against the
sentence-transformers fp32 embeddings. On the GPU machine (after `bash scripts/fill-minilm --join`):

  .gpu/bin/te embed --model .data/minilm -i .data/embed/sentences.txt --precision fp8 \
      --out-npy $OUT/fp8.npy --bench 5 --report $OUT/te-fp8.json
  .gpu/bin/te embed --model .data/minilm -i .data/embed/sentences.txt --precision bf16 \
      --out-npy $OUT/bf16.npy --bench 5 --report $OUT/te-bf16.json
  python3 benches/anchors/embed.py --ours fp8=$OUT/fp8.npy --ours bf16=$OUT/bf16.npy
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from sentence_transformers import SentenceTransformer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=".data/minilm")
    ap.add_argument("--sentences", default=".data/embed/sentences.txt")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ours", action="append", default=[], help="NAME=PATH of a .npy [n, hidden] in input order")
    a = ap.parse_args()
    sentences = [l.rstrip() for l in open(a.sentences, encoding="utf-8") if l.strip()]
    model = SentenceTransformer(a.model, device="cuda")
    model.max_seq_length = a.max_length
    model.eval()
    enc = lambda: model.encode(sentences, batch_size=a.batch_size, normalize_embeddings=True,
                               convert_to_numpy=True, show_progress_bar=False)
    with torch.inference_mode():
        ref32 = enc()
        model.half()
        enc()  # warm-up
        times = []
        for _ in range(a.iters):
            torch.cuda.synchronize()
            t = time.perf_counter()
            e16 = enc()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    def cos(x, y):
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        y = y / np.linalg.norm(y, axis=1, keepdims=True)
        c = (x.astype(np.float64) * y.astype(np.float64)).sum(1)
        return float(c.min()), float(c.mean())
    out = {
        "device": torch.cuda.get_device_name(),
        "sentences": len(sentences),
        "batch_size": a.batch_size,
        "max_length": a.max_length,
        "st_fp16_sentences_per_s": len(sentences) / statistics.median(times),
        "st_fp16_vs_fp32_cosine": cos(e16.astype(np.float32), ref32),
        "torch": torch.__version__,
    }
    for spec in a.ours:
        name, path = spec.split("=", 1)
        ours = np.load(path)
        out[f"{name}_vs_st_fp32_cosine"] = cos(ours, ref32)
    print(json.dumps(out, indent=1))
    dst = os.path.join(os.environ.get("OUT", "."), "anchor-embed.json")
    with open(dst, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
