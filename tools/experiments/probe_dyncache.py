#!/usr/bin/env python3
"""A decode loop shaped like Hugging Face's dynamic cache (each layer's K and V concatenated with the new key every
step, so that their batch and head strides change with the length), without transformers: per-step wall ms of a
first pass over the lengths (fresh plans) and of a second pass over the same lengths (cached plans), how many full
plans each pass made, cProfile's top host functions of the first pass, and torch.profiler's table of three more
steps (host calls and kernels).

    python3 tools/experiments/probe_dyncache.py [--sk 32768] [--steps 40] [--layers 8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sk", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=8)
    a = ap.parse_args()
    import torch

    import attn_lt
    from attn_lt import api

    made = [0]
    real_plan = api.plan

    def counting_plan(*args, **kw):
        made[0] += 1
        return real_plan(*args, **kw)

    api.plan = counting_plan
    B, Hq, Hkv, D = 1, 32, 8, 128
    dev, dt = "cuda", torch.bfloat16
    base = [(torch.randn(B, Hkv, a.sk, D, device=dev, dtype=dt), torch.randn(B, Hkv, a.sk, D, device=dev, dtype=dt))
            for _ in range(a.layers)]
    new = torch.randn(B, Hkv, 1, D, device=dev, dtype=dt)
    q = torch.randn(B, 1, Hq, D, device=dev, dtype=dt).transpose(1, 2)

    def step(caches) -> None:
        """One decode step: every layer's K and V one key longer (concatenated, as the dynamic cache does), then
        attention over them."""
        for i, (k, v) in enumerate(caches):
            caches[i] = k, v = torch.cat([k, new], dim=-2), torch.cat([v, new], dim=-2)
            attn_lt.attention(q, k, v)

    def run_pass(profile: bool):
        caches = list(base)
        times, n0 = [], made[0]
        prof = cProfile.Profile() if profile else None
        for _ in range(a.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            step(caches)
            if prof:
                prof.disable()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return times, made[0] - n0, prof, caches

    cold, cold_plans, prof, _ = run_pass(True)
    warm, warm_plans, _, caches = run_pass(False)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(3):
            step(caches)
        torch.cuda.synchronize()
    print(tp.key_averages().table(sort_by="cpu_time_total", row_limit=18, max_name_column_width=60))
    print("decode route:", attn_lt.explain(q, *caches[-1]).decision)
    print(f"{torch.cuda.get_device_name()}: B{B} Hq{Hq} Hkv{Hkv} D{D}, {a.layers} layers, Sk from {a.sk}")
    print(f"first pass:  median {statistics.median(cold[1:]):.3f} ms a step, {cold_plans} full plans")
    print(f"second pass: median {statistics.median(warm[1:]):.3f} ms a step, {warm_plans} full plans")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
    print(s.getvalue()[-4000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
