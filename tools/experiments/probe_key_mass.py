"""Where a call with the mass per key spends its GPU time: the fused forward kernel and the mass pass (native/
mass_sm90.cu on Hopper for every row, native/flash.cu's key_mass_kernel for a few) per kernel (torch.profiler, one
call at a time), beside the CUDA-event times of the call with and without the mass, and the kernels' sum over the
mass call's own forward kernel and over the plain call's kernels, in one process on one GPU.

    python3 tools/experiments/probe_key_mass.py [--reps 5] [--window 64] [--decode]

``--window W``: the mass of the last W rows (key_mass_window) instead of every row's.

Shapes: the issue's B1 H32/8 S16k D128 causal, B1 H32 S16k D64 and D256 (bf16); ``--decode``: its decode step
instead, B8 H32/8 Sk 32k D128 (the decode blocks store the scores, a pass turns them into the mass). The events of
a call include its host work before the first launch and whatever clock the GPU holds over the call's whole burst;
the profiler's kernel times do not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import attn_lt  # noqa: E402
from attn_lt.testing import events_ms  # noqa: E402

SHAPES = [(1, 32, 8, 16384, 16384, 128, True), (1, 32, 32, 16384, 16384, 64, False),
          (1, 32, 32, 16384, 16384, 256, False)]  # B, Hq, Hkv, Sq, Sk, D, causal
DECODE = [(8, 32, 8, 1, 32768, 128, False)]


def kernel_ms(fn, reps: int) -> dict[str, float]:
    """Median ms a call of ``fn`` spends in each CUDA kernel (by name), one call synchronised at a time."""
    from torch.profiler import ProfilerActivity, profile

    times: dict[str, list[float]] = {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = ("mass pass" if "mass" in e.name else "merge" if "merge" in e.name
                    else "forward" if "flash" in e.name else e.name[:40])
            times.setdefault(name, []).append(e.device_time / 1000)
    return {n: statistics.median(v) for n, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--window", type=int, default=None, help="the mass of the last W rows (default: every row)")
    ap.add_argument("--decode", action="store_true", help="the decode step instead of the prefill shapes")
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for B, Hq, Hkv, Sq, Sk, D, causal in DECODE if args.decode else SHAPES:
        q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kw = dict(causal=causal, backend="wmma")
        mkw = dict(kw, return_key_mass=True, key_mass_window=args.window)
        plain = events_ms(lambda: attn_lt.attention(q, k, v, **kw), args.reps)
        mass = events_ms(lambda: attn_lt.attention(q, k, v, **mkw), args.reps)
        ks = kernel_ms(lambda: attn_lt.attention(q, k, v, **mkw), args.reps)
        plain_ks = kernel_ms(lambda: attn_lt.attention(q, k, v, **kw), args.reps)
        total = sum(ks.values())
        print(f"B{B} H{Hq}/{Hkv} Sq{Sq} Sk{Sk} D{D} {'causal' if causal else 'full'}: events plain {plain:.3f} ms, "
              f"with the mass {mass:.3f} ({mass / plain:.3f}x); kernels "
              + ", ".join(f"{n} {t:.3f}" for n, t in ks.items())
              + f" (sum {total:.3f}, {total / ks.get('forward', plain):.3f}x its forward); the plain call's kernels "
              + ", ".join(f"{n} {t:.3f}" for n, t in plain_ks.items())
              + f" ({total / sum(plain_ks.values()):.3f}x)", flush=True)
        del q, k, v


if __name__ == "__main__":
    main()
