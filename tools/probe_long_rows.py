"""Probe: the planner's rule for rows longer than one softmax CTA holds (key tiles of at most ``ONE_CTA_KEYS``
keys, at any budget) against the rule before it (whole rows unless whole-row chunks would fall below
``TILE_MIN_ROWS`` rows), two rounds interleaved, the default 1 GiB budget. How ``ONE_CTA_KEYS`` in attn_lt/plan.py
was put to use.

    python tools/probe_long_rows.py
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import attn_lt  # noqa: E402
from attn_lt.testing import events_ms  # noqa: E402

planner = importlib.import_module("attn_lt.plan")  # attn_lt.plan is also the name of the public function

#: (Hq = Hkv, Sq, Sk, D, causal), B = 1
SHAPES = [(16, 32768, 32768, 128, False), (16, 32768, 32768, 128, True), (16, 65536, 65536, 128, False),
          (16, 65536, 65536, 128, True), (32, 131072, 131072, 128, True), (4, 65536, 65536, 512, False),
          (16, 1024, 65536, 128, False)]


def main() -> int:
    if not torch.cuda.is_available():
        print("probe_long_rows needs a CUDA GPU", file=sys.stderr)
        return 2
    one_cta = planner.ONE_CTA_KEYS
    for H, Sq, Sk, D, causal in SHAPES:
        q = torch.randn(1, H, Sq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, H, Sk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * H * Sq * Sk * D / (2 if causal else 1)
        plans = {}
        for i, (name, longest) in enumerate((("before", 1 << 40), ("now", one_cta))):
            planner.ONE_CTA_KEYS = longest
            # a budget a few bytes apart: neither the planner's cache nor attention()'s sees the constant
            p = attn_lt.plan(q, k, v, causal=causal, backend="lt", workspace_bytes=(1 << 30) - 256 * (i + 1))
            for _ in range(3):  # the first calls tune
                p.run(q, k, v)
                torch.cuda.synchronize()
                if not p.program.pending:
                    break
            plans[name] = p
        planner.ONE_CTA_KEYS = one_cta
        times = {n: [] for n in plans}
        for _ in range(2):
            for n, p in plans.items():
                times[n].append(events_ms(lambda p=p: p.run(q, k, v), 3))
        cells = " | ".join(f"{n} " + "/".join(f"{ms:.2f}" for ms in t) + f" ms {flops / min(t) / 1e9:.0f} TFLOP/s"
                           for n, t in times.items())
        ratio = min(times["now"]) / min(times["before"])
        print(f"H{H} Sq{Sq} Sk{Sk} D{D}{' causal' if causal else ''}: {cells}  now/before {ratio:.3f}", flush=True)
        for n, p in plans.items():
            print(f"    {n}: {p.chunks.summary()[:110]}")
        del q, k, v, plans
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
