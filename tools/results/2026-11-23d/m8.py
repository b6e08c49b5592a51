"""Prefill with and without the attention mass (the fourteenth pass's `m8` timing): B1 H32 D128 bf16 at 4k, 8k and
16k keys, attn_lt.attention(..., backend="lt") without and with return_key_mass=True, three rounds.

    python tools/results/2026-11-23d/m8.py
"""
import torch

import attn_lt
from attn_lt.testing import time_ms

for S in (4096, 8192, 16384):
    q, k, v = (torch.randn(1, 32, S, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f0 = lambda: attn_lt.attention(q, k, v, backend="lt")  # noqa: E731
    f1 = lambda: attn_lt.attention(q, k, v, backend="lt", return_key_mass=True)  # noqa: E731
    f0(), f1()
    torch.cuda.synchronize()
    t = [(time_ms(f0, warmup_ms=50, rep_ms=300), time_ms(f1, warmup_ms=50, rep_ms=300)) for _ in range(3)]
    print(f"S{S}: " + "  ".join(f"{a:.3f}/{b:.3f} ms (+{100 * (b / a - 1):.1f} %)" for a, b in t), flush=True)
