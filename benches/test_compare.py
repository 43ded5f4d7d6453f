"""Checks benches/compare.py on made-up inputs (no GPU, no torch): `python3 benches/test_compare.py`."""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def ours_row(work, shape, pass_, variant, precision, us, flops, flops_fp8, section, bytes_=None, tokens=None):
    return {"name": f"{work} {pass_} {variant}", "shape": shape, "median_us": us, "min_us": us * 0.9,
            "max_us": us * 1.1, "bytes": bytes_, "flops": flops or None, "section": section, "work": work,
            "pass": pass_, "variant": variant, "precision": precision, "flops_fp8": flops_fp8, "tokens": tokens}


def anchor_row(work, shape, pass_, variant, precision, us, flops, flops_fp8, section, bytes_=None, tokens=None):
    return {"section": section, "work": work, "shape": shape, "pass": pass_, "variant": variant,
            "precision": precision, "median_us": us, "min_us": us, "max_us": us, "flops": flops,
            "flops_fp8": flops_fp8, "bytes": bytes_, "tokens": tokens}


def write(d, name, rows, **meta):
    with open(os.path.join(d, name), "w") as f:
        json.dump({"device": "NVIDIA H200", "rows": rows, **meta}, f)


def run(d):
    p = subprocess.run([sys.executable, os.path.join(HERE, "compare.py"), d], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def cells(text, start):
    """The cells of the first table line starting with `start`."""
    line = next(l for l in text.splitlines() if l.startswith(start))
    return [c.strip() for c in line.strip("|").split("|")]


def main():
    g = 2 * 8192**3  # FLOPs of an 8192³ GEMM
    with tempfile.TemporaryDirectory() as d:
        ours = [
            {"name": "device copy (memcpy DtoD)", "shape": "1 GiB", "median_us": 500.0, "min_us": 499.0,
             "max_us": 510.0, "bytes": 2 * 2**30, "flops": None, "section": None},
            {"name": "jit: NVRTC compile per kernel", "shape": "18 kernels", "median_us": 16500.0,
             "min_us": 1.0, "max_us": 2.0, "bytes": None, "flops": None, "section": None},
            ours_row("gemm", "8192x8192x8192", "gemm", "ours fp8", "fp8", 700.0, g, g, "gemm"),
            ours_row("gemm", "8192x8192x8192", "gemm", "ours bf16", "bf16", 1400.0, g, 0, "gemm"),
            ours_row("linear", "8192x4096->16384", "fwd", "ours bf16", "bf16", 1500.0, g // 4, 0, "modules"),
            ours_row("linear", "8192x4096->16384", "fwd", "ours fp8 delayed", "fp8", 900.0, g // 4, g // 4, "modules"),
            ours_row("gpt small", "b8 s1024", "step", "ours fp8 delayed", "fp8", 40000.0, 10**12, 9 * 10**11,
                     "gpt", bytes_=30 * 86 * 10**6, tokens=8192),
        ]
        ratios = [{"name": "linear fwd+bwd: fp8 delayed speedup over our bf16", "value": 1.75, "target": "≥ 1.6: MET"}]
        write(d, "bench-kernels.json", ours, side="ours", copy_gbps=2 * 2**30 / 500e-6 / 1e9, driver="CUDA 13.0",
              ratios=ratios)
        write(d, "anchor-gemm.json", [
            anchor_row("gemm", "8192x8192x8192", "gemm", "torch._scaled_mm", "fp8", 800.0, g, g, "gemm"),
            anchor_row("gemm", "8192x8192x8192", "gemm", "torch bf16 matmul", "bf16", 1600.0, g, 0, "gemm"),
        ], side="anchor")
        write(d, "anchor-attention.json", [], side="anchor")
        write(d, "anchor-modules.json", [
            anchor_row("linear", "8192x4096->16384", "fwd", "torch eager bf16", "bf16", 1800.0, g // 4, 0, "modules"),
            anchor_row("linear", "8192x4096->16384", "fwd", "torchao tensorwise+compile", "fp8", 1000.0, g // 4,
                       g // 4, "modules"),
        ], side="anchor")
        code, out, err = run(d)
        assert code == 1 and "anchor-gpt.json is missing" in err, (code, err)
        # FP8 peak 1571 TFLOP/s (ours), BF16 785: the fp8 GEMM is at 100% of its roofline.
        assert "FP8 1 571 TFLOP/s, BF16 785 TFLOP/s" in out, out
        c = cells(out, "| gemm | 8192x8192x8192 | gemm | ours fp8 |")
        assert c[7:] == ["700.0", "100%", "0.88", "0.44"], c  # ÷ scaled_mm 700/800, ÷ bf16 matmul 700/1600
        c = cells(out, "| gemm | 8192x8192x8192 | gemm | ours bf16 |")
        assert c[8:] == ["100%", "", "0.88"], c  # the BF16 peak; not compared with _scaled_mm
        c = cells(out, "| linear | 8192x4096->16384 | fwd | ours bf16 |")
        assert c[9:] == ["0.83", ""], c  # not compared with the fp8 anchor
        c = cells(out, "| linear | 8192x4096->16384 | fwd | ours fp8 delayed |")
        assert c[9:] == ["0.50", "0.90"], c
        c = cells(out, "| gpt small | b8 s1024 | step | ours fp8 delayed |")
        # floor: 9e11 / 1571e12 + 1e11 / 785e12 + 2.58e9 B / 4295 GB/s = 573 + 127 + 601 µs
        assert c[7] == "204 800" and c[8] == "1 301.0", c
        assert cells(out, "| linear fwd+bwd: fp8 delayed") == [ratios[0]["name"], "1.750", "≥ 1.6: MET"]
        c = cells(out, "| device copy (memcpy DtoD) |")
        assert c[5] == "1.00" and c[8] == "100%", c
        assert os.path.exists(os.path.join(d, "compare.md"))
        c = cells(out.split("### summary")[1], "| gemm | 8192x8192x8192 | gemm |")
        assert c[3:] == ["ours fp8", "700.0", "torch._scaled_mm", "800.0", "0.88"], c

        write(d, "anchor-gpt.json", [
            {"section": "gpt", "work": "gpt small", "shape": "b8 s1024", "pass": None,
             "variant": "torchao tensorwise+compile", "error": "RuntimeError: boom"},
            anchor_row("gpt large", "b2 s2048", "step", "torch eager bf16", "bf16", 1.0, 1, 0, "gpt"),
        ], side="anchor")
        code, out, err = run(d)
        assert code == 1, code
        assert "failed: RuntimeError: boom" in err, err
        assert "('gpt large', 'b2 s2048', 'step') 'torch eager bf16' has no row of ours" in err, err

        os.remove(os.path.join(d, "anchor-gpt.json"))
        write(d, "anchor-gpt.json", [], side="anchor")
        code, out, err = run(d)
        assert code == 0 and err == "", (code, err)

        # Generation (section "generate", optional anchor files): tokens/s on every pass, our
        # variants against each anchor variant, and the summary's fastest against fastest.
        w = "gemma3 270m generate"
        ours += [
            ours_row(w, "b1 prompt 128", "prefill", "ours bf16", "bf16", 2000.0, 0, 0, "generate", tokens=128),
            ours_row(w, "b1 prompt 128", "decode step", "ours bf16", "bf16", 1000.0, 0, 0, "generate",
                     bytes_=536 * 10**6, tokens=1),
            ours_row(w, "b1 prompt 128", "decode step", "ours fp8", "fp8", 1500.0, 0, 0, "generate", tokens=1),
        ]
        write(d, "bench-kernels.json", ours, side="ours", copy_gbps=2 * 2**30 / 500e-6 / 1e9, driver="CUDA 13.0",
              ratios=ratios)
        write(d, "anchor-decoder-generate.json", [
            anchor_row(w, "b1 prompt 128", "prefill", "hf eager", "bf16", 30000.0, 0, 0, "generate", tokens=128),
            anchor_row(w, "b1 prompt 128", "decode step", "hf eager", "bf16", 26000.0, 0, 0, "generate", tokens=1),
            anchor_row(w, "b1 prompt 128", "decode step", "hf static cache + compile", "bf16", 2500.0, 0, 0,
                       "generate", tokens=1),
        ], side="anchor")
        code, out, err = run(d)
        assert code == 0 and err == "", (code, err)
        c = cells(out, f"| {w} | b1 prompt 128 | decode step | ours bf16 |")
        # 1 000 tokens/s; 536 MB over 4 295 GB/s = 124.8 µs floor; ÷ eager 1000/26000, ÷ compiled 1000/2500
        assert c[7] == "1 000" and c[8:] == ["124.8", "12%", "0.04", "0.40"], c
        c = cells(out, f"| {w} | b1 prompt 128 | prefill | ours bf16 |")
        assert c[7] == "64 000" and c[10] == "0.07", c
        c = cells(out.split("### summary")[1], f"| {w} | b1 prompt 128 | decode step |")
        assert c[3:] == ["ours bf16", "1 000.0", "hf static cache + compile", "2 500.0", "0.40"], c
        # A generate anchor row without a row of ours is a problem, as in every section.
        write(d, "anchor-generate.json", [
            anchor_row("gpt small generate", "b1 prompt 128", "decode step", "hf eager", "bf16", 1.0, 0, 0,
                       "generate", tokens=1),
        ], side="anchor")
        code, out, err = run(d)
        assert code == 1 and "'gpt small generate'" in err, (code, err)
    print("compare.py: ok")


if __name__ == "__main__":
    main()
