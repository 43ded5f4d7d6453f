"""PyTorch anchor for fused attention (benches/kernels/attention.rs): torch's
scaled_dot_product_attention with each backend (sdpa_kernel FLASH_ATTENTION, CUDNN_ATTENTION,
EFFICIENT_ATTENTION), bf16, bshd tensors viewed as [b, h, s, d] as a TE user's would be, forward
and forward+backward, on the issue's shapes. FLOPs as attention.rs: 4·b·h·sq·sk·d forward
(×3.5 fwd+bwd: the backward's five products, the recomputed S included), the causal half only.

Writes $OUT/anchor-attention.json (section "attention").
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import Results, phase_times, stats

# (b, s, heads, kv_heads, d, causal), as attention.rs spells them.
SHAPES = [
    (4, 2048, 32, 32, 128, True),
    (2, 8192, 32, 32, 128, True),
    (4, 4096, 32, 8, 128, True),
    (1, 16384, 32, 32, 128, True),
    (256, 128, 12, 12, 32, False),
    (8, 1024, 12, 12, 64, True),
    # Issue 34's shape classes (the same list as benches/kernels/attention.rs FUSED_SHAPES):
    # head_dim 64 long, GQA 8:1, MQA, Gemma 3's head_dim 256 with one KV head, a no-mask encoder
    # shape of a length that is no tile multiple.
    (4, 4096, 32, 32, 64, True),
    (2, 8192, 32, 4, 128, True),
    (4, 4096, 32, 1, 128, True),
    (4, 4096, 8, 1, 256, True),
    (16, 1000, 16, 16, 64, False),
]
BACKENDS = [
    ("torch sdpa cudnn", SDPBackend.CUDNN_ATTENTION),
    ("torch sdpa flash", SDPBackend.FLASH_ATTENTION),
    ("torch sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
]


def shape_name(b, s, h, g, d, causal):
    kv = f"/kv{g}" if g != h else ""
    return f"b{b} s{s} h{h}{kv} d{d} {'causal' if causal else 'no_mask'}"


def flops(b, s, h, d, causal):
    full = 4 * b * h * s * s * d
    return full // 2 if causal else full


def main():
    res = Results("anchor-attention.json")
    for b, s, h, g, d, causal in SHAPES:
        name = shape_name(b, s, h, g, d, causal)
        gen = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda heads: torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v = mk(h).requires_grad_(), mk(g).requires_grad_(), mk(g).requires_grad_()
        dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        fl = flops(b, s, h, d, causal)
        for variant, backend in BACKENDS:
            def fwd():
                return F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    enable_gqa=g != h).transpose(1, 2)

            for pass_, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
                row = {"section": "attention", "work": "attention", "shape": name, "pass": pass_,
                       "variant": variant, "precision": "bf16", "flops": int(fl * mult), "flops_fp8": 0,
                       "bytes": None, "tokens": None}
                try:
                    with sdpa_kernel(backend):
                        if pass_ == "fwd":
                            def step(mark):
                                with torch.no_grad():
                                    fwd()
                                mark()
                        else:
                            def step(mark):
                                o = fwd()
                                torch.autograd.backward(o, dout, inputs=[q, k, v])
                                mark()
                        _, us = phase_times(step, lambda: None, 3, 10, 1)
                    res.add({**row, **stats(us)})
                except RuntimeError as e:
                    res.add({**row, "skipped": str(e).splitlines()[0][:200]})
                finally:
                    q.grad = k.grad = v.grad = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
