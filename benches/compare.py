"""Merges our benchmark JSON with the PyTorch anchors' into one set of Markdown tables: ours ÷
anchor time ratios, TFLOP/s (tokens/s for GPT steps) and the roofline floor of every row.

  python3 benches/compare.py DIR       # DIR holds bench-kernels.json and anchor-*.json

Inputs (written by `scripts/bench` under $OUT): `bench-kernels.json` (benches/kernels, "side":
"ours"), `anchor-gemm.json`, `anchor-attention.json`, `anchor-modules.json`, `anchor-gpt.json`
(benches/anchors, "side": "anchor") and, when their stages ran, `anchor-generate.json` (GPT
`small` in Hugging Face GPT-2) and `anchor-decoder-generate.json` (Gemma 3 270M in transformers):
section "generate", whose rows show tokens/s (prefill: prompt tokens, decode step: sequences), and
`anchor-finetune.json` (Gemma 3 270M's training step in transformers, section "gpt");
optionally `device.txt` (nvidia-smi's name, driver, memory). Rows with a
`section` join on (work, shape, pass); the row fields are described in benches/anchors/common.py.

Roofline floor of a row, from figures measured in the same run:
  floor = flops_fp8 ÷ P_fp8 + (flops − flops_fp8) ÷ P_bf16 + bytes ÷ B
where P_fp8 and P_bf16 are the best TFLOP/s of the GEMM rows of that precision (ours or the
anchor's) and B the device-to-device copy bandwidth. A row has FLOPs or bytes, except the GPT
step, whose optimizer's bytes add to its GEMMs' time (the phases do not overlap). Rows of ours
without a section (kernels, attention) count their FLOPs at the BF16 rate. "% roofline" is
floor ÷ median; "÷ X" is our median ÷ anchor X's median for the same work, shape and pass (< 1:
we are faster). A BF16 row of ours is not compared with FP8 anchors.

Last comes a summary, one line per work and shape: our fastest variant ÷ the fastest anchor for
the whole step. Writes DIR/compare.md (what it prints). Exit status 1, after printing all it can, when an input
is missing or unreadable, an anchor row failed, or an anchor row has no row of ours to compare.
Standard library only.
"""

import json
import os
import sys

SECTIONS = ("gemm", "attention", "modules", "gpt", "generate")
ANCHOR_FILES = ("anchor-gemm.json", "anchor-attention.json", "anchor-modules.json", "anchor-gpt.json")
# Read when present: their stages are not in scripts/bench's default set (minutes each).
OPTIONAL_ANCHOR_FILES = ("anchor-generate.json", "anchor-decoder-generate.json", "anchor-finetune.json")
# Passes that are a whole unit of work, for the summary.
WHOLE_PASSES = {"gemm", "fwd+bwd", "step", "prefill", "decode step"}


class Problems:
    """Errors that make the exit status 1; printed as they come and again at the end."""

    def __init__(self):
        self.items = []

    def __call__(self, msg):
        self.items.append(msg)
        print(f"ERROR: {msg}", file=sys.stderr, flush=True)


def load(path, problems):
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        problems(f"{path} is missing (its step did not run or did not finish; see its log beside it)")
        return None
    except (OSError, json.JSONDecodeError) as e:
        problems(f"{path} is unreadable: {e}")
        return None
    if not isinstance(doc.get("rows"), list):
        problems(f"{path} has no 'rows' list")
        return None
    return doc


def fmt(x, digits=0):
    return "" if x is None else f"{x:,.{digits}f}".replace(",", " ")


def ratio(x):
    return "" if x is None else f"{x:.2f}"


def gemm_peaks(rows):
    """Best TFLOP/s per precision over the GEMM rows."""
    peaks = {}
    for r in rows:
        if r.get("section") == "gemm" and r.get("flops") and r.get("median_us"):
            t = r["flops"] / r["median_us"] / 1e6
            peaks[r["precision"]] = max(peaks.get(r["precision"], 0.0), t)
    return peaks


def floor_us(r, peaks, copy_gbps):
    """The roofline floor of row `r` in µs, or None when a figure it needs was not measured."""
    flops, bytes_ = r.get("flops") or 0, r.get("bytes") or 0
    if not flops and not bytes_:
        return None
    fp8 = r.get("flops_fp8") or 0
    us = 0.0
    for n, p in [(fp8, "fp8"), (flops - fp8, "bf16")]:
        if n:
            if not peaks.get(p):
                return None
            us += n / (peaks[p] * 1e6)
    if bytes_:
        if not copy_gbps:
            return None
        us += bytes_ / (copy_gbps * 1e3)
    return us


def pct(floor, median):
    return "" if floor is None or not median else f"{100 * floor / median:.0f}%"


def md_table(header, lines):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in line) + " |" for line in lines]
    return out


def key(r):
    return (r["work"], r["shape"], r["pass"])


def section_table(section, ours, anchors, peaks, copy_gbps, problems):
    """The Markdown lines of one section: every row of ours and of the anchors, grouped by
    (work, shape, pass), with our ratios to each anchor variant."""
    ours = [r for r in ours if r.get("section") == section]
    anchors = [r for r in anchors if r.get("section") == section]
    if not ours and not anchors:
        return []
    anchor_variants = list(dict.fromkeys(r["variant"] for r in anchors))
    by_key = {}
    for r in ours + anchors:
        by_key.setdefault(key(r), []).append(r)
    our_keys = {key(r) for r in ours}
    for r in anchors:
        if key(r) not in our_keys:
            problems(f"anchor row {key(r)} {r['variant']!r} has no row of ours with the same work, shape and pass")
    seen = set()
    for r in ours + anchors:
        k = (*key(r), r["variant"])
        if k in seen:
            problems(f"two rows for {k}")
        seen.add(k)
    rate = section in ("gpt", "generate")
    header = ["work", "shape", "pass", "implementation", "median µs", "min–max µs", "TFLOP/s"]
    header += ["tokens/s"] if rate else []
    header += ["floor µs", "% roofline"] + [f"÷ {v}" for v in anchor_variants]
    lines = []
    for k, rows in by_key.items():
        anchor_of = {r["variant"]: r for r in rows if r["side"] == "anchor"}
        for r in rows:
            m = r["median_us"]
            fl = floor_us(r, peaks, copy_gbps)
            line = [*k, r["variant"], fmt(m, 1), f"{fmt(r['min_us'], 1)}–{fmt(r['max_us'], 1)}",
                    fmt(r["flops"] / m / 1e6) if r.get("flops") else ""]
            if rate:
                counted = r["pass"] == "step" or section == "generate"
                line.append(fmt(r["tokens"] / (m * 1e-6)) if r.get("tokens") and counted else "")
            line += [fmt(fl, 1), pct(fl, m)]
            for v in anchor_variants:
                a = anchor_of.get(v)
                comparable = (r["side"] == "ours" and a is not None
                              and not (r["precision"] == "bf16" and a["precision"] == "fp8"))
                line.append(ratio(m / a["median_us"]) if comparable else "")
            lines.append(line)
    return [f"### {section}", ""] + md_table(header, lines) + [""]


def summary(ours, anchors):
    """One line per work and shape: our fastest variant ÷ the fastest anchor, for the whole
    step (gemm, fwd+bwd, GPT step, a generation's prefill and decode step)."""
    lines = []
    for k in dict.fromkeys(key(r) for r in ours if r.get("section") and r["pass"] in WHOLE_PASSES):
        mine = min((r for r in ours if r.get("section") and key(r) == k), key=lambda r: r["median_us"])
        theirs = [r for r in anchors if key(r) == k]
        if not theirs:
            continue
        best = min(theirs, key=lambda r: r["median_us"])
        lines.append([*k, mine["variant"], fmt(mine["median_us"], 1), best["variant"], fmt(best["median_us"], 1),
                      ratio(mine["median_us"] / best["median_us"])])
    header = ["work", "shape", "pass", "our fastest", "µs", "fastest anchor", "µs", "ours ÷ anchor"]
    return ["### summary: fastest against fastest", ""] + md_table(header, lines) + [""]


def kernel_table(ours, peaks, copy_gbps):
    """Our rows without an anchor: bandwidth against the copy, or TFLOP/s, and the floor."""
    lines = []
    for r in ours:
        if r.get("section"):
            continue
        m = r["median_us"]
        gbps = r["bytes"] / m / 1e3 if r.get("bytes") else None
        row = dict(r, flops_fp8=0)
        fl = floor_us(row, peaks, copy_gbps)
        lines.append([r["name"], r["shape"], fmt(m, 1), f"{fmt(r['min_us'], 1)}–{fmt(r['max_us'], 1)}",
                      fmt(gbps), ratio(gbps / copy_gbps) if gbps and copy_gbps else "",
                      fmt(r["flops"] / m / 1e6) if r.get("flops") else "", fmt(fl, 1), pct(fl, m)])
    header = ["kernel", "shape", "median µs", "min–max µs", "GB/s", "÷ copy", "TFLOP/s", "floor µs", "% roofline"]
    return ["### kernels (ours only)", ""] + md_table(header, lines) + [""]


def main(argv):
    if len(argv) != 2 or argv[1].startswith("-"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out_dir = argv[1]
    problems = Problems()
    our_doc = load(os.path.join(out_dir, "bench-kernels.json"), problems)
    ours = [dict(r, side="ours") for r in our_doc["rows"]] if our_doc else []
    anchor_docs = {}
    for name in ANCHOR_FILES + OPTIONAL_ANCHOR_FILES:
        path = os.path.join(out_dir, name)
        if name in OPTIONAL_ANCHOR_FILES and not os.path.exists(path):
            continue
        doc = load(path, problems)
        if doc:
            anchor_docs[name] = doc
    anchors = []
    for name, doc in anchor_docs.items():
        for r in doc["rows"]:
            if "error" in r:
                problems(f"{name}: {r['work']} {r['shape']} {r['variant']} failed: {r['error']}")
            elif "skipped" in r:
                problems(f"{name}: {r['work']} {r['shape']} {r['variant']} skipped: {r['skipped']}")
            else:
                anchors.append(dict(r, side="anchor"))
    copy_gbps = our_doc.get("copy_gbps") if our_doc else None
    if our_doc and not copy_gbps:
        problems("bench-kernels.json has no copy bandwidth: byte floors are left blank")
    peaks = gemm_peaks(ours + anchors)
    for p in ("fp8", "bf16"):
        if p not in peaks:
            problems(f"no {p} GEMM row: floors that need the {p} rate are left blank")

    devices = {d["device"] for d in [our_doc, *anchor_docs.values()] if d}
    if len(devices) > 1:
        problems(f"the inputs come from different devices: {sorted(devices)}")
    out = ["## Results", ""]
    smi = os.path.join(out_dir, "device.txt")
    if os.path.exists(smi):
        with open(smi) as f:
            out += [f"Device (nvidia-smi): {f.read().strip()}", ""]
    if our_doc:
        out.append(f"Ours: {our_doc['device']}, {our_doc.get('driver', '')}, {our_doc.get('date', '')}; "
                   f"copy bandwidth {fmt(copy_gbps)} GB/s.")
    for name, doc in anchor_docs.items():
        out.append(f"{name}: torch {doc.get('torch')}, CUDA {doc.get('cuda')}, torchao {doc.get('torchao', '-')}, "
                   f"{doc.get('date', '')}, warm-up {doc.get('warmup')}, timed {doc.get('iters')}.")
    out += [f"GEMM peaks of this run (roofline rates): FP8 {fmt(peaks.get('fp8'))} TFLOP/s, "
            f"BF16 {fmt(peaks.get('bf16'))} TFLOP/s.", ""]
    if ours:
        out += kernel_table(ours, peaks, copy_gbps)
    if our_doc and our_doc.get("ratios"):
        lines = [[r["name"], f"{r['value']:.3f}", r.get("target", "")] for r in our_doc["ratios"]]
        out += ["### ours: derived figures", ""] + md_table(["figure", "value", "target"], lines) + [""]
    for section in SECTIONS:
        out += section_table(section, ours, anchors, peaks, copy_gbps, problems)
    out += summary(ours, anchors)
    if problems.items:
        out += ["### problems", ""] + [f"- {p}" for p in problems.items] + [""]
    text = "\n".join(out)
    print(text)
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(text + "\n")
    print(f"written to {os.path.join(out_dir, 'compare.md')}")
    return 1 if problems.items else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
