"""Shared by the PyTorch anchors (gemm.py, modules.py, gpt.py): CUDA-event timing of steps split
into phases, and the JSON they write, whose rows carry the keys benches/compare.py joins with our
rows (benches/kernels/harness.rs `Work`):

  section    "gemm", "modules" or "gpt": the table the row goes to
  work       what runs ("linear", "transformer_layer", "gpt small", "gemm")
  shape      the shape, spelled as the Rust bench spells it
  pass       "fwd", "bwd", "fwd+bwd", "optimizer", "step" or "gemm"
  variant    the implementation ("torch eager bf16", "torchao rowwise+compile", ...)
  precision  "fp8" when the GEMMs run in FP8, else "bf16"
  median_us, min_us, max_us    over the timed repeats
  flops      FLOPs of the work (0 for memory-bound rows), flops_fp8 the part at the FP8 rate
  bytes      bytes that bound the row when it has no FLOPs (the GPT optimizer), else null
  tokens     tokens per step (GPT rows)

The JSON file is rewritten after every row, so a run cut short (a timeout) keeps what it measured.
"""

import json
import os
import statistics
import sys
import time

import torch


def phase_times(step, reset, warmup, iters, phases):
    """Per-phase and whole-step microseconds of `step(mark)` over `iters` runs after `warmup` runs.

    `step` calls `mark()` once after each of its `phases` phases; a CUDA event is recorded before
    the step and at each mark. `reset()` runs before every step, outside the timed region.
    Returns (list of `phases` lists of µs, list of whole-step µs)."""

    def run():
        events = []

        def mark():
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)

        reset()
        mark()
        step(mark)
        if len(events) != phases + 1:
            raise RuntimeError(f"the step marked {len(events) - 1} phases, expected {phases}")
        return events

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    steps = [run() for _ in range(iters)]
    torch.cuda.synchronize()
    per_phase = [[e[p].elapsed_time(e[p + 1]) * 1e3 for e in steps] for p in range(phases)]
    return per_phase, [e[0].elapsed_time(e[phases]) * 1e3 for e in steps]


def first_call_s(fn):
    """Wall seconds of one `fn()` (with compilation, for compiled variants), synchronized."""
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def stats(us):
    return {"median_us": statistics.median(us), "min_us": min(us), "max_us": max(us)}


class Results:
    """The anchor's JSON document at `$OUT/<name>` (or ./<name>), rewritten after every row."""

    def __init__(self, name, **meta):
        self.path = os.path.join(os.environ.get("OUT", "."), name)
        self.doc = {
            "side": "anchor",
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv,
            **meta,
            "rows": [],
        }
        self.failed = False
        self.write()

    def add(self, row):
        self.doc["rows"].append(row)
        self.write()
        if "error" in row:
            self.failed = True
            print(f"FAILED {row['work']} {row['shape']} {row['variant']}: {row['error']}", flush=True)
        elif "skipped" in row:
            print(f"skipped {row['work']} {row['shape']} {row['variant']}: {row['skipped']}", flush=True)
        else:
            tflops = f"{row['flops'] / row['median_us'] / 1e6:8.0f} TFLOP/s" if row.get("flops") else ""
            print(
                f"{row['work']:<18} {row['shape']:<32} {row['pass']:<9} {row['variant']:<28} "
                f"{row['median_us']:>11.1f} µs {tflops}",
                flush=True,
            )

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)

    def finish(self):
        """Prints where the JSON is; exits 1 when a row failed."""
        print(f"JSON written to {self.path}")
        if self.failed:
            sys.exit(1)


def row(section, work, shape, pass_, variant, precision, us, flops=0, flops_fp8=0, bytes_=None, tokens=None, **extra):
    return {
        "section": section,
        "work": work,
        "shape": shape,
        "pass": pass_,
        "variant": variant,
        "precision": precision,
        **stats(us),
        "flops": flops,
        "flops_fp8": flops_fp8,
        "bytes": bytes_,
        "tokens": tokens,
        **extra,
    }


def add_step_rows(res, section, work, shape, variant, precision, phases, fwd, fp8, opt_bytes, tokens, **extra):
    """The fwd, bwd (twice the forward's FLOPs), optimizer and step rows of one timed training
    step: `phases` = ((fwd_us, bwd_us, opt_us), step_us) as phase_times returns them, `fwd` the
    forward's FLOPs and `fp8` those of them at the FP8 rate, `opt_bytes` the optimizer's."""
    (fwd_us, bwd_us, opt_us), step_us = phases
    for pass_, us, flops, flops_fp8, bytes_ in [
        ("fwd", fwd_us, fwd, fp8, None),
        ("bwd", bwd_us, 2 * fwd, 2 * fp8, None),
        ("optimizer", opt_us, 0, 0, opt_bytes),
        ("step", step_us, 3 * fwd, 3 * fp8, opt_bytes),
    ]:
        res.add(row(section, work, shape, pass_, variant, precision, us, flops, flops_fp8, bytes_, tokens, **extra))


def failed_row(section, work, shape, variant, error):
    """A row for a variant that raised (the run goes on; the script exits 1 at the end)."""
    return {"section": section, "work": work, "shape": shape, "pass": None, "variant": variant, "error": error}


def skipped_row(section, work, shape, variant, why):
    return {"section": section, "work": work, "shape": shape, "pass": None, "variant": variant, "skipped": why}


def torchao_version():
    """torchao's version, or None (with a message) when it does not import."""
    try:
        import torchao
    except ImportError as e:
        print(f"torchao does not import ({e}): its variants are skipped (carry .whl and set PYTHONPATH)", flush=True)
        return None
    return torchao.__version__


def float8_config(recipe):
    """torchao's Float8LinearConfig for "tensorwise" or "rowwise"."""
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name(recipe)
