"""Ours beside transformers on the same token ids: logits, greedy continuations and perplexity.

  python3 benches/anchors/compare_logits.py --ours DIR --theirs DIR [--json FILE]

Each DIR holds what one side wrote (benches/anchors/decoder_reference.py writes transformers'
side; ours writes the same names):
  logits_<name>.npy  float32, C order, shape [T, vocab] (NumPy .npy, version 1.0 or 2.0): row t
                     is the logits after tokens 0..t of text <name>, one forward from position 0;
  result.json        {"perplexity": {name: {"mean_nll": float, "perplexity": float,
                                            "tokens": int}},
                      "greedy": {name: [int, ...]}}
                     `greedy` holds only the new tokens (not the prompt): argmax at every step,
                     no EOS stop. Other keys are allowed and ignored (decoder_reference.py adds
                     its config, versions, settings and checks).
For every logits file on both sides (the first min(T) rows when the lengths differ):
  top-1     fraction of positions whose argmax agrees;
  KL        mean and max over positions of KL(theirs || ours) = Σ p_theirs (log p_theirs −
            log p_ours), from log_softmax in float64, nats;
  max |Δ|   largest absolute logit difference.
Greedy continuations: identical, or the first position where they differ. Perplexity: ours ÷
theirs, and both token counts. Prints Markdown tables, then one JSON line with every figure
(also written to --json). Exit status 1 when the two sides have nothing in common. NumPy only.
"""

import argparse
import glob
import json
import os
import sys

import numpy as np


def log_softmax64(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def compare_logits(ours, theirs, chunk=32):
    """Figures of two [T, vocab] arrays (memory-mapped; processed `chunk` rows at a time)."""
    rows = min(len(ours), len(theirs))
    top1, kl_sum, kl_max, diff_max = 0, 0.0, 0.0, 0.0
    for r0 in range(0, rows, chunk):
        r1 = min(r0 + chunk, rows)
        a = np.asarray(theirs[r0:r1], dtype=np.float64)
        b = np.asarray(ours[r0:r1], dtype=np.float64)
        top1 += int((a.argmax(axis=1) == b.argmax(axis=1)).sum())
        la, lb = log_softmax64(a), log_softmax64(b)
        pa = np.exp(la)
        kl = np.where(pa > 0, pa * (la - lb), 0.0).sum(axis=1)
        kl_sum += float(kl.sum())
        kl_max = max(kl_max, float(kl.max()))
        diff_max = max(diff_max, float(np.abs(a - b).max()))
    return {"rows": rows, "rows_ours": len(ours), "rows_theirs": len(theirs), "top1": top1 / rows,
            "kl_mean": kl_sum / rows, "kl_max": kl_max, "max_abs_diff": diff_max}


def first_divergence(a, b):
    """None when equal, else the first index where they differ (a shorter list differs at its end)."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def load_result(d):
    path = os.path.join(d, "result.json")
    if not os.path.exists(path):
        print(f"note: {path} is missing (no greedy or perplexity figures from that side)", file=sys.stderr)
        return {}
    with open(path) as f:
        return json.load(f)


def md_table(header, lines):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]


def names(d):
    return {os.path.basename(p)[len("logits_"):-len(".npy")] for p in glob.glob(os.path.join(d, "logits_*.npy"))}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ours", required=True)
    p.add_argument("--theirs", required=True)
    p.add_argument("--json", help="also write the JSON line's object to this file")
    args = p.parse_args()
    doc = {"ours": args.ours, "theirs": args.theirs, "logits": {}, "greedy": {}, "perplexity": {}, "problems": []}

    common = sorted(names(args.ours) & names(args.theirs))
    for only, side in [(names(args.ours) - names(args.theirs), "ours"), (names(args.theirs) - names(args.ours), "theirs")]:
        doc["problems"] += [f"logits_{n}.npy only in {side}" for n in sorted(only)]
    lines = []
    for n in common:
        a = np.load(os.path.join(args.ours, f"logits_{n}.npy"), mmap_mode="r")
        b = np.load(os.path.join(args.theirs, f"logits_{n}.npy"), mmap_mode="r")
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
            doc["problems"].append(f"{n}: shapes {a.shape} (ours) and {b.shape} (theirs) do not compare")
            continue
        r = doc["logits"][n] = compare_logits(a, b)
        rows = f"{r['rows']}" if r["rows_ours"] == r["rows_theirs"] else f"{r['rows']} ({r['rows_ours']} vs {r['rows_theirs']})"
        lines.append([n, rows, f"{100 * r['top1']:.2f}%", f"{r['kl_mean']:.3e}", f"{r['kl_max']:.3e}",
                      f"{r['max_abs_diff']:.4f}"])
    out = ["### logits: ours against transformers", ""]
    out += md_table(["text", "positions", "top-1 agrees", "mean KL(theirs‖ours)", "max KL", "max abs Δ logit"], lines)

    ours, theirs = load_result(args.ours), load_result(args.theirs)
    lines = []
    g_ours, g_theirs = ours.get("greedy", {}), theirs.get("greedy", {})
    for n in sorted(set(g_ours) & set(g_theirs)):
        d = first_divergence(g_ours[n], g_theirs[n])
        doc["greedy"][n] = {"identical": d is None, "first_divergence": d,
                            "len_ours": len(g_ours[n]), "len_theirs": len(g_theirs[n])}
        lines.append([n, len(g_ours[n]), len(g_theirs[n]), "identical" if d is None else f"differ from token {d}"])
    out += ["", "### greedy continuations", ""] + md_table(["prompt", "ours", "theirs", "result"], lines)

    lines = []
    p_ours, p_theirs = ours.get("perplexity", {}), theirs.get("perplexity", {})
    for n in sorted(set(p_ours) & set(p_theirs)):
        a, b = p_ours[n], p_theirs[n]
        r = doc["perplexity"][n] = {"ours": a["perplexity"], "theirs": b["perplexity"],
                                    "ratio": a["perplexity"] / b["perplexity"],
                                    "nll_diff": a["mean_nll"] - b["mean_nll"],
                                    "tokens_ours": a["tokens"], "tokens_theirs": b["tokens"]}
        if a["tokens"] != b["tokens"]:
            doc["problems"].append(f"{n}: perplexity scored {a['tokens']} tokens (ours) and {b['tokens']} (theirs)")
        lines.append([n, f"{a['perplexity']:.4f}", f"{b['perplexity']:.4f}", f"{r['ratio']:.4f}",
                      f"{r['nll_diff']:+.2e}", f"{a['tokens']} / {b['tokens']}"])
    out += ["", "### perplexity", ""]
    out += md_table(["text", "ours", "theirs", "ours ÷ theirs", "Δ mean NLL", "tokens ours / theirs"], lines)
    if doc["problems"]:
        out += ["", "### problems", ""] + [f"- {x}" for x in doc["problems"]]
    print("\n".join(out))
    print(json.dumps(doc))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if not (doc["logits"] or doc["greedy"] or doc["perplexity"]):
        print("ERROR: the two sides have nothing in common", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
